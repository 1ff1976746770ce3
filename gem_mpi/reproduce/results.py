"""What the finished runs say: each run's numbers and their mean ± spread over seeds.

The report's pages and its claims table both read runs through here, and here only through
gem_mpi/outputs/runfile.py and analysis.py, so that a number printed on two pages is computed
once, the same way. A run counts when it is done (finished, or stopped by divergence); one that is
missing or was cut short is "not run yet", never a guess.
"""

from __future__ import annotations

import hashlib
import math
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gem_mpi.outputs import analysis, runfile
from gem_mpi.reproduce import experiments as ex
from gem_mpi.reproduce import runner


@dataclass(frozen=True)
class Numbers:
    """One done run's headline numbers."""

    diverged: bool
    initial_loss: float
    final_loss: float  # mean worker loss over the last 10 % of updates (figure 1d)
    test_loss: float
    test_accuracy: float
    median_pi: float  # NaN for methods without π
    clamped: float  # share of π cut to 0 or π_max (NaN for methods without π)
    clamped_low: float  # share of π cut to 0 (NaN as above, and for files before the column)
    zero_delta: float  # share of elements with Δθ = 0, inside the clamped share (NaN as above)
    wall_s: float  # the master's training time
    job_s: float  # the whole job, start-up and resumes included (the record's)
    updates: int

    @property
    def clamped_high(self) -> float:
        """Share of π cut to π_max."""
        return self.clamped - self.clamped_low


class Results:
    """The runs of a results directory, loaded once each."""

    def __init__(self, results: Path, exps: dict[str, ex.Experiment],
                 budget: ex.Budget) -> None:
        self.dir, self.exps, self.budget = results, exps, budget
        self._runs: dict[str, runfile.Run | None] = {}

    def paths(self, run: ex.Run) -> runner.Paths:
        return runner.Paths.of(self.dir, run)

    def record(self, run: ex.Run) -> dict | None:
        return runner.load_record(self.paths(run).record)

    def data(self, run: ex.Run) -> runfile.Run | None:
        """The run's metrics if it is done (finished or diverged), else None."""
        if run.name not in self._runs:
            data = None
            path = self.paths(run).metrics
            if path.exists():
                try:
                    data = runfile.load_run(path)
                except (runfile.RunFileError, OSError):
                    data = None
            if data is not None and not (data.finished or analysis.diverged(data)):
                data = None
            self._runs[run.name] = data
        return self._runs[run.name]

    def done(self, runs: list[ex.Run]) -> list[ex.Run]:
        return [r for r in runs if self.data(r) is not None]

    def numbers(self, run: ex.Run) -> Numbers | None:
        d = self.data(run)
        if d is None:
            return None
        test = analysis.final_test(d)
        record = self.record(run) or {}
        return Numbers(analysis.diverged(d), analysis.initial_train_loss(d),
                       analysis.final_train_loss(d), test.loss, test.accuracy,
                       analysis.run_median_pi(d), analysis.clamped_share(d),
                       analysis.clamped_share(d, "clamp_low"),
                       analysis.clamped_share(d, "zero_delta"),
                       analysis.wall_seconds(d),
                       float(record.get("wall_s", math.nan)), analysis.applied_updates(d))


def group(runs: list[ex.Run], key) -> dict:
    """Runs by ``key(run)``, keys in first-seen order."""
    out: dict = {}
    for r in runs:
        out.setdefault(key(r), []).append(r)
    return out


@dataclass(frozen=True)
class Stat:
    """Mean and sample standard deviation over seeds of the finite values."""

    values: tuple[float, ...]

    @property
    def finite(self) -> np.ndarray:
        v = np.asarray(self.values, np.float64)
        return v[np.isfinite(v)]

    @property
    def mean(self) -> float:
        return float(self.finite.mean()) if self.finite.size else math.nan

    @property
    def sd(self) -> float:
        return float(self.finite.std(ddof=1)) if self.finite.size > 1 else math.nan

    def text(self, fmt: str = ".3f", scale: float = 1.0, unit: str = "") -> str:
        if not self.finite.size:
            return "–"
        m = format(self.mean * scale, fmt) + unit
        if self.finite.size == 1:
            return f"{m} (1 seed)"
        return f"{m} ± {format(self.sd * scale, fmt)}{unit}"


@dataclass(frozen=True)
class Difference:
    """A difference of two means over seeds with its standard error, so that a gap is read
    against the seeds' scatter and not as a bare number."""

    mean: float
    se: float  # NaN when either side has fewer than two seeds

    def text(self, fmt: str = ".2f", scale: float = 1.0) -> str:
        if not math.isfinite(self.mean):
            return "–"
        m = format(self.mean * scale, "+" + fmt)
        if not math.isfinite(self.se):
            return f"{m} (no se: 1 seed)"
        return f"{m} ± {format(self.se * scale, fmt)}"


def difference(a: Stat, b: Stat) -> Difference:
    """a − b, with Welch's standard error √(sd_a²/k_a + sd_b²/k_b)."""
    se = math.sqrt(a.sd ** 2 / a.finite.size + b.sd ** 2 / b.finite.size) \
        if a.finite.size > 1 and b.finite.size > 1 else math.nan
    return Difference(a.mean - b.mean, se)


def stat(res: Results, runs: list[ex.Run], field: str, finished_only: bool = True) -> Stat:
    """``field`` of Numbers over the done runs (without diverged ones unless asked)."""
    vals = []
    for r in runs:
        n = res.numbers(r)
        if n is not None and not (finished_only and n.diverged):
            vals.append(float(getattr(n, field)))
    return Stat(tuple(vals))


def diverged_count(res: Results, runs: list[ex.Run]) -> tuple[int, int]:
    """(diverged, done) among ``runs``."""
    nums = [res.numbers(r) for r in runs]
    nums = [n for n in nums if n is not None]
    return sum(n.diverged for n in nums), len(nums)


def mean_curve(curves: list[tuple[np.ndarray, ...]]
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(x, mean, sample sd) over seeds of curves on the same x, up to the shortest one; the
    sd is NaN where fewer than two seeds have a finite value."""
    curves = [c for c in curves if c[0].size]
    if not curves:
        return np.zeros(0), np.zeros(0), np.zeros(0)
    k = min(c[0].size for c in curves)
    ys = np.stack([c[1][:k] for c in curves]).astype(np.float64)
    finite = np.isfinite(ys).sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns: NaN, as meant
        mean = np.nanmean(ys, axis=0)
        sd = np.where(finite > 1, np.nanstd(ys, axis=0, ddof=1), np.nan)
    return curves[0][0][:k], mean, sd


def loss_curve(d: runfile.Run) -> tuple[np.ndarray, np.ndarray]:
    """Smoothed mean worker loss per worker step."""
    loss = d.col("loss")
    if loss is None or loss.size == 0:
        return np.zeros(0), np.zeros(0)
    x, y = analysis.by_worker_step(d, loss)
    return x, analysis.smooth(y)


def pi_curve(d: runfile.Run) -> tuple[np.ndarray, np.ndarray]:
    """Smoothed median π per worker step (empty for methods without π)."""
    pi = analysis.median_pi(d)
    if pi is None:
        return np.zeros(0), np.zeros(0)
    x, y = analysis.by_worker_step(d, pi)
    return x, analysis.smooth(y)


def file_digest(path: Path) -> tuple[str, int]:
    """(sha256, bytes) of a file, read in blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest(), path.stat().st_size


# --- E10's verdict rule (experiments.py states it and why, beside its constants) ----------

@dataclass(frozen=True)
class Side:
    """One method's seeds in one E10 cell: its time to the target per seed (None: not
    reached, or diverged) and its final test accuracy per seed (NaN: diverged)."""

    times: tuple[float | None, ...]
    accuracy: tuple[float, ...]

    @property
    def reached(self) -> bool:
        """Every seed reached the target."""
        return bool(self.times) and all(t is not None and math.isfinite(t)
                                         for t in self.times)

    def time_stat(self) -> Stat:
        return Stat(tuple(math.nan if t is None else float(t) for t in self.times))

    @property
    def diverged(self) -> int:
        """Runs without a final accuracy (diverged)."""
        return sum(not math.isfinite(a) for a in self.accuracy)

    def accuracy_stat(self) -> Stat:
        """Final test accuracy of the runs that did not diverge."""
        return Stat(tuple(a for a in self.accuracy if math.isfinite(a)))


def _beyond_scatter(d: Difference) -> bool:
    """The gap is beyond two standard errors (with no se, one seed a side: it is)."""
    return not math.isfinite(d.se) or abs(d.mean) > 2 * d.se


def e10_time(gem: Side, rival: Side) -> str:
    """faster, slower, tie (both reach, no clear gap) or neither (neither reaches)."""
    return _time_outcome(gem, rival, ex.E10_TIME_RATIO)


def _time_outcome(gem: Side, rival: Side, ratio: float) -> str:
    """E10's and E11's time rule, with their own ratio."""
    if gem.reached != rival.reached:
        return "faster" if gem.reached else "slower"
    if not gem.reached:
        return "neither"
    g, r = gem.time_stat(), rival.time_stat()
    d = difference(r, g)  # > 0: GEM gets there first
    if r.mean > ratio * g.mean and _beyond_scatter(d):
        return "faster"
    if g.mean > ratio * r.mean and _beyond_scatter(d):
        return "slower"
    return "tie"


def e10_accuracy(gem: Side, rival: Side) -> str:
    """higher, lower or tie: GEM's final test accuracy at equal samples against the rival's
    (the side with more diverged runs is lower, whatever the others')."""
    if gem.diverged != rival.diverged:
        return "lower" if gem.diverged > rival.diverged else "higher"
    d = difference(gem.accuracy_stat(), rival.accuracy_stat())
    if not math.isfinite(d.mean):
        return "tie"
    if 100 * abs(d.mean) > ex.E10_ACC_POINTS and _beyond_scatter(d):
        return "higher" if d.mean > 0 else "lower"
    return "tie"


E10_VERDICTS = {("faster", "higher"): "GEM wins", ("faster", "tie"): "GEM wins",
                ("tie", "higher"): "GEM wins", ("neither", "higher"): "GEM wins",
                ("slower", "lower"): "GEM loses", ("slower", "tie"): "GEM loses",
                ("tie", "lower"): "GEM loses", ("neither", "lower"): "GEM loses",
                ("faster", "lower"): "mixed", ("slower", "higher"): "mixed",
                ("tie", "tie"): "even", ("neither", "tie"): "even"}


def e10_verdict(gem: Side, rival: Side) -> tuple[str, str, str]:
    """(verdict, time outcome, accuracy outcome) of GEM against one rival in one cell."""
    time, acc = e10_time(gem, rival), e10_accuracy(gem, rival)
    return E10_VERDICTS[(time, acc)], time, acc


def e10_side(res: Results, runs: list[ex.Run]) -> Side:
    """The done runs of one method in one cell, as the rule reads them."""
    times, accs = [], []
    for r in res.done(runs):
        d = res.data(r)
        assert d is not None
        bad = analysis.diverged(d)
        t = None if bad else analysis.time_to_accuracy(d, ex.E10_TARGET)
        times.append(t)
        accs.append(math.nan if bad else analysis.final_test(d).accuracy)
    return Side(tuple(times), tuple(accs))


# --- E11's verdict rule (experiments.py states it and why, beside its constants) ----------

@dataclass(frozen=True)
class LossSide:
    """One method's seeds in one E11 cell: its time to the target loss per seed (None: not
    reached, or diverged) and its final test loss in bits per byte per seed (NaN:
    diverged)."""

    times: tuple[float | None, ...]
    bits: tuple[float, ...]

    @property
    def timing(self) -> Side:
        """The times as E10's rule reads them."""
        return Side(self.times, ())

    @property
    def diverged(self) -> int:
        return sum(not math.isfinite(b) for b in self.bits)

    def loss_stat(self) -> Stat:
        """Final test loss (bits per byte) of the runs that did not diverge."""
        return Stat(tuple(b for b in self.bits if math.isfinite(b)))


def e11_time(gem: LossSide, rival: LossSide) -> str:
    """faster, slower, tie or neither: time to E11_TARGET_BITS, E10's rule with E11's ratio."""
    return _time_outcome(gem.timing, rival.timing, ex.E11_TIME_RATIO)


def e11_loss(gem: LossSide, rival: LossSide) -> str:
    """lower, higher or tie: GEM's final test loss at equal tokens against the rival's (the
    side with more diverged runs is higher, whatever the others')."""
    if gem.diverged != rival.diverged:
        return "higher" if gem.diverged > rival.diverged else "lower"
    g, r = gem.loss_stat(), rival.loss_stat()
    d = difference(g, r)
    if not math.isfinite(d.mean):
        return "tie"
    if r.mean > ex.E11_LOSS_RATIO * g.mean and _beyond_scatter(d):
        return "lower"
    if g.mean > ex.E11_LOSS_RATIO * r.mean and _beyond_scatter(d):
        return "higher"
    return "tie"


# E10's table, read in loss: GEM's lower loss is what its higher accuracy is there
E11_VERDICTS = {(time, {"higher": "lower", "lower": "higher", "tie": "tie"}[acc]): verdict
                for (time, acc), verdict in E10_VERDICTS.items()}


def e11_verdict(gem: LossSide, rival: LossSide) -> tuple[str, str, str]:
    """(verdict, time outcome, loss outcome) of GEM-AdamW against one rival in one cell."""
    time, loss = e11_time(gem, rival), e11_loss(gem, rival)
    return E11_VERDICTS[(time, loss)], time, loss


def e11_side(res: Results, runs: list[ex.Run]) -> LossSide:
    """The done runs of one method in one cell, as the rule reads them."""
    times, bits = [], []
    target = ex.E11_TARGET_BITS * math.log(2)  # the runs' losses are in nats
    for r in res.done(runs):
        d = res.data(r)
        assert d is not None
        bad = analysis.diverged(d)
        times.append(None if bad else analysis.time_to_loss(d, target))
        bits.append(math.nan if bad else analysis.final_test(d).loss / math.log(2))
    return LossSide(tuple(times), tuple(bits))
