"""End-to-end invariants of ``python -m gem_mpi.train`` on the deterministic quadratic model.

The quadratic's Δθ depends only on the θ it was computed on, so the HDF5 event log (who,
which version pulled, in which order) is enough to replay the whole asynchronous run in one
process and compare it with what the master produced.
"""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest
from conftest import PROGS, mpirun, train

from gem_mpi.gem import HIST_BINS
from gem_mpi.metrics import read_run
from gem_mpi.quadratic import Quadratic

DIM, STEPS, WORKERS, LR, MU = 2000, 60, 4, 0.05, 0.9


def _run(tmp_path, method: str, *extra: str) -> tuple[dict, np.ndarray]:
    h5, out = tmp_path / "run.h5", tmp_path / "theta.npy"
    res = train(WORKERS + 1, "--model", "quadratic", "--dataset", "synthetic", "--method",
                method, "--quadratic-dim", str(DIM), "--max-steps", str(STEPS), "--lr", str(LR),
                "--momentum", str(MU), "--metrics", str(h5), "--save", str(out),
                "--eval-every", "50", *extra)
    assert res.returncode == 0, res.stdout + res.stderr
    return read_run(str(h5)), np.load(out)


def _check_log(run: dict) -> dict:
    u = run["updates"]
    n = WORKERS * STEPS
    assert len(u["worker"]) == n  # none lost
    pairs = Counter(zip(u["worker"].tolist(), u["seq"].tolist()))
    assert set(pairs) == {(w, s) for w in range(1, WORKERS + 1) for s in range(STEPS)}
    assert max(pairs.values()) == 1  # none applied twice
    assert len(set(u["ticket"].tolist())) == n
    assert u["clock"].tolist() == list(range(n))
    assert np.array_equal(u["staleness"], u["clock"] - u["version_pulled"])
    assert run["summary"]["updates"] == n and run["summary"]["finished"] == 1.0
    return u


def replay_fixed(u: dict, dim: int, lr: float, method: str) -> tuple[np.ndarray, list]:
    """Replay a DOWNPOUR/adaptive quadratic run from its log: (final θ, losses at the pulls).

    Keeps only the recent versions of θ a pull can still refer to, so long runs fit.
    """
    q = Quadratic(dim, 0)
    targets = {w: q.target(w) for w in set(u["worker"].tolist())}
    versions = {0: q.theta0()}
    theta = q.theta0()
    losses = []
    for clock, (w, pulled, tau) in enumerate(zip(u["worker"], u["version_pulled"],
                                                 u["staleness"])):
        s = versions[pulled]  # the θ this worker pulled: exact version label
        losses.append(0.5 * float(np.dot(q.h * (s - targets[w]), s - targets[w])))
        delta = np.float32(-lr) * (q.h * (s - targets[w]))
        scale = 1.0 / (tau + 1.0) if method == "adaptive" else 1.0
        theta = theta + np.float32(scale) * delta
        versions[clock + 1] = theta
        versions.pop(clock - 1000, None)
    return theta, losses


@pytest.mark.parametrize("method", ["downpour", "adaptive"])
def test_final_theta_is_theta0_plus_the_applied_updates(tmp_path, method):
    run, theta_final = _run(tmp_path, method)
    u = _check_log(run)
    theta, losses = replay_fixed(u, DIM, LR, method)
    # bit for bit in float32: same operations in the same order
    assert np.array_equal(theta_final, theta)
    # the worker losses the master logged are those of the replayed pulls
    np.testing.assert_allclose(u["loss"], losses, rtol=1e-5)


def _algorithm1(u: dict, kappa: float, pi_max: float, eps: float) -> tuple[np.ndarray, list]:
    """The paper's worker-side Algorithm 1, driven by the master's event order.

    Each worker keeps m and its last pull s; at its commit it pulls the fresh central
    variable (here: θ at the moment the master applied the update) and scales its own Δθ.
    Plain float32 numpy, one operation at a time, as the paper writes it.
    """
    f32 = np.float32
    q = Quadratic(DIM, 0)
    theta = q.theta0()
    history = [theta]
    m = {w: np.zeros(DIM, f32) for w in range(1, WORKERS + 1)}
    pis = []
    for w, pulled in zip(u["worker"], u["version_pulled"]):
        s = history[pulled]
        delta = f32(-LR) * (q.h * (s - q.target(w)))
        m[w] = f32(MU) * m[w] + delta
        fresh = theta  # θ ← pull()
        pi = (f32(kappa) * np.abs(m[w]) - np.abs(fresh - s)) / (np.abs(delta) + f32(eps))
        pi = np.clip(pi, f32(0.0), f32(pi_max))
        theta = theta + pi * delta
        history.append(theta)
        pis.append(pi)
    return theta, pis


@pytest.mark.parametrize("kappa", [1.0, 2.0])
def test_master_side_gem_equals_worker_side_algorithm1(tmp_path, kappa):
    run, theta_final = _run(tmp_path, "gem", "--kappa", str(kappa))
    u = _check_log(run)
    theta_sim, pis = _algorithm1(u, kappa, 5.0, 1e-16)
    # the same float32 operations in the same order: the same bits
    assert np.array_equal(theta_final, theta_sim)
    sizes = run["tensors"]["size"]
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    def lower_median(x):
        k = (len(x) - 1) // 2
        return np.partition(x, k)[k]

    sim_medians = np.array([[lower_median(p[a:b]) for a, b in itertools.pairwise(bounds)]
                            for p in pis])
    # the master reads medians off a histogram: exact to within one bin, π_max / HIST_BINS
    assert np.abs(u["pi_median"] - sim_medians).max() <= 5.0 / HIST_BINS + 1e-3
    # GEM actually scaled: π is neither stuck at 0 nor always at π_max
    pi = u["pi_median"]
    assert ((pi > 0.0) & (pi < 5.0)).any() and (pi == 5.0).any()
    assert np.all(u["energy_proxy"] > 0)
    assert len(run["eval"]["clock"]) >= 1


@pytest.mark.parametrize("method", ["gem", "downpour"])
def test_poisoned_updates_are_rejected_whole_and_counted(tmp_path, method):
    h5, out = tmp_path / "run.h5", tmp_path / "theta.npy"
    res = mpirun(WORKERS + 1, [str(PROGS / "poison_worker.py"), "2", "--model", "quadratic",
                               "--dataset", "synthetic", "--method", method, "--quadratic-dim",
                               str(DIM), "--max-steps", str(STEPS), "--metrics", str(h5),
                               "--save", str(out)], timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    run = read_run(str(h5))
    # DOWNPOUR: every 5th update of worker 2. GEM: from the first one on, since the NaN
    # also entered that worker's momentum m and so every later κ|m| it sends.
    bad_seqs = list(range(4, STEPS, 5)) if method == "downpour" else list(range(4, STEPS))
    poisoned = len(bad_seqs)
    assert run["summary"]["rejected"] == poisoned
    assert run["summary"]["updates"] == WORKERS * STEPS - poisoned
    assert set(run["rejected"]["worker"].tolist()) == {2}
    assert sorted(run["rejected"]["seq"].tolist()) == bad_seqs
    assert np.isfinite(np.load(out)).all()  # θ never saw a NaN
    assert "of worker 2: it holds NaN or Inf" in res.stderr
    assert f"{poisoned} rejected updates" in res.stderr
    # the applied ones are all the others, each exactly once
    applied = set(zip(run["updates"]["worker"].tolist(), run["updates"]["seq"].tolist()))
    assert len(applied) == WORKERS * STEPS - poisoned
