"""What each ``--method`` is: one record per method, the one place the code asks.

A record says which engine runs the method (the asynchronous master and its workers, or the
synchronous step loop behind one of its faces), the options only it reads (refused with any
other method, so that nothing is silently ignored), what a worker's update carries to the
master, what per-element state the master keeps beside θ, and the MPI thread level it needs.
A new master rule is a record here and its two halves in :mod:`gem_mpi.algorithm.rule`, not a
tour of the modules; the numpy reference (:mod:`gem_mpi.algorithm.reference`) stays a
separate implementation on purpose, the oracle the engine is held to.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from gem_mpi.config import (
    ADAPTIVE,
    DDP,
    DILOCO,
    DN,
    DOWNPOUR,
    GAP_AWARE,
    GEM,
    PROXY_GLOBAL,
    SECTIONS,
    SHIFT_PAPER,
    SYNC,
    Config,
    OptimConfig,
    synchronous,
)
from gem_mpi.errors import UsageError

# the parts of an update's payload, by name: Δθ, κ|m|, s
DELTA, AMPLITUDE, SHIFT_BASE = "delta", "a", "s"

# how the master applies an update: GEM's energy rule, Gap-Aware's division by the gap, or a
# fixed π (1 for DOWNPOUR, 1/(τ+1) for adaptive staleness)
RULE_GEM, RULE_GAP, RULE_FIXED, RULE_DN = "gem", "gap", "fixed", "dn"

Parts = tuple[tuple[str, ...], str | None]  # (the parts in order, the part the master keeps)


@dataclass(frozen=True)
class Method:
    """One ``--method``: its engine, its own options and what its updates carry."""

    name: str
    title: str  # how a message names it ("Gap-Aware's", "DiLoCo's")
    rule: str | None  # the master's rule; None: a synchronous method, no master
    face: str | None = None  # the synchronous engine, as the start-up line names it
    section: str | None = None  # the Config section of the options only it reads
    own: tuple[str, ...] = ()  # more options only it reads, outside its section
    threads: str = "funneled"  # MPI's thread level: one-sided windows refuse MULTIPLE

    @property
    def synchronous(self) -> bool:
        """Every rank a worker, no master (config's vocabulary decides, the one truth)."""
        return synchronous(self.name)

    @property
    def options(self) -> tuple[str, ...]:
        """The options only this method reads: its section's fields and ``own``."""
        fields = () if self.section is None else tuple(
            f.name for f in dataclasses.fields(SECTIONS[self.section]))
        return fields + self.own

    def payload(self, optim: OptimConfig) -> Parts:
        """What a worker's update carries: (Δθ, κ|m|, s) for GEM, (Δθ, s) with its global
        proxy (the master makes κ|m|) and for Gap-Aware, Δθ for the fixed rules; with GEM's
        paper shift the master keeps s, so a worker sends it with its first update only."""
        if self.rule == RULE_GEM:
            kept = SHIFT_BASE if optim.gem_shift == SHIFT_PAPER else None
            if optim.gem_proxy == PROXY_GLOBAL:
                return (DELTA, SHIFT_BASE), kept
            return (DELTA, AMPLITUDE, SHIFT_BASE), kept
        if self.rule == RULE_GAP:
            return (DELTA, SHIFT_BASE), None
        return (DELTA,), None

    def master_state(self, optim: OptimConfig) -> str | None:
        """The per-element state the master keeps beside θ (a checkpoint's ``proxy_m``), as
        a message names it; None where it keeps none."""
        if self.rule == RULE_GAP:
            return "Gap-Aware's step average v"
        if self.rule == RULE_DN:
            return "delayed Nesterov's momentum"
        if self.rule == RULE_GEM and optim.gem_proxy == PROXY_GLOBAL:
            return "the global proxy's m"
        return None

    def fixed_scale(self, staleness: int) -> float:
        """π of a fixed rule: 1/(τ+1) for adaptive staleness, 1 for DOWNPOUR."""
        return 1.0 / (staleness + 1.0) if self.name == ADAPTIVE else 1.0


_ALL = (
    Method(GEM, "GEM", RULE_GEM, own=("gem_proxy",)),
    Method(DOWNPOUR, "DOWNPOUR", RULE_FIXED),
    Method(ADAPTIVE, "adaptive staleness", RULE_FIXED),
    Method(GAP_AWARE, "Gap-Aware", RULE_GAP, section="gap_aware"),
    Method(DN, "delayed Nesterov", RULE_DN, section="dn"),
    Method(SYNC, "sync", None, face="Horovod", threads="multiple"),
    Method(DDP, "DDP", None, face="DDP"),
    Method(DILOCO, "DiLoCo", None, face="DiLoCo", section="diloco"),
)
METHODS: dict[str, Method] = {m.name: m for m in _ALL}  # in config.METHODS' order


def of(name: str) -> Method:
    """The record of ``--method name``; an unknown name is one line."""
    try:
        return METHODS[name]
    except KeyError:
        raise UsageError(f"unknown --method {name!r}; choose from {', '.join(METHODS)}"
                         ) from None


class Owner(Protocol):
    """A record that owns options: a method, an optimizer."""

    @property
    def name(self) -> str: ...

    @property
    def title(self) -> str: ...

    @property
    def options(self) -> tuple[str, ...]: ...


def check_owned(cfg: Config, owners: Iterable[Owner], chosen: str, flag: str) -> None:
    """An option of an owner not ``chosen`` (``flag``: --method, --optimizer), set away from
    its default, would be silently ignored: one line naming its owner instead."""
    values, defaults = cfg.as_dict(), Config().as_dict()
    for owner in owners:
        if owner.name == chosen:
            continue
        for name in owner.options:
            if values[name] != defaults[name]:
                option = "--" + name.replace("_", "-")
                raise UsageError(f"{option} {values[name]} is {owner.title}'s: {flag} "
                                 f"{chosen} does not use it (use {flag} {owner.name})")


def check_own_options(cfg: Config) -> None:
    """Another method's option would be silently ignored: one line naming its owner."""
    check_owned(cfg, _ALL, cfg.method, "--method")
