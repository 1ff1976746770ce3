"""E11's rule (experiments.py: E11_LRS, e11_choose_lr; results.py: e11_verdict) on made-up
numbers: the tuning choice, each time and loss outcome with its margins, every verdict, and
how its main runs wait for their tuning runs, so that a change of the rule fixed before the
runs fails here."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from gem_mpi.reproduce import experiments as ex
from gem_mpi.reproduce import runner
from gem_mpi.reproduce.results import E11_VERDICTS, LossSide, e11_loss, e11_time, e11_verdict


def side(times, bits=(2.0, 2.0, 2.0)) -> LossSide:
    return LossSide(tuple(times), tuple(bits))


def test_the_constants_are_those_fixed_before_the_runs():
    assert ex.E11_LRS == (3e-4, 1e-3, 3e-3, 1e-2)
    assert (ex.E11_TUNE_SEED, ex.E11_TARGET_BITS, ex.E11_TIME_RATIO, ex.E11_LOSS_RATIO) == (
        100, 3.5, 1.1, 1.01)


def test_the_tuning_takes_the_lowest_validation_loss():
    assert ex.e11_choose_lr({3e-4: 2.0, 1e-3: 1.5, 3e-3: 1.7, 1e-2: math.inf}) == 1e-3
    assert ex.e11_choose_lr({3e-4: 2.0, 1e-3: 1.5, 3e-3: 1.5, 1e-2: 1.6}) == 1e-3  # tie
    assert ex.e11_choose_lr({3e-4: math.nan, 1e-3: math.inf, 3e-3: 1.9, 1e-2: math.inf}) == 3e-3
    assert ex.e11_choose_lr(dict.fromkeys(ex.E11_LRS, math.inf)) == 3e-4  # all diverged
    with pytest.raises(ValueError, match="every η"):
        ex.e11_choose_lr({1e-3: 1.0, 3e-3: 2.0})  # a 2-point grid is not the rule


def test_time_needs_the_ratio_and_two_standard_errors():
    gem = side((10.0, 10.1, 9.9))
    assert e11_time(gem, side((11.5, 11.6, 11.4))) == "faster"
    assert e11_time(side((11.5, 11.6, 11.4)), gem) == "slower"
    assert e11_time(gem, side((10.8, 10.9, 10.7))) == "tie"  # within 10 %
    assert e11_time(gem, side((5.0, 25.0, 15.0))) == "tie"  # the seeds scatter more
    assert e11_time(gem, side((12.0, None, 12.0))) == "faster"  # a seed did not reach
    assert e11_time(side((None,)), side((None,))) == "neither"


def test_loss_needs_one_per_cent_and_two_standard_errors():
    rival = side((1.0,), (3.000, 3.001, 2.999))
    assert e11_loss(side((1.0,), (2.950, 2.951, 2.949)), rival) == "lower"  # 1.7 %
    assert e11_loss(side((1.0,), (3.050, 3.051, 3.049)), rival) == "higher"
    assert e11_loss(side((1.0,), (2.980, 2.981, 2.979)), rival) == "tie"  # 0.7 %
    assert e11_loss(side((1.0,), (2.80, 3.10, 2.95)), rival) == "tie"  # the seeds scatter
    # more diverged runs: higher, whatever the others'
    assert e11_loss(side((1.0,), (2.0, math.nan, 2.0)), rival) == "higher"
    assert e11_loss(rival, side((1.0,), (math.nan, 2.0, 2.0))) == "lower"
    assert e11_loss(side((1.0,), (2.9,)), side((1.0,), (3.0,))) == "lower"  # 1 seed: ratio


def test_every_verdict_is_reachable():
    fast, slow = (10.0, 10.0, 10.0), (20.0, 20.0, 20.0)
    low, high = (2.0, 2.0, 2.0), (3.0, 3.0, 3.0)
    seen = {e11_verdict(side(fast, low), side(slow, high))[0],  # faster, lower
            e11_verdict(side(slow, high), side(fast, low))[0],  # slower, higher
            e11_verdict(side(fast, high), side(slow, low))[0],  # faster, higher
            e11_verdict(side(fast, low), side(fast, low))[0]}  # tie, tie
    assert seen == {"GEM wins", "GEM loses", "mixed", "even"}
    assert e11_verdict(side((None,), low), side((None,), high)) == ("GEM wins", "neither",
                                                                     "lower")
    assert set(E11_VERDICTS) == {(t, v) for t in ("faster", "slower", "tie", "neither")
                                 for v in ("lower", "higher", "tie")}


def test_the_grid_is_the_same_at_every_budget_and_main_runs_wait(tmp_path: Path):
    for budget in (ex.quick_budget(), ex.full_budget()):
        runs = ex.experiments(budget, str(tmp_path))["E11"].runs
        tunes = [r for r in runs if r.variant.startswith("tune-")]
        mains = [r for r in runs if r.tuned_by]
        assert len(tunes) == 4 * 5 * len(ex.e11_budget(budget).ns)
        assert len(mains) == 5 * 2 * len(ex.e11_budget(budget).ns) * len(budget.seeds)
        assert {r.lr for r in tunes} == set(ex.E11_LRS)
        assert all("--holdout" in r.options and r.seed == ex.E11_TUNE_SEED for r in tunes)
        names = [r.name for r in runs]
        for r in mains:  # after its tuning runs, which are its method's at its n
            assert "--holdout" not in r.options and ex.PENDING_LR in r.options
            assert all(names.index(t) < names.index(r.name) for t, _ in r.tuned_by)
            assert {ex.e11_method(ex_run) for ex_run in tunes if ex_run.name in
                    dict(r.tuned_by)} == {ex.e11_method(r)}
    run = mains[0]
    assert runner.tuned(tmp_path, run) is None  # nothing done: it waits
    assert "waits for its tuning runs (4 of 4 not done" in runner.waits_text(tmp_path, run)
    chosen = run.with_lr(3e-3)
    assert chosen.lr == 3e-3 and "0.003" in chosen.options and ex.PENDING_LR not in \
        chosen.options


def test_spread_speeds_go_from_one_to_four():
    assert ex.e11_speeds(2) == "1,4" and ex.e11_speeds(4) == "1,2,3,4"
    assert ex.e11_speeds(8).split(",")[0] == "1" and ex.e11_speeds(8).split(",")[-1] == "4"


def test_a_main_run_takes_the_eta_of_its_done_tuning_runs(tmp_path: Path, monkeypatch):
    """runner.tuned reads each tuning run's final validation loss (a diverged one: inf) and
    sets --lr by the rule; one tuning run not done keeps the main run waiting."""
    from types import SimpleNamespace

    run = next(r for r in ex.experiments(ex.quick_budget(), str(tmp_path))["E11"].runs
               if r.tuned_by)
    loss = dict(zip(ex.E11_LRS, (2.0, 1.2, 1.1, None)))  # η 0.01 diverged
    files = {}
    for name, lr in run.tuned_by:
        (tmp_path / f"{name}.h5").touch()
        summary = {"diverged": 1.0} if loss[lr] is None else {"test_loss": loss[lr]}
        files[str(tmp_path / f"{name}.h5")] = SimpleNamespace(
            finished=loss[lr] is not None, summary=summary)
    monkeypatch.setattr(runner.runfile, "load_run", lambda path: files[str(path)])
    assert runner.tuning_losses(tmp_path, run) == {3e-4: 2.0, 1e-3: 1.2, 3e-3: 1.1,
                                                   1e-2: math.inf}
    chosen = runner.tuned(tmp_path, run)
    assert chosen is not None and chosen.lr == 3e-3
    assert chosen.options[chosen.options.index("--lr") + 1] == "0.003"
    first = run.tuned_by[0][0]
    files[str(tmp_path / f"{first}.h5")] = SimpleNamespace(finished=False, summary={})
    assert runner.tuned(tmp_path, run) is None  # stopped before the end: not done


def test_every_e11_command_passes_the_preflight(tmp_path: Path):
    """Each (budget, method, case, n)'s options are accepted as gem_mpi.train would take
    them (the data itself: the quick run reads it), a main run once its η is set."""
    from gem_mpi import config
    from gem_mpi.run.preflight import validate

    seen = set()
    for budget in (ex.quick_budget(), ex.full_budget()):
        for r in ex.experiments(budget, str(tmp_path))["E11"].runs:
            if (budget.name, r.variant, r.n) not in seen:
                seen.add((budget.name, r.variant, r.n))
                cfg, _ = config.parse(list((r.with_lr(1e-3) if r.tuned_by else r).options))
                validate(cfg, r.ranks, data=False)
    assert len(seen) == 45
