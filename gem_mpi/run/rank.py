"""One training rank's environment, the same for asynchronous workers and the synchronous
baseline: where it runs (node placement, device, threads), what it reads (its data stream),
and the randomness and slowness it is given (dropout seed, --straggler)."""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gem_mpi.config import (
    AUTO_NICE,
    NICE_AUTO,
    QUADRATIC,
    Config,
    DataConfig,
    speeds,
    straggler,
    synchronous,
)
from gem_mpi.errors import UsageError
from gem_mpi.transport import MPI

if TYPE_CHECKING:  # torch is imported when a device is asked for, never on import
    import torch


@dataclass(frozen=True)
class Placement:
    local_rank: int  # this rank's index among the ranks on its node
    local_size: int  # ranks on this node
    node: int = 0  # the node's number: the lowest rank of ``comm`` on it
    local_masters: int = 1  # master ranks (0..K-1 of ``comm``) on this node


def local_placement(comm: MPI.Intracomm, masters: int = 1) -> Placement:
    """From MPI's shared-memory split, whatever the launcher (MPI decides what a node is);
    ``masters``: ranks 0..masters-1 are masters (--masters K). Collective."""
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        rank = comm.Get_rank()
        return Placement(node.Get_rank(), node.Get_size(), node.allreduce(rank, op=MPI.MIN),
                         node.allreduce(int(rank < masters), op=MPI.SUM))
    finally:
        node.Free()


def group_check(comm: MPI.Intracomm, masters: int, size: int) -> str | None:
    """Collective: None when every worker group (--group-size ``size``: consecutive worker
    ranks) lies on one node, else the one-line error, on every rank."""
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        lowest = node.allreduce(comm.Get_rank(), op=MPI.MIN)  # the node's name: its first rank
    finally:
        node.Free()
    nodes = comm.gather(lowest, root=0)
    error = None
    if nodes is not None:  # rank 0
        for first in range(masters, comm.Get_size(), size):
            if len(set(nodes[first:first + size])) > 1:
                error = (f"--group-size {size}: the group of ranks {first}-{first + size - 1} "
                         "spans nodes; a group must lie on one node, so G must divide each "
                         "node's worker ranks, placed consecutively (by slot, not round-robin "
                         "over nodes)")
                break
    return comm.bcast(error, root=0)


def _cores() -> int:
    """The cores this process may run on (its binding), where the OS says."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)


def torch_threads(threads: int, placement: Placement) -> int:
    """A training rank's torch threads: ``threads`` (--threads), else its node's cores shared
    among the ranks on that node (per node: a node of its own gets them all)."""
    return threads or max(1, (os.cpu_count() or _cores()) // placement.local_size)


def worker_nice(setting: str, placement: Placement, overlapped: bool) -> int:
    """How much a worker rank raises its nice value (--worker-nice): N as given, or with
    'auto' AUTO_NICE where its node holds more ranks than cores and the workers overlap
    (``overlapped``: --worker-mode overlap), 0 elsewhere. A waiting worker leaves its core
    while the master applies its update; an overlapped one computes on, and with every core
    taken the master waits its turn before it can apply an update: each update then lands
    on a θ older by that wait (docs/PERFORMANCE.md measures both; pipelined, which waits
    for its slot after each step, was not measured and is left as it was)."""
    if setting != NICE_AUTO:
        return int(setting)
    crowded = placement.local_size > (os.cpu_count() or _cores())
    return AUTO_NICE if crowded and overlapped else 0


def lower_priority(by: int) -> int:
    """Raise this process's nice value by ``by`` (capped at 19); returns the new value.
    Linux keeps a nice value per thread and a new thread takes its creator's: every thread
    running now (MPI's own among them) is reniced, and those started later (the compute
    thread, torch's, the loader processes) inherit it."""
    if by <= 0:
        return os.getpriority(os.PRIO_PROCESS, 0)
    try:
        try:
            tids = [int(t) for t in os.listdir("/proc/self/task")]
        except OSError:  # no procfs: the process-wide call
            return os.nice(by)
        for tid in tids:
            try:
                now = os.getpriority(os.PRIO_PROCESS, tid)
                os.setpriority(os.PRIO_PROCESS, tid, min(19, now + by))
            except ProcessLookupError:  # a thread that ended meanwhile
                continue
    except PermissionError as exc:  # a sandbox that forbids even lowering one's priority
        raise UsageError(f"--worker-nice: this system does not let a worker lower its own "
                         f"priority ({exc.strerror}); run with --worker-nice 0") from None
    return os.getpriority(os.PRIO_PROCESS, 0)


def device_name(placement: Placement, uses_torch: bool) -> str:
    """The device :func:`torch_device` gives this rank ("cuda:<local rank mod GPUs>" or
    "cpu"), without starting CUDA: for the placement line. A numpy model runs on the CPU."""
    if not uses_torch:
        return "cpu"
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return f"cuda:{placement.local_rank % count}" if count else "cpu"


def torch_device(threads: int, placement: Placement) -> torch.device:
    """This rank's GPU (one per local rank, round robin) or the CPU, and its torch threads
    (:func:`torch_threads`)."""
    import torch

    torch.set_num_threads(torch_threads(threads, placement))
    if not torch.cuda.is_available():
        return torch.device("cpu")
    device = torch.device(f"cuda:{placement.local_rank % torch.cuda.device_count()}")
    torch.cuda.set_device(device)
    return device


# node, host, local rank, local size, threads, device, nice value
RankPlace = tuple[int, str, int, int, int, str, int]


def gather_placement(comm: MPI.Intracomm, placement: Placement, threads: int,
                     uses_torch: bool) -> list[RankPlace] | None:
    """Collective: on rank 0, every rank's (node, host name, local rank, ranks on its node,
    torch threads, device, nice value), in rank order; None elsewhere. For --verbose's
    placement line, which shows that a job across nodes gets its budgets per node."""
    import socket

    mine = (placement.node, socket.gethostname(), placement.local_rank, placement.local_size,
            torch_threads(threads, placement), device_name(placement, uses_torch),
            os.getpriority(os.PRIO_PROCESS, 0))
    return comm.gather(mine, root=0)


def placement_line(ranks: list[RankPlace], kernel_threads: int, eval_threads: int) -> str:
    """One line: the nodes MPI's shared-memory split found (named by host name), the ranks
    on each, the master's kernel and evaluation threads, each worker's threads and device
    (and its nice value where it is not 0: --worker-nice)."""
    nodes: dict[int, list[int]] = {}
    for rank, place in enumerate(ranks):
        nodes.setdefault(place[0], []).append(rank)
    parts = []
    for members in nodes.values():
        said = []
        for r in members:
            _, _, local, size, threads, device, nice = ranks[r]
            niced = f", nice {nice}" if nice else ""
            said.append(f"rank 0 (master, local {local}/{size}: kernel {kernel_threads} threads, "
                        f"evaluation {eval_threads} threads{niced})" if r == 0 else
                        f"rank {r} (local {local}/{size}: {device}, {threads} threads{niced})")
        parts.append(f"{ranks[members[0]][1]}: " + ", ".join(said))
    return f"placement: {len(nodes)} node(s); " + "; ".join(parts)


def seed_dropout(seed: int, worker: int, step: int) -> None:
    """Each worker its own dropout masks (θ₀ came from --seed alone, before this); seeded
    per step, a resumed run draws the masks the uninterrupted one would have. The batch of
    the step is made just after (its augmentation draws first), here or in a loader process
    seeded alike (gem_mpi.problem.loader)."""
    from gem_mpi.problem.seeds import seed_step  # here: a quadratic run never loads torch

    seed_step(seed, worker, step)


def data_stream(data: DataConfig, worker: int, n_workers: int, start_seq: int = 0,
                runs: list | None = None) -> tuple:
    """(steps, batches) of worker number ``worker`` (1..n): the same stream whichever method
    runs it, so that methods are compared on the same data, and whether its batches are made
    in this process or in --loader-workers processes (page-locked when this rank trains on a
    GPU, as :func:`torch_device` decides). ``batches.close()`` ends the loader processes.
    ``runs``: the worker's plan once its run changed its number of workers
    (:mod:`gem_mpi.problem.elastic`), its batches dealt from the first start's streams."""
    # torch models only (the data modules import torch; the quadratic never does)
    import torch

    from gem_mpi.problem.batches import dealt_plan, steps_per_epoch
    from gem_mpi.problem.datasets import training_split
    from gem_mpi.problem.elastic import length
    from gem_mpi.problem.loader import load_batches

    shard = (worker - 1, n_workers) if data.shard else None
    split = training_split(data, synthetic_size=data.synthetic_size)
    steps = steps_per_epoch(split, data.batch_size, shard) * data.epochs
    if data.max_steps:
        steps = min(steps, data.max_steps)
    plan = None
    if runs is not None:
        steps = length(runs)
        plan = dealt_plan(split, data.batch_size, data.seed * 100_003, data.shard, runs,
                          start_seq)
    batches = load_batches(split, data.batch_size, data.epochs,
                           seed=data.seed * 100_003 + worker, shard=shard, start=start_seq,
                           workers=data.loader_workers, step_seed=(data.seed, worker),
                           pin_memory=torch.cuda.is_available(), plan=plan)
    cores = _cores()
    if data.loader_workers >= cores:
        print(f"gem_mpi: worker {worker}: its {data.loader_workers} loader processes and its "
              f"training share the {cores} core(s) this rank may run on; give each rank "
              "--loader-workers + 1 cores (Open MPI binds each of up to 2 ranks to one core: "
              "mpirun --bind-to none, or --map-by slot:PE=N; srun --cpus-per-task=N)",
              file=sys.stderr, flush=True)
    return steps, batches


def worker_data(cfg: Config) -> DataConfig:
    """The data a worker of the engine reads: with --group-size G its group's, G ×
    --batch-size a step (each rank of the group takes a part); with --local-steps H, H ×
    --batch-size an update (one part a local step)."""
    size = cfg.runtime.group_size * cfg.optim.local_steps
    if size <= 1 or synchronous(cfg.method):
        return cfg.data
    return dataclasses.replace(cfg.data, batch_size=cfg.data.batch_size * size)


def first_plans(data: DataConfig, sources: int, quadratic: bool) -> list:
    """Each worker's plan in a run of ``sources`` workers that never changed their number:
    worker s reads its own stream whole (:func:`data_stream`; the quadratic's steps as one
    epoch, it has no data). What :func:`gem_mpi.problem.elastic.redeal` starts from."""
    from gem_mpi.problem.elastic import source_plan

    if quadratic:
        steps = data.max_steps or data.epochs * max(1, data.synthetic_size // data.batch_size)
        return [source_plan(s, sources, steps, 1) for s in range(1, sources + 1)]
    from gem_mpi.problem.batches import steps_per_epoch
    from gem_mpi.problem.datasets import training_split

    split = training_split(data, synthetic_size=data.synthetic_size)
    return [source_plan(s, sources, steps_per_epoch(split, data.batch_size, (s - 1, sources)
                                                    if data.shard else None),
                        data.epochs, data.max_steps) for s in range(1, sources + 1)]


def plans_now(cfg: Config, n: int, dealt: Any) -> list:
    """The ``n`` workers' plans now: as a resume dealt them (a checkpoint's ``data_plan``),
    else each its own stream whole: the one answer to "its dealt plan, else its own"."""
    from gem_mpi.problem.elastic import from_array

    if dealt is not None:
        return from_array(dealt, n)
    return first_plans(worker_data(cfg), n, cfg.data.model == QUADRATIC)


def own_plan(data: DataConfig, n: int, worker: int, plan: list | None) -> list:
    """Torch worker ``worker``'s plan: the one dealt to it, else its own stream whole."""
    return plan if plan is not None else first_plans(data, n, False)[worker - 1]


def slowness(cfg: Config, world_size: int, worker: int) -> float:
    """How many times slower --speeds or --straggler makes worker ``worker`` (1 when
    neither names it)."""
    factors = speeds(cfg, world_size)
    if factors is not None:
        return factors[worker - 1]
    slow = straggler(cfg, world_size)
    return slow[1] if slow and slow[0] == worker else 1.0
