"""What scales a worker's gradient into Δθ = −η·g: the learning-rate schedule and clipping.

η is a function of the worker's own step number (its update's ``seq``; sync: the step), not
of the master's clock as the worker last saw it. A worker's step is known before its
gradient is taken, is the same in every replay and resume, and is what its proxy momentum
folds in order: GEM's m ← μm + Δθ then follows exactly the η of the updates it matches, as
a synchronous momentum SGD with the same schedule would. The master's clock depends on the
other workers' timing, so a schedule over it could be neither replayed nor resumed exactly.

A schedule spans the worker's budget (``steps``), as a synchronous run's spans its steps.
The multiplier is computed in float64 and η rounded to float32 once, so the workers, the
synchronous baseline and the numpy reference (gem_mpi.algorithm.reference) get the same
bits for every step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from gem_mpi.config import CONSTANT, COSINE, STEP, OptimConfig


@dataclass(frozen=True)
class Schedule:
    """η at each of a worker's ``steps`` steps."""

    lr: float
    steps: int  # the worker's budget: the cosine spans it unless decay_steps says otherwise
    kind: str = CONSTANT
    warmup: int = 0
    decay_steps: int = 0
    step_every: int = 0
    gamma: float = 0.1
    lr_min: float = 0.0

    @classmethod
    def of(cls, optim: OptimConfig, steps: int) -> Schedule:
        return cls(optim.lr, steps, optim.lr_schedule, optim.warmup_steps,
                   optim.lr_decay_steps, optim.lr_step_every, optim.lr_gamma, optim.lr_min)

    @property
    def constant(self) -> bool:
        return self.kind == CONSTANT and self.warmup == 0

    def factor(self, step: int) -> float:
        """η(step) / η, in float64."""
        if step < self.warmup:
            return (step + 1) / self.warmup
        t = step - self.warmup
        if self.kind == STEP:
            return self.gamma ** (t // self.step_every)
        if self.kind == COSINE:
            span = (self.decay_steps or self.steps) - self.warmup
            done = min(t / span, 1.0) if span > 0 else 1.0
            low = self.lr_min / self.lr
            return low + (1.0 - low) * 0.5 * (1.0 + math.cos(math.pi * done))
        return 1.0

    def eta(self, step: int) -> np.float32:
        """η at ``step`` (0-based), in the float32 the worker multiplies by."""
        if self.constant:
            return np.float32(self.lr)
        return np.float32(self.lr * self.factor(step))


def clip_coefficient(norm: float, max_norm: float) -> float:
    """The factor that brings a gradient of L2 norm ``norm`` to at most ``max_norm`` (1.0
    when it already is; ``max_norm`` 0: no clipping), as torch.nn.utils.clip_grad_norm_
    computes it."""
    if max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (norm + 1e-6))


def clip(g: np.ndarray, max_norm: float) -> np.ndarray:
    """``g`` clipped to L2 norm ``max_norm`` (float32; the norm taken in float64); ``g``
    itself when no clipping applies, so the unclipped path is the unchanged one."""
    if max_norm <= 0:
        return g
    coef = clip_coefficient(float(np.sqrt(np.dot(g.astype(np.float64), g))), max_norm)
    return g if coef >= 1.0 else np.float32(coef) * g


__all__ = ["Schedule", "clip", "clip_coefficient"]
