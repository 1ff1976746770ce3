"""The master on rank 0: applies worker updates first come, first served.

Its serving loop reads as poll → apply the batch → record. The hot path touches each payload
element once, in the kernel (C++ or numpy, see algorithm/kernel.py), plus the GEM
statistics; everything else is per update, never per element. The run supervisor does the
rest (metrics, evaluation in a background thread, checkpoints, the stop checks, the end).
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from gem_mpi import methods
from gem_mpi.algorithm.dylu import Paces
from gem_mpi.algorithm.kernel import GapStats, GemStats, Kernel, kernel_threads, node_cores_left
from gem_mpi.algorithm.rule import MasterRule
from gem_mpi.config import LOSS_CONTINUE, NICE_AUTO, OPT_ADAMW, OVERLAP, Config
from gem_mpi.engine.roster import Dealer, Roster
from gem_mpi.engine.shards import Lead, Plan
from gem_mpi.errors import OutputError
from gem_mpi.methods import RULE_GEM
from gem_mpi.outputs import checkpoint
from gem_mpi.problem import Problem, elastic
from gem_mpi.protocol import (
    ABORTED,
    DONE,
    UPDATE,
    WORKER_TIME_COLUMNS,
    At,
    Bye,
    Cut,
    Deal,
    End,
    Gather,
    Go,
    Hold,
    Layout,
    Piece,
    ShardState,
    State,
    update_payload,
)
from gem_mpi.run.departures import Departures
from gem_mpi.run.profiler import StepProfiler
from gem_mpi.run.rank import Placement, RankPlace, placement_line, plans_now, worker_nice
from gem_mpi.run.supervisor import (
    EXIT_CODES,
    SHUTDOWN,
    Outcome,
    Supervisor,
    Verdict,
    say,
)
from gem_mpi.transport import MPI, Backoff
from gem_mpi.transport.endpoints import MasterEndpoint
from gem_mpi.transport.idioms import Orders
from gem_mpi.transport.link import MessageLink

# where faulthandler's watchdog writes when it ends a rank hung in the windows' free: nowhere
# (a traceback per thread would bury the run's one line), open for the process's life
_DEVNULL = open(os.devnull, "w")  # noqa: SIM115


@dataclass
class Applied:
    """One update of a batch, as the metrics record it."""

    worker: int
    seq: int
    ticket: int
    version_pulled: int
    loss: float
    compute_s: float
    steps: int  # its local steps (--local-steps; --dylu varies them)
    ok: bool  # False: rejected (NaN or Inf), θ untouched
    clock: int  # θ's version before it
    staleness: int
    apply_s: float
    time: float  # seconds since the run started
    stats: GemStats | GapStats | None


@dataclass(frozen=True)
class Role:
    """This master's place among --masters K > 1: its shard, the cut, the lead's link."""

    shard: int
    plan: Plan
    link: MessageLink


class Master:
    """The central variable θ and the run's position: the asynchronous methods' engine."""

    noun = "update"
    DRAIN_S = 2e-3  # sharded: rank 0 reads the other masters' messages at most this often
    # an idle master's checks between batches (stop, watchdog, checkpoint, evaluations,
    # progress line) at most this often: each wake-up after a sleep runs on cold caches, and
    # the checks on every one took an eighth of rank 0's CPU (4 workers on 2 cores)
    CHECK_S = 1e-3
    # the supervisor, given by attach() before run(); not Optional, so that the serving
    # loop reads it without a check
    sup: Supervisor

    def __init__(self, cfg: Config, comm: MPI.Intracomm, layout: Layout, problem: Problem,
                 kernel: Kernel, resumed: checkpoint.Checkpoint | None = None,
                 eval_threads: int | None = None, role: Role | None = None,
                 endpoint: Callable[..., MasterEndpoint] = MasterEndpoint) -> None:
        """``role``: with --masters K > 1, this master's shard (``resumed`` then holds this
        shard's θ, clock, tickets and kept s, the rest as the checkpoint has it). θ, its
        version and the tickets of ``resumed`` go to the windows; the supervisor given to
        :meth:`attach` restores the rest (:meth:`load_state`). ``endpoint``: what opens
        rank 0's windows (the tests' in-memory one runs this engine in one process)."""
        self.n_workers = layout.n_workers
        self.clock = 0
        self.next_seq = np.zeros(self.n_workers, np.int64)
        self.role = role
        lo, hi = role.plan.bounds[role.shard] if role else (0, problem.n_params)
        self.tensors = role.plan.tensors[role.shard] if role else (0, len(problem.sizes))
        self.n_tensors = len(problem.sizes)
        # a resumed θ, its version and the ticket count go to the windows as they open (a
        # worker pulls at once); load_state restores the rest
        if resumed:
            theta0 = resumed.theta
        else:
            assert problem.theta0 is not None, "a fresh run starts from the problem's θ₀"
            theta0 = problem.theta0[lo:hi]
        self.ep = endpoint(comm, layout, theta0,
                                 version0=resumed.clock if resumed else 0,
                                 ticket0=resumed.tickets if resumed else 0,
                                 zero=kernel.zero)  # θ and the mailboxes: first touch
        self.rule = MasterRule(cfg.optim, kernel, hi - lo, self.n_workers, cfg.gap_aware,
                               cfg.dn)
        self.verbose = cfg.monitor.verbose
        self.eval_split = cfg.data.eval_split  # what the end line calls the evaluation
        self.exit_timeout = cfg.monitor.exit_timeout
        self.roster = Roster(self.n_workers)  # who is done, who left
        # --dylu: each worker's seconds per local step, the fastest published with θ
        self.paces = Paces(self.n_workers) if cfg.optim.dylu else None
        self.ep.tolerant = cfg.runtime.worker_loss == LOSS_CONTINUE
        self._lost: set[int] = set()  # workers whose death was handled (--worker-loss)
        self.dealer: Dealer | None = None  # rank 0: a departed worker's batches (attach)
        self.departures: Departures | None = None  # rank 0: who left, the plans (attach)
        self.cfg = cfg
        self.rejected: dict[int, int] = {}  # per worker
        self.timers = dict.fromkeys(("wait", "apply", "metrics", "mpi"), 0.0)
        self.cpu_s = 0.0  # the process's CPU seconds while serving (loop)
        self.worker_time = np.full((self.n_workers, len(WORKER_TIME_COLUMNS)), np.nan)
        self.recent_staleness = 0.0
        self.final_theta: np.ndarray | None = None  # θ once the run ended (rank 0's result)
        self.kernel_name = kernel.name
        self.eval_threads = eval_threads  # the evaluation's torch threads (the lead's)
        self.lead: Lead | None = None  # rank 0 of a sharded run: its side of the followers
        self.clock0 = 0  # where this run (or this resume of it) started
        # --profile-steps: the serving loop's batches are its steps
        self.profiler = StepProfiler(cfg.outputs)

    def attach(self, sup: Supervisor, lead: Lead | None = None) -> None:
        """The supervisor this master reports to and asks between batches: the run's (rank
        0) or a follower's (another shard's master); ``lead``: rank 0's side of the
        followers. The supervisor has restored a resumed state by now."""
        self.sup, self.lead = sup, lead
        self.clock0 = self.clock
        self.departures = sup.departures  # the run's elastic state: rank 0's alone
        if self.departures is not None:
            self.dealer = Dealer(self.roster, self._plans, self._give, Orders.RUNS)

    def _plans(self) -> list[elastic.Plan]:
        """The workers' plans now: as the checkpoint resumed dealt them, else each its own."""
        assert self.departures is not None, "rank 0's dealer asks"
        return plans_now(self.cfg, self.n_workers, self.departures.data_plan)

    def _give(self, worker: int, runs: elastic.Plan, length: int) -> None:
        """Deal ``runs`` to ``worker``: the followers learn it first (they must not count
        the worker done), then the worker's order; the watchdog waits for it again."""
        assert self.departures is not None, "rank 0's dealer gives"
        if self.lead is not None:
            self.lead.send_all(Deal(worker, length))
        self.ep.give(worker, runs)
        self.sup.heard(worker)
        self.departures.expect(worker)

    def idle_backoff(self, first: float = 20e-6, limit: float = 5e-3) -> Backoff:
        return self.ep.idle_backoff(first, limit)

    # --- the engine, as the supervisor drives it --------------------------------------------
    @property
    def position(self) -> int:
        return self.clock

    def theta(self) -> np.ndarray:
        """θ; sharded, gathered from every shard (each as it is when it answers: no cut)."""
        if self.lead is None:
            return self.ep.theta
        if self._all_done():
            pieces = [s.theta for s in self.lead.final_states()]
        else:
            self.lead.send_all(Gather())
            pieces = [p.theta for p in self.lead.collect(Piece)]
        return np.concatenate([self.ep.theta, *pieces])

    def _over(self) -> bool:
        """Every worker done or gone, nothing left to deal (a follower: as far as it knows)."""
        if self.dealer is None:
            return self.roster.all_finished()
        return self.dealer.over()

    def _all_done(self) -> bool:
        return (self._over() and self.lead is not None
                and self.lead.all_final(self.roster.deals))

    def shard_state(self, copy: bool = True) -> ShardState:
        """This master's part of a checkpoint (``copy``: the shard goes on after it)."""
        kept, proxy_m = self.rule.kept(self.ep.payloads), self.rule.proxy_m
        if not copy:
            return ShardState(self.ep.theta, self.clock, self.ep.tickets_drawn(),
                              self.next_seq, kept, proxy_m)
        return ShardState(self.ep.theta.copy(), self.clock, self.ep.tickets_drawn(),
                          self.next_seq.copy(), None if kept is None else kept.copy(),
                          None if proxy_m is None else proxy_m.copy())

    def state(self) -> dict:
        """The engine's fields of a checkpoint (θ, clock, tickets, next_seq, s, m; sharded,
        every shard's at one cut, with each shard's clock and tickets)."""
        if self.lead is None:  # no copies (asdict would deep-copy θ and every kept s)
            own = self.shard_state(copy=False)
            return {f.name: getattr(own, f.name) for f in dataclasses.fields(own)}
        others = self._cut()  # catches this shard up to the cut too
        return ShardState.join([self.shard_state(), *others])

    def _cut(self) -> list[ShardState]:
        """The followers' parts at one consistent cut: every shard holds exactly the same
        updates (see gem_mpi.engine.shards). Raises OutputError when a shard cannot reach it
        within --exit-timeout (a worker died or hangs between two of its posts)."""
        lead = self.lead
        assert lead is not None, "sharded only"
        if self._all_done():
            return lead.final_states()
        lead.send_all(Hold())
        target = np.max([self.next_seq, *[a.next_seq for a in lead.collect(At)]], axis=0)
        reached = self.catch_up(target, self.exit_timeout)
        lead.send_all(Cut(target))
        states = [s.state for s in lead.collect(State)]
        lead.send_all(Go())
        if not reached or any(st is None for st in states):
            raise OutputError(f"checkpoint at update {self.clock}: the {lead.masters} shards "
                              f"did not reach one consistent cut within --exit-timeout "
                              f"{self.exit_timeout:g} s (a worker stopped between its posts "
                              "to two shards); the previous checkpoint is kept")
        return states

    def catch_up(self, target: np.ndarray, timeout_s: float) -> bool:
        """Apply, from the mailboxes, only updates below ``target`` (each worker's next
        update number) until this shard is there; False if not within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        backoff = self.ep.idle_backoff()
        while (self.next_seq < target).any():
            if time.monotonic() > deadline:
                return False
            ready = self.ep.ready()
            batch = self._apply(ready, limit=target) if ready.size else []
            if batch:
                backoff.reset()
                self._record(batch, len(ready))
            else:
                backoff.wait()
        return True

    def load_state(self, ckpt: checkpoint.Checkpoint) -> None:
        """Continue from a checkpoint (sharded: this shard's part of it, with its own clock,
        s and slice of the global proxy's m)."""
        self.clock = int(ckpt.clock)
        self.next_seq = np.array(ckpt.next_seq, dtype=np.int64)
        kept = self.rule.kept(self.ep.payloads)
        if kept is not None and ckpt.kept_s is not None:
            # before any message is taken; only the rows of workers with updates applied: a
            # worker starting at 0 (new on a resume of more workers) sends its s with its
            # first update, which may have landed in its slot already
            started = self.next_seq > 0
            kept[started] = ckpt.kept_s[started]
        proxy_m = self.rule.proxy_m
        if proxy_m is not None:  # the global proxy's m or Gap-Aware's v (session checked it)
            proxy_m[...] = ckpt.proxy_m

    def run(self) -> Outcome:
        """Serve until every worker is done or the run ends otherwise; tell the workers, and
        end the job within --exit-timeout seconds whatever they do."""
        if self.role is not None and self.role.shard > 0:
            return self._run_follower()
        with self.profiler:
            outcome = self.sup.run()
        if outcome is Outcome.STUCK:  # checkpointed and said: a stuck rank would never
            MPI.COMM_WORLD.Abort(EXIT_CODES[outcome])  # take part in freeing the windows
            return outcome
        if outcome is Outcome.FINISHED and self.clock == self.clock0 and self.rejected:
            say(f"error: every update of this run was rejected ({sum(self.rejected.values())} "
                "held NaN or Inf): θ never moved. Lower --lr (or --kappa), or look at the "
                "data")
            outcome = Outcome.FAILED
        self.final_theta = self.theta().copy()  # θ's window is freed at the shutdown
        if self.lead is not None:  # the followers end with the same word, once said
            self.lead.send_all(End(SHUTDOWN.get(outcome, ABORTED)))
            self.lead.collect(Bye)
        with self._bounded_free():
            missing = self.ep.shutdown(SHUTDOWN.get(outcome, ABORTED), self.exit_timeout)
        if missing:
            code = EXIT_CODES[outcome]
            say(f"error: worker(s) {', '.join(map(str, missing))} did not leave within "
                f"--exit-timeout {self.exit_timeout:g} s after the run ended ({outcome.value}, "
                f"its files complete): stuck; ending the job with exit code {code}")
            MPI.COMM_WORLD.Abort(code)
        return outcome

    @contextlib.contextmanager
    def _bounded_free(self) -> Iterator[None]:
        """The shutdown's wait is bounded by --exit-timeout, but the windows' free after it is
        collective: a worker that hangs between its goodbye and the free (a SIGSTOP, a
        debugger) would hold rank 0 there forever, inside MPI with the GIL held, where no
        Python timer runs. faulthandler's watchdog is a C thread: past twice the timeout it
        ends rank 0 (exit 1), and mpirun the job; the run's files are complete by then."""
        faulthandler.dump_traceback_later(2 * self.exit_timeout, exit=True, file=_DEVNULL)
        try:
            yield
        finally:
            faulthandler.cancel_dump_traceback_later()

    def _run_follower(self) -> Outcome:
        """A follower's run: its loop, then the lead's word, then the shutdown of its shard."""
        assert self.role is not None, "a follower has its shard"
        with self.profiler:
            outcome = self.sup.run()  # its rows all sent, and its goodbye said
        with self._bounded_free():
            missing = self.ep.shutdown(SHUTDOWN.get(outcome, ABORTED), self.exit_timeout)
        if missing:
            say(f"error: worker(s) {', '.join(map(str, missing))} did not leave shard "
                f"{self.role.shard} within --exit-timeout {self.exit_timeout:g} s: stuck; "
                f"ending the job")
            MPI.COMM_WORLD.Abort(EXIT_CODES[outcome])
        return outcome

    def loop(self) -> Verdict:
        """Serve; the process's CPU time over the loop (every thread: the kernel's, the
        evaluation's) is kept in ``cpu_s``: on a machine the workers share, it is what the
        master takes from them, which its wall-time split cannot tell."""
        cpu0 = time.process_time()
        try:
            return self._serve()
        finally:
            self.cpu_s += time.process_time() - cpu0

    def _serve(self) -> Verdict:
        backoff = self.ep.idle_backoff()  # makes MPI progress too
        clock_fn = time.perf_counter
        next_drain = next_check = 0.0
        while not self._over():
            if self.dealer is not None and self.roster.all_finished():  # all gone, a rest
                return Verdict(Outcome.STOPPED, f"the departure of every worker, with "
                               f"{self.dealer.rest()} batches of the run not trained,")
            if self.lead is not None and clock_fn() >= next_drain:  # the followers' rows
                t = clock_fn()  # and words; at most every DRAIN_S: an Iprobe that finds
                self.lead.drain()  # nothing may yield the core (oversubscribed Open MPI)
                next_drain = clock_fn() + self.DRAIN_S
                self.timers["mpi"] += next_drain - self.DRAIN_S - t
            t = clock_fn()
            if t >= next_check:  # after every batch, and at most every CHECK_S when idle
                if self.ep.tolerant and len(self.ep.lost()) > len(self._lost):
                    self._losses()
                verdict = self.sup.between_batches()
                if verdict is not None:
                    return verdict
                self.sup.show(self._status)
                next_check = t + self.CHECK_S
                t = clock_fn()
            ready = self.ep.ready()
            if ready.size == 0:  # idle: the empty poll and the back-off sleep
                backoff.wait()
                self.timers["wait"] += clock_fn() - t
                continue
            self.timers["mpi"] += clock_fn() - t
            backoff.reset()
            with self.profiler.range("gem_mpi.apply"):
                batch = self._apply(ready)
            t = clock_fn()
            with self.profiler.range("gem_mpi.record"):
                self._record(batch, len(ready))
            self.timers["metrics"] += clock_fn() - t
            self.profiler.tick()
            next_check = 0.0
        if self.lead is not None:  # the run's θ is final once every shard applied all
            t = clock_fn()
            self.lead.wait_finals(self.roster.deals)
            self.timers["wait"] += clock_fn() - t
        return Verdict(Outcome.FINISHED)

    def _apply(self, ready: np.ndarray, limit: np.ndarray | None = None) -> list[Applied]:
        """Apply every ready update in one write of θ: the seqlock's words and the slot
        releases cost as much as a small update, so they are paid per batch. ``limit``
        (a checkpoint's cut): only updates below each worker's limit, the rest left waiting."""
        if limit is not None:
            ready = np.array([s for s in ready if self._below(int(s), limit)], np.int64)
            if ready.size == 0:
                return []
        clock_fn = time.perf_counter
        t_batch = clock_fn()
        sup = self.sup
        apply_total = 0.0
        self.ep.begin_write()
        batch = []
        signed = []  # DONE and LEFT: handled once the batch is applied and released
        for i, slot in enumerate(ready):
            if i:  # workers' RMA on rank 0 moves on between updates
                self.ep.progress.once()
            msg = self.ep.take(int(slot))
            sup.heard(msg.rank, msg.kind != UPDATE)
            if msg.kind != UPDATE:  # DONE or LEFT: it carries the worker's time split
                self.worker_time[msg.rank - 1] = msg.payload[:len(WORKER_TIME_COLUMNS)]
                signed.append((msg.kind, msg.rank, msg.seq))
                continue
            staleness = self.clock - msg.version
            t = clock_fn()
            with self.profiler.range("gem_mpi.kernel"):
                ok, stats = self.rule.apply(self.ep.theta, msg.payload, staleness, self.clock)
            apply_s = clock_fn() - t
            apply_total += apply_s
            batch.append(Applied(msg.rank, msg.seq, msg.ticket, msg.version, msg.loss,
                                 msg.compute_s, msg.steps, ok, self.clock, staleness, apply_s,
                                 sup.since_start(t), stats))
            if self.paces is not None:  # its seconds per local step, whether applied or not
                self.paces.observe(msg.rank, msg.compute_s, msg.steps)
            if ok:
                self.clock += 1
        # --dylu: the fastest worker's seconds per local step, read with θ by every pull
        self.ep.end_write(self.clock, 0.0 if self.paces is None else self.paces.fastest)
        # and after the write, not inside it: an entry that finds nothing to do may yield
        # the core (oversubscribed Open MPI), and every pull waits while θ is being written
        self.ep.progress.once()
        self.ep.release(ready)
        # the data positions move with θ, before any row is written: a failed write then
        # cannot leave them apart
        for u in batch:
            self.next_seq[u.worker - 1] = u.seq + 1
        for kind, worker, seq in signed:
            self._signed_off(kind, worker, seq)
        self.timers["apply"] += apply_total
        self.timers["mpi"] += clock_fn() - t_batch - apply_total
        return batch

    def _losses(self) -> None:
        """Workers whose process died (--worker-loss continue, ULFM): each leaves the run
        at its updates applied, once no whole message of it waits in its slot (that one is
        applied first); a half-written one is never ready, so never taken."""
        waiting = {int(slot) + 1 for slot in self.ep.ready()}
        for worker in sorted(self.ep.lost() - self._lost):
            if worker in waiting or not 1 <= worker <= self.n_workers:
                continue
            self._lost.add(worker)
            self.ep.theta_window.forget_readers()
            self.sup.heard(worker, True)
            if self.roster.left[worker - 1]:  # it had signed off LEFT already
                continue
            seq = int(self.next_seq[worker - 1])
            dealer, departures = self.dealer, self.departures
            assert dealer is not None and departures is not None, "rank 0's alone"
            rest = dealer.leave(worker, seq)
            departures.departed(worker, seq, self.clock, rest, dealer.data_plan(), lost=True)
            given = dealer.deal()
            if given:
                departures.replan(dealer.data_plan(), given)

    def _signed_off(self, kind: int, worker: int, seq: int) -> None:
        """A worker's DONE or LEFT (``seq``: its updates, all applied by now). Rank 0 deals
        a departed worker's batches to the workers waiting, and records the departure."""
        if seq != self.next_seq[worker - 1]:
            raise RuntimeError(f"worker {worker} signed off after {seq} updates, "
                               f"{self.next_seq[worker - 1]} of them applied")
        dealer = self.dealer
        if dealer is None:  # a follower: the lead deals, and tells it (Deal)
            if kind == DONE:
                self.roster.done(worker, seq)
            else:
                self.roster.leave(worker)
            return
        departures = self.departures
        assert departures is not None, "made with the dealer (attach)"
        if kind == DONE:
            dealer.done(worker, seq)
        else:
            rest = dealer.leave(worker, seq)
            departures.departed(worker, seq, self.clock, rest, dealer.data_plan())
        given = dealer.deal()
        if given:
            departures.replan(dealer.data_plan(), given)

    def _below(self, slot: int, limit: np.ndarray) -> bool:
        msg = self.ep.take(slot)
        return msg.kind == UPDATE and msg.seq < limit[msg.rank - 1]

    def _full(self, per_tensor: np.ndarray) -> np.ndarray:
        """A shard's per-tensor statistic in the metrics' columns of every tensor (NaN for
        the tensors of the other shards)."""
        if self.role is None:
            return per_tensor
        out = np.full(self.n_tensors, np.nan, np.float32)
        out[self.tensors[0]:self.tensors[1]] = per_tensor
        return out

    def _record(self, batch: list[Applied], queue: int) -> None:
        sup, theta = self.sup, self.ep.theta
        for u in batch:
            if not u.ok:
                self._reject(u)
                continue
            if sup.recording:
                row: dict[str, float | np.ndarray] = {  # numbers, and per-tensor columns
                    "time": u.time, "worker": u.worker, "seq": u.seq, "ticket": u.ticket,
                    "version_pulled": u.version_pulled, "clock": u.clock,
                    "staleness": u.staleness, "loss": u.loss, "queue": queue,
                    "compute_s": u.compute_s, "apply_s": u.apply_s}
                if self.cfg.optim.local_steps > 1:
                    row["steps"] = u.steps
                if isinstance(u.stats, GapStats):
                    row["ga_scale_mean"] = u.stats.scale_mean
                elif u.stats is not None:
                    s = u.stats
                    full = self._full
                    row.update(pi_median=full(s.pi_median), clamp_frac=full(s.clamp_frac),
                               clamp_low=full(s.clamp_low_frac),
                               zero_delta=full(s.zero_delta_frac),
                               pi_median_all=s.pi_median_all,
                               energy_central=s.energy_central, energy_proxy=s.energy_proxy)
                sup.record_update(row)
            self.recent_staleness = 0.95 * self.recent_staleness + 0.05 * u.staleness
            sup.observe(u.loss, u.clock, theta, u.steps / self.cfg.optim.local_steps)
            if sup.eval_due(u.clock):
                sup.evaluate(self.theta(), self.clock)

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
                f"workers done {self.roster.finished()}/{self.n_workers}")

    def summary(self) -> dict:
        out = {"rejected": sum(self.rejected.values()), "worker_time": self.worker_time,
               **{f"master_{k}_s": v for k, v in self.timers.items()},
               "master_cpu_s": self.cpu_s}
        if self.lead is not None and self._all_done():  # each shard's clock and rejections
            finals = [self.lead.finals[k] for k in self.lead.followers]
            out["shard_clock"] = np.array([self.clock, *[f.state.clock for f in finals]])
            out["shard_rejected"] = np.array([out["rejected"],
                                              *[f.summary["rejected"] for f in finals]])
        return out

    def done_line(self, s: dict) -> str:
        acc = "n/a" if np.isnan(s["test_accuracy"]) else f"{100 * s['test_accuracy']:.2f} %"
        rejected = f", {s['rejected']} rejected updates" if s["rejected"] else ""
        if self.verbose:
            say("master time: " + ", ".join(f"{k} {v:.2f} s" for k, v in self.timers.items()))
        return (f"done: {s['updates']} updates in {s['wall_s']:.1f} s "
                f"({s['updates'] / max(s['wall_s'], 1e-9):.1f} upd/s), {self.eval_split} loss "
                f"{s['test_loss']:.4f}, {self.eval_split} accuracy {acc}{rejected}")


def start_master(cfg: Config, comm: MPI.Intracomm, layout: Layout, problem: Problem,
                 resumed: checkpoint.Checkpoint | None, placement: Placement,
                 ranks: list[RankPlace] | None = None,
                 role: Role | None = None) -> Master:
    """A master's part of an asynchronous run, set up: its kernel and the kernel's threads,
    the evaluation's threads, and on rank 0 the start-up line (and, given every rank's
    ``ranks`` from :func:`gem_mpi.run.rank.gather_placement`, the placement line).
    ``role``: this master's shard of θ with --masters K > 1 (its kernel streams its tensors)."""
    offsets = problem.offsets
    if role is not None:
        t_lo, t_hi = role.plan.tensors[role.shard]
        offsets = offsets[t_lo:t_hi + 1] - offsets[t_lo]
    # the kernel's threads (GEM_NUM_THREADS, else this master's share of what the workers leave)
    kernel = Kernel(offsets, prefer_extension=not cfg.runtime.no_extension,
                    threads=kernel_threads(placement.local_size, placement.local_masters))
    eval_threads = node_cores_left(placement.local_size, placement.local_masters)
    if role is not None and role.shard > 0:
        return Master(cfg, comm, layout, problem, kernel, resumed, eval_threads, role)
    masters = "1 master" if role is None else (
        f"{role.plan.masters} masters (θ's shards: "
        + ", ".join(f"{hi - lo}" for lo, hi in role.plan.bounds) + " parameters)")
    adamw = " (AdamW workers)" if cfg.optim.optimizer == OPT_ADAMW else ""
    say(f"{cfg.method}{adamw} on {cfg.data.model}/{cfg.data.dataset}: {masters} + "
        f"{layout.n_workers} workers, {problem.n_params} parameters, master kernel: "
        f"{kernel.name}; {update_payload(cfg.optim, problem.n_params).wire_note()}"
        + (f"; resuming run {resumed.run_id} from {resumed.path} at update {resumed.clock}"
           + _changes_note(resumed) + _momentum_note(cfg, resumed) if resumed else "")
        + _nice_note(cfg, placement))
    # the evaluation's torch threads: the same cores. The evaluation runs in a background
    # thread every --eval-every updates and time-shares them with the kernel; the kernel's
    # pool sleeps between updates, so a master waiting for updates leaves them all to it.
    if ranks is not None:
        say(placement_line(ranks, kernel.threads, eval_threads))
    return Master(cfg, comm, layout, problem, kernel, resumed, eval_threads, role)


def _nice_note(cfg: Config, placement: Placement) -> str:
    """The priority the workers on the master's node take (each node decides its own)."""
    setting = cfg.runtime.worker_nice
    nice = worker_nice(setting, placement, cfg.optim.worker_mode == OVERLAP)
    if not nice:
        return ""
    why = (" (--worker-nice auto: more ranks than cores here, and overlapped workers)"
           if setting == NICE_AUTO else "")
    return f"; workers at nice +{nice}{why}"


def _changes_note(ckpt: checkpoint.Checkpoint) -> str:
    """The settings this resume changes, for the start-up line (the metrics file keeps them)."""
    return "".join(f", workers {a} -> {b} (the batches not done dealt anew, each worker "
                   "an equal share of each epoch's)" if k == "workers" else
                   f", --{k.replace('_', '-')} {a!r} -> {b!r}"
                   for k, (a, b) in ckpt.changes.items())


def _momentum_note(cfg: Config, ckpt: checkpoint.Checkpoint) -> str:
    """What state the resume restores: the master's own (its record says which), or how
    many GEM workers will find the momentum they saved when the run was stopped."""
    method = methods.of(cfg.method)
    state = method.master_state(cfg.optim)
    master = "" if state is None else f", {state} restored from the checkpoint"
    adamw = cfg.optim.optimizer == OPT_ADAMW
    own = adamw or cfg.optim.local_steps > 1  # the worker's own optimizer keeps a state
    if not own and (state is not None or method.rule != RULE_GEM):
        return master
    directory, seqs = cfg.outputs.checkpoint_dir, ckpt.next_seq
    assert seqs is not None, "an asynchronous run's checkpoint"
    found = sum(
        checkpoint.load_worker_state(directory, w + 1, int(seqs[w]), ckpt.run_id)
        is not None for w in range(len(seqs)) if seqs[w] > 0
    ) if directory else 0
    what = "AdamW state" if adamw else "local steps' momentum" if own else "momentum"
    return (f"{master}, worker {what} restored for {found} of {len(seqs)} workers (the rest "
            "start at 0)")
