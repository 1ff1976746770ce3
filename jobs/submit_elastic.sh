#!/usr/bin/env bash
# jobs/submit_elastic.sh MIN-MAX [sbatch options] - submit jobs/gem_elastic.sbatch on MIN to
# MAX nodes: sbatch --nodes=MIN-MAX with GEM_NODES=MIN-MAX in the job's environment, which
# each requeued run of the job gives back to Slurm (it would keep the first run's task count).
#
#   jobs/submit_elastic.sh 2-8 --ntasks-per-node=8
#   GEM_DATASET=mnist jobs/submit_elastic.sh 1-16 -p gpu --ntasks-per-node=4 --gpus-per-node=4
set -euo pipefail
range="${1:-}"
if ! [[ $range =~ ^([1-9][0-9]*)-([1-9][0-9]*)$ ]] || ((BASH_REMATCH[1] > BASH_REMATCH[2])); then
  echo "gem_jobs: error: usage: jobs/submit_elastic.sh MIN-MAX [sbatch options], MIN <= MAX," \
    "got '$range'" >&2
  exit 2
fi
shift
GEM_NODES="$range" exec sbatch --nodes="$range" "$@" "$(dirname "${BASH_SOURCE[0]}")/gem_elastic.sbatch"
