"""θ sharded over K master ranks (--masters K), under real mpirun.

Every rule is element-wise and the quadratic's Δθ of an element depends only on that
element of the θ it was computed on, so each shard's own event log (the metrics file's
``updates`` for shard 0, ``shard<k>`` for shard k) replays that shard's slice of θ in one
process, bit for bit, whatever order the other shards applied the same updates in.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import h5py
import numpy as np
import pytest
from helpers import (
    PROGS,
    QuadraticSlice,
    assert_exactly_once,
    checkpoint_after_start,
    kill_job,
    mpirun,
    quadratic_args,
    rank_pids,
    signal_when,
    train,
    train_background,
    wait_until,
)

from gem_mpi.algorithm.reference import replay
from gem_mpi.engine.shards import shard_cut
from gem_mpi.outputs import checkpoint
from gem_mpi.outputs.runfile import load_run
from gem_mpi.problem.quadratic import Quadratic

pytestmark = pytest.mark.mpi  # every test here launches mpirun or another process

DIM, WORKERS, LR, MU = 2000, 4, 0.05, 0.9
# stop/kill at the 1st checkpoint: by update ~1500 here, ~6000 at 4× the speed; budget 16000
CKPT_STEPS, EVERY = 4000, 0.1


def shard_bounds(masters: int) -> list[tuple[int, int]]:
    _, sizes = Quadratic(DIM, 0).tensors()
    ends = np.concatenate([[0], np.cumsum(sizes)])
    return [(int(ends[a]), int(ends[b])) for a, b in shard_cut(sizes, masters)]


def shard_logs(path: Path, masters: int) -> list[dict[str, np.ndarray]]:
    run = load_run(path)
    return [run.updates, *[run.other[f"shard{k}"] for k in range(1, masters)]]


def assert_shards_replay(path: Path, theta: np.ndarray, masters: int, method: str,
                         steps: int, **rule: object) -> None:
    """Each shard applied every update once, on its own clock, and its slice of θ is the
    replay of its own event order; the orders are the shards' own (they may differ)."""
    q = Quadratic(DIM, 0)
    for k, (u, (lo, hi)) in enumerate(zip(shard_logs(path, masters), shard_bounds(masters))):
        assert_exactly_once(u["worker"], u["seq"], range(1, WORKERS + 1), steps)
        assert u["clock"].tolist() == list(range(WORKERS * steps)), k
        assert np.array_equal(u["staleness"], u["clock"] - u["version_pulled"])
        ref = replay(u, QuadraticSlice(q, lo, hi), method, LR, window=len(u["worker"]) + 1,
                     **rule)
        assert np.array_equal(theta[lo:hi], ref.theta), f"shard {k}"


def _run(tmp: Path, masters: int, method: str, steps: int, *extra: str):
    h5, out = tmp / "run.h5", tmp / "theta.npy"
    res = train(WORKERS + masters, *quadratic_args(
        "--masters", str(masters), *extra, method=method, dim=DIM, steps=steps, lr=LR,
        momentum=MU, metrics=h5, save=out, eval_every=50))
    assert res.returncode == 0, res.stdout + res.stderr
    return h5, np.load(out), res.stderr


@pytest.mark.parametrize("shift", ["others", "paper"])
@pytest.mark.parametrize("masters", [2, 3])
def test_each_shard_replays_its_own_event_order_bit_for_bit(tmp_path, masters, shift):
    """GEM over 2 or 3 shards (the 3-shard runs overlapped: each shard's slice of θ pulled
    into its slice of the buffer the compute thread does not hold)."""
    steps = 60
    mode = "overlap" if masters == 3 else "wait"
    h5, theta, err = _run(tmp_path, masters, "gem", steps, "--gem-shift", shift,
                          "--worker-mode", mode)
    assert f"{masters} masters (θ's shards: " in err
    assert_shards_replay(h5, theta, masters, "gem", steps, momentum=MU, kappa=1.0,
                         pi_max=5.0, eps=1e-16, shift=shift)
    with h5py.File(h5) as f:
        assert f["summary/shard_clock"][()].tolist() == [WORKERS * steps] * masters
        assert f.attrs["masters"] == masters
    # each shard's per-tensor statistics are its own tensors'; the others' columns are NaN
    _, sizes = Quadratic(DIM, 0).tensors()
    for u, (a, b) in zip(shard_logs(h5, masters), shard_cut(sizes, masters)):
        pi = u["pi_median"]
        assert np.isfinite(pi[:, a:b]).all()
        assert np.isnan(np.delete(pi, np.s_[a:b], axis=1)).all()


@pytest.mark.parametrize("shift", ["others", "paper"])
def test_the_global_proxy_replays_each_shards_own_event_order_bit_for_bit(tmp_path, shift):
    """--gem-proxy global: each shard keeps the master's m for its slice of θ and folds its
    slice of every unscaled Δθ in its own order, so each slice is a one-master global run."""
    steps = 60
    h5, theta, _ = _run(tmp_path, 2, "gem", steps, "--gem-proxy", "global",
                        "--gem-shift", shift)
    assert_shards_replay(h5, theta, 2, "gem", steps, momentum=MU, kappa=1.0, pi_max=5.0,
                         eps=1e-16, shift=shift, proxy="global", n_workers=WORKERS)
    for u in shard_logs(h5, 2):  # each shard's own m, folded from its first update on
        assert (u["energy_proxy"] > 0).all()


@pytest.mark.parametrize("mode", ["wait", "pipelined", "overlap"])
def test_adaptive_staleness_takes_each_shards_own_tau(tmp_path, mode):
    """1/(τ+1) with τ the staleness on the shard applying it (its own clock)."""
    steps = 60
    h5, theta, _ = _run(tmp_path, 2, "adaptive", steps, "--worker-mode", mode)
    assert_shards_replay(h5, theta, 2, "adaptive", steps)


def _ckpt_args(tmp: Path, method: str, steps: int, *extra: str) -> list[str]:
    return quadratic_args("--masters", "2", *extra, method=method, dim=DIM, steps=steps,
                          lr=LR, metrics=tmp / "run.h5", save=tmp / "theta.npy",
                          checkpoint_dir=tmp, checkpoint_every=EVERY, eval_every=0,
                          pi_max=50.0)


def _has_checkpoint(tmp: Path):
    return checkpoint_after_start(tmp)


def _stop(tmp: Path, args: list[str]) -> None:
    """SIGUSR1 at the first checkpoint: rank 0 cuts every shard at the same updates."""
    proc = train_background(WORKERS + 2, *args)
    err = signal_when(proc, _has_checkpoint(tmp))
    assert proc.returncode == 3, err
    assert err.count("stopped by signal 10 at update") == 1
    with h5py.File(checkpoint.latest(str(tmp))) as f:
        clocks = f["shard_clock"][()].tolist()
        next_seq = f["next_seq"][()]
    assert clocks == [int(next_seq.sum())] * 2  # one cut: the same updates on each shard


def _kill_worker_2(tmp: Path, args: list[str], after: int = 0) -> str:
    """SIGKILL worker 2 (rank 3) once the run has a checkpoint of more than ``after``
    updates: the job must end, not hang. Returns its stderr."""
    proc = train_background(WORKERS + 2, *args)
    try:
        wait_until(proc, checkpoint_after_start(tmp, after=after))
        ranks = rank_pids(proc)
        assert set(ranks) == set(range(WORKERS + 2))
        os.kill(ranks[3], signal.SIGKILL)  # worker 2
        err = proc.communicate(timeout=60)[1]  # the job must end, not hang
    finally:
        if proc.poll() is None:
            kill_job(proc)
    assert proc.returncode != 0
    return err


def test_stop_and_resume_is_exact_on_every_shard(tmp_path):
    """SIGUSR1: rank 0 cuts every shard at the same updates, checkpoints, and every rank
    exits 3; the resume continues each shard's clock, tickets and θ, and each worker's m:
    the whole log of each shard replays its slice bit for bit. (The global proxy's stop:
    below; another cut of θ refused: tests/unit/test_checkpoint_state.py.)"""
    steps = CKPT_STEPS
    args = _ckpt_args(tmp_path, "gem", steps, "--gem-proxy", "local")
    _stop(tmp_path, args)
    assert len(list(tmp_path.glob("momentum_w*.h5"))) == WORKERS
    with h5py.File(checkpoint.latest(str(tmp_path))) as f:
        assert "proxy_m" not in f
    res = train(WORKERS + 2, *args, "--resume", "auto", timeout=300)
    assert res.returncode == 0, res.stderr
    assert f"worker momentum restored for {WORKERS} of {WORKERS} workers" in res.stderr
    assert_shards_replay(tmp_path / "run.h5", np.load(tmp_path / "theta.npy"), 2, "gem",
                         steps, momentum=0.9, pi_max=50.0, proxy="local", n_workers=WORKERS)


def test_global_proxy_stop_then_killed_worker_then_resume_is_exact_on_every_shard(tmp_path):
    """--gem-proxy global over 2 shards, one run stopped (SIGUSR1), resumed, then worker 2
    SIGKILLed and resumed again from the last periodic checkpoint: each shard's slice of the
    master's m gathered into the checkpoint's one ``proxy_m`` and scattered back, the workers
    keeping nothing; the whole log of each shard replays its slice bit for bit."""
    steps = CKPT_STEPS
    args = _ckpt_args(tmp_path, "gem", steps, "--gem-proxy", "global")
    _stop(tmp_path, args)
    assert not list(tmp_path.glob("momentum_w*.h5"))
    state = checkpoint.load(checkpoint.latest(str(tmp_path)))
    assert state.proxy_m.shape == (DIM,)  # m whole, both shards' slices folded
    assert all((state.proxy_m[lo:hi] != 0).any() for lo, hi in shard_bounds(2))
    err = _kill_worker_2(tmp_path, [*args, "--resume", "auto"], after=state.clock)
    assert "the global proxy's m restored from the checkpoint" in err
    res = train(WORKERS + 2, *args, "--resume", "auto", timeout=300)
    assert res.returncode == 0, res.stderr
    assert "the global proxy's m restored from the checkpoint" in res.stderr
    assert load_run(tmp_path / "run.h5").attrs["resumes"] >= 2
    assert_shards_replay(tmp_path / "run.h5", np.load(tmp_path / "theta.npy"), 2, "gem",
                         steps, momentum=0.9, pi_max=50.0, proxy="global", n_workers=WORKERS)


def test_killed_worker_then_resume_applies_every_update_once_on_every_shard(tmp_path):
    """A crash: the resume starts from the last periodic checkpoint, exact for DOWNPOUR (and
    for GEM's global proxy, above)."""
    steps = CKPT_STEPS
    args = _ckpt_args(tmp_path, "downpour", steps)
    _kill_worker_2(tmp_path, args)
    res = train(WORKERS + 2, *args, "--resume", "auto", timeout=300)
    assert res.returncode == 0, res.stderr
    assert load_run(tmp_path / "run.h5").attrs["resumes"] >= 1
    assert_shards_replay(tmp_path / "run.h5", np.load(tmp_path / "theta.npy"), 2, "downpour",
                         steps)


@pytest.mark.parametrize("method", ["gem", "downpour"])
def test_a_poisoned_update_is_rejected_by_every_shard_alike(tmp_path, method):
    """The NaN or Inf is in one element, so in one shard's part only: the worker poisons
    every shard's part, and each shard rejects the same updates and applies the others."""
    steps, masters = 60, 2
    h5, out = tmp_path / "run.h5", tmp_path / "theta.npy"
    res = mpirun(WORKERS + masters, [str(PROGS / "poison_worker.py"), "3",  # worker 2
                                     *quadratic_args("--masters", str(masters), method=method,
                                                     dim=DIM, steps=steps, metrics=h5,
                                                     save=out)], timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    bad = list(range(4, steps, 5)) if method == "downpour" else list(range(4, steps))
    run = load_run(h5)
    assert sorted(run.other["rejected"]["seq"].tolist()) == bad
    assert set(run.other["rejected"]["worker"].tolist()) == {2}
    applied = {(w, s) for w in range(1, WORKERS + 1) for s in range(steps)} - {
        (2, s) for s in bad}
    for u in shard_logs(h5, masters):
        assert set(zip(u["worker"].tolist(), u["seq"].tolist())) == applied
        assert len(u["worker"]) == len(applied)
    with h5py.File(h5) as f:
        assert f["summary/shard_rejected"][()].tolist() == [len(bad)] * masters
        assert f["summary/shard_clock"][()].tolist() == [len(applied)] * masters
    assert np.isfinite(np.load(out)).all()


def test_mnist_cnn_learns_with_two_masters(tmp_path):
    """The paper's net on Fashion-MNIST, θ cut between its tensors over 2 masters; the
    evaluation and the saved model are θ gathered from both."""
    h5, model_path = tmp_path / "run.h5", tmp_path / "model.pt"
    res = train(5, "--masters", "2", "--max-steps", "150", "--eval-every", "200",
                "--metrics", str(h5), "--save", str(model_path), timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "done: 450 updates" in res.stderr
    run = load_run(h5)
    u = run.updates
    assert u["loss"][-100:].mean() < 0.6 * u["loss"][:20].mean()
    assert run.summary["test_accuracy"] > 0.70
    assert len(run.other["shard1"]["worker"]) == 450


def test_bad_masters_is_one_line_from_rank_0_and_exit_2():
    """One job for the path from rank 0's check to every rank's exit 2; the cases are
    tests/unit/test_refusals.py's, in-process."""
    res = train(4, *quadratic_args("--masters", "4", dim=DIM, steps=5), timeout=120)
    assert res.returncode == 2, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("gem_mpi: error")]
    assert len(lines) == 1 and "--masters 4 needs at least 5 MPI ranks" in lines[0], res.stderr
    assert "Traceback" not in res.stderr
