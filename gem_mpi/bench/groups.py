"""Worker groups (``--group-size G``) against as many independent workers: the same ranks,
model, per-rank batch and samples, each a real mpirun job, read from its metrics file."""

from __future__ import annotations

import argparse
import os
import tempfile

from gem_mpi.bench import Subcommands, _machine
from gem_mpi.bench.compare import run_training
from gem_mpi.outputs import analysis


def _groups_run(group: int, args: argparse.Namespace, out_dir: str) -> dict:
    """``args.workers`` worker ranks as independent workers (group 1) or in groups."""
    steps = args.max_steps  # a worker's b or a group's G × b: the same samples in all
    run, job_s = run_training(
        args.mpirun, args.workers + 1,
        ["--model", args.model, "--dataset", args.dataset, "--batch-size",
         str(args.batch_size), "--max-steps", str(steps), "--group-size", str(group),
         "--eval-every", "0", "--threads", "1", "--log-every", "30"],
        os.path.join(out_dir, f"g{group}.h5"), "groups")
    per_update = analysis.samples_per_update(run)
    moved = int(run.attrs["bytes_committed_per_update"]) + int(
        run.attrs["bytes_pulled_per_update"])
    final = analysis.final_test(run)
    return {"group_size": group, "workers_seen": run.n_workers, "job_s": job_s,
            "wall_s": analysis.wall_seconds(run), "updates": analysis.applied_updates(run),
            "updates_per_s": analysis.updates_per_second(run),
            "samples": analysis.applied_updates(run) * per_update,
            "samples_per_s": analysis.samples_per_second(run),
            "master_bytes_per_sample": moved / per_update,
            "final_loss": final.loss, "final_accuracy": final.accuracy}


def bench_groups(args: argparse.Namespace) -> dict:
    """Independent workers first, then groups of ``--group-size``, one job at a time."""
    if args.group_size < 2 or args.workers % args.group_size:
        raise SystemExit(f"bench groups: --group-size {args.group_size} must be at least 2 "
                         f"and divide --workers {args.workers}")
    with tempfile.TemporaryDirectory(prefix="gem_groups_") as out_dir:
        rows = [_groups_run(g, args, out_dir) for g in (1, args.group_size)]
    base = rows[0]
    for r in rows:
        r["bytes_per_sample_vs_workers"] = r["master_bytes_per_sample"] / base[
            "master_bytes_per_sample"]
        r["samples_per_s_vs_workers"] = r["samples_per_s"] / base["samples_per_s"]
    return {"bench": "groups", "machine": _machine(), "model": args.model,
            "dataset": args.dataset, "worker_ranks": args.workers,
            "batch_per_rank": args.batch_size, "rows": rows}


def print_groups(result: dict) -> None:
    print(f"gem_mpi.bench groups: {result['machine']}; {result['model']}/{result['dataset']}, "
          f"{result['worker_ranks']} worker ranks + 1 master, {result['batch_per_rank']} "
          "samples per rank and step, the same samples in every row; ratios against the "
          "independent workers")
    cols = ["group size", "workers", "updates", "upd/s", "samples/s", "vs workers",
            "B/sample", "vs workers", "final loss", "final acc"]
    print("  ".join(f"{c:>10}" for c in cols))
    for r in result["rows"]:
        vals = [r["group_size"], r["workers_seen"], r["updates"], f"{r['updates_per_s']:.1f}",
                f"{r['samples_per_s']:.0f}", f"{r['samples_per_s_vs_workers']:.2f}",
                f"{r['master_bytes_per_sample']:.0f}", f"{r['bytes_per_sample_vs_workers']:.2f}",
                f"{r['final_loss']:.4f}", f"{100 * r['final_accuracy']:.2f}%"]
        print("  ".join(f"{v!s:>10}" for v in vals))
    print("workers: what the master sees (groups count once); B/sample: bytes committed and "
          "pulled through the master per training sample")


def register(sub: Subcommands) -> argparse.ArgumentParser:
    """``groups``: its options, and what runs and prints it."""
    p = sub.add_parser("groups", help="worker groups (--group-size) vs as many independent "
                       "workers: master updates/s, bytes per sample, final loss at equal "
                       "samples, each a real mpirun job (run it outside mpirun)")
    p.add_argument("--workers", type=int, default=4, help="worker ranks (plus one master)")
    p.add_argument("--group-size", type=int, default=2)
    p.add_argument("--model", default="mnist-cnn")
    p.add_argument("--dataset", default="fashion-mnist")
    p.add_argument("--max-steps", type=int, default=200, help="steps per worker or group "
                   "(a group's step takes G times the samples: as many in all)")
    p.add_argument("--batch-size", type=int, default=32, help="samples per rank and step")
    p.add_argument("--mpirun", default="mpirun --oversubscribe --mca btl self,vader",
                   help="launcher command line (one node)")
    p.set_defaults(run=bench_groups, show=print_groups)
    return p
