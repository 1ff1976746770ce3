"""Elastic workers without MPI (gem_mpi.problem.elastic): the plans of a run that never
changed its workers are their own streams; a resume on m workers deals the batches not done
so that none of an epoch is lost or dealt twice, each continuing worker keeps its past and
its own next batches, each worker gets an equal share of each epoch; the checkpoint's
remap; the metrics file's segments; a dealt batch is the one its source makes, in
the worker's process and in loader processes alike."""

from __future__ import annotations

import json
from collections import Counter

import h5py
import numpy as np
import pytest
import torch

from gem_mpi.outputs import checkpoint
from gem_mpi.outputs.checkpoint import Checkpoint
from gem_mpi.outputs.metrics import MetricsWriter
from gem_mpi.problem import elastic
from gem_mpi.problem.batches import dealt_plan, iterate_batches
from gem_mpi.problem.datasets import load_split
from gem_mpi.problem.elastic import batch_of, cut, length, redeal, source_plan
from gem_mpi.problem.seeds import seed_step
from gem_mpi.protocol import WORKER_TIME_COLUMNS


def _batches(plan: elastic.Plan) -> list[tuple[int, int, int, int]]:
    return [batch_of(plan, k) for k in range(length(plan))]


def _first(n: int, steps: int = 10, epochs: int = 3) -> list[elastic.Plan]:
    return [source_plan(s, n, steps + s % 2, epochs) for s in range(1, n + 1)]


def test_a_source_plan_is_the_workers_own_stream_cut_at_max_steps():
    assert source_plan(2, 4, 10, 3) == [(2, 4, 0, 0, 10), (2, 4, 1, 0, 10), (2, 4, 2, 0, 10)]
    assert source_plan(2, 4, 10, 3, max_steps=15) == [(2, 4, 0, 0, 10), (2, 4, 1, 0, 5)]
    assert batch_of(source_plan(1, 1, 10, 3), 23) == (1, 1, 2, 3)
    assert cut(source_plan(1, 1, 10, 3), 8, 12) == [(1, 1, 0, 8, 10), (1, 1, 1, 0, 2)]


@pytest.mark.parametrize("m", [1, 2, 3, 4, 6, 9])
def test_a_redeal_loses_nothing_deals_nothing_twice_and_keeps_each_place(m):
    n = 4
    plans = _first(n)
    done = [3, 17, 0, 25]  # asynchronous: each worker elsewhere, in another epoch
    new = redeal(plans, done, m)
    assert len(new) == m
    before = Counter(b for p in plans for b in _batches(p))
    gone = Counter(b for w in range(m, n) for b in _batches(plans[w])[:done[w]])
    after = Counter(b for p in new for b in _batches(p)) + gone  # with the departed's past
    assert after == before  # the budget: every batch once, none added
    for w in range(min(n, m)):  # the past kept as it was, seq for seq
        assert _batches(new[w])[:done[w]] == _batches(plans[w])[:done[w]]
    for w in range(n, m):
        assert w >= n and length(new[w]) > 0  # a new worker gets work
    for epoch in range(3):  # an equal share of what was left of each epoch
        left = [sum(1 for b in _batches(p)[done[w] if w < n else 0:] if b[2] == epoch)
                for w, p in enumerate(new)]
        assert max(left) - min(left) <= 1, (epoch, left)
    # a continuing worker's next batch is its own next one
    for w in range(min(n, m)):
        assert batch_of(new[w], done[w]) == batch_of(plans[w], done[w])


def test_resizes_compose_and_the_plans_survive_a_checkpoint(tmp_path):
    plans = _first(4)
    two = redeal(plans, [5, 12, 30, 1], 2)
    six = redeal(two, [20, 33], 6)
    gone = Counter(b for w in (2, 3) for b in _batches(plans[w])[:[30, 1][w - 2]])
    assert Counter(b for p in six for b in _batches(p)) + gone == Counter(
        b for p in plans for b in _batches(p))
    rows = elastic.to_array(six)
    assert rows.dtype == np.int64 and rows.shape[1] == elastic.COLUMNS
    assert elastic.from_array(rows, 6) == six
    ckpt = Checkpoint(theta=np.zeros(3, np.float32), clock=9, run_id="r", elapsed_s=0.0,
                      config={}, n_workers=2, next_seq=np.array([20, 33]),
                      kept_s=np.arange(6, dtype=np.float32).reshape(2, 3))
    grown = checkpoint.resize(ckpt, np.array([20, 33, 0, 0, 0, 0]), rows)
    assert grown.n_workers == 6 and grown.next_seq.tolist() == [20, 33, 0, 0, 0, 0]
    assert np.array_equal(grown.kept_s[:2], ckpt.kept_s) and not grown.kept_s[2:].any()
    back = checkpoint.load(checkpoint.save(str(tmp_path), grown))
    assert np.array_equal(back.data_plan, rows)
    shrunk = checkpoint.resize(ckpt, np.array([20]), elastic.to_array(redeal(two, [20, 33], 1)))
    assert np.array_equal(shrunk.kept_s, ckpt.kept_s[:1])


def test_the_metrics_file_records_each_segment_and_resizes_the_worker_times(tmp_path):
    path = str(tmp_path / "run.h5")
    args = ({"method": "downpour"}, ["a"], [3])
    w = MetricsWriter(path, *args, n_workers=4, kernel="numpy", run_id="r")
    w.close({"updates": 0})
    w = MetricsWriter(path, *args, n_workers=2, kernel="numpy", run_id="r",
                      resume_rows=(0, 0, 0), resume_log={"clock": 40, "checkpoint": "c",
                                                         "changes": {"workers": [4, 2]}})
    w.close({"updates": 0, "worker_time": np.zeros((2, len(WORKER_TIME_COLUMNS)))})
    with h5py.File(path) as f:
        assert f["summary"]["worker_time"].shape[0] == 2 and f.attrs["n_workers"] == 2
        segments = json.loads(f.attrs["segments"])
    assert segments == [{"clock_from": 0, "clock_to": 40, "workers": 4},
                        {"clock_from": 40, "clock_to": None, "workers": 2}]


def _dealt(workers: int, runs: list, start: int) -> list[tuple]:
    import itertools

    from gem_mpi.problem.loader import load_batches

    split = load_split("synthetic", None, "train", "mnist-cnn", synthetic_size=500)
    plan = dealt_plan(split, 20, 300, True, runs, start)
    stream = load_batches(split, 20, 1, seed=0, workers=workers, step_seed=(3, 1), plan=plan)
    try:
        out = []
        for seq in itertools.count(start):
            seed_step(3, 1, seq)
            try:
                x, y = next(stream)
            except StopIteration:
                return out
            out.append((seq, x, y, torch.rand(3)))  # what dropout would draw next
    finally:
        stream.close()


RUNS = [(2, 2, 1, 3, 6), (1, 2, 0, 10, 12), (2, 2, 0, 0, 1)]


def test_a_dealt_batch_is_the_batch_its_source_makes():
    split = load_split("synthetic", None, "train", "mnist-cnn", synthetic_size=500)
    sources = {s: list(iterate_batches(split, 20, 2, seed=300 + s, shard=(s - 1, 2)))
               for s in (1, 2)}
    got = _dealt(0, RUNS, 1)
    want = [sources[s][e * 12 + j] for s, _, e, lo, hi in RUNS for j in range(lo, hi)][1:]
    assert [seq for seq, *_ in got] == list(range(1, 6))
    for (_, x, y, _), (x0, y0) in zip(got, want, strict=True):
        assert torch.equal(x, x0) and torch.equal(y, y0)


@pytest.mark.mpi  # loader processes are processes
def test_loader_processes_make_the_dealt_batches_bit_for_bit():
    mine, loaded = _dealt(0, RUNS, 2), _dealt(2, RUNS, 2)
    assert len(mine) == len(loaded) == 4
    for a, b in zip(mine, loaded, strict=True):
        assert a[0] == b[0] and all(torch.equal(u, v) for u, v in zip(a[1:], b[1:]))
