"""A split of a dataset, prepared for the model that consumes it: :meth:`Split.make` makes
any batch of it from the batch's arguments alone, in a worker's process or a loader's.

Images stay uint8 in memory (a node may run 100 workers, each holding its shard's dataset)
and become normalised float32 only one batch at a time.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from gem_mpi.problem.seeds import mix_seed
from gem_mpi.problem.spec import SPLITS, DataSpec
from gem_mpi.problem.user import collate, load_dataset

# Per-dataset pixel statistics, so inputs are roughly zero-mean, unit-variance.
_NORMALISATION = {"fashion-mnist": (0.2860, 0.3530), "mnist": (0.1307, 0.3081)}


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


class TextSplit(Split):
    """Bytes of text (:mod:`gem_mpi.problem.text`): sample i is the context's bytes from
    i·T, its targets the bytes one further (int64 [B, T] both)."""

    def __init__(self, split: str, spec: DataSpec, data: np.ndarray) -> None:
        self.dataset, self.split, self.spec = "text", split, spec
        self.data, self.context = data, spec.context
        self._window = np.arange(self.context + 1)

    def __len__(self) -> int:
        return max(0, (len(self.data) - 1) // self.context)

    def make(self, indices: torch.Tensor, step: int, seed: int, shard_index: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.data[indices.numpy()[:, None] * self.context + self._window]
        tokens = torch.from_numpy(rows.astype(np.int64))
        return tokens[:, :-1], tokens[:, 1:]


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
