"""gem_mpi.algorithm._core's fused kernels against the numpy reference in gem_mpi.algorithm.kernel.

θ must match bit for bit, the histogram exactly, the double sums to rounding. The
extension is built by tools/install.sh (pip install .); when it is missing these tests
fail, they are never skipped.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import mpirun

from gem_mpi.algorithm import kernel as gem

EPS, PI_MAX = 1e-16, 5.0


def _inputs(n: int, seed: int = 0, scale: float = 1.0):
    rng = np.random.default_rng(seed)
    theta = (rng.normal(size=n) * scale).astype(np.float32)
    delta = (rng.normal(size=n) * 0.01 * scale).astype(np.float32)
    delta[::97] = 0.0  # (dead units) elements that do not move: counted apart
    a = np.abs(rng.normal(size=n) * 0.02 * scale).astype(np.float32)
    s = (theta + rng.normal(size=n) * 0.01 * scale).astype(np.float32)
    return theta, delta, a, s


def _offsets(n: int) -> np.ndarray:
    cuts = sorted({0, n // 3, n // 3, n // 2, n})  # includes an empty tensor when n is small
    return np.array(cuts if len(cuts) > 1 else [0, n], dtype=np.int64)


def _both(core, theta, delta, a, s, offsets, eps=EPS, pi_max=PI_MAX, threads=1):
    t = len(offsets) - 1
    out = []
    for fn in ("c", "numpy"):
        th = theta.copy()
        hist = np.zeros((t, gem.HIST_BINS + 2), np.int64)
        sums = np.zeros((t, 2))
        counts = np.zeros((t, gem.COUNTS), np.int64)
        with np.errstate(all="ignore"):
            if fn == "c":
                ok = core.gem_step(th, delta, a, s, offsets, eps, pi_max, hist, sums, counts,
                                   threads)
            else:
                ok = gem.gem_step_numpy(th, delta, a, s, offsets, eps, pi_max, hist, sums,
                                        counts)
        out.append((ok, th, hist, sums, counts))
    return out


def _assert_same(c, ref):
    assert c[0] == ref[0]
    assert np.array_equal(c[1].view(np.uint32), ref[1].view(np.uint32))  # bit for bit
    assert np.array_equal(c[2], ref[2])  # the histogram, same sample
    assert np.array_equal(c[4], ref[4])  # exact clamp counts
    # the kernel sums float32 squares in float within 1024-element blocks, numpy in double
    np.testing.assert_allclose(c[3], ref[3], rtol=2e-5, atol=1e-300)


def test_extension_agrees_on_the_histogram_size(core):
    assert core.HIST_BINS == gem.HIST_BINS and core.HIST_SAMPLE == gem.HIST_SAMPLE


@pytest.mark.parametrize("n", [1, 7, 1000, 1_000_003])
def test_gem_step_random(core, n):
    theta, delta, a, s = _inputs(n, seed=n)
    c, ref = _both(core, theta, delta, a, s, _offsets(n))
    assert c[0] is True
    _assert_same(c, ref)
    sizes = np.diff(_offsets(n))
    assert c[2].sum() == sum(len(range(0, k, gem.sample_stride(k))) for k in sizes)


@pytest.mark.parametrize("threads", [2, 3, 8])
def test_threads_change_nothing_but_sum_rounding(core, threads):
    n = 1_000_003
    theta, delta, a, s = _inputs(n, seed=1)
    one = _both(core, theta, delta, a, s, _offsets(n), threads=1)[0]
    many = _both(core, theta, delta, a, s, _offsets(n), threads=threads)[0]
    _assert_same(many, one)


@pytest.mark.parametrize(("eps", "pi_max"), [(1e-12, 1.0), (1e-8, 5.0), (1e-16, 0.5)])
def test_gem_step_parameters(core, eps, pi_max):
    theta, delta, a, s = _inputs(10_001, seed=2)
    c, ref = _both(core, theta, delta, a, s, _offsets(10_001), eps, pi_max)
    _assert_same(c, ref)


def test_zeros(core):
    z = np.zeros(1001, np.float32)
    c, ref = _both(core, z, z, z, z, _offsets(1001))
    _assert_same(c, ref)
    assert np.all(c[1] == 0) and c[4][:, 0].sum() == 1001  # π = 0/ε = 0: clamped low


def test_denormals_and_huge_values(core):
    for scale in (1e-40, 1e-30, 1e30):
        theta, delta, a, s = _inputs(4097, seed=3, scale=scale)
        c, ref = _both(core, theta.astype(np.float32), delta.astype(np.float32),
                       a.astype(np.float32), s.astype(np.float32), _offsets(4097))
        _assert_same(c, ref)


@pytest.mark.parametrize("where", ["delta", "a", "s"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_update_is_rejected_whole(core, where, bad):
    n = 100_003
    theta, delta, a, s = _inputs(n, seed=4)
    arrays = {"delta": delta, "a": a, "s": s}
    arrays[where][n - 1] = bad  # the very last element: everything before must stay
    for threads in (1, 4):
        c, ref = _both(core, theta, arrays["delta"], arrays["a"], arrays["s"], _offsets(n),
                       threads=threads)
        assert c[0] is False and ref[0] is False
        assert np.array_equal(c[1], theta) and np.array_equal(ref[1], theta)
        assert c[2].sum() == 0 and not c[3].any() and not c[4].any()


def test_fixed_step(core):
    theta, delta, _, _ = _inputs(1_000_003, seed=5)
    for scale in (1.0, 1.0 / 3.0, 1e-7):
        got, want = theta.copy(), theta.copy()
        assert core.fixed_step(got, delta, scale, 2) is True
        assert gem.fixed_step_numpy(want, delta, scale) is True
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    poisoned = delta.copy()
    poisoned[-1] = np.nan
    got = theta.copy()
    assert core.fixed_step(got, poisoned, 1.0, 1) is False
    assert np.array_equal(got, theta)


def _lower_median(x: np.ndarray) -> float:
    k = (len(x) - 1) // 2
    return float(np.partition(x, k)[k])


def test_histogram_median_is_within_one_bin(core):
    n = 13_000  # tensors of up to HIST_SAMPLE elements: every element is in the histogram
    theta, delta, a, s = _inputs(n, seed=6)
    delta[::7] = 0.0  # elements that do not move: counted apart, and always clamped
    delta[5::70] = -0.0
    offsets = np.array([0, 5_000, n], dtype=np.int64)
    kernel = gem.Kernel(offsets, prefer_extension=True)
    assert kernel.extension is core
    th = theta.copy()
    stats = kernel.gem_step(th, delta, a, s, EPS, PI_MAX)
    pi = np.clip((a - np.abs(theta - s)) / (np.abs(delta) + np.float32(EPS)), 0, PI_MAX)
    exact = np.array([_lower_median(pi[:5_000]), _lower_median(pi[5_000:])])
    assert np.all(np.abs(stats.pi_median - exact) <= PI_MAX / gem.HIST_BINS)
    clamped = [np.mean((p <= 0) | (p >= PI_MAX)) for p in (pi[:5_000], pi[5_000:])]
    np.testing.assert_allclose(stats.clamp_frac, clamped, rtol=1e-6)
    low = [np.mean(p <= 0) for p in (pi[:5_000], pi[5_000:])]
    np.testing.assert_allclose(stats.clamp_low_frac, low, rtol=1e-6)
    zero = [np.mean(d == 0) for d in (delta[:5_000], delta[5_000:])]
    assert min(zero) > 0.14
    np.testing.assert_allclose(stats.zero_delta_frac, zero, rtol=1e-6)
    # over all parameters: the pooled median, not a median of the tensors' medians
    assert abs(stats.pi_median_all - float(np.median(pi))) <= PI_MAX / gem.HIST_BINS
    np.testing.assert_allclose(stats.energy_proxy, 0.5 * np.sum(a.astype(np.float64) ** 2),
                               rtol=1e-6)
    d = (th - s).astype(np.float64)
    np.testing.assert_allclose(stats.energy_central, 0.5 * np.sum(d * d), rtol=1e-6)


def test_sampled_median_of_a_large_tensor(core):
    n = 1_000_000  # stride 123: 8 131 evenly spaced elements in the histogram
    theta, delta, a, s = _inputs(n, seed=8)
    kernel = gem.Kernel(np.array([0, n], dtype=np.int64))
    stats = kernel.gem_step(theta.copy(), delta, a, s, EPS, PI_MAX)
    pi = np.clip((a - np.abs(theta - s)) / (np.abs(delta) + np.float32(EPS)), 0, PI_MAX)
    # the estimate's rank among all elements is within 3 standard errors of the middle
    rank = np.mean(pi <= stats.pi_median[0])
    assert abs(rank - 0.5) <= 3 * 0.5 / np.sqrt(gem.HIST_SAMPLE / 2) + 1e-3
    np.testing.assert_allclose(stats.clamp_frac[0], np.mean((pi <= 0) | (pi >= PI_MAX)))


def test_pooled_median_weighs_every_parameter_alike_across_sampled_tensors(core):
    # a large tensor (sampled every 123rd element) whose π sit low and a small one whose π
    # sit high: the median over all parameters follows the large one, and a median of the
    # two tensors' medians weighted by size would say the same only by luck of the split
    n_big, n_small = 1_000_000, 3_000
    n = n_big + n_small
    theta, delta, a, s = _inputs(n, seed=9)
    a[n_big:] += np.float32(50.0)  # the small tensor's π clamp high
    offsets = np.array([0, n_big, n], dtype=np.int64)
    stats = gem.Kernel(offsets).gem_step(theta.copy(), delta, a, s, EPS, PI_MAX)
    pi = np.clip((a - np.abs(theta - s)) / (np.abs(delta) + np.float32(EPS)), 0, PI_MAX)
    rank = np.mean(pi <= stats.pi_median_all)
    assert abs(rank - 0.5) <= 3 * 0.5 / np.sqrt(gem.HIST_SAMPLE / 2) + 1e-3
    assert stats.pi_median_all < PI_MAX  # not the small tensor's clamped level
    np.testing.assert_allclose(stats.clamp_low_frac, [np.mean(pi[:n_big] <= 0),
                                                      np.mean(pi[n_big:] <= 0)])


def test_numpy_kernel_gives_the_same_stats():
    n = 30_001
    theta, delta, a, s = _inputs(n, seed=7)
    offsets = _offsets(n)
    k_np = gem.Kernel(offsets, prefer_extension=False)
    k_c = gem.Kernel(offsets, prefer_extension=True)
    assert k_np.extension is None and "numpy" in k_np.name
    t1, t2 = theta.copy(), theta.copy()
    s1, s2 = k_np.gem_step(t1, delta, a, s, EPS, PI_MAX), k_c.gem_step(t2, delta, a, s, EPS,
                                                                         PI_MAX)
    assert np.array_equal(t1, t2)
    assert np.array_equal(s1.pi_median, s2.pi_median, equal_nan=True)
    assert np.array_equal(s1.clamp_frac, s2.clamp_frac)
    assert np.array_equal(s1.clamp_low_frac, s2.clamp_low_frac)
    assert np.array_equal(s1.zero_delta_frac, s2.zero_delta_frac)
    assert s1.pi_median_all == s2.pi_median_all


def _random_stats(rng: np.random.Generator, tensors: int):
    """Statistics as a step leaves them: rows empty, clamped, spread or in one bin."""
    hist = np.zeros((tensors, gem.HIST_BINS + 2), np.int64)
    for t in range(tensors):
        kind = int(rng.integers(0, 5))
        if kind == 1:
            hist[t, rng.choice([0, gem.HIST_BINS + 1])] = rng.integers(1, 9000)
        elif kind == 2:
            hist[t, rng.integers(1, gem.HIST_BINS + 1)] = rng.integers(1, 9000)
        elif kind >= 3:
            k = int(rng.integers(1, 60))
            np.add.at(hist[t], rng.integers(0, gem.HIST_BINS + 2, size=k),
                      rng.integers(1, 5000, size=k))
    sampled = hist.sum(axis=1)
    sizes = sampled * rng.integers(1, 40, size=tensors)  # sampled: up to every 40th element
    sizes[sampled == 0] = rng.integers(0, 3, size=int((sampled == 0).sum()))
    counts = np.stack([hist[:, 0], hist[:, -1], rng.integers(0, 50, size=tensors)], axis=1)
    counts = np.ascontiguousarray(counts, dtype=np.int64)
    sums = rng.random((tensors, 2)) * 10.0 ** rng.integers(-12, 3, size=(tensors, 2))
    return hist, sums, counts, np.ascontiguousarray(sizes, dtype=np.int64)


@pytest.mark.parametrize("seed", range(4))
def test_summary_in_cpp_has_the_numpy_readings_bits(core, seed):
    """What the metrics record of a step (medians, shares, the pooled median, energies),
    read off its statistics in C++ (Kernel.gem_step with the extension) and by the numpy
    reference: the same bits, on 200 sets of tensors with empty, clamped and spread rows."""
    rng = np.random.default_rng(seed)
    for _ in range(200):
        tensors = int(rng.integers(1, 70))
        hist, sums, counts, sizes = _random_stats(rng, tensors)
        pi_max = float(rng.choice([0.5, 1.0, 5.0, 7.3]))
        want = gem.summary_numpy(hist, sums, counts, sizes, pi_max)
        per_tensor, scalars = np.empty((4, tensors), np.float32), np.empty(3)
        core.gem_summary(hist, sums, counts, sizes, pi_max, per_tensor, scalars)
        for row, name in zip(per_tensor, ("pi_median", "clamp_frac", "clamp_low_frac",
                                          "zero_delta_frac"), strict=True):
            assert np.array_equal(row.view(np.uint32), getattr(want, name).view(np.uint32))
        got = np.array([want.pi_median_all, want.energy_central, want.energy_proxy])
        assert np.array_equal(scalars.view(np.uint64), got.view(np.uint64))


def test_summary_refuses_arrays_of_the_wrong_shape(core):
    hist, sums, counts, sizes = _random_stats(np.random.default_rng(0), 3)
    per_tensor, scalars = np.empty((4, 3), np.float32), np.empty(3)
    with pytest.raises(ValueError, match="per_tensor"):
        core.gem_summary(hist, sums, counts, sizes, 1.0, np.empty((4, 2), np.float32),
                         scalars)
    with pytest.raises(ValueError, match="dtype"):
        core.gem_summary(hist.astype(np.int32), sums, counts, sizes, 1.0, per_tensor, scalars)
    with pytest.raises(ValueError, match="pi_max"):
        core.gem_summary(hist, sums, counts, sizes, 0.0, per_tensor, scalars)


@pytest.mark.parametrize(
    "bad",
    [
        lambda t, o: {"theta": t.astype(np.float64)},
        lambda t, o: {"theta": t[::2]},
        lambda t, o: {"delta": t[:-1]},
        lambda t, o: {"offsets": np.array([0, 5], np.int64)},
        lambda t, o: {"offsets": np.array([0, 80, 40, 101], np.int64)},
        lambda t, o: {"offsets": o.astype(np.int32)},
        lambda t, o: {"hist": np.zeros((1, gem.HIST_BINS + 2), np.int64)},
        lambda t, o: {"counts": np.zeros((2, 2), np.int64)},  # before the Δθ = 0 count
        lambda t, o: {"pi_max": 0.0},
        lambda t, o: {"threads": 0},
    ],
)
def test_bad_arguments_raise_value_error(core, bad):
    theta, delta, a, s = _inputs(101)
    offsets = np.array([0, 40, 101], np.int64)
    args = {"theta": theta, "delta": delta, "a": a, "s": s, "offsets": offsets, "eps": EPS,
            "pi_max": PI_MAX, "hist": np.zeros((2, gem.HIST_BINS + 2), np.int64),
            "sums": np.zeros((2, 2)), "counts": np.zeros((2, gem.COUNTS), np.int64),
            "threads": 1}
    assert core.gem_step(**{**args, "theta": theta.copy()})  # as given, the call is fine
    args.update(bad(theta, offsets))
    with pytest.raises(ValueError):
        core.gem_step(**args)


def test_read_only_theta_is_refused(core):
    theta, delta, _, _ = _inputs(11)
    theta.setflags(write=False)
    with pytest.raises(ValueError):
        core.fixed_step(theta, delta, 1.0, 1)


def test_build_info(core):
    info = core.build_info()
    assert "-ffp-contract=off" in info["flags"]
    assert isinstance(info["native"], bool)


@pytest.mark.parametrize("into", ["s", "separate"])
@pytest.mark.parametrize("threads", [1, 3])
def test_keep_receives_theta_before_the_update(core, into, threads):
    """The paper's shift: the kernel writes θ before the update into the slot's s (keep may
    be s itself) in the same pass; θ and the statistics are those of the plain step."""
    n = 100_003
    theta, delta, a, s = _inputs(n, seed=5)
    offsets = _offsets(n)
    plain = _both(core, theta, delta, a, s, offsets, threads=threads)
    t = len(offsets) - 1
    for fn in ("c", "numpy"):
        th, s_in = theta.copy(), s.copy()
        keep = s_in if into == "s" else np.full(n, np.nan, np.float32)
        hist = np.zeros((t, gem.HIST_BINS + 2), np.int64)
        sums, counts = np.zeros((t, 2)), np.zeros((t, gem.COUNTS), np.int64)
        if fn == "c":
            ok = core.gem_step(th, delta, a, s_in, offsets, EPS, PI_MAX, hist, sums, counts,
                               threads, keep)
        else:
            ok = gem.gem_step_numpy(th, delta, a, s_in, offsets, EPS, PI_MAX, hist, sums,
                                    counts, keep)
        _assert_same((ok, th, hist, sums, counts), plain[1])
        assert np.array_equal(keep.view(np.uint32), theta.view(np.uint32))


def test_the_two_shift_readings_differ_as_the_paper_says(core):
    """One worker, the same Δθ = −0.1 twice, μ 0.9, κ 1: the prototype's shift counts the
    worker's own previous update (π = 0.9 at the second step), the other reading does not
    (π = 1.9), through the Kernel the master uses."""
    f = np.float32
    k = gem.Kernel(np.array([0, 1], np.int64))
    d, mu = np.array([-0.1], f), f(0.9)
    theta, m = np.zeros(1, f), mu * np.zeros(1, f) + d
    slot_s = theta.copy()  # the paper's reading keeps θ before each update here
    k.gem_step(theta, d, np.abs(m), slot_s, 1e-16, 5.0, keep=slot_s)  # step 1: π = 1
    m = mu * m + d
    others, paper = theta.copy(), theta.copy()
    k.gem_step(others, d, np.abs(m), theta.copy(), 1e-16, 5.0)  # s: pulled after step 1
    k.gem_step(paper, d, np.abs(m), slot_s, 1e-16, 5.0, keep=slot_s)  # s: before step 1
    np.testing.assert_allclose(others, [-0.29], rtol=1e-6)
    np.testing.assert_allclose(paper, [-0.19], rtol=1e-6)
    assert slot_s[0] == theta[0]  # ready for the third update


@pytest.mark.parametrize("n", [1, 63, 64 * 3 - 1, 4_097, 100_003, 1_000_001])
def test_every_thread_count_is_bit_identical_to_numpy(core, n):
    """Threads 1, 2 and 3 on odd sizes (below, at and above the 64-element cut, one range
    shorter than the others): θ bit for bit the reference's, the histogram and the clamp
    counts exact, through the persistent pool (and again, the pool reused)."""
    theta, delta, a, s = _inputs(n, seed=n + 11)
    for threads in (1, 2, 3, 3, 2):
        c, ref = _both(core, theta, delta, a, s, _offsets(n), threads=threads)
        assert c[0] is True
        _assert_same(c, ref)
        got, want = theta.copy(), theta.copy()
        assert core.fixed_step(got, delta, 1.0 / 3.0, threads) is True
        assert gem.fixed_step_numpy(want, delta, 1.0 / 3.0) is True
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_the_pool_is_started_once_and_reused(core):
    core.fill(np.ones(1_000, np.float32), 0.0, 3)  # 1 000 >= 64 x 3: three ranges
    before = core.pool_threads()
    assert before >= 2
    x = np.ones(100_003, np.float32)
    for _ in range(20):
        core.fill(x, 0.0, 3)
        core.triad(x, x, x, 1.0, 2)
    assert core.pool_threads() == before  # no thread started per call


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_fill_and_the_spawned_triad(core, threads):
    for n in (0, 1, 191, 100_003):
        x = np.full(n, np.nan, np.float32)
        core.fill(x, 2.5, threads)
        assert np.all(x == np.float32(2.5))
        b, c = np.arange(n, dtype=np.float32), np.ones(n, np.float32)
        pool, spawn = np.zeros(n, np.float32), np.zeros(n, np.float32)
        core.triad(pool, b, c, 3.0, threads)
        core.triad(spawn, b, c, 3.0, threads, True)
        assert np.array_equal(pool, spawn) and np.array_equal(pool, b + np.float32(3.0) * c)
    with pytest.raises(ValueError):
        core.fill(np.zeros(3, np.float64), 0.0, 1)


def test_kernel_zero_uses_the_kernels_threads(core):
    k = gem.Kernel(np.array([0, 1_000], np.int64), threads=2)
    x = np.full(1_000, np.nan, np.float32)
    k.zero(x)
    assert not x.any() and core.pool_threads() >= 1
    k_np = gem.Kernel(np.array([0, 10], np.int64), prefer_extension=False)
    y = np.ones(10, np.float32)
    k_np.zero(y)
    assert not y.any()


FIRST_TOUCH = r"""
import json, sys
import numpy as np
from gem_mpi.algorithm.kernel import Kernel
from gem_mpi.transport import start_mpi
from gem_mpi.transport.idioms import HEADER_BYTES, Mailbox, VersionedArray

comm = start_mpi()
n, slots = 1_003, 2
kernel = Kernel(np.array([0, n], np.int64), threads=3)
calls = []

def zero(x):
    calls.append((x.__array_interface__["data"][0], x.size))
    kernel.zero(x)

box = Mailbox(comm, slots, 3 * n + 5, zero=zero, stream=n)
theta = VersionedArray(comm, n, zero=zero)
want = [(box.payloads[i, k * n:].__array_interface__["data"][0], n)
        for i in range(slots) for k in range(3)]
want.append((theta.data.__array_interface__["data"][0], n))
ok = (calls == want and not box._slots.memory.any() and not box._flags.memory.any()
      and not theta.memory.any())
box.free(); theta.free()
json.dump({"ok": bool(ok), "calls": len(calls)}, open(sys.argv[1], "w"))
"""


@pytest.mark.mpi
def test_the_master_windows_are_first_touched_by_the_kernel(tmp_path):
    """Rank 0's θ window and every stream of every mailbox slot (Δθ, κ|m|, s) are zeroed
    by the kernel's zero, each as one θ-long array (the split the kernel streams it with);
    the headers and the rest are zeroed too."""
    prog, out = tmp_path / "touch.py", tmp_path / "touch.json"
    prog.write_text(FIRST_TOUCH)
    res = mpirun(1, [str(prog), str(out)], timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert json.loads(out.read_text()) == {"ok": True, "calls": 7}


# --- the global proxy (--gem-proxy global): the master folds Δθ into its own m ----------------

def _global_both(core, theta, delta, m, s, offsets, mu, gain, kappa, threads=1):
    """The C++ and the numpy step with the global proxy, from copies of θ and m:
    [(ok, θ, hist, sums, counts, m)] for each."""
    t = len(offsets) - 1
    out = []
    for fn in ("c", "numpy"):
        th, mm = theta.copy(), m.copy()
        hist = np.zeros((t, gem.HIST_BINS + 2), np.int64)
        sums, counts = np.zeros((t, 2)), np.zeros((t, gem.COUNTS), np.int64)
        with np.errstate(all="ignore"):
            if fn == "c":
                ok = core.gem_step(th, delta, None, s, offsets, EPS, PI_MAX, hist, sums, counts,
                                   threads, m=mm, mu=mu, gain=gain, kappa=kappa)
            else:
                proxy = gem.GlobalProxy(mm, np.float32(mu), np.float32(gain),
                                        np.float32(kappa))
                ok = gem.gem_step_numpy(th, delta, None, s, offsets, EPS, PI_MAX, hist, sums,
                                        counts, proxy=proxy)
        out.append((ok, th, hist, sums, counts, mm))
    return out


@pytest.mark.parametrize("n", [1, 1000, 100_003])
@pytest.mark.parametrize("threads", [1, 3])
def test_global_proxy_step_is_bit_identical_to_numpy(core, n, threads):
    """θ and m bit for bit, the histogram and clamp counts exact, at the decay of 5 workers."""
    from gem_mpi.algorithm.rule import global_decay

    theta, delta, a, s = _inputs(n, seed=n + 21)
    m = (a * 5).astype(np.float32)  # a first moment of a few Δθ's size
    mu, gain = global_decay(0.9, 5)
    c, ref = _global_both(core, theta, delta, m, s, _offsets(n), float(mu), float(gain), 1.5,
                          threads)
    assert c[0] is True
    _assert_same(c[:5], ref[:5])
    assert np.array_equal(c[5].view(np.uint32), ref[5].view(np.uint32))
    assert not np.array_equal(c[5], m)  # m moved


def test_global_fold_is_the_workers_two_roundings_never_an_fma(core):
    """With one worker the master's m must be the worker's m = μ·m + Δθ, two float32
    roundings. Inputs where μ·m and Δθ nearly cancel make a fused multiply-add (one
    rounding) differ from them in most elements: the kernel must give the worker's bits."""
    from gem_mpi.algorithm.rule import Momentum
    from gem_mpi.config import OptimConfig

    n, mu = 100_003, np.float32(0.9)
    rng = np.random.default_rng(31)
    m0 = rng.normal(size=n).astype(np.float32)
    delta = (-(mu * m0) * (1 + rng.normal(size=n) * 1e-3)).astype(np.float32)
    worker = Momentum.zeros_like(np.zeros(n, np.float32), OptimConfig(momentum=float(mu)))
    worker.restore({"m": m0.copy()}, 0)
    worker.fold(delta)
    fma = (np.float64(mu) * m0.astype(np.float64) + delta).astype(np.float32)  # one rounding
    assert np.count_nonzero(fma.view(np.uint32) != worker.m.view(np.uint32)) > n // 10
    theta, s = np.zeros(n, np.float32), np.zeros(n, np.float32)
    for threads in (1, 3):
        c, ref = _global_both(core, theta, delta, m0, s, _offsets(n), float(mu), 1.0, 1.0,
                              threads)
        for got in (c, ref):
            assert got[0] is True
            assert np.array_equal(got[5].view(np.uint32), worker.m.view(np.uint32))


@pytest.mark.parametrize("where", ["delta", "s", "overflow"])
def test_global_proxy_rejected_update_leaves_theta_and_m(core, where):
    """A NaN or Inf in Δθ or s, or an a = κ|μm + cΔθ| that overflows float32 (what a worker
    would have sent as a non-finite κ|m|): rejected whole, θ and m untouched."""
    n = 100_003
    theta, delta, a, s = _inputs(n, seed=41)
    m = a.copy()
    kappa = 1.0
    if where == "delta":
        delta[n - 1] = np.nan
    elif where == "s":
        s[n - 1] = np.inf
    else:
        m[n - 1], kappa = np.float32(3e38), 4.0
    for threads in (1, 4):
        c, ref = _global_both(core, theta, delta, m, s, _offsets(n), 0.9, 1.0, kappa, threads)
        for got in (c, ref):
            assert got[0] is False
            assert np.array_equal(got[1], theta) and np.array_equal(got[5], m)
        assert c[2].sum() == 0 and not c[3].any() and not c[4].any()


def test_global_proxy_arguments_are_checked(core):
    theta, delta, a, s = _inputs(101)
    offsets = np.array([0, 40, 101], np.int64)
    args = {"theta": theta, "delta": delta, "a": a, "s": s, "offsets": offsets, "eps": EPS,
            "pi_max": PI_MAX, "hist": np.zeros((2, gem.HIST_BINS + 2), np.int64),
            "sums": np.zeros((2, 2)), "counts": np.zeros((2, gem.COUNTS), np.int64), "threads": 1}
    m = np.zeros(101, np.float32)
    with pytest.raises(ValueError, match="either a"):
        core.gem_step(**{**args, "m": m})  # a and m both
    with pytest.raises(ValueError, match="either a"):
        core.gem_step(**{**args, "a": None})  # neither
    m.setflags(write=False)
    with pytest.raises(ValueError, match="read-only"):
        core.gem_step(**{**args, "a": None, "m": m})
    with pytest.raises(ValueError):
        core.gem_step(**{**args, "a": None, "m": np.zeros(100, np.float32)})


@pytest.mark.parametrize("host", ["numpy", "torch"])
def test_worker_fold_in_one_pass_is_the_three_pass_fold_bit_for_bit(core, host):
    """A GEM worker's fused fold (m ← μ·m + Δθ, a = κ|m|, gem_mpi.algorithm._core.worker_fold) against
    the numpy/torch fold it replaces: m, the m before the last fold, a and the count the
    same bits step after step, on numpy arrays and on CPU tensors (views of their memory),
    including inputs where μ·m and Δθ nearly cancel (an FMA would differ there)."""
    from gem_mpi.algorithm.rule import Momentum
    from gem_mpi.config import OptimConfig

    optim = OptimConfig(method="gem", momentum=0.9, kappa=1.7)
    n = 100_003
    lib = np if host == "numpy" else pytest.importorskip("torch")
    like = np.zeros(n, np.float32) if host == "numpy" else lib.zeros(n, dtype=lib.float32)
    ref = Momentum.zeros_like(np.zeros(n, np.float32), optim)
    fused = Momentum.zeros_like(like, optim, extension=core)
    assert fused.fused is core and ref.fused is None
    rng = np.random.default_rng(7)
    for step in range(12):
        delta = (rng.normal(size=n) * 10.0 ** rng.integers(-6, 2)).astype(np.float32)
        if step == 6:  # nearly cancels: one rounding (an FMA) would differ from two
            delta = (-(np.float32(0.9) * ref.m) * (1 + rng.normal(size=n) * 1e-3)).astype(
                np.float32)
        a_ref = ref.fold(delta)
        a = fused.fold(delta if host == "numpy" else lib.from_numpy(delta.copy()))
        m, prev = (state["m"] for state in fused.arrays())
        a_np = a if host == "numpy" else a.numpy()
        for got, want in ((a_np, a_ref), (m, ref.m), (prev, ref.prev)):
            assert np.array_equal(np.asarray(got).view(np.uint32), want.view(np.uint32))
    assert fused.folded == ref.folded == 12
    # a resume's restore writes the m the next fold starts from
    fused.restore({"m": ref.m.copy()}, 12)
    a = fused.fold(np.ones(n, np.float32) if host == "numpy" else lib.ones(n))
    a_ref = ref.fold(np.ones(n, np.float32))
    assert np.array_equal(np.asarray(a if host == "numpy" else a.numpy()).view(np.uint32),
                          a_ref.view(np.uint32))


def test_worker_fold_refuses_mismatched_arrays(core):
    x = np.zeros(10, np.float32)
    with pytest.raises(ValueError, match="worker_fold: a"):
        core.worker_fold(x, x, x, np.zeros(9, np.float32), 0.9, 1.0)
    with pytest.raises(ValueError, match="float32"):
        core.worker_fold(x, np.zeros(10), x, x, 0.9, 1.0)
