"""Run the real launcher with one worker that kills itself (SIGKILL) in the middle of a
commit: its update's payload has reached rank 0 and it has drawn its ticket, but the flag
that makes the message ready is never set."""

import os
import signal
import sys

from gem_mpi import train
from gem_mpi.transport import MPI
from gem_mpi.transport.idioms import TicketCounter

victim, after = int(sys.argv[1]), int(sys.argv[2])
real_draw = TicketCounter.draw
calls = {"n": 0}


def draw_then_die(self):
    ticket = real_draw(self)
    if MPI.COMM_WORLD.Get_rank() == victim:
        calls["n"] += 1
        if calls["n"] > after:
            print(f"killed_mid_commit: rank {victim} dies in its update {after}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    return ticket


TicketCounter.draw = draw_then_die
sys.exit(train.launch(sys.argv[3:]))
