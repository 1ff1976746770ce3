"""The fused kernel against the numpy reference, torch, memcpy and a STREAM triad, each
validated against the reference before it is timed."""

from __future__ import annotations

import argparse
from functools import partial

import numpy as np

from gem_mpi.algorithm import kernel as gem
from gem_mpi.bench import OptionError, Subcommands, _machine, _time

# Bytes the fused GEM step touches per element: a finiteness pass reading Δθ, κ|m|, s
# (12 B), then the update reading θ, Δθ, κ|m|, s (16 B) and writing θ (4 B).
GEM_BYTES_PER_ELEMENT = 32


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
    from gem_mpi.algorithm import _core  # here: bench_kernel says so when it is not built

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
           np.zeros((n_tensors, 2)), np.zeros((n_tensors, gem.COUNTS), np.int64))
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
        return "θ is bit-identical but the π histogram or the clamp or Δθ = 0 counts differ"
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


def _kernel_rows(n: int, threads: list[int], with_torch: bool) -> list[dict]:
    """One row per thread count: validate every variant on the same inputs as the numpy
    reference, then time the valid ones, cache-warm: the median of repeated calls on the
    same buffers. numpy is timed once (it runs on one thread)."""
    core, why_not = gem.load_extension()
    if core is None:
        raise SystemExit(f"gem_mpi.bench kernel: the C++ extension gem_mpi.algorithm._core is "
                         f"{why_not}")
    eps, pi_max, n_tensors = 1e-16, 5.0, 8
    offsets = np.linspace(0, n, n_tensors + 1).astype(np.int64)
    theta0, delta, a, s = _inputs(n)
    theta = theta0.copy()  # the timed calls step it; every check starts from θ₀
    ref = _reference(theta0, delta, a, s, offsets, eps, pi_max)
    for t in threads:
        bad = _check_fused(core, ref, theta0, delta, a, s, offsets, eps, pi_max, t)
        if bad:  # every column is a ratio to it: nothing is worth timing
            raise SystemExit(f"gem_mpi.bench kernel: the C++ kernel fails validation against "
                             f"the numpy reference at {n} elements on {t} thread(s) ({bad}); "
                             "nothing timed")
    bytes_touched = GEM_BYTES_PER_ELEMENT * n
    hist, sums, counts = (np.zeros_like(x) for x in ref[1:])
    numpy_s = _time(lambda: gem.gem_step_numpy(theta, delta, a, s, offsets, eps, pi_max, hist,
                                               sums, counts))
    rows = []
    for t in threads:
        row: dict = {"elements": n, "threads": t, "bytes_touched": bytes_touched,
                     "invalid": _check_bounds(core, bytes_touched // 8, t)}
        step = None
        if with_torch:
            import torch

            torch.set_num_threads(t)
            step = _torch_gem(n_tensors, offsets, eps, pi_max)
            row["torch_max_abs_diff"], row["invalid"]["torch"] = _check_torch(
                step, ref, theta0, delta, a, s, pi_max)
        row["invalid"] = {k: v for k, v in row["invalid"].items() if v}
        row["fused_s"] = _time(partial(core.gem_step, theta, delta, a, s, offsets, eps, pi_max,
                                       hist, sums, counts, t))
        row["numpy_s"] = numpy_s
        if step is not None and "torch" not in row["invalid"]:
            import torch

            tt, td, ta, ts = (torch.from_numpy(x) for x in (theta, delta, a, s))
            row["torch_s"] = _time(partial(step, tt, td, ta, ts))
        # memcpy and triad moving the same number of bytes as the fused step
        if "memcpy" not in row["invalid"]:
            src = np.ones(bytes_touched // 8, np.float32)  # read + write = bytes_touched
            dst = np.empty_like(src)
            row["memcpy_s"] = _time(partial(core.copy, dst, src, t))
        if "triad" not in row["invalid"]:
            row["triad_s"] = _triad_seconds(bytes_touched, t)
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
        if rows and rows[0]["threads"] == 1:
            row["speedup_vs_1_thread"] = rows[0]["fused_s"] / row["fused_s"]
        elif t == 1:
            row["speedup_vs_1_thread"] = 1.0
        rows.append(row)
    return rows


# Sizes of the fork/join comparison: from a call that is all dispatch to one that streams.
DISPATCH_SIZES = (1_024, 16_384, 262_144, 4_194_304)


def _dispatch_rows(threads: list[int]) -> list[dict]:
    """What a call on t threads costs through the persistent pool and with threads spawned
    for it, side by side: a triad on n elements (3 float32 streams) on 1 thread, on t pool
    threads and on t spawned threads. Below the size where t threads beat 1, threading does
    not pay."""
    from gem_mpi.algorithm import _core  # here: bench_kernel says so when it is not built

    rows = []
    for n in DISPATCH_SIZES:
        a, b, c = (np.ones(n, np.float32) for _ in range(3))
        one = _time(partial(_core.triad, a, b, c, 3.0, 1), min_seconds=0.1)
        for t in (t for t in threads if t > 1):
            pool = _time(partial(_core.triad, a, b, c, 3.0, t), min_seconds=0.1)
            spawn = _time(partial(_core.triad, a, b, c, 3.0, t, True), min_seconds=0.1)
            rows.append({"elements": n, "threads": t, "one_thread_s": one, "pool_s": pool,
                         "spawn_s": spawn, "pool_speedup": one / pool,
                         "spawn_speedup": one / spawn})
    return rows


def default_threads() -> list[int]:
    """1 to the cores this process may run on."""
    import os

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)
    return list(range(1, cores + 1))


def bench_kernel(sizes: list[int], threads: list[int], with_torch: bool) -> dict:
    rows = [row for n in sizes for row in _kernel_rows(n, threads, with_torch)]
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
            "dispatch": _dispatch_rows(threads), "validated": validated,
            "failed": sorted(failed), "timing": "cache-warm"}


def print_kernel(result: dict) -> None:
    threads = result["threads"]
    print(f"gem_mpi.bench kernel: {result['machine']}; threads "
          f"{', '.join(map(str, threads))}; {GEM_BYTES_PER_ELEMENT} bytes touched per element")
    failed = f"; FAILED, not timed: {', '.join(result['failed'])}" if result["failed"] else ""
    print("validated before timing, on the inputs of the numpy reference gem_step_numpy "
          f"(timed as ×numpy), at every thread count: {'; '.join(result['validated'])}"
          f"{failed}")
    print("timings are cache-warm: the median of repeated calls on the same buffers, so "
          "sizes whose bytes fit in the cache run from it; triad, memcpy and torch on the "
          "row's threads, numpy on one")
    cols = ["elements", "threads", "fused GB/s", "triad GB/s", "memcpy GB/s", "fused/triad",
            "×1 thread", "×numpy", "×torch", "fused ms"]
    print("  ".join(f"{c:>11}" for c in cols))

    def num(r: dict, key: str, variant: str, fmt: str) -> str:
        if variant in r["invalid"]:
            return "invalid"
        return format(r[key], fmt) if key in r else "-"

    for r in result["rows"]:
        vals = [f"{r['elements']:.0e}", str(r["threads"]), f"{r['fused_GBps']:.2f}",
                num(r, "triad_GBps", "triad", ".2f"), num(r, "memcpy_GBps", "memcpy", ".2f"),
                num(r, "fused_vs_triad", "triad", ".2f"),
                num(r, "speedup_vs_1_thread", "-", ".2f"), f"{r['speedup_vs_numpy']:.1f}",
                num(r, "speedup_vs_torch", "torch", ".1f"), f"{1e3 * r['fused_s']:.3f}"]
        print("  ".join(f"{v:>11}" for v in vals))
    for r in result["rows"]:
        for variant, why in r["invalid"].items():
            print(f"{variant} at {r['elements']} elements on {r['threads']} thread(s): "
                  f"invalid, not timed: {why}")
    if result["dispatch"]:
        print("a call on t threads: the persistent pool against threads spawned per call "
              "(spawning is kept only for this comparison), each a triad on n elements, "
              "against the same triad on 1 thread; ×1 above 1: threading pays")
        cols = ["elements", "threads", "1 thread µs", "pool µs", "spawn µs", "pool ×1",
                "spawn ×1"]
        print("  ".join(f"{c:>11}" for c in cols))
        for r in result["dispatch"]:
            vals = [f"{r['elements']}", str(r["threads"]), f"{1e6 * r['one_thread_s']:.1f}",
                    f"{1e6 * r['pool_s']:.1f}", f"{1e6 * r['spawn_s']:.1f}",
                    f"{r['pool_speedup']:.2f}", f"{r['spawn_speedup']:.2f}"]
            print("  ".join(f"{v:>11}" for v in vals))


def register(sub: Subcommands) -> argparse.ArgumentParser:
    """``kernel``: its options, and what runs and prints it."""
    p = sub.add_parser("kernel", help="fused kernel vs numpy, torch, memcpy and triad, each "
                       "validated against the numpy reference first")
    p.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000, 10_000_000])
    p.add_argument("--no-torch", action="store_true", help="skip the torch eager column")
    p.add_argument("--threads", type=int, nargs="+", default=None,
                   help="thread counts, each a row per size (default 1 to the cores; "
                   "GEM_NUM_THREADS is not read here)")
    p.set_defaults(run=_run, show=print_kernel)
    return p


def _run(args: argparse.Namespace) -> dict:
    threads = args.threads or default_threads()
    if min(threads) < 1:
        raise OptionError("--threads: every count must be at least 1")
    return bench_kernel(args.sizes, threads, not args.no_torch)
