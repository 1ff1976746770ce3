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

from gem_mpi import config
from gem_mpi.algorithm.kernel import kernel_threads
from gem_mpi.baseline.sync import check_horovod, run_sync
from gem_mpi.engine import shards
from gem_mpi.engine.master import Role, start_master
from gem_mpi.engine.worker import run_worker
from gem_mpi.errors import GemError, UsageError
from gem_mpi.outputs import checkpoint
from gem_mpi.outputs.metrics import check_resumable
from gem_mpi.problem import build_problem
from gem_mpi.protocol import shard_cut
from gem_mpi.run.preflight import validate
from gem_mpi.run.rank import gather_placement, local_placement
from gem_mpi.run.supervisor import (
    EXIT_CODES,
    EXIT_USAGE,
    OUTCOME_OF,
    Outcome,
    StopFlag,
    say,
)
from gem_mpi.transport import MASTER, MPI, soft_barrier, window_check


def thread_level(cfg: config.Config | None) -> str:
    """MULTIPLE for --method sync (Horovod's thread calls MPI beside ours); FUNNELED for the
    asynchronous methods, whose one-sided windows Open MPI refuses under MULTIPLE."""
    return "multiple" if cfg is not None and cfg.method == config.SYNC else "funneled"


def prepare(cfg: config.Config, comm: MPI.Intracomm) -> tuple[str | None, dict | None]:
    """Collective: (None, the checkpoint to resume or None) when the run can start, else
    (the one-line error, None) on every rank."""
    error, resumed = None, None
    if comm.Get_rank() == MASTER:
        try:
            resumed = _check_on_master(cfg, comm.Get_size())
        except GemError as exc:
            error = str(exc)
    soft_barrier(comm)  # the others sleep while rank 0 checks the data
    error = comm.bcast(error, root=MASTER)
    if error is None and cfg.method != config.SYNC:
        error = window_check(comm)  # a stack that cannot make the windows: one line, exit 2
    return error, resumed


def _check_on_master(cfg: config.Config, size: int) -> dict | None:
    """Every check that can be made before any work; returns the checkpoint to resume."""
    validate(cfg, size)  # the data too: there, intact, and a batch per worker
    if cfg.method == config.SYNC:
        check_horovod()
    else:
        kernel_threads()  # GEM_NUM_THREADS
        if cfg.runtime.masters > 1:  # θ is cut between tensors: enough of them?
            try:
                shard_cut(build_problem(cfg.data, with_theta0=False).sizes, cfg.runtime.masters)
            except ValueError as exc:
                raise UsageError(str(exc)) from None
    return _resume(cfg, config.n_workers(cfg, size))


def _resume(cfg: config.Config, n_workers: int) -> dict | None:
    """Rank 0: the checkpoint's state (θ under "theta", its path under "path", what this
    resume changes under "changes"), or None. Refuses, before anything is written, a
    checkpoint of another setting and a metrics file of another run."""
    out = cfg.outputs
    if not out.resume:
        return None
    path = checkpoint.resolve(out.resume, out.checkpoint_dir)
    if path is None:
        say(f"--resume auto: no checkpoint in {out.checkpoint_dir} yet, starting afresh")
        return None
    theta, state = checkpoint.load(path)
    checkpoint.check_compatible(state, cfg.as_dict(), n_workers, path)
    if out.metrics:
        shard_rows = state.get("rows_shards")
        check_resumable(out.metrics, state["run_id"], path,
                        (state["rows_updates"], state["rows_eval"], state["rows_rejected"]),
                        [] if shard_rows is None else [int(r) for r in shard_rows])
    return {**state, "theta": theta, "path": path,
            "changes": checkpoint.changes(state, cfg.as_dict())}


def _shard_of(comm: MPI.Intracomm, plan: object, rank: int,
              resumed: dict | None) -> dict | None:
    """Among the masters: rank 0 gives each shard its part of the checkpoint (θ, its clock,
    tickets, kept s and the global proxy's m, each sliced like θ); every master returns its
    own (rank 0 keeps the rest too)."""
    masters = plan.masters
    if rank == MASTER:
        pieces = []
        for k, (lo, hi) in enumerate(plan.bounds):
            piece = None
            if resumed is not None:
                kept, proxy_m = resumed.get("kept_s"), resumed.get("proxy_m")
                piece = {"theta": resumed["theta"][lo:hi],
                         "clock": int(resumed["shard_clock"][k]),
                         "tickets": int(resumed["shard_tickets"][k]),
                         "next_seq": resumed["next_seq"],
                         "kept_s": None if kept is None else kept[:, lo:hi],
                         "proxy_m": None if proxy_m is None else proxy_m[lo:hi]}
            pieces.append(piece)
        for k in range(1, masters):
            comm.send(pieces[k], dest=k, tag=11)
        return None if resumed is None else {**resumed, **pieces[0]}
    return comm.recv(source=MASTER, tag=11)


def run(cfg: config.Config, comm: MPI.Intracomm, resumed: dict | None = None,
        result: dict | None = None) -> Outcome:
    """This rank's part of the run: the master, a worker, or a synchronous worker.
    ``result``, if given, receives on rank 0 the final θ and the model it was loaded into."""
    stop = StopFlag().install()
    rank = comm.Get_rank()
    masters = cfg.runtime.masters if cfg.method != config.SYNC else 1
    placement = local_placement(comm, masters)  # collective: every rank, before the windows
    problem = build_problem(cfg.data, with_theta0=rank < masters)
    # --verbose: rank 0 learns where every rank runs, for its placement line
    ranks = gather_placement(comm, placement, cfg.runtime.threads, problem.quadratic is None
                             ) if cfg.monitor.verbose and cfg.method != config.SYNC else None
    n_workers = config.n_workers(cfg, comm.Get_size())
    if resumed is not None and resumed["theta"].size != problem.n_params:
        raise UsageError(f"--resume {resumed['path']!r} holds {resumed['theta'].size} "
                         f"parameters, this model has {problem.n_params}")
    if (resumed is not None and cfg.method == config.GEM
            and cfg.optim.gem_proxy == config.PROXY_GLOBAL
            and getattr(resumed.get("proxy_m"), "shape", None) != (problem.n_params,)):
        raise UsageError(f"--resume {resumed['path']!r} holds no global proxy m of "
                         f"{problem.n_params} parameters (--gem-proxy global)")
    if cfg.method == config.SYNC:
        return run_sync(cfg, comm, problem, placement, stop, resumed, result)
    plan = shards.plan(cfg, problem, n_workers)
    soft_barrier(comm)
    # every rank learns the run's id (a new one on a fresh start) and where it resumes
    run_id = uuid.uuid4().hex if resumed is None else resumed["run_id"]
    start_seqs, run_id = comm.bcast((None if resumed is None else resumed["next_seq"].tolist(),
                                     run_id), root=MASTER)
    role = None
    comms, link = shards.connect(comm, plan)  # collective; [comm], None with one master
    if link is not None and rank < masters:
        role = Role(rank, plan, link)
        resumed = _shard_of(comm, plan, rank, resumed)
    if rank < masters:
        master = start_master(cfg, comms[rank], plan.layouts[rank], problem, stop, resumed,
                              placement, run_id, ranks, role)
        outcome = master.run()
        if result is not None and rank == MASTER:
            result.update(theta=master.final_theta, summary=master.sup.summary)
        return outcome
    worker = rank - masters + 1  # 1..n
    code = run_worker(cfg, comm, plan, problem, placement,
                      start_seq=0 if start_seqs is None else start_seqs[worker - 1],
                      run_id=run_id, comms=comms)
    # the master alone reports how the run ended; every rank exits with its code
    return OUTCOME_OF.get(code, Outcome.FAILED)



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
