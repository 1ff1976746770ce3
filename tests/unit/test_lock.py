"""OutputLocks (gem_mpi.outputs.lock): flock on a file beside the output. No MPI."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gem_mpi.errors import UsageError
from gem_mpi.outputs.lock import OutputLocks


def test_a_second_holder_is_refused_naming_the_first_until_it_releases(tmp_path):
    first, second = OutputLocks(), OutputLocks()
    first.take(str(tmp_path / "m.h5"), "--metrics")
    first.describe("abc123")
    with pytest.raises(UsageError, match=r"^--metrics .*m\.h5 is in use by run abc123 on host"):
        second.take(str(tmp_path / "m.h5"), "--metrics")
    first.release()
    second.take(str(tmp_path / "m.h5"), "--metrics")
    second.release()
    assert (tmp_path / "m.h5.lock").exists()  # kept: every run locks the same inode


def test_a_refused_run_removes_the_lock_files_it_made_and_only_those(tmp_path):
    holder = OutputLocks()
    holder.take(str(tmp_path), "--checkpoint-dir", directory=True)
    late = OutputLocks()
    with pytest.raises(UsageError, match="--checkpoint-dir"):
        late.take(str(tmp_path / "new.h5"), "--metrics")  # made by this run: removed again
        late.take(str(tmp_path), "--checkpoint-dir", directory=True)
    assert not (tmp_path / "new.h5.lock").exists()
    assert (tmp_path / ".gem_mpi.lock").exists()
    holder.release()


@pytest.mark.mpi  # another process (the suite's marker for any that a test starts)
def test_a_killed_holder_leaves_no_stale_lock(tmp_path):
    code = ("import os, sys; from gem_mpi.outputs.lock import OutputLocks; "
            "l = OutputLocks(); l.take(sys.argv[1], '--metrics'); print('held', flush=True); "
            "sys.stdin.read()")
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "m.h5")],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "held\n"
        with pytest.raises(UsageError, match="in use by a run on host"):
            OutputLocks().take(str(tmp_path / "m.h5"), "--metrics")
        proc.kill()
        proc.wait(timeout=30)
    finally:
        proc.kill()
    after = OutputLocks()
    after.take(str(tmp_path / "m.h5"), "--metrics")
    after.release()
