"""A worker's batches as a plan: which samples make each batch of its stream (each epoch's
seeded order of its shard, or the batches dealt to it), so that a resumed worker and a loader
process follow the same stream, batch for batch.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from gem_mpi.errors import UsageError
from gem_mpi.problem.seeds import mix_seed
from gem_mpi.problem.splits import Split


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
