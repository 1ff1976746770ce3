"""A worker's gradient point θ + Δθ (gem_mpi.engine.points) made in one pass from Δθ = q·v
as the step left it: the bits of θ + Δθ with Δθ made first, which the replay recomputes."""

from __future__ import annotations

import numpy as np
import pytest

from gem_mpi.algorithm import kernel
from gem_mpi.algorithm.stepsize import Schedule
from gem_mpi.config import AT_OWN, AT_PULLED, Config
from gem_mpi.engine.buffers import DeltaTurns
from gem_mpi.engine.points import GradientPoints

N = 100_003  # not a multiple of any vector width or thread split


def _vectors(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=N).astype(np.float32)
    y = (rng.normal(size=N) * 10.0 ** rng.integers(-20, 20, N)).astype(np.float32)
    return x, y


@pytest.mark.parametrize("extension", [True, False])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("scale", [1.0, -0.05, -3e-4, -0.1 / 3])
def test_axpy_has_the_bits_of_numpy(monkeypatch, extension, threads, scale):
    if not extension:
        monkeypatch.setattr(kernel, "_extension", lambda: None)
    else:
        assert kernel._extension() is not None, "the extension is built by tools/install.sh"
    x, y = _vectors(1)
    want = x + np.float32(scale) * y
    got = kernel.axpy(np.empty_like(x), x, scale, y, threads)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


class _Local:
    """What DeltaTurns asks of a LocalStep: torch, the device, the gradients' binding."""

    def __init__(self) -> None:
        import torch

        self.torch, self.device = torch, torch.device("cpu")

    def bind_grads(self, flat: object) -> None:
        self.bound = flat


def test_a_deferred_point_has_the_bits_of_the_pulled_theta_plus_the_settled_delta():
    optim = Config.of(lr=0.07).optim
    turns = DeltaTurns(_Local(), N, optim.lr, Schedule.of(optim, 10), overlapped=True,
                       on_gpu=False)
    assert turns.deferred, "an overlapped CPU worker makes −η·g on its sending thread"
    pulled, g = _vectors(2)
    points = GradientPoints(AT_OWN, pulled, start=0)
    for seq in (0, 1):
        turn = turns.begin(seq)
        turns.grad.copy_(turns.torch.from_numpy(g * (seq + 1)))
        assert turns.make(turn, seq, turns.torch.from_numpy(pulled)) is None
        points.done(seq, *turns.pending(seq, None))
        point = points.at(seq + 1, pulled).copy()
        delta = turns.settle(seq, None)  # after the point, as the overlapped order does
        assert not turns.grads[turn].any(), "settle zeroes g for the step after next"
        want = pulled + delta
        assert np.array_equal(point.view(np.uint32), want.view(np.uint32))


def test_no_point_at_the_first_step_nor_when_pulled():
    pulled, delta = _vectors(3)
    own = GradientPoints(AT_OWN, pulled, start=5)
    assert own.at(5, pulled) is pulled  # nothing in flight at the order's first pull
    own.done(5, delta)
    assert np.array_equal(own.at(6, pulled), pulled + delta)
    plain = GradientPoints(AT_PULLED, pulled, start=5)
    plain.done(5, delta)
    assert plain.at(6, pulled) is pulled
