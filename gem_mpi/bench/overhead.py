"""What asynchrony costs: end-to-end updates/s against the machine's compute ceiling.

The ceiling is the same forward/backward/step loop with no MPI at all: plain momentum SGD on
the same model and data path, one process per core, all at once, their rates summed. Then
each asynchronous method trains as a real mpirun job with n workers, and its applied updates
per second over the master's wall time are divided by the mean of the ceilings measured just
before and just after it (this machine's speed drifts by more than the gaps measured here).
Where the time went comes from the run's own metrics file: each worker's split (compute,
copying θ into the model, building the payload, commit, waiting for the application, back-off
sleeps, pull, --straggler sleeps) and the master's (idle, kernel, MPI work, metrics); what no
timer covers is printed as "other", so every row adds up to 100 %.

With more workers than cores, part of the gap is the time-sharing itself, not gem_mpi: so for
each n up to ``--shared-max`` the same plain loop also runs as n processes at once (no MPI,
no master), and each row shows its ratio to that time-shared ceiling too, and how the
workers' compute per step compares with the plain loop's step: what the run slows in the
compute itself, apart from the time spent outside it.

``--loader-workers 0 2`` makes every row once with the worker making its batches itself and
once with 2 loader processes making them. A run's split counts making a batch as compute, so
one worker's loop is also timed alone for each value (no MPI, one torch thread, as a
worker's): its time waiting for the next batch (load) against forward, backward and step
(compute), the values alternated so that the machine's drift hits them alike.
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing as mp
import os
import queue
import statistics
import tempfile
import time

import numpy as np

from gem_mpi.bench import Subcommands, _machine
from gem_mpi.bench.compare import run_training
from gem_mpi.config import AMP_BF16, AMP_OFF, Config
from gem_mpi.problem import build_problem
from gem_mpi.protocol import WORKER_TIME_SPLIT
from gem_mpi.run.rank import data_stream, seed_dropout

WORKER_SPLIT = tuple(WORKER_TIME_SPLIT)  # the columns that split a worker's wall time
MASTER_SPLIT = ("wait", "apply", "mpi", "metrics")  # "wait" is the master's idle time


def _single_trainer(options: dict, threads: int | None = 1, device: str = "cpu") -> tuple:
    """(config, problem, model in train mode on ``device``, momentum SGD) of one process on
    ``threads`` torch threads (None: torch's own default, a plain script's): the plain loop
    a worker's step is measured against."""
    import torch  # in the benchmark's own processes only

    if threads is not None:
        torch.set_num_threads(threads)
    cfg = Config.of(**options)
    problem = build_problem(cfg.data, with_theta0=False)
    model = problem.model.to(device)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=cfg.optim.lr, momentum=cfg.optim.momentum)
    return cfg, problem, model, opt


def _ceiling_process(options: dict, worker: int, n: int, steps: int, barrier: object,
                     out: object, device: str = "cpu", amp: str = AMP_OFF,
                     threads: int | None = 1) -> None:
    """One process of the ceiling: set up, wait for the others, then time ``steps`` steps
    on ``device`` (a GPU: each batch page-locked and copied in asynchronously, the clock
    stopped once the device has finished), the forward under bf16 autocast with --amp
    bf16, as a worker's."""
    import torch

    cfg, problem, model, opt = _single_trainer(options, threads, device)
    _, batches = data_stream(cfg.data, worker, n)
    on_gpu = torch.device(device).type == "cuda"
    dtype = torch.bfloat16 if amp == AMP_BF16 else torch.float32

    def step(i: int) -> None:
        seed_dropout(cfg.data.seed, worker, i)
        x, y = next(batches)
        if on_gpu:
            x = x.pin_memory().to(device, non_blocking=True)
            y = y.pin_memory().to(device, non_blocking=True)
        opt.zero_grad()
        with torch.autocast(torch.device(device).type, dtype=dtype, enabled=amp == AMP_BF16):
            loss = problem.loss.mean(model(x), y)
        loss.backward()
        opt.step()

    def finished() -> None:  # a GPU runs behind the host: wait for what was queued
        if on_gpu:
            torch.cuda.synchronize(device)

    for i in range(10):  # warm-up, as the workers' first steps are
        step(i)
    finished()
    barrier.wait()
    t = time.perf_counter()
    for i in range(steps):
        step(10 + i)
    finished()
    out.put(steps / (time.perf_counter() - t))


def _split_process(options: dict, steps: int, out: object) -> None:
    """One worker's loop alone, its seconds split: waiting for each batch (load), and the
    forward, backward and step (compute)."""
    cfg, problem, model, opt = _single_trainer(options)
    _, batches = data_stream(cfg.data, 1, 1)
    load = compute = 0.0
    try:
        for i in range(10 + steps):  # 10 to warm up, as the ceiling's
            if i == 10:
                load = compute = 0.0
            seed_dropout(cfg.data.seed, 1, i)
            t0 = time.perf_counter()
            x, y = next(batches)
            t1 = time.perf_counter()
            opt.zero_grad()
            problem.loss.mean(model(x), y).backward()
            opt.step()
            load, compute = load + t1 - t0, compute + time.perf_counter() - t1
    finally:
        batches.close()
    out.put({"loaders": cfg.data.loader_workers, "steps_per_s": steps / (load + compute),
             "load_ms": 1e3 * load / steps, "compute_ms": 1e3 * compute / steps})


def loader_split(options: dict, values: list[int], steps: int, repeat: int) -> list[dict]:
    """:func:`_split_process` for each --loader-workers value, alternated ``repeat`` times."""
    ctx = mp.get_context("spawn")
    rows = []
    for rep in range(repeat):
        for n in values:
            out = ctx.Queue()
            proc = ctx.Process(target=_split_process,
                               args=({**options, "loader_workers": n}, steps, out))
            proc.start()
            rows.append({"repeat": rep + 1, **out.get(timeout=600)})
            proc.join()
    return rows


def ceiling(options: dict, processes: int, steps: int, device: str = "cpu",
            amp: str = AMP_OFF, threads: int | None = 1) -> list[float]:
    """Steps/s of each of ``processes`` plain training loops running at once (spawned: a
    GPU's memory goes back when they end)."""
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(processes), ctx.Queue()
    procs = [ctx.Process(target=_ceiling_process,
                         args=(options, w + 1, processes, steps, barrier, out, device, amp,
                               threads))
             for w in range(processes)]
    for p in procs:
        p.start()
    rates: list[float] = []
    deadline = time.monotonic() + 600
    while len(rates) < processes:
        try:
            rates.append(out.get(timeout=2))
        except queue.Empty:
            failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if failed or time.monotonic() > deadline:  # not ten minutes' wait for a dead one
                for p in procs:
                    p.kill()
                raise SystemExit(f"bench: a plain-loop process failed (exit {failed[0]})"
                                 if failed else "bench: the plain loop took over 600 s")
    for p in procs:
        p.join()
    return rates


class Ceilings:
    """The plain loop's rates, measured just before and just after every run.

    A shared machine's speed drifts by 10–20 % over minutes (docs/PERFORMANCE.md), more than
    the gaps this bench is after; so each run is divided by the mean of the ceilings that
    bracket it, and the row shows how far they drifted. A point holds the all-cores
    ceiling and, for n up to ``shared_max``, the time-shared one of n processes."""
    def __init__(self, options: dict, cores: int, steps: int, shared_max: int) -> None:
        self.options, self.cores, self.steps, self.shared_max = (options, cores, steps,
                                                                 shared_max)
        self.points: list[dict] = []  # every point measured, in order (the JSON keeps them)

    def measure(self, n: int) -> dict:
        each = ceiling(self.options, self.cores, self.steps)
        shared = (float(sum(ceiling(self.options, n, self.steps)))
                  if n <= self.shared_max else None)
        point = {"workers": n, "total": float(sum(each)), "each": each, "shared": shared}
        self.points.append(point)
        return point


def _mean(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else (a + b) / 2.0


def _row(run: object, method: str, workers: int, job_s: float, before: dict,
         after: dict) -> dict:
    summary, wt = run.summary, run.worker_time
    wall = summary["wall_s"]
    rate = summary["updates"] / wall
    ceiling_rate = _mean(before["total"], after["total"])
    shared_rate = _mean(before["shared"], after["shared"])
    worker = {k: float(np.nanmean(wt[k] / wt["wall"])) for k in WORKER_SPLIT}
    worker["other"] = 1.0 - sum(worker.values())
    master = {k: summary[f"master_{k}_s"] / wall for k in MASTER_SPLIT}
    master["other"] = 1.0 - sum(master.values())
    # the master's CPU time over its wall time, in cores: what it takes from workers that
    # share its cores (its wall-time split cannot tell: descheduled, it still counts)
    master_cpu = float(summary.get("master_cpu_s", np.nan)) / wall
    # a worker's compute (θ into the model, forward, backward, Δθ) per step against the
    # plain loop's step run as the same number of processes: above 1, the compute itself
    # is slower in the run than alone, whatever the time outside it
    step = float(np.nanmean((wt["compute"] + wt["load"]) / (summary["updates"] / workers)))
    compute_vs_plain = step * shared_rate / workers if shared_rate else None
    reference = "shared" if shared_rate else "total"
    return {"master_cpu": master_cpu, "method": method, "workers": workers,
            "updates": int(summary["updates"]), "wall_s": wall, "job_s": job_s,
            "updates_per_s": rate, "ceiling": ceiling_rate, "ratio": rate / ceiling_rate,
            "shared_ceiling": shared_rate,
            "ratio_shared": rate / shared_rate if shared_rate else None,
            "drift": after[reference] / before[reference],
            "compute_vs_plain": compute_vs_plain,
            "worker_split": worker, "master_split": master}


def bench_overhead(args: argparse.Namespace) -> dict:
    options = {"model": args.model, "dataset": args.dataset, "batch_size": args.batch_size}
    cores = len(os.sched_getaffinity(0))
    ceilings = Ceilings(options, cores, args.ceiling_steps, args.shared_max)
    rows = []
    with tempfile.TemporaryDirectory(prefix="gem_overhead_") as out_dir:
        for n in args.workers:
            before = ceilings.measure(n)
            for method, mode, k, rep, lw in itertools.product(
                    args.methods, args.worker_modes, args.masters, range(args.repeat),
                    args.loader_workers):
                for via, mpirun in enumerate(args.mpirun, 1):
                    run, job_s = run_training(
                        mpirun, n + k,
                        ["--method", method, "--model", args.model, "--dataset", args.dataset,
                         "--batch-size", str(args.batch_size), "--max-steps", str(args.steps),
                         "--eval-every", "0", "--threads", "1", "--log-every", "60",
                         "--worker-mode", mode, "--masters", str(k),
                         "--loader-workers", str(lw)],
                        os.path.join(out_dir, f"{method}_{mode}_{n}_{k}_{rep}_{lw}_{via}.h5"),
                        "overhead")
                    after = ceilings.measure(n)
                    rows.append({"via": via, "mode": mode, "masters": k, "repeat": rep + 1,
                                 "loaders": lw, **_row(run, method, n, job_s, before, after)})
                    before = after
    split = (loader_split(options, args.loader_workers, args.ceiling_steps, args.repeat)
             if max(args.loader_workers) > 0 else [])
    first = ceilings.points[0]
    return {"bench": "overhead", "machine": _machine(), "model": args.model,
            "dataset": args.dataset, "batch_size": args.batch_size, "cores": cores,
            "ceiling_steps_per_s": first["total"], "ceiling_each": first["each"],
            "ceilings": ceilings.points, "steps": args.steps, "repeat": args.repeat,
            "shared_max": args.shared_max, "launchers": args.mpirun, "rows": rows,
            "loader_split": split, "split_steps": args.ceiling_steps}


def _medians(rows: list[dict]) -> list[tuple[tuple, list[dict]]]:
    """The rows grouped by everything but the repeat, in their order."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        key = (r["method"], r["mode"], r.get("masters", 1), r.get("loaders", 0),
               r["workers"], r["via"])
        groups.setdefault(key, []).append(r)
    return list(groups.items())


def _spread(group: list[dict], key: str) -> str:
    vals = [g[key] for g in group if g[key] is not None]
    if not vals:
        return "–"
    return f"{statistics.median(vals):.2f} ({min(vals):.2f}–{max(vals):.2f})"


def print_overhead(result: dict) -> None:
    first = result["ceilings"][0]
    each = ", ".join(f"{r:.1f}" for r in first["each"])
    totals = ", ".join(f"{p['total']:.1f}" for p in result["ceilings"])
    print(f"gem_mpi.bench overhead: {result['machine']}; {result['model']}/{result['dataset']}, "
          f"b {result['batch_size']}, 1 torch thread per process, {result['steps']} steps per "
          f"worker, no evaluation, {result['repeat']} run(s) per row")
    print(f"ceiling: {result['cores']} plain momentum-SGD processes at once (one per core, no "
          f"MPI), measured before and after every run: first {first['total']:.1f} steps/s "
          f"({each}), all {totals}")
    print("masters: K of --masters K (θ sharded over K ranks; the master split is rank 0's); "
          "ratio = applied updates/s over the master's wall time / the mean of the ceilings "
          "just before and just after the run; shared = the same plain loop as n processes at "
          "once (time-shared, no MPI; measured up to n = "
          f"{result['shared_max']}), vs shared = upd/s / shared; drift = the ceiling after "
          "the run over the one before (shared where measured); c/plain = a worker's compute "
          "per step over the plain loop's step (n processes at once); the splits are shares "
          "of wall time (workers: mean over workers), 'other' is what no timer covers; m:cpu "
          "= rank 0's CPU time over its wall time (cores it took, all its threads)")
    for via, launcher in enumerate(result["launchers"], 1):
        print(f"via {via}: {launcher}")
    cols = ["method", "mode", "masters", "loaders", "workers", "via", "run", "upd/s", "ratio",
            "shared",
            "vs shared", "drift", "c/plain", *(f"w:{k}" for k in WORKER_SPLIT),
            "w:other", "m:idle", *(f"m:{k}" for k in MASTER_SPLIT[1:]), "m:other", "m:cpu"]
    print(" ".join(f"{c:>9}" for c in cols))
    for r in result["rows"]:
        w, m = r["worker_split"], r["master_split"]
        shared = r["shared_ceiling"]
        vals = [r["method"], r["mode"], r.get("masters", 1), r.get("loaders", 0),
                r["workers"], r["via"],
                r.get("repeat", 1), f"{r['updates_per_s']:.1f}", f"{r['ratio']:.2f}",
                f"{shared:.1f}" if shared else "–",
                f"{r['ratio_shared']:.2f}" if shared else "–", f"{r['drift']:.2f}",
                f"{r['compute_vs_plain']:.2f}" if r["compute_vs_plain"] else "–",
                *(f"{100 * w[k]:.1f}%" for k in (*WORKER_SPLIT, "other")),
                *(f"{100 * m[k]:.1f}%" for k in (*MASTER_SPLIT, "other")),
                f"{r.get('master_cpu', float('nan')):.3f}"]
        print(" ".join(f"{v!s:>9}" for v in vals))
    if result["repeat"] > 1:
        print(f"medians over the {result['repeat']} runs of each row (min–max):")
        for (method, mode, k, lw, n, via), group in _medians(result["rows"]):
            print(f"  {method} {mode}, {k} master(s), {lw} loader(s), {n} worker(s), via {via}: "
                  f"ratio "
                  f"{_spread(group, 'ratio')}, vs shared {_spread(group, 'ratio_shared')}, "
                  f"c/plain {_spread(group, 'compute_vs_plain')}")
    split = result.get("loader_split") or []
    if split:
        print(f"one worker's loop alone, by --loader-workers (1 torch thread, no MPI; load = "
              f"waiting for the next batch, compute = forward, backward, step), "
              f"{result['split_steps']} steps, the values alternated:")
        print(" ".join(f"{c:>10}" for c in ("loaders", "run", "steps/s", "load ms",
                                             "compute ms", "load", "compute")))
        for r in split:
            step = r["load_ms"] + r["compute_ms"]
            print(" ".join(f"{v!s:>10}" for v in (
                r["loaders"], r["repeat"], f"{r['steps_per_s']:.1f}", f"{r['load_ms']:.1f}",
                f"{r['compute_ms']:.1f}", f"{100 * r['load_ms'] / step:.1f}%",
                f"{100 * r['compute_ms'] / step:.1f}%")))
        rate = {n: statistics.median(r["steps_per_s"] for r in split if r["loaders"] == n)
                for n in dict.fromkeys(r["loaders"] for r in split)}
        base = rate.get(0)
        if base:
            print("steps/s against the worker making its batches itself (medians): " + ", ".join(
                f"{n} loaders {v / base:.2f}x" for n, v in rate.items() if n))


def register(sub: Subcommands) -> argparse.ArgumentParser:
    """``overhead``: its options, and what runs and prints it."""
    p = sub.add_parser("overhead", help="end-to-end updates/s of the asynchronous methods "
                       "against the compute ceiling (plain SGD, one process per core), with "
                       "where the time goes (run it outside mpirun)")
    p.add_argument("--workers", type=int, nargs="+", default=[4, 8])
    p.add_argument("--methods", nargs="+", default=["gem", "downpour", "adaptive"])
    p.add_argument("--worker-modes", nargs="+", default=["wait", "pipelined"],
                   choices=["wait", "pipelined"], help="a row per worker mode, side by side")
    p.add_argument("--masters", type=int, nargs="+", default=[1],
                   help="θ sharded over K master ranks (gem_mpi.train's --masters): a row per "
                   "K, each with n workers (n + K ranks)")
    p.add_argument("--steps", type=int, default=600, help="steps per worker")
    p.add_argument("--ceiling-steps", type=int, default=300, help="steps per ceiling process")
    p.add_argument("--repeat", type=int, default=1, help="runs per row, each between two "
                   "ceiling measurements; with more than one, the medians are printed too")
    p.add_argument("--shared-max", type=int, default=16, help="measure the time-shared "
                   "ceiling (n plain processes at once) for n up to this many workers")
    p.add_argument("--model", default="mnist-cnn")
    p.add_argument("--dataset", default="fashion-mnist")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--loader-workers", type=int, nargs="+", default=[0],
                   help="gem_mpi.train's --loader-workers: a row per value, side by side; "
                   "with a value above 0, also one worker's loop alone (no MPI) for each, "
                   "alternated, split into waiting for batches and computing")
    p.add_argument("--mpirun", nargs="+", default=["mpirun --oversubscribe --mca btl self,vader"],
                   help="launcher command line(s) (one node); with several, every run is made "
                   "with each, side by side against the same ceiling")
    p.set_defaults(run=bench_overhead, show=print_overhead)
    return p
