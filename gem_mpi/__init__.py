"""gem_mpi: asynchronous distributed training with Gradient Energy Matching over MPI RMA.

From Python, under ``mpirun -n N python my_script.py``: ``gem_mpi.fit(make_model,
make_dataset, lr=0.05, ...)`` (see docs/YOUR_MODEL.md); from the command line:
``mpirun -n N python -m gem_mpi.train --model MODULE:FUNCTION ...``.
"""

from gem_mpi.api import Result, fit, options
from gem_mpi.errors import GemError, UsageError
from gem_mpi.version import __version__

__all__ = ["GemError", "Result", "UsageError", "__version__", "fit", "options"]
