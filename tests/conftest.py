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

# Skips are failures on CI. tools/test.sh installs everything the suites need (Open MPI,
# Debian's Fashion-MNIST, Horovod) and CI runs it as root (mounts, Slurm), so there a
# skipped test is a feature left untested while the run looks green. With
# GEM_MPI_NO_SKIPS=1 (tools/test.sh exports it) any skip not listed here fails the session;
# the listed ones that happened are printed at the end. Entries are node ids (a
# parametrized test's id without its [...] part, or a module's path for a whole module).
ALLOWED_SKIPS: tuple[tuple[str, str], ...] = ()


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


def kill_rank_when(proc: subprocess.Popen, ready: Callable[[], bool], rank: int) -> int:
    """Once ``ready()``, SIGKILL MPI rank ``rank`` of the job (a node lost, an OOM kill);
    returns the job's exit code once it ended. The job is killed whatever happens."""
    try:
        wait_until(proc, ready)
        os.kill(rank_pids(proc)[rank], signal.SIGKILL)
        proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode


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


# --- GEM_MPI_NO_SKIPS: skips are failures (see ALLOWED_SKIPS above) --------------------------

_SKIPPED: list[tuple[str, str]] = []  # (node id, reason) of every skip in this session


def _no_skips() -> bool:
    return os.environ.get("GEM_MPI_NO_SKIPS", "") == "1"


def _allowed_reason(nodeid: str) -> str | None:
    base = nodeid.split("[", 1)[0]
    return next((why for allowed, why in ALLOWED_SKIPS if allowed == base), None)


def _record_skip(report: pytest.CollectReport | pytest.TestReport) -> None:
    if not report.skipped or hasattr(report, "wasxfail"):  # an xfail is not a skip
        return
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    _SKIPPED.append((report.nodeid, reason.removeprefix("Skipped: ")))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _record_skip(report)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    _record_skip(report)  # a whole module skipped (pytest.importorskip at module level)


def _unexpected_skips() -> list[tuple[str, str]]:
    return [(nodeid, why) for nodeid, why in _SKIPPED if _allowed_reason(nodeid) is None]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _no_skips() and _unexpected_skips() and exitstatus in (
            pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter) -> None:
    if not _no_skips():
        return
    tr = terminalreporter
    allowed = [(nodeid, _allowed_reason(nodeid)) for nodeid, _ in _SKIPPED
               if _allowed_reason(nodeid) is not None]
    unexpected = _unexpected_skips()
    tr.section("skips (GEM_MPI_NO_SKIPS=1)")
    tr.write_line(f"expected skips (tests/conftest.py ALLOWED_SKIPS): {len(allowed)}")
    for nodeid, why in allowed:
        tr.write_line(f"  {nodeid}: {why}")
    if unexpected:
        tr.write_line(f"UNEXPECTED skips, failing the session: {len(unexpected)}", red=True)
        for nodeid, why in unexpected:
            tr.write_line(f"  {nodeid}: {why}", red=True)
