"""Every check that can be made before a run starts, on rank 0, without MPI.

The options' own rules (ranges, choices) are declared with them in :mod:`gem_mpi.config`;
what needs the disk, the node's memory, the dataset or the user's code is checked here, so
that config stays a declaration below everything that reads it. Each failure is a
:class:`~gem_mpi.errors.UsageError` with one readable line (rank 0 prints it, every rank
exits 2), raised before anything is written.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
import os
import re
from typing import Any

from gem_mpi import methods, optimizers
from gem_mpi.algorithm.rule import global_decay
from gem_mpi.config import (
    AMP_OFF,
    COSINE,
    DATASETS,
    DILOCO,
    GPT,
    HOLDOUT_DATASETS,
    LOSS_CONTINUE,
    MODELS,
    NICE_AUTO,
    PROXY_GLOBAL,
    PROXY_LOCAL,
    QUADRATIC,
    SECTIONS,
    SHIFT_OTHERS,
    SHIFT_PAPER,
    STEP,
    TEXT,
    WAIT,
    WIRE_F32,
    Config,
    DataConfig,
    OutputConfig,
    flag_of,
    is_plugin,
    n_workers,
    speeds,
    step_range,
    straggler,
    synchronous,
)
from gem_mpi.errors import UsageError
from gem_mpi.methods import RULE_DN, RULE_GAP, RULE_GEM
from gem_mpi.outputs import checkpoint
from gem_mpi.outputs.scalars import require
from gem_mpi.problem import is_safetensors
from gem_mpi.problem.loss import Loss, make_loss
from gem_mpi.problem.user import SPLITS, why
from gem_mpi.problem.user import build_model as build_users_model
from gem_mpi.run.rank import worker_data


def _writable_target(path: str, what: str) -> None:
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise UsageError(f"{what} {path!r}: directory {parent!r} does not exist")
    if not os.access(parent, os.W_OK):
        raise UsageError(f"{what} {path!r}: directory {parent!r} is not writable")


def _check_fields(cfg: Config) -> None:
    for name in SECTIONS:
        section = getattr(cfg, name)
        for f in dataclasses.fields(section):
            check = f.metadata["check"]
            value = getattr(section, f.name)
            # a failed comparison also catches NaN; an infinite value is never meant
            if check and not (check[0](value) and not _infinite(value)):
                raise UsageError(f"{flag_of(f)} must be {check[1]}, got {value}")


def _infinite(value: Any) -> bool:
    return isinstance(value, float) and math.isinf(value)


def _check_loss_tolerance(cfg: Config, sync: bool) -> None:
    """--worker-loss continue: where rank 0 can go on after a worker died (the probe's
    finding, docs/RELIABILITY.md), for the engine that handles it."""
    if sync or cfg.runtime.masters > 1 or cfg.runtime.group_size > 1:
        raise UsageError("--worker-loss continue: an asynchronous method with one master and "
                         "no --group-size only")
    if os.environ.get("OMPI_MCA_mpi_ft_enable") != "1":
        raise UsageError("--worker-loss continue needs Open MPI 5 launched with mpirun "
                         "--with-ft ulfm (no other stack lets rank 0 go on after a worker "
                         "died: docs/RELIABILITY.md); elsewhere use python -m gem_mpi.launch")


def validate(cfg: Config, world_size: int, data: bool = True) -> None:
    """Every check that can be made before the run starts, without MPI; raises UsageError
    with one readable line. With ``data`` (rank 0 of a run) it also checks the dataset:
    that it is there and intact, and that each worker's share holds a batch."""
    method, model, dataset = cfg.method, cfg.data.model, cfg.data.dataset
    record = methods.of(method)  # an unknown --method is one line
    sync = record.synchronous
    if world_size < 2 and not sync:
        raise UsageError(
            f"needs at least 2 MPI ranks (1 master + workers), got {world_size}: "
            "launch with e.g. mpirun -n 5 python -m gem_mpi.train"
        )
    if cfg.runtime.worker_loss == LOSS_CONTINUE:
        _check_loss_tolerance(cfg, sync)
    if model not in MODELS and not is_plugin(model):
        raise UsageError(f"unknown --model {model!r}; choose from {', '.join(MODELS)}, or "
                         "give your own as MODULE:FUNCTION")
    if dataset not in DATASETS and not is_plugin(dataset):
        raise UsageError(f"unknown --dataset {dataset!r}; choose from {', '.join(DATASETS)}, "
                         "or give your own as MODULE:FUNCTION")
    if model == QUADRATIC and dataset != "synthetic":
        raise UsageError("--model quadratic uses no data: pass --dataset synthetic")
    if cfg.data.holdout and dataset not in HOLDOUT_DATASETS:
        raise UsageError(f"--holdout holds part of a training set out "
                         f"({', '.join(HOLDOUT_DATASETS)}), not of {dataset!r}")
    if model == QUADRATIC and cfg.data.loss:
        raise UsageError("--model quadratic has its own objective: --loss does not apply")
    if is_plugin(dataset) and not is_plugin(model):
        raise UsageError(f"--dataset {dataset!r} is a dataset of your own and --model {model} "
                         "is built for the built-in datasets; give a model of your own too "
                         "(--model MODULE:FUNCTION)")
    methods.check_own_options(cfg)  # another method's option would be ignored: refused
    if record.rule == RULE_DN:
        _check_dn(cfg)
    if record.rule == RULE_GAP and cfg.optim.gem_shift != SHIFT_OTHERS:
        raise UsageError(f"--gem-shift {cfg.optim.gem_shift} is GEM's: --method gap-aware "
                         "measures its gap against the θ each update was computed at")
    masters = cfg.runtime.masters
    if sync and masters != 1:
        raise UsageError(f"--masters {masters} is for the asynchronous methods: --method "
                         f"{method} has no master (every rank is a worker)")
    if not sync and masters >= 1 and world_size <= masters:
        raise UsageError(f"--masters {masters} needs at least {masters + 1} MPI ranks (the "
                         f"masters and a worker), got {world_size}: launch with e.g. mpirun "
                         f"-n {masters + 4} python -m gem_mpi.train")
    _check_groups(cfg, world_size)
    if sync and cfg.optim.worker_mode != WAIT:
        raise UsageError(f"--worker-mode is for the asynchronous methods: --method {method} "
                         "has no master to pipeline against (every step waits for every "
                         "worker)")
    if sync and cfg.runtime.worker_nice not in (NICE_AUTO, "0"):
        raise UsageError(f"--worker-nice {cfg.runtime.worker_nice} is for the asynchronous "
                         f"methods: --method {method} has no master to make room for (every "
                         "rank is a worker)")
    if sync and cfg.optim.wire != WIRE_F32:
        raise UsageError(f"--wire {cfg.optim.wire} is for the asynchronous methods: --method "
                         f"{method} averages gradients and sends no update to a master")
    if sync and model == QUADRATIC:
        raise UsageError(f"--method {method} trains torch models: --model quadratic is for "
                         "the asynchronous methods only")
    _check_fields(cfg)
    _check_text(cfg.data)
    _check_local_steps(cfg)
    optimizers.check(cfg)  # the other optimizer's option would be ignored too: refused
    _check_step_options(cfg)
    if record.rule == RULE_GEM and cfg.optim.gem_proxy == PROXY_GLOBAL:
        _check_global_decay(cfg.optim.momentum, n_workers(cfg, world_size))
    out = cfg.outputs
    if out.metrics:
        _writable_target(out.metrics, "--metrics")
        if os.path.isdir(out.metrics):
            raise UsageError(f"--metrics {out.metrics!r} is a directory")
    if out.save:
        _writable_target(out.save, "--save")
        if os.path.isdir(out.save):
            raise UsageError(f"--save {out.save!r} is a directory; name the file to write")
        if is_safetensors(out.save):
            require("safetensors", f"--save {out.save}", "safetensors")
    if out.tensorboard:
        _writable_target(out.tensorboard, "--tensorboard")
        require("torch.utils.tensorboard", "--tensorboard", "tensorboard")
    if out.wandb:
        require("wandb", "--wandb", "wandb")
    straggler(cfg, world_size)
    speeds(cfg, world_size)
    if out.checkpoint_dir:
        if os.path.exists(out.checkpoint_dir) and not os.path.isdir(out.checkpoint_dir):
            raise UsageError(f"--checkpoint-dir {out.checkpoint_dir!r} is not a directory")
        if not os.path.isdir(out.checkpoint_dir):
            raise UsageError(f"--checkpoint-dir {out.checkpoint_dir!r} does not exist")
        if not os.access(out.checkpoint_dir, os.W_OK):
            raise UsageError(f"--checkpoint-dir {out.checkpoint_dir!r} is not writable")
    if out.resume and out.resume != "auto" and not os.path.isfile(out.resume):
        raise UsageError(f"--resume {out.resume!r}: no such file")
    if out.resume == "auto" and not out.checkpoint_dir:
        raise UsageError("--resume auto needs --checkpoint-dir")
    _check_paths_apart(out)
    _check_profile(cfg)
    _check_threads(cfg.runtime.threads)
    _check_loader_workers(cfg.data)
    if model == QUADRATIC:
        _check_quadratic_memory(cfg, world_size)
        d = cfg.data
        _check_schedule(cfg, d.max_steps or d.epochs * max(1, d.synthetic_size
                                                                  // d.batch_size))
    if model != QUADRATIC:
        loss = make_loss(cfg.data.loss, model)  # a name it knows, or a function it finds
        if data:
            _check_data(cfg, world_size)
            if is_plugin(model):  # the user's code: build it and try one batch
                check_user_code(cfg.data, loss, cfg.data.batch_size)


def _check_text(data: DataConfig) -> None:
    """The text dataset's and the language model's options with another dataset or model
    would be ignored: one line; and the model's heads must divide its width."""
    defaults = DataConfig()
    for name, used, owner in (("context", data.dataset == TEXT, "--dataset text"),
                              ("test_bytes", data.dataset == TEXT, "--dataset text"),
                              ("gpt_layers", data.model == GPT, "--model gpt"),
                              ("gpt_heads", data.model == GPT, "--model gpt"),
                              ("gpt_width", data.model == GPT, "--model gpt")):
        value = getattr(data, name)
        if not used and value != getattr(defaults, name):
            raise UsageError(f"--{name.replace('_', '-')} {value} is for {owner}: "
                             f"--model {data.model} --dataset {data.dataset} does not use it")
    if data.model == GPT and data.gpt_width % data.gpt_heads:
        raise UsageError(f"--gpt-heads {data.gpt_heads} must divide --gpt-width "
                         f"{data.gpt_width}")


def _check_dn(cfg: Config) -> None:
    """Delayed Nesterov: what its master half is built for."""
    o = cfg.optim
    if o.wire != WIRE_F32:
        raise UsageError(f"--wire {o.wire} with --method dn is not built: its master folds "
                         "each float32 update into its momentum (use --wire float32)")
    if cfg.runtime.masters > 1:
        raise UsageError(f"--masters {cfg.runtime.masters} with --method dn is not built: "
                         "its momentum's cycle is one master's clock")
    for flag, value, default in (("--gem-shift", o.gem_shift, SHIFT_OTHERS),
                                 ("--gem-proxy", o.gem_proxy, PROXY_LOCAL)):
        if value != default:
            raise UsageError(f"{flag} {value} is GEM's: --method dn does not use it")


def _check_local_steps(cfg: Config) -> None:
    """--local-steps (and --dylu, which varies it): the asynchronous methods' workers, alone,
    with the shift GEM's budget κ|Δ| is derived for."""
    h, o = cfg.optim.local_steps, cfg.optim
    if o.dylu and synchronous(cfg.method):
        raise UsageError(f"--dylu is for the asynchronous methods: --method {cfg.method} is "
                         "synchronous, every worker a step of each round")
    if o.dylu and h == 1:
        raise UsageError("--dylu sets each worker's local steps below --local-steps H: give "
                         "--local-steps H > 1 (the fastest worker's steps an update)")
    if h == 1:
        return
    if synchronous(cfg.method):
        own = " (its rounds are --diloco-steps)" if cfg.method == DILOCO else ""
        raise UsageError(f"--local-steps {h} is for the asynchronous methods: --method "
                         f"{cfg.method} is synchronous{own}")
    if cfg.runtime.group_size > 1:
        raise UsageError(f"--local-steps {h} with --group-size {cfg.runtime.group_size} is "
                         "not built: a group takes one step an update")
    if methods.of(cfg.method).rule == RULE_GEM and o.gem_proxy == PROXY_GLOBAL:
        raise UsageError("--gem-proxy global folds each update into a momentum-SGD proxy's m: "
                         "with --local-steps the proxy is the worker's own H steps (use "
                         "--gem-proxy local)")
    if methods.of(cfg.method).rule == RULE_GEM and o.gem_shift == SHIFT_PAPER:
        raise UsageError("--gem-shift paper counts the worker's own last update in the shift, "
                         "which is not derived for local steps: use --gem-shift others")


def _check_groups(cfg: Config, world_size: int) -> None:
    """--group-size: asynchronous methods and torch models, whole groups of the workers."""
    g = cfg.runtime.group_size
    if g == 1:
        return
    if synchronous(cfg.method):
        raise UsageError(f"--group-size {g} groups the workers of an asynchronous method: "
                         f"--method {cfg.method} is synchronous across all ranks already")
    if cfg.data.model == QUADRATIC:
        raise UsageError(f"--group-size {g} averages torch gradients: --model quadratic has "
                         "none")
    ranks = world_size - cfg.runtime.masters
    if ranks % g:
        raise UsageError(f"--group-size {g} must divide the {ranks} worker ranks (MPI ranks "
                         f"less --masters {cfg.runtime.masters}): launch e.g. "
                         f"{cfg.runtime.masters + g * max(1, ranks // g)} ranks")


def _check_global_decay(momentum: float, workers: int) -> None:
    """μ^(1/n) must stay below 1 in float32, or the global m would never decay."""
    mu_g, gain = global_decay(momentum, workers)
    if not (mu_g < 1 and gain > 0):
        raise UsageError(f"--gem-proxy global with --momentum {momentum} and {workers} "
                         f"workers: μ^(1/{workers}) rounds to {float(mu_g)!r} in float32, a "
                         "proxy that never decays; lower --momentum or use --gem-proxy local")


def _same_file(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def _checkpoint_names() -> tuple[str, ...]:
    """Glob patterns of the files the checkpoints own in --checkpoint-dir (the newest
    checkpoint is kept: the others matching are deleted)."""
    return tuple(re.sub(r"\{[^}]*\}", "*", name)
                 for name in (checkpoint.NAME, checkpoint.WORKER_MOMENTUM))


def _check_paths_apart(out: OutputConfig) -> None:
    """Two outputs in one file would overwrite (or delete) each other; one line instead."""
    if out.metrics and out.save and _same_file(out.metrics, out.save):
        raise UsageError(f"--metrics and --save are the same file {out.metrics!r}: the saved "
                         "model would overwrite the metrics")
    for flag, path in (("--metrics", out.metrics), ("--save", out.save)):
        if not path:
            continue
        if out.resume and out.resume != "auto" and _same_file(path, out.resume):
            raise UsageError(f"{flag} {path!r} is the --resume checkpoint: writing it would "
                             "destroy the checkpoint the run continues from")
        if out.checkpoint_dir and _same_file(os.path.dirname(os.path.abspath(path)),
                                             out.checkpoint_dir):
            name = os.path.basename(path)
            for pattern in _checkpoint_names():
                if fnmatch.fnmatchcase(name, pattern):
                    raise UsageError(f"{flag} {path!r} has the name of a checkpoint file "
                                     f"({pattern}) in --checkpoint-dir: the checkpoints "
                                     "would delete or overwrite it; choose another name")


def _check_profile(cfg: Config) -> None:
    """--profile-steps: a torch model, and a folder for the traces that can be made."""
    out = cfg.outputs
    if not out.profile_steps:
        if out.profile_dir:
            raise UsageError(f"--profile-dir {out.profile_dir!r} is for --profile-steps A:B: "
                             "no trace is asked for")
        return
    if cfg.data.model == QUADRATIC:
        raise UsageError(f"--profile-steps {out.profile_steps} traces torch's operators: "
                         "--model quadratic computes in numpy")
    folder = out.trace_dir
    if folder is None:
        raise UsageError(f"--profile-steps {out.profile_steps} needs a folder for its traces: "
                         "give --profile-dir DIR, or --metrics PATH (the traces then go to "
                         "PATH less its suffix, plus _profile)")
    flag = "--profile-dir" if out.profile_dir else "--profile-steps (beside --metrics)"
    if not os.path.exists(folder):
        _writable_target(folder, flag)
    elif not os.path.isdir(folder):
        raise UsageError(f"{flag} {folder!r} is not a directory")
    elif not os.access(folder, os.W_OK):
        raise UsageError(f"{flag} {folder!r} is not writable")


def _check_threads(threads: int) -> None:
    cores = os.cpu_count() or 1
    if threads > cores:
        raise UsageError(f"--threads {threads} is more than the {cores} cores of rank 0's "
                         "node (0: the node's cores divided by its ranks)")


def _check_loader_workers(data: DataConfig) -> None:
    """Loader processes beyond the node's cores only time-share them (each worker rank has
    its own); a model without data has none to load."""
    workers = data.loader_workers
    if workers and data.model == QUADRATIC:
        raise UsageError("--model quadratic uses no data: --loader-workers does not apply")
    cores = os.cpu_count() or 1
    if workers > cores:
        raise UsageError(f"--loader-workers {workers} is more than the {cores} cores of rank "
                         "0's node (each worker rank starts that many loader processes)")


def _node_memory() -> int | None:
    """Bytes of memory of this node (rank 0's), or None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _check_quadratic_memory(cfg: Config, world_size: int) -> None:
    """The master holds θ and one mailbox slot per worker (Δθ, κ|m| and s for GEM; Δθ and s
    with the global proxy, plus its one m)."""
    n, workers = cfg.data.quadratic_dim, n_workers(cfg, world_size)
    record = methods.of(cfg.method)
    master_state = record.master_state(cfg.optim) is not None  # the master's m, or its v
    per_slot = len(record.payload(cfg.optim)[0])
    # θ's window, θ₀, the problem's h and c, and numpy's float64 draws of them at the start
    need = 4 * n * (workers * per_slot + 4 + master_state) + 8 * n
    total = _node_memory()
    if total and need > total:
        raise UsageError(
            f"--quadratic-dim {n}: the master alone needs about {need / 2**30:.1f} GiB "
            f"(θ and {workers} workers' mailbox slots of {per_slot} float32 per parameter), "
            f"more than the {total / 2**30:.1f} GiB of rank 0's node"
        )


def _check_data(cfg: Config, world_size: int) -> None:
    """The data is there and each worker's share holds at least one batch (rank 0 reads the
    dataset's headers, or counts ImageFolder images up to what is needed)."""
    from gem_mpi.problem.datasets import check_dataset  # torch: not for the quadratic
    from gem_mpi.problem.spec import dataset_spec

    # a worker group's step takes G × --batch-size samples, an update of H local steps H ×
    g, h = cfg.runtime.group_size, cfg.optim.local_steps
    d = worker_data(cfg)
    batch = (f"--batch-size {cfg.data.batch_size}" + (f" × --group-size {g}" if g > 1 else "")
             + (f" × --local-steps {h}" if h > 1 else ""))
    if not is_plugin(d.dataset):
        dataset_spec(d.dataset, d.model, d.context)  # combinations that cannot work
    shards = n_workers(cfg, world_size) if d.shard else 1
    need = d.batch_size * shards
    if d.dataset == "synthetic":
        n, what = d.synthetic_size, "--dataset synthetic (--synthetic-size)"
        # each epoch a worker draws its shard's order: arange, randperm and the gather, int64
        need, total = 24 * (n // shards), _node_memory()
        if total and need > total:
            raise UsageError(
                f"--synthetic-size {n}: each worker would hold its epoch's sample order, "
                f"about {need / 2**30:.1f} GiB, more than the {total / 2**30:.1f} GiB of "
                "rank 0's node"
            )
    else:
        n, what = check_dataset(d.dataset, d.data_dir, at_least=need,
                                context=d.context), d.dataset
    if d.holdout and d.dataset == TEXT:  # whole files held apart, the first N bytes evaluated
        from gem_mpi.problem.datasets import evaluation_split, training_split

        if not len(evaluation_split(d)):
            raise UsageError(f"--holdout {d.holdout}: the validation files of --dataset text "
                             f"hold fewer than --context {d.context} + 1 bytes to evaluate on")
        n, what = len(training_split(d)), "text less its validation files (--holdout)"
    elif d.holdout:  # the dataset is one of HOLDOUT_DATASETS (checked above)
        if d.holdout >= n:
            raise UsageError(f"--holdout {d.holdout} leaves none of the {n} training samples "
                             f"of {what} to train on")
        n, what = n - d.holdout, f"{what} less --holdout {d.holdout}"
    if n // shards >= d.batch_size:
        steps = n // shards // d.batch_size * d.epochs
        _check_schedule(cfg, min(steps, d.max_steps) if d.max_steps else steps)
        return
    if shards > 1:
        raise UsageError(f"{batch} exceeds the {n // shards} training "
                         f"samples of each worker's shard (--shard: {n} samples of {what} "
                         f"over {shards} workers); use a smaller batch or fewer workers")
    raise UsageError(f"{batch} exceeds the {n} training samples of "
                     f"{what}; use a smaller batch")


def check_user_code(data: DataConfig, loss: Loss, batch_size: int) -> None:
    """Rank 0, before any work, when the model or the dataset is the user's: build the
    model, and run one forward pass and the loss on a small batch of each split."""
    # torch and the modules that import it, here: a quadratic run never loads them
    import torch

    from gem_mpi.problem.batches import iterate_batches
    from gem_mpi.problem.datasets import load_split
    from gem_mpi.problem.models import build_model as build_builtin
    from gem_mpi.problem.spec import dataset_spec

    if is_plugin(data.model):
        model = build_users_model(data.model)
    else:
        model = build_builtin(data.model, dataset_spec(data.dataset, data.model))
    for split_name in SPLITS:
        split = load_split(data.dataset, data.data_dir, split_name, data.model,
                           synthetic_size=min(data.synthetic_size, 4), context=data.context,
                           test_bytes=data.test_bytes)
        n = min(len(split), batch_size, 4)
        try:
            x, y = next(iterate_batches(split, n, 1, 0, shuffle=False))
        except UsageError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise UsageError(f"--dataset {data.dataset!r}: its {split_name!r} samples cannot "
                             f"be batched ({why(exc)}): inputs and targets must be tensors "
                             "(or numbers) of one shape") from None
        if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
            raise UsageError(f"--dataset {data.dataset!r}: a batch of {split_name!r} is "
                             f"({type(x).__name__}, {type(y).__name__}), not (tensor, tensor)")
        with torch.no_grad():
            try:
                out = model(x)
            except Exception as exc:  # noqa: BLE001
                raise UsageError(f"--model {data.model!r} cannot take a batch of --dataset "
                                 f"{data.dataset!r} (inputs {tuple(x.shape)} {x.dtype}): "
                                 f"{why(exc)}") from None
            try:
                value = loss.mean(out, y)
            except Exception as exc:  # noqa: BLE001
                raise UsageError(f"--loss {loss.name} cannot take the model's output "
                                 f"{tuple(out.shape)} {out.dtype} with the targets "
                                 f"{tuple(y.shape)} {y.dtype} of --dataset {data.dataset!r}: "
                                 f"{why(exc)}") from None
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            got = (f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor)
                   else f"a {type(value).__name__}")
            raise UsageError(f"--loss {loss.name} returned {got}, not a scalar tensor")
        if not math.isfinite(float(value)):
            raise UsageError(f"--loss {loss.name} is {float(value)} on the first samples of "
                             f"{split_name!r} at θ₀")


def _check_step_options(cfg: Config) -> None:
    """The schedule's, clipping's and precision's options that cannot work together."""
    o = cfg.optim
    if o.lr_schedule == STEP and not o.lr_step_every:
        raise UsageError("--lr-schedule step needs --lr-step-every N: every how many steps η "
                         "is multiplied by --lr-gamma")
    if o.lr_schedule != STEP and o.lr_step_every:
        raise UsageError(f"--lr-step-every is for --lr-schedule step, not {o.lr_schedule}")
    if o.lr_schedule != COSINE and (o.lr_decay_steps or o.lr_min):
        flag = "--lr-decay-steps" if o.lr_decay_steps else "--lr-min"
        raise UsageError(f"{flag} is for --lr-schedule cosine, not {o.lr_schedule}")
    if o.lr_schedule == COSINE and o.lr_min >= o.lr:
        raise UsageError(f"--lr-min {o.lr_min:g} must be below --lr {o.lr:g}: the cosine "
                         "falls from --lr to --lr-min")
    if cfg.data.model == QUADRATIC and o.amp != AMP_OFF:
        raise UsageError(f"--amp {o.amp} is for torch models: --model quadratic computes in "
                         "float32 numpy")


def _check_schedule(cfg: Config, steps: int) -> None:
    """A warm-up, a cosine, a DiLoCo round or a --profile-steps range that does not fit in a
    worker's ``steps`` steps would end before the run does, or never finish: one line
    instead."""
    optim, h = cfg.optim, cfg.diloco.diloco_steps
    if optim.warmup_steps and optim.warmup_steps >= steps:
        raise UsageError(f"--warmup-steps {optim.warmup_steps} is as long as the run or longer: "
                         f"each worker takes {steps} steps")
    if optim.method == DILOCO and h > steps:
        raise UsageError(f"--diloco-steps {h} is longer than the run: each "
                         f"worker takes {steps} steps, so no outer step would be taken")
    decay = optim.lr_decay_steps
    if optim.lr_schedule == COSINE and decay and decay <= optim.warmup_steps:
        raise UsageError(f"--lr-decay-steps {decay} must be longer than --warmup-steps "
                         f"{optim.warmup_steps}: the cosine follows the warm-up")
    if optim.lr_schedule == COSINE and decay and decay < steps:
        raise UsageError(f"--lr-decay-steps {decay} ends the schedule before the run: each "
                         f"worker takes {steps} steps (0: the cosine spans them)")
    traced = step_range(cfg.outputs.profile_steps) if cfg.outputs.profile_steps else None
    taken = steps - steps % h if optim.method == DILOCO else steps  # whole rounds
    if traced is not None and traced[1] >= taken:
        raise UsageError(f"--profile-steps {cfg.outputs.profile_steps} ends after the run: "
                         f"each worker takes {taken} steps, 0 to {taken - 1}")
