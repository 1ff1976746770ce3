"""Writing output files so that a crash or a full disk never leaves half of one.

Checkpoints, the GEM workers' momentum files, ``--save`` and the repaired metrics file all
go through ``atomic_write``; every HDF5 write also goes through ``h5py_write_errors``, so
that a failed write is one exception in the caller, not a traceback printed later.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys
import traceback
from collections.abc import Callable, Iterator
from types import TracebackType


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
    if "I/O error: " in text:  # Rust's (safetensors): "... I/O error: No space left on device
        return text.split("I/O error: ", 1)[1].split(" (os error")[0]  # (os error 28)"
    for marker in ("error message = '", "] "):
        if marker in text:
            tail = text.split(marker, 1)[1]
            return tail.split("'", 1)[0] if marker.startswith("error") else tail.split("(")[0]
    return text.strip() or type(exc).__name__


def _from_h5py(exc: BaseException | None, tb: TracebackType | None, obj: object = None) -> bool:
    """Whether an exception that reached a hook was raised inside h5py: one of its frames
    is h5py's (its Cython modules have frames too), or the object being freed is h5py's."""
    if obj is not None:
        owner = obj if isinstance(obj, str) else type(obj).__module__
        if owner.startswith("h5py."):
            return True
    if exc is not None and type(exc).__module__.startswith("h5py"):
        return True
    return any(frame.f_globals.get("__name__", "").startswith("h5py")
               for frame, _ in traceback.walk_tb(tb))


_DIAG = "HDF5-DIAG: Error detected in "  # the first line of every HDF5 error-stack report
_DIAG_ENTRY = re.compile(r"^\s+#\d+: .*? in [\w.]+\(\): (?P<what>.*)$")


def split_hdf5_diagnostics(text: str) -> tuple[list[str], str]:
    """(HDF5's error-stack reports in ``text``, everything else in it, unchanged).

    A report as HDF5 prints it: a ``HDF5-DIAG: Error detected in HDF5 (2.0.0) ...:`` line,
    then per stack entry an indented ``#000: file line N in function(): what failed`` line
    (whose text may run onto unindented lines: the OS error's time stamp ends in a newline)
    and indented ``major:`` / ``minor:`` lines. Each report is returned as one line, the
    deepest entry's text: the one that names the OS error."""
    reports: list[str] = []
    rest: list[str] = []
    entry: list[str] | None = None  # the current report's deepest entry so far
    in_text = False  # inside an entry's text, before its major/minor lines
    for line in text.splitlines(keepends=True):
        bare = line.rstrip("\n")
        if bare.startswith(_DIAG):
            if entry is not None:
                reports.append(" ".join(entry) or _DIAG.strip())
            entry, in_text = [], False
            continue
        if entry is not None:
            m = _DIAG_ENTRY.match(bare)
            if m:
                entry, in_text = [m["what"].strip()], True
                continue
            if bare[:1].isspace():  # indented: the report's own line
                if bare.strip().startswith(("major:", "minor:")):
                    in_text = False
                elif in_text:
                    entry.append(bare.strip())
                continue
            if in_text:  # an entry's text that ran onto the next line
                if bare.strip():
                    entry.append(bare.strip())
                continue
            reports.append(" ".join(entry) or _DIAG.strip())
            entry = None
        rest.append(line)
    if entry is not None:
        reports.append(" ".join(entry) or _DIAG.strip())
    return reports, "".join(rest)


@contextlib.contextmanager
def h5py_write_errors() -> Iterator[None]:
    """Raise the first write error h5py or HDF5 reported inside the block.

    h5py writes some data when an object is freed and reports a failure there only by
    printing it: Cython passes the exception to ``sys.excepthook`` (a traceback on stderr)
    and then to ``sys.unraisablehook`` ("Exception ignored in ..."), and the caller sees
    nothing. Inside the block both hooks keep the exceptions raised in h5py's own frames,
    so that the caller gets one exception, and pass any other exception on to the hooks
    that were there. HDF5's own error-stack report (``HDF5-DIAG: Error detected in ...``)
    is taken out of what is printed to ``sys.stderr`` and raised as an OSError; all other
    text, whichever thread prints it, reaches stderr unchanged when the block ends. (h5py
    switches HDF5's automatic printing off, and HDF5 prints to the C stream, not through
    Python: this catches such a report where something routes it through ``sys.stderr``.)
    The objects a block creates are freed by reference counting as it ends; no garbage
    collection is forced (it would stall the master for tens of milliseconds at every
    flush)."""
    errors: list[BaseException] = []
    printed = io.StringIO()
    unraisable, excepthook = sys.unraisablehook, sys.excepthook

    def keep_unraisable(info: sys.UnraisableHookArgs) -> None:
        if info.exc_value is not None and _from_h5py(info.exc_value, info.exc_traceback,
                                                     info.object):
            errors.append(info.exc_value)
        else:
            unraisable(info)

    def keep_printed(kind: type[BaseException], exc: BaseException,
                     tb: TracebackType | None) -> None:
        if _from_h5py(exc, tb):
            errors.append(exc)
        else:
            excepthook(kind, exc, tb)

    sys.unraisablehook, sys.excepthook = keep_unraisable, keep_printed
    try:
        with contextlib.redirect_stderr(printed):
            yield
    finally:
        sys.unraisablehook, sys.excepthook = unraisable, excepthook
        reports, rest = split_hdf5_diagnostics(printed.getvalue())
        if rest:
            sys.stderr.write(rest)
    if errors:
        raise errors[0]
    if reports:
        raise OSError(f"HDF5: {reports[0]}")
