"""Where the suite's CPU goes, process by process (tools/test.sh with GEM_MPI_TEST_ACCOUNT=FILE
puts this directory on PYTHONPATH; tools/test_account.py sums the file up).

Every Python process the suite starts (pytest, its helpers, each MPI rank) appends one JSON
line at its exit: the test that was running (PYTEST_CURRENT_TEST, which pytest sets for its
own process and its children inherit), the module or script it ran, whether it imported
torch, and its CPU and wall seconds. A process ended by a signal or MPI_Abort writes nothing:
the sums are a floor."""

from __future__ import annotations

import atexit
import json
import os
import resource
import sys
import time

_PATH = os.environ.get("GEM_MPI_TEST_ACCOUNT")
_STARTED = time.time()


def _record() -> None:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    row = {"test": os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0],
           "argv": [os.path.basename(a) for a in sys.argv[:3]], "torch": "torch" in sys.modules,
           "rank": os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK")),
           "cpu_s": round(usage.ru_utime + usage.ru_stime, 3),
           "wall_s": round(time.time() - _STARTED, 3)}
    # one write of one line to a file opened for appending: lines of processes that end
    # together do not interleave
    with open(_PATH, "a", encoding="utf-8") as fh:  # type: ignore[arg-type]
        fh.write(json.dumps(row) + "\n")


if _PATH:
    atexit.register(_record)
