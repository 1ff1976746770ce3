"""``--group-size G``: G ranks of one node train as one GEM worker, synchronously inside.

The group's leader (its first rank) is the worker the master sees: it pulls θ, commits Δθ
and folds GEM's momentum, as a worker does. Every step it broadcasts the θ it pulled to the
members with the step's number; each rank computes the gradient of its own part of the
group's batch (G × --batch-size, the group's stream: worker g's stream of a run of n groups,
made with the larger batch), and the G gradients are averaged (allreduce) before the leader
clips them and makes Δθ = −η·g: the Δθ of one worker whose batch is the union, up to the
order of summation. The collectives are torch.distributed's (gloo on the CPU, NCCL on GPUs,
gloo again where ranks share a GPU) over a process group of the G ranks, started from the MPI
world (:func:`process_group` on the group's communicator; a group never spans nodes, so
its sockets listen on loopback alone). When the leader's run ends it sends the members its stop word instead of a step.

A member that dies ends the job (MPI's launcher kills it); a member that hangs holds the
leader in the allreduce, so the master hears nothing from that worker and its watchdog ends
the run with a checkpoint after --worker-timeout (the process group's own timeout is set
longer, so that the master speaks first).
"""

from __future__ import annotations

import datetime
import time
from typing import TYPE_CHECKING

from gem_mpi.config import Config
from gem_mpi.problem import Problem
from gem_mpi.run.local_step import LocalStep
from gem_mpi.run.profiler import StepProfiler
from gem_mpi.run.rank import (
    Placement,
    data_stream,
    own_plan,
    seed_dropout,
    torch_device,
    worker_data,
)
from gem_mpi.transport import MPI
from gem_mpi.transport.runtime import process_group

if TYPE_CHECKING:  # torch is imported when a group is made, never on import
    import torch

_END = -1  # in the control word's step field: the run ended, the code follows
_MORE = -2  # the group was dealt more batches (a departed worker's): their runs follow


class Group:
    """This rank's worker group: its process group, the step's θ sent from the leader, the
    gradient averaged. ``comm``: the MPI communicator of the group's ranks, leader first."""

    def __init__(self, cfg: Config, comm: MPI.Intracomm, device: torch.device) -> None:
        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist
        self.size, self.member = comm.Get_size(), comm.Get_rank()
        self.leader = self.member == 0
        self.batch = cfg.data.batch_size  # this rank's part of the group's batch
        # NCCL needs a GPU per rank; ranks sharing one (a one-GPU check) go through gloo,
        # which takes CUDA tensors too
        devices = comm.allgather(str(device))
        distinct = len(set(devices)) == len(devices)
        backend = "nccl" if device.type == "cuda" and distinct else "gloo"
        # longer than the master's watchdog: a hung member is the master's to report
        timeout = 2 * (cfg.monitor.worker_timeout or 900.0) + 60.0
        # a group never spans nodes: loopback
        process_group(comm, backend, datetime.timedelta(seconds=timeout), None, local=True)
        self.backend = backend
        self._word = torch.zeros(2, dtype=torch.int64, device=device)
        self.allreduce_s = 0.0  # seconds in the gradient's average (the group's cost)
        self.more: list = []  # a member: the runs last dealt to the group
        self.ended = False  # the leader said the end

    def part(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of the group's batch."""
        lo = self.member * self.batch
        return x[lo:lo + self.batch], y[lo:lo + self.batch]

    def theta(self, flat: torch.Tensor, seq: int) -> None:
        """Leader: send step ``seq`` and its θ (``flat``) to the members."""
        self._word[0], self._word[1] = seq, 0
        self.dist.broadcast(self._word, src=0)
        self.dist.broadcast(flat, src=0)

    def extend(self, runs: list) -> None:
        """Leader: the group was dealt ``runs`` (:mod:`gem_mpi.problem.elastic`) after its
        own batches; the members read their parts of them too."""
        torch = self.torch
        self._word[0], self._word[1] = _MORE, len(runs)
        self.dist.broadcast(self._word, src=0)
        self.dist.broadcast(torch.tensor(runs, dtype=torch.int64, device=self._word.device),
                            src=0)

    def next_step(self, flat: torch.Tensor) -> tuple[int, int]:
        """Member: (the step, 0) with θ received into ``flat``, (-1, the leader's code), or
        (-2, 0) with the runs dealt to the group in ``self.more``."""
        self.dist.broadcast(self._word, src=0)
        seq, code = int(self._word[0]), int(self._word[1])
        if seq == _END:
            return _END, code
        if seq == _MORE:
            runs = self.torch.empty((code, 5), dtype=self.torch.int64,
                                    device=self._word.device)
            self.dist.broadcast(runs, src=0)
            self.more = [tuple(r) for r in runs.tolist()]
            return _MORE, 0
        self.dist.broadcast(flat, src=0)
        return seq, 0

    def average(self, grad: torch.Tensor) -> None:
        """The mean of the G ranks' gradients, in place (every rank)."""
        t = time.perf_counter()
        self.dist.all_reduce(grad)
        grad.div_(self.size)
        self.allreduce_s += time.perf_counter() - t

    def end(self, code: int) -> None:
        """Leader: the run is over (or the leader left it); the members exit with ``code``
        (the master's stop word). Once: a departed leader has told them already."""
        if self.ended:
            return
        self.ended = True
        self._word[0], self._word[1] = _END, code
        self.dist.broadcast(self._word, src=0)

    def close(self) -> None:
        if self.dist.is_initialized():
            self.dist.destroy_process_group()


def run_member(cfg: Config, group: Group, problem: Problem, placement: Placement,
               worker: int, n_workers: int, start_seq: int, plan: list | None = None) -> int:
    """A member's loop: θ from the leader, its part's gradient, the average; returns the
    leader's stop word when the run ends. ``worker``: the group's number (1..n)."""
    import torch

    device = torch_device(cfg.runtime.threads, placement)
    local = LocalStep(cfg.optim, problem, device)
    flat = torch.zeros(problem.n_params, dtype=torch.float32, device=device)
    grad = torch.zeros_like(flat)
    local.bind(flat)  # the parameters and their gradients: views of two flat buffers
    local.bind_grads(grad)
    data = worker_data(cfg)
    _, batches = data_stream(data, worker, n_workers, start_seq, plan)
    # dropout masks of its own: a number no worker of the run has, fixed per (group, member)
    masks = n_workers * group.member + worker
    expect = start_seq
    profiler = StepProfiler(cfg.outputs, device.type == "cuda")  # --profile-steps
    profiler.start()
    try:
        while True:
            seq, code = group.next_step(flat)
            if seq == _END:
                return code
            if seq == _MORE:  # the group's stream goes on with the batches dealt to it
                plan = own_plan(data, n_workers, worker, plan) + group.more
                batches.close()
                _, batches = data_stream(data, worker, n_workers, expect, plan)
                continue
            if seq != expect:
                raise RuntimeError(f"group {worker}: the leader sent step {seq}, this member "
                                   f"expected {expect}")
            expect += 1
            seed_dropout(cfg.data.seed, masks, seq)
            x, y = group.part(*next(batches))
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            grad.zero_()
            local.forward_backward(x, y)
            group.average(grad)
            profiler.tick()  # its step ends, as its leader's does
    finally:
        profiler.close()
        batches.close()
