"""The per-tensor median read off the kernel's histograms, all tensors at once, against a
plain per-row reading (the definition), bit for bit: the metrics hold its values."""

from __future__ import annotations

import numpy as np
import pytest

from gem_mpi.algorithm.kernel import HIST_BINS, hist_median


def _one_row(row: np.ndarray, pi_max: float) -> np.float32:
    """The lower median of one histogram row, read the slow way."""
    total = int(row.sum())
    if total == 0:
        return np.float32(np.nan)
    rank = (total + 1) // 2
    cum = np.cumsum(row)
    b = int(np.searchsorted(cum, rank))
    if b == 0:
        return np.float32(0.0)
    if b == HIST_BINS + 1:
        return np.float32(pi_max)
    return np.float32((b - 1 + (rank - cum[b - 1] - 0.5) / row[b]) * (pi_max / HIST_BINS))


def test_edge_rows():
    h = np.zeros((5, HIST_BINS + 2), np.int64)
    h[1, 0] = 3  # clamped low: exactly 0
    h[2, -1] = 4  # clamped high: exactly π_max
    h[3, [0, 10, -1]] = [1, 5, 1]  # inside bin 10
    h[4, [0, -1]] = [2, 2]  # the lower median is a clamped-low one
    got = hist_median(h, 5.0)
    assert np.isnan(got[0]) and got[1] == 0.0 and got[2] == np.float32(5.0)
    assert 9 * 5.0 / HIST_BINS <= got[3] <= 10 * 5.0 / HIST_BINS and got[4] == 0.0
    assert got.dtype == np.float32


@pytest.mark.parametrize("seed", range(5))
def test_all_tensors_at_once_equal_row_by_row(seed):
    rng = np.random.default_rng(seed)
    for _ in range(300):
        tensors = int(rng.integers(1, 70))
        h = np.zeros((tensors, HIST_BINS + 2), np.int64)
        for t in range(tensors):
            k = int(rng.integers(0, 40))
            np.add.at(h[t], rng.integers(0, HIST_BINS + 2, size=k),
                      rng.integers(1, 10_000, size=k))
        pi_max = float(rng.choice([0.5, 1.0, 5.0, 7.3]))
        want = np.array([_one_row(row, pi_max) for row in h], np.float32)
        assert np.array_equal(hist_median(h, pi_max).view(np.uint32), want.view(np.uint32))
