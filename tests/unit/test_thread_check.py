"""The thread level --worker-mode overlap needs (FUNNELED: only the thread that started MPI
calls it), checked on every rank before any window: a rank whose MPI gave less makes the
run one line and exit 2 (the check itself runs on every MPI stack in tests/test_mpi_stacks.py;
here a fake communicator gives the levels)."""

from __future__ import annotations

import pytest

from gem_mpi.transport import runtime


class _Ranks:
    """allgather over ranks whose MPI gave these levels (this process is the first)."""

    def __init__(self, *others: int) -> None:
        self.others = others

    def allgather(self, value: int) -> list[int]:
        return [value, *self.others]


@pytest.mark.parametrize("mine, others, refused", [
    ("THREAD_FUNNELED", ("THREAD_FUNNELED",), False),
    ("THREAD_MULTIPLE", ("THREAD_SERIALIZED",), False),
    ("THREAD_FUNNELED", ("THREAD_SINGLE",), True),
    ("THREAD_SINGLE", (), True),
])
def test_every_rank_needs_funneled(monkeypatch, mine, others, refused):
    MPI = runtime.MPI
    monkeypatch.setattr(MPI, "Query_thread", lambda: getattr(MPI, mine))
    line = runtime.thread_check(_Ranks(*(getattr(MPI, o) for o in others)))
    if not refused:
        assert line is None
    else:
        assert "MPI_THREAD_SINGLE" in line and "--worker-mode pipelined" in line
        assert "\n" not in line
