"""Samples/s, tokens/s, model FLOPs and MFU from a rate (gem_mpi.run.throughput): no MPI."""

from __future__ import annotations

import math

import pytest
import torch

from gem_mpi.run.throughput import Throughput, flops_per_sample, peak_flops


def test_a_linear_layer_counts_its_forward_and_its_weight_gradient():
    """y = xWᵀ + b on a batch of 4: 2·8·3 FLOPs a sample forward, as many for ∂W (x needs
    no gradient); the loss's own arithmetic is not model FLOPs."""
    model = torch.nn.Linear(8, 3)
    x, y = torch.randn(4, 8), torch.randn(4, 3)
    before = [p.clone() for p in model.parameters()]
    assert flops_per_sample(model, (x, y), torch.nn.functional.mse_loss) == 2 * (2 * 8 * 3)
    # rank 0's model is untouched: counted on a copy
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_rates_per_worker_tokens_flops_and_mfu():
    t = Throughput(samples=64, workers=4, tokens=128, flops=1e9, peak=1e12)
    r = t.rates(10.0)  # 10 updates a second of 64 samples each
    assert r["samples_per_s"] == 640 and r["samples_per_s_per_worker"] == 160
    assert r["tokens_per_s"] == 640 * 128
    assert r["model_flops_per_s"] == 640e9
    assert r["mfu"] == pytest.approx(640e9 / 4e12)  # against the peak of every worker
    assert t.text(10.0) == "640 samples/s (160/worker), 81920 tok/s, MFU 16.0%"


def test_the_cpu_shows_flops_without_an_mfu_and_a_model_without_flops_shows_neither():
    cpu = Throughput(samples=32, workers=2, flops=2e6)
    assert "mfu" not in cpu.rates(100.0)
    assert cpu.text(100.0) == "3200 samples/s (1600/worker), 6.40 GFLOP/s (CPU: no MFU)"
    quad = Throughput(samples=64, workers=2)
    assert quad.rates(1.0) == {"samples_per_s": 64, "samples_per_s_per_worker": 32}


@pytest.mark.parametrize(("name", "peak"), [
    ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12),
    ("NVIDIA H200", 989e12), ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA L40S", 362e12),
    ("AMD Instinct MI300X", 1307e12), ("Some Future GPU", 0.0), (None, 0.0)])
def test_the_peak_table_matches_by_the_driver_s_name(name, peak):
    assert peak_flops(name) == peak
    assert not math.isnan(peak_flops(name))
