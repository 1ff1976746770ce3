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

    ``rounds``: how many times each call enters the progress engine. MPICH 4.0 (Debian's
    ch4:ucx) serves every RMA operation on rank 0's windows as an active message that rank 0
    handles in its progress engine, one piece per entry: a 2 MB ``Put`` took about 30
    entries, so with one entry per poke it took 30 of rank 0's wake-ups (measured,
    docs/PERFORMANCE.md, "MPICH"). The endpoints pass enough rounds for a whole payload on
    MPICH only: on Open MPI (``osc sm``) an entry with nothing to do costs 0.2 µs alone, but
    60 per poke cut its throughput from 142 to 96 upd/s (measured side by side).
    """

    def __init__(self, comm: MPI.Intracomm, rounds: int = 1) -> None:
        self.comm = comm.Dup()  # collective: every rank makes one, in the same order
        self._buf = bytearray(1)
        self._request = self.comm.Irecv([self._buf, MPI.BYTE], MPI.ANY_SOURCE, 0)
        self.rounds = max(1, rounds)
        self.calls = 0
        # ranks whose process died, as ULFM reports them here (--worker-loss continue): the
        # pending receive from any source fails with MPI_ERR_PROC_FAILED(_PENDING)
        self.lost: set[int] = set()

    def __call__(self) -> None:
        self.calls += 1
        test = self._request.Test
        try:
            for _ in range(self.rounds):
                test()
        except MPI.Exception as exc:
            self._failed(exc)

    def once(self) -> None:
        """One entry: between the updates of a batch, where θ is being written and every
        microsecond rank 0 spends makes a concurrent pull read again."""
        self.calls += 1
        try:
            self._request.Test()
        except MPI.Exception as exc:
            self._failed(exc)

    def _failed(self, exc: MPI.Exception) -> None:
        """A process failure (ULFM): acknowledge it, so that the receive goes on, and note
        the ranks lost; any other error is raised."""
        if exc.Get_error_class() not in (MPI.ERR_PROC_FAILED, MPI.ERR_PROC_FAILED_PENDING):
            raise exc
        self.comm.Ack_failed()
        failed = self.comm.Get_failed()
        try:
            own = MPI.Group.Translate_ranks(failed, list(range(failed.Get_size())),
                                            self.comm.Get_group())
        finally:
            failed.Free()
        self.lost.update(int(r) for r in own)

    def free(self) -> None:
        if self.comm != MPI.COMM_NULL:
            self._request.Cancel()
            self._request.Wait()
            self.comm.Free()


def complete(request: MPI.Request, backoff: Backoff) -> None:
    """Wait for an RMA request without spinning inside MPI.

    A blocking ``Flush`` spins in the progress engine until the target answers; on MPICH 4.0
    that is rank 0's next wake-up, and four workers spinning on two cores took the CPU from
    the workers computing and from rank 0 itself (docs/PERFORMANCE.md, "MPICH"). Testing
    the operation's request and sleeping between tests leaves the core to them. Where the
    operation completes at once (Open MPI's ``osc sm``) the first test returns true."""
    if request.Test():
        return
    backoff.reset()
    while not request.Test():
        backoff.wait()


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
