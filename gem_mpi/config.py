"""Command-line options of ``python -m gem_mpi.train`` and their validation.

Every rank parses the same argv; parsing never exits or prints by itself, so that a bad
option becomes one line from rank 0 and a non-zero exit on every rank instead of a usage
message per rank.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass

from gem_mpi.errors import UsageError
from gem_mpi.gem import METHODS

SYNC = "sync"  # synchronous momentum SGD on Horovod: every rank a worker, no master
ALL_METHODS = (*METHODS, SYNC)
MODELS = ("mnist-cnn", "alexnet", "resnet18", "quadratic")
DATASETS = ("fashion-mnist", "mnist", "imagenet", "synthetic")


@dataclass(frozen=True)
class Config:
    method: str = "gem"
    model: str = "mnist-cnn"
    dataset: str = "fashion-mnist"
    data_dir: str | None = None
    lr: float = 0.05
    momentum: float = 0.9
    kappa: float = 1.0
    pi_max: float = 5.0
    eps: float = 1e-16
    batch_size: int = 64
    epochs: int = 1
    max_steps: int = 0
    shard: bool = False
    seed: int = 0
    eval_every: int = 2000
    eval_batch_size: int = 1000
    metrics: str | None = None
    save: str | None = None
    synthetic_size: int = 60000
    quadratic_dim: int = 100_000
    threads: int = 0
    poll_max_ms: float = 5.0
    log_every: float = 10.0
    verbose: bool = False
    no_extension: bool = False
    straggler: str | None = None
    stop_on_divergence: bool = True
    divergence_factor: float = 1000.0
    checkpoint_dir: str | None = None
    checkpoint_every: float = 300.0
    resume: str | None = None
    min_free_mb: float = 64.0
    worker_timeout: float = 1800.0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def min_free_bytes(self) -> int:
        return int(self.min_free_mb * 2**20)


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of printing and exiting on every rank."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message)

    def exit(self, status: int = 0, message: str | None = None) -> None:  # type: ignore[override]
        raise UsageError(message or f"exit {status}")


def build_parser() -> argparse.ArgumentParser:
    d = Config()
    p = _Parser(
        prog="python -m gem_mpi.train",
        description="Asynchronous data-parallel training with Gradient Energy Matching. "
        "Launch under MPI: rank 0 is the master, every other rank a worker, e.g. "
        "mpirun -n 5 python -m gem_mpi.train",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        add_help=False,
    )
    a = p.add_argument
    a("-h", "--help", action="store_true", help="show this help and exit")
    a("--method", default=d.method, help=f"update rule at the master: {', '.join(METHODS)}; "
      "or sync: synchronous momentum SGD on Horovod (every rank a worker, no master), "
      "GEM's proxy, the baseline to compare with")
    a("--model", default=d.model, help=f"model: {', '.join(MODELS)} (quadratic: a convex "
      "test problem in numpy, no torch, for checks and transport benchmarks)")
    a("--dataset", default=d.dataset, help=f"dataset: {', '.join(DATASETS)}")
    a("--data-dir", default=d.data_dir, help="dataset location (default: Debian's "
      "/usr/share/datasets/fashion-mnist, then ~/.cache/gem_mpi/data)")
    a("--lr", type=float, default=d.lr, help="learning rate η (> 0)")
    a("--momentum", type=float, default=d.momentum, help="proxy momentum μ in [0, 1)")
    a("--kappa", type=float, default=d.kappa, help="proxy amplification κ (> 0)")
    a("--pi-max", type=float, default=d.pi_max, help="upper clamp of the GEM scale π (> 0)")
    a("--eps", type=float, default=d.eps, help="ε in π's denominator |Δθ| + ε (> 0)")
    a("--batch-size", type=int, default=d.batch_size, help="worker mini-batch b")
    a("--epochs", type=int, default=d.epochs, help="epochs of the training set per worker")
    a("--max-steps", type=int, default=d.max_steps, help="cap on each worker's steps "
      "(0: no cap; the epochs decide)")
    a("--shard", action="store_true", help="each worker uses a disjoint shard of the data "
      "instead of the whole set with its own shuffle")
    a("--seed", type=int, default=d.seed, help="seed of θ₀ and of the workers' shuffles")
    a("--eval-every", type=int, default=d.eval_every, help="evaluate the central variable "
      "every N master updates (0: only at the end)")
    a("--eval-batch-size", type=int, default=d.eval_batch_size, help="evaluation batch size")
    a("--metrics", default=d.metrics, help="HDF5 file for the metrics (rank 0 writes it)")
    a("--save", default=d.save, help="save the final model's state_dict here (torch.save)")
    a("--synthetic-size", type=int, default=d.synthetic_size, help="samples per epoch of "
      "--dataset synthetic")
    a("--quadratic-dim", type=int, default=d.quadratic_dim, help="parameters of --model "
      "quadratic")
    a("--threads", type=int, default=d.threads, help="torch intra-op threads per worker "
      "(0: the node's cores divided by the ranks on the node)")
    a("--poll-max-ms", type=float, default=d.poll_max_ms, help="longest sleep of an idle "
      "worker between polls of the master")
    a("--log-every", type=float, default=d.log_every, help="seconds between progress lines "
      "when the output is not a terminal")
    a("--verbose", action="store_true", help="workers report their own progress too")
    a("--no-extension", action="store_true", help="use the numpy reference at the master "
      "even when the C++ extension is built")
    a("--straggler", default=d.straggler, metavar="WORKER:FACTOR", help="make worker "
      "WORKER (1..n: its MPI rank, or rank WORKER-1 with --method sync, which has no master) "
      "FACTOR times slower (it sleeps after each step): to see what asynchrony buys")
    a("--no-stop-on-divergence", dest="stop_on_divergence", action="store_false",
      help="keep going when the run diverges")
    a("--divergence-factor", type=float, default=d.divergence_factor, help="the run has "
      "diverged when the smoothed worker loss exceeds this many times its lowest value so "
      "far, or turns NaN/Inf, or θ does")
    a("--checkpoint-dir", default=d.checkpoint_dir, help="the master writes checkpoints "
      "here (HDF5, atomically; the newest is kept)")
    a("--checkpoint-every", type=float, default=d.checkpoint_every, help="seconds between "
      "checkpoints (0: only when stopped by SIGUSR1/SIGTERM)")
    a("--resume", default=d.resume, help="continue from this checkpoint, or 'auto': the "
      "newest in --checkpoint-dir if there is one, else start afresh")
    a("--min-free-mb", type=float, default=d.min_free_mb, help="stop the run cleanly (exit "
      "1, after a checkpoint) when the metrics file's file system has less than this many "
      "MB free, before a full disk can damage the file (0: no check)")
    a("--worker-timeout", type=float, default=d.worker_timeout, help="end the job (after a "
      "checkpoint, naming the worker) when a worker has sent nothing for this many seconds: "
      "stuck, not just slow (0: never)")
    return p


def parse(argv: list[str]) -> tuple[Config | None, str | None]:
    """Returns (config, None), or (None, help text) when --help was asked for."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.help:
        return None, parser.format_help()
    fields = {f.name for f in dataclasses.fields(Config)}
    return Config(**{k: v for k, v in vars(ns).items() if k in fields}), None


def n_workers(cfg: Config, world_size: int) -> int:
    """Workers in a job of ``world_size`` ranks: all of them for sync, all but the master else."""
    return world_size if cfg.method == SYNC else world_size - 1


def straggler(cfg: Config, world_size: int) -> tuple[int, float] | None:
    """(worker number 1..n, factor) of --straggler WORKER:FACTOR, or None."""
    if cfg.straggler is None:
        return None
    try:
        rank_text, factor_text = cfg.straggler.split(":")
        rank, factor = int(rank_text), float(factor_text)
    except ValueError:
        raise UsageError(f"--straggler wants WORKER:FACTOR, e.g. 2:5, got {cfg.straggler!r}")
    n = n_workers(cfg, world_size)
    if not 1 <= rank <= n:
        raise UsageError(f"--straggler worker must be in 1..{n}, got {rank}")
    if not factor >= 1:
        raise UsageError(f"--straggler factor must be >= 1, got {factor}")
    return rank, factor


def _writable_target(path: str, what: str) -> None:
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise UsageError(f"{what} {path!r}: directory {parent!r} does not exist")
    if not os.access(parent, os.W_OK):
        raise UsageError(f"{what} {path!r}: directory {parent!r} is not writable")


def validate(cfg: Config, world_size: int) -> None:
    """Checks that need no data and no MPI; raises UsageError with one readable line."""
    if world_size < 2 and cfg.method != SYNC:
        raise UsageError(
            f"needs at least 2 MPI ranks (1 master + workers), got {world_size}: "
            "launch with e.g. mpirun -n 5 python -m gem_mpi.train"
        )
    if cfg.method not in ALL_METHODS:
        raise UsageError(
            f"unknown --method {cfg.method!r}; choose from {', '.join(ALL_METHODS)}"
        )
    if cfg.model not in MODELS:
        raise UsageError(f"unknown --model {cfg.model!r}; choose from {', '.join(MODELS)}")
    if cfg.dataset not in DATASETS:
        raise UsageError(
            f"unknown --dataset {cfg.dataset!r}; choose from {', '.join(DATASETS)}"
        )
    if cfg.model == "quadratic" and cfg.dataset != "synthetic":
        raise UsageError("--model quadratic uses no data: pass --dataset synthetic")
    if cfg.method == SYNC and cfg.model == "quadratic":
        raise UsageError("--method sync trains torch models (Horovod): --model quadratic is "
                         "for the asynchronous methods only")
    checks = [
        (cfg.lr > 0, f"--lr must be > 0, got {cfg.lr}"),
        (0 <= cfg.momentum < 1, f"--momentum must be in [0, 1), got {cfg.momentum}"),
        (cfg.kappa > 0, f"--kappa must be > 0, got {cfg.kappa}"),
        (cfg.pi_max > 0, f"--pi-max must be > 0, got {cfg.pi_max}"),
        (cfg.eps > 0, f"--eps must be > 0, got {cfg.eps}"),
        (cfg.batch_size > 0, f"--batch-size must be > 0, got {cfg.batch_size}"),
        (cfg.epochs > 0, f"--epochs must be > 0, got {cfg.epochs}"),
        (cfg.max_steps >= 0, f"--max-steps must be >= 0, got {cfg.max_steps}"),
        (cfg.eval_every >= 0, f"--eval-every must be >= 0, got {cfg.eval_every}"),
        (cfg.eval_batch_size > 0, f"--eval-batch-size must be > 0, got {cfg.eval_batch_size}"),
        (cfg.synthetic_size > 0, f"--synthetic-size must be > 0, got {cfg.synthetic_size}"),
        (cfg.quadratic_dim > 0, f"--quadratic-dim must be > 0, got {cfg.quadratic_dim}"),
        (cfg.threads >= 0, f"--threads must be >= 0, got {cfg.threads}"),
        (cfg.poll_max_ms > 0, f"--poll-max-ms must be > 0, got {cfg.poll_max_ms}"),
        (cfg.log_every > 0, f"--log-every must be > 0, got {cfg.log_every}"),
        (cfg.divergence_factor > 1,
         f"--divergence-factor must be > 1, got {cfg.divergence_factor}"),
        (cfg.checkpoint_every >= 0,
         f"--checkpoint-every must be >= 0, got {cfg.checkpoint_every}"),
        (cfg.min_free_mb >= 0, f"--min-free-mb must be >= 0, got {cfg.min_free_mb}"),
        (cfg.worker_timeout >= 0, f"--worker-timeout must be >= 0, got {cfg.worker_timeout}"),
    ]
    for ok, message in checks:
        if not ok:  # also catches NaN, which fails every comparison
            raise UsageError(message)
    if cfg.metrics:
        _writable_target(cfg.metrics, "--metrics")
        if os.path.isdir(cfg.metrics):
            raise UsageError(f"--metrics {cfg.metrics!r} is a directory")
    if cfg.save:
        _writable_target(cfg.save, "--save")
    if cfg.straggler is not None:
        straggler(cfg, world_size)
    if cfg.checkpoint_dir:
        if not os.path.isdir(cfg.checkpoint_dir):
            raise UsageError(f"--checkpoint-dir {cfg.checkpoint_dir!r} does not exist")
        if not os.access(cfg.checkpoint_dir, os.W_OK):
            raise UsageError(f"--checkpoint-dir {cfg.checkpoint_dir!r} is not writable")
    if cfg.resume and cfg.resume != "auto" and not os.path.isfile(cfg.resume):
        raise UsageError(f"--resume {cfg.resume!r}: no such file")
    if cfg.resume == "auto" and not cfg.checkpoint_dir:
        raise UsageError("--resume auto needs --checkpoint-dir")
