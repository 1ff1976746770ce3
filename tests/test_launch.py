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
from helpers import REPO, mpi_env, quadratic_args, rank_pids

from gem_mpi.outputs import checkpoint
from gem_mpi.outputs.runfile import load_run

pytestmark = pytest.mark.mpi

WORKERS, STEPS = 4, 6000


def _mpirun_of(launcher: subprocess.Popen) -> SimpleNamespace | None:
    """The launcher's running mpirun (its child), as rank_pids wants it."""
    out = subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True,
                         check=False).stdout.split()
    return SimpleNamespace(pid=int(out[0])) if out else None


def test_a_job_that_loses_a_worker_is_relaunched_on_one_fewer(tmp_path):
    args = quadratic_args(method="gem", steps=STEPS, dim=2000, checkpoint_dir=tmp_path,
                          checkpoint_every=0.3, eval_every=0, metrics=tmp_path / "run.h5")
    cmd = [sys.executable, "-m", "gem_mpi.launch", "-n", str(WORKERS + 1), "--max-restarts",
           "1", "--mpirun", "mpirun --oversubscribe", "--", *map(str, args)]
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
            os.killpg(launcher.pid, signal.SIGKILL)
    assert launcher.returncode == 0, err
    lines = [ln for ln in err.splitlines() if ln.startswith("gem_mpi: launch:")]
    assert lines[0].startswith("gem_mpi: launch: the job lost a rank (exit ")
    assert "restart 1 of 1 on 4 ranks, from the newest checkpoint" in lines[0]
    assert lines[1] == "gem_mpi: launch: the run finished after 1 restart(s), on 4 ranks"
    assert "workers 4 -> 3" in err  # the resume's one line
    run = load_run(tmp_path / "run.h5")
    budget = WORKERS * STEPS  # the first start's, neither lost nor grown
    assert run.summary["finished"] == 1.0
    assert run.updates["clock"].tolist() == list(range(budget))  # each update once
    segments = json.loads(run.attrs["segments"])
    assert [s["workers"] for s in segments] == [4, 3] and segments[0]["clock_from"] == 0


def test_a_refused_run_is_not_restarted(tmp_path):
    cmd = [sys.executable, "-m", "gem_mpi.launch", "-n", "3", "--mpirun",
           "mpirun --oversubscribe", "--", "--checkpoint-dir", str(tmp_path), "--model",
           "quadratic"]  # without --dataset synthetic: refused by the job, exit 2
    res = subprocess.run(cmd, env=mpi_env(), cwd=REPO, capture_output=True, text=True,
                         timeout=120, check=False)
    assert res.returncode == 2, res.stderr
    assert "launch:" not in res.stderr and res.stderr.count("gem_mpi: error:") == 1
