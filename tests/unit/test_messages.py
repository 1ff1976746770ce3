"""gem_mpi.protocol, the one definition of the messages, without MPI: the layout per method,
the DONE payload, and the kinds and stop words."""

from __future__ import annotations

import numpy as np
import pytest

from gem_mpi.config import ADAPTIVE, ASYNC_METHODS, DOWNPOUR, GEM, GEM_SHIFTS, OptimConfig
from gem_mpi.protocol import (
    DONE,
    KINDS,
    LEFT,
    RUNNING,
    STOP_WORDS,
    UPDATE,
    WORKER_TIME_COLUMNS,
    layout,
    update_payload,
)

N = 1000


@pytest.mark.parametrize("method, shift, proxy, floats, lengths, kept", [
    (GEM, "others", "local", 3 * N, (3 * N,), None),
    (GEM, "paper", "local", 3 * N, (2 * N, 3 * N), (2 * N, 3 * N)),  # s kept: the tail
    (GEM, "others", "global", 2 * N, (2 * N,), None),  # Δθ, s: no κ|m|
    (GEM, "paper", "global", 2 * N, (N, 2 * N), (N, 2 * N)),  # Δθ alone after the first
    (DOWNPOUR, "others", "local", N, (N,), None),
    (ADAPTIVE, "others", "local", N, (N,), None),
    (DOWNPOUR, "paper", "local", N, (N,), None),  # the shift is GEM's alone
])
def test_layout_per_method(method, shift, proxy, floats, lengths, kept):
    sizes = layout(OptimConfig(method=method, gem_shift=shift, gem_proxy=proxy), N, 7)
    assert (sizes.n_workers, sizes.n_params) == (7, N)
    assert sizes.payload_floats == floats
    assert sizes.update_lengths == lengths
    assert sizes.kept == kept
    assert sizes.done_floats == len(WORKER_TIME_COLUMNS)


@pytest.mark.parametrize("method", ASYNC_METHODS)
@pytest.mark.parametrize("shift", GEM_SHIFTS)
@pytest.mark.parametrize("n", [1, 2, 3, 8, 9, 10, 4097])
def test_the_slot_holds_any_update_and_the_done_payload(method, shift, n):
    """However small the model, a worker's time split fits the slot beside every update."""
    sizes = layout(OptimConfig(method=method, gem_shift=shift), n, 3)
    assert sizes.done_floats == len(WORKER_TIME_COLUMNS) <= sizes.payload_floats
    assert max(sizes.update_lengths) <= sizes.payload_floats
    assert max(sizes.update_lengths) == update_payload(OptimConfig(method=method), n).floats
    if sizes.kept is not None:
        lo, hi = sizes.kept
        assert hi <= sizes.payload_floats and lo in sizes.update_lengths


def test_the_parts_are_views_of_the_slot_in_order():
    payload = update_payload(OptimConfig(method=GEM, gem_shift="paper"), 4)
    slot = np.arange(12, dtype=np.float32)
    delta, a, s = payload.split(slot)
    assert [p.tolist() for p in (delta, a, s)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert all(np.shares_memory(p, slot) for p in (delta, a, s))  # the kernel writes s back
    assert payload.span(payload.kept) == payload.kept_span == (8, 12)


def test_kinds_and_stop_words_are_distinct():
    assert len(KINDS) == 3 and {UPDATE, DONE, LEFT} == set(KINDS) and 0 not in KINDS
    assert len(set(STOP_WORDS.values())) == len(STOP_WORDS)
    assert RUNNING == 0  # a worker reads any other word as "the run has ended"
    assert len(set(WORKER_TIME_COLUMNS)) == len(WORKER_TIME_COLUMNS)
