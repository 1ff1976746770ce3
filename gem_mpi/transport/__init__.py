"""MPI one-sided transport between the workers and the master on rank 0.

:mod:`.idioms` holds one small class per RMA idiom, each owning its window on rank 0;
:mod:`.endpoints` composes them into the master's and the workers' view. MPI starts only when
:func:`start_mpi` is called (importing this package does not initialise it), with the thread
level the run needs.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import mpi4py

mpi4py.rc.initialize = False  # start_mpi() does it, with the level the run asks for
mpi4py.rc.finalize = True
from mpi4py import MPI

MASTER = 0
THREAD_LEVELS = {"funneled": MPI.THREAD_FUNNELED, "multiple": MPI.THREAD_MULTIPLE}


def start_mpi(thread_level: str = "funneled") -> MPI.Intracomm:
    """Initialise MPI (once) and return COMM_WORLD.

    FUNNELED for the asynchronous methods: Open MPI's ``pt2pt`` one-sided component refuses
    windows under MULTIPLE. MULTIPLE for ``--method sync``, whose Horovod thread calls MPI
    beside the main thread."""
    if not MPI.Is_initialized():
        prefer_shared_memory_windows()
        MPI.Init_thread(THREAD_LEVELS[thread_level])
    return MPI.COMM_WORLD


# Open MPI's one-sided component "rdma" has priority 101, "sm" 100 (offered only when every
# rank of the window is on one node). Over shared memory, sm's Get is a memcpy from the
# segment, about 15 times rdma's here (docs/ARCHITECTURE.md, "What each stack costs").
OSC_RDMA_PRIORITY = "99"


def prefer_shared_memory_windows() -> None:
    """Before MPI starts: unless the user chose a component (``--mca osc ...``, which mpirun
    passes on as OMPI_MCA_osc) or rdma's priority, put rdma just below sm, so that a job on
    one node gets sm and a job across nodes rdma as before. Other MPIs ignore the variable."""
    if "OMPI_MCA_osc" not in os.environ:
        os.environ.setdefault("OMPI_MCA_osc_rdma_priority", OSC_RDMA_PRIORITY)


class Backoff:
    """Exponential sleep for idle polling: spinning ranks steal the cores that do the work.

    ``progress``, if given, is called before each sleep: rank 0 passes its endpoint's
    ``progress`` so that it enters MPI at least once per ``limit`` while idle (see
    :class:`Progress`)."""

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


class Progress:
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


def window_check(comm: MPI.Intracomm) -> str | None:
    """Collective: None when this MPI creates the windows gem_mpi needs, else one line that
    names the stack and what to use instead (for rank 0 to print before exit 2).

    Open MPI's ``osc rdma`` over ``btl tcp`` is the one refusal seen: every rank gets
    ``MPI_ERR_WIN`` from ``Win.Allocate``."""
    error = ""
    try:
        win = MPI.Win.Allocate(8 if comm.Get_rank() == MASTER else 0, 8, comm=comm)
    except MPI.Exception as exc:
        error = exc.Get_error_string()
    else:
        win.Free()
    errors = [e for e in comm.allgather(error) if e]
    if not errors:
        return None
    vendor, version = MPI.get_vendor()
    return (f"{vendor} {'.'.join(map(str, version))} cannot create the one-sided windows "
            f"gem_mpi needs ({errors[0]}); with Open MPI over TCP use --mca osc pt2pt "
            f"(osc rdma needs shared memory or UCX); see docs/ARCHITECTURE.md, "
            f"\"Working MPI configuration\"")


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
