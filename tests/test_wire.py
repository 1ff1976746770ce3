"""``--wire bf16``: Δθ and κ|m| sent as bfloat16, GEM's energy rule kept exact.

The worker's conversion (C++ ``_core.to_bf16`` and its numpy reference) is held bit for bit
to torch's own float32 → bfloat16 rounding (nearest even) and to truncation (toward zero);
the master's kernels on bf16 inputs to the numpy reference, which widens them and runs the
float32 arithmetic; a run's θ to the single-process replay of its event log rounded as the
worker rounds (``replay(..., wire="bf16")``), under real mpirun.
"""

from __future__ import annotations

import h5py
import numpy as np
import pytest
from helpers import QuadraticSlice, assert_exactly_once, quadratic_args, train

from gem_mpi.algorithm import kernel as gem
from gem_mpi.algorithm.kernel import BF16_NEAREST_EVEN, BF16_TOWARD_ZERO, Kernel, widen
from gem_mpi.algorithm.reference import replay
from gem_mpi.algorithm.rule import MasterRule, WorkerRule, global_decay
from gem_mpi.config import (
    DOWNPOUR,
    GEM,
    PROXY_GLOBAL,
    PROXY_LOCAL,
    SHIFT_OTHERS,
    SHIFT_PAPER,
    WIRE_BF16,
    WIRE_F32,
    OptimConfig,
)
from gem_mpi.engine.shards import shard_cut
from gem_mpi.outputs.runfile import load_run
from gem_mpi.problem.quadratic import Quadratic
from gem_mpi.protocol import layout, update_payload

f32 = np.float32
EPS, PI_MAX = 1e-16, 5.0


def _bits32(x: np.ndarray) -> np.ndarray:
    return x.view(np.uint32)


def _special_values() -> np.ndarray:
    """Every class the conversion must get right: ±0, denormals (float32's, and those that
    round into bf16's), the largest finite values (they round up to Inf), Inf, NaNs of both
    signs with payloads in either half, exact ties of both parities, and random bit patterns."""
    rng = np.random.default_rng(37)
    named = np.array([0x00000000, 0x80000000, 0x00000001, 0x80000001, 0x007FFFFF, 0x00008000,
                      0x00018000, 0x00010000, 0x0000FFFF, 0x00800000, 0x7F7FFFFF, 0xFF7FFFFF,
                      0x7F7F8000, 0x7F7F7FFF, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000,
                      0x7F800001, 0xFF800001, 0x7FFFFFFF, 0xFFFFFFFF, 0x3F808000, 0x3F818000,
                      0x3F80FFFF, 0x3F807FFF, 0x3F800001, 0xBF808000, 0xBF818000], np.uint32)
    random = rng.integers(0, 2**32, size=400_000, dtype=np.uint64).astype(np.uint32)
    normal = rng.normal(scale=1e-3, size=100_000).astype(f32).view(np.uint32)
    tiny = rng.integers(0, 1 << 23, size=50_000, dtype=np.uint32)  # denormals
    ties = (rng.integers(0, 1 << 16, size=50_000, dtype=np.uint32) << 16) | np.uint32(0x8000)
    return np.concatenate([named, random, normal, tiny, ties]).view(f32)


def _convert(fn, x: np.ndarray, mode: int) -> np.ndarray:
    out = np.empty(x.size, np.uint16)
    fn(x, out, mode)
    return out


def test_to_bf16_is_torchs_rounding_and_truncation_bit_for_bit(core):
    """Nearest even: C++ == numpy == torch's ``tensor.to(torch.bfloat16)`` on every non-NaN
    (finite values that round past the largest bf16 become ±Inf, as in torch); a NaN stays a
    NaN (torch's own NaN bits differ between its scalar and vector paths). Toward zero: the
    top half of the float32 exactly, never above |x|."""
    torch = pytest.importorskip("torch")
    x = _special_values()
    nan = np.isnan(x)
    for mode in (BF16_NEAREST_EVEN, BF16_TOWARD_ZERO):
        c, ref = _convert(core.to_bf16, x, mode), _convert(gem.to_bf16_numpy, x, mode)
        assert np.array_equal(c, ref), mode
        assert np.isnan(widen(c)[nan]).all()
    rne = _convert(core.to_bf16, x, BF16_NEAREST_EVEN)
    ours = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(rne[~nan], ours[~nan])
    assert np.isposinf(widen(rne)[x.view(np.uint32) == 0x7F7FFFFF]).all()  # rounds up to Inf
    tz = _convert(core.to_bf16, x, BF16_TOWARD_ZERO)
    assert np.array_equal(tz[~nan], (_bits32(x)[~nan] >> 16).astype(np.uint16))
    wide = widen(tz)[~nan]
    assert (np.abs(wide) <= np.abs(x[~nan])).all()
    # torch's scalar path (0-d tensors) on the named values, one by one
    few = x[:29]
    scalar = [int(torch.tensor(float(v), dtype=torch.float32).to(torch.bfloat16)
                  .view(torch.int16).item()) & 0xFFFF for v in few]
    assert [int(b) for b, n in zip(rne[:29], nan[:29]) if not n] == \
        [b for b, n in zip(scalar, nan[:29]) if not n]


def test_to_bf16_refuses_wrong_arrays(core):
    x = np.ones(4, f32)
    with pytest.raises(ValueError, match="uint16"):
        core.to_bf16(x, np.empty(4, f32), BF16_NEAREST_EVEN)
    with pytest.raises(ValueError, match="elements"):
        core.to_bf16(x, np.empty(3, np.uint16), BF16_NEAREST_EVEN)
    with pytest.raises(ValueError, match="mode"):
        core.to_bf16(x, np.empty(4, np.uint16), 7)


# --- the payload's layout -----------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 6, 7])
def test_bf16_parts_take_half_the_floats_and_split_as_uint16_views(n):
    optim = OptimConfig(method=GEM, gem_shift=SHIFT_PAPER, wire=WIRE_BF16)
    p = update_payload(optim, n)
    half = (n + 1) // 2
    assert (p.width("delta"), p.width("a"), p.width("s")) == (half, half, n)
    assert p.span("delta") == (0, half) and p.span("a") == (half, 2 * half)
    assert p.span("s") == p.kept_span == (2 * half, 2 * half + n)
    assert p.lengths == (2 * half, 2 * half + n)
    slot = np.arange(p.floats, dtype=f32)
    q, a, s = p.split(slot)
    assert q.dtype == a.dtype == np.uint16 and len(q) == len(a) == n and s.dtype == f32
    assert np.shares_memory(q, slot) and np.shares_memory(s, slot)
    assert p.wire_bytes == (4 * 2 * half, 4 * n)
    lay = layout(optim, n, 3)
    assert lay.update_lengths == p.lengths and lay.kept == p.kept_span
    # the bytes per parameter each way, as the start-up line states them
    assert update_payload(OptimConfig(method=GEM, wire=WIRE_BF16), 1000).wire_note() == \
        "wire bf16: 8 B/param committed, 4 B/param pulled"
    assert update_payload(OptimConfig(method=GEM), 1000).wire_note() == \
        "wire float32: 12 B/param committed, 4 B/param pulled"
    assert update_payload(OptimConfig(method=DOWNPOUR, wire=WIRE_BF16), 1000).wire_bytes == \
        (2000, 4000)


# --- the master's kernels on bf16 ---------------------------------------------------------

def _bf16_inputs(n: int, seed: int):
    rng = np.random.default_rng(seed)
    theta = rng.normal(size=n).astype(f32)
    delta = (rng.normal(size=n) * 0.01).astype(f32)
    delta[::97] = 0.0
    a = np.abs(rng.normal(size=n) * 0.02).astype(f32)
    s = (theta + rng.normal(size=n) * 0.01).astype(f32)
    q = _convert(gem.to_bf16_numpy, delta, BF16_NEAREST_EVEN)
    qa = _convert(gem.to_bf16_numpy, a, BF16_TOWARD_ZERO)
    return theta, q, qa, s


def _offsets(n: int) -> np.ndarray:
    return np.array(sorted({0, n // 3, n // 2, n}), np.int64)


def _step(fn: str, core, theta, q, qa, s, offsets, threads=1, keep=None, proxy=None):
    t = len(offsets) - 1
    th = theta.copy()
    hist = np.zeros((t, gem.HIST_BINS + 2), np.int64)
    sums, counts = np.zeros((t, 2)), np.zeros((t, gem.COUNTS), np.int64)
    with np.errstate(all="ignore"):
        if fn == "c":
            px = {} if proxy is None else {"m": proxy.m, "mu": float(proxy.mu),
                                           "gain": float(proxy.gain),
                                           "kappa": float(proxy.kappa)}
            ok = core.gem_step(th, q, qa, s, offsets, EPS, PI_MAX, hist, sums, counts, threads,
                               keep, **px)
        else:
            ok = gem.gem_step_numpy(th, q, qa, s, offsets, EPS, PI_MAX, hist, sums, counts,
                                    keep, proxy)
    return ok, th, hist, sums, counts


def _same(c, ref) -> None:
    assert c[0] == ref[0]
    assert np.array_equal(_bits32(c[1]), _bits32(ref[1]))
    assert np.array_equal(c[2], ref[2]) and np.array_equal(c[4], ref[4])
    np.testing.assert_allclose(c[3], ref[3], rtol=2e-5, atol=1e-300)


@pytest.mark.parametrize("n", [1, 63, 4_097, 100_003])
@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_bf16_gem_step_is_the_numpy_reference_for_every_thread_count(core, n, threads):
    """θ bit for bit, histogram and counts exact; and it is the float32 step on the widened
    values (the bf16 wire changes what is read, not the arithmetic)."""
    theta, q, qa, s = _bf16_inputs(n, seed=n + threads)
    offsets = _offsets(n)
    c = _step("c", core, theta, q, qa, s, offsets, threads)
    ref = _step("numpy", core, theta, q, qa, s, offsets)
    assert c[0] is True
    _same(c, ref)
    wide = _step("c", core, theta, widen(q).copy(), widen(qa).copy(), s, offsets, threads)
    _same(c, wide)


@pytest.mark.parametrize("into", ["s", "separate"])
@pytest.mark.parametrize("threads", [1, 3])
def test_bf16_gem_step_keeps_theta_for_the_papers_shift(core, into, threads):
    n = 100_003
    theta, q, qa, s = _bf16_inputs(n, seed=5)
    offsets = _offsets(n)
    plain = _step("numpy", core, theta, q, qa, s, offsets)
    for fn in ("c", "numpy"):
        s_in = s.copy()
        keep = s_in if into == "s" else np.full(n, np.nan, f32)
        _same(_step(fn, core, theta, q, qa, s_in, offsets, threads, keep), plain)
        assert np.array_equal(_bits32(keep), _bits32(theta))


@pytest.mark.parametrize("threads", [1, 3])
def test_bf16_global_proxy_folds_the_widened_delta(core, threads):
    n = 100_003
    theta, q, qa, s = _bf16_inputs(n, seed=11)
    mu, gain = global_decay(0.9, 5)
    m0 = (widen(qa) * 5).astype(f32)
    out = []
    for fn in ("c", "numpy"):
        proxy = gem.GlobalProxy(m0.copy(), mu, gain, f32(1.5))
        out.append((_step(fn, core, theta, q, None, s, _offsets(n), threads, proxy=proxy),
                    proxy.m))
    (c, m_c), (ref, m_ref) = out
    _same(c, ref)
    assert np.array_equal(_bits32(m_c), _bits32(m_ref))
    expect, _ = gem.GlobalProxy(m0.copy(), mu, gain, f32(1.5)).fold(widen(q))
    assert np.array_equal(_bits32(m_ref), _bits32(expect))


@pytest.mark.parametrize("where", ["delta", "a", "s", "inf"])
def test_non_finite_bf16_update_is_rejected_whole(core, where):
    n = 1000
    theta, q, qa, s = _bf16_inputs(n, seed=3)
    q, qa, s = q.copy(), qa.copy(), s.copy()
    if where == "delta":
        q[500] = 0x7FC0  # a bf16 NaN
    elif where == "a":
        qa[7] = 0xFFC1
    elif where == "s":
        s[999] = np.nan
    else:  # a finite float32 that rounded up to Inf on the worker
        big = np.array([3.4e38], f32)
        q[0] = _convert(gem.to_bf16_numpy, big, BF16_NEAREST_EVEN)[0]
        assert np.isinf(widen(q[:1]))[0]
    for fn in ("c", "numpy"):
        ok, th, *_ = _step(fn, core, theta, q, qa, s, _offsets(n))
        assert ok is False and np.array_equal(_bits32(th), _bits32(theta))
        th = theta.copy()
        if where in ("delta", "inf"):
            fixed = core.fixed_step(th, q, 1.0, 3) if fn == "c" else \
                gem.fixed_step_numpy(th, q, 1.0)
            assert fixed is False and np.array_equal(_bits32(th), _bits32(theta))


@pytest.mark.parametrize("threads", [1, 3])
def test_bf16_fixed_step_is_the_numpy_reference(core, threads):
    n = 100_003
    theta, q, _, _ = _bf16_inputs(n, seed=9)
    for scale in (1.0, 1.0 / 3.0):
        th_c, th_np = theta.copy(), theta.copy()
        assert core.fixed_step(th_c, q, scale, threads) is True
        assert gem.fixed_step_numpy(th_np, q, scale) is True
        assert np.array_equal(_bits32(th_c), _bits32(th_np))
        assert np.array_equal(_bits32(th_np), _bits32(theta + f32(scale) * widen(q)))


def test_bf16_a_and_delta_must_agree(core):
    theta, q, qa, s = _bf16_inputs(10, seed=1)
    t = 1
    args = (np.array([0, 10], np.int64), EPS, PI_MAX, np.zeros((t, gem.HIST_BINS + 2), np.int64),
            np.zeros((t, 2)), np.zeros((t, gem.COUNTS), np.int64))
    with pytest.raises(ValueError, match="uint16"):
        core.gem_step(theta, q, widen(qa).copy(), s, *args)
    with pytest.raises(ValueError, match="float32"):
        core.gem_step(theta, widen(q).copy(), qa, s, *args)


# --- the worker's rule ---------------------------------------------------------------------

@pytest.mark.parametrize("extension", [False, True], ids=["numpy", "c++"])
def test_worker_rule_sends_rounded_bits_from_two_buffers_in_turn(core, extension):
    """q = bf16(Δθ) nearest even, a = bf16(κ|m|) toward zero (never above κ|m|), m folding the
    float32 Δθ (the float32 rule's m, bit for bit); update k's arrays stay intact while
    update k+1's are made, and the two sets alternate."""
    n = 1001
    rng = np.random.default_rng(2)
    optim = OptimConfig(method=GEM, wire=WIRE_BF16, kappa=1.5)
    rule = WorkerRule(optim, np.zeros(n, f32), extension=core if extension else None)
    plain = WorkerRule(OptimConfig(method=GEM, kappa=1.5), np.zeros(n, f32))
    s = rng.normal(size=n).astype(f32)
    sent = []
    for _ in range(4):
        delta = (rng.normal(size=n) * 0.01).astype(f32)
        q, qa, s_sent = rule.payload(delta, s)
        _, a32, _ = plain.payload(delta, s)
        assert q.dtype == qa.dtype == np.uint16 and s_sent is s and len(q) == n
        assert np.array_equal(q, _convert(gem.to_bf16_numpy, delta, BF16_NEAREST_EVEN))
        assert np.array_equal(qa, _convert(gem.to_bf16_numpy, a32, BF16_TOWARD_ZERO))
        assert (widen(qa) <= a32).all()
        assert np.array_equal(_bits32(rule.momentum.m), _bits32(plain.momentum.m))
        sent.append((q, qa, q.copy(), qa.copy()))
        if len(sent) >= 2:  # the previous payload is untouched by this one
            pq, pa, pq0, pa0 = sent[-2]
            assert np.array_equal(pq, pq0) and np.array_equal(pa, pa0)
            assert not np.shares_memory(pq, q) and not np.shares_memory(pa, qa)
    assert sent[0][0] is sent[2][0] and sent[1][1] is sent[3][1]  # two sets, in turn
    down = WorkerRule(OptimConfig(method=DOWNPOUR, wire=WIRE_BF16), np.zeros(n, f32))
    (only,) = down.payload(delta, s)
    assert only.dtype == np.uint16


def test_a_sharded_worker_poisons_every_shards_bf16_delta():
    """--masters K: a non-finite value in one shard's slice of any part (a bf16 NaN or Inf
    here) makes Δθ a bf16 NaN at the start of every shard's slice, so every kernel rejects it."""
    from gem_mpi.engine.shards import Plan

    plan = Plan(2, 1, [(0, 1), (1, 2)], [(0, 3), (3, 7)], [])
    for bad in (0x7FC0, 0xFF80):
        q, qa, s = np.zeros(7, np.uint16), np.zeros(7, np.uint16), np.zeros(7, f32)
        qa[5] = bad
        plan.poison_all((q, qa, s))
        assert np.isnan(widen(q)[[0, 3]]).all() and np.isfinite(widen(q)[[1, 2, 4, 5, 6]]).all()
    q = np.zeros(7, np.uint16)
    plan.poison_all((q, np.ones(7, np.uint16), np.ones(7, f32)))  # all finite: untouched
    assert not q.any()


def _post(slot: np.ndarray, parts: tuple[np.ndarray, ...]) -> int:
    """Mailbox.post's packing into a slot's payload area (float32): each part's bytes from
    the next 4-byte boundary; returns the floats posted (what the header's length says)."""
    raw, offset = slot.view(np.uint8), 0
    for part in parts:
        raw[offset:offset + part.nbytes] = part.view(np.uint8)
        offset += (part.nbytes + 3) // 4 * 4
    return offset // 4


@pytest.mark.parametrize("method, shift, proxy", [
    (GEM, SHIFT_OTHERS, PROXY_LOCAL), (GEM, SHIFT_PAPER, PROXY_LOCAL),
    (GEM, SHIFT_OTHERS, PROXY_GLOBAL), (GEM, SHIFT_PAPER, PROXY_GLOBAL),
    (DOWNPOUR, SHIFT_OTHERS, PROXY_LOCAL)])
@pytest.mark.parametrize("extension", [False, True], ids=["numpy", "c++"])
def test_worker_and_master_rules_on_the_bf16_wire_are_the_replay(method, shift, proxy,
                                                                  extension):
    """One worker and the master in lockstep on an odd θ (257: a pad after each bf16 part),
    through the payload layout: θ is the replay rounded as the worker rounds, bit for bit, and
    differs from the float32 wire's; every length sent is one the master accepts."""
    q, lr, steps = Quadratic(257, 3), 0.3, 6
    out = {}
    for wire in (WIRE_BF16, WIRE_F32):
        optim = OptimConfig(method=method, gem_shift=shift, gem_proxy=proxy, lr=lr,
                            momentum=0.9, kappa=1.5, wire=wire)
        lay = layout(optim, q.dim, 1)
        _, tensor_sizes = q.tensors()
        kernel = Kernel(np.cumsum([0, *tensor_sizes]), prefer_extension=extension)
        master = MasterRule(optim, kernel, q.dim, 1)
        worker = WorkerRule(optim, np.zeros(q.dim, f32),
                            extension=kernel.extension if extension else None)
        slot = np.full(lay.payload_floats, np.nan, f32)
        theta, target = q.theta0(), q.target(1)
        for _ in range(steps):
            pulled = theta.copy()
            delta, _ = q.step(pulled, target, lr)
            assert _post(slot, worker.payload(delta, pulled)) in lay.update_lengths
            ok, _ = master.apply(theta, slot, staleness=0, clock=0)
            assert ok
        out[wire] = theta
    log = {"worker": np.ones(steps, np.int64), "version_pulled": np.arange(steps),
           "staleness": np.zeros(steps, np.int64)}
    ref = replay(log, q, method, lr, momentum=0.9, kappa=1.5, shift=shift, proxy=proxy,
                 wire=WIRE_BF16)
    assert np.array_equal(_bits32(out[WIRE_BF16]), _bits32(ref.theta))
    assert not np.array_equal(out[WIRE_BF16], out[WIRE_F32])


# --- real runs -----------------------------------------------------------------------------

DIM, STEPS, WORKERS, LR, MU = 2001, 40, 4, 0.05, 0.9  # odd: each bf16 part ends with a pad


def _run(tmp_path, method: str, *extra: str, masters: int = 1):
    h5, out = tmp_path / "run.h5", tmp_path / "theta.npy"
    res = train(WORKERS + masters, *quadratic_args(
        "--wire", "bf16", *extra, method=method, dim=DIM, steps=STEPS, lr=LR, momentum=MU,
        metrics=h5, save=out, eval_every=0, masters=masters))
    assert res.returncode == 0, res.stdout + res.stderr
    return h5, np.load(out), res.stderr


def _check(h5, theta, method: str, **rule: object) -> None:
    run = load_run(h5)
    u = run.updates
    assert_exactly_once(u["worker"], u["seq"], range(1, WORKERS + 1), STEPS)
    assert u["clock"].tolist() == list(range(WORKERS * STEPS))
    q = Quadratic(DIM, 0)
    ref = replay(u, q, method, LR, MU, window=len(u["worker"]) + 1, wire=WIRE_BF16, **rule)
    assert np.array_equal(_bits32(theta), _bits32(ref.theta))
    f32_ref = replay(u, q, method, LR, MU, window=len(u["worker"]) + 1, **rule)
    assert not np.array_equal(theta, f32_ref.theta)  # the rounding is real


@pytest.mark.mpi
@pytest.mark.parametrize("shift, proxy, mode, kernel", [
    (SHIFT_OTHERS, PROXY_LOCAL, "wait", "extension"),
    (SHIFT_PAPER, PROXY_LOCAL, "wait", "numpy"),
    (SHIFT_OTHERS, PROXY_LOCAL, "pipelined", "numpy"),
    (SHIFT_PAPER, PROXY_LOCAL, "pipelined", "extension"),
    (SHIFT_OTHERS, PROXY_GLOBAL, "pipelined", "extension"),
    (SHIFT_PAPER, PROXY_GLOBAL, "wait", "numpy"),
    (SHIFT_OTHERS, PROXY_LOCAL, "overlap", "extension"),
    (SHIFT_PAPER, PROXY_GLOBAL, "overlap", "numpy"),
])
def test_bf16_gem_run_equals_the_replay_bit_for_bit(tmp_path, shift, proxy, mode, kernel):
    """Both kernels (and both workers' conversions: --no-extension takes both to numpy),
    both shifts, both proxies, every worker order; the start-up line and the metrics file
    state the bytes of the wire."""
    extra = ["--gem-shift", shift, "--gem-proxy", proxy, "--worker-mode", mode,
             *(["--no-extension"] if kernel == "numpy" else [])]
    h5, theta, err = _run(tmp_path, GEM, *extra)
    _check(h5, theta, GEM, shift=shift, proxy=proxy)
    per_param = {PROXY_LOCAL: 8, PROXY_GLOBAL: 6}[proxy] - (4 if shift == SHIFT_PAPER else 0)
    payload = update_payload(OptimConfig(method=GEM, gem_shift=shift, gem_proxy=proxy,
                                         wire=WIRE_BF16), DIM)
    assert f"{payload.wire_note()}" in err
    assert f"wire bf16: {payload.bytes_committed / DIM:.3g} B/param committed" in err
    assert abs(payload.bytes_committed / DIM - per_param) < 0.01
    with h5py.File(h5) as f:
        assert f.attrs["bytes_committed_per_update"] == payload.bytes_committed
        assert f.attrs["bytes_pulled_per_update"] == 4 * DIM


@pytest.mark.mpi
@pytest.mark.parametrize("masters", [1, 2])
def test_bf16_downpour_run_equals_the_replay_bit_for_bit(tmp_path, masters):
    """DOWNPOUR θ ← θ + q; with --masters 2 (overlapped) each shard's slice of the bf16
    parts (the worker slices them by θ's element range) replays its own event order."""
    h5, theta, _ = _run(tmp_path, DOWNPOUR, "--worker-mode",
                        "pipelined" if masters == 1 else "overlap", masters=masters)
    if masters == 1:
        _check(h5, theta, DOWNPOUR)
        return
    run = load_run(h5)
    logs = [run.updates, *[run.other[f"shard{k}"] for k in range(1, masters)]]
    q = Quadratic(DIM, 0)
    _, sizes = q.tensors()
    ends = np.concatenate([[0], np.cumsum(sizes)])
    for u, (a, b) in zip(logs, shard_cut(sizes, masters)):
        lo, hi = int(ends[a]), int(ends[b])
        assert_exactly_once(u["worker"], u["seq"], range(1, WORKERS + 1), STEPS)
        ref = replay(u, QuadraticSlice(q, lo, hi), DOWNPOUR, LR, window=len(u["worker"]) + 1,
                     wire=WIRE_BF16)
        assert np.array_equal(_bits32(theta[lo:hi]), _bits32(ref.theta))


