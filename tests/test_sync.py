"""``--method sync``: synchronous momentum SGD on Horovod (GEM's proxy), under real mpirun;
some tests run ``--method ddp`` beside it (tests/test_ddp.py holds its own)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from helpers import (
    PROGS,
    REPO,
    mpi_env,
    mpirun,
    quadratic_args,
    signal_when,
    single_process,
    steps_written,
    theta0_state,
    train,
    train_background,
)

from gem_mpi.outputs import checkpoint
from gem_mpi.outputs.runfile import load_run

pytestmark = pytest.mark.mpi  # every test here launches mpirun or another process

hvd = pytest.importorskip("horovod.torch", reason="tools/install.sh builds Horovod")


def test_every_rank_holds_the_same_parameters_after_every_step():
    res = mpirun(3, [str(PROGS / "sync_consistency.py"), "8", "--threads", "1"], timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SYNC-OK 8 steps" in res.stdout


@pytest.mark.parametrize("options, optimizer", [
    (("--lr", "0.05", "--momentum", "0.9"),
     lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9)),
    (("--optimizer", "adamw", "--lr", "0.002", "--betas", "0.9,0.99", "--adam-eps", "1e-7",
      "--weight-decay", "0.05"),
     lambda params: torch.optim.AdamW(params, lr=0.002, betas=(0.9, 0.99), eps=1e-7,
                                      weight_decay=0.05)),
], ids=["sgd", "adamw"])
def test_one_worker_equals_the_single_process_optimizer(tmp_path, options, optimizer):
    """25 steps of one rank equal torch.optim's own over the same batches bit for bit (one
    rank's average is its gradient; measured 0 apart for both): AdamW's state is not made by
    Horovod's broadcast, whose step on zero gradients would count a step and decay θ (0.04
    apart then)."""
    args = ["--method", "sync", "--max-steps", "25", "--threads", "1", "--eval-every", "0",
            *options]
    saved = tmp_path / "model.pt"
    res = train(1, *args, "--save", str(saved), timeout=300)
    assert res.returncode == 0, res.stderr
    assert "done: 25 synchronous steps of 1 workers" in res.stderr
    got = torch.load(saved, weights_only=True)
    want = single_process(args, optimizer)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    assert any(not torch.equal(got[k], theta0_state()[k]) for k in got)  # it trained


def test_four_ranks_learn_fashion_mnist_and_write_the_step_schema(tmp_path):
    h5 = tmp_path / "sync.h5"
    res = train(4, "--method", "sync", "--max-steps", "120", "--eval-every", "60",
                "--metrics", str(h5), timeout=600)
    assert res.returncode == 0, res.stderr
    run = load_run(h5)
    u = run.updates
    assert u["seq"].tolist() == list(range(120))
    assert u["loss"][-20:].mean() < 0.6 * u["loss"][:10].mean()
    assert run.summary["test_accuracy"] > 0.65
    assert np.all(u["loss_max"] >= u["loss"])
    # what has no meaning without a master is left out, not faked
    for absent in ("worker", "ticket", "staleness", "queue", "pi_median"):
        assert absent not in u
    assert "rejected" not in run.summary and run.other.get("rejected", {}) == {}
    assert run.attrs["method"] == "sync" and run.attrs["n_workers"] == 4
    assert len(run.eval["clock"]) == 2  # at steps 60 and 120
    # the analysis tools read it as what it is
    import subprocess
    import sys

    out = tmp_path / "report"
    res = subprocess.run([sys.executable, str(REPO / "tools" / "report.py"), str(h5), "-o",
                          str(out)], capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0, res.stderr
    summary = (out / "summary.md").read_text()
    assert "| method | sync |" in summary and "sync: no master" in summary
    # nothing reported missing: the step schema is what a sync run writes (the figure of
    # per-worker updates is "Not plotted": "no worker column")
    assert run.notes == [] and "## Notes" not in summary, summary


@pytest.mark.parametrize("method, optimizer", [("sync", "sgd"), ("ddp", "adamw"),
                                               ("diloco", "adamw")])
def test_stop_and_resume_equals_the_uninterrupted_run(tmp_path, method, optimizer):
    """Bit for bit, the optimizer's state included (AdamW's m, v and step counts; DiLoCo's
    inner ones): each face once and each optimizer of the faces' shared torch.optim state
    once (sync and ddp keep it alike; DiLoCo's inner AdamW state holds its SGD's m and
    more); ddp's momentum SGD equals sync's in tests/test_ddp.py."""
    common = ["--method", method, "--optimizer", optimizer, "--max-steps", "200", "--threads",
              "1", "--eval-every", "0", *(["--lr", "0.002"] if optimizer == "adamw" else [])]
    whole = tmp_path / "whole.pt"
    res = train(2, *common, "--save", str(whole), timeout=300)
    assert res.returncode == 0, res.stderr
    ckdir, h5, part = tmp_path / "ck", tmp_path / "run.h5", tmp_path / "part.pt"
    ckdir.mkdir()
    args = [*common, "--checkpoint-dir", str(ckdir), "--checkpoint-every", "0",
            "--metrics", str(h5), "--save", str(part)]
    # worker 1 three times as slow until the stop (timing only): a 2 s flush of the metrics
    # rows must not find the run near its end
    proc = train_background(2, *args, "--straggler", "1:3")
    err = signal_when(proc, lambda: steps_written(h5) >= 50)
    assert proc.returncode == 3, err
    assert err.count("stopped by a signal at step") == 1 and "Traceback" not in err
    ck = checkpoint.latest(str(ckdir))
    state = checkpoint.load(ck)
    assert 0 < state.clock < 200 and state.momentum.shape == state.theta.shape
    assert state.tickets is None and state.next_seq is None  # only the asynchronous have them
    adamw = optimizer == "adamw"
    tensors = len(theta0_state())
    if method == "diloco":  # stopped at a round's end, each worker's inner state kept
        assert state.clock % 20 == 0 and state.inner_m.shape == (2, state.theta.size)
        assert not np.array_equal(state.inner_m[0], state.inner_m[1])
        assert not adamw or (state.inner_v.shape == (2, state.theta.size) and
                             np.all(state.inner_t == state.clock))
    elif adamw:  # AdamW's second moment and each tensor's step count beside its first
        assert state.adam_v.shape == state.theta.shape and np.all(state.adam_v >= 0)
        assert state.adam_t.tolist() == [state.clock] * tensors
    res = train(2, *args, "--resume", "auto", timeout=300)
    assert res.returncode == 0, res.stderr
    assert "resuming" in res.stderr
    run = load_run(h5)
    assert run.updates["seq"].tolist() == list(range(200))  # no row lost or repeated
    assert run.summary["finished"] == 1.0
    a, b = torch.load(whole, weights_only=True), torch.load(part, weights_only=True)
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_sync_with_the_numpy_quadratic_is_one_line_and_exit_2():
    res = train(2, *quadratic_args(method="sync"), timeout=120)
    assert res.returncode == 2
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("gem_mpi:")]
    assert lines == [("gem_mpi: error: --method sync trains torch models: --model quadratic "
                      "is for the asynchronous methods only")]


def test_bench_compare_runs_each_method_as_a_real_job(tmp_path):
    import json
    import subprocess
    import sys

    out = tmp_path / "compare.json"
    res = subprocess.run(
        [sys.executable, "-m", "gem_mpi.bench", "compare", "--workers", "2", "--max-steps",
         "20", "--eval-every", "10", "--methods", "downpour", "sync", "--straggler", "1:2",
         "--target-accuracy", "0.3", "--json", str(out)],
        capture_output=True, text=True, timeout=600, check=False, env=mpi_env(), cwd=REPO)
    assert res.returncode == 0, res.stderr
    result = json.loads(out.read_text())
    rows = {r["method"]: r for r in result["rows"]}
    assert set(rows) == {"downpour", "sync"} and result["base"] == "sync"
    assert rows["downpour"]["updates"] == 40 and rows["sync"]["updates"] == 20
    assert rows["downpour"]["ranks"] == 3 and rows["sync"]["ranks"] == 2
    for r in rows.values():
        assert r["samples_per_s"] > 0 and r["wall_s"] > 0
    assert rows["sync"]["samples_per_s_vs_base"] == 1.0
    assert "ratios against sync" in res.stdout and "--straggler 1:2" in res.stderr


@pytest.mark.parametrize("method, failed", [
    ("sync", "step 20 could not complete"), ("ddp", "step 20 could not complete"),
    ("diloco", "the round of steps 20-29 (its outer step) could not complete")])
def test_a_stuck_rank_ends_the_sync_job_with_a_checkpoint(tmp_path, method, failed):
    """Horovod's stall check, DDP's process-group timeout or DiLoCo's quorum timeout (all
    --worker-timeout) fails the others' step or round; rank 0 checkpoints the last completed
    step (DiLoCo: round) and prints one line."""
    t0 = time.monotonic()
    rounds = ["--diloco-steps", "10"] if method == "diloco" else []
    res = mpirun(3, [str(PROGS / "stuck_sync_worker.py"), "1", "20", "--method", method, *rounds,
                     "--max-steps", "500", "--eval-every", "0", "--worker-timeout", "4",
                     "--checkpoint-dir", str(tmp_path), "--metrics", str(tmp_path / "run.h5")],
                 timeout=120)
    assert res.returncode != 0 and time.monotonic() - t0 < 90
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("gem_mpi: rank")]
    assert len(lines) == 1, res.stderr
    assert failed in lines[0] and "--worker-timeout 4" in lines[0]
    if method == "sync":
        assert "1!:" in res.stderr  # Horovod's stall report marks the stuck rank
    state = checkpoint.load(checkpoint.latest(str(tmp_path)))
    assert state.clock == 20 and state.momentum is not None
    assert load_run(tmp_path / "run.h5").updates["seq"].size == 20


def test_a_diverging_sync_run_stops_with_exit_4():
    res = train(2, "--method", "sync", "--lr", "40", "--max-steps", "300", "--eval-every", "0",
                timeout=300)
    assert res.returncode == 4, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if "diverged" in ln]
    assert len(lines) == 1 and "Lower --lr" in lines[0] and "Traceback" not in res.stderr


def test_low_space_on_rank_0_ends_every_rank_at_one_step_with_a_checkpoint(tmp_path):
    """Rank 0's verdict (here: its metrics file system below --min-free-mb) travels in the
    next step's Allgather row: every rank stops there, and the checkpoint's rows match it."""
    ck = tmp_path / "ck"
    ck.mkdir()
    res = train(2, "--method", "sync", "--max-steps", "300", "--eval-every", "20",
                "--metrics", str(tmp_path / "run.h5"), "--min-free-mb", "1e9",
                "--checkpoint-dir", str(ck), timeout=300)
    assert res.returncode == 5, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("gem_mpi: error")]
    assert len(lines) == 1 and "below --min-free-mb 1e+09" in lines[0], res.stderr
    assert "free space, then --resume auto" in lines[0] and "Traceback" not in res.stderr
    state = checkpoint.load(checkpoint.latest(str(ck)))
    run = load_run(tmp_path / "run.h5")
    assert run.summary["finished"] == 0.0
    assert 0 < state.clock < 300 and state.rows_updates == state.clock
    assert np.array_equal(run.updates["seq"], np.arange(state.clock))
