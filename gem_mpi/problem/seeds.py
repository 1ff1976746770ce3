"""Seeds: every stream of the data (an epoch's order, a synthetic batch, a step's augmentation
and dropout) drawn from its own well-mixed seed, so that nearby seeds give unrelated streams.
"""

from __future__ import annotations

import numpy as np
import torch

_U64 = (1 << 64) - 1


def mix_seed(*parts: int) -> int:
    """A well-mixed 63-bit seed from several integers, so nearby seeds give unrelated streams."""
    state = np.random.SeedSequence([p & _U64 for p in parts]).generate_state(2, dtype=np.uint32)
    return ((int(state[0]) << 32) | int(state[1])) & ((1 << 63) - 1)


def seed_step(seed: int, worker: int, step: int) -> None:
    """Seed torch's global generator for step ``step`` of worker ``worker``: what a dataset's
    augmentation and then the model's dropout draw from, in whichever process."""
    torch.manual_seed(mix_seed(seed, worker, step))
