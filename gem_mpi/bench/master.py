"""The master's updates/s under mpirun, against its memory-bandwidth bound."""

from __future__ import annotations

import os
import tempfile

import numpy as np

from gem_mpi.algorithm import kernel as gem
from gem_mpi.bench import _machine
from gem_mpi.bench.kernel import GEM_BYTES_PER_ELEMENT, _triad_seconds


def bench_master(sizes: list[int], updates: int, poll_ms: float,
                 worker_step_ms: float | None = None) -> dict | None:
    """Workers commit pre-computed GEM updates as fast as they can; the real master applies,
    on the kernel threads a run would give it (GEM_NUM_THREADS, else the node's cores the
    workers beside it leave)."""
    from gem_mpi.config import Config
    from gem_mpi.engine.master import Master
    from gem_mpi.problem import build_problem
    from gem_mpi.protocol import DONE, UPDATE, WORKER_TIME_COLUMNS, layout
    from gem_mpi.run.rank import local_placement
    from gem_mpi.transport import start_mpi
    from gem_mpi.transport.endpoints import WorkerEndpoint

    comm = start_mpi()
    rank, size = comm.Get_rank(), comm.Get_size()
    if size < 2:
        raise SystemExit("bench master needs mpirun with at least 2 ranks")
    n_workers = size - 1
    threads = gem.kernel_threads(local_placement(comm).local_size)
    rows = []
    for n in sizes:
        tmp = tempfile.mkdtemp() if rank == 0 else None
        cfg = Config.of(method="gem", model="quadratic", dataset="synthetic", quadratic_dim=n,
                        eval_every=0, max_steps=max(1, updates // n_workers),
                        metrics=os.path.join(tmp, "bench.h5") if tmp else None)
        steps = cfg.data.max_steps
        problem = build_problem(cfg.data, with_theta0=rank == 0)
        sizes = layout(cfg.optim, problem.n_params, n_workers)
        if rank == 0:
            triad_s = _triad_seconds(GEM_BYTES_PER_ELEMENT * n, threads)
            kernel = gem.Kernel(problem.offsets, threads=threads)
            master = Master(cfg, comm, sizes, problem, kernel)
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
                         "apply_ratio_to_bound": triad_s / apply_s,
                         # workers of that step time this master keeps busy: its rate (as
                         # measured, and its kernel alone) over one worker's demand
                         **({"workers_served": ups * worker_step_ms / 1e3,
                             "workers_served_by_kernel": worker_step_ms / (1e3 * apply_s)}
                            if worker_step_ms else {})})
        else:
            ep = WorkerEndpoint(comm, sizes, poll_limit=poll_ms / 1000.0)
            delta = (np.random.default_rng(rank).normal(size=n) * 1e-3).astype(np.float32)
            a = np.abs(delta) * np.float32(2.0)
            version = ep.pull()
            for seq in range(steps):
                ep.commit(UPDATE, seq, version, 0.0, 0.0, (delta, a, ep.theta))
                ep.wait_slot_free()
                version = ep.pull()
            no_split = np.full(len(WORKER_TIME_COLUMNS), np.nan, np.float32)  # not measured
            ep.commit(DONE, steps, version, parts=(no_split,))
            ep.wait_shutdown()
            ep.close()
    if rank != 0:
        return None
    return {"bench": "master", "machine": _machine(), "threads": threads, "rows": rows,
            "worker_step_ms": worker_step_ms}


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
    step = result.get("worker_step_ms")
    for r in result["rows"] if step else []:
        print(f"at {r['params']} parameters, workers taking {step:g} ms a step ask "
              f"{1e3 / step:.1f} upd/s each: this master served {r['updates_per_s']:.0f} upd/s "
              f"here, enough for {r['workers_served']:.1f} such workers; its kernel alone "
              f"({r['apply_ms']:.2f} ms an update) would serve "
              f"{r['workers_served_by_kernel']:.1f}")
