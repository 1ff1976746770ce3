"""The numbers every tool derives from a run (:class:`gem_mpi.outputs.runfile.Run`),
computed one way: ``tools/report.py``, ``tools/compare.py``, the benchmarks and the
reproduction's pages all call these, so a number printed in two places is the same number.
Each helper returns None (or NaN) for what the run's columns cannot give.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from gem_mpi.config import synchronous
from gem_mpi.outputs.runfile import Run, rows_of


def smooth(y: np.ndarray, window: int | None = None) -> np.ndarray:
    """Centred moving average that skips NaN; the default window is 2 % of the points."""
    y = np.asarray(y, dtype=np.float64)
    n = y.size
    if n == 0:
        return y
    w = max(1, n // 50) if window is None else max(1, int(window))
    ok = np.isfinite(y)
    csum = np.concatenate([[0.0], np.cumsum(np.where(ok, y, 0.0))])
    ccnt = np.concatenate([[0], np.cumsum(ok)])
    idx = np.arange(n)
    lo = np.clip(idx - w // 2, 0, n)
    hi = np.clip(idx - w // 2 + w, 0, n)
    cnt = ccnt[hi] - ccnt[lo]
    out = np.full(n, np.nan)
    has = cnt > 0
    out[has] = (csum[hi] - csum[lo])[has] / cnt[has]
    return out


def worker_steps(run: Run) -> np.ndarray:
    """x-axis "worker steps": each update's own step counter at its worker (seq), or the
    master clock divided by the workers when seq is not recorded."""
    seq = run.col("seq")
    if seq is not None:
        return seq.astype(np.float64)
    return np.arange(run.n_updates, dtype=np.float64) / max(run.n_workers, 1)


def loss_by_steps(run: Run, window: int | None = None) -> tuple[np.ndarray, np.ndarray,
                                                                np.ndarray] | None:
    """(worker steps, raw loss, smoothed loss) in step order, or None without a loss."""
    loss = run.col("loss")
    if loss is None or loss.size == 0:
        return None
    steps = worker_steps(run)
    order = np.argsort(steps, kind="stable")
    raw = loss[order].astype(np.float64)
    return steps[order], raw, smooth(raw, window)


def final_train_loss(run: Run, fraction: float = 0.1) -> float:
    """Mean worker mini-batch loss over the last ``fraction`` of updates (at least one):
    the "final training loss" of the paper's figure 1d."""
    loss = run.col("loss")
    if loss is None or loss.size == 0:
        return math.nan
    k = max(1, round(fraction * loss.size))
    tail = loss[-k:].astype(np.float64)
    tail = tail[np.isfinite(tail)]
    return float(tail.mean()) if tail.size else math.nan


@dataclass
class FinalTest:
    loss: float
    accuracy: float
    source: str  # where the numbers come from, said in reports


def final_test(run: Run) -> FinalTest:
    """The last test numbers: the summary's for a finished run, else the last evaluation."""
    if run.finished:
        return FinalTest(run.summary.get("test_loss", math.nan),
                         run.summary.get("test_accuracy", math.nan), "the final evaluation")
    clock, loss, acc = (run.eval_col(k) for k in ("clock", "test_loss", "test_accuracy"))
    if loss is None or loss.size == 0:
        return FinalTest(math.nan, math.nan, "none: the run has no evaluation")
    at = f", at clock {int(clock[-1])}" if clock is not None and clock.size else ""
    return FinalTest(float(loss[-1]),
                     float(acc[-1]) if acc is not None and acc.size else math.nan,
                     f"the last evaluation written{at}; the run did not finish")


def wall_seconds(run: Run) -> float:
    """Master's training time: the summary's, or the time of the last update when unfinished."""
    wall = run.summary.get("wall_s", math.nan)
    if math.isfinite(wall):
        return wall
    t = run.col("time")
    return float(t[-1]) if t is not None and t.size else math.nan


def applied_updates(run: Run) -> int:
    """Applied updates: the summary's count for a finished run, else the rows written."""
    count = run.summary.get("updates", math.nan)
    return int(count) if math.isfinite(count) else run.n_updates


def rejected(run: Run) -> int | None:
    """Updates the master rejected (NaN or Inf in them): the summary's count, else the rows
    of /rejected; None for files from before rejection was recorded."""
    count = run.summary.get("rejected", math.nan)
    if math.isfinite(count):
        return int(count)
    table = run.other.get("rejected")
    return rows_of(table) if table is not None else None


def updates_per_second(run: Run) -> float:
    wall = wall_seconds(run)
    return applied_updates(run) / wall if wall > 0 else math.nan


def time_to_accuracy(run: Run, target: float) -> float | None:
    """Seconds until the first evaluation at or above ``target`` test accuracy (the time the
    evaluated θ was taken), or None if no evaluation reached it."""
    t, acc = run.eval_col("time"), run.eval_col("test_accuracy")
    if t is None or acc is None:
        return None
    hit = np.flatnonzero(acc >= target)
    return float(t[hit[0]]) if hit.size else None


def time_to_loss(run: Run, target: float) -> float | None:
    """Seconds until the first evaluation at or below ``target`` test loss, or None if no
    evaluation reached it."""
    t, loss = run.eval_col("time"), run.eval_col("test_loss")
    if t is None or loss is None:
        return None
    hit = np.flatnonzero(loss <= target)
    return float(t[hit[0]]) if hit.size else None


def samples_per_second(run: Run) -> float:
    """Training samples per second while every worker was still running: up to the first
    worker's last update (asynchronous; a straggler's tail after the others finished would
    understate the rate), or the whole run (sync: every step has every worker)."""
    batch = samples_per_update(run)  # b; a group's G × b
    t = run.col("time")
    if t is None or t.size == 0 or batch <= 0:
        return math.nan
    if synchronous(run.method):
        wall = wall_seconds(run)
        return applied_updates(run) * batch / wall if wall > 0 else math.nan
    w = run.col("worker")
    if w is None:
        return trained_samples(run) / max(wall_seconds(run), 1e-9)
    first_done = min(float(t[w == rank][-1]) for rank in np.unique(w))
    upto = t <= first_done
    steps = run.col("steps")  # --dylu: each update's own local steps, else H for every one
    if steps is not None and steps.size == t.size:
        trained = int(steps[upto].sum()) * (batch // int(run.config.get("local_steps", 1)))
    else:
        trained = int(np.count_nonzero(upto)) * batch
    return trained / first_done if first_done > 0 else math.nan


def trained_samples(run: Run) -> int:
    """Training samples the applied updates trained on: updates × :func:`samples_per_update`,
    except under --dylu, where an update of h < H local steps trained h parts of its H-part
    batch (the /updates ``steps`` column says each one's h)."""
    steps = run.col("steps")
    per = samples_per_update(run)
    if steps is None or synchronous(run.method):
        return applied_updates(run) * per
    return int(steps[:applied_updates(run)].sum()) * (per // int(run.config.get("local_steps", 1)))


def throughput(run: Run, bins: int = 60) -> tuple[np.ndarray, np.ndarray] | None:
    """(bin centres in seconds, updates/s at the master in each bin), or None without time."""
    t = run.col("time")
    if t is None or t.size < 2:
        return None
    end = max(float(t[-1]), 1e-9)
    nb = max(1, min(bins, t.size // 5))
    counts, edges = np.histogram(t, bins=nb, range=(0.0, end))
    return 0.5 * (edges[1:] + edges[:-1]), counts / np.diff(edges)


def worker_counts(run: Run) -> dict[int, int] | None:
    """Updates applied per worker rank, every rank 1..n listed (0 for a starved one)."""
    w = run.col("worker")
    if w is None:
        return None
    ranks, counts = np.unique(w, return_counts=True)
    out = dict.fromkeys(range(1, run.n_workers + 1), 0)
    out.update({int(r): int(c) for r, c in zip(ranks, counts)})
    return out


@dataclass
class Staleness:
    mean: float
    median: float
    max: int
    theory: int  # n − 1: the other workers' updates between a pull and its application


def staleness(run: Run) -> Staleness | None:
    tau = run.col("staleness")
    if tau is None or tau.size == 0:
        return None
    return Staleness(float(tau.mean()), float(np.median(tau)), int(tau.max()),
                     run.n_workers - 1)


def staleness_shares(run: Run) -> tuple[np.ndarray, np.ndarray] | None:
    """(τ = 0, 1, …, max, share of the updates applied with that staleness)."""
    tau = run.col("staleness")
    if tau is None or tau.size == 0:
        return None
    counts = np.bincount(np.maximum(tau.astype(np.int64), 0))
    return np.arange(counts.size), counts / counts.sum()


@dataclass
class Progress:
    """The workers' progress over a run, one value per applied update (in apply order)."""

    time: np.ndarray  # seconds since the start
    spread: np.ndarray  # most minus fewest of the workers' updates applied so far
    active: np.ndarray  # workers that have updates still to come


def progress(run: Run) -> Progress | None:
    """How far apart the workers are: a worker's progress is the number of its updates the
    master has applied; the spread is the most minus the fewest over the n workers. Workers
    that finish early leave the run to fewer ones: ``active`` counts those still to send."""
    w, t = run.col("worker"), run.col("time")
    if w is None or t is None or w.size == 0:
        return None
    order = np.argsort(t, kind="stable")
    w, t = w[order].astype(np.int64) - 1, t[order]
    n = max(run.n_workers, int(w.max()) + 1)
    done = np.zeros((w.size, n), dtype=np.int32)
    done[np.arange(w.size), w] = 1
    np.cumsum(done, axis=0, out=done)
    last = np.full(n, -1)
    last[w] = np.arange(w.size)  # each worker's last row
    active = n - np.searchsorted(np.sort(last), np.arange(w.size), side="left")
    return Progress(t, (done.max(axis=1) - done.min(axis=1)).astype(np.int64), active)


def pi_by_staleness(run: Run, min_updates: int = 20) -> tuple[np.ndarray, np.ndarray] | None:
    """(τ, median over the updates applied with that τ of their median π), for the τ seen at
    least ``min_updates`` times."""
    tau, pi = run.col("staleness"), median_pi(run)
    if tau is None or pi is None or tau.size == 0:
        return None
    tau = tau.astype(np.int64)
    values = [t for t in np.unique(tau) if np.count_nonzero(tau == t) >= min_updates]
    return (np.array(values, dtype=np.int64),
            np.array([float(np.nanmedian(pi[tau == t])) for t in values]))


def median_pi(run: Run) -> np.ndarray | None:
    """Per update, the median of π over all parameters (the paper's figure 3): the master's
    ``pi_median_all``, read off the pooled histogram; a file written before that column
    existed gets the size-weighted median of its per-tensor medians, an estimate that one
    large tensor can decide alone."""
    pooled = run.col("pi_median_all")
    if pooled is not None and pooled.size:
        return pooled.astype(np.float64)
    pi = run.col("pi_median")
    if pi is None or pi.size == 0:
        return None
    return weighted_row_median(pi, run.tensor_sizes)


def _tensor_weights(sizes: np.ndarray | None, n_tensors: int) -> np.ndarray:
    """Element counts per tensor, or equal weights when the file does not give them."""
    w = np.asarray(sizes if sizes is not None else [], np.float64)
    return w if w.shape == (n_tensors,) and w.sum() > 0 else np.ones(n_tensors)


def weighted_row_median(pi: np.ndarray, sizes: np.ndarray | None) -> np.ndarray:
    """Per row, the median of the per-tensor values weighted by tensor size (NaN skipped)."""
    pi = pi.reshape(pi.shape[0], -1).astype(np.float64)
    w = np.where(np.isfinite(pi), _tensor_weights(sizes, pi.shape[1]), 0.0)
    order = np.argsort(np.where(np.isfinite(pi), pi, np.inf), axis=1)
    vals = np.take_along_axis(pi, order, axis=1)
    cum = np.cumsum(np.take_along_axis(w, order, axis=1), axis=1)
    total = cum[:, -1:]
    pick = np.argmax(cum >= 0.5 * total, axis=1)
    out = vals[np.arange(pi.shape[0]), pick]
    out[total[:, 0] <= 0] = np.nan
    return out


def pi_heatmap(run: Run, max_bins: int = 200) -> tuple[np.ndarray, np.ndarray] | None:
    """(tensors × bins matrix of median π, bin edges in master updates), or None."""
    pi = run.col("pi_median")
    if pi is None or pi.size == 0:
        return None
    pi = pi.reshape(pi.shape[0], -1)
    n = pi.shape[0]
    edges = np.unique(np.linspace(0, n, min(n, max_bins) + 1).astype(int))
    cells = np.full((pi.shape[1], edges.size - 1), np.nan)
    for j, (a, b) in enumerate(itertools.pairwise(edges)):
        block = pi[a:b]
        finite = np.isfinite(block).any(axis=0)
        if finite.any():
            cells[finite, j] = np.nanmedian(block[:, finite], axis=0)
    return cells, edges


def energy_ratio(run: Run) -> np.ndarray | None:
    """energy_central / energy_proxy per update (1: GEM matched the proxy's energy);
    NaN where the proxy has no energy. None for methods without energies."""
    central, proxy = run.col("energy_central"), run.col("energy_proxy")
    if central is None or proxy is None:
        return None
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(proxy > 0, central / proxy, np.nan)
    return ratio.astype(np.float64)


def clamped_share(run: Run, column: str = "clamp_frac") -> float:
    """Share of all parameter elements whose π was clamped, averaged over updates
    (``column``: ``clamp_frac`` at 0 or π_max; ``clamp_low`` at 0 alone; ``zero_delta``
    the elements with Δθ = 0, always clamped and not moved whatever π is)."""
    frac = run.col(column)
    if frac is None or frac.size == 0:
        return math.nan
    frac = frac.reshape(frac.shape[0], -1).astype(np.float64)
    w = _tensor_weights(run.tensor_sizes, frac.shape[1])
    return float(np.nanmean(frac @ (w / w.sum())))


# --- views for the reproduction of the paper (gem_mpi/reproduce) ----------------------------

def diverged(run: Run) -> bool:
    """The run was stopped because it diverged (summary/diverged == 1)."""
    return run.summary.get("diverged", math.nan) == 1.0


def samples_per_update(run: Run) -> int:
    """Training samples behind one /updates row: b, n × b for a synchronous step, G × b for
    a group's update (--group-size G), H × b for an update of H local steps."""
    b = int(run.config.get("batch_size", 0))
    return b * run.n_workers if synchronous(run.method) else b * int(
        run.config.get("group_size", 1)) * int(run.config.get("local_steps", 1))


def by_worker_step(run: Run, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(worker steps, mean of the finite ``values``, one per /updates row, at each step): the
    paper's "worker steps" axis, one point per step of the workers' own counters."""
    steps = worker_steps(run).astype(np.int64)
    values = np.asarray(values, np.float64).reshape(-1)[:steps.size]
    steps = steps[:values.size]
    keys, inverse = np.unique(steps, return_inverse=True)
    ok = np.isfinite(values)
    total = np.bincount(inverse, weights=np.where(ok, values, 0.0), minlength=keys.size)
    count = np.bincount(inverse, weights=ok.astype(np.float64), minlength=keys.size)
    with np.errstate(invalid="ignore", divide="ignore"):
        return keys.astype(np.float64), np.where(count > 0, total / count, np.nan)


def initial_train_loss(run: Run, fraction: float = 0.02) -> float:
    """Mean worker mini-batch loss over the first ``fraction`` of updates (at least one)."""
    loss = run.col("loss")
    if loss is None or loss.size == 0:
        return math.nan
    head = loss[:max(1, round(fraction * loss.size))].astype(np.float64)
    head = head[np.isfinite(head)]
    return float(head.mean()) if head.size else math.nan


def run_median_pi(run: Run) -> float:
    """The median over the whole run of the per-update median π (figure 3's level)."""
    pi = median_pi(run)
    if pi is None or not np.isfinite(pi).any():
        return math.nan
    return float(np.nanmedian(pi))


def loss_by_epoch(run: Run, epoch_samples: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(data epochs 1..E, mean worker mini-batch loss within each): training loss per pass
    over ``epoch_samples`` samples, counted over all workers (figure 5)."""
    loss = run.col("loss")
    per = samples_per_update(run)
    if loss is None or loss.size == 0 or per <= 0:
        return None
    epoch = (np.arange(1, loss.size + 1) * per - 1) // epoch_samples + 1
    keys, inverse = np.unique(epoch, return_inverse=True)
    finite = np.isfinite(loss)
    total = np.bincount(inverse, weights=np.where(finite, loss, 0.0))
    count = np.bincount(inverse, weights=finite.astype(np.float64))
    with np.errstate(invalid="ignore", divide="ignore"):
        return keys.astype(np.float64), np.where(count > 0, total / count, np.nan)


def eval_by_epoch(run: Run, epoch_samples: int
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(data epochs seen when each evaluated θ was taken, test loss, test accuracy)."""
    clock, loss = run.eval_col("clock"), run.eval_col("test_loss")
    acc = run.eval_col("test_accuracy")
    if clock is None or loss is None or clock.size == 0:
        return None
    epochs = clock.astype(np.float64) * samples_per_update(run) / epoch_samples
    acc = acc if acc is not None else np.full(clock.size, np.nan)
    return epochs, loss.astype(np.float64), acc.astype(np.float64)


@dataclass
class Reached:
    seconds: float
    updates: int  # rows applied (sync: steps) when the smoothed loss first got there
    samples: int


def first_reaching(run: Run, target: float, window: int | None = None) -> Reached | None:
    """When the smoothed worker loss, in the order the updates were applied, first fell to
    ``target`` or below; None if it never did."""
    loss, t = run.col("loss"), run.col("time")
    if loss is None or t is None or loss.size == 0:
        return None
    hit = np.flatnonzero(smooth(loss, window) <= target)
    if not hit.size:
        return None
    i = int(hit[0])
    return Reached(float(t[i]), i + 1, (i + 1) * samples_per_update(run))


def thin(n: int, max_points: int = 20000) -> slice:
    """Every k-th row, so that a scatter of a million updates stays a small picture."""
    return slice(None, None, max(1, math.ceil(n / max_points)))
