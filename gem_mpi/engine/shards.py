"""θ sharded over K master ranks (``--masters K``): the cut, and how the masters agree.

Ranks 0..K−1 are masters; master k holds θ's tensors ``plan.tensors[k]`` (elements
``plan.bounds[k]``, a tensor is never split: :func:`shard_cut`) in windows
of its own, on its shard's communicator (:func:`gem_mpi.transport.endpoints.shard_comm`), so
each shard has its own clock, tickets, mailboxes, versioned θ and roll, exactly those of a
one-master run over its part of θ. GEM, DOWNPOUR and adaptive staleness are element-wise,
so each shard applies its part of every update by itself and the cut changes no bit of θ;
the only quantity that is not element-wise is adaptive staleness's τ, which each shard
takes from its own clock (the updates *it* applied between the worker's pull of its part
and this update).

Rank 0 (the lead) runs the run: the metrics file, evaluation, checkpoints and every
decision (stop, divergence, output failure, a stuck worker, how the run ended). The other
masters (followers) only apply, and talk to the lead over the masters' link
(:mod:`gem_mpi.transport.link`) in the typed messages of :mod:`gem_mpi.protocol`, never on
the data path:

    follower -> lead   Rows (its /shard<k> rows, every quarter second or so), At (its
                       next_seq), State (its part of a checkpoint), Piece (its θ), Final (its
                       part at the end), Diverged (its θ is not finite), Bye (after End)
    lead -> follower   Hold, Cut (to a target next_seq), Go, Gather (θ), End (the stop word)

A follower is its master's supervisor (:class:`Follower` satisfies
:class:`gem_mpi.run.supervisor.Supervisor`, as the run's supervisor on the lead does): the
engine calls the same methods whichever it has.

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

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from gem_mpi.config import Config
from gem_mpi.engine.roster import Roster
from gem_mpi.outputs.checkpoint import Checkpoint
from gem_mpi.problem import Problem
from gem_mpi.protocol import (
    At,
    Bye,
    Cut,
    Deal,
    Diverged,
    End,
    Final,
    Gather,
    Go,
    Hold,
    Layout,
    Piece,
    Rows,
    ShardState,
    State,
    layout,
)
from gem_mpi.run.supervisor import OUTCOME_OF, Outcome, Verdict
from gem_mpi.transport import MPI, Backoff
from gem_mpi.transport.endpoints import shard_comm
from gem_mpi.transport.link import Link, MessageLink

LEAD = 0
BF16_NAN = 0x7FC0  # a quiet NaN's bf16 bits


def shard_cut(sizes: list[int], masters: int) -> list[tuple[int, int]]:
    """θ cut over ``masters`` shards on tensor boundaries: per shard, the range [lo, hi) of
    tensor indices it holds (contiguous, in order, at least one tensor each). A tensor is
    never split, so each shard's per-tensor statistics are those of whole tensors. Of all
    such cuts, the one whose largest shard is smallest (the slowest master bounds the run);
    ValueError when there are fewer tensors than shards."""
    t_count = len(sizes)
    if masters > t_count:
        raise ValueError(f"--masters {masters}: θ is cut between tensors and this model has "
                         f"only {t_count}, so at most {t_count} masters")
    ends = [0, *np.cumsum(np.asarray(sizes, dtype=np.int64)).tolist()]
    # best[k][t]: the smallest largest shard of tensors [0, t) cut into k shards
    inf = float("inf")
    best = [[inf] * (t_count + 1) for _ in range(masters + 1)]
    back = [[0] * (t_count + 1) for _ in range(masters + 1)]
    best[0][0] = 0
    for k in range(1, masters + 1):
        for t in range(k, t_count + 1):
            for c in range(k - 1, t):
                cost = max(best[k - 1][c], ends[t] - ends[c])
                if cost < best[k][t]:
                    best[k][t], back[k][t] = cost, c
    cuts, t = [t_count], t_count
    for k in range(masters, 0, -1):
        t = back[k][t]
        cuts.append(t)
    cuts.reverse()
    return [(cuts[k], cuts[k + 1]) for k in range(masters)]


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
        its slice). Two passes (min, max) without allocating; NaN propagates through both.
        A bf16 part (uint16 bits, --wire bf16) is non-finite where its exponent is all ones;
        a bf16 Δθ is poisoned with a bf16 NaN."""
        for p in parts:
            if p.dtype == np.uint16:
                bad = bool(((p & np.uint16(0x7F80)) == np.uint16(0x7F80)).any())
            else:
                lo, hi = float(p.min()), float(p.max())
                bad = not (np.isfinite(lo) and np.isfinite(hi))
            if bad:
                delta = parts[0]
                for a, _ in self.bounds:
                    delta[a] = BF16_NAN if delta.dtype == np.uint16 else np.nan
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


class ShardEngine(Protocol):
    """What a follower drives of its master (:class:`gem_mpi.engine.master.Master`)."""

    next_seq: np.ndarray
    roster: Roster

    def loop(self) -> Verdict: ...

    def theta(self) -> np.ndarray: ...

    def load_state(self, ckpt: Checkpoint) -> None: ...

    def shard_state(self, copy: bool = True) -> ShardState: ...

    def catch_up(self, target: np.ndarray, timeout_s: float) -> bool: ...

    def summary(self) -> dict: ...

    def idle_backoff(self, first: float = 20e-6, limit: float = 5e-3) -> Backoff: ...


class Follower:
    """A follower master's supervisor: what the engine calls on its supervisor, answered for
    a shard that decides nothing. Its rows go to the lead (which writes them into the
    metrics file's ``shard<k>`` table), its θ is watched for values that are not finite
    (the lead then ends the run as diverged), and between batches it answers the lead.
    ``run`` returns the outcome of the lead's stop word."""

    ROWS_EVERY_S = 0.25

    def __init__(self, engine: ShardEngine, link: MessageLink, shard: int,
                 exit_timeout: float, resumed: Checkpoint | None = None) -> None:
        self.engine, self.link, self.shard = engine, link, shard
        self.exit_timeout = exit_timeout
        self.recording = True
        self.recent_loss = float("nan")
        self.summary: dict = {}
        self.departures = None  # the lead deals and keeps the plans
        self.word: int | None = None  # the lead's stop word, once it said it
        self.held = False
        self._rows: list[dict] = []
        self._sent_at = time.monotonic()
        self._reported = False  # θ found not finite, and said
        self.t0 = time.perf_counter()
        if resumed is not None:
            engine.load_state(resumed)

    # --- what the engine calls --------------------------------------------------------------
    def heard(self, worker: int, finished: bool = False) -> None:
        """The lead's watchdog watches the workers (every worker posts to every shard)."""

    def record_update(self, row: dict) -> None:
        self._rows.append(row)

    def record_rejected(self, row: dict) -> None:
        """Not sent: ``/rejected`` is shard 0's. An update non-finite in any shard's part is
        poisoned in every shard's (:meth:`Plan.poison_all`), so the lead's rows already name
        each one once; this shard's count reaches ``/summary/shard_rejected`` in its Final."""

    def observe(self, loss: float, position: int, theta: np.ndarray,
                share: float = 1.0) -> None:
        """The lead watches the loss; each shard watches its own θ (every 100 updates)."""
        if position % 100 == 0 and not self._reported:
            with np.errstate(over="ignore", invalid="ignore"):
                norm = float(np.dot(theta, theta))
            if not np.isfinite(norm):
                self._reported = True
                self.link.send(LEAD, Diverged(f"θ of shard {self.shard} holds values that "
                                              "are not finite"))

    def eval_due(self, position: int) -> bool:
        return False

    def evaluate(self, theta: np.ndarray, done: int) -> None:
        """Only the lead evaluates (θ gathered from every shard)."""

    def show(self, status: Callable[[], str]) -> None:
        """Only the lead shows progress."""

    def since_start(self, t: float) -> float:
        return t - self.t0

    def between_batches(self) -> Verdict | None:
        """None: go on; else the run has ended (the lead said its stop word)."""
        self._send_rows()
        backoff = self.engine.idle_backoff()
        while self.word is None:
            got = self.link.poll(LEAD)
            if got is not None:
                self._handle(got[1])
                continue
            if not self.held:
                return None
            backoff.wait()  # held: the mailboxes wait, MPI progresses
        return Verdict(OUTCOME_OF.get(self.word, Outcome.FAILED), "the lead's word")

    def run(self) -> Outcome:
        """The shard's loop; at its end (every worker done) its final part goes to the lead,
        then it answers the lead until the lead's stop word. Its rows all sent, it says
        goodbye and returns the word's outcome."""
        roster = self.engine.roster
        while True:
            self.engine.loop()
            if self.word is not None:
                break
            self._send_rows(now=True)
            self.link.send(LEAD, Final(self.engine.shard_state(), self.engine.summary(),
                                       roster.deals))
            backoff = self.engine.idle_backoff(first=50e-6, limit=5e-3)
            while self.word is None and roster.all_finished():
                got = self.link.poll(LEAD)
                if got is not None:
                    self._handle(got[1])
                else:
                    backoff.wait()
            if self.word is not None:  # else a worker was dealt more: serve again
                break
        self._send_rows(now=True)
        self.link.send(LEAD, Bye())  # after every row: the lead has them all
        self.link.flush()
        return OUTCOME_OF.get(self.word, Outcome.FAILED)

    # --- talking to the lead ----------------------------------------------------------------
    def _send_rows(self, now: bool = False) -> None:
        if self._rows and (now or time.monotonic() - self._sent_at > self.ROWS_EVERY_S):
            self.link.send(LEAD, Rows(self._rows))
            self._rows = []
            self._sent_at = time.monotonic()

    def _handle(self, msg: object) -> None:
        engine = self.engine
        match msg:
            case Hold():
                self.held = True
                self._send_rows(now=True)
                self.link.send(LEAD, At(engine.next_seq.copy()))
            case Cut(target=target):
                reached = engine.catch_up(target, self.exit_timeout)
                self._send_rows(now=True)  # the rows up to the cut come before its state
                self.link.send(LEAD, State(engine.shard_state() if reached else None))
            case Go():
                self.held = False
            case Gather():
                self.link.send(LEAD, Piece(engine.theta().copy()))
            case End(word=word):
                self.word = word
            case Deal(worker=worker, length=length):
                engine.roster.dealt(worker, length)
            case _:
                raise TypeError(f"shard {self.shard}: unexpected message {msg!r} from the lead")


class LeadSupervisor(Protocol):
    """What the lead needs of the run's supervisor."""

    def record_shard_update(self, shard: int, row: dict) -> None: ...

    def shard_diverged(self, why: str) -> None: ...


class Lead:
    """Rank 0's side of the followers: their rows into the metrics file, their divergence
    into the run's verdict, and the collective moves (the cut of a checkpoint, θ gathered for
    an evaluation, the end)."""

    def __init__(self, link: MessageLink, masters: int, sup: LeadSupervisor,
                 progress: Callable[[], object]) -> None:
        self.link, self.masters, self.sup = link, masters, sup
        self.followers = list(range(1, masters))
        self.progress = progress  # rank 0's MPI progress, before each sleep of its waits
        self.replies: dict[type, dict[int, object]] = {}
        self.finals: dict[int, Final] = {}

    def drain(self) -> None:
        """Take every message the followers sent: rows, divergence, finals, replies."""
        while (got := self.link.poll()) is not None:
            source, msg = got
            match msg:
                case Rows(rows=rows):
                    for row in rows:
                        self.sup.record_shard_update(source, row)
                case Diverged(why=why):
                    self.sup.shard_diverged(why)
                case Final():
                    self.finals[source] = msg
                case At() | State() | Piece() | Bye():
                    self.replies.setdefault(type(msg), {})[source] = msg
                case _:
                    raise TypeError(f"the lead got an unexpected message {msg!r} from "
                                    f"shard {source}")

    def send_all(self, msg: object) -> None:
        for k in self.followers:
            self.link.send(k, msg)

    def collect(self, kind: type) -> list:
        """One reply of class ``kind`` from each follower, in shard order; waits asleep,
        making MPI progress for the workers' operations on rank 0 meanwhile."""
        backoff = Backoff(20e-6, 1e-3, progress=self.progress)
        while True:
            self.drain()
            got = self.replies.get(kind, {})
            if all(k in got for k in self.followers):
                return [got.pop(k) for k in self.followers]
            backoff.wait()

    def all_final(self, deals: int = 0) -> bool:
        """Every follower's final part, sent after it had seen all ``deals`` of the lead."""
        return (len(self.finals) == len(self.followers)
                and all(f.deals == deals for f in self.finals.values()))

    def wait_finals(self, deals: int = 0) -> None:
        backoff = Backoff(50e-6, 2e-3, progress=self.progress)
        while not self.all_final(deals):
            self.drain()
            if not self.all_final(deals):
                backoff.wait()

    def final_states(self) -> list[ShardState]:
        return [self.finals[k].state for k in self.followers]


__all__ = ["LEAD", "Follower", "Lead", "LeadSupervisor", "Plan", "ShardEngine", "connect",
           "plan", "shard_cut"]
