"""What is being trained, as master and workers both need to know it: θ's layout and θ₀.

Every rank builds the same description locally (same model code, same sizes), so the window
sizes agree before the collective allocation without any message. Only the master needs θ₀;
workers pull it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gem_mpi.config import Config
from gem_mpi.quadratic import Quadratic


@dataclass
class Problem:
    names: list[str]
    sizes: list[int]
    theta0: np.ndarray | None
    model: object | None = None  # torch.nn.Module for torch models
    quadratic: Quadratic | None = None

    @property
    def n_params(self) -> int:
        return int(sum(self.sizes))

    @property
    def offsets(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)


def build_problem(cfg: Config, with_theta0: bool) -> Problem:
    if cfg.model == "quadratic":
        q = Quadratic(cfg.quadratic_dim, cfg.seed)
        names, sizes = q.tensors()
        return Problem(names, sizes, q.theta0() if with_theta0 else None, quadratic=q)
    import torch

    from gem_mpi.data import dataset_spec
    from gem_mpi.models import build_model

    torch.manual_seed(cfg.seed)  # θ₀ is a function of --seed alone
    model = build_model(cfg.model, dataset_spec(cfg.dataset, cfg.model))
    params = list(model.named_parameters())
    names = [n for n, _ in params]
    sizes = [p.numel() for _, p in params]
    theta0 = None
    if with_theta0:
        with torch.no_grad():
            theta0 = torch.cat([p.detach().reshape(-1) for _, p in params]).float().numpy()
    return Problem(names, sizes, theta0, model=model)


def load_theta(model: object, theta: np.ndarray) -> None:
    """Copy a flat float32 θ into a torch model's parameters."""
    import torch

    flat = torch.from_numpy(theta)
    offset = 0
    with torch.no_grad():
        for p in model.parameters():
            n = p.numel()
            p.copy_(flat[offset:offset + n].view_as(p))
            offset += n


def save_final(model: object | None, theta: np.ndarray, path: str) -> None:
    """--save: a torch model's state_dict (θ loaded into it), or θ as .npy for the quadratic;
    atomically, so a failed write leaves no partial file."""
    from gem_mpi.errors import OutputError
    from gem_mpi.files import atomic_write, os_reason

    def write(tmp: str) -> None:
        if model is not None:
            import torch

            load_theta(model, theta)
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
