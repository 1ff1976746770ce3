"""``python -m gem_mpi.train``: the launcher every rank runs.

Rank 0 validates the whole configuration (data included) and broadcasts the verdict, so a
bad input is one line from rank 0 and exit code 2 on every rank. Any unhandled error on any
rank afterwards aborts the whole MPI job (plain ``python`` would leave the other ranks
waiting forever) after printing that rank's message once.
"""

from __future__ import annotations

import os
import sys
import traceback
import uuid

from gem_mpi import config
from gem_mpi.errors import GemError, UsageError
from gem_mpi.run.supervisor import EXIT_CODES, EXIT_USAGE, Outcome, StopFlag, say
from gem_mpi.transport import MASTER, MPI, soft_barrier, start_mpi, window_check


def thread_level(argv: list[str]) -> str:
    """MULTIPLE for --method sync (Horovod's thread calls MPI beside ours); FUNNELED for the
    asynchronous methods, whose one-sided windows Open MPI refuses under MULTIPLE."""
    try:
        cfg, _ = config.parse(argv)
    except UsageError:
        return "funneled"  # rank 0 reports it once MPI runs
    return "multiple" if cfg is not None and cfg.method == config.SYNC else "funneled"


def _check_on_master(cfg: config.Config, size: int) -> dict | None:
    """Every check that can be made before any work; returns the checkpoint to resume."""
    from gem_mpi.algorithm.kernel import kernel_threads

    config.validate(cfg, size)  # the data too: there, intact, and a batch per worker
    if cfg.method == config.SYNC:
        from gem_mpi.baseline.sync import check_horovod

        check_horovod()
    else:
        kernel_threads()  # GEM_NUM_THREADS
    return _resume(cfg, config.n_workers(cfg, size))


def main(argv: list[str]) -> int:
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    error, cfg, help_text, resumed = None, None, None, None
    try:
        cfg, help_text = config.parse(argv)
        if rank == MASTER and cfg is not None:
            resumed = _check_on_master(cfg, size)
    except GemError as exc:
        error = str(exc)
    soft_barrier(comm)  # the others sleep while rank 0 checks the data
    error = comm.bcast(error, root=MASTER)
    if help_text is not None:
        if rank == MASTER:
            print(help_text)
        return 0
    if error is None and cfg is not None and cfg.method != config.SYNC:
        error = window_check(comm)  # a stack that cannot make the windows: one line, exit 2
    if error is not None:
        if rank == MASTER:
            say(f"error: {error}")
        return EXIT_USAGE
    return EXIT_CODES[run(cfg, comm, resumed)]


def _resume(cfg: config.Config, n_workers: int) -> dict | None:
    """Rank 0: the checkpoint's state (θ under "theta", its path under "path", what this
    resume changes under "changes"), or None. Refuses, before anything is written, a
    checkpoint of another setting and a metrics file of another run."""
    from gem_mpi.outputs import checkpoint
    from gem_mpi.outputs.metrics import check_resumable

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
        check_resumable(out.metrics, state["run_id"], path,
                        (state["rows_updates"], state["rows_eval"], state["rows_rejected"]))
    return {**state, "theta": theta, "path": path,
            "changes": checkpoint.changes(state, cfg.as_dict())}


def run(cfg: config.Config, comm: MPI.Intracomm, resumed: dict | None = None) -> Outcome:
    """This rank's part of the run: the master, a worker, or a synchronous worker."""
    from gem_mpi.problem import build_problem
    from gem_mpi.run.rank import local_placement

    stop = StopFlag().install()
    rank = comm.Get_rank()
    placement = local_placement(comm)  # collective: every rank, before the windows
    problem = build_problem(cfg.data, with_theta0=rank == MASTER)
    n_workers = config.n_workers(cfg, comm.Get_size())
    if resumed is not None and resumed["theta"].size != problem.n_params:
        raise UsageError(f"--resume {resumed['path']!r} holds {resumed['theta'].size} "
                         f"parameters, this model has {problem.n_params}")
    if cfg.method == config.SYNC:
        from gem_mpi.baseline.sync import run_sync

        return run_sync(cfg, comm, problem, placement, stop, resumed)
    from gem_mpi.protocol import layout as message_layout

    layout = message_layout(cfg.optim, problem.n_params, n_workers)
    soft_barrier(comm)
    # every rank learns the run's id (a new one on a fresh start) and where it resumes
    run_id = uuid.uuid4().hex if resumed is None else resumed["run_id"]
    start_seqs, run_id = comm.bcast((None if resumed is None else resumed["next_seq"].tolist(),
                                     run_id), root=MASTER)
    if rank == MASTER:
        from gem_mpi.algorithm.kernel import Kernel, kernel_threads
        from gem_mpi.engine.master import Master

        kernel = Kernel(problem.offsets, prefer_extension=not cfg.runtime.no_extension,
                        threads=kernel_threads())
        say(f"{cfg.method} on {cfg.data.model}/{cfg.data.dataset}: 1 master + "
            f"{n_workers} workers, {problem.n_params} parameters, master kernel: {kernel.name}"
            + (f"; resuming {resumed['path']} at update {resumed['clock']}"
               + _changes_note(resumed) + _momentum_note(cfg, resumed) if resumed else ""))
        # the evaluation's torch threads: what the node's cores leave to the master's rank
        cores = len(os.sched_getaffinity(0))
        eval_threads = max(1, cores - (placement.local_size - 1))
        return Master(cfg, comm, layout, problem, kernel, stop, resumed, eval_threads,
                      run_id=run_id).run()
    from gem_mpi.engine.worker import run_worker

    code = run_worker(cfg, comm, layout, problem, placement,
                      start_seq=0 if start_seqs is None else start_seqs[rank - 1],
                      run_id=run_id)
    from gem_mpi.engine.master import OUTCOME_OF

    # the master alone reports how the run ended; every rank exits with its code
    return OUTCOME_OF.get(code, Outcome.FAILED)


def _changes_note(state: dict) -> str:
    """The settings this resume changes, for the start-up line (the metrics file keeps them)."""
    return "".join(f", --{k.replace('_', '-')} {a!r} -> {b!r}"
                   for k, (a, b) in state["changes"].items())


def _momentum_note(cfg: config.Config, state: dict) -> str:
    """How many GEM workers will find the momentum they saved when the run was stopped."""
    if cfg.method != config.GEM:
        return ""
    from gem_mpi.outputs import checkpoint

    directory, seqs = cfg.outputs.checkpoint_dir, state["next_seq"]
    found = sum(
        checkpoint.load_worker_momentum(directory, w + 1, int(seqs[w]), state["run_id"])
        is not None for w in range(len(seqs)) if seqs[w] > 0
    ) if directory else 0
    return f", worker momentum restored for {found} of {len(seqs)} workers (the rest start at 0)"


def launch(argv: list[str] | None = None) -> int:
    """main() with the job-wide abort: one message from the failing rank, then MPI_Abort."""
    argv = sys.argv[1:] if argv is None else argv
    comm = start_mpi(thread_level(argv))
    try:
        return main(argv)
    except SystemExit:
        raise
    except (GemError, UsageError) as exc:
        say(f"rank {comm.Get_rank()}: error: {exc}")
        code = EXIT_USAGE
    except BaseException:  # noqa: BLE001 - anything else must not leave the job hanging
        text = traceback.format_exc()
        sys.stderr.write(
            "".join(f"[rank {comm.Get_rank()}] {line}\n" for line in text.rstrip().splitlines())
        )
        sys.stderr.flush()
        code = EXIT_CODES[Outcome.FAILED]
    comm.Abort(code)
    return code


if __name__ == "__main__":
    sys.exit(launch())
