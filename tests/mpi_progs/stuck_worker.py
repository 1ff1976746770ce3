"""Run the real launcher with one worker that hangs (alive, silent) after some updates."""

import sys
import time

from gem_mpi import train
from gem_mpi.problem.quadratic import Quadratic
from gem_mpi.transport import MPI

stuck_rank, after = int(sys.argv[1]), int(sys.argv[2])
real_step = Quadratic.step
calls = {"n": 0}


def hanging_step(self, s, target, lr):
    if MPI.COMM_WORLD.Get_rank() == stuck_rank:
        calls["n"] += 1
        if calls["n"] > after:
            time.sleep(3600)  # a hung data loader, a lost device: no error, no progress
    return real_step(self, s, target, lr)


Quadratic.step = hanging_step
sys.exit(train.launch(sys.argv[3:]))
