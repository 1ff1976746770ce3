"""A worker's training batches, made in its own process or in loader processes
(``--loader-workers N``: torch DataLoader worker processes).

Both follow one plan (:func:`gem_mpi.problem.batches.batch_plan`) and make each batch with the
same function (:meth:`~gem_mpi.problem.splits.Split.make`), so they give the same batches bit
for bit, whatever the dataset. The plan stays in the worker's process and hands each loader
process the step and the sample indices of the batch to make. A dataset's augmentation draws
from torch's global generator, which the worker seeds per (seed, worker, step) just before
it makes a batch (:func:`~gem_mpi.problem.seeds.seed_step`); a loader process seeds it the same
way before making the batch and returns the generator's state with it, which the worker then
takes as its own, so the model's dropout draws on from where the batch left the generator,
as it does when the worker made the batch itself.

Loader processes are forked once, for the whole stream (every epoch), and end with it:
:meth:`LoaderBatches.close` at the end of the worker's loop, however the loop ended. They
ignore the stop signals (SIGUSR1, SIGTERM, SIGINT: the rank handles them and closes its
loader; blocked while they start, so a scheduler's signal to every process of the job during
their start waits for that, then is dropped), and the kernel kills them when their rank dies (``PR_SET_PDEATHSIG``, Linux), so a
killed rank leaves none behind; elsewhere torch's own watchdog ends them within seconds.
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import sys
import warnings
from collections.abc import Iterator
from typing import Any, Protocol

import torch

from gem_mpi.problem.batches import BatchPlan, batch_plan, iterate_batches
from gem_mpi.problem.seeds import seed_step
from gem_mpi.problem.splits import Split

PREFETCH = 2  # batches each loader process makes ahead (DataLoader's prefetch_factor)
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class BatchStream(Protocol):
    """A worker's batches: the next one, and ``close()`` when the worker is done with them
    (a generator is one)."""

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]: ...

    def close(self) -> None: ...


class _PlannedBatches(torch.utils.data.Dataset):
    """The DataLoader's dataset: item (step, indices) is that batch of the plan, made as the
    worker would make it, with torch's generator state after it."""

    def __init__(self, plan: BatchPlan, step_seed: tuple[int, int]) -> None:
        self.plan, self.step_seed = plan, step_seed

    def __getitem__(self, key: tuple[int, list[int]]) -> tuple[torch.Tensor, ...]:
        step, indices = key
        seed_step(*self.step_seed, step)
        x, y = self.plan.make(step, torch.tensor(indices, dtype=torch.int64))
        return x, y, torch.get_rng_state()


class _Keys:
    """The plan as DataLoader's sampler: (step, indices as a list), sent to a loader process
    by value (a tensor would be moved to shared memory, a file descriptor per batch)."""

    def __init__(self, plan: BatchPlan) -> None:
        self.steps = plan.steps

    def __iter__(self) -> Iterator[tuple[int, list[int]]]:
        for step, indices in self.steps:
            yield step, indices.tolist()


_STOPS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)  # the rank's to handle


def _follow_the_rank(parent: int, worker_id: int) -> None:
    """A loader process's start: the stop signals are its rank's to handle, and it dies
    with its rank."""
    for sig in _STOPS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOPS)  # blocked by the rank while it forked:
    # a stop signal sent to the whole job before this line waited, and is now dropped
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):
            pass  # torch's watchdog still ends it once its rank is gone
    if os.getppid() != parent:  # the rank died before the line above
        os._exit(0)


class LoaderBatches:
    """The batches of a plan, made ahead by ``workers`` loader processes; ``next`` returns
    them in the plan's order (page-locked with ``pin_memory``: a GPU worker copies them to
    its device asynchronously)."""

    def __init__(self, plan: BatchPlan, workers: int, step_seed: tuple[int, int],
                 pin_memory: bool = False) -> None:
        with warnings.catch_warnings():  # the rank says it in one line (run.rank)
            warnings.filterwarnings("ignore", "This DataLoader will create")
            self._loader: Any = torch.utils.data.DataLoader(
                _PlannedBatches(plan, step_seed), batch_size=None, sampler=_Keys(plan),
                num_workers=workers, persistent_workers=True, prefetch_factor=PREFETCH,
                pin_memory=pin_memory,
                worker_init_fn=functools.partial(_follow_the_rank, os.getpid()),
                # fork: the loader processes share the loaded dataset and the user's
                # functions (closures too) without pickling them
                multiprocessing_context="fork",
                # DataLoader draws its processes' base seeds from this, not from the global
                # generator the worker's steps are seeded through (each batch reseeds anyway)
                generator=torch.Generator().manual_seed(0))
            # the processes start now, making ahead: the stop signals blocked meanwhile, so
            # that one sent to the whole job reaches no process before it ignores it (the
            # rank's own waits until its mask is back)
            before = signal.pthread_sigmask(signal.SIG_BLOCK, _STOPS)
            try:
                self._it: Any = iter(self._loader)
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, before)

    def __iter__(self) -> LoaderBatches:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._it is None:
            raise StopIteration
        x, y, state = next(self._it)
        torch.set_rng_state(state)  # as if this process had made the batch
        return x, y

    def close(self) -> None:
        """End the loader processes now (idempotent)."""
        it, self._it, self._loader = self._it, None, None
        if it is not None:
            it._shutdown_workers()  # torch has no public call: the iterator's own, on delete


def load_batches(split: Split, batch_size: int, epochs: int, seed: int,
                 shard: tuple[int, int] | None = None, start: int = 0, *, workers: int = 0,
                 step_seed: tuple[int, int] = (0, 0), pin_memory: bool = False,
                 plan: BatchPlan | None = None) -> BatchStream:
    """A worker's training batches, as :func:`gem_mpi.problem.batches.iterate_batches` gives
    them (shuffled, whole batches, from batch ``start`` on), made in this process
    (``workers`` 0) or in ``workers`` loader processes. ``step_seed``: (seed, worker) of
    :func:`~gem_mpi.problem.seeds.seed_step`, with which the worker seeds each step.
    ``plan``: follow this plan instead (a worker's dealt batches, already from ``start``)."""
    if plan is not None:
        return (LoaderBatches(plan, workers, step_seed, pin_memory) if workers else
                (plan.make(step, indices) for step, indices in plan.steps))
    if workers == 0:
        return iterate_batches(split, batch_size, epochs, seed, shard, start=start)
    plan = batch_plan(split, batch_size, epochs, seed, shard, start=start)
    return LoaderBatches(plan, workers, step_seed, pin_memory)
