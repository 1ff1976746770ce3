"""What each ``--optimizer`` is: the options only it reads (refused with the other, so that
nothing is silently ignored), and what its proxy cannot be combined with.

The optimizer is GEM's proxy (../shared/GEM_SPEC.md §10): under momentum SGD a worker's update
is Δθ = −η·g and GEM's budget κ|m| with m ← μm + Δθ; under AdamW the update is the worker's
own AdamW step d at the θ it pulled (:mod:`gem_mpi.algorithm.optim`) and the budget κ|d|, the
master's rule unchanged (Gap-Aware divides d by its penalty as it divides an SGD step: C, the
RMS of the incoming steps, is in d's units, docs/ARCHITECTURE.md). The synchronous methods step torch.optim.AdamW on the averaged
gradient (DiLoCo: as its inner optimizer; :mod:`gem_mpi.baseline.opt_state`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from gem_mpi import methods
from gem_mpi.config import (
    GEM,
    OPT_ADAMW,
    OPT_SGD,
    PROXY_GLOBAL,
    SECTIONS,
    SHIFT_PAPER,
    Config,
)
from gem_mpi.errors import UsageError


@dataclass(frozen=True)
class Optimizer:
    """One ``--optimizer``: the options only it reads (it trains every method)."""

    name: str
    title: str  # how a message names it ("AdamW's")
    section: str | None = None  # the Config section of the options only it reads
    own: tuple[str, ...] = ()  # more options only it reads, outside its section

    @property
    def options(self) -> tuple[str, ...]:
        fields = () if self.section is None else tuple(
            f.name for f in dataclasses.fields(SECTIONS[self.section]))
        return fields + self.own


_ALL = (
    Optimizer(OPT_SGD, "momentum SGD", own=("momentum",)),
    Optimizer(OPT_ADAMW, "AdamW", section="adamw"),
)
OPTIMIZERS: dict[str, Optimizer] = {o.name: o for o in _ALL}


def check(cfg: Config) -> None:
    """The optimizer's options and what its proxy excludes, each refusal one line."""
    o = cfg.optim
    methods.check_owned(cfg, _ALL, o.optimizer, "--optimizer")
    if o.optimizer != OPT_ADAMW or cfg.method != GEM:
        return
    if o.gem_proxy == PROXY_GLOBAL:
        raise UsageError("--gem-proxy global keeps a momentum-SGD proxy's m at the master: "
                         "under --optimizer adamw each worker's AdamW step is the proxy's "
                         "(use --gem-proxy local)")
    if o.gem_shift == SHIFT_PAPER:
        raise UsageError("--gem-shift paper counts the worker's own last update in the shift, "
                         "which is not derived for an AdamW proxy: use --gem-shift others")
