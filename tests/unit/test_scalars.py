"""LiveScalars (gem_mpi.outputs.scalars): rows averaged between ticks, read back with
tensorboard's own reader. No MPI."""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import tensorboard_scalars

from gem_mpi.outputs.scalars import LiveScalars


def test_a_tick_writes_the_mean_of_the_rows_since_the_last_one(tmp_path):
    live = LiveScalars(str(tmp_path), None, "run", {})
    live.row({"loss": 2.0, "staleness": 1, "clamp_frac": np.array([0.0, 1.0, np.nan])})
    live.row({"loss": 4.0, "staleness": 3, "clamp_frac": np.array([np.nan, np.nan, np.nan]),
              "worker": 7})  # not a scalar of the dashboard
    live.tick(2, {"speed/updates_per_s": 5.0})
    live.row({"loss": math.nan})  # a NaN loss is no point (the row counts nothing)
    live.row({"loss": 1.0})
    live.tick(4, {})
    live.write(3, {"eval/test_accuracy": 0.5})
    live.close()
    got = tensorboard_scalars(tmp_path)
    assert got["train/loss"] == [(2, 3.0), (4, 1.0)]
    assert got["train/staleness"] == [(2, 2.0)]
    assert got["gem/clamp_share"] == [(2, pytest.approx(0.5))]
    assert got["speed/updates_per_s"] == [(2, 5.0)]
    assert got["eval/test_accuracy"] == [(3, 0.5)]
    assert "worker" not in " ".join(got)


def test_a_resumed_run_drops_the_points_a_crashed_start_wrote_past_its_checkpoint(tmp_path):
    first = LiveScalars(str(tmp_path), None, "run", {})
    for step in (10, 20, 30):
        first.write(step, {"train/loss": float(step)})
    first.close()
    resumed = LiveScalars(str(tmp_path), None, "run", {}, resume_at=20)
    resumed.write(25, {"train/loss": 0.0})
    resumed.close()
    assert tensorboard_scalars(tmp_path)["train/loss"] == [(10, 10.0), (25, 0.0)]
