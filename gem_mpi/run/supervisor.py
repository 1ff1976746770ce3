"""Rank 0's run supervisor: everything about a run that is not the method itself.

The asynchronous master and the synchronous baseline are both an :class:`Engine`: a loop
that produces rows (one per applied update or step) and a checkpoint state of its own. The
supervisor drives it and owns the rest: the metrics file, evaluation, the progress line, the
checkpointer (when a save is due, and the composition of the stateful parts into one file),
the stop checks (signal, divergence, an output failure or low disk space, a stuck worker),
and the end of the run. The engine talks to it through a few methods (``record_update``,
``record_rejected``, ``heard``, ``observe``, ``evaluate``, ``show``) and asks it
``between_batches()`` whether the run must end: the answer is a :class:`Verdict`, never an
exception, and the run's end (:meth:`RunSupervisor.run`) handles every verdict in one place.
Each ends as one :class:`Outcome`, mapped to the process's exit code by :data:`EXIT_CODES`.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import os
import signal
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from gem_mpi import protocol
from gem_mpi.config import Config, synchronous, worker_ranks
from gem_mpi.errors import OutputError
from gem_mpi.outputs import checkpoint
from gem_mpi.outputs.lock import RUN_LOCKS
from gem_mpi.outputs.metrics import MetricsWriter
from gem_mpi.outputs.scalars import LiveScalars
from gem_mpi.problem import Problem, save_final
from gem_mpi.run.departures import Departures
from gem_mpi.run.monitor import Evaluator, LossWatch, ProgressLine, Watchdog, say
from gem_mpi.run.throughput import Throughput, measure


class Outcome(enum.Enum):
    FINISHED = "finished"  # the data budget is used up; final evaluation, model saved
    STOPPED = "stopped"  # a signal: checkpoint written, resume to finish
    DIVERGED = "diverged"  # the last good checkpoint is kept
    OUTPUT_FAILED = "output failed"  # an output could not be written, or disk space ran low
    STUCK = "stuck"  # a worker sent nothing for --worker-timeout seconds: the job is aborted
    FAILED = "failed"  # an error on some rank, reported where it happened


EXIT_USAGE = 2  # a bad option or input, reported before anything ran
# one code per way to end, so that a launcher can tell what a restart would fix: a stuck
# worker (6) or a killed rank (mpirun: 128 + the signal) yes, a full disk (5) not
EXIT_CODES = {
    Outcome.FINISHED: 0,
    Outcome.FAILED: 1,
    Outcome.STOPPED: 3,
    Outcome.DIVERGED: 4,
    Outcome.OUTPUT_FAILED: 5,
    Outcome.STUCK: 6,
}
# the stop word each outcome sends the workers (they exit with the code it maps back to)
SHUTDOWN = {Outcome.FINISHED: protocol.FINISHED, Outcome.STOPPED: protocol.STOPPED,
            Outcome.DIVERGED: protocol.DIVERGED, Outcome.OUTPUT_FAILED: protocol.OUTPUT_FAILED}
OUTCOME_OF = {word: outcome for outcome, word in SHUTDOWN.items()}  # a worker's view


class StopFlag:
    """Set by SIGUSR1 or SIGTERM: rank 0 checkpoints and ends the run early, cleanly.

    mpirun and srun forward SIGUSR1 unchanged to every rank and keep the job alive; SIGTERM
    sent to mpirun kills the ranks within about a second, and sent to srun it kills the
    step at once, so forward SIGUSR1 to the launcher (Slurm: ``--signal=B:USR1@300``, as
    jobs/ does); SIGTERM helps only where it reaches the ranks directly. A worker of an
    asynchronous method that gets SIGTERM leaves the run alone (gem_mpi.engine.roster);
    otherwise workers only note the signal: rank 0 decides and tells them.
    """

    def __init__(self) -> None:
        self.signum = 0
        self.signals: set[int] = set()  # every signal received

    def install(self) -> StopFlag:
        for sig in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(sig, self)
        return self

    def __call__(self, signum: int, frame: object) -> None:
        self.signum = signum
        self.signals.add(signum)

    def terminated(self) -> bool:
        """SIGTERM reached this process: an asynchronous worker leaves the run."""
        return signal.SIGTERM in self.signals

    def __bool__(self) -> bool:
        return self.signum != 0


@dataclass(frozen=True)
class Verdict:
    """How a run ends and why: the signal, the divergence, the output that failed, the
    silent worker. What the supervisor's check answers and what an engine's loop ends with."""

    outcome: Outcome
    reason: str = ""


FINISHED = Verdict(Outcome.FINISHED)


class Stateful(Protocol):
    """A part of the run that a checkpoint holds: its ``state()`` gives its own fields of
    :class:`~gem_mpi.outputs.checkpoint.Checkpoint` by name (the engine, the metrics rows,
    the supervisor); a resumed run gives each part the checkpoint to read its own back."""

    def state(self) -> dict[str, Any]: ...


class Engine(Protocol):
    """A training method, as the supervisor drives it.

    ``loop`` trains until the data budget is used up (then it returns :data:`FINISHED`) or
    ``between_batches()`` of its supervisor gives a verdict (then it returns that one; the
    synchronous run returns the one every rank agreed on). It records through the
    supervisor's methods and never ends the run itself."""

    noun: str  # its unit of progress: "update" or "step"

    @property
    def position(self) -> int:
        """Updates or steps done: what its checkpoint and the metrics rows count."""
        ...

    def loop(self) -> Verdict: ...

    def state(self) -> dict[str, Any]:
        """Its fields of a checkpoint (θ, its position, what else it needs to continue)."""
        ...

    def load_state(self, ckpt: checkpoint.Checkpoint) -> None:
        """Continue from a checkpoint's state (the supervisor calls it when resuming)."""
        ...

    def theta(self) -> np.ndarray: ...

    def summary(self) -> dict:
        """Its own fields of the metrics file's /summary."""
        ...

    def done_line(self, fields: dict) -> str:
        """The one line of a finished run, from the summary ``fields``."""
        ...


class Supervisor(Protocol):
    """What an engine calls on its supervisor while it trains: the run's (rank 0:
    :class:`RunSupervisor`) or, on another master of a sharded run, a follower's
    (:class:`gem_mpi.engine.shards.Follower`). The session builds it and gives it to the
    engine; the engine never asks which it has."""

    recording: bool  # whether rows are wanted now
    recent_loss: float
    summary: dict
    departures: Departures | None  # the run's elastic state: rank 0's alone

    def heard(self, worker: int, finished: bool = False) -> None: ...

    def record_update(self, row: dict) -> None: ...

    def record_rejected(self, row: dict) -> None: ...

    def observe(self, loss: float, position: int, theta: np.ndarray,
                share: float = 1.0) -> None: ...

    def eval_due(self, position: int) -> bool: ...

    def evaluate(self, theta: np.ndarray, done: int) -> None: ...

    def show(self, status: Callable[[], str]) -> None: ...

    def since_start(self, t: float) -> float: ...

    def between_batches(self) -> Verdict | None:
        """None: train on; else the verdict that ends the run."""
        ...

    def run(self) -> Outcome:
        """Drive the engine's loop to the end of the run."""
        ...


class Checkpointer:
    """Composes the stateful parts into one checkpoint file, and decides when one is due."""

    def __init__(self, directory: str | None, every: float, config: dict, n_workers: int,
                 parts: list[Stateful], clock: Callable[[], float] = time.monotonic,
                 keep: int = 1) -> None:
        self.directory, self.every, self.keep = directory, every if directory else 0.0, keep
        self.config, self.n_workers, self.parts = config, n_workers, parts
        self.clock = clock
        self._last = clock()

    def save(self, finished: bool = False) -> str | None:
        """Write θ and the run's position (the metrics rows on disk match it exactly);
        ``finished``: the run's last, which a resume must not extend."""
        if not self.directory:
            return None
        fields: dict[str, Any] = {"config": self.config, "n_workers": self.n_workers,
                                  "finished": int(finished)}
        for part in self.parts:
            fields.update(part.state())
        path = checkpoint.save(self.directory, checkpoint.Checkpoint(**fields), self.keep)
        self._last = self.clock()
        return path

    def maybe_save(self) -> str | None:
        if self.every and self.clock() - self._last >= self.every:
            return self.save()
        return None


class _MetricsRows:
    """The metrics file's part of a checkpoint: how many rows of each table are on disk."""

    def __init__(self, metrics: MetricsWriter | None) -> None:
        self.metrics = metrics

    def state(self) -> dict[str, Any]:
        if self.metrics is None:
            return {"rows_updates": 0, "rows_eval": 0, "rows_rejected": 0}
        # into the low-space margin if need be, and on the disk before the checkpoint
        self.metrics.flush(check_space=False, durable=True)
        rows = self.metrics.rows()
        out: dict[str, Any] = {"rows_updates": rows[0], "rows_eval": rows[1],
                               "rows_rejected": rows[2]}
        if self.metrics.shard_tables:  # --masters K > 1: the rows of shards 1..K-1
            out["rows_shards"] = np.array(self.metrics.shard_rows(), np.int64)
        return out


class RunSupervisor:
    """Rank 0's bookkeeping for one run of ``n_workers`` workers of any method.

    ``engine`` is the method (θ, its position, its loop); ``resumed`` is the loaded
    checkpoint's state, given to ``engine.load_state``. ``losses`` is a loss watch the engine
    keeps itself (the synchronous run: every rank watches alike); ``watch_workers=False``
    leaves stuck workers to someone else (Horovod's stall check)."""

    def __init__(self, cfg: Config, problem: Problem, n_workers: int, engine: Engine,
                 kernel_name: str, stop: StopFlag,
                 resumed: checkpoint.Checkpoint | None = None,
                 eval_problem: Problem | None = None, eval_threads: int | None = None,
                 run_id: str | None = None, losses: LossWatch | None = None,
                 watch_workers: bool = True) -> None:
        self.cfg, self.monitor, self.outputs = cfg, cfg.monitor, cfg.outputs
        self.engine, self.noun = engine, engine.noun
        self.problem, self.n_workers, self.stop = problem, n_workers, stop
        noun = self.noun
        self.remedy = "Lower --lr" if synchronous(cfg.method) else "Lower --lr (or --kappa)"
        self.evaluator = Evaluator(cfg.data, cfg.monitor, eval_problem or problem, noun=noun,
                                   threads=eval_threads)
        # the run's id: drawn at its first start, kept by its checkpoints and metrics file
        self.run_id = run_id or (resumed.run_id if resumed
                                 else cfg.outputs.run_id or uuid.uuid4().hex)
        RUN_LOCKS.describe(self.run_id)  # a second run on the outputs is told whose they are
        self.metrics: MetricsWriter | None = None
        if self.outputs.metrics:
            rows, log, shard_rows = None, None, None
            if resumed:
                log = {"clock": resumed.clock, "checkpoint": resumed.path,
                       "changes": resumed.changes}
                if os.path.exists(self.outputs.metrics):
                    rows = resumed.rows
                    shard_rows = resumed.rows_shards
            self.metrics = self.evaluator.metrics = MetricsWriter(
                self.outputs.metrics, cfg.as_dict(), problem.names, problem.sizes, n_workers,
                kernel_name, resume_rows=rows, min_free_bytes=self.monitor.min_free_bytes,
                run_id=self.run_id, resume_log=log, masters=cfg.runtime.masters,
                resume_shard_rows=None if shard_rows is None else list(shard_rows),
                wire_bytes=None if synchronous(cfg.method) else protocol.update_payload(
                    cfg.optim, problem.n_params).wire_bytes,
            )
        # the samples (text: and tokens) an update or a step trains on, and their FLOPs
        self.throughput: Throughput = measure(cfg, n_workers, eval_problem or problem,
                                              getattr(self.evaluator, "split", None))
        if self.throughput.note:
            say(self.throughput.note)
        self.tokens_per = self.throughput.samples * self.throughput.tokens
        self._shares = [0.0, 0]  # this start's updates' shares of their batch (observe)
        self.progress = ProgressLine(self.monitor.log_every, unit="upd" if noun == "update"
                                     else "step", noun=f"{noun}s", throughput=self.throughput)
        self.scalars: LiveScalars | None = None
        if self.outputs.tensorboard or self.outputs.wandb:
            self.scalars = self.evaluator.scalars = LiveScalars(
                self.outputs.tensorboard, self.outputs.wandb, self.run_id, cfg.as_dict(),
                resume_at=resumed.clock if resumed else None)
        self.losses = losses if losses is not None else LossWatch(self.monitor.divergence_factor)
        self.watchdog = Watchdog(n_workers, self.monitor.worker_timeout if watch_workers
                                 else 0.0)
        self.departures = Departures(
            cfg, n_workers, resumed.data_plan if resumed else None, self.watchdog,
            lambda row, left: self._write(lambda m: m.departed(row, left)),
            self._checkpoint_soon, self.elapsed)
        self.checkpointer = Checkpointer(self.outputs.checkpoint_dir,
                                         self.outputs.checkpoint_every, cfg.as_dict(),
                                         n_workers, [engine, _MetricsRows(self.metrics), self,
                                                     self.departures],
                                         keep=self.outputs.keep_checkpoints)
        if resumed:
            engine.load_state(resumed)
        self._save_due = False  # a checkpoint at the next check (a worker left)
        self.elapsed0 = resumed.elapsed_s if resumed else 0.0
        self.t0 = time.perf_counter() - self.elapsed0  # a resumed run's times continue
        self._first = engine.position
        self._failure: str | None = None  # an output that could not be written
        self.summary: dict = {}  # what the metrics file's /summary holds, once the run ended

    # --- the parts of a checkpoint that are the supervisor's --------------------------------
    def state(self) -> dict[str, Any]:
        return {"elapsed_s": self.elapsed(), "run_id": self.run_id}

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def since_start(self, t: float) -> float:
        """Seconds of the run (a resumed one's included) at ``time.perf_counter()`` ``t``."""
        return t - self.t0

    @property
    def position(self) -> int:
        return self.engine.position

    # --- what the engine calls during the run -----------------------------------------------
    @property
    def recording(self) -> bool:
        """Whether rows are written (a metrics file, not failed, or live scalars): build them
        only then."""
        return (self.metrics is not None or self.scalars is not None) and self._failure is None

    def _write(self, add: Callable[[MetricsWriter], None]) -> None:
        """One row through ``add`` while recording; a failed write ends the run at the next
        check."""
        if self.metrics is not None and self._failure is None:
            try:
                add(self.metrics)
            except OutputError as exc:
                self._failure = str(exc)

    def record_update(self, row: dict) -> None:
        """One applied update or step."""
        self._write(lambda m: m.add_update(row))
        if self.scalars is not None:
            self.scalars.row(row)

    def record_shard_update(self, shard: int, row: dict) -> None:
        """One update as shard ``shard`` (1..K-1 of --masters K) applied it, in its order."""
        self._write(lambda m: m.add_shard_update(shard, row))

    def record_rejected(self, row: dict) -> None:
        """One rejected update (NaN or Inf, θ untouched)."""
        self._write(lambda m: m.add_rejected(row))

    def heard(self, worker: int, finished: bool = False) -> None:
        """Worker ``worker`` (1..n) sent a message; ``finished``: its last one."""
        self.watchdog.heard(worker, finished)

    def _checkpoint_soon(self) -> None:
        self._save_due = True

    @property
    def diverged(self) -> str | None:
        return self.losses.diverged

    def shard_diverged(self, why: str) -> None:
        """Another master's θ is not finite: the run ends as diverged (the first reason)."""
        if self.losses.diverged is None:
            self.losses.diverged = why

    @property
    def recent_loss(self) -> float:
        return self.losses.recent

    def observe(self, loss: float, position: int, theta: np.ndarray,
                share: float = 1.0) -> None:
        """A worker loss at ``position``: smooth it, and look for divergence. ``share``: the
        part of its batch the update trained on (--dylu: its steps over H)."""
        self.losses.observe(loss, position, theta)
        self._shares[0] += share
        self._shares[1] += 1

    def _counted(self) -> Throughput:
        """The throughput as trained: an update's samples times the mean share of its batch
        this start's updates trained on (1 but under --dylu)."""
        total, n = self._shares
        if not n or total == n:
            return self.throughput
        return dataclasses.replace(self.throughput, samples=self.throughput.samples * total / n)

    def eval_due(self, position: int) -> bool:
        """After every --eval-every-th update or step (``position``: the one just recorded)."""
        every = self.monitor.eval_every
        return bool(every) and (position + 1) % every == 0

    def evaluate(self, theta: np.ndarray, done: int) -> None:
        """Evaluate θ (holding ``done`` updates or steps) in the background."""
        self.evaluator.submit(theta, done, self.elapsed())

    def between_batches(self) -> Verdict | None:
        """Whether the run must end now, and why; if not, save if due and record the
        evaluations that have finished. Never raises for an output, never ends the job."""
        verdict = self._verdict()
        if verdict is not None:
            return verdict
        try:
            if self._save_due:
                self._save_due = False
                self.checkpointer.save()
            else:
                self.checkpointer.maybe_save()
            self.evaluator.drain()
        except OutputError as exc:
            self._failure = str(exc)
            return Verdict(Outcome.OUTPUT_FAILED, self._failure)
        return None

    def _verdict(self) -> Verdict | None:
        if self._failure is not None:
            return Verdict(Outcome.OUTPUT_FAILED, self._failure)
        if self.stop:
            signum = self.stop.signum
            return Verdict(Outcome.STOPPED, f"signal {signum}" if signum else "a signal")
        if self.diverged and self.monitor.stop_on_divergence:
            return Verdict(Outcome.DIVERGED, self.diverged)
        if self.metrics is not None and self.metrics.low_space:
            return Verdict(Outcome.OUTPUT_FAILED, self.metrics.low_space)
        stuck = self.watchdog.stuck()
        if stuck is not None:
            worker, silent_s = stuck
            return Verdict(Outcome.STUCK,
                           f"worker {worker} ({worker_ranks(self.cfg, worker)}) has sent "
                           "nothing for "
                           f"{silent_s:.0f} s (--worker-timeout "
                           f"{self.monitor.worker_timeout:g}): it or its node is stuck")
        return None

    def show(self, status: Callable[[], str]) -> None:
        """The progress line, when one is due (``status`` is called only then)."""
        if self.progress.due():
            rate = self.rate()
            self.progress.throughput = self._counted()
            self.progress.update(self.position, rate, status())
            if self.scalars is not None:
                self.scalars.tick(self.position, self.rate_scalars(rate))

    def rate(self) -> float:
        """Updates (steps) per second since this start of the run began training."""
        return (self.position - self._first) / max(self.elapsed() - self.elapsed0, 1e-9)

    def rate_scalars(self, rate: float) -> dict[str, float]:
        """The live scalars of ``rate`` updates (steps) per second."""
        unit = "updates_per_s" if self.noun == "update" else "steps_per_s"
        return {f"speed/{unit}": rate,
                **{f"speed/{k}": v for k, v in self._counted().rates(rate).items()}}

    def begin(self) -> None:
        """Training starts now (set-up time is not the run's)."""
        self._first = self.position
        self.t0 = time.perf_counter() - self.elapsed0

    # --- the end ----------------------------------------------------------------------------
    def run(self) -> Outcome:
        """Run the engine's loop to its verdict and end the run accordingly: every way a run
        can end is handled here, and nothing here ends the job (a STUCK outcome asks the
        caller to: a stuck rank never takes part in a normal shutdown)."""
        self.begin()
        try:
            verdict = self.engine.loop()
        finally:
            self.progress.close()
        if verdict.outcome is Outcome.FINISHED and self._failure is not None:
            verdict = Verdict(Outcome.OUTPUT_FAILED, self._failure)  # in the last batch
        try:
            return self._end(verdict)
        except OutputError as exc:  # the end's own writes: the model, a checkpoint, metrics
            self.output_failed(str(exc))
            return Outcome.OUTPUT_FAILED

    def saved_metadata(self) -> dict[str, str]:
        """What a .safetensors --save holds beside the tensors (strings, as the format wants):
        the run's id and its effective configuration, as the metrics file records them."""
        return {"run_id": self.run_id, "config": json.dumps(self.cfg.as_dict(), sort_keys=True)}

    def _end(self, verdict: Verdict) -> Outcome:
        outcome = verdict.outcome
        if outcome is Outcome.OUTPUT_FAILED:
            self.output_failed(verdict.reason)
            return outcome
        if outcome is Outcome.STUCK:
            self._stuck(verdict.reason)
            return outcome
        wall = self.elapsed()
        base = {"updates": self.position, "wall_s": wall}
        counted = self._counted()
        if self.tokens_per:  # (the share of this start's updates taken for the earlier ones')
            base["tokens"] = self.position * counted.samples * counted.tokens
        base.update(counted.rates(self.rate()))
        engine = self.engine
        if outcome is Outcome.FINISHED:
            test_loss, test_acc = self.evaluator.final(engine.theta(), self.position, wall)
            fields = {**base, "test_loss": test_loss, "test_accuracy": test_acc,
                      "finished": 1.0, "diverged": 0.0, **engine.summary()}
            if self.outputs.save:
                save_final(self.evaluator.problem.model, engine.theta(), self.outputs.save,
                           self.saved_metadata())
            self.checkpointer.save(finished=True)  # the end is a checkpoint too
            self.summary = fields
            if self.metrics is not None:
                self.metrics.close(fields)
            self._close_scalars(fields)
            say(engine.done_line(fields) + self._speed_note(fields))
            return outcome
        self.evaluator.close()
        self.evaluator.drain()
        fields = {**base, "finished": 0.0, "diverged": 1.0 if self.diverged else 0.0,
                  **engine.summary()}
        self.summary = fields
        self._stopped_early(verdict.reason if outcome is Outcome.STOPPED else "a signal")
        if self.metrics is not None:
            self.metrics.close(fields)
        self._close_scalars(fields)
        return Outcome.DIVERGED if self.diverged else Outcome.STOPPED

    def _close_scalars(self, fields: dict) -> None:
        """The last point of the live scalars, and the run's summary for W&B."""
        if self.scalars is not None:
            self.scalars.tick(self.position, self.rate_scalars(self.rate()))
            self.scalars.close({k: float(v) for k, v in fields.items()
                                if isinstance(v, (int, float))})

    def _speed_note(self, fields: dict) -> str:
        """The done line's throughput (text: and the loss in bits per byte, the language
        model's unit)."""
        note = f", {fields['samples_per_s']:.0f} samples/s"
        if "mfu" in fields:
            note += f", MFU {100 * fields['mfu']:.1f}%"
        if not self.tokens_per:
            return note
        return (f"{note}, {fields['test_loss'] / math.log(2):.3f} bits/byte, "
                f"{fields['tokens'] / max(fields['wall_s'], 1e-9):.0f} tok/s")

    def output_failed(self, reason: str) -> None:
        """An output file could not be written (or space ran low): leave a checkpoint where
        one can still be written and a readable metrics file (or none), and say so."""
        self.evaluator.close()  # a torch evaluation must not be running as the process exits
        fields = {"updates": self.position, "wall_s": self.elapsed(),
                  **self.engine.summary(), "finished": 0.0, "error": 1.0}
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
        if self.scalars is not None:
            self.scalars.close()
        return "; ".join(notes)

    def _stopped_early(self, by: str) -> None:
        """The one line of a run stopped before its end. Diverged: the newest checkpoint on
        disk is the last good state, so none is written. Stopped by a signal: save now."""
        noun, at = self.noun, self.position
        if self.diverged:
            directory = self.outputs.checkpoint_dir
            last = checkpoint.latest(directory, self.run_id) if directory else None
            where = f"the last good state is {last}" if last else "no checkpoint was written"
            say(f"stopped: the run diverged at {noun} {at} ({self.diverged}); {where}. "
                f"{self.remedy}, or pass --no-stop-on-divergence")
            return
        path = self.checkpointer.save()
        where = (f"checkpoint {path}; continue with --resume {path} (or --resume auto)"
                 if path else "no --checkpoint-dir, so no checkpoint was written")
        say(f"stopped by {by} at {noun} {at}: {where}")

    def _stuck(self, reason: str) -> None:
        """Checkpoint, close the metrics unfinished, say which worker; the caller then ends
        the job (MPI_Abort with the STUCK code)."""
        self.evaluator.close()
        notes = self.cut_short({"updates": self.position, "wall_s": self.elapsed(),
                                "finished": 0.0}, "--resume auto continues")
        say(f"error: {reason}; ending the job at {self.noun} {self.position}; {notes}")
