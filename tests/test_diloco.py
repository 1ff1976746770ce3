"""``--method diloco``: local SGD with an outer Nesterov step (torchft's DiLoCo), started from
the MPI world, under real mpirun: its rounds against a hand-computed DiLoCo on the same data,
and its bad input (its stop and resume and a stuck rank: tests/test_sync.py, beside sync's)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import theta0_state, train

from gem_mpi import config
from gem_mpi.outputs.runfile import load_run

pytestmark = pytest.mark.mpi  # every test here launches mpirun or another process

pytest.importorskip("torchft", reason="tools/install.sh installs torchft")


def _hand_diloco(args: list[str], n: int) -> dict[str, torch.Tensor]:
    """DiLoCo written out: n models, each worker's inner momentum SGD over its own batches and
    dropout masks; every H steps Δ = mean over workers of θ_outer − θ_w, the outer Nesterov
    step b ← μ_o·b + Δ, θ_outer ← θ_outer − η_o·(Δ + μ_o·b), and every worker restarts from
    θ_outer with its own inner momentum."""
    from gem_mpi.problem import build_problem
    from gem_mpi.run.rank import data_stream, seed_dropout

    cfg, _ = config.parse(args)
    o, d = cfg.optim, cfg.diloco
    torch.set_num_threads(1)
    models = [build_problem(cfg.data, with_theta0=False).model for _ in range(n)]
    opts = [torch.optim.SGD(m.parameters(), lr=o.lr, momentum=o.momentum) for m in models]
    streams = [data_stream(cfg.data, w + 1, n) for w in range(n)]
    outer = [p.detach().clone() for p in models[0].parameters()]
    buf = [torch.zeros_like(p) for p in outer]
    steps = streams[0][0]
    for step in range(steps):
        for w, (model, opt, (_, batches)) in enumerate(zip(models, opts, streams)):
            model.train()
            seed_dropout(cfg.data.seed, w + 1, step)
            x, y = next(batches)
            opt.zero_grad()
            torch.nn.functional.nll_loss(model(x), y).backward()
            opt.step()
        if (step + 1) % d.diloco_steps:
            continue
        with torch.no_grad():
            for i, theta in enumerate(outer):
                delta = sum(theta - list(m.parameters())[i] for m in models) / n
                buf[i] = d.diloco_outer_momentum * buf[i] + delta
                theta -= d.diloco_outer_lr * (delta + d.diloco_outer_momentum * buf[i])
            for model in models:
                for p, theta in zip(model.parameters(), outer):
                    p.copy_(theta)
    return models[0].state_dict()


def test_diloco_rounds_equal_the_hand_computed_ones(tmp_path):
    """3 workers, 3 rounds of H = 4 with the outer options set: the saved θ equals the
    hand-written DiLoCo's within float32 summation order (gloo averages in its own order),
    and the metrics file has a row per step."""
    args = ["--method", "diloco", "--max-steps", "12", "--diloco-steps", "4",
            "--diloco-outer-lr", "0.5", "--diloco-outer-momentum", "0.8", "--threads", "1",
            "--eval-every", "0"]
    saved, h5 = tmp_path / "model.pt", tmp_path / "run.h5"
    res = train(3, *args, "--save", str(saved), "--metrics", str(h5), timeout=300)
    assert res.returncode == 0, res.stderr
    assert "3 rounds of 4 steps" in res.stderr
    assert "done: 12 synchronous steps (3 outer steps) of 3 workers" in res.stderr
    got = torch.load(saved, weights_only=True)
    want = _hand_diloco(args, 3)
    theta0 = theta0_state()
    for name in want:
        scale = float(want[name].abs().max())
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-6 * scale, msg=name)
    assert any(not torch.equal(got[k], theta0[k]) for k in got)  # it trained
    run = load_run(h5)
    assert run.attrs["method"] == "diloco" and "DiLoCo" in run.attrs["kernel"]
    assert run.updates["seq"].tolist() == list(range(12))
    waits = np.asarray(run.updates["allreduce_s"])
    assert np.all(np.isfinite(waits)) and run.summary["finished"] == 1.0


def test_a_budget_of_no_whole_round_ends_at_the_last_whole_one(tmp_path):
    saved = tmp_path / "model.pt"
    res = train(2, "--method", "diloco", "--max-steps", "10", "--diloco-steps", "4",
                "--threads", "1", "--eval-every", "0", "--save", str(saved), timeout=300)
    assert res.returncode == 0, res.stderr
    assert "2 rounds of 4 steps (the last 2 steps of the budget make no whole round" in \
        res.stderr
    assert "done: 8 synchronous steps (2 outer steps)" in res.stderr


def test_diloco_bad_input_is_one_line_and_exit_2():
    """One job for the path from rank 0's preflight (the data read) to every rank's exit 2;
    the cases themselves are tests/unit/test_refusals.py's, in-process."""
    says = "--diloco-steps 50 is longer than the run"
    res = train(2, "--method", "diloco", "--diloco-steps", "50", "--max-steps", "20",
                timeout=120)
    assert res.returncode == 2, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("gem_mpi:")]
    assert len(lines) == 1 and says in lines[0] and "Traceback" not in res.stderr, res.stderr
