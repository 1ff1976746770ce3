"""The reports' statistics over seeds, no MPI: a difference of means carries Welch's standard
error, and E4's "accuracy lost" reads a drop against it."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gem_mpi.reproduce.claims import E4_ACC_POINTS, loses_accuracy
from gem_mpi.reproduce.results import Difference, Stat, difference


def test_difference_has_welchs_standard_error():
    a, b = Stat((0.981, 0.985, 0.979)), Stat((0.990, 0.986, 0.992, 0.987))
    d = difference(a, b)
    va, vb = np.var(a.values, ddof=1), np.var(b.values, ddof=1)
    assert d.mean == pytest.approx(np.mean(a.values) - np.mean(b.values))
    assert d.se == pytest.approx(math.sqrt(va / 3 + vb / 4))
    assert d.text(".2f", 100) == f"{100 * d.mean:+.2f} ± {100 * d.se:.2f}"


def test_difference_of_one_seed_has_no_standard_error():
    d = difference(Stat((0.98,)), Stat((0.97, 0.99)))
    assert d.mean == pytest.approx(0.0) and math.isnan(d.se)
    assert "no se" in d.text(".2f", 100)
    assert difference(Stat(()), Stat((0.9, 0.8))).text() == "–"
    # non-finite values (a diverged run's) are left out, as in Stat.mean
    assert difference(Stat((0.9, math.nan, 0.7)), Stat((0.8, 0.8))).mean == pytest.approx(0.0)


@pytest.mark.parametrize(("drop_points", "se_points", "lost"), [
    (0.5, math.nan, False),   # within the tolerance
    (1.2, math.nan, True),    # one seed a side: the drop alone decides
    (1.5, 0.1, True),         # beyond the tolerance and beyond 2 se
    (1.5, 1.0, False),        # beyond the tolerance, but within the seeds' scatter
    (2.9, 1.5, False),        # just within 2 se
    (-2.0, 0.1, False),       # a gain
])
def test_accuracy_is_lost_beyond_the_tolerance_and_two_standard_errors(drop_points, se_points,
                                                                        lost):
    assert E4_ACC_POINTS == 1.0
    assert loses_accuracy(Difference(-drop_points / 100, se_points / 100)) is lost
