"""Watching a run from rank 0, whatever the method: evaluation, progress line, divergence.

The asynchronous master (master.py) and the synchronous baseline (sync.py) share these, so
the two report, evaluate and stop on divergence the same way.
"""

from __future__ import annotations

import math
import queue
import sys
import threading
import time
from collections.abc import Callable

import numpy as np

from gem_mpi.config import DataConfig, MonitorConfig
from gem_mpi.outputs.metrics import MetricsWriter
from gem_mpi.outputs.scalars import LiveScalars
from gem_mpi.problem import Problem, load_theta
from gem_mpi.run.throughput import Throughput


class Evaluator:
    """Test loss and accuracy of a θ snapshot, in a thread beside the training loop, and
    their rows in the metrics file (``metrics``, set by the owner once it has one)."""

    def __init__(self, data: DataConfig, monitor: MonitorConfig, problem: Problem,
                 noun: str = "update", threads: int | None = None) -> None:
        self.data, self.monitor = data, monitor
        self.problem = problem
        self.threads = threads  # torch threads of the evaluation (None: leave torch's)
        self.noun = noun
        self.metrics: MetricsWriter | None = None  # the supervisor's, once it has one
        self.scalars: LiveScalars | None = None  # the supervisor's live scalars, if any
        self.last: tuple = (-1, float("nan"), float("nan"))  # (clock, loss, accuracy)
        self._jobs: queue.Queue = queue.Queue(maxsize=1)
        self._results: queue.Queue = queue.Queue()
        self._busy = threading.Event()
        if problem.quadratic is None:
            # torch and the data modules here: a quadratic run never loads torch
            import torch

            from gem_mpi.problem.datasets import evaluation_split

            self.device = torch.device("cpu")  # the master is a CPU rank
            self.split = evaluation_split(data)
        self._thread = threading.Thread(target=self._serve, name="gem-eval", daemon=True)
        self._thread.start()

    def evaluate(self, theta: np.ndarray) -> tuple[float, float]:
        q = self.problem.quadratic
        if q is not None:  # the mean objective over workers' targets ≈ the shared optimum
            diff = theta - q.center
            return 0.5 * float(np.dot(q.h * diff, diff)), float("nan")
        # torch: not for the quadratic
        from gem_mpi.problem.batches import iterate_batches
        from gem_mpi.problem.datasets import statistics_batches
        from gem_mpi.problem.models import evaluate, recompute_batch_norm

        model = self.problem.model
        assert model is not None, "a torch problem has its model"
        load_theta(model, theta)
        if self.monitor.bn_batches:  # BatchNorm statistics of this θ (none: nothing done)
            recompute_batch_norm(model,
                                 statistics_batches(self.data, self.monitor.bn_batches),
                                 self.device)
        batches = iterate_batches(
            self.split, self.monitor.eval_batch_size, 1, 0, shuffle=False, drop_last=False
        )
        return evaluate(model, batches, self.device, self.problem.loss)

    def submit(self, theta: np.ndarray, clock: int, t: float) -> bool:
        """Queue a snapshot unless an evaluation is still running (then skip this one)."""
        if self._busy.is_set():
            return False
        self._busy.set()
        self._jobs.put((theta.copy(), clock, t))
        return True

    def _serve(self) -> None:
        if self.threads and self.problem.quadratic is None:
            import torch

            torch.set_num_threads(self.threads)  # the master's process runs torch only here
        while True:
            job = self._jobs.get()
            if job is None:
                return
            theta, clock, t = job
            try:
                loss, acc = self.evaluate(theta)
                self._results.put((t, clock, loss, acc, None))
            except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
                self._results.put((t, clock, float("nan"), float("nan"), exc))
            finally:
                self._busy.clear()

    def results(self) -> list[tuple]:
        out = []
        while True:
            try:
                out.append(self._results.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join()

    def record(self, t: float, clock: int, loss: float, acc: float) -> None:
        self.last = (clock, loss, acc)
        if self.metrics is not None:
            self.metrics.add_eval({"time": t, "clock": clock, "test_loss": loss,
                                   "test_accuracy": acc})
        if self.scalars is not None:
            split = self.data.eval_split
            self.scalars.write(clock, {f"eval/{split}_loss": loss,
                                       f"eval/{split}_accuracy": acc})
        if self.monitor.verbose:
            print(f"gem_mpi: eval at {self.noun} {clock}: test loss {loss:.4f}, accuracy "
                  f"{acc:.4f}", file=sys.stderr, flush=True)

    def drain(self) -> None:
        """Record the evaluations that have finished; re-raise one that failed."""
        for t, clock, loss, acc, exc in self.results():
            if exc is not None:
                raise exc
            self.record(t, clock, loss, acc)

    def final(self, theta: np.ndarray, clock: int, t: float) -> tuple[float, float]:
        """The end of a run: stop the thread, and evaluate θ unless that was just done."""
        self.close()
        self.drain()
        if self.last[0] == clock:
            return self.last[1], self.last[2]
        loss, acc = self.evaluate(theta)
        self.record(t, clock, loss, acc)
        return loss, acc


class ProgressLine:
    """One status line on rank 0: a live tqdm bar on a terminal, throttled lines otherwise."""

    def __init__(self, log_every: float, unit: str = "upd", noun: str = "updates",
                 throughput: Throughput | None = None) -> None:
        """``throughput``: what one unit trains on, shown as samples/s (tokens/s, MFU)."""
        self.unit, self.noun, self.throughput = unit, noun, throughput
        self.tty = sys.stderr.isatty()
        self.log_every = log_every
        self._last = time.monotonic()
        self._bar = None
        if self.tty:
            from tqdm import tqdm

            self._bar = tqdm(unit=unit, file=sys.stderr, mininterval=0.5, dynamic_ncols=True)

    def due(self) -> bool:
        """Whether :meth:`update` would show anything now: callers build its text only then
        (rank 0 asks after every batch and on idle wake-ups, thousands of times a second)."""
        wait = 0.5 if self._bar is not None else self.log_every
        return time.monotonic() - self._last >= wait

    def update(self, clock: int, rate: float, text: str) -> None:
        self._last = time.monotonic()
        if self._bar is not None:
            self._bar.n = clock
            words = f"{self.throughput.text(rate)}, {text}" if self.throughput else text
            self._bar.set_postfix_str(words, refresh=False)
            self._bar.refresh()
            return
        speed = f" ({self.throughput.text(rate)})" if self.throughput else ""
        print(f"gem_mpi: {clock} {self.noun}, {rate:.1f} {self.unit}/s{speed}, {text}",
              file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


# The rise is judged once the smoothed loss averages WARMUP losses (a run, or a resume of
# one, whose first loss is 1e-11 and whose next is 0.5 has not diverged), and from a lowest
# value never counted below LOWEST_FLOOR of the first smoothed one (a run that all but
# memorised its data, at 1e-11, then meets a harder batch at 0.5 has not diverged either)
WARMUP = 20
LOWEST_FLOOR = 1e-3


class DivergenceWatch:
    """Says why a run has diverged, or None: the smoothed worker loss turned NaN/Inf or,
    after ``warmup`` losses, rose ``factor`` times above its lowest value so far (never
    counted below ``LOWEST_FLOOR`` of the first one), or θ is no longer finite (checked every
    100 updates: one pass over θ)."""

    def __init__(self, factor: float, warmup: int = WARMUP) -> None:
        self.factor = factor
        self.warmup = warmup
        self.seen = 0
        self.lowest = math.inf
        self.first = math.nan

    def check(self, recent_loss: float, clock: int, theta: np.ndarray) -> str | None:
        if not math.isfinite(recent_loss):
            return f"the workers' loss is {recent_loss}"
        self.seen += 1
        if self.seen > self.warmup:
            if math.isnan(self.first):
                self.first = recent_loss
            self.lowest = min(self.lowest, recent_loss)
        base = max(self.lowest, LOWEST_FLOOR * self.first) if self.lowest < math.inf else 0.0
        if base > 0 and recent_loss > self.factor * base:
            return (f"the smoothed worker loss {recent_loss:.4g} is over {self.factor:g} times "
                    f"its lowest, {self.lowest:.4g}" + ("" if base == self.lowest else
                    f" (counted as {base:.4g}: {LOWEST_FLOOR:g} of its first, "
                    f"{self.first:.4g})"))
        if clock % 100 == 0:
            with np.errstate(over="ignore", invalid="ignore"):
                norm = float(np.dot(theta, theta))
            if not math.isfinite(norm):
                return "θ holds values that are not finite"
        return None


class LossWatch:
    """The workers' smoothed loss, and whether the run has diverged (the first reason)."""

    def __init__(self, factor: float) -> None:
        self.watch = DivergenceWatch(factor)
        self.recent = math.nan
        self.diverged: str | None = None

    def observe(self, loss: float, position: int, theta: np.ndarray) -> None:
        self.recent = loss if math.isnan(self.recent) else 0.95 * self.recent + 0.05 * loss
        if self.diverged is None:
            self.diverged = self.watch.check(self.recent, position, theta)


def say(text: str) -> None:
    """rank 0's one-line messages: progress, the end of the run, errors."""
    print(f"gem_mpi: {text}", file=sys.stderr, flush=True)


class Watchdog:
    """Which worker has sent nothing for longer than ``timeout`` seconds, if any.

    A dead worker ends the job through mpirun at once; a stuck one (a hung data loader, a
    lost GPU, a frozen node) would hold it until the time limit."""

    def __init__(self, n_workers: int, timeout: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout, self.clock = timeout, clock
        self.last = np.full(n_workers, clock())
        self.finished = np.zeros(n_workers, dtype=bool)
        self._next_check = clock() + 1.0

    def heard(self, worker: int, finished: bool = False) -> None:
        """Worker ``worker`` (1..n) sent a message; ``finished``: its last one."""
        self.last[worker - 1] = self.clock()
        self.finished[worker - 1] |= finished

    def expect(self, worker: int) -> None:
        """Worker ``worker`` is at work again (dealt more batches after its last message)."""
        self.finished[worker - 1] = False
        self.last[worker - 1] = self.clock()

    def stuck(self) -> tuple[int, float] | None:
        """(worker, seconds silent) of the longest-silent unfinished worker past the timeout;
        looked at once a second."""
        now = self.clock()
        if not self.timeout or now < self._next_check:
            return None
        self._next_check = now + 1.0
        silent = np.where(self.finished, 0.0, now - self.last)
        slot = int(np.argmax(silent))
        return (slot + 1, float(silent[slot])) if silent[slot] > self.timeout else None
