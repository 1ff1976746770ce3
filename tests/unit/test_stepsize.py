"""What scales the gradient (gem_mpi.algorithm.stepsize) and the bad inputs of its options,
in-process: the schedules' values, clipping as torch computes it, and one line for each
combination that cannot work."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gem_mpi import config
from gem_mpi.algorithm.stepsize import Schedule, clip
from gem_mpi.errors import UsageError
from gem_mpi.run.preflight import validate

LR = 0.1


def test_constant_is_lr_exactly_and_warmup_rises_linearly():
    s = Schedule(LR, 100)
    assert s.constant and all(s.eta(k) == np.float32(LR) for k in (0, 50, 99))
    w = Schedule(LR, 100, warmup=4)
    assert not w.constant
    assert [float(w.eta(k)) for k in range(5)] == [float(np.float32(LR * f))
                                                   for f in (0.25, 0.5, 0.75, 1.0, 1.0)]


def test_step_and_cosine():
    s = Schedule(LR, 100, "step", warmup=10, step_every=20, gamma=0.5)
    assert s.eta(10) == np.float32(LR) and s.eta(29) == np.float32(LR)
    assert s.eta(30) == np.float32(LR * 0.5) and s.eta(50) == np.float32(LR * 0.25)
    c = Schedule(LR, 110, "cosine", warmup=10, lr_min=0.01)
    assert c.eta(10) == np.float32(LR)  # the cosine starts where the warm-up ends
    assert c.eta(60) == np.float32(0.01 + (LR - 0.01) * 0.5)  # half way
    assert abs(float(c.eta(109)) - 0.01) < 1e-4 and c.eta(110) == np.float32(0.01)
    longer = Schedule(LR, 110, "cosine", decay_steps=220)
    assert longer.eta(110) == np.float32(LR * 0.5 * (1 + math.cos(math.pi / 2)))
    assert all(isinstance(x.eta(3), np.float32) for x in (s, c, longer))


def test_clip_matches_torch_and_leaves_small_gradients_alone():
    g = np.random.default_rng(0).normal(size=1000).astype(np.float32)
    assert clip(g, 0.0) is g and clip(g, 1e6) is g  # no copy where nothing is clipped
    t = torch.from_numpy(g.copy()).requires_grad_()
    t.grad = torch.from_numpy(g.copy())
    torch.nn.utils.clip_grad_norm_([t], 3.0)
    np.testing.assert_allclose(clip(g, 3.0), t.grad.numpy(), rtol=1e-6)
    assert abs(float(np.linalg.norm(clip(g, 3.0))) - 3.0) < 1e-3


QUAD = ["--model", "quadratic", "--dataset", "synthetic", "--max-steps", "100"]


@pytest.mark.parametrize("args, says", [
    (["--lr-schedule", "step"], "--lr-schedule step needs --lr-step-every N"),
    (["--lr-step-every", "5"], "--lr-step-every is for --lr-schedule step, not constant"),
    (["--lr-min", "0.01"], "--lr-min is for --lr-schedule cosine"),
    (["--lr-schedule", "cosine", "--lr-min", "1"], "--lr-min 1 must be below --lr 0.05"),
    (["--warmup-steps", "100"], ("--warmup-steps 100 is as long as the run or longer: each "
                                "worker takes 100 steps")),
    (["--lr-schedule", "cosine", "--lr-decay-steps", "50"],
     "--lr-decay-steps 50 ends the schedule before the run: each worker takes 100 steps"),
    (["--lr-schedule", "cosine", "--warmup-steps", "20", "--lr-decay-steps", "10"],
     "--lr-decay-steps 10 must be longer than --warmup-steps 20"),
    (["--lr-gamma", "0"], "--lr-gamma must be in (0, 1], got 0.0"),
    (["--amp", "fp16"], ("--amp must be one of off, bf16 (fp16, whose loss scaler skips steps, "
                        "is not offered: use bf16), got fp16")),
    (["--amp", "bf16"], "--amp bf16 is for torch models"),
    (["--clip-grad-norm", "-1"], "--clip-grad-norm must be >= 0, got -1.0"),
    (["--bn-batches", "-1"], "--bn-batches must be >= 0, got -1"),
])
def test_each_bad_combination_is_one_line(args, says):
    cfg, _ = config.parse([*QUAD, *args])
    with pytest.raises(UsageError) as exc:
        validate(cfg, 3)
    assert says in str(exc.value) and "\n" not in str(exc.value)


def test_the_run_length_of_a_data_run_is_what_the_schedule_is_checked_against():
    """Fashion-MNIST, batch 60000 / 2 workers sharded: 1 step per epoch, 3 epochs."""
    cfg, _ = config.parse(["--shard", "--batch-size", "30000", "--epochs", "3",
                           "--warmup-steps", "3"])
    with pytest.raises(UsageError, match="each worker takes 3 steps"):
        validate(cfg, 3)
    cfg, _ = config.parse(["--shard", "--batch-size", "30000", "--epochs", "3",
                           "--warmup-steps", "2"])
    validate(cfg, 3)
