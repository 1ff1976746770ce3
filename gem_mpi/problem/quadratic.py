"""A convex quadratic problem in plain numpy: the deterministic model of the invariant tests.

Worker w minimises L_w(θ) = ½ Σ h ⊙ (θ − c_w)², so Δθ = −η h ⊙ (s − c_w) depends only on
the parameters s it was computed on. That makes a whole asynchronous run replayable from
its event log, and it needs no torch, so tests and transport benchmarks start in a second.
"""

from __future__ import annotations

import itertools

import numpy as np

TENSOR_SPLIT = 4  # reported as this many equal "tensors" so per-tensor metrics have work


class Quadratic:
    def __init__(self, dim: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.dim = dim
        self.h = rng.uniform(0.5, 1.5, dim).astype(np.float32)
        self.center = rng.normal(0.0, 1.0, dim).astype(np.float32)
        self.seed = seed

    def theta0(self) -> np.ndarray:
        return np.zeros(self.dim, dtype=np.float32)

    def target(self, rank: int) -> np.ndarray:
        """c_w: the shared optimum plus a per-worker offset, so workers disagree a little."""
        rng = np.random.default_rng((self.seed, rank))
        return self.center + np.float32(0.1) * rng.normal(0.0, 1.0, self.dim).astype(np.float32)

    def step(self, s: np.ndarray, target: np.ndarray, lr: float) -> tuple[np.ndarray, float]:
        """(Δθ, loss) at s."""
        diff = s - target
        loss = 0.5 * float(np.dot(self.h * diff, diff))
        return np.float32(-lr) * (self.h * diff), loss

    def tensors(self) -> tuple[list[str], list[int]]:
        bounds = np.linspace(0, self.dim, TENSOR_SPLIT + 1).astype(int)
        sizes = [int(b - a) for a, b in itertools.pairwise(bounds) if b > a]
        return [f"block{i}" for i in range(len(sizes))], sizes
