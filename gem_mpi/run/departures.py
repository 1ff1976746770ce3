"""The run's elastic state, with one owner on rank 0 (as Horovod's ``State`` owns what a
restart needs): the workers' plans once a resume or a departure dealt them anew, and the
departures so far. It is a part of every checkpoint, and what the master calls when a worker
leaves or is dealt more batches; the other masters of a sharded run have none (the lead
deals)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from gem_mpi.config import Config, worker_ranks
from gem_mpi.run.monitor import Watchdog, say

Row = dict[str, Any]


class Departures:
    """Rank 0's record of who left and where every worker's batches are now.

    ``record(row, left)`` writes a row of the metrics file's ``departures`` (the run's
    writer, which keeps a failed write for the next check), ``save_soon()`` asks for a
    checkpoint at the next check (a job whose worker left may be killed soon after), and
    ``elapsed()`` gives the run's seconds."""

    def __init__(self, cfg: Config, n_workers: int, data_plan: np.ndarray | None,
                 watchdog: Watchdog, record: Callable[[Row, int], None],
                 save_soon: Callable[[], None], elapsed: Callable[[], float]) -> None:
        self.cfg, self.n_workers = cfg, n_workers
        self.data_plan = data_plan  # None until the plans changed: each worker its own
        self.count = 0  # workers that left this run
        self._watchdog, self._record = watchdog, record
        self._save_soon, self._elapsed = save_soon, elapsed

    def state(self) -> dict[str, Any]:
        """Its part of a checkpoint: the plans, so that any later resume continues them."""
        return {"data_plan": self.data_plan}

    def expect(self, worker: int) -> None:
        """Worker ``worker`` was dealt more batches: it is not finished after all."""
        self._watchdog.expect(worker)

    def departed(self, worker: int, seq: int, clock: int, rest: int,
                 data_plan: np.ndarray, lost: bool = False) -> None:
        """Worker ``worker`` left after ``seq`` updates (``lost``: its process died), at θ's
        version ``clock``, with ``rest`` batches of its plan not done; the plans are
        ``data_plan`` now. One line, a row and a new segment, a checkpoint soon."""
        self.data_plan = data_plan
        self.count += 1
        left = self.n_workers - self.count
        self._record({"worker": worker, "updates": seq, "clock": clock, "not_done": rest,
                      "time": self._elapsed()}, left)
        self._save_soon()
        where = (f"{rest} of its batches go to the workers that finish theirs"
                 if rest else "its batches were all done")
        how = ("was lost (its process died; an update it was sending is not applied)"
               if lost else "left")
        say(f"worker {worker} ({worker_ranks(self.cfg, worker)}) {how} at update {clock} "
            f"after {seq} of its own: {where}; {left} of {self.n_workers} workers train on")

    def replan(self, data_plan: np.ndarray, given: list[tuple[int, int]]) -> None:
        """Batches were dealt ((worker, batches) each); the plans are ``data_plan`` now."""
        self.data_plan = data_plan
        if self.cfg.monitor.verbose:
            say("dealt " + ", ".join(f"{b} batches to worker {w}" for w, b in given))
