"""Run the real launcher with --method sync where one rank hangs (alive, silent) after some
steps: the others wait in Horovod's allreduce until its stall check shuts it down."""

import sys
import time

from gem_mpi import train
from gem_mpi.baseline import sync
from gem_mpi.transport import MPI

stuck_rank, after = int(sys.argv[1]), int(sys.argv[2])
real_step = sync.SyncTrainer.step
calls = {"n": 0}


def hanging_step(self):
    if MPI.COMM_WORLD.Get_rank() == stuck_rank:
        calls["n"] += 1
        if calls["n"] > after:
            time.sleep(3600)
    return real_step(self)


sync.SyncTrainer.step = hanging_step
sys.exit(train.launch(sys.argv[3:]))
