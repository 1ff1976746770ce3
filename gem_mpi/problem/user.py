"""The user's own model, dataset and loss, named ``MODULE:FUNCTION`` (or given from Python).

A name is recorded as text in the metrics file and the checkpoints (a resume must name the
same factory), and every rank resolves it itself: the same code on every rank gives the same
parameter layout without a message. Functions given from Python (:func:`gem_mpi.fit`) are
registered under their ``module:qualname`` first, so lambdas and closures work too.

Every failure here is one :class:`~gem_mpi.errors.UsageError` line; rank 0 also builds the
model and runs a batch through it before any work (:func:`gem_mpi.run.preflight.check_user_code`),
so that a factory that raises or returns the wrong thing is one line and exit 2 there, instead
of a traceback on every rank.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

from gem_mpi.errors import UsageError

_REGISTERED: dict[str, Callable] = {}  # name -> a function given from Python
SPLITS = ("train", "test")


def register(fn: Callable, what: str) -> str:
    """The name a function given from Python is recorded under (the same on every rank)."""
    if not callable(fn):
        raise UsageError(f"{what}: expected a function, got {type(fn).__name__}")
    name = f"{getattr(fn, '__module__', None) or '__main__'}:{getattr(fn, '__qualname__', repr(fn))}"
    _REGISTERED[name] = fn
    return name


def resolve(name: str, flag: str) -> Callable:
    """The function ``MODULE:FUNCTION`` names, imported as Python imports modules."""
    if name in _REGISTERED:
        return _REGISTERED[name]
    module_name, _, attr = name.partition(":")
    if not module_name or not attr:
        raise UsageError(f"{flag} {name!r}: expected MODULE:FUNCTION, e.g. mymodels:make_net")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # `python -m` has it; a script run from elsewhere not
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - whatever the user's module raises on import
        raise UsageError(f"{flag} {name!r}: cannot import {module_name!r} "
                         f"({why(exc)})") from None
    fn: Any = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise UsageError(f"{flag} {name!r}: module {module_name!r} "
                             f"({getattr(module, '__file__', '?')}) has no {attr!r}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise UsageError(f"{flag} {name!r}: {attr!r} is a {type(fn).__name__}, not a function")
    return fn


def why(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _call(fn: Callable, flag: str, name: str, *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - the user's code: one line, not a traceback
        call = f"{name.partition(':')[2] or name}({', '.join(map(repr, args))})"
        raise UsageError(f"{flag} {name!r}: {call} raised {why(exc)}") from None


def build_model(name: str) -> Any:
    """The user's freshly initialised model: a torch Module of float32 parameters."""
    import torch
    from torch import nn

    model = _call(resolve(name, "--model"), "--model", name)
    if not isinstance(model, nn.Module):
        raise UsageError(f"--model {name!r} returned a {type(model).__name__}, not a "
                         "torch.nn.Module")
    params = list(model.named_parameters())
    if not params:
        raise UsageError(f"--model {name!r}: the model has no parameters to train")
    for pname, p in params:
        if p.dtype != torch.float32:
            raise UsageError(f"--model {name!r}: parameter {pname!r} is {p.dtype}; gem_mpi "
                             "trains float32 parameters (call .float() on the model)")
        if p.device.type != "cpu":
            raise UsageError(f"--model {name!r}: parameter {pname!r} is on {p.device}; "
                             "return the model on the CPU (each worker moves it to its GPU)")
    return model


def load_dataset(name: str, split: str) -> Any:
    """The user's map-style dataset of (input, target) pairs for ``split``."""
    ds = _call(resolve(name, "--dataset"), "--dataset", name, split)
    import torch.utils.data as tud

    what = f"--dataset {name!r}: {name.partition(':')[2]}({split!r})"
    if isinstance(ds, tud.IterableDataset) or not (hasattr(ds, "__getitem__")
                                                     and hasattr(ds, "__len__")):
        raise UsageError(f"{what} returned a {type(ds).__name__}, not a map-style dataset "
                         "(one with __len__ and __getitem__; gem_mpi shuffles and shards by "
                         "index)")
    try:
        n = len(ds)
    except Exception as exc:  # noqa: BLE001
        raise UsageError(f"{what}: len() raised {why(exc)}") from None
    if n == 0:
        raise UsageError(f"{what} is empty")
    return ds


def sample(ds: Any, name: str, split: str, index: int) -> tuple[Any, Any]:
    """One (input, target) pair, with a readable error when the dataset yields another kind."""
    try:
        item = ds[index]
    except Exception as exc:  # noqa: BLE001
        raise UsageError(f"--dataset {name!r}: sample {index} of {split!r} raised "
                         f"{why(exc)}") from None
    if not (isinstance(item, (tuple, list)) and len(item) == 2):
        raise UsageError(f"--dataset {name!r}: sample {index} of {split!r} is a "
                         f"{type(item).__name__}, not an (input, target) pair")
    return item[0], item[1]


def collate(ds: Any, name: str, split: str, indices: list[int]) -> tuple[Any, Any]:
    """A batch of the user's dataset: its samples stacked as torch's DataLoader would."""
    from torch.utils.data import default_collate

    x, y = default_collate([sample(ds, name, split, i) for i in indices])
    return x, y
