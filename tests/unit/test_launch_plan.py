"""gem_mpi.launch's plan, without a job: what it refuses, what it adds (its restarts run as real
jobs in tests/test_launch.py)."""

from __future__ import annotations

import numpy as np
import pytest

from gem_mpi.errors import UsageError
from gem_mpi.launch import FINAL, lost_rank, plan
from gem_mpi.outputs import checkpoint
from gem_mpi.outputs.checkpoint import Checkpoint


def test_it_adds_resume_auto_and_keeps_one_worker_at_least(tmp_path):
    ck = str(tmp_path)
    args, train, fewest = plan(["-n", "5", "--", "--checkpoint-dir", ck, "--masters", "2"])
    assert args.n == 5 and args.max_restarts == 3
    assert train[:4] == ["--checkpoint-dir", ck, "--masters", "2"]
    assert train[4] == "--run-id" and len(train[5]) == 32  # every restart continues this run
    assert train[6:] == ["--resume", "auto"]
    assert fewest == 3  # two masters and a worker


def test_a_named_run_or_a_resumed_file_keeps_its_id(tmp_path):
    ck = str(tmp_path)
    _, train, _ = plan(["-n", "3", "--", "--checkpoint-dir", ck, "--run-id", "mine"])
    assert train.count("--run-id") == 1
    state = Checkpoint(theta=np.zeros(3, np.float32), clock=4, run_id="earlier", elapsed_s=0.0,
                       config={}, n_workers=2)
    path = checkpoint.save(ck, state)
    _, train, _ = plan(["-n", "3", "--", "--checkpoint-dir", ck, "--resume", path])
    assert train[-2:] == ["--run-id", "earlier"]
    _, train, _ = plan(["-n", "3", "--", "--checkpoint-dir", ck])  # a new run beside it
    assert train[-4] == "--run-id" and train[-3] != "earlier"


def test_a_given_resume_is_kept_and_a_synchronous_method_keeps_its_ranks(tmp_path):
    _, train, fewest = plan(["-n", "4", "--", "--method", "ddp", "--checkpoint-dir",
                             str(tmp_path), "--resume", "auto"])
    assert train.count("--resume") == 1 and fewest == 4


@pytest.mark.parametrize("argv, says", [
    (["-n", "5", "--", "--lr", "0.1"], "give --checkpoint-dir"),
    (["-n", "1", "--", "--checkpoint-dir", "ck"], "at least 2 ranks"),
    (["-n", "5", "--max-restarts", "-1", "--", "--checkpoint-dir", "ck"], "must be >= 0"),
    (["-n", "5", "--", "--checkpoint-dir", "ck", "--lr", "-1"], "--lr"),
])
def test_what_cannot_work_is_refused(argv, says, tmp_path):
    argv = [str(tmp_path) if a == "ck" else a for a in argv]
    with pytest.raises(UsageError, match=says):
        plan(argv)


def test_only_a_lost_rank_restarts():
    # finished, refused, stopped, diverged, an output that cannot be written end the launcher
    assert set(FINAL) == {0, 2, 3, 4, 5}
    assert lost_rank(137) and lost_rank(143) and lost_rank(6)  # killed, or stuck
    assert not lost_rank(1) and not lost_rank(5)


def test_a_group_is_dropped_whole_and_a_synchronous_job_keeps_its_ranks(tmp_path):
    args, train, fewest = plan(["-n", "7", "--", "--checkpoint-dir", str(tmp_path),
                                "--group-size", "2", "--model", "mnist-cnn"])
    assert (args.drop, fewest) == (2, 3) and train[-2:] == ["--resume", "auto"]
    args, _, fewest = plan(["-n", "4", "--", "--checkpoint-dir", str(tmp_path), "--method",
                            "ddp"])
    assert (args.drop, fewest) == (0, 4)
