"""A torch worker's steps in the overlap order's bookkeeping (two gradient and Δθ buffers
taking turns, Δθ = −ηg made by ``settle`` on the other thread, θ in three buffers) give the
Δθ of the plain one-buffer steps bit for bit, step after step: the replay tests run the
quadratic, whose steps are numpy, so this holds the torch path to the same exactness."""

from __future__ import annotations

import numpy as np
import pytest

from gem_mpi.config import Config
from gem_mpi.engine.steps import TorchSteps
from gem_mpi.problem import build_problem
from gem_mpi.run.rank import Placement

pytest.importorskip("torch")


@pytest.mark.parametrize("schedule", ["constant", "cosine"])
def test_overlapped_steps_equal_the_plain_ones(schedule):
    cfg = Config.of(model="mnist-cnn", dataset="synthetic", synthetic_size=64, batch_size=8,
                    max_steps=6, lr_schedule=schedule, lr_decay_steps=6, threads=1)
    place = Placement(0, 1)
    problem = build_problem(cfg.data, with_theta0=True)
    theta0 = problem.theta0.astype(np.float32)
    plain = TorchSteps(cfg, build_problem(cfg.data, with_theta0=False), 1, 1, place)
    turns = TorchSteps(cfg, build_problem(cfg.data, with_theta0=False), 1, 1, place,
                       overlapped=True)
    thetas = [theta0.copy() for _ in range(3)]  # the overlap order's three θ buffers
    rng = np.random.default_rng(0)
    pending = None
    for seq in range(6):
        theta = thetas[seq % 3]
        theta[...] = theta0 + np.float32(1e-3) * rng.standard_normal(theta0.size,
                                                                      dtype=np.float32)
        want, want_loss = plain(theta.copy(), seq)
        want = want.copy()
        got, loss = turns(theta, seq)
        assert got is None  # Δθ is the sending thread's to make
        if pending is not None:  # the previous step settled after this one computed
            prev_seq, prev_want = pending
            assert np.array_equal(turns.settle(prev_seq, None), prev_want)
        pending = (seq, want)
        assert loss == want_loss
    prev_seq, prev_want = pending
    assert np.array_equal(turns.settle(prev_seq, None), prev_want)
    plain.close()
    turns.close()
