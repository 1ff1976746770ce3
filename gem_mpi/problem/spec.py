"""Which datasets and splits there are, and the input each gives a model (:class:`DataSpec`).

Model and data code both read it, so that they cannot disagree; it imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gem_mpi.config import DATASETS, GPT, TEXT, TORCH_MODELS, is_plugin
from gem_mpi.errors import UsageError

SPLITS = ("train", "test")

MNIST_SIZE = 28
MNIST_CLASSES = 10
# torchvision's AlexNet collapses to nothing below 63 px; 64 is the nearest round size.
_ALEXNET_MIN_SIZE = 64


BYTES = 256  # the text dataset's vocabulary: one token a byte


@dataclass(frozen=True)
class DataSpec:
    """The input a model is built for; shared by data and model code so they cannot disagree.
    Text is ``context`` bytes a sample, ``num_classes`` the vocabulary (no channels, no
    image)."""

    channels: int
    image_size: int
    num_classes: int
    context: int = 0  # text: the bytes of a sample (0: images)


def default_data_root() -> Path:
    """Where MNIST is downloaded and Fashion-MNIST is looked for when no data dir is given."""
    return Path.home() / ".cache" / "gem_mpi" / "data"


def check_dataset_name(dataset: str) -> None:
    if dataset not in DATASETS and not is_plugin(dataset):
        raise UsageError(f"unknown dataset {dataset!r}; choose one of: {', '.join(DATASETS)}")


def check_split_name(split: str) -> None:
    if split not in SPLITS:
        raise UsageError(f"unknown split {split!r}; choose one of: {', '.join(SPLITS)}")


def dataset_spec(dataset: str, model: str, context: int = 64) -> DataSpec:
    """The input shape `model` sees on `dataset` (AlexNet gets MNIST-like images upsampled;
    a model of the user's own gets each dataset's natural images; the language model reads
    ``context`` bytes of text a sample)."""
    check_dataset_name(dataset)
    if is_plugin(dataset):
        raise UsageError(f"--dataset {dataset!r} is a dataset of your own and --model "
                         f"{model} is built for the built-in datasets; give a model of your own "
                         "too (--model MODULE:FUNCTION)")
    if is_plugin(model):
        model = {"imagenet": "resnet18", TEXT: GPT}.get(dataset, "mnist-cnn")
    if model not in TORCH_MODELS:
        raise UsageError(f"unknown model {model!r}; choose one of: {', '.join(TORCH_MODELS)}")
    if (model == GPT) != (dataset == TEXT):
        raise UsageError("--model gpt reads --dataset text, and text trains --model gpt (or a "
                         f"model of your own): not --model {model} on --dataset {dataset}")
    if dataset == TEXT:
        return DataSpec(channels=0, image_size=0, num_classes=BYTES, context=context)
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
