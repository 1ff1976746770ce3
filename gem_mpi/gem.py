"""The update rules the master applies: GEM, DOWNPOUR and adaptive staleness.

The numpy functions here are the reference implementation; the C++ extension (``_core``)
computes the same float32 operations in the same order, fused into one pass, and the tests
hold the two to bit-for-bit equality. :class:`Kernel` picks the extension when it is built.

Master-side GEM (spec section 3) needs three numbers per element from the worker: its
update Δθ, its permitted amplitude ``a = κ|m|`` and the parameters ``s`` it computed Δθ on.
With the master's current θ::

    π = clamp((a − |θ − s|) / (|Δθ| + ε), 0, π_max);   θ ← θ + π Δθ

DOWNPOUR and adaptive staleness are the same loop with π fixed to 1 and 1 / (τ + 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

METHODS = ("gem", "downpour", "adaptive")


def payload_floats(method: str, n_params: int) -> int:
    """Floats a worker sends per update: (Δθ, κ|m|, s) for GEM, Δθ alone otherwise."""
    return 3 * n_params if method == "gem" else n_params


def fixed_scale(method: str, staleness: int) -> float:
    """π of the non-GEM methods: 1 for DOWNPOUR, 1/(τ+1) for adaptive staleness."""
    return 1.0 / (staleness + 1.0) if method == "adaptive" else 1.0


def gem_apply_numpy(
    theta: np.ndarray,
    delta: np.ndarray,
    a: np.ndarray,
    s: np.ndarray,
    pi_out: np.ndarray,
    eps: float,
    pi_max: float,
) -> None:
    """Reference GEM step, in place on θ; π lands in ``pi_out`` for the metrics."""
    np.abs(theta - s, out=pi_out)
    np.subtract(a, pi_out, out=pi_out)
    pi_out /= np.abs(delta) + np.float32(eps)
    np.clip(pi_out, np.float32(0.0), np.float32(pi_max), out=pi_out)
    theta += pi_out * delta


def scaled_apply_numpy(theta: np.ndarray, delta: np.ndarray, scale: float) -> None:
    """Reference fixed-π step, in place on θ."""
    theta += np.float32(scale) * delta


class Kernel:
    """The apply functions the master uses: the C++ extension if built, numpy otherwise."""

    def __init__(self, prefer_extension: bool = True) -> None:
        self.extension = None
        if prefer_extension:
            try:
                from gem_mpi import _core

                self.extension = _core
            except ImportError:
                self.extension = None

    @property
    def name(self) -> str:
        if self.extension is not None:
            return "C++ extension gem_mpi._core"
        return "numpy reference (C++ extension gem_mpi._core NOT built: slower master)"

    def gem_apply(self, theta, delta, a, s, pi_out, eps: float, pi_max: float) -> None:
        if self.extension is not None:
            self.extension.gem_apply(theta, delta, a, s, pi_out, float(eps), float(pi_max))
        else:
            gem_apply_numpy(theta, delta, a, s, pi_out, eps, pi_max)

    def scaled_apply(self, theta: np.ndarray, delta: np.ndarray, scale: float) -> None:
        if self.extension is not None:
            self.extension.scaled_apply(theta, delta, float(scale))
        else:
            scaled_apply_numpy(theta, delta, scale)


@dataclass
class GemStats:
    """What the metrics record of one GEM step."""

    pi_median: np.ndarray  # per tensor
    clamp_frac: np.ndarray  # per tensor: share of elements where π hit 0 or π_max
    energy_central: float  # ½‖θ_new − s‖²: the central variable's kinetic energy seen by w
    energy_proxy: float  # ½‖κ m‖²: the (amplified) proxy energy GEM matches


def gem_stats(
    pi: np.ndarray,
    theta_new: np.ndarray,
    s: np.ndarray,
    a: np.ndarray,
    offsets: np.ndarray,
    pi_max: float,
) -> GemStats:
    """Per-tensor summaries of one step; vectorised over elements, a loop over tensors only."""
    medians = np.array(
        [np.median(pi[offsets[i]:offsets[i + 1]]) for i in range(len(offsets) - 1)],
        dtype=np.float32,
    )
    clamped = (pi <= 0.0) | (pi >= np.float32(pi_max))
    counts = np.add.reduceat(clamped, offsets[:-1])
    sizes = np.diff(offsets)
    d = theta_new - s
    return GemStats(
        pi_median=medians,
        clamp_frac=(counts / sizes).astype(np.float32),
        energy_central=0.5 * float(np.dot(d, d)),
        energy_proxy=0.5 * float(np.dot(a, a)),
    )
