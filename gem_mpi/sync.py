"""``--method sync``: synchronous data-parallel momentum SGD on Horovod, GEM's proxy.

The spec's proxy (section 5): n workers average their gradients every step, then take one
momentum-SGD step with the same η and μ as the asynchronous methods; the effective batch is
n × b. Every rank is a worker (no master), Horovod's ``DistributedOptimizer`` averages the
gradients over our mpi4py communicator, and each worker reads the same data stream as
worker number rank + 1 of an asynchronous run, so that the methods see the same data.

Besides Horovod's allreduce, each step does one small ``Allgather`` of (loss, compute
seconds, stop, output error) over mpi4py: it gives rank 0 the metrics row and makes every
rank agree, at the same step, on a stop signal that reached any rank or on rank 0's failure
to write its outputs (divergence each rank decides alike from the same numbers). Rank 0
evaluates, prints progress, writes the metrics file and the checkpoints (θ and the momentum
buffer, identical on every rank).
"""

from __future__ import annotations

import math
import os
import sys
import time

import numpy as np

from gem_mpi import checkpoint
from gem_mpi.config import Config, straggler
from gem_mpi.errors import GemError, OutputError, UsageError
from gem_mpi.metrics import MetricsWriter, rows_on_disk
from gem_mpi.monitor import (
    DivergenceWatch,
    Evaluator,
    Progress,
    cut_short,
    stopped_early,
)
from gem_mpi.problem import Problem, build_problem, load_theta, save_final
from gem_mpi.transport import MPI
from gem_mpi.worker import data_stream, seed_dropout, torch_device

ROOT = 0
# the per-step Allgather row: what rank 0 records and what every rank must agree on
_LOSS, _COMPUTE, _STOP, _ERROR = range(4)


def check_horovod() -> None:
    """UsageError, with the fix, when Horovod is missing or built without PyTorch or MPI."""
    try:
        import horovod.torch as hvd
    except ImportError as exc:
        raise UsageError(f"--method sync needs Horovod with PyTorch support ({exc}): run "
                         "tools/install.sh, which builds it") from None
    if not hvd.mpi_built():
        raise UsageError("--method sync: this Horovod was built without MPI; rebuild it with "
                         "tools/build_horovod.sh")


def _say(text: str) -> None:
    print(f"gem_mpi: {text}", file=sys.stderr, flush=True)


class SyncTrainer:
    """One worker of the synchronous run: model, momentum SGD wrapped by Horovod, data.

    ``theta`` and ``momentum`` (flat float32, from a checkpoint) replace θ₀ and the zero
    momentum when given; they must be given on every rank alike (run_sync broadcasts them).
    """

    def __init__(self, cfg: Config, comm: MPI.Intracomm, problem: Problem,
                 placement: tuple[int, int], start_step: int = 0,
                 theta: np.ndarray | None = None, momentum: np.ndarray | None = None) -> None:
        import horovod.torch as hvd
        import torch
        import torch.nn.functional as F
        from horovod.common.exceptions import HorovodInternalError

        self.torch, self.F, self.hvd = torch, F, hvd
        self.hvd_failure = HorovodInternalError  # what a step raises once Horovod shut down
        if cfg.worker_timeout:
            # a hung rank holds every allreduce: Horovod's stall check (rank 0's background
            # thread sees which ranks never submitted) shuts Horovod down after the timeout
            os.environ.setdefault("HOROVOD_STALL_CHECK_TIME_SECONDS",
                                  str(max(1, int(min(60.0, cfg.worker_timeout / 2)))))
            os.environ.setdefault("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS",
                                  str(max(1, int(cfg.worker_timeout))))
        hvd.init(comm=comm)  # every rank of comm runs this: Horovod hangs otherwise
        self.comm = comm
        self.worker = comm.Get_rank() + 1
        self.n_workers = comm.Get_size()
        self.device = torch_device(cfg, *placement)
        self.model = problem.model.to(self.device)
        self.model.train()
        self.params = list(self.model.parameters())
        opt = torch.optim.SGD(self.params, lr=cfg.lr, momentum=cfg.momentum)
        if theta is not None:
            load_theta(self.model, theta)
        # the wrapper is a new optimizer over the same parameters: state goes on it, not on opt
        self.opt = hvd.DistributedOptimizer(opt, named_parameters=self.model.named_parameters(),
                                            op=hvd.Average)
        if momentum is not None:
            self._set_momentum(self.opt, momentum)
        hvd.broadcast_parameters(self.model.state_dict(), root_rank=ROOT)
        hvd.broadcast_optimizer_state(self.opt, root_rank=ROOT)
        self.cfg, self.step_count = cfg, start_step
        self.steps, self.batches = data_stream(cfg, self.worker, self.n_workers, start_step)
        slow = straggler(cfg, self.n_workers)
        self.slow_factor = slow[1] if slow and slow[0] == self.worker else 1.0

    def _set_momentum(self, opt: object, flat: np.ndarray) -> None:
        offset = 0
        for p in self.params:
            k = p.numel()
            buf = self.torch.from_numpy(flat[offset:offset + k].copy()).view_as(p)
            opt.state[p]["momentum_buffer"] = buf.to(self.device)
            offset += k

    def step(self) -> tuple[float, float, float]:
        """One synchronous step: (this worker's loss, its compute seconds, seconds waited for
        the averaged gradient)."""
        t0 = time.perf_counter()
        seed_dropout(self.cfg, self.worker, self.step_count)
        self.step_count += 1
        x, y = next(self.batches)
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        self.opt.zero_grad()
        loss = self.F.nll_loss(self.model(x), y)
        loss.backward()  # Horovod's hooks start the allreduces here, tensor by tensor
        value = float(loss.detach())
        compute_s = time.perf_counter() - t0
        if self.slow_factor > 1.0:  # --straggler: this worker takes FACTOR times as long
            time.sleep((self.slow_factor - 1.0) * compute_s)
            compute_s *= self.slow_factor
        t1 = time.perf_counter()
        self.opt.step()  # waits for every worker's gradient, averaged
        return value, compute_s, time.perf_counter() - t1

    def theta(self) -> np.ndarray:
        with self.torch.no_grad():
            return self.torch.cat([p.detach().reshape(-1) for p in self.params]).cpu().numpy()

    def momentum(self) -> np.ndarray:
        state = self.opt.state
        with self.torch.no_grad():
            return self.torch.cat([
                state[p]["momentum_buffer"].reshape(-1) if "momentum_buffer" in state[p]
                else self.torch.zeros(p.numel(), device=p.device) for p in self.params
            ]).cpu().numpy()

    def close(self) -> None:
        self.hvd.shutdown()


def run_sync(cfg: Config, comm: MPI.Intracomm, problem: Problem, placement: tuple[int, int],
             stop: object, resumed: tuple[str, np.ndarray, dict] | None) -> dict:
    """Train to the end of the data budget (or a stop); every rank returns the summary."""
    rank = comm.Get_rank()
    start, theta, momentum = 0, None, None
    # rank 0 alone has read the checkpoint, if any
    if comm.bcast(resumed is not None if rank == ROOT else None, root=ROOT):
        start = comm.bcast(resumed[2]["clock"] if rank == ROOT else None, root=ROOT)
        theta = resumed[1] if rank == ROOT else np.empty(problem.n_params, np.float32)
        momentum = (resumed[2]["momentum"] if rank == ROOT
                    else np.empty(problem.n_params, np.float32))
        if rank == ROOT and momentum is None:
            momentum = np.zeros(problem.n_params, np.float32)  # an asynchronous checkpoint
        comm.Bcast(theta, root=ROOT)
        comm.Bcast(momentum, root=ROOT)
    trainer = SyncTrainer(cfg, comm, problem, placement, start, theta, momentum)
    if rank == ROOT:
        import horovod

        n = comm.Get_size()
        _say(f"sync on {cfg.model}/{cfg.dataset}: {n} workers, no master, Horovod "
             f"{horovod.__version__} allreduce (average), {problem.n_params} parameters, "
             f"effective batch {n} × {cfg.batch_size}, device {trainer.device}"
             + (f"; resuming {resumed[0]} at step {start}" if resumed else ""))
    try:
        return _SyncLoop(cfg, comm, problem, trainer, stop, resumed).run(start)
    finally:
        trainer.close()


class _SyncLoop:
    """The step loop, with rank 0's bookkeeping (metrics, evaluation, checkpoints)."""

    def __init__(self, cfg: Config, comm: MPI.Intracomm, problem: Problem,
                 trainer: SyncTrainer, stop: object,
                 resumed: tuple[str, np.ndarray, dict] | None) -> None:
        self.cfg, self.comm, self.trainer, self.stop = cfg, comm, trainer, stop
        self.root = comm.Get_rank() == ROOT
        self.n = comm.Get_size()
        self.elapsed0 = resumed[2]["elapsed_s"] if resumed else 0.0
        self.metrics = None
        self.evaluator = None
        self._last_checkpoint = time.monotonic()
        self.error: str | None = None  # rank 0 could not write an output: stop, exit 1
        if not self.root:
            return
        # the evaluator loads θ snapshots into a model of its own, apart from the trained one
        self.evaluator = Evaluator(cfg, build_problem(cfg, with_theta0=False), noun="step")
        if cfg.metrics:
            rows = None
            if resumed and os.path.exists(cfg.metrics):
                rows = (resumed[2]["rows_updates"], resumed[2]["rows_eval"], 0)
            self.metrics = self.evaluator.metrics = MetricsWriter(
                cfg.metrics, cfg.as_dict(), problem.names, problem.sizes, self.n,
                "horovod allreduce (average)", resume_rows=rows,
                min_free_bytes=cfg.min_free_bytes,
            )

    def run(self, start: int) -> dict:
        cfg, trainer, comm = self.cfg, self.trainer, self.comm
        watch = DivergenceWatch(cfg.divergence_factor)
        progress = Progress(cfg.log_every, unit="step", noun="steps") if self.root else None
        mine = np.zeros(4)
        rows = np.zeros((self.n, 4))
        recent_loss = float("nan")
        compute_total = allreduce_total = 0.0
        diverged: str | None = None
        stopped = False
        every = cfg.checkpoint_every if cfg.checkpoint_dir else 0.0
        t0 = self._t0 = time.perf_counter() - self.elapsed0
        step = start
        try:
            while step < trainer.steps:
                loss, compute_s, allreduce_s = self._step(step)
                if self.metrics is not None and self.metrics.low_space and not self.error:
                    self.error = self.metrics.low_space
                mine[:] = (loss, compute_s, 1.0 if self.stop else 0.0,
                           1.0 if self.error else 0.0)
                comm.Allgather(mine, rows)
                step += 1
                losses = rows[:, _LOSS]
                mean_loss = float(np.mean(losses))
                recent_loss = mean_loss if math.isnan(recent_loss) else (
                    0.95 * recent_loss + 0.05 * mean_loss)
                # every rank sees the same losses and the same θ, so all reach one verdict
                diverged = watch.check(recent_loss, step, self._theta_if_due(step))
                compute_total += float(np.max(rows[:, _COMPUTE]))
                allreduce_total += allreduce_s
                now = time.perf_counter() - t0
                if self.root and not rows[:, _ERROR].any():
                    try:
                        self._record(step, now, losses, float(np.max(rows[:, _COMPUTE])),
                                     allreduce_s)
                    except OutputError as exc:  # the others learn it at the next step
                        self.error = str(exc)
                    progress.update(step, (step - start) / max(now - self.elapsed0, 1e-9),
                                    f"loss {recent_loss:.4f} workers {self.n}")
                failed = bool(rows[:, _ERROR].any())
                if failed or rows[:, _STOP].any() or (diverged and cfg.stop_on_divergence):
                    stopped = True
                    break
                if every and self.root and time.monotonic() - self._last_checkpoint >= every:
                    self._checkpoint(step, now)
            wall = time.perf_counter() - t0
        finally:
            if progress is not None:
                progress.close()
        summary = {"updates": step, "wall_s": wall, "finished": 0.0 if stopped else 1.0,
                   "diverged": 1.0 if diverged else 0.0, "compute_s": compute_total,
                   "allreduce_s": allreduce_total}
        if stopped and failed:
            summary["error"] = 1.0
            if self.root:
                self._output_failed(summary, step, wall)
            return summary
        if self.root:
            try:
                self._finish(summary, step, wall, stopped, diverged)
            except OutputError as exc:  # the end's own writes; the others have left already
                self.error = str(exc)
                self._output_failed(summary, step, wall)
                summary["error"] = 1.0
        return summary

    def _step(self, step: int) -> tuple[float, float, float]:
        """One step; if Horovod shut down (its stall check: a rank sent nothing for
        --worker-timeout seconds), rank 0 checkpoints θ (the failed step changed nothing)
        and ends the job with one line. The others give it time to do so before speaking."""
        try:
            return self.trainer.step()
        except self.trainer.hvd_failure:
            pass
        why = (f"step {step} could not complete: Horovod shut down, a worker having sent "
               f"nothing for --worker-timeout {self.cfg.worker_timeout:g} s (Horovod's lines "
               "above mark it with '!')")
        if self.root:
            notes = cut_short(lambda: self._checkpoint(step, time.perf_counter() - self._t0),
                              self.metrics, {"updates": step, "finished": 0.0},
                              "--resume auto continues")
            raise GemError(f"{why}; {notes}")
        time.sleep(10.0)  # rank 0 aborts the job meanwhile, unless it is the stuck one
        raise GemError(why)

    def _theta_if_due(self, step: int) -> np.ndarray:
        # DivergenceWatch looks at θ every 100 steps only; an empty array costs nothing else
        return self.trainer.theta() if step % 100 == 0 else np.zeros(0, np.float32)

    def _record(self, step: int, t: float, losses: np.ndarray, compute_s: float,
                allreduce_s: float) -> None:
        self.evaluator.drain()
        if self.metrics is not None:
            self.metrics.add_update({
                "time": t, "seq": step - 1, "clock": step - 1, "loss": float(np.mean(losses)),
                "loss_max": float(np.max(losses)), "compute_s": compute_s,
                "allreduce_s": allreduce_s,
            })
        if self.cfg.eval_every and step % self.cfg.eval_every == 0:
            self.evaluator.submit(self.trainer.theta(), step, t)

    def _checkpoint(self, step: int, elapsed: float) -> str | None:
        if not self.cfg.checkpoint_dir:
            return None
        rows = rows_on_disk(self.metrics)
        state = {"clock": step, "tickets": step, "next_seq": np.full(self.n, step, np.int64),
                 "rows_updates": rows[0], "rows_eval": rows[1], "rows_rejected": 0,
                 "elapsed_s": elapsed, "config": self.cfg.as_dict(), "n_workers": self.n,
                 "momentum": self.trainer.momentum()}
        path = checkpoint.save(self.cfg.checkpoint_dir, self.trainer.theta(), state)
        self._last_checkpoint = time.monotonic()
        return path

    def _output_failed(self, summary: dict, step: int, wall: float) -> None:
        summary.update(finished=0.0, error=1.0)
        notes = cut_short(lambda: self._checkpoint(step, wall), self.metrics, summary,
                          "free space, then --resume auto")
        _say(f"error: stopped at step {step}: {self.error}; {notes}")

    def _finish(self, summary: dict, step: int, wall: float, stopped: bool,
                diverged: str | None) -> None:
        theta = self.trainer.theta()
        if stopped:
            self.evaluator.close()
            self.evaluator.drain()
            stopped_early("step", step, diverged, self.cfg.checkpoint_dir,
                          lambda: self._checkpoint(step, wall), "a signal", "Lower --lr")
            if self.metrics is not None:
                self.metrics.close(summary)
            return
        test_loss, test_acc = self.evaluator.final(theta, step, wall)
        summary.update(test_loss=test_loss, test_accuracy=test_acc)
        if self.cfg.save:
            save_final(self.evaluator.problem.model, theta, self.cfg.save)
        self._checkpoint(step, wall)
        if self.metrics is not None:
            self.metrics.close(summary)
        _say(f"done: {step} synchronous steps of {self.n} workers in {wall:.1f} s "
             f"({step / max(wall - self.elapsed0, 1e-9):.2f} steps/s), test loss "
             f"{test_loss:.4f}, test accuracy {100 * test_acc:.2f} %")
