"""GEM against the other asynchronous rules, synchronous SGD (Horovod, DDP) and DiLoCo, each a
real mpirun job on the same model, data streams and samples, with a straggler."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

from gem_mpi.baseline.diloco import check_diloco
from gem_mpi.baseline.sync import check_ddp, check_horovod
from gem_mpi.bench import Subcommands, _machine, mpi_env
from gem_mpi.config import ASYNC_METHODS, DDP, DILOCO, SYNC, SYNC_METHODS, synchronous
from gem_mpi.outputs import analysis, runfile

COMPARE_METHODS = (*ASYNC_METHODS, *SYNC_METHODS)


def run_training(mpirun: str, ranks: int, train_args: list[str], h5: str,
                 who: str) -> tuple[object, float]:
    """``python -m gem_mpi.train`` as a real mpirun job writing ``h5``: (its run as
    analysis reads it, the job's seconds). A failed run ends the benchmark with its tail."""
    import shlex
    import subprocess


    cmd = [*shlex.split(mpirun), "-n", str(ranks), sys.executable, "-m", "gem_mpi.train",
           *train_args, "--metrics", h5]
    print(f"gem_mpi.bench {who}: {' '.join(cmd)}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    res = subprocess.run(cmd, env=mpi_env(), capture_output=True, text=True, check=False)
    job_s = time.perf_counter() - t0
    if res.returncode != 0:
        tail = "\n".join(res.stderr.strip().splitlines()[-5:])
        raise SystemExit(f"bench {who}: a run failed (exit {res.returncode}):\n{tail}")
    return runfile.load_run(h5), job_s


def _compare_run(method: str, workers: int, args: argparse.Namespace, out_dir: str) -> dict:
    """One training run as a real mpirun job; its numbers come from its metrics file."""
    ranks = workers if synchronous(method) else workers + 1
    # evaluations at the same numbers of samples: sync counts steps of all workers at once
    eval_every = args.eval_every if synchronous(method) else args.eval_every * workers
    run, job_s = run_training(
        args.mpirun, ranks,
        ["--method", method, "--model", args.model, "--dataset", args.dataset,
         "--max-steps", str(args.max_steps), "--batch-size", str(args.batch_size),
         "--eval-every", str(eval_every), "--log-every", "30", "--threads", "1",
         *(["--straggler", args.straggler] if args.straggler else []),
         *(["--diloco-steps", str(args.diloco_steps)] if method == DILOCO else [])],
        os.path.join(out_dir, f"{method}.h5"), "compare")
    wall = analysis.wall_seconds(run)
    return {"method": method, "ranks": ranks, "workers": workers, "job_s": job_s,
            "wall_s": wall, "updates": analysis.applied_updates(run),
            "updates_per_s": analysis.updates_per_second(run),
            "samples_per_s": analysis.samples_per_second(run),
            "time_to_target_s": analysis.time_to_accuracy(run, args.target_accuracy),
            "final_accuracy": analysis.final_test(run).accuracy,
            "final_loss": analysis.final_test(run).loss}


def bench_compare(args: argparse.Namespace) -> dict:
    """Each method trains the same model on the same data streams with the same per-worker
    budget, one after the other (never at once: they would share the cores)."""
    if SYNC in args.methods:
        check_horovod()
    if DDP in args.methods:
        check_ddp()
    if DILOCO in args.methods:
        check_diloco()
    rows = []
    with tempfile.TemporaryDirectory(prefix="gem_compare_") as out_dir:
        rows = [_compare_run(m, args.workers, args, out_dir) for m in args.methods]
    base = next((r for r in rows if r["method"] == SYNC), rows[0])
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
            "speedup", "final acc", "final loss"]
    print("  ".join(f"{c:>11}" for c in cols))
    for r in result["rows"]:
        t = r["time_to_target_s"]
        sp = r["speedup_to_target_vs_base"]
        vals = [r["method"], r["ranks"], f"{r['wall_s']:.1f}", f"{r['updates_per_s']:.1f}",
                f"{r['samples_per_s']:.0f}", f"{r['samples_per_s_vs_base']:.2f}",
                "not reached" if t is None else f"{t:.1f}",
                "-" if sp is None else f"{sp:.2f}", f"{100 * r['final_accuracy']:.2f}%",
                f"{r['final_loss']:.4f}"]
        print("  ".join(f"{v!s:>11}" for v in vals))
    print("upd/s: applied updates (sync, ddp, diloco: steps of all workers) per second over "
          "the run (diloco evaluates at its rounds' ends only); "
          "samples/s: while every worker still ran; speedup: base's time to target over this "
          "method's")


def register(sub: Subcommands) -> argparse.ArgumentParser:
    """``compare``: its options, and what runs and prints it."""
    p = sub.add_parser("compare", help="GEM vs the other asynchronous rules vs synchronous "
                       "SGD (Horovod, DDP) vs DiLoCo, each a real mpirun job (run it outside "
                       "mpirun)")
    p.add_argument("--methods", nargs="+", default=list(COMPARE_METHODS),
                   choices=COMPARE_METHODS,
                   help="methods, one run each; ratios against sync when it is there")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--straggler", default="2:5", help="WORKER:FACTOR, as gem_mpi.train's "
                   "option ('' for none)")
    p.add_argument("--model", default="mnist-cnn")
    p.add_argument("--dataset", default="fashion-mnist")
    p.add_argument("--max-steps", type=int, default=300, help="steps per worker")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--eval-every", type=int, default=25, help="evaluate every this many "
                   "steps per worker (every workers × this many updates when asynchronous)")
    p.add_argument("--target-accuracy", type=float, default=0.75)
    p.add_argument("--diloco-steps", type=int, default=20, help="diloco's H: inner steps "
                   "per round")
    p.add_argument("--mpirun", default="mpirun --oversubscribe --mca btl self,vader",
                   help="launcher command line (one node)")
    p.set_defaults(run=bench_compare, show=print_compare)
    return p
