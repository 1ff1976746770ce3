"""The masters' private link (--masters K > 1): small pickled messages between the lead and
the followers, never on the data path.

The messages themselves (their classes, and what each means) are the protocol's
(:mod:`gem_mpi.protocol`); this module only moves them. Anything with ``send``, ``poll`` and
``flush`` serves as a link: the unit tests run a lead and its followers over an in-memory
one.
"""

from __future__ import annotations

import pickle
import time
from typing import Any, Protocol

from gem_mpi.transport.runtime import MPI

TAG = 7


class MessageLink(Protocol):
    """What the lead and the followers need of a link."""

    def send(self, dest: int, msg: Any) -> None:
        """Queue ``msg`` for rank ``dest``; never blocks."""
        ...

    def poll(self, source: int = -1) -> tuple[int, Any] | None:
        """(source, message) of one pending message (from ``source``, -1: any), or None."""
        ...

    def flush(self) -> None:
        """Return once every message sent has been received."""
        ...


class Link:
    """Pickled messages on a private duplicate of ``comm`` (collective to make: every rank,
    in the same order). Sends are non-blocking (their requests are kept until completed);
    receives are polled."""

    def __init__(self, comm: MPI.Intracomm) -> None:
        self.comm = comm.Dup()
        self._sent: list[tuple[MPI.Request, bytes]] = []

    def send(self, dest: int, msg: Any) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        self._sent = [(r, d) for r, d in self._sent if not r.Test()]
        # the buffer is kept with its request until the send completes
        self._sent.append((self.comm.Isend([data, MPI.BYTE], dest, TAG), data))

    def poll(self, source: int = -1) -> tuple[int, Any] | None:
        status = MPI.Status()
        if not self.comm.Iprobe(MPI.ANY_SOURCE if source < 0 else source, TAG, status):
            return None
        buf = bytearray(status.Get_count(MPI.BYTE))
        self.comm.Recv([buf, MPI.BYTE], status.Get_source(), TAG)
        return status.Get_source(), pickle.loads(buf)

    def flush(self) -> None:
        while self._sent:
            self._sent = [(r, d) for r, d in self._sent if not r.Test()]
            if self._sent:
                time.sleep(100e-6)

    def free(self) -> None:
        self.flush()
        self.comm.Free()


__all__ = ["TAG", "Link", "MessageLink"]
