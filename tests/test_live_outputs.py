"""What a training user watches: live scalars in TensorBoard and Weights & Biases (offline
here: no network), and the samples/s, tokens/s and model FLOP/s of every line and summary.
Real runs, read back with tensorboard's own reader and W&B's own record format."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from helpers import REPO, mpi_env, tensorboard_scalars, train, wandb_history, wandb_records

from gem_mpi.outputs.runfile import load_run

CNN = ("--model", "mnist-cnn", "--dataset", "synthetic", "--synthetic-size", "1024",
       "--batch-size", "16", "--max-steps", "40", "--eval-every", "20", "--log-every", "0.1")


@pytest.mark.mpi
@pytest.mark.parametrize("method", ["gem", "ddp"])
def test_scalars_reach_tensorboard_and_wandb_as_the_metrics_file_holds_them(
        tmp_path, monkeypatch, method):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    h5, tb = tmp_path / "run.h5", tmp_path / "tb"
    # gem counts the FLOPs on the CPU (--flops on); ddp keeps the default, which counts
    # them only where a GPU's peak makes an MFU
    flops = ["--flops", "on"] if method == "gem" else []
    res = train(3, *CNN, "--method", method, "--metrics", str(h5), "--tensorboard", str(tb),
                "--wandb", "gem-tests", *flops, timeout=300)
    assert res.returncode == 0, res.stderr
    run = load_run(h5)
    s = run.summary
    # the progress lines and the done line say samples/s; the CPU has no MFU
    assert "samples/s (" in res.stderr
    assert ("GFLOP/s (CPU: no MFU)" in res.stderr) == bool(flops)
    assert f", {s['samples_per_s']:.0f} samples/s" in res.stderr.splitlines()[-1]
    workers = 3 if method == "ddp" else 2
    assert s["samples_per_s_per_worker"] == pytest.approx(s["samples_per_s"] / workers)
    assert s["samples_per_s"] > 0 and math.isnan(s["mfu"])
    assert s["model_flops_per_s"] > 0 if flops else math.isnan(s["model_flops_per_s"])

    scalars = tensorboard_scalars(tb)
    final = run.n_updates
    assert scalars["eval/test_accuracy"][-1] == (final, pytest.approx(s["test_accuracy"]))
    assert scalars["eval/test_loss"][-1] == (final, pytest.approx(s["test_loss"]))
    unit = "steps_per_s" if method == "ddp" else "updates_per_s"
    for tag in ("train/loss", f"speed/{unit}", "speed/samples_per_s",
                *(["speed/model_flops_per_s"] if flops else [])):
        assert scalars[tag] and scalars[tag][-1][0] == final, tag
    if method == "gem":  # the master's own columns
        assert {"train/staleness", "gem/pi_median", "gem/clamp_share"} <= scalars.keys()
    # the TensorBoard train/loss points average the metrics file's rows between two ticks
    losses = run.updates["loss"]
    assert min(v for _, v in scalars["train/loss"]) >= losses.min() - 1e-6
    assert max(v for _, v in scalars["train/loss"]) <= losses.max() + 1e-6

    # W&B: the run's id, its configuration, the same evaluations
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    assert run_dir.name.endswith(run.attrs["run_id"])
    history = wandb_history(run_dir)
    evals = [(h["position"], h["eval/test_accuracy"]) for h in history
             if "eval/test_accuracy" in h]
    assert evals[-1] == (final, pytest.approx(s["test_accuracy"]))
    config = next(r.run.config for r in wandb_records(run_dir)
                  if r.WhichOneof("record_type") == "run")
    lr = next(item.value_json for item in config.update if item.key == "lr")
    assert json.loads(lr) == 0.05

    if method == "gem":  # an existing run exported to TensorBoard by tools/report.py
        out = tmp_path / "exported"
        done = subprocess.run([sys.executable, str(REPO / "tools" / "report.py"), str(h5),
                               "-o", str(tmp_path / "report"), "--tensorboard", str(out)],
                              capture_output=True, text=True, env=mpi_env(), check=False)
        assert done.returncode == 0, done.stderr
        exported = tensorboard_scalars(out)
        assert exported["eval/test_accuracy"] == [
            (int(c), pytest.approx(a)) for c, a in zip(run.eval["clock"],
                                                       run.eval["test_accuracy"], strict=True)]
        assert len(exported["train/loss"]) == final  # fewer rows than points: one each
        assert [v for _, v in exported["train/loss"]] == pytest.approx(list(losses))
