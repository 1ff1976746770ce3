#!/usr/bin/env bash
# tools/gpu_check.sh - the GPU check, for a machine with one CUDA GPU, python3 with torch and
# a C++ compiler, maybe no MPI library and no network (tools/bare_env.sh prepares it: Open MPI
# or MPICH and mpi4py from PyPI wheels, from .whl/ when that folder is there, and the C++
# extension). Then 1 master + 3 workers sharing cuda:0 train ResNet-18 on generated 224x224
# images, each worker mode in float32 and in bf16 (--amp) for about 40 s each (python -m
# gem_mpi.bench gpu), printing bf16's steps/s against float32's, each worker's split and the
# GPU's share, checking that the loss falls and θ stays finite.
# Under 8 minutes; exits non-zero when a check fails.
#
#   tools/gpu_check.sh [OUT_DIR] [bench gpu options...]   # JSON to OUT_DIR/gpu_check.json
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${1:-.}"
shift || true
mkdir -p "$out"
# shellcheck source=tools/bare_env.sh
source tools/bare_env.sh
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
"$GEM_MPI_PY" -m gem_mpi.bench gpu --mpirun "$GEM_MPI_MPIRUN" --json "$out/gpu_check.json" "$@"
