"""The master kernel's thread count: GEM_NUM_THREADS, else the cores of its node that the
other ranks on it leave (the rule the evaluation's threads follow too)."""

from __future__ import annotations

import os

import pytest

from gem_mpi.algorithm import kernel as gem
from gem_mpi.errors import UsageError


@pytest.fixture
def eight_cores(monkeypatch):
    monkeypatch.delenv("GEM_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)


def test_default_is_the_cores_the_other_local_ranks_leave(eight_cores):
    assert [gem.kernel_threads(k) for k in (1, 2, 3, 8, 9, 40)] == [8, 7, 6, 1, 1, 1]
    assert gem.kernel_threads() == 8  # alone on its node
    assert gem.node_cores_left(3) == gem.kernel_threads(3)


def test_masters_on_one_node_share_the_cores_the_workers_leave(eight_cores):
    """--masters K on one node: each master its share, not every leftover core K times."""
    # 8 cores, 4 workers: 4 left; 1, 2, 4 masters get 4, 2, 1 threads each
    assert [gem.kernel_threads(4 + k, k) for k in (1, 2, 4)] == [4, 2, 1]
    assert gem.node_cores_left(6, 2) == 2 and gem.node_cores_left(3, 3) == 2
    assert gem.node_cores_left(20, 4) == 1  # more ranks than cores: at least 1


def test_gem_num_threads_overrides(eight_cores, monkeypatch):
    monkeypatch.setenv("GEM_NUM_THREADS", "1")
    assert gem.kernel_threads(1) == 1
    monkeypatch.setenv("GEM_NUM_THREADS", "2")
    assert gem.kernel_threads(8) == 2  # even where the default would be 1


@pytest.mark.parametrize("value", ["0", "-1", "two", ""])
def test_a_bad_gem_num_threads_is_a_usage_error(eight_cores, monkeypatch, value):
    monkeypatch.setenv("GEM_NUM_THREADS", value)
    with pytest.raises(UsageError, match="GEM_NUM_THREADS must be a positive integer"):
        gem.kernel_threads(1)


def test_more_threads_than_cores_is_a_usage_error(eight_cores, monkeypatch):
    monkeypatch.setenv("GEM_NUM_THREADS", str((os.cpu_count() or 1) + 1))
    with pytest.raises(UsageError, match="is more than the"):
        gem.kernel_threads(1)
