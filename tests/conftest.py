"""Shared helpers: every multi-rank test launches a real ``mpirun`` in a subprocess."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PROGS = Path(__file__).resolve().parent / "mpi_progs"


def mpi_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def mpirun_cmd(n: int, args: list[str]) -> list[str]:
    return ["mpirun", "--oversubscribe", "-n", str(n), sys.executable, *args]


def mpirun(n: int, args: list[str], timeout: float = 300, cwd: Path | None = None
           ) -> subprocess.CompletedProcess:
    """Run ``args`` (after the python executable) on n ranks; never hangs past ``timeout``."""
    return subprocess.run(mpirun_cmd(n, args), capture_output=True, text=True, timeout=timeout,
                          check=False, env=mpi_env(), cwd=str(cwd or REPO))


def train(n: int, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return mpirun(n, ["-m", "gem_mpi.train", *args], timeout=timeout)


def train_background(n: int, *args: str, env: dict[str, str] | None = None
                     ) -> subprocess.Popen:
    """Start a training job and return at once (in its own session; stdout discarded,
    stderr piped): for tests that watch or kill a run while it trains. The caller ends it."""
    return subprocess.Popen(mpirun_cmd(n, ["-m", "gem_mpi.train", *args]),
                            env={**mpi_env(), **(env or {})}, cwd=str(REPO),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def wait_until(proc: subprocess.Popen, ready: Callable[[], bool], timeout: float = 90) -> None:
    """Poll ``ready()`` while the background job runs; fail if it ends or times out first."""
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, "the job never got ready"
        time.sleep(0.1)


def signal_when(proc: subprocess.Popen, ready: Callable[[], bool], sig: int = signal.SIGUSR1,
                whole_job: bool = False, timeout: float = 120) -> str:
    """Once ``ready()`` (the job still running), send ``sig`` to mpirun (or, ``whole_job``,
    to every process of the job, as a scheduler does); returns the job's stderr after it
    ended. The job is killed whatever happens."""
    try:
        wait_until(proc, ready, timeout)
        if whole_job:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        return proc.communicate(timeout=60)[1]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def rank_pids(proc: subprocess.Popen) -> dict[int, int]:
    """MPI rank -> pid of the ranks a background mpirun started (from their environment)."""
    out = {}
    children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True,
                              check=False).stdout.split()
    for pid in map(int, children):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for item in environ:
            if item.startswith(b"OMPI_COMM_WORLD_RANK="):
                out[int(item.split(b"=")[1])] = pid
    return out


@pytest.fixture
def run_train():
    return train
