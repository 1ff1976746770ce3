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

from gem_mpi.config import Config
from gem_mpi.problem import Problem, load_theta


class Evaluator:
    """Test loss and accuracy of a θ snapshot, in a thread beside the training loop, and
    their rows in the metrics file (``metrics``, set by the owner once it has one)."""

    def __init__(self, cfg: Config, problem: Problem, noun: str = "update") -> None:
        self.cfg = cfg
        self.problem = problem
        self.noun = noun
        self.metrics = None
        self.last: tuple = (-1, float("nan"), float("nan"))  # (clock, loss, accuracy)
        self._jobs: queue.Queue = queue.Queue(maxsize=1)
        self._results: queue.Queue = queue.Queue()
        self._busy = threading.Event()
        if problem.quadratic is None:
            import torch

            from gem_mpi.data import load_split

            self.device = torch.device("cpu")  # the master is a CPU rank
            self.split = load_split(cfg.dataset, cfg.data_dir, "test", cfg.model)
        self._thread = threading.Thread(target=self._serve, name="gem-eval", daemon=True)
        self._thread.start()

    def evaluate(self, theta: np.ndarray) -> tuple[float, float]:
        q = self.problem.quadratic
        if q is not None:  # the mean objective over workers' targets ≈ the shared optimum
            diff = theta - q.center
            return 0.5 * float(np.dot(q.h * diff, diff)), float("nan")
        from gem_mpi.data import iterate_batches
        from gem_mpi.models import evaluate

        load_theta(self.problem.model, theta)
        batches = iterate_batches(
            self.split, self.cfg.eval_batch_size, 1, 0, shuffle=False, drop_last=False
        )
        return evaluate(self.problem.model, batches, self.device)

    def submit(self, theta: np.ndarray, clock: int, t: float) -> bool:
        """Queue a snapshot unless an evaluation is still running (then skip this one)."""
        if self._busy.is_set():
            return False
        self._busy.set()
        self._jobs.put((theta.copy(), clock, t))
        return True

    def _serve(self) -> None:
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
        if self.cfg.verbose:
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


class Progress:
    """One status line on rank 0: a live tqdm bar on a terminal, throttled lines otherwise."""

    def __init__(self, log_every: float, unit: str = "upd", noun: str = "updates") -> None:
        self.unit, self.noun = unit, noun
        self.tty = sys.stderr.isatty()
        self.log_every = log_every
        self._last = time.monotonic()
        self._bar = None
        if self.tty:
            from tqdm import tqdm

            self._bar = tqdm(unit=unit, file=sys.stderr, mininterval=0.5, dynamic_ncols=True)

    def update(self, clock: int, rate: float, text: str) -> None:
        if self._bar is not None:
            self._bar.n = clock
            self._bar.set_postfix_str(text, refresh=False)
            self._bar.refresh() if time.monotonic() - self._last > 0.5 else None
            self._last = time.monotonic()
            return
        now = time.monotonic()
        if now - self._last >= self.log_every:
            self._last = now
            print(f"gem_mpi: {clock} {self.noun}, {rate:.1f} {self.unit}/s, {text}",
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


class DivergenceWatch:
    """Says why a run has diverged, or None: the smoothed worker loss turned NaN/Inf or rose
    ``factor`` times above its lowest value so far, or θ is no longer finite (checked every
    100 updates: one pass over θ)."""

    def __init__(self, factor: float) -> None:
        self.factor = factor
        self.lowest = math.inf

    def check(self, recent_loss: float, clock: int, theta: np.ndarray) -> str | None:
        if not math.isfinite(recent_loss):
            return f"the workers' loss is {recent_loss}"
        self.lowest = min(self.lowest, recent_loss)
        if self.lowest > 0 and recent_loss > self.factor * self.lowest:
            return (f"the smoothed worker loss {recent_loss:.4g} is over {self.factor:g} times "
                    f"its lowest, {self.lowest:.4g}")
        if clock % 100 == 0:
            with np.errstate(over="ignore", invalid="ignore"):
                norm = float(np.dot(theta, theta))
            if not math.isfinite(norm):
                return "θ holds values that are not finite"
        return None


def cut_short(write_checkpoint: Callable[[], str | None], metrics: object | None,
              summary: dict, resume_hint: str) -> str:
    """A run ending on an error: write a checkpoint if one can be, close the metrics file
    unfinished; returns what became of each, for the one error line."""
    from gem_mpi.errors import OutputError

    notes = []
    try:
        path = write_checkpoint()
        notes.append(f"checkpoint {path}: {resume_hint}" if path
                     else "no --checkpoint-dir, so no checkpoint")
    except OutputError as exc:
        notes.append(str(exc))
    if metrics is not None:
        try:
            metrics.close(summary)
        except OutputError as exc:
            notes.append(str(exc))
    return "; ".join(notes)


def stopped_early(noun: str, at: int, diverged: str | None, checkpoint_dir: str | None,
                  write_checkpoint: Callable[[], str | None], by: str, remedy: str) -> None:
    """The one line of a run stopped before its end. Diverged: the newest checkpoint on disk
    is the last good state, so none is written. Stopped by a signal: checkpoint now."""
    from gem_mpi import checkpoint

    if diverged:
        last = checkpoint.latest(checkpoint_dir) if checkpoint_dir else None
        where = f"the last good state is {last}" if last else "no checkpoint was written"
        print(f"gem_mpi: stopped: the run diverged at {noun} {at} ({diverged}); {where}. "
              f"{remedy}, or pass --no-stop-on-divergence", file=sys.stderr, flush=True)
        return
    path = write_checkpoint()
    where = (f"checkpoint {path}; continue with --resume {path} (or --resume auto)"
             if path else "no --checkpoint-dir, so no checkpoint was written")
    print(f"gem_mpi: stopped by {by} at {noun} {at}: {where}", file=sys.stderr, flush=True)
