"""Live scalars for TensorBoard (torch's ``SummaryWriter``) and Weights & Biases, from rank 0.

The metrics file holds every update; a dashboard wants a point every few seconds. The rows
rank 0 records are averaged here between two ticks (the progress line's), and each tick
writes one point per scalar at the run's position (updates, or steps for the synchronous
methods), so the curves of a resumed run continue its own. Both sinks are optional
dependencies: asking for one that is not installed is one line at start-up.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

from gem_mpi.errors import UsageError

# the per-update columns a tick averages, and the tag each gets
ROW_SCALARS = {"loss": "train/loss", "staleness": "train/staleness",
               "pi_median_all": "gem/pi_median", "clamp_frac": "gem/clamp_share",
               "compute_s": "time/compute_s", "apply_s": "time/apply_s",
               "allreduce_s": "time/allreduce_s", "ga_scale_mean": "gap_aware/scale_mean"}


def require(module: str, flag: str, package: str) -> None:
    """One line when ``flag``'s optional dependency is missing (rank 0 checks at start-up)."""
    try:
        __import__(module)
    except ImportError:
        raise UsageError(f"{flag} needs the {package} package: pip install {package} (or "
                         "bash tools/install.sh)") from None


class LiveScalars:
    """TensorBoard event files in ``tensorboard`` and/or a W&B run in ``wandb_project``."""

    def __init__(self, tensorboard: str | None, wandb_project: str | None, run_id: str,
                 config: dict[str, Any], resume_at: int | None = None) -> None:
        """``resume_at``: the position a resumed run continues from; TensorBoard drops the
        points a crashed earlier start wrote beyond it, W&B continues the run ``run_id``."""
        self._sums: dict[str, float] = {}
        self._counts: dict[str, int] = {}
        self.tb = None
        self.wandb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(tensorboard, purge_step=resume_at)
        if wandb_project:
            import wandb

            self.wandb = wandb.init(project=wandb_project, id=run_id, resume="allow",
                                    config=config, dir=os.environ.get("WANDB_DIR"))
            # an evaluation's point arrives after later ticks': W&B's own step must only
            # grow, so every scalar is plotted over the run's position instead
            self.wandb.define_metric("position")
            self.wandb.define_metric("*", step_metric="position")

    def row(self, row: dict) -> None:
        """One recorded update (or step): its columns join the current averages."""
        for key in ROW_SCALARS.keys() & row.keys():
            value = row[key]
            if isinstance(value, np.ndarray):  # a per-tensor column: its mean over tensors
                value = float(np.nanmean(value)) if np.isfinite(value).any() else math.nan
            value = float(value)
            if math.isfinite(value):
                self._sums[key] = self._sums.get(key, 0.0) + value
                self._counts[key] = self._counts.get(key, 0) + 1

    def tick(self, position: int, values: dict[str, float]) -> None:
        """One point per scalar at ``position``: the averages since the last tick, and
        ``values`` (rates, tagged as given)."""
        points = {ROW_SCALARS[k]: s / self._counts[k] for k, s in self._sums.items()}
        points.update(values)
        self._sums.clear()
        self._counts.clear()
        self.write(position, points)

    def write(self, position: int, points: dict[str, float]) -> None:
        if self.tb is not None:
            for tag, value in points.items():
                self.tb.add_scalar(tag, value, position)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log({**points, "position": position})

    def close(self, summary: dict[str, float] | None = None) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            if summary:
                self.wandb.summary.update(summary)
            self.wandb.finish()


def export(updates: dict[str, np.ndarray], evals: dict[str, np.ndarray], split: str,
           directory: str, points: int = 500) -> int:
    """An HDF5 run's rows (runfile.Run's ``updates`` and ``eval``) as TensorBoard scalars in
    ``directory``: the update columns averaged over ``points`` windows of consecutive rows,
    the updates/s of each window, and every evaluation. Returns the points written."""
    scalars = LiveScalars(directory, None, "", {})
    clock = updates.get("clock", np.zeros(0))
    n = len(clock)
    written = 0
    for rows in np.array_split(np.arange(n), min(points, n)) if n else []:
        window: dict[str, float] = {}
        for key in ROW_SCALARS.keys() & updates.keys():
            col = np.asarray(updates[key][rows], np.float64)
            col = np.nanmean(col, axis=1) if col.ndim == 2 else col  # per-tensor: their mean
            if np.isfinite(col).any():
                window[ROW_SCALARS[key]] = float(np.nanmean(col))
        t, before = float(updates["time"][rows[-1]]), rows[0] - 1
        if before >= 0 and t > updates["time"][before]:  # since the last window's end
            window["speed/updates_per_s"] = len(rows) / (t - float(updates["time"][before]))
        scalars.write(int(clock[rows[-1]]), window)
        written += 1
    for c, loss, acc in zip(evals.get("clock", []), evals.get("test_loss", []),
                            evals.get("test_accuracy", []), strict=False):
        scalars.write(int(c), {f"eval/{split}_loss": float(loss),
                               f"eval/{split}_accuracy": float(acc)})
        written += 1
    scalars.close()
    return written
