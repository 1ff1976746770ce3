"""``python -m gem_mpi.bench``: speed measured side by side in one run, printed as ratios.

    python -m gem_mpi.bench kernel                 # fused kernel vs numpy, torch, memcpy, triad
    mpirun -n 5 python -m gem_mpi.bench master     # master updates/s vs its bandwidth bound
    mpirun -n 2 python -m gem_mpi.bench transport  # RMA Get/Put vs memcpy
    python -m gem_mpi.bench compare                # GEM vs DOWNPOUR vs sync (Horovod), with
                                                   # a straggler; launches mpirun itself

Every figure is a median over repeated calls; every ratio compares numbers taken in the same
process minutes apart, never numbers from another run. ``--json PATH`` writes them all.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from gem_mpi import gem

if TYPE_CHECKING:
    from mpi4py import MPI

# Bytes the fused GEM step touches per element: a finiteness pass reading Δθ, κ|m|, s
# (12 B), then the update reading θ, Δθ, κ|m|, s (16 B) and writing θ (4 B).
GEM_BYTES_PER_ELEMENT = 32


def _time(fn: Callable[[], object], min_seconds: float = 0.3, min_calls: int = 5) -> float:
    """Median seconds per call, after one warm-up call."""
    fn()
    samples: list[float] = []
    start = time.perf_counter()
    while len(samples) < min_calls or time.perf_counter() - start < min_seconds:
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
        if len(samples) > 10_000:
            break
    return statistics.median(samples)


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}"


def _inputs(n: int, seed: int = 0) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    theta = rng.normal(size=n).astype(np.float32)
    delta = (rng.normal(size=n) * 0.01).astype(np.float32)
    a = np.abs(rng.normal(size=n) * 0.02).astype(np.float32)
    s = (theta + rng.normal(size=n) * 0.01).astype(np.float32)
    return theta, delta, a, s


def _torch_gem(n_tensors: int, offsets: np.ndarray, eps: float, pi_max: float):
    """The same math in torch eager ops on the CPU (the obvious alternative to a kernel)."""
    import torch

    bounds = offsets.tolist()

    def step(theta, delta, a, s):
        if not (torch.isfinite(delta).all() and torch.isfinite(a).all()
                and torch.isfinite(s).all()):
            return None
        pi = (a - (theta - s).abs()) / (delta.abs() + eps)
        pi.clamp_(0.0, pi_max)
        theta.add_(pi * delta)
        e2 = (theta - s).square()
        a2 = a.square()
        bins = torch.where(pi > 0, torch.where(pi >= pi_max, gem.HIST_BINS + 1,
                           1 + (pi * (gem.HIST_BINS / pi_max)).long().clamp_(max=gem.HIST_BINS
                                                                            - 1)), 0)
        out = []
        for t in range(n_tensors):
            lo, hi = bounds[t], bounds[t + 1]
            stride = gem.sample_stride(hi - lo)
            out.append((torch.bincount(bins[lo:hi:stride], minlength=gem.HIST_BINS + 2),
                        (bins[lo:hi] == 0).sum(), (bins[lo:hi] == gem.HIST_BINS + 1).sum(),
                        e2[lo:hi].sum(dtype=torch.float64), a2[lo:hi].sum(dtype=torch.float64)))
        return out

    return step


def _triad_seconds(bytes_touched: int, threads: int) -> float:
    """Seconds of one STREAM triad moving ``bytes_touched`` bytes (three float32 streams)."""
    from gem_mpi import _core

    m = bytes_touched // 12
    a, b, c = (np.ones(m, np.float32) for _ in range(3))
    return _time(lambda: _core.triad(a, b, c, 3.0, threads))


def _kernel_row(n: int, threads: int, with_torch: bool) -> dict:
    from gem_mpi import _core

    eps, pi_max, n_tensors = 1e-16, 5.0, 8
    offsets = np.linspace(0, n, n_tensors + 1).astype(np.int64)
    theta, delta, a, s = _inputs(n)
    hist = np.zeros((n_tensors, gem.HIST_BINS + 2), np.int64)
    sums = np.zeros((n_tensors, 2))
    counts = np.zeros((n_tensors, 2), np.int64)
    bytes_touched = GEM_BYTES_PER_ELEMENT * n
    row: dict = {"elements": n, "bytes_touched": bytes_touched}
    row["fused_s"] = _time(lambda: _core.gem_step(theta, delta, a, s, offsets, eps, pi_max,
                                                  hist, sums, counts, threads))
    row["numpy_s"] = _time(lambda: gem.gem_step_numpy(theta, delta, a, s, offsets, eps,
                                                      pi_max, hist, sums, counts))
    if with_torch:
        import torch

        torch.set_num_threads(threads)
        step = _torch_gem(n_tensors, offsets, eps, pi_max)
        tt, td, ta, ts = (torch.from_numpy(x) for x in (theta, delta, a, s))
        row["torch_s"] = _time(lambda: step(tt, td, ta, ts))
    # memcpy and triad moving the same number of bytes as the fused step
    src = np.ones(bytes_touched // 8, np.float32)  # read + write = bytes_touched
    dst = np.empty_like(src)
    row["memcpy_s"] = _time(lambda: _core.copy(dst, src, threads))
    row["triad_s"] = _triad_seconds(bytes_touched, threads)
    for key in ("fused", "memcpy", "triad", "numpy", "torch"):
        if f"{key}_s" in row:
            row[f"{key}_GBps"] = bytes_touched / row[f"{key}_s"] / 1e9
    row["fused_vs_triad"] = row["fused_GBps"] / row["triad_GBps"]
    row["fused_vs_memcpy"] = row["fused_GBps"] / row["memcpy_GBps"]
    row["speedup_vs_numpy"] = row["numpy_s"] / row["fused_s"]
    if with_torch:
        row["speedup_vs_torch"] = row["torch_s"] / row["fused_s"]
    return row


def bench_kernel(sizes: list[int], threads: int, with_torch: bool) -> dict:
    rows = [_kernel_row(n, threads, with_torch) for n in sizes]
    return {"bench": "kernel", "threads": threads, "machine": _machine(), "rows": rows}


def print_kernel(result: dict) -> None:
    print(f"gem_mpi.bench kernel: {result['machine']}; {result['threads']} thread(s); "
          f"{GEM_BYTES_PER_ELEMENT} bytes touched per element")
    cols = ["elements", "fused GB/s", "triad GB/s", "memcpy GB/s", "fused/triad",
            "×numpy", "×torch", "fused ms"]
    print("  ".join(f"{c:>11}" for c in cols))
    for r in result["rows"]:
        vals = [f"{r['elements']:.0e}", f"{r['fused_GBps']:.2f}", f"{r['triad_GBps']:.2f}",
                f"{r['memcpy_GBps']:.2f}", f"{r['fused_vs_triad']:.2f}",
                f"{r['speedup_vs_numpy']:.1f}",
                f"{r['speedup_vs_torch']:.1f}" if "speedup_vs_torch" in r else "-",
                f"{1e3 * r['fused_s']:.3f}"]
        print("  ".join(f"{v:>11}" for v in vals))


def bench_master(sizes: list[int], updates: int, threads: int, poll_ms: float) -> dict | None:
    """Workers commit pre-computed GEM updates as fast as they can; the real master applies."""
    from gem_mpi.config import Config
    from gem_mpi.master import Master
    from gem_mpi.problem import build_problem
    from gem_mpi.transport import KIND_DONE, KIND_UPDATE, MPI, Layout, WorkerEndpoint

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    if size < 2:
        raise SystemExit("bench master needs mpirun with at least 2 ranks")
    n_workers = size - 1
    rows = []
    for n in sizes:
        tmp = tempfile.mkdtemp() if rank == 0 else None
        cfg = Config(method="gem", model="quadratic", dataset="synthetic", quadratic_dim=n,
                     eval_every=0, max_steps=max(1, updates // n_workers),
                     metrics=os.path.join(tmp, "bench.h5") if tmp else None)
        problem = build_problem(cfg, with_theta0=rank == 0)
        layout = Layout(n_workers, problem.n_params, gem.payload_floats("gem", n))
        if rank == 0:
            triad_s = _triad_seconds(GEM_BYTES_PER_ELEMENT * n, threads)
            kernel = gem.Kernel(problem.offsets, threads=threads)
            summary = Master(cfg, comm, layout, problem, kernel).run()
            ups = summary["updates"] / summary["wall_s"]
            bound = 1.0 / triad_s  # one update touches as many bytes as one triad call here
            split = {k: summary[f"master_{k}_s"] / summary["wall_s"]
                     for k in ("wait", "apply", "metrics", "mpi")}
            apply_s = summary["master_apply_s"] / summary["updates"]
            rows.append({"params": n, "workers": n_workers, "updates": summary["updates"],
                         "updates_per_s": ups, "bound_updates_per_s": bound,
                         "ratio_to_bound": ups / bound, "time_split": split,
                         "apply_ms": 1e3 * apply_s,
                         # the kernel's own speed during the run against the quiet triad:
                         # the ceiling of ratio_to_bound when the workers share the machine
                         "apply_ratio_to_bound": triad_s / apply_s})
        else:
            ep = WorkerEndpoint(comm, layout, poll_limit=poll_ms / 1000.0)
            delta = (np.random.default_rng(rank).normal(size=n) * 1e-3).astype(np.float32)
            a = np.abs(delta) * np.float32(2.0)
            version = ep.pull()
            for seq in range(cfg.max_steps):
                ep.commit(KIND_UPDATE, seq, version, 0.0, 0.0, (delta, a, ep.theta))
                ep.wait_slot_free()
                version = ep.pull()
            ep.commit(KIND_DONE, cfg.max_steps, version)
            ep.wait_shutdown()
            ep.close()
    if rank != 0:
        return None
    return {"bench": "master", "machine": _machine(), "threads": threads, "rows": rows}


def print_master(result: dict) -> None:
    print(f"gem_mpi.bench master: {result['machine']}; kernel threads {result['threads']}; "
          "bound = triad bandwidth / bytes touched per update; apply ratio = the kernel's "
          "own speed during the run against that bound (the ceiling of ratio)")
    cols = ["params", "workers", "upd/s", "bound upd/s", "ratio", "apply ms", "apply ratio",
            "wait", "apply", "metrics", "mpi"]
    print("  ".join(f"{c:>11}" for c in cols))
    for r in result["rows"]:
        sp = r["time_split"]
        vals = [r["params"], r["workers"], f"{r['updates_per_s']:.0f}",
                f"{r['bound_updates_per_s']:.0f}", f"{r['ratio_to_bound']:.2f}",
                f"{r['apply_ms']:.3f}", f"{r['apply_ratio_to_bound']:.2f}",
                *(f"{100 * sp[k]:.0f}%" for k in
                                          ("wait", "apply", "metrics", "mpi"))]
        print("  ".join(f"{v!s:>11}" for v in vals))


def _transport_row(comm: MPI.Intracomm, n: int) -> dict | None:
    """Rank 1 times Get and Put on rank 0's window of n floats; rank 0 returns the row."""
    from gem_mpi.transport import MPI

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
    from gem_mpi.transport import MPI

    comm = MPI.COMM_WORLD
    if comm.Get_size() != 2:
        raise SystemExit("bench transport needs exactly 2 ranks: mpirun -n 2 ...")
    rows = [_transport_row(comm, n) for n in sizes]
    if comm.Get_rank() != 0:
        return None
    return {"bench": "transport", "machine": _machine(),
            "mpi": MPI.Get_library_version().splitlines()[0], "rows": rows}


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


COMPARE_METHODS = ("gem", "downpour", "sync")


def _compare_run(method: str, workers: int, args: argparse.Namespace, out_dir: str) -> dict:
    """One training run as a real mpirun job; its numbers come from its metrics file."""
    import shlex
    import subprocess

    from gem_mpi import analysis

    ranks = workers if method == "sync" else workers + 1
    # evaluations at the same numbers of samples: sync counts steps of all workers at once
    eval_every = args.eval_every if method == "sync" else args.eval_every * workers
    h5 = os.path.join(out_dir, f"{method}.h5")
    cmd = [*shlex.split(args.mpirun), "-n", str(ranks), sys.executable, "-m", "gem_mpi.train",
           "--method", method, "--model", args.model, "--dataset", args.dataset,
           "--max-steps", str(args.max_steps), "--batch-size", str(args.batch_size),
           "--eval-every", str(eval_every), "--metrics", h5, "--log-every", "30",
           "--threads", "1", *(["--straggler", args.straggler] if args.straggler else [])]
    env = dict(os.environ)
    if hasattr(os, "geteuid") and os.geteuid() == 0:  # Open MPI refuses root without these
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    print(f"gem_mpi.bench compare: {' '.join(cmd)}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    job_s = time.perf_counter() - t0
    if res.returncode != 0:
        tail = "\n".join(res.stderr.strip().splitlines()[-5:])
        raise SystemExit(f"bench compare: the {method} run failed (exit {res.returncode}):\n"
                         f"{tail}")
    run = analysis.load_run(h5)
    wall = analysis.wall_seconds(run)
    return {"method": method, "ranks": ranks, "workers": workers, "job_s": job_s,
            "wall_s": wall, "updates": analysis.applied_updates(run),
            "updates_per_s": analysis.updates_per_second(run),
            "samples_per_s": analysis.samples_per_second(run),
            "time_to_target_s": analysis.time_to_accuracy(run, args.target_accuracy),
            "final_accuracy": analysis.final_test(run).accuracy}


def bench_compare(args: argparse.Namespace) -> dict:
    """Each method trains the same model on the same data streams with the same per-worker
    budget, one after the other (never at once: they would share the cores)."""
    if "sync" in args.methods:
        from gem_mpi.sync import check_horovod

        check_horovod()
    rows = []
    with tempfile.TemporaryDirectory(prefix="gem_compare_") as out_dir:
        rows = [_compare_run(m, args.workers, args, out_dir) for m in args.methods]
    base = next((r for r in rows if r["method"] == "sync"), rows[0])
    for r in rows:
        r["samples_per_s_vs_base"] = r["samples_per_s"] / base["samples_per_s"]
        a, b = r["time_to_target_s"], base["time_to_target_s"]
        r["speedup_to_target_vs_base"] = b / a if a and b else None
    return {"bench": "compare", "machine": _machine(), "model": args.model,
            "dataset": args.dataset, "workers": args.workers, "straggler": args.straggler,
            "max_steps": args.max_steps, "batch_size": args.batch_size,
            "target_accuracy": args.target_accuracy, "base": base["method"], "rows": rows}


def print_compare(result: dict) -> None:
    slow = result["straggler"] or "none"
    print(f"gem_mpi.bench compare: {result['machine']}; {result['model']}/{result['dataset']}, "
          f"{result['workers']} workers × {result['max_steps']} steps × batch "
          f"{result['batch_size']}, straggler {slow}, target test accuracy "
          f"{100 * result['target_accuracy']:.0f} %; ratios against {result['base']}")
    cols = ["method", "ranks", "wall s", "upd/s", "samples/s", "vs base", "to target s",
            "speedup", "final acc"]
    print("  ".join(f"{c:>11}" for c in cols))
    for r in result["rows"]:
        t = r["time_to_target_s"]
        sp = r["speedup_to_target_vs_base"]
        vals = [r["method"], r["ranks"], f"{r['wall_s']:.1f}", f"{r['updates_per_s']:.1f}",
                f"{r['samples_per_s']:.0f}", f"{r['samples_per_s_vs_base']:.2f}",
                "not reached" if t is None else f"{t:.1f}",
                "-" if sp is None else f"{sp:.2f}", f"{100 * r['final_accuracy']:.2f}%"]
        print("  ".join(f"{v!s:>11}" for v in vals))
    print("upd/s: applied updates (sync: steps of all workers) per second over the run; "
          "samples/s: while every worker still ran; speedup: base's time to target over this "
          "method's")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gem_mpi.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    k = sub.add_parser("kernel", help="fused kernel vs numpy, torch, memcpy and triad")
    k.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000, 10_000_000])
    k.add_argument("--no-torch", action="store_true", help="skip the torch eager column")
    m = sub.add_parser("master", help="master updates/s under mpirun")
    m.add_argument("--sizes", type=int, nargs="+", default=[163_790, 1_637_900],
                   help="parameters (default: the paper's net and 10x)")
    m.add_argument("--updates", type=int, default=2000, help="updates per size")
    m.add_argument("--poll-max-ms", type=float, default=5.0,
                   help="workers' longest sleep between polls (as gem_mpi.train's option)")
    t = sub.add_parser("transport", help="Get/Put between 2 ranks under mpirun")
    t.add_argument("--sizes", type=int, nargs="+",
                   default=[10_000, 100_000, 1_000_000, 10_000_000])
    c = sub.add_parser("compare", help="GEM vs DOWNPOUR vs synchronous Horovod, each a real "
                       "mpirun job (run it outside mpirun)")
    c.add_argument("--methods", nargs="+", default=list(COMPARE_METHODS),
                   help="methods, one run each; ratios against sync when it is there")
    c.add_argument("--workers", type=int, default=4)
    c.add_argument("--straggler", default="2:5", help="WORKER:FACTOR, as gem_mpi.train's "
                   "option ('' for none)")
    c.add_argument("--model", default="mnist-cnn")
    c.add_argument("--dataset", default="fashion-mnist")
    c.add_argument("--max-steps", type=int, default=300, help="steps per worker")
    c.add_argument("--batch-size", type=int, default=64)
    c.add_argument("--eval-every", type=int, default=25, help="evaluate every this many "
                   "steps per worker (every workers × this many updates when asynchronous)")
    c.add_argument("--target-accuracy", type=float, default=0.75)
    c.add_argument("--mpirun", default="mpirun --oversubscribe --mca btl self,vader",
                   help="launcher command line (one node)")
    for p in (k, m, t, c):
        p.add_argument("--json", help="write the results to this file too")
    args = parser.parse_args(argv)
    threads = gem.kernel_threads()
    if args.what == "compare":
        result, show = bench_compare(args), print_compare
    elif args.what == "kernel":
        result, show = bench_kernel(args.sizes, threads, not args.no_torch), print_kernel
    elif args.what == "master":
        result, show = bench_master(args.sizes, args.updates, threads, args.poll_max_ms), print_master
    else:
        result, show = bench_transport(args.sizes), print_transport
    if result is None:  # not rank 0
        return 0
    show(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
