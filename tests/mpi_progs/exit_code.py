"""Run the real launcher and append "<rank> <exit code>" to a file (first argument), so a
test sees every rank's own exit code, not just the one mpirun passes on."""

import sys

from gem_mpi import train
from gem_mpi.transport import MPI

out = sys.argv[1]
code = train.launch(sys.argv[2:])
with open(out, "a") as f:
    f.write(f"{MPI.COMM_WORLD.Get_rank()} {code}\n")
sys.exit(code)
