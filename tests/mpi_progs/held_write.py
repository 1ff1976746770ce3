"""A worker pulls θ while rank 0 holds a write of it open for HOLD seconds.

The pull must wait for the write and return the new θ whole; it must not spin on the
sequence word meanwhile (a reader spinning at MPI speed would take the core from a rank 0
that shares it). Rank 0 writes a JSON report: the worker's version, θ's values and how many
times the worker read the header in vain.
"""

import json
import sys
import time

import numpy as np

from gem_mpi.protocol import Layout
from gem_mpi.transport import start_mpi
from gem_mpi.transport.endpoints import MasterEndpoint, WorkerEndpoint

n_params, hold, out = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
comm = start_mpi()
layout = Layout(n_workers=comm.Get_size() - 1, n_params=n_params, payload_floats=n_params)
if comm.Get_rank() == 0:
    ep = MasterEndpoint(comm, layout, np.zeros(n_params, np.float32))
    ep.begin_write()
    comm.Barrier()  # the worker pulls from now on
    ep.theta[:] = 1.0
    time.sleep(hold)  # the write held open: no MPI call, no progress made
    ep.end_write(1)
    reports = comm.gather(None, root=0)
    ep.shutdown()
    with open(out, "w") as f:
        json.dump({"hold_s": hold, "workers": reports[1:]}, f)
else:
    ep = WorkerEndpoint(comm, layout)
    comm.Barrier()
    t = time.perf_counter()
    version = ep.pull()
    waited = time.perf_counter() - t
    th = ep.theta
    comm.gather({"version": version, "min": float(th.min()), "max": float(th.max()),
                 "retries": ep.theta_window.retries, "waited_s": waited}, root=0)
    ep.wait_shutdown()
    ep.close()
