"""``python -m gem_mpi.launch`` under real mpirun: a job that loses a worker (SIGKILL, as an
OOM kill or a lost node) is relaunched from its newest checkpoint on one worker fewer and
finishes, every update of the first start's budget applied once (the restart
loop; docs/RELIABILITY.md, "A lost worker")."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
from helpers import REPO, kill_job, mpi_env, quadratic_args, rank_pids

from gem_mpi.outputs import checkpoint
from gem_mpi.outputs.runfile import load_run

USER_CODE = REPO / "tests" / "user_code"

WORKERS, STEPS = 4, 6000


def _mpirun_of(launcher: subprocess.Popen) -> SimpleNamespace | None:
    """The launcher's running mpirun (its child), as rank_pids wants it."""
    out = subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True,
                         check=False).stdout.split()
    return SimpleNamespace(pid=int(out[0])) if out else None


@pytest.mark.mpi
def test_a_job_that_loses_a_worker_is_relaunched_on_one_fewer(tmp_path):
    args = quadratic_args(method="gem", steps=STEPS, dim=2000, checkpoint_dir=tmp_path,
                          checkpoint_every=0.3, eval_every=0, metrics=tmp_path / "run.h5")
    cmd = [sys.executable, "-m", "gem_mpi.launch", "-n", str(WORKERS + 1), "--max-restarts",
           "1", "--backoff", "0", "--mpirun", "mpirun --oversubscribe", "--", *map(str, args)]
    launcher = subprocess.Popen(cmd, env=mpi_env(), cwd=REPO, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while checkpoint.latest(str(tmp_path)) is None:
            assert launcher.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        os.kill(rank_pids(_mpirun_of(launcher))[2], signal.SIGKILL)  # worker 2
        err = launcher.communicate(timeout=300)[1]
    finally:
        if launcher.poll() is None:
            kill_job(launcher)
    assert launcher.returncode == 0, err
    lines = [ln for ln in err.splitlines() if ln.startswith("gem_mpi: launch:")]
    assert lines[0].startswith("gem_mpi: launch: the job lost a rank (exit ")
    assert "restart 1 of 1 on 4 ranks, from the newest checkpoint" in lines[0]
    assert lines[1] == "gem_mpi: launch: the run finished after 1 restart(s), on 4 ranks"
    assert "workers 4 -> 3" in err  # the resume's one line
    assert "--resume auto: continuing run " in err  # the launcher's own run, named
    run = load_run(tmp_path / "run.h5")
    budget = WORKERS * STEPS  # the first start's, neither lost nor grown
    assert run.summary["finished"] == 1.0
    assert run.updates["clock"].tolist() == list(range(budget))  # each update once
    segments = json.loads(run.attrs["segments"])
    assert [s["workers"] for s in segments] == [4, 3] and segments[0]["clock_from"] == 0


@pytest.mark.mpi
def test_a_refused_run_is_not_restarted(tmp_path):
    cmd = [sys.executable, "-m", "gem_mpi.launch", "-n", "3", "--mpirun",
           "mpirun --oversubscribe", "--", "--checkpoint-dir", str(tmp_path), "--model",
           "quadratic"]  # without --dataset synthetic: refused by the job, exit 2
    res = subprocess.run(cmd, env=mpi_env(), cwd=REPO, capture_output=True, text=True,
                         timeout=120, check=False)
    assert res.returncode == 2, res.stderr
    assert "launch:" not in res.stderr and res.stderr.count("gem_mpi: error:") == 1


def _launch(tmp_path, *train: str, n: int = 3, restarts: int = 3, cwd=REPO,
            background: bool = False):
    cmd = [sys.executable, "-m", "gem_mpi.launch", "-n", str(n), "--max-restarts",
           str(restarts), "--backoff", "0", "--mpirun", "mpirun --oversubscribe", "--",
           "--checkpoint-dir", str(tmp_path), *train]
    if background:
        return subprocess.Popen(cmd, env=mpi_env(), cwd=cwd, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
    return subprocess.run(cmd, env=mpi_env(), cwd=cwd, capture_output=True, text=True,
                          timeout=240, check=False)


def _launch_lines(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.startswith("gem_mpi: launch:")]


@pytest.mark.mpi
def test_a_full_disk_is_not_restarted(tmp_path):
    """Exit 5 (an output that cannot be written): a restart would drop a worker and fail
    again (the launcher used to restart it on 2, then 2 ranks)."""
    res = _launch(tmp_path, *quadratic_args(dim=1000, steps=100000, eval_every=0),
                  "--metrics", str(tmp_path / "run.h5"), "--min-free-mb", "1e9")
    assert res.returncode == 5, res.stderr
    assert _launch_lines(res.stderr) == [(
        "gem_mpi: launch: the run could not write an output (a full disk?): free space, "
        "then run the launcher again")]


@pytest.mark.mpi
def test_an_error_that_recurs_before_any_progress_is_not_restarted_again(tmp_path):
    res = _launch(tmp_path, "--model", "plugins:mlp", "--dataset", "plugins:blobs", "--loss",
                  "plugins:worker_crash", "--batch-size", "8", "--eval-every", "0",
                  cwd=USER_CODE)
    assert res.returncode == 1, res.stderr
    lines = _launch_lines(res.stderr)
    assert len(lines) <= 2, lines  # a first checkpoint (clock 0) may count as progress once
    assert "before any new checkpoint: a restart would end the same way" in lines[-1]
    assert "a bug in the user's loss" in res.stderr


@pytest.mark.mpi
def test_sigusr1_to_the_launcher_stops_the_job_with_a_checkpoint_and_no_restart(tmp_path):
    launcher = _launch(tmp_path, *quadratic_args(dim=1000, steps=10**7, eval_every=0),
                       "--checkpoint-every", "0.2", background=True)
    try:
        deadline = time.monotonic() + 120
        while checkpoint.latest(str(tmp_path)) is None:
            assert launcher.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        launcher.send_signal(signal.SIGUSR1)  # to the launcher alone, as a scheduler may
        err = launcher.communicate(timeout=120)[1]
    finally:
        if launcher.poll() is None:
            kill_job(launcher)
    assert launcher.returncode == 3, err
    assert "stopped by signal" in err and "launch:" not in err
