"""gem_mpi._core against its numpy reference, bit for bit.

The extension is built by tools/install.sh (pip install .); when it is missing these
tests fail, they are never skipped.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest

EPS = 1e-8
PI_MAX = 1.0


def _load_core():
    try:
        return importlib.import_module("gem_mpi._core")
    except ImportError as exc:  # pragma: no cover - the failure message is the point
        pytest.fail(
            "gem_mpi._core (the C++ extension) is not importable: "
            f"{exc}. Build it with tools/install.sh (or pip install .).",
            pytrace=False,
        )


@pytest.fixture(scope="module")
def core():
    return _load_core()


def ref_gem_apply(theta, delta, a, s, eps, pi_max):
    """The numpy reference, on copies: returns (theta_after, pi)."""
    theta = theta.copy()
    with np.errstate(all="ignore"):  # inf/NaN cases are meant
        shift = np.abs(theta - s)
        pi = (a - shift) / (np.abs(delta) + np.float32(eps))
        np.clip(pi, 0, pi_max, out=pi)
        theta += pi * delta
    return theta, pi


def ref_scaled_apply(theta, delta, scale):
    theta = theta.copy()
    with np.errstate(all="ignore"):
        theta += np.float32(scale) * delta
    return theta


def bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)


def assert_bit_identical(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == want.dtype == np.float32
    assert np.array_equal(got, want, equal_nan=True)
    # array_equal says -0.0 == 0.0; the bit patterns must agree too. NaNs only need to be
    # NaN on both sides: which operand's payload x86 propagates is not part of the contract.
    same = (bits(got) == bits(want)) | (np.isnan(got) & np.isnan(want))
    if not same.all():
        i = int(np.flatnonzero(~same)[0])
        raise AssertionError(
            f"{int((~same).sum())} element(s) differ in bits, first at {i}: "
            f"got {got[i]!r} ({bits(got)[i]:#010x}), want {want[i]!r} ({bits(want)[i]:#010x})"
        )


def check_gem(core, theta, delta, a, s, eps=EPS, pi_max=PI_MAX):
    arrays = [np.ascontiguousarray(x, dtype=np.float32) for x in (theta, delta, a, s)]
    theta, delta, a, s = arrays
    want_theta, want_pi = ref_gem_apply(theta, delta, a, s, eps, pi_max)
    got_theta = theta.copy()
    got_pi = np.full_like(theta, np.nan)
    inputs_before = [x.copy() for x in (delta, a, s)]
    with np.errstate(all="ignore"):
        assert core.gem_apply(got_theta, delta, a, s, got_pi, eps, pi_max) is None
    assert_bit_identical(got_pi, want_pi)
    assert_bit_identical(got_theta, want_theta)
    for before, after in zip(inputs_before, (delta, a, s)):
        assert_bit_identical(after, before)  # inputs untouched


def random_case(n: int, seed: int, scale: float = 1.0):
    rng = np.random.default_rng(seed)
    theta = (rng.standard_normal(n) * scale).astype(np.float32)
    delta = (rng.standard_normal(n) * 0.01 * scale).astype(np.float32)
    # Anchor s near theta and energy a of the order of the shift so pi spans 0..pi_max.
    s = (theta + rng.standard_normal(n).astype(np.float32) * np.float32(0.05 * scale)).astype(
        np.float32
    )
    a = (np.abs(rng.standard_normal(n)) * 0.05 * scale).astype(np.float32)
    return theta, delta, a, s


@pytest.mark.parametrize("n", [1, 7, 1_000_003])
def test_gem_apply_random(core, n):
    theta, delta, a, s = random_case(n, seed=n)
    check_gem(core, theta, delta, a, s)


@pytest.mark.parametrize("eps,pi_max", [(1e-8, 1.0), (1e-3, 0.25), (0.0, 10.0), (1e-6, 1e30)])
def test_gem_apply_parameters(core, eps, pi_max):
    theta, delta, a, s = random_case(10_007, seed=17)
    check_gem(core, theta, delta, a, s, eps=eps, pi_max=pi_max)


def test_gem_apply_covers_all_clip_branches(core):
    theta, delta, a, s = random_case(100_000, seed=3)
    _, pi = ref_gem_apply(theta, delta, a, s, EPS, PI_MAX)
    assert (pi == 0).any() and (pi == PI_MAX).any() and ((pi > 0) & (pi < PI_MAX)).any()
    check_gem(core, theta, delta, a, s)


def test_gem_apply_zeros(core):
    z = np.zeros(1001, dtype=np.float32)
    check_gem(core, z, z, z, z)
    check_gem(core, z, z, z, z, eps=0.0)  # 0/0: NaN, kept by clip as numpy does


def test_gem_apply_negative_zero(core):
    n = 64
    nz = np.full(n, -0.0, dtype=np.float32)
    z = np.zeros(n, dtype=np.float32)
    ones = np.ones(n, dtype=np.float32)
    check_gem(core, nz, ones, nz, z)
    check_gem(core, nz, -ones, z, nz)


def test_gem_apply_denormals(core):
    rng = np.random.default_rng(5)
    n = 4099
    tiny = np.float32(1e-40)
    theta = (rng.standard_normal(n) * tiny).astype(np.float32)
    delta = (rng.standard_normal(n) * tiny).astype(np.float32)
    a = (np.abs(rng.standard_normal(n)) * tiny).astype(np.float32)
    s = (rng.standard_normal(n) * tiny).astype(np.float32)
    assert (np.abs(theta[theta != 0]) < np.finfo(np.float32).tiny).all()
    check_gem(core, theta, delta, a, s, eps=1e-40)
    check_gem(core, theta, delta, a, s, eps=0.0)
    check_gem(core, theta, delta, a, s)


def test_gem_apply_huge(core):
    theta, delta, a, s = random_case(4099, seed=11, scale=1e30)
    check_gem(core, theta, delta, a, s)
    check_gem(core, theta, delta, a, s, pi_max=1e30)
    big = np.full(33, 3e38, dtype=np.float32)
    check_gem(core, big, big, big, -big, pi_max=1e30)  # overflow to inf, inf - inf = NaN


def test_gem_apply_special_values(core):
    vals = np.array(
        [0.0, -0.0, 1.0, -1.0, 1e-40, -1e-40, 1e30, -1e30, np.inf, -np.inf, np.nan, 3.4e38],
        dtype=np.float32,
    )
    grids = np.meshgrid(vals, vals, vals, vals, indexing="ij")
    theta, delta, a, s = (g.ravel().copy() for g in grids)
    check_gem(core, theta, delta, a, s)
    check_gem(core, theta, delta, a, s, eps=0.0)


def test_gem_apply_in_place_and_aliasing(core):
    theta, delta, a, s = random_case(1000, seed=2)
    want_theta, want_pi = ref_gem_apply(theta, delta, a, s, EPS, PI_MAX)
    pi = np.empty_like(theta)
    t = theta.copy()
    core.gem_apply(t, delta, a, s, pi, EPS, PI_MAX)
    assert_bit_identical(t, want_theta)
    assert_bit_identical(pi, want_pi)
    # A 1-D contiguous view of a larger array is updated in place.
    buf = np.zeros(3000, dtype=np.float32)
    buf[1000:2000] = theta
    core.gem_apply(buf[1000:2000], delta, a, s, pi, EPS, PI_MAX)
    assert_bit_identical(buf[1000:2000], want_theta)
    assert not buf[:1000].any() and not buf[2000:].any()


def test_gem_apply_empty(core):
    e = np.empty(0, dtype=np.float32)
    core.gem_apply(e, e, e, e, e.copy(), EPS, PI_MAX)


@pytest.mark.parametrize("n", [1, 7, 1_000_003])
@pytest.mark.parametrize("scale", [1.0, -0.1, 0.2, 1e-3, 0.0])
def test_scaled_apply_random(core, n, scale):
    rng = np.random.default_rng(n)
    theta = rng.standard_normal(n).astype(np.float32)
    delta = rng.standard_normal(n).astype(np.float32)
    want = ref_scaled_apply(theta, delta, scale)
    got = theta.copy()
    assert core.scaled_apply(got, delta, scale) is None
    assert_bit_identical(got, want)


def test_scaled_apply_edge_values(core):
    for theta, delta, scale in [
        (np.zeros(9, np.float32), np.zeros(9, np.float32), 0.5),
        (np.full(9, 1e-40, np.float32), np.full(9, -1e-40, np.float32), 0.3),
        (np.full(9, 1e30, np.float32), np.full(9, 1e30, np.float32), 1e10),  # -> inf
        (np.full(9, -0.0, np.float32), np.full(9, 1.0, np.float32), -0.0),
        (np.ones(9, np.float32), np.ones(9, np.float32), 0.1),  # 0.1 rounds to float32 first
    ]:
        want = ref_scaled_apply(theta, delta, scale)
        got = theta.copy()
        with np.errstate(all="ignore"):
            core.scaled_apply(got, delta, scale)
        assert_bit_identical(got, want)


def _good(n=8):
    return [np.zeros(n, dtype=np.float32) for _ in range(5)]


@pytest.mark.parametrize("position", range(1, 5))
def test_gem_apply_size_mismatch(core, position):
    args = _good()
    args[position] = np.zeros(9, dtype=np.float32)
    with pytest.raises(ValueError, match="elements"):
        core.gem_apply(*args, EPS, PI_MAX)


def test_scaled_apply_size_mismatch(core):
    with pytest.raises(ValueError, match="elements"):
        core.scaled_apply(np.zeros(8, np.float32), np.zeros(7, np.float32), 1.0)


@pytest.mark.parametrize("position", [0, 4])
def test_gem_apply_read_only_output(core, position):
    args = _good()
    args[position].flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        core.gem_apply(*args, EPS, PI_MAX)


def test_scaled_apply_read_only_theta(core):
    theta = np.zeros(8, np.float32)
    theta.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        core.scaled_apply(theta, np.zeros(8, np.float32), 1.0)


def test_read_only_inputs_are_fine(core):
    theta, delta, a, s = random_case(100, seed=4)
    for x in (delta, a, s):
        x.flags.writeable = False
    check_gem(core, theta, delta, a, s)


@pytest.mark.parametrize(
    "bad",
    [
        np.zeros(8, dtype=np.float64),  # would be a silent copy if converted
        np.zeros(8, dtype=">f4"),
        np.zeros((2, 4), dtype=np.float32),
        np.zeros(16, dtype=np.float32)[::2],
        [0.0] * 8,
    ],
    ids=["float64", "big-endian", "2-D", "strided", "list"],
)
def test_bad_arrays_raise_value_error(core, bad):
    for position in range(5):
        args = _good()
        args[position] = bad
        with pytest.raises(ValueError):
            core.gem_apply(*args, EPS, PI_MAX)
    with pytest.raises(ValueError):
        core.scaled_apply(bad, np.zeros(8, np.float32), 1.0)
    with pytest.raises(ValueError):
        core.scaled_apply(np.zeros(8, np.float32), bad, 1.0)


def test_build_info(core):
    import gem_mpi

    info = core.build_info()
    assert isinstance(info, dict)
    for key in ("compiler", "flags", "native", "version"):
        assert key in info, key
    assert info["version"] == gem_mpi.__version__
    assert "-ffp-contract=off" in info["flags"] or "/fp:precise" in info["flags"]
    assert isinstance(info["native"], bool)
    assert ("-march=native" in info["flags"]) == info["native"]
