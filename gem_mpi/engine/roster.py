"""Which workers still train, as a master sees them sign off, and, on rank 0, where a
departed worker's batches go (a worker may leave a live run).

A worker signs off with DONE once its plan (:mod:`gem_mpi.problem.elastic`) is trained, or
with LEFT when it got SIGTERM; either message's ``seq`` counts its updates, every one
applied (it waits for its slot before it signs off). A worker that left never trains again;
one that is done waits for the master's word or an order. Its plan's batches it had not
done when it left (its *rest*) are dealt, a share at a time, to the workers that finish
theirs: so a departure neither shortens nor lengthens the run, which trains every batch of
its budget once. The run is over when every worker is done or has left and no rest is
left to deal; if every worker left before that, the run stops with a checkpoint and a
resume trains the rest (on whatever number of workers it gets).

The plans are the run's state as much as θ: every batch is in exactly one worker's plan (a
departed worker's holds its past and its rest not yet dealt), so a checkpoint records them
(``data_plan``) and a resume, on as many workers or on any other number, continues them.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from gem_mpi.problem import elastic
from gem_mpi.problem.elastic import Plan


class Roster:
    """Each worker's sign-off as one master sees it (the followers of a sharded run learn
    the deals from the lead's :class:`~gem_mpi.protocol.Deal`). Order-free: a DONE counts
    once its ``seq`` reaches the worker's plan as last dealt, whichever came first."""

    def __init__(self, n_workers: int) -> None:
        self.left = np.zeros(n_workers, bool)
        self.signed = np.full(n_workers, -1, np.int64)  # the seq of its last DONE
        self.length = np.zeros(n_workers, np.int64)  # its plan's length, once dealt more
        self.deals = 0  # the Deal messages taken (a follower's Final says how many)
        # how many are done or gone: counted at each sign-off or deal, read on every pass
        # of the master's loop (a count of numpy masks there cost a few per cent of upd/s)
        self._finished = 0

    def done(self, worker: int, seq: int) -> None:
        self.signed[worker - 1] = max(self.signed[worker - 1], seq)
        self._count()

    def leave(self, worker: int) -> None:
        self.left[worker - 1] = True
        self._count()

    def dealt(self, worker: int, length: int) -> None:
        self.length[worker - 1] = max(self.length[worker - 1], length)
        self.deals += 1
        self._count()

    def _count(self) -> None:
        self._finished = int(np.count_nonzero(self.left | self.idle()))

    def idle(self) -> np.ndarray:
        """The workers (as a mask) that trained their plan and wait for a word or an order."""
        return ~self.left & (self.signed >= 0) & (self.signed >= self.length)

    def finished(self) -> int:
        """How many workers are done or have left."""
        return self._finished

    def all_finished(self) -> bool:
        return self.finished() == self.left.size


class Dealer:
    """Rank 0's side of departures: each worker's plan once one left, the rests, and the
    orders that deal them. ``plans``: the run's plans (called at the first departure);
    ``give(worker, runs, length)``: tells the followers, then orders the worker."""

    def __init__(self, roster: Roster, plans: Callable[[], list[Plan]],
                 give: Callable[[int, Plan, int], None], max_runs: int) -> None:
        self.roster, self._first_plans, self.give = roster, plans, give
        self.max_runs = max_runs
        self.plans: list[Plan] | None = None  # None until a worker leaves
        self.stopped_at: dict[int, int] = {}  # a departed worker's updates

    @property
    def n_workers(self) -> int:
        return self.roster.left.size

    def rests(self) -> dict[int, Plan]:
        """Each departed worker's batches not done nor dealt yet."""
        if self.plans is None:
            return {}
        return {w: elastic.cut(self.plans[w - 1], at) for w, at in self.stopped_at.items()}

    def rest(self) -> int:
        """Batches of departed workers not dealt yet."""
        return sum(elastic.length(p) for p in self.rests().values())

    def done(self, worker: int, seq: int) -> None:
        """Worker ``worker`` trained its plan (``seq`` batches)."""
        if self.plans is not None and seq != elastic.length(self.plans[worker - 1]):
            raise RuntimeError(f"worker {worker} signed off done after {seq} updates; its plan "
                               f"holds {elastic.length(self.plans[worker - 1])} batches")
        self.roster.done(worker, seq)

    def leave(self, worker: int, seq: int) -> int:
        """Worker ``worker`` left after ``seq`` updates; returns its batches not done (the
        rest of an order it had not begun included)."""
        if self.plans is None:
            self.plans = [list(p) for p in self._first_plans()]
        self.roster.leave(worker)
        self.stopped_at[worker] = seq
        return elastic.length(elastic.cut(self.plans[worker - 1], seq))

    def deal(self) -> list[tuple[int, int]]:
        """Deal the rests to the workers waiting idle: each a share of what is left, the
        batches over the workers still training and those waiting (the ones training take
        theirs when they finish). Returns (worker, batches) of each order given."""
        rests = self.rests()
        pool = sum(elastic.length(p) for p in rests.values())
        idle = [int(w) + 1 for w in np.flatnonzero(self.roster.idle())]
        if not pool or not idle:
            return []
        training = int(np.count_nonzero(~self.roster.left)) - len(idle)
        share = -(-pool // (training + len(idle)))
        given = []
        for w in idle:
            runs, rests = elastic.take(rests, share, self.max_runs)
            if not runs:
                break
            self._move(w, runs, rests)
            given.append((w, elastic.length(runs)))
        return given

    def _move(self, worker: int, runs: Plan, rests: dict[int, Plan]) -> None:
        """``runs`` leave the departed workers' plans (what is ``rests`` now) for
        ``worker``'s, which is told (the followers first, then the worker)."""
        plans = self.plans
        assert plans is not None, "rests are dealt only once a worker left"
        for w, rest in rests.items():
            plans[w - 1] = elastic.cut(plans[w - 1], 0, self.stopped_at[w]) + rest
        plans[worker - 1] = plans[worker - 1] + runs
        length = elastic.length(plans[worker - 1])
        self.roster.dealt(worker, length)
        self.give(worker, runs, length)

    def over(self) -> bool:
        """Every worker done or gone, and nothing left to deal."""
        return self.roster.all_finished() and not self.rest()

    def data_plan(self) -> np.ndarray:
        """The plans for a checkpoint, asked once a worker left (before, each worker has its
        own and the departures record none)."""
        assert self.plans is not None, "the plans are made at the first departure"
        return elastic.to_array(self.plans)
