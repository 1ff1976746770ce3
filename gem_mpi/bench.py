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

from gem_mpi.algorithm import kernel as gem

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


# How far torch's θ may sit from the reference's, per element, in float32 roundings of the
# two terms of θ + πΔθ. torch evaluates the same float32 operations in the same order, each
# rounded correctly under IEEE 754, so a correct implementation matches exactly; it may
# differ only where it evaluates them otherwise (a fused multiply-add in θ + πΔθ, a
# reciprocal instead of the division in π), and each of those moves θ_new by at most a
# rounding or two of |θ| or of |πΔθ| ≤ π_max|Δθ|. A wrong step (a missing clamp, a wrong
# sign, π not applied) moves θ by a sizeable part of |Δθ| somewhere: at these inputs
# |Δθ| ~ 1e-2 and the tolerance ~ 5e-7.
TORCH_ROUNDINGS = 4


def _reference(theta, delta, a, s, offsets, eps, pi_max) -> tuple[np.ndarray, ...]:
    """(θ, hist, sums, counts) after one numpy reference step from copies of the inputs."""
    n_tensors = len(offsets) - 1
    out = (theta.copy(), np.zeros((n_tensors, gem.HIST_BINS + 2), np.int64),
           np.zeros((n_tensors, 2)), np.zeros((n_tensors, 2), np.int64))
    if not gem.gem_step_numpy(out[0], delta, a, s, offsets, eps, pi_max, *out[1:]):
        raise AssertionError("the reference rejected finite inputs")
    return out


def _check_fused(core, ref, theta, delta, a, s, offsets, eps, pi_max, threads) -> str:
    """Why the C++ kernel's step differs from the reference's ("" when it does not): θ must
    be bit-identical (its specification), and so the histogram and the clamp counts."""
    got = (theta.copy(), *(np.zeros_like(x) for x in ref[1:]))
    if not core.gem_step(got[0], delta, a, s, offsets, eps, pi_max, *got[1:], threads):
        return "it rejected finite inputs"
    differ = np.count_nonzero(got[0].view(np.uint32) != ref[0].view(np.uint32))
    if differ:
        return (f"θ is not bit-identical: {differ} element(s) differ, by up to "
                f"{np.max(np.abs(got[0] - ref[0])):.3g}")
    if not (np.array_equal(got[1], ref[1]) and np.array_equal(got[3], ref[3])):
        return "θ is bit-identical but the π histogram or the clamp counts differ"
    return ""


def _check_torch(step, ref, theta, delta, a, s, pi_max) -> tuple[float, str]:
    """(max |θ_torch − θ_ref|, why it is out of tolerance or "")."""
    import torch

    tt = torch.from_numpy(theta.copy())
    if step(tt, *(torch.from_numpy(x) for x in (delta, a, s))) is None:
        return float("nan"), "it rejected finite inputs"
    diff = np.abs(tt.numpy() - ref[0])
    bound = (TORCH_ROUNDINGS * np.finfo(np.float32).eps
             * (np.abs(ref[0]) + np.float32(pi_max) * np.abs(delta)))
    worst = float(diff.max())
    if np.all(diff <= bound):
        return worst, ""
    return worst, (f"θ differs from the reference by up to {worst:.3g}, beyond "
                   f"{TORCH_ROUNDINGS} float32 roundings of |θ| + π_max|Δθ| at "
                   f"{np.count_nonzero(diff > bound)} element(s)")


def _check_bounds(core, n: int, threads: int) -> dict[str, str]:
    """Why memcpy or the triad does not do the work it is timed for ("" when it does), on
    buffers as large as the timed ones: every byte copied; a = b + q·c everywhere, to within
    the one rounding a fused multiply-add may save (the compiler may contract it)."""
    src = np.arange(n, dtype=np.float32)  # cheap, and a different value in most elements
    dst = np.zeros_like(src)
    core.copy(dst, src, threads)
    why = {"memcpy": "" if np.array_equal(dst.view(np.uint32), src.view(np.uint32))
           else "the copy differs from its source"}
    m = n * 2 // 3  # the triad's three streams move as many bytes as memcpy's two
    b, c = src[:m], src[n - m:]
    out = np.zeros_like(b)
    core.triad(out, b, c, 3.0, threads)
    want = b + np.float32(3.0) * c
    tol = 2 * np.finfo(np.float32).eps * (np.abs(b) + np.abs(np.float32(3.0) * c))
    why["triad"] = "" if np.all(np.abs(out - want) <= tol) else "a ≠ b + q·c"
    return why


def _kernel_row(n: int, threads: int, with_torch: bool) -> dict:
    """Validate every variant on the same inputs as the numpy reference, then time the
    valid ones, cache-warm: the median of repeated calls on the same buffers."""
    core, why_not = gem.load_extension()
    if core is None:
        raise SystemExit(f"gem_mpi.bench kernel: the C++ extension gem_mpi._core is "
                         f"{why_not}")
    eps, pi_max, n_tensors = 1e-16, 5.0, 8
    offsets = np.linspace(0, n, n_tensors + 1).astype(np.int64)
    theta, delta, a, s = _inputs(n)
    ref = _reference(theta, delta, a, s, offsets, eps, pi_max)
    bad = _check_fused(core, ref, theta, delta, a, s, offsets, eps, pi_max, threads)
    if bad:  # every column is a ratio to it: nothing is worth timing
        raise SystemExit(f"gem_mpi.bench kernel: the C++ kernel fails validation against "
                         f"the numpy reference at {n} elements ({bad}); nothing timed")
    bytes_touched = GEM_BYTES_PER_ELEMENT * n
    row: dict = {"elements": n, "bytes_touched": bytes_touched,
                 "invalid": _check_bounds(core, bytes_touched // 8, threads)}
    step = None
    if with_torch:
        import torch

        torch.set_num_threads(threads)
        step = _torch_gem(n_tensors, offsets, eps, pi_max)
        row["torch_max_abs_diff"], row["invalid"]["torch"] = _check_torch(
            step, ref, theta, delta, a, s, pi_max)
    row["invalid"] = {k: v for k, v in row["invalid"].items() if v}
    hist, sums, counts = (np.zeros_like(x) for x in ref[1:])
    row["fused_s"] = _time(lambda: core.gem_step(theta, delta, a, s, offsets, eps, pi_max,
                                                 hist, sums, counts, threads))
    row["numpy_s"] = _time(lambda: gem.gem_step_numpy(theta, delta, a, s, offsets, eps,
                                                      pi_max, hist, sums, counts))
    if step is not None and "torch" not in row["invalid"]:
        import torch

        tt, td, ta, ts = (torch.from_numpy(x) for x in (theta, delta, a, s))
        row["torch_s"] = _time(lambda: step(tt, td, ta, ts))
    # memcpy and triad moving the same number of bytes as the fused step
    if "memcpy" not in row["invalid"]:
        src = np.ones(bytes_touched // 8, np.float32)  # read + write = bytes_touched
        dst = np.empty_like(src)
        row["memcpy_s"] = _time(lambda: core.copy(dst, src, threads))
    if "triad" not in row["invalid"]:
        row["triad_s"] = _triad_seconds(bytes_touched, threads)
    for key in ("fused", "memcpy", "triad", "numpy", "torch"):
        if f"{key}_s" in row:
            row[f"{key}_GBps"] = bytes_touched / row[f"{key}_s"] / 1e9
    if "triad_s" in row:
        row["fused_vs_triad"] = row["fused_GBps"] / row["triad_GBps"]
    if "memcpy_s" in row:
        row["fused_vs_memcpy"] = row["fused_GBps"] / row["memcpy_GBps"]
    row["speedup_vs_numpy"] = row["numpy_s"] / row["fused_s"]
    if "torch_s" in row:
        row["speedup_vs_torch"] = row["torch_s"] / row["fused_s"]
    return row


def bench_kernel(sizes: list[int], threads: int, with_torch: bool) -> dict:
    rows = [_kernel_row(n, threads, with_torch) for n in sizes]
    checks = {"fused C++": "θ bit-identical, same π histogram and clamp counts"}
    if with_torch:
        worst = max(r["torch_max_abs_diff"] for r in rows)
        checks["torch"] = (f"max |θ − θ_ref| {worst:.3g}, tolerance {TORCH_ROUNDINGS} "
                           "float32 roundings of |θ| + π_max|Δθ|")
    checks["memcpy"] = "exact copy"
    checks["triad"] = "a = b + q·c"
    failed = {k for r in rows for k in r["invalid"]}
    validated = [f"{k} ({v})" for k, v in checks.items() if k not in failed]
    return {"bench": "kernel", "threads": threads, "machine": _machine(), "rows": rows,
            "validated": validated, "failed": sorted(failed), "timing": "cache-warm"}


def print_kernel(result: dict) -> None:
    print(f"gem_mpi.bench kernel: {result['machine']}; {result['threads']} thread(s); "
          f"{GEM_BYTES_PER_ELEMENT} bytes touched per element")
    failed = f"; FAILED, not timed: {', '.join(result['failed'])}" if result["failed"] else ""
    print("validated before timing, on the inputs of the numpy reference gem_step_numpy "
          f"(timed as ×numpy): {'; '.join(result['validated'])}{failed}")
    print("timings are cache-warm: the median of repeated calls on the same buffers, so "
          "sizes whose bytes fit in the cache run from it")
    cols = ["elements", "fused GB/s", "triad GB/s", "memcpy GB/s", "fused/triad",
            "×numpy", "×torch", "fused ms"]
    print("  ".join(f"{c:>11}" for c in cols))

    def num(r: dict, key: str, variant: str, fmt: str) -> str:
        if variant in r["invalid"]:
            return "invalid"
        return format(r[key], fmt) if key in r else "-"

    for r in result["rows"]:
        vals = [f"{r['elements']:.0e}", f"{r['fused_GBps']:.2f}",
                num(r, "triad_GBps", "triad", ".2f"), num(r, "memcpy_GBps", "memcpy", ".2f"),
                num(r, "fused_vs_triad", "triad", ".2f"), f"{r['speedup_vs_numpy']:.1f}",
                num(r, "speedup_vs_torch", "torch", ".1f"), f"{1e3 * r['fused_s']:.3f}"]
        print("  ".join(f"{v:>11}" for v in vals))
    for r in result["rows"]:
        for variant, why in r["invalid"].items():
            print(f"{variant} at {r['elements']} elements: invalid, not timed: {why}")


def bench_master(sizes: list[int], updates: int, threads: int, poll_ms: float) -> dict | None:
    """Workers commit pre-computed GEM updates as fast as they can; the real master applies."""
    from gem_mpi.algorithm.rule import payload_floats
    from gem_mpi.config import Config
    from gem_mpi.engine.master import Master
    from gem_mpi.problem import build_problem
    from gem_mpi.transport import start_mpi
    from gem_mpi.transport.endpoints import DONE, UPDATE, Layout, WorkerEndpoint

    comm = start_mpi()
    rank, size = comm.Get_rank(), comm.Get_size()
    if size < 2:
        raise SystemExit("bench master needs mpirun with at least 2 ranks")
    n_workers = size - 1
    rows = []
    for n in sizes:
        tmp = tempfile.mkdtemp() if rank == 0 else None
        cfg = Config.of(method="gem", model="quadratic", dataset="synthetic", quadratic_dim=n,
                        eval_every=0, max_steps=max(1, updates // n_workers),
                        metrics=os.path.join(tmp, "bench.h5") if tmp else None)
        steps = cfg.data.max_steps
        problem = build_problem(cfg.data, with_theta0=rank == 0)
        layout = Layout(n_workers, problem.n_params, payload_floats("gem", n))
        if rank == 0:
            triad_s = _triad_seconds(GEM_BYTES_PER_ELEMENT * n, threads)
            kernel = gem.Kernel(problem.offsets, threads=threads)
            master = Master(cfg, comm, layout, problem, kernel)
            master.run()
            summary = master.sup.summary
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
            for seq in range(steps):
                ep.commit(UPDATE, seq, version, 0.0, 0.0, (delta, a, ep.theta))
                ep.wait_slot_free()
                version = ep.pull()
            ep.commit(DONE, steps, version)
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
    from gem_mpi.transport import MPI, start_mpi

    comm = start_mpi()
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

    from gem_mpi.outputs import analysis

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
        from gem_mpi.baseline.sync import check_horovod

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
    k = sub.add_parser("kernel", help="fused kernel vs numpy, torch, memcpy and triad, each "
                       "validated against the numpy reference first")
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
