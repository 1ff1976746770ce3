"""Training from Python: ``gem_mpi.fit(make_model, make_dataset, ...)`` under ``mpirun``.

Every rank of the job runs the user's script and calls :func:`fit` with the same arguments,
as every rank of ``python -m gem_mpi.train`` parses the same command line; the run is the
same run (one way to do each thing: the same session, the same checks, the same files).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gem_mpi import config
from gem_mpi.errors import GemError, UsageError
from gem_mpi.problem import build_problem, load_theta
from gem_mpi.problem.user import register


@dataclass
class Result:
    """How a run ended, and on rank 0 what it trained.

    ``theta`` (the final flat float32 parameters) and ``model`` (a fresh model of the user's
    factory with θ loaded) are set on rank 0 only; None on the other ranks and on a failed run.
    """

    outcome: str  # finished, stopped, diverged, output failed, failed
    exit_code: int  # what python -m gem_mpi.train would exit with
    rank: int
    theta: np.ndarray | None = None
    model: Any = None
    summary: dict = field(default_factory=dict)  # rank 0: the metrics file's /summary fields

    @property
    def finished(self) -> bool:
        return self.outcome == "finished"


def _name(value: str | Callable, what: str) -> str:
    return value if isinstance(value, str) else register(value, what)


def options() -> list[str]:
    """The keyword options of :func:`fit`: the command line's, with underscores."""
    return [f.name for sec in config.SECTIONS.values() for f in dataclasses.fields(sec)]


def fit(model: str | Callable[[], Any], dataset: str | Callable[[str], Any], *,
        loss: str | Callable[[Any, Any], Any] | None = None, comm: Any = None,
        **kwargs: Any) -> Result:
    """Train ``model`` (a function returning a fresh ``torch.nn.Module``, or a built-in name
    or ``MODULE:FUNCTION``) on ``dataset`` (``dataset(split)`` for split ``"train"`` and
    ``"test"`` returns a map-style dataset of (input, target) pairs), with every option of
    ``python -m gem_mpi.train`` as a keyword (``method="gem", lr=0.05, metrics="run.h5"``).

    Collective: call it on every rank with the same arguments. A bad input raises
    :class:`gem_mpi.UsageError` on every rank with the line the command line prints (rank 0
    prints it too); a failure during the run ends the whole job, as on the command line.
    """
    # here, not at the top: `import gem_mpi` stays light (no MPI library, h5py or engine
    # loaded) until a run starts
    from gem_mpi import session
    from gem_mpi.run.supervisor import EXIT_CODES, Outcome, say
    from gem_mpi.transport import MASTER, start_mpi

    names = {"model": _name(model, "model"), "dataset": _name(dataset, "dataset")}
    if loss is not None:
        names["loss"] = _name(loss, "loss")
    unknown = sorted(set(kwargs) - set(options()))
    if unknown:
        raise UsageError(f"gem_mpi.fit: no option {unknown[0]!r}; the options are those of "
                         "python -m gem_mpi.train with underscores: " + ", ".join(options()))
    cfg = config.Config.of(**names, **kwargs)
    comm = comm if comm is not None else start_mpi(session.thread_level(cfg))
    rank = comm.Get_rank()
    error, resumed, finished = session.prepare(cfg, comm)
    if error is not None:
        if rank == MASTER:
            say(f"error: {error}")
        raise UsageError(error)
    result: dict = {}
    if finished:  # resumed at a finished run's end: its θ, nothing trained or written
        outcome = Outcome.FINISHED
        if resumed is not None:
            result["theta"] = resumed.theta
    else:
        try:
            outcome = session.run(cfg, comm, resumed, result)
        except BaseException as exc:  # a rank failing alone would hang the others: end it
            session.abort(comm, exc)
            raise
    out = Result(outcome.value, EXIT_CODES[outcome], rank)
    if rank == MASTER and "theta" in result:
        out.theta = result["theta"]
        out.summary = result.get("summary", {})
        if cfg.data.model != config.QUADRATIC:
            out.model = _trained_model(cfg, out.theta)
    return out


def _trained_model(cfg: config.Config, theta: np.ndarray) -> Any:
    """θ in a fresh model, with the BatchNorm statistics the evaluation used (the same
    batches: the model equals the one --save writes)."""
    import torch  # a torch model's run only: the quadratic returns no model

    from gem_mpi.problem.datasets import statistics_batches
    from gem_mpi.problem.models import recompute_batch_norm

    model = build_problem(cfg.data, with_theta0=False).model
    load_theta(model, theta)
    if cfg.monitor.bn_batches:
        recompute_batch_norm(model, statistics_batches(cfg.data, cfg.monitor.bn_batches),
                             torch.device("cpu"))
    return model


__all__ = ["GemError", "Result", "UsageError", "fit", "options"]
