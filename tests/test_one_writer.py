"""One writer per output (issue: two runs on one file). A live run holds OS locks on its
metrics file and its checkpoint directory: a second run on either is one line naming the
live run, exit 2 on every rank, and writes nothing; a killed run leaves no stale lock."""

from __future__ import annotations

import os

import pytest
from helpers import (
    PROGS,
    checkpoint_after_start,
    kill_job,
    mpirun,
    quadratic_args,
    train,
    train_background,
    wait_until,
)

from gem_mpi.outputs import checkpoint
from gem_mpi.outputs.runfile import load_run

LONG = quadratic_args(dim=1000, steps=10**7, eval_every=0, checkpoint_every=0.2)


@pytest.mark.mpi
def test_a_second_run_on_a_live_run_s_files_is_refused_and_a_killed_run_frees_them(tmp_path):
    live, other = tmp_path / "live", tmp_path / "other"
    live.mkdir()
    other.mkdir()
    h5, ckpt = live / "run.h5", live / "ckpt"
    ckpt.mkdir()
    a = train_background(3, *LONG, "--metrics", str(h5), "--checkpoint-dir", str(ckpt))
    try:
        wait_until(a, checkpoint_after_start(ckpt))
        # the same metrics file (a fresh run would truncate it), the same checkpoint
        # directory (each run would delete the other's checkpoints), a resume of its own
        for args, flag in ((["--metrics", str(h5)], "--metrics"),
                           (["--metrics", str(other / "b.h5"), "--checkpoint-dir", str(ckpt)],
                            "--checkpoint-dir"),
                           (["--metrics", str(h5), "--checkpoint-dir", str(ckpt),
                             "--resume", "auto"], "--metrics")):
            codes = tmp_path / "codes.txt"
            res = mpirun(3, [str(PROGS / "exit_code.py"), str(codes),
                             *quadratic_args(dim=1000, steps=50, eval_every=0), *args],
                         timeout=120)
            errors = [line for line in res.stderr.splitlines() if "error" in line]
            assert len(errors) == 1, res.stderr
            assert f"{flag} " in errors[0] and "is in use by run " in errors[0]
            assert f"on host {os.uname().nodename}" in errors[0]
            assert sorted(codes.read_text().split("\n")[:-1]) == ["0 2", "1 2", "2 2"]
            codes.unlink()
        assert not list(other.iterdir())  # the refused run wrote nothing, not even a lock
        assert a.poll() is None  # the live run goes on
        kill_job(a)  # a killed run: its locks die with it
    finally:
        if a.poll() is None:
            kill_job(a)
    killed = load_run(h5).attrs["run_id"]
    res = train(3, *quadratic_args(dim=1000, steps=50, eval_every=0), "--metrics", str(h5),
                "--checkpoint-dir", str(ckpt), timeout=120)  # a new run on the freed files
    assert res.returncode == 0, res.stderr
    fresh = load_run(h5).attrs["run_id"]
    assert fresh != killed
    assert (live / "run.h5.lock").read_text().startswith(f"run {fresh}")
    # the new run deleted none of the killed run's checkpoints, and --resume auto continues
    # neither run without being told which
    owners = {checkpoint.run_of(p) for _, p in checkpoint.listed(str(ckpt))}
    assert owners == {killed, fresh}
    res = train(3, *quadratic_args(dim=1000, steps=50, eval_every=0), "--checkpoint-dir",
                str(ckpt), "--resume", "auto", timeout=120)
    errors = [line for line in res.stderr.splitlines() if "error" in line]
    assert res.returncode == 2 and len(errors) == 1, res.stderr
    assert "holds checkpoints of 2 runs" in errors[0] and killed in errors[0], errors
