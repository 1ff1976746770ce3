"""A CNN of your own on a folder of images: what to pass gem_mpi.

    mpirun -n 5 python -m gem_mpi.train --model image_cnn:make_model \
        --dataset image_cnn:image_folder --epochs 2 --metrics run.h5

run from this directory (or with it on PYTHONPATH). The images are read from
$IMAGE_DIR/train/<class>/* and $IMAGE_DIR/test/<class>/* (default ./images; make_images.py
writes such a folder from Fashion-MNIST). Replace the two functions with your own.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn
from torchvision import datasets, transforms

IMAGE_SIZE = 32


def image_dir() -> Path:
    return Path(os.environ.get("IMAGE_DIR", "images"))


def make_model() -> nn.Module:
    """A fresh model: gem_mpi calls this on every rank (θ₀ comes from --seed)."""
    classes = len([d for d in (image_dir() / "train").iterdir() if d.is_dir()])
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),   # 16 x 16
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # 8 x 8
        nn.Flatten(), nn.Linear(32 * 8 * 8, 128), nn.ReLU(), nn.Linear(128, classes),
    )  # logits: the default loss of a model of your own is cross_entropy


def image_folder(split: str) -> torch.utils.data.Dataset:
    """The map-style dataset of (image, class index) pairs of ``split`` ("train", "test")."""
    steps = [transforms.Resize((IMAGE_SIZE, IMAGE_SIZE))]
    if split == "train":
        steps.append(transforms.RandomHorizontalFlip())  # seeded per worker and step by gem_mpi
    steps += [transforms.ToTensor(), transforms.Normalize((0.5,) * 3, (0.5,) * 3)]
    return datasets.ImageFolder(str(image_dir() / split), transform=transforms.Compose(steps))
