"""Checkpoint, stop and resume under real mpirun: nothing lost, nothing applied twice.

DOWNPOUR on the quadratic is replayable from the HDF5 log, so after a stop (SIGUSR1) or a
crash (SIGKILL of a worker) and a resume, the final θ must equal the replay of the log of
the whole run, bit for bit, and every worker update must appear in it exactly once.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np
import pytest
from helpers import (
    assert_exactly_once,
    checkpoint_after_start,
    kill_job,
    kill_rank_when,
    quadratic_args,
    rank_pids,
    signal_when,
    train,
    train_background,
    wait_until,
)

from gem_mpi.algorithm.reference import replay
from gem_mpi.outputs import checkpoint
from gem_mpi.outputs.runfile import load_run
from gem_mpi.problem.quadratic import Quadratic

pytestmark = pytest.mark.mpi  # every test here launches mpirun or another process

DIM, WORKERS, LR = 2000, 4, 0.05
# stop/kill at the 1st checkpoint: by update ~1500 here, ~6000 at 4× the speed; budget 16000
STEPS, EVERY = 4000, 0.1


def _args(tmp: Path, *extra: str) -> list[str]:
    return quadratic_args(*extra, method="downpour", dim=DIM, steps=STEPS, lr=LR,
                          metrics=tmp / "run.h5", save=tmp / "theta.npy", checkpoint_dir=tmp,
                          checkpoint_every=EVERY, eval_every=0)


def _has_checkpoint(tmp: Path) -> Callable[[], bool]:
    return checkpoint_after_start(tmp)


def _check_whole_run(tmp: Path, steps: int = STEPS) -> None:
    run = load_run(tmp / "run.h5")
    u = run.updates
    assert run.summary["finished"] == 1.0
    assert run.attrs["resumes"] >= 1
    assert_exactly_once(u["worker"], u["seq"], range(1, WORKERS + 1), steps)
    assert u["clock"].tolist() == list(range(WORKERS * steps))
    assert np.all(np.diff(u["time"]) >= 0)  # the clock and the times continue
    ref = replay(u, Quadratic(DIM, 0), "downpour", LR)
    assert np.array_equal(np.load(tmp / "theta.npy"), ref.theta)


def test_stop_signal_checkpoints_and_resume_finishes_exactly(tmp_path):
    proc = train_background(WORKERS + 1, *_args(tmp_path))
    err = signal_when(proc, _has_checkpoint(tmp_path))  # SIGUSR1: Slurm's --signal=B:USR1
    assert proc.returncode == 3, err
    assert err.count("stopped by signal 10 at update") == 1
    assert "Traceback" not in err
    stopped = load_run(tmp_path / "run.h5")
    assert stopped.summary["finished"] == 0.0  # readable, and says it is unfinished
    assert 0 < stopped.summary["updates"] < WORKERS * STEPS
    ckpts = list(tmp_path.glob("checkpoint_*.h5"))
    # the newest and the one before it (--keep-checkpoints 2), no temporary file
    assert 1 <= len(ckpts) <= 2 and not list(tmp_path.glob("*.tmp"))
    res = train(WORKERS + 1, *_args(tmp_path, "--resume", "auto"), timeout=300)
    assert res.returncode == 0, res.stderr
    assert "resuming" in res.stderr
    _check_whole_run(tmp_path)


def test_sigterm_to_the_whole_job_leaves_a_checkpoint_and_resume_finishes(tmp_path):
    """What a scheduler does at a time limit or a cancel: SIGTERM to every process of the job
    (mpirun and the ranks). The master checkpoints at once; mpirun then ends the ranks."""
    # mpirun passes SIGTERM on 1 s late: ~7000 updates here, ~27000 at 4× the speed, of 60000
    steps = 15000
    proc = train_background(WORKERS + 1, *_args(tmp_path, "--max-steps", str(steps)))
    first: list[str | None] = []

    def ready() -> bool:
        first.append(checkpoint.latest(str(tmp_path)))
        return first[-1] is not None

    err = signal_when(proc, ready, signal.SIGTERM, whole_job=True)
    assert proc.returncode != 0
    assert "stopped by signal 15 at update" in err  # the master's own stop checkpoint
    assert checkpoint.latest(str(tmp_path)) != first[-1]
    assert not list(tmp_path.glob("*.tmp"))
    res = train(WORKERS + 1, *_args(tmp_path, "--max-steps", str(steps), "--resume", "auto"),
                timeout=300)
    assert res.returncode == 0, res.stderr
    _check_whole_run(tmp_path, steps)


@pytest.mark.parametrize("mode", ["wait", "pipelined", "overlap"])
def test_killed_worker_ends_the_job_and_resume_recovers(tmp_path, mode):
    """Pipelined or overlapped, the killed worker may have had an update in flight (and,
    overlapped, the next one computed): applied at most once before the kill, and every
    update exactly once after the resume."""
    proc = train_background(WORKERS + 1, *_args(tmp_path, "--worker-mode", mode))
    try:
        wait_until(proc, _has_checkpoint(tmp_path))
        ranks = rank_pids(proc)
        assert set(ranks) == set(range(WORKERS + 1))
        t0 = time.monotonic()
        os.kill(ranks[2], signal.SIGKILL)
        _, err = proc.communicate(timeout=30)  # the job must end, not hang
        ended = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            kill_job(proc)
    assert proc.returncode != 0
    assert ended < 30
    assert "rank 2" in err  # mpirun names the rank that died
    res = train(WORKERS + 1, *_args(tmp_path, "--worker-mode", mode, "--resume", "auto"),
                timeout=300)
    assert res.returncode == 0, res.stderr
    _check_whole_run(tmp_path)


def test_killed_master_leaves_a_metrics_file_the_resume_continues(tmp_path):
    """SIGKILL of rank 0 (a node lost, an OOM kill) leaves the metrics file marked open for
    writing; the resume must still continue it, with nothing lost or repeated."""
    proc = train_background(WORKERS + 1, *_args(tmp_path))
    assert kill_rank_when(proc, _has_checkpoint(tmp_path), 0) != 0
    res = train(WORKERS + 1, *_args(tmp_path, "--resume", "auto"), timeout=300)
    assert res.returncode == 0, res.stderr
    _check_whole_run(tmp_path)


@pytest.fixture(scope="module")
def short_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished run of 200 steps per worker (its checkpoint, metrics file and θ), which the
    refusal tests below copy what they change from."""
    tmp = tmp_path_factory.mktemp("short")
    res = train(WORKERS + 1, *_args(tmp, "--max-steps", "200"), timeout=120)
    assert res.returncode == 0, res.stderr
    return tmp


def test_incompatible_or_corrupt_checkpoint_is_one_line(tmp_path, short_run):
    shutil.copytree(short_run, tmp_path, dirs_exist_ok=True)
    ckpt = next(tmp_path.glob("checkpoint_*.h5"))
    other = train(WORKERS + 1, *_args(tmp_path, "--max-steps", "200", "--quadratic-dim", "3000",
                                      "--resume", str(ckpt)), timeout=120)
    assert other.returncode == 2, other.stderr  # refused before it started
    assert other.stderr.count("--quadratic-dim was 2000, now 3000") == 1
    assert "Traceback" not in other.stderr
    bad = tmp_path / "bad.h5"
    bad.write_bytes(b"not hdf5 at all" * 10)
    res = train(WORKERS + 1, *_args(tmp_path, "--resume", str(bad)), timeout=120)
    assert res.returncode == 2, res.stderr
    assert res.stderr.count("not a readable checkpoint") == 1
    assert "Traceback" not in res.stderr


PI_MAX = 50.0  # high enough that π is rarely clamped: θ then depends on every bit of m


def _gem_args(tmp: Path, steps: int, *extra: str) -> list[str]:
    args = [a if a != "downpour" else "gem" for a in _args(tmp, "--pi-max", str(PI_MAX), *extra)]
    args[args.index("--max-steps") + 1] = str(steps)
    return args


@pytest.mark.parametrize("shift,mode", [("others", "wait"), ("paper", "wait"),
                                        ("paper", "pipelined"), ("paper", "overlap")])
def test_gem_stop_and_resume_restores_each_workers_momentum(tmp_path, shift, mode):
    """Exact in both readings of the shift: with ``paper`` the master keeps each worker's s
    in its mailbox slot, and the checkpoint now carries it (the replay was off by up to
    0.099 before). Pipelined, a worker stops with its next update computed and maybe its
    last one unapplied: m folds an update only once it is committed, so m is at most one
    fold ahead of what was applied, which the momentum file's ``prev`` covers. Overlapped,
    the next step is computed too, but m still folds only right before a commit. Every mode
    with ``paper`` (m's fold ahead is the workers' whatever the shift; paper adds the
    master's kept s), ``others`` once."""
    steps = STEPS
    args = _gem_args(tmp_path, steps, "--gem-shift", shift, "--worker-mode", mode)
    proc = train_background(WORKERS + 1, *args)
    err = signal_when(proc, _has_checkpoint(tmp_path))
    assert proc.returncode == 3, err
    assert len(list(tmp_path.glob("momentum_w*.h5"))) == WORKERS
    assert not list(tmp_path.glob("*.tmp"))
    res = train(WORKERS + 1, *args, "--resume", "auto", timeout=300)
    assert res.returncode == 0, res.stderr
    assert f"worker momentum restored for {WORKERS} of {WORKERS} workers" in res.stderr
    u = load_run(tmp_path / "run.h5").updates
    assert u["clock"].tolist() == list(range(WORKERS * steps))
    # each worker's m runs on across the resume in the replay, so the result matches the run
    # only if the resumed workers got their m (and, with paper, the master their s) back
    ref = replay(u, Quadratic(DIM, 0), "gem", LR, momentum=0.9, pi_max=PI_MAX, shift=shift)
    assert np.array_equal(np.load(tmp_path / "theta.npy"), ref.theta)


@pytest.mark.parametrize("shift, mode, crash", [("others", "wait", False),
                                               ("paper", "pipelined", False),
                                               ("paper", "wait", True),
                                               ("others", "overlap", True)])
def test_global_proxy_stop_or_crash_then_resume_is_exact(tmp_path, shift, mode, crash):
    """--gem-proxy global: m is the master's, so every checkpoint holds it (beside θ and,
    with paper, the kept s) and the workers keep nothing: a resume after a stop and even
    after a killed worker replays bit for bit, every update exactly once."""
    steps = STEPS
    args = _gem_args(tmp_path, steps, "--gem-proxy", "global", "--gem-shift", shift,
                     "--worker-mode", mode)
    proc = train_background(WORKERS + 1, *args)
    if crash:
        assert kill_rank_when(proc, _has_checkpoint(tmp_path), 2) != 0
    else:
        err = signal_when(proc, _has_checkpoint(tmp_path))
        assert proc.returncode == 3, err
    assert not list(tmp_path.glob("momentum_w*.h5"))  # nothing of the workers' to keep
    res = train(WORKERS + 1, *args, "--resume", "auto", timeout=300)
    assert res.returncode == 0, res.stderr
    assert "the global proxy's m restored from the checkpoint" in res.stderr
    u = load_run(tmp_path / "run.h5").updates
    assert_exactly_once(u["worker"], u["seq"], range(1, WORKERS + 1), steps)
    assert u["clock"].tolist() == list(range(WORKERS * steps))
    ref = replay(u, Quadratic(DIM, 0), "gem", LR, momentum=0.9, pi_max=PI_MAX, shift=shift,
                 proxy="global", n_workers=WORKERS)
    assert np.array_equal(np.load(tmp_path / "theta.npy"), ref.theta)


def _one_error(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.startswith("gem_mpi: error")]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_resume_never_cuts_another_runs_metrics_file(tmp_path, short_run):
    """Run A writes A.h5; run B checkpoints into c/; resuming B with --metrics A.h5 used to
    exit 0 and cut A.h5 to B's 200 rows. Now: one line, exit 2, A.h5 untouched (A: the
    short run's 800 rows)."""
    a, c = tmp_path / "A.h5", tmp_path / "c"
    c.mkdir()
    shutil.copy(short_run / "run.h5", a)
    before = _sha(a)
    res = train(WORKERS + 1, *_args(c, "--max-steps", "50"), timeout=120)
    assert res.returncode == 0, res.stderr
    res = train(WORKERS + 1, *_args(c, "--max-steps", "50", "--metrics", str(a), "--resume",
                                    "auto", "--lr", "0.9"), timeout=120)
    assert res.returncode == 2
    assert "belongs to another run" in _one_error(res.stderr)
    assert _sha(a) == before
    assert load_run(a).updates["clock"].size == WORKERS * 200


def test_a_resume_may_change_lr_recorded_and_nothing_else(tmp_path):
    """η may change on a resume (the start-up line and the metrics file's resume_log say so,
    with the update it took effect at); any other setting of the rule or the data is refused
    with one line before anything is written."""
    proc = train_background(WORKERS + 1, *_args(tmp_path))
    err = signal_when(proc, _has_checkpoint(tmp_path))
    assert proc.returncode == 3, err
    metrics = tmp_path / "run.h5"
    before = _sha(metrics)
    for option, value in (("--momentum", "0.5"), ("--kappa", "2"), ("--gem-shift", "paper"),
                          ("--eps", "1e-8"), ("--pi-max", "3"), ("--seed", "1")):
        res = train(WORKERS + 1, *_args(tmp_path, option, value, "--resume", "auto"),
                    timeout=120)
        assert res.returncode == 2, (option, res.stderr)
        assert f"{option} was " in _one_error(res.stderr)
        assert "a resume may change only --lr" in res.stderr
    assert _sha(metrics) == before
    state = checkpoint.load(checkpoint.latest(str(tmp_path)))
    res = train(WORKERS + 1, *_args(tmp_path, "--lr", "0.02", "--resume", "auto"), timeout=300)
    assert res.returncode == 0, res.stderr
    assert "--lr 0.05 -> 0.02" in res.stderr
    run = load_run(metrics)
    log = json.loads(run.attrs["resume_log"])
    assert log[-1]["clock"] == state.clock and log[-1]["changes"] == {"lr": [0.05, 0.02]}
    assert run.summary["finished"] == 1.0


def test_a_divergence_keeps_the_momentum_an_earlier_stop_saved(tmp_path):
    """A GEM run is stopped (each worker saves m beside the checkpoint), resumed with an η
    that diverges: the divergence must not replace those files (it used to)."""
    args = _gem_args(tmp_path, 100000)
    proc = train_background(WORKERS + 1, *args)
    err = signal_when(proc, _has_checkpoint(tmp_path))
    assert proc.returncode == 3, err
    saved = {p.name: _sha(p) for p in tmp_path.glob("momentum_w*.h5")}
    assert len(saved) == WORKERS
    res = train(WORKERS + 1, *args, "--lr", "40", "--resume", "auto", timeout=120)
    assert res.returncode == 4, res.stderr
    assert {p.name: _sha(p) for p in tmp_path.glob("momentum_w*.h5")} == saved


def test_a_flipped_bit_in_a_checkpoint_is_refused(tmp_path, short_run):
    shutil.copytree(short_run, tmp_path, dirs_exist_ok=True)
    ckpt = checkpoint.latest(str(tmp_path))
    with h5py.File(ckpt, "r+") as f:
        theta = f["theta"][()]
        theta.view(np.uint32)[7] ^= 1 << 3
        f["theta"][...] = theta
    res = train(WORKERS + 1, *_args(tmp_path, "--max-steps", "200", "--resume", ckpt),
                timeout=120)
    assert res.returncode == 2
    assert "theta does not match its checksum" in _one_error(res.stderr)


def test_resuming_a_finished_run_adds_nothing(tmp_path, short_run):
    """The end of a run is a checkpoint; --resume auto from it (a requeued job, a launcher's
    restart, a user) used to evaluate and write a second final row. Now: one line, exit 0,
    every file as it was."""
    shutil.copytree(short_run, tmp_path, dirs_exist_ok=True)
    before = {p.name: _sha(p) for p in tmp_path.iterdir() if p.suffix in (".h5", ".npy")}
    res = train(WORKERS + 1, *_args(tmp_path, "--max-steps", "200", "--resume", "auto"),
                timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stderr.count("finished already") == 1 and "nothing written" in res.stderr
    assert {p.name: _sha(p) for p in tmp_path.iterdir() if p.suffix in (".h5", ".npy")} == before
