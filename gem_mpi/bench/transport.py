"""RMA Get and Put between two ranks against a local memcpy of the same bytes."""

from __future__ import annotations

import argparse

import numpy as np

from gem_mpi.bench import Subcommands, _machine, _time
from gem_mpi.transport import MPI, start_mpi


def _transport_row(comm: MPI.Intracomm, n: int) -> dict | None:
    """Rank 1 times Get and Put on rank 0's window of n floats; rank 0 returns the row."""
    rank = comm.Get_rank()
    win = MPI.Win.Allocate(4 * n if rank == 0 else 0, 4, comm=comm)
    row = None
    if rank == 1:
        buf = np.ones(n, np.float32)
        other = np.empty_like(buf)

        def get() -> None:
            win.Lock(0, MPI.LOCK_SHARED)
            win.Get([buf, MPI.FLOAT], 0)
            win.Unlock(0)

        def put() -> None:
            win.Lock(0, MPI.LOCK_SHARED)
            win.Put([buf, MPI.FLOAT], 0)
            win.Unlock(0)

        timing = {"floats": n, "bytes": 4 * n, "get_s": _time(get), "put_s": _time(put),
                  "memcpy_s": _time(lambda: np.copyto(other, buf))}
        for k in ("get", "put", "memcpy"):
            timing[f"{k}_GBps"] = 4 * n / timing[f"{k}_s"] / 1e9
        comm.send(timing, dest=0)
    elif rank == 0:
        row = comm.recv(source=1)
    comm.Barrier()
    win.Free()
    return row


def bench_transport(sizes: list[int]) -> dict | None:

    comm = start_mpi()
    if comm.Get_size() != 2:
        raise SystemExit("bench transport needs exactly 2 ranks: mpirun -n 2 ...")
    rows = [_transport_row(comm, n) for n in sizes]
    if comm.Get_rank() != 0:
        return None
    return {"bench": "transport", "machine": _machine(),
            "mpi": MPI.Get_library_version().replace("\0", "").splitlines()[0].strip(),
            "rows": rows}


def print_transport(result: dict) -> None:
    print(f"gem_mpi.bench transport: {result['machine']}; {result['mpi']}; rank 1 reads/writes "
          "rank 0's window (lock, op, unlock) vs a local memcpy of the same bytes")
    cols = ["floats", "Get µs", "Put µs", "memcpy µs", "Get GB/s", "Put GB/s", "memcpy GB/s",
            "Get/memcpy"]
    print("  ".join(f"{c:>11}" for c in cols))
    for r in result["rows"]:
        vals = [f"{r['floats']:.0e}", f"{1e6 * r['get_s']:.1f}", f"{1e6 * r['put_s']:.1f}",
                f"{1e6 * r['memcpy_s']:.1f}", f"{r['get_GBps']:.2f}", f"{r['put_GBps']:.2f}",
                f"{r['memcpy_GBps']:.2f}", f"{r['get_GBps'] / r['memcpy_GBps']:.2f}"]
        print("  ".join(f"{v:>11}" for v in vals))


def register(sub: Subcommands) -> argparse.ArgumentParser:
    """``transport``: its options, and what runs and prints it."""
    p = sub.add_parser("transport", help="Get/Put between 2 ranks under mpirun")
    p.add_argument("--sizes", type=int, nargs="+",
                   default=[10_000, 100_000, 1_000_000, 10_000_000])
    p.set_defaults(run=_run, show=print_transport)
    return p


def _run(args: argparse.Namespace) -> dict | None:
    return bench_transport(args.sizes)
