"""Checkpoint, stop and resume under real mpirun: nothing lost, nothing applied twice.

DOWNPOUR and GEM on the quadratic are replayable from the HDF5 log, so after a stop (SIGUSR1,
or SIGTERM to the whole job) or a crash (SIGKILL of a worker or of the master) and a resume,
the final θ must equal the replay of the log of the whole run, bit for bit, and every worker
update must appear in it exactly once. What a resume refuses is one line from rank 0 here
once per kind (a changed setting, another run's metrics file); each case is in-process in
tests/unit/test_checkpoint_state.py.
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

import numpy as np
import pytest
from helpers import (
    assert_exactly_once,
    checkpoint_after_start,
    kill_job,
    quadratic_args,
    rank_pids,
    signal_when,
    train,
    train_background,
    wait_until,
)

from gem_mpi.algorithm.reference import replay
from gem_mpi.algorithm.stepsize import Schedule
from gem_mpi.config import Config
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


def _check_whole_run(tmp: Path, steps: int = STEPS, **rule: object) -> None:
    """The resumed run finished with every update once, on a clock and times that continue,
    and its θ is the replay of its whole log (DOWNPOUR unless ``rule`` says: replay's
    keywords, ``method`` among them)."""
    run = load_run(tmp / "run.h5")
    u = run.updates
    assert run.summary["finished"] == 1.0
    assert run.attrs["resumes"] >= 1
    assert_exactly_once(u["worker"], u["seq"], range(1, WORKERS + 1), steps)
    assert u["clock"].tolist() == list(range(WORKERS * steps))
    assert np.all(np.diff(u["time"]) >= 0)  # the clock and the times continue
    ref = replay(u, Quadratic(DIM, 0), rule.pop("method", "downpour"), LR, **rule)
    assert np.array_equal(np.load(tmp / "theta.npy"), ref.theta)


class _LrFrom:
    """η of each row of a replay (replay asks once per row, in clock order): ``before`` for
    the rows below ``clock``, ``after`` from it on (a resume changed --lr at that clock;
    every row from it on was computed by the resumed workers)."""

    def __init__(self, clock: int, before: float, after: float) -> None:
        self.clock, self.before, self.after, self.rows = clock, before, after, 0

    def eta(self, seq: int) -> np.float32:
        self.rows += 1
        return np.float32(self.before if self.rows <= self.clock else self.after)


def _one_error(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.startswith("gem_mpi: error")]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_sigterm_a_new_lr_and_a_killed_master_then_resume_replays_bit_for_bit(tmp_path):
    """One run through three interruptions. SIGTERM to every process of the job (mpirun and
    the ranks), what a scheduler does at a time limit or a cancel: the master checkpoints at
    once; mpirun then ends the ranks. A resume that changes a setting of the rule is one line
    from rank 0, exit 2, nothing written (each setting's refusal: tests/unit/
    test_checkpoint_state.py); one that changes η continues, says so and records it (the
    metrics file's resume_log, with the update it took effect at). Then SIGKILL of rank 0
    (a node lost, an OOM kill) leaves the metrics file marked open for writing; the resume
    still continues it. The whole log replays bit for bit with η changed at the first
    resume, every update once."""
    # mpirun passes SIGTERM on 1 s late: ~7000 updates here, ~27000 at 4× the speed, of 60000
    steps = 15000
    args = _args(tmp_path, "--max-steps", str(steps))
    proc = train_background(WORKERS + 1, *args)
    first: list[str | None] = []

    def ready() -> bool:
        first.append(checkpoint.latest(str(tmp_path)))
        return first[-1] is not None

    err = signal_when(proc, ready, signal.SIGTERM, whole_job=True)
    assert proc.returncode != 0
    assert "stopped by signal 15 at update" in err  # the master's own stop checkpoint
    assert checkpoint.latest(str(tmp_path)) != first[-1]
    assert not list(tmp_path.glob("*.tmp"))
    metrics = tmp_path / "run.h5"
    before = _sha(metrics)
    res = train(WORKERS + 1, *args, "--momentum", "0.5", "--resume", "auto", timeout=120)
    assert res.returncode == 2, res.stderr
    assert "--momentum was " in _one_error(res.stderr)
    assert "a resume may change only --lr" in res.stderr
    assert _sha(metrics) == before
    stopped_at = checkpoint.load(checkpoint.latest(str(tmp_path))).clock
    proc = train_background(WORKERS + 1, *args, "--lr", "0.02", "--resume", "auto")
    try:  # rank 0 killed once the resumed run has checkpointed past the stop
        wait_until(proc, checkpoint_after_start(tmp_path, after=stopped_at))
        os.kill(rank_pids(proc)[0], signal.SIGKILL)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            kill_job(proc)
    assert proc.returncode != 0
    assert "--lr 0.05 -> 0.02" in err
    res = train(WORKERS + 1, *args, "--lr", "0.02", "--resume", "auto", timeout=300)
    assert res.returncode == 0, res.stderr
    assert "resuming" in res.stderr
    log = json.loads(load_run(metrics).attrs["resume_log"])
    changed = [entry for entry in log if entry["changes"]]
    assert changed == [{**changed[0], "clock": stopped_at, "changes": {"lr": [0.05, 0.02]}}]
    _check_whole_run(tmp_path, steps, schedule=_LrFrom(stopped_at, LR, 0.02))


@pytest.fixture(scope="module")
def short_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished run of 200 steps per worker (its checkpoint, metrics file and θ), which the
    refusal tests below copy what they change from."""
    tmp = tmp_path_factory.mktemp("short")
    res = train(WORKERS + 1, *_args(tmp, "--max-steps", "200"), timeout=120)
    assert res.returncode == 0, res.stderr
    return tmp


PI_MAX = 50.0  # high enough that π is rarely clamped: θ then depends on every bit of m


def _gem_args(tmp: Path, steps: int, *extra: str) -> list[str]:
    args = [a if a != "downpour" else "gem" for a in _args(tmp, "--pi-max", str(PI_MAX), *extra)]
    args[args.index("--max-steps") + 1] = str(steps)
    return args


# (the first row also runs a cosine schedule with warmup, stopped mid-cosine: each resumed
# worker's η goes on from its own step)
@pytest.mark.parametrize("shift,mode,schedule", [
    ("others", "wait", ("--lr-schedule", "cosine", "--warmup-steps", "50")),
    ("paper", "wait", ()), ("paper", "pipelined", ()), ("paper", "overlap", ())],
    ids=["others-wait-cosine", "paper-wait", "paper-pipelined", "paper-overlap"])
def test_gem_stop_and_resume_restores_each_workers_momentum(tmp_path, shift, mode, schedule):
    """SIGUSR1 (Slurm's --signal=B:USR1): exit 3 with one line, a readable metrics file
    that says it is unfinished, the newest checkpoints (--keep-checkpoints 2), no temporary
    file; the resume finishes every update once on a clock that continues. Exact in both
    readings of the shift: with ``paper`` the master keeps each worker's s in its mailbox
    slot, and the checkpoint now carries it (the replay was off by up to 0.099 before).
    Pipelined, a worker stops with its next update computed and maybe its last one
    unapplied: m folds an update only once it is committed, so m is at most one fold ahead
    of what was applied, which the momentum file's ``prev`` covers. Overlapped, the next
    step is computed too, but m still folds only right before a commit. Every mode with
    ``paper`` (m's fold ahead is the workers' whatever the shift; paper adds the master's
    kept s), ``others`` once."""
    args = _gem_args(tmp_path, STEPS, "--gem-shift", shift, "--worker-mode", mode, *schedule)
    proc = train_background(WORKERS + 1, *args)
    err = signal_when(proc, _has_checkpoint(tmp_path))
    assert proc.returncode == 3, err
    assert err.count("stopped by signal 10 at update") == 1
    assert "Traceback" not in err
    stopped = load_run(tmp_path / "run.h5")
    assert stopped.summary["finished"] == 0.0  # readable, and says it is unfinished
    assert 0 < stopped.summary["updates"] < WORKERS * STEPS
    # the newest and the one before it (--keep-checkpoints 2), no temporary file
    assert 1 <= len(list(tmp_path.glob("checkpoint_*.h5"))) <= 2
    assert not list(tmp_path.glob("*.tmp"))
    assert len(list(tmp_path.glob("momentum_w*.h5"))) == WORKERS
    res = train(WORKERS + 1, *args, "--resume", "auto", timeout=300)
    assert res.returncode == 0, res.stderr
    assert "resuming" in res.stderr
    assert f"worker momentum restored for {WORKERS} of {WORKERS} workers" in res.stderr
    # each worker's m runs on across the resume in the replay, so the result matches the run
    # only if the resumed workers got their m (and, with paper, the master their s) back
    sched = Schedule.of(Config.of(**stopped.config).optim, STEPS) if schedule else None
    _check_whole_run(tmp_path, method="gem", momentum=0.9, pi_max=PI_MAX, shift=shift,
                     schedule=sched)


@pytest.mark.parametrize("shift, mode", [("others", "wait"), ("paper", "pipelined"),
                                         ("others", "overlap")])
def test_global_proxy_stop_then_killed_worker_then_resume_is_exact(tmp_path, shift, mode):
    """--gem-proxy global: m is the master's, so every checkpoint holds it (beside θ and,
    with paper, the kept s) and the workers keep nothing. One run stopped (SIGUSR1),
    resumed, then worker 2 SIGKILLed (pipelined or overlapped, it may have had an update
    in flight and, overlapped, the next one computed): the job ends, not hangs, mpirun naming
    the rank; the second resume starts from the last periodic checkpoint and the whole log
    replays bit for bit, every update exactly once. Each order once, both shifts."""
    args = _gem_args(tmp_path, STEPS, "--gem-proxy", "global", "--gem-shift", shift,
                     "--worker-mode", mode)
    proc = train_background(WORKERS + 1, *args)
    err = signal_when(proc, _has_checkpoint(tmp_path))
    assert proc.returncode == 3, err
    assert not list(tmp_path.glob("momentum_w*.h5"))  # nothing of the workers' to keep
    stopped_at = checkpoint.load(checkpoint.latest(str(tmp_path))).clock
    proc = train_background(WORKERS + 1, *args, "--resume", "auto")
    try:  # killed once the resumed run has checkpointed past the stop
        wait_until(proc, checkpoint_after_start(tmp_path, after=stopped_at))
        ranks = rank_pids(proc)
        assert set(ranks) == set(range(WORKERS + 1))
        t0 = time.monotonic()
        os.kill(ranks[2], signal.SIGKILL)
        _, err = proc.communicate(timeout=30)  # the job must end, not hang
        ended = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            kill_job(proc)
    assert proc.returncode != 0 and ended < 30
    assert "rank 2" in err  # mpirun names the rank that died
    assert "the global proxy's m restored from the checkpoint" in err
    res = train(WORKERS + 1, *args, "--resume", "auto", timeout=300)
    assert res.returncode == 0, res.stderr
    assert "the global proxy's m restored from the checkpoint" in res.stderr
    assert load_run(tmp_path / "run.h5").attrs["resumes"] >= 2
    _check_whole_run(tmp_path, method="gem", momentum=0.9, pi_max=PI_MAX, shift=shift,
                     proxy="global", n_workers=WORKERS)


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
