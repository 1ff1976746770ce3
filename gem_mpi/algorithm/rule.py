"""The update rule, both halves and what travels between them.

GEM is split between a worker and the master so that π is computed against the master's
*current* θ, exactly, without a second round trip. The worker keeps its proxy momentum and
sends three numbers per element; the master computes π and applies it:

    worker:  m ← μ·m + Δθ,   a = κ·|m|,   sends (Δθ, a, s)     s: the θ Δθ was computed on
    master:  π = clamp((a − |θ − s|) / (|Δθ| + ε), 0, π_max),   θ ← θ + π·Δθ

Two readings of the shift are offered (``--gem-shift``). ``others`` (the default): s is the θ
the update was computed at; with ``--worker-mode wait`` that θ holds the worker's own previous
update, so |θ − s| counts the other workers' updates (the paper's equations 20–22; with one
worker it is 0 and the step is sign(Δθ)·κ|m| clamped at π_max·|Δθ|), and with
``pipelined`` it is Algorithm 1's s. ``paper``: s is θ
just before the worker's previous update was applied, as the authors' prototype takes it, so
|θ − s| also holds the worker's own previous scaled update. Master-side GEM implements it by having the kernel write θ
before each update into the s part of the worker's mailbox slot, in the same pass; the
worker sends s only with its first update. It costs the master 4 more bytes per element
(36 instead of 32) and saves the worker 4 bytes per element on the wire.

The global proxy (``--gem-proxy global``, the paper's proposed future work): the master keeps
one first moment m_g for all workers and folds every incoming *unscaled* Δθ into it, in the
kernel's pass (a proxy built from the applied π·Δθ would follow the very quantity it bounds);
the worker keeps no m and sends (Δθ, s), or Δθ alone under the paper's shift:

    master:  m_g ← μ_g·m_g + c·Δθ,   a = κ·|m_g|,   then π and θ as above
             μ_g = μ^(1/n),   c = (1 − μ_g)/(1 − μ)          n: the run's workers

GEM compares the central variable's movement over one worker's round trip, n updates, with
one step of the proxy, so the proxy's clock ticks once per n updates: μ_g decays a round of
them like one step of μ, and c makes a constant Δθ build the proxy's own |m| = |Δθ|/(1 − μ)
(the round's updates are averaged into the step, not summed). With one worker μ_g = μ and
c = 1 exactly: local GEM, bit for bit (:func:`global_decay`).

DOWNPOUR (π = 1) and adaptive staleness (π = 1/(τ + 1)) send Δθ alone. Gap-Aware
(``--method gap-aware``, Barkai, Hakimi and Schuster, ICLR 2020) sends (Δθ, s) and keeps no
worker state: the master divides Δθ element-wise by P = 1 + |θ − s|/C, C its per-element
running RMS of the incoming steps (:class:`gem_mpi.algorithm.kernel.GapAware`).

``--wire bf16`` halves the bytes of Δθ and κ|m| and keeps the energy rule exact: the worker
sends q = bf16(Δθ) rounded to nearest even and a = κ|m| rounded *toward zero* (so a never
exceeds the proxy's κ|m|); m itself folds the float32 Δθ, and s stays float32 (its rounding,
up to 2⁻⁹|θ|, would be charged as staleness). The master widens q and a exactly and computes
π from them, θ ← θ + π·q in float32: where π is not clamped the applied magnitude is exactly
a − |θ − s| whatever the rounding. The baselines apply θ ← θ + π·q; the global proxy folds q. An update holding a
NaN or an Inf is rejected whole by the master's kernel. This module is the one place that
knows the rule's formulas for the worker and the fixed π of the baselines; the payload's
layout is :mod:`gem_mpi.protocol`'s, the fused master-side arithmetic
:mod:`gem_mpi.algorithm.kernel`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from gem_mpi import methods
from gem_mpi.algorithm.kernel import (
    BF16_NEAREST_EVEN,
    BF16_TOWARD_ZERO,
    GapAware,
    GapStats,
    GemStats,
    GlobalProxy,
    Kernel,
    to_bf16,
)
from gem_mpi.config import (
    OPT_ADAMW,
    PROXY_GLOBAL,
    WIRE_BF16,
    DnConfig,
    GapAwareConfig,
    OptimConfig,
)
from gem_mpi.methods import RULE_DN, RULE_GAP, RULE_GEM, SHIFT_BASE
from gem_mpi.protocol import update_payload


def global_decay(momentum: float, workers: int) -> tuple[np.float32, np.float32]:
    """(μ_g, c) of the global proxy m_g ← μ_g·m_g + c·Δθ, in float32: μ_g = μ^(1/n), so that
    the n updates of a round decay m_g like one proxy step, and c = (1 − μ_g)/(1 − μ), so that
    a constant Δθ builds the proxy's |m| = |Δθ|/(1 − μ) whatever n. With one worker (μ, 1)
    exactly, as a worker's float32 μ (the reduction to local GEM rests on it)."""
    mu = np.float32(momentum)
    mu_g = np.float32(float(mu) ** (1.0 / workers)) if workers > 1 else mu
    return mu_g, np.float32((1.0 - float(mu_g)) / (1.0 - float(mu)))


@dataclass
class Momentum:
    """A GEM worker's proxy momentum m (a numpy array or a torch tensor), m before the last
    update was folded in, and how many of this worker's updates it holds: on a stop the
    worker saves both values, and a resume takes the one holding exactly the updates the
    master had applied (the last commit may or may not have been)."""

    m: Any
    prev: Any
    mu: Any  # μ and κ as the array library multiplies them: float32 for numpy
    kappa: Any
    folded: int = 0
    fused: Any = None  # gem_mpi.algorithm._core, when the fold runs there in one pass (host memory)
    a: Any = None  # the fused fold's κ|m|, reused: each payload is sent before the next fold

    @classmethod
    def zeros_like(cls, x: Any, optim: OptimConfig, extension: Any = None) -> Momentum:
        """``extension``: gem_mpi.algorithm._core, to fold in one pass when ``x`` is in host memory (a
        numpy array or a CPU tensor); the fold is then a third of the memory traffic."""
        if isinstance(x, np.ndarray):
            z, scalar = np.zeros_like(x), np.float32
        else:  # torch: a Python float multiplies a float32 tensor in float32
            z, scalar = x.new_zeros(x.shape), float
        momentum = cls(z, z.clone() if hasattr(z, "clone") else z.copy(),
                       scalar(optim.momentum), scalar(optim.kappa))
        if extension is not None and (isinstance(x, np.ndarray) or x.device.type == "cpu"):
            momentum.fused = extension
            momentum.a = z.clone() if hasattr(z, "clone") else z.copy()
        return momentum

    def fold(self, delta: Any) -> Any:
        """m ← μ·m + Δθ; returns a = κ·|m| (of the same library; fused: the same array each
        time, else a new one). Fused, the new m is written over prev, which then takes the
        old m's array: the same values, one pass, no copy."""
        if self.fused is not None:
            self.fused.worker_fold(_host(self.m), _host(delta), _host(self.prev),
                                   _host(self.a), float(self.mu), float(self.kappa))
            self.m, self.prev = self.prev, self.m
            self.folded += 1
            return self.a
        self.prev[...] = self.m
        self.m *= self.mu
        self.m += delta
        self.folded += 1
        a = abs(self.m)
        a *= self.kappa
        return a

    def arrays(self) -> list[dict[str, np.ndarray]]:
        """[m now, m before the last update], on the host, as a stop saves them."""
        def host(x: Any) -> np.ndarray:
            return x if isinstance(x, np.ndarray) else x.detach().cpu().numpy()

        return [{"m": host(self.m)}, {"m": host(self.prev)}]

    def restore(self, values: dict[str, np.ndarray], folded: int) -> None:
        """A saved m (one of :meth:`arrays`' two) holding the first ``folded`` updates."""
        if isinstance(self.m, np.ndarray):
            self.m[...] = values["m"]
        else:
            import torch

            self.m.copy_(torch.from_numpy(values["m"]))
        self.folded = folded


def _host(x: Any) -> np.ndarray:
    """A host array's numpy view (a CPU tensor shares its memory)."""
    return x if isinstance(x, np.ndarray) else x.numpy()


class WorkerRule:
    """The worker's half: what it sends the master for each Δθ, in the layout
    :meth:`MasterRule.apply` reads."""

    def __init__(self, optim: OptimConfig, like: Any, resumed: bool = False,
                 extension: Any = None) -> None:
        """``like``: an array (numpy, or a torch tensor on the worker's device) of θ's size;
        ``resumed``: this worker's updates before a checkpoint were applied, so with the
        paper's shift the master holds its s already (the checkpoint carries it). With the
        global proxy the worker keeps no momentum: the master does. ``extension``:
        gem_mpi.algorithm._core, to fold m in one pass when it lives in host memory, and to
        round to bf16 (--wire bf16) in one pass; None: numpy does both."""
        gem = methods.of(optim.method).rule == RULE_GEM
        # AdamW, or --local-steps: the proxy's update is Δ itself, its budget a = κ|Δ|
        own = optim.optimizer == OPT_ADAMW or optim.local_steps > 1
        local = gem and optim.gem_proxy != PROXY_GLOBAL and not own
        self.momentum = Momentum.zeros_like(like, optim, extension) if local else None
        self.kappa = np.float32(optim.kappa) if gem and own else None
        self._a: np.ndarray | None = None  # κ|d|'s buffer, reused like the fused fold's
        payload = update_payload(optim, 0)
        self.with_s = SHIFT_BASE in payload.parts  # GEM and Gap-Aware: the master needs s
        self.send_s_once = payload.kept == SHIFT_BASE  # the master keeps s
        self.sent_s = resumed
        # --wire bf16: the rule's own uint16 buffers for q = bf16(Δθ) and a = bf16(κ|m|), in
        # two sets used in turn, so that update k's payload stays intact while update k+1's
        # is made (a worker may make the next payload before the previous one was posted);
        # a payload's arrays are overwritten two payloads later, by which time it was posted
        self.bf16 = optim.wire == WIRE_BF16
        self.extension = extension  # the conversion runs there when given (--no-extension: numpy)
        self._wire: list[tuple[np.ndarray, np.ndarray]] = []
        self._turn = 0

    @property
    def sends_s(self) -> bool:
        """Whether the next payload carries s (so the caller must keep it intact till then)."""
        return self.with_s and not (self.send_s_once and self.sent_s)

    def payload(self, delta: np.ndarray, s: np.ndarray, delta_on_device: Any = None,
                to_host: Callable[[Any], np.ndarray] = np.asarray) -> tuple[np.ndarray, ...]:
        """(Δθ, κ|m|, s) for GEM, after folding Δθ into m; (Δθ, s) with the global proxy and
        for Gap-Aware; (Δθ,) otherwise. ``delta`` and ``s`` are host arrays; m lives beside
        ``delta_on_device`` (default: ``delta``). With --wire bf16, Δθ and κ|m| are sent as
        uint16 bf16 bits of θ's length, in the rule's buffers (see __init__: valid until
        the payload after next is made).

        With the paper's shift only the first update carries s (the initial pull);
        the master then keeps, in this worker's slot, θ just before each of its updates."""
        a = None
        if self.momentum is not None:  # m folds the float32 Δθ, whatever the wire
            a = to_host(self.momentum.fold(delta if delta_on_device is None
                                           else delta_on_device))
        elif self.kappa is not None:  # its own optimizer's proxy: the budget of its step, κ|Δ|
            if self._a is None:
                self._a = np.empty_like(delta)
            a = np.abs(delta, out=self._a)
            a *= self.kappa
        parts = self._wire_parts(delta, a)
        if not self.with_s or (self.send_s_once and self.sent_s):
            return parts
        self.sent_s = True
        return (*parts, s)

    def _wire_parts(self, delta: np.ndarray, a: np.ndarray | None) -> tuple[np.ndarray, ...]:
        """(Δθ, a) as the wire sends them (a None: Δθ alone): float32 as they are, or bf16
        in the next set of the rule's buffers, Δθ rounded to nearest even and a toward zero."""
        if not self.bf16:
            return (delta,) if a is None else (delta, a)
        if not self._wire:
            self._wire = [(np.empty(delta.size, np.uint16), np.empty(delta.size, np.uint16))
                          for _ in range(2)]
        q, qa = self._wire[self._turn]
        self._turn ^= 1
        to_bf16(delta, q, BF16_NEAREST_EVEN, self.extension)
        if a is None:
            return (q,)
        to_bf16(a, qa, BF16_TOWARD_ZERO, self.extension)
        return (q, qa)


class DelayedNesterov:
    """--method dn at the master (Liu et al. 2024, arXiv 2401.09135, without momentum
    activation): each update Δ moves θ at once by η_o·Δ/N, and the outer momentum takes in
    the updates only every N of them, so that it does not compound stale updates. In Δ's
    sign (a pseudo-gradient is −Δ), with M the outer momentum:

        every update:     θ ← θ + (η_o/N)·Δ,   p ← p + (1/N)·Δ       (p starts a cycle at βM)
        every N-th, then: M ← p,   θ ← θ + η_o·β·M,   p ← β·M

    so M ← βM + (ΣΔ)/N over the cycle and its last update takes θ ← θ + η_o(βM + Δ/N), the
    paper's Nesterov step. One array, p, is the state (a checkpoint's ``proxy_m``); the
    cycle's position is the master's clock."""

    def __init__(self, p: np.ndarray, outer_lr: float, momentum: float, every: int) -> None:
        self.p, self.every = p, every
        self.scale = np.float32(outer_lr / every)  # the kernel's fixed π of each update
        self.inv = np.float32(1.0 / every)
        self.boost = np.float32(outer_lr * momentum)  # η_o·β
        self.beta = np.float32(momentum)
        self.tmp = np.empty_like(p)

    def after(self, theta: np.ndarray, delta: np.ndarray, clock: int) -> None:
        """The rest of update ``clock``'s step, once the kernel applied θ + (η_o/N)·Δ: p's
        share of Δ and, at the cycle's end, the momentum's step (numpy, whole arrays)."""
        np.multiply(delta, self.inv, out=self.tmp)
        self.p += self.tmp
        if (clock + 1) % self.every == 0:
            np.multiply(self.p, self.boost, out=self.tmp)
            theta += self.tmp
            self.p *= self.beta


class MasterRule:
    """The master's half: reads a payload the way the worker laid it out and applies it."""

    def __init__(self, optim: OptimConfig, kernel: Kernel, n_params: int,
                 n_workers: int = 1, gap_aware: GapAwareConfig | None = None,
                 dn: DnConfig | None = None) -> None:
        """``gap_aware``, ``dn``: Gap-Aware's and delayed Nesterov's own options (None:
        their defaults)."""
        self.method, self.kernel, self.n = methods.of(optim.method), kernel, n_params
        self.eps, self.pi_max = optim.eps, optim.pi_max
        self.payload = update_payload(optim, n_params)
        self.keep_s = self.payload.kept == SHIFT_BASE
        self.proxy: GlobalProxy | None = None  # the global proxy's m, at the master
        if self.method.rule == RULE_GEM and optim.gem_proxy == PROXY_GLOBAL:
            m = np.empty(n_params, np.float32)
            kernel.zero(m)  # streamed in every update: first-touched by the kernel's threads
            self.proxy = GlobalProxy(m, *global_decay(optim.momentum, n_workers),
                                     np.float32(optim.kappa))
        self.gap: GapAware | None = None  # Gap-Aware's average of the squared steps, v
        if self.method.rule == RULE_GAP:
            ga = gap_aware or GapAwareConfig()
            v = np.empty(n_params, np.float32)
            kernel.zero(v)
            self.gap = GapAware.of(v, ga.ga_decay, ga.ga_eps)
        self.dn: DelayedNesterov | None = None  # delayed Nesterov's p
        if self.method.rule == RULE_DN:
            d = dn or DnConfig()
            p = np.empty(n_params, np.float32)
            kernel.zero(p)
            self.dn = DelayedNesterov(p, d.dn_outer_lr, d.dn_momentum,
                                      d.dn_every or n_workers)

    @property
    def proxy_m(self) -> np.ndarray | None:
        """The master's own per-element state, which a checkpoint holds (as ``proxy_m``):
        the global proxy's m, Gap-Aware's v, or delayed Nesterov's p; None for the other
        rules."""
        if self.gap is not None:
            return self.gap.v
        if self.dn is not None:
            return self.dn.p
        return None if self.proxy is None else self.proxy.m

    def kept(self, payloads: np.ndarray) -> np.ndarray | None:
        """The s the master keeps per worker (rows of the mailbox ``payloads``: the slots'
        ``kept`` part, :mod:`gem_mpi.protocol`) under the paper's shift, a view; None when it
        keeps none. A checkpoint holds it, so that a resume continues each worker's shift
        exactly."""
        span = self.payload.kept_span
        return None if span is None else payloads[:, span[0]:span[1]]

    def apply(self, theta: np.ndarray, payload: np.ndarray, staleness: int,
              clock: int) -> tuple[bool, GemStats | GapStats | None]:
        """θ ← θ + π·Δθ in place; (applied, the rule's statistics or None). Not applied: θ
        untouched. Under the paper's shift the kernel writes θ before the update into the
        slot's kept s (``payload`` is a view of the slot); with the global proxy it folds Δθ
        into m. ``clock``: the updates this master applied before (Gap-Aware's bias
        correction takes t = clock + 1; no default, so that no caller gets t = 1 by
        omission)."""
        if self.gap is not None:
            delta, s = self.payload.split(payload)
            gstats = self.kernel.gap_step(theta, delta, s, self.gap, clock + 1)
            return gstats is not None, gstats
        if self.method.rule == RULE_GEM:
            if self.proxy is not None:
                (delta, s), a = self.payload.split(payload), None
            else:
                delta, a, s = self.payload.split(payload)
            stats = self.kernel.gem_step(theta, delta, a, s, self.eps, self.pi_max,
                                         keep=s if self.keep_s else None, proxy=self.proxy)
            return stats is not None, stats
        (delta,) = self.payload.split(payload)
        if self.dn is not None:
            ok = self.kernel.fixed_step(theta, delta, float(self.dn.scale))
            if ok:
                self.dn.after(theta, delta, clock)
            return ok, None
        ok = self.kernel.fixed_step(theta, delta, self.method.fixed_scale(staleness))
        return ok, None
