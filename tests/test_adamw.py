"""``--optimizer adamw`` under real mpirun: each worker's update is its own AdamW step d at the
θ it pulled (GEM's budget κ|d|), replayed bit for bit against the numpy reference from the
runs' logs, its state carried across a stop, and one GEM worker with κ = 1 sequential AdamW."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import (
    assert_exactly_once,
    checkpoint_after_start,
    quadratic_args,
    signal_when,
    single_process,
    theta0_state,
    train,
    train_background,
)

from gem_mpi.algorithm.reference import replay
from gem_mpi.config import AdamWConfig
from gem_mpi.outputs.runfile import load_run
from gem_mpi.problem.quadratic import Quadratic

pytestmark = pytest.mark.mpi  # every test here launches mpirun

DIM, WORKERS, LR, PI_MAX = 2000, 3, 0.01, 50.0
BETAS, DECAY = "0.9,0.99", 0.1  # not the defaults: the replay must read the run's own
ADAMW = ("--optimizer", "adamw", "--betas", BETAS, "--weight-decay", str(DECAY))
OPTIONS = AdamWConfig(betas=BETAS, weight_decay=DECAY)


def _args(tmp_path, method: str, steps: int, *extra: str, adamw: bool = True) -> list[str]:
    return quadratic_args(*(ADAMW if adamw else ()), *extra, method=method, dim=DIM, steps=steps, lr=LR,
                          pi_max=PI_MAX, metrics=tmp_path / "run.h5",
                          save=tmp_path / "theta.npy", eval_every=0)


@pytest.mark.parametrize("method, mode, wire", [("gem", "wait", "float32"),
                                                ("gem", "pipelined", "bf16"),
                                                ("gem", "overlap", "float32"),
                                                ("downpour", "overlap", "float32"),
                                                ("adaptive", "pipelined", "bf16"),
                                                ("gap-aware", "overlap", "bf16")])
def test_each_asynchronous_method_under_adamw_is_the_replay(tmp_path, method, mode, wire):
    steps = 60
    res = train(WORKERS + 1, *_args(tmp_path, method, steps, "--worker-mode", mode,
                                    "--wire", wire, "--kappa", "2"))
    assert res.returncode == 0, res.stdout + res.stderr
    u = load_run(tmp_path / "run.h5").updates
    assert_exactly_once(u["worker"], u["seq"], range(1, WORKERS + 1), steps)
    theta, q = np.load(tmp_path / "theta.npy"), Quadratic(DIM, 0)
    ref = replay(u, q, method, LR, kappa=2.0, pi_max=PI_MAX, window=len(u["worker"]) + 1,
                 wire=wire, adamw=OPTIONS)
    assert np.array_equal(theta, ref.theta)  # bit for bit
    np.testing.assert_allclose(u["loss"], ref.losses, rtol=1e-5)
    sgd = replay(u, q, method, LR, kappa=2.0, pi_max=PI_MAX, wire=wire,
                 window=len(u["worker"]) + 1)
    assert not np.allclose(theta, sgd.theta)  # AdamW's steps, not −η·g


@pytest.mark.parametrize("method, mode, optimizer, h", [("gem", "pipelined", "adamw", 1),
                                                        ("gem", "overlap", "adamw", 1),
                                                        ("gem", "pipelined", "sgd", 4),
                                                        ("gap-aware", "wait", "adamw", 1)])
def test_a_stopped_run_resumes_each_workers_own_optimizer(tmp_path, method, mode, optimizer,
                                                          h):
    """A stop saves each worker's AdamW m, v and t (local steps' momentum buffer), and the
    states before its last updates (a pipelined or overlapped worker may have computed
    updates the master never applied); the resume takes the one the master's checkpoint
    holds (Gap-Aware: beside the master's own v), so the whole run is the replay in which
    every worker's state runs on across the resume."""
    steps = 4000 // h
    args = _args(tmp_path, method, steps, "--worker-mode", mode, "--local-steps", str(h),
                 "--checkpoint-dir", str(tmp_path), "--checkpoint-every", "0.1",
                 adamw=optimizer == "adamw")
    proc = train_background(WORKERS + 1, *args)
    err = signal_when(proc, checkpoint_after_start(tmp_path))
    assert proc.returncode == 3, err
    assert len(list(tmp_path.glob("momentum_w*.h5"))) == WORKERS
    res = train(WORKERS + 1, *args, "--resume", "auto", timeout=300)
    assert res.returncode == 0, res.stderr
    what = "AdamW state" if optimizer == "adamw" else "local steps' momentum"
    assert f"worker {what} restored for {WORKERS} of {WORKERS} workers" in res.stderr, res.stderr
    if method == "gap-aware":
        assert "Gap-Aware's step average v restored from the checkpoint" in res.stderr
    u = load_run(tmp_path / "run.h5").updates
    assert u["clock"].tolist() == list(range(WORKERS * steps))
    ref = replay(u, Quadratic(DIM, 0), method, LR, pi_max=PI_MAX, local_steps=h,
                 adamw=OPTIONS if optimizer == "adamw" else None)
    assert np.array_equal(np.load(tmp_path / "theta.npy"), ref.theta)


def test_one_gem_worker_with_kappa_1_is_sequential_adamw(tmp_path):
    """π = κ|d|/(|d| + ε) = 1 with one worker: the run is torch.optim.AdamW over the same
    batches, up to float32 rounding (the decay is a term of d here, torch applies it to θ
    first). Measured on mnist-cnn, η 0.002: after 1 step at most 1.5e-8 apart (an ulp of θ),
    after 25 at most 3e-6 (0.15 % of one step: AdamW's m/√v turns a rounding in a near-zero
    gradient into a step), θ having moved 0.045."""
    args = ["--method", "gem", "--optimizer", "adamw", "--max-steps", "25", "--threads", "1",
            "--eval-every", "0", "--lr", "0.002", "--weight-decay", "0.05"]
    saved = tmp_path / "model.pt"
    res = train(2, *args, "--save", str(saved), timeout=300)
    assert res.returncode == 0, res.stderr
    got = torch.load(saved, weights_only=True)
    want = single_process(args, lambda params: torch.optim.AdamW(params, lr=0.002,
                                                                 weight_decay=0.05))
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0.01 * 0.002, msg=name)
    assert any(not torch.equal(got[k], theta0_state()[k]) for k in got)  # it trained


@pytest.mark.parametrize("method, optimizer, mode", [("gem", "sgd", "pipelined"),
                                                     ("gem", "adamw", "wait"),
                                                     ("downpour", "adamw", "overlap")])
def test_local_steps_are_the_replay(tmp_path, method, optimizer, mode):
    """--local-steps 4: each update is 4 steps of the worker's own optimizer (momentum SGD or
    AdamW) from the θ it pulled, Δ = θ₄ − θ₀, GEM's budget κ|Δ|; replayed bit for bit, the
    logged loss the mean of the 4 steps'."""
    steps, h = 30, 4
    res = train(WORKERS + 1, *_args(tmp_path, method, steps, "--local-steps", str(h),
                                    "--worker-mode", mode, adamw=optimizer == "adamw"))
    assert res.returncode == 0, res.stdout + res.stderr
    u = load_run(tmp_path / "run.h5").updates
    assert_exactly_once(u["worker"], u["seq"], range(1, WORKERS + 1), steps)
    ref = replay(u, Quadratic(DIM, 0), method, LR, pi_max=PI_MAX, window=len(u["worker"]) + 1,
                 adamw=OPTIONS if optimizer == "adamw" else None, local_steps=h)
    assert np.array_equal(np.load(tmp_path / "theta.npy"), ref.theta)
    np.testing.assert_allclose(u["loss"], ref.losses, rtol=1e-5)
