"""One run's life on every rank, whoever started it: the command line (gem_mpi.train) or
Python (gem_mpi.fit).

Rank 0 validates the whole configuration (the data and the user's code included) and
broadcasts the verdict, so a bad input is one line from rank 0 and the same error on every
rank. Then every rank takes its part: the master, a worker, or a synchronous worker.
"""

from __future__ import annotations

import sys
import traceback
import uuid

import numpy as np

from gem_mpi import config, methods
from gem_mpi.algorithm.kernel import kernel_threads
from gem_mpi.baseline.sync import check_face, run_sync
from gem_mpi.engine import shards
from gem_mpi.engine.group import Group, run_member
from gem_mpi.engine.master import Master, Role, start_master
from gem_mpi.engine.shards import shard_cut
from gem_mpi.engine.worker import run_worker
from gem_mpi.errors import GemError, UsageError
from gem_mpi.outputs import checkpoint
from gem_mpi.outputs.lock import RUN_LOCKS
from gem_mpi.outputs.metrics import check_resumable
from gem_mpi.problem import Problem, build_problem, elastic, preload
from gem_mpi.run.preflight import validate
from gem_mpi.run.rank import (
    device_name,
    gather_placement,
    group_check,
    local_placement,
    lower_priority,
    plans_now,
    torch_device,
    worker_nice,
)
from gem_mpi.run.supervisor import (
    EXIT_CODES,
    EXIT_USAGE,
    OUTCOME_OF,
    Outcome,
    RunSupervisor,
    StopFlag,
    say,
)
from gem_mpi.transport import MASTER, MPI, soft_barrier, thread_check, window_check
from gem_mpi.transport.runtime import node_count


def thread_level(cfg: config.Config | None) -> str:
    """MULTIPLE for --method sync (Horovod's thread calls MPI beside ours); FUNNELED for the
    asynchronous methods, whose one-sided windows Open MPI refuses under MULTIPLE."""
    return "funneled" if cfg is None else methods.of(cfg.method).threads


def prepare(cfg: config.Config, comm: MPI.Intracomm
            ) -> tuple[str | None, checkpoint.Checkpoint | None, bool]:
    """Collective: (None, the checkpoint to resume or None, False) when the run can start,
    (the one-line error, None, False) when it cannot, and (None, that checkpoint on rank 0, True)
    when the checkpoint to resume is a finished run's end: there is nothing to do."""
    error, resumed = None, None
    if comm.Get_rank() == MASTER:
        try:
            resumed = _check_on_master(cfg, comm.Get_size())
        except GemError as exc:
            error = str(exc)
    else:
        preload(cfg.data)  # torch's import, meanwhile: not after rank 0's checks
    soft_barrier(comm)  # the others sleep while rank 0 checks the data
    error = comm.bcast(error, root=MASTER)
    if error is None and comm.bcast(resumed is not None and resumed.finished, root=MASTER):
        RUN_LOCKS.release()
        return None, resumed, True  # the run ended already: a resume adds nothing
    if error is None and not config.synchronous(cfg.method):
        error = window_check(comm)  # a stack that cannot make the windows: one line, exit 2
    if error is None and cfg.optim.worker_mode == config.OVERLAP:
        error = thread_check(comm)  # a compute thread beside the MPI one
    if error is None and cfg.runtime.group_size > 1:
        error = group_check(comm, cfg.runtime.masters, cfg.runtime.group_size)
    if error is None and cfg.method == config.DILOCO and node_count(comm) > 1:
        error = ("--method diloco runs on one node: torchft's lighthouse, stores and managers "
                 "listen on loopback alone, and its managers would advertise loopback to the "
                 "other nodes; across nodes use --method ddp or an asynchronous method")
    if error is not None:
        RUN_LOCKS.release(refused=True)  # nothing runs: the outputs are as they were
    return error, resumed, False


def _check_on_master(cfg: config.Config, size: int) -> checkpoint.Checkpoint | None:
    """Every check that can be made before any work; returns the checkpoint to resume."""
    validate(cfg, size)  # the data too: there, intact, and a batch per worker
    if config.synchronous(cfg.method):
        check_face(cfg.method)  # its engine's library, installed and working
    else:
        kernel_threads()  # GEM_NUM_THREADS
        if cfg.runtime.masters > 1:  # θ is cut between tensors: enough of them?
            try:
                shard_cut(build_problem(cfg.data, with_theta0=False).sizes, cfg.runtime.masters)
            except ValueError as exc:
                raise UsageError(str(exc)) from None
    out = cfg.outputs  # one run writes them at a time, from here to the run's end
    if out.metrics:
        RUN_LOCKS.take(out.metrics, "--metrics")
    if out.checkpoint_dir:
        RUN_LOCKS.take(out.checkpoint_dir, "--checkpoint-dir", directory=True)
    return _resume(cfg, config.n_workers(cfg, size))


def _resume(cfg: config.Config, n_workers: int) -> checkpoint.Checkpoint | None:
    """Rank 0: the checkpoint to continue from (with what this resume changes), or None.
    Refuses, before anything is written, a checkpoint of another setting and a metrics
    file of another run."""
    out = cfg.outputs
    path = checkpoint.resolve(out.resume, out.checkpoint_dir, out.run_id)
    if path is None:
        if out.resume:
            whose = f"of run {out.run_id} " if out.run_id else ""
            say(f"--resume auto: no checkpoint {whose}in {out.checkpoint_dir} yet, starting "
                "afresh")
        return None
    ckpt = checkpoint.load(path)
    if out.resume == "auto":
        say(f"--resume auto: continuing run {ckpt.run_id} from {path}")
    checkpoint.check_compatible(ckpt, cfg.as_dict(), n_workers)
    if out.metrics:
        shard_rows = ckpt.rows_shards
        check_resumable(out.metrics, ckpt.run_id, path, ckpt.rows,
                        [] if shard_rows is None else [int(r) for r in shard_rows])
    if ckpt.finished:
        say(f"resume: run {ckpt.run_id} finished already ({ckpt.clock} "
            f"{'steps' if config.synchronous(cfg.method) else 'updates'}, checkpoint {path}): "
            "nothing to do, nothing written")
        return ckpt
    ckpt.changes = checkpoint.changes(ckpt, cfg.as_dict())
    if ckpt.n_workers != n_workers:
        ckpt = _deal(cfg, ckpt, n_workers)
    return ckpt


def _deal(cfg: config.Config, ckpt: checkpoint.Checkpoint, m: int) -> checkpoint.Checkpoint:
    """A checkpoint of n workers continued by m: the batches its workers had not done dealt
    anew (gem_mpi.problem.elastic), recorded in the checkpoint and the metrics file."""
    n = ckpt.n_workers
    plans = plans_now(cfg, n, ckpt.data_plan)
    done = [int(k) for k in ckpt.next_seq]
    dealt = elastic.redeal(plans, done, m)
    next_seq = np.array([done[w] if w < n else 0 for w in range(m)], np.int64)
    changes = {**ckpt.changes, "workers": [n, m]}
    ckpt = checkpoint.resize(ckpt, next_seq, elastic.to_array(dealt))
    ckpt.changes = changes
    return ckpt


def _shard_of(comm: MPI.Intracomm, plan: shards.Plan, rank: int,
              resumed: checkpoint.Checkpoint | None) -> checkpoint.Checkpoint | None:
    """Among the masters: rank 0 gives each shard its part of the checkpoint
    (:meth:`~gem_mpi.outputs.checkpoint.Checkpoint.shard`); every master returns its own."""
    if rank != MASTER:
        return comm.recv(source=MASTER, tag=11)
    pieces = [None if resumed is None else resumed.shard(k, bounds)
              for k, bounds in enumerate(plan.bounds)]
    for k in range(1, plan.masters):
        comm.send(pieces[k], dest=k, tag=11)
    return pieces[0]


def run(cfg: config.Config, comm: MPI.Intracomm, resumed: checkpoint.Checkpoint | None = None,
        result: dict | None = None) -> Outcome:
    """This rank's part of the run: the master, a worker, or a synchronous worker.
    ``result``, if given, receives on rank 0 the final θ and the model it was loaded into."""
    try:
        return _run(cfg, comm, resumed, result)
    finally:
        RUN_LOCKS.release()  # rank 0's locks on its outputs (no-op elsewhere)


def _run(cfg: config.Config, comm: MPI.Intracomm, resumed: checkpoint.Checkpoint | None,
         result: dict | None) -> Outcome:
    stop = StopFlag().install()
    rank = comm.Get_rank()
    sync = methods.of(cfg.method).synchronous  # no master: the synchronous step loop
    masters = cfg.runtime.masters if not sync else 1
    placement = local_placement(comm, masters)  # collective: every rank, before the windows
    if not sync and rank >= masters:  # before its threads and loaders start: they inherit it
        lower_priority(worker_nice(cfg.runtime.worker_nice, placement,
                                   cfg.optim.worker_mode == config.OVERLAP))
    problem = build_problem(cfg.data, with_theta0=rank < masters)
    n_workers = config.n_workers(cfg, comm.Get_size())  # a group of ranks counts as one
    group_comm = None
    if cfg.runtime.group_size > 1 and not sync:
        world = comm
        comm, group_comm = _split_groups(world, cfg.runtime.group_size, masters)
        if comm is None:  # a group's member: its leader is the worker the master sees
            return _member(cfg, world, group_comm, problem, placement)
        rank = comm.Get_rank()  # a master's or a leader's place among the engine's ranks
    # --verbose: rank 0 learns where every rank runs, for its placement line
    ranks = gather_placement(comm, placement, cfg.runtime.threads, problem.quadratic is None
                             ) if cfg.monitor.verbose and not sync else None
    if resumed is not None and resumed.theta.size != problem.n_params:
        raise UsageError(f"--resume {resumed.path!r} holds {resumed.theta.size} "
                         f"parameters, this model has {problem.n_params}")
    state = methods.of(cfg.method).master_state(cfg.optim)
    if (resumed is not None and state is not None
            and getattr(resumed.proxy_m, "shape", None) != (problem.n_params,)):
        raise UsageError(f"--resume {resumed.path!r} lacks {state} of {problem.n_params} "
                         "parameters")
    if sync:
        return run_sync(cfg, comm, problem, placement, stop, resumed, result)
    plan = shards.plan(cfg, problem, n_workers)
    soft_barrier(comm)
    # every rank learns the run's id (a new one on a fresh start) and where it resumes
    run_id = (cfg.outputs.run_id or uuid.uuid4().hex) if resumed is None else resumed.run_id
    start_seqs, run_id, plans = comm.bcast((
        None if resumed is None else resumed.next_seq.tolist(), run_id,
        None if resumed is None or resumed.data_plan is None
        else elastic.from_array(resumed.data_plan, n_workers)), root=MASTER)
    role = None
    comms, link = shards.connect(comm, plan)  # collective; [comm], None with one master
    if link is not None and rank < masters:
        role = Role(rank, plan, link)
        resumed = _shard_of(comm, plan, rank, resumed)
    if rank < masters:
        master = start_master(cfg, comms[rank], plan.layouts[rank], problem, resumed,
                              placement, ranks, role)
        supervise(master, cfg, problem, stop, resumed, run_id)
        outcome = master.run()
        if result is not None and rank == MASTER:
            result.update(theta=master.final_theta, summary=master.sup.summary)
        return outcome
    worker = rank - masters + 1  # 1..n
    start_seq = 0 if start_seqs is None else start_seqs[worker - 1]
    dealt = None if plans is None else plans[worker - 1]
    group = None
    if group_comm is not None:  # this worker leads a group: its members start where it does
        group_comm.bcast((worker, n_workers, start_seq, dealt), root=0)
        group = Group(cfg, group_comm, torch_device(cfg.runtime.threads, placement))
        _say_group(cfg, group_comm, placement, worker)
    code = run_worker(cfg, comm, plan, problem, placement, start_seq=start_seq,
                      run_id=run_id, comms=comms, plan=dealt, group=group,
                      leaving=stop.terminated)
    if group is not None:
        group.end(code)
        group.close()
    # the master alone reports how the run ended; every rank exits with its code
    return OUTCOME_OF.get(code, Outcome.FAILED)


def _split_groups(world: MPI.Intracomm, size: int, masters: int
                  ) -> tuple[MPI.Intracomm | None, MPI.Intracomm | None]:
    """Collective: (the communicator the engine runs on, the masters and each group's leader,
    or None on a member; this worker rank's group, leader first, or None on a master)."""
    rank = world.Get_rank()
    member = (rank - masters) % size if rank >= masters else -1
    group = world.Split((rank - masters) // size if rank >= masters else MPI.UNDEFINED, rank)
    engine = world.Split(0 if member <= 0 else MPI.UNDEFINED, rank)
    return (None if engine == MPI.COMM_NULL else engine,
            None if group == MPI.COMM_NULL else group)


def _say_group(cfg: config.Config, group_comm: MPI.Intracomm, placement: object,
               worker: int) -> None:
    """--verbose: the leader names its group's ranks, their node (MPI's: its first rank) and
    devices, in one line. Collective over the group."""
    rows = group_comm.gather((MPI.COMM_WORLD.Get_rank(), placement.node, device_name(
        placement, True)), root=0)
    if cfg.monitor.verbose and rows is not None:
        ranks, nodes, devices = zip(*rows)
        say(f"group {worker}: ranks {', '.join(map(str, ranks))} (leader {ranks[0]}) on the "
            f"node of rank {', '.join(sorted(set(map(str, nodes))))}, devices "
            f"{', '.join(devices)}, {group_comm.Get_size()} × --batch-size a step")


def _member(cfg: config.Config, world: MPI.Intracomm, group_comm: MPI.Intracomm,
            problem: Problem, placement: object) -> Outcome:
    """A group member's part: where its leader starts, then the member's loop."""
    worker, n_workers, start_seq, dealt = group_comm.bcast(None, root=0)
    group = Group(cfg, group_comm, torch_device(cfg.runtime.threads, placement))
    _say_group(cfg, group_comm, placement, worker)
    try:
        code = run_member(cfg, group, problem, placement, worker, n_workers, start_seq, dealt)
    finally:
        group.close()
    return OUTCOME_OF.get(code, Outcome.FAILED)



def supervise(master: Master, cfg: config.Config, problem: Problem, stop: StopFlag,
              resumed: checkpoint.Checkpoint | None, run_id: str | None = None) -> None:
    """Give ``master`` its supervisor: a follower's on the other masters of a sharded run,
    else the run's, with rank 0's side of the followers (the lead) when θ is sharded. Each
    restores its part of ``resumed``."""
    role = master.role
    if role is not None and role.shard > 0:
        master.attach(shards.Follower(master, role.link, role.shard, cfg.monitor.exit_timeout,
                                      resumed))
        return
    sup = RunSupervisor(cfg, problem, master.n_workers, master, master.kernel_name, stop,
                        resumed, eval_threads=master.eval_threads, run_id=run_id)
    lead = None if role is None else shards.Lead(role.link, role.plan.masters, sup,
                                                 master.ep.progress)
    master.attach(sup, lead)


def abort(comm: MPI.Intracomm, exc: BaseException) -> None:
    """End the whole job from this rank: its one message (or its traceback), then
    MPI_Abort, so that no other rank waits forever for it."""
    if isinstance(exc, GemError):
        say(f"rank {comm.Get_rank()}: error: {exc}")
        code = EXIT_USAGE
    else:
        text = traceback.format_exc()
        sys.stderr.write(
            "".join(f"[rank {comm.Get_rank()}] {line}\n" for line in text.rstrip().splitlines())
        )
        sys.stderr.flush()
        code = EXIT_CODES[Outcome.FAILED]
    comm.Abort(code)
