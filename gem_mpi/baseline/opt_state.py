"""The synchronous methods' torch optimizer (``--optimizer``) and its state as a checkpoint
holds it: each per-parameter buffer one flat float32 array like θ (momentum SGD's momentum
buffer; AdamW's exp_avg and exp_avg_sq) and AdamW's step count per parameter tensor (int64),
so that a resume puts back exactly the state torch.optim had and continues bit for bit.

An array is named by its key (``m``, ``v``, ``t``); the checkpoint's field of each key is
:data:`SHARED`'s for the optimizer every rank shares (sync's and ddp's, DiLoCo's outer
Nesterov step, always momentum SGD) and :data:`INNER`'s for DiLoCo's workers' own (one row
per worker).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gem_mpi.config import DILOCO, OPT_ADAMW, OPT_SGD, Config
from gem_mpi.problem import flatten, unflatten

# each --optimizer's per-parameter buffers: (the array's key, torch.optim's state name)
BUFFERS = {OPT_SGD: (("m", "momentum_buffer"),),
           OPT_ADAMW: (("m", "exp_avg"), ("v", "exp_avg_sq"))}
STEPS = "t"  # AdamW's step count per parameter tensor (its bias correction)
SHARED = {"m": "momentum", "v": "adam_v", "t": "adam_t"}
INNER = {"m": "inner_m", "v": "inner_v", "t": "inner_t"}


def shared_kind(cfg: Config) -> str:
    """The kind of the optimizer every rank shares: --optimizer, but DiLoCo's outer step is
    momentum SGD whatever --optimizer, which is then its workers' inner optimizer."""
    return OPT_SGD if cfg.method == DILOCO else cfg.optim.optimizer


def build(cfg: Config, params: list) -> Any:
    """The torch optimizer --optimizer names, at η (a schedule sets each step's lr)."""
    import torch

    o = cfg.optim
    if o.optimizer == OPT_ADAMW:
        a = cfg.adamw
        return torch.optim.AdamW(params, lr=o.lr, betas=(a.beta1, a.beta2), eps=a.adam_eps,
                                 weight_decay=a.weight_decay)
    return torch.optim.SGD(params, lr=o.lr, momentum=o.momentum)


def empty(kind: str, sizes: list[int]) -> dict[str, np.ndarray]:
    """Arrays of each key's shape and dtype (for a receiving rank to fill)."""
    out = {key: np.empty(sum(sizes), np.float32) for key, _ in BUFFERS[kind]}
    if kind == OPT_ADAMW:
        out[STEPS] = np.empty(len(sizes), np.int64)
    return out


def arrays(state: dict, params: list, kind: str) -> dict[str, np.ndarray]:
    """An optimizer's ``state`` as arrays: zeros and step 0 where a parameter has none yet,
    which torch.optim's first step treats as it treats no state."""
    import torch

    out = {key: flatten([state[p][name] if name in state[p] else torch.zeros_like(p)
                         for p in params]) for key, name in BUFFERS[kind]}
    if kind == OPT_ADAMW:
        out[STEPS] = np.array([int(state[p]["step"]) if "step" in state[p] else 0
                               for p in params], np.int64)
    return out


def put(state: dict, params: list, kind: str, values: dict[str, np.ndarray],
        device: Any) -> None:
    """:func:`arrays`' arrays into an optimizer's ``state``, as torch.optim keeps them (AdamW's
    step a float scalar tensor on the host)."""
    import torch

    for key, name in BUFFERS[kind]:
        views = unflatten(torch.from_numpy(values[key].copy()), params)
        for p, buf in zip(params, views):
            state[p][name] = buf.to(device)
    if kind == OPT_ADAMW:
        for p, t in zip(params, values[STEPS]):
            state[p]["step"] = torch.tensor(float(t))
