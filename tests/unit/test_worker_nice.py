"""--worker-nice: which workers step aside for the master, and what the placement line says
(the priority itself, on real ranks: tests/test_training_loop.py)."""

from __future__ import annotations

import os

import pytest

from gem_mpi.config import AUTO_NICE
from gem_mpi.errors import UsageError
from gem_mpi.run.rank import Placement, lower_priority, placement_line, worker_nice

CORES = os.cpu_count() or 1


@pytest.mark.parametrize("setting, ranks_on_node, overlapped, nice", [
    # more ranks than cores and workers that compute on: the master would wait its turn
    ("auto", CORES + 1, True, AUTO_NICE),
    ("auto", CORES + 1, False, 0),  # wait, pipelined: they leave their cores while they wait
    ("auto", CORES, True, 0),  # a core each: nothing to make room for
    ("auto", 1, True, 0),
    ("0", CORES + 1, True, 0),  # asked for: as asked, whatever the node and the order
    ("7", 1, False, 7),
])
def test_auto_lowers_the_workers_only_where_they_crowd_out_the_master(
        setting, ranks_on_node, overlapped, nice):
    placement = Placement(local_rank=1, local_size=ranks_on_node)
    assert worker_nice(setting, placement, overlapped) == nice


def test_the_placement_line_names_a_nice_value_only_where_it_is_not_zero():
    ranks = [(0, "n0", 0, 3, 1, "cpu", 0), (0, "n0", 1, 3, 1, "cpu", 10),
             (0, "n0", 2, 3, 1, "cpu", 10)]
    assert placement_line(ranks, 2, 2) == (
        "placement: 1 node(s); n0: rank 0 (master, local 0/3: kernel 2 threads, evaluation 2 "
        "threads), rank 1 (local 1/3: cpu, 1 threads, nice 10), rank 2 (local 2/3: cpu, 1 "
        "threads, nice 10)")


def test_a_system_that_forbids_the_lower_priority_is_one_line(monkeypatch):
    def forbidden(*args: object) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "setpriority", forbidden)
    monkeypatch.setattr(os, "nice", forbidden)
    with pytest.raises(UsageError, match="does not let a worker lower its own priority "
                                         r"\(Operation not permitted\); run with --worker-nice 0"):
        lower_priority(10)
    assert lower_priority(0) == os.getpriority(os.PRIO_PROCESS, 0)  # nothing asked, nothing done
