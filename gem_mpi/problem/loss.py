"""The training loss, by name (``--loss``) or the user's ``MODULE:FUNCTION``.

Workers minimise ``mean`` on each mini-batch; the evaluation sums ``total`` over the test set,
so its loss is the mean over samples whatever the batch sizes. The built-in models end in
``log_softmax`` and keep ``nll``, the loss they always had; a model of the user's own gets
``cross_entropy`` (logits in, class indices as targets) unless told otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gem_mpi.config import is_plugin
from gem_mpi.errors import UsageError
from gem_mpi.problem.user import resolve

NAMES = ("cross_entropy", "nll", "mse")


@dataclass(frozen=True)
class Loss:
    name: str
    mean: Callable[[Any, Any], Any]  # the batch's mean loss: what workers differentiate
    total: Callable[[Any, Any], Any]  # the batch's summed loss: what the evaluation adds up


def _mse(output: Any, target: Any, reduction: str = "mean") -> Any:
    """torch's mse_loss, but refusing what it would only warn about: shapes that broadcast
    ((B, 1) against (B,)) give a loss of the wrong thing."""
    import torch.nn.functional as F

    if output.shape != target.shape:
        raise ValueError(f"mse compares outputs and targets of one shape, got "
                         f"{tuple(output.shape)} and {tuple(target.shape)}")
    return F.mse_loss(output, target, reduction=reduction)


def default_name(model: str) -> str:
    return "cross_entropy" if is_plugin(model) else "nll"


def make_loss(name: str | None, model: str) -> Loss:
    """The loss ``name`` names (None: the model's default)."""
    import torch.nn.functional as F

    name = name or default_name(model)
    builtin = {"cross_entropy": F.cross_entropy, "nll": F.nll_loss, "mse": _mse}
    if name in builtin:
        fn = builtin[name]
        return Loss(name, fn, lambda out, target: fn(out, target, reduction="sum"))
    if not is_plugin(name):
        raise UsageError(f"unknown --loss {name!r}; choose from {', '.join(NAMES)} or give "
                         "MODULE:FUNCTION (FUNCTION(output, target) -> the batch's mean loss)")
    fn = resolve(name, "--loss")
    # the user's function gives the batch's mean: the evaluation weighs it by the batch size
    return Loss(name, fn, lambda out, target: fn(out, target) * target.shape[0])
