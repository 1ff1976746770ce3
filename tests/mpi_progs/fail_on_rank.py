"""Run the real launcher, but make one rank raise mid-run: the whole job must abort."""

import sys

from gem_mpi import session, train

bad_rank = int(sys.argv[1])
real_run = session.run


def failing_run(cfg, comm, *rest):
    if comm.Get_rank() == bad_rank:
        raise RuntimeError(f"injected failure on rank {bad_rank}")
    return real_run(cfg, comm, *rest)


session.run = failing_run
sys.exit(train.launch(sys.argv[2:]))
