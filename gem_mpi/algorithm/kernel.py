"""The master's half of the update rules, fused: GEM, DOWNPOUR, adaptive staleness, Gap-Aware.

The numpy functions here are the reference implementation, kept forever; the C++ extension
(``_core``) computes the same float32 operations on θ in the same order, fused into one pass
with the statistics, and the tests hold θ to bit-for-bit equality. :class:`Kernel` picks the
extension when it is built.

Master-side GEM (see :mod:`gem_mpi.algorithm.rule`) needs three numbers per element from the
worker: its update Δθ, its permitted amplitude ``a = κ|m|`` and the parameters ``s`` it
computed Δθ on. With the master's current θ::

    π = clamp((a − |θ − s|) / (|Δθ| + ε), 0, π_max);   θ ← θ + π Δθ

DOWNPOUR and adaptive staleness are the same loop with π fixed to 1 and 1 / (τ + 1). An
update holding a NaN or an Inf is rejected whole: θ is not touched.

With the global proxy (``--gem-proxy global``, :class:`GlobalProxy`) the worker sends no
``a``: the master keeps the proxy's first moment m itself and, in the same pass, folds the
unscaled Δθ into it and takes ``a`` from it, with the float32 operations a GEM worker uses::

    m ← μ_g·m + c·Δθ;   a = |m|·κ           (μ_g = μ, c = 1 with one worker: local GEM)

A rejected update touches neither θ nor m (its ``a`` counts in the finiteness check).

With ``--wire bf16`` Δθ and ``a`` arrive as bf16 bits (uint16 arrays; the worker rounds them
with :func:`to_bf16`: Δθ to nearest even, ``a`` toward zero). Every step widens them exactly
to float32 and runs the float32 arithmetic above on the widened values, so π comes from what
was sent, θ ← θ + π·q, and the statistics (a², the Δθ = 0 count) are those of the widened
values; s, θ and the global proxy's m stay float32.

Gap-Aware (``--method gap-aware``, :class:`GapAware`) divides Δθ element-wise by a penalty
that grows with the gap G = |θ − s| between the master's θ and the θ Δθ was computed at,
measured in C, an estimate of one parameter's typical step kept at the master: a moving
average v of the squared incoming steps (θ-sized, float32). For the master's t-th applied
update (t = its clock + 1), in float32, one rounding per operation, in this order::

    v ← γ·v + g·(Δθ·Δθ)        g = float32(1 − γ)        (the unscaled Δθ, as sent)
    C = √(v / b_t) + ε          b_t = float32(1 − γ^t)   (bias correction, float64 power)
    P = 1 + |θ − s| / C;   θ ← θ + Δθ / P

An update whose Δθ or s holds a NaN or an Inf, or whose v would overflow, is rejected whole:
θ and v untouched. Its statistic: the mean of 1/P over the elements (``ga_scale_mean``).

Statistics per tensor: exact counts of the clamped elements (π ≤ 0, π ≥ π_max) and of the
elements with Δθ = 0 (they do not move whatever π is, and their π, (a − |θ − s|)/ε, is
always clamped: counted apart so that the clamp shares can be read without them); the sums
of (θ_new − s)² and a² behind the energies; and a histogram of π with :data:`HIST_BINS`
equal bins over (0, π_max) plus one bin for each clamp, from which the lower median is read.
For tensors of up to HIST_SAMPLE = 8192 elements the histogram holds every element and the
median is off by at most one bin width, π_max / HIST_BINS; larger tensors contribute every
``sample_stride(n)``-th element (between 4096 and 8192 evenly spaced ones), which adds a
sampling error of at most about 0.5 / √4096 ≈ 0.8 % of the tensor's elements in rank (one
standard error). Histogram increments are the kernel's costliest part; sampling bounds them.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import numpy as np

from gem_mpi.errors import UsageError

HIST_BINS = 512  # must equal _core.HIST_BINS (checked when the extension loads)
HIST_SAMPLE = 8192  # must equal _core.HIST_SAMPLE
COUNTS = 3  # per tensor: π ≤ 0, π ≥ π_max, Δθ = 0; must equal _core.COUNTS


BF16_NEAREST_EVEN, BF16_TOWARD_ZERO = 0, 1  # to_bf16's modes; must equal _core's


def widen(x: np.ndarray) -> np.ndarray:
    """A wire array as float32: uint16 bf16 bits widened exactly (the top half of a float32),
    a float32 array as it is."""
    if x.dtype != np.uint16:
        return x
    return (x.astype(np.uint32) << 16).view(np.float32)


def to_bf16_numpy(src: np.ndarray, dst: np.ndarray, mode: int) -> None:
    """dst (uint16) = the bf16 bits of src (float32): rounded to nearest even (add 0x7FFF and
    the kept half's lowest bit, keep the top half; a finite value may become ±Inf) or toward
    zero (keep the top half). A NaN is handled apart in both, its top half with the quiet bit
    set: the addition would carry a NaN into Inf or wrap a −NaN to +0. The reference of
    ``_core.to_bf16``, bit for bit."""
    u = src.view(np.uint32)
    top = u >> np.uint32(16)
    if mode == BF16_NEAREST_EVEN:
        r = (u + (np.uint32(0x7FFF) + (top & np.uint32(1)))) >> np.uint32(16)
    elif mode == BF16_TOWARD_ZERO:
        r = top
    else:
        raise ValueError(f"to_bf16: unknown mode {mode}")
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    dst[...] = np.where(nan, top | np.uint32(0x0040), r).astype(np.uint16)


def to_bf16(src: np.ndarray, dst: np.ndarray, mode: int, extension: object | None = None) -> None:
    """A worker's bf16 conversion (--wire bf16): ``_core.to_bf16`` (one pass, the GIL
    released) when ``extension`` is given, else the numpy reference; the same bits."""
    if extension is not None:
        extension.to_bf16(src, dst, mode)  # type: ignore[attr-defined]
    else:
        to_bf16_numpy(src, dst, mode)


def sample_stride(n: int) -> int:
    """A tensor's histogram takes every stride-th element: at most HIST_SAMPLE of them."""
    return 1 if n <= HIST_SAMPLE else -(-n // HIST_SAMPLE)


def pi_bins(pi: np.ndarray, pi_max: float) -> np.ndarray:
    """Histogram bin of each π: 0 clamped low, 1..HIST_BINS interior, HIST_BINS+1 high."""
    inv = np.float32(HIST_BINS) / np.float32(pi_max)
    interior = 1 + np.minimum(HIST_BINS - 1, (pi * inv).astype(np.int32))
    return np.where(pi > 0, np.where(pi >= np.float32(pi_max), HIST_BINS + 1, interior), 0)


@dataclass
class GlobalProxy:
    """The global proxy's state at the master: its first moment m (float32, θ's size, the
    kernel writes it) and the float32 constants of m ← mu·m + gain·Δθ, a = |m|·kappa."""

    m: np.ndarray
    mu: np.float32
    gain: np.float32
    kappa: np.float32

    def fold(self, delta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(m after folding Δθ in, a = κ|m|) as new arrays; ``self.m`` untouched. The
        worker's operations in its order (Momentum.fold), one float32 rounding each."""
        m = self.m * self.mu
        m += self.gain * delta
        a = np.abs(m)
        a *= self.kappa
        return m, a


@dataclass
class GapAware:
    """Gap-Aware's state at the master: v, the moving average of the squared incoming steps
    (float32, θ's size, the kernel writes it), and the float32 constants of
    v ← decay·v + gain·Δθ², C = √(v / b_t) + eps (:func:`ga_bias` gives b_t)."""

    v: np.ndarray
    decay: np.float32
    gain: np.float32  # float32(1 − decay)
    eps: np.float32

    @classmethod
    def of(cls, v: np.ndarray, decay: float, eps: float) -> GapAware:
        d = np.float32(decay)
        return cls(v, d, np.float32(1.0 - float(d)), np.float32(eps))

    def bias(self, t: int) -> np.float32:
        """b_t = 1 − γ^t for the t-th update (t ≥ 1), computed in float64 and rounded once."""
        return ga_bias(self.decay, t)


def ga_bias(decay: np.float32, t: int) -> np.float32:
    """Adam's bias correction of a moving average started at 0: float32(1 − γ^t), γ^t in
    float64 from the float32 γ (the replay and both kernels take this one value)."""
    return np.float32(1.0 - float(decay) ** max(int(t), 1))


def gap_step_numpy(theta: np.ndarray, delta: np.ndarray, s: np.ndarray, ga: GapAware,
                   t: int) -> float | None:
    """Reference Gap-Aware step, in place on θ and ``ga.v``, for the master's t-th update;
    the mean of 1/P, or None when rejected (θ and v untouched). ``delta`` may be bf16 bits
    (uint16, --wire bf16): widened exactly first."""
    delta = widen(delta)
    with np.errstate(over="ignore", invalid="ignore"):  # an overflowing v is rejected below
        v = ga.decay * ga.v
        v += ga.gain * (delta * delta)
    if not (np.isfinite(delta).all() and np.isfinite(s).all() and np.isfinite(v).all()):
        return None
    ga.v[...] = v
    c = np.sqrt(v / ga.bias(t))
    c += ga.eps
    penalty = np.abs(theta - s)
    with np.errstate(over="ignore"):  # a gap of many C: P = inf, the element does not move
        penalty /= c
    penalty += np.float32(1.0)
    theta += delta / penalty
    return float(np.sum(np.float32(1.0) / penalty, dtype=np.float64)) / max(theta.size, 1)


@dataclass
class GapStats:
    """What the metrics record of one Gap-Aware step."""

    scale_mean: float  # the mean over the elements of 1/P, the share of Δθ applied


def gem_step_numpy(
    theta: np.ndarray,
    delta: np.ndarray,
    a: np.ndarray | None,
    s: np.ndarray,
    offsets: np.ndarray,
    eps: float,
    pi_max: float,
    hist: np.ndarray,
    sums: np.ndarray,
    counts: np.ndarray,
    keep: np.ndarray | None = None,
    proxy: GlobalProxy | None = None,
) -> bool:
    """Reference GEM step, in place on θ, accumulating statistics like the kernel; ``keep``
    (which may be ``s`` itself) receives θ before the update. With ``proxy`` (the global
    proxy) ``a`` is None and is made from the proxy's m, which the step updates. ``delta``
    and ``a`` may be bf16 bits (uint16, --wire bf16): widened exactly first."""
    delta = widen(delta)
    a = None if a is None else widen(a)
    m_new = None
    if proxy is not None:
        m_new, a = proxy.fold(delta)
    if not (np.isfinite(delta).all() and np.isfinite(a).all() and np.isfinite(s).all()):
        return False
    if proxy is not None:
        proxy.m[...] = m_new
    pi = np.abs(theta - s)
    np.subtract(a, pi, out=pi)
    pi /= np.abs(delta) + np.float32(eps)
    np.clip(pi, np.float32(0.0), np.float32(pi_max), out=pi)
    step = pi * delta
    diff = theta + step  # θ_new, before θ itself is written
    np.subtract(diff, s, out=diff)
    if keep is not None:
        keep[...] = theta
    theta += step
    e2 = diff * diff
    a2 = a * a
    bins = pi_bins(pi, pi_max)
    for t in range(len(offsets) - 1):
        lo, hi = int(offsets[t]), int(offsets[t + 1])
        hist[t] += np.bincount(bins[lo:hi:sample_stride(hi - lo)], minlength=HIST_BINS + 2)
        sums[t, 0] += np.sum(e2[lo:hi], dtype=np.float64)
        sums[t, 1] += np.sum(a2[lo:hi], dtype=np.float64)
        counts[t, 0] += np.count_nonzero(bins[lo:hi] == 0)
        counts[t, 1] += np.count_nonzero(bins[lo:hi] == HIST_BINS + 1)
        counts[t, 2] += np.count_nonzero(delta[lo:hi] == 0)
    return True


def fixed_step_numpy(theta: np.ndarray, delta: np.ndarray, scale: float) -> bool:
    """Reference fixed-π step, in place on θ; rejects a non-finite update. ``delta`` may be
    bf16 bits (uint16): widened exactly first."""
    delta = widen(delta)
    if not np.isfinite(delta).all():
        return False
    theta += np.float32(scale) * delta
    return True


def hist_median(hist: np.ndarray, pi_max: float) -> np.ndarray:
    """Lower median of π per tensor, read off its histogram.

    The lower median is the ⌈n/2⌉-th smallest π. It is exact when it is clamped (0 or
    π_max); otherwise the estimate is interpolated inside the bin that holds it, so it is
    off by at most one bin width, π_max / HIST_BINS. All tensors at once, no Python loop
    over them: the master calls it for every update, and models have hundreds of tensors.
    """
    total = hist.sum(axis=1)
    rank = (total + 1) // 2
    cum = np.cumsum(hist, axis=1)
    b = np.count_nonzero(cum < rank[:, None], axis=1)  # the bin holding the rank-th π
    rows = np.arange(hist.shape[0])
    below = np.where(b > 0, cum[rows, np.maximum(b - 1, 0)], 0)
    inside = np.maximum(hist[rows, np.minimum(b, HIST_BINS + 1)], 1)
    est = (b - 1 + (rank - below - 0.5) / inside) * (pi_max / HIST_BINS)
    out = np.where(b == 0, 0.0, np.where(b == HIST_BINS + 1, pi_max, est))
    return np.where(total == 0, np.nan, out).astype(np.float32)


def pooled_median(hist: np.ndarray, sizes: np.ndarray, pi_max: float) -> float:
    """Median of π over all parameters, from the per-tensor histograms pooled.

    Each tensor's histogram counts a sample of its elements (``sample_stride``), so its
    counts are weighted by size / sampled before they are added: every parameter weighs the
    same, whatever tensor holds it. The median is read like :func:`hist_median`'s (exact when
    it is clamped, else interpolated inside its bin, within π_max / HIST_BINS), at half the
    pooled weight. NaN when nothing was counted.
    """
    sampled = hist.sum(axis=1)
    weights = np.divide(sizes, sampled, out=np.zeros(len(sizes)), where=sampled > 0)
    row = np.zeros(hist.shape[1])
    for t in range(hist.shape[0]):  # tensor by tensor, the order _core.gem_summary adds in
        row += weights[t] * hist[t]
    cum = np.cumsum(row)
    total = float(cum[-1])
    if total <= 0:
        return float("nan")
    half = 0.5 * total
    b = int(np.searchsorted(cum, half))
    if b == 0:
        return 0.0
    if b >= HIST_BINS + 1:
        return float(pi_max)
    frac = (half - cum[b - 1]) / row[b]
    return float((b - 1 + frac) * (pi_max / HIST_BINS))


@dataclass
class GemStats:
    """What the metrics record of one GEM step."""

    pi_median: np.ndarray  # per tensor: lower median, to within π_max / HIST_BINS
    clamp_frac: np.ndarray  # per tensor: share of elements where π hit 0 or π_max
    clamp_low_frac: np.ndarray  # per tensor: share of elements where π hit 0
    zero_delta_frac: np.ndarray  # per tensor: share of elements with Δθ = 0 (always clamped)
    pi_median_all: float  # over all parameters: pooled_median
    energy_central: float  # ½‖θ_new − s‖²: the central variable's kinetic energy seen by w
    energy_proxy: float  # ½‖κ m‖²: the (amplified) proxy energy GEM matches


def summary_numpy(hist: np.ndarray, sums: np.ndarray, counts: np.ndarray, sizes: np.ndarray,
                  pi_max: float) -> GemStats:
    """The reference reading of one step's statistics (``_core.gem_summary`` gives its bits;
    the energies are summed tensor by tensor, in order, as it does)."""
    clamped = counts[:, :2].sum(axis=1)
    size = np.maximum(sizes, 1)
    return GemStats(
        pi_median=hist_median(hist, pi_max),
        clamp_frac=(clamped / size).astype(np.float32),
        clamp_low_frac=(counts[:, 0] / size).astype(np.float32),
        zero_delta_frac=(counts[:, 2] / size).astype(np.float32),
        pi_median_all=pooled_median(hist, sizes, pi_max),
        energy_central=0.5 * sum(sums[:, 0].tolist()),
        energy_proxy=0.5 * sum(sums[:, 1].tolist()),
    )


def node_cores_left(local_ranks: int, local_masters: int = 1) -> int:
    """The cores this rank may run on (its affinity) less one per worker on its node, shared
    evenly among the ``local_masters`` masters there, at least 1: a master's share, for its
    kernel and its evaluation alike (--masters K on one node: K masters would otherwise each
    take every leftover core, K times over)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)
    masters = max(1, local_masters)
    return max(1, (cores - (local_ranks - masters)) // masters)


def kernel_threads(local_ranks: int = 1, local_masters: int = 1) -> int:
    """GEM_NUM_THREADS, else this master's share of the cores its node's workers leave
    (:func:`node_cores_left`): a master beside its workers takes no core from them."""
    value = os.environ.get("GEM_NUM_THREADS")
    if value is None:
        return node_cores_left(local_ranks, local_masters)
    try:
        threads = int(value)
    except ValueError:
        threads = 0
    if threads < 1:
        raise UsageError(f"GEM_NUM_THREADS must be a positive integer, got {value!r}")
    cores = os.cpu_count() or 1
    if threads > cores:
        raise UsageError(f"GEM_NUM_THREADS {threads} is more than the {cores} cores of the "
                         "master's node")
    return threads


def load_extension() -> tuple[object | None, str]:
    """(gem_mpi.algorithm._core, "") when it loads and agrees with this module; else (None, why not)."""
    try:
        # imported here, not at the top: a missing or stale build is reported (the numpy
        # reference runs), not raised on import
        from gem_mpi.algorithm import _core
    except ImportError as exc:
        if getattr(exc, "name", None) == "gem_mpi.algorithm._core":
            return None, "not built; pip install . builds it"
        return None, f"built but does not load: {exc}"
    for name, want in (("HIST_BINS", HIST_BINS), ("HIST_SAMPLE", HIST_SAMPLE),
                       ("COUNTS", COUNTS), ("BF16_NEAREST_EVEN", BF16_NEAREST_EVEN),
                       ("BF16_TOWARD_ZERO", BF16_TOWARD_ZERO)):
        got = getattr(_core, name, None)
        if got != want:
            return None, f"stale build ({name} {got}, expected {want}); rebuild with pip install ."
    return _core, ""


@functools.cache
def _extension() -> object | None:
    return load_extension()[0]


def axpy(out: np.ndarray, x: np.ndarray, scale: float, y: np.ndarray,
         threads: int = 1) -> np.ndarray:
    """out = x + scale·y in float32 with one rounding per operation (scale·y, then the
    add; no FMA), so that the bits equal numpy's ``x + np.float32(scale) * y``: a worker's
    gradient point (:mod:`gem_mpi.engine.points`) from its Δθ = −η·g without Δθ made first,
    in one pass on the compute's path. The extension's triad when built, else numpy's two
    passes."""
    core = _extension()
    if core is not None:
        core.triad(out, x, y, float(scale), threads)  # type: ignore[attr-defined]
    elif scale == 1.0:
        np.add(x, y, out=out)
    else:
        np.multiply(y, np.float32(scale), out=out)
        np.add(x, out, out=out)
    return out


class Kernel:
    """The master's update kernel: the C++ extension if built, else the numpy reference."""

    def __init__(self, offsets: np.ndarray, prefer_extension: bool = True,
                 threads: int = 1) -> None:
        self.offsets = np.ascontiguousarray(offsets, dtype=np.int64)
        self.sizes = np.diff(self.offsets)
        self.threads = threads
        self.extension = None
        self.why_not = "--no-extension"  # why the extension is not used, when it is not
        if prefer_extension:
            self.extension, self.why_not = load_extension()
        n_tensors = len(self.offsets) - 1
        self._hist = np.zeros((n_tensors, HIST_BINS + 2), dtype=np.int64)
        self._sums = np.zeros((n_tensors, 2), dtype=np.float64)
        self._counts = np.zeros((n_tensors, COUNTS), dtype=np.int64)

    @property
    def name(self) -> str:
        if self.extension is not None:
            return f"C++ extension gem_mpi.algorithm._core ({self.threads} thread(s))"
        return f"numpy reference (C++ extension gem_mpi.algorithm._core not used: {self.why_not})"

    def gem_step(self, theta: np.ndarray, delta: np.ndarray, a: np.ndarray | None,
                 s: np.ndarray, eps: float, pi_max: float, keep: np.ndarray | None = None,
                 proxy: GlobalProxy | None = None) -> GemStats | None:
        """One GEM step; None when the update was rejected (θ untouched, and the proxy's m).
        ``keep`` (may be ``s``) receives θ before the update; ``proxy``: the global proxy,
        ``a`` None."""
        self._hist.fill(0)
        self._sums.fill(0.0)
        self._counts.fill(0)
        if self.extension is not None:
            px = {} if proxy is None else {"m": proxy.m, "mu": float(proxy.mu),
                                           "gain": float(proxy.gain),
                                           "kappa": float(proxy.kappa)}
            ok = self.extension.gem_step(theta, delta, a, s, self.offsets, float(eps),
                                         float(pi_max), self._hist, self._sums, self._counts,
                                         self.threads, keep, **px)
        else:
            ok = gem_step_numpy(theta, delta, a, s, self.offsets, eps, pi_max, self._hist,
                                self._sums, self._counts, keep, proxy)
        if not ok:
            return None
        if self.extension is None:
            return summary_numpy(self._hist, self._sums, self._counts, self.sizes, pi_max)
        per_tensor = np.empty((4, len(self.sizes)), np.float32)  # the same values, without
        scalars = np.empty(3)  # numpy's per-call costs (a dozen small arrays per update)
        self.extension.gem_summary(self._hist, self._sums, self._counts, self.sizes,
                                   float(pi_max), per_tensor, scalars)
        return GemStats(*per_tensor, *scalars.tolist())

    def gap_step(self, theta: np.ndarray, delta: np.ndarray, s: np.ndarray, ga: GapAware,
                 t: int) -> GapStats | None:
        """One Gap-Aware step for the master's t-th applied update (t ≥ 1); None when it was
        rejected (θ and v untouched)."""
        if self.extension is not None:
            mean = self.extension.gap_step(theta, delta, s, ga.v, float(ga.decay),
                                           float(ga.gain), float(ga.bias(t)), float(ga.eps),
                                           self.threads)
        else:
            mean = gap_step_numpy(theta, delta, s, ga, t)
        return None if mean is None else GapStats(mean)

    def zero(self, x: np.ndarray) -> None:
        """x[:] = 0 (1-D float32, fresh memory the kernel will stream as one of its θ-long
        arrays), each of the kernel's threads zeroing the range it streams: this first touch
        places every page on the NUMA node of the thread that will read or write it."""
        if self.extension is not None:
            self.extension.fill(x, 0.0, self.threads)
        else:
            x.fill(0)

    def fixed_step(self, theta: np.ndarray, delta: np.ndarray, scale: float) -> bool:
        """One DOWNPOUR/adaptive step; False when the update was rejected (θ untouched)."""
        if self.extension is not None:
            return bool(self.extension.fixed_step(theta, delta, float(scale), self.threads))
        return fixed_step_numpy(theta, delta, scale)
