#!/usr/bin/env bash
# tools/test.sh - install/check everything (tools/install.sh), then run the test suite
# (tests/) with the venv's python from the repo root. Arguments go to pytest, e.g.
#   tools/test.sh tests/test_kernel.py -k gem_apply
# Exits with pytest's code; "no tests collected" (5) counts as a failure, and so does a
# skipped test: this script installs everything the suites need, so a skip means a feature
# went untested (GEM_MPI_NO_SKIPS=1; the few expected skips are listed in tests/conftest.py
# ALLOWED_SKIPS and printed at the end; GEM_MPI_NO_SKIPS=0 tools/test.sh ... allows all).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=tools/install.sh
source tools/install.sh

if [[ "$(id -u)" == 0 ]]; then
  # mpirun refuses to run as root without these (CI and containers run as root).
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi

export GEM_MPI_NO_SKIPS="${GEM_MPI_NO_SKIPS:-1}"

# The package's layers (pyproject.toml's import-linter contract: no module imports one above
# its own, function-level imports included) and ruff's rules, before any test: both take
# a second or two.
"$(dirname "$GEM_MPI_PY")/lint-imports" --no-cache >/dev/null || {
  "$(dirname "$GEM_MPI_PY")/lint-imports" --no-cache | tail -n 40 >&2
  echo "test.sh: an import breaks the package's layers (pyproject.toml [tool.importlinter])" >&2
  exit 1
}
"$(dirname "$GEM_MPI_PY")/ruff" check --quiet gem_mpi tests tools examples || {
  echo "test.sh: ruff check failed" >&2
  exit 1
}
# The typed core (pyproject.toml [tool.mypy] files): its declared protocols and records checked
"$(dirname "$GEM_MPI_PY")/mypy" >/dev/null || {
  "$(dirname "$GEM_MPI_PY")/mypy" | tail -n 40 >&2
  echo "test.sh: mypy found type errors (pyproject.toml [tool.mypy])" >&2
  exit 1
}

# Every rank of every job imports the package: compiled once here, not once per process
# (compileall writes the bytecode even where PYTHONDONTWRITEBYTECODE keeps python from it).
"$GEM_MPI_PY" -m compileall -q gem_mpi tests tools examples >/dev/null

# With no file arguments pytest runs the testpaths of pyproject.toml (tests/); with some
# (tools/test.sh tests/test_kernel.py) it runs just those. The test files run on
# GEM_MPI_TEST_PROCS pytest processes (pytest-xdist, default 2; 0: this one only), a file
# on one process from start to end (its module fixtures and shared daemons stay one), the
# slowest files first (tests/conftest.py).
# GEM_MPI_TEST_ACCOUNT=FILE: every Python process the suite starts appends its CPU seconds
# there (tests/accounting/sitecustomize.py), summed up at the end (tools/test_account.py)
if [[ -n "${GEM_MPI_TEST_ACCOUNT:-}" ]]; then
  export PYTHONPATH="$PWD/tests/accounting${PYTHONPATH:+:$PYTHONPATH}"
fi
rc=0
procs="${GEM_MPI_TEST_PROCS:-2}"
xdist=(-n "$procs")
# (--no-loadscope-reorder: xdist would start the files with the most tests first)
((procs == 0)) || xdist+=(--dist loadfile --no-loadscope-reorder)
# --durations=20: the 20 slowest tests, printed at the end (what a new test costs, seen)
"$GEM_MPI_PY" -m pytest -q "${xdist[@]}" --durations=20 "$@" || rc=$?
if [[ -n "${GEM_MPI_TEST_ACCOUNT:-}" && -s "$GEM_MPI_TEST_ACCOUNT" ]]; then
  "$GEM_MPI_PY" tools/test_account.py "$GEM_MPI_TEST_ACCOUNT" --top 25 | head -n 80
fi
if ((rc == 5)); then
  echo "test.sh: pytest collected no tests: failing" >&2
fi
exit "$rc"
