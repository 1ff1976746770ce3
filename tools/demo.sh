#!/usr/bin/env bash
# tools/demo.sh - install/check everything (tools/install.sh), then train with GEM on
# ${GEM_MPI_DEMO_RANKS:-5} MPI ranks on this machine (1 master + 4 workers): the paper's net
# on Fashion-MNIST, one epoch per worker. Metrics go to runs/demo.h5 and the model to
# runs/demo_model.pt unless arguments are given; arguments go to gem_mpi.train:
#   tools/demo.sh --help
set -euo pipefail

# shellcheck source=tools/install.sh
source "$(dirname "${BASH_SOURCE[0]}")/install.sh"

mpirun_args=(--oversubscribe -n "${GEM_MPI_DEMO_RANKS:-5}")
# One machine: MPI moves data through shared memory only, so no rank opens a TCP port
# (Open MPI's tcp transport would listen on every interface).
export OMPI_MCA_btl="${OMPI_MCA_btl:-self,vader}"
if [[ "$(id -u)" == 0 ]]; then
  # Open MPI refuses to run as root unless told it is intended (containers, CI).
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi

cd "$(dirname "${BASH_SOURCE[0]}")/.."
if (($# == 0)); then
  mkdir -p runs
  set -- --metrics runs/demo.h5 --save runs/demo_model.pt
fi
exec mpirun "${mpirun_args[@]}" "$GEM_MPI_PY" -m gem_mpi.train "$@"
