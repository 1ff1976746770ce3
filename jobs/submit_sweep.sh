#!/usr/bin/env bash
# jobs/submit_sweep.sh - submit the stability sweep and its analysis in one go: the array
# jobs/sweep_stability.sbatch sized to the grid (--array=0-(|methods|·|workers|-1),
# --ntasks = largest worker count + 1), then jobs/analyze_sweep.sbatch with
# --dependency=afterok on the array, so the report is made once every run has succeeded.
#
#   jobs/submit_sweep.sh                                    # the default grid (12 runs)
#   GEM_SWEEP_METHODS="gem downpour" GEM_SWEEP_WORKERS="5 10 20 30" jobs/submit_sweep.sh
#   jobs/submit_sweep.sh --partition=cpu --account=proj    # sbatch options for both jobs
#
# Reads GEM_SWEEP_METHODS, GEM_SWEEP_WORKERS, GEM_OUT_DIR (default: runs/ here) and passes
# the environment on to the jobs (GEM_TRAIN_ARGS, GEM_DATASET, ... see the .sbatch headers).
# Prints the two job ids and the sweep directory; the last line is for scripts:
#   sweep_job=<id> analysis_job=<id> sweep_dir=<dir>
set -euo pipefail
GEM_JOBS_DIR="$(dirname "${BASH_SOURCE[0]}")"
# shellcheck source=jobs/lib/common.sh
source "$GEM_JOBS_DIR/lib/common.sh"

gem_sweep_grid
n_runs=$((${#GEM_METHODS[@]} * ${#GEM_WORKER_COUNTS[@]}))
max=0
for w in "${GEM_WORKER_COUNTS[@]}"; do ((w > max)) && max=$w; done
export GEM_OUT_DIR="${GEM_OUT_DIR:-$PWD/runs}"
mkdir -p "$GEM_OUT_DIR"
GEM_OUT_DIR="$(cd "$GEM_OUT_DIR" && pwd)"
# GEM_SWEEP_DIR is left to the array (named after its job id) unless set here
sweep_job="$(sbatch --parsable --array="0-$((n_runs - 1))" --ntasks="$((max + 1))" "$@" \
  "$GEM_JOBS_DIR/sweep_stability.sbatch")"
sweep_job="${sweep_job%%;*}"
if [[ -z ${GEM_SWEEP_DIR:-} ]]; then
  name="$(scontrol show job -o "$sweep_job" | sed -n 's/.* JobName=\([^ ]*\).*/\1/p' | head -n1)"
  GEM_SWEEP_DIR="$GEM_OUT_DIR/${name:-gem_sweep}_$sweep_job"
fi
echo "submit_sweep.sh: sweep: array job $sweep_job, $n_runs runs" \
  "(${GEM_METHODS[*]}) × (${GEM_WORKER_COUNTS[*]} workers), $((max + 1)) tasks each," \
  "into $GEM_SWEEP_DIR" >&2
analysis_job="$(GEM_SWEEP_DIR="$GEM_SWEEP_DIR" GEM_SWEEP_EXPECT="$n_runs" \
  sbatch --parsable --dependency="afterok:$sweep_job" --kill-on-invalid-dep=yes "$@" \
  "$GEM_JOBS_DIR/analyze_sweep.sbatch")"
analysis_job="${analysis_job%%;*}"
echo "submit_sweep.sh: analysis: job $analysis_job (afterok:$sweep_job) into" \
  "$GEM_SWEEP_DIR/analysis" >&2
echo "sweep_job=$sweep_job analysis_job=$analysis_job sweep_dir=$GEM_SWEEP_DIR"
