"""Which datasets and splits there are, and the input each gives a model (:class:`DataSpec`).

Model and data code both read it, so that they cannot disagree; it imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gem_mpi.config import DATASETS, TORCH_MODELS, is_plugin
from gem_mpi.errors import UsageError

SPLITS = ("train", "test")

MNIST_SIZE = 28
MNIST_CLASSES = 10
# torchvision's AlexNet collapses to nothing below 63 px; 64 is the nearest round size.
_ALEXNET_MIN_SIZE = 64


@dataclass(frozen=True)
class DataSpec:
    """The input a model is built for; shared by data and model code so they cannot disagree."""

    channels: int
    image_size: int
    num_classes: int


def default_data_root() -> Path:
    """Where MNIST is downloaded and Fashion-MNIST is looked for when no data dir is given."""
    return Path.home() / ".cache" / "gem_mpi" / "data"


def check_dataset_name(dataset: str) -> None:
    if dataset not in DATASETS and not is_plugin(dataset):
        raise UsageError(f"unknown dataset {dataset!r}; choose one of: {', '.join(DATASETS)}")


def check_split_name(split: str) -> None:
    if split not in SPLITS:
        raise UsageError(f"unknown split {split!r}; choose one of: {', '.join(SPLITS)}")


def dataset_spec(dataset: str, model: str) -> DataSpec:
    """The input shape `model` sees on `dataset` (AlexNet gets MNIST-like images upsampled;
    a model of the user's own gets each dataset's natural images)."""
    check_dataset_name(dataset)
    if is_plugin(dataset):
        raise UsageError(f"--dataset {dataset!r} is a dataset of your own and --model "
                         f"{model} is built for the built-in datasets; give a model of your own "
                         "too (--model MODULE:FUNCTION)")
    if is_plugin(model):
        model = "mnist-cnn" if dataset != "imagenet" else "resnet18"
    if model not in TORCH_MODELS:
        raise UsageError(f"unknown model {model!r}; choose one of: {', '.join(TORCH_MODELS)}")
    if dataset in ("fashion-mnist", "mnist"):
        size = _ALEXNET_MIN_SIZE if model == "alexnet" else MNIST_SIZE
        return DataSpec(channels=1, image_size=size, num_classes=MNIST_CLASSES)
    if dataset == "imagenet":
        if model == "mnist-cnn":
            raise UsageError(
                "model mnist-cnn takes 28 px single-channel images and cannot train on imagenet; "
                "use --model alexnet or --model resnet18"
            )
        return DataSpec(channels=3, image_size=224, num_classes=1000)
    # synthetic: mimic the data each model was designed for
    if model == "mnist-cnn":
        return DataSpec(channels=1, image_size=MNIST_SIZE, num_classes=MNIST_CLASSES)
    return DataSpec(channels=3, image_size=224, num_classes=1000)
