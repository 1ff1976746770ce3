"""Time one worker's RMA operations on a window of rank 0 while rank 0 polls in a given way
(does each operation wait for rank 0's next progress call?).

    mpirun -n 2 python tools/rma_probe.py MODE [lock|lockall] [allocate|alloc_shm|shared]

MODE is what rank 0 does between its polls: spin (ProgressPoke without pause), sleep1ms (a
poke, then 1 ms asleep: the master's former idle back-off), drain1ms (16 pokes,
then 1 ms), sleep100us, busy5ms (a poke, then 5 ms of computing), nopoke (sleep only; hangs
where rank 0 must serve the operations). Rank 1 prints the median µs of each operation,
each completed by a Flush: Fetch_and_op, a 64-byte Get, and Get/Put of 655 kB (the paper's
net's θ).
"""

from __future__ import annotations

import sys
import time

import numpy as np

from gem_mpi.transport.polling import ProgressPoke
from gem_mpi.transport.runtime import MPI, start_mpi

N = 163_790


def main() -> None:
    mode = sys.argv[1]
    how = sys.argv[2] if len(sys.argv) > 2 else "lock"
    flavor = sys.argv[3] if len(sys.argv) > 3 else "allocate"
    comm = start_mpi()
    rank = comm.Get_rank()
    poke = ProgressPoke(comm)

    def alloc(n: int, unit: int) -> MPI.Win:
        size = n if rank == 0 else 0
        if flavor == "shared":
            return MPI.Win.Allocate_shared(size, unit, comm=comm)
        info = MPI.Info.Create()
        if flavor == "alloc_shm":
            info.Set("alloc_shm", "true")
        return MPI.Win.Allocate(size, unit, info, comm=comm)

    win, cell = alloc(64 + 4 * N, 1), alloc(8, 8)
    for w in (win, cell):
        if how == "lock":
            w.Lock(0, MPI.LOCK_SHARED)
        else:
            w.Lock_all(MPI.MODE_NOCHECK)
    comm.Barrier()
    if rank == 0:
        done = np.frombuffer(cell.tomemory(), dtype=np.int64)
        while True:
            cell.Sync()
            if done[0]:
                break
            if mode in ("spin", "drain1ms", "sleep1ms", "sleep100us", "busy5ms"):
                for _ in range(16 if mode == "drain1ms" else 1):
                    poke()
            if mode in ("sleep1ms", "drain1ms", "nopoke"):
                time.sleep(1e-3)
            elif mode == "sleep100us":
                time.sleep(100e-6)
            elif mode == "busy5ms":
                t = time.perf_counter()
                while time.perf_counter() - t < 5e-3:
                    pass
    elif rank == 1:
        small, big = np.zeros(8, np.int64), np.ones(N, np.float32)
        one, res = np.ones(1, np.int64), np.zeros(1, np.int64)

        def timed(op: object) -> float:
            ts = []
            for _ in range(30):
                t = time.perf_counter()
                op()
                win.Flush(0)
                ts.append(time.perf_counter() - t)
            return 1e6 * float(np.median(ts))

        ops = {"fao": lambda: win.Fetch_and_op(one, res, 0, 16, MPI.SUM),
               "get64": lambda: win.Get([small.view(np.uint8), MPI.BYTE], 0, (0, 64, MPI.BYTE)),
               "get655k": lambda: win.Get([big.view(np.uint8), MPI.BYTE], 0,
                                          (64, 4 * N, MPI.BYTE)),
               "put655k": lambda: win.Put([big.view(np.uint8), MPI.BYTE], 0,
                                          (64, 4 * N, MPI.BYTE))}
        times = {k: timed(op) for k, op in ops.items()}
        name, version = MPI.get_vendor()
        vendor = f"{name} {'.'.join(map(str, version))}"
        print(f"{vendor} {how} {flavor} rank 0 {mode}: "
              + " ".join(f"{k} {v:.1f} us" for k, v in times.items()), flush=True)
        cell.Fetch_and_op(one, res, 0, 0, MPI.REPLACE)
        cell.Flush(0)
    for w in (win, cell):
        w.Unlock(0) if how == "lock" else w.Unlock_all()
        w.Free()
    poke.free()


if __name__ == "__main__":
    main()
