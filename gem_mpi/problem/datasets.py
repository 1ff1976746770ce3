"""A dataset by name: checked before a run, and loaded as the splits the workers train on
and the master evaluates on.

torchvision is imported only where it is unavoidable (MNIST download, ImageNet), so the
Fashion-MNIST and synthetic paths work in a bare torch + numpy environment.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch

from gem_mpi.config import GPT, TEXT, DataConfig, is_plugin
from gem_mpi.errors import DataError, UsageError
from gem_mpi.problem import idx, imagenet, text
from gem_mpi.problem.batches import iterate_batches
from gem_mpi.problem.seeds import mix_seed
from gem_mpi.problem.spec import check_dataset_name, check_split_name, dataset_spec
from gem_mpi.problem.splits import (
    ArraySplit,
    ImageFolderSplit,
    Split,
    SyntheticSplit,
    TextSplit,
    UserSplit,
)

_SYNTHETIC_DEFAULT_SIZE = {"train": 60_000, "test": 10_000}
_STATISTICS_SEED = 0x5BA7C4  # the BatchNorm statistics' batches: a stream of their own


def check_dataset(dataset: str, data_dir: str | None, at_least: int = 1,
                  context: int = 64) -> int:
    """Fail early, in the launcher, with one readable line instead of N worker tracebacks.

    Reads IDX headers and streams (but does not keep) the data. For MNIST this downloads the
    files if absent, so that workers started afterwards find them instead of all downloading.
    Returns the number of training samples: exact, except for imagenet, whose images are
    counted up to ``at_least`` only.
    """
    check_dataset_name(dataset)
    if is_plugin(dataset):
        return len(load_split(dataset, data_dir, "train", ""))
    if dataset == "synthetic":
        return 0
    if dataset == TEXT:
        for split in ("test", "train"):  # each must hold a sample
            n = len(load_split(dataset, data_dir, split, GPT, context=context))
            if not n:
                raise DataError(f"--dataset text: the {split} files under "
                                f"{data_dir or str(text.default_root())!r} hold fewer than "
                                f"--context {context} + 1 bytes")
        return n
    if dataset == "imagenet":
        return imagenet.check_imagenet(data_dir, at_least)
    return idx.check_files(dataset, data_dir)


def load_split(
    dataset: str,
    data_dir: str | None,
    split: str,
    model: str,
    synthetic_size: int | None = None,
    context: int = 64,
    test_bytes: int = 0,
) -> Split:
    """Load one split, shaped for `model` (see `dataset_spec`).

    `synthetic_size` only matters for the synthetic dataset, `context` and `test_bytes` (the
    test split's first bytes; 0: all) for text.
    """
    check_dataset_name(dataset)
    check_split_name(split)
    if is_plugin(dataset):
        return UserSplit(dataset, split)
    spec = dataset_spec(dataset, model, context)
    if dataset == TEXT:
        limit = test_bytes if split == "test" else 0
        return TextSplit(split, spec, text.read_split(data_dir, split, limit))
    if dataset == "synthetic":
        size = _SYNTHETIC_DEFAULT_SIZE[split] if synthetic_size is None else synthetic_size
        if size < 1:
            raise UsageError(f"synthetic dataset size must be at least 1, got {size}")
        return SyntheticSplit(split, spec, size)
    if dataset == "imagenet":
        return ImageFolderSplit(split, spec, imagenet.load_imagefolder(data_dir, split, spec))
    return ArraySplit(dataset, split, spec, *idx.read_split(dataset, data_dir, split))


def training_split(data: DataConfig, synthetic_size: int | None = None) -> Split:
    """What the workers train on: the training split, less its last --holdout samples (text:
    less its validation files)."""
    if data.holdout and data.dataset == TEXT:
        return TextSplit("train", dataset_spec(TEXT, data.model, data.context),
                         text.read_split(data.data_dir, "train", holdout=True))
    split = load_split(data.dataset, data.data_dir, "train", data.model,
                       synthetic_size=synthetic_size, context=data.context)
    if not data.holdout:
        return split
    assert isinstance(split, ArraySplit)  # the config allows --holdout for these only
    return split.part("train", slice(0, len(split) - data.holdout))


def evaluation_split(data: DataConfig) -> Split:
    """What the master evaluates θ on: the test split, or with --holdout the last
    --holdout training samples, which no worker trains on (a validation set; text: the first
    --holdout bytes of the validation files)."""
    if data.holdout and data.dataset == TEXT:
        return TextSplit("validation", dataset_spec(TEXT, data.model, data.context),
                         text.read_split(data.data_dir, "validation", limit=data.holdout))
    if not data.holdout:
        return load_split(data.dataset, data.data_dir, "test", data.model,
                          context=data.context, test_bytes=data.test_bytes)
    split = load_split(data.dataset, data.data_dir, "train", data.model)
    assert isinstance(split, ArraySplit)
    return split.part("validation", slice(len(split) - data.holdout, len(split)))


def statistics_batches(data: DataConfig, count: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The ``count`` training batches (of --batch-size, as the workers see them) that rank 0
    recomputes BatchNorm statistics on: always the same ones (their own fixed shuffle), so
    an evaluation is a function of θ alone."""
    split = training_split(data, synthetic_size=data.synthetic_size)
    batch = min(data.batch_size, len(split))
    epochs = -(-count // (len(split) // batch))  # enough for ``count`` batches
    stream = iterate_batches(split, batch, epochs, seed=mix_seed(data.seed, _STATISTICS_SEED))
    return itertools.islice(stream, count)
