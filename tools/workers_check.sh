#!/usr/bin/env bash
# tools/workers_check.sh - the worker floors with a core per rank (the pipelined worker's
# issue), prepared for a machine of 16 cores or more that may have no MPI library and no
# network (tools/bare_env.sh brings Open MPI or MPICH from PyPI wheels). On 2 cores the master
# and 4 workers time-share the cores, and the master's CPU and the workers' own communication
# come out of the same two cores (docs/PERFORMANCE.md); here every rank has a core, as on a
# cluster. Runs python -m gem_mpi.bench overhead with 1, 4 and 8 GEM workers, pipelined, three
# runs per row between bracketing ceilings, on MNIST; prints its rows and writes JSON.
# Under 8 minutes on 16 cores.
#
#   tools/workers_check.sh [OUT_DIR] [bench overhead options]   # JSON to OUT_DIR/workers_check.json
#   tools/workers_check.sh /tmp/wc --workers 1 --repeat 1 --steps 40   # a dry run, anywhere
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${1:-.}"
shift || true
mkdir -p "$out"
# shellcheck source=tools/bare_env.sh
source tools/bare_env.sh
export PYTHONUNBUFFERED=1
gem_mnist_ready
echo "== workers_check: $(nproc) cores; $(date -u +%FT%TZ)"
# later options override these (argparse keeps the last)
"$GEM_MPI_PY" -m gem_mpi.bench overhead --workers 1 4 8 --methods gem \
  --worker-modes pipelined --repeat 3 --steps 600 --dataset mnist \
  --mpirun "$GEM_MPI_MPIRUN" --json "$out/workers_check.json" "$@" 2>&1 |
  grep -v '^gem_mpi: '
