"""``--group-size G``: G ranks of a node train as one GEM worker, synchronously inside,
under real mpirun: a group's Δθ is the Δθ of one worker whose batch is the union of the
members' parts (the synchronous-SGD identity), in every worker order; groups train a CNN; a
stopped group resumes bit for bit; a killed member ends the job and the resume applies every
update once; bad input is one line."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from helpers import (
    REPO,
    kill_job,
    mpirun,
    rank_pids,
    signal_when,
    train,
    wait_until,
)

from gem_mpi.outputs import checkpoint
from gem_mpi.outputs.runfile import load_run

pytestmark = pytest.mark.mpi

USER_CODE = REPO / "tests" / "user_code"
# a model without dropout or BatchNorm: the G parts' mean gradient is the union's gradient
MLP = ("--model", "plugins:mlp", "--dataset", "plugins:blobs", "--loss", "cross_entropy",
       "--threads", "1", "--eval-every", "0")


def _flat(path) -> torch.Tensor:
    return torch.cat([v.flatten() for v in torch.load(path, weights_only=True).values()])


@pytest.mark.parametrize("method, mode", [
    ("gem", "wait"), ("gem", "pipelined"), ("gem", "overlap"), ("downpour", "wait")])
def test_a_group_computes_what_one_worker_computes_on_the_union_batch(tmp_path, method, mode):
    """1 group of 2 ranks, each 8 samples a step, against 1 worker of 16: the same θ after
    15 updates within float32 summation order (the allreduce adds the two halves' means),
    in every worker order. The group is a worker to the master, so what varies is the
    worker's side: GEM's (its proxy m) in each order, DOWNPOUR's (Δθ as it is) once; a
    rule that differs only at the master (adaptive, gap-aware) applies the group's update
    as any worker's."""
    common = [*MLP, "--max-steps", "15", "--worker-mode", mode, "--lr", "0.1", "--method",
              method]
    grouped, single = tmp_path / "group.pt", tmp_path / "single.pt"
    res = mpirun(3, ["-m", "gem_mpi.train", *common, "--group-size", "2", "--batch-size", "8",
                     "--save", str(grouped), "--metrics", str(tmp_path / "g.h5")],
                 cwd=USER_CODE, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "1 master + 1 workers" in res.stderr
    res = mpirun(2, ["-m", "gem_mpi.train", *common, "--batch-size", "16", "--save",
                     str(single)], cwd=USER_CODE, timeout=300)
    assert res.returncode == 0, res.stderr
    a, b = _flat(grouped), _flat(single)
    assert float((a - b).abs().max()) <= 1e-6 * float(b.abs().max())
    assert not torch.equal(a, b * 0)
    run = load_run(tmp_path / "g.h5")
    assert run.n_workers == 1 and run.updates["seq"].tolist() == list(range(15))
    group_s = run.worker_time["group"][0]  # the leader's wait for the average, out of compute
    assert (group_s == 0.0) if mode == "overlap" else (0.0 < group_s < run.worker_time["wall"][0])


def test_two_groups_of_two_learn_fashion_mnist(tmp_path):
    h5 = tmp_path / "run.h5"
    res = train(5, "--group-size", "2", "--max-steps", "60", "--threads", "1",
                "--eval-every", "60", "--metrics", str(h5), timeout=300)
    assert res.returncode == 0, res.stderr
    assert "1 master + 2 workers" in res.stderr
    run = load_run(h5)
    assert run.n_workers == 2 and len(run.updates["seq"]) == 120
    assert sorted(set(run.updates["worker"].tolist())) == [1, 2]
    assert run.summary["test_accuracy"] > 0.5  # 120 steps of 2 × 64 samples


# Steps of the stop-and-resume tests: a run of 1000 trains for seconds here, the signal comes at
# the first checkpoint (0.3 s in), so a machine 4 times faster still stops mid-run.
STEPS = 1000


def test_a_stopped_group_resumes_bit_for_bit(tmp_path):
    common = [*MLP, "--group-size", "2", "--batch-size", "8", "--max-steps", str(STEPS),
              "--epochs", "100"]
    whole = tmp_path / "whole.pt"
    res = mpirun(3, ["-m", "gem_mpi.train", *common, "--save", str(whole)], cwd=USER_CODE,
                 timeout=300)
    assert res.returncode == 0, res.stderr
    ck, part = tmp_path / "ck", tmp_path / "part.pt"
    ck.mkdir()
    args = [*common, "--checkpoint-dir", str(ck), "--checkpoint-every", "0.3", "--save",
            str(part)]
    proc = _background(3, args)
    err = signal_when(proc, lambda: checkpoint.latest(str(ck)) is not None)
    assert proc.returncode == 3, err
    assert 0 < checkpoint.load(checkpoint.latest(str(ck))).clock < STEPS
    res = mpirun(3, ["-m", "gem_mpi.train", *args, "--resume", "auto"], cwd=USER_CODE,
                 timeout=300)
    assert res.returncode == 0, res.stderr
    assert torch.equal(_flat(whole), _flat(part))


def _background(n: int, args: list[str]):
    import subprocess

    from helpers import mpi_env, mpirun_cmd

    return subprocess.Popen(mpirun_cmd(n, ["-m", "gem_mpi.train", *args]), env=mpi_env(),
                            cwd=str(USER_CODE), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def test_a_killed_member_ends_the_job_and_the_resume_applies_every_update_once(tmp_path):
    args = [*MLP, "--group-size", "2", "--batch-size", "8", "--max-steps", str(STEPS),
            "--epochs", "100",
            "--checkpoint-dir", str(tmp_path), "--checkpoint-every", "0.3", "--metrics",
            str(tmp_path / "run.h5")]
    proc = _background(5, args)  # groups: ranks 1-2 and 3-4
    try:
        wait_until(proc, lambda: checkpoint.latest(str(tmp_path)) is not None)
        t0 = time.monotonic()
        os.kill(rank_pids(proc)[4], signal.SIGKILL)  # group 2's member
        proc.communicate(timeout=60)
        assert time.monotonic() - t0 < 60
    finally:
        if proc.poll() is None:
            kill_job(proc)
    assert proc.returncode != 0
    res = mpirun(5, ["-m", "gem_mpi.train", *args, "--resume", "auto"], cwd=USER_CODE,
                 timeout=300)
    assert res.returncode == 0, res.stderr
    u = load_run(tmp_path / "run.h5").updates
    assert u["clock"].tolist() == list(range(2 * STEPS))
    for worker in (1, 2):  # each group's updates, each once
        assert sorted(u["seq"][u["worker"] == worker].tolist()) == list(range(STEPS))


def test_group_bad_input_is_one_line_and_exit_2():
    """One job for the path from rank 0's preflight (the user's code built) to every rank's
    exit 2; the cases themselves are tests/unit/test_refusals.py's, in-process."""
    says = "--batch-size 400 × --group-size 2 exceeds the 600 training samples"
    extra = ("--group-size", "2", "--model", "plugins:mlp", "--dataset", "plugins:blobs",
             "--loss", "cross_entropy", "--batch-size", "400")
    res = mpirun(3, ["-m", "gem_mpi.train", *extra], cwd=USER_CODE, timeout=120)
    assert res.returncode == 2, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("gem_mpi:")]
    assert len(lines) == 1 and says in lines[0] and "Traceback" not in res.stderr, res.stderr


def test_the_group_check_refuses_a_group_across_nodes():
    """MPICH's cliques make two "nodes" of one machine (tests/stacks.py): ranks 0-1 and 2-3
    (one clique each); a group of ranks 1-2 would span both."""
    import subprocess

    from stacks import stack_command

    cmd, env = stack_command("mpich-cliques", 4, ["-m", "gem_mpi.train", "--group-size",
                                                  "3", "--masters", "1", "--max-steps", "2"])
    res = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=120,
                         check=False)
    assert res.returncode == 2, res.stderr
    assert "spans nodes" in res.stderr and res.stderr.count("gem_mpi: error:") == 1


def test_bench_groups_measures_groups_against_independent_workers(tmp_path):
    """Each row a real job with the same samples; a group of 2 moves half the bytes through
    the master per sample (one update of 2 × b where the workers send two of b)."""
    import json
    import subprocess
    import sys

    from helpers import mpi_env

    out = tmp_path / "groups.json"
    res = subprocess.run(
        [sys.executable, "-m", "gem_mpi.bench", "groups", "--workers", "2", "--group-size",
         "2", "--max-steps", "10", "--dataset", "synthetic", "--json", str(out)],
        capture_output=True, text=True, timeout=300, check=False, env=mpi_env(), cwd=REPO)
    assert res.returncode == 0, res.stderr
    workers, groups = json.loads(out.read_text())["rows"]
    assert (workers["workers_seen"], groups["workers_seen"]) == (2, 1)
    assert (workers["updates"], groups["updates"]) == (20, 10)
    assert workers["samples"] == groups["samples"] == 20 * 32
    assert groups["bytes_per_sample_vs_workers"] == 0.5
    assert "B/sample" in res.stdout


def test_a_hung_member_ends_the_job_with_a_checkpoint(tmp_path):
    """Group 2's member (rank 4) hangs after 20 steps: its leader waits in the allreduce, the
    master hears nothing from worker 2 for --worker-timeout, names it, checkpoints and ends
    the job with one line, as for a hung worker."""
    from helpers import PROGS

    t0 = time.monotonic()
    res = mpirun(5, [str(PROGS / "stuck_member.py"), "4", "20", *MLP, "--group-size", "2",
                     "--batch-size", "8", "--max-steps", "3000", "--epochs", "100",
                     "--worker-timeout", "4", "--checkpoint-dir", str(tmp_path)],
                 cwd=USER_CODE, timeout=180)
    assert res.returncode != 0 and time.monotonic() - t0 < 120
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("gem_mpi: error")]
    assert len(lines) == 1, res.stderr
    assert "worker 2 (ranks 3-4, leader 3) has sent nothing for" in lines[0]
    state = checkpoint.load(checkpoint.latest(str(tmp_path)))
    assert state.next_seq[1] in (20, 21)  # group 2's updates up to its member's hang
