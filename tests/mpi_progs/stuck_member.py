"""Run the real launcher with --group-size where one group member hangs (alive, silent) after
some steps: its leader waits in the group's allreduce, so the master hears nothing from that
worker and its watchdog ends the run."""

import sys
import time

from gem_mpi import train
from gem_mpi.engine import group
from gem_mpi.transport import MPI

stuck_rank, after = int(sys.argv[1]), int(sys.argv[2])
real_average = group.Group.average
calls = {"n": 0}


def hanging_average(self, grad):
    if MPI.COMM_WORLD.Get_rank() == stuck_rank:
        calls["n"] += 1
        if calls["n"] > after:
            time.sleep(3600)  # a hung loader, a lost device: no error, no progress
    return real_average(self, grad)


group.Group.average = hanging_average
sys.exit(train.launch(sys.argv[3:]))
