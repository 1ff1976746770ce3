"""MPI one-sided transport between the workers and the master on rank 0.

Only re-exports. :mod:`.runtime` starts MPI (importing this package does not initialise it)
with the thread level the run needs and checks that it can make the windows; :mod:`.polling`
waits without spinning (back-off, the poke that makes MPI progress on rank 0, a sleeping
barrier); :mod:`.idioms` holds one small class per RMA idiom, each owning its window on rank
0; :mod:`.endpoints` composes them into the master's and the workers' view. What the messages
mean is :mod:`gem_mpi.protocol`.
"""

from __future__ import annotations

from gem_mpi.transport.polling import Backoff, ProgressPoke, soft_barrier
from gem_mpi.transport.runtime import (
    MASTER,
    MPI,
    THREAD_LEVELS,
    prefer_shared_memory_windows,
    start_mpi,
    thread_check,
    window_check,
)

__all__ = ["MASTER", "MPI", "THREAD_LEVELS", "Backoff", "ProgressPoke",
           "prefer_shared_memory_windows", "soft_barrier", "start_mpi", "thread_check",
           "window_check"]
