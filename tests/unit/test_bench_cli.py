"""``python -m gem_mpi.bench``'s command line, built from each bench module's ``register``:
every subcommand there, in the order of its help, and an option a bench refuses after
parsing reported as argparse reports its own. In-process: nothing is measured."""

from __future__ import annotations

import argparse

import pytest

from gem_mpi.bench import __main__ as cli


def test_every_bench_registers_its_subcommand_and_what_runs_it():
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="what")
    names = []
    for bench in cli.BENCHES:
        p = bench.register(sub)
        names.append(p.prog.split()[-1])
        assert callable(p.get_default("run")) and callable(p.get_default("show"))
    assert names == ["kernel", "master", "transport", "compare", "overhead", "gpu", "overlap",
                     "groups", "lm"]


def test_a_bad_thread_count_is_a_usage_error_of_the_command(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["kernel", "--threads", "0", "--sizes", "10"])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: python -m gem_mpi.bench [-h]")
    assert err.rstrip().endswith(
        "python -m gem_mpi.bench: error: --threads: every count must be at least 1")


def test_overhead_repeats_are_grouped_by_setting_and_summed_up_as_median_and_range():
    """--repeat: the runs of one setting, in their order, as one median (min–max) line."""
    from gem_mpi.bench.overhead import _medians, _spread

    def row(masters: int, repeat: int, ratio: float) -> dict:
        return {"method": "gem", "mode": "wait", "masters": masters, "loaders": 0,
                "workers": 2, "via": 1, "repeat": repeat, "ratio": ratio}

    rows = [row(1, 1, 0.8), row(1, 2, 0.9), row(1, 3, 0.5), row(2, 1, 0.7), row(2, 2, 0.6)]
    groups = _medians(rows)
    assert [key for key, _ in groups] == [("gem", "wait", 1, 0, 2, 1), ("gem", "wait", 2, 0, 2, 1)]
    assert [[r["repeat"] for r in g] for _, g in groups] == [[1, 2, 3], [1, 2]]
    assert _spread(groups[0][1], "ratio") == "0.80 (0.50–0.90)"
    assert _spread([{"ratio": None}], "ratio") == "–"
