"""Errors a user can act on: the launcher prints their message once, without a traceback."""


class GemError(Exception):
    """Base of every error gem_mpi reports as one readable line."""


class UsageError(GemError):
    """A bad command-line value or an impossible configuration."""


class DataError(UsageError):
    """A dataset that is missing, truncated or not what it claims to be."""


class OutputError(GemError):
    """An output file could not be written (disk full, quota, I/O error): the run stops
    cleanly, with the files it leaves readable."""


def one_line(exc: BaseException) -> str:
    """An exception's text fit for such a line: its whitespace collapsed, 200 characters
    at most (a library's message may span lines or hold a whole file name list)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 200 else text[:197] + "..."
