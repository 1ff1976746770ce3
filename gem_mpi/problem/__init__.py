"""What is being trained, as master and workers both need to know it: θ's layout and θ₀.

Every rank builds the same description locally (same model code, same sizes), so the window
sizes agree before the collective allocation without any message. Only the master needs θ₀;
workers pull it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from gem_mpi.config import QUADRATIC, DataConfig, is_plugin
from gem_mpi.errors import OutputError
from gem_mpi.outputs.files import atomic_write, os_reason
from gem_mpi.problem.loss import Loss, make_loss
from gem_mpi.problem.quadratic import Quadratic
from gem_mpi.problem.user import build_model as build_users_model

if TYPE_CHECKING:  # torch is imported where a model is built, never on import
    import torch


@dataclass
class Problem:
    names: list[str]
    sizes: list[int]
    theta0: np.ndarray | None
    model: torch.nn.Module | None = None  # for torch models
    quadratic: Quadratic | None = None
    loss: Loss | None = None  # for torch models: what workers minimise

    @property
    def n_params(self) -> int:
        return int(sum(self.sizes))

    @property
    def offsets(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)


def build_problem(data: DataConfig, with_theta0: bool) -> Problem:
    if data.model == QUADRATIC:
        q = Quadratic(data.quadratic_dim, data.seed)
        names, sizes = q.tensors()
        return Problem(names, sizes, q.theta0() if with_theta0 else None, quadratic=q)
    import torch

    # models import torch: here, so that the quadratic problem never loads it
    from gem_mpi.problem.models import build_model
    from gem_mpi.problem.spec import dataset_spec

    torch.manual_seed(data.seed)  # θ₀ is a function of --seed alone
    if is_plugin(data.model):
        model = build_users_model(data.model)
    else:
        model = build_model(data.model, dataset_spec(data.dataset, data.model, data.context),
                            (data.gpt_layers, data.gpt_heads, data.gpt_width))
    params = list(model.named_parameters())
    names = [n for n, _ in params]
    sizes = [p.numel() for _, p in params]
    theta0 = flatten([p for _, p in params]) if with_theta0 else None
    return Problem(names, sizes, theta0, model=model, loss=make_loss(data.loss, data.model))


def preload(data: DataConfig) -> None:
    """Import what :func:`build_problem` will for this model (torch and the models: seconds
    of a rank's start-up), so that a worker spends that time while rank 0 checks the run,
    not after it."""
    if data.model != QUADRATIC:
        import torch  # noqa: F401

        import gem_mpi.problem.models  # noqa: F401


def unflatten(flat: torch.Tensor, params: list) -> list:
    """Views of a flat torch tensor shaped like each parameter, in θ's order: the one
    mapping between θ and a model's parameters."""
    views, offset = [], 0
    for p in params:
        n = p.numel()
        views.append(flat[offset:offset + n].view_as(p))
        offset += n
    return views


def flatten(tensors: list) -> np.ndarray:
    """Parameters (or tensors shaped like them) as one flat float32 θ on the host."""
    import torch

    with torch.no_grad():
        return torch.cat([t.detach().reshape(-1) for t in tensors]).float().cpu().numpy()


def load_theta(model: torch.nn.Module, theta: np.ndarray) -> None:
    """Copy a flat float32 θ into a torch model's parameters."""
    import torch

    params = list(model.parameters())
    with torch.no_grad():
        for p, view in zip(params, unflatten(torch.from_numpy(theta), params)):
            p.copy_(view)


SAFETENSORS = ".safetensors"  # --save's suffix for the safetensors format


def is_safetensors(path: str) -> bool:
    """Whether --save ``path`` is written as safetensors (its suffix, in any case)."""
    return path.lower().endswith(SAFETENSORS)


def save_final(model: torch.nn.Module | None, theta: np.ndarray, path: str,
               metadata: dict[str, str] | None = None) -> None:
    """--save: θ loaded into a torch model, whose ``state_dict`` (parameters and buffers, the
    BatchNorm statistics as last evaluated) is written, or the quadratic's θ; atomically, so a
    failed write leaves no partial file. The suffix picks the format: ``.safetensors`` the
    named tensors (the quadratic's one, ``theta``) with ``metadata`` (strings) in the file's
    header; any other, ``torch.save`` of the ``state_dict``, and for the quadratic numpy's
    ``.npy``."""
    if model is not None:
        load_theta(model, theta)
    if is_safetensors(path):
        # "format": the framework the tensors are for, as safetensors' own save_model writes
        header = {"format": "pt" if model is not None else "np", **(metadata or {})}
        if model is not None:
            tensors = safetensors_state(model.state_dict(), path)
        else:
            flat = np.ascontiguousarray(theta)

        def write(tmp: str) -> None:
            from safetensors import SafetensorError

            try:
                if model is not None:
                    from safetensors.torch import save_file

                    save_file(tensors, tmp, metadata=header)
                else:
                    from safetensors.numpy import save_file as save_numpy

                    save_numpy({"theta": flat}, tmp, metadata=header)
            except SafetensorError as exc:  # its I/O errors (ENOSPC), as the OS's
                raise OSError(str(exc)) from None
    else:
        def write(tmp: str) -> None:
            if model is not None:
                import torch

                torch.save(model.state_dict(), tmp)
            else:  # via memory: numpy's own file write hides the OS error (ENOSPC) in its text
                import io

                buf = io.BytesIO()
                np.save(buf, theta)
                with open(tmp, "wb") as f:
                    f.write(buf.getbuffer())

    try:
        atomic_write(path, write)
    except (OSError, RuntimeError) as exc:  # torch.save says RuntimeError for ENOSPC
        raise OutputError(f"--save {path!r}: writing failed ({os_reason(exc)})") from None


def safetensors_state(state: dict, path: str) -> dict:
    """A ``state_dict`` as safetensors stores it: every tensor contiguous on the CPU, and one
    sharing memory with a tensor before it (tied weights) copied, since the format holds no
    shared tensors; it loads strictly into the model again. A value that is not a tensor
    (a module's extra state) cannot be stored: an :class:`OutputError` naming it."""
    import torch

    tensors: dict[str, torch.Tensor] = {}
    storages: set[int] = set()
    for name, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise OutputError(f"--save {path!r}: the model's state_dict holds {name!r}, a "
                              f"{type(value).__name__}, and safetensors stores tensors only; "
                              "save to a .pt file")
        t = value.detach().cpu().contiguous()
        storage = t.untyped_storage().data_ptr()
        if storage in storages:
            t = t.clone()
        storages.add(storage)
        tensors[name] = t
    return tensors
