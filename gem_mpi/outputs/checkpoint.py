"""Checkpoints of the master's state, so a stopped or crashed job loses minutes, not hours.

A checkpoint is an HDF5 file (no pickle): the central parameters θ, the master clock and
ticket counter, each worker's next update number (its place in its data budget), how many
rows the metrics file held, the seconds already trained, and the run's configuration.
No RNG state needs storing: every random draw (θ₀, each worker's shuffles, dropout masks)
is a function of (--seed, worker, epoch or step), so a resumed worker draws what the
uninterrupted one would have.
It is written to a temporary file, flushed and fsync'ed, then renamed over; the previous
checkpoint is deleted only after that, so a valid one exists at every moment.

--method sync also stores the optimizer's momentum buffer (one flat array like θ), so its
resume continues exactly. A GEM worker's momentum m lives on the worker: when a run is
stopped (SIGUSR1/SIGTERM), each GEM worker writes its own file beside the checkpoint
(``momentum_w<rank>.h5``, atomically), and a resume restores it where it holds exactly the
updates the checkpoint counts for that worker. After a crash, the periodic checkpoint has
no such files and m restarts at 0; the updates applied after the checkpoint are done again.
"""

from __future__ import annotations

import glob
import json
import os
import re
import sys

import h5py
import numpy as np

from gem_mpi.errors import OutputError, UsageError
from gem_mpi.outputs.files import atomic_write, os_reason

FORMAT = 1
NAME = "checkpoint_{clock:012d}.h5"
_PATTERN = re.compile(r"checkpoint_(\d{12})\.h5$")
# configuration fields a resumed run must share with the checkpoint
MUST_MATCH = ("method", "model", "dataset", "quadratic_dim", "batch_size", "epochs",
              "max_steps", "shard", "seed", "synthetic_size")


def _write(tmp: str, theta: np.ndarray, state: dict) -> None:
    with h5py.File(tmp, "w") as f:
        f.attrs["gem_mpi_checkpoint"] = FORMAT
        f.create_dataset("theta", data=theta)
        f.create_dataset("next_seq", data=np.asarray(state["next_seq"], dtype=np.int64))
        if state.get("momentum") is not None:
            f.create_dataset("momentum", data=state["momentum"])
        for key in ("clock", "tickets", "rows_updates", "rows_eval", "rows_rejected"):
            f.attrs[key] = int(state[key])
        f.attrs["elapsed_s"] = float(state["elapsed_s"])
        f.attrs["config"] = json.dumps(state["config"], sort_keys=True)
        f.attrs["n_workers"] = int(state["n_workers"])


def save(directory: str, theta: np.ndarray, state: dict) -> str:
    """Write a checkpoint atomically and drop the older ones; returns its path."""
    final = os.path.join(directory, NAME.format(clock=int(state["clock"])))
    try:
        atomic_write(final, lambda tmp: _write(tmp, theta, state))
    except (OSError, RuntimeError) as exc:  # disk full, quota, I/O: the previous one stays
        before = latest(directory)
        kept = f"the previous one, {before}, is kept" if before else "there is no earlier one"
        raise OutputError(f"checkpoint {final!r}: writing failed ({os_reason(exc)}); "
                          f"{kept}") from None
    for old in glob.glob(os.path.join(directory, "checkpoint_*.h5")):
        if old != final and _PATTERN.search(old):
            os.remove(old)
    return final


WORKER_MOMENTUM = "momentum_w{rank:05d}.h5"


def save_worker_momentum(directory: str, rank: int, folded: int, m: np.ndarray,
                         prev: np.ndarray, config: dict) -> None:
    """A stopping GEM worker's m (holding its first ``folded`` updates) and the m before the
    last of them; atomically, like a checkpoint. A failure is reported, not raised: the
    master's checkpoint is what matters, and m would merely restart at 0."""
    def write(tmp: str) -> None:
        with h5py.File(tmp, "w") as f:
            f.attrs["folded"] = int(folded)
            f.attrs["config"] = json.dumps({k: config.get(k) for k in MUST_MATCH},
                                           sort_keys=True)
            f.create_dataset("m", data=m)
            f.create_dataset("prev", data=prev)

    try:
        atomic_write(os.path.join(directory, WORKER_MOMENTUM.format(rank=rank)), write)
    except (OSError, RuntimeError) as exc:
        print(f"gem_mpi: worker {rank}: could not save its momentum ({os_reason(exc)}); a "
              "resume restarts it at 0", file=sys.stderr, flush=True)


def load_worker_momentum(directory: str, rank: int, start_seq: int,
                         config: dict) -> np.ndarray | None:
    """The saved m holding exactly this worker's first ``start_seq`` updates, or None."""
    path = os.path.join(directory, WORKER_MOMENTUM.format(rank=rank))
    try:
        with h5py.File(path, "r") as f:
            same_run = json.loads(f.attrs["config"]) == {k: config.get(k) for k in MUST_MATCH}
            folded = int(f.attrs["folded"])
            if not same_run:
                return None
            if folded == start_seq:
                return f["m"][()]
            if folded - 1 == start_seq:
                return f["prev"][()]
    except (OSError, KeyError, ValueError):
        return None
    return None


def latest(directory: str) -> str | None:
    """The newest complete checkpoint in a directory (temporary files never count)."""
    found = [p for p in glob.glob(os.path.join(directory, "checkpoint_*.h5"))
             if _PATTERN.search(p)]
    return max(found, key=lambda p: int(_PATTERN.search(p).group(1))) if found else None


def load(path: str) -> tuple[np.ndarray, dict]:
    """θ and the state dict of a checkpoint; UsageError if it is not a readable one."""
    try:
        with h5py.File(path, "r") as f:
            if f.attrs.get("gem_mpi_checkpoint") != FORMAT:
                raise UsageError(f"--resume {path!r} is not a gem_mpi checkpoint")
            theta = f["theta"][()]
            state = {k: int(f.attrs[k]) for k in ("clock", "tickets", "rows_updates",
                                                  "rows_eval", "rows_rejected", "n_workers")}
            state["elapsed_s"] = float(f.attrs["elapsed_s"])
            state["config"] = json.loads(f.attrs["config"])
            state["next_seq"] = f["next_seq"][()]
            state["momentum"] = f["momentum"][()] if "momentum" in f else None
    except (OSError, KeyError, ValueError) as exc:
        raise UsageError(f"--resume {path!r}: not a readable checkpoint ({exc})") from None
    if theta.dtype != np.float32 or theta.ndim != 1:
        raise UsageError(f"--resume {path!r}: θ has dtype {theta.dtype}, shape {theta.shape}")
    return theta, state


def check_compatible(state: dict, theta: np.ndarray, config: dict, n_workers: int,
                     n_params: int, path: str) -> None:
    """A checkpoint of another model, size or setting cannot be continued: say which."""
    if theta.size != n_params:
        raise UsageError(f"--resume {path!r} holds {theta.size} parameters, this model has "
                         f"{n_params}")
    if state["n_workers"] != n_workers:
        raise UsageError(f"--resume {path!r} was written by a run of {state['n_workers']} "
                         f"workers, this one has {n_workers}")
    for key in MUST_MATCH:
        if state["config"].get(key) != config.get(key):
            raise UsageError(f"--resume {path!r}: --{key.replace('_', '-')} was "
                             f"{state['config'].get(key)!r}, now {config.get(key)!r}")


def resolve(resume: str, directory: str | None) -> str | None:
    """The checkpoint a --resume value names: a path, or 'auto' for the newest in the
    checkpoint directory, None when there is none yet (a requeued job's first start)."""
    if resume != "auto":
        if not os.path.isfile(resume):
            raise UsageError(f"--resume {resume!r}: no such file")
        return resume
    if not directory:
        raise UsageError("--resume auto needs --checkpoint-dir")
    return latest(directory)
