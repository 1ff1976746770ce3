"""One training rank's environment, the same for asynchronous workers and the synchronous
baseline: where it runs (node placement, device, threads), what it reads (its data stream),
and the randomness and slowness it is given (dropout seed, --straggler)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from gem_mpi.config import Config, DataConfig, straggler
from gem_mpi.transport import MPI


@dataclass(frozen=True)
class Placement:
    local_rank: int  # this rank's index among the ranks on its node
    local_size: int  # ranks on this node


def local_placement(comm: MPI.Intracomm) -> Placement:
    """From MPI's shared-memory split, whatever the launcher. Collective."""
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return Placement(node.Get_rank(), node.Get_size())
    finally:
        node.Free()


def torch_device(threads: int, placement: Placement) -> object:
    """This rank's GPU (one per local rank, round robin) or the CPU, and its torch threads
    (``threads``, or the node's cores shared among its ranks)."""
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    torch.set_num_threads(threads or max(1, (os.cpu_count() or cores) // placement.local_size))
    if not torch.cuda.is_available():
        return torch.device("cpu")
    device = torch.device(f"cuda:{placement.local_rank % torch.cuda.device_count()}")
    torch.cuda.set_device(device)
    return device


def seed_dropout(seed: int, worker: int, step: int) -> None:
    """Each worker its own dropout masks (θ₀ came from --seed alone, before this); seeded
    per step, a resumed run draws the masks the uninterrupted one would have."""
    import torch

    from gem_mpi.problem.data import mix_seed

    torch.manual_seed(mix_seed(seed, worker, step))


def data_stream(data: DataConfig, worker: int, n_workers: int, start_seq: int = 0) -> tuple:
    """(steps, batches) of worker number ``worker`` (1..n): the same stream whichever method
    runs it, so that methods are compared on the same data."""
    from gem_mpi.problem.data import iterate_batches, load_split, steps_per_epoch

    shard = (worker - 1, n_workers) if data.shard else None
    split = load_split(data.dataset, data.data_dir, "train", data.model,
                       synthetic_size=data.synthetic_size)
    steps = steps_per_epoch(split, data.batch_size, shard) * data.epochs
    if data.max_steps:
        steps = min(steps, data.max_steps)
    batches = iterate_batches(split, data.batch_size, data.epochs,
                              seed=data.seed * 100_003 + worker, shard=shard, start=start_seq)
    return steps, batches


def slowness(cfg: Config, world_size: int, worker: int) -> float:
    """How many times slower --straggler makes worker ``worker`` (1 for all the others)."""
    slow = straggler(cfg, world_size)
    return slow[1] if slow and slow[0] == worker else 1.0
