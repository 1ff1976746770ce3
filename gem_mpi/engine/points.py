"""Where a worker takes its gradient (``--gradient-at``). A pipelined worker computes step k at
a θ pulled before its update k−1 was committed, an overlapped one at a θ pulled before its
updates k−2 and k−1 were: those own updates are in flight, not in θ. ``own`` (the default)
takes the gradient at θ + Δθ_{k−2} + Δθ_{k−1}, the worker's own updates in flight, unscaled,
oldest first, as the authors' prototype adds its own update to its copy; ``pulled`` at the θ
pulled (Algorithm 1 as printed). A waiting worker has nothing in flight: both are the θ pulled.
GEM's shift is measured from the θ pulled in either case (the payload's s).

The point is a function of what the run's log holds (the versions pulled, the worker's own
Δθ), so :func:`gem_mpi.algorithm.reference.replay` recomputes it. Overlapped, the older update
is added on the thread that calls MPI right after the pull, beside the compute; the newer one
just before the step starts (one add of θ's size on the compute's path)."""

from __future__ import annotations

import numpy as np

from gem_mpi.config import AT_PULLED


class GradientPoints:
    """The gradient points of an order's θ turns, in buffers of their own: the θ pulled stays s.
    ``in_flight``: an order's own updates in flight at a pull once under way (pipelined 1,
    overlap 2)."""

    def __init__(self, how: str, like: np.ndarray, start: int, in_flight: int,
                 buffers: list[np.ndarray] | None = None) -> None:
        """``start``: the order's first step (nothing is in flight at its pull);
        ``buffers``: the worker's own for the points, one per θ turn (page-locked on a GPU)."""
        self.on, self.start, self.most = how != AT_PULLED, start, in_flight
        turns = 3 if in_flight > 1 else 1
        self.points = [] if not self.on else (
            list(buffers[:turns]) if buffers else [np.empty_like(like) for _ in range(turns)])
        self.recent: dict[int, np.ndarray] = {}  # the worker's Δθ of its steps in flight

    def in_flight(self, seq: int) -> int:
        """Step ``seq``'s own updates not in the θ pulled for it."""
        return min(self.most, seq - self.start)

    def done(self, seq: int, delta: np.ndarray) -> None:
        """Step ``seq``'s Δθ on the host, kept while a later step's point needs it (the array
        must hold it until that step's own Δθ is made: the worker's turns do)."""
        if self.on:
            self.recent[seq] = delta
            self.recent.pop(seq - self.most, None)

    def prepare(self, seq: int, turn: int, pulled: np.ndarray) -> None:
        """Right after θ for step ``seq`` was pulled into turn ``turn``: its point as far as
        known (the older of two updates in flight; :meth:`at` adds the newer)."""
        if self.on and self.in_flight(seq) == 2:
            np.add(pulled, self.recent[seq - 2], out=self.points[turn])

    def at(self, seq: int, turn: int, pulled: np.ndarray) -> np.ndarray:
        """Where step ``seq`` takes its gradient, once step seq − 1's Δθ is :meth:`done`."""
        c = self.in_flight(seq)
        if not self.on or c == 0:
            return pulled
        out = self.points[turn]
        np.add(out if c == 2 else pulled, self.recent[seq - 1], out=out)
        return out
