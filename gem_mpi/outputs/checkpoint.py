"""Checkpoints of the master's state, so a stopped or crashed job loses minutes, not hours.

A checkpoint is one :class:`Checkpoint`, written as an HDF5 file (no pickle): the central
parameters θ, the master clock and ticket counter, each worker's next update number (its
place in its data budget), how many rows the metrics file held, the seconds already trained,
and the run's configuration. The run's stateful parts (the engine, the metrics file, the
supervisor) each give their own fields when one is saved and read their own on a resume; a
sharded run's checkpoint is every shard's state joined (:class:`gem_mpi.protocol.ShardState`)
and is sliced again per shard (:meth:`Checkpoint.shard`).
No RNG state needs storing: every random draw (θ₀, each worker's shuffles, dropout masks)
is a function of (--seed, worker, epoch or step), so a resumed worker draws what the
uninterrupted one would have.
It is written to a temporary file, flushed and fsync'ed, then renamed over; the previous
checkpoint is deleted only after that, so a valid one exists at every moment. Each array
carries its sha256, checked on load: a flipped bit is refused like a truncated file.

A run has an id, drawn at its first start (or named, --run-id) and kept by every checkpoint
and by its metrics file: a resume continues (and cuts back) only the metrics file of its own
run, --resume auto only its own run's checkpoints, and a run deletes only its own old ones.
Which settings may change on a resume is decided here (:data:`MAY_CHANGE`); the metrics file
records every change with the update it took effect at.

--method sync also stores the optimizer's momentum buffer (one flat array like θ), so its
resume continues exactly; under --optimizer adamw ``momentum`` holds AdamW's first moment,
``adam_v`` its second and ``adam_t`` each parameter tensor's step count. A GEM worker's momentum m (any worker's AdamW m, v and t under
--optimizer adamw) lives on the worker: when a run is stopped (SIGUSR1/SIGTERM), each such
worker writes its own file beside the checkpoint (``momentum_w<rank>.h5``, atomically: its
state and those before its last steps), and a resume restores the one holding exactly the
updates the checkpoint counts for that worker. After a crash, the periodic checkpoint has
no such files and m restarts at 0; the updates applied after the checkpoint are done again.
With the global proxy (``--gem-proxy global``) m is the master's: every checkpoint holds it
(``proxy_m``), so a resume continues it exactly after a stop and after a crash alike; so
does Gap-Aware's average of the squared steps v (``--method gap-aware``), in the same field.
--method diloco stores the outer Nesterov buffer as ``momentum`` and, in a checkpoint written
where every worker agreed to end (a stop, the end), each worker's inner momentum
(``inner_m``; AdamW's also ``inner_v``, ``inner_t``); a periodic checkpoint has none, and
inner states restart at 0 from it.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any

import h5py
import numpy as np

from gem_mpi.config import (
    DILOCO,
    OPT_ADAMW,
    AdamWConfig,
    DataConfig,
    DilocoConfig,
    DnConfig,
    GapAwareConfig,
    OptimConfig,
    synchronous,
)
from gem_mpi.errors import OutputError, UsageError
from gem_mpi.outputs.files import atomic_write, os_reason

# 3: a synchronous run stores no tickets or next_seq (it has none). Fields added since are
# optional arrays that an older reader never needs (the AdamW ones: it refuses synchronous
# AdamW), and an older file lacks only those its run could not have had
FORMAT = 3
NAME = "checkpoint_{clock:012d}.h5"
_PATTERN = re.compile(r"checkpoint_(\d{12})\.h5$")
# Settings a resume may change: η (a new learning rate after a stop is a common wish; each
# worker's Δθ simply uses the new one), where the data lives and how many processes make
# the batches (the same batches either way). Every other option of the
# update rule and of the data must match, since the state in the checkpoint (θ, each
# worker's m and place in its data) was made by them; monitoring, outputs and runtime
# options change nothing that is computed and may differ freely.
MAY_CHANGE = ("lr", "data_dir", "loader_workers")
# the sections of the update rule (each method's own included) and of the data
_COMPUTED = [f for sec in (OptimConfig, AdamWConfig, GapAwareConfig, DilocoConfig, DnConfig,
                            DataConfig)
             for f in dataclasses.fields(sec)]
MUST_MATCH = tuple(f.name for f in _COMPUTED if f.name not in MAY_CHANGE)
RECORDED = tuple(f.name for f in _COMPUTED)


@dataclass
class Checkpoint:
    """Everything a resume continues from. The engine, the metrics file and the supervisor
    each give their own fields when one is saved (:class:`gem_mpi.run.supervisor.Checkpointer`)
    and read their own when the run resumes; what a method does not have stays None (a
    synchronous run has no tickets or next_seq, an asynchronous one no momentum buffer)."""

    theta: np.ndarray
    clock: int  # updates applied (synchronous: steps done)
    run_id: str
    elapsed_s: float  # seconds already trained
    config: dict  # the run's settings (Config.as_dict())
    n_workers: int
    rows_updates: int = 0  # rows of each metrics table on disk at the checkpoint
    rows_eval: int = 0
    rows_rejected: int = 0
    rows_shards: np.ndarray | None = None  # --masters K > 1: rows of the shard<k> tables
    tickets: int | None = None  # tickets drawn (asynchronous)
    next_seq: np.ndarray | None = None  # each worker's next update number (asynchronous)
    kept_s: np.ndarray | None = None
    proxy_m: np.ndarray | None = None  # the master's per-element state: m, or Gap-Aware's v
    momentum: np.ndarray | None = None  # synchronous: the optimizer's momentum buffer
    # synchronous --optimizer adamw (momentum: its first moment): its second moment, flat
    # like θ, and the step count of each parameter tensor
    adam_v: np.ndarray | None = None
    adam_t: np.ndarray | None = None
    # --method diloco: each worker's inner momentum (n × P rows, worker 1 first), kept where
    # every worker agreed to end the run (momentum then holds the outer Nesterov buffer);
    # under AdamW the inner one's three, as adam_v and adam_t's
    inner_m: np.ndarray | None = None
    inner_v: np.ndarray | None = None
    inner_t: np.ndarray | None = None
    shard_clock: np.ndarray | None = None  # --masters K > 1: each shard's clock and tickets
    shard_tickets: np.ndarray | None = None
    # once the worker count changed: each worker's dealt batches (gem_mpi.problem.elastic)
    data_plan: np.ndarray | None = None
    finished: int = 0  # 1: written at the end of a finished run, which a resume cannot extend
    path: str = ""  # where it was loaded from (not stored)
    changes: dict[str, list] = field(default_factory=dict)  # what this resume changes

    @property
    def rows(self) -> tuple[int, int, int]:
        return self.rows_updates, self.rows_eval, self.rows_rejected

    def shard(self, k: int, bounds: tuple[int, int]) -> Checkpoint:
        """Master ``k``'s part of a sharded run's checkpoint: θ, s and m sliced to its
        elements ``bounds``, its own clock and tickets; the rest as it is."""
        lo, hi = bounds
        assert self.shard_clock is not None and self.shard_tickets is not None, "not sharded"
        return dataclasses.replace(
            self, theta=self.theta[lo:hi].copy(), clock=int(self.shard_clock[k]),
            tickets=int(self.shard_tickets[k]),
            kept_s=None if self.kept_s is None else self.kept_s[:, lo:hi].copy(),
            proxy_m=None if self.proxy_m is None else self.proxy_m[lo:hi].copy(),
            shard_clock=None, shard_tickets=None)


ARRAYS = ("theta", "next_seq", "momentum", "kept_s", "proxy_m", "shard_clock", "shard_tickets",
          "rows_shards", "inner_m", "data_plan", "adam_v", "adam_t", "inner_v", "inner_t")
_INTS = ("clock", "rows_updates", "rows_eval", "rows_rejected", "n_workers")


def _sha256(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).view(np.uint8).reshape(-1).data).hexdigest()


def _write(tmp: str, ckpt: Checkpoint) -> None:
    with h5py.File(tmp, "w") as f:
        f.attrs["gem_mpi_checkpoint"] = FORMAT
        f.attrs["run_id"] = ckpt.run_id
        for name in ARRAYS:
            value = getattr(ckpt, name)
            if value is not None:
                if name == "next_seq":
                    value = np.asarray(value, dtype=np.int64)
                f.create_dataset(name, data=value).attrs["sha256"] = _sha256(value)
        for key in _INTS:
            f.attrs[key] = int(getattr(ckpt, key))
        if ckpt.tickets is not None:
            f.attrs["tickets"] = int(ckpt.tickets)
        f.attrs["elapsed_s"] = float(ckpt.elapsed_s)
        f.attrs["finished"] = int(ckpt.finished)
        f.attrs["config"] = json.dumps(ckpt.config, sort_keys=True)


def save(directory: str, ckpt: Checkpoint, keep: int = 1) -> str:
    """Write a checkpoint atomically and keep it and the ``keep`` − 1 newest before it;
    returns its path. One of a later clock is from a future this run abandoned (it resumed
    from an earlier one), and is dropped, so that ``--resume auto`` never goes back to it."""
    final = os.path.join(directory, NAME.format(clock=int(ckpt.clock)))
    try:
        atomic_write(final, lambda tmp: _write(tmp, ckpt))
    except (OSError, RuntimeError) as exc:  # disk full, quota, I/O: the previous one stays
        before = latest(directory)
        kept = f"the previous one, {before}, is kept" if before else "there is no earlier one"
        raise OutputError(f"checkpoint {final!r}: writing failed ({os_reason(exc)}); "
                          f"{kept}") from None
    found = [(clock, p) for clock, p in listed(directory) if run_of(p) == ckpt.run_id]
    found.reverse()
    newest = [p for clock, p in found if clock <= ckpt.clock][:keep]
    for _, old in found:  # another run's checkpoints are never this run's to delete
        if old not in newest:
            os.remove(old)
    return final


WORKER_MOMENTUM = "momentum_w{rank:05d}.h5"


def save_worker_state(directory: str, rank: int, folded: int,
                      states: list[dict[str, np.ndarray]], run_id: str) -> None:
    """A stopping worker's own optimizer state (GEM's m; AdamW's m, v and t) holding its
    first ``folded`` updates, then the states before its last, its last two, ... updates
    (``states``, newest first: a worker may have taken steps the master never applied), as
    HDF5 groups ``0``, ``1``, ...; atomically, like a checkpoint. A failure is reported, not
    raised: the master's checkpoint is what matters, and the state would merely restart
    at 0."""
    def write(tmp: str) -> None:
        with h5py.File(tmp, "w") as f:
            f.attrs["folded"] = int(folded)
            f.attrs["run_id"] = run_id
            for back, arrays in enumerate(states):
                group = f.create_group(str(back))
                for name, value in arrays.items():
                    value = np.asarray(value)
                    group.create_dataset(name, data=value).attrs["sha256"] = _sha256(value)

    try:
        atomic_write(os.path.join(directory, WORKER_MOMENTUM.format(rank=rank)), write)
    except (OSError, RuntimeError) as exc:
        print(f"gem_mpi: worker {rank}: could not save its optimizer state ({os_reason(exc)}); "
              "a resume restarts it at 0", file=sys.stderr, flush=True)


def load_worker_state(directory: str, rank: int, start_seq: int,
                      run_id: str) -> dict[str, np.ndarray] | None:
    """The saved state of this run holding exactly this worker's first ``start_seq``
    updates, intact, or None (it then restarts at 0; the start-up line counts the workers
    that got it)."""
    path = os.path.join(directory, WORKER_MOMENTUM.format(rank=rank))
    try:
        with h5py.File(path, "r") as f:
            if str(f.attrs["run_id"]) != run_id:
                return None
            back = str(int(f.attrs["folded"]) - start_seq)
            if back not in f:
                return None
            out = {}
            for name, dataset in f[back].items():
                value = np.asarray(dataset[()])
                if _sha256(value) != dataset.attrs["sha256"]:
                    return None
                out[name] = value
            return out
    except (OSError, KeyError, ValueError):
        return None


def listed(directory: str) -> list[tuple[int, str]]:
    """The complete checkpoints in a directory as (clock, path), oldest first (temporary
    files never count)."""
    return sorted((int(m.group(1)), p) for p in glob.glob(os.path.join(
        directory, "checkpoint_*.h5")) if (m := _PATTERN.search(p)))


def run_of(path: str) -> str | None:
    """The id of the run that wrote a checkpoint; None if it cannot be read."""
    try:
        with h5py.File(path, "r") as f:
            return str(f.attrs["run_id"])
    except (OSError, KeyError):
        return None


def latest(directory: str, run_id: str | None = None) -> str | None:
    """The newest complete checkpoint in a directory, of the run ``run_id`` if given."""
    found = [p for _, p in listed(directory) if run_id is None or run_of(p) == run_id]
    return found[-1] if found else None


def load(path: str) -> Checkpoint:
    """The checkpoint at ``path``; UsageError if it is not a readable one of this format, or
    if an array does not match its checksum."""
    try:
        with h5py.File(path, "r") as f:
            version = f.attrs.get("gem_mpi_checkpoint")
            if version is None:
                raise UsageError(f"--resume {path!r} is not a gem_mpi checkpoint")
            if version != FORMAT:
                raise UsageError(f"--resume {path!r}: checkpoint format {version}, this "
                                 f"gem_mpi reads format {FORMAT} (written by another version: "
                                 "resume with that one, or start afresh)")
            fields: dict[str, Any] = {k: int(f.attrs[k]) for k in _INTS}
            fields["tickets"] = int(f.attrs["tickets"]) if "tickets" in f.attrs else None
            fields["finished"] = int(f.attrs.get("finished", 0))
            fields["elapsed_s"] = float(f.attrs["elapsed_s"])
            fields["config"] = json.loads(f.attrs["config"])
            fields["run_id"] = str(f.attrs["run_id"])
            for name in ARRAYS:
                fields[name] = f[name][()] if name in f else None
                if name in f and _sha256(fields[name]) != f[name].attrs["sha256"]:
                    raise UsageError(f"--resume {path!r}: {name} does not match its checksum "
                                     "(the file is damaged); resume from an older checkpoint "
                                     "or start afresh")
    except (OSError, KeyError, ValueError) as exc:
        raise UsageError(f"--resume {path!r}: not a readable checkpoint ({exc})") from None
    theta = fields["theta"]
    if theta is None or theta.dtype != np.float32 or theta.ndim != 1:
        what = "no θ" if theta is None else f"θ of dtype {theta.dtype}, shape {theta.shape}"
        raise UsageError(f"--resume {path!r}: {what}")
    return Checkpoint(**fields, path=path)


# Each setting's default: a checkpoint written before an option existed ran with it
DEFAULTS = {f.name: f.default for f in _COMPUTED}


def _setting(config: dict, key: str) -> object:
    """A recorded setting; its default when the record predates the option."""
    return config.get(key, DEFAULTS.get(key))


def check_compatible(ckpt: Checkpoint, config: dict, n_workers: int) -> None:
    """A checkpoint of another setting or size of job cannot be continued: say which."""
    path = ckpt.path
    if ckpt.n_workers != n_workers and synchronous(config.get("method", "")):
        raise UsageError(f"--resume {path!r} was written by a run of {ckpt.n_workers} "
                         f"workers, this one has {n_workers} (--method "
                         f"{config.get('method')} resumes on as many workers; the "
                         "asynchronous methods on any number)")
    # each shard's clock and tickets are its own: the cut must stay the same; a group's
    # batch (G × --batch-size) is what its data plan counts in
    for key in ("masters", "group_size"):
        was, now = ckpt.config.get(key, 1), config.get(key, 1)
        if was != now:
            flag = "--" + key.replace("_", "-")
            raise UsageError(f"--resume {path!r} was written by a run of {flag} {was}, this "
                             f"one has {flag} {now}; resume with {flag} {was}")
    for key in MUST_MATCH:
        if _setting(ckpt.config, key) != config.get(key):
            raise UsageError(f"--resume {path!r}: --{key.replace('_', '-')} was "
                             f"{_setting(ckpt.config, key)!r}, now {config.get(key)!r}; a resume "
                             f"may change only {', '.join('--' + k.replace('_', '-') for k in MAY_CHANGE)} "
                             "of the update rule and the data")
    _check_optimizer_state(ckpt, config)


def _check_optimizer_state(ckpt: Checkpoint, config: dict) -> None:
    """A synchronous run continues its optimizer's state exactly: a checkpoint of its
    settings without that state (damaged, or made by hand) is refused, not resumed at 0."""
    method, optimizer = config.get("method", ""), config.get("optimizer")
    if not synchronous(method):
        return
    adamw = optimizer == OPT_ADAMW
    need = ["momentum"] + (["adam_v", "adam_t"] if adamw and method != DILOCO else [])
    if adamw and ckpt.inner_m is not None:
        need += ["inner_v", "inner_t"]
    missing = [name for name in need if getattr(ckpt, name) is None]
    if missing:
        raise UsageError(f"--resume {ckpt.path!r} holds no {', '.join(missing)}, the optimizer "
                         f"state a --method {method} --optimizer {optimizer} run continues "
                         "from; resume from another checkpoint or start afresh")


def resize(ckpt: Checkpoint, next_seq: np.ndarray, data_plan: np.ndarray) -> Checkpoint:
    """The checkpoint of n workers continued by m = ``len(next_seq)``: each worker's next
    update number and its dealt batches (gem_mpi.problem.elastic); the s the master keeps
    per worker (--gem-shift paper) carried for the continuing workers, zero for a new one
    (it sends its s with its first update). The rest (θ, the clock, tickets, the master's m
    or v, the rows) is the run's, whatever its workers."""
    m, keep = len(next_seq), min(len(next_seq), ckpt.n_workers)
    kept, before = None, ckpt.kept_s
    if before is not None:
        kept = np.zeros((m, before.shape[1]), before.dtype)
        kept[:keep] = before[:keep]
    return dataclasses.replace(ckpt, n_workers=m, next_seq=np.asarray(next_seq, np.int64),
                               kept_s=kept, data_plan=np.asarray(data_plan, np.int64))


def changes(ckpt: Checkpoint, config: dict) -> dict[str, list]:
    """The settings of the update rule and the data that this resume changes: name ->
    [before, now] (only :data:`MAY_CHANGE` can be there once check_compatible passed)."""
    before = ckpt.config
    return {k: [_setting(before, k), config.get(k)] for k in RECORDED
            if _setting(before, k) != config.get(k)}


def resolve(resume: str | None, directory: str | None, run_id: str | None) -> str | None:
    """The checkpoint a run continues: the file --resume names, or under 'auto' the newest
    in the checkpoint directory of the run it continues (``run_id``, --run-id; without it
    the one run whose checkpoints are there); None when there is none (a requeued job's
    first start, or no --resume). A directory of several runs without --run-id, a file of
    another run than --run-id and a new run named like one with checkpoints here are
    refused: each would continue, or later delete, another run's state."""
    if resume not in (None, "auto"):
        if not os.path.isfile(resume):
            raise UsageError(f"--resume {resume!r}: no such file")
        if run_id is not None and (owner := run_of(resume)) not in (run_id, None):
            raise UsageError(f"--resume {resume!r} is a checkpoint of run {owner}, not of "
                             f"--run-id {run_id}")
        return resume
    if resume == "auto" and not directory:
        raise UsageError("--resume auto needs --checkpoint-dir")
    if not directory:
        return None
    runs: dict[str, str] = {}  # run id -> its newest checkpoint
    for _, path in listed(directory):
        runs[run_of(path) or "?"] = path
    if resume is None:
        if run_id in runs:
            raise UsageError(f"--checkpoint-dir {directory!r} holds checkpoints of run "
                             f"{run_id} already (newest {runs[run_id]!r}): continue it with "
                             "--resume auto, or give this run another --run-id")
        return None
    if run_id is not None:
        return runs.get(run_id)
    if len(runs) > 1:
        named = ", ".join(f"{rid} (newest {os.path.basename(p)})" for rid, p in runs.items())
        raise UsageError(f"--resume auto: --checkpoint-dir {directory!r} holds checkpoints of "
                         f"{len(runs)} runs, {named}: name the one to continue with --run-id")
    return next(iter(runs.values()), None)
