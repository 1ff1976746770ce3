"""A non-vision model of your own: an MLP regressing a smooth function of 16 features, on
data this module makes (seeded, so every rank makes the same). Trained with --loss mse; the
targets are not class indices, so the evaluation reports the test loss and no accuracy.

    mpirun -n 5 python train.py                       # from Python: gem_mpi.fit
    mpirun -n 5 python -m gem_mpi.train --model regression:make_model \
        --dataset regression:make_dataset --loss mse  # the same from the command line
"""

from __future__ import annotations

import torch
from torch import nn

FEATURES = 16
SIZES = {"train": 16384, "test": 2048}


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                         nn.Linear(64, 1))


def make_dataset(split: str) -> torch.utils.data.Dataset:
    """(x, y) pairs: y = sin(x · w) + x₀ x₁ / 2 + noise, w the same for both splits."""
    w = torch.randn(FEATURES, generator=torch.Generator().manual_seed(1)) / FEATURES**0.5
    g = torch.Generator().manual_seed({"train": 2, "test": 3}[split])
    x = torch.randn(SIZES[split], FEATURES, generator=g)
    y = torch.sin(x @ w) + 0.5 * x[:, 0] * x[:, 1] + 0.05 * torch.randn(SIZES[split], generator=g)
    return torch.utils.data.TensorDataset(x, y.unsqueeze(1))
