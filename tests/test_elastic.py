"""Elastic workers under real mpirun: a run of 4 workers stopped by
SIGUSR1, resumed on 2, stopped again, resumed on 6 to its end.

On the quadratic the run is replayable from its log, so every asynchronous method must end
with the replay's θ bit for bit, the continuing workers' m carried across each resume and
a new worker's starting at 0; every update is applied once per segment and the budget (the
first start's 4 × steps updates) neither shrinks nor grows. On a dataset whose targets are
the samples' indices (tests/user_code/elastic_probe.py) each update's loss names its batch:
every worker computed the batches its plan deals it, and every sample of every epoch is
seen exactly once over the three segments.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from helpers import (
    assert_every_sample_once,
    indexed_probe,
    probe_per_epoch,
    quadratic_args,
    running_checkpoint,
    signal_when,
    train_background,
)

from gem_mpi.algorithm.reference import replay
from gem_mpi.outputs import checkpoint
from gem_mpi.outputs.runfile import load_run
from gem_mpi.problem import elastic
from gem_mpi.problem.quadratic import Quadratic

pytestmark = pytest.mark.mpi

DIM, LR, PI_MAX = 2000, 0.05, 50.0
# both stops (a checkpoint each): by update ~1600 here, ~6400 at 4× the speed; budget 16000
STEPS, EVERY = 4000, 0.1
SIZES = (4, 2, 6)  # the workers of each segment


def _clock_of(tmp: Path) -> int:
    state = running_checkpoint(tmp)
    return -1 if state is None else state.clock


def _segments(tmp: Path, args: list[str], env: dict | None = None, masters: int = 1
              ) -> tuple[list[checkpoint.Checkpoint], list[str]]:
    """Run ``args`` on 4 workers, stop it (SIGUSR1) at its first checkpoint, resume it on 2,
    stop it at a later checkpoint, resume it on 6 to the end; each stop's checkpoint and
    each start's stderr."""
    stops, errs = [], []
    for i, n in enumerate(SIZES):
        resume = ["--resume", "auto"] if i else []
        proc = train_background(n + masters, *args, *resume, env=env)
        if i < len(SIZES) - 1:
            before = max(_clock_of(tmp), 0)  # so that no segment is empty
            err = signal_when(proc, lambda b=before: _clock_of(tmp) > b)
            assert proc.returncode == 3, err
            stops.append(checkpoint.load(checkpoint.latest(str(tmp))))
        else:
            err = proc.communicate(timeout=300)[1]
            assert proc.returncode == 0, err
        assert "Traceback" not in err
        errs.append(err)
    assert "workers 4 -> 2" in errs[1] and "workers 2 -> 6" in errs[2]
    return stops, errs


def _check_segments(tmp: Path, stops: list[checkpoint.Checkpoint], budget: int
                    ) -> tuple[dict, list[list[elastic.Plan]]]:
    """Every update once per segment, each worker's seqs running on from where the segment
    found it; the budget kept. Returns the log and each segment's plans."""
    run = load_run(tmp / "run.h5")
    u = run.updates
    assert run.summary["finished"] == 1.0
    assert u["clock"].tolist() == list(range(budget))  # nothing lost, nothing added
    segments = json.loads(run.attrs["segments"])
    bounds = [0, stops[0].clock, stops[1].clock, budget]
    assert [(s["clock_from"], s["workers"]) for s in segments] == list(zip(bounds, SIZES))
    assert [s["clock_to"] for s in segments[:-1]] == bounds[1:3]
    final = checkpoint.load(checkpoint.latest(str(tmp)))
    plans = [None, elastic.from_array(stops[1].data_plan, 2),
             elastic.from_array(final.data_plan, 6)]
    starts = [np.zeros(4, np.int64), stops[0].next_seq[:2],
              np.r_[stops[1].next_seq, np.zeros(4, np.int64)]]
    ends = [stops[0].next_seq, stops[1].next_seq,
            np.array([elastic.length(p) for p in plans[2]])]
    assert sum(int(e) for e in ends[2]) > 0
    for k in range(3):
        rows = slice(bounds[k], bounds[k + 1])
        pairs = Counter(zip(u["worker"][rows].tolist(), u["seq"][rows].tolist()))
        expected = {(w + 1, s) for w in range(SIZES[k])
                    for s in range(int(starts[k][w]), int(ends[k][w]))}
        assert set(pairs) == expected and max(pairs.values()) == 1, k
    assert np.array_equal(final.next_seq, ends[2])
    return u, plans


def _quadratic(tmp: Path, method: str, shift: str, mode: str, *extra: str) -> list[str]:
    args = quadratic_args(*extra, method=method, dim=DIM, steps=STEPS, lr=LR,
                          metrics=tmp / "run.h5", save=tmp / "theta.npy", checkpoint_dir=tmp,
                          checkpoint_every=EVERY, eval_every=0, worker_mode=mode)
    if method == "gem":
        args += ["--pi-max", str(PI_MAX), "--gem-shift", shift]
    return args


@pytest.mark.parametrize("method, shift, mode, masters", [
    ("gem", "paper", "wait", 2), ("gem", "others", "pipelined", 1),
    ("gem", "paper", "overlap", 1), ("gap-aware", "others", "wait", 1)])
def test_four_workers_resume_on_two_then_six_exactly(tmp_path, method, shift, mode, masters):
    """Pipelined or overlapped, a stopped worker may have had an update in flight (m one
    fold ahead: the momentum file's prev) or its next computed: whoever gets the batch
    redoes it. The rules with state across a resize (GEM's m and kept s, Gap-Aware's v);
    DOWNPOUR's and adaptive's have none, and their replays are the in-process orders'
    (tests/unit/test_master_in_process.py) and tests/test_train_invariants.py's. With
    --masters 2 (the first row) the kept s is remapped before it is cut per shard: each
    shard's slice of θ is the replay of its own event order, every update once per segment
    on every shard."""
    from test_shards import QuadraticSlice, shard_bounds, shard_logs

    extra = ("--masters", str(masters)) if masters > 1 else ()
    args = _quadratic(tmp_path, method, shift, mode, *extra)
    stops, errs = _segments(tmp_path, args, masters=masters)
    if method == "gem":  # the continuing workers found their m, the new ones start at 0
        assert "worker momentum restored for 2 of 2 workers" in errs[1]
        assert "worker momentum restored for 2 of 6 workers" in errs[2]
    _check_segments(tmp_path, stops, 4 * STEPS)
    # bit for bit: each continuing worker's m (and, paper, its kept s) ran on, a new one's
    # started afresh, Gap-Aware's v and the clock carried over
    theta, q = np.load(tmp_path / "theta.npy"), Quadratic(DIM, 0)
    logs = shard_logs(tmp_path / "run.h5", masters) if masters > 1 else [
        load_run(tmp_path / "run.h5").updates]
    bounds = shard_bounds(masters) if masters > 1 else [(0, DIM)]
    for k, (u, (lo, hi)) in enumerate(zip(logs, bounds)):
        assert u["clock"].tolist() == list(range(4 * STEPS)), k
        ref = replay(u, QuadraticSlice(q, lo, hi), method, LR, momentum=0.9, pi_max=PI_MAX,
                     shift=shift, window=len(u["worker"]) + 1, new_at_seq0=True)
        assert np.array_equal(theta[lo:hi], ref.theta), f"shard {k}"


EPOCHS = 4


def test_no_sample_of_an_epoch_is_lost_or_seen_twice(tmp_path):
    """The dealing is the same whatever the rule: one method holds it."""
    args, env = indexed_probe(tmp_path, "gem", EPOCHS)
    stops, _ = _segments(tmp_path, args, env)
    per_epoch = probe_per_epoch()
    first = [elastic.source_plan(s + 1, 4, per_epoch[s], EPOCHS) for s in range(4)]
    u, plans = _check_segments(tmp_path, stops, EPOCHS * sum(per_epoch))
    plans[0] = first
    bounds = json.loads(load_run(tmp_path / "run.h5").attrs["segments"])
    rows = []
    for k, seg in enumerate(bounds):
        cut = slice(seg["clock_from"], seg["clock_to"])
        rows += [(plans[k][w - 1], seq, w, loss) for w, seq, loss in zip(
            u["worker"][cut].tolist(), u["seq"][cut].tolist(), u["loss"][cut].tolist())]
    assert_every_sample_once(rows, stops[0].config["seed"] * 100_003, EPOCHS)
