"""``--method dn`` (Async Local-SGD's delayed Nesterov) under real mpirun: the master applies
each update at once and folds the updates into its outer momentum every N of them; replayed bit
for bit against the numpy reference, and its momentum carried across a stop by the checkpoint."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import (
    assert_exactly_once,
    checkpoint_after_start,
    quadratic_args,
    signal_when,
    train,
    train_background,
)

from gem_mpi.algorithm.reference import replay
from gem_mpi.config import AdamWConfig, DnConfig
from gem_mpi.outputs.runfile import load_run
from gem_mpi.problem.quadratic import Quadratic

pytestmark = pytest.mark.mpi  # every test here launches mpirun

DIM, WORKERS, LR = 2000, 3, 0.01
DN = ("--dn-outer-lr", "0.8", "--dn-momentum", "0.85")
OPTIONS = {"dn_outer_lr": 0.8, "dn_momentum": 0.85}


def _args(tmp_path, steps: int, *extra: str) -> list[str]:
    return quadratic_args(*DN, *extra, method="dn", dim=DIM, steps=steps, lr=LR,
                          metrics=tmp_path / "run.h5", save=tmp_path / "theta.npy",
                          eval_every=0)


@pytest.mark.parametrize("every, optimizer, h, mode, dylu", [
    (0, "sgd", 1, "wait", False),
    (2, "adamw", 4, "pipelined", False),
    (0, "adamw", 4, "overlap", True),
])
def test_delayed_nesterov_is_the_replay(tmp_path, every, optimizer, h, mode, dylu):
    """N = the workers (0) with one plain step an update; N = 2 with AdamW workers taking 4
    local steps an update (the paper's setting); and with dynamic local updates, worker 3
    made 4 times slower than the others: it takes fewer steps an update than they do (every
    update's steps in the log, the replay taking them from there)."""
    steps = 60
    extra = ("--optimizer", "adamw") if optimizer == "adamw" else ()
    if dylu:
        extra += ("--dylu", "--speeds", "1,1,4")
    res = train(WORKERS + 1, *_args(tmp_path, steps, *extra, "--dn-every", str(every),
                                    "--local-steps", str(h), "--worker-mode", mode))
    assert res.returncode == 0, res.stdout + res.stderr
    u = load_run(tmp_path / "run.h5").updates
    assert_exactly_once(u["worker"], u["seq"], range(1, WORKERS + 1), steps)
    if dylu:
        taken = {w: u["steps"][u["worker"] == w] for w in range(1, WORKERS + 1)}
        assert all(((1 <= t) & (t <= h)).all() for t in taken.values())
        fast = np.concatenate([taken[1], taken[2]])
        assert taken[3].mean() < fast.mean(), {w: t.tolist() for w, t in taken.items()}
        assert fast.max() == h and taken[3].min() < h
    elif h > 1:
        assert (u["steps"] == h).all()
    q, dn = Quadratic(DIM, 0), DnConfig(dn_every=every, **OPTIONS)
    adamw = AdamWConfig() if optimizer == "adamw" else None
    ref = replay(u, q, "dn", LR, window=len(u["worker"]) + 1, adamw=adamw, local_steps=h,
                 dn=dn)
    theta = np.load(tmp_path / "theta.npy")
    assert np.array_equal(theta, ref.theta)  # bit for bit
    plain = replay(u, q, "downpour", LR, window=len(u["worker"]) + 1, adamw=adamw,
                   local_steps=h)
    assert not np.allclose(theta, plain.theta)  # the outer step is not DOWNPOUR's


@pytest.mark.parametrize("dylu", [False, True])
def test_a_stopped_dn_run_resumes_its_momentum(tmp_path, dylu):
    """With --dylu (AdamW workers, 4 local steps, one 3 times slower) the resumed workers
    measure their speeds afresh: the run is still the replay of its log bit for bit."""
    steps, h = (1000, 4) if dylu else (4000, 1)
    extra = ("--optimizer", "adamw", "--local-steps", "4", "--dylu", "--speeds",
             "1,3,1") if dylu else ()
    args = _args(tmp_path, steps, *extra, "--checkpoint-dir", str(tmp_path),
                 "--checkpoint-every", "0.1")
    proc = train_background(WORKERS + 1, *args)
    err = signal_when(proc, checkpoint_after_start(tmp_path))
    assert proc.returncode == 3, err
    res = train(WORKERS + 1, *args, "--resume", "auto", timeout=300)
    assert res.returncode == 0, res.stderr
    assert "delayed Nesterov's momentum restored from the checkpoint" in res.stderr
    u = load_run(tmp_path / "run.h5").updates
    assert u["clock"].tolist() == list(range(WORKERS * steps))
    ref = replay(u, Quadratic(DIM, 0), "dn", LR, dn=DnConfig(**OPTIONS), local_steps=h,
                 adamw=AdamWConfig() if dylu else None)
    assert np.array_equal(np.load(tmp_path / "theta.npy"), ref.theta)
