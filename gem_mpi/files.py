"""Writing output files so that a crash or a full disk never leaves half of one.

Checkpoints, the GEM workers' momentum files, ``--save`` and the repaired metrics file all
go through ``atomic_write``; every HDF5 write also goes through ``h5py_write_errors``, so
that a failed write is one exception in the caller, not a traceback printed later.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from collections.abc import Callable, Iterator


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str, write: Callable[[str], None]) -> None:
    """``write(tmp)`` a temporary file beside ``path``, fsync it, rename it over ``path``,
    fsync the directory. On any failure the temporary file is removed and the error raised:
    ``path`` is either the old file or the complete new one, never half of one."""
    tmp = path + ".tmp"
    try:
        with h5py_write_errors():
            write(tmp)
        _fsync(tmp)
        os.replace(tmp, path)
        _fsync(os.path.dirname(os.path.abspath(path)))
    finally:
        with contextlib.suppress(OSError):
            os.remove(tmp)


def os_reason(exc: BaseException) -> str:
    """The OS's words for a failed write, without HDF5's internals around them."""
    text = str(exc)
    for marker in ("error message = '", "] "):
        if marker in text:
            tail = text.split(marker, 1)[1]
            return tail.split("'", 1)[0] if marker.startswith("error") else tail.split("(")[0]
    return text.strip() or type(exc).__name__


@contextlib.contextmanager
def h5py_write_errors() -> Iterator[None]:
    """Raise the first write error h5py hit inside the block. h5py writes some data when an
    object is freed and reports a failure there only by printing it (a traceback on stderr,
    then nothing): collect those instead, so that the caller sees one exception. The objects
    a block creates are freed by reference counting as it ends; no garbage collection is
    forced (it would stall the master for tens of milliseconds at every flush)."""
    errors: list[BaseException] = []
    printed = io.StringIO()
    hook = sys.unraisablehook
    sys.unraisablehook = lambda info: errors.append(info.exc_value)
    try:
        with contextlib.redirect_stderr(printed):
            yield
    finally:
        sys.unraisablehook = hook
    if errors:
        raise errors[0]
    text = printed.getvalue()
    if "Error" in text:
        raise OSError(text.strip().splitlines()[-1])
    sys.stderr.write(text)
