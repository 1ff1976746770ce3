"""E10's rules on made-up numbers: the verdict (results.py: e10_verdict), each outcome, its
margins and the table from outcomes to verdicts; the tuning (experiments.py: E10_LRS,
choose_lr) and how the main runs wait for it; so that a change of the rules fixed before the
runs fails here."""

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


def test_the_tuning_grid_holds_the_paper_s_eta_and_the_linear_scaling_values():
    assert ex.E10_LRS == (0.025, 0.05, 0.1, 0.2, 0.4)
    assert (ex.E10_TUNE_SEED, ex.E10_HOLDOUT) == (100, 10_000)
    full = ex.full_budget()
    assert full.e10_tune_steps == 100 and ex.e10_lrs(full) == ex.E10_LRS
    for n in full.e10_ns:  # DDP's and DiLoCo's steps average n gradients: η 0.05 · n
        assert 0.05 * n in ex.E10_LRS
    assert 0.05 in ex.E10_LRS  # the paper's MNIST setting, E10's η before it was tuned


def test_the_tuning_takes_the_lowest_validation_loss():
    assert ex.choose_lr({0.025: 0.3, 0.05: 0.2, 0.1: 0.25, 0.2: math.inf, 0.4: math.inf}) == 0.05
    assert ex.choose_lr({0.05: 0.2, 0.1: 0.2}) == 0.05  # a tie: the smaller η
    assert ex.choose_lr({0.1: math.inf, 0.05: math.inf}) == 0.05  # all diverged: the smallest
    with pytest.raises(ValueError):
        ex.choose_lr({})


def test_every_main_run_waits_for_its_method_s_tuning_runs_at_its_n(tmp_path):
    for budget in (ex.quick_budget(), ex.full_budget()):
        runs = ex.experiments(budget, str(tmp_path))["E10"].runs
        tunes = [r for r in runs if r.variant.startswith("tune-")]
        mains = [r for r in runs if r.tuned_by]
        grid = ex.e10_lrs(budget)
        assert len(tunes) == len(grid) * 3 * len(budget.e10_ns)
        assert len(mains) == 3 * 2 * len(budget.e10_ns) * len(budget.seeds)
        assert len(runs) == len(tunes) + len(mains)
        for t in tunes:  # no straggler, validated on the held-out images, at its grid's η
            assert t.seed == ex.E10_TUNE_SEED and t.steps == budget.e10_tune_steps
            assert "--holdout" in t.options and "--straggler" not in t.options
            assert t.options[t.options.index("--lr") + 1] == f"{t.lr:g}"
        names = [r.name for r in runs]
        for r in mains:
            assert "--holdout" not in r.options and ex.PENDING_LR in r.options
            assert "-tuned-" in r.name  # apart from the files of E10 before it was tuned
            by = dict(r.tuned_by)
            assert sorted(by.values()) == sorted(grid)
            assert all(names.index(t) < names.index(r.name) for t in by)
            assert {t.method for t in tunes if t.name in by} == {r.method}
            assert {t.n for t in tunes if t.name in by} == {r.n}


def test_every_e10_command_passes_the_preflight(tmp_path):
    """Each tuning and main run's options are accepted as gem_mpi.train would take them."""
    from gem_mpi import config
    from gem_mpi.run.preflight import validate

    for budget in (ex.quick_budget(), ex.full_budget()):
        for r in ex.experiments(budget, str(tmp_path))["E10"].runs:
            cfg, _ = config.parse(list((r.with_lr(0.1) if r.tuned_by else r).options))
            validate(cfg, r.ranks, data=False)
