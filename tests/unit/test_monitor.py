"""The watches of rank 0, in-process: the watchdog's silence, the loss watch's divergence,
the progress line's pace."""

from __future__ import annotations

import math

import numpy as np

from gem_mpi.run import monitor
from gem_mpi.run.monitor import DivergenceWatch, LossWatch, Watchdog


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_watchdog_names_the_longest_silent_unfinished_worker():
    clock = FakeClock()
    dog = Watchdog(3, timeout=5.0, clock=clock)
    clock.now += 2.0
    assert dog.stuck() is None  # nobody silent for 5 s yet
    dog.heard(1)
    dog.heard(3)
    clock.now += 4.0  # worker 2: 6 s silent; 1 and 3: 4 s
    assert dog.stuck() == (2, 6.0)


def test_watchdog_looks_once_a_second_and_not_at_finished_workers():
    clock = FakeClock()
    dog = Watchdog(2, timeout=5.0, clock=clock)
    dog.heard(2, finished=True)  # its last message: it may stay silent
    clock.now += 10.0
    assert dog.stuck() == (1, 10.0)
    clock.now += 0.5
    assert dog.stuck() is None  # looked less than a second ago
    clock.now += 0.6
    dog.heard(1)
    assert dog.stuck() is None


def test_watchdog_with_no_timeout_never_fires():
    clock = FakeClock()
    dog = Watchdog(2, timeout=0.0, clock=clock)
    clock.now += 1e6
    assert dog.stuck() is None


def test_divergence_watch_on_a_rising_loss():
    watch = DivergenceWatch(factor=10.0, warmup=0)
    theta = np.ones(4, np.float32)
    assert watch.check(1.0, 1, theta) is None
    assert watch.check(9.0, 2, theta) is None
    why = watch.check(11.0, 3, theta)
    assert why is not None and "over 10 times its lowest, 1" in why


def test_divergence_watch_measures_a_rise_from_no_lower_than_a_thousandth_of_the_first():
    """A run that all but memorised its data (smoothed loss 1e-11) then meets a harder batch
    (0.5) has not diverged; a rise over 1000 times a thousandth of the first loss has."""
    watch = DivergenceWatch(factor=1000.0, warmup=0)
    theta = np.ones(4, np.float32)
    assert watch.check(2.3, 1, theta) is None
    assert watch.check(1e-11, 2, theta) is None
    assert watch.check(0.5, 3, theta) is None
    why = watch.check(2.4, 4, theta)
    assert why is not None and "over 1000 times its lowest, 1e-11 (counted as 0.0023" in why


def test_divergence_watch_judges_a_rise_once_the_smoothed_loss_averages_some_losses():
    """A resume whose first smoothed loss is one worker's 1e-11 and whose next losses are
    0.5 (a worker whose momentum restarts) has not diverged: the loss watch's average of 20
    losses is what a rise is measured from."""
    watch, losses = LossWatch(1000.0), [1e-11] + [0.5] * 40
    for i, loss in enumerate(losses):
        watch.observe(loss, i + 1, np.ones(2, np.float32))
    assert watch.diverged is None
    for i in range(200):  # a real rise after the warm-up still stops the run
        watch.observe(1e4, 100 + i, np.ones(2, np.float32))
    assert watch.diverged is not None and "over 1000 times its lowest" in watch.diverged


def test_divergence_watch_on_a_loss_or_theta_not_finite():
    assert "loss is nan" in DivergenceWatch(10.0).check(math.nan, 1, np.ones(2))
    theta = np.array([1.0, np.inf], np.float32)
    assert DivergenceWatch(10.0).check(1.0, 99, theta) is None  # θ is looked at every 100th
    assert "not finite" in DivergenceWatch(10.0).check(1.0, 100, theta)


def test_loss_watch_smooths_and_keeps_the_first_reason():
    watch = LossWatch(factor=2.0)
    watch.observe(1.0, 1, np.ones(2))
    assert watch.recent == 1.0 and watch.diverged is None
    watch.observe(3.0, 2, np.ones(2))
    assert math.isclose(watch.recent, 0.95 + 0.05 * 3.0)
    for i in range(30):  # the warm-up: a rise is judged against a smoothed lowest
        watch.observe(1.0, 3 + i, np.ones(2))
    assert watch.diverged is None
    for i in range(100):
        watch.observe(100.0, 33 + i, np.ones(2))
    first = watch.diverged
    assert first is not None and "over 2 times" in first
    watch.observe(math.nan, 200, np.ones(2))
    assert watch.diverged == first


class _Bar:
    def __init__(self) -> None:
        self.n, self.text, self.refreshes = 0, "", 0

    def set_postfix_str(self, text: str, refresh: bool = True) -> None:
        self.text = text

    def refresh(self) -> None:
        self.refreshes += 1


def test_a_line_is_due_every_log_every_seconds(monkeypatch, capsys):
    clock = FakeClock()
    monkeypatch.setattr(monitor.time, "monotonic", clock)
    line = monitor.ProgressLine(log_every=10.0)
    assert not line.due()
    clock.now += 9.9
    assert not line.due()
    clock.now += 0.1
    assert line.due()
    line.update(42, 7.0, "loss 0.5")
    assert not line.due()  # the clock restarts at the line
    assert "42 updates, 7.0 upd/s, loss 0.5" in capsys.readouterr().err


def test_a_bar_refreshes_twice_a_second_however_often_it_is_asked(monkeypatch):
    """The bar once reset its timer on every call, so rank 0 (which asks thousands of times a
    second) never refreshed it."""
    clock = FakeClock()
    monkeypatch.setattr(monitor.time, "monotonic", clock)
    line = monitor.ProgressLine(log_every=60.0)
    line._bar = bar = _Bar()
    shown = 0
    for step in range(2048):  # 2 s of asking every 1/1024 s (exact in binary)
        clock.now += 2.0 ** -10
        if line.due():
            line.update(step, 1000.0, f"step {step}")
            shown += 1
    assert shown == 4 and bar.refreshes == 4 and bar.n == 2047 and bar.text == "step 2047"
