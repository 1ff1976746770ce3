#!/usr/bin/env bash
# tools/demo.sh - install/check everything (tools/install.sh), then train with GEM on
# ${GEM_MPI_DEMO_RANKS:-5} MPI ranks on this machine (1 master + 4 workers): the paper's net
# on Fashion-MNIST, one epoch per worker, evaluated every 250 updates. Without arguments the
# metrics go to runs/demo.h5, live TensorBoard scalars to runs/demo_tb/, the model to
# runs/demo_model.pt, and tools/report.py then draws the figures into runs/demo_report/;
# arguments go to gem_mpi.train instead (and no report is drawn):
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
if (($# > 0)); then
  exec mpirun "${mpirun_args[@]}" "$GEM_MPI_PY" -m gem_mpi.train "$@"
fi
mkdir -p runs
rm -rf runs/demo_tb  # a new run's curves, not appended to the last demo's
mpirun "${mpirun_args[@]}" "$GEM_MPI_PY" -m gem_mpi.train --metrics runs/demo.h5 \
  --save runs/demo_model.pt --eval-every 250 --tensorboard runs/demo_tb
"$GEM_MPI_PY" tools/report.py runs/demo.h5 -o runs/demo_report
echo "demo.sh: figures (test accuracy over time: eval.png) and summary.md in runs/demo_report/;"
echo "demo.sh: live scalars: tensorboard --logdir runs/demo_tb; metrics: runs/demo.h5"
