"""--dylu's pure pieces: each worker's steps from its pace and the fastest one's, the running
paces the master and a worker keep, the replay taking each update's steps from the log, and
the analysis counting the samples they trained."""

from __future__ import annotations

import numpy as np
import pytest

from gem_mpi.algorithm.dylu import WEIGHT, Pace, Paces, WorkerSteps, steps_for
from gem_mpi.algorithm.reference import replay
from gem_mpi.outputs import analysis
from gem_mpi.outputs.runfile import Run
from gem_mpi.problem.quadratic import Quadratic

f32 = np.float32


@pytest.mark.parametrize("own, fastest, h, want", [
    (1.0, 1.0, 8, 8),  # the fastest takes H
    (2.0, 1.0, 8, 4),  # twice as slow: half the steps
    (3.0, 1.0, 8, 3),  # 8/3 = 2.67 rounds to 3
    (1.0 / 0.45, 1.0, 4, 2),  # 1.8 rounds to 2
    (100.0, 1.0, 8, 1),  # at least 1
    (0.5, 1.0, 4, 4),  # faster than the published fastest (a newer measurement): H, not more
    (0.0, 1.0, 4, 4),  # its own pace not measured yet: H
    (2.0, 0.0, 4, 4),  # nothing published yet (a run's or a resume's first pulls): H
])
def test_steps_follow_the_speed_within_1_and_h(own, fastest, h, want):
    assert steps_for(h, own, fastest) == want


def test_a_pace_is_a_running_mean_of_seconds_per_step():
    p = Pace()
    p.observe(0.8, 4)  # the first measurement whole: 0.2 s a step
    assert p.seconds == pytest.approx(0.2)
    p.observe(0.4, 1)  # then weighted
    assert p.seconds == pytest.approx(0.2 + WEIGHT * (0.4 - 0.2))
    before = p.seconds
    p.observe(0.0, 3)  # a clock that did not move, a message without steps: ignored
    p.observe(1.0, 0)
    assert p.seconds == before


def test_the_master_publishes_the_fastest_measured_worker():
    paces = Paces(3)
    assert paces.fastest == 0.0  # none measured
    paces.observe(2, 0.9, 3)
    paces.observe(3, 0.4, 1)
    paces.observe(7, 0.001, 1)  # no such worker: ignored
    assert paces.fastest == pytest.approx(0.3)  # worker 2's, worker 1 unmeasured


def test_a_worker_reports_the_steps_it_decided_and_measures_by_them():
    w = WorkerSteps(4)
    assert w.decide(0, fastest_s=0.0) == 4  # nothing known: H
    w.measured(0, 4.0)  # 1 s a step
    assert w.decide(1, fastest_s=0.25) == 1  # four times slower than the fastest
    w.measured(1, 1.0)
    assert w.committed(0) == 4 and w.committed(1) == 1
    assert not w.took


def _log(steps: list[int] | None) -> dict[str, np.ndarray]:
    n = 4 if steps is None else len(steps)
    log = {"worker": np.array([1, 2, 1, 2][:n]), "version_pulled": np.array([0, 0, 2, 2][:n]),
           "staleness": np.array([0, 1, 0, 1][:n]), "seq": np.array([0, 0, 1, 1][:n])}
    if steps is not None:
        log["steps"] = np.array(steps)
    return log


def test_the_replay_takes_each_updates_steps_from_the_log():
    """A column of H throughout is --local-steps H; fewer steps change θ; one update of 2
    momentum-SGD steps is the two steps written out."""
    q, lr, mu = Quadratic(64, 2), 0.05, 0.9
    args = {"momentum": mu, "local_steps": 4}
    full = replay(_log(None), q, "downpour", lr, **args)
    assert np.array_equal(replay(_log([4, 4, 4, 4]), q, "downpour", lr, **args).theta,
                          full.theta)
    fewer = replay(_log([4, 1, 4, 2]), q, "downpour", lr, **args)
    assert not np.allclose(fewer.theta, full.theta)
    one = replay(_log([2]), q, "downpour", lr, **args)
    theta, b, losses = q.theta0(), np.zeros(q.dim, f32), []
    local = theta
    for _ in range(2):
        diff = local - q.target(1)
        losses.append(0.5 * float(np.dot(q.h * diff, diff)))
        b = b * f32(mu) + q.h * diff
        local = local + b * f32(-float(f32(lr)))
    assert np.array_equal(one.theta, theta + (local - theta))
    assert one.losses == [pytest.approx(sum(losses) / 2)]


def test_the_analysis_counts_the_samples_a_dylu_update_trained():
    """--dylu: an update of h < H local steps trained h parts of its H-part batch, and the
    analysis (bench lm's samples, samples/s) counts those, not H × b for every update."""
    cols = {"worker": np.array([1, 2, 1, 2]), "time": np.array([1.0, 2.0, 3.0, 4.0]),
            "steps": np.array([4, 1, 4, 2])}
    run = Run(path="r.h5", attrs={"n_workers": 2},
              config={"method": "dn", "batch_size": 8, "local_steps": 4},
              tensor_names=[], tensor_sizes=np.zeros(0), updates=cols, eval={},
              summary={"updates": 4.0})
    assert analysis.samples_per_update(run) == 32  # H × b: what an update may train
    assert analysis.trained_samples(run) == (4 + 1 + 4 + 2) * 8
    # up to worker 1's last update (3 s): the first three updates' 9 steps of 8 samples
    assert analysis.samples_per_second(run) == 9 * 8 / 3.0
    del cols["steps"]  # without the column every update trained its H parts
    assert analysis.trained_samples(run) == 4 * 32
