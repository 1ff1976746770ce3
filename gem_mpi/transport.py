"""One-sided MPI transport between the workers and the master on rank 0.

Three windows live on rank 0 (every other rank contributes zero bytes), all made with
``Win.Allocate`` because Open MPI progresses atomics without the target calling MPI only on
such windows:

* ``ctrl`` (int64 cells): the ticket counter, the shutdown flag and one *ready flag* per worker.
  A ready flag holds ``ticket + 1`` while the worker's inbox slot holds an unapplied message,
  ``0`` when the slot is free.
* ``params``: a 64-byte header (the version counter) followed by the central parameters θ
  (float32). The master writes it only while holding an exclusive lock on its own window;
  workers ``Get`` header and θ in one operation under a shared lock, so a pull is never a
  torn mixture of two versions.
* ``inbox``: one slot per worker, a 64-byte header followed by the payload floats.

A commit is: wait until the own slot is free, ``Put`` header and payload, ``Flush``, draw a
ticket with ``Fetch_and_op`` on the counter, then publish ``ticket + 1`` in the ready flag.
Because the ticket is drawn only once the payload is complete, ticket order is the order in
which updates became ready; the master always serves the lowest ready ticket, so a worker
waits behind at most the ``n - 1`` updates that were ready before its own (no starvation,
unlike rank-order polling).

Working configuration (Open MPI 4.1, mpi4py 4.1), also recorded in docs/ARCHITECTURE.md:
MPI is initialised with ``MPI_THREAD_FUNNELED`` (the ``pt2pt`` one-sided component refuses
windows under ``MPI_THREAD_MULTIPLE``, mpi4py's default); 8-byte ``Compare_and_swap`` is
never used (it crashes rank 0 on ``Allocate`` windows in Open MPI 4.1.4); idle ranks back off
exponentially instead of spinning, which matters when ranks outnumber cores.
``--method sync`` makes no window and runs Horovod, whose background thread calls MPI beside
the main thread: train.py then asks for ``MPI_THREAD_MULTIPLE`` through
``GEM_MPI_THREAD_LEVEL``, read here before MPI starts.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import mpi4py
import numpy as np

mpi4py.rc.thread_level = os.environ.get("GEM_MPI_THREAD_LEVEL", "funneled")
from mpi4py import MPI

MASTER = 0
HEADER_BYTES = 64

# ctrl window cells (int64)
CTRL_TICKET = 0
CTRL_SHUTDOWN = 1
CTRL_FLAGS = 8  # ready flag of worker w is cell CTRL_FLAGS + w - 1

# message kinds
KIND_UPDATE = 1
KIND_DONE = 2

# slot header: int64 fields, then float64 fields (8 cells of 8 bytes in all)
H_RANK, H_SEQ, H_VERSION, H_KIND, H_NFLOATS = 0, 1, 2, 3, 4
H_LOSS, H_COMPUTE_S = 5, 6

SHUTDOWN_OK = 1
SHUTDOWN_ABORT = 2
SHUTDOWN_STOP = 3  # stopped early (signal): workers leave without their DONE message


class Backoff:
    """Exponential sleep for idle polling: spinning ranks steal the cores that do the work."""

    def __init__(self, first: float = 50e-6, limit: float = 5e-3) -> None:
        self.first = first
        self.limit = limit
        self.delay = 0.0

    def reset(self) -> None:
        self.delay = 0.0

    def wait(self) -> None:
        self.delay = self.first if self.delay == 0.0 else min(self.delay * 2.0, self.limit)
        time.sleep(self.delay)


def soft_barrier(comm: MPI.Intracomm, limit: float = 10e-3) -> None:
    """A barrier that sleeps while it waits.

    Open MPI's blocking collectives poll at full speed; when 101 ranks share 2 cores and some
    are still importing torch, the early ones would take the CPU from the late ones. Use it
    before any collective that follows slow, uneven work.
    """
    request = comm.Ibarrier()
    backoff = Backoff(limit=limit)
    while not request.Test():
        backoff.wait()


@dataclass(frozen=True)
class Layout:
    """Sizes every rank must agree on before the collective window allocation."""

    n_workers: int
    n_params: int
    payload_floats: int  # floats per message: n_params (Δθ) or 3 * n_params (Δθ, κ|m|, s)

    @property
    def slot_bytes(self) -> int:
        raw = HEADER_BYTES + 4 * self.payload_floats
        return (raw + 63) // 64 * 64

    @property
    def params_bytes(self) -> int:
        return HEADER_BYTES + 4 * self.n_params


def _bytes(a: np.ndarray) -> list:
    """An MPI buffer spec of raw bytes, so origin and target signatures always match."""
    return [a.reshape(-1).view(np.uint8), MPI.BYTE]


class _Windows:
    """The three windows, allocated collectively on every rank and freed collectively."""

    def __init__(self, comm: MPI.Intracomm, layout: Layout) -> None:
        self.comm = comm
        self.layout = layout
        is_master = comm.Get_rank() == MASTER
        soft_barrier(comm)  # ranks arrive after uneven imports and data loading
        n_ctrl = CTRL_FLAGS + layout.n_workers
        self.ctrl = MPI.Win.Allocate(8 * n_ctrl if is_master else 0, 8, comm=comm)
        self.params = MPI.Win.Allocate(layout.params_bytes if is_master else 0, 1, comm=comm)
        self.inbox = MPI.Win.Allocate(
            layout.slot_bytes * layout.n_workers if is_master else 0, 1, comm=comm
        )
        self._freed = False

    def free(self) -> None:
        if not self._freed:
            self._freed = True
            for win in (self.inbox, self.params, self.ctrl):
                win.Free()


class MasterEndpoint:
    """Rank 0's view: local numpy views of its own windows, no MPI calls on the data path."""

    def __init__(self, comm: MPI.Intracomm, layout: Layout, theta0: np.ndarray,
                 version0: int = 0, ticket0: int = 0) -> None:
        self.layout = layout
        self._w = _Windows(comm, layout)
        ctrl_mem = np.frombuffer(self._w.ctrl.tomemory(), dtype=np.int64)
        ctrl_mem[:] = 0
        ctrl_mem[CTRL_TICKET] = ticket0  # a resumed run continues the ticket sequence
        self.flags = ctrl_mem[CTRL_FLAGS:]
        self._snap = np.zeros_like(self.flags)
        self._ctrl = ctrl_mem
        pmem = np.frombuffer(self._w.params.tomemory(), dtype=np.uint8)
        self._param_header = pmem[:HEADER_BYTES].view(np.int64)
        self.theta = pmem[HEADER_BYTES:].view(np.float32)
        self._param_header[:] = 0
        self._param_header[0] = version0
        self.theta[:] = theta0
        imem = np.frombuffer(self._w.inbox.tomemory(), dtype=np.uint8)
        slots = imem.reshape(layout.n_workers, layout.slot_bytes)
        self.headers_i = slots[:, :HEADER_BYTES].view(np.int64)
        self.headers_f = slots[:, :HEADER_BYTES].view(np.float64)
        pay = slots[:, HEADER_BYTES:HEADER_BYTES + 4 * layout.payload_floats]
        self.payloads = pay.view(np.float32)  # shape (n_workers, payload_floats)
        # Passive epochs on our own windows for the whole run: Sync() is then the memory
        # barrier that makes remote Puts and atomics visible to our loads and vice versa.
        self._w.ctrl.Lock(MASTER, MPI.LOCK_SHARED)
        self._w.inbox.Lock(MASTER, MPI.LOCK_SHARED)
        comm.Barrier()  # θ₀ and the zeroed flags are in place before any worker looks

    @property
    def version(self) -> int:
        return int(self._param_header[0])

    def tickets(self) -> int:
        """Tickets drawn so far (the counter's value)."""
        self._w.ctrl.Sync()
        return int(self._ctrl[CTRL_TICKET])

    def ready(self) -> np.ndarray:
        """Workers (0-based slot indices) with a message waiting, lowest ticket first."""
        self._w.ctrl.Sync()
        self._w.inbox.Sync()
        snap = self.flags.copy()  # workers keep writing; decide on one snapshot
        idx = np.flatnonzero(snap)
        if idx.size > 1:
            idx = idx[np.argsort(snap[idx], kind="stable")]
        self._snap = snap
        return idx

    def ticket_of(self, slot: int) -> int:
        return int(self._snap[slot]) - 1

    def release_all(self, slots: np.ndarray) -> None:
        """Mark slots free once their messages have been consumed."""
        self.flags[slots] = 0
        self._w.ctrl.Sync()

    def begin_write(self) -> None:
        """Exclusive lock on our own parameters: no worker Get can interleave with the write."""
        self._w.params.Lock(MASTER, MPI.LOCK_EXCLUSIVE)

    def end_write(self, version: int) -> None:
        self._param_header[0] = version
        self._w.params.Unlock(MASTER)

    def shutdown(self, code: int = SHUTDOWN_OK) -> None:
        """Tell waiting workers to leave, then free the windows with them."""
        self._ctrl[CTRL_SHUTDOWN] = code
        self._w.ctrl.Sync()
        self._w.ctrl.Unlock(MASTER)
        self._w.inbox.Unlock(MASTER)
        self._w.free()


class WorkerEndpoint:
    """A worker's view: pulls θ and commits messages into its own inbox slot on rank 0."""

    def __init__(self, comm: MPI.Intracomm, layout: Layout, poll_limit: float = 5e-3) -> None:
        self.layout = layout
        self.rank = comm.Get_rank()
        self.slot = self.rank - 1
        self._w = _Windows(comm, layout)
        self._slot_disp = self.slot * layout.slot_bytes
        self._flag_disp = CTRL_FLAGS + self.slot
        self._header = np.zeros(HEADER_BYTES // 8, dtype=np.int64)
        self._header_f = self._header.view(np.float64)
        self._one = np.ones(1, dtype=np.int64)
        self._noop = np.zeros(1, dtype=np.int64)
        self._result = np.zeros(1, dtype=np.int64)
        self._pending = False
        self._backoff = Backoff(limit=poll_limit)
        self.pull_buffer = np.empty(HEADER_BYTES // 4 + layout.n_params, dtype=np.float32)
        self.theta = self.pull_buffer[HEADER_BYTES // 4:]
        self._pull_header = self.pull_buffer[: HEADER_BYTES // 4].view(np.int64)
        # ctrl and inbox stay in one shared passive epoch for the whole run (Flush completes
        # operations); params is locked per pull so the master's exclusive lock can get in.
        self._w.ctrl.Lock(MASTER, MPI.LOCK_SHARED)
        self._w.inbox.Lock(MASTER, MPI.LOCK_SHARED)
        comm.Barrier()

    def pull(self) -> int:
        """Read the header and θ in one Get under a shared lock; returns the version."""
        win = self._w.params
        win.Lock(MASTER, MPI.LOCK_SHARED)
        win.Get(_bytes(self.pull_buffer), MASTER, (0, self.layout.params_bytes, MPI.BYTE))
        win.Unlock(MASTER)
        return int(self._pull_header[0])

    def _ctrl_read(self, cell: int) -> int:
        self._w.ctrl.Fetch_and_op(self._noop, self._result, MASTER, cell, MPI.NO_OP)
        self._w.ctrl.Flush(MASTER)
        return int(self._result[0])

    def wait_slot_free(self) -> bool:
        """Block (backing off) until the master consumed our previous message.

        Returns False instead when the master has stopped the run (it will not consume it).
        """
        if not self._pending:
            return self.stop_code() == 0
        self._backoff.reset()
        while self._ctrl_read(self._flag_disp) != 0:
            if self.stop_code():
                return False
            self._backoff.wait()
        self._pending = False
        return self.stop_code() == 0

    def stop_code(self) -> int:
        """The master's shutdown code: 0 while the run goes on."""
        return self._ctrl_read(CTRL_SHUTDOWN)

    def commit(
        self,
        kind: int,
        seq: int,
        version: int,
        loss: float = 0.0,
        compute_s: float = 0.0,
        parts: tuple[np.ndarray, ...] = (),
    ) -> int:
        """Deposit one message in our slot and publish it with a fresh ticket; returns it."""
        if self._pending and not self.wait_slot_free():
            raise RuntimeError("commit after the master stopped the run")
        h = self._header
        h[H_RANK], h[H_SEQ], h[H_VERSION], h[H_KIND] = self.rank, seq, version, kind
        h[H_NFLOATS] = sum(p.size for p in parts)
        self._header_f[H_LOSS] = loss
        self._header_f[H_COMPUTE_S] = compute_s
        if h[H_NFLOATS] > self.layout.payload_floats:
            raise ValueError("payload larger than the inbox slot")
        inbox = self._w.inbox
        inbox.Put(_bytes(h), MASTER, (self._slot_disp, HEADER_BYTES, MPI.BYTE))
        offset = self._slot_disp + HEADER_BYTES
        for part in parts:  # buffers stay referenced by the caller until the Flush below
            inbox.Put(_bytes(part), MASTER, (offset, part.nbytes, MPI.BYTE))
            offset += part.nbytes
        inbox.Flush(MASTER)
        ctrl = self._w.ctrl
        ctrl.Fetch_and_op(self._one, self._result, MASTER, CTRL_TICKET, MPI.SUM)
        ctrl.Flush(MASTER)
        ticket = int(self._result[0])
        flag = np.array([ticket + 1], dtype=np.int64)
        ctrl.Fetch_and_op(flag, self._result, MASTER, self._flag_disp, MPI.REPLACE)
        ctrl.Flush(MASTER)
        self._pending = True
        return ticket

    def wait_shutdown(self) -> int:
        """After our last message: wait, without spinning, for the master's word to leave."""
        backoff = Backoff(limit=max(self._backoff.limit, 50e-3))  # latency matters little here
        while True:
            code = self.stop_code()
            if code:
                return code
            backoff.wait()

    def close(self) -> None:
        self._w.ctrl.Unlock(MASTER)
        self._w.inbox.Unlock(MASTER)
        self._w.free()
