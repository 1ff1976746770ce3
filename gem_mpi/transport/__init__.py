"""MPI one-sided transport between the workers and the master on rank 0.

:mod:`.idioms` holds one small class per RMA idiom, each owning its window on rank 0;
:mod:`.endpoints` composes them into the master's and the workers' view. MPI starts only when
:func:`start_mpi` is called (importing this package does not initialise it), with the thread
level the run needs.
"""

from __future__ import annotations

import time

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
        MPI.Init_thread(THREAD_LEVELS[thread_level])
    return MPI.COMM_WORLD


class Backoff:
    """Exponential sleep for idle polling: spinning ranks steal the cores that do the work."""

    def __init__(self, first: float = 50e-6, limit: float = 5e-3) -> None:
        self.first = first
        self.limit = limit
        self.delay = 0.0
        self.slept = 0.0  # seconds spent in wait(), for the time splits

    def reset(self) -> None:
        self.delay = 0.0

    def wait(self) -> None:
        self.delay = self.first if self.delay == 0.0 else min(self.delay * 2.0, self.limit)
        t = time.perf_counter()
        time.sleep(self.delay)
        self.slept += time.perf_counter() - t


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
