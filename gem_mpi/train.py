"""``python -m gem_mpi.train``: the command line every rank runs.

It only parses the options and dispatches to :mod:`gem_mpi.session`; a bad input is one
line from rank 0 and exit code 2 on every rank. Any unhandled error on any rank afterwards
aborts the whole MPI job (plain ``python`` would leave the other ranks waiting forever) after
printing that rank's message once.
"""

from __future__ import annotations

import sys

from gem_mpi import config, session
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


def launch(argv: list[str] | None = None) -> int:
    """main() with the job-wide abort: one message from the failing rank, then MPI_Abort."""
    argv = sys.argv[1:] if argv is None else argv
    comm = start_mpi(session.thread_level(_parse(argv)[0]))
    try:
        return main(argv)
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 - anything else must not leave the job hanging
        session.abort(comm, exc)
    return EXIT_CODES[Outcome.FAILED]


if __name__ == "__main__":
    sys.exit(launch())
