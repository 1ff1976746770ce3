"""The overlapped worker's pull time (gem_mpi.engine.orders.PullClock), without a clock: when
it pulls follows from the moving means of what it measured."""

from __future__ import annotations

import pytest

from gem_mpi.engine.orders import PullClock


def test_the_pull_starts_at_once_until_both_times_are_measured():
    clock = PullClock()
    assert clock.due() is None
    clock.computed(0.1)
    assert clock.due() is None  # no pull measured yet
    clock.pulled(0.01)
    clock.started = 5.0
    assert clock.due() == pytest.approx(5.0 + 0.8 * 0.1 - 2 * 0.01)


def test_the_times_are_moving_means_from_their_first_value():
    clock = PullClock(slack=0.0, weight=0.5)
    clock.computed(0.1)
    clock.computed(0.3)
    clock.pulled(0.02)
    clock.pulled(0.04)
    clock.started = 0.0
    assert clock.compute_s == pytest.approx(0.2)
    assert clock.pull_s == pytest.approx(0.03)
    assert clock.due() == pytest.approx(0.2 - 0.06)
