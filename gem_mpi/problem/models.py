"""The built-in models, which all end in log_softmax (so their default --loss is nll), and
the evaluation of any model.

torchvision is imported only when AlexNet or ResNet-18 is built; the paper's MNIST CNN
needs nothing beyond torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from functools import partial
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from gem_mpi.config import GPT, TORCH_MODELS
from gem_mpi.errors import UsageError
from gem_mpi.problem.loss import Loss
from gem_mpi.problem.spec import DataSpec

_MNIST_CNN_SIZE = 28
_INDEX_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


class MnistCNN(nn.Module):
    """The CNN of the GEM paper's MNIST experiments (about 164k parameters), kept verbatim."""

    def __init__(self, channels: int = 1, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(320, 300)
        self.fc2 = nn.Linear(300, 200)
        self.fc3 = nn.Linear(200, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = x.flatten(1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return F.log_softmax(self.fc3(x), dim=1)


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention, then a 4× MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for z in self.qkv(self.ln1(x)).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class ByteGPT(nn.Module):
    """A small decoder-only transformer over bytes: ``(B, T)`` byte indices in, the next
    byte's log-probabilities ``(B, vocab, T)`` out (classes on dim 1, as nll_loss and the
    evaluation take them, each position a sample of its own)."""

    def __init__(self, vocab: int, context: int, layers: int, heads: int, width: int) -> None:
        super().__init__()
        if width % heads:
            raise UsageError(f"--gpt-heads {heads} must divide --gpt-width {width}")
        self.tokens, self.positions = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(width), nn.Linear(width, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tokens(idx) + self.positions(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return F.log_softmax(self.head(self.ln(x)), dim=-1).transpose(1, 2)


class LogSoftmax(nn.Module):
    """Turns a logits model into a log-probability one; parameters live under `net.`."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(self.net(x), dim=1)


def _with_in_channels(conv: nn.Conv2d, channels: int) -> nn.Conv2d:
    """A fresh first convolution for `channels` inputs, otherwise shaped like `conv`."""
    if conv.in_channels == channels:
        return conv
    return nn.Conv2d(
        channels,
        conv.out_channels,
        kernel_size=conv.kernel_size,
        stride=conv.stride,
        padding=conv.padding,
        bias=conv.bias is not None,
    )


def _torchvision_models() -> ModuleType:
    try:
        from torchvision import models
    except ImportError as exc:
        raise UsageError(
            f"models alexnet and resnet18 need torchvision, which failed to import ({exc}); "
            "install torchvision or use --model mnist-cnn"
        ) from exc
    return models


def build_model(name: str, spec: DataSpec, gpt: tuple[int, int, int] = (2, 4, 128)
                ) -> nn.Module:
    """A freshly initialised model for inputs of `spec` that outputs log-probabilities;
    ``gpt``: the language model's layers, heads and width."""
    if name not in TORCH_MODELS:
        raise UsageError(f"unknown model {name!r}; choose one of: {', '.join(TORCH_MODELS)}")
    if name == GPT:
        return ByteGPT(spec.num_classes, spec.context, *gpt)
    if name == "mnist-cnn":
        if spec.image_size != _MNIST_CNN_SIZE:
            raise UsageError(
                f"model mnist-cnn takes {_MNIST_CNN_SIZE} px images, the data gives "
                f"{spec.image_size} px; use --model alexnet or resnet18 for larger images"
            )
        return MnistCNN(spec.channels, spec.num_classes)
    models = _torchvision_models()
    if name == "alexnet":
        net = models.alexnet(weights=None, num_classes=spec.num_classes)
        net.features[0] = _with_in_channels(net.features[0], spec.channels)
    else:
        net = models.resnet18(weights=None, num_classes=spec.num_classes)
        conv1 = _with_in_channels(net.conv1, spec.channels)
        if conv1 is not net.conv1:  # keep torchvision's ResNet initialisation
            nn.init.kaiming_normal_(conv1.weight, mode="fan_out", nonlinearity="relu")
            net.conv1 = conv1
    return LogSoftmax(net)


def evaluate(
    model: nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    device: torch.device,
    loss: Loss | None = None,
) -> tuple[float, float]:
    """Mean loss (NLL unless ``loss`` says otherwise) and accuracy in [0, 1], per sample
    (text: per predicted byte); NaN for both when `batches` is empty, and NaN accuracy where
    the targets are not class indices.

    Runs in eval mode without gradients and restores every submodule's train/eval mode
    afterwards, so it can be called in the middle of training.
    """
    total = loss.total if loss is not None else partial(F.nll_loss, reduction="sum")
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    correct = torch.zeros((), dtype=torch.int64, device=device)
    n, classes = 0, True
    try:
        with torch.no_grad():
            for x, y in batches:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                out = model(x)
                loss_sum += total(out, y).double()
                # accuracy where the targets are class indices and the output has one more
                # dim, the classes' (dim 1): a row per image, or (text) per position
                classes = classes and (y.dtype in _INDEX_DTYPES and out.dim() == y.dim() + 1)
                if classes:
                    correct += (out.argmax(dim=1) == y).sum()
                n += y.numel() if classes else y.shape[0]
    finally:
        for module, training in modes:
            module.training = training
    if n == 0:
        return math.nan, math.nan
    # one device sync at the end instead of one per batch
    return loss_sum.item() / n, correct.item() / n if classes else math.nan


def has_batch_norm(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def recompute_batch_norm(model: nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
                         device: torch.device) -> int:
    """Make every BatchNorm layer's running mean and variance those of the model's current
    parameters: reset them, then average each layer's batch statistics over ``batches``
    with equal weight (momentum None), as torch.optim.swa_utils.update_bn does. Unlike
    update_bn the other modules stay in eval mode, so dropout draws nothing from torch's
    global generator (which rank 0's evaluation thread shares with the synchronous run's
    training on the same rank) and the statistics are a function of θ and the batches
    alone. Returns the batches used (0: no BatchNorm, nothing done)."""
    layers = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not layers:
        return 0
    modes = [(m, m.training) for m in model.modules()]
    momenta = [m.momentum for m in layers]
    model.eval()
    for m in layers:
        m.reset_running_stats()
        m.momentum = None  # a cumulative average over the batches
        m.train()
    used = 0
    try:
        with torch.no_grad():
            for x, _ in batches:
                model(x.to(device, non_blocking=True))
                used += 1
    finally:
        for m, momentum in zip(layers, momenta):
            m.momentum = momentum
        for m, training in modes:
            m.training = training
    return used
