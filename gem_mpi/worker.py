"""A worker rank: pull θ, compute Δθ = −η∇L(s) on its next mini-batch, commit, repeat.

For GEM the worker also keeps its proxy momentum m ← μm + Δθ (spec section 3) and sends the
master (Δθ, κ|m|, s): the three numbers per element that master-side GEM needs to compute π
exactly against the master's current θ (see docs/ARCHITECTURE.md). After a commit the worker
waits until the master has applied it before pulling again, so its next s includes its own
contribution (as in the authors' prototype) and its staleness is that of the others' updates.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass

import numpy as np

from gem_mpi import checkpoint
from gem_mpi.config import Config, straggler
from gem_mpi.problem import Problem
from gem_mpi.transport import (
    KIND_DONE,
    KIND_UPDATE,
    MPI,
    SHUTDOWN_STOP,
    Layout,
    WorkerEndpoint,
)


def local_placement(comm: MPI.Intracomm) -> tuple[int, int]:
    """(local rank, ranks on this node) from MPI's shared-memory split, whatever the launcher."""
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return node.Get_rank(), node.Get_size()
    finally:
        node.Free()


def torch_device(cfg: Config, local_rank: int, local_size: int) -> object:
    """This rank's GPU (one per local rank, round robin) or the CPU, and its torch threads."""
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    torch.set_num_threads(cfg.threads or max(1, (os.cpu_count() or cores) // local_size))
    if not torch.cuda.is_available():
        return torch.device("cpu")
    device = torch.device(f"cuda:{local_rank % torch.cuda.device_count()}")
    torch.cuda.set_device(device)
    return device


def seed_dropout(cfg: Config, worker: int, step: int) -> None:
    """Each worker its own dropout masks (θ₀ came from --seed alone, before this); seeded
    per step, a resumed run draws the masks the uninterrupted one would have."""
    import torch

    from gem_mpi.data import mix_seed

    torch.manual_seed(mix_seed(cfg.seed, worker, step))


def data_stream(cfg: Config, worker: int, n_workers: int, start_seq: int = 0) -> tuple:
    """(steps, batches) of worker number ``worker`` (1..n): the same stream whichever method
    runs it, so that methods are compared on the same data."""
    from gem_mpi.data import iterate_batches, load_split, steps_per_epoch

    shard = (worker - 1, n_workers) if cfg.shard else None
    split = load_split(cfg.dataset, cfg.data_dir, "train", cfg.model,
                       synthetic_size=cfg.synthetic_size)
    steps = steps_per_epoch(split, cfg.batch_size, shard) * cfg.epochs
    if cfg.max_steps:
        steps = min(steps, cfg.max_steps)
    batches = iterate_batches(split, cfg.batch_size, cfg.epochs,
                              seed=cfg.seed * 100_003 + worker, shard=shard, start=start_seq)
    return steps, batches


@dataclass
class Momentum:
    """A GEM worker's proxy momentum m (numpy or torch), its value before the last update
    was folded in, and how many of this worker's updates it holds: on a stop the worker
    saves both values, and a resume takes the one holding exactly the updates the master
    had applied (the last commit may or may not have been)."""

    m: object
    prev: object
    folded: int = 0

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        def host(x: object) -> np.ndarray:
            return x if isinstance(x, np.ndarray) else x.detach().cpu().numpy()

        return host(self.m), host(self.prev)

    def restore(self, values: np.ndarray, folded: int) -> None:
        if isinstance(self.m, np.ndarray):
            self.m[...] = values
        else:
            import torch

            self.m.copy_(torch.from_numpy(values))
        self.folded = folded


class _QuadraticSteps:
    """Δθ of the numpy quadratic problem; used by the invariant tests."""

    def __init__(self, cfg: Config, problem: Problem, rank: int) -> None:
        self.q = problem.quadratic
        self.lr = cfg.lr
        self.target = self.q.target(rank)
        self.steps = cfg.max_steps or cfg.epochs * max(1, cfg.synthetic_size // cfg.batch_size)
        self.device = "cpu (numpy)"

    def __call__(self, theta: np.ndarray, seq: int) -> tuple[np.ndarray, float]:
        return self.q.step(theta, self.target, self.lr)

    def momentum(self) -> Momentum:
        return Momentum(np.zeros(self.q.dim, np.float32), np.zeros(self.q.dim, np.float32))

    def gem_parts(self, delta: np.ndarray, state: Momentum, cfg: Config) -> np.ndarray:
        m = state.m
        state.prev[...] = m
        m *= np.float32(cfg.momentum)
        m += delta
        state.folded += 1
        return np.float32(cfg.kappa) * np.abs(m)


class _TorchSteps:
    """Δθ of a torch model on this worker's data stream, on its GPU or the CPU."""

    def __init__(self, cfg: Config, problem: Problem, rank: int, n_workers: int,
                 local_rank: int, local_size: int, start_seq: int = 0) -> None:
        import torch
        import torch.nn.functional as F

        self.torch, self.F = torch, F
        self.device = torch_device(cfg, local_rank, local_size)
        self.cfg, self.rank = cfg, rank
        self.model = problem.model.to(self.device)
        self.model.train()
        self.params = list(self.model.parameters())
        n = problem.n_params
        on_gpu = self.device.type == "cuda"
        # host staging buffers (pinned on GPU, so copies are DMA and can overlap)
        self._delta_host = torch.empty(n, dtype=torch.float32, pin_memory=on_gpu)
        self._a_host = torch.empty(n, dtype=torch.float32, pin_memory=on_gpu)
        self._flat = torch.empty(n, dtype=torch.float32, device=self.device)
        self._grad = torch.empty(n, dtype=torch.float32, device=self.device)
        self.steps, self.batches = data_stream(cfg, rank, n_workers, start_seq)
        self.lr = cfg.lr

    def __call__(self, theta: np.ndarray, seq: int) -> tuple[np.ndarray, float]:
        torch = self.torch
        seed_dropout(self.cfg, self.rank, seq)  # randomness a function of (seed, worker, step)
        self._flat.copy_(torch.from_numpy(theta), non_blocking=True)
        offset = 0
        with torch.no_grad():
            for p in self.params:
                k = p.numel()
                p.copy_(self._flat[offset:offset + k].view_as(p))
                offset += k
        x, y = next(self.batches)
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        for p in self.params:
            p.grad = None
        loss = self.F.nll_loss(self.model(x), y)
        loss.backward()
        torch.cat([p.grad.reshape(-1) for p in self.params], out=self._grad)
        self._grad.mul_(-self.lr)  # Δθ, on the device
        self._delta_host.copy_(self._grad, non_blocking=True)
        value = float(loss.detach())  # synchronises the device, so the host copy is done
        return self._delta_host.numpy(), value

    def momentum(self) -> Momentum:
        return Momentum(self.torch.zeros_like(self._grad), self.torch.zeros_like(self._grad))

    def gem_parts(self, delta: np.ndarray, state: Momentum, cfg: Config) -> np.ndarray:
        m = state.m
        state.prev.copy_(m)
        m.mul_(cfg.momentum).add_(self._grad)
        state.folded += 1
        self._a_host.copy_(m.abs().mul_(cfg.kappa))
        return self._a_host.numpy()


def run_worker(cfg: Config, comm: MPI.Intracomm, layout: Layout, problem: Problem,
               placement: tuple[int, int], start_seq: int = 0) -> int:
    """Train until the data budget is used (or the master stops the run early); returns the
    master's shutdown code (transport.SHUTDOWN_*).

    ``start_seq`` > 0 resumes from a checkpoint: the first ``start_seq`` updates of this
    worker were applied before it, so its data stream continues after them.
    """
    rank = comm.Get_rank()
    local_rank, local_size = placement
    if problem.quadratic is not None:
        steps_fn = _QuadraticSteps(cfg, problem, rank)
    else:
        steps_fn = _TorchSteps(cfg, problem, rank, layout.n_workers, local_rank, local_size,
                               start_seq)
    ep = WorkerEndpoint(comm, layout, poll_limit=cfg.poll_max_ms / 1000.0)
    is_gem = cfg.method == "gem"
    state = steps_fn.momentum() if is_gem else None
    if state is not None:
        state.folded = start_seq
        if start_seq and cfg.checkpoint_dir:  # a stopped run's momentum, if it matches
            found = checkpoint.load_worker_momentum(cfg.checkpoint_dir, rank, start_seq,
                                                    cfg.as_dict())
            if found is not None:
                state.restore(found, start_seq)
    if cfg.verbose:
        print(f"gem_mpi: worker {rank}: steps {start_seq}..{steps_fn.steps} on "
              f"{steps_fn.device}", file=sys.stderr, flush=True)
    slow = straggler(cfg, comm.Get_size())
    slow_factor = slow[1] if slow and slow[0] == rank else 1.0
    version = ep.pull()
    t_wait = 0.0
    stopped = False
    for seq in range(start_seq, steps_fn.steps):
        t0 = time.perf_counter()
        delta, loss = steps_fn(ep.theta, seq)
        if is_gem:
            a = steps_fn.gem_parts(delta, state, cfg)
            parts = (delta, a, ep.theta)  # s: the θ this Δθ was computed on
        else:
            parts = (delta,)
        compute_s = time.perf_counter() - t0
        if slow_factor > 1.0:  # --straggler: this worker takes FACTOR times as long
            time.sleep((slow_factor - 1.0) * compute_s)
            compute_s *= slow_factor
        ep.commit(KIND_UPDATE, seq, version, loss, compute_s, parts)
        tw = time.perf_counter()
        if not ep.wait_slot_free():
            stopped = True
            break
        t_wait += time.perf_counter() - tw
        version = ep.pull()
        if cfg.verbose and (seq + 1) % 100 == 0:
            print(f"gem_mpi: worker {rank}: step {seq + 1}/{steps_fn.steps} loss {loss:.4f} "
                  f"waited {t_wait:.1f} s", file=sys.stderr, flush=True)
    if not stopped:
        ep.commit(KIND_DONE, steps_fn.steps, version)
    code = ep.wait_shutdown()
    ep.close()
    if code == SHUTDOWN_STOP and state is not None and cfg.checkpoint_dir:
        m, prev = state.arrays()
        checkpoint.save_worker_momentum(cfg.checkpoint_dir, rank, state.folded, m, prev,
                                        cfg.as_dict())
    return code
