"""What MPI decides per node, for tests/test_multinode.py: each rank's host name, its place
in MPI's shared-memory split (MPI_COMM_TYPE_SHARED), and the info keys of a window like
gem_mpi's (on rank 0, as gem_mpi allocates; Open MPI's osc sm names "alloc_shared_noncontig"
there, rdma "no_locks", pt2pt and ucx nothing). Rank 0 writes them as JSON to argv[1]."""

import json
import socket
import sys

from gem_mpi.transport import MPI, start_mpi

comm = start_mpi()
node = comm.Split_type(MPI.COMM_TYPE_SHARED)
win = MPI.Win.Allocate(8 if comm.Get_rank() == 0 else 0, 8, comm=comm)
info = win.Get_info()
keys = sorted(info.Get_nthkey(i) for i in range(info.Get_nkeys()))
seen = comm.gather({"host": socket.gethostname(), "local_rank": node.Get_rank(),
                    "local_size": node.Get_size(), "window_info": keys}, root=0)
win.Free()
node.Free()
if comm.Get_rank() == 0:
    with open(sys.argv[1], "w") as f:
        json.dump(seen, f)
