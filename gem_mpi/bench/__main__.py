"""The command line of ``python -m gem_mpi.bench``."""

from __future__ import annotations

import argparse
import json
import sys

import gem_mpi.bench as package
from gem_mpi.algorithm import kernel as gem
from gem_mpi.bench.compare import COMPARE_METHODS, bench_compare, print_compare
from gem_mpi.bench.gpu import WIRES as GPU_WIRES
from gem_mpi.bench.gpu import bench_gpu, best_default, combo_of, print_gpu
from gem_mpi.bench.groups import bench_groups, print_groups
from gem_mpi.bench.kernel import bench_kernel, default_threads, print_kernel
from gem_mpi.bench.master import bench_master, print_master
from gem_mpi.bench.overhead import bench_overhead, print_overhead
from gem_mpi.bench.overlap import ORDERS, WIRES, bench_overlap, print_overlap
from gem_mpi.bench.transport import bench_transport, print_transport
from gem_mpi.config import AMP_MODES, AMP_OFF, WORKER_MODES


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gem_mpi.bench", description=package.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    k = sub.add_parser("kernel", help="fused kernel vs numpy, torch, memcpy and triad, each "
                       "validated against the numpy reference first")
    k.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000, 10_000_000])
    k.add_argument("--no-torch", action="store_true", help="skip the torch eager column")
    k.add_argument("--threads", type=int, nargs="+", default=None,
                   help="thread counts, each a row per size (default 1 to the cores; "
                   "GEM_NUM_THREADS is not read here)")
    m = sub.add_parser("master", help="master updates/s under mpirun (kernel threads: "
                       "GEM_NUM_THREADS, else the master's default)")
    m.add_argument("--sizes", type=int, nargs="+", default=[163_790, 1_637_900],
                   help="parameters (default: the paper's net and 10x)")
    m.add_argument("--updates", type=int, default=2000, help="updates per size")
    m.add_argument("--poll-max-ms", type=float, default=5.0,
                   help="workers' longest sleep between polls (as gem_mpi.train's option)")
    m.add_argument("--worker-step-ms", type=float, default=None,
                   help="a worker's step time (e.g. a GPU's, from bench gpu): print how many "
                   "such workers the measured master rate would keep busy")
    m.add_argument("--masters", type=int, nargs="+", default=[1],
                   help="θ sharded over K master ranks (as gem_mpi.train's --masters): a row "
                   "per K, side by side, every K with the same workers")
    t = sub.add_parser("transport", help="Get/Put between 2 ranks under mpirun")
    t.add_argument("--sizes", type=int, nargs="+",
                   default=[10_000, 100_000, 1_000_000, 10_000_000])
    c = sub.add_parser("compare", help="GEM vs the other asynchronous rules vs synchronous "
                       "SGD (Horovod, DDP) vs DiLoCo, each a real mpirun job (run it outside "
                       "mpirun)")
    c.add_argument("--methods", nargs="+", default=list(COMPARE_METHODS),
                   choices=COMPARE_METHODS,
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
    c.add_argument("--diloco-steps", type=int, default=20, help="diloco's H: inner steps "
                   "per round")
    c.add_argument("--mpirun", default="mpirun --oversubscribe --mca btl self,vader",
                   help="launcher command line (one node)")
    o = sub.add_parser("overhead", help="end-to-end updates/s of the asynchronous methods "
                       "against the compute ceiling (plain SGD, one process per core), with "
                       "where the time goes (run it outside mpirun)")
    o.add_argument("--workers", type=int, nargs="+", default=[4, 8])
    o.add_argument("--methods", nargs="+", default=["gem", "downpour", "adaptive"])
    o.add_argument("--worker-modes", nargs="+", default=["wait", "pipelined"],
                   choices=["wait", "pipelined"], help="a row per worker mode, side by side")
    o.add_argument("--masters", type=int, nargs="+", default=[1],
                   help="θ sharded over K master ranks (gem_mpi.train's --masters): a row per "
                   "K, each with n workers (n + K ranks)")
    o.add_argument("--steps", type=int, default=600, help="steps per worker")
    o.add_argument("--ceiling-steps", type=int, default=300, help="steps per ceiling process")
    o.add_argument("--repeat", type=int, default=1, help="runs per row, each between two "
                   "ceiling measurements; with more than one, the medians are printed too")
    o.add_argument("--shared-max", type=int, default=16, help="measure the time-shared "
                   "ceiling (n plain processes at once) for n up to this many workers")
    o.add_argument("--model", default="mnist-cnn")
    o.add_argument("--dataset", default="fashion-mnist")
    o.add_argument("--batch-size", type=int, default=64)
    o.add_argument("--loader-workers", type=int, nargs="+", default=[0],
                   help="gem_mpi.train's --loader-workers: a row per value, side by side; "
                   "with a value above 0, also one worker's loop alone (no MPI) for each, "
                   "alternated, split into waiting for batches and computing")
    o.add_argument("--mpirun", nargs="+", default=["mpirun --oversubscribe --mca btl self,vader"],
                   help="launcher command line(s) (one node); with several, every run is made "
                   "with each, side by side against the same ceiling")
    g = sub.add_parser("gpu", help="the GPU check: 1 master + n workers sharing one CUDA "
                       "device, ResNet-18 on generated images, against the plain loop on the "
                       "same device; a row per worker order, precision, wire format and CUDA "
                       "MPS setting, each for about --seconds; exits 1 unless the loss fell "
                       "and θ stayed finite (run it outside mpirun; tools/gpu_check.sh "
                       "prepares a bare GPU machine)")
    g.add_argument("--workers", type=int, default=3)
    g.add_argument("--seconds", type=float, default=30.0, help="training time per row")
    g.add_argument("--modes", nargs="+", default=list(WORKER_MODES), choices=WORKER_MODES,
                   help="worker orders (--worker-mode), each with every --amps and --wires")
    g.add_argument("--amps", nargs="+", default=[AMP_OFF], choices=AMP_MODES,
                   help="the workers' precisions (--amp), each with every mode; where a row "
                   "has a bf16 twin, bf16's steps/s are printed against float32's")
    g.add_argument("--wires", nargs="+", default=["float32"], choices=list(GPU_WIRES),
                   help="wire formats of an update, each with every mode")
    g.add_argument("--best", type=combo_of, default=combo_of(best_default()),
                   help="MODE:AMP:WIRE, one more row beside the matrix (the combination suited "
                   f"to a GPU; default {best_default()}), or 'none'")
    g.add_argument("--mps", default="auto", choices=["auto", "off"],
                   help="auto: where CUDA MPS's daemon starts, run rows again with the workers "
                   "as its clients (--mps-rows), then stop it; off: never")
    g.add_argument("--mps-rows", default="best", choices=["best", "all"],
                   help="the rows run again under MPS: --best's, or every row")
    g.add_argument("--plain-steps", type=int, default=200,
                   help="timed steps of the plain loop (one process, no MPI) at each "
                   "precision, after 10 of warm-up")
    g.add_argument("--batch-size", type=int, default=64)
    g.add_argument("--image-size", type=int, default=224)
    g.add_argument("--lr", type=float, default=0.01)
    g.add_argument("--calibration-steps", type=int, default=20,
                   help="steps per worker of the run that sizes the others")
    g.add_argument("--cpu", action="store_true", help="a dry run on the CPU (no CUDA, no MPS)")
    g.add_argument("--mpirun", default="mpirun --oversubscribe --mca btl self,vader",
                   help="launcher command line (one node)")
    v = sub.add_parser("overlap", help="a worker whose compute releases the GIL (a CPU "
                       "stand-in for an accelerator): steps/s per worker against the compute "
                       "alone, a row per worker order and wire format, with where the time "
                       "goes and the master's capacity (run it outside mpirun)")
    v.add_argument("--params", type=int, required=True, help="float32 parameters of the model")
    v.add_argument("--step-ms", type=float, required=True,
                   help="a worker's compute per step, milliseconds (slept, GIL released)")
    v.add_argument("--workers", type=int, nargs="+", required=True,
                   help="workers per run (1 master beside them): a row each")
    v.add_argument("--orders", nargs="+", default=list(ORDERS), choices=ORDERS,
                   help="worker orders (gem_mpi.train's --worker-mode), a row each")
    v.add_argument("--wires", nargs="+", default=list(WIRES), choices=list(WIRES),
                   help="wire formats of an update, a row each")
    budget = v.add_mutually_exclusive_group()
    budget.add_argument("--steps", type=int, default=None, help="steps per worker")
    budget.add_argument("--seconds", type=float, default=30.0,
                        help="steps per worker for this long at the compute ceiling "
                        "(default; the run takes longer by what it falls short)")
    v.add_argument("--mpirun", default="mpirun --oversubscribe --bind-to none --mca btl "
                   "self,vader", help="launcher command line (one node; unbound, so that a "
                   "worker's compute thread and its communication thread may run on two "
                   "cores, as a GPU worker's host threads do: Open MPI binds each of two "
                   "ranks to one core otherwise)")
    q = sub.add_parser("groups", help="worker groups (--group-size) vs as many independent "
                       "workers: master updates/s, bytes per sample, final loss at equal "
                       "samples, each a real mpirun job (run it outside mpirun)")
    q.add_argument("--workers", type=int, default=4, help="worker ranks (plus one master)")
    q.add_argument("--group-size", type=int, default=2)
    q.add_argument("--model", default="mnist-cnn")
    q.add_argument("--dataset", default="fashion-mnist")
    q.add_argument("--max-steps", type=int, default=200, help="steps per worker or group "
                   "(a group's step takes G times the samples: as many in all)")
    q.add_argument("--batch-size", type=int, default=32, help="samples per rank and step")
    q.add_argument("--mpirun", default="mpirun --oversubscribe --mca btl self,vader",
                   help="launcher command line (one node)")
    for p in (k, m, t, c, o, g, v, q):
        p.add_argument("--json", help="write the results to this file too")
    args = parser.parse_args(argv)
    gem.kernel_threads()  # a bad GEM_NUM_THREADS is refused before anything runs
    if args.what == "compare":
        result, show = bench_compare(args), print_compare
    elif args.what == "overhead":
        result, show = bench_overhead(args), print_overhead
    elif args.what == "gpu":
        result, show = bench_gpu(args), print_gpu
    elif args.what == "groups":
        result, show = bench_groups(args), print_groups
    elif args.what == "overlap":
        result, show = bench_overlap(args), print_overlap
    elif args.what == "kernel":
        threads = args.threads or default_threads()
        if min(threads) < 1:
            parser.error("--threads: every count must be at least 1")
        result, show = bench_kernel(args.sizes, threads, not args.no_torch), print_kernel
    elif args.what == "master":
        result, show = (bench_master(args.sizes, args.updates, args.poll_max_ms,
                                     args.worker_step_ms, args.masters), print_master)
    else:
        result, show = bench_transport(args.sizes), print_transport
    if result is None:  # not rank 0
        return 0
    show(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    sys.stdout.flush()
    return 0 if result.get("ok", True) else 1


if __name__ == "__main__":
    sys.exit(main())
