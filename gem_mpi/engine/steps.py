"""A worker's steps: Δθ = −η∇L(s) at the θ it pulled, for the numpy quadratic (the invariant
tests') or a torch model, behind one interface (:class:`Steps`), so that the worker's loop
and orders never ask which kind they hold."""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Protocol, TypeVar

import numpy as np

from gem_mpi.algorithm.optim import States, own_optimizer
from gem_mpi.algorithm.stepsize import Schedule, clip
from gem_mpi.config import AT_PULLED, AdamWConfig, Config, DataConfig, OptimConfig
from gem_mpi.engine.batches import WorkerBatches
from gem_mpi.engine.buffers import DeltaTurns, HostCopies
from gem_mpi.engine.group import Group
from gem_mpi.problem import Problem
from gem_mpi.problem.elastic import length
from gem_mpi.run.local_step import LocalStep
from gem_mpi.run.rank import Placement, torch_device

if TYPE_CHECKING:  # torch is imported when a torch worker is made, never on import
    import torch

# where GEM's m lives: numpy's array (the quadratic), or a torch tensor on the worker's device
M = TypeVar("M")


class Steps(Protocol[M]):
    """What the worker needs of its steps. ``steps``: the batches of its plan (more once
    dealt more); ``load_s``, ``gpu_s``: the time split's columns they measure; ``group``:
    the worker group it leads (--group-size), if any."""

    load_s: float
    gpu_s: float
    # where its pulls land (the overlap's three θ), then its gradient points', if its own
    pull_buffers: list[np.ndarray]
    group: Group | None
    own: States | None  # the worker's own optimizer (AdamW, --local-steps'), whose step is Δθ
    threads: int  # the worker's intra-op threads (its gradient point's add takes them too)

    @property
    def device(self) -> object:
        """Where the steps run, as the --verbose line names it."""

    @property
    def steps(self) -> int: ...

    @property
    def pull_buffer(self) -> np.ndarray | None:
        """Where its pulls land; None: the endpoint's own buffer."""

    @property
    def delta_on_device(self) -> M | None:
        """The last step's Δθ where GEM's m lives; None: on the host, with Δθ."""

    def momentum_like(self) -> M:
        """An array of θ's size where GEM's m is to live (the rule makes m like it)."""

    def __call__(self, theta: np.ndarray, seq: int, h: int | None = None
                 ) -> tuple[np.ndarray | None, float]:
        """Step ``seq`` at ``theta``: (Δθ on the host, or None when settle makes it, loss);
        ``h``: its local steps, ≤ --local-steps H (--dylu; None: H)."""

    def pending(self, seq: int, delta: np.ndarray | None) -> tuple[np.ndarray, float]:
        """Step ``seq``'s Δθ as (v, q), Δθ = q·v, before :meth:`settle` (v holds until
        then): a gradient point's add reads it without Δθ made first."""

    def settle(self, seq: int, delta: np.ndarray | None) -> np.ndarray:
        """Step ``seq``'s Δθ on the host, on the thread that sends it."""

    def host(self, a: M) -> np.ndarray:
        """An array where m lives (κ|m|), on the host."""

    def comm_stream(self) -> contextlib.AbstractContextManager:
        """The sending thread's context while another thread computes."""

    def compute_thread(self) -> None:
        """Set up the compute thread (--worker-mode overlap)."""

    def close(self) -> None:
        """End the data stream."""

    def extend(self, runs: list) -> None:
        """Go on with ``runs`` more batches (a departed worker's)."""

    def release(self) -> None:
        """The worker left the run: give its device back."""


class QuadraticSteps:
    """Δθ of the numpy quadratic problem; used by the invariant tests."""

    def __init__(self, optim: OptimConfig, data: DataConfig, problem: Problem,
                 rank: int, plan: list | None = None, adamw: AdamWConfig | None = None
                 ) -> None:
        assert problem.quadratic is not None, "the quadratic problem"
        self.q = problem.quadratic
        self.n = problem.n_params
        self.lr = optim.lr
        self.target = self.q.target(rank)
        self.steps = length(plan) if plan is not None else (
            data.max_steps or data.epochs * max(1, data.synthetic_size // data.batch_size))
        self.h = optim.local_steps  # each update H steps of its own optimizer
        self.schedule = Schedule.of(optim, self.steps * self.h)
        self.clip_norm = optim.clip_grad_norm
        self.plain = self.schedule.constant and self.clip_norm == 0  # Quadratic.step as is
        self.device = "cpu (numpy)"
        self.load_s = 0.0  # Δθ is computed on the pulled θ in place
        self.gpu_s = float("nan")
        self.pull_buffer = None  # pulls land in the endpoint's own buffer
        self.pull_buffers: list[np.ndarray] = []
        self.group: Group | None = None
        self.delta_on_device = None  # m lives on the host, beside Δθ
        self.threads = 1
        self.own = own_optimizer(optim, adamw or AdamWConfig(), np.zeros(self.n, np.float32))

    def momentum_like(self) -> np.ndarray:
        return np.zeros(self.n, np.float32)

    def __call__(self, theta: np.ndarray, seq: int, h: int | None = None
                 ) -> tuple[np.ndarray, float]:
        if self.plain and self.own is None:
            return self.q.step(theta, self.target, self.lr)
        if self.own is None:
            diff = theta - self.target
            loss = 0.5 * float(np.dot(self.q.h * diff, diff))
            return -self.schedule.eta(seq) * clip(self.q.h * diff, self.clip_norm), loss
        if self.h == 1:  # its own optimizer's step d is Δθ (a new array each step, as q.step's)
            diff = theta - self.target
            loss = 0.5 * float(np.dot(self.q.h * diff, diff))
            return self.own.step(clip(self.q.h * diff, self.clip_norm), theta,
                                 float(self.schedule.eta(seq)), np.empty_like(theta)), loss
        # --local-steps H: H steps (--dylu: h ≤ H) from θ₀ = theta on its own copy,
        # Δ = θ_h − θ₀, the loss the mean of the steps'; step i's η is the i-th of seq's H
        steps = self.h if h is None else h
        local, losses, d = theta.copy(), 0.0, np.empty_like(theta)
        for i in range(steps):
            diff = local - self.target
            losses += 0.5 * float(np.dot(self.q.h * diff, diff))
            g = clip(self.q.h * diff, self.clip_norm)
            local += self.own.step(g, local, float(self.schedule.eta(seq * self.h + i)), d,
                                   fresh=i == 0)
        return local - theta, losses / steps

    def host(self, a: np.ndarray) -> np.ndarray:
        return a

    def comm_stream(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def compute_thread(self) -> None:
        """Nothing to set up on the compute thread."""

    def pending(self, seq: int, delta: np.ndarray | None) -> tuple[np.ndarray, float]:
        return self.settle(seq, delta), 1.0

    def settle(self, seq: int, delta: np.ndarray | None) -> np.ndarray:
        assert delta is not None, "the quadratic's Δθ comes with its step"
        return delta

    def close(self) -> None:
        """Nothing to end: the quadratic has no data stream."""

    def extend(self, runs: list) -> None:
        """Dealt ``runs`` more batches (a departed worker's): the quadratic has no data."""
        self.steps += length(runs)

    def release(self) -> None:
        """Nothing to give back: numpy on the CPU."""


class TorchSteps:
    """Δθ of a torch model on this worker's data stream, on its GPU or the CPU: θ in, the
    step of :class:`LocalStep`, Δθ = −η·g out. On the CPU the parameters are views of the
    pulled θ and Δθ is computed in place: nothing is copied. On a GPU θ and Δθ go through
    :class:`HostCopies` beside the compute, and the next batch is sent ahead meanwhile."""

    def __init__(self, cfg: Config, problem: Problem, rank: int, n_workers: int,
                 placement: Placement, start_seq: int = 0, overlapped: bool = False,
                 plan: list | None = None, group: Group | None = None) -> None:
        """``overlapped`` (--worker-mode overlap): Δθ and θ's buffers take turns; ``plan``:
        the worker's dealt batches (:mod:`gem_mpi.problem.elastic`; None: its own stream);
        ``group``: this leader's worker group (--group-size), computing beside it."""
        import torch

        self.torch = torch
        self.device = torch_device(cfg.runtime.threads, placement)
        self.local = LocalStep(cfg.optim, problem, self.device)
        self.threads = torch.get_num_threads()  # as torch_device set them
        self._first_seq = start_seq
        n = problem.n_params
        self.load_s = 0.0  # copying θ into the model's parameters
        self.gpu_s = float("nan")  # the GPU's own time for the steps (see protocol)
        self.on_gpu = self.device.type == "cuda"
        self.group = group
        self.batches = WorkerBatches(cfg, rank, n_workers, start_seq, plan, self.device)
        like = torch.zeros(n, dtype=torch.float32, device=self.device)
        self.own = own_optimizer(cfg.optim, cfg.adamw, like)
        # --local-steps H: the steps run on a copy of θ the parameters view, at η of the
        # worker's own steps, H an update
        self.h, self.batch_size = cfg.optim.local_steps, cfg.data.batch_size
        self.schedule = Schedule.of(cfg.optim, self.steps * self.h)
        self.turns = DeltaTurns(self.local, n, cfg.optim.lr, self.schedule, overlapped,
                                self.on_gpu, self.own)
        self.theta_local = like if self.h > 1 else None
        self._d = torch.empty_like(like) if self.h > 1 else None  # a local step's d
        self._bound: int | None = None  # the host θ the CPU parameters view
        self.copies: HostCopies | None = None
        if self.on_gpu:
            self.copies = HostCopies(torch, self.device, n, overlapped, len(self.turns.deltas),
                                     points=cfg.optim.gradient_at != AT_PULLED)
            assert self.copies.flat is not None, "just made"
            self.local.bind(self.copies.flat)
            self.gpu_s = 0.0
        if self.theta_local is not None:
            self.local.bind(self.theta_local)
        self.pull_buffers = [] if self.copies is None else self.copies.pull_buffers

    @property
    def steps(self) -> int:
        return self.batches.steps

    @property
    def pull_buffer(self) -> np.ndarray | None:
        """Where the worker's pulls land: page-locked memory on a GPU, else its own."""
        return self.pull_buffers[0] if self.pull_buffers else None

    @property
    def delta_on_device(self) -> torch.Tensor | None:
        return self.turns.delta

    def momentum_like(self) -> torch.Tensor:
        assert self.turns.delta is not None, "asked at set-up, before release()"
        return self.turns.delta

    def __call__(self, theta: np.ndarray, seq: int, h: int | None = None
                 ) -> tuple[np.ndarray | None, float]:
        copies, turns, from_numpy = self.copies, self.turns, self.torch.from_numpy
        t = time.perf_counter()
        start = None
        if copies is not None:
            start = copies.load(theta)
        elif self.h == 1 and self._bound != theta.ctypes.data:  # its pull buffer, each step
            self.local.bind(from_numpy(theta))
            self._bound = theta.ctypes.data
        self.load_s += time.perf_counter() - t
        x, y = self.batches.batch(seq)
        flat = copies.flat if copies is not None else from_numpy(theta)  # θ, on its device
        assert flat is not None, "a step after release()"
        if self.group is not None:  # the members compute at this θ, each on its own part
            self.group.theta(flat, seq)
            x, y = self.group.part(x, y)
        turn = turns.begin(seq)
        grad = turns.grad
        assert grad is not None, "a step after release()"
        delta: torch.Tensor | None
        if self.theta_local is not None:  # --local-steps H > 1
            loss = self._local_steps(x, y, flat, seq, self.h if h is None else h)
            delta = turns.difference(turn, self.theta_local, flat)
        else:
            loss = self.local.forward_backward(x, y)  # into turns.grad (float32 parameters)
            if seq == self._first_seq:
                self.local.check_grads(grad)
            if self.group is not None:  # the group's gradient: the mean over its G parts
                self.group.average(grad)
            self.local.clip()  # before Δθ, and so before GEM's momentum fold
            delta = turns.make(turn, seq, flat)
        if delta is None:
            return None, float(loss.detach())  # Δθ: settle(), on the other thread
        if copies is None:
            return delta.numpy(), float(loss.detach())
        done = copies.back(turn, delta, loss)
        self.batches.prefetch(seq + 1, copies.stream)  # on the CPU, while the GPU computes
        done.synchronize()
        assert start is not None, "loaded by copies"
        self.gpu_s += start.elapsed_time(done) / 1e3
        return copies.delta_hosts[turn].numpy(), float(copies.loss_host[0])

    def _local_steps(self, x: torch.Tensor, y: torch.Tensor, theta: torch.Tensor,
                     seq: int, h: int) -> torch.Tensor:
        """--local-steps H: ``h`` ≤ H steps of its own optimizer from θ₀ = ``theta`` on the
        copy the parameters view, one part of the update's batch of H each (--dylu: a worker
        taking h < H skips the last H − h parts); the steps' mean loss."""
        local, own, grad, d = self.theta_local, self.own, self.turns.grad, self._d
        assert local is not None and own is not None and grad is not None and d is not None, \
            "made for --local-steps"
        local.copy_(theta)
        parts = list(zip(x.split(self.batch_size), y.split(self.batch_size)))[:h]
        total = self.torch.zeros((), device=self.device)
        for i, (xi, yi) in enumerate(parts):
            if i:
                grad.zero_()
            total += self.local.forward_backward(xi, yi).detach()
            if seq == self._first_seq and i == 0:
                self.local.check_grads(grad)
            self.local.clip()
            eta = float(self.schedule.eta(seq * self.h + i))
            local.add_(own.step(grad, local, eta, d, fresh=i == 0))
        return total / len(parts)

    def pending(self, seq: int, delta: np.ndarray | None) -> tuple[np.ndarray, float]:
        return self.turns.pending(seq, delta)

    def settle(self, seq: int, delta: np.ndarray | None) -> np.ndarray:
        return self.turns.settle(seq, delta)

    def host(self, a: torch.Tensor) -> np.ndarray:
        return a.numpy() if self.copies is None else self.copies.host(a)

    def comm_stream(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if self.copies is None else self.copies.comm_stream()

    def compute_thread(self) -> None:
        if self.copies is not None:
            self.copies.compute_thread()

    def close(self) -> None:
        self.batches.close()

    def extend(self, runs: list) -> None:
        """The lr schedule stays its own plan's: a batch past its end takes the last η."""
        added = self.batches.extend(runs)
        if self.group is not None:
            self.group.extend(added)

    def release(self) -> None:
        """The data stream ends, the GPU memory goes back (the process itself stays until
        the job ends, see gem_mpi.engine.roster)."""
        self.close()
        if self.on_gpu:
            assert self.copies is not None, "made on a GPU"
            self.local.model.to("cpu")
            self.turns.release()
            self.copies.flat = None
            self.torch.cuda.empty_cache()
