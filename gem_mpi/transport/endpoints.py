"""The master's and a worker's view of the transport, composed of the RMA idioms.

A worker pulls θ (a :class:`VersionedArray`), computes, and posts its update into its own
:class:`Mailbox` slot with a ticket from the :class:`TicketCounter`; the master takes ready
messages lowest ticket first, applies them between ``begin_write`` and ``end_write`` (which
make a pull that overlaps them read again), and releases the slots. The :class:`StopWord`
tells workers when the run ends and how; each worker signs the :class:`Roll` as it leaves,
and the master frees the windows (a collective) only once all have, so that a stuck worker
can delay the end of a run by at most ``timeout_s`` (then the caller aborts the job). Neither
side sees a window, a cell or a displacement. The message kinds, the stop words and the
:class:`Layout` are :mod:`gem_mpi.protocol`'s (importable from here as before).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import cast

import numpy as np

from gem_mpi.protocol import (  # the message format; re-exported for the endpoints' users
    ABORTED,
    DIVERGED,
    DONE,
    FINISHED,
    LEFT,
    OUTPUT_FAILED,
    RUNNING,
    SIGN_OFFS,
    STOPPED,
    UPDATE,
    WORKER_LOST,
    Layout,
)
from gem_mpi.transport.idioms import (
    Mailbox,
    Message,
    Orders,
    Roll,
    StopWord,
    TicketCounter,
    VersionedArray,
    Zero,
)
from gem_mpi.transport.polling import Backoff, ProgressPoke, soft_barrier
from gem_mpi.transport.runtime import MASTER, MPI

# MPICH 4.0 moves a Put to rank 0 in pieces of about 64 KiB, one per entry into rank 0's
# progress engine (measured: a 655 kB Put took 9 of rank 0's wake-ups with one entry each)
AM_PIECE_BYTES = 64 * 1024


def poke_rounds(layout: Layout) -> int:
    """Progress-engine entries per poke of rank 0: twice the pieces of a whole payload, so
    that a worker's post arrives in one wake-up of rank 0 even while another's does too
    (more rounds measured faster on MPICH: 16 gave 70 upd/s, 64 gave 85, for 30 pieces);
    capped at 1024 (0.2 ms of empty entries). One on other stacks (Open MPI lost a third of
    its throughput with 60)."""
    if MPI.get_vendor()[0] != "MPICH":
        return 1
    pieces = -(-4 * layout.payload_floats // AM_PIECE_BYTES)
    return max(1, min(1024, 2 * pieces))


class _Endpoint:
    """The idioms, allocated collectively in one order on every rank and freed likewise."""

    def __init__(self, comm: MPI.Intracomm, layout: Layout, ticket0: int = 0,
                 zero: Zero | None = None, theta_into: np.ndarray | None = None) -> None:
        self.layout = layout
        soft_barrier(comm)  # ranks arrive after uneven imports and data loading
        self.progress = ProgressPoke(comm, poke_rounds(layout))
        self.tickets = TicketCounter(comm, ticket0)
        self.stop = StopWord(comm)
        self.mailbox = Mailbox(comm, layout.n_workers, layout.payload_floats, layout.kept,
                               zero=zero, stream=layout.n_params)
        self.theta_window = VersionedArray(comm, layout.n_params, zero=zero,
                                           into=theta_into)
        self.roll = Roll(comm, layout.n_workers)
        self.orders = Orders(comm, layout.n_workers)

    def _open(self, comm: MPI.Intracomm) -> None:
        for idiom in (self.tickets, self.stop, self.mailbox, self.theta_window, self.roll,
                      self.orders):
            idiom.open()
        comm.Barrier()  # rank 0's initial values are in place before any worker looks

    tolerant = False  # --worker-loss continue: rank 0 goes on after a worker's death

    peer_lost = False  # a worker's process died: the windows are left to MPI_Finalize

    def _free(self) -> None:
        if self.peer_lost:  # each window's free is collective and would wait for it forever
            return
        for idiom in (self.orders, self.roll, self.theta_window, self.mailbox, self.stop,
                      self.tickets, self.progress):
            idiom.free()


class MasterEndpoint(_Endpoint):
    """Rank 0's view: its own windows' memory, no MPI call on the data path. ``zero``: how
    the kernel that streams θ and the payloads first-touches them (the idioms' note)."""

    def __init__(self, comm: MPI.Intracomm, layout: Layout, theta0: np.ndarray,
                 version0: int = 0, ticket0: int = 0, zero: Zero | None = None) -> None:
        super().__init__(comm, layout, ticket0, zero)
        self.theta = self.theta_window.data
        self.theta_window.set(theta0, version0)
        self._open(comm)

    # rank 0's longest sleep while idle: on stacks whose RMA rank 0 serves in its progress
    # engine (MPICH 4.0, Open MPI's osc pt2pt and ucx) every worker operation waits up to
    # this long (with 1 ms MPICH made 72 against 104 upd/s with 200 µs: docs/
    # PERFORMANCE.md, "MPICH")
    IDLE_LIMIT = 200e-6

    def idle_backoff(self, first: float = 20e-6, limit: float = IDLE_LIMIT) -> Backoff:
        """The back-off for rank 0's idle polling: it makes MPI progress before each sleep,
        so workers' RMA on rank 0 completes on every stack (see
        :class:`~gem_mpi.transport.polling.ProgressPoke`)."""
        return Backoff(first, limit, progress=self.progress)

    @property
    def payloads(self) -> np.ndarray:
        """Every slot's payload area, one row per worker (rank 0's own memory)."""
        return self.mailbox.payloads

    @property
    def kept(self) -> np.ndarray | None:
        """The part of every slot that rank 0 writes and keeps between a worker's messages
        (``Layout.kept``: GEM's s under ``--gem-shift paper``), one row per worker; None when
        the layout keeps none."""
        return self.mailbox.kept

    def ready(self) -> np.ndarray:
        """Slots with a message waiting, lowest ticket first."""
        return self.mailbox.ready()

    def take(self, slot: int) -> Message:
        return self.mailbox.take(slot, {UPDATE: self.layout.update_lengths
                                        or (self.layout.payload_floats,),
                                        DONE: (self.layout.done_floats,),
                                        LEFT: (self.layout.done_floats,)})

    def release(self, slots: np.ndarray | list[int]) -> None:
        self.mailbox.release(slots)

    def begin_write(self) -> None:
        self.theta_window.begin_write(self.progress)

    def end_write(self, version: int, pace: float = 0.0) -> None:
        """θ's new ``version``; ``pace``: published with it (--dylu's fastest worker)."""
        self.theta_window.end_write(version, pace)

    def give(self, worker: int, runs: Sequence[tuple[int, ...]]) -> None:
        """Order worker ``worker``, waiting after its DONE, to train ``runs`` next."""
        self.orders.give(worker, runs)

    def tickets_drawn(self) -> int:
        return self.tickets.drawn()

    def lost(self) -> set[int]:
        """Workers (1..n) whose process died, as ULFM told rank 0 (--worker-loss continue)."""
        return self.progress.lost

    def shutdown(self, code: int = FINISHED, timeout_s: float = 60.0) -> list[int]:
        """Tell the workers to leave and free the windows with them once every worker has
        signed the roll (a lost one cannot). Returns the workers that had not signed after
        ``timeout_s`` (the windows are then left as they are: freeing them would wait for
        those workers forever, so the caller ends the job), or [] once the windows are
        freed."""
        self.peer_lost = bool(self.lost())
        self.stop.say(code | (WORKER_LOST if self.peer_lost else 0))
        deadline = time.monotonic() + timeout_s
        backoff = self.idle_backoff(first=50e-6, limit=10e-3)
        while True:
            missing = [w for w in self.roll.missing() if w not in self.lost()]
            if not missing:
                break
            if time.monotonic() >= deadline:
                return missing
            backoff.wait()
        self._free()
        return []


class WorkerEndpoint(_Endpoint):
    """A worker's view: pulls θ and posts messages into its own mailbox slot on rank 0.
    ``theta_into``: where pulls land (default: a buffer of its own), see VersionedArray."""

    def __init__(self, comm: MPI.Intracomm, layout: Layout, poll_limit: float = 5e-3,
                 theta_into: np.ndarray | None = None) -> None:
        super().__init__(comm, layout, theta_into=theta_into)
        self.rank = comm.Get_rank()
        self.slot = self.rank - 1
        self.theta = self.theta_window.data
        self._pending = False
        self._backoff = Backoff(limit=poll_limit)
        self._open(comm)

    def pull(self, into: np.ndarray | None = None) -> int:
        """θ into ``self.theta`` (or ``into``), never torn; returns its version."""
        return self.theta_window.read(into)

    def stop_code(self) -> int:
        """The master's stop word: RUNNING while the run goes on."""
        word = self.stop.heard()
        if word & WORKER_LOST:
            self.peer_lost = True
        return word & ~WORKER_LOST

    def wait_slot_free(self) -> bool:
        """Block (backing off) until the master consumed our previous message.

        Returns False instead when the master has stopped the run (it will not consume it).
        """
        if not self._pending:
            return self.stop_code() == RUNNING
        self._backoff.reset()
        while not self.mailbox.is_free(self.slot):
            if self.stop_code():
                return False
            self._backoff.wait()
        self._pending = False
        return self.stop_code() == RUNNING

    def commit(self, kind: int, seq: int, version: int, loss: float = 0.0,
               compute_s: float = 0.0, parts: tuple[np.ndarray, ...] = (),
               steps: int = 0) -> int:
        """Post one message (``steps``: an update's local steps); returns its ticket."""
        if self._pending and not self.wait_slot_free():
            raise RuntimeError("commit after the master stopped the run")
        ticket = self.mailbox.post(self.slot, self.tickets, parts, rank=self.rank, seq=seq,
                                   version=version, kind=kind, loss=loss, compute_s=compute_s,
                                   steps=steps)
        self._pending = True
        return ticket

    def wait_shutdown(self, limit: float = 50e-3) -> int:
        """After our last message: wait, without spinning, for the master's word to leave
        (``limit``: the longest sleep between two looks)."""
        backoff = Backoff(limit=max(self._backoff.limit, limit))  # latency matters little
        while True:
            code = self.stop_code()
            if code:
                return code
            backoff.wait()

    def wait_word_or_order(self, seen: int, leaving: Callable[[], bool]
                           ) -> tuple[int, list[tuple[int, ...]] | None]:
        """After a DONE: wait for the master's word (code, None) or, once the order serial
        passes ``seen``, for its order (RUNNING, runs); (RUNNING, None) as soon as
        ``leaving()`` (the worker got SIGTERM)."""
        backoff = Backoff(limit=max(self._backoff.limit, 50e-3))
        while True:
            code = self.stop_code()
            if code:
                return code, None
            if self.orders.serial(self.rank) > seen:
                return RUNNING, self.orders.runs(self.rank)
            if leaving():
                return RUNNING, None
            backoff.wait()

    @property
    def backoff_s(self) -> float:
        """Seconds slept waiting for the master to consume our messages."""
        return self._backoff.slept

    def close(self) -> None:
        """Sign the roll, then free the windows with the master."""
        self.sign()
        self.free()

    def sign(self) -> None:
        """Sign the roll: this worker leaves (its files are written)."""
        self.roll.sign(self.rank)

    def free(self) -> None:
        """Free the windows with the master (collective over this endpoint's ranks)."""
        self._free()


def shard_comm(comm: MPI.Intracomm, masters: int, shard: int) -> MPI.Intracomm:
    """Collective over ``comm``: the communicator of shard ``shard`` (of ``masters``): its
    master (world rank ``shard``) as rank 0, then every worker (world ranks masters..) as
    ranks 1..n in order, so that a shard's windows, mailbox slots, worker numbers and roll
    are those of a one-master run (MASTER is rank 0 there); COMM_NULL on the other masters.
    With one master, ``comm`` itself."""
    if masters == 1:
        return comm
    group = comm.Get_group()
    members = group.Incl([shard, *range(masters, comm.Get_size())])
    try:
        return cast(MPI.Intracomm, comm.Create(members))  # an Intracomm's is one too
    finally:
        members.Free()
        group.Free()


class WorkerShards:
    """A worker's view of θ sharded over K masters: one :class:`WorkerEndpoint` per shard,
    each on its shard's communicator (:func:`shard_comm`). A pull reads every shard into
    its slice of one buffer (``theta``); a commit posts each shard its slice of every part,
    back to back once every slot is free, so that a shard is never more than one update of
    this worker behind another. The run's end is read from shard 0's stop word (rank 0
    decides it once, for all). With one shard it is that shard's endpoint, call for call."""

    def __init__(self, comms: list[MPI.Intracomm], layouts: list[Layout],
                 bounds: list[tuple[int, int]], poll_limit: float = 5e-3,
                 theta_into: np.ndarray | None = None) -> None:
        n = bounds[-1][1]
        self.theta = np.empty(n, np.float32) if theta_into is None else theta_into
        self.bounds = bounds
        self.eps = [WorkerEndpoint(c, lay, poll_limit=poll_limit,
                                   theta_into=self.theta[lo:hi])
                    for c, lay, (lo, hi) in zip(comms, layouts, bounds)]
        self.lead = self.eps[0]

    def pull(self, into: np.ndarray | None = None) -> list[int]:
        """θ of every shard into its slice of ``self.theta`` (or of ``into``, a buffer like
        it), never torn; their versions."""
        if into is None:
            return [ep.pull() for ep in self.eps]
        return [ep.pull(into[lo:hi]) for ep, (lo, hi) in zip(self.eps, self.bounds)]

    def stop_code(self) -> int:
        return self.lead.stop_code()

    def wait_slot_free(self) -> bool:
        """Every shard consumed our previous message; False once the run was stopped."""
        return all(ep.wait_slot_free() for ep in self.eps)

    def commit(self, kind: int, seq: int, versions: list[int], loss: float = 0.0,
               compute_s: float = 0.0, parts: tuple[np.ndarray, ...] = (),
               steps: int = 0) -> None:
        """Post one message to every shard: each its slice of every part (a DONE's parts,
        shorter than θ, go whole to each)."""
        if len(self.eps) > 1 and not self.wait_slot_free():
            raise RuntimeError("commit after the master stopped the run")
        for ep, (lo, hi), version in zip(self.eps, self.bounds, versions):
            mine = parts if kind in SIGN_OFFS else tuple(p[lo:hi] for p in parts)
            ep.commit(kind, seq, version, loss, compute_s, mine, steps)

    @property
    def pace(self) -> float:
        """The value rank 0 published with the θ last pulled (--dylu: the fastest worker's
        seconds per local step; 0 before any)."""
        return self.lead.theta_window.pace

    def wait_shutdown(self, limit: float = 50e-3) -> int:
        return self.lead.wait_shutdown(limit)

    def wait_word_or_order(self, seen: int, leaving: Callable[[], bool]
                           ) -> tuple[int, list[tuple[int, ...]] | None]:
        """Shard 0's master (rank 0) gives the orders, for every shard."""
        return self.lead.wait_word_or_order(seen, leaving)

    @property
    def backoff_s(self) -> float:
        return sum(ep.backoff_s for ep in self.eps)

    def close(self) -> None:
        """Sign every shard's roll, then free every shard's windows, in shard order: each
        master frees its own (a collective of its shard) once all have signed."""
        for ep in self.eps:
            ep.sign()
        for ep in self.eps:
            ep.free()


__all__ = ["ABORTED", "DIVERGED", "DONE", "FINISHED", "LEFT", "MASTER", "OUTPUT_FAILED", "RUNNING",
           "STOPPED", "UPDATE", "Layout",
           "MasterEndpoint", "Message", "WorkerEndpoint", "WorkerShards", "shard_comm"]
