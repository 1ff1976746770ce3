"""Models, datasets and losses of a user, good and bad, for the tests of --model MODULE:FUNCTION
and friends. Every bad one is a mistake a user makes."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import IterableDataset, TensorDataset

FEATURES, CLASSES = 6, 3


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.ReLU(), nn.Linear(16, CLASSES))


def blobs(split: str) -> TensorDataset:
    """Three Gaussian blobs: learnable, with class-index targets."""
    g = torch.Generator().manual_seed(0 if split == "train" else 1)
    n = 600 if split == "train" else 150
    y = torch.randint(0, CLASSES, (n,), generator=g)
    centers = torch.randn(CLASSES, FEATURES, generator=torch.Generator().manual_seed(7)) * 3
    return TensorDataset(centers[y] + torch.randn(n, FEATURES, generator=g), y)


def bn_cnn() -> nn.Module:
    """A small CNN with BatchNorm for 28×28 grey images (Fashion-MNIST): its evaluation is
    right only with running statistics of the trained θ."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 7 * 7, 64), nn.BatchNorm1d(64), nn.ReLU(),
        nn.Dropout(0.2), nn.Linear(64, 10))


def half_ce(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return 0.5 * nn.functional.cross_entropy(output, target)


# --- bad ones --------------------------------------------------------------------------------
def raises() -> nn.Module:
    raise RuntimeError("cannot find my weights file")


def not_a_module() -> object:
    return {"weights": [1, 2, 3]}


def no_parameters() -> nn.Module:
    return nn.ReLU()


def float64() -> nn.Module:
    return mlp().double()


class _Stream(IterableDataset):
    def __iter__(self):
        yield torch.zeros(FEATURES), 0


def iterable(split: str) -> IterableDataset:
    return _Stream()


def empty(split: str) -> TensorDataset:
    return TensorDataset(torch.zeros(0, FEATURES), torch.zeros(0, dtype=torch.int64))


def not_pairs(split: str) -> list:
    return [torch.zeros(FEATURES) for _ in range(10)]


def wrong_shape(split: str) -> TensorDataset:
    return TensorDataset(torch.zeros(10, FEATURES + 1), torch.zeros(10, dtype=torch.int64))


def float_targets(split: str) -> TensorDataset:
    """Targets the cross-entropy of 3 classes cannot take: one float per sample."""
    return TensorDataset(torch.zeros(10, FEATURES), torch.zeros(10, 2))


def vector_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output, target, reduction="none")


NOT_A_FUNCTION = 3


def worker_crash(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A loss that fails on every worker (MPI rank > 0) at its first step, every time: a
    crash that a restart cannot fix (rank 0's checks and evaluations use it fine)."""
    import os

    if os.environ.get("OMPI_COMM_WORLD_RANK", "0") != "0":
        raise RuntimeError("a bug in the user's loss")
    return nn.functional.cross_entropy(output, target)
