"""``python -m gem_mpi.train``: the command line every rank runs.

It only parses the options and dispatches to :mod:`gem_mpi.session`; a bad input is one
line from rank 0 and exit code 2 on every rank. Any unhandled error on any rank afterwards
aborts the whole MPI job (plain ``python`` would leave the other ranks waiting forever) after
printing that rank's message once.
"""

from __future__ import annotations

import faulthandler
import os
import sys

from gem_mpi import config, session

DEVNULL = open(os.devnull, "w")  # noqa: SIM115 - the watchdog's file, open for the process's life
from gem_mpi.errors import UsageError
from gem_mpi.run.supervisor import EXIT_CODES, EXIT_USAGE, Outcome, say
from gem_mpi.transport import MASTER, MPI, start_mpi


def _parse(argv: list[str]) -> tuple[config.Config | None, str | None, str | None]:
    """(config, help text, error): every rank parses alike, none prints."""
    try:
        cfg, help_text = config.parse(argv)
    except UsageError as exc:
        return None, None, str(exc)
    return cfg, help_text, None


def main(argv: list[str]) -> int:
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    cfg, help_text, error = _parse(argv)
    if help_text is not None:
        if rank == MASTER:
            print(help_text)
        return 0
    resumed = None
    if error is None:
        error, resumed, finished = session.prepare(cfg, comm)
        if finished:
            return EXIT_CODES[Outcome.FINISHED]
    if error is not None:
        if rank == MASTER:
            say(f"error: {error}")
        return EXIT_USAGE
    return EXIT_CODES[session.run(cfg, comm, resumed)]


def _bounded_exit(timeout: float) -> None:
    """MPI_Finalize, at the process's exit, waits for every rank: one hung as it left (a
    SIGSTOP, a debugger) would hold the others forever, spinning inside MPI with the GIL
    held, where no Python timer runs. faulthandler's watchdog is a C thread: past
    ``timeout`` seconds it ends this process (exit 1), and mpirun the job (the run's files
    are complete by then)."""
    faulthandler.dump_traceback_later(timeout, exit=True, file=DEVNULL)


def launch(argv: list[str] | None = None) -> int:
    """main() with the job-wide abort: one message from the failing rank, then MPI_Abort."""
    argv = sys.argv[1:] if argv is None else argv
    cfg = _parse(argv)[0]
    comm = start_mpi(session.thread_level(cfg))
    try:
        code = main(argv)
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 - anything else must not leave the job hanging
        session.abort(comm, exc)
        return EXIT_CODES[Outcome.FAILED]
    _bounded_exit(2 * (cfg.monitor.exit_timeout if cfg is not None else 60.0))
    return code


if __name__ == "__main__":
    sys.exit(launch())
