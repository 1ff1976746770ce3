"""Options of ``python -m gem_mpi.train``, in sections, and the names every module shares.

Each section is a frozen dataclass whose fields carry their own help text and validity rule;
the command-line parser and the validation are built from them, so an option is declared in
one place. Each component receives only its section (the worker its ``optim`` and ``data``,
the run supervisor its ``monitor`` and ``outputs``, ...). Every rank parses the same argv;
parsing never exits or prints by itself, so a bad option becomes one line from rank 0 and a
non-zero exit on every rank instead of a usage message per rank.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gem_mpi.errors import UsageError

# --- the vocabularies: every module takes its names from here -----------------------------
GEM, DOWNPOUR, ADAPTIVE = "gem", "downpour", "adaptive"
GAP_AWARE = "gap-aware"  # Barkai et al., ICLR 2020: Δθ divided by 1 + |θ − s|/C per element
# Async Local-SGD's delayed Nesterov (Liu et al. 2024, arXiv 2401.09135): each update applied
# at once, scaled, an outer Nesterov momentum folded in only every N updates
DN = "dn"
ASYNC_METHODS = (GEM, DOWNPOUR, ADAPTIVE, GAP_AWARE, DN)  # applied by the master on rank 0
SYNC = "sync"  # synchronous momentum SGD on Horovod: every rank a worker, no master
DDP = "ddp"  # the same on torch.distributed's DistributedDataParallel
# local SGD with an outer Nesterov step every --diloco-steps (arXiv 2311.08105), on torchft
DILOCO = "diloco"
SYNC_METHODS = (SYNC, DDP, DILOCO)
METHODS = (*ASYNC_METHODS, *SYNC_METHODS)


def synchronous(method: str) -> bool:
    """Whether ``method`` is a synchronous one: every rank a worker, no master (DiLoCo's
    workers meet every --diloco-steps steps instead of every step)."""
    return method in SYNC_METHODS

QUADRATIC = "quadratic"  # the numpy test problem: no torch, no data
TORCH_MODELS = ("mnist-cnn", "alexnet", "resnet18", "gpt")
MODELS = (*TORCH_MODELS, QUADRATIC)
DATASETS = ("fashion-mnist", "mnist", "imagenet", "synthetic", "text")
GPT, TEXT = "gpt", "text"  # the language model and the bytes it reads: each needs the other
# --holdout: the arrays' last N images, or text's validation files (one in ten, by name)
HOLDOUT_DATASETS = ("fashion-mnist", "mnist", "text")
SHIFT_OTHERS, SHIFT_PAPER = "others", "paper"  # GEM's two readings of the shift |θ − s|
GEM_SHIFTS = (SHIFT_OTHERS, SHIFT_PAPER)
# where GEM's proxy momentum m lives: each worker's own (the paper), or one at the master fed
# by every worker's Δθ (the paper's proposed future work; docs/ARCHITECTURE.md)
PROXY_LOCAL, PROXY_GLOBAL = "local", "global"
GEM_PROXIES = (PROXY_LOCAL, PROXY_GLOBAL)
# where a worker computes its next gradient: at θ pulled after its own update was applied
# (it waits), or at θ pulled just before it commits that update (Algorithm 1's order)
LOSS_END, LOSS_CONTINUE = "end", "continue"  # --worker-loss
WORKER_LOSS = (LOSS_END, LOSS_CONTINUE)
WAIT, PIPELINED, OVERLAP = "wait", "pipelined", "overlap"
WORKER_MODES = (WAIT, PIPELINED, OVERLAP)
# --gradient-at: where a worker with updates in flight takes its next gradient
AT_OWN, AT_PULLED = "own", "pulled"
GRADIENT_POINTS = (AT_OWN, AT_PULLED)
# η over a worker's own steps (gem_mpi.algorithm.stepsize): after --warmup-steps, constant,
# multiplied by --lr-gamma every --lr-step-every steps, or a cosine down to --lr-min
CONSTANT, STEP, COSINE = "constant", "step", "cosine"
LR_SCHEDULES = (CONSTANT, STEP, COSINE)
# mixed precision of the workers' forward pass (θ, Δθ, m and the master stay float32)
AMP_OFF, AMP_BF16 = "off", "bf16"
AMP_MODES = (AMP_OFF, AMP_BF16)
# the workers' optimizer, GEM's proxy: momentum SGD (the paper), or AdamW, whose step d at s
# a GEM worker sends with the budget κ|d| (../shared/GEM_SPEC.md §10; gem_mpi.optimizers)
OPT_SGD, OPT_ADAMW = "sgd", "adamw"
OPTIMIZERS = (OPT_SGD, OPT_ADAMW)
# how Δθ and κ|m| travel from a worker to the master (s and θ always float32)
WIRE_F32, WIRE_BF16 = "float32", "bf16"
WIRES = (WIRE_F32, WIRE_BF16)


def is_plugin(name: str) -> bool:
    """``MODULE:FUNCTION``: the user's own model, dataset or loss, not a built-in name."""
    return ":" in name

Check = tuple[Callable[[Any], bool], str]  # (is it valid?, what "must be" says otherwise)


def _float32(v: float) -> np.float32:
    """``v`` as the kernel and the workers compute with it: float32 (NaN stays NaN, a value
    beyond float32's range becomes inf, one below its smallest subnormal 0)."""
    with np.errstate(over="ignore"):
        return np.float32(v)


def _float32_positive(v: float) -> bool:
    """Positive and finite once cast to the float32 the kernel computes in."""
    x = _float32(v)
    return bool(np.isfinite(x) and x > 0)


def _float32_fraction(v: float) -> bool:
    """In [0, 1) once cast to float32: 0.99999999 is 1.0 there, a momentum that never decays."""
    return bool(0 <= v and _float32(v) < 1)


def step_range(text: str) -> tuple[int, int] | None:
    """``A:B`` (--profile-steps) as (A, B), or None unless 0 <= A <= B are whole numbers."""
    try:
        a, b = (int(x) for x in text.split(":"))
    except ValueError:
        return None
    return (a, b) if 0 <= a <= b else None


POSITIVE: Check = (lambda v: v > 0, "> 0")
POSITIVE_F32: Check = (_float32_positive, "> 0 and finite in float32")
NON_NEGATIVE: Check = (lambda v: v >= 0, ">= 0")
FRACTION_F32: Check = (_float32_fraction, "in [0, 1) in float32")
SEED_MAX = 2**63 - 1  # numpy takes no negative seed, torch none beyond 64 bits
# An idle worker doubles its sleep between polls up to --poll-max-ms: beyond a second it
# would sleep through the master's answers (and a stop) for minutes; time.sleep overflows
POLL_MAX_MS = 1000.0
LOG_EVERY_MIN = 0.1  # seconds: below this the progress lines flood the job's log
FLOPS_AUTO, FLOPS_ON, FLOPS_OFF = "auto", "on", "off"  # --flops: when rank 0 counts FLOPs
FLOPS_MODES = (FLOPS_AUTO, FLOPS_ON, FLOPS_OFF)
NICE_AUTO = "auto"  # --worker-nice: AUTO_NICE where a node holds more ranks than cores
AUTO_NICE = 10


def _nice_setting(value: str) -> bool:
    return value == NICE_AUTO or (value.isdigit() and int(value) <= 19)


RUN_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")  # --run-id: a file name, a W&B id, a log word
RUN_ID_CHECK: Check = (lambda v: v is None or bool(RUN_ID.fullmatch(v)),
                      "letters, digits, '.', '_', '-' (1 to 64 of them)")
STRAGGLER_MAX = 1000.0  # a larger factor sleeps past --worker-timeout, or overflows sleep()


def opt(default: Any, help: str, *, check: Check | None = None, flag: str | None = None,
        metavar: str | None = None) -> Any:
    """A config field: its default, its --help text, and the rule its value must follow."""
    return field(default=default, metadata={"help": help, "check": check, "flag": flag,
                                            "metavar": metavar})


@dataclass(frozen=True)
class OptimConfig:
    """The update rule and its hyper-parameters."""

    method: str = opt(GEM, f"update rule at the master: {', '.join(ASYNC_METHODS)}; or sync: "
                      "synchronous momentum SGD on Horovod (every rank a worker, no master), "
                      "GEM's proxy, the baseline to compare with; or ddp: the same on "
                      "PyTorch's DistributedDataParallel (gloo on the CPU, NCCL on GPUs); or "
                      "diloco: each worker takes --diloco-steps steps of its own momentum SGD, "
                      "then the workers average θ_outer − θ_local and take one outer Nesterov "
                      "step (torchft's DiLoCo; every rank a worker, no master)")
    optimizer: str = opt(OPT_SGD, "the workers' optimizer, GEM's proxy: 'sgd' (momentum SGD, "
                         "Δθ = −η·g with GEM's m ← μm + Δθ, --momentum) or 'adamw' (each "
                         "worker's update is its own AdamW step d at the θ it pulled, "
                         "--betas, --adam-eps, --weight-decay; GEM's budget is κ|d|; sync, "
                         "ddp: torch.optim.AdamW on the averaged gradient; diloco: the inner "
                         "optimizer)",
                         check=(lambda v: v in OPTIMIZERS, f"one of {', '.join(OPTIMIZERS)}"))
    local_steps: int = opt(1, "H: each update is H steps of the worker's own optimizer (momentum "
                           "SGD with --momentum, or AdamW) on its own copy from the θ it pulled, "
                           "committing Δ = θ_H − θ₀, GEM's budget κ|Δ| (asynchronous local "
                           "SGD); a worker's batch is then H × --batch-size samples, split in "
                           "H, and --epochs and --max-steps count its updates; asynchronous "
                           "methods only", check=POSITIVE, metavar="H")
    dylu: bool = opt(False, "dynamic local updates (Async Local-SGD's DyLU): each worker takes "
                     "H_w = round(H · t_fast/t_w) local steps an update, at least 1, t_w its "
                     "measured seconds per local step and t_fast the fastest worker's (which "
                     "the master publishes with θ), so that every worker commits at about "
                     "the fastest one's rate; an update of H_w steps trains on the first H_w "
                     "parts of its batch; needs --local-steps H > 1, asynchronous methods only")
    # the workers and the kernel compute in float32: each value is checked as float32 sees it
    lr: float = opt(0.05, "learning rate η (> 0)", check=POSITIVE_F32)
    momentum: float = opt(0.9, "proxy momentum μ in [0, 1)", check=FRACTION_F32)
    kappa: float = opt(1.0, "proxy amplification κ (> 0)", check=POSITIVE_F32)
    pi_max: float = opt(5.0, "upper clamp of the GEM scale π (> 0)", check=POSITIVE_F32)
    eps: float = opt(1e-16, "ε in π's denominator |Δθ| + ε (> 0)", check=POSITIVE_F32)
    gem_shift: str = opt(SHIFT_OTHERS, "GEM's shift |θ − s|: 'others' takes s = the θ the "
                         "update was computed at (with --worker-mode wait that θ holds the "
                         "worker's own previous update, so the shift counts the other "
                         "workers' updates; with pipelined it is Algorithm 1's s); 'paper' "
                         "takes s = θ just before the worker's previous update was applied, "
                         "as the authors' prototype code does (not Algorithm 1)",
                         check=(lambda v: v in GEM_SHIFTS, f"one of {', '.join(GEM_SHIFTS)}"))
    gem_proxy: str = opt(PROXY_LOCAL, "where GEM's proxy momentum m lives: 'local', each "
                         "worker's own m ← μm + Δθ of its updates, sent as κ|m| (the paper); "
                         "'global', one m at the master that every worker's unscaled Δθ is "
                         "folded into, m ← μ^(1/n)·m + cΔθ with c = (1 − μ^(1/n))/(1 − μ) "
                         "for n workers, so that a round of n updates decays it like one "
                         "proxy step and a constant Δθ builds the same |m|; workers then keep "
                         "no m and do not send κ|m| (with one worker it is 'local' exactly); "
                         "--method gem only, with either --gem-shift and --worker-mode",
                         check=(lambda v: v in GEM_PROXIES, f"one of {', '.join(GEM_PROXIES)}"))
    wire: str = opt(WIRE_F32, "how a worker sends Δθ and GEM's κ|m|: 'float32', or 'bf16' "
                    "(half the bytes: Δθ rounded to nearest even, κ|m| rounded toward zero "
                    "so it never exceeds the proxy; the master computes π from the values "
                    "sent and applies θ ← θ + π·bf16(Δθ) in float32, so GEM's energy rule "
                    "stays exact; s, θ and the worker's m stay float32); asynchronous "
                    "methods only", check=(lambda v: v in WIRES, f"one of {', '.join(WIRES)}"))
    worker_mode: str = opt(WAIT, "'wait': after each commit a worker waits until the master "
                           "has applied it, then pulls θ and computes the next update there; "
                           "'pipelined': it computes the next update at once, at the θ it "
                           "pulled just before the commit, while the master applies it "
                           "(Algorithm 1's order: with --gem-shift others and "
                           "--gradient-at pulled, Algorithm 1 exactly); 'overlap': a "
                           "compute thread computes step k+1 while the worker commits step k "
                           "and, just before step k+1 ends and once update k was applied, "
                           "pulls the θ of step k+2, so a step costs the longer of compute "
                           "and communication, not their sum (pipelined's staleness: update "
                           "k+1 is in flight; GEM's shift sees it: s is the θ each update's "
                           "step pulled); asynchronous methods only",
                           check=(lambda v: v in WORKER_MODES,
                                  f"one of {', '.join(WORKER_MODES)}"))
    gradient_at: str = opt(AT_OWN, "where a worker whose own last update is still in flight "
                           "when it pulls (--worker-mode pipelined or overlap) takes "
                           "its next gradient: 'own', at the θ pulled plus that update "
                           "(unscaled, as the authors' prototype adds its own update to its "
                           "copy); 'pulled', at the θ pulled (Algorithm 1 as printed). GEM's "
                           "shift is measured from the θ pulled either way; a waiting worker "
                           "has nothing in flight",
                           check=(lambda v: v in GRADIENT_POINTS,
                                  f"one of {', '.join(GRADIENT_POINTS)}"))
    lr_schedule: str = opt(CONSTANT, "η over each worker's own steps (sync: the steps): "
                           "'constant', 'step' (times --lr-gamma every --lr-step-every "
                           "steps) or 'cosine' (down to --lr-min over --lr-decay-steps); "
                           "after --warmup-steps of linear warm-up in every case",
                           check=(lambda v: v in LR_SCHEDULES,
                                  f"one of {', '.join(LR_SCHEDULES)}"))
    warmup_steps: int = opt(0, "steps of linear warm-up of η, from η/N at the first step to η "
                            "(0: none)", check=NON_NEGATIVE)
    lr_decay_steps: int = opt(0, "--lr-schedule cosine: the steps (warm-up included) over "
                              "which η falls to --lr-min (0: the worker's whole budget)",
                              check=NON_NEGATIVE)
    lr_step_every: int = opt(0, "--lr-schedule step: multiply η by --lr-gamma every this many "
                             "steps after the warm-up (required with step)", check=NON_NEGATIVE)
    lr_gamma: float = opt(0.1, "--lr-schedule step: the factor", check=(
        lambda v: 0 < v <= 1, "in (0, 1]"))
    lr_min: float = opt(0.0, "--lr-schedule cosine: the last η", check=NON_NEGATIVE)
    clip_grad_norm: float = opt(0.0, "clip each worker's gradient to this L2 norm before "
                                "Δθ = −η·g (and before GEM's momentum fold) (0: no clipping)",
                                check=NON_NEGATIVE)
    amp: str = opt(AMP_OFF, "mixed precision of the workers' forward pass: 'off' (float32) or "
                   "'bf16' (torch.autocast, on CUDA and on the CPU); θ, Δθ, m and the master "
                   "stay float32", check=(lambda v: v in AMP_MODES,
                          (f"one of {', '.join(AMP_MODES)} (fp16, whose loss scaler skips "
                           "steps, is not offered: use bf16)")))


@dataclass(frozen=True)
class DataConfig:
    """What is trained, on which data, and each worker's budget."""

    model: str = opt("mnist-cnn", f"model: {', '.join(MODELS)} (quadratic: a convex test "
                     "problem in numpy, no torch, for checks and transport benchmarks), or "
                     "your own as MODULE:FUNCTION, FUNCTION() returning a torch.nn.Module",
                     metavar="MODEL")
    dataset: str = opt("fashion-mnist", f"dataset: {', '.join(DATASETS)}, or your own as "
                       "MODULE:FUNCTION, FUNCTION(split) returning a map-style dataset of "
                       "(input, target) pairs for split 'train' and 'test'", metavar="DATASET")
    loss: str | None = opt(None, "training loss: cross_entropy, nll, mse, or MODULE:FUNCTION "
                           "(FUNCTION(output, target) returning the batch's mean loss as a "
                           "scalar tensor); default: nll for the built-in models (they end in "
                           "log_softmax), cross_entropy for a model of your own",
                           metavar="LOSS")
    data_dir: str | None = opt(None, "dataset location (default: ~/.cache/gem_mpi/data, where "
                               "tools/install.sh unpacks Fashion-MNIST, then Debian's "
                               "/usr/share/datasets/fashion-mnist; "
                               "--dataset text: the text files under it, by default the running "
                               "Python's standard-library sources)")
    batch_size: int = opt(64, "worker mini-batch b", check=POSITIVE)
    epochs: int = opt(1, "epochs of the training set per worker", check=POSITIVE)
    max_steps: int = opt(0, "cap on each worker's steps (0: no cap; the epochs decide)",
                         check=NON_NEGATIVE)
    shard: bool = opt(False, "each worker uses a disjoint shard of the data instead of the "
                      "whole set with its own shuffle")
    holdout: int = opt(0, "hold the last N images of the training set out of training and "
                       "evaluate on them instead of the test split: a validation set (mnist: "
                       "10000 are the classic pickle's validation images); --dataset text: "
                       "hold one training file in ten out (by its name) and evaluate on the "
                       "first N bytes of those (mnist, fashion-mnist and text only)",
                       check=NON_NEGATIVE)
    seed: int = opt(0, "seed of θ₀ and of the workers' shuffles",
                    check=(lambda v: 0 <= v <= SEED_MAX, f"in 0..2**63-1 ({SEED_MAX})"))
    synthetic_size: int = opt(60000, "samples per epoch of --dataset synthetic",
                              check=POSITIVE)
    quadratic_dim: int = opt(100_000, "parameters of --model quadratic", check=POSITIVE)
    context: int = opt(64, "--dataset text: the bytes of one sample, the language model's "
                       "context (each sample predicts the byte after each of its bytes)",
                       check=POSITIVE)
    test_bytes: int = opt(262_144, "--dataset text: evaluate on the first N bytes of the test "
                          "files (0: all of them; an evaluation predicts each byte once, and "
                          "the standard library's 3.2 MB take 2 CPU cores about 40 s)",
                          check=NON_NEGATIVE)
    gpt_layers: int = opt(2, "--model gpt: transformer blocks", check=POSITIVE)
    gpt_heads: int = opt(4, "--model gpt: attention heads per block (they divide --gpt-width)",
                         check=POSITIVE)
    gpt_width: int = opt(128, "--model gpt: the width of its embeddings and blocks",
                         check=POSITIVE)
    loader_workers: int = opt(0, "processes that make each worker's training batches ahead "
                              "(torch DataLoader workers, started once, page-locked batches "
                              "for a GPU), the same batches bit for bit (0: the worker makes "
                              "them itself); at most the cores of rank 0's node",
                              check=NON_NEGATIVE, metavar="N")

    @property
    def eval_split(self) -> str:
        """What the evaluations measure: the test split, or the held-out validation set."""
        return "validation" if self.holdout else "test"


@dataclass(frozen=True)
class MonitorConfig:
    """What rank 0 watches while the run goes: evaluation, progress, the stop checks."""

    eval_every: int = opt(2000, "evaluate the central variable every N master updates (0: "
                          "only at the end)", check=NON_NEGATIVE)
    eval_batch_size: int = opt(1000, "evaluation batch size", check=POSITIVE)
    bn_batches: int = opt(20, "before each evaluation and --save, rank 0 recomputes the "
                          "BatchNorm statistics of the evaluated θ on this many training "
                          "batches (torch.optim.swa_utils.update_bn; models without BatchNorm "
                          "skip it; 0: keep the model's initial statistics)",
                          check=NON_NEGATIVE)
    log_every: float = opt(10.0, "seconds between progress lines when the output is not a "
                           "terminal", check=(lambda v: v >= LOG_EVERY_MIN,
                                              f">= {LOG_EVERY_MIN} (seconds)"))
    verbose: bool = opt(False, "workers report their own progress too")
    stop_on_divergence: bool = opt(True, "keep going when the run diverges",
                                   flag="--no-stop-on-divergence")
    divergence_factor: float = opt(1000.0, "the run has diverged when the smoothed worker loss "
                                   "exceeds this many times its lowest value so far (judged "
                                   "after its first 20 losses, counted as at least a thousandth "
                                   "of its first), or turns NaN/Inf, or θ does", check=(lambda v: v > 1, "> 1"))
    flops: str = opt(FLOPS_AUTO, "count the model's FLOPs per sample once at the start (torch's "
                     "FlopCounterMode on two samples: about a second of rank 0's CPU) for "
                     "model FLOP/s and MFU: 'auto' where the workers' GPU has a known peak, "
                     "so that MFU means something; 'on' also on the CPU (GFLOP/s); 'off' "
                     "never", check=(lambda v: v in FLOPS_MODES,
                                     f"one of {', '.join(FLOPS_MODES)}"))
    min_free_mb: float = opt(64.0, "stop the run cleanly (exit 5, after a checkpoint) when the "
                             "metrics file's file system has less than this many MB free, "
                             "before a full disk can damage the file (0: no check)",
                             check=NON_NEGATIVE)
    worker_timeout: float = opt(1800.0, "end the job (after a checkpoint, naming the worker) "
                                "when a worker has sent nothing for this many seconds: stuck, "
                                "not just slow (0: never)", check=NON_NEGATIVE)
    exit_timeout: float = opt(60.0, "once the run has ended (its checkpoint and metrics "
                              "written), the master waits this many seconds for every worker "
                              "to leave, then ends the job (MPI_Abort with the run's exit "
                              "code): a worker stuck in a step cannot hold the job",
                              check=POSITIVE)

    @property
    def min_free_bytes(self) -> int:
        return int(self.min_free_mb * 2**20)


@dataclass(frozen=True)
class OutputConfig:
    """Files the run writes and the checkpoint it may continue from."""

    metrics: str | None = opt(None, "HDF5 file for the metrics (rank 0 writes it)")
    save: str | None = opt(None, "save the final model's state_dict here (parameters and "
                           "buffers by name, BatchNorm statistics as evaluated): a name ending "
                           "in .safetensors as safetensors, the run's id and configuration in "
                           "its metadata; any other with torch.save (--model quadratic: θ as "
                           ".npy, or the tensor 'theta' in a .safetensors file)")
    checkpoint_dir: str | None = opt(None, "the master writes checkpoints here (HDF5, "
                                     "atomically; the newest --keep-checkpoints are kept)")
    checkpoint_every: float = opt(300.0, "seconds between checkpoints (0: only when stopped by "
                                  "SIGUSR1/SIGTERM)", check=NON_NEGATIVE)
    keep_checkpoints: int = opt(2, "checkpoints kept in --checkpoint-dir: the newest and the "
                                "K − 1 before it (the last good state stays beside the newest, "
                                "which may already hold a diverging θ)", check=POSITIVE,
                                metavar="K")
    resume: str | None = opt(None, "continue from this checkpoint, or 'auto': the newest in "
                             "--checkpoint-dir of the run it continues (--run-id, else the "
                             "one run whose checkpoints are there) if there is one, else "
                             "start afresh")
    run_id: str | None = opt(None, "this run's id (letters, digits, '.', '_', '-'; at most 64): "
                             "a new run takes it instead of a random one, --resume auto "
                             "continues only this run's checkpoints and --resume FILE must be "
                             "one of them", check=RUN_ID_CHECK, metavar="ID")
    tensorboard: str | None = opt(None, "write live scalars (loss, staleness, π median, "
                                  "clamp share, the time split, updates/s, samples/s, "
                                  "tokens/s, MFU, the evaluations) as TensorBoard event files "
                                  "into this directory, from rank 0, at each progress line",
                                  metavar="DIR")
    wandb: str | None = opt(None, "log the same scalars to this Weights & Biases project "
                            "(the run's id is W&B's run id, so a resume continues it; "
                            "WANDB_MODE=offline keeps it on disk)", metavar="PROJECT")
    profile_steps: str | None = opt(None, "write a torch.profiler trace (Chrome trace JSON, "
                                    "for TensorBoard and Perfetto) of each rank's steps A to B, "
                                    "both included, counted from 0 at this start of the run "
                                    "(a worker's updates, a synchronous worker's steps, the "
                                    "master's applied batches): rank<r>.pt.trace.json in "
                                    "--profile-dir; torch models only",
                                    check=(lambda v: v is None or step_range(v) is not None,
                                           "A:B, step numbers 0 <= A <= B, e.g. 5:8"),
                                    metavar="A:B")
    profile_dir: str | None = opt(None, "the folder of the --profile-steps traces, made if "
                                  "missing (None: the --metrics path less its suffix, plus "
                                  "_profile: run.h5 gives run_profile)", metavar="DIR")

    @property
    def trace_dir(self) -> str | None:
        """Where the --profile-steps traces go: --profile-dir, else beside --metrics."""
        if self.profile_dir or not self.metrics:
            return self.profile_dir
        return os.path.splitext(self.metrics)[0] + "_profile"


@dataclass(frozen=True)
class RuntimeConfig:
    """How the ranks use the machine."""

    threads: int = opt(0, "torch intra-op threads per worker (0: the node's cores divided by "
                       "the ranks on the node)", check=NON_NEGATIVE)
    poll_max_ms: float = opt(5.0, "longest sleep of an idle worker between polls of the "
                             "master", check=(lambda v: 0 < v <= POLL_MAX_MS,
                                              f"in (0, {POLL_MAX_MS:g}] (milliseconds)"))
    masters: int = opt(1, "ranks 0..K-1 are masters, each holding one shard of θ (cut between "
                       "tensors) with its own clock, tickets and mailboxes; every worker "
                       "commits to and pulls from each; asynchronous methods only. Must match "
                       "the checkpoint on --resume", check=POSITIVE, metavar="K")
    group_size: int = opt(1, "G: consecutive worker ranks of a node form one worker group "
                          "that trains synchronously inside (torch.distributed: gloo on the "
                          "CPU, NCCL on GPUs; the gradients of the G parts of the group's "
                          "batch of G × --batch-size averaged every step) and is one GEM "
                          "worker to the master: its first rank, the leader, commits and "
                          "pulls; G must divide each node's worker ranks; asynchronous "
                          "methods and torch models only", check=POSITIVE, metavar="G")
    worker_loss: str = opt(LOSS_END, "what a worker whose process dies does to the run: "
                           "'end' the job (every MPI stack; --resume auto or python -m "
                           "gem_mpi.launch continue it) or 'continue' without it, its update "
                           "in flight dropped and its batches dealt to the others (Open MPI 5 "
                           "under mpirun --with-ft ulfm only; an asynchronous method, one "
                           "master, no --group-size)",
                           check=(lambda v: v in WORKER_LOSS, f"one of {', '.join(WORKER_LOSS)}"))
    worker_nice: str = opt(NICE_AUTO, "raise the nice value of every worker rank by N (0-19; "
                           "asynchronous methods), so that the master gets a core as soon as it "
                           "has an update to apply instead of waiting its turn behind the "
                           f"workers' steps: 'auto' is {AUTO_NICE} on a node that holds more "
                           "ranks than cores when --worker-mode is overlap (its workers never "
                           "leave the cores to the master, and the updates grow stale), 0 "
                           "elsewhere",
                           check=(_nice_setting, f"'{NICE_AUTO}' or an integer in [0, 19]"),
                           metavar="N|auto")
    interface: str | None = opt(None, "the network interface whose address the sockets of "
                                "torch.distributed (--method ddp) and gloo listen on across "
                                "nodes (e.g. ib0, eth1; default: MASTER_ADDR, else the address "
                                "of rank 0's host name); on one node they listen on loopback "
                                "alone", metavar="IFACE")
    no_extension: bool = opt(False, "use the numpy reference at the master (and the "
                             "three-pass fold of the GEM workers' momentum) even when the C++ "
                             "extension is built")
    straggler: str | None = opt(None, "make worker WORKER (1..n: MPI rank K-1+WORKER with "
                                "--masters K, rank WORKER-1 with --method sync, which has no "
                                "master; with --group-size, group WORKER, its leader sleeping) "
                                "FACTOR "
                                "times slower (it sleeps after each step): to see what "
                                "asynchrony buys", metavar="WORKER:FACTOR")
    speeds: str | None = opt(None, "each worker's slowdown factor, F1 for worker 1, F2 for "
                             "worker 2, ... (each in [1, 1000]; one per worker): a mixed "
                             "cluster, as --straggler makes one slow worker",
                             metavar="F1,F2,...")


@dataclass(frozen=True)
class GapAwareConfig:
    """--method gap-aware alone: its master's step average (Barkai et al., ICLR 2020)."""

    ga_decay: float = opt(0.999, "decay γ of the master's per-element "
                          "moving average v ← γv + (1 − γ)Δθ² of the incoming steps; "
                          "C = √(v/(1 − γ^t)) + ε is the typical step a gap is measured "
                          "in (0: the current step alone); in [0, 1)", check=FRACTION_F32)
    ga_eps: float = opt(1e-8, "ε added to C (θ's units), so that a "
                        "parameter that never moved is not divided by 0 (> 0)",
                        check=POSITIVE_F32)


@dataclass(frozen=True)
class DilocoConfig:
    """--method diloco alone: its rounds and outer Nesterov step (arXiv 2311.08105)."""

    diloco_steps: int = opt(20, "H, the inner steps each worker takes between "
                            "two outer steps (> 0); a budget that is no whole number of "
                            "rounds ends at the last whole one", check=POSITIVE)
    diloco_outer_lr: float = opt(0.7, "the outer learning rate (the paper's "
                                 "0.7; > 0)", check=POSITIVE_F32)
    diloco_outer_momentum: float = opt(0.9, "the outer Nesterov momentum (the "
                                       "paper's 0.9) in [0, 1)", check=FRACTION_F32)


def _betas(text: str) -> tuple[float, float] | None:
    """``B1,B2`` as two floats, or None when it is not two numbers."""
    try:
        b1, b2 = (float(x) for x in text.split(","))
    except ValueError:
        return None
    return b1, b2


@dataclass(frozen=True)
class AdamWConfig:
    """--optimizer adamw alone: the workers' AdamW (decoupled weight decay, torch's defaults)."""

    betas: str = opt("0.9,0.999", "B1,B2: the decays of AdamW's first and second moments, "
                     "each in [0, 1)", check=(
                         lambda v: (b := _betas(v)) is not None and all(
                             _float32_fraction(x) for x in b), "two numbers B1,B2 in [0, 1)"))
    adam_eps: float = opt(1e-8, "ε added to √v̂ in AdamW's denominator (> 0)",
                          check=POSITIVE_F32)
    weight_decay: float = opt(0.01, "λ of AdamW's decoupled weight decay, −η·λ·θ per step "
                              "(>= 0)", check=NON_NEGATIVE)

    @property
    def beta1(self) -> float:
        b = _betas(self.betas)
        assert b is not None, "checked by the preflight"
        return b[0]

    @property
    def beta2(self) -> float:
        b = _betas(self.betas)
        assert b is not None, "checked by the preflight"
        return b[1]


@dataclass(frozen=True)
class DnConfig:
    """--method dn alone: delayed Nesterov's outer step at the master (arXiv 2401.09135)."""

    dn_outer_lr: float = opt(0.7, "the outer learning rate η_o: each update Δ moves θ by "
                             "η_o·Δ/N at once (> 0)", check=POSITIVE_F32)
    dn_momentum: float = opt(0.9, "the outer Nesterov momentum β, in [0, 1)",
                             check=FRACTION_F32)
    dn_every: int = opt(0, "N: the outer momentum takes in the updates every N of them (0: "
                        "the run's number of workers)", check=NON_NEGATIVE)


SECTIONS = {"optim": OptimConfig, "adamw": AdamWConfig, "gap_aware": GapAwareConfig,
            "diloco": DilocoConfig, "dn": DnConfig,
            "data": DataConfig, "monitor": MonitorConfig, "outputs": OutputConfig,
            "runtime": RuntimeConfig}


@dataclass(frozen=True)
class Config:
    """The whole run's options: one section per component."""

    optim: OptimConfig = field(default_factory=OptimConfig)
    adamw: AdamWConfig = field(default_factory=AdamWConfig)
    gap_aware: GapAwareConfig = field(default_factory=GapAwareConfig)
    diloco: DilocoConfig = field(default_factory=DilocoConfig)
    dn: DnConfig = field(default_factory=DnConfig)
    data: DataConfig = field(default_factory=DataConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    outputs: OutputConfig = field(default_factory=OutputConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)

    @classmethod
    def of(cls, **options: Any) -> Config:
        """A config from flat option names (``lr=0.1, metrics="run.h5"``), for programs and
        tests that build one without a command line."""
        sections: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
        owner = {f.name: name for name, sec in SECTIONS.items() for f in dataclasses.fields(sec)}
        for key, value in options.items():
            if key not in owner:
                raise TypeError(f"no option {key!r}")
            sections[owner[key]][key] = value
        return cls(**{name: SECTIONS[name](**kw) for name, kw in sections.items()})

    def as_dict(self) -> dict:
        """Flat option name -> value: what metrics files and checkpoints record."""
        return {k: v for name in SECTIONS for k, v in dataclasses.asdict(getattr(self, name)).items()}

    @property
    def method(self) -> str:
        return self.optim.method


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of printing and exiting on every rank."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message)

    def exit(self, status: int = 0, message: str | None = None) -> None:  # type: ignore[override]
        raise UsageError(message or f"exit {status}")


def flag_of(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m gem_mpi.train",
        usage="%(prog)s [--config FILE] [--print-config] [OPTION ...]",
        description="Asynchronous data-parallel training with Gradient Energy Matching. "
        "Launch under MPI: rank 0 is the master, every other rank a worker, e.g. "
        "mpirun -n 5 python -m gem_mpi.train. The options come in sections; a TOML file "
        "given with --config holds any of them under its section's name ([optim] lr = 0.1), "
        "and an option on the command line overrides the file.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        add_help=False,
    )
    p.add_argument("-h", "--help", action="store_true", help="show this help and exit")
    p.add_argument("--config", metavar="FILE", default=None,
                   help="read the options from this TOML file (one table per section, as "
                   "--print-config writes it); options on the command line override it")
    p.add_argument("--print-config", action="store_true",
                   help="print the effective configuration as a TOML file for --config, "
                   "and exit")
    for name, section in SECTIONS.items():
        group = p.add_argument_group(name, section.__doc__)
        for f in dataclasses.fields(section):
            kw: dict[str, Any] = {"dest": f.name, "help": f.metadata["help"]}
            if isinstance(f.default, bool):  # a switch: its flag turns the default around
                kw["action"] = "store_false" if f.default else "store_true"
            else:
                kw["default"] = f.default
                if f.default is not None:
                    kw["type"] = type(f.default)
                if f.metadata.get("metavar"):
                    kw["metavar"] = f.metadata["metavar"]
            group.add_argument(flag_of(f), **kw)
    return p


# a field's type as TOML must hold it: (accepted Python types, the name a message gives)
_TOML_TYPES: dict[str, tuple[tuple[type, ...], str]] = {
    "bool": ((bool,), "true or false"), "int": ((int,), "an integer"),
    "float": ((int, float), "a number"), "str": ((str,), "a string"),
    "str | None": ((str,), "a string")}


def read_toml(path: str) -> dict[str, Any]:
    """The flat options a --config file sets, checked against the sections: an unknown
    section or key, or a value of the wrong type, is one line naming it and the file."""
    try:
        with open(path, "rb") as fh:
            doc = tomllib.load(fh)
    except OSError as exc:
        raise UsageError(f"--config {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"--config {path}: not valid TOML: {exc}") from None
    options: dict[str, Any] = {}
    for name, table in doc.items():
        if name not in SECTIONS or not isinstance(table, dict):
            raise UsageError(f"--config {path}: unknown section [{name}] (sections: "
                             f"{', '.join(SECTIONS)})")
        fields = {f.name: f for f in dataclasses.fields(SECTIONS[name])}
        items: dict[str, Any] = table
        for key, value in items.items():
            f = fields.get(key.replace("-", "_"))
            if f is None:
                raise UsageError(f"--config {path}: unknown key {name}.{key} (its options: "
                                 f"{', '.join(fields)})")
            types, wanted = _TOML_TYPES[str(f.type)]
            if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
                raise UsageError(f"--config {path}: {name}.{key} must be {wanted}, got "
                                 f"{value!r}")
            number: Any = value  # checked: an int or a float where a float is due
            options[f.name] = float(number) if str(f.type) == "float" else value
    return options


def to_toml(cfg: Config) -> str:
    """``cfg`` as a --config file: every option under its section (an unset one, None, left
    out: TOML has no null), so that reading it back gives ``cfg``."""
    import tomli_w  # writing TOML is a library's job; install.sh installs it

    doc = {name: {k: v for k, v in dataclasses.asdict(getattr(cfg, name)).items()
                  if v is not None} for name in SECTIONS}
    return ("# gem_mpi run configuration: python -m gem_mpi.train --config FILE\n"
            + tomli_w.dumps(doc))


def parse(argv: list[str]) -> tuple[Config | None, str | None]:
    """Returns (config, None), or (None, text to print) when --help or --print-config was
    asked for. The --config file's options become the parser's defaults, so that the
    command line overrides them."""
    parser = build_parser()
    first = vars(parser.parse_known_args(argv)[0])
    if first["help"]:
        return None, parser.format_help()
    if first["config"] is not None:
        parser.set_defaults(**read_toml(first["config"]))
    ns = vars(parser.parse_args(argv))
    for key in ("help", "config"):
        ns.pop(key)
    printing = ns.pop("print_config")
    cfg = Config.of(**ns)
    return (None, to_toml(cfg)) if printing else (cfg, None)


def n_workers(cfg: Config, world_size: int) -> int:
    """Workers in a job of ``world_size`` ranks: all of them for sync, all but the --masters
    master ranks else, a group of --group-size ranks counting as one."""
    if synchronous(cfg.method):
        return world_size
    return (world_size - cfg.runtime.masters) // cfg.runtime.group_size


def worker_ranks(cfg: Config, worker: int) -> str:
    """The MPI ranks of asynchronous worker ``worker`` (1..n), as a message names them: its
    rank, or its group's (--group-size), the leader first."""
    first = cfg.runtime.masters + (worker - 1) * cfg.runtime.group_size
    g = cfg.runtime.group_size
    return f"rank {first}" if g == 1 else f"ranks {first}-{first + g - 1}, leader {first}"


def speeds(cfg: Config, world_size: int) -> list[float] | None:
    """Each worker's slowdown factor from --speeds (worker w's at w − 1), or None."""
    text = cfg.runtime.speeds
    if text is None:
        return None
    if cfg.runtime.straggler is not None:
        raise UsageError("--speeds sets every worker's factor: --straggler would be a second "
                         "one (give its factor in --speeds)")
    try:
        factors = [float(x) for x in text.split(",")]
    except ValueError:
        raise UsageError(f"--speeds wants numbers F1,F2,..., got {text!r}") from None
    n = n_workers(cfg, world_size)
    if len(factors) != n:
        raise UsageError(f"--speeds gives {len(factors)} factors for the run's {n} workers: "
                         "one per worker")
    for w, factor in enumerate(factors, 1):
        if not 1 <= factor <= STRAGGLER_MAX:
            raise UsageError(f"--speeds: worker {w}'s factor must be in [1, "
                             f"{STRAGGLER_MAX:g}] (a slowdown), got {factor}")
    return factors


def straggler(cfg: Config, world_size: int) -> tuple[int, float] | None:
    """(worker number 1..n, factor) of --straggler WORKER:FACTOR, or None."""
    text = cfg.runtime.straggler
    if text is None:
        return None
    try:
        rank_text, factor_text = text.split(":")
        rank, factor = int(rank_text), float(factor_text)
    except ValueError:
        raise UsageError(f"--straggler wants WORKER:FACTOR, e.g. 2:5, got {text!r}") from None
    n = n_workers(cfg, world_size)
    if not 1 <= rank <= n:
        raise UsageError(f"--straggler worker must be in 1..{n}, got {rank}")
    if not 1 <= factor <= STRAGGLER_MAX:
        raise UsageError(f"--straggler factor must be in [1, {STRAGGLER_MAX:g}], got {factor}")
    return rank, factor
