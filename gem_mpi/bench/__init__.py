"""``python -m gem_mpi.bench``: speed measured side by side in one run, printed as ratios.

    python -m gem_mpi.bench kernel                 # fused kernel vs numpy, torch, memcpy, triad
    mpirun -n 5 python -m gem_mpi.bench master     # master updates/s vs its bandwidth bound
    mpirun -n 2 python -m gem_mpi.bench transport  # RMA Get/Put vs memcpy
    python -m gem_mpi.bench compare                # GEM vs DOWNPOUR vs sync (Horovod), with
                                                   # a straggler; launches mpirun itself
    python -m gem_mpi.bench overhead               # end-to-end updates/s vs the compute
                                                   # ceiling, and where the time goes
    python -m gem_mpi.bench gpu                    # the GPU check (tools/gpu_check.sh): the
                                                   # workers' split on one CUDA device
    python -m gem_mpi.bench groups                 # worker groups vs independent workers
    python -m gem_mpi.bench overlap --params N --step-ms MS --workers W
                                                   # steps/s of a worker whose compute
                                                   # releases the GIL vs the compute alone

Every figure is a median over repeated calls; every ratio compares numbers taken in the same
process minutes apart, never numbers from another run. ``--json PATH`` writes them all.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable

# What each bench module's ``register(sub)`` adds its subcommand to; the subparser it returns
# carries ``run`` (the parsed options -> the result, None off rank 0) and ``show`` (prints it)
Subcommands = argparse._SubParsersAction


class OptionError(Exception):
    """An option a bench refuses once parsed: reported as argparse reports its own (exit 2)."""


def _time(fn: Callable[[], object], min_seconds: float = 0.3, min_calls: int = 5) -> float:
    """Median seconds per call, after one warm-up call."""
    fn()
    samples: list[float] = []
    start = time.perf_counter()
    while len(samples) < min_calls or time.perf_counter() - start < min_seconds:
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
        if len(samples) > 10_000:
            break
    return statistics.median(samples)


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}"


def mpi_env() -> dict[str, str]:
    """The environment for an mpirun launched from here: Open MPI refuses root without these."""
    env = dict(os.environ)
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    return env
