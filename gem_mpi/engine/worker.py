"""A worker rank: pull θ, compute Δθ = −η∇L(s) on its next mini-batch, commit, repeat.

For GEM the worker also folds Δθ into its proxy momentum (with ``--gem-proxy global`` the
master keeps it instead) and sends the master the payload of :mod:`gem_mpi.protocol`. Three
orders (``--worker-mode``): ``wait``, where after a commit the worker waits until the master
has applied it before pulling again, so its next gradient is taken at a θ holding its own
update; ``pipelined``, Algorithm 1's order, where it computes the next Δθ at once at the θ
pulled just before the commit, while the master applies it, and waits for its mailbox slot
only before the next commit; and ``overlap``, where a compute thread computes step k+1 while
the thread that started MPI (the only one that calls it: MPI_THREAD_FUNNELED) commits step k
and pulls θ for step k+2, so that a step costs the longer of compute and communication
instead of their sum, at one step more staleness, which GEM's shift sees. One update in
flight is enough: the single slot per worker keeps the master's memory and the
exactly-once bookkeeping as they are.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from gem_mpi.algorithm.kernel import load_extension
from gem_mpi.algorithm.rule import WorkerRule
from gem_mpi.algorithm.stepsize import Schedule, clip
from gem_mpi.config import (
    AMP_BF16,
    LOSS_CONTINUE,
    OVERLAP,
    PIPELINED,
    Config,
    DataConfig,
    OptimConfig,
)
from gem_mpi.engine.group import Group
from gem_mpi.engine.shards import Plan
from gem_mpi.outputs import checkpoint
from gem_mpi.problem import Problem, unflatten
from gem_mpi.problem.elastic import length
from gem_mpi.protocol import DONE, FINISHED, LEFT, STOPPED, UPDATE, WORKER_TIME_COLUMNS
from gem_mpi.run.rank import (
    Placement,
    data_stream,
    first_plans,
    seed_dropout,
    slowness,
    torch_device,
    worker_data,
)
from gem_mpi.transport import MPI
from gem_mpi.transport.endpoints import WorkerShards


class _QuadraticSteps:
    """Δθ of the numpy quadratic problem; used by the invariant tests."""

    def __init__(self, optim: OptimConfig, data: DataConfig, problem: Problem,
                 rank: int, plan: list | None = None) -> None:
        self.q = problem.quadratic
        self.lr = optim.lr
        self.target = self.q.target(rank)
        self.steps = length(plan) if plan is not None else (
            data.max_steps or data.epochs * max(1, data.synthetic_size // data.batch_size))
        self.schedule = Schedule.of(optim, self.steps)
        self.clip_norm = optim.clip_grad_norm
        self.plain = self.schedule.constant and self.clip_norm == 0  # Quadratic.step as is
        self.device = "cpu (numpy)"
        self.load_s = 0.0  # Δθ is computed on the pulled θ in place
        self.gpu_s = float("nan")
        self.pull_buffer = None  # pulls land in the endpoint's own buffer
        self.pull_buffers: list[np.ndarray] = []

    def __call__(self, theta: np.ndarray, seq: int) -> tuple[np.ndarray, float]:
        if self.plain:
            return self.q.step(theta, self.target, self.lr)
        diff = theta - self.target
        loss = 0.5 * float(np.dot(self.q.h * diff, diff))
        return -self.schedule.eta(seq) * clip(self.q.h * diff, self.clip_norm), loss

    def host(self, a: np.ndarray) -> np.ndarray:
        return a

    def comm_stream(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def compute_thread(self) -> None:
        """Nothing to set up on the compute thread."""

    def settle(self, seq: int, delta: np.ndarray) -> np.ndarray:
        return delta

    def close(self) -> None:
        """Nothing to end: the quadratic has no data stream."""

    def extend(self, runs: list) -> None:
        """Dealt ``runs`` more batches (a departed worker's): the quadratic has no data."""
        self.steps += length(runs)

    def release(self) -> None:
        """Nothing to give back: numpy on the CPU."""


class _TorchSteps:
    """Δθ of a torch model on this worker's data stream, on its GPU or the CPU.

    On the CPU the parameters are views of the pulled θ and Δθ is computed in place: nothing
    is copied. On a GPU θ is pulled into page-locked memory and reaches the parameters (views
    of one flat device buffer) in one asynchronous copy; Δθ and κ|m| come back on a side
    stream, each ordered after the compute by an event; the next mini-batch is made on the
    CPU and sent to the device while the GPU still computes this step.
    """

    def __init__(self, cfg: Config, problem: Problem, rank: int, n_workers: int,
                 placement: Placement, start_seq: int = 0, overlapped: bool = False,
                 plan: list | None = None, group: Group | None = None) -> None:
        """``overlapped`` (--worker-mode overlap): two Δθ buffers and three pull buffers
        taking turns, see :func:`_overlap_order`; ``plan``: the worker's dealt batches
        (:mod:`gem_mpi.problem.elastic`; None: its own stream); ``group``: this leader's
        worker group (--group-size), whose members compute beside it every step."""
        import torch

        self.torch = torch
        self.device = torch_device(cfg.runtime.threads, placement)
        self.seed, self.rank = cfg.data.seed, rank
        self.model = problem.model.to(self.device)
        self.loss = problem.loss.mean
        self.model.train()
        self.params = list(self.model.parameters())
        self._first_seq = start_seq
        n = problem.n_params
        self.load_s = 0.0  # copying θ into the model's parameters
        self.gpu_s = float("nan")  # the GPU's own time for the steps (see protocol)
        self.on_gpu = self.device.type == "cuda"
        # overlapped on the CPU, Δθ = −ηg and g's zeroing are the communication thread's
        # (settle): two gradient buffers take turns, each zero when its step starts
        self._deferred = overlapped and not self.on_gpu
        self._grads = [torch.zeros(n, dtype=torch.float32, device=self.device)
                       for _ in range(2 if self._deferred else 1)]
        self._lrs = [cfg.optim.lr] * len(self._grads)  # each turn's η, for settle
        self._grad = self._grads[0]
        self._bind_grads(self._grad)
        # Δθ on the device: one buffer, or two taking turns (--worker-mode overlap: step k's
        # is still being sent while step k+1's is computed)
        self._deltas = [torch.empty(n, dtype=torch.float32, device=self.device)
                        for _ in range(2 if overlapped else 1)]
        self.delta = self._deltas[0]
        self.group = group
        data = self.data = worker_data(cfg)
        self.n_workers, self.plan = n_workers, plan
        self.steps, self.batches = data_stream(data, rank, n_workers, start_seq, plan)
        self.lr = cfg.optim.lr
        self.schedule = Schedule.of(cfg.optim, self.steps)
        self.clip_norm = cfg.optim.clip_grad_norm
        self.amp = torch.bfloat16 if cfg.optim.amp == AMP_BF16 else None
        self._bound: int | None = None  # the host θ the CPU parameters view
        self.pull_buffers: list[np.ndarray] = []  # where the worker's pulls land (GPU)
        self._next: tuple | None = None  # (seq, x, y, ready event): a batch on its way (GPU)
        if self.on_gpu:
            self._init_gpu(n, overlapped)

    def _init_gpu(self, n: int, overlapped: bool) -> None:
        torch = self.torch
        pinned = [torch.empty(n, dtype=torch.float32, pin_memory=True)
                  for _ in range(3 if overlapped else 1)]
        self.pull_buffers = [p.numpy() for p in pinned]
        self._pinned = {b.ctypes.data: p for b, p in zip(self.pull_buffers, pinned)}
        self._flat = torch.empty(n, dtype=torch.float32, device=self.device)
        self._bind(self._flat)
        self._delta_hosts = [torch.empty(n, dtype=torch.float32, pin_memory=True)
                             for _ in range(len(self._deltas))]
        self._a_host = None  # κ|m|'s page-locked copy: made at its first use (the global
        # proxy sends no κ|m|, so its workers never pin θ's size a third time)
        self._loss_host = torch.empty(1, dtype=torch.float32, pin_memory=True)
        self._copies = torch.cuda.Stream(self.device)  # host <-> device beside the compute
        self._a_copies = None  # κ|m|'s copies, made on the thread that folds m (host())
        self.gpu_s = 0.0

    @property
    def pull_buffer(self) -> np.ndarray | None:
        """Where the worker's pulls land: page-locked memory on a GPU, else its own."""
        return self.pull_buffers[0] if self.pull_buffers else None

    def compute_thread(self) -> None:
        """On the compute thread, first: the worker's GPU is its current device (CUDA's
        current device is per thread, and a new thread's is device 0), so that its events and
        streams are that device's."""
        if self.on_gpu:
            self.torch.cuda.set_device(self.device)

    def comm_stream(self) -> contextlib.AbstractContextManager:
        """A context for the thread that folds m and sends while another computes (--worker-
        mode overlap): on a GPU a CUDA stream of its own (the current stream is per
        thread), so that its work never queues behind the next step's; else nothing."""
        if not self.on_gpu:
            return contextlib.nullcontext()
        return self.torch.cuda.stream(self.torch.cuda.Stream(self.device))

    def _bind_grads(self, flat: object) -> None:
        """Make every parameter's .grad a view of ``flat`` (backward accumulates there)."""
        for p, view in zip(self.params, unflatten(flat, self.params)):
            p.grad = view

    def _bind(self, flat: object) -> None:
        """Make every parameter a view of ``flat`` (θ's layout, this worker's device)."""
        with self.torch.no_grad():
            for p, view in zip(self.params, unflatten(flat, self.params)):
                p.data = view

    def _batch(self, seq: int) -> tuple:
        """Mini-batch ``seq`` on the device: the one prefetched, else made now. Its dropout
        seed is set just before it is made, so both ways draw the same masks."""
        torch = self.torch
        if self._next is not None:
            next_seq, x, y, ready = self._next
            self._next = None
            if next_seq == seq:
                torch.cuda.current_stream().wait_event(ready)
                return x, y
        seed_dropout(self.seed, self.rank, seq)  # randomness a function of (seed, worker, step)
        x, y = next(self.batches)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def _prefetch(self, seq: int) -> None:
        """Make mini-batch ``seq`` and start its copy to the device on the side stream."""
        torch = self.torch
        if seq >= self.steps:
            return
        seed_dropout(self.seed, self.rank, seq)
        x, y = next(self.batches)
        x, y = x.pin_memory(), y.pin_memory()
        compute = torch.cuda.current_stream()
        with torch.cuda.stream(self._copies):
            x = x.to(self.device, non_blocking=True)
            y = y.to(self.device, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        x.record_stream(compute)  # allocated on the side stream, used on the compute one
        y.record_stream(compute)
        self._next = (seq, x, y, ready)

    def _to_host(self, pairs: tuple[tuple[object, object], ...], timing: bool = False,
                 stream: object = None) -> object:
        """Copy each (device source, page-locked destination) on a side stream (default: the
        compute's copies), after the work queued so far on this thread's current stream;
        returns the event that marks them done."""
        torch = self.torch
        copies = self._copies if stream is None else stream
        computed = torch.cuda.Event()
        computed.record()
        done = torch.cuda.Event(enable_timing=timing)
        with torch.cuda.stream(copies):
            copies.wait_event(computed)
            for src, dst in pairs:
                src.record_stream(copies)
                dst.copy_(src, non_blocking=True)
            done.record()
        return done

    def __call__(self, theta: np.ndarray, seq: int) -> tuple[np.ndarray, float]:
        torch = self.torch
        t = time.perf_counter()
        start = None
        if self.on_gpu:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            src = self._pinned.get(theta.ctypes.data)
            self._flat.copy_(torch.from_numpy(theta) if src is None else src,
                             non_blocking=True)
        elif self._bound != theta.ctypes.data:  # the worker's pull buffer, the same each step
            self._bind(torch.from_numpy(theta))
            self._bound = theta.ctypes.data
        self.load_s += time.perf_counter() - t
        x, y = self._batch(seq)
        if self.group is not None:  # the members compute at this θ, each on its own part
            self.group.theta(self._flat if self.on_gpu else torch.from_numpy(theta), seq)
            x, y = self.group.part(x, y)
        turn = seq % len(self._deltas)
        if self._deferred:  # this turn's g, zeroed by the settle of two steps ago
            self._grad = self._grads[turn]
            self._bind_grads(self._grad)
        else:
            self._grad.zero_()
        with torch.autocast(self.device.type, dtype=self.amp or torch.float32,
                            enabled=self.amp is not None):
            loss = self.loss(self.model(x), y)
        loss.backward()  # accumulates into the views of self._grad (float32 parameters)
        if seq == self._first_seq:
            self._check_grads()
        if self.group is not None:  # the group's gradient: the mean over its G parts
            self.group.average(self._grad)
        if self.clip_norm > 0:  # before Δθ, and so before GEM's momentum fold
            torch.nn.utils.clip_grad_norm_(self.params, self.clip_norm)
        lr = self.lr if self.schedule.constant else float(self.schedule.eta(seq))
        self.delta = self._deltas[turn]
        if self._deferred:
            self._lrs[turn] = lr
            return None, float(loss.detach())  # Δθ: settle(), on the other thread
        torch.mul(self._grad, -lr, out=self.delta)  # Δθ, on the device
        if not self.on_gpu:
            return self.delta.numpy(), float(loss.detach())
        delta_host = self._delta_hosts[turn]
        done = self._to_host(((self.delta, delta_host),
                              (loss.detach().reshape(1), self._loss_host)), timing=True)
        self._prefetch(seq + 1)  # on the CPU, while the GPU computes this step
        done.synchronize()
        self.gpu_s += start.elapsed_time(done) / 1e3
        return delta_host.numpy(), float(self._loss_host[0])

    def settle(self, seq: int, delta: np.ndarray | None) -> np.ndarray:
        """Step ``seq``'s Δθ on the host: as computed, or (overlapped on the CPU) −ηg made
        now, its g zeroed for the step after next; on the thread that sends it."""
        if delta is not None:
            return delta
        turn = seq % len(self._deltas)
        self.torch.mul(self._grads[turn], -self._lrs[turn], out=self._deltas[turn])
        self._grads[turn].zero_()
        return self._deltas[turn].numpy()

    def _check_grads(self) -> None:
        """Autograd accumulates into an existing .grad in place; a model whose backward
        replaces it (or leaves a parameter without one) would send a stale Δθ: refuse."""
        lo = self._grad.data_ptr()
        hi = lo + self._grad.numel() * self._grad.element_size()
        for p in self.params:
            if p.grad is None or not lo <= p.grad.data_ptr() < hi:
                raise RuntimeError("a parameter's gradient left the worker's flat gradient "
                                   "buffer after backward (its .grad was replaced)")

    def host(self, a: object) -> np.ndarray:
        """A device array on the host (κ|m| before it is sent)."""
        if not self.on_gpu:
            return a.numpy()
        if self._a_host is None:
            self._a_host = self.torch.empty(a.numel(), dtype=self.torch.float32,
                                            pin_memory=True)
            self._a_copies = self.torch.cuda.Stream(self.device)
        self._to_host(((a, self._a_host),), stream=self._a_copies).synchronize()
        return self._a_host.numpy()

    def close(self) -> None:
        """End the data stream: its loader processes (--loader-workers) stop now."""
        self.batches.close()

    def extend(self, runs: list) -> None:
        """Dealt ``runs`` more batches (a departed worker's, issue 39) after its own plan:
        the stream goes on with them (the lr schedule stays the one of its own plan: a
        batch past its end takes the schedule's last η)."""
        own = self.plan if self.plan is not None else first_plans(
            self.data, self.n_workers, False)[self.rank - 1]
        start, self.plan = self.steps, own + list(runs)
        self.batches.close()
        self._next = None
        self.steps, self.batches = data_stream(self.data, self.rank, self.n_workers, start,
                                               self.plan)
        if self.group is not None:
            self.group.extend(self.plan[len(own):])

    def release(self) -> None:
        """The worker left the run: its data stream ends and its GPU memory goes back (the
        process itself stays until the job ends, see gem_mpi.engine.roster)."""
        self.close()
        if self.on_gpu:
            self.model.to("cpu")
            self._grads = self._deltas = []
            self._flat = self._grad = self.delta = None
            self.torch.cuda.empty_cache()


class TimeSplit:
    """Where a worker's time goes (the metrics file's /summary/worker_time): each
    :meth:`charge` adds the time since the previous one to a column, so the columns from
    the first pull to the last message add up to the wall time."""

    def __init__(self) -> None:
        self.columns = dict.fromkeys(WORKER_TIME_COLUMNS, 0.0)
        self.start = self.last = time.perf_counter()

    def charge(self, column: str) -> float:
        """Charge the seconds since the last charge to ``column``; returns them."""
        now = time.perf_counter()
        spent = now - self.last
        self.columns[column] += spent
        self.last = now
        return spent

    def final(self, load_s: float, gpu_s: float, backoff_s: float,
              group_s: float = 0.0) -> np.ndarray:
        """The DONE message's columns: the copy of θ into the model and a group's allreduce
        (--group-size) taken out of compute, the sleeps of the back-off out of waiting, the
        wall time since the first pull. With --worker-mode overlap the compute column is the
        wait for the compute thread and load_s and group_s, spent there, are 0 here."""
        c = dict(self.columns)  # a worker dealt more batches signs off again later
        c["load"], c["gpu"], c["backoff"], c["group"] = load_s, gpu_s, backoff_s, group_s
        c["compute"] -= load_s + group_s
        c["wait"] -= backoff_s
        c["wall"] = time.perf_counter() - self.start
        return np.array([c[k] for k in WORKER_TIME_COLUMNS], np.float32)


@dataclass(frozen=True)
class Step:
    """One computed step: Δθ on the host and where m lives, its loss and compute seconds."""

    delta: np.ndarray | None
    on_device: object
    loss: float
    compute_s: float


@dataclass
class _Worker:
    """One worker's parts, as :func:`_set_up` makes them."""

    cfg: Config
    rank: int  # the worker's number, 1..n
    steps_fn: _QuadraticSteps | _TorchSteps
    ep: WorkerShards
    rule: WorkerRule
    poison_all: Callable[[tuple[np.ndarray, ...]], None] | None
    slow_factor: float
    leaving: Callable[[], bool] = lambda: False  # SIGTERM reached this worker: leave the run
    split: TimeSplit = field(default_factory=TimeSplit)
    left_at: int | None = None  # its updates when it left (all committed)
    orders: int = 0  # the master's orders of more batches taken

    def leave_now(self, seq: int) -> bool:
        """Before step ``seq`` (updates 0..seq−1 committed): whether to leave the run now."""
        if self.leaving():
            self.left_at = seq
            return True
        return False

    def time_split(self) -> np.ndarray:
        """The columns of a DONE or LEFT message."""
        overlapped = self.cfg.optim.worker_mode == OVERLAP  # load_s was the compute thread's
        group = getattr(self.steps_fn, "group", None)
        return self.split.final(0.0 if overlapped else self.steps_fn.load_s,
                                self.steps_fn.gpu_s, self.ep.backoff_s,
                                0.0 if overlapped or group is None else group.allreduce_s)

    def compute(self, seq: int) -> tuple[np.ndarray, float, float]:
        """Δθ and the loss of step ``seq`` at the θ in hand, and its compute seconds (times
        the --straggler factor, slept here)."""
        delta, loss = self.steps_fn(self.ep.theta, seq)
        compute_s = self.split.charge("compute")  # θ into the model, forward, backward, Δθ
        compute_s = self.straggle(compute_s)
        self.split.charge("straggle")
        return delta, loss, compute_s

    def straggle(self, compute_s: float) -> float:
        """--straggler: this worker takes FACTOR times as long (the rest slept here)."""
        if self.slow_factor > 1.0:
            time.sleep((self.slow_factor - 1.0) * compute_s)
            compute_s *= self.slow_factor
        return compute_s

    def step(self, seq: int, theta: np.ndarray) -> Step:
        """Step ``seq`` at ``theta``, on the compute thread (--worker-mode overlap): no MPI,
        no time split (the thread that calls MPI keeps it)."""
        t = time.perf_counter()
        delta, loss = self.steps_fn(theta, seq)  # Δθ None: settle() makes it
        on_device = self.steps_fn.delta if isinstance(self.steps_fn, _TorchSteps) else None
        return Step(delta, on_device, loss, self.straggle(time.perf_counter() - t))

    def payload(self, delta: np.ndarray, s: np.ndarray,
                delta_on_device: object = None) -> tuple[np.ndarray, ...]:
        """The update's parts (GEM: Δθ, κ|m|, s after the fold); sharded, an update holding
        NaN/Inf in one shard's part is poisoned in every shard's, so every kernel rejects it.
        ``delta_on_device``: the step's Δθ where m lives (default: the last step's)."""
        if delta_on_device is None and isinstance(self.steps_fn, _TorchSteps):
            delta_on_device = self.steps_fn.delta
        parts = self.rule.payload(delta, s, delta_on_device, self.steps_fn.host)
        if self.poison_all is not None:
            self.poison_all(parts)
        self.split.charge("payload")
        return parts

    def report(self, seq: int, loss: float) -> None:
        if self.cfg.monitor.verbose and (seq + 1) % 100 == 0:
            print(f"gem_mpi: worker {self.rank}: step {seq + 1}/{self.steps_fn.steps} loss "
                  f"{loss:.4f} waited {self.split.columns['wait']:.1f} s", file=sys.stderr,
                  flush=True)


def _set_up(cfg: Config, comm: MPI.Intracomm, plan: Plan, problem: Problem,
            placement: Placement, start_seq: int, run_id: str,
            comms: list[MPI.Intracomm] | None, dealt: list | None = None,
            group: Group | None = None) -> _Worker:
    """The worker's steps, endpoint and rule; a resumed GEM worker's momentum restored."""
    rank = comm.Get_rank() - (plan.masters - 1)  # the worker's number, 1..n
    if problem.quadratic is not None:
        steps_fn: _QuadraticSteps | _TorchSteps = _QuadraticSteps(cfg.optim, cfg.data, problem,
                                                                  rank, dealt)
    else:
        steps_fn = _TorchSteps(cfg, problem, rank, plan.n_workers, placement, start_seq,
                               overlapped=cfg.optim.worker_mode == OVERLAP, plan=dealt,
                               group=group)
    ep = WorkerShards(comms or [comm], plan.layouts, plan.bounds,
                      poll_limit=cfg.runtime.poll_max_ms / 1000.0,
                      theta_into=steps_fn.pull_buffer)
    for endpoint in ep.eps:  # --worker-loss continue: freeing the windows meets a dead rank
        endpoint.tolerant = cfg.runtime.worker_loss == LOSS_CONTINUE
    on_device = isinstance(steps_fn, _TorchSteps)
    extension = None if cfg.runtime.no_extension else load_extension()[0]
    rule = WorkerRule(cfg.optim, steps_fn.delta if on_device else np.zeros(problem.n_params,
                                                                             np.float32),
                      resumed=start_seq > 0, extension=extension)
    momentum, directory = rule.momentum, cfg.outputs.checkpoint_dir
    if momentum is not None:
        momentum.folded = start_seq
        if start_seq and directory:  # a stopped run's momentum, if it matches
            found = checkpoint.load_worker_momentum(directory, rank, start_seq, run_id)
            if found is not None:
                momentum.restore(found, start_seq)
    if cfg.monitor.verbose:
        print(f"gem_mpi: worker {rank}: steps {start_seq}..{steps_fn.steps} on "
              f"{steps_fn.device}", file=sys.stderr, flush=True)
    return _Worker(cfg, rank, steps_fn, ep, rule,
                   plan.poison_all if plan.masters > 1 else None,
                   slowness(cfg, comm.Get_size(), rank))


def _wait_order(w: _Worker, start_seq: int, version: object) -> tuple[bool, object]:
    """--worker-mode wait: commit Δθ with s the θ it was computed on, wait for its
    application, pull. Returns (stopped by the master, the last version pulled)."""
    ep, split = w.ep, w.split
    for seq in range(start_seq, w.steps_fn.steps):
        if w.leave_now(seq):
            return False, version
        delta, loss, compute_s = w.compute(seq)
        parts = w.payload(delta, ep.theta)
        ep.commit(UPDATE, seq, version, loss, compute_s, parts)
        split.charge("commit")
        if not ep.wait_slot_free():
            return True, version
        split.charge("wait")
        version = ep.pull()
        split.charge("pull")
        w.report(seq, loss)
    return False, version


def _pipelined_order(w: _Worker, start_seq: int, version: object) -> tuple[bool, object]:
    """--worker-mode pipelined, Algorithm 1's order: the previous update was being applied
    while this one was computed; wait for its slot, then θ ← pull(), commit Δθ, s ← θ. m
    folds Δθ only then, so a stop during the wait leaves m one fold ahead at most."""
    ep, split = w.ep, w.split
    s_copy = np.empty_like(ep.theta) if w.rule.with_s else None
    for seq in range(start_seq, w.steps_fn.steps):
        if w.leave_now(seq):  # its last update may be in flight: LEFT waits for its slot
            return False, version
        delta, loss, compute_s = w.compute(seq)
        if not ep.wait_slot_free():
            return True, version
        split.charge("wait")
        s = ep.theta
        if s_copy is not None and w.rule.sends_s:  # the pull below overwrites ep.theta
            np.copyto(s_copy, ep.theta)
            s = s_copy
        parts = w.payload(delta, s)
        pulled = ep.pull()
        split.charge("pull")
        ep.commit(UPDATE, seq, version, loss, compute_s, parts)
        split.charge("commit")
        version = pulled
        w.report(seq, loss)
    stopped = not ep.wait_slot_free()  # the last update's turn
    split.charge("wait")
    return stopped, version


def _overlap_order(w: _Worker, start_seq: int, version: object) -> tuple[bool, object]:
    """--worker-mode overlap: a compute thread computes step k+1 at θ_{k+1} while this
    thread, the one that started MPI (FUNNELED), waits for the slot, pulls θ_{k+2}, folds m
    and commits step k, so that a step costs the longer of the two, not their sum. θ takes
    turns among three buffers: the one being computed at, the one step k was computed at (s
    of its update, intact until its commit) and the one pulled into. The pull comes after
    the slot is free and before the commit, so it never meets the master's write of the
    update just committed (a torn read, read again), and θ_{k+2} holds update k-1. m folds
    Δθ only once the slot is free, right before the commit, as in pipelined: a stop leaves m
    one fold ahead at most. The split is this thread's: compute is its wait for the compute
    thread."""
    ep, split, steps = w.ep, w.split, w.steps_fn.steps
    if start_seq >= steps:
        return False, version
    pinned = w.steps_fn.pull_buffers
    thetas = [ep.theta, *(pinned[k] if k < len(pinned) else np.empty_like(ep.theta)
                          for k in (1, 2))]
    versions = [version] * 3
    with ThreadPoolExecutor(1, thread_name_prefix="gem-compute",
                            initializer=w.steps_fn.compute_thread) as pool, \
            w.steps_fn.comm_stream():
        running: Future = pool.submit(w.step, start_seq, thetas[0])
        try:
            if start_seq + 1 < steps:
                versions[1] = ep.pull(thetas[1])
                split.charge("pull")
            for seq in range(start_seq, steps):
                turn = (seq - start_seq) % 3
                if w.leave_now(seq):  # step seq, computed or not, is abandoned
                    return False, versions[turn]
                done = running.result()
                split.charge("compute")
                if seq + 1 < steps:
                    running = pool.submit(w.step, seq + 1, thetas[(turn + 1) % 3])
                if not ep.wait_slot_free():
                    return True, versions[turn]
                split.charge("wait")
                if seq + 2 < steps:
                    versions[(turn + 2) % 3] = ep.pull(thetas[(turn + 2) % 3])
                    split.charge("pull")
                delta = w.steps_fn.settle(seq, done.delta)
                parts = w.payload(delta, thetas[turn], done.on_device)
                ep.commit(UPDATE, seq, versions[turn], done.loss, done.compute_s, parts)
                split.charge("commit")
                w.report(seq, done.loss)
        finally:  # a stop or an error: the step in hand ends before the pool does
            running.cancel()
    stopped = not ep.wait_slot_free()  # the last update's turn
    split.charge("wait")
    return stopped, versions[turn]


ORDERS = {PIPELINED: _pipelined_order, OVERLAP: _overlap_order}


DEPARTED = -1  # run_worker's own code for a worker that left the run (never a stop word)


def _sign_off_done(w: _Worker, version: object) -> tuple[int, list | None]:
    """Its plan trained: DONE with the time split, then the master's word (code, None) or an
    order of more batches (RUNNING, runs), or SIGTERM meanwhile (RUNNING, None)."""
    w.ep.commit(DONE, w.steps_fn.steps, version, parts=(w.time_split(),))
    code, runs = w.ep.wait_word_or_order(w.orders, w.leaving)
    if runs is not None:
        w.orders += 1
    return code, runs


def _save_momentum(w: _Worker, run_id: str) -> None:
    """A GEM worker's m beside the checkpoints, for the resume that gives it back."""
    momentum, directory = w.rule.momentum, w.cfg.outputs.checkpoint_dir
    if momentum is not None and directory:
        m, prev = momentum.arrays()
        checkpoint.save_worker_momentum(directory, w.rank, momentum.folded, m, prev, run_id)


def _leave(w: _Worker, version: object, run_id: str) -> int:
    """SIGTERM: sign off with LEFT once its last update is applied (its m saved first, so a
    kill right after loses nothing), tell its group, give back its device and loader
    processes, and wait for the end of the run, which a process cannot leave before under
    MPI (the windows are freed together). Returns DEPARTED, or the master's word if the run
    ended before the worker could sign off."""
    ep = w.ep
    if not ep.wait_slot_free():  # the run ended meanwhile: it leaves as every worker does
        return ep.stop_code()
    _save_momentum(w, run_id)
    ep.commit(LEFT, w.left_at, version, parts=(w.time_split(),))
    group = getattr(w.steps_fn, "group", None)
    if group is not None:
        group.end(FINISHED)  # the members exit 0 now
    if w.cfg.monitor.verbose:
        print(f"gem_mpi: worker {w.rank}: left after {w.left_at} updates (SIGTERM); waiting "
              "for the end of the run", file=sys.stderr, flush=True)
    w.steps_fn.release()
    ep.wait_slot_free()  # the master took LEFT (or ended the run)
    ep.wait_shutdown(limit=0.5)
    return DEPARTED


def _finish(w: _Worker, code: int, run_id: str) -> int:
    """The master's stop word heard: a stopped GEM worker's momentum saved for the resume."""
    # only a stop by signal keeps m for a resume: a diverged run's m is no state to resume
    # from, and it must not replace the m an earlier stop saved beside the last good checkpoint
    if code == STOPPED:
        _save_momentum(w, run_id)
    w.ep.close()  # signs the roll: this worker's files are written
    return code


def run_worker(cfg: Config, comm: MPI.Intracomm, shards_plan: Plan, problem: Problem,
               placement: Placement, start_seq: int = 0, run_id: str = "",
               comms: list[MPI.Intracomm] | None = None, plan: list | None = None,
               group: Group | None = None, leaving: Callable[[], bool] = lambda: False) -> int:
    """Train until the data budget is used (or the master stops the run early); returns the
    master's stop word (one of gem_mpi.protocol's stop words), FINISHED if it left the run
    (``leaving()`` became true: SIGTERM reached it, gem_mpi.engine.roster).

    ``start_seq`` > 0 resumes from a checkpoint: the first ``start_seq`` updates of this
    worker were applied before it, so its data stream continues after them. ``comms``: each
    shard's communicator (:func:`gem_mpi.transport.endpoints.shard_comm`; default ``comm``,
    one master). The worker's number (1..n) is its rank less the masters' ranks before it
    but one, so worker w reads the same data, whatever --masters. ``plan``: its batches
    once the run changed its number of workers (:mod:`gem_mpi.problem.elastic`). ``group``:
    this rank leads a worker group (--group-size, :mod:`gem_mpi.engine.group`).
    """
    w = _set_up(cfg, comm, shards_plan, problem, placement, start_seq, run_id, comms, plan,
                group)
    w.leaving = leaving
    order = ORDERS.get(cfg.optim.worker_mode, _wait_order)
    code = 0
    try:
        start = start_seq
        while not code:
            version = w.ep.pull()
            w.split.charge("pull")
            stopped, version = order(w, start, version)
            if stopped:
                code = w.ep.stop_code()
            elif w.left_at is None:  # its plan trained: done, or dealt more batches
                code, runs = _sign_off_done(w, version)
                if runs is not None:
                    start = w.steps_fn.steps
                    w.steps_fn.extend(runs)
                    continue
                if not code:  # SIGTERM while it waited: it leaves with its plan done
                    w.left_at = w.steps_fn.steps
            if w.left_at is not None:
                code = _leave(w, version, run_id)
    finally:  # however the loop ended: no loader process outlives it
        w.steps_fn.close()
    if code == DEPARTED:  # it left the live run: exit 0 whatever the others do
        w.ep.close()
        return FINISHED
    return _finish(w, code, run_id)
