"""Where a worker takes its gradient (``--gradient-at``). A pipelined or overlapped worker
computes step k at a θ pulled before its update k−1 was applied (pipelined: before it was
committed; overlapped: after update k−2 was applied, see
:func:`gem_mpi.engine.orders.overlap_order`): that own update is in flight, not in θ.
``own`` (the default) takes the gradient at θ + Δθ_{k−1}, the worker's own update in
flight, unscaled, as the authors' prototype adds its own update to its copy; ``pulled`` at
the θ pulled (Algorithm 1 as printed). A waiting worker has nothing in flight: both are the θ
pulled. GEM's shift is measured from the θ pulled in either case (the payload's s).

The point is a function of what the run's log holds (the versions pulled, the worker's own
Δθ), so :func:`gem_mpi.algorithm.reference.replay` recomputes it. The add is on the
compute's path: one pass of θ's size between two steps."""

from __future__ import annotations

import numpy as np

from gem_mpi.config import AT_PULLED


class GradientPoints:
    """The gradient point of an order's steps, in a buffer of its own: the θ pulled stays s."""

    def __init__(self, how: str, like: np.ndarray, start: int,
                 buffers: list[np.ndarray] | None = None) -> None:
        """``start``: the order's first step (nothing is in flight at its pull);
        ``buffers``: the worker's own for the point (page-locked on a GPU)."""
        self.on, self.start = how != AT_PULLED, start
        self.point = None if not self.on else (
            buffers[0] if buffers else np.empty_like(like))
        self.last: np.ndarray | None = None  # the worker's Δθ of its step in flight

    def done(self, seq: int, delta: np.ndarray) -> None:
        """Step ``seq``'s Δθ on the host, kept for step seq + 1's point (the array must
        hold it until that step has started: the worker's turns do)."""
        if self.on:
            self.last = delta

    def at(self, seq: int, pulled: np.ndarray) -> np.ndarray:
        """Where step ``seq`` takes its gradient, once step seq − 1's Δθ is :meth:`done`."""
        if self.point is None or seq == self.start:
            return pulled
        assert self.last is not None, "step seq − 1's Δθ, done before"
        return np.add(pulled, self.last, out=self.point)
