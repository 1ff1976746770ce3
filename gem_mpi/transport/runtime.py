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
# segment, about 15 times rdma's on one node (docs/PERFORMANCE.md, "What each stack costs").
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

    Seen refusals, each ``MPI_ERR_WIN`` from ``Win.Allocate`` on every rank: Open MPI's
    ``osc rdma`` over ``btl tcp`` (also what a job across nodes over TCP gets by default),
    and ``--mca osc sm`` in a job across nodes (sm serves one node's ranks only)."""
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
    nodes = node_count(comm)
    vendor, version = MPI.get_vendor()
    stack = f"{vendor} {'.'.join(map(str, version))}"
    see = "see docs/ARCHITECTURE.md, \"Working MPI configuration\""
    chosen = os.environ.get("OMPI_MCA_osc", "")
    if nodes > 1 and not chosen.startswith("^") and "sm" in chosen.split(","):
        return (f"{stack}: --mca osc sm serves the ranks of one node only, and this job "
                f"spans {nodes} nodes: use --mca osc pt2pt over TCP, or --mca osc ucx with "
                f"UCX; {see}")
    return (f"{stack} cannot create the one-sided windows gem_mpi needs ({errors[0]}); "
            f"with Open MPI over TCP (across nodes too) use --mca osc pt2pt (osc rdma "
            f"needs shared memory or UCX); {see}")


def thread_check(comm: MPI.Intracomm) -> str | None:
    """Collective: None when every rank's MPI gave at least FUNNELED, else one line for rank
    0 to print before exit 2. ``--worker-mode overlap`` computes on a second thread while the
    thread that started MPI (the only one that calls it) commits and pulls: FUNNELED is
    enough, and every stack the tests cover gives it."""
    provided = comm.allgather(MPI.Query_thread())
    if min(provided) >= MPI.THREAD_FUNNELED:
        return None
    vendor, version = MPI.get_vendor()
    return (f"{vendor} {'.'.join(map(str, version))} gives MPI_THREAD_SINGLE only, and "
            "--worker-mode overlap computes on a second thread beside the one that calls MPI "
            "(it needs MPI_THREAD_FUNNELED): use --worker-mode pipelined")


def node_count(comm: MPI.Intracomm) -> int:
    """Collective: how many nodes the job spans, as MPI's shared-memory split sees them."""
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return comm.allreduce(1 if node.Get_rank() == 0 else 0)
    finally:
        node.Free()


def rendezvous(comm: MPI.Intracomm, local: bool) -> tuple[str, int]:
    """Collective: an address and a free port on ``comm``'s rank 0, for a torch.distributed
    process group over ``comm``'s ranks (``local``: every rank on rank 0's node, so loopback;
    else ``MASTER_ADDR`` if set, or rank 0's host's address). No launcher of its own needed."""
    import os
    import socket

    addr = port = None
    if comm.Get_rank() == 0:
        addr = "127.0.0.1" if local else (os.environ.get("MASTER_ADDR")
                                          or socket.gethostbyname(socket.gethostname()))
        with socket.socket() as probe:  # a free port: bound, read, released
            probe.bind(("", 0))
            port = probe.getsockname()[1]
    return comm.bcast((addr, port), root=0)
