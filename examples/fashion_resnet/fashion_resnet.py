"""A small residual network with BatchNorm for 28×28 grey images (Fashion-MNIST): the shape
of the models users train on GPUs (ResNet-18 adapted to small images), sized so that a CPU
run takes minutes. Built by gem_mpi from ``--model fashion_resnet:make_model`` and by the
plain single-process loop in ``reference.py`` alike."""

from __future__ import annotations

from torch import nn


class Block(nn.Module):
    """Two 3×3 convolutions with BatchNorm and a shortcut (a 1×1 one where the shape changes)."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(),
            nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False), nn.BatchNorm2d(c_out))
        self.skip = nn.Identity() if stride == 1 and c_in == c_out else nn.Sequential(
            nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))
        self.out = nn.ReLU()

    def forward(self, x):
        return self.out(self.body(x) + self.skip(x))


def make_model() -> nn.Module:
    """ResNet-18's plan cut to three stages of one block each (16, 32, 64 channels): a 3×3
    stem without max-pooling, as ResNets for small images have."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
        Block(16, 16, 1), Block(16, 32, 2), Block(32, 64, 2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))
