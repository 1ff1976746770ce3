"""One writer per output: a run holds an OS file lock on its metrics file and on its
checkpoint directory for its whole life, so that a second run on either is refused in one
line before it writes anything, instead of truncating the live run's file or deleting its
checkpoints.

The lock is ``flock`` on a small file beside the output (``run.h5.lock``; ``.gem_mpi.lock``
in a checkpoint directory), never on the HDF5 file itself, whose library takes its own. The
kernel drops it when the process ends, however it ends, so a killed run leaves no stale lock:
the file stays, saying who held it last, and the next run takes it.
"""

from __future__ import annotations

import datetime
import fcntl
import os
import socket

from gem_mpi.errors import UsageError

DIRECTORY_LOCK = ".gem_mpi.lock"


def lock_path(output: str, directory: bool) -> str:
    """The lock file of a metrics file (beside it) or of a checkpoint directory (in it)."""
    return os.path.join(output, DIRECTORY_LOCK) if directory else output + ".lock"


class OutputLocks:
    """The locks one run holds (rank 0's): taken before anything is written, kept until
    :meth:`release` or the process's end."""

    def __init__(self) -> None:
        self._held: list[tuple[int, str]] = []  # (fd, lock file)
        self._created: list[str] = []  # lock files this run made (removed if it never runs)

    def take(self, output: str, flag: str, directory: bool = False) -> None:
        """Lock ``output`` (named by option ``flag`` in the refusal) or raise one line naming
        the run that holds it."""
        path = lock_path(output, directory)
        try:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
                self._created.append(path)
            except FileExistsError:  # an earlier run's: it stays, so that all lock one inode
                fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            self.release(refused=True)
            raise UsageError(f"{flag} {output}: cannot make its lock file {path} "
                             f"({exc.strerror or exc})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip() or "another run"
            os.close(fd)
            self.release(refused=True)
            raise UsageError(f"{flag} {output} is in use by {holder}: one run writes it at a "
                             "time; wait for that run to end, or give this one its own "
                             f"{flag}") from None
        self._held.append((fd, path))
        self.describe(None)

    def describe(self, run_id: str | None) -> None:
        """Say in every lock file who holds it (the run's id once it is known)."""
        who = f"run {run_id}" if run_id else "a run"
        since = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        text = f"{who} on host {socket.gethostname()} (pid {os.getpid()}, since {since})\n"
        for fd, _ in self._held:
            os.ftruncate(fd, 0)
            os.pwrite(fd, text.encode(), 0)

    def release(self, refused: bool = False) -> None:
        """Drop the locks; ``refused``: the run never started, so the lock files it made
        are removed too (it writes nothing). A run's lock files stay after it: removing one
        while another run opens it would let two runs lock two files of one name."""
        if refused:
            for path in self._created:
                os.unlink(path)
        for fd, _ in self._held:
            os.close(fd)  # closing the only descriptor drops the flock
        self._held.clear()
        self._created.clear()


RUN_LOCKS = OutputLocks()  # this process's: rank 0 takes them in the session's preflight
