"""``--report``: one Markdown page per experiment, with figures like the paper's as PNG.

Each page says what the paper shows, what ran, the figure, a table of the numbers, and the
provenance: the exact commands (from each run's record), wall times, machine, commit, and
the sha256 and size of each HDF5 file (the files themselves are not published). Missing runs
are listed as "not run yet". docs/results/README.md (the claims table) is claims.py's.
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gem_mpi.outputs import analysis, figures
from gem_mpi.reproduce import experiments as ex
from gem_mpi.reproduce import runner
from gem_mpi.reproduce.results import (
    LossSide,
    Results,
    Side,
    Stat,
    difference,
    diverged_count,
    e10_side,
    e10_verdict,
    e11_side,
    e11_verdict,
    file_digest,
    group,
    loss_curve,
    mean_curve,
    pi_curve,
    stat,
)

Body = Callable[[Results, ex.Experiment, Path], list[str]]


def _num(x: float, fmt: str = ".3f") -> str:
    return format(x, fmt) if isinstance(x, (int, float)) and math.isfinite(x) else "–"


def md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return out + ["| " + " | ".join(row) + " |" for row in rows]


def _figure(out: Path, name: str, fig, caption: str) -> list[str]:
    figures.save_figure(fig, out / name)
    return [f"![{caption}]({name})", "", f"*{caption}*", ""]


def _div(res: Results, runs: list[ex.Run]) -> str:
    k, m = diverged_count(res, runs)
    return f"{k}/{m}" if m else "–"


def _summary_rows(res: Results, groups: dict, label: Callable, pi: bool = True
                  ) -> list[list[str]]:
    """One row per group: runs done, diverged, final training loss, test accuracy, π, wall."""
    rows = []
    for key, runs in groups.items():
        done = res.done(runs)
        row = [*label(key), f"{len(done)}/{len(runs)}", _div(res, runs),
               stat(res, runs, "final_loss").text(), stat(res, runs, "test_accuracy").text(
                   ".2f", 100, " %")]
        if pi:
            row.append(stat(res, runs, "median_pi", finished_only=False).text(".3f"))
        row.append(stat(res, runs, "wall_s", finished_only=False).text(".0f"))
        rows.append(row)
    return rows


def _band(ax, curve: tuple[np.ndarray, np.ndarray, np.ndarray], label: str, **kw) -> None:
    """A mean curve over seeds with its spread (± one sd) shaded in the line's colour."""
    x, y, sd = curve
    (line,) = ax.plot(x, y, lw=1, label=label, **kw)
    if np.isfinite(sd).any():
        ax.fill_between(x, y - sd, y + sd, color=line.get_color(), alpha=0.2, lw=0)


def workers(n: int) -> str:
    return f"{n} worker" + ("" if n == 1 else "s")


# the colours of the summary panels' series (methods, readings): C0–C3 mean n in the curve
# panels beside them, so that a colour has one meaning per figure
SERIES = ("C4", "C5", "C6", "C7", "C8", "C9")


def _curves(ax, res: Results, groups: dict, label: Callable, curve=loss_curve,
            log: bool = True, ylabel: str = "training loss",
            colours: dict | None = None) -> None:
    """Mean curves over seeds, one per group, ± one sd shaded; a group's colour is its
    place among ``groups`` (or ``colours[key]``), whether or not its runs are done, so that
    panels with the same groups colour them alike."""
    for i, (key, runs) in enumerate(groups.items()):
        done = res.done(runs)
        if not done:
            continue
        k, m = diverged_count(res, runs)
        _band(ax, mean_curve([curve(res.data(r)) for r in done]),
              label(key) + (f" ({k}/{m} diverged)" if k else ""),
              color=(colours or {}).get(key, f"C{i % 10}"))
    ax.set_xlabel("worker steps")
    ax.set_ylabel(ylabel)
    if log and ax.lines:
        ax.set_yscale("log")
    if ax.lines:
        ax.legend()


# --- the experiments ------------------------------------------------------------------------

def _e1(res: Results, exp: ex.Experiment, out: Path) -> list[str]:
    plt = figures.pyplot()
    runs = list(exp.runs)
    variants = [v for v, _, _ in ex.E1_VARIANTS]
    ns = sorted({r.n for r in runs})
    fig, axes = plt.subplots(2, 3, figsize=(12, 7))
    for ax, v in zip(axes.flat[:4], variants):
        if ax is not axes.flat[0]:
            ax.sharey(axes.flat[0])  # the methods' curves compared on one scale
        _curves(ax, res, group([r for r in runs if r.variant == v], lambda r: r.n),
                workers)
        ax.set_title(v)
    for ax, field, name in ((axes.flat[4], "final_loss", "final training loss"),
                            (axes.flat[5], "test_accuracy", "final test accuracy")):
        for v, colour in zip(variants, SERIES):
            st = [stat(res, [r for r in runs if r.variant == v and r.n == n], field)
                  for n in ns]
            ax.errorbar(ns, [s.mean for s in st], yerr=[0 if math.isnan(s.sd) else s.sd
                                                        for s in st], marker="o", label=v,
                        color=colour)
        ax.set(xlabel="asynchronous workers", ylabel=name, title=f"{name} (diverged runs "
               "left out)")
        ax.legend()
    axes.flat[4].set_yscale("log")
    lines = _figure(out, "E1.png", fig, "Training loss per worker step (mean over seeds, "
                    "smoothed) for each method and n, and the final numbers against n: the "
                    "paper's figure 1 (a–d)")
    groups = group(runs, lambda r: (r.variant, r.n))
    return lines + md_table(
        ["method", "n", "runs done", "diverged", "final training loss", "test accuracy",
         "median π", "master wall s"],
        _summary_rows(res, groups, lambda k: [k[0], str(k[1])]))


def _e2(res: Results, exp: ex.Experiment, out: Path) -> list[str]:
    plt = figures.pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    rows = []
    for run in exp.runs:
        d = res.data(run)
        label = (f"GEM, {workers(run.n)}" if run.method == "gem" else
                 f"momentum SGD (1 rank, {run.n} epochs)")
        if d is None:
            rows.append([label, "not run yet"] + ["–"] * 7)
            continue
        t, loss = d.col("time"), d.col("loss")
        sl = analysis.thin(t.size)
        a.plot(t[sl], analysis.smooth(loss)[sl], lw=1, label=label)
        et, acc = d.eval_col("time"), d.eval_col("test_accuracy")
        if et is not None and et.size:
            b.plot(et, 100 * acc, marker=".", lw=1, label=label)
        n = res.numbers(run)
        tau = analysis.staleness(d)
        mem = (res.record(run) or {}).get("memory") or {}
        rows.append([label, "diverged" if n.diverged else "finished", str(n.updates),
                     _num(n.wall_s, ".0f"), _num(analysis.updates_per_second(d), ".1f"),
                     _num(n.final_loss), _num(100 * n.test_accuracy, ".2f") + " %",
                     "–" if tau is None else f"{tau.mean:.1f} (n − 1 = {tau.theory})",
                     f"{mem['peak_tree_pss_mb'] / 1024:.1f} GB" if mem else "–"])
    a.set(xlabel="seconds", ylabel="training loss (smoothed)", yscale="log",
          title="training loss against wall-clock time")
    b.set(xlabel="seconds", ylabel="test accuracy (%)", title="test accuracy")
    for ax in (a, b):
        if ax.lines:
            ax.legend()
    lines = _figure(out, "E2.png", fig, "GEM with many workers, each one epoch of the "
                    "training set: training loss and test accuracy against wall-clock time, "
                    "the paper's figure 2")
    return lines + md_table(["run", "status", "updates (steps)", "master wall s", "updates/s",
                           "final training loss", "test accuracy", "mean staleness",
                           "peak memory (job)"], rows)


# what decides π's level, found by an audit of the Fashion-MNIST set (2026-12)
E3_LEVEL = (
    "**π's level is the data's, not the code's.** An audit ported the authors' prototype "
    "(`code/gem.py`) and ran it beside gem_mpi's `--gem-shift paper` (the prototype's "
    "reading) at n = 5 on the same data: the π distributions agree. On MNIST π = 0 in 0.446 "
    "(prototype) against 0.431 (gem_mpi) of the elements and π = π_max in 0.305 against 0.317, "
    "and both medians are ≈ 0.8, like the paper's figure 3; on Fashion-MNIST both medians are "
    "≈ 0.1, because there κ|m| ≈ 4|Δθ| meets a shift of ≈ 4|Δθ|, where on MNIST it is ≈ 10 "
    "against ≈ 8.6. So the Fashion-MNIST set's low π (docs/results/fashion-mnist/E3.md) does "
    "not say the code differs from the paper's.")


def _e3(res: Results, exp: ex.Experiment, out: Path) -> list[str]:
    plt = figures.pyplot()
    runs = [r for r in res.exps["E1"].runs if r.method == "gem"]
    readings = sorted({r.variant for r in runs})
    ns = sorted({r.n for r in runs})
    fig, axes = plt.subplots(1, len(readings) + 1, figsize=(4.2 * (len(readings) + 1), 3.6))
    for ax, v in zip(axes, readings):
        if ax is not axes[0]:
            ax.sharey(axes[0])
        _curves(ax, res, group([r for r in runs if r.variant == v], lambda r: r.n),
                workers, curve=pi_curve, log=False, ylabel="median π")
        ax.set_title(v)
    ax = axes[-1]
    rows = []
    for v, colour in zip(readings, SERIES):
        at = [[r for r in runs if r.variant == v and r.n == n] for n in ns]
        st = [stat(res, rs, "median_pi", finished_only=False) for rs in at]
        cut = [stat(res, rs, "clamped", finished_only=False) for rs in at]
        low = [stat(res, rs, "clamped_low", finished_only=False) for rs in at]
        zero = [stat(res, rs, "zero_delta", finished_only=False) for rs in at]
        ax.errorbar(ns, [s.mean for s in st], yerr=[0 if math.isnan(s.sd) else s.sd
                                                    for s in st], marker="o", label=v,
                    color=colour)
        high = [stat(res, rs, "clamped_high", finished_only=False) for rs in at]
        rows += [[v, str(n), s.text(), c.text(), lo.text(), hi.text(), z.text()]
                 for n, s, c, lo, hi, z in zip(ns, st, cut, low, high, zero)]
    ax.set(xlabel="asynchronous workers", ylabel="median π over the run",
           title="median π against n")
    ax.legend()
    lines = _figure(out, "E3.png", fig, "Median per-parameter π per worker step (mean over "
                    "seeds, smoothed) for each n, and its level over the whole run: the "
                    "paper's figure 3")
    lines += [E3_LEVEL, ""]
    lines += md_table(["GEM reading", "n", "median π over all updates",
                       "share of π clamped to 0 or π_max", "of it, clamped to 0",
                       "clamped to π_max", "Δθ = 0 (in the clamped share)"], rows)
    return lines + ["", *_staleness(res, [r for r in runs if r.variant == readings[0]], out)]


END_SHARE = 0.05  # "the end of a run": its last 5 % of updates


def _staleness(res: Results, runs: list[ex.Run], out: Path) -> list[str]:
    """Staleness as it was: τ's histogram, how far apart the workers got, π against τ, and
    π at the end of the run, when the workers that finished early have left."""
    plt = figures.pyplot()
    fig, axes = plt.subplots(1, 4, figsize=(17, 3.8))
    a, b, c, d = axes
    rows, rises = [], []
    reading = runs[0].variant if runs else "?"
    for i, (n, rs) in enumerate(group(runs, lambda r: r.n).items()):
        done = [res.data(r) for r in res.done(rs)]
        if not done:
            continue
        colour = f"C{i}"
        hist = [h for h in map(analysis.staleness_shares, done) if h is not None]
        if hist:
            top = max(h[0].size for h in hist)
            shares = np.mean([np.pad(h[1], (0, top - h[1].size)) for h in hist], axis=0)
            a.plot(np.arange(top), shares, marker=".", lw=1, color=colour, label=workers(n))
        prog = [p for p in map(analysis.progress, done) if p is not None]
        for j, p in enumerate(prog):
            frac = p.time / p.time[-1]
            sl = analysis.thin(frac.size, 4000)
            b.plot(frac[sl], p.spread[sl], lw=0.8, color=colour,
                   label=workers(n) if j == 0 else None)
        for j, dd in enumerate(done):
            pt = analysis.pi_by_staleness(dd)
            if pt is not None:
                c.plot(pt[0], pt[1], marker=".", lw=1, color=colour,
                       label=workers(n) if j == 0 else None)
        ends = []
        for dd, p in zip(done, prog):
            pi = analysis.median_pi(dd)
            if pi is None or p is None or pi.size != p.time.size:
                continue
            cut = int((1 - END_SHARE) * pi.size)
            frac = p.time / p.time[-1]
            sl = analysis.thin(frac.size, 4000)
            d.plot(frac[sl], analysis.smooth(pi)[sl], lw=0.8, color=colour,
                   label=workers(n) if not ends else None)
            ends.append((float(np.nanmedian(pi[:cut])), float(np.nanmedian(pi[cut:])),
                         int(p.active[cut])))
            rises.append(ends[-1][1] > ends[-1][0])
        tau = [t for t in map(analysis.staleness, done) if t is not None]
        p95 = [float(np.percentile(dd.col("staleness"), 95)) for dd in done]
        rows.append([str(n), Stat(tuple(t.mean for t in tau)).text(".1f"),
                     Stat(tuple(p95)).text(".0f"), str(n - 1),
                     Stat(tuple(e[0] for e in ends)).text(),
                     Stat(tuple(e[1] for e in ends)).text(),
                     Stat(tuple(e[2] for e in ends)).text(".0f")])
    a.set(xlabel="staleness τ", ylabel="share of updates", title="τ (mean over seeds)")
    b.set(xlabel="share of the run's time", ylabel="most − fewest updates applied",
          title="spread of the workers' progress")
    c.set(xlabel="staleness τ", ylabel="median π", title="π against τ")
    d.set(xlabel="share of the run's time", ylabel="median π (smoothed)",
          title="π over the run")
    for ax in axes:
        if ax.lines:
            ax.legend()
    lines = ["## Staleness, and π at the end of a run", ""]
    lines += _figure(out, "E3_staleness.png", fig, f"E1's {reading} runs, every seed: the "
                     "histogram of the staleness τ; how far apart the workers' progress is "
                     "over the run; π against τ; π over the run")
    lines += md_table(["n", "mean τ", "95th percentile of τ", "n − 1", ("median π, all but "
                       f"the last {END_SHARE:.0%} of updates"), (f"median π, the last "
                       f"{END_SHARE:.0%}"), ("workers still sending when the last "
                       f"{END_SHARE:.0%} begin")], rows)
    if rises:
        lines += ["", (f"In {sum(rises)} of {len(rises)} runs the median π of the last "
                  f"{END_SHARE:.0%} of updates is above the rest of the run's. Where it is, "
                  "this is why: each gem_mpi worker goes through its own shuffle of the data at its own pace, so they "
                  "finish at different times; the last updates come from fewer and fewer "
                  "workers, θ moves less between a worker's pulls (its shift falls), and π "
                  "rises towards what fewer workers need. The authors' prototype serves its "
                  "workers round-robin, one update each in turn, so they all finish together "
                  "and its curves have no such end.")]
    return lines


def e4_target(res: Results, runs: list[ex.Run]) -> float:
    """The training loss every n reaches: the highest of the per-n mean final losses."""
    means = [stat(res, rs, "final_loss").mean for rs in group(runs, lambda r: r.n).values()]
    means = [m for m in means if math.isfinite(m)]
    return max(means) if means else math.nan


def e4_speedups(res: Results, runs: list[ex.Run]) -> dict[int, dict[str, Stat]]:
    """Per n: wall-clock seconds, updates and samples per worker to the target loss."""
    target = e4_target(res, runs)
    out = {}
    for n, rs in group(runs, lambda r: r.n).items():
        hits = [analysis.first_reaching(res.data(r), target) for r in res.done(rs)]
        hits = [h for h in hits if h is not None]
        out[n] = {"seconds": Stat(tuple(h.seconds for h in hits)),
                  "updates": Stat(tuple(float(h.updates) for h in hits)),
                  "worker_samples": Stat(tuple(h.samples / n for h in hits))}
    return out


def _e4(res: Results, exp: ex.Experiment, out: Path) -> list[str]:
    plt = figures.pyplot()
    runs = list(exp.runs)
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(13, 3.8))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    groups = group(runs, lambda r: r.n)
    for i, (n, rs) in enumerate(groups.items()):
        for j, r in enumerate(res.done(rs)):
            d = res.data(r)
            t, loss = d.col("time"), analysis.smooth(d.col("loss"))
            samples = np.arange(1, loss.size + 1) * analysis.samples_per_update(d)
            kw = {"color": colours[i % len(colours)], "lw": 1,
                  "label": f"{workers(n)}, b = {r.batch}" if j == 0 else None}
            a.plot(t, loss, **kw)
            b.plot(samples, loss, **kw)
    a.set(xlabel="seconds", ylabel="training loss (smoothed)", yscale="log",
          title="against wall-clock time")
    b.set(xlabel="training samples", ylabel="training loss (smoothed)", yscale="log",
          title="against samples")
    target = e4_target(res, runs)
    sp = e4_speedups(res, runs)
    rows = []
    done_ns = sorted({r.n for r in res.done(runs)})
    base = sp.get(done_ns[0]) if done_ns else None
    acc = {n: stat(res, rs, "test_accuracy") for n, rs in groups.items()}
    xs, wall_sp, core_sp = [], [], []
    for n, rs in groups.items():
        s = sp[n]
        w = base["seconds"].mean / s["seconds"].mean if base else math.nan
        k = base["worker_samples"].mean / s["worker_samples"].mean if base else math.nan
        xs.append(n)
        wall_sp.append(w)
        core_sp.append(k)
        rows.append([str(n), str(rs[0].batch), f"{len(res.done(rs))}/{len(rs)}",
                     stat(res, rs, "wall_s").text(".1f"), s["seconds"].text(".1f"),
                     _num(w, ".2f"), s["updates"].text(".0f"), _num(k, ".2f"),
                     acc[n].text(".2f", 100, " %"),
                     difference(acc[n], acc[done_ns[0]]).text(".2f", 100)
                     if n != done_ns[0] else "–"])
    c.plot(xs, wall_sp, marker="o", label="wall-clock, this machine")
    c.plot(xs, core_sp, marker="s", label="one core per worker (samples per worker)")
    c.plot(xs, xs, ls=":", color="grey", label="ideal (n)")
    c.set(xlabel="workers n", ylabel="speedup to the target loss", xscale="log",
          yscale="log", title=f"speedup to training loss {_num(target)}")
    for ax in (a, b, c):
        if ax.lines:
            ax.legend()
    lines = _figure(out, "E4.png", fig, "Effective batch B split as b = B/n over n workers: "
                    "loss against seconds and samples, and the speedup: the paper's figure 4")
    lines += [(f"Target: training loss {_num(target)}, the highest of the per-n mean final "
              f"losses, so that every n reaches it. {runner.cores()} cores here: the n "
              "workers share them, so the wall-clock speedup cannot exceed about "
              f"{runner.cores()}; the last speedup column divides the samples each worker "
              "needed to reach the target, which is the wall-clock speedup if every worker "
              "had a core of its own and time grew with the samples computed. The "
              "accuracy differences carry their standard error over seeds (Welch's), so a "
              "gap can be read against the seeds' scatter."), ""]
    return lines + md_table(["n", "b", "runs done", "master wall s", "seconds to target",
                           "wall-clock speedup", "updates to target",
                           "speedup, a core per worker", "test accuracy",
                           f"accuracy − n = {done_ns[0]}'s, points (± se)"], rows)


@dataclass(frozen=True)
class Rise:
    """One E5 run's validation curve, read the way the paper's figure 5 is."""

    lowest: float  # the lowest validation loss
    epoch: float  # the data epoch where it was
    last: float  # the validation loss at the end (E5's last data epoch)
    accuracy: float  # the validation accuracy at the end

    @property
    def rise(self) -> float:
        return self.last - self.lowest

    @property
    def rise_share(self) -> float:
        return self.rise / self.lowest


def e5_rise(res: Results, run: ex.Run) -> Rise | None:
    """The run's lowest validation loss, where, and what it was at the end."""
    d = res.data(run)
    ev = analysis.eval_by_epoch(d, ex.E5_TRAIN) if d is not None else None
    if ev is None or not np.isfinite(ev[1]).any():
        return None
    i = int(np.nanargmin(ev[1]))
    return Rise(float(ev[1][i]), float(ev[0][i]), float(ev[1][-1]), float(ev[2][-1]))


E5_LABELS = {"gem": "GEM", "sync": "momentum SGD"}


def e5_rises(res: Results, exp: ex.Experiment) -> dict[str, list[Rise]]:
    """Per method (gem, sync): the done runs' rises, one per seed."""
    out: dict[str, list[Rise]] = {m: [] for m in E5_LABELS}
    for run in exp.runs:
        rise = e5_rise(res, run)
        if rise is not None:
            out[run.method].append(rise)
    return out


def _e5(res: Results, exp: ex.Experiment, out: Path) -> list[str]:
    plt = figures.pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    rises = e5_rises(res, exp)
    rows = []
    for method, label in E5_LABELS.items():
        runs = [r for r in exp.runs if r.method == method]
        done = res.done(runs)
        data = [res.data(r) for r in done]
        tr = [c for c in (analysis.loss_by_epoch(d, ex.E5_TRAIN) for d in data) if c]
        ev = [c for c in (analysis.eval_by_epoch(d, ex.E5_TRAIN) for d in data) if c]
        if tr:
            _band(a, mean_curve(tr), f"{label} training", ls="--")
        if ev:
            color = a.lines[-1].get_color() if tr else None
            _band(a, mean_curve(ev), f"{label} validation", color=color)
            _band(b, mean_curve([(e[0], 100 * e[2]) for e in ev]), label, color=color)
        r = rises[method]
        if not r:
            rows.append([label, f"0 of {len(runs)}", *["–"] * 6])
            continue
        st = {k: Stat(tuple(getattr(x, k) for x in r)) for k in
              ("lowest", "epoch", "last", "rise", "rise_share", "accuracy")}
        rows.append([label, f"{len(r)} of {len(runs)}", st["lowest"].text(".4f"),
                     st["epoch"].text(".1f"), st["last"].text(".4f"), st["rise"].text("+.4f"),
                     st["rise_share"].text(".1f", 100, " %"),
                     st["accuracy"].text(".2f", 100, " %")])
    a.set(xlabel="data epochs", ylabel="loss", yscale="log",
          title="training and validation loss")
    b.set(xlabel="data epochs", ylabel="validation accuracy (%)", title="validation accuracy")
    for ax in (a, b):
        if ax.lines:
            ax.legend()
    lines = _figure(out, "E5.png", fig, "Training loss (dashed: mean worker mini-batch loss "
                    f"per data epoch of the {ex.E5_TRAIN} training images) and validation "
                    f"loss on the {ex.E5_HOLDOUT} held out, for GEM and momentum SGD, mean "
                    "over seeds with ± one sd shaded: the paper's figure 5")
    return lines + md_table(["method", "runs done", "lowest validation loss",
                           "at data epoch", "last validation loss", "rise from the lowest",
                           "rise, share of the lowest", "last validation accuracy"], rows)


def _e6(res: Results, exp: ex.Experiment, out: Path) -> list[str]:
    plt = figures.pyplot()
    runs = list(exp.runs)
    msgd = [r for r in runs if r.variant == "msgd"]
    variants = [v for v, _, _ in ex.E6_VARIANTS]
    ns = sorted({r.n for r in runs if r.variant != "msgd"})
    fig, axes = plt.subplots(1, len(variants), figsize=(4.3 * len(variants), 3.8),
                             sharey=True)
    for ax, v in zip(axes, variants):
        groups = group([r for r in runs if r.variant == v], lambda r: r.n)
        if v != "downpour":
            groups = {"msgd": msgd, **groups}
        _curves(ax, res, groups, lambda n: "momentum SGD (1 rank)" if n == "msgd"
                else workers(n), colours={"msgd": "k", **{n: f"C{i}" for i, n in
                                                             enumerate(ns)}})
        ax.set_title(f"{v}, η = 0.1")
    lines = _figure(out, "E6.png", fig, "Training loss per worker step with η = 0.1: the "
                    "paper's figure 6 (sync: synchronous SGD on n ranks, the same data as "
                    "the n asynchronous workers)")
    groups = group(runs, lambda r: (r.variant, r.n))
    return lines + md_table(["method", "n", "runs done", "diverged", "final training loss",
                           "test accuracy", "master wall s"],
                          _summary_rows(res, groups, lambda k: [k[0], str(k[1])], pi=False))


def _e7(res: Results, exp: ex.Experiment, out: Path) -> list[str]:
    plt = figures.pyplot()
    by_n = group(list(exp.runs), lambda r: r.n)
    fig, axes = plt.subplots(len(by_n), 2, figsize=(10, 3.6 * len(by_n)), squeeze=False,
                             sharex="row", sharey="col")
    for (a, b), (n, runs) in zip(axes, by_n.items()):
        groups = group(runs, lambda r: r.kappa)
        _curves(a, res, groups, lambda k: f"κ = {k:g}")
        _curves(b, res, groups, lambda k: f"κ = {k:g}", curve=pi_curve, log=False,
                ylabel="median π")
        a.set_title(f"n = {n}: training loss")
        b.set_title(f"n = {n}: median π")
    ns = ", ".join(map(str, by_n))
    lines = _figure(out, "E7.png", fig, f"GEM with κ = 1…4 at n = {ns} (mean over seeds, ± "
                    "one sd shaded; the paper does not state its n): the paper's figure 8")
    return lines + md_table(["n", "κ", "runs done", "diverged", "final training loss",
                           "test accuracy", "median π", "master wall s"],
                          _summary_rows(res, group(list(exp.runs), lambda r: (r.n, r.kappa)),
                                        lambda k: [str(k[0]), f"{k[1]:g}"]))


def _e8(res: Results, exp: ex.Experiment, out: Path) -> list[str]:
    plt = figures.pyplot()
    lines, rows = [], []
    lrs = sorted({r.lr for r in exp.runs}, reverse=True)
    fig, axes = plt.subplots(len(lrs), 2, figsize=(12, 3.8 * len(lrs)), squeeze=False,
                             gridspec_kw={"width_ratios": [2, 1]})
    names: tuple[str, ...] = ()
    for (a, b), lr in zip(axes, lrs):
        gem = next(r for r in exp.runs if r.variant == "gem" and r.lr == lr)
        msgd = [r for r in exp.runs if r.variant == "msgd" and r.lr == lr]
        d = res.data(gem)
        heat = analysis.pi_heatmap(d) if d is not None else None
        if heat is not None:
            cells, edges = heat
            im = a.imshow(cells, aspect="auto", interpolation="nearest", origin="lower",
                          extent=(edges[0], edges[-1], -0.5, cells.shape[0] - 0.5))
            fig.colorbar(im, ax=a, label="median π")
            a.grid(False)
            names = d.tensor_names
        a.set(xlabel="master updates", ylabel="tensor",
              title=f"η = {lr:g}: median π per tensor" + ("" if d else " (not run yet)"))
        _curves(b, res, {"gem": [gem], "msgd": msgd},
                lambda k, gem=gem: f"GEM, {workers(gem.workers)}" if k == "gem"
                else "momentum SGD (1 rank)")
        b.set_title(f"η = {lr:g}: training loss")
    gem = exp.runs[0]
    lines += _figure(out, "E8.png", fig, f"AlexNet, {workers(gem.workers)}, b = {gem.batch}, "
                     "at each η: per-tensor median π over the master's updates (the paper's "
                     "figures 9 and 10), and the training loss per worker step (figure 7) "
                     "beside that of momentum SGD, the proxy GEM matches, with the same η, "
                     "μ and b")
    if names:
        lines += ["Tensors, bottom to top: " + ", ".join(
            f"{i} `{t}`" for i, t in enumerate(names)) + ".", ""]
    for run in exp.runs:
        if res.data(run) is None:
            rows.append([run.name, f"{run.lr:g}", "not run yet"] + ["–"] * 6)
            continue
        n = res.numbers(run)
        mem = (res.record(run) or {}).get("memory") or {}
        rows.append([run.name, f"{run.lr:g}", "diverged" if n.diverged else "finished",
                     str(n.updates), _num(n.wall_s, ".0f"),
                     f"{_num(n.initial_loss)} → {_num(n.final_loss)}",
                     _num(100 * n.test_accuracy, ".2f") + " %",
                     f"{mem['peak_tree_pss_mb'] / 1024:.1f} GB" if mem else "–",
                     f"{mem['mean_rank_pss_mb']} MB / {mem['max_rank_pss_mb']} MB"
                     if mem else "–"])
    return lines + md_table(["run", "η", "status", "updates", "master wall s",
                           "training loss first → last", "test accuracy (val/)",
                           "peak memory of the job (PSS)", "per rank: mean / largest"], rows)


def _e9(res: Results, exp: ex.Experiment, out: Path) -> list[str]:
    """The global proxy's runs beside the local proxy's (E1's and E6's gem-others), per
    setting: loss curves per n on shared axes, the final loss and the median π against n."""
    plt = figures.pyplot()
    fig, axes = plt.subplots(len(ex.E9_SETTINGS), 4, figsize=(17, 3.8 * len(ex.E9_SETTINGS)),
                             squeeze=False)
    groups: dict = {}
    for row, (src, lr) in zip(axes, ex.E9_SETTINGS):
        proxies = {"global": [r for r in exp.runs if r.lr == lr],
                   "local": [r for r in res.exps[src].runs if r.variant == "gem-others"]}
        row[1].sharey(row[0])  # before plotting, so that the limits cover both
        for ax, (proxy, runs) in zip(row[:2], proxies.items()):
            _curves(ax, res, group(runs, lambda r: r.n), lambda n: f"{n} workers")
            ax.set_title(f"{proxy} proxy, η = {lr:g} ({src}'s setting)")
        ns = sorted({r.n for r in proxies["global"]})
        for ax, field, name in ((row[2], "final_loss", "final training loss"),
                                (row[3], "median_pi", "median π over the run")):
            for proxy, runs in proxies.items():
                st = [stat(res, [r for r in runs if r.n == n], field,
                           finished_only=field == "final_loss") for n in ns]
                ax.errorbar(ns, [s.mean for s in st], yerr=[0 if math.isnan(s.sd) else s.sd
                                                            for s in st], marker="o",
                            label=f"{proxy} proxy")
            ax.set(xlabel="asynchronous workers", ylabel=name, title=f"{name}, η = {lr:g}")
            ax.legend()
        for n in ns:
            for proxy, runs in proxies.items():
                groups[(f"{lr:g} ({src})", n, proxy)] = [r for r in runs if r.n == n]
    lines = _figure(out, "E9.png", fig, "GEM with the global proxy (m at the master, "
                    "every worker's Δθ folded in) against the local proxy (each worker's m: "
                    "E1's and E6's gem-others runs, the same seeds): training loss per worker "
                    "step (mean over seeds, smoothed; the two loss panels of a row share their "
                    "axis), the final training loss and the median π against n")
    lines += [(f"The verdict's rule was fixed in `gem_mpi/reproduce/claims.py` before any run: "
               f"no global-proxy run may diverge, and its mean final training loss must stay "
               f"within {ex.E9_LOSS_RATIO:g}× the local proxy's at every (η, n). The global m "
               "averages about n mini-batches per proxy step, so where the updates are mostly "
               "noise it is smaller than a local m and π is lower: some extra loss is the "
               "design (docs/ARCHITECTURE.md#gem-with-a-global-proxy---gem-proxy-global)."),
              ""]
    return lines + md_table(
        ["η (setting)", "n", "proxy", "runs done", "diverged", "final training loss",
         "test accuracy", "median π", "master wall s"],
        _summary_rows(res, groups, lambda k: [k[0], str(k[1]), k[2]]))


E10_LABELS = {"gem": "GEM", "ddp": "DDP", "diloco": "DiLoCo"}
E10_CASE_TEXT = {"even": "no straggler",
                 "straggler": f"worker {ex.E10_STRAGGLER.replace(':', ', ')}× slower"}


def e10_cells(exp: ex.Experiment) -> dict[tuple[int, str], dict[str, list[ex.Run]]]:
    """(n, case) → method → its runs (every seed), in the experiment's order."""
    out: dict[tuple[int, str], dict[str, list[ex.Run]]] = {}
    for r in exp.runs:
        if r.tuned_by:
            out.setdefault((r.n, ex.e10_case(r)), {}).setdefault(r.method, []).append(r)
    return out


def e10_time_text(side: Side) -> str:
    """Time to the target, mean ± sd over the seeds that reached it, and how many did not."""
    missed = sum(t is None for t in side.times)
    if not side.times:
        return "–"
    if missed == len(side.times):
        return "not reached"
    text = side.time_stat().text(".1f", unit=" s")
    return text + (f" ({missed} of {len(side.times)} not reached)" if missed else "")


def e10_sides(res: Results, exp: ex.Experiment) -> dict[tuple[int, str], dict[str, Side]]:
    """(n, case) → method → its done runs as the rule reads them."""
    return {cell: {m: e10_side(res, runs) for m, runs in methods.items()}
            for cell, methods in e10_cells(exp).items()}


def e10_lines(res: Results, exp: ex.Experiment) -> list[tuple[tuple[int, str], str, str, str]]:
    """Per cell and rival with done runs on both sides: (cell, rival, verdict, why)."""
    out = []
    for cell, sides in e10_sides(res, exp).items():
        gem = sides.get("gem", Side((), ()))
        for rival in (m for m in sides if m != "gem"):
            other = sides[rival]
            if not gem.accuracy or not other.accuracy:
                continue
            verdict, time, acc = e10_verdict(gem, other)
            g, o = gem.accuracy_stat(), other.accuracy_stat()
            why = (f"time to {100 * ex.E10_TARGET:g} %: GEM {e10_time_text(gem)}, "
                   f"{E10_LABELS[rival]} {e10_time_text(other)} ({time}); final test "
                   f"accuracy at equal samples: GEM {g.text('.2f', 100, ' %')}, "
                   f"{E10_LABELS[rival]} {o.text('.2f', 100, ' %')} ({acc})")
            out.append((cell, E10_LABELS[rival], verdict, why))
    return out


def _e10_stat(res: Results, runs: list[ex.Run], of: Callable) -> Stat:
    """``of(run's data)`` over the done runs that did not diverge."""
    vals = []
    for r in res.done(runs):
        d = res.data(r)
        if d is not None and not analysis.diverged(d):
            vals.append(float(of(d)))
    return Stat(tuple(vals))


def _e10_curves(ax_samples, ax_time, res: Results, methods: dict[str, list[ex.Run]]) -> None:
    for i, (method, runs) in enumerate(methods.items()):
        colour = SERIES[i]
        curves = []
        for k, r in enumerate(res.done(runs)):
            d = res.data(r)
            clock, t = d.eval_col("clock"), d.eval_col("time")
            acc = d.eval_col("test_accuracy")
            if clock is None or acc is None or not acc.size:
                continue
            curves.append((clock * analysis.samples_per_update(d), 100 * acc))
            ax_time.plot(t, 100 * acc, lw=0.8, marker=".", ms=3, color=colour,
                         label=E10_LABELS[method] if k == 0 else None)
        if curves:  # an evaluation due while another runs is skipped: the seeds' common x
            common = curves[0][0]
            for x, _ in curves[1:]:
                common = np.intersect1d(common, x)
            curves = [(x[np.isin(x, common)], y[np.isin(x, common)]) for x, y in curves]
            _band(ax_samples, mean_curve(curves), E10_LABELS[method], color=colour,
                  marker=".", ms=3)
    for ax in (ax_samples, ax_time):
        ys = [y for line in ax.lines for y in np.asarray(line.get_ydata(), float)
              if np.isfinite(y)]
        if ax.lines:
            ax.legend()
        ax.axhline(100 * ex.E10_TARGET, color="k", lw=0.6, ls=":")
        ax.set_ylim(min([100 * ex.E10_TARGET - 5, *ys]) - 0.5, 100)
        ax.set_ylabel("test accuracy (%)")
    ax_samples.set_xlabel("training samples (all workers)")
    ax_time.set_xlabel("seconds (training clock)")


def _e10(res: Results, exp: ex.Experiment, out: Path) -> list[str]:
    """The rules as fixed; per cell (n, straggler or not): test accuracy against samples and
    against seconds for each method; the η each method's tuning chose; the table of time to
    target, samples/s, final numbers; the verdicts."""
    cells = e10_cells(exp)
    mains = [r for methods in cells.values() for runs in methods.values() for r in runs]
    lines: list[str] = []
    if res.done(mains):
        plt = figures.pyplot()
        ns = sorted({n for n, _ in cells})
        cases = [c for c, _ in ex.E10_CASES]
        fig, axes = plt.subplots(len(ns), 2 * len(cases), figsize=(4.2 * 2 * len(cases),
                                                                   3.6 * len(ns)),
                                 squeeze=False)
        for row, n in zip(axes, ns):
            for j, case in enumerate(cases):
                a, b = row[2 * j], row[2 * j + 1]
                _e10_curves(a, b, res, cells.get((n, case), {}))
                a.set_title(f"{workers(n)}, {E10_CASE_TEXT[case]}: per sample")
                b.set_title(f"{workers(n)}, {E10_CASE_TEXT[case]}: per second")
        lines = _figure(out, "E10.png", fig, "Test accuracy of θ against the training samples "
                        "of all workers (mean over seeds at the numbers of samples every seed "
                        "evaluated, ± one sd shaded) and against the "
                        "training clock (each seed), per method, n and straggler; the dotted "
                        f"line is the target, {100 * ex.E10_TARGET:g} %")
    steps = mains[0].steps if mains else 0
    gaps = [g for r in res.done(mains) for g in
            np.diff(res.data(r).eval_col("time") if res.data(r).eval_col("time") is not None
                    else np.zeros(0))]
    grid = ex.e10_lrs(res.budget)
    lines += [(f"Every method trains the same model on MNIST with μ 0.9 and b 64 at the η its "
               f"tuning chose (below), each worker {steps} steps, so every run sees n × "
               f"{steps} × 64 samples, and "
               "is evaluated on the test set at the same numbers of samples: every "
               f"{res.budget.e10_eval_steps} steps per worker "
               "(a synchronous step is every worker's; GEM counts updates, so n times as "
               "many); but an evaluation runs beside the training, and one that falls due "
               "while another still runs is skipped, so that the runs here were evaluated "
               + (f"every {np.median(gaps):.1f} s of their clock (median; "
                  f"{np.percentile(gaps, 10):.1f}–{np.percentile(gaps, 90):.1f} s from the "
                  "10th to the 90th percentile)" if gaps else "at most once per evaluation's "
                  "time") + ": the time to target is known to about that. GEM runs one "
               "master rank besides its n workers; DDP and DiLoCo run n "
               f"ranks. The straggler is worker {ex.E10_STRAGGLER.split(':')[0]}, "
               f"{ex.E10_STRAGGLER.split(':')[1]} times slower (it sleeps after each step). "
               "Every rank shares this machine's cores, so the seconds are this machine's: "
               "with more ranks than cores, a straggler's sleep frees a core for the others."
               + (f" {ex.E10_BUDGET_NOTE}" if res.budget.name == "full" else "")),
              "", "## The rules, fixed before the runs", "",
              (f"- **The verdict**, fixed in `gem_mpi/reproduce/experiments.py` (E10's "
               f"constants; `results.py`: `e10_verdict`) and committed before any E10 run: "
               f"per cell and rival, time to {100 * ex.E10_TARGET:g} % test accuracy (a "
               "method reaches it only if every seed does; a gap counts if it is over "
               f"{100 * (ex.E10_TIME_RATIO - 1):.0f} % and beyond two standard errors) and "
               f"final test accuracy at equal samples (a gap counts if over "
               f"{ex.E10_ACC_POINTS:g} points and beyond two standard errors; more diverged "
               "runs is lower). GEM wins: faster and not lower, or as fast and higher; loses: "
               "slower and not higher, or as fast and lower; mixed: faster but lower, or "
               "slower but higher; even: neither differs."),
              (f"- **The tuning, the same for every method**, fixed (E10_LRS, `choose_lr`) "
               f"before any tuned E10 run: per n and method, one run at each η of "
               f"{', '.join(f'{x:g}' for x in grid)}, {res.budget.e10_tune_steps} steps per "
               f"worker, no straggler, seed {ex.E10_TUNE_SEED} (none of the main runs'), "
               f"trained without the last {ex.E10_HOLDOUT} training images (`--holdout`) and "
               "validated on them, never on the test set. Its main runs take the η of the "
               "lowest final validation loss (diverged: infinite; a tie: the smaller η; all "
               "diverged: the smallest). The grid holds the paper's 0.05 and the synchronous "
               "methods' linear-scaling value, 0.05 · n."), "",
              "## The η each method's tuning chose", ""]
    lines += tuning_table(res, exp, lambda r: r.method, E10_LABELS, grid, fmt=".4f")
    lines += ["", "Final validation loss of each tuning run (nats).", "",
              ("What the numbers do not say: DDP and DiLoCo, whose steps average n workers' "
               "gradients (a batch n times GEM's), take n times fewer steps for the same "
               "samples than GEM's master applies updates; each η was chosen on a short "
               "budget without a straggler; and the seconds are those of n + 1 (GEM) or n "
               "ranks sharing this machine's 2 cores, not of a core per worker."), "",
              "## Verdicts", ""]
    verdicts = e10_lines(res, exp)
    if verdicts:
        count = {v: sum(x[2] == v for x in verdicts) for v in ("GEM wins", "GEM loses",
                                                               "mixed", "even")}
        lines += [f"Of {len(verdicts)} comparisons (cell × rival): " + ", ".join(
            f"{v} {k}" for v, k in count.items()) + ".", ""]
    lines += [f"- n = {n}, {E10_CASE_TEXT[case]}, against {rival}: **{verdict}**. {why}."
              for (n, case), rival, verdict, why in verdicts] or ["No cell done yet."]
    lines += ["", "## Numbers", ""]
    rows = []
    for (n, case), methods in cells.items():
        for method, runs in methods.items():
            side = e10_side(res, runs)
            rows.append([str(n), E10_CASE_TEXT[case], E10_LABELS[method],
                         tuned_lrs(res, runs), f"{len(res.done(runs))}/{len(runs)}",
                         _div(res, runs),
                         e10_time_text(side),
                         _e10_stat(res, runs, analysis.samples_per_second).text(".0f"),
                         side.accuracy_stat().text(".2f", 100, " %"),
                         _e10_stat(res, runs, lambda d: analysis.final_test(d).loss).text(
                             ".4f"),
                         stat(res, runs, "final_loss").text(".4f"),
                         stat(res, runs, "wall_s", finished_only=False).text(".1f")])
    lines += md_table(["n", "straggler", "method", "η", "runs done", "diverged",
                       f"time to {100 * ex.E10_TARGET:g} % test accuracy",
                       "samples/s (all workers)", "final test accuracy", "final test loss",
                       "final training loss", "training wall s"], rows)
    lines += ["", ("Time to target: the training clock at the first evaluation at or above "
                   "the target (mean ± sd over the seeds that reached it). Samples/s: "
                   "training samples of all workers per second, while every worker still "
                   "ran (GEM: up to the first worker's last update; synchronous: the whole "
                   "run). Final numbers: the evaluation at the end, after the same samples "
                   "for every method. Training loss: the workers' mini-batch loss over the "
                   "last 10 % of updates or steps.")]
    return lines


E11_CASE_TEXT = {"even": "even speeds",
                 "spread": f"speeds {ex.E11_SPREAD[0]:g}–{ex.E11_SPREAD[1]:g}×"}
BITS = math.log(2)  # the runs' losses are in nats: bits per byte = nats / ln 2


def e11_cells(exp: ex.Experiment) -> dict[tuple[int, str], dict[str, list[ex.Run]]]:
    """(n, case) → method variant → its main runs (every seed), in the experiment's order."""
    out: dict[tuple[int, str], dict[str, list[ex.Run]]] = {}
    for r in exp.runs:
        if r.tuned_by:
            out.setdefault((r.n, ex.e11_case(r)), {}).setdefault(ex.e11_method(r), []).append(r)
    return out


def tuning(res: Results, exp: ex.Experiment, method_of: Callable[[ex.Run], str]
           ) -> list[tuple[int, str, dict[float, float] | None, float | None]]:
    """Per (n, method) of E10's or E11's: its tuning runs' validation losses by η (None
    while any is not done) and the η the rule chose (None likewise)."""
    out, seen = [], set()
    for r in exp.runs:
        key = (r.n, method_of(r))
        if not r.tuned_by or key in seen:
            continue
        seen.add(key)
        losses = runner.tuning_losses(res.dir, r)
        out.append((r.n, key[1], losses, None if losses is None else ex.choose_lr(losses)))
    return out


def tuning_table(res: Results, exp: ex.Experiment, method_of: Callable[[ex.Run], str],
                 labels: dict[str, str], grid: tuple[float, ...], unit: float = 1.0,
                 fmt: str = ".3f") -> list[str]:
    """The table of each (n, method)'s final validation losses by η and the η chosen."""
    rows = []
    for n, method, losses, chosen in tuning(res, exp, method_of):
        cells = [("–" if losses is None or lr not in losses else
                  "diverged" if not math.isfinite(losses[lr]) else
                  _num(losses[lr] / unit, fmt)) for lr in grid]
        rows.append([str(n), labels[method], *cells,
                     f"**{chosen:g}**" if chosen is not None else "waits for its tuning runs"])
    return md_table(["n", "method", *(f"η {x:g}" for x in grid), "chosen η"], rows)


def tuned_lrs(res: Results, runs: list[ex.Run]) -> str:
    """The η the runs' tuning chose ("–" while it waits)."""
    lrs = {r.lr for r in (runner.tuned(res.dir, r) for r in runs) if r is not None}
    return ", ".join(f"{x:g}" for x in sorted(lrs)) or "–"


def e11_sides(res: Results, exp: ex.Experiment) -> dict[tuple[int, str], dict[str, LossSide]]:
    return {cell: {m: e11_side(res, runs) for m, runs in methods.items()}
            for cell, methods in e11_cells(exp).items()}


def e11_lines(res: Results, exp: ex.Experiment) -> list[tuple[tuple[int, str], str, str, str]]:
    """Per cell and rival with done runs on both sides: (cell, rival, verdict, why)."""
    out = []
    target = f"{ex.E11_TARGET_BITS:g} bits/byte"
    for cell, sides in e11_sides(res, exp).items():
        gem = sides.get("gem", LossSide((), ()))
        for rival in (m for m in sides if m != "gem"):
            other = sides[rival]
            if not gem.bits or not other.bits:
                continue
            verdict, time, loss = e11_verdict(gem, other)
            label = ex.E11_LABELS[rival]
            why = (f"time to {target}: GEM-AdamW {e10_time_text(gem.timing)}, {label} "
                   f"{e10_time_text(other.timing)} ({time}); final test loss at equal "
                   f"tokens: GEM-AdamW {gem.loss_stat().text('.3f')}, {label} "
                   f"{other.loss_stat().text('.3f')} bits/byte ({loss})")
            out.append((cell, label, verdict, why))
    return out


def _e11_curves(ax, res: Results, methods: dict[str, list[ex.Run]]) -> None:
    for i, (variant, runs) in enumerate(methods.items()):
        for k, r in enumerate(res.done(runs)):
            d = res.data(r)
            clock, loss = d.eval_col("clock"), d.eval_col("test_loss")
            if clock is None or loss is None or not loss.size:
                continue
            tokens = clock * analysis.samples_per_update(d) * int(d.config.get("context", 1))
            ax.plot(tokens, loss / BITS, lw=0.8, marker=".", ms=3, color=SERIES[i],
                    label=ex.E11_LABELS[variant] if k == 0 else None)
    if ax.lines:
        ax.legend(fontsize=7)
    ax.axhline(ex.E11_TARGET_BITS, color="k", lw=0.6, ls=":")
    ax.set_xlabel("training tokens (all workers)")
    ax.set_ylabel("test loss (bits per byte)")


def _e11(res: Results, exp: ex.Experiment, out: Path) -> list[str]:
    """The rule as fixed, the η each method's tuning chose, test loss against tokens per cell,
    the verdicts per cell and rival, and the numbers."""
    e = ex.e11_budget(res.budget)
    cells = e11_cells(exp)
    lines: list[str] = []
    if any(res.done(runs) for methods in cells.values() for runs in methods.values()):
        plt = figures.pyplot()
        fig, axes = plt.subplots(len(e.ns), len(ex.E11_CASES), squeeze=False,
                                 figsize=(5.0 * len(ex.E11_CASES), 3.8 * len(e.ns)))
        for row, n in zip(axes, e.ns):
            for ax, case in zip(row, ex.E11_CASES):
                _e11_curves(ax, res, cells.get((n, case), {}))
                ax.set_title(f"{workers(n)}, {E11_CASE_TEXT[case]}")
        lines = _figure(out, "E11.png", fig, "Test loss (bits per byte) of θ against the "
                        "training tokens of all workers, each seed, per method, n and speeds; "
                        f"the dotted line is the target, {ex.E11_TARGET_BITS:g} bits per byte")
    size = " ".join(e.gpt)
    lines += [(f"Every method trains the same byte-level transformer (`--model gpt {size} "
               f"--context {e.context}`) on the running Python's standard-library sources "
               f"(`--dataset text`) with AdamW workers, each worker {e.steps} steps of "
               f"{e.batch} samples of {e.context} bytes, so every run sees n × {e.steps} × "
               f"{e.batch} × {e.context} bytes (DN + DyLU: at most that, its slower workers "
               f"take fewer local steps an update), and is evaluated on the first "
               f"{e.eval_bytes} bytes of the test files every {e.eval_steps} steps per worker. "
               f"DN and DiLoCo take H = {e.local_steps} local steps; DiLoCo's outer step is "
               "Nesterov with η 0.7, μ 0.9, DN's its defaults. GEM, DN and Gap-Aware run one "
               "master rank besides their n workers; DDP and DiLoCo run n ranks. With spread "
               f"speeds worker w is `--speeds` {', '.join(e11_speeds_text(n) for n in e.ns)} "
               "times slower (it sleeps after each step); a synchronous method's ranks are all "
               "workers. Every rank shares this machine's cores: the seconds are this "
               "machine's."), "",
              "## The rule, fixed before the runs", "",
              ("Committed in `gem_mpi/reproduce/experiments.py` (E11's constants, "
               "`e11_choose_lr`, `choose_lr`) and `results.py` (`e11_verdict`) before any "
               "E11 run."), "",
              (f"- **Tuning, the same for every method**: per n and method, one run at each "
               f"η of {', '.join(f'{x:g}' for x in ex.E11_LRS)} (the workers' AdamW η), "
               f"{e.tune_steps} steps per worker, even speeds, seed {ex.E11_TUNE_SEED} (none "
               "of the main runs'), trained without the validation files (`--holdout`: one "
               "training file in ten, by name) and validated on their first "
               f"{e.eval_bytes} bytes, never on the test files. Its main runs take the η of "
               "the lowest final validation loss (diverged: infinite; a tie: the smaller η; "
               "all diverged: the smallest)."),
              (f"- **Time to target**: the training clock at the first evaluation at or below "
               f"{ex.E11_TARGET_BITS:g} bits per byte; a method reaches it only if every seed "
               f"does; a gap counts if over {100 * (ex.E11_TIME_RATIO - 1):.0f} % and beyond "
               "two standard errors."),
              (f"- **Loss at equal tokens**: the final test loss; a gap counts if over "
               f"{100 * (ex.E11_LOSS_RATIO - 1):.0f} % and beyond two standard errors; more "
               "diverged runs is higher."),
              ("- **Per cell and rival**: GEM-AdamW wins when faster and not higher, or as fast "
               "and lower; loses when slower and not lower, or as fast and higher; mixed when "
               "faster but higher, or slower but lower; even when neither differs."), "",
              "## The η each method's tuning chose", ""]
    lines += tuning_table(res, exp, ex.e11_method, ex.E11_LABELS, ex.E11_LRS, unit=BITS)
    lines += ["", "Final validation loss of each tuning run, bits per byte.", "",
              "## Verdicts", ""]
    verdicts = e11_lines(res, exp)
    if verdicts:
        count = {v: sum(x[2] == v for x in verdicts) for v in ("GEM wins", "GEM loses",
                                                               "mixed", "even")}
        lines += [f"Of {len(verdicts)} comparisons (cell × rival): " + ", ".join(
            f"{v} {k}" for v, k in count.items()) + ".", ""]
    lines += [f"- n = {n}, {E11_CASE_TEXT[case]}, against {rival}: **{verdict}**. {why}."
              for (n, case), rival, verdict, why in verdicts] or ["No cell done yet."]
    lines += ["", "## Numbers", ""]
    rows = []
    for (n, case), methods in cells.items():
        for variant, runs in methods.items():
            side = e11_side(res, runs)
            rows.append([str(n), E11_CASE_TEXT[case], ex.E11_LABELS[variant],
                         tuned_lrs(res, runs),
                         f"{len(res.done(runs))}/{len(runs)}", _div(res, runs),
                         side.loss_stat().text(".3f"), e10_time_text(side.timing),
                         _e10_stat(res, runs, lambda d: d.summary.get("tokens", math.nan)
                                   ).text(".0f"),
                         _e10_stat(res, runs, lambda d: d.summary.get("tokens_per_s",
                                                                      math.nan)).text(".0f"),
                         stat(res, runs, "wall_s", finished_only=False).text(".1f")])
    lines += md_table(["n", "speeds", "method", "η", "runs done", "diverged",
                       "final test loss (bits/byte)",
                       f"time to {ex.E11_TARGET_BITS:g} bits/byte", "tokens trained",
                       "tokens/s", "training wall s"], rows)
    lines += ["", ("Final test loss: the evaluation at the end, on the test files. Time to "
                   "target: mean ± sd over the seeds that reached it. Tokens: the bytes "
                   "predicted in training by all workers (the run's summary).")]
    return lines


def e11_speeds_text(n: int) -> str:
    return f"{ex.e11_speeds(n)} (n = {n})"


# pages whose body states a rule fixed before the runs (and what waits on it): written before
# any of their runs is done
RULE_FIRST = ("E10", "E11")
BODIES: dict[str, Body] = {"E1": _e1, "E2": _e2, "E3": _e3, "E4": _e4, "E5": _e5, "E6": _e6,
                           "E7": _e7, "E8": _e8, "E9": _e9, "E10": _e10, "E11": _e11}


# --- provenance and the page ------------------------------------------------------------------

def _provenance(res: Results, exp: ex.Experiment, budget: ex.Budget) -> list[str]:
    if not exp.runs:
        src = ", ".join(f"[{j}]({j}.md)" for j in exp.reads)
        return ["## Runs", "", (f"This page shows the runs of {src}: their commands, wall "
                "times, machine, commit and HDF5 files are listed there."), ""]
    rows, commands, machines, commits, job_s = [], [], set(), set(), 0.0
    for run in exp.runs:
        record = res.record(run) or {}
        path = res.paths(run).metrics
        state = runner.status(res.dir, run)
        digest = file_digest(path) if res.data(run) is not None else None
        attempts = len(record.get("segments", []))
        job_s += float(record.get("wall_s", 0.0)) if digest else 0.0
        rows.append([f"`{run.name}`", state if digest or state != "new" else "not run yet",
                     str(attempts), _num(float(record.get("wall_s", math.nan)), ".0f"),
                     f"`{digest[0]}`" if digest else "–",
                     f"{digest[1]:,}" if digest else "–"])
        cmd = record.get("command") or shlex.join(runner.command(run, res.dir,
                                                                 budget.log_every))
        commands.append(("" if record.get("command") else "# not run yet: ") + cmd)
        if record.get("machine"):
            machines.add(record["machine"])
        if record.get("git_commit"):
            commits.add(record["git_commit"][:12] + (" (uncommitted changes)"
                                                     if record.get("git_dirty") else ""))
    ran = (f"Wall time of the jobs (start-up, resumes and evaluation included): "
           f"{runner.fmt_s(job_s)} in all. Machine: {'; '.join(sorted(machines))}. "
           f"Commit: {', '.join(sorted(commits))}.{_same_code(commits)}"
           ) if machines else "Nothing run yet."
    lines = ["## Runs", "", ran, ""]
    lines += md_table(["run", "status", "attempts", "job wall s", "HDF5 sha256", "bytes"], rows)
    lines += ["", ("Commands, exactly as run (from the directory in each run's record, with "
              "the checkout on PYTHONPATH), or as planned for a run not run yet:"), "",
              "```text", *commands, "```", ""]
    return lines


def page(res: Results, exp: ex.Experiment, budget: ex.Budget, out: Path) -> str:
    shown = [r for j in (*exp.reads, exp.id) for r in res.exps[j].runs]
    done = res.done(shown)
    head = [f"# {exp.id}: {exp.title}", "",
            f"**The paper** ({exp.figure}): {exp.claim}.", "",
            f"**Here**: {len(done)} of {len(shown)} runs done"
            + (f" (budget: {budget.name})" if budget.name != "full" else "") + ".", ""]
    if budget.name != "full":
        head += [(f"> Budget **{budget.name}**: a few dozen steps per worker, to test the "
                 "harness. These numbers say nothing about the paper's claims."), ""]
    body = BODIES[exp.id](res, exp, out) if done or exp.id in RULE_FIRST else [
        "Not run yet.", ""]
    return "\n".join(head + body + [""] + _provenance(res, exp, budget)).rstrip() + "\n"


def write_pages(res: Results, budget: ex.Budget, out: Path,
                only: list[str] | None = None) -> list[Path]:
    """Every experiment's page (or only those named) in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for exp in res.exps.values():
        if only is not None and exp.id not in only:
            continue
        path = out / f"{exp.id}.md"
        path.write_text(page(res, exp, budget, out))
        paths.append(path)
    return paths


def _same_code(commits: set[str]) -> str:
    """Whether the runs' commits still hold the code users get (HEAD's)."""
    dirty = sorted(c.split()[0] for c in commits if " " in c)
    verdict = runner.code_changed_since(sorted(c.split()[0] for c in commits))
    if verdict is None or not commits:
        return ""
    head, changed = verdict
    paths = " ".join(p for p in runner.RUN_CODE if not p.startswith(":"))
    if dirty:
        return (f" Runs at {', '.join(dirty)} were made with uncommitted changes: whether "
                f"they describe {head}'s code cannot be checked.")
    same = sorted(c.split()[0] for c in commits if c.split()[0] not in changed)
    if changed:
        return (f" The code a run executes ({paths}; comments and docstrings aside) has changed "
                f"since {', '.join(changed)}: the runs made there ran earlier code than "
                f"{head}'s, the commit these pages were made from (`git diff <commit> {head} "
                f"-- {shlex.join(runner.RUN_CODE)}` shows how)"
                + (f"; at {', '.join(same)} it is the same as at {head}." if same else "."))
    return (f" The code a run executes ({paths}; the harness, benchmarks and analysis "
            f"excluded, comments and docstrings aside) is the same at each of them as at "
            f"{head}, the commit these pages were made from.")
