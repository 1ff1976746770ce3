"""Each worker's data as a list of batches, and how a resume on another number of workers
deals them anew (elastic workers).

The run's data is fixed at its first start, by its n₀ workers: *source* s (1..n₀) is the
stream worker s reads today (its own shuffle, and with ``--shard`` the samples i mod n₀ =
s − 1), ``epochs`` epochs of ``steps[s]`` batches, at most ``--max-steps`` batches. A batch is
named by (source, epoch, j), its samples a function of the seed alone. A worker's *plan* is
its list of batches in order; its update ``seq`` is batch ``seq`` of its plan. Until the
worker count changes, worker w's plan is source w whole: the stream it always read, so a
run that keeps its workers computes what it always did.

A resume on m ≠ n workers (:func:`redeal`) keeps each worker's past (the batches the
checkpoint counts as applied) and deals the rest, epoch by epoch, so that each worker gets
an equal share of each epoch's remaining batches: a continuing worker keeps its own next
batches up to its share (its place in the data: they come first), a departed worker's and
any surplus go, in order, to the workers short of their share (a new one starts with none
of its own); a worker takes its dealt batches of an epoch in that epoch's place, or, for an
epoch before its own (it was ahead), right after its own batches of its epoch. No
batch of an epoch is lost or dealt twice, and the run's budget (the batches of its sources)
neither shrinks nor grows. Runs are kept compact: (source, sources, epoch, lo, hi), the
batches lo..hi − 1 of that source's epoch, so a plan is a few runs however long the run.
Everything here is integers: the plan is a function of the checkpoint's recorded state.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

Run = tuple[int, int, int, int, int]  # source, sources (n₀), epoch, first batch, end (exclusive)
Plan = list[Run]
COLUMNS = 6  # a checkpoint's row: worker, then the run


def source_plan(source: int, sources: int, steps: int, epochs: int, max_steps: int = 0) -> Plan:
    """Source ``source``'s batches: ``epochs`` epochs of ``steps`` batches, cut at
    ``max_steps`` (0: no cap): what worker ``source`` of a run that never changed reads."""
    plan: Plan = []
    left = max_steps if max_steps else epochs * steps
    for epoch in range(epochs):
        take = min(steps, left)
        if take <= 0:
            break
        plan.append((source, sources, epoch, 0, take))
        left -= take
    return plan


def length(plan: Plan) -> int:
    return sum(hi - lo for *_, lo, hi in plan)


def cut(plan: Plan, start: int, stop: int | None = None) -> Plan:
    """Batches ``start`` .. ``stop`` − 1 of a plan (None: to its end), as runs."""
    out: Plan = []
    pos = 0
    for s, n, e, lo, hi in plan:
        size = hi - lo
        a, b = max(start - pos, 0), size if stop is None else min(stop - pos, size)
        if a < b:
            out.append((s, n, e, lo + a, lo + b))
        pos += size
    return out


def _join(plan: Plan) -> Plan:
    """Adjacent runs of one source's epoch merged."""
    out: Plan = []
    for run in plan:
        if out and out[-1][:3] == run[:3] and out[-1][4] == run[3]:
            out[-1] = (*out[-1][:4], run[4])
        else:
            out.append(run)
    return out


def redeal(plans: Sequence[Plan], done: Sequence[int], m: int) -> list[Plan]:
    """The plans of m workers continuing n = ``len(plans)`` workers whose first ``done[w]``
    batches were applied. Worker w ≤ min(n, m) keeps its past and its own next batches up to
    its share of each epoch; the others' remaining batches are dealt to whoever is short."""
    n = len(plans)
    past = [cut(plans[w], 0, int(done[w])) if w < n else [] for w in range(m)]
    rest = [cut(plans[w], int(done[w])) for w in range(n)]
    epochs = sorted({run[2] for plan in rest for run in plan})
    # a continuing worker's epoch now: its own next batches come first, then what it is
    # dealt of that epoch and of any before it (a worker ahead of the others), then the rest
    now = [rest[w][0][2] if w < min(n, m) and rest[w] else -1 for w in range(m)]
    head: list[Plan] = [[] for _ in range(m)]
    new: list[Plan] = [[] for _ in range(m)]
    for epoch in epochs:
        own = [[r for r in plan if r[2] == epoch] for plan in rest]
        total = sum(length(p) for p in own)
        share = [total // m + (1 if w < total % m else 0) for w in range(m)]
        kept: list[Plan] = [[] for _ in range(m)]
        pool: Plan = []
        for w in range(n):
            keep = min(share[w], length(own[w])) if w < m else 0
            if w < m:
                kept[w] = cut(own[w], 0, keep)
            pool += cut(own[w], keep)
        at = 0
        for w in range(m):
            short = share[w] - length(kept[w])
            dealt = cut(pool, at, at + short)
            at += short
            if epoch < now[w]:
                head[w] += dealt
            elif epoch == now[w]:
                new[w] = kept[w] + head[w] + dealt
            else:
                new[w] += kept[w] + dealt
    return [_join(past[w] + (head[w] if now[w] < 0 else []) + new[w]) for w in range(m)]


def to_array(plans: Sequence[Plan]) -> np.ndarray:
    """The plans as one int64 array of rows (worker, source, sources, epoch, lo, hi)."""
    rows = [(w + 1, *run) for w, plan in enumerate(plans) for run in plan]
    return np.array(rows, np.int64).reshape(-1, COLUMNS)


def from_array(rows: np.ndarray, workers: int) -> list[Plan]:
    plans: list[Plan] = [[] for _ in range(workers)]
    for w, *run in np.asarray(rows, np.int64).tolist():
        plans[w - 1].append(tuple(run))
    return plans


def batch_of(plan: Plan, seq: int) -> tuple[int, int, int, int]:
    """(source, sources, epoch, j) of batch ``seq`` of a plan."""
    pos = 0
    for s, n, e, lo, hi in plan:
        if seq < pos + hi - lo:
            return s, n, e, lo + seq - pos
        pos += hi - lo
    raise IndexError(f"batch {seq} of a plan of {pos}")


def take(rests: dict[int, Plan], count: int, max_runs: int) -> tuple[Plan, dict[int, Plan]]:
    """Up to ``count`` batches of the departed workers' batches not yet done nor dealt
    (``rests``: worker -> those batches, in its plan's order), the earliest epoch first, in
    at most ``max_runs`` runs; returns them and what is left of ``rests``. A live run's
    departure deals them to the workers that finished their own."""
    left = {w: list(plan) for w, plan in rests.items() if plan}
    out: Plan = []
    while count > 0 and left and len(out) < max_runs:
        w = min(left, key=lambda k: (left[k][0][2], k))  # the earliest epoch, then worker
        s, n, e, lo, hi = left[w][0]
        k = min(count, hi - lo)
        out.append((s, n, e, lo, lo + k))
        count -= k
        if k == hi - lo:
            left[w].pop(0)
            if not left[w]:
                del left[w]
        else:
            left[w][0] = (s, n, e, lo + k, hi)
    return out, {w: left.get(w, []) for w in rests}
