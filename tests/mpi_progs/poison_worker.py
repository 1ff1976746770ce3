"""Run the real launcher with one worker whose every 5th update holds a NaN or an Inf
(first argument: its rank), or with every worker's every update poisoned ("all")."""

import sys

import numpy as np

from gem_mpi import train
from gem_mpi.problem.quadratic import Quadratic
from gem_mpi.transport import MPI

everything = sys.argv[1] == "all"
bad_rank = -1 if everything else int(sys.argv[1])
real_step = Quadratic.step
calls = {"n": 0}


def poisoned_step(self, s, target, lr):
    delta, loss = real_step(self, s, target, lr)
    if everything:
        return np.full_like(delta, np.nan), loss
    if MPI.COMM_WORLD.Get_rank() == bad_rank:
        calls["n"] += 1
        if calls["n"] % 5 == 0:
            delta = delta.copy()
            delta[calls["n"] % delta.size] = np.nan if calls["n"] % 10 else np.inf
    return delta, loss


Quadratic.step = poisoned_step
sys.exit(train.launch(sys.argv[2:]))
