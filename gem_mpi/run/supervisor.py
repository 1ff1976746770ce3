"""Rank 0's run supervisor: everything about a run that is not the method itself.

The asynchronous master and the synchronous baseline both train by producing rows (one per
applied update or step) and a checkpoint state of their own. The supervisor owns the rest:
the metrics file, evaluation, the progress line, the checkpointer (when a save is due, and
the composition of the stateful parts into one file), the stop checks (signal, divergence,
low disk space, a stuck worker), and the end of the run, which is always one
:class:`Outcome`, mapped to the process's exit code by :data:`EXIT_CODES`.
"""

from __future__ import annotations

import enum
import os
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from gem_mpi.config import SYNC, Config
from gem_mpi.errors import OutputError
from gem_mpi.outputs import checkpoint
from gem_mpi.outputs.metrics import MetricsWriter
from gem_mpi.problem import Problem, save_final
from gem_mpi.run.monitor import Evaluator, LossWatch, ProgressLine, Watchdog


class Outcome(enum.Enum):
    FINISHED = "finished"  # the data budget is used up; final evaluation, model saved
    STOPPED = "stopped"  # a signal: checkpoint written, resume to finish
    DIVERGED = "diverged"  # the last good checkpoint is kept
    OUTPUT_FAILED = "output failed"  # an output could not be written, or disk space ran low
    STUCK = "stuck"  # a worker sent nothing for --worker-timeout seconds: the job is aborted
    FAILED = "failed"  # an error on some rank, reported where it happened


EXIT_USAGE = 2  # a bad option or input, reported before anything ran
EXIT_CODES = {
    Outcome.FINISHED: 0,
    Outcome.FAILED: 1,
    Outcome.OUTPUT_FAILED: 1,
    Outcome.STUCK: 1,
    Outcome.STOPPED: 3,
    Outcome.DIVERGED: 4,
}


def say(text: str) -> None:
    """rank 0's one-line messages: progress, the end of the run, errors."""
    print(f"gem_mpi: {text}", file=sys.stderr, flush=True)


class StopFlag:
    """Set by SIGUSR1 or SIGTERM: rank 0 checkpoints and ends the run early, cleanly.

    mpirun and srun forward SIGUSR1 unchanged to every rank and keep the job alive; SIGTERM
    sent to mpirun kills the ranks within about a second, and sent to srun it kills the
    step at once, so forward SIGUSR1 to the launcher (Slurm: ``--signal=B:USR1@300``, as
    jobs/ does); SIGTERM helps only where it reaches the ranks directly. Workers only note
    the signal: rank 0 decides and tells them.
    """

    def __init__(self) -> None:
        self.signum = 0

    def install(self) -> StopFlag:
        import signal

        for sig in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(sig, self)
        return self

    def __call__(self, signum: int, frame: object) -> None:
        self.signum = signum

    def __bool__(self) -> bool:
        return self.signum != 0


class Stateful(Protocol):
    """A part of the run that a checkpoint holds."""

    def state(self) -> dict[str, Any]: ...


class Checkpointer:
    """Composes the stateful parts into one checkpoint file, and decides when one is due."""

    def __init__(self, directory: str | None, every: float, config: dict, n_workers: int,
                 parts: list[Stateful]) -> None:
        self.directory, self.every = directory, every if directory else 0.0
        self.config, self.n_workers, self.parts = config, n_workers, parts
        self._last = time.monotonic()

    def save(self) -> str | None:
        """Write θ and the run's position (the metrics rows on disk match it exactly)."""
        if not self.directory:
            return None
        state: dict[str, Any] = {"config": self.config, "n_workers": self.n_workers}
        for part in self.parts:
            state.update(part.state())
        path = checkpoint.save(self.directory, state.pop("theta"), state)
        self._last = time.monotonic()
        return path

    def maybe_save(self) -> str | None:
        if self.every and time.monotonic() - self._last >= self.every:
            return self.save()
        return None


class _MetricsRows:
    """The metrics file's part of a checkpoint: how many rows of each table are on disk."""

    def __init__(self, metrics: MetricsWriter | None) -> None:
        self.metrics = metrics

    def state(self) -> dict[str, int]:
        if self.metrics is None:
            return {"rows_updates": 0, "rows_eval": 0, "rows_rejected": 0}
        self.metrics.flush(check_space=False)  # into the low-space margin if need be
        rows = self.metrics.rows()
        return {"rows_updates": rows[0], "rows_eval": rows[1], "rows_rejected": rows[2]}


class RunSupervisor:
    """Rank 0's bookkeeping for one run of ``n_workers`` workers of any method.

    ``engine`` is the method's own stateful part (θ and its position); ``noun`` names its
    unit of progress ("update" or "step"); ``resumed`` is the loaded checkpoint's state.
    """

    def __init__(self, cfg: Config, problem: Problem, n_workers: int, engine: Stateful,
                 kernel_name: str, stop: StopFlag, resumed: dict | None = None,
                 noun: str = "update", eval_problem: Problem | None = None,
                 eval_threads: int | None = None, run_id: str | None = None) -> None:
        self.cfg, self.monitor, self.outputs = cfg, cfg.monitor, cfg.outputs
        self.problem, self.n_workers, self.noun, self.stop = problem, n_workers, noun, stop
        self.remedy = "Lower --lr" if cfg.method == SYNC else "Lower --lr (or --kappa)"
        self.evaluator = Evaluator(cfg.data, cfg.monitor, eval_problem or problem, noun=noun,
                                   threads=eval_threads)
        # the run's id: drawn at its first start, kept by its checkpoints and metrics file
        self.run_id = run_id or (resumed["run_id"] if resumed else uuid.uuid4().hex)
        self.metrics = None
        if self.outputs.metrics:
            rows, log = None, None
            if resumed:
                log = {"clock": resumed["clock"], "checkpoint": resumed["path"],
                       "changes": resumed["changes"]}
                if os.path.exists(self.outputs.metrics):
                    rows = (resumed["rows_updates"], resumed["rows_eval"],
                            resumed["rows_rejected"])
            self.metrics = self.evaluator.metrics = MetricsWriter(
                self.outputs.metrics, cfg.as_dict(), problem.names, problem.sizes, n_workers,
                kernel_name, resume_rows=rows, min_free_bytes=self.monitor.min_free_bytes,
                run_id=self.run_id, resume_log=log,
            )
        self.progress = ProgressLine(self.monitor.log_every, unit="upd" if noun == "update"
                                     else "step", noun=f"{noun}s")
        self.checkpointer = Checkpointer(self.outputs.checkpoint_dir,
                                         self.outputs.checkpoint_every, cfg.as_dict(),
                                         n_workers, [engine, _MetricsRows(self.metrics), self])
        self.losses = LossWatch(self.monitor.divergence_factor)
        self.watchdog = Watchdog(n_workers, self.monitor.worker_timeout)
        self.elapsed0 = resumed["elapsed_s"] if resumed else 0.0
        self.t0 = time.perf_counter() - self.elapsed0  # a resumed run's times continue
        self.position = resumed["clock"] if resumed else 0  # updates or steps done
        self._first = self.position
        self.summary: dict = {}  # what the metrics file's /summary holds, once the run ended

    # --- the parts of a checkpoint that are the supervisor's --------------------------------
    def state(self) -> dict[str, float | str]:
        return {"elapsed_s": self.elapsed(), "run_id": self.run_id}

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    # --- during the run ---------------------------------------------------------------------
    @property
    def diverged(self) -> str | None:
        return self.losses.diverged

    def observe(self, loss: float, position: int, theta: np.ndarray) -> None:
        """A worker loss at ``position``: smooth it, and look for divergence."""
        self.losses.observe(loss, position, theta)

    def eval_due(self, position: int) -> bool:
        """After every --eval-every-th update or step (``position``: the one just recorded)."""
        every = self.monitor.eval_every
        return bool(every) and (position + 1) % every == 0

    def evaluate(self, theta: np.ndarray, done: int) -> None:
        """Evaluate θ (holding ``done`` updates or steps) in the background."""
        self.evaluator.submit(theta, done, self.elapsed())

    def check(self, position: int) -> Outcome | None:
        """Between batches: record finished evaluations, save if due, and say whether the
        run must end now. A stuck worker ends the job here; low disk space raises."""
        self.position = position
        if self.stop:
            return Outcome.STOPPED
        if self.diverged and self.monitor.stop_on_divergence:
            return Outcome.DIVERGED
        if self.metrics is not None and self.metrics.low_space:
            raise OutputError(self.metrics.low_space)
        stuck = self.watchdog.stuck()
        if stuck is not None:
            self._abort_stuck(*stuck)
        self.housekeeping()
        return None

    def housekeeping(self) -> None:
        """Save if due; record the evaluations that have finished."""
        self.checkpointer.maybe_save()
        self.evaluator.drain()

    def show(self, status: str) -> None:
        rate = (self.position - self._first) / max(self.elapsed() - self.elapsed0, 1e-9)
        self.progress.update(self.position, rate, status)

    def begin(self) -> None:
        """Training starts now (set-up time is not the run's)."""
        self._first = self.position
        self.t0 = time.perf_counter() - self.elapsed0

    # --- the end ----------------------------------------------------------------------------
    def run(self, loop: Callable[[], Outcome], summary: Callable[[], dict],
            theta: Callable[[], np.ndarray], done_line: Callable[[dict], str],
            stop_by: Callable[[], str]) -> Outcome:
        """Run ``loop`` to its outcome and end the run accordingly: every way a run can end
        is handled here. ``summary`` gives the method's own summary fields, ``theta`` the
        final parameters, ``done_line`` the line of a finished run."""
        self.begin()
        try:
            try:
                outcome = loop()
            finally:
                self.progress.close()
            wall = self.elapsed()
            base = {"updates": self.position, "wall_s": wall}
            if outcome is Outcome.FINISHED:
                test_loss, test_acc = self.evaluator.final(theta(), self.position, wall)
                fields = {**base, "test_loss": test_loss, "test_accuracy": test_acc,
                          "finished": 1.0, "diverged": 0.0, **summary()}
                if self.outputs.save:
                    save_final(self.evaluator.problem.model, theta(), self.outputs.save)
                self.checkpointer.save()  # the end is a checkpoint too
                self.summary = fields
                if self.metrics is not None:
                    self.metrics.close(fields)
                say(done_line(fields))
                return outcome
            self.evaluator.close()
            self.evaluator.drain()
            fields = {**base, "finished": 0.0, "diverged": 1.0 if self.diverged else 0.0,
                      **summary()}
            self.summary = fields
            self._stopped_early(stop_by())
            if self.metrics is not None:
                self.metrics.close(fields)
            return Outcome.DIVERGED if self.diverged else Outcome.STOPPED
        except OutputError as exc:
            self.output_failed(str(exc), summary())
            return Outcome.OUTPUT_FAILED

    def output_failed(self, reason: str, summary: dict) -> None:
        """An output file could not be written (or space ran low): leave a checkpoint where
        one can still be written and a readable metrics file (or none), and say so."""
        fields = {"updates": self.position, "wall_s": self.elapsed(), **summary,
                  "finished": 0.0, "error": 1.0}
        notes = self.cut_short(fields, "free space, then --resume auto")
        say(f"error: stopped at {self.noun} {self.position}: {reason}; {notes}")

    def cut_short(self, fields: dict, resume_hint: str) -> str:
        """A run ending on an error: write a checkpoint if one can be, close the metrics file
        unfinished; returns what became of each, for the one error line."""
        notes = []
        try:
            path = self.checkpointer.save()
            notes.append(f"checkpoint {path}: {resume_hint}" if path
                         else "no --checkpoint-dir, so no checkpoint")
        except OutputError as exc:
            notes.append(str(exc))
        if self.metrics is not None:
            try:
                self.metrics.close(fields)
            except OutputError as exc:
                notes.append(str(exc))
        return "; ".join(notes)

    def _stopped_early(self, by: str) -> None:
        """The one line of a run stopped before its end. Diverged: the newest checkpoint on
        disk is the last good state, so none is written. Stopped by a signal: save now."""
        noun, at = self.noun, self.position
        if self.diverged:
            directory = self.outputs.checkpoint_dir
            last = checkpoint.latest(directory) if directory else None
            where = f"the last good state is {last}" if last else "no checkpoint was written"
            say(f"stopped: the run diverged at {noun} {at} ({self.diverged}); {where}. "
                f"{self.remedy}, or pass --no-stop-on-divergence")
            return
        path = self.checkpointer.save()
        where = (f"checkpoint {path}; continue with --resume {path} (or --resume auto)"
                 if path else "no --checkpoint-dir, so no checkpoint was written")
        say(f"stopped by {by} at {noun} {at}: {where}")

    def _abort_stuck(self, worker: int, silent_s: float) -> None:
        """Checkpoint, close the metrics unfinished, say which worker, abort the job: a stuck
        rank never takes part in the collective window free of a normal shutdown."""
        notes = self.cut_short({"updates": self.position, "wall_s": self.elapsed(),
                                "finished": 0.0}, "--resume auto continues")
        say(f"error: worker {worker} (rank {worker}) has sent nothing for {silent_s:.0f} s "
            f"(--worker-timeout {self.monitor.worker_timeout:g}): it or its node is stuck; "
            f"ending the job at {self.noun} {self.position}; {notes}")
        from gem_mpi.transport import MPI

        MPI.COMM_WORLD.Abort(EXIT_CODES[Outcome.STUCK])
