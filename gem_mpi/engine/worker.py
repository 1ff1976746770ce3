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

import sys
from collections.abc import Callable
from typing import Any

from gem_mpi.algorithm.dylu import WorkerSteps
from gem_mpi.algorithm.kernel import load_extension
from gem_mpi.algorithm.optim import States
from gem_mpi.algorithm.rule import Momentum, WorkerRule
from gem_mpi.config import LOSS_CONTINUE, OVERLAP, Config
from gem_mpi.engine.group import Group
from gem_mpi.engine.orders import ORDERS, Versions, wait_order
from gem_mpi.engine.shards import Plan
from gem_mpi.engine.steps import QuadraticSteps, Steps, TorchSteps
from gem_mpi.engine.worker_step import WorkerStep
from gem_mpi.outputs import checkpoint
from gem_mpi.problem import Problem
from gem_mpi.protocol import DONE, FINISHED, LEFT, STOPPED
from gem_mpi.run.profiler import StepProfiler
from gem_mpi.run.rank import Placement, slowness
from gem_mpi.transport import MPI
from gem_mpi.transport.endpoints import WorkerShards


def _set_up(cfg: Config, comm: MPI.Intracomm, plan: Plan, problem: Problem,
            placement: Placement, start_seq: int, run_id: str,
            comms: list[MPI.Intracomm] | None, dealt: list | None = None,
            group: Group | None = None) -> WorkerStep:
    """The worker's steps, endpoint and rule; a resumed GEM worker's momentum restored."""
    rank = comm.Get_rank() - (plan.masters - 1)  # the worker's number, 1..n
    if problem.quadratic is not None:
        steps_fn: Steps[Any] = QuadraticSteps(cfg.optim, cfg.data, problem, rank, dealt,
                                               cfg.adamw)
    else:
        steps_fn = TorchSteps(cfg, problem, rank, plan.n_workers, placement, start_seq,
                              overlapped=cfg.optim.worker_mode == OVERLAP, plan=dealt,
                              group=group)
    ep = WorkerShards(comms or [comm], plan.layouts, plan.bounds,
                      poll_limit=cfg.runtime.poll_max_ms / 1000.0,
                      theta_into=steps_fn.pull_buffer)
    for endpoint in ep.eps:  # --worker-loss continue: freeing the windows meets a dead rank
        endpoint.tolerant = cfg.runtime.worker_loss == LOSS_CONTINUE
    extension = None if cfg.runtime.no_extension else load_extension()[0]
    rule = WorkerRule(cfg.optim, steps_fn.momentum_like(), resumed=start_seq > 0,
                      extension=extension)
    state, directory = own_state(steps_fn, rule), cfg.outputs.checkpoint_dir
    if state is not None:
        state.folded = start_seq
        if start_seq and directory:  # a stopped run's state, if it matches
            found = checkpoint.load_worker_state(directory, rank, start_seq, run_id)
            if found is not None and set(found) == set(state.arrays()[0]):  # its optimizer's
                state.restore(found, start_seq)
    if cfg.monitor.verbose:
        print(f"gem_mpi: worker {rank}: steps {start_seq}..{steps_fn.steps} on "
              f"{steps_fn.device}", file=sys.stderr, flush=True)
    return WorkerStep(cfg, rank, steps_fn, ep, rule,
                       plan.poison_all if plan.masters > 1 else None,
                       slowness(cfg, comm.Get_size(), rank),
                       StepProfiler(cfg.outputs, getattr(steps_fn.device, "type", "") == "cuda"),
                       dylu=WorkerSteps(cfg.optim.local_steps) if cfg.optim.dylu else None)


DEPARTED = -1  # run_worker's own code for a worker that left the run (never a stop word)


def _sign_off_done(w: WorkerStep, version: Versions) -> tuple[int, list | None]:
    """Its plan trained: DONE with the time split, then the master's word (code, None) or an
    order of more batches (RUNNING, runs), or SIGTERM meanwhile (RUNNING, None)."""
    w.ep.commit(DONE, w.steps_fn.steps, version, parts=(w.time_split(),))
    code, runs = w.ep.wait_word_or_order(w.orders, w.leaving)
    if runs is not None:
        w.orders += 1
    return code, runs


def own_state(steps_fn: Steps[Any], rule: WorkerRule) -> States | Momentum | None:
    """The optimizer state a worker keeps across its updates: its own optimizer's (AdamW,
    --local-steps'), or GEM's m (momentum SGD's other methods keep none)."""
    return steps_fn.own if steps_fn.own is not None else rule.momentum


def _save_momentum(w: WorkerStep, run_id: str) -> None:
    """A worker's own optimizer state beside the checkpoints, for the resume that gives it
    back."""
    state, directory = own_state(w.steps_fn, w.rule), w.cfg.outputs.checkpoint_dir
    if state is not None and directory:
        checkpoint.save_worker_state(directory, w.rank, state.folded, state.arrays(), run_id)


def _leave(w: WorkerStep, version: Versions, run_id: str) -> int:
    """SIGTERM: sign off with LEFT once its last update is applied (its m saved first, so a
    kill right after loses nothing), tell its group, give back its device and loader
    processes, and wait for the end of the run, which a process cannot leave before under
    MPI (the windows are freed together). Returns DEPARTED, or the master's word if the run
    ended before the worker could sign off."""
    ep = w.ep
    assert w.left_at is not None, "leave_now() or the wait after DONE set it"
    if not ep.wait_slot_free():  # the run ended meanwhile: it leaves as every worker does
        return ep.stop_code()
    _save_momentum(w, run_id)
    ep.commit(LEFT, w.left_at, version, parts=(w.time_split(),))
    if w.steps_fn.group is not None:
        w.steps_fn.group.end(FINISHED)  # the members exit 0 now
    if w.cfg.monitor.verbose:
        print(f"gem_mpi: worker {w.rank}: left after {w.left_at} updates (SIGTERM); waiting "
              "for the end of the run", file=sys.stderr, flush=True)
    w.steps_fn.release()
    ep.wait_slot_free()  # the master took LEFT (or ended the run)
    ep.wait_shutdown(limit=0.5)
    return DEPARTED


def _finish(w: WorkerStep, code: int, run_id: str) -> int:
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
    order = ORDERS.get(cfg.optim.worker_mode, wait_order)
    code = 0
    try:
        start = start_seq
        w.profiler.start()  # --profile-steps: its steps, from the first pull to its sign-off
        while not code:
            version = w.ep.pull()
            w.split.charge("pull")
            stopped, version = order(w, start, version)
            w.profiler.close()
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
        w.profiler.close()
        w.steps_fn.close()
    if code == DEPARTED:  # it left the live run: exit 0 whatever the others do
        w.ep.close()
        return FINISHED
    return _finish(w, code, run_id)
