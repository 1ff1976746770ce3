"""python -m gem_mpi.chaos, short: real runs broken at random (workers and the master
killed, SIGUSR1, a hung worker, a full disk), resumed until they finish, every invariant
checked. docs/RELIABILITY.md reports a long one."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from helpers import REPO, mpi_env


@pytest.mark.mpi
def test_a_short_chaos_run_loses_and_duplicates_nothing(tmp_path):
    res = subprocess.run([sys.executable, "-m", "gem_mpi.chaos", "--minutes", "0.4", "--seed",
                          "1", "--keep", str(tmp_path)], capture_output=True, text=True,
                         env=mpi_env(), cwd=REPO, timeout=600, check=False)
    assert res.returncode == 0, res.stdout + res.stderr
    line = res.stdout.splitlines()[0]
    faults = int(re.search(r"(\d+) faults that ended a start", line).group(1))
    assert faults >= 3 and "updates lost 0, duplicated 0" in line, line
