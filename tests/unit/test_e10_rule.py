"""E10's verdict rule (gem_mpi/reproduce/results.py: e10_verdict) on made-up numbers: each
outcome, its margins, and the table from outcomes to verdicts, so that a change of the rule
fixed before the runs fails here."""

from __future__ import annotations

import math

import pytest

from gem_mpi.reproduce import experiments as ex
from gem_mpi.reproduce.results import Side, e10_accuracy, e10_time, e10_verdict


def side(times, acc=(0.98, 0.98, 0.98)) -> Side:
    return Side(tuple(times), tuple(acc))


def test_the_constants_are_those_fixed_before_the_runs():
    assert (ex.E10_TARGET, ex.E10_TIME_RATIO, ex.E10_ACC_POINTS) == (0.95, 1.1, 0.25)


def test_time_needs_the_ratio_and_two_standard_errors():
    gem = side((10.0, 10.1, 9.9))
    assert e10_time(gem, side((11.5, 11.6, 11.4))) == "faster"  # 1.15×, tight
    assert e10_time(side((11.5, 11.6, 11.4)), gem) == "slower"
    assert e10_time(gem, side((10.8, 10.9, 10.7))) == "tie"  # 1.08×: within 10 %
    # 1.5× on the means, but the seeds scatter more than the gap
    assert e10_time(gem, side((5.0, 25.0, 15.0))) == "tie"
    # 1.4×, the gap beyond one standard error but not two
    assert e10_time(side((10.0, 10.0, 10.0)), side((8.0, 20.0, 14.0))) == "tie"
    assert e10_time(side((10.0, 10.0, 10.0)), side((12.0, 16.0, 14.0))) == "faster"
    # one seed a side: the ratio alone decides
    assert e10_time(side((10.0,)), side((11.2,))) == "faster"
    assert e10_time(side((10.0,)), side((10.9,))) == "tie"


def test_not_reached_in_any_seed_is_not_reached():
    gem = side((10.0, 10.0, 10.0))
    assert e10_time(gem, side((12.0, None, 12.0))) == "faster"
    assert e10_time(side((1.0, 1.0, None)), gem) == "slower"
    assert e10_time(side((None, None, None)), side((None, 3.0, None))) == "neither"
    assert e10_time(side(()), gem) == "slower"  # no done run reaches nothing
    assert e10_time(side((math.inf,)), side((10.0,))) == "slower"


def test_accuracy_needs_a_quarter_point_and_two_standard_errors():
    rival = side((1.0,), (0.9800, 0.9801, 0.9799))
    assert e10_accuracy(side((1.0,), (0.9830, 0.9831, 0.9829)), rival) == "higher"
    assert e10_accuracy(side((1.0,), (0.9770, 0.9771, 0.9769)), rival) == "lower"
    assert e10_accuracy(side((1.0,), (0.9820, 0.9821, 0.9819)), rival) == "tie"  # 0.2 points
    # 0.5 points on the means, but the seeds scatter more
    assert e10_accuracy(side((1.0,), (0.975, 0.995, 0.985)), rival) == "tie"
    # the gap beyond one standard error but not two
    assert e10_accuracy(side((1.0,), (0.980, 0.990, 0.985)), rival) == "tie"
    # more diverged runs: lower, whatever the others'
    assert e10_accuracy(side((1.0,), (0.99, math.nan, 0.99)), rival) == "lower"
    assert e10_accuracy(rival, side((1.0,), (math.nan, 0.99, 0.99))) == "higher"
    both = side((1.0,), (0.9830, 0.9831, math.nan))
    assert e10_accuracy(both, side((1.0,), (0.9800, math.nan, 0.9801))) == "higher"
    assert e10_accuracy(side((1.0,), ()), side((1.0,), ())) == "tie"


@pytest.mark.parametrize(("time", "acc", "verdict"), [
    ("faster", "higher", "GEM wins"), ("faster", "tie", "GEM wins"),
    ("tie", "higher", "GEM wins"), ("neither", "higher", "GEM wins"),
    ("slower", "lower", "GEM loses"), ("slower", "tie", "GEM loses"),
    ("tie", "lower", "GEM loses"), ("neither", "lower", "GEM loses"),
    ("faster", "lower", "mixed"), ("slower", "higher", "mixed"),
    ("tie", "tie", "even"), ("neither", "tie", "even")])
def test_outcomes_to_verdicts(time, acc, verdict):
    times = {"faster": ((10.0,), (20.0,)), "slower": ((20.0,), (10.0,)),
             "tie": ((10.0,), (10.0,)), "neither": ((None,), (None,))}[time]
    accs = {"higher": ((0.99,), (0.98,)), "lower": ((0.98,), (0.99,)),
            "tie": ((0.98,), (0.98,))}[acc]
    gem, rival = Side(times[0], accs[0]), Side(times[1], accs[1])
    assert e10_verdict(gem, rival) == (verdict, time, acc)
