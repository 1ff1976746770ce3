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

from gem_mpi import config
from gem_mpi.errors import GemError, UsageError


def _mpi_thread_level(argv: list[str]) -> str:
    """MULTIPLE for --method sync (Horovod's thread calls MPI beside ours); FUNNELED for the
    asynchronous methods, whose one-sided windows Open MPI refuses under MULTIPLE."""
    try:
        cfg, _ = config.parse(argv)
    except UsageError:
        return "funneled"  # rank 0 reports it once MPI runs
    return "multiple" if cfg is not None and cfg.method == config.SYNC else "funneled"


if __name__ == "__main__":  # before transport starts MPI
    os.environ.setdefault("GEM_MPI_THREAD_LEVEL", _mpi_thread_level(sys.argv[1:]))

from gem_mpi.transport import MASTER, MPI, SHUTDOWN_ABORT, Layout, soft_barrier

EXIT_USAGE = 2
EXIT_ERROR = 1
EXIT_STOPPED = 3  # stopped early by a signal, after a checkpoint: resume to finish
EXIT_DIVERGED = 4  # stopped because the run diverged (--stop-on-divergence)


def _say(text: str) -> None:
    print(f"gem_mpi: {text}", file=sys.stderr, flush=True)


def _check_on_master(cfg: config.Config, size: int) -> None:
    from gem_mpi.gem import kernel_threads

    config.validate(cfg, size)
    if cfg.method == config.SYNC:
        from gem_mpi.sync import check_horovod

        check_horovod()
    else:
        kernel_threads()  # GEM_NUM_THREADS
    if cfg.model != "quadratic":
        from gem_mpi.data import check_dataset, dataset_spec

        dataset_spec(cfg.dataset, cfg.model)  # model/dataset combinations that cannot work
        check_dataset(cfg.dataset, cfg.data_dir)


def main(argv: list[str] | None = None) -> int:
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    argv = sys.argv[1:] if argv is None else argv
    error, cfg, help_text = None, None, None
    try:
        cfg, help_text = config.parse(argv)
        if rank == MASTER and cfg is not None:
            _check_on_master(cfg, size)
    except GemError as exc:
        error = str(exc)
    soft_barrier(comm)  # the others sleep while rank 0 checks the data
    error = comm.bcast(error, root=MASTER)
    if help_text is not None:
        if rank == MASTER:
            print(help_text)
        return 0
    if error is not None:
        if rank == MASTER:
            _say(f"error: {error}")
        return EXIT_USAGE
    return run(cfg, comm)


class StopFlag:
    """Set by SIGUSR1 or SIGTERM: the master checkpoints and ends the run early, cleanly.

    mpirun and srun forward SIGUSR1 unchanged to every rank and keep the job alive; SIGTERM
    sent to mpirun kills the ranks within about a second, and sent to srun it kills the
    step at once, so forward SIGUSR1 to the launcher (Slurm: ``--signal=B:USR1@300``, as
    jobs/ does); SIGTERM helps only where it reaches the ranks directly. Workers only note
    the signal: the master decides and tells them.
    """

    def __init__(self) -> None:
        self.signum = 0

    def __call__(self, signum: int, frame: object) -> None:
        self.signum = signum

    def __bool__(self) -> bool:
        return self.signum != 0


def run(cfg: config.Config, comm: MPI.Intracomm) -> int:
    import signal

    from gem_mpi import checkpoint, gem
    from gem_mpi.problem import build_problem
    from gem_mpi.worker import local_placement

    stop = StopFlag()
    for sig in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(sig, stop)
    rank = comm.Get_rank()
    placement = local_placement(comm)  # collective: every rank, before the windows
    problem = build_problem(cfg, with_theta0=rank == MASTER)
    n_workers = config.n_workers(cfg, comm.Get_size())
    resumed = None
    if rank == MASTER and cfg.resume:
        path = checkpoint.resolve(cfg.resume, cfg.checkpoint_dir)
        if path is None:
            _say(f"--resume auto: no checkpoint in {cfg.checkpoint_dir} yet, starting afresh")
        else:
            theta, state = checkpoint.load(path)
            checkpoint.check_compatible(state, theta, cfg.as_dict(), n_workers,
                                        problem.n_params, path)
            resumed = (path, theta, state)
    if cfg.method == config.SYNC:
        from gem_mpi.sync import run_sync

        summary = run_sync(cfg, comm, problem, placement, stop, resumed)
        if summary.get("error"):
            return EXIT_ERROR
        if summary["diverged"]:
            return EXIT_DIVERGED
        return EXIT_STOPPED if not summary["finished"] else 0
    layout = Layout(
        n_workers=n_workers,
        n_params=problem.n_params,
        payload_floats=gem.payload_floats(cfg.method, problem.n_params),
    )
    soft_barrier(comm)
    start_seqs = comm.bcast(None if resumed is None else resumed[2]["next_seq"].tolist(),
                            root=MASTER)
    if rank == MASTER:
        from gem_mpi.master import Master

        kernel = gem.Kernel(problem.offsets, prefer_extension=not cfg.no_extension,
                            threads=gem.kernel_threads())
        _say(
            f"{cfg.method} on {cfg.model}/{cfg.dataset}: 1 master + {layout.n_workers} workers, "
            f"{problem.n_params} parameters, master kernel: {kernel.name}"
            + (f"; resuming {resumed[0]} at update {resumed[2]['clock']}"
               + _momentum_note(cfg, resumed[2]) if resumed else "")
        )
        summary = Master(cfg, comm, layout, problem, kernel, stop, resumed).run()
        if summary.get("error"):
            return EXIT_ERROR
        if summary.get("diverged"):
            return EXIT_DIVERGED
        return EXIT_STOPPED if not summary["finished"] else 0
    from gem_mpi.worker import run_worker

    code = run_worker(cfg, comm, layout, problem, placement,
                      start_seq=0 if start_seqs is None else start_seqs[rank - 1])
    # the master alone reports stops and their exit codes; an abort fails every rank
    return EXIT_ERROR if code == SHUTDOWN_ABORT else 0


def _momentum_note(cfg: config.Config, state: dict) -> str:
    """How many GEM workers will find the momentum they saved when the run was stopped."""
    if cfg.method != "gem":
        return ""
    from gem_mpi import checkpoint

    seqs = state["next_seq"]
    found = sum(
        checkpoint.load_worker_momentum(cfg.checkpoint_dir, w + 1, int(seqs[w]),
                                        cfg.as_dict()) is not None
        for w in range(len(seqs)) if seqs[w] > 0
    ) if cfg.checkpoint_dir else 0
    return f", worker momentum restored for {found} of {len(seqs)} workers (the rest start at 0)"


def launch(argv: list[str] | None = None) -> int:
    """main() with the job-wide abort: one message from the failing rank, then MPI_Abort."""
    comm = MPI.COMM_WORLD
    try:
        return main(argv)
    except SystemExit:
        raise
    except (GemError, UsageError) as exc:
        _say(f"rank {comm.Get_rank()}: error: {exc}")
        code = EXIT_USAGE
    except BaseException:  # noqa: BLE001 - anything else must not leave the job hanging
        text = traceback.format_exc()
        sys.stderr.write(
            "".join(f"[rank {comm.Get_rank()}] {line}\n" for line in text.rstrip().splitlines())
        )
        sys.stderr.flush()
        code = EXIT_ERROR
    comm.Abort(code)
    return code


if __name__ == "__main__":
    sys.exit(launch())
