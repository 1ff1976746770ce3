"""pytest's hooks and fixtures for the suite; what tests share is in tests/helpers.py."""

from __future__ import annotations

import contextlib
import ctypes.util
import multiprocessing.process
import os
import subprocess
import sys
from collections.abc import Callable, Iterator

import pytest

# Open MPI's PMIx tries its munge security component first: where munge is installed (the
# Slurm tests install it) but munged is not running, every mpirun retries the dead socket for
# about 2 s. The suite's jobs run as one user, which PMIx's native (uid) check covers.
os.environ.setdefault("PMIX_MCA_psec", "^munge")

# Skips are failures on CI. tools/test.sh installs everything the suites need (Open MPI,
# Debian's Fashion-MNIST, Horovod) and CI runs it as root (mounts, Slurm), so there a
# skipped test is a feature left untested while the run looks green. With
# GEM_MPI_NO_SKIPS=1 (tools/test.sh exports it) any skip not listed here fails the session;
# the listed ones that happened are printed at the end. Entries are node ids (a
# parametrized test's id without its [...] part, or a module's path for a whole module).
ALLOWED_SKIPS: tuple[tuple[str, str], ...] = ()


@pytest.fixture(scope="module")
def core() -> object:
    """gem_mpi.algorithm._core, checked against the numpy side's constants; a failure (not
    a skip) when it is missing or stale: the kernels' tests are the point of building it."""
    from gem_mpi.algorithm import kernel

    ext, why = kernel.load_extension()
    if ext is None:
        pytest.fail(f"gem_mpi.algorithm._core (the C++ extension) is not usable: {why}. "
                    "Build it with tools/install.sh (or pip install .).", pytrace=False)
    return ext


# --- the order: the slowest files first ----------------------------------------------------

# tools/test.sh runs the files on two pytest processes, each file whole on one (pytest-xdist
# --dist loadfile): started last, one of these would leave the other process idle for
# minutes at the end. (Measured with tools/test.sh --durations=0; the order is all it sets.)
SLOW_FILES = ("test_reproduce.py", "test_slurm.py", "test_sync.py", "test_mpi_stacks.py",
              "test_bench.py", "test_checkpoint.py", "test_training_loop.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        name = item.path.name
        return SLOW_FILES.index(name) if name in SLOW_FILES else len(SLOW_FILES)
    items.sort(key=rank)  # stable: each file's own order kept


# --- the mpi marker: a test that starts a process says so -----------------------------------

_NOT_MARKED = ("{what} in a test without the mpi marker: mark this test @pytest.mark.mpi (it "
               "launches mpirun or another process, so it is left out of pytest -m 'not mpi')")


def _refuse(what: str, original: Callable) -> Callable:
    def refused(*args, **kwargs):
        frame = sys._getframe(1)
        while frame is not None:  # a library looking itself up (ctypes.util.find_library
            if frame.f_code.co_filename == ctypes.util.__file__:  # runs ldconfig) is not
                return original(*args, **kwargs)  # the test's process
            frame = frame.f_back
        raise RuntimeError(_NOT_MARKED.format(what=what))
    return refused


@contextlib.contextmanager
def _no_processes() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(subprocess.Popen, "__init__",
                   _refuse("subprocess.Popen", subprocess.Popen.__init__))
        mp.setattr(multiprocessing.process.BaseProcess, "start",
                   _refuse("multiprocessing's Process.start",
                           multiprocessing.process.BaseProcess.start))
        for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "spawnv", "spawnve",
                     "spawnvp", "spawnvpe"):
            if hasattr(os, name):
                mp.setattr(os, name, _refuse(f"os.{name}", getattr(os, name)))
        yield


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    """``pytest -m "not mpi"`` is the fast loop: every test without the mpi marker runs in
    this process. Enforced: while such a test's fixtures are set up (a module's too) and while
    it runs, starting a process fails at once with the line that says how to mark it. (Not
    while fixtures are torn down: a module's fixture may be finalised after its last test.)"""
    if item.get_closest_marker("mpi") is not None:
        return (yield)
    with _no_processes():
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    if item.get_closest_marker("mpi") is not None:
        return (yield)
    with _no_processes():
        return (yield)


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
