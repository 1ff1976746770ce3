#!/usr/bin/env bash
# tools/gpu_check.sh - the GPU check, for a machine with one CUDA GPU, python3 with torch and
# a C++ compiler, maybe no MPI library and no network (tools/bare_env.sh prepares it: Open MPI
# or MPICH and mpi4py from PyPI wheels, from .whl/ when that folder is there, and the C++
# extension). Then python -m gem_mpi.bench gpu: the plain loop (one process, momentum SGD, no
# MPI) trains ResNet-18 on generated 224x224 images on the GPU in float32 and in bf16, then
# 1 master + 3 workers sharing cuda:0 train it, about 30 s per row (--seconds): each worker
# order (wait, pipelined, overlap) in float32, the overlap order with bf16 autocast (--best),
# and that again with the workers as CUDA MPS clients where MPS's daemon starts (--mps auto;
# its folders are under a temp dir of this script's, and the exit trap stops it, whatever
# happens to the bench). It prints each worker's split and GPU-busy share against the floor
# of 0.85, the images/s on the GPU against the plain loop's (the scaling efficiency), bf16's
# steps/s against float32's, and checks that the loss falls and θ stays finite.
# Expected duration with the defaults: about 6-7 minutes on a fresh machine (bare_env.sh
# about 1 min; the plain loop about 30 s; calibration about 25 s; 5 rows of about 50 s each:
# 30 s of training plus the job's start and end), under 8; --mps-rows all adds 3 rows
# (about 2.5 min: give it --seconds 20). Then python -m gem_mpi.bench groups: a worker group
# of 2 ranks against 2 workers (about 40 s more), and python -m gem_mpi.bench lm: the language
# model under GEM-AdamW, DN and DDP-AdamW (not yet timed on a GPU). Exits non-zero when a check
# fails.
#
#   tools/gpu_check.sh [OUT_DIR] [bench gpu options...]   # JSON to OUT_DIR/gpu_check.json
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${1:-.}"
shift || true
mkdir -p "$out"
mps_dir="$(mktemp -d "${TMPDIR:-/tmp}/gem_mps.XXXXXX")"
export CUDA_MPS_PIPE_DIRECTORY="$mps_dir/pipe" CUDA_MPS_LOG_DIRECTORY="$mps_dir/log"
_stop_mps() {  # a daemon the bench started and could not stop itself never outlives us
  if command -v nvidia-cuda-mps-control >/dev/null 2>&1; then
    echo quit | timeout 10 nvidia-cuda-mps-control >/dev/null 2>&1 || true
  fi
  rm -rf "$mps_dir"
}
trap _stop_mps EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
# shellcheck source=tools/bare_env.sh
source tools/bare_env.sh
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
"$GEM_MPI_PY" -m gem_mpi.bench gpu --mpirun "$GEM_MPI_MPIRUN" --json "$out/gpu_check.json" "$@"
# a worker group (--group-size 2) on the GPU against 2 independent workers: NCCL where the
# machine has a GPU per rank, gloo on CUDA tensors where both share one (about 40 s)
"$GEM_MPI_PY" -m gem_mpi.bench groups --workers 2 --group-size 2 --dataset synthetic \
  --max-steps 100 --mpirun "$GEM_MPI_MPIRUN" --json "$out/groups_check.json"
# the language model (gpt on the standard library's bytes) under GEM-AdamW, Gap-Aware-AdamW,
# delayed Nesterov with AdamW local steps (and --dylu) and DDP-AdamW, 3 workers sharing cuda:0
# at equal samples: tokens/s, GPU-busy share, bits per byte (not yet timed on a GPU; about
# 2.5 minutes on 2 CPU cores at --context 64, 200 steps)
"$GEM_MPI_PY" -m gem_mpi.bench lm --mpirun "$GEM_MPI_MPIRUN" --json "$out/lm_check.json"
