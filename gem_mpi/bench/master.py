"""The master's updates/s under mpirun, against its memory-bandwidth bound."""

from __future__ import annotations

import argparse
import os
import tempfile

import numpy as np

from gem_mpi.algorithm import kernel as gem
from gem_mpi.bench import Subcommands, _machine
from gem_mpi.bench.kernel import GEM_BYTES_PER_ELEMENT, _triad_seconds
from gem_mpi.config import Config
from gem_mpi.engine import shards
from gem_mpi.engine.master import Master, Role
from gem_mpi.problem import build_problem
from gem_mpi.protocol import DONE, UPDATE, WORKER_TIME_COLUMNS
from gem_mpi.run.rank import local_placement
from gem_mpi.run.supervisor import StopFlag
from gem_mpi.session import supervise
from gem_mpi.transport import MPI, soft_barrier, start_mpi
from gem_mpi.transport.endpoints import WorkerShards


def bench_master(sizes: list[int], updates: int, poll_ms: float,
                 worker_step_ms: float | None = None,
                 masters: list[int] | None = None) -> dict | None:
    """Workers commit pre-computed GEM updates as fast as they can; the real master applies,
    on the kernel threads a run would give each master (GEM_NUM_THREADS, else its share of
    the node's cores the workers beside it leave). ``masters``: one row per K (θ sharded over K master ranks,
    --masters K), side by side; every K gets the same workers (the job's ranks less the
    largest K), the ranks a smaller K does not use wait."""
    world = start_mpi()
    masters = masters or [1]
    top = max(masters)
    if world.Get_size() <= top:
        raise SystemExit(f"bench master --masters {top} needs mpirun with at least {top + 1} "
                         "ranks")
    rows = []
    for n in sizes:
        for k_masters in masters:
            # the masters 0..K-1 and the workers (the ranks from the largest K on); the
            # ranks a K leaves out sleep until the next one (a blocking collective spins)
            soft_barrier(world)
            rank = world.Get_rank()
            used = rank < k_masters or rank >= top
            comm = world.Split(0 if used else MPI.UNDEFINED, rank)
            if comm == MPI.COMM_NULL:
                continue
            rank, n_workers = comm.Get_rank(), comm.Get_size() - k_masters
            # the threads a run would give each master: its share of the cores this K's
            # workers leave on its node (K masters on one node split them)
            place = local_placement(comm, k_masters)
            threads = gem.kernel_threads(place.local_size, place.local_masters)
            tmp = tempfile.mkdtemp() if rank == 0 else None
            cfg = Config.of(method="gem", model="quadratic", dataset="synthetic",
                            quadratic_dim=n, eval_every=0, masters=k_masters,
                            max_steps=max(1, updates // n_workers),
                            metrics=os.path.join(tmp, "bench.h5") if tmp else None)
            steps = cfg.data.max_steps
            problem = build_problem(cfg.data, with_theta0=rank < k_masters)
            plan = shards.plan(cfg, problem, n_workers)
            comms, link = shards.connect(comm, plan)
            if rank < k_masters:
                lo_t, hi_t = plan.tensors[rank]
                offsets = problem.offsets[lo_t:hi_t + 1] - problem.offsets[lo_t]
                kernel = gem.Kernel(offsets, threads=threads)
                role = Role(rank, plan, link) if link is not None else None
                master = Master(cfg, comms[rank], plan.layouts[rank], problem, kernel,
                                role=role)
                supervise(master, cfg, problem, StopFlag(), None)
                master.run()
                if rank == 0:
                    rows.append(_row(master.sup.summary, n, n_workers, k_masters, plan,
                                     threads, worker_step_ms))
            else:
                ep = WorkerShards(comms, plan.layouts, plan.bounds,
                                  poll_limit=poll_ms / 1000.0)
                delta = (np.random.default_rng(rank).normal(size=n) * 1e-3).astype(np.float32)
                a = np.abs(delta) * np.float32(2.0)
                versions = ep.pull()
                for seq in range(steps):
                    ep.commit(UPDATE, seq, versions, 0.0, 0.0, (delta, a, ep.theta))
                    ep.wait_slot_free()
                    versions = ep.pull()
                no_split = np.full(len(WORKER_TIME_COLUMNS), np.nan, np.float32)
                ep.commit(DONE, steps, versions, parts=(no_split,))
                ep.wait_shutdown()
                ep.close()
            comm.Free()
    if world.Get_rank() != 0:
        return None
    return {"bench": "master", "machine": _machine(), "rows": rows,
            "worker_step_ms": worker_step_ms}


def _row(summary: dict, n: int, n_workers: int, k_masters: int, plan: object, threads: int,
         worker_step_ms: float | None) -> dict:
    """One row: rank 0's rate (every shard applies every update, and the run ends when the
    last shard has), the bytes the busiest master streams per update and its triad bound."""
    largest = max(hi - lo for lo, hi in plan.bounds)
    streamed = GEM_BYTES_PER_ELEMENT * largest
    triad_s = _triad_seconds(streamed, threads)
    ups = summary["updates"] / summary["wall_s"]
    bound = 1.0 / triad_s  # one update touches as many bytes as one triad call here
    split = {k: summary[f"master_{k}_s"] / summary["wall_s"]
             for k in ("wait", "apply", "metrics", "mpi")}
    apply_s = summary["master_apply_s"] / summary["updates"]
    return {"params": n, "masters": k_masters, "workers": n_workers, "threads": threads,
            "updates": summary["updates"], "updates_per_s": ups,
            "bytes_per_master": streamed, "bound_updates_per_s": bound,
            "ratio_to_bound": ups / bound, "time_split": split,
            "apply_ms": 1e3 * apply_s,
            # the kernel's own speed during the run against the quiet triad: the ceiling
            # of ratio_to_bound when the workers share the machine
            "apply_ratio_to_bound": triad_s / apply_s,
            # workers of that step time these masters keep busy: the rate (as measured,
            # and rank 0's kernel alone) over one worker's demand
            **({"workers_served": ups * worker_step_ms / 1e3,
                "workers_served_by_kernel": worker_step_ms / (1e3 * apply_s)}
               if worker_step_ms else {})}


def print_master(result: dict) -> None:
    print(f"gem_mpi.bench master: {result['machine']}; threads = each master's kernel "
          "threads; bound = triad bandwidth / bytes touched per update; apply ratio = the kernel's "
          "own speed during the run against that bound (the ceiling of ratio)")
    print("  (K masters: θ sharded over K ranks; bytes/master = what the busiest master "
          "streams per update; the split is rank 0's)")
    cols = ["params", "masters", "threads", "workers", "upd/s", "bytes/master", "bound upd/s", "ratio",
            "apply ms", "apply ratio", "wait", "apply", "metrics", "mpi"]
    print("  ".join(f"{c:>11}" for c in cols))
    for r in result["rows"]:
        sp = r["time_split"]
        vals = [r["params"], r.get("masters", 1), r["threads"], r["workers"], f"{r['updates_per_s']:.0f}",
                f"{r.get('bytes_per_master', 0) / 1e6:.1f} MB",
                f"{r['bound_updates_per_s']:.0f}", f"{r['ratio_to_bound']:.2f}",
                f"{r['apply_ms']:.3f}", f"{r['apply_ratio_to_bound']:.2f}",
                *(f"{100 * sp[k]:.0f}%" for k in
                                          ("wait", "apply", "metrics", "mpi"))]
        print("  ".join(f"{v!s:>11}" for v in vals))
    step = result.get("worker_step_ms")
    for r in result["rows"] if step else []:
        print(f"at {r['params']} parameters, K = {r.get('masters', 1)}: workers taking "
              f"{step:g} ms a step ask {1e3 / step:.1f} upd/s each: the masters served {r['updates_per_s']:.0f} upd/s "
              f"here, enough for {r['workers_served']:.1f} such workers; its kernel alone "
              f"({r['apply_ms']:.2f} ms an update) would serve "
              f"{r['workers_served_by_kernel']:.1f}")


def register(sub: Subcommands) -> argparse.ArgumentParser:
    """``master``: its options, and what runs and prints it."""
    p = sub.add_parser("master", help="master updates/s under mpirun (kernel threads: "
                       "GEM_NUM_THREADS, else the master's default)")
    p.add_argument("--sizes", type=int, nargs="+", default=[163_790, 1_637_900],
                   help="parameters (default: the paper's net and 10x)")
    p.add_argument("--updates", type=int, default=2000, help="updates per size")
    p.add_argument("--poll-max-ms", type=float, default=5.0,
                   help="workers' longest sleep between polls (as gem_mpi.train's option)")
    p.add_argument("--worker-step-ms", type=float, default=None,
                   help="a worker's step time (e.g. a GPU's, from bench gpu): print how many "
                   "such workers the measured master rate would keep busy")
    p.add_argument("--masters", type=int, nargs="+", default=[1],
                   help="θ sharded over K master ranks (as gem_mpi.train's --masters): a row "
                   "per K, side by side, every K with the same workers")
    p.set_defaults(run=_run, show=print_master)
    return p


def _run(args: argparse.Namespace) -> dict | None:
    return bench_master(args.sizes, args.updates, args.poll_max_ms, args.worker_step_ms,
                        args.masters)
