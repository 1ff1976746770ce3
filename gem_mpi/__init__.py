"""gem_mpi: asynchronous distributed training with Gradient Energy Matching over MPI RMA."""

__version__ = "0.1.0"
