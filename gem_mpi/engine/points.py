"""Where a worker takes its gradient (``--gradient-at``). A pipelined or overlapped worker
computes step k at a θ pulled before its update k−1 was applied (pipelined: before it was
committed; overlapped: after update k−2 was applied, see
:func:`gem_mpi.engine.orders.overlap_order`): that own update is in flight, not in θ.
``own`` (the default) takes the gradient at θ + Δθ_{k−1}, the worker's own update in
flight, unscaled, as the authors' prototype adds its own update to its copy; ``pulled`` at
the θ pulled (Algorithm 1 as printed). A waiting worker has nothing in flight: both are the θ
pulled. GEM's shift is measured from the θ pulled in either case (the payload's s).

The point is a function of what the run's log holds (the versions pulled, the worker's own
Δθ), so :func:`gem_mpi.algorithm.reference.replay` recomputes it. It is on the compute's
path, between two steps: one fused pass θ + q·v (:func:`gem_mpi.algorithm.kernel.axpy`)
from Δθ = q·v as the step left it, so that an overlapped CPU worker, whose −η·g is made by
the sending thread, need not make Δθ first (the bits are those of θ + Δθ either way)."""

from __future__ import annotations

import numpy as np

from gem_mpi.algorithm.kernel import axpy
from gem_mpi.config import AT_PULLED


class GradientPoints:
    """The gradient point of an order's steps, in a buffer of its own: the θ pulled stays s."""

    def __init__(self, how: str, like: np.ndarray, start: int,
                 buffers: list[np.ndarray] | None = None, threads: int = 1) -> None:
        """``start``: the order's first step (nothing is in flight at its pull);
        ``buffers``: the worker's own for the point (page-locked on a GPU); ``threads``:
        the worker's, for the add (its compute is idle meanwhile)."""
        self.on, self.start, self.threads = how != AT_PULLED, start, threads
        self.point = None if not self.on else (
            buffers[0] if buffers else np.empty_like(like))
        self.last: tuple[np.ndarray, float] | None = None  # Δθ = q·v of the step in flight

    def done(self, seq: int, v: np.ndarray, q: float = 1.0) -> None:
        """Step ``seq``'s Δθ = q·v on the host (:meth:`gem_mpi.engine.steps.Steps.pending`),
        kept for step seq + 1's point: v must hold until that point is made."""
        if self.on:
            self.last = (v, q)

    def at(self, seq: int, pulled: np.ndarray) -> np.ndarray:
        """Where step ``seq`` takes its gradient, once step seq − 1's Δθ is :meth:`done`."""
        if self.point is None or seq == self.start:
            return pulled
        assert self.last is not None, "step seq − 1's Δθ, done before"
        v, q = self.last
        return axpy(self.point, pulled, q, v, self.threads)
