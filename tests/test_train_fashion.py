"""The real thing, small: the paper's net on Fashion-MNIST with 4 asynchronous workers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import train

from gem_mpi.outputs.runfile import load_run
from gem_mpi.problem.models import build_model
from gem_mpi.problem.spec import dataset_spec

pytestmark = pytest.mark.mpi  # every test here launches mpirun or another process


def test_four_gem_workers_learn_fashion_mnist(tmp_path):
    h5, model_path = tmp_path / "run.h5", tmp_path / "model.pt"
    res = train(5, "--max-steps", "150", "--eval-every", "200", "--metrics", str(h5),
                "--save", str(model_path), timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "master kernel:" in res.stderr and "done: 600 updates" in res.stderr
    run = load_run(h5)
    u, ev = run.updates, run.eval
    assert len(u["worker"]) == 600
    # learning happened: worker losses fell, and the central variable classifies
    assert u["loss"][-100:].mean() < 0.6 * u["loss"][:20].mean()
    assert run.summary["test_accuracy"] > 0.70
    assert np.all(np.diff(ev["clock"]) >= 0)
    # GEM metrics are there and finite, one column per parameter tensor
    assert u["pi_median"].shape == (600, len(run.tensor_names))
    assert np.isfinite(u["energy_central"]).all()
    # the saved model is the central variable and loads into a fresh net
    model = build_model("mnist-cnn", dataset_spec("fashion-mnist", "mnist-cnn"))
    model.load_state_dict(torch.load(model_path, weights_only=True))
    assert run.config["method"] == "gem" and "torch" in run.attrs["versions"]
