"""Can rank 0 and the other workers go on after one worker is killed in the middle of a commit?

Run it under an MPI launcher with 3 or more ranks (docs/RELIABILITY.md, "A lost worker"):

    mpirun --with-ft ulfm -n 4 python tools/ft_probe.py           # Open MPI 5
    mpiexec -disable-auto-cleanup -n 4 python tools/ft_probe.py   # MPICH

It uses the pattern a fault-tolerant gem_mpi master would need: one small window per worker on
rank 0, over a communicator of just {0, w} (so that a failure touches only that worker's
window), errors returned instead of aborting, passive target without exclusive locks (each
side opens one ``Lock_all`` epoch; nobody holds a lock a dead rank could keep), and a slot
whose first and last words carry the update's number, so a half-written update is told apart
from a whole one. Worker 1 kills itself (SIGKILL) after writing the payload of its update
KILL_AT and before its last word; the others write UPDATES updates each.

Rank 0 prints one line ``FT-PROBE verdict=holds|fails ...``: it holds when every surviving
worker's UPDATES updates arrived, the victim's slot shows update KILL_AT half-written (its first
word KILL_AT, its last KILL_AT − 1: not to be applied), and rank 0 freed the survivors' windows; every survivor prints
``FT-PROBE rank R finalized`` once MPI_Finalize has returned. Where the stack does not hold,
the launcher kills the job or it hangs: run it under ``timeout``.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np
from mpi4py import MPI

VICTIM, KILL_AT, UPDATES, N = 1, 30, 200, 4096  # N: payload words per update


def _window(world: MPI.Intracomm, w: int) -> MPI.Win:
    """Worker w's window: N + 2 int64 words on rank 0, over the communicator {0, w}."""
    sub = world.Create_group(world.Get_group().Incl([0, w]))  # collective over {0, w} only
    sub.Set_errhandler(MPI.ERRORS_RETURN)
    win = MPI.Win.Allocate((N + 2) * 8 if sub.Get_rank() == 0 else 0, 8, comm=sub)
    win.Set_errhandler(MPI.ERRORS_RETURN)
    win.Lock_all()
    return win


def _master(wins: dict[int, MPI.Win], timeout: float = 60.0) -> None:
    """Poll each worker's slot (local reads after Win.Sync) until the survivors are done."""
    seen = {w: -1 for w in wins}
    errors: list[str] = []
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        for w, win in wins.items():
            slot = np.frombuffer(win.tomemory(), dtype=np.int64)
            try:
                win.Sync()
            except MPI.Exception as exc:
                errors.append(f"worker {w}: {exc.Get_error_string()}")
                continue
            first, last = int(slot[0]), int(slot[N + 1])
            if first == last:  # a whole update (a half-written one has first > last)
                seen[w] = last
        if all(v == UPDATES - 1 for w, v in seen.items() if w != VICTIM):
            break
        time.sleep(0.005)
    survivors = all(v == UPDATES - 1 for w, v in seen.items() if w != VICTIM)
    # the victim's slot now: the payload of update KILL_AT landed, its last word did not
    victim = np.frombuffer(wins[VICTIM].tomemory(), dtype=np.int64)
    half = (int(victim[0]), int(victim[N + 1])) == (KILL_AT, KILL_AT - 1)
    freed = True
    for w, win in wins.items():
        if w != VICTIM:
            try:
                win.Unlock_all()
                win.Free()
            except MPI.Exception as exc:
                errors.append(f"free {w}: {exc.Get_error_string()}")
                freed = False
    holds = survivors and half and freed
    print(f"FT-PROBE verdict={'holds' if holds else 'fails'} survivors_done={survivors} "
          f"victim_half_written_{KILL_AT}_seen={half} freed={freed} "
          f"seconds={time.monotonic() - t0:.1f} errors={errors[:3]}", flush=True)


def _worker(rank: int, win: MPI.Win) -> None:
    update = np.zeros(N + 2, np.int64)
    for i in range(UPDATES):
        update[:] = i
        win.Put(update[:N + 1], 0, target=(0, N + 1, MPI.INT64_T))  # first word + payload
        win.Flush(0)
        if rank == VICTIM and i == KILL_AT:
            os.kill(os.getpid(), signal.SIGKILL)  # mid-commit: the last word never written
        win.Put(update[N + 1:], 0, target=(N + 1, 1, MPI.INT64_T))
        win.Flush(0)
        time.sleep(0.01)  # 2 s in all: a launcher that ends the job at the loss has done so
    win.Unlock_all()
    win.Free()


def main() -> int:
    world = MPI.COMM_WORLD
    world.Set_errhandler(MPI.ERRORS_RETURN)
    rank, size = world.Get_rank(), world.Get_size()
    if size < 3:
        if rank == 0:
            print("ft_probe: run it with 3 or more ranks", file=sys.stderr)
        return 2
    # rank 0 joins every {0, w}, in order; worker w joins its own only
    wins = {w: _window(world, w) for w in range(1, size) if rank in (0, w)}
    if rank == 0:
        _master(wins)
    else:
        _worker(rank, wins[rank])
    MPI.Finalize()
    print(f"FT-PROBE rank {rank} finalized", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
