"""The master on rank 0: applies worker updates first come, first served.

Its serving loop reads as poll → apply the batch → record. The hot path touches each payload
element once, in the kernel (C++ or numpy, see algorithm/kernel.py), plus the GEM
statistics; everything else is per update, never per element. The run supervisor does the
rest (metrics, evaluation in a background thread, checkpoints, the stop checks, the end).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from gem_mpi.algorithm.kernel import GemStats, Kernel
from gem_mpi.algorithm.rule import MasterRule
from gem_mpi.config import GEM, PROXY_GLOBAL, Config
from gem_mpi.problem import Problem
from gem_mpi.protocol import (
    ABORTED,
    DIVERGED,
    DONE,
    FINISHED,
    OUTPUT_FAILED,
    STOPPED,
    WORKER_TIME_COLUMNS,
    Layout,
)
from gem_mpi.run.rank import Placement, RankPlace, placement_line
from gem_mpi.run.supervisor import EXIT_CODES, Outcome, RunSupervisor, StopFlag, Verdict, say
from gem_mpi.transport import MPI
from gem_mpi.transport.endpoints import MasterEndpoint

# the stop word each outcome sends the workers (they exit with the code it maps back to)
SHUTDOWN = {Outcome.FINISHED: FINISHED, Outcome.STOPPED: STOPPED, Outcome.DIVERGED: DIVERGED,
            Outcome.OUTPUT_FAILED: OUTPUT_FAILED}
OUTCOME_OF = {word: outcome for outcome, word in SHUTDOWN.items()}  # a worker's view


@dataclass
class Applied:
    """One update of a batch, as the metrics record it."""

    worker: int
    seq: int
    ticket: int
    version_pulled: int
    loss: float
    compute_s: float
    ok: bool  # False: rejected (NaN or Inf), θ untouched
    clock: int  # θ's version before it
    staleness: int
    apply_s: float
    time: float  # seconds since the run started
    stats: GemStats | None


class Master:
    """The central variable θ and the run's position: the asynchronous methods' engine."""

    noun = "update"

    def __init__(self, cfg: Config, comm: MPI.Intracomm, layout: Layout, problem: Problem,
                 kernel: Kernel, stop: StopFlag | None = None, resumed: dict | None = None,
                 eval_threads: int | None = None, run_id: str | None = None) -> None:
        self.n_workers = layout.n_workers
        self.clock = 0
        self.next_seq = np.zeros(self.n_workers, np.int64)
        # a resumed θ, its version and the ticket count go to the windows as they open (a
        # worker pulls at once); load_state restores the rest
        self.ep = MasterEndpoint(comm, layout, resumed["theta"] if resumed else problem.theta0,
                                 version0=resumed["clock"] if resumed else 0,
                                 ticket0=resumed["tickets"] if resumed else 0,
                                 zero=kernel.zero)  # θ and the mailboxes: first touch
        self.rule = MasterRule(cfg.optim, kernel, problem.n_params, self.n_workers)
        self.verbose = cfg.monitor.verbose
        self.eval_split = cfg.data.eval_split  # what the end line calls the evaluation
        self.exit_timeout = cfg.monitor.exit_timeout
        self.done = 0  # workers whose budget is used up
        self.rejected: dict[int, int] = {}  # per worker
        self.timers = dict.fromkeys(("wait", "apply", "metrics", "mpi"), 0.0)
        self.worker_time = np.full((self.n_workers, len(WORKER_TIME_COLUMNS)), np.nan)
        self.recent_staleness = 0.0
        self.final_theta: np.ndarray | None = None  # θ once the run ended (rank 0's result)
        self.sup = RunSupervisor(cfg, problem, self.n_workers, self, kernel.name,
                                 stop if stop is not None else StopFlag(), resumed,
                                 eval_threads=eval_threads, run_id=run_id)
        self.clock0 = self.clock  # where this run (or this resume of it) started

    # --- the engine, as the supervisor drives it --------------------------------------------
    @property
    def position(self) -> int:
        return self.clock

    def theta(self) -> np.ndarray:
        return self.ep.theta

    def state(self) -> dict:
        return {"theta": self.ep.theta, "clock": self.clock,
                "tickets": self.ep.tickets_drawn(), "next_seq": self.next_seq,
                "kept_s": self.rule.kept(self.ep.payloads), "proxy_m": self.rule.proxy_m}

    def load_state(self, state: dict) -> None:
        self.clock = int(state["clock"])
        self.next_seq = np.array(state["next_seq"], dtype=np.int64)
        kept = self.rule.kept(self.ep.payloads)
        if kept is not None and state.get("kept_s") is not None:
            kept[...] = state["kept_s"]  # before any message is taken
        proxy_m = self.rule.proxy_m
        if proxy_m is not None:  # the global proxy's m (session checked the checkpoint has it)
            proxy_m[...] = state["proxy_m"]

    def run(self) -> Outcome:
        """Serve until every worker is done or the run ends otherwise; tell the workers, and
        end the job within --exit-timeout seconds whatever they do."""
        outcome = self.sup.run()
        if outcome is Outcome.STUCK:  # checkpointed and said: a stuck rank would never
            MPI.COMM_WORLD.Abort(EXIT_CODES[outcome])  # take part in freeing the windows
            return outcome
        if outcome is Outcome.FINISHED and self.clock == self.clock0 and self.rejected:
            say(f"error: every update of this run was rejected ({sum(self.rejected.values())} "
                "held NaN or Inf): θ never moved. Lower --lr (or --kappa), or look at the "
                "data")
            outcome = Outcome.FAILED
        self.final_theta = self.ep.theta.copy()  # θ's window is freed at the shutdown
        missing = self.ep.shutdown(SHUTDOWN.get(outcome, ABORTED), self.exit_timeout)
        if missing:
            code = EXIT_CODES[outcome]
            say(f"error: worker(s) {', '.join(map(str, missing))} did not leave within "
                f"--exit-timeout {self.exit_timeout:g} s after the run ended ({outcome.value}, "
                f"its files complete): stuck; ending the job with exit code {code}")
            MPI.COMM_WORLD.Abort(code)
        return outcome

    def loop(self) -> Verdict:
        backoff = self.ep.idle_backoff()  # makes MPI progress too
        clock_fn = time.perf_counter
        while self.done < self.n_workers:
            verdict = self.sup.between_batches()
            if verdict is not None:
                return verdict
            t = clock_fn()
            ready = self.ep.ready()
            if ready.size == 0:  # idle: the empty poll and the back-off sleep
                self.sup.show(self._status())
                backoff.wait()
                self.timers["wait"] += clock_fn() - t
                continue
            self.timers["mpi"] += clock_fn() - t
            backoff.reset()
            batch = self._apply(ready)
            t = clock_fn()
            self._record(batch, len(ready))
            self.timers["metrics"] += clock_fn() - t
            self.sup.show(self._status())
        return Verdict(Outcome.FINISHED)

    def _apply(self, ready: np.ndarray) -> list[Applied]:
        """Apply every ready update under one exclusive lock: the lock and the slot releases
        cost as much as a small update, so they are paid per batch."""
        clock_fn = time.perf_counter
        t_batch = clock_fn()
        sup = self.sup
        apply_total = 0.0
        self.ep.begin_write()
        batch = []
        for slot in ready:
            msg = self.ep.take(int(slot))
            sup.heard(msg.rank, msg.kind == DONE)
            if msg.kind == DONE:  # it carries the worker's time split
                self.worker_time[msg.rank - 1] = msg.payload[:len(WORKER_TIME_COLUMNS)]
                self.done += 1
                continue
            staleness = self.clock - msg.version
            t = clock_fn()
            ok, stats = self.rule.apply(self.ep.theta, msg.payload, staleness)
            apply_s = clock_fn() - t
            apply_total += apply_s
            self.ep.progress.once()  # workers' RMA on rank 0 moves on between updates
            batch.append(Applied(msg.rank, msg.seq, msg.ticket, msg.version, msg.loss,
                                 msg.compute_s, ok, self.clock, staleness, apply_s,
                                 sup.since_start(t), stats))
            if ok:
                self.clock += 1
        self.ep.end_write(self.clock)
        self.ep.release(ready)
        # the data positions move with θ, before any row is written: a failed write then
        # cannot leave them apart
        for u in batch:
            self.next_seq[u.worker - 1] = u.seq + 1
        self.timers["apply"] += apply_total
        self.timers["mpi"] += clock_fn() - t_batch - apply_total
        return batch

    def _record(self, batch: list[Applied], queue: int) -> None:
        sup, theta = self.sup, self.ep.theta
        for u in batch:
            if not u.ok:
                self._reject(u)
                continue
            if sup.recording:
                row = {"time": u.time, "worker": u.worker, "seq": u.seq, "ticket": u.ticket,
                       "version_pulled": u.version_pulled, "clock": u.clock,
                       "staleness": u.staleness, "loss": u.loss, "queue": queue,
                       "compute_s": u.compute_s, "apply_s": u.apply_s}
                if u.stats is not None:
                    s = u.stats
                    row.update(pi_median=s.pi_median, clamp_frac=s.clamp_frac,
                               clamp_low=s.clamp_low_frac, zero_delta=s.zero_delta_frac,
                               pi_median_all=s.pi_median_all,
                               energy_central=s.energy_central, energy_proxy=s.energy_proxy)
                sup.record_update(row)
            self.recent_staleness = 0.95 * self.recent_staleness + 0.05 * u.staleness
            sup.observe(u.loss, u.clock, theta)
            if sup.eval_due(u.clock):
                sup.evaluate(theta, self.clock)

    def _reject(self, u: Applied) -> None:
        """Count a poisoned update; name its worker the first time and every 100th."""
        count = self.rejected[u.worker] = self.rejected.get(u.worker, 0) + 1
        if count == 1 or count % 100 == 0:
            say(f"rejected update {u.seq} of worker {u.worker}: it holds NaN or Inf "
                f"({count} rejected from this worker so far); θ is unchanged")
        self.sup.record_rejected({"time": u.time, "worker": u.worker, "seq": u.seq,
                                  "ticket": u.ticket})

    def _status(self) -> str:
        return (f"loss {self.sup.recent_loss:.4f} staleness {self.recent_staleness:.1f} "
                f"workers done {self.done}/{self.n_workers}")

    def summary(self) -> dict:
        return {"rejected": sum(self.rejected.values()), "worker_time": self.worker_time,
                **{f"master_{k}_s": v for k, v in self.timers.items()}}

    def done_line(self, s: dict) -> str:
        acc = "n/a" if np.isnan(s["test_accuracy"]) else f"{100 * s['test_accuracy']:.2f} %"
        rejected = f", {s['rejected']} rejected updates" if s["rejected"] else ""
        if self.verbose:
            say("master time: " + ", ".join(f"{k} {v:.2f} s" for k, v in self.timers.items()))
        return (f"done: {s['updates']} updates in {s['wall_s']:.1f} s "
                f"({s['updates'] / max(s['wall_s'], 1e-9):.1f} upd/s), {self.eval_split} loss "
                f"{s['test_loss']:.4f}, {self.eval_split} accuracy {acc}{rejected}")


def start_master(cfg: Config, comm: MPI.Intracomm, layout: Layout, problem: Problem,
                 stop: StopFlag, resumed: dict | None, placement: Placement,
                 run_id: str, ranks: list[RankPlace] | None = None) -> Master:
    """Rank 0's part of an asynchronous run, set up: its kernel and the kernel's threads,
    the evaluation's threads, and the start-up line (and, given every rank's ``ranks``
    from :func:`gem_mpi.run.rank.gather_placement`, the placement line)."""
    from gem_mpi.algorithm.kernel import kernel_threads, node_cores_left

    # the kernel's threads (GEM_NUM_THREADS, else the cores the other ranks on the node leave)
    kernel = Kernel(problem.offsets, prefer_extension=not cfg.runtime.no_extension,
                    threads=kernel_threads(placement.local_size))
    say(f"{cfg.method} on {cfg.data.model}/{cfg.data.dataset}: 1 master + "
        f"{layout.n_workers} workers, {problem.n_params} parameters, master kernel: "
        f"{kernel.name}"
        + (f"; resuming {resumed['path']} at update {resumed['clock']}"
           + _changes_note(resumed) + _momentum_note(cfg, resumed) if resumed else ""))
    # the evaluation's torch threads: the same cores. The evaluation runs in a background
    # thread every --eval-every updates and time-shares them with the kernel; the kernel's
    # pool sleeps between updates, so a master waiting for updates leaves them all to it.
    eval_threads = node_cores_left(placement.local_size)
    if ranks is not None:
        say(placement_line(ranks, kernel.threads, eval_threads))
    return Master(cfg, comm, layout, problem, kernel, stop, resumed, eval_threads,
                  run_id=run_id)


def _changes_note(state: dict) -> str:
    """The settings this resume changes, for the start-up line (the metrics file keeps them)."""
    return "".join(f", --{k.replace('_', '-')} {a!r} -> {b!r}"
                   for k, (a, b) in state["changes"].items())


def _momentum_note(cfg: Config, state: dict) -> str:
    """How many GEM workers will find the momentum they saved when the run was stopped."""
    if cfg.method != GEM:
        return ""
    if cfg.optim.gem_proxy == PROXY_GLOBAL:
        return ", the global proxy's m restored from the checkpoint"
    from gem_mpi.outputs import checkpoint

    directory, seqs = cfg.outputs.checkpoint_dir, state["next_seq"]
    found = sum(
        checkpoint.load_worker_momentum(directory, w + 1, int(seqs[w]), state["run_id"])
        is not None for w in range(len(seqs)) if seqs[w] > 0
    ) if directory else 0
    return f", worker momentum restored for {found} of {len(seqs)} workers (the rest start at 0)"
