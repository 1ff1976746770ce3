"""One rank's gradient of a mini-batch: its model and loss on its device, the forward under
--amp's autocast, the backward, the clip. An asynchronous worker, a group member and a
synchronous worker all take it, so that they compute the same gradient of the same batch;
what each does around it (θ in, the average, the optimizer) stays theirs."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gem_mpi.config import AMP_BF16, OptimConfig
from gem_mpi.problem import Problem, unflatten

if TYPE_CHECKING:  # torch is imported when a step is made, never on import
    import torch


class LocalStep:
    """The model (moved to ``device``, in training mode), its loss and parameters.

    ``net`` is the module the forward runs: the model itself, or a wrapper of it that a
    synchronous method puts around it (DDP's, whose backward averages as it goes)."""

    def __init__(self, optim: OptimConfig, problem: Problem, device: torch.device) -> None:
        import torch

        assert problem.model is not None and problem.loss is not None, "a torch problem"
        self.torch, self.device = torch, device
        self.model: torch.nn.Module = problem.model.to(device)
        self.loss = problem.loss.mean
        self.model.train()
        self.params = list(self.model.parameters())
        self.net: torch.nn.Module = self.model
        self.amp = torch.bfloat16 if optim.amp == AMP_BF16 else None
        self.clip_norm = optim.clip_grad_norm

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The loss of (x, y), its gradient accumulated into the parameters' .grad; returns
        the loss tensor (bf16 autocast with --amp bf16, else float32 throughout)."""
        torch = self.torch
        with torch.autocast(self.device.type, dtype=self.amp or torch.float32,
                            enabled=self.amp is not None):
            loss = self.loss(self.net(x), y)
        loss.backward()
        return loss

    def clip(self) -> None:
        """--clip-grad-norm: the gradient's norm cut to it (nothing when 0)."""
        if self.clip_norm > 0:
            self.torch.nn.utils.clip_grad_norm_(self.params, self.clip_norm)

    def bind(self, flat: torch.Tensor) -> None:
        """Make every parameter a view of ``flat`` (θ's layout, this rank's device), so that
        θ reaches the model in one copy, or none."""
        with self.torch.no_grad():
            for p, view in zip(self.params, unflatten(flat, self.params)):
                p.data = view

    def bind_grads(self, flat: torch.Tensor) -> None:
        """Make every parameter's .grad a view of ``flat`` (backward accumulates there), so
        that the gradient is one flat tensor to average, clip and scale."""
        for p, view in zip(self.params, unflatten(flat, self.params)):
            p.grad = view

    def check_grads(self, flat: torch.Tensor) -> None:
        """Autograd accumulates into an existing .grad in place; a model whose backward
        replaces it (or leaves a parameter without one) would send a stale Δθ: refuse."""
        lo = flat.data_ptr()
        hi = lo + flat.numel() * flat.element_size()
        for p in self.params:
            if p.grad is None or not lo <= p.grad.data_ptr() < hi:
                raise RuntimeError("a parameter's gradient left the worker's flat gradient "
                                   "buffer after backward (its .grad was replaced)")
