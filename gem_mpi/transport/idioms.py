"""One class per RMA idiom, each owning one window that lives on rank 0.

Every window is made with ``Win.Allocate`` (Open MPI progresses atomics without the target
calling MPI only on such windows); rank 0 holds the memory, every other rank contributes zero
bytes. Windows are allocated collectively, so every rank must construct the same idioms in
the same order (the endpoints do). Rank 0 reads and writes its own memory through numpy
views; ``Win.Sync`` inside its passive epoch is the memory barrier that makes the workers'
Puts and atomics visible to it, and its stores visible to them.

Rank 0 zeroes its fresh memory, which is also its first touch (Linux places a page on the
NUMA node of the thread that first writes it): the float arrays the master's kernel streams
(θ, the mailboxes' payloads) are zeroed by a ``zero`` function the master gives, the kernel's
own threads each zeroing the range it will stream (:meth:`gem_mpi.algorithm.kernel.Kernel.zero`);
everything else, and everything without one, by numpy on the calling thread.

Working configuration (Open MPI 4.1, mpi4py 4.1): 8-byte ``Compare_and_swap`` is never used
(it crashed rank 0 on ``Allocate`` windows in Open MPI 4.1.4); every atomic is a
``Fetch_and_op`` (as its request-based form ``Rget_accumulate``) followed by a ``Flush``
where it changes the word.

A mailbox message's parts are arrays of any dtype (float32; uint16 bf16 bits with ``--wire
bf16``): :meth:`Mailbox.post` puts each part's bytes at the next 4-byte boundary of the slot
and counts its length as ceil(nbytes / 4) floats, so an odd number of uint16 leaves two
bytes of padding (not written, never read) and the parts' float offsets are the ones
:class:`gem_mpi.protocol.UpdatePayload` gives.

A worker waits for each of its operations on a request, sleeping between tests
(:func:`~gem_mpi.transport.polling.complete`), never inside a blocking ``Flush`` while the
target may not have served it: on MPICH 4.0 every operation waits for rank 0's next progress
call, and workers spinning meanwhile took the cores from the others. The one ``Flush`` left
per change (after the request completed) finds it done, or waits only for its
acknowledgement.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence

import numpy as np

from gem_mpi.transport.polling import Backoff, complete
from gem_mpi.transport.runtime import MASTER, MPI

HEADER_BYTES = 64

# A mailbox message's header: 64 bytes, read on rank 0 as one record (steps: the local steps
# an update took, which --dylu varies; 0 in a sign-off)
HEADER = np.dtype([("rank", "<i8"), ("seq", "<i8"), ("version", "<i8"), ("kind", "<i8"),
                   ("nfloats", "<i8"), ("loss", "<f8"), ("compute_s", "<f8"),
                   ("steps", "<i8")])
assert HEADER.itemsize == HEADER_BYTES


def _bytes(a: np.ndarray) -> list:
    """An MPI buffer spec of raw bytes, so origin and target signatures always match."""
    return [a.reshape(-1).view(np.uint8), MPI.BYTE]


def _floats(part: np.ndarray) -> int:
    """Float32 slots a message part takes: ceil(nbytes / 4) (a uint16 part of odd length
    ends with two bytes of padding)."""
    return (part.nbytes + 3) // 4


Zero = Callable[[np.ndarray], None]  # zeroes a fresh 1-D float32 array where it is streamed


def rma_backoff() -> Backoff:
    """A worker's sleep between tests of an RMA request: short, since rank 0 serves requests
    within its own idle back-off (at most MasterEndpoint.IDLE_LIMIT apart)."""
    return Backoff(first=5e-6, limit=100e-6)


class _Window:
    """A window of ``nbytes`` on rank 0, in one shared passive epoch for the whole run."""

    def __init__(self, comm: MPI.Intracomm, nbytes: int, disp_unit: int,
                 first_touch: Callable[[np.ndarray], None] | None = None) -> None:
        self.is_master = comm.Get_rank() == MASTER
        self.win = MPI.Win.Allocate(nbytes if self.is_master else 0, disp_unit, comm=comm)
        # mpi4py's buffer has the buffer protocol, which its stubs do not declare
        self.memory = (np.frombuffer(self.win.tomemory(), dtype=np.uint8)  # type: ignore[call-overload]
                       if self.is_master
                       else np.zeros(0, np.uint8))
        if self.is_master and first_touch is not None:
            first_touch(self.memory)  # zeroes all of it, in its own way
        else:
            self.memory[:] = 0
        self._opened = self._freed = False

    def open(self) -> None:
        self.win.Lock(MASTER, MPI.LOCK_SHARED)
        self._opened = True

    def free(self) -> None:
        if not self._freed:
            self._freed = True
            if self._opened:
                self.win.Unlock(MASTER)
            self.win.Free()


class _Cell(_Window):
    """One int64 on rank 0, read and changed by workers with atomics."""

    def __init__(self, comm: MPI.Intracomm, value: int = 0) -> None:
        super().__init__(comm, 8, 8)
        self.local = self.memory.view(np.int64)  # rank 0's own view
        if self.is_master:
            self.local[0] = value
        self._operand = np.zeros(1, np.int64)
        self._result = np.zeros(1, np.int64)
        self._wait = rma_backoff()

    def _fetch_and_op(self, operand: int, op: MPI.Op) -> int:
        """The word before ``op``; the change (unless NO_OP) completed at rank 0."""
        self._operand[0] = operand
        complete(self.win.Rget_accumulate(self._operand, self._result, MASTER, 0, op),
                 self._wait)
        if op != MPI.NO_OP:
            self.win.Flush(MASTER)
        return int(self._result[0])

    def read_local(self) -> int:
        self.win.Sync()
        return int(self.local[0])


class TicketCounter(_Cell):
    """A global counter: each draw returns a distinct number, in the order of the draws."""

    def draw(self) -> int:
        return self._fetch_and_op(1, MPI.SUM)

    def drawn(self) -> int:
        """Rank 0: the tickets drawn so far."""
        return self.read_local()


class StopWord(_Cell):
    """Rank 0's word to every worker: 0 while the run goes on, else how it ended."""

    def say(self, code: int) -> None:
        self.local[0] = code
        self.win.Sync()

    def heard(self) -> int:
        return self._fetch_and_op(0, MPI.NO_OP)


class VersionedArray(_Window):
    """A float32 array with a version number, published by rank 0 and read by workers, where
    neither side ever waits for the other.

    Rank 0 writes under a sequence word (a seqlock): odd while a write is in progress, even
    and one higher after it. A reader gets the header, then the data, then the header again,
    each completed before the next starts; equal even words mean no write overlapped the
    data, else it reads again. No MPI lock is taken on the data path: a worker that dies or
    hangs in the middle of a read holds nothing, so rank 0 never blocks on it (it did inside
    ``Win.Lock`` when θ was written under an exclusive lock), and MPICH, which messages the
    target for every lock, is spared two round trips per pull.

    A reader that failed once raises the ``wanted`` word (an atomic) until it has read; rank
    0 holds back its next write while it is raised, up to ``hold_s``, so a reader cannot be
    starved by back-to-back writes, and a dead reader costs at most ``hold_s`` per write.
    """

    # header: int64 words at these byte offsets, and a float64 one: a value rank 0 publishes
    # with θ (--dylu: the fastest worker's seconds per local step), valid as the θ read is
    _SEQ, _VERSION, _WANTED, _PACE = 0, 8, 16, 24

    def __init__(self, comm: MPI.Intracomm, n: int, hold_s: float = 20e-3,
                 zero: Zero | None = None, into: np.ndarray | None = None) -> None:
        """``into``: a reader's own float32 buffer of ``n`` to read θ into (a GPU worker's
        page-locked one, so that θ's copy to the device is asynchronous DMA)."""
        self.nbytes = HEADER_BYTES + 4 * n
        self.hold_s = hold_s

        def first_touch(memory: np.ndarray, zero: Zero) -> None:
            zero(memory[HEADER_BYTES:].view(np.float32))  # θ, by the kernel's threads
            memory[:HEADER_BYTES] = 0

        super().__init__(comm, self.nbytes, 1, None if zero is None else
                         functools.partial(first_touch, zero=zero))
        self._header = np.zeros(HEADER_BYTES // 8, np.int64)
        if self.is_master:
            self._words = self.memory[:HEADER_BYTES].view(np.int64)
            self._reals = self.memory[:HEADER_BYTES].view(np.float64)
            self.data = self.memory[HEADER_BYTES:].view(np.float32)
            self._backoff = Backoff(first=5e-6, limit=200e-6)
            self.held_s = 0.0  # seconds rank 0 held writes back for a reader
        else:
            if into is not None and (into.dtype != np.float32 or into.shape != (n,)
                                     or not into.flags.c_contiguous):
                raise ValueError(f"a reader's buffer must be {n} contiguous float32")
            self.data = np.empty(n, dtype=np.float32) if into is None else into
            self._again = np.zeros(HEADER_BYTES // 8, np.int64)
            self._operand = np.zeros(1, np.int64)
            self._result = np.zeros(1, np.int64)
            self._wait = rma_backoff()
            self._again_wait = rma_backoff()  # between a failed read and the next
            self.retries = 0  # reads that overlapped a write and were done again
            self.pace = 0.0  # the float word published with the θ last read

    # rank 0
    def set(self, values: np.ndarray, version: int) -> None:
        """The initial value, before the window is opened (no reader can look yet)."""
        self.data[:] = values
        self._words[self._VERSION // 8] = version

    def begin_write(self, progress: Callable[[], object] | None = None) -> None:
        """No read that overlaps what is written until end_write is taken as valid."""
        words = self._words
        self.win.Sync()
        # a reader's -1 after forget_readers: even again (stored only then: a store every
        # write would race the readers' atomics on the word)
        if words[self._WANTED // 8] < 0:  # noqa: PLR1730
            words[self._WANTED // 8] = 0
        if words[self._WANTED // 8] > 0:  # a reader failed: let it through first
            t0 = time.perf_counter()
            self._backoff.reset()
            while words[self._WANTED // 8] > 0 and time.perf_counter() - t0 < self.hold_s:
                if progress is not None:
                    progress()
                self._backoff.wait()
                self.win.Sync()
            self.held_s += time.perf_counter() - t0
        words[self._SEQ // 8] += 1  # odd: writing
        self.win.Sync()

    def forget_readers(self) -> None:
        """Rank 0, after a reader's process died: a read it had failed would hold every
        write back by hold_s for good, so the wanted word starts again from 0 (a live
        reader that failed just then goes without its turn once: its -1 is undone by
        the next write)."""
        self.win.Sync()
        self._words[self._WANTED // 8] = 0
        self.win.Sync()

    def end_write(self, version: int, pace: float = 0.0) -> None:
        """θ's ``version`` is written; ``pace``: the float word readers get with it."""
        words = self._words
        self.win.Sync()  # the data before the word that validates it
        words[self._VERSION // 8] = version
        self._reals[self._PACE // 8] = pace
        words[self._SEQ // 8] += 1  # even: a consistent state
        self.win.Sync()

    # workers
    def _get(self, buffer: np.ndarray, offset: int, nbytes: int) -> None:
        """Complete when it returns (the request of an Rget completes with its data)."""
        complete(self.win.Rget(_bytes(buffer), MASTER, (offset, nbytes, MPI.BYTE)),
                 self._wait)

    def _want(self, delta: int) -> None:
        self._operand[0] = delta
        complete(self.win.Rget_accumulate(self._operand, self._result, MASTER, self._WANTED,
                                          MPI.SUM), self._wait)
        self.win.Flush(MASTER)

    def read(self, into: np.ndarray | None = None) -> int:
        """Copy θ into ``self.data`` (or ``into``, another buffer like it: a worker that
        computes on one θ while it pulls the next), never torn; returns its version.

        After a failed read it sleeps (5 µs, doubling to 100 µs) before the next: rank 0 is
        in the middle of a write, and a reader spinning on the header would take the core
        from it wherever ranks share cores (measured: hundreds of header reads per pull with
        4 workers and rank 0 on 2 cores)."""
        head, again, wanted = self._header, self._again, False
        data = self.data if into is None else into
        if data.nbytes != self.nbytes - HEADER_BYTES:
            raise ValueError("a pull's buffer must be as long as θ")
        self._again_wait.reset()
        while True:
            self._get(head, 0, HEADER_BYTES)
            seq = int(head[self._SEQ // 8])
            if seq % 2 == 0:
                self._get(data, HEADER_BYTES, self.nbytes - HEADER_BYTES)
                self._get(again, 0, HEADER_BYTES)
                if int(again[self._SEQ // 8]) == seq:
                    break
            self.retries += 1
            if not wanted:
                wanted = True
                self._want(1)
            self._again_wait.wait()
        if wanted:
            self._want(-1)
        self.pace = float(head.view(np.float64)[self._PACE // 8])
        return int(head[self._VERSION // 8])


class Roll(_Window):
    """One word per worker, set when it leaves: rank 0 frees the windows (a collective every
    rank must join) only once every worker has signed, and can name those that have not."""

    def __init__(self, comm: MPI.Intracomm, n_workers: int) -> None:
        super().__init__(comm, 8 * n_workers, 8)
        self.words = self.memory.view(np.int64)
        self._one = np.ones(1, np.int64)
        self._result = np.zeros(1, np.int64)

    def sign(self, worker: int) -> None:
        """Worker ``worker`` (1..n) leaves now."""
        self.win.Fetch_and_op(self._one, self._result, MASTER, worker - 1, MPI.REPLACE)
        self.win.Flush(MASTER)

    def missing(self) -> list[int]:
        """Rank 0: the workers (1..n) that have not signed yet."""
        self.win.Sync()
        return [int(w) + 1 for w in np.flatnonzero(self.words == 0)]


class Orders(_Window):
    """Rank 0's orders to workers that have done their batches: more batches to train (a
    departed worker's). One record a worker: a serial number, a count, then up to
    ``RUNS`` runs of ``RUN_WORDS`` int64 (:mod:`gem_mpi.problem.elastic`'s runs). Rank 0
    writes a worker's record only while that worker waits for it (after its DONE, before it
    trains again), the runs first and the serial last; the worker reads the serial with an
    atomic and the runs once the serial moved, so it never reads a record being written."""

    RUNS, RUN_WORDS = 64, 5
    WORDS = 2 + RUNS * RUN_WORDS

    def __init__(self, comm: MPI.Intracomm, n_workers: int) -> None:
        super().__init__(comm, 8 * self.WORDS * n_workers, 8)
        self.words = self.memory.view(np.int64)
        self._operand = np.zeros(1, np.int64)
        self._result = np.zeros(1, np.int64)
        self._record = np.zeros(self.WORDS, np.int64)
        self._wait = rma_backoff()

    def give(self, worker: int, runs: Sequence[tuple[int, ...]]) -> None:
        """Rank 0: order worker ``worker`` (1..n) to train ``runs`` (at most RUNS) next."""
        if not 0 < len(runs) <= self.RUNS:
            raise ValueError(f"an order holds 1..{self.RUNS} runs, not {len(runs)}")
        record = self.words[(worker - 1) * self.WORDS:worker * self.WORDS]
        record[2:2 + self.RUN_WORDS * len(runs)] = np.asarray(runs, np.int64).reshape(-1)
        record[1] = len(runs)
        self.win.Sync()  # the runs are in place before the serial says so
        record[0] += 1
        self.win.Sync()

    def serial(self, worker: int) -> int:
        """Worker ``worker``'s orders so far (an atomic read of its record's first word)."""
        complete(self.win.Rget_accumulate(self._operand, self._result, MASTER,
                                          (worker - 1) * self.WORDS, MPI.NO_OP), self._wait)
        return int(self._result[0])

    def runs(self, worker: int) -> list[tuple[int, ...]]:
        """Worker ``worker``'s newest order (read once :meth:`serial` moved)."""
        complete(self.win.Rget(_bytes(self._record), MASTER,
                               ((worker - 1) * self.WORDS, self.WORDS * 8, MPI.BYTE)),  # disp: words
                 self._wait)
        count = int(self._record[1])
        body = self._record[2:2 + self.RUN_WORDS * count].reshape(count, self.RUN_WORDS)
        return [tuple(int(v) for v in row) for row in body]


class Message:
    """A message rank 0 took out of a mailbox slot: its header and its payload (a view into
    the slot, valid until the slot is released)."""

    __slots__ = ("header", "payload", "slot", "ticket")
    # HEADER's fields, read through __getattr__ (declared, not stored: their types)
    rank: int
    seq: int
    version: int
    kind: int
    nfloats: int
    loss: float
    compute_s: float
    steps: int

    def __init__(self, slot: int, ticket: int, header: np.void, payload: np.ndarray) -> None:
        self.slot, self.ticket, self.header, self.payload = slot, ticket, header, payload

    def __getattr__(self, name: str) -> object:  # rank, seq, version, kind, loss, compute_s
        return self.header[name].item()


class Mailbox:
    """One slot per worker (header + payload) and one ready flag per slot.

    A post is: ``Put`` header and payload into the own slot, ``Flush``, draw a ticket, then
    publish ``ticket + 1`` in the ready flag. Because the ticket is drawn only once the
    payload is complete, ticket order is the order in which messages became ready; rank 0
    takes the ready slots lowest ticket first. A worker posts again only once rank 0 has
    released its slot (flag back to 0). Rank 0 checks each message's length on arrival.

    ``kept``, a float range [lo, hi) of the payload area, is rank 0's own part of every slot
    (:data:`kept`, one row per slot): rank 0 writes it while it applies a message (GEM's s
    under ``--gem-shift paper``, see :mod:`gem_mpi.protocol`), a release leaves it as it is,
    a post that ends at ``lo`` leaves it untouched, and a full post sets it (a worker's
    first s).

    ``zero`` (rank 0) zeroes each ``stream`` floats of a payload (Δθ, κ|m|, s: the arrays
    the kernel reads, and the kept s it writes) as the kernel will stream them.
    """

    def __init__(self, comm: MPI.Intracomm, n_slots: int, payload_floats: int,
                 kept: tuple[int, int] | None = None, zero: Zero | None = None,
                 stream: int = 0) -> None:
        self.n_slots, self.payload_floats = n_slots, payload_floats
        if kept is not None and not 0 <= kept[0] <= kept[1] <= payload_floats:
            raise ValueError(f"kept range {kept} outside the slot's {payload_floats} floats")
        self.kept_span = kept
        self.slot_bytes = (HEADER_BYTES + 4 * payload_floats + 63) // 64 * 64
        self._flags = _Window(comm, 8 * n_slots, 8)  # int64 cells, one per slot
        streams = payload_floats // stream if zero is not None and stream > 0 else 0

        def first_touch(memory: np.ndarray, zero: Zero) -> None:
            slots = memory.reshape(n_slots, self.slot_bytes)
            for slot in slots:
                for k in range(streams):
                    lo = HEADER_BYTES + 4 * k * stream
                    zero(slot[lo:lo + 4 * stream].view(np.float32))
            slots[:, :HEADER_BYTES] = 0
            slots[:, HEADER_BYTES + 4 * streams * stream:] = 0  # a DONE's tail, the padding

        self._slots = _Window(comm, self.slot_bytes * n_slots, 1, None if zero is None or not
                              streams else functools.partial(first_touch, zero=zero))
        self._one = np.zeros(1, np.int64)
        self._result = np.zeros(1, np.int64)
        self._wait = rma_backoff()
        self.kept: np.ndarray | None = None  # rank 0: the kept part of every slot, a view
        if self._flags.is_master:
            self.flags = self._flags.memory.view(np.int64)
            slots = self._slots.memory.reshape(n_slots, self.slot_bytes)
            self._headers = slots[:, :HEADER_BYTES]
            self.payloads = slots[:, HEADER_BYTES:HEADER_BYTES + 4 * payload_floats].view(
                np.float32)
            if kept is not None:
                self.kept = self.payloads[:, kept[0]:kept[1]]
            self._snap = np.zeros(n_slots, np.int64)
        else:
            self._header = np.zeros(1, HEADER)

    def open(self) -> None:
        self._flags.open()
        self._slots.open()

    def free(self) -> None:
        self._slots.free()
        self._flags.free()

    # rank 0
    def ready(self) -> np.ndarray:
        """Slots holding a message, lowest ticket first (decided on one snapshot)."""
        self._flags.win.Sync()
        self._slots.win.Sync()
        snap = self.flags.copy()  # workers keep writing
        idx = np.flatnonzero(snap)
        if idx.size > 1:
            idx = idx[np.argsort(snap[idx], kind="stable")]
        self._snap = snap
        return idx

    def take(self, slot: int, lengths: dict[int, tuple[int, ...]]) -> Message:
        """The message in a ready slot; its length must be one its kind may carry
        (``lengths``: kind -> allowed lengths; other kinds carry nothing)."""
        header = self._headers[slot].view(HEADER)[0].copy()
        want = lengths.get(int(header["kind"]), (0,))
        if int(header["nfloats"]) not in want:
            raise RuntimeError(f"corrupt message in mailbox slot {slot}: kind "
                               f"{int(header['kind'])} with {int(header['nfloats'])} floats, "
                               f"expected {' or '.join(map(str, want))}")
        return Message(slot, int(self._snap[slot]) - 1, header, self.payloads[slot])

    def release(self, slots: np.ndarray | list[int]) -> None:
        """Mark slots free once their messages have been consumed."""
        self.flags[slots] = 0
        self._flags.win.Sync()

    # workers
    def is_free(self, slot: int) -> bool:
        self._one[0] = 0
        complete(self._flags.win.Rget_accumulate(self._one, self._result, MASTER, slot,
                                                 MPI.NO_OP), self._wait)
        return int(self._result[0]) == 0

    def post(self, slot: int, counter: TicketCounter, parts: tuple[np.ndarray, ...],
             **fields: float) -> int:
        """Deposit one message in ``slot`` and publish it with a fresh ticket; returns it."""
        h = self._header
        for name, value in fields.items():
            h[name] = value
        h["nfloats"] = sum(_floats(p) for p in parts)
        if h["nfloats"][0] > self.payload_floats:
            raise ValueError("payload larger than the mailbox slot")
        win, disp = self._slots.win, slot * self.slot_bytes
        puts = [win.Rput(_bytes(h), MASTER, (disp, HEADER_BYTES, MPI.BYTE))]
        offset = disp + HEADER_BYTES
        for part in parts:  # buffers stay referenced by the caller until the Flush below
            puts.append(win.Rput(_bytes(part), MASTER, (offset, part.nbytes, MPI.BYTE)))
            offset += 4 * _floats(part)  # the next part at a 4-byte boundary
        for put in puts:  # sent (not yet known to have arrived): sleeping, not spinning
            complete(put, self._wait)
        win.Flush(MASTER)  # arrived: only then is the message given a ticket
        ticket = counter.draw()
        self._one[0] = ticket + 1
        complete(self._flags.win.Rget_accumulate(self._one, self._result, MASTER, slot,
                                                 MPI.REPLACE), self._wait)
        self._flags.win.Flush(MASTER)
        return ticket


__all__ = ["HEADER", "Backoff", "Mailbox", "Message", "Roll", "StopWord", "TicketCounter",
           "VersionedArray", "Zero"]
