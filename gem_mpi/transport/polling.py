"""Waiting without spinning: exponential back-off, the poke that makes MPI progress on rank 0
while it waits, and a barrier that sleeps."""

from __future__ import annotations

import time
from collections.abc import Callable

from gem_mpi.transport.runtime import MPI


class Backoff:
    """Exponential sleep for idle polling: spinning ranks steal the cores that do the work.

    ``progress``, if given, is called before each sleep: rank 0 passes its endpoint's
    ``progress`` so that it enters MPI at least once per ``limit`` while idle (see
    :class:`ProgressPoke`)."""

    def __init__(self, first: float = 50e-6, limit: float = 5e-3,
                 progress: Callable[[], object] | None = None) -> None:
        self.first = first
        self.limit = limit
        self.progress = progress
        self.delay = 0.0
        self.slept = 0.0  # seconds spent in wait(), for the time splits

    def reset(self) -> None:
        self.delay = 0.0

    def wait(self) -> None:
        if self.progress is not None:
            self.progress()
        self.delay = self.first if self.delay == 0.0 else min(self.delay * 2.0, self.limit)
        t = time.perf_counter()
        time.sleep(self.delay)
        self.slept += time.perf_counter() - t


class ProgressPoke:
    """Make MPI progress on rank 0 without waiting for anything.

    Every window lives on rank 0, and on most stacks a worker's ``Get``, ``Put`` or atomic on
    it completes only when rank 0 enters MPI's progress engine: measured here, with the
    master asleep between polls, Open MPI's ``osc ucx`` and MPICH 4.0 (ch4) hang forever,
    every worker inside its first ``Flush``. ``Win.Sync`` (rank 0's poll) does not progress
    on either; ``Win.Flush`` on its own windows does on MPICH but not on ``osc ucx``;
    ``Iprobe`` does under ``pml ob1`` and MPICH but not under ``pml ucx`` (it progresses only
    the pml's own UCX worker, not the one-sided component's). Testing a pending request
    enters the whole progress engine everywhere (Open MPI's request test calls
    ``opal_progress``, which drives every component), so the call is ``Test`` on a receive
    that never completes, posted on a private duplicate of the communicator on which nothing
    is ever sent: it can never match or disturb another message. Where workers' RMA needs
    no help (Open MPI's ``osc rdma`` over shared memory) it costs 0.2 µs a call.
    """

    def __init__(self, comm: MPI.Intracomm) -> None:
        self.comm = comm.Dup()  # collective: every rank makes one, in the same order
        self._buf = bytearray(1)
        self._request = self.comm.Irecv([self._buf, MPI.BYTE], MPI.ANY_SOURCE, 0)
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1
        self._request.Test()

    def free(self) -> None:
        if self.comm != MPI.COMM_NULL:
            self._request.Cancel()
            self._request.Wait()
            self.comm.Free()


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
