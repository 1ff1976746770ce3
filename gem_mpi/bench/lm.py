"""The language model on each method users now compare (``python -m gem_mpi.bench lm``): GEM with
AdamW workers, Gap-Aware with AdamW workers, delayed Nesterov with AdamW workers taking local
steps (with and without dynamic local updates), and DDP with AdamW, on ``--model gpt --dataset
text`` at equal samples, each a real mpirun job, read from its metrics file: tokens/s, the GPU's
busy share while it trains (NVML, on a GPU), and the test loss in bits per byte after the
budget. ``--speeds``: the workers' slowdown factors, the same in every row (a mixed cluster).
``--cpu``: a dry run of the command on the CPU, tiny sizes.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile

from gem_mpi.bench import Subcommands, _machine
from gem_mpi.bench.compare import run_training
from gem_mpi.bench.gpu import _Utilisation
from gem_mpi.outputs import analysis

# (row, method, its own options): every row's workers use AdamW with the same η
ROWS = (("gem-adamw", "gem", ()),
        ("gap-aware-adamw", "gap-aware", ()),
        ("dn-adamw", "dn", ("--local-steps", "4")),
        ("dn-adamw-dylu", "dn", ("--local-steps", "4", "--dylu")),
        ("ddp-adamw", "ddp", ()))  # the last: what the others are compared with
LEARNED = 0.9  # a row has learned when its loss is below this share of ln 256 (uniform bytes)


def _model_args(args: argparse.Namespace) -> list[str]:
    size = (("--gpt-layers", "1", "--gpt-width", "32", "--gpt-heads", "2", "--context", "32")
            if args.cpu else ("--context", str(args.context)))
    return ["--model", "gpt", "--dataset", "text", *size, "--batch-size",
            str(args.batch_size), "--test-bytes", str(args.test_bytes), "--optimizer",
            "adamw", "--lr", str(args.lr), "--eval-every", "0", "--log-every", "30"]


def _row(name: str, method: str, own: tuple[str, ...], args: argparse.Namespace,
         out_dir: str) -> dict:
    """One method's job at the budget of ``--max-steps`` steps a worker (local steps: fewer
    updates of as many samples)."""
    h = int(own[own.index("--local-steps") + 1]) if "--local-steps" in own else 1
    ranks = args.workers if method == "ddp" else args.workers + 1
    with _Utilisation() as util:
        run, job_s = run_training(
            args.mpirun, ranks,
            ["--method", method, *own, *_model_args(args), "--max-steps",
             str(max(1, args.max_steps // h)), *(["--threads", "1"] if args.cpu else []),
             *(["--speeds", args.speeds] if args.speeds else [])],
            os.path.join(out_dir, f"{name}.h5"), "lm")
    final = analysis.final_test(run)
    context = int(run.config["context"])
    return {"row": name, "method": method, "job_s": job_s,
            "wall_s": analysis.wall_seconds(run),
            "samples": analysis.trained_samples(run),  # --dylu: what its steps trained
            "tokens_per_s": analysis.samples_per_second(run) * context,
            "gpu_busy": None if util.mean is None else util.mean / 100.0,
            "test_loss": final.loss, "bits_per_byte": final.loss / math.log(2),
            "learned": bool(math.isfinite(final.loss)
                            and final.loss < LEARNED * math.log(256))}


def _device(cpu: bool) -> str:
    """Where the workers trained, as the first line says it."""
    if cpu:
        return "cpu (dry run: --cpu)"
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu (no GPU)"


def bench_lm(args: argparse.Namespace) -> dict:
    """Each row in turn; ok when every row learned."""
    with tempfile.TemporaryDirectory(prefix="gem_lm_") as out_dir:
        rows = [_row(name, method, own, args, out_dir) for name, method, own in ROWS
                if not args.rows or name in args.rows]
    base = rows[-1]  # DDP-AdamW by default: what a synchronous user runs today
    for r in rows:
        r["tokens_per_s_vs_ddp"] = r["tokens_per_s"] / base["tokens_per_s"]
        r["loss_vs_ddp"] = r["test_loss"] / base["test_loss"]
    return {"bench": "lm", "machine": _machine(), "device": _device(args.cpu),
            "workers": args.workers,
            "steps_per_worker": args.max_steps, "batch_size": args.batch_size,
            "speeds": args.speeds,
            "rows": rows, "ok": all(r["learned"] for r in rows)}


def print_lm(result: dict) -> None:
    print(f"gem_mpi.bench lm: {result['machine']}; {result['device']}; gpt/text, "
          f"{result['workers']} workers × {result['steps_per_worker']} steps × batch "
          f"{result['batch_size']} (the same samples in every row)"
          + (f", speeds {result['speeds']}" if result["speeds"] else "")
          + f"; ratios against {result['rows'][-1]['row']}")
    cols = ["row", "samples", "tokens/s", "vs last", "GPU busy", "bits/byte", "vs last",
            "learned"]
    first = max(len(r["row"]) for r in result["rows"])  # the row names' column, aligned
    print("  ".join([f"{cols[0]:>{first}}", *(f"{c:>10}" for c in cols[1:])]))
    for r in result["rows"]:
        busy = "n/a" if r["gpu_busy"] is None else f"{100 * r['gpu_busy']:.0f}%"
        vals = [r["row"], r["samples"], f"{r['tokens_per_s']:.0f}",
                f"{r['tokens_per_s_vs_ddp']:.2f}", busy, f"{r['bits_per_byte']:.3f}",
                f"{r['loss_vs_ddp']:.3f}", "yes" if r["learned"] else "NO"]
        print("  ".join([f"{vals[0]:>{first}}", *(f"{v!s:>10}" for v in vals[1:])]))
    print(f"gem_mpi.bench lm: {'ok' if result['ok'] else 'FAILED'} (learned: test loss below "
          f"{LEARNED} × ln 256 nats a byte)")


def _rows(text: str) -> list[str]:
    """--rows: known row names only (argparse makes the error one line, exit 2)."""
    names = text.split(",")
    unknown = [n for n in names if n not in {r[0] for r in ROWS}]
    if unknown:
        raise argparse.ArgumentTypeError(f"no row {', '.join(unknown)}; the rows: "
                                         f"{', '.join(r[0] for r in ROWS)}")
    return names


def register(sub: Subcommands) -> argparse.ArgumentParser:
    """``lm``: its options, and what runs and prints it."""
    p = sub.add_parser("lm", help="the language model (gpt on text) under GEM-AdamW, "
                       "Gap-Aware-AdamW, delayed Nesterov with AdamW local steps (and "
                       "--dylu), and DDP-AdamW at equal samples: "
                       "tokens/s, GPU-busy share, bits per byte (run it outside mpirun)")
    p.add_argument("--workers", type=int, default=3, help="workers (plus one master where "
                   "the method has one)")
    p.add_argument("--max-steps", type=int, default=300, help="optimizer steps per worker")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--context", type=int, default=128, help="bytes a sample (not --cpu)")
    p.add_argument("--test-bytes", type=int, default=65_536)
    p.add_argument("--lr", type=float, default=0.002, help="every row's AdamW η")
    p.add_argument("--speeds", default=None, metavar="F1,F2,...",
                   help="each worker's slowdown factor, in every row (train's --speeds)")
    p.add_argument("--rows", type=_rows, default=None,
                   metavar="ROW,ROW", help="only these rows, in the table's order (default: "
                   f"all: {', '.join(r[0] for r in ROWS)}); the last is the ratios' base")
    p.add_argument("--cpu", action="store_true", help="a dry run on the CPU, tiny sizes")
    p.add_argument("--mpirun", default="mpirun --oversubscribe",
                   help="launcher command line (one node)")
    p.set_defaults(run=bench_lm, show=print_lm)
    return p
