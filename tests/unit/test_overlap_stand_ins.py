"""The learning stand-in for an accelerator's worker (gem_mpi.bench.overlap.mlp): its
forward sleeps the step's milliseconds, and it is a real MNIST classifier whose gradients
reach every parameter."""

from __future__ import annotations

import time

from gem_mpi.bench import overlap


def test_the_mlp_classifies_mnist_images_and_sleeps_its_step(monkeypatch):
    import torch

    monkeypatch.setenv("GEM_MPI_OVERLAP_STEP_MS", "50")
    net = overlap.mlp()
    x, y = torch.zeros(4, 1, 28, 28), torch.tensor([0, 1, 2, 3])
    t = time.perf_counter()
    logits = net(x)
    assert time.perf_counter() - t >= 0.05  # the step's sleep
    assert logits.shape == (4, 10)
    torch.nn.functional.cross_entropy(logits, y).backward()
    assert all(p.grad is not None for p in net.parameters())
