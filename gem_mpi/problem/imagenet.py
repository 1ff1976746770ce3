"""ImageNet as ImageFolder trees ``train/`` and ``val/``: checked cheaply before a run (the
class folders alike, none empty, the training images counted only as far as needed) and read
through torchvision, imported only when a split is read.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from gem_mpi.errors import DataError, UsageError, one_line
from gem_mpi.problem.spec import DataSpec

_IMAGENET_MEAN = (0.485, 0.456, 0.406)
_IMAGENET_STD = (0.229, 0.224, 0.225)


def _imagenet_root(data_dir: str | None) -> Path:
    if data_dir is None:
        raise DataError(
            "imagenet needs --data-dir DIR with ImageFolder trees DIR/train/ and "
            "DIR/val/ (one subfolder per class)"
        )
    root = Path(data_dir)
    for sub in ("train", "val"):
        if not (root / sub).is_dir():
            raise DataError(
                f"imagenet: {root / sub} does not exist; --data-dir must hold "
                "ImageFolder trees train/ and val/ (one subfolder per class)"
            )
    return root


# torchvision's ImageFolder: the files it takes as images (its IMG_EXTENSIONS)
_IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def _class_folders(folder: Path) -> list[str]:
    """The classes ImageFolder finds in ``folder``: every subfolder (hidden ones too)."""
    with os.scandir(folder) as entries:
        return sorted(e.name for e in entries if e.is_dir())


def _count_images(folder: Path, cap: int) -> int:
    """Images below ``folder`` as ImageFolder finds them (symbolic links followed), counted
    no further than ``cap``: scandir reads a directory lazily, so an early stop is cheap."""
    found, pending = 0, [folder]
    while pending and found < cap:
        with os.scandir(pending.pop()) as entries:
            for e in entries:
                if e.is_dir():
                    pending.append(Path(e.path))
                elif e.name.lower().endswith(_IMAGE_EXTENSIONS):
                    found += 1
                    if found >= cap:
                        break
    return found


def _names_of(names: Iterable[str], most: int = 5) -> str:
    names = sorted(names)
    return ', '.join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def check_imagenet(data_dir: str | None, at_least: int) -> int:
    """Class folders of train/ and val/ the same, none empty; the training images counted
    up to ``at_least`` (scanning 1.3M files would not be cheap). Returns that count."""
    root = _imagenet_root(data_dir)
    classes = {}
    for sub in ("train", "val"):
        classes[sub] = _class_folders(root / sub)
        if not classes[sub]:
            raise DataError(
                f"imagenet: {root / sub} has no class subfolders; it must be an "
                "ImageFolder tree (one subfolder per class)"
            )
    train, val = classes["train"], classes["val"]
    if train != val:  # ImageFolder numbers the classes in sorted order: labels would differ
        only_train, only_val = set(train) - set(val), set(val) - set(train)
        detail = "; ".join(
            f"only in {sub}: {_names_of(only)}"
            for sub, only in (("train", only_train), ("val", only_val)) if only
        )
        raise DataError(
            f"imagenet: {root}/train has {len(train)} class folders and {root}/val has "
            f"{len(val)}, not the same ({detail}); labels would not match"
        )
    if len(train) > 1000:
        raise DataError(
            f"imagenet: {root}/train has {len(train)} class folders, more "
            "than the 1000 outputs the models are built with"
        )
    counted = 0
    for sub in ("train", "val"):
        for name in classes[sub]:
            want = max(1, at_least - counted) if sub == "train" else 1
            found = _count_images(root / sub / name, want)
            if found == 0:
                raise DataError(
                    f"imagenet: class folder {root / sub / name} holds no image (files "
                    f"ending in {', '.join(_IMAGE_EXTENSIONS)}); remove it or fill it"
                )
            if sub == "train":
                counted += found
    return counted


def load_imagefolder(data_dir: str | None, split: str, spec: DataSpec) -> Any:
    """``split``'s ImageFolder (train/, else val/), its images transformed for ``spec``."""
    root = _imagenet_root(data_dir)
    try:
        from torchvision import datasets, transforms
    except ImportError as exc:
        raise UsageError(
            f"imagenet needs torchvision, which failed to import "
            f"({one_line(exc)}); install torchvision"
        ) from exc
    normalize = transforms.Normalize(_IMAGENET_MEAN, _IMAGENET_STD)
    size = spec.image_size
    if split == "train":
        steps = [transforms.RandomResizedCrop(size), transforms.RandomHorizontalFlip()]
    else:
        steps = [transforms.Resize(size * 256 // 224), transforms.CenterCrop(size)]
    transform = transforms.Compose([*steps, transforms.ToTensor(), normalize])
    sub = root / ("train" if split == "train" else "val")
    try:
        folder = datasets.ImageFolder(str(sub), transform=transform)
    except (OSError, RuntimeError, FileNotFoundError) as exc:
        raise DataError(
            f"imagenet: cannot read {sub} as an ImageFolder tree "
            f"({one_line(exc)}); one subfolder per class with images"
        ) from exc
    if len(folder.classes) > spec.num_classes:
        raise DataError(
            f"imagenet: {sub} has {len(folder.classes)} classes, more than the "
            f"{spec.num_classes} outputs the models are built with"
        )
    return folder
