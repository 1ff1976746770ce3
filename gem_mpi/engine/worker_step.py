"""A worker's parts and what it does with them each step, whatever its order: compute Δθ
at the θ in hand (slowed by --straggler), make the update's payload, leave when told, and
keep the time split that its sign-off reports."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gem_mpi.algorithm.dylu import WorkerSteps
from gem_mpi.algorithm.rule import WorkerRule
from gem_mpi.config import OVERLAP, Config, OutputConfig
from gem_mpi.engine.steps import Steps
from gem_mpi.protocol import WORKER_TIME_COLUMNS
from gem_mpi.run.profiler import StepProfiler
from gem_mpi.transport.endpoints import WorkerShards


class TimeSplit:
    """Where a worker's time goes (the metrics file's /summary/worker_time): each
    :meth:`charge` adds the time since the previous one to a column, so the columns from
    the first pull to the last message add up to the wall time."""

    def __init__(self) -> None:
        self.columns = dict.fromkeys(WORKER_TIME_COLUMNS, 0.0)
        self.start = self.last = time.perf_counter()

    def charge(self, column: str) -> float:
        """Charge the seconds since the last charge to ``column``; returns them."""
        now = time.perf_counter()
        spent = now - self.last
        self.columns[column] += spent
        self.last = now
        return spent

    def final(self, load_s: float, gpu_s: float, backoff_s: float,
              group_s: float = 0.0) -> np.ndarray:
        """The DONE message's columns: the copy of θ into the model and a group's allreduce
        (--group-size) taken out of compute, the sleeps of the back-off out of waiting, the
        wall time since the first pull. With --worker-mode overlap the compute column is the
        wait for the compute thread and load_s and group_s, spent there, are 0 here."""
        c = dict(self.columns)  # a worker dealt more batches signs off again later
        c["load"], c["gpu"], c["backoff"], c["group"] = load_s, gpu_s, backoff_s, group_s
        c["compute"] -= load_s + group_s
        c["wait"] -= backoff_s
        c["wall"] = time.perf_counter() - self.start
        return np.array([c[k] for k in WORKER_TIME_COLUMNS], np.float32)


@dataclass(frozen=True)
class Step:
    """One computed step: Δθ on the host and where m lives, its loss and compute seconds."""

    delta: np.ndarray | None
    on_device: object
    loss: float
    compute_s: float


@dataclass
class WorkerStep:
    """One worker's parts, as :func:`gem_mpi.engine.worker.run_worker` sets them up."""

    cfg: Config
    rank: int  # the worker's number, 1..n
    steps_fn: Steps[Any]  # numpy's or torch's (where m lives): the worker never asks which
    ep: WorkerShards
    rule: WorkerRule
    poison_all: Callable[[tuple[np.ndarray, ...]], None] | None
    slow_factor: float
    # --profile-steps: started around the loop, ticked by report() (default: profiles nothing)
    profiler: StepProfiler = field(default_factory=lambda: StepProfiler(OutputConfig()))
    leaving: Callable[[], bool] = lambda: False  # SIGTERM reached this worker: leave the run
    split: TimeSplit = field(default_factory=TimeSplit)
    left_at: int | None = None  # its updates when it left (all committed)
    orders: int = 0  # the master's orders of more batches taken
    # --dylu: its own pace and each update's steps; None: every update --local-steps H
    dylu: WorkerSteps | None = None

    def leave_now(self, seq: int) -> bool:
        """Before step ``seq`` (updates 0..seq−1 committed): whether to leave the run now."""
        if self.leaving():
            self.left_at = seq
            return True
        return False

    def time_split(self) -> np.ndarray:
        """The columns of a DONE or LEFT message."""
        overlapped = self.cfg.optim.worker_mode == OVERLAP  # load_s was the compute thread's
        group = self.steps_fn.group
        return self.split.final(0.0 if overlapped else self.steps_fn.load_s,
                                self.steps_fn.gpu_s, self.ep.backoff_s,
                                0.0 if overlapped or group is None else group.allreduce_s)

    def local_steps(self, seq: int) -> int | None:
        """--dylu: update ``seq``'s local steps, from this worker's pace and the fastest one's
        as published with the θ last pulled; None: --local-steps H."""
        return None if self.dylu is None else self.dylu.decide(seq, self.ep.pace)

    def steps_of(self, seq: int) -> int:
        """The local steps update ``seq`` took, for its commit's header."""
        return self.cfg.optim.local_steps if self.dylu is None else self.dylu.committed(seq)

    def compute(self, seq: int, at: np.ndarray | None = None) -> tuple[np.ndarray, float, float]:
        """Δθ and the loss of step ``seq`` at ``at`` (default: the θ in hand), and its compute
        seconds (times the --straggler factor, slept here)."""
        h = self.local_steps(seq)
        with self.profiler.range("gem_mpi.compute"):
            delta, loss = self.steps_fn(self.ep.theta if at is None else at, seq, h)
        assert delta is not None, "only --worker-mode overlap defers Δθ (its own step())"
        compute_s = self.split.charge("compute")  # θ into the model, forward, backward, Δθ
        compute_s = self.straggle(compute_s)
        self.split.charge("straggle")
        if self.dylu is not None:
            self.dylu.measured(seq, compute_s)
        return delta, loss, compute_s

    def straggle(self, compute_s: float) -> float:
        """--straggler: this worker takes FACTOR times as long (the rest slept here)."""
        if self.slow_factor > 1.0:
            time.sleep((self.slow_factor - 1.0) * compute_s)
            compute_s *= self.slow_factor
        return compute_s

    def step(self, seq: int, theta: np.ndarray) -> Step:
        """Step ``seq`` at ``theta``, on the compute thread (--worker-mode overlap): no MPI,
        no time split (the thread that calls MPI keeps it)."""
        h = self.local_steps(seq)
        t = time.perf_counter()
        with self.profiler.range("gem_mpi.compute"):
            delta, loss = self.steps_fn(theta, seq, h)  # Δθ None: settle() makes it
        on_device = self.steps_fn.delta_on_device
        compute_s = self.straggle(time.perf_counter() - t)
        if self.dylu is not None:
            self.dylu.measured(seq, compute_s)
        return Step(delta, on_device, loss, compute_s)

    def payload(self, delta: np.ndarray, s: np.ndarray,
                delta_on_device: object = None) -> tuple[np.ndarray, ...]:
        """The update's parts (GEM: Δθ, κ|m|, s after the fold); sharded, an update holding
        NaN/Inf in one shard's part is poisoned in every shard's, so every kernel rejects it.
        ``delta_on_device``: the step's Δθ where m lives (default: the last step's)."""
        if delta_on_device is None:
            delta_on_device = self.steps_fn.delta_on_device
        with self.profiler.range("gem_mpi.payload"):
            parts = self.rule.payload(delta, s, delta_on_device, self.steps_fn.host)
        if self.poison_all is not None:
            self.poison_all(parts)
        self.split.charge("payload")
        return parts

    def report(self, seq: int, loss: float) -> None:
        """Step ``seq`` is committed, whatever the order: the profiler's step ends, and
        --verbose's line is due every 100 steps."""
        self.profiler.tick()
        if self.cfg.monitor.verbose and (seq + 1) % 100 == 0:
            print(f"gem_mpi: worker {self.rank}: step {seq + 1}/{self.steps_fn.steps} loss "
                  f"{loss:.4f} waited {self.split.columns['wait']:.1f} s", file=sys.stderr,
                  flush=True)

