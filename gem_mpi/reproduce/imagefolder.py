"""A small generated ImageFolder for E8 (AlexNet), since ImageNet is not available here.

``--dataset imagenet --data-dir DIR`` wants ``DIR/train/<class>/*`` and ``DIR/val/<class>/*``
(gem_mpi/problem/imagenet.py). Each class here is a colour and a stripe pattern (orientation and
frequency depend on the class) under per-image noise, a random phase and a random brightness,
so the task is learnable but not trivial, and survives the random crops and flips the
training transform applies. The images are deterministic in the seed: regenerating gives
the same files, and a folder that is complete (its marker file says so) is left alone.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

MARKER = "generated.json"


@dataclass(frozen=True)
class FolderSpec:
    """What to generate: classes, images per class per split, image side, seed."""

    classes: int = 8
    train_per_class: int = 384
    val_per_class: int = 32
    size: int = 224
    seed: int = 0

    @property
    def train_images(self) -> int:
        return self.classes * self.train_per_class


def _image(rng: np.random.Generator, label: int, spec: FolderSpec) -> np.ndarray:
    """One H×W×3 uint8 image of class ``label``."""
    k = spec.classes
    hue = 2 * np.pi * label / k
    colour = 0.5 + 0.35 * np.cos(hue + np.array([0.0, 2.1, 4.2]))  # one colour per class
    angle = np.pi * (label % 4) / 4 + rng.normal(0, 0.08)
    freq = (3 + 2 * (label // 4)) * 2 * np.pi / spec.size
    yy, xx = np.mgrid[0:spec.size, 0:spec.size].astype(np.float32)
    wave = np.sin(freq * (np.cos(angle) * xx + np.sin(angle) * yy) + rng.uniform(0, 2 * np.pi))
    img = colour[None, None, :] * (0.75 + 0.25 * wave[..., None])
    img = img * rng.uniform(0.7, 1.1) + rng.normal(0, 0.12, img.shape)
    return (np.clip(img, 0, 1) * 255).astype(np.uint8)


def generate(root: str | Path, spec: FolderSpec) -> Path:
    """Write ``root/train`` and ``root/val`` as JPEG class folders, unless ``root`` already
    holds this exact spec (its marker); returns ``root``."""
    from PIL import Image  # torchvision's dependency, present wherever AlexNet runs

    root = Path(root)
    marker = root / MARKER
    if marker.is_file() and json.loads(marker.read_text()) == asdict(spec):
        return root
    if root.exists():
        shutil.rmtree(root)  # half-written or another spec: start over
    rng = np.random.default_rng(spec.seed)
    for split, per_class in (("train", spec.train_per_class), ("val", spec.val_per_class)):
        for label in range(spec.classes):
            folder = root / split / f"class_{label:02d}"
            folder.mkdir(parents=True)
            for i in range(per_class):
                Image.fromarray(_image(rng, label, spec)).save(folder / f"{i:05d}.jpg",
                                                               quality=85)
    marker.write_text(json.dumps(asdict(spec)))
    return root
