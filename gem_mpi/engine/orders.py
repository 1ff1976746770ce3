"""The worker's three orders (``--worker-mode``), each a loop over its steps from
``start_seq``: ``wait`` commits, waits for the update's application, pulls; ``pipelined``
(Algorithm 1's order) computes the next Δθ while the master applies the last; ``overlap``
computes step k+1 on a thread of its own while this one commits step k and pulls θ for step
k+2. Each returns (stopped by the master, the versions of the θ last pulled)."""

from __future__ import annotations

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
    points = GradientPoints(w.cfg.optim.gradient_at, ep.theta, start_seq, 1,
                            w.steps_fn.pull_buffers[1:2])
    for seq in range(start_seq, w.steps_fn.steps):
        if w.leave_now(seq):  # its last update may be in flight: LEFT waits for its slot
            return False, version
        delta, loss, compute_s = w.compute(seq, points.at(seq, 0, ep.theta))
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


def overlap_order(w: WorkerStep, start_seq: int, version: Versions) -> tuple[bool, Versions]:
    """--worker-mode overlap: a compute thread computes step k+1 at θ_{k+1} while this
    thread, the one that started MPI (FUNNELED), waits for the slot, pulls θ_{k+2}, folds m
    and commits step k, so that a step costs the longer of the two, not their sum. θ takes
    turns among three buffers: the one being computed at, the one step k was computed at (s
    of its update, intact until its commit) and the one pulled into. The pull comes after
    the slot is free and before the commit, so it never meets the master's write of the
    update just committed (a torn read, read again), and θ_{k+2} holds update k-1. m folds
    Δθ only once the slot is free, right before the commit, as in pipelined: a stop leaves m
    one fold ahead at most. The split is this thread's: compute is its wait for the compute
    thread."""
    ep, split, steps = w.ep, w.split, w.steps_fn.steps
    if start_seq >= steps:
        return False, version
    pinned = w.steps_fn.pull_buffers
    thetas = [ep.theta, *(pinned[k] if k < len(pinned) else np.empty_like(ep.theta)
                          for k in (1, 2))]
    versions = [version] * 3
    points = GradientPoints(w.cfg.optim.gradient_at, ep.theta, start_seq, 2, pinned[3:6])
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
                delta = None
                if points.on:  # the next step's point holds this Δθ
                    delta = w.steps_fn.settle(seq, done.delta)
                    points.done(seq, delta)
                if seq + 1 < steps:
                    nxt = (turn + 1) % 3
                    running = pool.submit(w.step, seq + 1,
                                          points.at(seq + 1, nxt, thetas[nxt]))
                if not ep.wait_slot_free():
                    return True, versions[turn]
                split.charge("wait")
                if seq + 2 < steps:
                    after = (turn + 2) % 3
                    versions[after] = ep.pull(thetas[after])
                    points.prepare(seq + 2, after, thetas[after])
                    split.charge("pull")
                if delta is None:
                    delta = w.steps_fn.settle(seq, done.delta)
                parts = w.payload(delta, thetas[turn], done.on_device)
                ep.commit(UPDATE, seq, versions[turn], done.loss, done.compute_s, parts,
                          w.steps_of(seq))
                split.charge("commit")
                w.report(seq, done.loss)
        finally:  # a stop or an error: the step in hand ends before the pool does
            running.cancel()
    stopped = not ep.wait_slot_free()  # the last update's turn
    split.charge("wait")
    return stopped, versions[turn]


Order = Callable[[WorkerStep, int, Versions], tuple[bool, Versions]]
ORDERS: dict[str, Order] = {PIPELINED: pipelined_order, OVERLAP: overlap_order}
