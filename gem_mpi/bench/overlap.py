"""Communication beside the compute: a worker's steps/s against its compute alone.

A CPU stand-in for an accelerator: each worker's compute is ``--step-ms``
milliseconds spent inside a call that releases the GIL, as a queued GPU step does. The model,
named to ``gem_mpi.train`` as a user's (``gem_mpi.bench.overlap:model``), is one float32
tensor of ``--params`` elements whose forward sleeps that long (``time.sleep`` releases the
GIL) and returns the square of the parameters' mean: its forward and backward are one pass
over θ each (the sum's backward is a stride-0 view, added into the worker's gradient), so the
rest of a step's host work is gem_mpi's own (zeroing the gradient, Δθ = −ηg), which a GPU
would do inside its step. Each (workers, order, wire) is a real mpirun job, 1 master + W
asynchronous GEM workers; its row is the workers' steps/s against the compute-only ceiling
1000 / ``--step-ms``, each worker's time split and the master's (from the run's metrics
file), and the bytes an update commits and a pull reads. Before the runs the master's kernel
is timed alone on θ's size, on the threads a run's master gets: the updates/s it could apply,
against the updates/s the workers ask at the ceiling, so that a row bound by the master is
told apart from one bound by the worker.

The orders and wire formats are lists (``ORDERS``, ``WIRES``): an order or a wire format to
come is one more entry, with the options ``gem_mpi.train`` takes for it.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time

import numpy as np

from gem_mpi.algorithm import kernel as gem
from gem_mpi.bench import Subcommands, _machine, _time
from gem_mpi.bench.compare import run_training
from gem_mpi.bench.kernel import _inputs
from gem_mpi.config import AT_OWN, GRADIENT_POINTS, Config
from gem_mpi.outputs import analysis, runfile
from gem_mpi.protocol import WORKER_TIME_SPLIT, update_payload

ORDERS = ("wait", "pipelined", "overlap")  # --worker-mode values, each a row
# wire format -> gem_mpi.train's options for it (--wire; float32 is the default)
WIRES: dict[str, tuple[str, ...]] = {"float32": (), "bf16": ("--wire", "bf16")}
MODEL = "gem_mpi.bench.overlap:model"
DATASET = "gem_mpi.bench.overlap:dataset"
_PARAMS, _STEP_MS = "GEM_MPI_OVERLAP_PARAMS", "GEM_MPI_OVERLAP_STEP_MS"  # to the ranks
_TRAIN, _TEST = 64, 1  # samples per split: one test sample, so the final evaluation sleeps once
SHOWN = ("compute", "payload", "commit", "wait", "pull", "other")  # the printed worker split
MASTER_SPLIT = ("wait", "apply", "mpi", "metrics")  # the summary's master_*_s; wait = idle
IDLE_BOUND = 0.1  # a master idle less than this share of its wall time bounds its row


def model() -> object:
    """One float32 tensor of $GEM_MPI_OVERLAP_PARAMS elements; its forward sleeps
    $GEM_MPI_OVERLAP_STEP_MS ms with the GIL released, then gives the mean, once per sample."""
    import torch

    n = int(os.environ.get(_PARAMS, "1000"))
    seconds = float(os.environ.get(_STEP_MS, "10")) / 1e3

    class Sleeper(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(n))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            time.sleep(seconds)  # the accelerator's step: the GIL is free meanwhile
            # sum × 1/n rather than mean(): mean's backward materialises an n-long
            # gradient (8x the time at 11.7 M), sum's is a stride-0 view
            return (self.weight.sum() * (1.0 / n)).expand(x.shape[0])

    return Sleeper()


def mlp() -> object:
    """A learning stand-in for an accelerator's worker: an MNIST MLP (784-128-10) whose
    forward also sleeps $GEM_MPI_OVERLAP_STEP_MS ms with the GIL released, so that many
    workers on a few cores each spend their step waiting, as GPU workers do, not competing
    for the cores (which inflates every order's staleness by the time-sharing). For
    comparing the worker orders' learning at equal updates:
    ``mpirun -n 31 -x GEM_MPI_OVERLAP_STEP_MS=50 python -m gem_mpi.train --model
    gem_mpi.bench.overlap:mlp --dataset mnist --max-steps 200 --eval-every 0 --worker-mode
    overlap``."""
    import torch

    seconds = float(os.environ.get(_STEP_MS, "10")) / 1e3

    class SleepyMlp(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 128),
                                           torch.nn.ReLU(), torch.nn.Linear(128, 10))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            time.sleep(seconds)
            return self.net(x)

    return SleepyMlp()


class _Zeros:
    """(0.0, 0.0) pairs: the model reads no input; mse against 0 makes the loss mean(θ)²."""
    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[object, object]:
        import torch

        if not 0 <= i < self.size:
            raise IndexError(i)
        return torch.zeros(1), torch.tensor(0.0)


def dataset(split: str) -> _Zeros:
    return _Zeros(_TRAIN if split == "train" else _TEST)


def wire_bytes(order: str, wire: str, n: int) -> tuple[int, int]:
    """(bytes committed, bytes pulled) per GEM update on ``wire``: its payload's, as
    gem_mpi.protocol counts them for the run's options (the metrics file's attributes)."""
    if wire not in WIRES:
        raise ValueError(f"no wire format {wire!r}: one of {', '.join(WIRES)}")
    return update_payload(Config.of(method="gem", worker_mode=order, wire=wire).optim,
                          n).wire_bytes


def committed_bytes(order: str, wire: str, n: int) -> int:
    """Bytes one GEM update commits on ``wire`` (:func:`wire_bytes`)."""
    return wire_bytes(order, wire, n)[0]


def master_capacity(n: int, workers: int) -> dict:
    """The master's kernel alone on n floats (one tensor), on the threads a run's master
    with ``workers`` workers on this node gets: the updates/s it could apply."""
    threads = gem.kernel_threads(workers + 1)
    kernel = gem.Kernel(np.array([0, n], np.int64), threads=threads)
    theta, delta, a, s = _inputs(n)
    optim = Config.of().optim
    apply_s = _time(lambda: kernel.gem_step(theta, delta, a, s, optim.eps, optim.pi_max))
    return {"workers": workers, "threads": threads, "kernel": kernel.name,
            "apply_ms": 1e3 * apply_s, "updates_per_s": 1.0 / apply_s}


def _train_args(args: argparse.Namespace, order: str, wire: str, steps: int,
                at: str) -> list[str]:
    return ["--model", MODEL, "--dataset", DATASET, "--loss", "mse", "--lr", "0.01",
            "--batch-size", "1", "--max-steps", str(steps),
            "--epochs", str(-(-steps // _TRAIN)), "--eval-every", "0", "--threads", "1",
            "--log-every", "60", "--worker-mode", order, "--gradient-at", at, *WIRES[wire]]


def _row(run: runfile.Run, args: argparse.Namespace, workers: int, order: str, wire: str,
         steps: int, job_s: float, capacity: dict, at: str) -> dict:
    """One job's row: the workers' steps/s, their split, the master's, the bytes."""
    wt, summary = run.worker_time, run.summary
    done = np.bincount(np.asarray(run.updates["worker"], np.int64), minlength=workers + 1)
    each = [float(done[w + 1] / wt["wall"][w]) for w in range(workers)]
    per_s = float(np.mean(each))
    ceiling = 1e3 / args.step_ms
    split = {k: float(np.nanmean(wt[k] / wt["wall"])) for k in WORKER_TIME_SPLIT}
    split["wait"] += split.pop("backoff")  # the sleeps of a wait are waiting too
    split["other"] = 1.0 - sum(split.values())
    wall, updates = analysis.wall_seconds(run), analysis.applied_updates(run)
    master = {k: summary[f"master_{k}_s"] / wall for k in MASTER_SPLIT}
    master["other"] = 1.0 - sum(master.values())
    apply_ms = 1e3 * summary["master_apply_s"] / updates
    committed, pulled = wire_bytes(order, wire, args.params)
    # compute per step as the updates report it (the sleep, θ into the model, the gradient
    # zeroed, Δθ): on the compute thread with the overlap order; the worker's own host work
    # beyond the sleep (that, and the payload's m and κ|m| where it is on the critical
    # path: every order but overlap) is what a GPU would do inside its step; the ratio a
    # row could reach with the commit, the pull and the wait all hidden is step / (step +
    # host)
    compute_ms = 1e3 * float(np.mean(run.updates["compute_s"]))
    payload_ms = 0.0 if order == "overlap" else 1e3 * float(np.nanmean(wt["payload"]
                                                                        / done[1:]))
    host_ms = compute_ms + payload_ms - args.step_ms
    return {"workers": workers, "order": order, "wire": wire, "at": at, "params": args.params,
            "step_ms": args.step_ms, "steps": steps, "job_s": job_s,
            "updates": updates, "steps_per_s": per_s,
            "steps_per_s_each": each, "ceiling_steps_per_s": ceiling,
            "ratio": per_s / ceiling,
            "compute_ms": compute_ms,
            "host_ms": host_ms, "hidden_ratio": args.step_ms / (args.step_ms + host_ms),
            "worker_split": split, "bytes_per_update": committed,
            "bytes_committed": committed, "bytes_pulled": pulled,
            "master_split": master, "master_cpu": summary.get("master_cpu_s", math.nan) / wall,
            "master_updates_per_s": updates / wall, "apply_ms": apply_ms,
            "demand_vs_capacity": workers * per_s / capacity["updates_per_s"],
            "bound": "master" if master["wait"] < IDLE_BOUND else "worker"}


def bench_overlap(args: argparse.Namespace) -> dict:
    """The master's capacity for each number of workers, then one job per (workers, order,
    wire), one after the other (never at once: they would share the cores)."""
    if args.params < 1 or args.step_ms <= 0 or min(args.workers) < 1:
        raise SystemExit("bench overlap: --params and --workers must be at least 1, "
                         "--step-ms above 0")
    steps = args.steps or max(5, math.ceil(args.seconds * 1e3 / args.step_ms))
    capacity = {w: master_capacity(args.params, w) for w in sorted(set(args.workers))}
    os.environ[_PARAMS], os.environ[_STEP_MS] = str(args.params), str(args.step_ms)
    rows = []
    with tempfile.TemporaryDirectory(prefix="gem_overlap_") as out:
        for w in args.workers:
            for wire in args.wires:
                for order in args.orders:  # a waiting worker has no update in flight
                    for at in args.gradient_at if order != "wait" else args.gradient_at[:1]:
                        run, job_s = run_training(
                            args.mpirun, w + 1, _train_args(args, order, wire, steps, at),
                            os.path.join(out, f"{w}-{order}-{wire}-{at}.h5"), "overlap")
                        rows.append(_row(run, args, w, order, wire, steps, job_s, capacity[w],
                                         at))
                        print(f"gem_mpi.bench overlap: {w} worker(s), {order}, {wire}, "
                              f"gradient at {at}: ratio {rows[-1]['ratio']:.2f}",
                              file=sys.stderr, flush=True)
    return {"bench": "overlap", "machine": _machine(), "params": args.params,
            "step_ms": args.step_ms, "ceiling_steps_per_s": 1e3 / args.step_ms,
            "steps": steps, "launcher": args.mpirun, "model": MODEL, "dataset": DATASET,
            "capacity": list(capacity.values()), "rows": rows}


def print_overlap(result: dict) -> None:
    n, ms = result["params"], result["step_ms"]
    print(f"gem_mpi.bench overlap: {result['machine']}; {n} float32 parameters, compute "
          f"{ms:g} ms a step (a sleep, GIL released) plus the host's work on θ; "
          f"{result['steps']} steps per worker; launcher: {result['launcher']}")
    for c in result["capacity"]:
        ask = c["workers"] * result["ceiling_steps_per_s"]
        print(f"master capacity, {c['workers']} worker(s): its kernel alone applies "
              f"{c['updates_per_s']:.0f} upd/s ({c['apply_ms']:.1f} ms an update, "
              f"{c['threads']} thread(s)); the workers at the compute ceiling ask {ask:.0f} "
              f"upd/s ({ask / c['updates_per_s']:.2f} of it)")
    print(f"ratio = steps/s per worker / {result['ceiling_steps_per_s']:g} (1000 / step ms); "
          "c ms = compute per step as the updates report it; host ms = the worker's work on θ "
          "per step beyond the sleep on its critical path (compute, and the payload but with "
          "overlap: a GPU's work, on the CPU here); w:compute = waiting for the compute "
          "thread with overlap; hidden = "
          "step / (step + host), the ratio with commit, pull and wait all hidden; worker split (mean over workers, shares of "
          "wall time): compute, payload (m, κ|m|), commit, wait (back-off sleeps included), "
          "pull, other; MB = per update committed (c) and pulled (p); master (shares of its "
          "wall time): idle, apply, mpi, metrics; apply ms = its kernel per update in the run; "
          f"bound: master when it idled under {100 * IDLE_BOUND:.0f} %, else worker")
    cols = ["workers", "order", "wire", "at", "steps/s", "ratio", "c ms", "host ms", "hidden", *(f"w:{k}" for k in SHOWN),
            "MB c", "MB p", "m:idle", *(f"m:{k}" for k in MASTER_SPLIT[1:]), "apply ms",
            "bound"]
    print(" ".join(f"{c:>9}" for c in cols))
    for r in result["rows"]:
        w, m = r["worker_split"], r["master_split"]
        vals = [r["workers"], r["order"], r["wire"], r.get("at", "pulled"),
                f"{r['steps_per_s']:.2f}",
                f"{r['ratio']:.2f}", f"{r['compute_ms']:.1f}", f"{r['host_ms']:.1f}",
                f"{r['hidden_ratio']:.2f}",
                *(f"{100 * w[k]:.1f}%" for k in SHOWN), f"{r['bytes_committed'] / 1e6:.1f}",
                f"{r['bytes_pulled'] / 1e6:.1f}", *(f"{100 * m[k]:.1f}%" for k in MASTER_SPLIT),
                f"{r['apply_ms']:.1f}", r["bound"]]
        print(" ".join(f"{v!s:>9}" for v in vals))
    for workers in dict.fromkeys(r["workers"] for r in result["rows"]):
        best = max((r for r in result["rows"] if r["workers"] == workers),
                   key=lambda r: r["ratio"])
        print(f"{workers} worker(s): best ratio {best['ratio']:.2f} ({best['order']}, "
              f"{best['wire']}, gradient at {best.get('at', 'pulled')})")


def register(sub: Subcommands) -> argparse.ArgumentParser:
    """``overlap``: its options, and what runs and prints it."""
    p = sub.add_parser("overlap", help="a worker whose compute releases the GIL (a CPU "
                       "stand-in for an accelerator): steps/s per worker against the compute "
                       "alone, a row per worker order and wire format, with where the time "
                       "goes and the master's capacity (run it outside mpirun)")
    p.add_argument("--params", type=int, required=True, help="float32 parameters of the model")
    p.add_argument("--step-ms", type=float, required=True,
                   help="a worker's compute per step, milliseconds (slept, GIL released)")
    p.add_argument("--workers", type=int, nargs="+", required=True,
                   help="workers per run (1 master beside them): a row each")
    p.add_argument("--orders", nargs="+", default=list(ORDERS), choices=ORDERS,
                   help="worker orders (gem_mpi.train's --worker-mode), a row each")
    p.add_argument("--wires", nargs="+", default=list(WIRES), choices=list(WIRES),
                   help="wire formats of an update, a row each")
    p.add_argument("--gradient-at", nargs="+", default=[AT_OWN], choices=GRADIENT_POINTS,
                   help="where a pipelined or overlapped worker takes its gradient "
                   "(gem_mpi.train's --gradient-at), a row each")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--steps", type=int, default=None, help="steps per worker")
    budget.add_argument("--seconds", type=float, default=30.0,
                        help="steps per worker for this long at the compute ceiling "
                        "(default; the run takes longer by what it falls short)")
    p.add_argument("--mpirun", default="mpirun --oversubscribe --bind-to none --mca btl "
                   "self,vader", help="launcher command line (one node; unbound, so that a "
                   "worker's compute thread and its communication thread may run on two "
                   "cores, as a GPU worker's host threads do: Open MPI binds each of two "
                   "ranks to one core otherwise)")
    p.set_defaults(run=bench_overlap, show=print_overlap)
    return p
