"""MPI's start on every rank: mpi4py told not to initialise on import (every transport
module imports MPI from here, so the setting comes first), the thread level, the one-sided
component preferred on one node, and the collective check that this MPI can make the windows
gem_mpi needs."""

from __future__ import annotations

import os

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
