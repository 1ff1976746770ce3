"""A worker's own optimizer: AdamW (``--optimizer adamw``), or momentum SGD as the inner
optimizer of ``--local-steps``, each a state over the worker's own gradient stream and the step
d it takes (../shared/GEM_SPEC.md §10):

    AdamW:  m ← m + (1 − β₁)(g − m),   v ← β₂v + (1 − β₂)g²,   t ← t + 1
            d = −(η/(1 − β₁ᵗ))·m / (√v/√(1 − β₂ᵗ) + ε) − ηλ·s
    SGD:    b ← μb + g,   d = −η·b

at the θ s the step is taken at, in the order of torch.optim's steps (AdamW's m by lerp, its
decoupled weight decay taken at s), so that one worker with κ = 1 is sequential AdamW up to
float32 rounding (torch folds the decay into θ before the step; here it is a term of d). In
float32, on numpy arrays (the quadratic problem) or torch tensors alike; the numpy reference
(:mod:`gem_mpi.algorithm.reference`) writes the same formulas on its own.

The state lives in ``depth`` sets of arrays (:class:`States`): an update's first step writes
the oldest set from the current one (no copy), its further local steps write it in place, so
the states before the worker's last ``depth − 1`` updates are kept: a worker may have taken
steps the master never applied when a run stops (a pipelined worker has computed its next
update, and its last commit may be unapplied), so a stop saves them all and a resume takes
the one holding exactly the updates the master had applied, as GEM's momentum keeps the m
before its last fold (:class:`gem_mpi.algorithm.rule.Momentum`). A worker that starts without
a saved state starts at zero and t = 0, whatever its first update's number.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from gem_mpi.config import OPT_ADAMW, OVERLAP, PIPELINED, WAIT, AdamWConfig, OptimConfig

f32 = np.float32


def corrections(beta1: float, beta2: float, t: int) -> tuple[float, float]:
    """(1/(1 − β₁ᵗ), √(1 − β₂ᵗ)) of step t ≥ 1, in float64 as torch computes them."""
    return 1.0 / (1.0 - beta1 ** t), math.sqrt(1.0 - beta2 ** t)


# the states a worker keeps, by --worker-mode: a stop finds it at most this many steps less
# one ahead of the master's applied updates (waiting: its last commit may be unapplied;
# pipelined: its next step computed too; overlapped: and the one after that under way)
DEPTH = {WAIT: 2, PIPELINED: 3, OVERLAP: 4}


class States:
    """``depth`` sets of a worker optimizer's named arrays (numpy or torch, like ``like``)
    and their step counts t, the newest current."""

    def __init__(self, like: Any, names: tuple[str, ...], depth: int) -> None:
        self.numpy = isinstance(like, np.ndarray)
        self.names = names
        self.sets = [{n: self._zeros(like) for n in names} for _ in range(depth)]
        self.ts = [0] * depth  # the steps each set holds (AdamW's bias correction)
        self.head = 0  # the current set
        self.folded = 0  # the worker's updates the current set holds (which a resume takes)
        self.tmp = self._zeros(like) if self.numpy else None

    def _zeros(self, like: Any) -> Any:
        return np.zeros_like(like) if self.numpy else like.new_zeros(like.shape)

    @property
    def now(self) -> dict[str, Any]:
        return self.sets[self.head]

    @property
    def t(self) -> int:
        return self.ts[self.head]

    def begin(self, fresh: bool) -> tuple[dict[str, Any], dict[str, Any], int]:
        """(the set a step reads, the set it writes, its t): a new update's first step
        (``fresh``) writes the oldest set, a later local step of it the current one."""
        src = self.sets[self.head]
        if fresh:
            self.head = (self.head + 1) % len(self.sets)
            self.ts[self.head] = self.ts[(self.head - 1) % len(self.sets)]
            self.folded += 1
        self.ts[self.head] += 1
        return src, self.sets[self.head], self.ts[self.head]

    def step(self, g: Any, s: Any, eta: float, out: Any, fresh: bool = True) -> Any:
        """The step d of gradient ``g`` at ``s`` with learning rate ``eta``, into ``out``;
        ``fresh``: the first step of an update (a later local step updates the state in
        place)."""
        raise NotImplementedError

    def arrays(self) -> list[dict[str, np.ndarray]]:
        """The kept sets on the host, newest first (the current one, then the one before
        the last update, ...), as a stop saves them."""
        def host(x: Any) -> np.ndarray:
            return x if self.numpy else x.detach().cpu().numpy()

        depth = len(self.sets)
        order = [(self.head - back) % depth for back in range(depth)]
        return [{**{n: host(self.sets[i][n]) for n in self.names}, "t": np.int64(self.ts[i])}
                for i in order]

    def restore(self, values: dict[str, np.ndarray], folded: int) -> None:
        """A saved set (one of :meth:`arrays`') holding the worker's first ``folded``
        updates."""
        for name in self.names:
            target = self.now[name]
            if self.numpy:
                target[...] = values[name]
            else:
                import torch

                target.copy_(torch.from_numpy(values[name]))
        self.ts[self.head], self.folded = int(values["t"]), folded


class AdamW(States):
    """One worker's AdamW: its moments m, v and its step."""

    def __init__(self, like: Any, cfg: AdamWConfig, depth: int = 2) -> None:
        """``depth``: the states kept, this one and those before the last depth − 1 updates."""
        super().__init__(like, ("m", "v"), depth)
        self.beta1, self.beta2 = f32(cfg.beta1), f32(cfg.beta2)
        self.eps, self.decay = f32(cfg.adam_eps), cfg.weight_decay

    @property
    def m(self) -> Any:
        return self.now["m"]

    @property
    def v(self) -> Any:
        return self.now["v"]

    def step(self, g: Any, s: Any, eta: float, out: Any, fresh: bool = True) -> Any:
        src, dst, t = self.begin(fresh)
        m, v, m_new, v_new = src["m"], src["v"], dst["m"], dst["v"]
        inv_bc1, sqrt_bc2 = corrections(float(self.beta1), float(self.beta2), t)
        step, decay = -float(eta) * inv_bc1, float(eta) * self.decay
        w1, w2 = f32(1) - self.beta1, f32(1) - self.beta2
        if self.numpy:
            tmp = self.tmp
            np.subtract(g, m, out=tmp)
            tmp *= w1
            np.add(m, tmp, out=m_new)
            np.multiply(g, g, out=tmp)
            tmp *= w2
            np.multiply(v, self.beta2, out=v_new)
            v_new += tmp
            np.sqrt(v_new, out=out)
            out /= f32(sqrt_bc2)
            out += self.eps
            np.divide(m_new, out, out=out)
            out *= f32(step)
            if decay:
                np.multiply(s, f32(decay), out=tmp)
                out -= tmp
            return out
        import torch

        torch.lerp(m, g, float(w1), out=m_new)
        torch.mul(v, float(self.beta2), out=v_new)
        v_new.addcmul_(g, g, value=float(w2))
        torch.sqrt(v_new, out=out)
        out.div_(sqrt_bc2).add_(float(self.eps))
        torch.div(m_new, out, out=out)
        out.mul_(step)
        if decay:
            out.add_(s, alpha=-decay)
        return out


class MomentumSGD(States):
    """One worker's momentum SGD, the inner optimizer of its local steps: its buffer b."""

    def __init__(self, like: Any, momentum: float, depth: int = 2) -> None:
        super().__init__(like, ("b",), depth)
        self.mu = f32(momentum)

    def step(self, g: Any, s: Any, eta: float, out: Any, fresh: bool = True) -> Any:
        """d = −η·b of gradient ``g`` into ``out`` (``s`` unused: no weight decay)."""
        src, dst, _ = self.begin(fresh)
        if self.numpy:
            np.multiply(src["b"], self.mu, out=dst["b"])
            dst["b"] += g
            np.multiply(dst["b"], f32(-float(eta)), out=out)
            return out
        import torch

        torch.mul(src["b"], float(self.mu), out=dst["b"])
        dst["b"].add_(g)
        return torch.mul(dst["b"], -float(eta), out=out)


def own_optimizer(optim: OptimConfig, adamw: AdamWConfig, like: Any) -> States | None:
    """The worker's own optimizer, if it keeps one: AdamW (--optimizer adamw), momentum SGD
    (μ: --momentum) as the inner optimizer of --local-steps H > 1; None: Δθ = −η·g."""
    depth = DEPTH[optim.worker_mode]
    if optim.optimizer == OPT_ADAMW:
        return AdamW(like, adamw, depth)
    if optim.local_steps > 1:
        return MomentumSGD(like, optim.momentum, depth)
    return None
