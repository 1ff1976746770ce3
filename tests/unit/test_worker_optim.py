"""The worker's AdamW (gem_mpi.algorithm.optim) in-process: its kept states resume a worker
exactly, and its numpy and torch forms take the same steps (the mpirun replays in
tests/test_adamw.py hold the numpy form to the reference bit for bit)."""

from __future__ import annotations

import numpy as np
import torch

from gem_mpi.algorithm.optim import AdamW
from gem_mpi.config import AdamWConfig

CFG = AdamWConfig(betas="0.8,0.99", adam_eps=1e-6, weight_decay=0.1)


def _grads(n: int, steps: int) -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    return [(rng.normal(size=n) * 10.0 ** rng.integers(-4, 1)).astype(np.float32)
            for _ in range(steps)]


def test_each_kept_state_resumes_the_steps_after_it_bit_for_bit():
    n, grads, s = 1001, _grads(1001, 9), np.linspace(-1, 1, 1001, dtype=np.float32)
    whole = AdamW(np.zeros(n, np.float32), CFG, depth=3)
    ds = [whole.step(g, s, 0.01, np.empty(n, np.float32)).copy() for g in grads]
    states = whole.arrays()
    assert [int(st["t"]) for st in states] == [9, 8, 7]
    for back, state in enumerate(states):  # the state before the last `back` steps
        resumed = AdamW(np.zeros(n, np.float32), CFG, depth=3)
        resumed.restore(state, 9 - back)
        for k in range(9 - back, 9):
            d = resumed.step(grads[k], s, 0.01, np.empty(n, np.float32))
            assert np.array_equal(d.view(np.uint32), ds[k].view(np.uint32))
        assert resumed.folded == 9 and resumed.t == 9


def test_the_numpy_and_torch_forms_take_the_same_steps():
    n, grads = 4099, _grads(4099, 20)
    s = np.linspace(-2, 2, n, dtype=np.float32)
    host = AdamW(np.zeros(n, np.float32), CFG)
    dev = AdamW(torch.zeros(n), CFG)
    for g in grads:
        d_np = host.step(g, s, 0.003, np.empty(n, np.float32))
        d_t = dev.step(torch.from_numpy(g), torch.from_numpy(s), 0.003, torch.empty(n))
        # the same formulas; torch may fuse a multiply-add, so an ulp apart (absolute where the
        # AdamW term and the decay nearly cancel)
        np.testing.assert_allclose(d_t.numpy(), d_np, rtol=2e-6, atol=1e-6 * 0.003)
    np.testing.assert_allclose(dev.arrays()[0]["v"], host.arrays()[0]["v"], rtol=1e-6)
