"""The algorithm in one process, driven by a real run's event log: what the run must equal.

On the quadratic problem a worker's Δθ depends only on the θ it was computed on, so the
metrics file's log (which worker, which version it pulled, in which order the master applied
the updates) determines the whole asynchronous run. :func:`replay` recomputes it with plain
float32 numpy, one operation at a time as the formulas are written, independent of the
master's kernel and of the workers' code, so that tests can hold a run to it bit for bit.

Each gradient is taken at s, the θ its worker pulled, plus (``gradient_at="own"``, the
default, as the workers do) the worker's own updates that were in flight at that pull: those
of its earlier updates applied at a clock at or after the version it pulled, unscaled, oldest
first (:mod:`gem_mpi.engine.points`; none when the worker waited for its last update).

The GEM replay keeps each worker's m across the whole log and takes the shift |θ − s|
against θ just before the master applies the update, in either reading of s: ``others``,
the θ the worker pulled (the θ its update was computed at, whichever ``--worker-mode`` chose
it: the pull is in the log), or ``paper``, θ just before the worker's previous update was
applied (the authors' prototype; for a worker's first update, the θ it pulled). With the
global proxy one m runs across the whole log instead, every applied update's unscaled Δθ
folded into it in clock order: m ← μ_g·m + c·Δθ (μ_g, c from the run's number of workers,
:func:`gem_mpi.algorithm.rule.global_decay`), a = κ|m|.

With ``wire="bf16"`` the replay rounds as the worker does (the numpy reference of the
conversion, itself held to torch's bf16 rounding by the tests): q = bf16(Δθ) to nearest even,
a = bf16(κ|m|) toward zero, m folding the float32 Δθ; π from q and a, θ ← θ + π·q (the
baselines θ ← θ + scale·q; the global proxy folds q into its m and makes a in float32).

With ``adamw`` (--optimizer adamw, :mod:`gem_mpi.algorithm.optim`) each worker keeps its own
AdamW moments (m, v, t) across the log and its update is its AdamW step d at the θ it pulled:
m ← m + (1 − β₁)(g − m), v ← β₂v + (1 − β₂)g², d = −(η/(1 − β₁ᵗ))·m/(√v/√(1 − β₂ᵗ) + ε)
− ηλ·s; GEM's budget is a = κ|d| (no proxy momentum), the baselines apply d as they apply Δθ.
With ``local_steps`` H > 1 an update is H such steps (AdamW's, or momentum SGD's b ← μb + g,
d = −ηb) from the pulled θ on the worker's own copy, Δ = θ_H − s, and GEM's a = κ|Δ|; an
update's steps are the log's ``steps`` where it has them (--dylu takes fewer than H on a slower
worker), step i taking η of the i-th of the update's H.

Delayed Nesterov (``dn``) keeps one p across the log: θ ← θ + (η_o/N)·Δ and p ← p + Δ/N each
update, and every N-th update θ ← θ + η_o·β·p, p ← β·p (:class:`gem_mpi.algorithm.rule.
DelayedNesterov`; N the run's workers unless set).

Gap-Aware keeps one v across the whole log, every applied update's unscaled Δθ (q on the bf16
wire) folded into it in clock order, and takes the gap against θ just before the update:
v ← γ·v + (1 − γ)·Δθ², C = √(v / (1 − γ^t)) + ε (t: the update's clock + 1),
θ ← θ + Δθ / (1 + |θ − s|/C).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from gem_mpi.algorithm.kernel import (
    BF16_NEAREST_EVEN,
    BF16_TOWARD_ZERO,
    ga_bias,
    to_bf16_numpy,
    widen,
)
from gem_mpi.algorithm.optim import corrections
from gem_mpi.algorithm.rule import global_decay
from gem_mpi.algorithm.stepsize import Schedule, clip
from gem_mpi.config import (
    ADAPTIVE,
    AT_OWN,
    DN,
    GAP_AWARE,
    GEM,
    PROXY_GLOBAL,
    PROXY_LOCAL,
    SHIFT_OTHERS,
    SHIFT_PAPER,
    WIRE_BF16,
    WIRE_F32,
    AdamWConfig,
    DnConfig,
)
from gem_mpi.problem.quadratic import Quadratic

f32 = np.float32


def _bf16(x: np.ndarray, mode: int) -> np.ndarray:
    """x rounded to bf16 (``mode``) and widened back: the value the master reads."""
    bits = np.empty(x.size, np.uint16)
    to_bf16_numpy(x, bits, mode)
    return widen(bits)


@dataclass
class Replay:
    theta: np.ndarray  # θ after the last update of the log
    losses: list[float] = field(default_factory=list)  # each update's loss at its pull
    pis: list[np.ndarray] = field(default_factory=list)  # each GEM update's π (keep_pi)


def replay(log: Mapping[str, np.ndarray], q: Quadratic, method: str, lr: float,
           momentum: float = 0.9, kappa: float = 1.0, pi_max: float = 5.0,
           eps: float = 1e-16, keep_pi: bool = False, window: int = 1000,
           shift: str = SHIFT_OTHERS, proxy: str = PROXY_LOCAL,
           n_workers: int | None = None, schedule: Schedule | None = None,
           clip_norm: float = 0.0, wire: str = WIRE_F32, ga_decay: float = 0.999,
           ga_eps: float = 1e-8, new_at_seq0: bool = False,
           adamw: AdamWConfig | None = None, local_steps: int = 1,
           dn: DnConfig | None = None, gradient_at: str = AT_OWN) -> Replay:
    """Replay the applied updates of ``log`` (columns worker, version_pulled, staleness, in
    clock order; and seq with a ``schedule``) on ``q``. Only the last ``window`` versions of
    θ are kept for the pulls. ``n_workers``: the run's (the global proxy's decay depends on
    it; default: the workers in the log). ``schedule``: η of each worker's step (default:
    ``lr`` throughout); ``clip_norm``: the gradient's clipping (0: none); ``wire``: the
    run's --wire; ``ga_decay``, ``ga_eps``: Gap-Aware's γ and ε. ``new_at_seq0``: a worker
    whose update has seq 0 is a new one (a resume on more workers): its m and s start
    afresh (the log's seq column is read). ``adamw``: the run's AdamW options, when its
    workers' optimizer is AdamW (None: momentum SGD); ``local_steps``: --local-steps H (an
    update is H steps of the worker's own optimizer, momentum SGD with ``momentum`` or AdamW,
    the loss their mean); ``dn``: delayed Nesterov's options (its N: the run's workers when
    0); ``gradient_at``: the run's --gradient-at (``own``: each gradient is taken at s plus
    the worker's own updates in flight at its pull, those applied at a clock at or after it,
    oldest first; ``pulled``: at s)."""
    bf16 = wire == WIRE_BF16
    theta = q.theta0()
    if n_workers is None:
        n_workers = len(set(log["worker"].tolist()))
    mu_g, gain = global_decay(momentum, n_workers)
    m_global = np.zeros(q.dim, f32)
    gamma = f32(ga_decay)
    v = np.zeros(q.dim, f32)  # Gap-Aware's average of the squared steps
    p_dn = np.zeros(q.dim, f32)  # delayed Nesterov's p (βM plus the cycle's Δ/N)
    versions = {0: theta}
    targets: dict[int, np.ndarray] = {}
    m: dict[int, np.ndarray] = {}
    adam: dict[int, tuple[np.ndarray, np.ndarray, int]] = {}  # w's AdamW (m, v, t)
    buf: dict[int, np.ndarray] = {}  # w's momentum buffer of its local steps (SGD)

    def adamw_step(w: int, g: np.ndarray, at: np.ndarray, eta: np.float32) -> np.ndarray:
        """Worker w's AdamW step d of ``g`` at ``at`` (its moments, t + 1)."""
        assert adamw is not None, "an AdamW run"
        am, av, t = adam[w]
        b1, b2 = f32(adamw.beta1), f32(adamw.beta2)
        inv_bc1, sqrt_bc2 = corrections(float(b1), float(b2), t + 1)
        am = am + (f32(1) - b1) * (g - am)
        av = b2 * av + (f32(1) - b2) * (g * g)
        adam[w] = (am, av, t + 1)
        denom = np.sqrt(av) / f32(sqrt_bc2) + f32(adamw.adam_eps)
        d = (am / denom) * f32(-float(eta) * inv_bc1)
        if adamw.weight_decay:
            d = d - f32(float(eta) * adamw.weight_decay) * at
        return d
    before_own: dict[int, np.ndarray] = {}  # paper: θ just before w's previous update
    mine: dict[int, list[tuple[int, np.ndarray]]] = {}  # w's last two (clock, Δθ)
    out = Replay(theta)
    with_seq = schedule is not None or new_at_seq0
    seqs = log["seq"].tolist() if with_seq else [0] * len(log["worker"])
    # each update's local steps: the log's (--dylu varies them), else H throughout
    taken = (log["steps"].tolist() if local_steps > 1 and "steps" in log
             else [local_steps] * len(log["worker"]))
    for clock, (w, pulled, tau, seq) in enumerate(zip(log["worker"].tolist(),
                                                      log["version_pulled"].tolist(),
                                                      log["staleness"].tolist(), seqs)):
        if w not in targets or (new_at_seq0 and seq == 0):
            targets[w], m[w] = q.target(w), np.zeros(q.dim, f32)
            adam[w] = (np.zeros(q.dim, f32), np.zeros(q.dim, f32), 0)
            buf[w] = np.zeros(q.dim, f32)
            before_own.pop(w, None)
            mine[w] = []
        s = versions[pulled]  # the θ this worker pulled: exact version label
        flying = [d for c, d in mine[w] if c >= pulled]  # its own, not in s, oldest first
        at = s  # where its gradient is taken
        if gradient_at == AT_OWN:
            for own in flying:
                at = at + own
        if local_steps == 1:
            diff = at - targets[w]
            out.losses.append(0.5 * float(np.dot(q.h * diff, diff)))
            eta = f32(lr) if schedule is None else schedule.eta(seq)
            g = clip(q.h * diff, clip_norm)
            delta = f32(-eta) * g if adamw is None else adamw_step(w, g, at, eta)
        else:  # H steps of its own optimizer from the point on its own copy: Δ = θ_H − θ₀
            local, losses = at, 0.0
            for i in range(taken[clock]):
                diff = local - targets[w]
                losses += 0.5 * float(np.dot(q.h * diff, diff))
                g = clip(q.h * diff, clip_norm)
                eta = f32(lr) if schedule is None else schedule.eta(seq * local_steps + i)
                if adamw is None:
                    buf[w] = buf[w] * f32(momentum) + g
                    local = local + buf[w] * f32(-float(eta))
                else:
                    local = local + adamw_step(w, g, local, eta)
            out.losses.append(losses / taken[clock])
            delta = local - at
        mine[w] = [*mine[w][-1:], (clock, delta)]
        sent = _bf16(delta, BF16_NEAREST_EVEN) if bf16 else delta  # what the master reads
        if method == GEM:
            if adamw is not None or local_steps > 1:  # the proxy's update is Δ: a = κ|Δ|
                a = f32(kappa) * np.abs(delta)
                if bf16:
                    a = _bf16(a, BF16_TOWARD_ZERO)
            elif proxy == PROXY_GLOBAL:
                m_global = mu_g * m_global + gain * sent
                a = f32(kappa) * np.abs(m_global)
            else:
                m[w] = f32(momentum) * m[w] + delta
                a = f32(kappa) * np.abs(m[w])
                if bf16:
                    a = _bf16(a, BF16_TOWARD_ZERO)
            ref = before_own.get(w, s) if shift == SHIFT_PAPER else s
            pi = (a - np.abs(theta - ref)) / (np.abs(sent) + f32(eps))
            before_own[w] = theta
            pi = np.clip(pi, f32(0.0), f32(pi_max))
            if keep_pi:
                out.pis.append(pi)
            theta = theta + pi * sent
        elif method == DN:  # each update at once, the momentum every N-th
            d = dn or DnConfig()
            every = d.dn_every or n_workers
            theta = theta + f32(d.dn_outer_lr / every) * sent
            p_dn = p_dn + f32(1.0 / every) * sent
            if (clock + 1) % every == 0:
                theta = theta + f32(d.dn_outer_lr * d.dn_momentum) * p_dn
                p_dn = f32(d.dn_momentum) * p_dn
        elif method == GAP_AWARE:
            v = gamma * v + f32(1.0 - float(gamma)) * (sent * sent)
            c = np.sqrt(v / ga_bias(gamma, clock + 1)) + f32(ga_eps)
            with np.errstate(over="ignore"):
                penalty = np.abs(theta - s) / c + f32(1.0)
            theta = theta + sent / penalty
        else:
            scale = 1.0 / (tau + 1.0) if method == ADAPTIVE else 1.0
            theta = theta + f32(scale) * sent
        versions[clock + 1] = theta
        versions.pop(clock + 1 - window, None)
    out.theta = theta
    return out
