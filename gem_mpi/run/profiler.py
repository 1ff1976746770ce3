"""``--profile-steps A:B``: a torch.profiler trace of one rank's steps A to B.

Each loop that steps holds one :class:`StepProfiler`: started before its first step, ticked
at the end of each step (torch.profiler's ``step()``, which opens the trace's
``ProfilerStep#k`` range of step k), closed when the loop ends; ``range`` names a part of a
step (``record_function``). A step is what the loop repeats, counted from 0 where this start
of the run begins: an asynchronous worker's update, a synchronous worker's step, a group
member's step, a master's applied batch. The schedule waits until step A (warming up on the
step before it), records steps A to B and writes the trace as step B ends, or at ``close()``
if the loop ended first: ``rank<r>.pt.trace.json`` (r the MPI rank) in the run's trace
folder (``OutputConfig.trace_dir``), Chrome trace JSON that TensorBoard's profiler plugin and
Perfetto open. Without --profile-steps every call does nothing and torch is not imported.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from types import TracebackType
from typing import Any, Self

from gem_mpi.config import OutputConfig, step_range
from gem_mpi.transport import MPI

_NOTHING = contextlib.nullcontext()  # a range when not profiling (reusable, made once)


def trace_name(rank: int) -> str:
    """The file of rank ``rank``'s trace in the trace folder."""
    return f"rank{rank}.pt.trace.json"


class StepProfiler:
    """torch.profiler over steps A..B of one rank's loop, or nothing (no --profile-steps).

    ``cuda``: the rank computes on a GPU, whose kernels are traced too; ``rank``: what the
    trace is named by (default: the rank's place in MPI's world)."""

    def __init__(self, outputs: OutputConfig, cuda: bool = False, rank: int | None = None
                 ) -> None:
        self._prof: Any = None  # torch's profiler, until close()
        self._live: Any = None  # the same, between start() and close()
        steps = step_range(outputs.profile_steps) if outputs.profile_steps else None
        if steps is None:
            return
        # kineto's own lines (its start and stop on every rank, "ERROR: gpuGetDeviceCount
        # failed" on a machine without a GPU) go to stderr unless told otherwise
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        import torch.profiler as tp  # only when profiling

        first, last = steps
        warmup = min(1, first)  # the step before A, where there is one
        with warnings.catch_warnings():  # A = 0: no step to warm up on, which torch warns of
            warnings.simplefilter("ignore")
            schedule = tp.schedule(wait=first - warmup, warmup=warmup,
                                   active=last - first + 1, repeat=1)
        activities = [tp.ProfilerActivity.CPU] + ([tp.ProfilerActivity.CUDA] if cuda else [])
        directory = outputs.trace_dir
        assert directory is not None, "the preflight refuses --profile-steps without one"
        rank = MPI.COMM_WORLD.Get_rank() if rank is None else rank
        self.path = os.path.join(directory, trace_name(rank))
        self._record = tp.record_function
        try:  # every thread's operators: the compute thread's (--worker-mode overlap), the
            # evaluation's on rank 0; by default only those of the thread that starts it
            every_thread = tp._ExperimentalConfig(profile_all_threads=True)
        except (AttributeError, TypeError):  # a torch without it: that thread alone
            every_thread = None
        self._prof = tp.profile(activities=activities, schedule=schedule,
                                on_trace_ready=self._write, experimental_config=every_thread)

    def _write(self, prof: Any) -> None:
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        prof.export_chrome_trace(self.path)

    def start(self) -> None:
        """The loop starts: its step 0 begins."""
        if self._prof is not None and self._live is None:
            self._live = self._prof
            self._live.start()

    def close(self) -> None:
        """The loop ended: a trace still recording (the loop ended before step B did) is
        written now. Once: what follows records nothing."""
        live, self._prof, self._live = self._live, None, None
        if live is not None:
            live.stop()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def tick(self) -> None:
        """A step ended (the next one begins)."""
        if self._live is not None:
            self._live.step()

    def range(self, name: str) -> contextlib.AbstractContextManager:
        """A named range of the trace around a part of a step (nothing when not profiling)."""
        return self._record(name) if self._live is not None else _NOTHING
