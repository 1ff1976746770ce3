"""The update rule, both halves and what travels between them.

GEM is split between a worker and the master so that π is computed against the master's
*current* θ, exactly, without a second round trip. The worker keeps its proxy momentum and
sends three numbers per element; the master computes π and applies it:

    worker:  m ← μ·m + Δθ,   a = κ·|m|,   sends (Δθ, a, s)     s: the θ Δθ was computed on
    master:  π = clamp((a − |θ − s|) / (|Δθ| + ε), 0, π_max),   θ ← θ + π·Δθ

DOWNPOUR (π = 1) and adaptive staleness (π = 1/(τ + 1)) send Δθ alone. An update holding a
NaN or an Inf is rejected whole by the master's kernel. This module is the one place that
knows the rule's formulas for the worker, the payload layout, and the fixed π of the
baselines; the fused master-side arithmetic lives in :mod:`gem_mpi.algorithm.kernel`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from gem_mpi.algorithm.kernel import GemStats, Kernel
from gem_mpi.config import ADAPTIVE, GEM, OptimConfig


def payload_floats(method: str, n_params: int) -> int:
    """Floats a worker sends per update: (Δθ, κ|m|, s) for GEM, Δθ alone otherwise."""
    return 3 * n_params if method == GEM else n_params


def fixed_scale(method: str, staleness: int) -> float:
    """π of the non-GEM methods: 1 for DOWNPOUR, 1/(τ+1) for adaptive staleness."""
    return 1.0 / (staleness + 1.0) if method == ADAPTIVE else 1.0


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

    @classmethod
    def zeros_like(cls, x: Any, optim: OptimConfig) -> Momentum:
        if isinstance(x, np.ndarray):
            z, scalar = np.zeros_like(x), np.float32
        else:  # torch: a Python float multiplies a float32 tensor in float32
            z, scalar = x.new_zeros(x.shape), float
        return cls(z, z.clone() if hasattr(z, "clone") else z.copy(),
                   scalar(optim.momentum), scalar(optim.kappa))

    def fold(self, delta: Any) -> Any:
        """m ← μ·m + Δθ in place; returns a = κ·|m| (a new array of the same library)."""
        self.prev[...] = self.m
        self.m *= self.mu
        self.m += delta
        self.folded += 1
        a = abs(self.m)
        a *= self.kappa
        return a

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        def host(x: Any) -> np.ndarray:
            return x if isinstance(x, np.ndarray) else x.detach().cpu().numpy()

        return host(self.m), host(self.prev)

    def restore(self, values: np.ndarray, folded: int) -> None:
        if isinstance(self.m, np.ndarray):
            self.m[...] = values
        else:
            import torch

            self.m.copy_(torch.from_numpy(values))
        self.folded = folded


class WorkerRule:
    """The worker's half: what it sends the master for each Δθ, in the layout
    :meth:`MasterRule.apply` reads."""

    def __init__(self, optim: OptimConfig, like: Any) -> None:
        """``like``: an array (numpy, or a torch tensor on the worker's device) of θ's size."""
        self.momentum = Momentum.zeros_like(like, optim) if optim.method == GEM else None

    def payload(self, delta: np.ndarray, s: np.ndarray, delta_on_device: Any = None,
                to_host: Callable[[Any], np.ndarray] = np.asarray) -> tuple[np.ndarray, ...]:
        """(Δθ, κ|m|, s) for GEM, after folding Δθ into m; (Δθ,) otherwise. ``delta`` and
        ``s`` are host arrays; m lives beside ``delta_on_device`` (default: ``delta``)."""
        if self.momentum is None:
            return (delta,)
        a = self.momentum.fold(delta if delta_on_device is None else delta_on_device)
        return (delta, to_host(a), s)


class MasterRule:
    """The master's half: reads a payload the way the worker laid it out and applies it."""

    def __init__(self, optim: OptimConfig, kernel: Kernel, n_params: int) -> None:
        self.method, self.kernel, self.n = optim.method, kernel, n_params
        self.eps, self.pi_max = optim.eps, optim.pi_max
        self.floats = payload_floats(self.method, n_params)

    def apply(self, theta: np.ndarray, payload: np.ndarray,
              staleness: int) -> tuple[bool, GemStats | None]:
        """θ ← θ + π·Δθ in place; (applied, GEM statistics or None). Not applied: θ untouched."""
        n = self.n
        if self.method == GEM:
            stats = self.kernel.gem_step(theta, payload[:n], payload[n:2 * n],
                                         payload[2 * n:3 * n], self.eps, self.pi_max)
            return stats is not None, stats
        ok = self.kernel.fixed_step(theta, payload[:n], fixed_scale(self.method, staleness))
        return ok, None
