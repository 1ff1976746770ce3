"""What the master and the workers say to each other: the one definition of their messages.

The transport (:mod:`gem_mpi.transport`) moves bytes and checks lengths: a mailbox slot per
worker, a stop word, θ. What the bytes mean lives here, so that a worker, the master, the
metrics writer and the launcher cannot disagree: the message kinds, the stop words, the
payload of an update for each method, the payload of a worker's last message, and the
:class:`Layout` every rank must agree on before the collective window allocation. It sits
above the transport because an update's payload depends on the method (the transport knows
nothing of GEM), and it imports no MPI, so the metrics writer and the offline readers can use
it.

An update's payload is a run of float32 slots, its parts one after the other in this order:

    GEM       Δθ, κ|m|, s     s: the θ Δθ was computed on (see gem_mpi.algorithm.rule)
    GEM, global proxy   Δθ, s       the master keeps m and makes κ|m| itself
    Gap-Aware Δθ, s           the master keeps its step average and measures |θ − s|
    others    Δθ              DOWNPOUR (π = 1), adaptive staleness (π = 1/(τ + 1))

With ``--gem-shift paper`` the master *keeps* s in each worker's slot: while applying an
update the kernel writes θ just before it into the slot's s part (the Mailbox's ``kept``
range, which outlives the slot's release), so a worker sends s with its first update only and
(Δθ, κ|m|) afterwards (Δθ alone with the global proxy); s is the last part so that a shorter
post leaves it in place.

Each part has a width. With ``--wire float32`` (the default) every part is ``n_params``
float32. With ``--wire bf16`` Δθ and κ|m| travel as bfloat16 (Δθ rounded to nearest even, κ|m|
toward zero: gem_mpi.algorithm.rule): such a part is ``n_params`` uint16 holding bf16 bits,
packed into ``ceil(n_params / 2)`` float32 slots (one pad uint16 when ``n_params`` is odd,
never read); s stays float32 (rounding s would be charged as staleness energy). The master's
:meth:`UpdatePayload.split` gives a bf16 part as a uint16 view of exactly ``n_params``
elements, which the kernel widens exactly to float32. A worker's parts stay element-indexed
arrays (uint16 or float32) until the transport packs them (Mailbox.post: each part at a
4-byte boundary), so a sharded worker slices them by θ's element range.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gem_mpi import methods
from gem_mpi.config import WIRE_BF16, WIRE_F32, OptimConfig
from gem_mpi.methods import AMPLITUDE, DELTA

# message kinds (a mailbox header's ``kind``)
UPDATE = 1  # carries an update's payload
DONE = 2  # the worker's batches are done; carries its time split (WORKER_TIME_COLUMNS)
LEFT = 3  # the worker leaves the live run (SIGTERM); seq: its updates, all applied; the split
KINDS = {UPDATE: "update", DONE: "done", LEFT: "left"}
SIGN_OFFS = (DONE, LEFT)  # the messages that carry the time split instead of an update

# the stop word: how the run ended, so that every rank exits with the master's code
RUNNING = 0
FINISHED = 1
ABORTED = 2  # an error: the job is failing
STOPPED = 3  # stopped early (signal): workers leave without their DONE message
DIVERGED = 4  # stopped early, diverged: workers keep no state of it
OUTPUT_FAILED = 5  # stopped early, an output could not be written
STOP_WORDS = {RUNNING: "running", FINISHED: "finished", ABORTED: "aborted",
              STOPPED: "stopped", DIVERGED: "diverged", OUTPUT_FAILED: "output failed"}
# added to the stop word when a worker's process died (--worker-loss continue): the windows,
# whose collective free would wait for it forever, are left to MPI_Finalize
WORKER_LOST = 0x100

# DONE's payload: the worker's own time split in seconds, one float32 per column, from its
# first pull to its last message (the metrics file's /summary/worker_time). The columns from
# compute to straggle split the wall time; gpu does not: it is the GPU's own clock from θ's
# copy to the device until Δθ reached the host, summed over the steps (the time the device
# had this worker's step queued, overlapping compute and load), NaN on a CPU worker
WORKER_TIME_COLUMNS = ["wall", "compute", "load", "payload", "commit", "wait", "backoff",
                       "pull", "straggle", "group", "gpu"]
WORKER_TIME_SPLIT = WORKER_TIME_COLUMNS[1:-1]  # the columns that add up to (at most) wall


# the parts a bf16 wire narrows (s never: its rounding would be charged as staleness)
NARROWED = (DELTA, AMPLITUDE)


@dataclass(frozen=True)
class UpdatePayload:
    """The parts of one method's update on one wire, and the part rank 0 keeps in the slot
    between a worker's updates (None: it keeps none). A part is ``n_params`` elements: float32,
    or on the bf16 wire for Δθ and κ|m| uint16 (bf16 bits) packed two to a float32 slot."""

    n_params: int
    parts: tuple[str, ...]
    kept: str | None = None
    wire: str = WIRE_F32

    def narrow(self, name: str) -> bool:
        """Whether part ``name`` travels as bf16 (uint16 bits)."""
        return self.wire == WIRE_BF16 and name in NARROWED

    def width(self, name: str) -> int:
        """Float32 slots part ``name`` takes: n_params, or ceil(n_params / 2) as bf16."""
        return (self.n_params + 1) // 2 if self.narrow(name) else self.n_params

    @property
    def floats(self) -> int:
        """Floats of a full update: the slot's update area."""
        return sum(self.width(p) for p in self.parts)

    @property
    def lengths(self) -> tuple[int, ...]:
        """The lengths an update may arrive with: without the kept part, or full."""
        if self.kept is None:
            return (self.floats,)
        return (self.floats - self.width(self.kept), self.floats)

    def span(self, name: str) -> tuple[int, int]:
        """The float range [lo, hi) of part ``name`` in the payload."""
        k = self.parts.index(name)
        lo = sum(self.width(p) for p in self.parts[:k])
        return lo, lo + self.width(name)

    @property
    def kept_span(self) -> tuple[int, int] | None:
        return None if self.kept is None else self.span(self.kept)

    def split(self, payload: np.ndarray) -> tuple[np.ndarray, ...]:
        """Views of the parts of one slot's payload (float32), in order: a bf16 part as a
        uint16 view of exactly n_params elements."""
        out = []
        for name in self.parts:
            lo, hi = self.span(name)
            part = payload[lo:hi]
            out.append(part.view(np.uint16)[:self.n_params] if self.narrow(name) else part)
        return tuple(out)

    @property
    def bytes_committed(self) -> int:
        """Bytes of payload a worker commits per update in the steady state (the 64-byte
        header aside): every part but the kept one, as the wire packs them."""
        kept = 0 if self.kept is None else self.width(self.kept)
        return 4 * (self.floats - kept)

    @property
    def bytes_pulled(self) -> int:
        """Bytes a worker pulls per update: θ, float32 whatever the wire."""
        return 4 * self.n_params

    @property
    def wire_bytes(self) -> tuple[int, int]:
        """(bytes committed, bytes pulled) per update: what the metrics file records."""
        return self.bytes_committed, self.bytes_pulled

    def wire_note(self) -> str:
        """What the start-up line says of the wire: bytes per parameter each way."""
        n = max(self.n_params, 1)
        return (f"wire {self.wire}: {self.bytes_committed / n:.3g} B/param committed, "
                f"{self.bytes_pulled / n:.3g} B/param pulled")


def update_payload(optim: OptimConfig, n_params: int) -> UpdatePayload:
    """The parts ``optim.method``'s record says an update carries, on ``optim.wire``."""
    parts, kept = methods.of(optim.method).payload(optim)
    return UpdatePayload(n_params, parts, kept, optim.wire)


@dataclass(frozen=True)
class Layout:
    """Sizes every rank must agree on before the collective window allocation."""

    n_workers: int
    n_params: int
    payload_floats: int  # floats of a mailbox slot's payload area
    update_lengths: tuple[int, ...] = ()  # lengths an update may arrive with (default: full)
    done_floats: int = 0  # length of a worker's DONE message (its time split)
    kept: tuple[int, int] | None = None  # the floats of each slot rank 0 writes and keeps


def layout(optim: OptimConfig, n_params: int, n_workers: int) -> Layout:
    """The run's :class:`Layout`: the slot holds a full update or a DONE, whichever is
    longer."""
    update = update_payload(optim, n_params)
    done = len(WORKER_TIME_COLUMNS)
    return Layout(n_workers, n_params, max(update.floats, done), update.lengths, done,
                  update.kept_span)


@dataclass
class ShardState:
    """One master's engine state: the whole of it with one master, or one shard's part of θ
    with its own clock and tickets (--masters K > 1). A checkpoint is made of one (or of
    every shard's, joined); a follower sends its own to the lead."""

    theta: np.ndarray
    clock: int
    tickets: int
    next_seq: np.ndarray  # each worker's next update number
    kept_s: np.ndarray | None = None  # GEM paper's s, per worker (workers × parameters)
    proxy_m: np.ndarray | None = None  # the master's own per-element state: GEM's global
    # proxy m, or Gap-Aware's step average v

    @staticmethod
    def join(parts: list[ShardState]) -> dict[str, Any]:
        """The engine's fields of a checkpoint from every shard's part, in shard order: θ,
        s and m concatenated, each shard's clock and tickets kept (the lead's are the run's)."""
        lead = parts[0]
        kept = [p.kept_s for p in parts if p.kept_s is not None]
        proxy_m = [p.proxy_m for p in parts if p.proxy_m is not None]
        return {"theta": np.concatenate([p.theta for p in parts]), "clock": lead.clock,
                "tickets": lead.tickets, "next_seq": lead.next_seq,
                "kept_s": np.concatenate(kept, axis=1) if kept else None,
                "proxy_m": np.concatenate(proxy_m) if proxy_m else None,
                "shard_clock": np.array([p.clock for p in parts], np.int64),
                "shard_tickets": np.array([p.tickets for p in parts], np.int64)}


# --- what the masters of a sharded run say to each other (--masters K > 1) -----------------
# The lead (rank 0) runs the run; each follower applies its shard and answers. They travel
# pickled on the masters' private link (gem_mpi.transport.link), never on the data path;
# a receiver dispatches on the message's class. gem_mpi.engine.shards says when each is sent.

@dataclass(frozen=True)
class Hold:
    """lead → follower: stop taking updates and say where you are (:class:`At`)."""


@dataclass(frozen=True)
class Cut:
    """lead → follower: apply, from your mailboxes, exactly the updates below ``target``
    (each worker's next update number), then send your :class:`State`."""

    target: np.ndarray


@dataclass(frozen=True)
class Go:
    """lead → follower: take updates again (after a :class:`Cut`)."""


@dataclass(frozen=True)
class Gather:
    """lead → follower: send your part of θ as it is now (:class:`Piece`), for an evaluation."""


@dataclass(frozen=True)
class End:
    """lead → follower: the run has ended with stop word ``word``."""

    word: int


@dataclass(frozen=True)
class Rows:
    """follower → lead: its rows of the metrics file's ``/shard<k>`` since the last."""

    rows: list[dict] = field(default_factory=list)


@dataclass(frozen=True)
class At:
    """follower → lead, answering :class:`Hold`: its next update number of each worker."""

    next_seq: np.ndarray


@dataclass(frozen=True)
class State:
    """follower → lead, answering :class:`Cut`: its part of the checkpoint, or None when it
    could not reach the cut within --exit-timeout."""

    state: ShardState | None


@dataclass(frozen=True)
class Piece:
    """follower → lead, answering :class:`Gather`: its part of θ."""

    theta: np.ndarray


@dataclass(frozen=True)
class Final:
    """follower → lead, once every worker is done with it: its last state and its summary;
    ``deals``: the lead's :class:`Deal` messages it had seen (an older one is stale)."""

    state: ShardState
    summary: dict
    deals: int = 0


@dataclass(frozen=True)
class Deal:
    """lead → follower: worker ``worker`` was dealt batches that a departed worker had not
    done, its plan now ``length`` batches long (sent before the worker learns of them)."""

    worker: int
    length: int


@dataclass(frozen=True)
class Diverged:
    """follower → lead: its θ holds values that are not finite (the lead ends the run)."""

    why: str


@dataclass(frozen=True)
class Bye:
    """follower → lead, after the lead's :class:`End`: every row has been sent."""


LEAD_SAYS = (Hold, Cut, Go, Gather, End, Deal)
REPLIES = (At, State, Piece, Bye)  # what the lead waits for, one from each follower


__all__ = [
    "ABORTED",
    "DIVERGED",
    "DONE",
    "FINISHED",
    "KINDS",
    "LEAD_SAYS",
    "LEFT",
    "NARROWED",
    "OUTPUT_FAILED",
    "REPLIES",
    "RUNNING",
    "SIGN_OFFS",
    "STOPPED",
    "STOP_WORDS",
    "UPDATE",
    "WORKER_LOST",
    "WORKER_TIME_COLUMNS",
    "WORKER_TIME_SPLIT",
    "At",
    "Bye",
    "Cut",
    "Deal",
    "Diverged",
    "End",
    "Final",
    "Gather",
    "Go",
    "Hold",
    "Layout",
    "Piece",
    "Rows",
    "ShardState",
    "State",
    "UpdatePayload",
    "layout",
    "update_payload",
]
