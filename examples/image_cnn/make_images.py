"""Write an image folder to train image_cnn on: Fashion-MNIST as PNG files, one folder per
class (DIR/train/<class>/*.png, DIR/test/<class>/*.png). Your own images go the same way.

    python make_images.py images --per-class 300 --test-per-class 50
"""

from __future__ import annotations

import argparse
from pathlib import Path

from PIL import Image

from gem_mpi.problem.datasets import load_split

CLASSES = ("t-shirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker",
           "bag", "boot")


def write(out: Path, split: str, per_class: int) -> int:
    data = load_split("fashion-mnist", None, split, "mnist-cnn")  # Debian's files
    counts = dict.fromkeys(range(len(CLASSES)), 0)
    for i, label in enumerate(data.labels.tolist()):
        if counts[label] >= per_class:
            continue
        folder = out / split / CLASSES[label]
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(data.images[i]).convert("RGB").save(folder / f"{i:05d}.png")
        counts[label] += 1
        if min(counts.values()) >= per_class:
            break
    return sum(counts.values())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--per-class", type=int, default=300)
    p.add_argument("--test-per-class", type=int, default=50)
    a = p.parse_args()
    n = write(a.out, "train", a.per_class), write(a.out, "test", a.test_per_class)
    print(f"{a.out}: {n[0]} training and {n[1]} test images in {len(CLASSES)} classes")


if __name__ == "__main__":
    main()
