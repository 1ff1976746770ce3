"""In-memory fakes of the transport, for the fast loop: rank 0's windows as plain memory that
the master's engine and scripted workers share inside one process (threads, no MPI).

:class:`MemoryWindows` keeps what rank 0's windows hold (θ and its version, the mailbox
slots with their headers and ready flags, the ticket counter, the stop word, the orders) and
hands out an endpoint with :class:`~gem_mpi.transport.endpoints.MasterEndpoint`'s face, so
that :class:`~gem_mpi.engine.master.Master` serves and applies exactly as under mpirun, and
a worker side that posts messages the way ``Mailbox.post`` lays them out. The real idioms
are tested under mpirun (tests/test_transport.py); this fake is for the engine above them.
"""

from __future__ import annotations

import threading

import numpy as np

from gem_mpi.protocol import DONE, UPDATE, WORKER_TIME_COLUMNS, Layout
from gem_mpi.transport.idioms import HEADER, Message
from gem_mpi.transport.polling import Backoff


class _NoProgress:
    """One process: nothing to make progress on."""

    def once(self) -> None:
        pass


class _ThetaWindow:
    def forget_readers(self) -> None:
        pass


class MemoryWindows:
    """Rank 0's windows in one process. ``master`` has MasterEndpoint's signature, so it can
    be given to ``Master(endpoint=...)``; :meth:`post` and :meth:`pull` are a worker's side."""

    def __init__(self) -> None:
        self.lock = threading.Condition()
        self.ep: _MasterSide | None = None
        self.stop_code: int | None = None  # the word rank 0 said at its shutdown
        self.orders: dict[int, list] = {}
        self.pace = 0.0  # what rank 0 published with θ (--dylu's fastest worker)

    def master(self, comm: object, layout: Layout, theta0: np.ndarray, version0: int = 0,
               ticket0: int = 0, zero: object = None) -> _MasterSide:
        self.ep = _MasterSide(self, layout, theta0, version0, ticket0)
        return self.ep

    # --- a worker's side -------------------------------------------------------------------
    def pull(self) -> tuple[np.ndarray, int]:
        """θ and its version, never torn (the master writes under the same lock)."""
        ep = self._ep()
        with self.lock:
            while ep.writing:
                self.lock.wait()
            return ep.theta.copy(), ep.version

    def post(self, worker: int, kind: int, seq: int, version: int,
             parts: tuple[np.ndarray, ...], loss: float = 0.0, compute_s: float = 0.0,
             steps: int = 0) -> int:
        """Wait until worker ``worker``'s slot is free, deposit a message as Mailbox.post
        lays it out (each part at a 4-byte boundary) and publish it with a ticket."""
        ep = self._ep()
        with self.lock:
            while ep.flags[worker - 1] != 0:
                self.lock.wait(0.01)
            slot = ep.payloads[worker - 1].view(np.uint8)
            offset = 0
            for part in parts:
                raw = np.ascontiguousarray(part).reshape(-1).view(np.uint8)
                slot[offset:offset + raw.size] = raw
                offset += (raw.size + 3) // 4 * 4
            h = ep.headers[worker - 1]
            h["rank"], h["seq"], h["version"], h["kind"] = worker, seq, version, kind
            h["nfloats"], h["loss"], h["compute_s"] = offset // 4, loss, compute_s
            h["steps"] = steps
            ticket = ep.tickets
            ep.tickets += 1
            ep.flags[worker - 1] = ticket + 1
            return ticket

    def update(self, worker: int, seq: int, version: int, parts: tuple[np.ndarray, ...],
               loss: float = 0.0) -> int:
        return self.post(worker, UPDATE, seq, version, parts, loss)

    def done(self, worker: int, seq: int) -> int:
        split = np.zeros(len(WORKER_TIME_COLUMNS), np.float32)
        return self.post(worker, DONE, seq, 0, (split,))

    def wait_applied(self, worker: int) -> None:
        """Until worker ``worker``'s last message was taken (its slot free again)."""
        ep = self._ep()
        with self.lock:
            while ep.flags[worker - 1] != 0:
                self.lock.wait(0.01)

    def worker(self, rank: int, n_params: int) -> _WorkerSide:
        """Worker ``rank``'s endpoint (WorkerShards' face, one shard)."""
        return _WorkerSide(self, rank, n_params)

    def _ep(self) -> _MasterSide:
        assert self.ep is not None, "the master has not opened its windows yet"
        return self.ep


class _MasterSide:
    """MasterEndpoint's face over :class:`MemoryWindows`."""

    tolerant = False
    peer_lost = False

    def __init__(self, board: MemoryWindows, layout: Layout, theta0: np.ndarray,
                 version0: int, ticket0: int) -> None:
        n = layout.n_workers
        self.board, self.layout = board, layout
        self.theta = np.array(theta0, np.float32)
        self.version, self.tickets, self.writing = version0, ticket0, False
        self.payloads = np.zeros((n, layout.payload_floats), np.float32)
        self.headers = np.zeros(n, HEADER)
        self.flags = np.zeros(n, np.int64)
        self.kept = (None if layout.kept is None else
                     self.payloads[:, layout.kept[0]:layout.kept[1]])
        self.progress = _NoProgress()
        self.theta_window = _ThetaWindow()

    def idle_backoff(self, first: float = 20e-6, limit: float = 200e-6) -> Backoff:
        return Backoff(first, limit)

    def ready(self) -> np.ndarray:
        with self.board.lock:
            slots = np.flatnonzero(self.flags)
            return slots[np.argsort(self.flags[slots], kind="stable")].astype(np.int64)

    def take(self, slot: int) -> Message:
        header = self.headers[slot].copy()
        return Message(slot, int(self.flags[slot]) - 1, header, self.payloads[slot])

    def release(self, slots: np.ndarray | list[int]) -> None:
        with self.board.lock:
            self.flags[slots] = 0
            self.board.lock.notify_all()

    def begin_write(self) -> None:
        with self.board.lock:
            self.writing = True

    def end_write(self, version: int, pace: float = 0.0) -> None:
        with self.board.lock:
            self.version, self.writing = version, False
            self.board.pace = pace
            self.board.lock.notify_all()

    def give(self, worker: int, runs: list[tuple[int, ...]]) -> None:
        self.board.orders.setdefault(worker, []).append(runs)

    def tickets_drawn(self) -> int:
        return self.tickets

    def lost(self) -> set[int]:
        return set()

    def shutdown(self, code: int = 1, timeout_s: float = 60.0) -> list[int]:
        self.board.stop_code = code
        return []


class _WorkerSide:
    """WorkerShards' face over :class:`MemoryWindows` for one worker and one shard: what the
    worker orders of gem_mpi.engine.orders call."""

    backoff_s = 0.0

    def __init__(self, board: MemoryWindows, rank: int, n_params: int) -> None:
        self.board, self.rank = board, rank
        self.theta = np.empty(n_params, np.float32)

    def pull(self, into: np.ndarray | None = None) -> list[int]:
        theta, version = self.board.pull()
        (self.theta if into is None else into)[...] = theta
        return [version]

    def stop_code(self) -> int:
        return self.board.stop_code or 0

    def wait_slot_free(self) -> bool:
        """Until the master took our last message; False once the run was stopped."""
        self.board.wait_applied(self.rank)
        return self.board.stop_code is None

    def commit(self, kind: int, seq: int, versions: list[int], loss: float = 0.0,
               compute_s: float = 0.0, parts: tuple[np.ndarray, ...] = (),
               steps: int = 0) -> None:
        self.board.post(self.rank, kind, seq, versions[0], parts, loss, compute_s, steps)

    @property
    def pace(self) -> float:
        return self.board.pace
