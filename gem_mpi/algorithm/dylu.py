"""Dynamic local updates (``--dylu``; Liu et al. 2024, arXiv 2401.09135): with ``--local-steps
H`` worker w takes

    H_w = clamp(round(H · t_fast / t_w), 1, H)

local steps an update, t_w its own seconds per local step and t_fast the fastest worker's, so
that a worker k times slower commits about as often as the fastest, with 1/k of its steps.

Who measures and who decides: each update's header carries its compute seconds (the
``--straggler``/``--speeds`` sleep included) and its steps; the master keeps each worker's
seconds per step (:class:`Paces`) and publishes the fastest with θ, in the header every pull
reads already (no message more); each worker keeps its own (:class:`Pace`, the same average
of the same numbers) and decides its H_w from the last θ it pulled (:func:`steps_for`). A
worker knows its own time at once and the master sees everyone's; neither waits for the
other. Before any measurement (a run's or a resume's first updates) a worker takes H.

The decision depends on wall-clock times, so it is not reproducible; the update's steps are,
once taken: the metrics log records each (``steps``), and the replay
(:func:`gem_mpi.algorithm.reference.replay`) takes them from there. Pure: no MPI, no clock.
"""

from __future__ import annotations

# the weight of a new measurement in the running average of seconds per local step: a worker
# whose speed changes is followed within a few updates, one slow step is half forgotten at once
WEIGHT = 0.5


class Pace:
    """One worker's seconds per local step, a running average over its updates (0: none yet)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def observe(self, compute_s: float, steps: int) -> None:
        """An update of ``steps`` local steps took ``compute_s`` seconds."""
        if steps < 1 or not compute_s > 0:  # a DONE, or a clock that did not move
            return
        per = compute_s / steps
        self.seconds = per if self.seconds == 0 else self.seconds + WEIGHT * (per - self.seconds)


class Paces:
    """The master's: every worker's :class:`Pace`, and the fastest, which it publishes."""

    def __init__(self, workers: int) -> None:
        self.paces = [Pace() for _ in range(workers)]

    def observe(self, worker: int, compute_s: float, steps: int) -> None:
        """Worker ``worker`` (1..n)'s update of ``steps`` steps took ``compute_s`` seconds."""
        if 1 <= worker <= len(self.paces):
            self.paces[worker - 1].observe(compute_s, steps)

    @property
    def fastest(self) -> float:
        """The fastest measured worker's seconds per local step (0: none measured yet)."""
        measured = [p.seconds for p in self.paces if p.seconds > 0]
        return min(measured) if measured else 0.0


def steps_for(h: int, own_s: float, fastest_s: float) -> int:
    """H_w of a worker taking ``own_s`` seconds per local step when the fastest takes
    ``fastest_s``: H for the fastest, in proportion below it, at least 1; H while either is
    unmeasured (0)."""
    if not (own_s > 0 and fastest_s > 0):
        return h
    return max(1, min(h, int(h * fastest_s / own_s + 0.5)))


class WorkerSteps:
    """A worker's side of --dylu: its own :class:`Pace` and the steps each of its updates
    took, from the decision to the commit that reports them (an overlapped worker decides
    update k + 1 on its compute thread while it commits update k)."""

    def __init__(self, h: int) -> None:
        self.h, self.pace = h, Pace()
        self.took: dict[int, int] = {}

    def decide(self, seq: int, fastest_s: float) -> int:
        """Update ``seq``'s steps, the fastest worker taking ``fastest_s`` seconds a step."""
        steps = self.took[seq] = steps_for(self.h, self.pace.seconds, fastest_s)
        return steps

    def measured(self, seq: int, compute_s: float) -> None:
        """Update ``seq`` took ``compute_s`` seconds (a straggler's sleep included)."""
        self.pace.observe(compute_s, self.took[seq])

    def committed(self, seq: int) -> int:
        """Update ``seq``'s steps, as its commit reports them (then forgotten)."""
        return self.took.pop(seq)
