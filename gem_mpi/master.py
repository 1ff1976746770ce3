"""The master on rank 0: applies worker updates first come, first served, and keeps score.

Its hot path touches each payload element once in the kernel (C++ or numpy, see gem.py)
plus the GEM statistics; everything else is per update, never per element. Evaluation
runs in a background thread on a copy of θ so that the apply loop keeps serving workers.
"""

from __future__ import annotations

import math
import os
import sys
import time

import numpy as np

from gem_mpi import checkpoint, gem
from gem_mpi.config import Config
from gem_mpi.errors import OutputError
from gem_mpi.metrics import MetricsWriter, rows_on_disk
from gem_mpi.monitor import DivergenceWatch, Evaluator, Progress, cut_short, stopped_early
from gem_mpi.problem import Problem, save_final
from gem_mpi.transport import (
    H_COMPUTE_S,
    H_KIND,
    H_LOSS,
    H_RANK,
    H_SEQ,
    H_VERSION,
    KIND_DONE,
    KIND_UPDATE,
    MPI,
    SHUTDOWN_ABORT,
    SHUTDOWN_STOP,
    Backoff,
    Layout,
    MasterEndpoint,
)


def _say(text: str) -> None:
    print(f"gem_mpi: {text}", file=sys.stderr, flush=True)


class _Watchdog:
    """Ends the job when a worker has sent nothing for --worker-timeout seconds.

    A dead worker ends the job through mpirun at once; a stuck one (a hung data loader, a
    lost GPU, a frozen node) would hold it until the time limit. The master checkpoints,
    names the worker, and aborts the job: MPI_Abort, because a stuck rank never takes part
    in the collective window free of a normal shutdown."""

    def __init__(self, master: Master, timeout: float) -> None:
        self.master = master
        self.timeout = timeout
        self.last = np.full(master.n_workers, time.monotonic())
        self.finished = np.zeros(master.n_workers, dtype=bool)
        self._next_check = time.monotonic() + 1.0

    def heard(self, slot: int, finished: bool) -> None:
        self.last[slot] = time.monotonic()
        self.finished[slot] |= finished

    def check(self, clock: int) -> None:
        now = time.monotonic()
        if not self.timeout or now < self._next_check:
            return
        self._next_check = now + 1.0
        silent = np.where(self.finished, 0.0, now - self.last)
        slot = int(np.argmax(silent))
        if silent[slot] > self.timeout:
            self.master.abort_stuck(slot + 1, float(silent[slot]), clock)


class Master:
    def __init__(self, cfg: Config, comm: MPI.Intracomm, layout: Layout, problem: Problem,
                 kernel: gem.Kernel, stop: object = None,
                 resumed: tuple[str, np.ndarray, dict] | None = None) -> None:
        self.cfg = cfg
        self.layout = layout
        self.problem = problem
        self.kernel = kernel
        self.n_workers = layout.n_workers
        self.stop = stop  # truthy once a stop signal arrived (train.StopFlag)
        state = resumed[2] if resumed else {"clock": 0, "tickets": 0, "elapsed_s": 0.0,
                                            "next_seq": np.zeros(self.n_workers, np.int64)}
        self.start_state = state
        self.next_seq = np.array(state["next_seq"], dtype=np.int64)
        theta0 = resumed[1] if resumed else problem.theta0
        self.ep = MasterEndpoint(comm, layout, theta0, version0=state["clock"],
                                 ticket0=state["tickets"])
        self.evaluator = Evaluator(cfg, problem, noun="update")
        self.metrics = None
        self._last_checkpoint = time.monotonic()
        if cfg.metrics:
            rows = None
            if resumed and os.path.exists(cfg.metrics):
                rows = (state["rows_updates"], state["rows_eval"], state["rows_rejected"])
            self.metrics = self.evaluator.metrics = MetricsWriter(
                cfg.metrics, cfg.as_dict(), problem.names, problem.sizes, self.n_workers,
                kernel.name, resume_rows=rows, min_free_bytes=cfg.min_free_bytes,
            )

    def checkpoint(self, clock: int, elapsed: float) -> str | None:
        """Write θ and the run's position; the metrics rows on disk match it exactly."""
        if not self.cfg.checkpoint_dir:
            return None
        rows = rows_on_disk(self.metrics)
        state = {"clock": clock, "tickets": self.ep.tickets(), "next_seq": self.next_seq,
                 "rows_updates": rows[0], "rows_eval": rows[1], "rows_rejected": rows[2],
                 "elapsed_s": elapsed, "config": self.cfg.as_dict(),
                 "n_workers": self.n_workers}
        path = checkpoint.save(self.cfg.checkpoint_dir, self.ep.theta, state)
        self._last_checkpoint = time.monotonic()
        return path

    def run(self) -> dict:
        """Serve until every worker is done or the run stops; the summary of the run."""
        try:
            return self._serve()
        except OutputError as exc:
            return self._output_failed(str(exc))

    def _serve(self) -> dict:
        cfg, ep, P = self.cfg, self.ep, self.problem.n_params
        is_gem = cfg.method == "gem"
        theta = ep.theta
        progress = Progress(cfg.log_every)
        backoff = Backoff(first=20e-6, limit=1e-3)
        clock, done, rejected = self.start_state["clock"], 0, 0
        stopped = False
        diverged: str | None = None
        watch = DivergenceWatch(cfg.divergence_factor)
        watchdog = _Watchdog(self, cfg.worker_timeout)
        rejected_by: dict[int, int] = {}
        timers = dict.fromkeys(("wait", "apply", "metrics", "mpi"), 0.0)
        recent_loss, recent_stale = float("nan"), 0.0
        clock_fn = time.perf_counter
        t0 = clock_fn() - self.start_state["elapsed_s"]  # a resumed run's times continue
        self._t0, self._clock = t0, clock  # where the run is, should an output fail
        every = cfg.checkpoint_every if cfg.checkpoint_dir else 0.0
        try:
            while done < self.n_workers:
                if self.stop or (diverged and cfg.stop_on_divergence):
                    stopped = True
                    break
                if self.metrics is not None and self.metrics.low_space:
                    raise OutputError(self.metrics.low_space)
                watchdog.check(clock)
                if every and time.monotonic() - self._last_checkpoint >= every:
                    self.checkpoint(clock, clock_fn() - t0)
                self.evaluator.drain()
                tm = clock_fn()
                ready = ep.ready()
                timers["mpi"] += clock_fn() - tm
                if ready.size == 0:
                    progress.update(clock, clock / max(clock_fn() - t0, 1e-9),
                                    self._status(recent_loss, recent_stale, done))
                    tw = clock_fn()
                    backoff.wait()
                    timers["wait"] += clock_fn() - tw
                    continue
                backoff.reset()
                # One exclusive lock for every update that is ready: the lock and the slot
                # releases cost as much as a small update, so they are paid per batch.
                ta = clock_fn()
                ep.begin_write()
                applied = []
                for slot in ready:
                    head = ep.headers_i[slot]
                    watchdog.heard(slot, head[H_KIND] == KIND_DONE)
                    if head[H_KIND] == KIND_DONE:
                        done += 1
                        continue
                    if head[H_KIND] != KIND_UPDATE:
                        raise RuntimeError(f"corrupt inbox slot {slot}: kind {head[H_KIND]}")
                    pulled = int(head[H_VERSION])
                    payload = ep.payloads[slot]
                    staleness = clock - pulled
                    tk = clock_fn()
                    if is_gem:
                        stats = self.kernel.gem_step(theta, payload[:P], payload[P:2 * P],
                                                     payload[2 * P:3 * P], cfg.eps, cfg.pi_max)
                        ok = stats is not None
                    else:
                        stats = None
                        ok = self.kernel.fixed_step(
                            theta, payload[:P], gem.fixed_scale(cfg.method, staleness))
                    apply_s = clock_fn() - tk
                    timers["apply"] += apply_s
                    applied.append((slot, ok, clock, staleness, stats, apply_s, tk - t0,
                                    head.copy(), ep.headers_f[slot].copy(), ep.ticket_of(slot)))
                    if ok:
                        clock += 1
                ep.end_write(clock)
                ep.release_all(ready)
                self._clock = clock
                for item in applied:  # before any row is written: a failed write then
                    hi = item[7]      # cannot leave θ and the data positions apart
                    self.next_seq[int(hi[H_RANK]) - 1] = int(hi[H_SEQ]) + 1
                tm = clock_fn()
                timers["mpi"] += tm - ta - sum(item[5] for item in applied)
                for _slot, ok, at_clock, staleness, stats, apply_s, t_rel, hi, hf, ticket in applied:
                    worker, seq = int(hi[H_RANK]), int(hi[H_SEQ])
                    loss = float(hf[H_LOSS])
                    if not ok:
                        rejected += 1
                        self._reject(worker, seq, ticket, t_rel, rejected_by)
                        continue
                    if self.metrics is not None:
                        row = {
                            "time": t_rel, "worker": worker, "seq": seq, "ticket": ticket,
                            "version_pulled": int(hi[H_VERSION]), "clock": at_clock,
                            "staleness": staleness, "loss": loss, "queue": len(ready),
                            "compute_s": float(hf[H_COMPUTE_S]), "apply_s": apply_s,
                        }
                        if stats is not None:
                            row.update(pi_median=stats.pi_median, clamp_frac=stats.clamp_frac,
                                       energy_central=stats.energy_central,
                                       energy_proxy=stats.energy_proxy)
                        self.metrics.add_update(row)
                    recent_loss = loss if math.isnan(recent_loss) else (
                        0.95 * recent_loss + 0.05 * loss)
                    recent_stale = 0.95 * recent_stale + 0.05 * staleness
                    if diverged is None:
                        diverged = watch.check(recent_loss, at_clock, theta)
                    if cfg.eval_every and (at_clock + 1) % cfg.eval_every == 0:
                        self.evaluator.submit(theta, clock, clock_fn() - t0)
                timers["metrics"] += clock_fn() - tm
                progress.update(clock, clock / max(clock_fn() - t0, 1e-9),
                                self._status(recent_loss, recent_stale, done))
            wall = clock_fn() - t0
            progress.close()
            if stopped:
                self.evaluator.close()
                self.evaluator.drain()
                return self._stop(clock, wall, rejected, diverged)
            test_loss, test_acc = self.evaluator.final(theta, clock, clock_fn() - t0)
            final_theta = theta.copy()
        finally:
            progress.close()
        if cfg.save:
            save_final(self.problem.model, final_theta, cfg.save)
        self.checkpoint(clock, wall)  # the end is a checkpoint too
        summary = {"updates": clock, "wall_s": wall, "test_loss": test_loss,
                   "test_accuracy": test_acc, "finished": 1.0, "rejected": rejected,
                   "diverged": 0.0,
                   **{f"master_{k}_s": v for k, v in timers.items()}}
        if self.metrics is not None:
            self.metrics.close(summary)
        acc = "n/a" if math.isnan(test_acc) else f"{100 * test_acc:.2f} %"
        extra = f", {rejected} rejected updates" if rejected else ""
        _say(f"done: {clock} updates in {wall:.1f} s ({clock / max(wall, 1e-9):.1f} upd/s), "
             f"test loss {test_loss:.4f}, test accuracy {acc}{extra}")
        if cfg.verbose:
            _say("master time: " + ", ".join(f"{k} {v:.2f} s" for k, v in timers.items()))
        self.ep.shutdown()
        return summary

    def _stop(self, clock: int, wall: float, rejected: int, diverged: str | None) -> dict:
        """End early: checkpoint (unless diverged), close the metrics unfinished, release
        the workers."""
        summary = {"updates": clock, "wall_s": wall, "rejected": rejected, "finished": 0.0,
                   "diverged": 1.0 if diverged else 0.0}
        stopped_early("update", clock, diverged, self.cfg.checkpoint_dir,
                      lambda: self.checkpoint(clock, wall),
                      f"signal {int(self.stop.signum)}" if self.stop else "a signal",
                      "Lower --lr (or --kappa)")
        if self.metrics is not None:
            self.metrics.close(summary)
        self.ep.shutdown(SHUTDOWN_STOP)
        return summary

    def _output_failed(self, reason: str) -> dict:
        """An output file could not be written (or space ran low): stop every rank with an
        error, leaving a checkpoint where one can still be written and a readable metrics
        file (or none)."""
        clock, wall = self._clock, time.perf_counter() - self._t0
        summary = {"updates": clock, "wall_s": wall, "finished": 0.0, "error": 1.0}
        notes = cut_short(lambda: self.checkpoint(clock, wall), self.metrics, summary,
                          "free space, then --resume auto")
        _say(f"error: stopped at update {clock}: {reason}; {notes}")
        self.ep.shutdown(SHUTDOWN_ABORT)
        return summary

    def abort_stuck(self, worker: int, silent_s: float, clock: int) -> None:
        """Checkpoint, close the metrics unfinished, say which worker, abort the job."""
        wall = time.perf_counter() - self._t0
        notes = cut_short(lambda: self.checkpoint(clock, wall), self.metrics,
                          {"updates": clock, "wall_s": wall, "finished": 0.0},
                          "--resume auto continues")
        _say(f"error: worker {worker} (rank {worker}) has sent nothing for {silent_s:.0f} s "
             f"(--worker-timeout {self.cfg.worker_timeout:g}): it or its node is stuck; "
             f"ending the job at update {clock}; {notes}")
        MPI.COMM_WORLD.Abort(1)

    def _status(self, loss: float, staleness: float, done: int) -> str:
        return f"loss {loss:.4f} staleness {staleness:.1f} workers done {done}/{self.n_workers}"

    def _reject(self, worker: int, seq: int, ticket: int, t: float,
                rejected_by: dict[int, int]) -> None:
        """Count a poisoned update; name its worker the first time and every 100th."""
        count = rejected_by[worker] = rejected_by.get(worker, 0) + 1
        if count == 1 or count % 100 == 0:
            _say(f"rejected update {seq} of worker {worker}: it holds NaN or Inf "
                 f"({count} rejected from this worker so far); θ is unchanged")
        if self.metrics is not None:
            self.metrics.add_rejected({"time": t, "worker": worker, "seq": seq,
                                       "ticket": ticket})
