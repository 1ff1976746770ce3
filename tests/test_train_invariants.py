"""End-to-end invariants of ``python -m gem_mpi.train`` on the deterministic quadratic model.

The quadratic's Δθ depends only on the θ it was computed on, so the HDF5 event log (who,
which version pulled, in which order) is enough to replay the whole asynchronous run in one
process and compare it with what the master produced.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from helpers import PROGS, assert_exactly_once, mpirun, quadratic_args, train

from gem_mpi.algorithm.kernel import HIST_BINS
from gem_mpi.algorithm.reference import replay
from gem_mpi.outputs.runfile import load_run
from gem_mpi.problem.quadratic import Quadratic
from gem_mpi.protocol import WORKER_TIME_SPLIT

pytestmark = pytest.mark.mpi  # every test here launches mpirun or another process

DIM, STEPS, WORKERS, LR, MU = 2000, 60, 4, 0.05, 0.9


def _run(tmp_path, method: str, *extra: str):
    h5, out = tmp_path / "run.h5", tmp_path / "theta.npy"
    res = train(WORKERS + 1, *quadratic_args(*extra, method=method, dim=DIM, steps=STEPS,
                                             lr=LR, momentum=MU, metrics=h5, save=out,
                                             eval_every=50))
    assert res.returncode == 0, res.stdout + res.stderr
    return load_run(h5), np.load(out)


def _check_log(run) -> dict:
    u = run.updates
    n = WORKERS * STEPS
    assert len(u["worker"]) == n  # none lost
    assert_exactly_once(u["worker"], u["seq"], range(1, WORKERS + 1), STEPS)
    assert len(set(u["ticket"].tolist())) == n
    assert u["clock"].tolist() == list(range(n))
    assert np.array_equal(u["staleness"], u["clock"] - u["version_pulled"])
    assert run.summary["updates"] == n and run.summary["finished"] == 1.0
    # each worker's time split arrived with its last message and covers its wall time
    wt = run.worker_time
    assert np.all(wt["wall"] > 0) and len(wt["wall"]) == WORKERS
    parts = sum(wt[k] for k in WORKER_TIME_SPLIT)
    assert np.all(np.isnan(wt["gpu"]))  # CPU workers: the GPU column is not measured
    assert np.all(parts <= wt["wall"] * 1.01)
    return u


@pytest.mark.parametrize("mode", ["wait", "pipelined", "overlap"])
@pytest.mark.parametrize("method", ["downpour", "adaptive"])
def test_final_theta_is_theta0_plus_the_applied_updates(tmp_path, method, mode):
    run, theta_final = _run(tmp_path, method, "--worker-mode", mode)
    u = _check_log(run)
    ref = replay(u, Quadratic(DIM, 0), method, LR)
    # bit for bit in float32: same operations in the same order
    assert np.array_equal(theta_final, ref.theta)
    # the worker losses the master logged are those of the replayed pulls
    np.testing.assert_allclose(u["loss"], ref.losses, rtol=1e-5)


@pytest.mark.parametrize("shift", ["others", "paper"])
@pytest.mark.parametrize("kappa", [1.0, 2.0])
def test_master_side_gem_equals_the_single_process_replay(tmp_path, kappa, shift):
    """The worker-side rule (m, κ|m|) and the master-side π, replayed in one process with
    plain float32 numpy in the master's event order, in either reading of the shift
    (others: |θ − s| counts the other workers' updates; paper: the prototype's s, θ just
    before the worker's previous update, which the master keeps in the worker's slot)."""
    run, theta_final = _run(tmp_path, "gem", "--kappa", str(kappa), "--gem-shift", shift)
    u = _check_log(run)
    ref = replay(u, Quadratic(DIM, 0), "gem", LR, MU, kappa, 5.0, 1e-16, keep_pi=True,
                 window=len(u["worker"]) + 1, shift=shift)
    other = replay(u, Quadratic(DIM, 0), "gem", LR, MU, kappa, 5.0, 1e-16,
                   shift="paper" if shift == "others" else "others")
    assert not np.array_equal(theta_final, other.theta)  # the readings differ here
    theta_sim, pis = ref.theta, ref.pis
    # the same float32 operations in the same order: the same bits
    assert np.array_equal(theta_final, theta_sim)
    sizes = run.tensor_sizes
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
    assert len(run.eval["clock"]) >= 1


@pytest.mark.parametrize("kernel", ["extension", "numpy"])
@pytest.mark.parametrize("shift", ["others", "paper"])
def test_pipelined_gem_workers_equal_the_replay_of_their_event_order(tmp_path, shift, kernel):
    """--worker-mode pipelined (Algorithm 1's order: the next Δθ is computed at the θ pulled
    just before the commit, while the master applies it): the replay of the run's own event
    order gives θ bit for bit in both readings of the shift and both kernels; every update
    after a worker's first was computed before its own previous update was applied, so its
    staleness is at least 1."""
    extra = ["--worker-mode", "pipelined", "--gem-shift", shift]
    run, theta_final = _run(tmp_path, "gem", *extra,
                            *(["--no-extension"] if kernel == "numpy" else []))
    u = _check_log(run)
    ref = replay(u, Quadratic(DIM, 0), "gem", LR, MU, 1.0, 5.0, 1e-16,
                 window=len(u["worker"]) + 1, shift=shift)
    assert np.array_equal(theta_final, ref.theta)
    # Algorithm 1's gradient point: update k was computed at a θ pulled after the worker's
    # update k-2 was applied and before its update k-1 was (θ's version v holds the updates
    # of clocks < v); the wait order would hold k-1 too
    clocks: dict[tuple[int, int], int] = {}
    for w, seq, clock in zip(u["worker"].tolist(), u["seq"].tolist(), u["clock"].tolist()):
        clocks[w, seq] = clock
    for w, seq, pulled in zip(u["worker"].tolist(), u["seq"].tolist(),
                              u["version_pulled"].tolist()):
        if seq >= 1:
            assert pulled <= clocks[w, seq - 1]
        if seq >= 2:
            assert pulled > clocks[w, seq - 2]
    assert (u["staleness"][u["seq"] > 0] >= 1).all()


@pytest.mark.parametrize("kernel", ["extension", "numpy"])
@pytest.mark.parametrize("shift", ["others", "paper"])
def test_overlapped_gem_workers_equal_the_replay_of_their_event_order(tmp_path, shift, kernel):
    """--worker-mode overlap (step k+1 computed while step k is committed and θ_{k+2}
    pulled): the replay of the run's event order gives θ bit for bit in both readings of
    the shift and both kernels, with s each update's own θ; update k was computed at a θ
    pulled after the worker's update k-2 was applied (the pull waits for it) and before its
    update k-1 was: as pipelined, recorded as such."""
    extra = ["--worker-mode", "overlap", "--gem-shift", shift]
    run, theta_final = _run(tmp_path, "gem", *extra,
                            *(["--no-extension"] if kernel == "numpy" else []))
    u = _check_log(run)
    ref = replay(u, Quadratic(DIM, 0), "gem", LR, MU, 1.0, 5.0, 1e-16,
                 window=len(u["worker"]) + 1, shift=shift)
    assert np.array_equal(theta_final, ref.theta)
    clocks = {(w, seq): c for w, seq, c in zip(u["worker"].tolist(), u["seq"].tolist(),
                                                u["clock"].tolist())}
    for w, seq, pulled in zip(u["worker"].tolist(), u["seq"].tolist(),
                              u["version_pulled"].tolist()):
        if seq >= 1:
            assert pulled <= clocks[w, seq - 1]
        if seq >= 2:
            assert pulled > clocks[w, seq - 2]
    assert (u["staleness"][u["seq"] > 0] >= 1).all()


@pytest.mark.parametrize("mode, shift, at", [("overlap", "others", "own"),
                                             ("pipelined", "paper", "own"),
                                             ("overlap", "others", "pulled")])
def test_a_worker_s_gradient_point_is_the_replay_s(tmp_path, mode, shift, at):
    """--gradient-at own (the default): a pipelined or overlapped gradient is taken at the θ
    pulled plus the worker's own update in flight, s staying the θ pulled; pulled: at s. The
    replay told the point gives θ bit for bit, the replay told the other does not."""
    run, theta_final = _run(tmp_path, "gem", "--worker-mode", mode, "--gem-shift", shift,
                            "--gradient-at", at)
    u = _check_log(run)
    other = "pulled" if at == "own" else "own"
    ref, wrong = (replay(u, Quadratic(DIM, 0), "gem", LR, MU, 1.0, 5.0, 1e-16,
                         window=len(u["worker"]) + 1, shift=shift, gradient_at=point)
                  for point in (at, other))
    assert np.array_equal(theta_final, ref.theta)
    assert not np.array_equal(theta_final, wrong.theta)


@pytest.mark.parametrize("shift, mode, kernel", [
    ("others", "wait", "extension"), ("paper", "wait", "extension"),
    ("others", "wait", "numpy"), ("paper", "wait", "numpy"),
    ("others", "pipelined", "extension"), ("paper", "pipelined", "numpy"),
    ("others", "overlap", "numpy"), ("paper", "overlap", "extension")])
def test_global_proxy_equals_the_single_process_replay(tmp_path, shift, mode, kernel):
    """--gem-proxy global: one m at the master, every applied Δθ folded into it in clock
    order with μ_g = μ^(1/n), c = (1 − μ_g)/(1 − μ); the replay of the run's event order
    gives θ bit for bit in both readings of the shift, both worker orders and both kernels,
    and the local proxy's replay of the same log does not."""
    extra = ["--gem-proxy", "global", "--gem-shift", shift, "--worker-mode", mode,
             *(["--no-extension"] if kernel == "numpy" else [])]
    run, theta_final = _run(tmp_path, "gem", *extra)
    u = _check_log(run)
    assert run.config["gem_proxy"] == "global"
    ref = replay(u, Quadratic(DIM, 0), "gem", LR, MU, 1.0, 5.0, 1e-16,
                 window=len(u["worker"]) + 1, shift=shift, proxy="global", n_workers=WORKERS)
    assert np.array_equal(theta_final, ref.theta)
    local = replay(u, Quadratic(DIM, 0), "gem", LR, MU, 1.0, 5.0, 1e-16,
                   window=len(u["worker"]) + 1, shift=shift)
    assert not np.array_equal(theta_final, local.theta)
    pi = u["pi_median"]
    assert ((pi > 0.0) & (pi < 5.0)).any() and np.all(u["energy_proxy"] > 0)


@pytest.mark.parametrize("shift", ["others", "paper"])
def test_one_worker_global_proxy_is_local_gem_bit_for_bit(tmp_path, shift):
    """With one worker μ_g = μ and c = 1: the master's m is the worker's, so θ and every
    recorded statistic of the run are local GEM's, bit for bit."""
    runs = {}
    for proxy in ("local", "global"):
        h5, out = tmp_path / f"{proxy}.h5", tmp_path / f"{proxy}.npy"
        res = train(2, *quadratic_args("--gem-proxy", proxy, "--gem-shift", shift,
                                       method="gem", dim=DIM, steps=STEPS, lr=LR,
                                       momentum=MU, metrics=h5, save=out, eval_every=0))
        assert res.returncode == 0, res.stdout + res.stderr
        runs[proxy] = (load_run(h5).updates, np.load(out))
    (ul, tl), (ug, tg) = runs["local"], runs["global"]
    assert np.array_equal(tl.view(np.uint32), tg.view(np.uint32))
    for col in ("version_pulled", "pi_median", "clamp_frac", "clamp_low", "zero_delta",
                "pi_median_all", "energy_central", "energy_proxy", "loss"):
        nan = ul[col].dtype.kind == "f"
        assert np.array_equal(ul[col], ug[col], equal_nan=nan), col
    assert len(ul["clock"]) == STEPS and ((ug["pi_median"] > 0) & (ug["pi_median"] < 5)).any()


def test_a_rejected_update_leaves_the_global_proxy_untouched(tmp_path):
    """Worker 2's every 5th Δθ holds a NaN or an Inf. With the global proxy the worker keeps no
    m, so only those are rejected; and since a rejected update touches neither θ nor the
    master's m, the replay of the applied updates alone gives θ bit for bit."""
    h5, out = tmp_path / "run.h5", tmp_path / "theta.npy"
    res = mpirun(WORKERS + 1, [str(PROGS / "poison_worker.py"), "2",
                               *quadratic_args("--gem-proxy", "global", method="gem", dim=DIM,
                                               steps=STEPS, lr=LR, momentum=MU, metrics=h5,
                                               save=out, eval_every=0)], timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    run = load_run(h5)
    bad_seqs = list(range(4, STEPS, 5))
    assert sorted(run.other["rejected"]["seq"].tolist()) == bad_seqs
    u = run.updates
    assert len(u["worker"]) == WORKERS * STEPS - len(bad_seqs)
    ref = replay(u, Quadratic(DIM, 0), "gem", LR, MU, window=len(u["worker"]) + 1,
                 proxy="global", n_workers=WORKERS)
    assert np.array_equal(np.load(out), ref.theta)


@pytest.mark.parametrize("method", ["gem", "downpour"])
def test_poisoned_updates_are_rejected_whole_and_counted(tmp_path, method):
    h5, out = tmp_path / "run.h5", tmp_path / "theta.npy"
    res = mpirun(WORKERS + 1, [str(PROGS / "poison_worker.py"), "2",
                               *quadratic_args(method=method, dim=DIM, steps=STEPS, metrics=h5,
                                               save=out)], timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    run = load_run(h5)
    # DOWNPOUR: every 5th update of worker 2. GEM: from the first one on, since the NaN
    # also entered that worker's momentum m and so every later κ|m| it sends.
    bad_seqs = list(range(4, STEPS, 5)) if method == "downpour" else list(range(4, STEPS))
    poisoned = len(bad_seqs)
    assert run.summary["rejected"] == poisoned
    assert run.summary["updates"] == WORKERS * STEPS - poisoned
    assert set(run.other["rejected"]["worker"].tolist()) == {2}
    assert sorted(run.other["rejected"]["seq"].tolist()) == bad_seqs
    assert np.isfinite(np.load(out)).all()  # θ never saw a NaN
    assert "of worker 2: it holds NaN or Inf" in res.stderr
    assert f"{poisoned} rejected updates" in res.stderr
    # the applied ones are all the others, each exactly once
    applied = set(zip(run.updates["worker"].tolist(), run.updates["seq"].tolist()))
    assert len(applied) == WORKERS * STEPS - poisoned
