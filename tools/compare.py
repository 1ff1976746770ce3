"""Several gem_mpi runs side by side: overlaid loss curves, final loss against workers, a table.

    python tools/compare.py RUN.h5 [RUN.h5 ...] [-o DIR]

Writes into DIR (default: compare_report/ in the current folder): loss_steps.png and
loss_time.png (smoothed training loss, one panel per method, one colour per number of
workers), final_loss.png (final training loss against the number of workers, one line per
method: the paper's figure 1d), and compare.md / compare.csv (final training loss, test
accuracy and loss, wall time and updates/s of every run). Unfinished runs are included as
far as they went and marked as such. Any path that is missing, not HDF5 or not a gem_mpi
run is one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import csv
import math
from pathlib import Path
from typing import Any

import numpy as np

from gem_mpi.outputs import analysis as an
from gem_mpi.outputs import runfile
from gem_mpi.outputs.figures import pyplot, save_figure

PROG = "compare.py"
FINAL_FRACTION = 0.1  # final training loss: mean over the last 10 % of each run's updates
COLUMNS = ["run", "method", "workers", "model", "status", "updates", "final_train_loss",
           "test_accuracy", "test_loss", "wall_s", "updates_per_s"]


def table_rows(runs: list[runfile.Run]) -> list[dict[str, Any]]:
    """One row of numbers per run, as gem_mpi.outputs.analysis computes them for every tool."""
    rows = []
    for run in runs:
        ft = an.final_test(run)
        rows.append({
            "run": run.name, "method": run.method, "workers": run.n_workers,
            "model": run.model, "status": "finished" if run.finished else "unfinished",
            "updates": an.applied_updates(run),
            "final_train_loss": an.final_train_loss(run, FINAL_FRACTION),
            "test_accuracy": ft.accuracy, "test_loss": ft.loss,
            "wall_s": an.wall_seconds(run), "updates_per_s": an.updates_per_second(run),
        })
    return rows


def _fmt(value: Any, fmt: str) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        return ""
    return format(value, fmt)


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    """Plain numbers (empty where a run has none) for spreadsheets and scripts."""
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for row in rows:
            w.writerow({k: _fmt(v, ".6g" if isinstance(v, float) else "")
                        for k, v in row.items()})


def _colours(runs: list[runfile.Run], plt: Any) -> dict[int, Any]:
    """One colour per number of workers, the same in every panel."""
    ns = sorted({r.n_workers for r in runs})
    cmap = plt.get_cmap("viridis")
    return {n: cmap(0.85 * i / max(len(ns) - 1, 1)) for i, n in enumerate(ns)}


TWIN_STYLES = ["-", "-.", ":", (0, (5, 1, 1, 1, 1, 1))]


def _curve_style(run: runfile.Run, runs: list[runfile.Run]) -> tuple[str, Any]:
    """(label, line style): runs with the same method and workers (seeds, settings) get
    their names and a line style each; an unfinished run alone is dashed."""
    twins = [r for r in runs if (r.method, r.n_workers) == (run.method, run.n_workers)]
    label = f"n={run.n_workers}" + (f" ({run.name})" if len(twins) > 1 else "")
    label += "" if run.finished else " unfinished"
    if len(twins) > 1:
        return label, TWIN_STYLES[twins.index(run) % len(TWIN_STYLES)]
    return label, "-" if run.finished else "--"


def fig_loss(runs: list[runfile.Run], plt: Any, against: str, notes: list[str]) -> Any:
    """Smoothed training loss per run, one panel per method, overlaid within a panel."""
    methods = sorted({r.method for r in runs})
    ncols = min(3, len(methods))
    nrows = math.ceil(len(methods) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(3.6 * ncols + 0.6, 3.0 * nrows),
                             squeeze=False)
    colours = _colours(runs, plt)
    for ax, method in zip(axes.flat, methods):
        lows, highs = [], []
        for run in (r for r in runs if r.method == method):
            if against == "steps":
                curve = an.loss_by_steps(run)
                if curve is None:
                    notes.append(f"{run.name}: no loss column, not in loss_steps.png")
                    continue
                x, _, y = curve
            else:
                t, loss = run.col("time"), run.col("loss")
                if t is None or loss is None:
                    notes.append(f"{run.name}: no time or loss column, not in loss_time.png")
                    continue
                x, y = t, an.smooth(loss)
            k = an.thin(x.size)
            label, style = _curve_style(run, runs)
            ax.plot(x[k], y[k], color=colours[run.n_workers], linewidth=1.3, linestyle=style,
                    label=label)
            finite = y[np.isfinite(y)]
            if finite.size:
                lows.append(finite.min())
                highs.append(finite.max())
        if lows and min(lows) > 0 and max(highs) / min(lows) > 100:
            ax.set_yscale("log")
        ax.set(title=method, xlabel="worker steps" if against == "steps" else
               "seconds (master)", ylabel="training loss (smoothed)")
        ax.legend(loc="upper right")
    for ax in list(axes.flat)[len(methods):]:
        ax.set_visible(False)
    return fig


def fig_final_loss(runs: list[runfile.Run], rows: list[dict[str, Any]], plt: Any) -> Any:
    """Final training loss against the number of workers, one line per method (fig. 1d)."""
    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    for i, method in enumerate(sorted({r.method for r in runs})):
        pts = [(row["workers"], row["final_train_loss"], run.finished)
               for run, row in zip(runs, rows) if run.method == method
               and math.isfinite(row["final_train_loss"])]
        if not pts:
            continue
        colour = f"C{i}"
        ns = sorted({n for n, _, _ in pts})
        means = [np.mean([y for n2, y, _ in pts if n2 == n]) for n in ns]
        ax.plot(ns, means, "-", color=colour, label=method)
        for n, y, done in pts:
            ax.plot(n, y, "o", color=colour, markerfacecolor=colour if done else "none")
    ns_all = sorted({r.n_workers for r in runs})
    if ns_all and ns_all[0] > 0 and ns_all[-1] / ns_all[0] >= 10:
        ax.set_xscale("log")
    ax.set_xticks(ns_all, [str(n) for n in ns_all])
    ax.set(xlabel="number of workers", ylabel=f"final training loss (last "
           f"{FINAL_FRACTION:.0%} of updates)", title="final training loss against workers")
    ax.legend(loc="best", title="open marker: unfinished" if not all(r.finished for r in runs)
              else None)
    return fig


def markdown(rows: list[dict[str, Any]], figures: list[str], notes: list[str]) -> str:
    head = ["run", "method", "workers", "model", "status", "updates", "final training loss",
            "test accuracy", "test loss", "wall s", "updates/s"]
    lines = ["# gem_mpi runs compared", "", "| " + " | ".join(head) + " |",
             "|" + "---|" * len(head)]
    for row in rows:
        acc = row["test_accuracy"]
        cells = [f"`{row['run']}`", row["method"], str(row["workers"]), row["model"],
                 row["status"] if row["status"] == "finished" else "**unfinished**",
                 str(row["updates"]), _fmt(row["final_train_loss"], ".4g") or "n/a",
                 f"{100 * acc:.2f} %" if math.isfinite(acc) else "n/a",
                 _fmt(row["test_loss"], ".4g") or "n/a", _fmt(row["wall_s"], ".1f") or "n/a",
                 _fmt(row["updates_per_s"], ".1f") or "n/a"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", (f"Final training loss: mean worker mini-batch loss over the last "
              f"{FINAL_FRACTION:.0%} of each run's updates. Test numbers: the final "
              "evaluation, or for an unfinished run the last one it wrote."), "",
              "## Figures", ""]
    lines += [f"![{f}]({f})\n" for f in figures]
    if notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    return "\n".join(lines).rstrip() + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python tools/compare.py",
        description="Compare gem_mpi runs (HDF5 metrics files): training loss curves "
        "overlaid per method and number of workers, final training loss against the "
        "number of workers per method (paper figure 1d), and a Markdown/CSV table of "
        "final loss, test accuracy, wall time and updates/s.")
    p.add_argument("runs", nargs="+", metavar="RUN.h5", help="metrics files, any methods")
    p.add_argument("-o", "--output", metavar="DIR", default="compare_report",
                   help="output folder, created if needed")
    return p


def main(argv: list[str]) -> int:
    """Compare the runs; returns the exit code."""
    args = build_parser().parse_args(argv)
    runs = [runfile.load_run(p) for p in args.runs]  # every file is checked before any output
    runs.sort(key=lambda r: (r.method, r.n_workers, r.name))
    outdir = Path(args.output)
    outdir.mkdir(parents=True, exist_ok=True)
    plt = pyplot()
    notes = [f"{r.name}: unfinished (summary/finished is NaN): {r.n_updates} updates "
             "written before it stopped" for r in runs if not r.finished]
    models = sorted({r.model for r in runs})
    if len(models) > 1:
        notes.append(f"the runs train different problems ({', '.join(models)}): their "
                     "losses are not on one scale")
    notes += [f"{r.name}: {n}" for r in runs for n in r.notes]
    rows = table_rows(runs)
    figures = []
    for fname, fig in (("loss_steps.png", fig_loss(runs, plt, "steps", notes)),
                       ("loss_time.png", fig_loss(runs, plt, "time", notes)),
                       ("final_loss.png", fig_final_loss(runs, rows, plt))):
        save_figure(fig, outdir / fname)
        figures.append(fname)
    write_csv(rows, outdir / "compare.csv")
    (outdir / "compare.md").write_text(markdown(rows, figures, notes))
    print(f"{PROG}: {len(runs)} runs: {len(figures)} figures, compare.md and compare.csv "
          f"in {outdir}")
    return 0


if __name__ == "__main__":
    runfile.cli(PROG, main)
