"""Figures and a short Markdown summary of one gem_mpi run, from its HDF5 metrics file.

    python tools/report.py RUN.h5 [-o DIR]

Writes PNG figures and summary.md into DIR (default: RUN_report/ beside the file). Works on
runs of every method (figures a method cannot have are skipped, and summary.md says why),
on a run that crashed half-way (whatever was written before the crash) and on one still
training. A path that is missing, not HDF5 or not a gem_mpi run is one line on stderr and
exit code 2. docs/ANALYSIS.md describes each figure.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gem_mpi.outputs import analysis as an
from gem_mpi.outputs import figures, runfile, scalars

PROG = "report.py"
FINAL_FRACTION = 0.1  # "final training loss": mean over the last 10 % of updates


@dataclass
class Outcome:
    """What a report produced: figures with captions, figures skipped with the reason."""

    figures: list[tuple[str, str]] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _log_if_wide(ax: Any, y: np.ndarray) -> None:
    y = y[np.isfinite(y)]
    if y.size and y.min() > 0 and y.max() / y.min() > 100:
        ax.set_yscale("log")


def _raw_and_smooth(ax: Any, x: np.ndarray, raw: np.ndarray, smooth: np.ndarray,
                    color: str, label: str) -> None:
    k = an.thin(x.size)
    ax.plot(x[k], raw[k], ".", color=color, alpha=0.12, markersize=2, label="raw")
    ax.plot(x, smooth, "-", color=color, linewidth=1.4, label=label)


def fig_loss(run: runfile.Run, plt: Any, out: Outcome) -> Any:
    """Training loss against worker steps and against the master's seconds."""
    by_steps = an.loss_by_steps(run)
    if by_steps is None:
        return "no loss column in /updates"
    t, loss = run.col("time"), run.col("loss")
    panels = 2 if t is not None else 1
    if t is None:
        out.notes.append("loss against seconds not plotted: the run has no time column")
    fig, axes = plt.subplots(1, panels, figsize=(8, 3.2), squeeze=False)
    steps, raw, smoothed = by_steps
    ax = axes[0, 0]
    _raw_and_smooth(ax, steps, raw, smoothed, "C0", "smoothed")
    ax.set(xlabel="worker steps", ylabel="worker mini-batch loss",
           title="training loss against worker steps")
    _log_if_wide(ax, smoothed)
    ax.legend(loc="upper right")
    if t is not None:
        ax = axes[0, 1]
        lf = loss.astype(np.float64)
        smoothed_t = an.smooth(lf)
        _raw_and_smooth(ax, t, lf, smoothed_t, "C1", "smoothed")
        ax.set(xlabel="seconds (master)", title="training loss against time")
        _log_if_wide(ax, smoothed_t)
        ax.legend(loc="upper right")
    return fig


def fig_eval(run: runfile.Run, plt: Any, out: Outcome) -> Any:
    """Test accuracy and loss of the central variable at each evaluation."""
    loss = run.eval_col("test_loss")
    if loss is None or loss.size == 0:
        why = "the run ended before its first evaluation" if not run.finished else \
            "the file has no evaluation rows"
        return f"no evaluation rows ({why})"
    x, xlabel = run.eval_col("time"), "seconds (master)"
    if x is None:
        x, xlabel = run.eval_col("clock"), "master updates"
    if x is None:
        x, xlabel = np.arange(loss.size, dtype=np.float64), "evaluation"
    acc = run.eval_col("test_accuracy")
    has_acc = acc is not None and bool(np.isfinite(acc).any())
    if not has_acc:
        out.notes.append("test accuracy not plotted: it is NaN (no classes, e.g. the "
                         "quadratic model) or absent")
    fig, axes = plt.subplots(1, 2 if has_acc else 1, figsize=(8 if has_acc else 4.5, 3.2),
                             squeeze=False)
    axes = list(axes[0])
    if has_acc:
        ax = axes.pop(0)
        ax.plot(x, 100 * acc, "o-", color="C2", markersize=3)
        ax.set(xlabel=xlabel, ylabel="%", title="test accuracy")
        ax.set_xlim(left=0)
    ax = axes[0]
    ax.plot(x, loss, "o-", color="C3", markersize=3)
    ax.set(xlabel=xlabel, title="test loss")
    ax.set_xlim(left=0)
    _log_if_wide(ax, loss.astype(np.float64))
    return fig


def _not_gem(run: runfile.Run, what: str) -> str:
    return f"no {what} columns: method {run.method} records none (GEM only)"


def fig_pi(run: runfile.Run, plt: Any, out: Outcome) -> Any:
    """Median π over worker steps (the paper's figure 3)."""
    med = an.median_pi(run)
    if med is None:
        return _not_gem(run, "pi_median")
    steps = an.worker_steps(run)
    order = np.argsort(steps, kind="stable")
    fig, ax = plt.subplots(figsize=(6, 3.2))
    _raw_and_smooth(ax, steps[order], med[order], an.smooth(med[order]), "C4", "smoothed")
    ax.axhline(1.0, color="k", linewidth=0.8, linestyle=":", label="π = 1 (unscaled)")
    pi_max = float(run.config.get("pi_max", np.nanmax(med) if med.size else 1.0))
    ax.set(xlabel="worker steps", ylabel="median π", ylim=(0, pi_max * 1.02),
           title="median π over worker steps (size-weighted over tensors)")
    ax.legend(loc="upper right")
    return fig


def fig_pi_heatmap(run: runfile.Run, plt: Any, out: Outcome) -> Any:
    """Per-tensor median π over master updates (the paper's figures 9 and 10)."""
    heat = an.pi_heatmap(run)
    if heat is None:
        return _not_gem(run, "pi_median")
    cells, edges = heat
    n_tensors = cells.shape[0]
    fig, ax = plt.subplots(figsize=(8, min(8.0, max(2.6, 0.2 * n_tensors + 1.4))))
    vmax = float(run.config.get("pi_max", np.nanmax(cells)))
    im = ax.imshow(cells, aspect="auto", interpolation="nearest", cmap="viridis",
                   vmin=0.0, vmax=vmax, extent=(edges[0], edges[-1], n_tensors, 0))
    names = run.tensor_names if len(run.tensor_names) == n_tensors else \
        [str(i) for i in range(n_tensors)]
    step = max(1, math.ceil(n_tensors / 30))
    ax.set_yticks(np.arange(0, n_tensors, step) + 0.5, names[::step], fontsize=6)
    ax.set(xlabel="master updates", title="median π per tensor over master updates")
    ax.grid(False)
    fig.colorbar(im, ax=ax, label="median π", pad=0.01)
    return fig


def fig_staleness(run: runfile.Run, plt: Any, out: Outcome) -> Any:
    """Staleness histogram, its mean beside the n − 1 that theory expects."""
    st, shares = an.staleness(run), an.staleness_shares(run)
    if st is None or shares is None:
        return "no staleness column (a synchronous run has none)"
    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    ax.bar(shares[0], shares[1] * run.col("staleness").size, width=0.9, color="C0", alpha=0.8)
    ax.axvline(st.mean, color="C3", linewidth=1.5, label=f"mean {st.mean:.2f}")
    ax.axvline(st.theory, color="k", linestyle="--", linewidth=1.2,
               label=f"theory n − 1 = {st.theory}")
    ax.set(xlabel="staleness τ (updates)", ylabel="updates", title="staleness")
    ax.legend(loc="upper right")
    return fig


def fig_energy(run: runfile.Run, plt: Any, out: Outcome) -> Any:
    """Central-variable energy over proxy energy: 1 is what GEM aims for."""
    ratio = an.energy_ratio(run)
    if ratio is None:
        return _not_gem(run, "energy_central/energy_proxy")
    if not np.isfinite(ratio).any():
        return "energy_proxy is 0 or NaN in every row: no ratio to plot"
    t = run.col("time")
    x, xlabel = (t, "seconds (master)") if t is not None else (
        np.arange(ratio.size, dtype=np.float64), "master updates")
    ok = np.isfinite(ratio) & (ratio > 0)
    fig, ax = plt.subplots(figsize=(6, 3.2))
    _raw_and_smooth(ax, x[ok], ratio[ok], np.exp(an.smooth(np.log(ratio[ok]))), "C5",
                    "smoothed (geometric)")
    ax.axhline(1.0, color="k", linewidth=0.8, linestyle="--", label="matched (1)")
    ax.set_yscale("log")
    ax.set(xlabel=xlabel, ylabel="energy_central / energy_proxy",
           title="GEM compliance: central over proxy energy")
    ax.legend(loc="upper right")
    return fig


def _rejected_text(run: runfile.Run) -> str:
    if run.method == "sync":
        return "n/a (sync: no master; every step averages all workers' gradients)"
    count = an.rejected(run)
    return str(count) if count is not None else "not recorded (a file from before gem_mpi " \
        "counted them)"


def fig_throughput(run: runfile.Run, plt: Any, out: Outcome) -> Any:
    """Updates per second applied by the master."""
    tp = an.throughput(run)
    if tp is None:
        return "no time column (or fewer than 2 updates)"
    centres, rate = tp
    fig, ax = plt.subplots(figsize=(6, 3.2))
    width = centres[1] - centres[0] if centres.size > 1 else 1.0
    ax.bar(centres, rate, width=width * 0.95, color="C7", alpha=0.8)
    ups = an.updates_per_second(run)
    if math.isfinite(ups):
        ax.axhline(ups, color="C3", linewidth=1.2, label=f"whole run {ups:.1f}/s")
        ax.legend(loc="lower right")
    if run.method == "sync":  # no master: one row per synchronous step of every worker
        ax.set(xlabel="seconds (rank 0)", ylabel="steps/s", title="synchronous steps/s")
    else:
        ax.set(xlabel="seconds (master)", ylabel="updates/s", title="updates/s at the master")
    return fig


def fig_workers(run: runfile.Run, plt: Any, out: Outcome) -> Any:
    """Updates each worker contributed: fairness at a glance."""
    counts = an.worker_counts(run)
    if not counts:
        return "no worker column"
    ranks, n = np.array(list(counts)), np.array(list(counts.values()))
    fig, ax = plt.subplots(figsize=(min(10.0, max(4.5, 0.12 * ranks.size + 3)), 3.2))
    ax.bar(ranks, n, width=0.8, color="C9")
    ax.axhline(n.sum() / ranks.size, color="k", linestyle="--", linewidth=1,
               label=f"fair share {n.sum() / ranks.size:.1f}")
    ax.set(xlabel="worker rank", ylabel="updates applied", title="per-worker contributions")
    if ranks.size <= 32:
        ax.set_xticks(ranks)
    ax.legend(loc="lower right")
    return fig


FIGURES = [
    ("loss.png", "Training loss against worker steps and against time", fig_loss),
    ("eval.png", "Test accuracy and loss of the central variable", fig_eval),
    ("pi_median.png", "Median π over worker steps (paper figure 3)", fig_pi),
    ("pi_heatmap.png", "Median π per tensor over master updates (paper figures 9, 10)",
     fig_pi_heatmap),
    ("staleness.png", "Staleness histogram, mean and n − 1", fig_staleness),
    ("energy.png", "Central over proxy energy (GEM's compliance)", fig_energy),
    ("throughput.png", "Updates/s at the master", fig_throughput),
    ("workers.png", "Per-worker contributions", fig_workers),
]


def make_figures(run: runfile.Run, outdir: Path) -> Outcome:
    """Every figure the run's columns allow; a skipped figure's old file is removed."""
    plt = figures.pyplot()
    out = Outcome()
    for fname, caption, make in FIGURES:
        if run.n_updates == 0 and fname != "eval.png":
            result = "no updates written (the run stopped before its first flush)"
        else:
            result = make(run, plt, out)
        target = outdir / fname
        if isinstance(result, str):
            out.skipped.append((fname, result))
            target.unlink(missing_ok=True)
            continue
        if not run.finished:
            result.suptitle(f"{run.name}: unfinished run ({run.n_updates} updates written)",
                            fontsize=8, color="C3")
        figures.save_figure(result, target)
        out.figures.append((fname, caption))
    return out


def _num(x: float, fmt: str = ".4g") -> str:
    return "n/a" if not math.isfinite(x) else format(x, fmt)


def summary_markdown(run: runfile.Run, out: Outcome) -> str:
    """The run's numbers, each computed by gem_mpi.outputs.analysis, plus the figures' index."""
    cfg, wall = run.config, an.wall_seconds(run)
    rows: list[tuple[str, str]] = [("file", f"`{run.path}`")]
    if run.finished:
        rows.append(("status", "finished (summary/finished = 1)"))
    else:
        rows.append(("status", (f"**unfinished**: summary/finished is NaN, so the run crashed, "
                     f"was killed or is still running; this report covers the {run.n_updates} "
                     f"updates and {len(run.eval.get('test_loss', []))} evaluations written "
                     "before that")))
    rows += [
        ("method", run.method),
        ("workers", str(run.n_workers)),
        ("model", run.model),
        ("settings", ", ".join(f"{k} {cfg[k]}" for k in
                               ("lr", "momentum", "kappa", "pi_max", "batch_size",
                                "max_steps", "epochs", "seed") if k in cfg) or "?"),
        ("started", str(run.attrs.get("started", "?"))),
        ("kernel", str(run.attrs.get("kernel", "?"))),
        ("updates", str(an.applied_updates(run))),
        ("rejected updates", _rejected_text(run)),
        ("wall time", f"{wall:.2f} s" if math.isfinite(wall) else "n/a"),
        ("updates/s", _num(an.updates_per_second(run), ".2f")),
        ("final training loss", (f"{_num(an.final_train_loss(run, FINAL_FRACTION))} (mean "
         f"worker mini-batch loss over the last {FINAL_FRACTION:.0%} of updates)")),
    ]
    ft = an.final_test(run)
    acc = "n/a" if not math.isfinite(ft.accuracy) else f"{100 * ft.accuracy:.2f} %"
    rows += [("test accuracy", f"{acc} ({ft.source})"),
             ("test loss", f"{_num(ft.loss)} ({ft.source})")]
    st = an.staleness(run)
    no_tau = "n/a (no updates)" if run.n_updates == 0 else "n/a (no staleness column)"
    rows.append(("staleness", no_tau if st is None else
                 f"mean {st.mean:.3f}, median {st.median:g}, max {st.max} "
                 f"(theory: n − 1 = {st.theory})"))
    med = an.median_pi(run)
    if med is not None:
        rows.append(("median π", (f"{_num(float(np.nanmedian(med)), '.3f')} over updates; "
                     f"clamped elements {_num(100 * an.clamped_share(run), '.1f')} %")))
    ratio = an.energy_ratio(run)
    if ratio is not None and np.isfinite(ratio).any():
        lo, mid, hi = np.nanpercentile(ratio, [10, 50, 90])
        rows.append(("energy ratio", (f"median {mid:.3f} (10–90 %: {lo:.3f}–{hi:.3f}); "
                     "1 = central energy matches the proxy's")))
    counts = an.worker_counts(run)
    if counts:
        vals = list(counts.values())
        rows.append(("per-worker updates", (f"min {min(vals)}, max {max(vals)}, fair share "
                     f"{sum(vals) / len(vals):.1f}")))
    known = {"updates", "rejected", "wall_s", "test_loss", "test_accuracy", "finished"}
    extra = {k: v for k, v in run.summary.items() if k not in known and math.isfinite(v)}
    if extra:
        rows.append(("other summary fields", ", ".join(f"{k} {_num(v)}" for k, v in
                                                       sorted(extra.items()))))
    lines = [f"# gem_mpi run `{run.name}`", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in rows]
    if counts and len(counts) <= 16:
        total = max(sum(counts.values()), 1)
        lines += ["", "## Per-worker updates", "", "| worker | updates | share |",
                  "|---|---|---|"]
        lines += [f"| {r} | {c} | {100 * c / total:.1f} % |" for r, c in counts.items()]
    lines += ["", "## Figures", ""]
    lines += [f"![{cap}]({fname})" + "\n" for fname, cap in out.figures]
    if out.skipped:
        lines += ["## Not plotted", ""]
        lines += [f"- `{fname}`: {why}" for fname, why in out.skipped]
        lines.append("")
    notes = run.notes + out.notes
    if notes:
        lines += ["## Notes", ""]
        lines += [f"- {n}" for n in notes]
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python tools/report.py",
        description="PNG figures and a Markdown summary (summary.md) of one gem_mpi run "
        "from its HDF5 metrics file (python -m gem_mpi.train --metrics RUN.h5). Figures a "
        "run cannot have (π and energies for non-GEM methods, staleness for synchronous "
        "runs) are skipped and summary.md says so; an unfinished run is reported as far as "
        "it went.")
    p.add_argument("run", metavar="RUN.h5", help="the metrics file")
    p.add_argument("-o", "--output", metavar="DIR", help="output folder (default: "
                   "RUN_report/ beside RUN.h5); created if needed")
    p.add_argument("--tensorboard", metavar="DIR", help="also write the run's scalars as "
                   "TensorBoard event files into DIR (tensorboard --logdir DIR), as "
                   "python -m gem_mpi.train --tensorboard writes them live")
    return p


def main(argv: list[str]) -> int:
    """Report one run; returns the exit code."""
    args = build_parser().parse_args(argv)
    run = runfile.load_run(args.run)
    path = Path(args.run)
    outdir = Path(args.output) if args.output else path.with_name(path.stem + "_report")
    outdir.mkdir(parents=True, exist_ok=True)
    outcome = make_figures(run, outdir)
    (outdir / "summary.md").write_text(summary_markdown(run, outcome))
    state = "finished" if run.finished else "UNFINISHED"
    skipped = f", skipped {len(outcome.skipped)}" if outcome.skipped else ""
    print(f"{PROG}: {run.name} ({run.label}, {state}, {run.n_updates} updates): "
          f"{len(outcome.figures)} figures{skipped} and summary.md in {outdir}")
    if args.tensorboard:
        split = "validation" if run.config.get("holdout") else "test"
        points = scalars.export(run.updates, run.eval, split, args.tensorboard)
        print(f"{PROG}: {points} TensorBoard points in {args.tensorboard}: "
              f"tensorboard --logdir {args.tensorboard}")
    return 0


if __name__ == "__main__":
    runfile.cli(PROG, main)
