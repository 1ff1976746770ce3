"""What asynchrony costs: end-to-end updates/s against the machine's compute ceiling.

The ceiling is the same forward/backward/step loop with no MPI at all: plain momentum SGD on
the same model and data path, one process per core, all at once, their rates summed. Then
each asynchronous method trains as a real mpirun job with n workers, and its applied updates
per second over the master's wall time are divided by the ceiling measured minutes before in
the same command. Where the time went comes from the run's own metrics file: each worker's
split (compute, copying θ into the model, building the payload, commit, waiting for the
application, back-off sleeps, pull, --straggler sleeps) and the master's (idle, kernel, MPI
work, metrics); what no timer covers is printed as "other", so every row adds up to 100 %.

With more workers than cores, part of the gap is the time-sharing itself, not gem_mpi: so for
each n up to ``--shared-max`` the same plain loop also runs as n processes at once (no MPI,
no master), and each row shows its ratio to that time-shared ceiling too.
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing as mp
import os
import tempfile
import time

import numpy as np

from gem_mpi.bench import _machine
from gem_mpi.bench.compare import run_training
from gem_mpi.protocol import WORKER_TIME_SPLIT

WORKER_SPLIT = tuple(WORKER_TIME_SPLIT)  # the columns that split a worker's wall time
MASTER_SPLIT = ("wait", "apply", "mpi", "metrics")  # "wait" is the master's idle time


def _ceiling_process(options: dict, worker: int, n: int, steps: int, barrier: object,
                     out: object) -> None:
    """One process of the ceiling: set up, wait for the others, then time ``steps`` steps."""
    import torch

    from gem_mpi.config import Config
    from gem_mpi.problem import build_problem
    from gem_mpi.run.rank import data_stream, seed_dropout

    torch.set_num_threads(1)
    cfg = Config.of(**options)
    problem = build_problem(cfg.data, with_theta0=False)
    model = problem.model
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=cfg.optim.lr, momentum=cfg.optim.momentum)
    _, batches = data_stream(cfg.data, worker, n)

    def step(i: int) -> None:
        seed_dropout(cfg.data.seed, worker, i)
        x, y = next(batches)
        opt.zero_grad()
        problem.loss.mean(model(x), y).backward()
        opt.step()

    for i in range(10):  # warm-up, as the workers' first steps are
        step(i)
    barrier.wait()
    t = time.perf_counter()
    for i in range(steps):
        step(10 + i)
    out.put(steps / (time.perf_counter() - t))


def ceiling(options: dict, processes: int, steps: int) -> list[float]:
    """Steps/s of each of ``processes`` plain training loops running at once."""
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(processes), ctx.Queue()
    procs = [ctx.Process(target=_ceiling_process,
                         args=(options, w + 1, processes, steps, barrier, out))
             for w in range(processes)]
    for p in procs:
        p.start()
    rates = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    return rates


def _row(run: object, method: str, workers: int, job_s: float, ceiling_rate: float,
         shared_rate: float | None) -> dict:
    summary, wt = run.summary, run.worker_time
    wall = summary["wall_s"]
    rate = summary["updates"] / wall
    worker = {k: float(np.nanmean(wt[k] / wt["wall"])) for k in WORKER_SPLIT}
    worker["other"] = 1.0 - sum(worker.values())
    master = {k: summary[f"master_{k}_s"] / wall for k in MASTER_SPLIT}
    master["other"] = 1.0 - sum(master.values())
    # the master's CPU time over its wall time, in cores: what it takes from workers that
    # share its cores (its wall-time split cannot tell: descheduled, it still counts)
    master_cpu = float(summary.get("master_cpu_s", np.nan)) / wall
    return {"master_cpu": master_cpu,"method": method, "workers": workers, "updates": int(summary["updates"]),
            "wall_s": wall, "job_s": job_s, "updates_per_s": rate,
            "ratio": rate / ceiling_rate, "shared_ceiling": shared_rate,
            "ratio_shared": rate / shared_rate if shared_rate else None,
            "worker_split": worker, "master_split": master}


def bench_overhead(args: argparse.Namespace) -> dict:
    options = {"model": args.model, "dataset": args.dataset, "batch_size": args.batch_size}
    cores = len(os.sched_getaffinity(0))
    rates = ceiling(options, cores, args.ceiling_steps)
    total = float(sum(rates))
    rows = []
    with tempfile.TemporaryDirectory(prefix="gem_overhead_") as out_dir:
        for n in args.workers:
            shared = (float(sum(ceiling(options, n, args.ceiling_steps)))
                      if n <= args.shared_max else None)
            for method, mode, k in itertools.product(args.methods, args.worker_modes,
                                                     args.masters):
                for via, mpirun in enumerate(args.mpirun, 1):
                    run, job_s = run_training(
                        mpirun, n + k,
                        ["--method", method, "--model", args.model, "--dataset", args.dataset,
                         "--batch-size", str(args.batch_size), "--max-steps", str(args.steps),
                         "--eval-every", "0", "--threads", "1", "--log-every", "60",
                         "--worker-mode", mode, "--masters", str(k)],
                        os.path.join(out_dir, f"{method}_{mode}_{n}_{k}_{via}.h5"), "overhead")
                    rows.append({"via": via, "mode": mode, "masters": k,
                                 **_row(run, method, n, job_s, total, shared)})
    return {"bench": "overhead", "machine": _machine(), "model": args.model,
            "dataset": args.dataset, "batch_size": args.batch_size, "cores": cores,
            "ceiling_steps_per_s": total, "ceiling_each": rates, "steps": args.steps,
            "shared_max": args.shared_max, "launchers": args.mpirun, "rows": rows}


def print_overhead(result: dict) -> None:
    each = ", ".join(f"{r:.1f}" for r in result["ceiling_each"])
    print(f"gem_mpi.bench overhead: {result['machine']}; {result['model']}/{result['dataset']}, "
          f"b {result['batch_size']}, 1 torch thread per process, {result['steps']} steps per "
          "worker, no evaluation")
    print(f"ceiling: {result['cores']} plain momentum-SGD processes at once (one per core, no "
          f"MPI): {result['ceiling_steps_per_s']:.1f} steps/s ({each})")
    print("masters: K of --masters K (θ sharded over K ranks; the master split is rank 0's); "
          "ratio = applied updates/s over the master's wall time / ceiling; shared = the same "
          "plain loop as n processes at once (time-shared, no MPI; measured up to n = "
          f"{result['shared_max']}), vs shared = upd/s / shared; the splits are shares of wall "
          "time (workers: mean over workers), 'other' is what no timer covers; m:cpu = rank "
          "0's CPU time over its wall time (cores it took, all its threads)")
    for via, launcher in enumerate(result["launchers"], 1):
        print(f"via {via}: {launcher}")
    cols = ["method", "mode", "masters", "workers", "via", "upd/s", "ratio", "shared", "vs shared",
            *(f"w:{k}" for k in WORKER_SPLIT),
            "w:other", "m:idle", *(f"m:{k}" for k in MASTER_SPLIT[1:]), "m:other", "m:cpu"]
    print(" ".join(f"{c:>9}" for c in cols))
    for r in result["rows"]:
        w, m = r["worker_split"], r["master_split"]
        shared = r["shared_ceiling"]
        vals = [r["method"], r["mode"], r.get("masters", 1), r["workers"], r["via"], f"{r['updates_per_s']:.1f}",
                f"{r['ratio']:.2f}",
                f"{shared:.1f}" if shared else "–",
                f"{r['ratio_shared']:.2f}" if shared else "–",
                *(f"{100 * w[k]:.1f}%" for k in (*WORKER_SPLIT, "other")),
                *(f"{100 * m[k]:.1f}%" for k in (*MASTER_SPLIT, "other")),
                f"{r.get('master_cpu', float('nan')):.3f}"]
        print(" ".join(f"{v!s:>9}" for v in vals))
