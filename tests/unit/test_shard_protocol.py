"""The sharded masters' protocol in one process: a real Lead and real Followers
(gem_mpi.engine.shards) over an in-memory link pair, each follower on its own thread driving
a fake shard engine, as its master's loop would. The mpirun tests in tests/test_shards.py
run the same classes over MPI; these check each exchange alone, fast."""

from __future__ import annotations

import pickle
import threading
from collections.abc import Callable

import numpy as np
import pytest

from gem_mpi.engine.roster import Roster
from gem_mpi.engine.shards import LEAD, Follower, Lead
from gem_mpi.protocol import (
    FINISHED,
    STOPPED,
    At,
    Bye,
    Cut,
    End,
    Gather,
    Go,
    Hold,
    Piece,
    Rows,
    ShardState,
    State,
)
from gem_mpi.run.supervisor import FINISHED as RUN_FINISHED
from gem_mpi.run.supervisor import Outcome, Verdict
from gem_mpi.transport import Backoff

WORKERS = 2


class MemoryLink:
    """One rank's end of an in-memory link: what is sent is pickled and unpickled, as on the
    wire, and waits in the receiver's box in order."""

    def __init__(self, rank: int, boxes: list[list], lock: threading.Lock) -> None:
        self.rank, self.boxes, self.lock = rank, boxes, lock
        self.sent: list[str] = []  # the class of each message sent, in order

    def send(self, dest: int, msg: object) -> None:
        with self.lock:
            self.sent.append(type(msg).__name__)
            self.boxes[dest].append((self.rank, pickle.loads(pickle.dumps(msg))))

    def poll(self, source: int = -1) -> tuple[int, object] | None:
        with self.lock:
            box = self.boxes[self.rank]
            for i, (src, msg) in enumerate(box):
                if source < 0 or src == source:
                    del box[i]
                    return src, msg
        return None

    def flush(self) -> None:
        """Delivery is immediate."""


def links(n: int) -> list[MemoryLink]:
    boxes: list[list] = [[] for _ in range(n)]
    lock = threading.Lock()
    return [MemoryLink(r, boxes, lock) for r in range(n)]


class FakeShard:
    """A shard engine: ``budget`` updates per worker, applied one per batch (θ += 1 each),
    with the supervisor asked between batches, as Master.loop does."""

    def __init__(self, shard: int, budget: int, size: int = 3) -> None:
        self.shard, self.budget = shard, budget
        self.theta_ = np.full(size, float(shard), np.float32)
        self.clock = 0
        self.next_seq = np.zeros(WORKERS, np.int64)
        self.sup: Follower | None = None
        self.gate = threading.Event()  # the test opens it when updates may be applied
        self.gate.set()
        self.roster = Roster(WORKERS)  # each worker's DONE, once its budget is applied

    def _apply_one(self, limit: np.ndarray | None = None) -> bool:
        for w in range(WORKERS):
            if self.next_seq[w] < self.budget and (limit is None or self.next_seq[w] < limit[w]):
                self.theta_ += 1
                self.clock += 1
                self.next_seq[w] += 1
                self.sup.record_update({"clock": self.clock, "worker": w + 1})
                return True
        return False

    def loop(self) -> Verdict:
        while True:
            verdict = self.sup.between_batches()
            if verdict is not None:
                return verdict
            if not self.gate.is_set():
                self.gate.wait(0.01)
                continue
            if not self._apply_one():
                for w in range(1, WORKERS + 1):
                    self.roster.done(w, self.budget)
                return RUN_FINISHED

    def theta(self) -> np.ndarray:
        return self.theta_

    def load_state(self, ckpt) -> None:
        self.clock, self.next_seq = ckpt.clock, np.array(ckpt.next_seq)

    def shard_state(self, copy: bool = True) -> ShardState:
        return ShardState(self.theta_.copy(), self.clock, self.clock, self.next_seq.copy())

    def catch_up(self, target: np.ndarray, timeout_s: float) -> bool:
        while (self.next_seq < target).any():
            if not self._apply_one(limit=target):
                return False  # the updates below the cut never came
        return True

    def summary(self) -> dict:
        return {"rejected": 0}

    def idle_backoff(self, first: float = 20e-6, limit: float = 5e-3) -> Backoff:
        return Backoff(1e-5, 1e-4)


class FakeRun:
    """What the lead needs of the run's supervisor."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, dict]] = []
        self.why: str | None = None

    def record_shard_update(self, shard: int, row: dict) -> None:
        self.rows.append((shard, row))

    def shard_diverged(self, why: str) -> None:
        self.why = self.why or why


def start(masters: int = 3, budget: int = 5, gate_open: bool = True
          ) -> tuple[Lead, FakeRun, list[FakeShard], dict[int, Outcome], Callable[[], None],
                     list[MemoryLink]]:
    """A lead (rank 0, this thread) and ``masters - 1`` followers, each running on its own
    thread; returns them and a function that joins the threads."""
    ends = links(masters)
    run = FakeRun()
    lead = Lead(ends[LEAD], masters, run, progress=lambda: None)
    engines, outcomes, threads = [], {}, []
    for k in range(1, masters):
        engine = FakeShard(k, budget)
        if not gate_open:
            engine.gate.clear()
        engine.sup = Follower(engine, ends[k], k, exit_timeout=5.0)
        engines.append(engine)

        def follow(k: int = k, sup: Follower = engine.sup) -> None:
            outcomes[k] = sup.run()

        threads.append(threading.Thread(target=follow, daemon=True))
    for t in threads:
        t.start()

    def join() -> None:
        for t in threads:
            t.join(10)
            assert not t.is_alive(), "a follower never ended"

    return lead, run, engines, outcomes, join, ends


def test_a_cut_brings_every_shard_to_exactly_the_same_updates():
    lead, run, engines, outcomes, join, ends = start(budget=5, gate_open=False)
    lead.send_all(Hold())
    at = lead.collect(At)
    assert all(np.array_equal(a.next_seq, [0, 0]) for a in at)  # held before any update
    target = np.array([3, 2], np.int64)  # the lead is further on: the shards catch up
    lead.send_all(Cut(target))
    states = [s.state for s in lead.collect(State)]
    assert [s.clock for s in states] == [5, 5]
    assert all(np.array_equal(s.next_seq, target) for s in states)
    # the rows up to the cut are sent before the state: the lead has every one of them
    assert [ends[k].sent[:3] for k in (1, 2)] == [["At", "Rows", "State"]] * 2
    lead.drain()
    assert sorted(k for k, _ in run.rows) == [1] * 5 + [2] * 5
    lead.send_all(Go())
    for e in engines:
        e.gate.set()
    lead.wait_finals()
    assert [s.clock for s in lead.final_states()] == [10, 10]
    lead.send_all(End(FINISHED))
    lead.collect(Bye)
    join()
    assert outcomes == {1: Outcome.FINISHED, 2: Outcome.FINISHED}


def test_the_lead_gathers_theta_while_the_shards_run():
    lead, _, _, outcomes, join, _ = start(budget=10**9, gate_open=False)
    lead.send_all(Gather())
    pieces = lead.collect(Piece)
    assert [p.theta.tolist() for p in pieces] == [[1.0] * 3, [2.0] * 3]
    lead.send_all(End(STOPPED))
    lead.collect(Bye)
    join()
    assert outcomes == {1: Outcome.STOPPED, 2: Outcome.STOPPED}


def test_a_shard_whose_theta_is_not_finite_makes_the_run_diverge():
    lead, run, engines, _, join, _ = start(masters=2, budget=10**9, gate_open=False)
    engines[0].sup.observe(0.0, 100, np.array([np.inf], np.float32))
    lead.send_all(Gather())  # a reply after the report: the report is there by then
    lead.collect(Piece)
    assert run.why == "θ of shard 1 holds values that are not finite"
    lead.send_all(End(STOPPED))
    lead.collect(Bye)
    join()


def test_a_message_out_of_the_protocol_is_an_error_not_ignored():
    ends = links(2)
    lead = Lead(ends[LEAD], 2, FakeRun(), progress=lambda: None)
    ends[1].send(LEAD, ("rows", []))  # the untyped tuples of before
    with pytest.raises(TypeError, match="unexpected message"):
        lead.drain()
    engine = FakeShard(1, 1)
    engine.sup = Follower(engine, ends[1], 1, exit_timeout=1.0)
    ends[LEAD].send(1, "hold")
    with pytest.raises(TypeError, match="unexpected message"):
        engine.sup.between_batches()


def test_a_follower_sends_its_update_rows_and_keeps_its_rejected_ones():
    """/rejected is shard 0's: every shard rejects a poisoned update alike, so the lead's own
    rows name it once; a follower's rows are its /shard<k> rows only."""
    ends = links(2)
    run = FakeRun()
    lead = Lead(ends[LEAD], 2, run, progress=lambda: None)
    engine = FakeShard(1, 1)
    engine.sup = Follower(engine, ends[1], 1, exit_timeout=1.0)
    engine.sup.record_rejected({"time": 0.0, "worker": 2, "seq": 4, "ticket": 4})
    engine.sup.record_update({"clock": 1, "worker": 1})
    lead.send_all(Hold())  # the follower sends its rows now, then says where it is
    lead.send_all(Go())
    assert engine.sup.between_batches() is None
    sent = [msg for _, msg in ends[1].boxes[LEAD] if isinstance(msg, Rows)]
    assert sent == [Rows([{"clock": 1, "worker": 1}])]  # the rejected row never left
    lead.drain()
    assert run.rows == [(1, {"clock": 1, "worker": 1})]
