"""--save's writer, in-process: the suffix picks the format (.safetensors: the state_dict's
tensors by name and the run's metadata; any other: torch.save, or .npy for the quadratic), a
file loads strictly into a fresh model, and a failure is one OutputError with no file left.
That a real run's file holds the evaluated BatchNorm statistics and evaluates to the reported
accuracy is tests/test_training_loop.py's BatchNorm test."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.numpy import load_file as load_numpy
from safetensors.torch import load_file
from torch import nn

from gem_mpi.config import Config
from gem_mpi.errors import OutputError, UsageError
from gem_mpi.problem import flatten, is_safetensors, save_final
from gem_mpi.run.preflight import validate

META = {"run_id": "0123abcd", "config": json.dumps({"method": "gem"})}


class Tied(nn.Module):
    """A BatchNorm net whose output layer shares the input layer's weight (two names, one
    tensor: what the safetensors format cannot hold as such)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 6, bias=False)
        self.bn = nn.BatchNorm1d(6)
        self.out = nn.Linear(6, 6)
        self.out.weight = self.inp.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.bn(self.inp(x))))


def _model() -> tuple[Tied, np.ndarray]:
    """A model with statistics of its own in the BatchNorm buffers, and a θ that is not its
    current parameters (save_final loads θ into it)."""
    torch.manual_seed(0)
    model = Tied()
    model.train()
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(16, 6) * 3 + 1)
    theta = flatten(list(model.parameters())) + np.float32(0.25)
    return model, theta


def _fresh() -> Tied:
    torch.manual_seed(1)
    return Tied()


def test_the_suffix_picks_the_format():
    assert is_safetensors("m.safetensors") and is_safetensors("/a/b/M.SafeTensors")
    assert not is_safetensors("m.pt") and not is_safetensors("safetensors")


def test_safetensors_holds_the_state_dict_by_name_and_the_runs_metadata(tmp_path):
    model, theta = _model()
    path = tmp_path / "model.safetensors"
    save_final(model, theta, str(path), META)
    tensors = load_file(path)
    state = model.state_dict()
    assert sorted(tensors) == sorted(state)  # parameters and buffers, tied names both
    for name, t in state.items():
        assert torch.equal(tensors[name], t), name
    assert tensors["bn.num_batches_tracked"].item() == 3  # the statistics as they were
    fresh = _fresh()
    fresh.load_state_dict(tensors, strict=True)
    assert np.array_equal(flatten(list(fresh.parameters())), theta)
    assert fresh.out.weight is fresh.inp.weight  # loading kept the tie
    with safe_open(path, "pt") as f:
        assert f.metadata() == {"format": "pt", **META}
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]  # no temporary


def test_another_suffix_is_torch_save_of_the_state_dict(tmp_path):
    model, theta = _model()
    path = tmp_path / "model.pt"
    save_final(model, theta, str(path), META)
    state = torch.load(path, weights_only=True)
    fresh = _fresh()
    fresh.load_state_dict(state, strict=True)
    assert np.array_equal(flatten(list(fresh.parameters())), theta)
    assert torch.equal(state["bn.running_var"], model.bn.running_var)


def test_the_quadratic_saves_theta_as_npy_or_one_named_tensor(tmp_path):
    theta = np.arange(10, dtype=np.float32) / 7
    save_final(None, theta, str(tmp_path / "theta.npy"))
    assert np.array_equal(np.load(tmp_path / "theta.npy"), theta)
    path = tmp_path / "theta.safetensors"
    save_final(None, theta, str(path), META)
    tensors = load_numpy(path)
    assert list(tensors) == ["theta"] and np.array_equal(tensors["theta"], theta)
    with safe_open(path, "np") as f:
        assert f.metadata() == {"format": "np", **META}


class WithExtraState(nn.Linear):
    def get_extra_state(self) -> dict:
        return {"note": "not a tensor"}

    def set_extra_state(self, state: dict) -> None:
        pass


def test_a_state_dict_entry_that_is_not_a_tensor_is_one_line_and_no_file(tmp_path):
    model = WithExtraState(3, 2)
    path = tmp_path / "model.safetensors"
    with pytest.raises(OutputError, match=r"holds '_extra_state', a dict, and safetensors "
                                          r"stores tensors only; save to a \.pt file"):
        save_final(model, flatten(list(model.parameters())), str(path))
    assert list(tmp_path.iterdir()) == []


def test_a_failed_safetensors_write_is_the_os_reason_and_no_file(tmp_path):
    model, theta = _model()
    path = tmp_path / "gone" / "model.safetensors"
    with pytest.raises(OutputError) as err:
        save_final(model, theta, str(path), META)
    assert str(err.value) == f"--save {str(path)!r}: writing failed (No such file or directory)"
    assert list(tmp_path.iterdir()) == []


def test_safetensors_without_the_package_is_refused_before_the_run(monkeypatch, tmp_path):
    monkeypatch.setitem(__import__("sys").modules, "safetensors", None)
    cfg = Config.of(model="quadratic", dataset="synthetic", save=str(tmp_path / "t.safetensors"))
    with pytest.raises(UsageError, match=r"t\.safetensors needs the safetensors package: "
                                         r"pip install safetensors"):
        validate(cfg, 3, data=False)
    validate(Config.of(model="quadratic", dataset="synthetic", save=str(tmp_path / "t.npy")),
             3, data=False)
