#!/usr/bin/env bash
# tools/scale.sh - the 101-rank scale check on one small machine (1 master + 100 workers).
#
# A rank of the CUDA build of torch 2.14.1 keeps ~280 MB of private memory after
# `import torch` (CUDA libraries' static data, even with no GPU), so 101 ranks need ~30 GB.
# This script therefore uses a second, CPU-only environment: torch 2.13.0+cpu (~145 MB per
# rank), without torchvision, at ${GEM_MPI_SCALE_VENV:-~/.cache/gem_mpi/venv-cpu}. The
# trade-off: that environment runs only what needs no torchvision and no GPU (the paper's
# net on Fashion-MNIST or synthetic data, the quadratic), on another torch version than the
# main environment. On a machine with ~40 GB, the main environment does it too:
#   GEM_MPI_SCALE_VENV=~/.cache/gem_mpi/venv GEM_MPI_TORCH=2.14.1 GEM_MPI_TORCHVISION=0.29.1 tools/scale.sh
#
# Prints the job's own summary and the peak memory (tools/memwatch.py). Arguments go to
# gem_mpi.train after the defaults below; GEM_MPI_SCALE_RANKS sets the number of ranks.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

export GEM_MPI_VENV="${GEM_MPI_SCALE_VENV:-$HOME/.cache/gem_mpi/venv-cpu}"
export GEM_MPI_TORCH="${GEM_MPI_TORCH:-2.13.0}" GEM_MPI_TORCHVISION="${GEM_MPI_TORCHVISION:-none}"
export GEM_MPI_HOROVOD="${GEM_MPI_HOROVOD:-0}"  # the scale check runs GEM only
# shellcheck source=tools/install.sh
source tools/install.sh

# One machine: MPI moves data through shared memory only, so no rank opens a TCP port
# (Open MPI's tcp transport would listen on every interface).
export OMPI_MCA_btl="${OMPI_MCA_btl:-self,vader}"
if [[ "$(id -u)" == 0 ]]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
mkdir -p runs
ranks="${GEM_MPI_SCALE_RANKS:-101}"
exec "$GEM_MPI_PY" tools/memwatch.py --json "runs/scale_${ranks}.json" -- \
  mpirun --oversubscribe -n "$ranks" -x MALLOC_TRIM_THRESHOLD_=0 \
  "$GEM_MPI_PY" -m gem_mpi.train --dataset synthetic --max-steps 20 --eval-every 0 \
  --poll-max-ms 20 --metrics "runs/scale_${ranks}.h5" "$@"
