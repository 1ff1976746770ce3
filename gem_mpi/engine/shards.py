"""θ sharded over K master ranks (``--masters K``): the cut, and how the masters agree.

Ranks 0..K−1 are masters; master k holds θ's tensors ``plan.tensors[k]`` (elements
``plan.bounds[k]``, a tensor is never split: :func:`gem_mpi.protocol.shard_cut`) in windows
of its own, on its shard's communicator (:func:`gem_mpi.transport.endpoints.shard_comm`), so
each shard has its own clock, tickets, mailboxes, versioned θ and roll, exactly those of a
one-master run over its part of θ. GEM, DOWNPOUR and adaptive staleness are element-wise,
so each shard applies its part of every update by itself and the cut changes no bit of θ;
the only quantity that is not element-wise is adaptive staleness's τ, which each shard
takes from its own clock (the updates *it* applied between the worker's pull of its part
and this update).

Rank 0 (the lead) runs the run: the metrics file, evaluation, checkpoints and every
decision (stop, divergence, output failure, a stuck worker, how the run ended). The other
masters (followers) only apply, and talk to the lead over a private duplicate of the world
communicator, in pickled messages that are never on the data path:

    follower -> lead   rows (its metrics rows, every batch or two), at (its next_seq),
                       state (its part of a checkpoint), piece (its θ), final (its part at
                       the end), diverged (its θ is not finite)
    lead -> follower   hold, cut (to a target next_seq), go, theta, end (the stop word)

A consistent checkpoint (every shard has applied exactly the same updates) is one cut:
the lead holds every shard (hold: a shard stops taking messages and says where it is),
takes the target as the furthest next update of each worker over the shards, lets every
shard apply, from what is already in its mailboxes, only the updates below the target
(cut), and gathers each shard's part (state). It is reachable without any worker's help
because a worker posts an update to every shard back to back once all its slots are free:
no shard is ever more than one update of a worker behind another, and that update is
already posted (or on its way) to the shard behind.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from gem_mpi.config import Config
from gem_mpi.problem import Problem
from gem_mpi.protocol import Layout, layout, shard_cut
from gem_mpi.run.supervisor import OUTCOME_OF, Outcome, Verdict
from gem_mpi.transport import MPI
from gem_mpi.transport.endpoints import shard_comm

LEAD = 0
TAG = 7


@dataclass(frozen=True)
class Plan:
    """The cut every rank computes alike: per shard its tensors, elements and Layout."""

    masters: int
    n_workers: int
    tensors: list[tuple[int, int]]  # per shard: tensor indices [lo, hi)
    bounds: list[tuple[int, int]]  # per shard: θ's elements [lo, hi)
    layouts: list[Layout]

    @property
    def n_params(self) -> int:
        return self.bounds[-1][1]

    def poison_all(self, parts: tuple[np.ndarray, ...]) -> None:
        """An update with NaN or Inf in any part of any shard's slice is made non-finite in
        every shard's Δθ, so that every shard's kernel rejects it alike (each checks only
        its slice). Two passes (min, max) without allocating; NaN propagates through both."""
        for p in parts:
            lo, hi = float(p.min()), float(p.max())
            if not (np.isfinite(lo) and np.isfinite(hi)):
                delta = parts[0]
                for a, _ in self.bounds:
                    delta[a] = np.nan
                return


def plan(cfg: Config, problem: Problem, n_workers: int) -> Plan:
    """The cut of ``problem``'s θ over --masters shards (ValueError: too few tensors)."""
    masters = cfg.runtime.masters
    tensors = shard_cut(problem.sizes, masters)
    offsets = problem.offsets
    bounds = [(int(offsets[a]), int(offsets[b])) for a, b in tensors]
    layouts = [layout(cfg.optim, hi - lo, n_workers) for lo, hi in bounds]
    return Plan(masters, n_workers, tensors, bounds, layouts)


def connect(comm: MPI.Intracomm, plan: Plan) -> tuple[list[MPI.Intracomm], Link | None]:
    """Collective over ``comm``, in this order on every rank: each shard's communicator
    (COMM_NULL on the masters of the other shards) and the masters' link; with one master,
    ([comm], None)."""
    if plan.masters == 1:
        return [comm], None
    comms = [shard_comm(comm, plan.masters, k) for k in range(plan.masters)]
    return comms, Link(comm)


class Link:
    """Pickled messages between the lead and the followers, on a private communicator
    (collective to make: every rank, in the same order). Sends are non-blocking (their
    requests are kept until completed); receives are polled."""

    def __init__(self, comm: MPI.Intracomm) -> None:
        self.comm = comm.Dup()
        self._sent: list[tuple[MPI.Request, bytes]] = []

    def send(self, dest: int, msg: tuple) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        self._sent = [(r, d) for r, d in self._sent if not r.Test()]
        # the buffer is kept with its request until the send completes
        self._sent.append((self.comm.Isend([data, MPI.BYTE], dest, TAG), data))

    def poll(self, source: int = MPI.ANY_SOURCE) -> tuple[int, tuple] | None:
        """(source, message) of one pending message, or None."""
        status = MPI.Status()
        if not self.comm.Iprobe(source, TAG, status):
            return None
        buf = bytearray(status.Get_count(MPI.BYTE))
        self.comm.Recv([buf, MPI.BYTE], status.Get_source(), TAG)
        return status.Get_source(), pickle.loads(buf)

    def flush(self) -> None:
        """Wait (asleep) until every send has been received."""
        while self._sent:
            self._sent = [(r, d) for r, d in self._sent if not r.Test()]
            if self._sent:
                time.sleep(100e-6)

    def free(self) -> None:
        self.flush()
        self.comm.Free()


class Follower:
    """A follower master's supervisor: what :class:`gem_mpi.engine.master.Master` calls on
    its supervisor, answered for a shard that decides nothing. Its rows go to the lead (which
    writes them into the metrics file's ``shard<k>`` table), its θ is watched for values
    that are not finite (the lead then ends the run as diverged), and between batches it
    answers the lead: hold, cut, go, theta, end. ``run`` returns the lead's stop word."""

    ROWS_EVERY_S = 0.25

    def __init__(self, engine: object, link: Link, shard: int, exit_timeout: float) -> None:
        self.engine, self.link, self.shard = engine, link, shard
        self.exit_timeout = exit_timeout
        self.recording = True
        self.recent_loss = float("nan")
        self.summary: dict = {}
        self.word: int | None = None  # the lead's stop word, once it said it
        self.held = False
        self._rows: list[tuple[str, dict]] = []
        self._sent_at = time.monotonic()
        self._reported = False  # θ found not finite, and said
        self.t0 = time.perf_counter()

    # --- what the engine calls --------------------------------------------------------------
    def heard(self, worker: int, finished: bool = False) -> None:
        """The lead's watchdog watches the workers (every worker posts to every shard)."""

    def record_update(self, row: dict) -> None:
        self._rows.append(("update", row))

    def record_rejected(self, row: dict) -> None:
        self._rows.append(("rejected", row))

    def observe(self, loss: float, position: int, theta: np.ndarray) -> None:
        """The lead watches the loss; each shard watches its own θ (every 100 updates)."""
        if position % 100 == 0 and not self._reported:
            with np.errstate(over="ignore", invalid="ignore"):
                norm = float(np.dot(theta, theta))
            if not np.isfinite(norm):
                self._reported = True
                why = f"θ of shard {self.shard} holds values that are not finite"
                self.link.send(LEAD, ("diverged", why))

    def eval_due(self, position: int) -> bool:
        return False

    def evaluate(self, theta: np.ndarray, done: int) -> None:
        """Only the lead evaluates (θ gathered from every shard)."""

    def show(self, status: Callable[[], str]) -> None:
        """Only the lead shows progress."""

    def since_start(self, t: float) -> float:
        return t - self.t0

    # --- talking to the lead ----------------------------------------------------------------
    def _send_rows(self, now: bool = False) -> None:
        if self._rows and (now or time.monotonic() - self._sent_at > self.ROWS_EVERY_S):
            self.link.send(LEAD, ("rows", self._rows))
            self._rows = []
            self._sent_at = time.monotonic()

    def _handle(self, msg: tuple) -> None:
        kind = msg[0]
        engine = self.engine
        if kind == "hold":
            self.held = True
            self._send_rows(now=True)
            self.link.send(LEAD, ("at", engine.next_seq.copy()))
        elif kind == "cut":
            reached = engine.catch_up(msg[1], self.exit_timeout)
            self._send_rows(now=True)  # the rows up to the cut come before its state
            self.link.send(LEAD, ("state", engine.shard_state() if reached else None))
        elif kind == "go":
            self.held = False
        elif kind == "theta":
            self.link.send(LEAD, ("piece", engine.ep.theta.copy()))
        elif kind == "end":
            self.word = msg[1]

    def between_batches(self) -> object:
        """None: go on; else the run has ended (the lead said its stop word)."""
        self._send_rows()
        backoff = self.engine.ep.idle_backoff()
        while self.word is None:
            got = self.link.poll(LEAD)
            if got is not None:
                self._handle(got[1])
                continue
            if not self.held:
                return None
            backoff.wait()  # held: the mailboxes wait, MPI progresses
        return Verdict(OUTCOME_OF.get(self.word, Outcome.FAILED), "the lead's word")

    def run(self) -> int:
        """The shard's loop; at its end (every worker done) its final part goes to the lead,
        then it answers the lead until the lead's stop word, which it returns."""
        self.engine.loop()
        if self.word is None:
            self._send_rows(now=True)
            self.link.send(LEAD, ("final", {**self.engine.shard_state(),
                                            **self.engine.summary()}))
            backoff = self.engine.ep.idle_backoff(first=50e-6, limit=5e-3)
            while self.word is None:
                got = self.link.poll(LEAD)
                if got is not None:
                    self._handle(got[1])
                else:
                    backoff.wait()
        self._send_rows(now=True)
        return self.word


class Lead:
    """Rank 0's side of the followers: their rows into the metrics file, their divergence
    into the run's verdict, and the collective moves (the cut of a checkpoint, θ gathered for
    an evaluation, the end)."""

    def __init__(self, link: Link, masters: int, sup: object, progress: object) -> None:
        self.link, self.masters, self.sup = link, masters, sup
        self.followers = list(range(1, masters))
        self.progress = progress
        self.replies: dict[str, dict[int, object]] = {}
        self.finals: dict[int, dict] = {}

    def drain(self) -> None:
        """Take every message the followers sent: rows, divergence, replies."""
        while True:
            got = self.link.poll()
            if got is None:
                return
            source, msg = got
            kind = msg[0]
            if kind == "rows":
                for table, row in msg[1]:
                    if table == "update":
                        self.sup.record_shard_update(source, row)
            elif kind == "diverged":
                if self.sup.losses.diverged is None:
                    self.sup.losses.diverged = msg[1]
            elif kind == "final":
                self.finals[source] = msg[1]
            else:
                self.replies.setdefault(kind, {})[source] = msg[1]

    def send_all(self, msg: tuple) -> None:
        for k in self.followers:
            self.link.send(k, msg)

    def collect(self, kind: str) -> list[object]:
        """One reply of ``kind`` from each follower, in shard order; waits asleep, making MPI
        progress for the workers' operations on rank 0 meanwhile."""
        backoff_s = 20e-6
        while True:
            self.drain()
            got = self.replies.get(kind, {})
            if all(k in got for k in self.followers):
                return [got.pop(k) for k in self.followers]
            self.progress()
            time.sleep(backoff_s)
            backoff_s = min(2 * backoff_s, 1e-3)

    def wait_finals(self) -> None:
        backoff_s = 50e-6
        while len(self.finals) < len(self.followers):
            self.drain()
            if len(self.finals) < len(self.followers):
                self.progress()
                time.sleep(backoff_s)
                backoff_s = min(2 * backoff_s, 2e-3)


__all__ = ["LEAD", "Follower", "Lead", "Link", "Plan", "connect", "plan"]
