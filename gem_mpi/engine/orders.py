"""The worker's three orders (``--worker-mode``), each a loop over its steps from
``start_seq``: ``wait`` commits, waits for the update's application, pulls; ``pipelined``
(Algorithm 1's order) computes the next Δθ while the master applies the last; ``overlap``
computes step k+1 on a thread of its own while this one commits step k and pulls θ for step
k+2. Each returns (stopped by the master, the versions of the θ last pulled)."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from gem_mpi.config import OVERLAP, PIPELINED
from gem_mpi.engine.points import GradientPoints
from gem_mpi.engine.worker_step import WorkerStep
from gem_mpi.protocol import UPDATE

Versions = list[int]  # θ's version in each shard, as the worker pulled it (its commits carry it)


def wait_order(w: WorkerStep, start_seq: int, version: Versions) -> tuple[bool, Versions]:
    """--worker-mode wait: commit Δθ with s the θ it was computed on, wait for its
    application, pull. Returns (stopped by the master, the last version pulled)."""
    ep, split = w.ep, w.split
    for seq in range(start_seq, w.steps_fn.steps):
        if w.leave_now(seq):
            return False, version
        delta, loss, compute_s = w.compute(seq)
        parts = w.payload(delta, ep.theta)
        ep.commit(UPDATE, seq, version, loss, compute_s, parts, w.steps_of(seq))
        split.charge("commit")
        if not ep.wait_slot_free():
            return True, version
        split.charge("wait")
        version = ep.pull()
        split.charge("pull")
        w.report(seq, loss)
    return False, version


def pipelined_order(w: WorkerStep, start_seq: int, version: Versions) -> tuple[bool, Versions]:
    """--worker-mode pipelined, Algorithm 1's order: the previous update was being applied
    while this one was computed; wait for its slot, then θ ← pull(), commit Δθ, s ← θ. m
    folds Δθ only then, so a stop during the wait leaves m one fold ahead at most."""
    ep, split = w.ep, w.split
    s_copy = np.empty_like(ep.theta) if w.rule.with_s else None
    points = GradientPoints(w.cfg.optim.gradient_at, ep.theta, start_seq,
                            w.steps_fn.pull_buffers[1:2], w.steps_fn.threads)
    for seq in range(start_seq, w.steps_fn.steps):
        if w.leave_now(seq):  # its last update may be in flight: LEFT waits for its slot
            return False, version
        delta, loss, compute_s = w.compute(seq, points.at(seq, ep.theta))
        points.done(seq, delta)
        if not ep.wait_slot_free():
            return True, version
        split.charge("wait")
        s = ep.theta
        if s_copy is not None and w.rule.sends_s:  # the pull below overwrites ep.theta
            np.copyto(s_copy, ep.theta)
            s = s_copy
        parts = w.payload(delta, s)
        pulled = ep.pull()
        split.charge("pull")
        ep.commit(UPDATE, seq, version, loss, compute_s, parts, w.steps_of(seq))
        split.charge("commit")
        version = pulled
        w.report(seq, loss)
    stopped = not ep.wait_slot_free()  # the last update's turn
    split.charge("wait")
    return stopped, version


class PullClock:
    """When an overlapped worker pulls θ for the step after next: as late as it can while
    the pull still ends before the step in hand does, so that θ holds the worker's own
    update just committed and the others' of nearly a whole step more. It learns the
    compute's and the pull's seconds as it goes (a moving mean); until it has both, it pulls
    at once. ``slack``: the share of a step kept in hand against a step that ends early."""

    def __init__(self, slack: float = 0.2, weight: float = 0.2) -> None:
        self.slack, self.weight = slack, weight
        self.compute_s = self.pull_s = 0.0
        self.started = time.perf_counter()

    def _mean(self, old: float, new: float) -> float:
        return new if old == 0.0 else old + self.weight * (new - old)

    def step_started(self) -> None:
        self.started = time.perf_counter()

    def computed(self, seconds: float) -> None:
        self.compute_s = self._mean(self.compute_s, seconds)

    def pulled(self, seconds: float) -> None:
        self.pull_s = self._mean(self.pull_s, seconds)

    def due(self) -> float | None:
        """When the pull should start (``time.perf_counter``'s clock): the step's expected
        end less the slack and twice the pull's seconds; None until both were measured."""
        if self.compute_s == 0.0 or self.pull_s == 0.0:
            return None
        return self.started + (1.0 - self.slack) * self.compute_s - 2.0 * self.pull_s

    def wait(self) -> None:
        """Sleep until :meth:`due` (at once while it is unknown)."""
        due = self.due()
        ahead = 0.0 if due is None else due - time.perf_counter()
        if ahead > 0:
            time.sleep(ahead)


def overlap_order(w: WorkerStep, start_seq: int, version: Versions) -> tuple[bool, Versions]:
    """--worker-mode overlap: a compute thread computes step k+1 while this thread, the one
    that started MPI (FUNNELED), commits step k and pulls θ for step k+2, so that a step costs
    the longer of the two, not their sum. The pull waits until step k+1 is about to end
    (:class:`PullClock`) and until update k was applied (its slot free): θ for step k+2 then
    holds the worker's own update k and the others' of the step, and only update k+1 is in
    flight, as pipelined. θ takes turns among three buffers: the one being computed at, the
    one step k was computed at (s of its update, intact until its commit) and the one pulled
    into. m folds Δθ right before the commit: a stop leaves m one fold ahead at most. The
    split is this thread's: compute is its wait for the compute thread, the pull's sleep is
    wait."""
    ep, split, steps = w.ep, w.split, w.steps_fn.steps
    if start_seq >= steps:
        return False, version
    pinned = w.steps_fn.pull_buffers
    thetas = [ep.theta, *(pinned[k] if k < len(pinned) else np.empty_like(ep.theta)
                          for k in (1, 2))]
    versions = [version] * 3
    points = GradientPoints(w.cfg.optim.gradient_at, ep.theta, start_seq, pinned[3:],
                            w.steps_fn.threads)
    clock = PullClock()
    with ThreadPoolExecutor(1, thread_name_prefix="gem-compute",
                            initializer=w.steps_fn.compute_thread) as pool, \
            w.steps_fn.comm_stream():
        running: Future = pool.submit(w.step, start_seq, thetas[0])
        try:
            if start_seq + 1 < steps:
                versions[1] = ep.pull(thetas[1])
                split.charge("pull")
            for seq in range(start_seq, steps):
                turn = (seq - start_seq) % 3
                if w.leave_now(seq):  # step seq, computed or not, is abandoned
                    return False, versions[turn]
                done = running.result()
                split.charge("compute")
                clock.computed(done.compute_s)
                if points.on:  # the next step's point holds this Δθ, still q·v here
                    points.done(seq, *w.steps_fn.pending(seq, done.delta))
                if seq + 1 < steps:
                    nxt = (turn + 1) % 3
                    running = pool.submit(w.step, seq + 1,
                                          points.at(seq + 1, thetas[nxt]))
                    clock.step_started()
                if not ep.wait_slot_free():  # freed before the pull but near the end
                    return True, versions[turn]
                split.charge("wait")
                delta = w.steps_fn.settle(seq, done.delta)  # off the compute's path
                parts = w.payload(delta, thetas[turn], done.on_device)
                ep.commit(UPDATE, seq, versions[turn], done.loss, done.compute_s, parts,
                          w.steps_of(seq))
                split.charge("commit")
                w.report(seq, done.loss)
                if seq + 2 < steps:  # θ for step seq + 2, with update seq in it
                    clock.wait()
                    t = time.perf_counter()
                    if not ep.wait_slot_free():
                        return True, versions[turn]
                    split.charge("wait")
                    after = (turn + 2) % 3
                    versions[after] = ep.pull(thetas[after])
                    split.charge("pull")
                    clock.pulled(time.perf_counter() - t)
        finally:  # a stop or an error: the step in hand ends before the pool does
            running.cancel()
    stopped = not ep.wait_slot_free()  # the last update's turn
    split.charge("wait")
    return stopped, versions[turn]


Order = Callable[[WorkerStep, int, Versions], tuple[bool, Versions]]
ORDERS: dict[str, Order] = {PIPELINED: pipelined_order, OVERLAP: overlap_order}
