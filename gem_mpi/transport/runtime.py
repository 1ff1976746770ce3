"""MPI's start on every rank: mpi4py told not to initialise on import (every transport
module imports MPI from here, so the setting comes first), the thread level, the one-sided
component preferred on one node, and the collective check that this MPI can make the windows
gem_mpi needs."""

from __future__ import annotations

import datetime
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


def interface_address(name: str) -> str:
    """The IPv4 address of network interface ``name`` (``ip -4 -o addr show``), or a one-line
    UsageError."""
    import subprocess

    from gem_mpi.errors import UsageError

    out = subprocess.run(["ip", "-4", "-o", "addr", "show", "dev", name], capture_output=True,
                         text=True, check=False).stdout.split()
    if "inet" not in out:
        raise UsageError(f"--interface {name}: no such interface with an IPv4 address on "
                         "this node (ip -4 addr lists them)")
    return out[out.index("inet") + 1].split("/")[0]


def job_address(comm: MPI.Intracomm, interface: str | None) -> tuple[str, str | None]:
    """Collective: (the address rank 0 listens on and advertises, the interface gloo's own
    sockets bind to). Every rank on one node: loopback, reachable from the node alone; across
    nodes: ``--interface``'s, else MASTER_ADDR, else the address of rank 0's host name."""
    import socket

    if node_count(comm) == 1 and interface is None:
        return "127.0.0.1", "lo"
    addr = None
    if comm.Get_rank() == 0:
        addr = (interface_address(interface) if interface else os.environ.get("MASTER_ADDR")
                or socket.gethostbyname(socket.gethostname()))
    return comm.bcast(addr, root=0), interface


def process_group(comm: MPI.Intracomm, backend: str, timeout: datetime.timedelta,
                  interface: str | None, local: bool = False) -> None:
    """Collective: a torch.distributed process group over ``comm``'s ranks, its store on rank 0
    listening on the job's address alone (``job_address``; ``local``: loopback, for ranks
    known to share a node), on a socket bound once and handed to the store (no free port
    found by binding and releasing one: another process could take it in between). gloo's
    own sockets bind to the same interface (GLOO_SOCKET_IFNAME)."""
    import socket

    import torch.distributed as dist

    addr, ifname = ("127.0.0.1", "lo") if local else job_address(comm, interface)
    if ifname and "GLOO_SOCKET_IFNAME" not in os.environ:
        os.environ["GLOO_SOCKET_IFNAME"] = ifname
    listener, port = None, None
    if comm.Get_rank() == 0:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind((addr, 0))
        listener.listen(max(128, comm.Get_size()))
        port = listener.getsockname()[1]
    port = comm.bcast(port, root=0)
    store = dist.TCPStore(addr, port, comm.Get_size(), comm.Get_rank() == 0, timeout=timeout,
                          wait_for_workers=False,
                          master_listen_fd=None if listener is None else listener.fileno())
    dist.init_process_group(backend, store=store, rank=comm.Get_rank(),
                            world_size=comm.Get_size(), timeout=timeout)
