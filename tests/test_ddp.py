"""``--method ddp``: synchronous momentum SGD on PyTorch's DistributedDataParallel (gloo on
the CPU), started from the MPI world, under real mpirun: it computes what ``--method sync``
(Horovod) computes, within float32 summation order, and shares its metrics, checkpoints and
bad-input rules (its stop and resume and a stuck rank: tests/test_sync.py, beside sync's)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import train

from gem_mpi.outputs.runfile import load_run

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


def test_ddp_bad_input_is_one_line_and_exit_2():
    """One job for the path from rank 0's preflight to every rank's exit 2; the cases
    themselves are tests/unit/test_refusals.py's, in-process."""
    says = "--method ddp has no master"
    res = train(2, "--method", "ddp", "--worker-mode", "overlap", timeout=120)
    assert res.returncode == 2, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("gem_mpi:")]
    assert len(lines) == 1 and says in lines[0] and "Traceback" not in res.stderr
