"""A worker's AdamW (``--optimizer adamw``): its moments over its own gradient stream and the
step d it takes at the θ it pulled, the update it sends instead of −η·g
(../shared/GEM_SPEC.md §10; GEM's budget is then κ|d|, the master's rule unchanged):

    m ← m + (1 − β₁)(g − m),   v ← β₂v + (1 − β₂)g²,   t ← t + 1
    d = −(η/(1 − β₁ᵗ))·m / (√v/√(1 − β₂ᵗ) + ε) − ηλ·s

in the order of torch.optim.AdamW's step (m by lerp, the decoupled weight decay taken at s),
so that one worker with κ = 1 is sequential AdamW up to float32 rounding (torch folds the
decay into θ before the step; here it is a term of d). In float32, on numpy arrays (the
quadratic problem) or torch tensors alike; the numpy reference
(:mod:`gem_mpi.algorithm.reference`) writes the same formulas on its own.

m and v are written into the oldest of ``depth`` sets of arrays (no copy), so the states
before the worker's last ``depth − 1`` steps are kept: a worker may have taken steps the master
never applied when a run stops (a pipelined worker has computed its next step, and its last
commit may be unapplied), so a stop saves them all and a resume takes the one holding exactly
the updates the master had applied, as GEM's momentum keeps the m before its last fold
(:class:`gem_mpi.algorithm.rule.Momentum`). A worker that starts without a saved state starts
at zero moments and t = 0, whatever its first step's number.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from gem_mpi.config import OVERLAP, PIPELINED, WAIT, AdamWConfig

f32 = np.float32


def corrections(beta1: float, beta2: float, t: int) -> tuple[float, float]:
    """(1/(1 − β₁ᵗ), √(1 − β₂ᵗ)) of step t ≥ 1, in float64 as torch computes them."""
    return 1.0 / (1.0 - beta1 ** t), math.sqrt(1.0 - beta2 ** t)


# the states a worker keeps, by --worker-mode: a stop finds it at most this many steps less
# one ahead of the master's applied updates (waiting: its last commit may be unapplied;
# pipelined: its next step computed too; overlapped: and the one after that under way)
DEPTH = {WAIT: 2, PIPELINED: 3, OVERLAP: 4}


class AdamW:
    """One worker's AdamW state (numpy or torch, like ``like``) and its step."""

    def __init__(self, like: Any, cfg: AdamWConfig, depth: int = 2) -> None:
        """``depth``: the states kept, this one and those before the last depth − 1 steps."""
        self.numpy = isinstance(like, np.ndarray)
        self.ms = [self._zeros(like) for _ in range(depth)]
        self.vs = [self._zeros(like) for _ in range(depth)]
        self.ts = [0] * depth  # the steps each state's moments hold (bias correction)
        self.head = 0  # the current state's set
        self.tmp = self._zeros(like) if self.numpy else None
        self.beta1, self.beta2 = f32(cfg.beta1), f32(cfg.beta2)
        self.eps, self.decay = f32(cfg.adam_eps), cfg.weight_decay
        self.folded = 0  # the worker's updates the current state holds (which a resume takes)

    def _zeros(self, like: Any) -> Any:
        return np.zeros_like(like) if self.numpy else like.new_zeros(like.shape)

    @property
    def m(self) -> Any:
        return self.ms[self.head]

    @property
    def v(self) -> Any:
        return self.vs[self.head]

    @property
    def t(self) -> int:
        return self.ts[self.head]

    def step(self, g: Any, s: Any, eta: float, out: Any) -> Any:
        """d of gradient ``g`` at ``s`` with learning rate ``eta``, into ``out``; the new
        state replaces the oldest kept one."""
        m, v, new = self.m, self.v, (self.head + 1) % len(self.ms)
        m_new, v_new, t = self.ms[new], self.vs[new], self.t + 1
        self.ts[new], self.head = t, new
        self.folded += 1
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

    def arrays(self) -> list[dict[str, np.ndarray]]:
        """The kept states on the host, newest first (the current one, then the one before
        the last step, ...), as a stop saves them."""
        def host(x: Any) -> np.ndarray:
            return x if self.numpy else x.detach().cpu().numpy()

        depth = len(self.ms)
        order = [(self.head - back) % depth for back in range(depth)]
        return [{"m": host(self.ms[i]), "v": host(self.vs[i]), "t": np.int64(self.ts[i])}
                for i in order]

    def restore(self, values: dict[str, np.ndarray], folded: int) -> None:
        """A saved state (one of :meth:`arrays`') holding the worker's first ``folded``
        updates."""
        for target, name in ((self.m, "m"), (self.v, "v")):
            if self.numpy:
                target[...] = values[name]
            else:
                import torch

                target.copy_(torch.from_numpy(values[name]))
        self.ts[self.head], self.folded = int(values["t"]), folded
