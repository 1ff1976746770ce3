"""``--method ddp``: synchronous momentum SGD on PyTorch's DistributedDataParallel (gloo on
the CPU), started from the MPI world, under real mpirun: it computes what ``--method sync``
(Horovod) computes, within float32 summation order, and shares its metrics, checkpoints and
bad-input rules."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from helpers import PROGS, mpirun, quadratic_args, signal_when, train, train_background

from gem_mpi.outputs import checkpoint
from gem_mpi.outputs.analysis import RunFileError, load_run

pytestmark = pytest.mark.mpi  # every test here launches mpirun or another process

pytest.importorskip("horovod.torch", reason="tools/install.sh builds Horovod")

LOOP = ("--max-steps", "10", "--eval-every", "0", "--threads", "1", "--lr-schedule",
        "cosine", "--warmup-steps", "3", "--clip-grad-norm", "2")


def _flat(path) -> torch.Tensor:
    state = torch.load(path, weights_only=True)
    return torch.cat([v.flatten().float() for v in state.values()])


def test_ddp_computes_what_horovods_sync_computes(tmp_path):
    """4 ranks, 10 steps with a schedule and clipping: the same θ within float32 summation
    order (the two allreduces add in their own orders: 4e-9 apart after one step, 1.5e-8
    after ten; later a ReLU or a max-pool that flips on such a difference makes the runs
    drift apart as any two orders of summation would), the same step rows."""
    thetas, runs = {}, {}
    for method in ("sync", "ddp"):
        h5, out = tmp_path / f"{method}.h5", tmp_path / f"{method}.pt"
        res = train(4, "--method", method, *LOOP, "--metrics", str(h5), "--save", str(out),
                    timeout=300)
        assert res.returncode == 0, res.stderr
        thetas[method], runs[method] = _flat(out), load_run(h5)
    assert "DistributedDataParallel (gloo, average)" in runs["ddp"].attrs["kernel"]
    assert runs["ddp"].attrs["method"] == "ddp" and runs["ddp"].attrs["n_workers"] == 4
    a, b = thetas["sync"], thetas["ddp"]
    scale = float(a.abs().max())
    assert float((a - b).abs().max()) <= 1e-6 * scale  # summation order only
    assert not torch.equal(a, _flat(tmp_path / "sync.pt") * 0)  # they trained
    u, v = runs["sync"].updates, runs["ddp"].updates
    assert v["seq"].tolist() == list(range(10))
    np.testing.assert_allclose(u["loss"], v["loss"], rtol=1e-5)


def _steps_written(h5) -> int:
    try:
        return load_run(h5).updates["seq"].size
    except (RunFileError, OSError):
        return 0


def test_ddp_stop_and_resume_equals_the_uninterrupted_run(tmp_path):
    common = ["--method", "ddp", "--max-steps", "400", "--threads", "1", "--eval-every", "0"]
    whole = tmp_path / "whole.pt"
    res = train(2, *common, "--save", str(whole), timeout=300)
    assert res.returncode == 0, res.stderr
    ckdir, h5, part = tmp_path / "ck", tmp_path / "run.h5", tmp_path / "part.pt"
    ckdir.mkdir()
    args = [*common, "--checkpoint-dir", str(ckdir), "--checkpoint-every", "0",
            "--metrics", str(h5), "--save", str(part)]
    proc = train_background(2, *args)
    err = signal_when(proc, lambda: _steps_written(h5) >= 50)
    assert proc.returncode == 3, err
    state = checkpoint.load(checkpoint.latest(str(ckdir)))
    assert 0 < state.clock < 400 and state.momentum.shape == state.theta.shape
    res = train(2, *args, "--resume", "auto", timeout=300)
    assert res.returncode == 0, res.stderr
    assert load_run(h5).updates["seq"].tolist() == list(range(400))
    assert torch.equal(_flat(whole), _flat(part))


def test_a_stuck_rank_ends_the_ddp_job_with_a_checkpoint(tmp_path):
    """The process group's timeout is --worker-timeout: the others' allreduce fails, rank 0
    checkpoints the last completed step and ends the job with one line."""
    t0 = time.monotonic()
    res = mpirun(3, [str(PROGS / "stuck_sync_worker.py"), "1", "20", "--method", "ddp",
                     "--max-steps", "500", "--eval-every", "0", "--worker-timeout", "4",
                     "--checkpoint-dir", str(tmp_path), "--metrics", str(tmp_path / "run.h5")],
                 timeout=120)
    assert res.returncode != 0 and time.monotonic() - t0 < 90
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("gem_mpi: rank")]
    assert len(lines) == 1, res.stderr
    assert "step 20 could not complete" in lines[0] and "--worker-timeout 4" in lines[0]
    state = checkpoint.load(checkpoint.latest(str(tmp_path)))
    assert state.clock == 20 and state.momentum is not None


@pytest.mark.parametrize("extra, says", [
    (quadratic_args(method="ddp"), "--method ddp trains torch models"),
    (("--method", "ddp", "--worker-mode", "overlap"), "--method ddp has no master"),
    (("--method", "ddp", "--wire", "bf16"), "--method ddp averages gradients"),
])
def test_ddp_bad_input_is_one_line_and_exit_2(extra, says):
    res = train(2, *extra, timeout=120)
    assert res.returncode == 2, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("gem_mpi:")]
    assert len(lines) == 1 and says in lines[0] and "Traceback" not in res.stderr
