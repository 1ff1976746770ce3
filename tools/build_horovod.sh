#!/usr/bin/env bash
# tools/build_horovod.sh - build Horovod 0.28.1 (PyPI's sdist) into a python env, against the
# same Open MPI as mpi4py, for `--method sync`. Called by tools/install.sh; idempotent: it does
# nothing when an installed Horovod already imports with PyTorch and MPI support.
#
#   bash tools/build_horovod.sh PYTHON
#
# Why patch: 0.28.1 (the newest release) hard-codes C++14 in two CMakeLists, while PyTorch 2.1+
# headers need C++17 and 2.14's need C++20 (horovod/horovod#3996, fixed upstream, unreleased);
# CXXFLAGS or -DCMAKE_CXX_STANDARD do not override a `set()` in the file. And its FindPytorch
# asks torch whether it is a CUDA build with a CUDA_HOME: a CUDA torch on a machine without a
# matching CUDA toolchain then tries to compile CUDA code and fails. Unless GPU operations are
# asked for, we tell it torch has no CUDA, so only CPU (MPI) operations are built.
#
# Environment:
#   HOROVOD_GPU_OPERATIONS=NCCL   build NCCL operations (GPU clusters: needs nvcc and NCCL;
#                                 see HOROVOD_NCCL_HOME / HOROVOD_CUDA_HOME in Horovod's docs)
#   GEM_MPI_HOROVOD_CACHE         where the sdist and the built wheel are kept
#                                 (default ~/.cache/gem_mpi/horovod)
set -euo pipefail

py="${1:?usage: build_horovod.sh PYTHON}"
version="0.28.1"
cache="${GEM_MPI_HOROVOD_CACHE:-$HOME/.cache/gem_mpi/horovod}"
say() { printf 'build_horovod.sh: %s\n' "$*" >&2; }

# what "already done" means: Horovod imports, with the torch ops and MPI built in
check='
import horovod.torch as hvd
assert hvd.mpi_built(), "no MPI"
'
if [[ -n "${HOROVOD_GPU_OPERATIONS:-}" ]]; then
  check+='assert hvd.nccl_built(), "no NCCL"
'
fi
if "$py" -c "$check" >/dev/null 2>&1; then
  exit 0
fi

# its runtime dependencies (numpy: broadcast_optimizer_state needs it, nothing pulls it in)
"$py" -m pip install -q cloudpickle psutil pyyaml packaging numpy

flavour="cpu"
[[ -n "${HOROVOD_GPU_OPERATIONS:-}" ]] && flavour="gpu-${HOROVOD_GPU_OPERATIONS,,}"
torch_ver="$("$py" -c 'import torch; print(torch.__version__.split("+")[0])')"
wheel_dir="$cache/wheels/torch-$torch_ver-$flavour"

# a wheel built before against this torch is reused (the 3-minute build happens once)
shopt -s nullglob
wheels=("$wheel_dir"/horovod-"$version"-*.whl)
if ((${#wheels[@]})); then
  say "installing the Horovod $version wheel built before (${wheels[0]})"
  "$py" -m pip install -q --force-reinstall --no-deps "${wheels[0]}"
  if "$py" -c "$check" >/dev/null 2>&1; then exit 0; fi
  say "that wheel does not import here: rebuilding"
  rm -f "${wheels[@]}"
fi

say "building Horovod $version ($flavour operations, MPI, PyTorch $torch_ver): a few minutes"
mkdir -p "$cache" "$wheel_dir"
work="$(mktemp -d "$cache/build.XXXXXX")"
trap 'rm -rf "$work"' EXIT
"$py" -m pip download -q --no-deps --no-binary :all: "horovod==$version" -d "$work"
tar -xzf "$work/horovod-$version.tar.gz" -C "$work"
src="$work/horovod-$version"

# the two hard-coded standards; fail loudly if the text moved (another version)
for f in "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"; do
  grep -q 'set(CMAKE_CXX_STANDARD 14)' "$f" || { say "no C++14 line in $f: not $version?"; exit 1; }
  sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 20)/' "$f"
done
if [[ -z "${HOROVOD_GPU_OPERATIONS:-}" ]]; then
  findpt="$src/cmake/Modules/FindPytorch.cmake"
  grep -q 'string(TOUPPER "${Pytorch_CUDA}" Pytorch_CUDA)' "$findpt" || {
    say "FindPytorch.cmake is not the one expected"
    exit 1
  }
  sed -i 's/string(TOUPPER "${Pytorch_CUDA}" Pytorch_CUDA)/set(Pytorch_CUDA FALSE)/' "$findpt"
fi

export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_MPI=1 HOROVOD_WITHOUT_GLOO=1
export HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1
export MAKEFLAGS="-j$(nproc)"
log="$cache/build-$torch_ver-$flavour.log"
if ! "$py" -m pip wheel -v --no-build-isolation --no-deps "$src" -w "$wheel_dir" >"$log" 2>&1; then
  say "the Horovod build failed; its log: $log"
  tail -n 30 "$log" >&2
  exit 1
fi
wheels=("$wheel_dir"/horovod-"$version"-*.whl)
"$py" -m pip install -q --force-reinstall --no-deps "${wheels[0]}"
if ! "$py" -c "$check"; then
  say "Horovod built but does not import with PyTorch and MPI; build log: $log"
  exit 1
fi
say "Horovod $version installed"
