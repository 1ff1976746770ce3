"""pytest's hooks and fixtures for the suite; what tests share is in tests/helpers.py."""

from __future__ import annotations

import os

import pytest

# Skips are failures on CI. tools/test.sh installs everything the suites need (Open MPI,
# Debian's Fashion-MNIST, Horovod) and CI runs it as root (mounts, Slurm), so there a
# skipped test is a feature left untested while the run looks green. With
# GEM_MPI_NO_SKIPS=1 (tools/test.sh exports it) any skip not listed here fails the session;
# the listed ones that happened are printed at the end. Entries are node ids (a
# parametrized test's id without its [...] part, or a module's path for a whole module).
ALLOWED_SKIPS: tuple[tuple[str, str], ...] = ()


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
