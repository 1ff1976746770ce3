"""``--method sync``, ``ddp`` and ``diloco``: data-parallel momentum SGD (or AdamW,
``--optimizer adamw``) without a master.

GEM's proxy, the process whose energy GEM matches: n workers average their gradients every step, then take one
momentum-SGD step with the same η and μ as the asynchronous methods (or one torch.optim.AdamW
step, :mod:`gem_mpi.baseline.opt_state`); the effective batch is
n × b. Every rank is a worker (no master) and reads the same data stream as worker number
rank + 1 of an asynchronous run, so that the methods see the same data. Two engines average
the gradients, each behind a small face (:class:`_Horovod`, :class:`_Ddp`) so that the step
loop, the metrics and the checkpoints are one: ``sync``, Horovod's ``DistributedOptimizer``
over our mpi4py communicator; ``ddp``, PyTorch's ``DistributedDataParallel`` (gloo on the
CPU, NCCL on GPUs) whose process group is started from the MPI world (rank 0's address and a
free port broadcast over MPI: no other launcher), its bucketed allreduces overlapping the
backward pass. Both compute the same θ up to float32 summation order. ``diloco``
(:mod:`gem_mpi.baseline.diloco`, torchft's DiLoCo) is the third face: the workers step on their
own and meet every H steps, so the loop below exchanges its rows every H steps, not every step.

Besides Horovod's allreduce, each step does one small ``Allgather`` of (loss, compute
seconds, stop, rank 0's verdict) over mpi4py: it gives rank 0 the metrics row and makes every
rank agree, at the same step, on a stop signal that reached any rank or on the verdict of
rank 0's supervisor at the step before (an output that could not be written); divergence
each rank decides alike from the same numbers. Rank 0 evaluates, prints progress, writes the
metrics file and the checkpoints (θ and the optimizer's state, identical on every rank).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from gem_mpi.algorithm.stepsize import Schedule
from gem_mpi.baseline import opt_state
from gem_mpi.baseline.diloco import Diloco, check_diloco
from gem_mpi.config import DDP, DILOCO, SYNC, Config
from gem_mpi.errors import GemError, UsageError
from gem_mpi.outputs.checkpoint import Checkpoint
from gem_mpi.problem import Problem, build_problem, flatten, load_theta
from gem_mpi.run.local_step import LocalStep
from gem_mpi.run.monitor import LossWatch
from gem_mpi.run.profiler import StepProfiler
from gem_mpi.run.rank import Placement, data_stream, seed_dropout, slowness, torch_device
from gem_mpi.run.supervisor import FINISHED, Outcome, RunSupervisor, StopFlag, Verdict, say
from gem_mpi.transport import MPI
from gem_mpi.transport.runtime import process_group

ROOT = 0
_CODE = {outcome: float(i + 1) for i, outcome in enumerate(Outcome)}  # 0: no verdict
_OUTCOME = {int(code): outcome for outcome, code in _CODE.items()}


def check_horovod() -> None:
    """UsageError, with the fix, when Horovod is missing or built without PyTorch or MPI, or
    when the job runs on another MPI than the Open MPI that Horovod is linked against (its
    library would load a second MPI into the process; under another Open MPI, e.g. 5 from
    PyPI's wheel, its import fails on a symbol that release lacks)."""
    vendor, version = MPI.get_vendor()
    if vendor != "Open MPI":
        raise UsageError(f"--method sync: Horovod here is built against Open MPI, and this job "
                         f"runs on {vendor} {'.'.join(map(str, version))}; launch it with Open "
                         f"MPI's mpirun, or use an asynchronous method (gem, downpour, "
                         f"adaptive), which runs on {vendor}")
    try:
        import horovod.torch as hvd
    except ImportError as exc:
        if "undefined symbol" in str(exc):  # e.g. Open MPI 5's wheel under a 4.1 build
            raise UsageError(
                f"--method sync: Horovod here is built against another Open MPI than this "
                f"job's {vendor} {'.'.join(map(str, version))} ({exc}); launch it with the "
                f"mpirun Horovod was built with (tools/build_horovod.sh: Debian's "
                f"/usr/bin/mpirun), or use an asynchronous method (gem, downpour, adaptive), "
                f"which runs on this one") from None
        raise UsageError(f"--method sync needs Horovod with PyTorch support ({exc}): run "
                         "tools/install.sh, which builds it") from None
    if not hvd.mpi_built():
        raise UsageError("--method sync: this Horovod was built without MPI; rebuild it with "
                         "tools/build_horovod.sh")


def check_ddp() -> None:
    """UsageError, with the fix, when this torch has no torch.distributed with gloo."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        raise UsageError("--method ddp needs torch.distributed with the gloo backend; this "
                         "torch has none (use --method sync, Horovod)")


class Face(Protocol):
    """What the step loop asks of a synchronous method's engine (Horovod, DDP, DiLoCo)."""

    name: str  # as the start-up line names it
    every: int  # steps between two exchanges: 1, or a round's H
    hint: str  # added to the line of a failed exchange

    @property
    def outer_state(self) -> dict | None:
        """The optimizer state a checkpoint's shared fields hold when the workers' own (inner)
        optimizers differ from rank to rank (DiLoCo's outer buffer); None: the optimizer's."""

    def failed(self, exc: BaseException) -> bool:
        """Whether a step raised because the exchange failed (a worker stopped sending)."""

    def wrap(self, model: Any, opt: Any) -> tuple[Any, Any]:
        """(the module to run, the optimizer to step)."""

    def broadcast(self, model: Any, opt: Any) -> None:
        """Make the ranks' parameters and optimizer state rank 0's."""

    def step(self, opt: Any, clip: Callable[[], object] | None) -> None:
        """Wait for the exchange, clip the averaged gradient if asked, step."""

    def close(self) -> None:
        """Give the engine's resources back."""


class _Horovod:
    """The allreduce on Horovod: its optimizer wrapper averages the gradients as the
    backward pass produces them (MPI_THREAD_MULTIPLE: its thread calls MPI)."""

    every, outer_state, hint = 1, None, " (Horovod's lines above mark it with '!')"

    def __init__(self, cfg: Config, comm: MPI.Intracomm, device: object) -> None:
        import horovod
        import horovod.torch as hvd
        from horovod.common.exceptions import HorovodInternalError

        self.hvd, self._failure = hvd, HorovodInternalError
        self.name = f"Horovod {horovod.__version__} allreduce (average)"
        timeout = cfg.monitor.worker_timeout
        if timeout:
            # a hung rank holds every allreduce: Horovod's stall check (rank 0's background
            # thread sees which ranks never submitted) shuts Horovod down after the timeout
            os.environ.setdefault("HOROVOD_STALL_CHECK_TIME_SECONDS",
                                  str(max(1, int(min(60.0, timeout / 2)))))
            os.environ.setdefault("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS",
                                  str(max(1, int(timeout))))
        hvd.init(comm=comm)  # every rank of comm runs this: Horovod hangs otherwise

    def failed(self, exc: BaseException) -> bool:
        """Whether a step raised because Horovod shut down (its stall check)."""
        return isinstance(exc, self._failure)

    def wrap(self, model: object, opt: object) -> tuple[object, object]:
        """(the module to run, the optimizer to step): the wrapper is a new optimizer over
        the same parameters, so state goes on it."""
        return model, self.hvd.DistributedOptimizer(
            opt, named_parameters=model.named_parameters(), op=self.hvd.Average)

    def broadcast(self, model: object, opt: object) -> None:
        """θ, and the optimizer's state if it has one (a checkpoint's): Horovod would make an
        empty one by a step on zero gradients, which under AdamW counts a step and decays θ."""
        self.hvd.broadcast_parameters(model.state_dict(), root_rank=ROOT)
        if any(opt.state.values()):
            self.hvd.broadcast_optimizer_state(opt, root_rank=ROOT)

    def step(self, opt: object, clip: object) -> None:
        """Wait for the averaged gradient, clip it if asked, step."""
        if clip is None:
            opt.step()
            return
        opt.synchronize()
        clip()
        with opt.skip_synchronize():
            opt.step()

    def close(self) -> None:
        self.hvd.shutdown()


class _Ddp:
    """The allreduce on torch.distributed's DistributedDataParallel: a process group over
    the MPI world's ranks, its store on rank 0 listening on loopback on one node, across
    nodes on --interface's address (else MASTER_ADDR, else its host's); its timeout is
    --worker-timeout, so a hung rank fails the step as Horovod's stall check does."""

    every, outer_state, hint = 1, None, ""

    def __init__(self, cfg: Config, comm: MPI.Intracomm, device: object) -> None:
        import datetime

        import torch
        import torch.distributed as dist

        self.dist, self.device = dist, device
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=cfg.monitor.worker_timeout or 1800.0)
        process_group(comm, backend, timeout, cfg.runtime.interface)
        self._failure = (dist.DistBackendError, dist.DistNetworkError, dist.DistStoreError)
        self.name = f"torch {torch.__version__} DistributedDataParallel ({backend}, average)"

    def failed(self, exc: BaseException) -> bool:
        """Whether a step raised because the process group failed: a torch.distributed
        error, or gloo's timeout, which reaches Python as a plain RuntimeError."""
        return isinstance(exc, self._failure) or (
            isinstance(exc, RuntimeError) and "gloo" in str(exc) and "Timed out" in str(exc))

    def wrap(self, model: object, opt: object) -> tuple[object, object]:
        from torch.nn.parallel import DistributedDataParallel

        ids = [self.device] if self.device.type == "cuda" else None
        # DDP broadcasts rank 0's parameters and buffers as it wraps
        return DistributedDataParallel(model, device_ids=ids), opt

    def broadcast(self, model: object, opt: object) -> None:
        """The optimizer's state, identical on every rank already (a checkpoint's, given to
        every rank, or none): nothing to send."""

    def step(self, opt: object, clip: object) -> None:
        """The gradient is averaged by the end of backward; clip it if asked, step."""
        if clip is not None:
            clip()
        opt.step()

    def close(self) -> None:
        if self.dist.is_initialized():
            self.dist.destroy_process_group()


# each synchronous method's check of its library (on rank 0, before the run) and its face
_FACES: dict[str, tuple[Callable[[], None], Callable[..., Face]]] = {
    SYNC: (check_horovod, _Horovod), DDP: (check_ddp, _Ddp), DILOCO: (check_diloco, Diloco)}


def check_face(method: str) -> None:
    """UsageError, with the fix, when ``method``'s engine cannot run here."""
    _FACES[method][0]()


class SyncTrainer:
    """One worker of the synchronous run: model, momentum SGD or AdamW wrapped by the
    method's exchange (Horovod, DDP or DiLoCo), data.

    ``theta`` and ``shared`` (the optimizer's state as :mod:`~gem_mpi.baseline.opt_state`'s
    arrays, from a checkpoint) replace θ₀ and the fresh state when given; they must be given
    on every rank alike (run_sync broadcasts them). DiLoCo: ``shared`` is the outer Nesterov
    buffer, ``inner`` this worker's own optimizer state.
    """

    def __init__(self, cfg: Config, comm: MPI.Intracomm, problem: Problem,
                 placement: Placement, start_step: int = 0,
                 theta: np.ndarray | None = None, shared: dict[str, np.ndarray] | None = None,
                 inner: dict[str, np.ndarray] | None = None) -> None:
        self.comm = comm
        self.worker = comm.Get_rank() + 1
        self.n_workers = comm.Get_size()
        self.device = torch_device(cfg.runtime.threads, placement)
        self.face: Face = _FACES[cfg.method][1](cfg, comm, self.device)
        self.every = self.face.every  # steps between two exchanges
        self.local = LocalStep(cfg.optim, problem, self.device)
        self.model, self.params = self.local.model, self.local.params
        if theta is not None:
            load_theta(self.model, theta)
        self.kind, self.shared_kind = cfg.optim.optimizer, opt_state.shared_kind(cfg)
        self.local.net, self.opt = self.face.wrap(self.model, opt_state.build(cfg, self.params))
        if shared is not None:
            opt_state.put(self._shared, self.params, self.shared_kind, shared, self.device)
        if inner is not None:
            opt_state.put(self.opt.state, self.params, self.kind, inner, self.device)
        self.face.broadcast(self.model, self.opt)
        self.seed, self.step_count = cfg.data.seed, start_step
        self.steps, self.batches = data_stream(cfg.data, self.worker, self.n_workers, start_step)
        self.budget = self.steps
        self.steps -= self.steps % self.every  # DiLoCo: whole rounds (the start-up line says so)
        self.schedule = Schedule.of(cfg.optim, self.steps)  # η per step, as the workers'
        self.slow_factor = slowness(cfg, self.n_workers, self.worker)

    @property
    def _shared(self) -> dict:
        """The state of the optimizer every rank shares: the optimizer's (DiLoCo: the outer
        Nesterov step's, the inner optimizers' differing from worker to worker)."""
        outer = self.face.outer_state
        return self.opt.state if outer is None else outer

    def step(self) -> tuple[float, float, float]:
        """One synchronous step: (this worker's loss, its compute seconds, seconds waited for
        the averaged gradient)."""
        t0 = time.perf_counter()
        step = self.step_count
        seed_dropout(self.seed, self.worker, step)
        self.step_count += 1
        if not self.schedule.constant:
            for group in self.opt.param_groups:
                group["lr"] = float(self.schedule.eta(step))
        x, y = next(self.batches)
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        self.opt.zero_grad()
        # the allreduces start in the backward, tensor by tensor (Horovod) or bucket by bucket
        # (DDP, whose backward returns once they are done: its wait counts in compute)
        loss = self.local.forward_backward(x, y)
        value = float(loss.detach())
        compute_s = time.perf_counter() - t0
        if self.slow_factor > 1.0:  # --straggler: this worker takes FACTOR times as long
            time.sleep((self.slow_factor - 1.0) * compute_s)
            compute_s *= self.slow_factor
        t1 = time.perf_counter()
        # the averaged gradient is clipped, as the workers clip theirs
        clip = None if self.local.clip_norm <= 0 else self.local.clip
        self.face.step(self.opt, clip)  # waits for every worker's gradient, averaged
        return value, compute_s, time.perf_counter() - t1

    def theta(self) -> np.ndarray:
        return flatten(self.params)

    def shared_state(self) -> dict[str, np.ndarray]:
        """The checkpoint's optimizer state, the same on every worker (DiLoCo: the outer
        Nesterov buffer)."""
        return opt_state.arrays(self._shared, self.params, self.shared_kind)

    def inner_state(self) -> dict[str, np.ndarray]:
        """DiLoCo: this worker's own optimizer state, which differs from worker to worker."""
        return opt_state.arrays(self.opt.state, self.params, self.kind)

    def close(self) -> None:
        self.batches.close()  # its loader processes (--loader-workers) stop now
        self.face.close()


def run_sync(cfg: Config, comm: MPI.Intracomm, problem: Problem, placement: Placement,
             stop: StopFlag, resumed: Checkpoint | None, result: dict | None = None
             ) -> Outcome:
    """Train to the end of the data budget (or a stop); every rank returns the outcome.
    ``result``, if given, receives rank 0's final θ."""
    rank = comm.Get_rank()
    start, theta, shared, inner = 0, None, None, None
    # rank 0 alone has read the checkpoint, if any
    if comm.bcast(resumed is not None if rank == ROOT else None, root=ROOT):
        start = comm.bcast(resumed.clock if rank == ROOT else None, root=ROOT)
        theta = resumed.theta if rank == ROOT else np.empty(problem.n_params, np.float32)
        comm.Bcast(theta, root=ROOT)
        shared = opt_state.empty(opt_state.shared_kind(cfg), problem.sizes)
        for key, array in shared.items():
            if rank == ROOT:
                array[...] = getattr(resumed, opt_state.SHARED[key])
            comm.Bcast(array, root=ROOT)
        # DiLoCo: each worker's own inner state, if the checkpoint kept them (a stop's)
        if comm.bcast(rank == ROOT and resumed.inner_m is not None, root=ROOT):
            inner = opt_state.empty(cfg.optim.optimizer, problem.sizes)
            for key, array in inner.items():
                comm.Scatter(getattr(resumed, opt_state.INNER[key]) if rank == ROOT else None,
                             array, root=ROOT)
    trainer = SyncTrainer(cfg, comm, problem, placement, start, theta, shared, inner)
    if rank == ROOT:
        n = comm.Get_size()
        say(f"{cfg.method} on {cfg.data.model}/{cfg.data.dataset}: {n} workers, no master, "
            f"{trainer.face.name}, {problem.n_params} parameters, "
            f"effective batch {n} × {cfg.data.batch_size}, device {trainer.device}"
            + _rounds_note(cfg, trainer, resumed)
            + (f"; resuming run {resumed.run_id} from {resumed.path} at step {start}"
               if resumed else ""))
    try:
        outcome = SyncRun(cfg, comm, problem, trainer, stop, resumed, start).run()
        if result is not None and rank == ROOT:
            result["theta"] = trainer.theta()
        return outcome
    finally:
        trainer.close()


def _rounds_note(cfg: Config, trainer: SyncTrainer, resumed: Checkpoint | None) -> str:
    """Rounds (DiLoCo): how many, the budget's steps cut to whole rounds, and where the
    inner momenta of a resume come from."""
    if trainer.every == 1:
        return ""
    h = trainer.every
    note = f"; {trainer.steps // h} rounds of {h} steps"
    cut = trainer.budget - trainer.steps
    if cut:
        note += f" (the last {cut} steps of the budget make no whole round: not taken)"
    if resumed is not None:
        note += ("; inner optimizer states from the checkpoint" if resumed.inner_m is not None
                 else "; inner optimizer states restart at 0 (a periodic checkpoint keeps none)")
    return note


class SyncRun:
    """The step loop on every rank, the synchronous run's engine; rank 0's run supervisor
    records, evaluates and saves.

    The synchronous run's part of a checkpoint: θ and the optimizer's state (identical on
    every rank) and the step count. ``start``: the step it continues at (every rank)."""

    noun = "step"

    def __init__(self, cfg: Config, comm: MPI.Intracomm, problem: Problem,
                 trainer: SyncTrainer, stop: StopFlag, resumed: Checkpoint | None,
                 start: int = 0) -> None:
        self.cfg, self.comm, self.trainer, self.stop = cfg, comm, trainer, stop
        self.root = comm.Get_rank() == ROOT
        self.n = comm.Get_size()
        self.step = start
        self.compute_total = self.allreduce_total = 0.0
        # DiLoCo, rank 0: every worker's inner state, a row each, gathered at the end
        self._inner: dict[str, np.ndarray] = {}
        self.sup: RunSupervisor | None = None
        # every rank watches the same losses alike: rank 0's supervisor watches with it
        self.losses = LossWatch(cfg.monitor.divergence_factor)
        self.profiler = StepProfiler(cfg.outputs, trainer.device.type == "cuda")
        if self.root:
            # the evaluator loads θ snapshots into a model of its own, apart from the trained
            # one; a stuck rank is Horovod's stall check's to find (see SyncTrainer)
            self.sup = RunSupervisor(cfg, problem, self.n, self, trainer.face.name,
                                     stop, resumed,
                                     eval_problem=build_problem(cfg.data, with_theta0=False),
                                     losses=self.losses, watch_workers=False)

    # --- the engine, as the supervisor drives it --------------------------------------------
    @property
    def position(self) -> int:
        return self.step

    def theta(self) -> np.ndarray:
        return self.trainer.theta()

    def state(self) -> dict:
        """θ, the optimizer's state and the step: no tickets or next_seq, which only the
        asynchronous methods have."""
        shared = self.trainer.shared_state()
        return {"theta": self.trainer.theta(), "clock": self.step,
                **{opt_state.SHARED[k]: a for k, a in shared.items()},
                **{opt_state.INNER[k]: a for k, a in self._inner.items()}}

    def load_state(self, ckpt: Checkpoint) -> None:
        self.step = int(ckpt.clock)  # θ and the optimizer: run_sync gave them to the trainer

    def run(self) -> Outcome:
        with self.profiler:  # --profile-steps: a tick at the end of each step
            if self.sup is None:
                return self.loop().outcome
            return self.sup.run()

    def loop(self) -> Verdict:
        """Every rank steps, and every ``trainer.every`` steps (1: each step) the ranks
        exchange their rows: the losses, compute seconds, a stop and rank 0's verdict."""
        cfg, trainer, comm, sup = self.cfg, self.trainer, self.comm, self.sup
        h = trainer.every
        mine = np.zeros(2 * h + 2)  # losses, compute seconds, stop, verdict
        rows = np.zeros((self.n, 2 * h + 2))
        waits = np.zeros(h)
        verdict: Verdict | None = None  # rank 0's, which every rank learns at the next step
        while self.step < trainer.steps:
            for k in range(h):
                mine[k], mine[h + k], waits[k] = self._step(self.step + k)
                if k < h - 1:
                    self.profiler.tick()  # DiLoCo: a round's inner step
            mine[2 * h:] = (1.0 if self.stop else 0.0,
                            _CODE[verdict.outcome] if verdict is not None else 0.0)
            with self.profiler.range("gem_mpi.exchange"):
                comm.Allgather(mine, rows)
            self._take(rows, waits)
            self.profiler.tick()
            ruled = _OUTCOME.get(int(rows[ROOT, -1]))
            if ruled is not None and ruled is not Outcome.STOPPED:
                return self._end(verdict if verdict is not None else Verdict(ruled))
            if ruled is Outcome.STOPPED or rows[:, -2].any():
                return self._end(Verdict(Outcome.STOPPED, "a signal"))  # whichever rank
            if self.losses.diverged and cfg.monitor.stop_on_divergence:
                return self._end(Verdict(Outcome.DIVERGED, self.losses.diverged))
            if sup is not None:
                verdict = sup.between_batches()
        return self._end(FINISHED)

    def _take(self, rows: np.ndarray, waits: np.ndarray) -> None:
        """The exchanged rows, a step at a time: every rank watches the losses alike (the
        same numbers, the same θ, one verdict); rank 0 records them. θ is looked at, and
        evaluated, only at the exchange (DiLoCo's θ_outer; mid-round θ is a worker's own)."""
        h, sup, start = self.trainer.every, self.sup, self.step
        evaluate = False
        for k in range(h):
            self.step += 1
            losses, compute_s = rows[:, k], float(np.max(rows[:, h + k]))
            # DivergenceWatch looks at θ every 100 steps only; an empty array costs nothing
            due = k == h - 1 and self.step // 100 > start // 100
            self.losses.observe(float(np.mean(losses)), self.step, self.trainer.theta() if due
                                else np.zeros(0, np.float32))
            self.compute_total += compute_s
            self.allreduce_total += float(waits[k])
            if sup is not None:  # this step is done on every rank: its row goes in (unless
                # the metrics file failed), so the checkpoint's rows match its step
                self._record(losses, compute_s, float(waits[k]))
                evaluate = evaluate or sup.eval_due(self.step - 1)
                sup.show(lambda: f"loss {self.losses.recent:.4f} workers {self.n}")
        if evaluate:
            sup.evaluate(self.trainer.theta(), self.step)

    def _end(self, verdict: Verdict) -> Verdict:
        """Every rank ends here at the same step. DiLoCo: rank 0 gathers each worker's inner
        optimizer state, so that the checkpoint it writes now resumes them exactly."""
        if self.trainer.face.outer_state is not None:
            for key, mine in self.trainer.inner_state().items():
                rows = np.empty((self.n, mine.size), mine.dtype) if self.root else None
                self.comm.Gather(mine, rows, root=ROOT)
                if rows is not None:
                    self._inner[key] = rows
        return verdict

    def _step(self, step: int) -> tuple[float, float, float]:
        """One step; if the allreduce failed (Horovod's stall check, or the process group's
        timeout: a rank sent nothing for --worker-timeout seconds), rank 0 checkpoints θ (the failed step changed nothing)
        and ends the job with one line. The others give it time to do so before speaking."""
        try:
            return self.trainer.step()
        except Exception as exc:  # the allreduce's failure; anything else is re-raised
            if not self.trainer.face.failed(exc):
                raise
        what = (f"step {step}" if self.trainer.every == 1 else
                f"the round of steps {self.step}-{step} (its outer step)")
        why = (f"{what} could not complete: the allreduce failed, a worker having sent "
               f"nothing for --worker-timeout {self.cfg.monitor.worker_timeout:g} s"
               + self.trainer.face.hint)
        if self.sup is not None:
            notes = self.sup.cut_short({"updates": step, "finished": 0.0},
                                       "--resume auto continues")
            raise GemError(f"{why}; {notes}")
        time.sleep(10.0)  # rank 0 aborts the job meanwhile, unless it is the stuck one
        raise GemError(why)

    def _record(self, losses: np.ndarray, compute_s: float, allreduce_s: float) -> None:
        sup, step = self.sup, self.step
        if sup.recording:
            sup.record_update({
                "time": sup.elapsed(), "seq": step - 1, "clock": step - 1,
                "loss": float(np.mean(losses)), "loss_max": float(np.max(losses)),
                "compute_s": compute_s, "allreduce_s": allreduce_s,
            })

    def summary(self) -> dict:
        return {"compute_s": self.compute_total, "allreduce_s": self.allreduce_total}

    def done_line(self, s: dict) -> str:
        sup = self.sup
        acc = "n/a" if np.isnan(s["test_accuracy"]) else f"{100 * s['test_accuracy']:.2f} %"
        h = self.trainer.every
        rounds = f" ({s['updates'] // h} outer steps)" if h > 1 else ""
        return (f"done: {s['updates']} synchronous steps{rounds} of {self.n} workers in "
                f"{s['wall_s']:.1f} s ({s['updates'] / max(s['wall_s'] - sup.elapsed0, 1e-9):.2f}"
                f" steps/s), {self.cfg.data.eval_split} loss {s['test_loss']:.4f}, "
                f"{self.cfg.data.eval_split} accuracy {acc}")
