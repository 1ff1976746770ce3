"""Hammer the transport with uniform updates so that any torn or lost message shows.

Every update adds +1 to every element of θ (θ₀ = 0), so a consistent pull of version v is
all v, a torn pull mixes values, and the final θ counts the updates applied. Rank 0 writes
a JSON report for the test to check.
"""

import json
import sys
import time

import numpy as np

from gem_mpi.protocol import DONE, UPDATE, Layout
from gem_mpi.transport import start_mpi
from gem_mpi.transport.endpoints import MasterEndpoint, WorkerEndpoint

n_params, steps, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
# seconds the master sleeps per update: makes the master the bottleneck on purpose
master_delay = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
comm = start_mpi()
rank, size = comm.Get_rank(), comm.Get_size()
layout = Layout(n_workers=size - 1, n_params=n_params, payload_floats=n_params)

if rank == 0:
    ep = MasterEndpoint(comm, layout, np.zeros(n_params, np.float32))
    log, done, version, back = [], 0, 0, ep.idle_backoff(first=50e-6, limit=1e-3)
    done_tickets = []
    while done < size - 1:
        ready = ep.ready()
        if ready.size == 0:
            back.wait()
            continue
        back.reset()
        for slot in ready:
            msg = ep.take(int(slot))
            if msg.kind == UPDATE:
                ep.begin_write()
                ep.theta += msg.payload[:n_params]
                version += 1
                ep.end_write(version)
                if master_delay:
                    time.sleep(master_delay)
                ep.progress()  # as the engine's master does between updates
                log.append([msg.rank, msg.seq, msg.ticket, msg.version, version - 1, len(ready)])
            else:
                assert msg.kind == DONE
                done_tickets.append(msg.ticket)
                done += 1
            ep.release([slot])
    theta = ep.theta.copy()
    torn = comm.gather(0, root=0)
    ep.shutdown()
    report = {"log": log, "torn": int(sum(torn)), "theta_min": float(theta.min()),
              "theta_max": float(theta.max()), "version": version,
              "done_tickets": done_tickets}
    with open(out, "w") as f:
        json.dump(report, f)
else:
    ep = WorkerEndpoint(comm, layout)
    delta = np.ones(n_params, np.float32)
    torn = 0
    for seq in range(steps):
        ep.wait_slot_free()
        v = ep.pull()
        th = ep.theta
        if not (th.min() == th.max() == np.float32(v)):
            torn += 1
        ep.commit(UPDATE, seq, v, parts=(delta,))
    ep.commit(DONE, steps, ep.pull())
    comm.gather(torn, root=0)
    ep.wait_shutdown()
    ep.close()
