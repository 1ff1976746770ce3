"""The training loop GPU users expect, as real mpirun jobs: BatchNorm statistics of the
trained θ, bf16 autocast (on the CPU here), learning-rate schedules and gradient clipping,
each replayed bit for bit by the numpy reference where the model allows it (a schedule
stopped mid-cosine and resumed: tests/test_checkpoint.py's first momentum row)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import (
    REPO,
    assert_exactly_once,
    mpi_env,
    mpirun_cmd,
    quadratic_args,
    theta0_state,
    train,
)
from safetensors import safe_open
from safetensors.torch import load_file

from gem_mpi.algorithm.reference import replay
from gem_mpi.algorithm.stepsize import Schedule
from gem_mpi.config import Config
from gem_mpi.outputs.runfile import load_run
from gem_mpi.problem.batches import iterate_batches
from gem_mpi.problem.datasets import evaluation_split, load_split
from gem_mpi.problem.models import evaluate
from gem_mpi.problem.quadratic import Quadratic

pytestmark = pytest.mark.mpi

DIM, STEPS, WORKERS, LR, MU = 2000, 60, 3, 0.05, 0.9
USER_CODE = REPO / "tests" / "user_code"


# each schedule, clipping and worker order acts on the worker's η and gradient whatever the
# rule: one method a row, each of them with both methods somewhere (pairwise)
@pytest.mark.parametrize("schedule, method", [
    (("--warmup-steps", "10"), "gem"),
    (("--lr-schedule", "step", "--lr-step-every", "15", "--lr-gamma", "0.5"), "downpour"),
    (("--lr-schedule", "cosine", "--warmup-steps", "5", "--lr-min", "0.005"), "downpour"),
    (("--clip-grad-norm", "10"), "downpour"),
    (("--lr-schedule", "cosine", "--clip-grad-norm", "10", "--worker-mode", "pipelined"),
     "gem"),
    (("--lr-schedule", "step", "--lr-step-every", "15", "--worker-mode", "overlap"), "gem"),
])
def test_each_schedule_and_clipping_is_replayed_bit_for_bit(tmp_path, method, schedule):
    h5, out = tmp_path / "run.h5", tmp_path / "theta.npy"
    args = quadratic_args(*schedule, method=method, dim=DIM, steps=STEPS, lr=LR, momentum=MU,
                          metrics=h5, save=out, eval_every=0)
    res = train(WORKERS + 1, *args)
    assert res.returncode == 0, res.stderr
    run, theta = load_run(h5), np.load(out)
    cfg = Config.of(**run.config)
    sched = Schedule.of(cfg.optim, STEPS)
    clip_norm = cfg.optim.clip_grad_norm
    ref = replay(run.updates, Quadratic(DIM, 0), method, LR, momentum=MU, schedule=sched,
                 clip_norm=clip_norm)
    assert np.array_equal(theta, ref.theta)
    # and the schedule or the clipping really acted: without them the replay differs
    plain = replay(run.updates, Quadratic(DIM, 0), method, LR, momentum=MU)
    assert not np.array_equal(theta, plain.theta)


FASHION = ("--model", "mnist-cnn", "--dataset", "fashion-mnist", "--batch-size", "32",
           "--eval-every", "0", "--eval-batch-size", "500")


@pytest.mark.parametrize("method, ranks", [("gem", 2), ("sync", 2)])
def test_bf16_autocast_trains_on_the_cpu_and_is_recorded(tmp_path, method, ranks):
    """One worker (sync: two), 60 steps, bf16 against float32: both learn, the metrics file
    records the precision, and the two differ (autocast really ran in bf16)."""
    thetas = {}
    for amp in ("off", "bf16"):
        h5, out = tmp_path / f"{amp}.h5", tmp_path / f"{amp}.pt"
        res = train(ranks, *FASHION, "--method", method, "--max-steps", "60", "--amp", amp,
                    "--metrics", str(h5), "--save", str(out), timeout=300)
        assert res.returncode == 0, res.stderr
        run = load_run(h5)
        assert run.config["amp"] == amp
        loss = run.updates["loss"]
        assert np.all(np.isfinite(loss)) and loss[-10:].mean() < loss[:10].mean()
        assert run.summary["test_accuracy"] > 0.3  # chance: 0.1
        thetas[amp] = torch.cat([t.flatten() for t in torch.load(out, weights_only=True).values()])
    assert not torch.equal(thetas["off"], thetas["bf16"])


def test_an_overlapped_cnn_learns_with_every_part_of_the_loop(tmp_path):
    """--worker-mode overlap on a torch CNN (the compute thread, Δθ made on the sending
    thread, three θ buffers), with bf16 autocast, a cosine schedule and clipping: 2 GEM
    workers learn Fashion-MNIST, every update is applied once, and each update after a
    worker's first was computed without its previous one (one step more staleness)."""
    h5 = tmp_path / "run.h5"
    res = train(3, *FASHION, "--method", "gem", "--max-steps", "150", "--worker-mode",
                "overlap", "--amp", "bf16", "--lr-schedule", "cosine", "--clip-grad-norm",
                "5", "--metrics", str(h5), timeout=300)
    assert res.returncode == 0, res.stderr
    run = load_run(h5)
    u = run.updates
    assert_exactly_once(u["worker"], u["seq"], (1, 2), 150)
    assert (u["staleness"][u["seq"] > 0] >= 1).all()
    assert run.summary["test_accuracy"] > 0.6  # chance: 0.1


def _bn_run(args: list[str], h5: Path) -> float:
    """The reported test accuracy of a 2-worker run of ``args`` (after python) on the user's
    BatchNorm CNN, which writes the metrics file ``h5``."""
    env = mpi_env()
    env["PYTHONPATH"] = f"{USER_CODE}{os.pathsep}{env['PYTHONPATH']}"
    res = subprocess.run(mpirun_cmd(3, args), capture_output=True, text=True, timeout=300,
                         env=env, cwd=str(REPO), check=False)
    assert res.returncode == 0, res.stderr
    return float(load_run(h5).summary["test_accuracy"])


def test_batchnorm_models_are_evaluated_and_saved_with_trained_statistics(tmp_path):
    """A BatchNorm CNN on Fashion-MNIST, 2 GEM workers, trained by gem_mpi.fit and saved as
    safetensors: the file holds the model's parameters and buffers by name, loads strictly
    into the user's model, and carries the run's id and configuration; the reported accuracy
    is that of the saved model, which is the model fit returned, and equals (within noise)
    the accuracy after recomputing the statistics independently from training data with
    torch's own update_bn; it is far above what the initial statistics give (--bn-batches 0,
    the behaviour before: a command-line run saved with torch.save, its file that run's
    model too)."""
    sys.path.insert(0, str(USER_CODE))
    from plugins import bn_cnn

    h5, saved, returned = tmp_path / "bn.h5", tmp_path / "bn.safetensors", tmp_path / "fit.pt"
    reported = _bn_run([str(USER_CODE / "fit_bn.py"), str(saved), str(h5), str(returned)], h5)
    h5_0, saved_0 = tmp_path / "bn0.h5", tmp_path / "bn0.pt"
    before = _bn_run(["-m", "gem_mpi.train", "--model", "plugins:bn_cnn", "--loss",
                      "cross_entropy", "--max-steps", "150", "--eval-every", "0",
                      "--bn-batches", "0", "--metrics", str(h5_0), "--save", str(saved_0)],
                     h5_0)
    cfg = Config.of(model="plugins:bn_cnn", dataset="fashion-mnist")
    test = evaluation_split(cfg.data)

    def accuracy(model: torch.nn.Module) -> float:
        batches = iterate_batches(test, 500, 1, 0, shuffle=False, drop_last=False)
        return evaluate(model, batches, torch.device("cpu"))[1]

    tensors = load_file(saved)
    model = bn_cnn()
    assert sorted(tensors) == sorted(model.state_dict())  # parameters and buffers
    model.load_state_dict(tensors, strict=True)
    assert abs(accuracy(model) - reported) <= 0.002  # the saved model is the evaluated one
    run = load_run(h5)
    with safe_open(saved, "pt") as f:
        meta = f.metadata()
    assert meta["run_id"] == run.attrs["run_id"] and len(meta["run_id"]) == 32
    assert json.loads(meta["config"]) == run.config
    assert run.config["bn_batches"] == 20 and run.config["save"] == str(saved)
    fitted = torch.load(returned, weights_only=True)  # what gem_mpi.fit returned
    assert sorted(fitted) == sorted(tensors)
    for name, t in tensors.items():  # θ alike; statistics from the same batches
        torch.testing.assert_close(fitted[name], t, msg=name)
    model_0 = bn_cnn()
    model_0.load_state_dict(torch.load(saved_0, weights_only=True), strict=True)
    assert abs(accuracy(model_0) - before) <= 0.002
    train_split = load_split("fashion-mnist", None, "train", "plugins:bn_cnn")
    loader = [x for x, _ in iterate_batches(train_split, 64, 1, seed=12345)][:50]
    torch.optim.swa_utils.update_bn(loader, model)  # other batches, torch's own way
    assert abs(accuracy(model) - reported) <= 0.02
    assert reported > before + 0.15, (reported, before)


def _theta(path: Path) -> torch.Tensor:
    return torch.cat([t.flatten().double() for t in torch.load(path, weights_only=True).values()])


def test_clipping_bounds_how_far_a_torch_model_moves(tmp_path):
    """DOWNPOUR applies each Δθ as it is: with every gradient clipped to norm c, T updates of
    η move θ by at most T·η·c; unclipped, the same run moves much further."""
    moved = {}
    theta0 = torch.cat([t.flatten().double() for t in theta0_state(*FASHION).values()])
    for clip_norm in ("0.01", "0"):
        out = tmp_path / f"clip{clip_norm}.pt"
        res = train(2, *FASHION, "--method", "downpour", "--max-steps", "20", "--lr", "0.05",
                    "--clip-grad-norm", clip_norm, "--save", str(out), timeout=300)
        assert res.returncode == 0, res.stderr
        moved[clip_norm] = float((_theta(out) - theta0).norm())
    assert moved["0.01"] <= 20 * 0.05 * 0.01 * 1.001
    assert moved["0"] > 10 * moved["0.01"]


def test_sync_follows_the_schedule(tmp_path):
    """Synchronous SGD with η times 1e-6 after its first step: θ after 12 steps is θ after
    the first one (momentum aside, which the tiny η multiplies too); constant η moves on.
    The constant run also traces its steps 10 and 11 (--profile-steps: the synchronous loop's
    ticks; the asynchronous ones' below)."""
    thetas = {}
    traces = tmp_path / "traces"
    for name, steps, extra in (("one", 1, ()), ("step", 12, ("--lr-schedule", "step",
                               "--lr-step-every", "1", "--lr-gamma", "1e-6")),
                               ("constant", 12, ("--profile-steps", "10:11", "--profile-dir",
                                                 str(traces)))):
        out = tmp_path / f"{name}.pt"
        res = train(2, *FASHION, "--method", "sync", "--max-steps", str(steps), *extra,
                    "--save", str(out), timeout=300)
        assert res.returncode == 0, res.stderr
        thetas[name] = _theta(out)
    assert float((thetas["step"] - thetas["one"]).norm()) < 1e-4
    assert float((thetas["constant"] - thetas["one"]).norm()) > 1e-2
    for rank in (0, 1):
        names = _trace_names(traces / f"rank{rank}.pt.trace.json")
        assert _profiler_steps(names) == [10, 11]
        assert {"aten::conv2d", "aten::addmm", "gem_mpi.exchange"} <= names


def _trace_names(path: Path) -> set[str]:
    """The names of a Chrome trace's events (the file must be valid JSON)."""
    return {e["name"] for e in json.loads(path.read_text())["traceEvents"] if "name" in e}


def _profiler_steps(names: set[str]) -> list[int]:
    return sorted(int(n.split("#")[1]) for n in names if n.startswith("ProfilerStep#"))


def test_profile_steps_traces_each_ranks_steps(tmp_path):
    """--profile-steps 5:8, 1 master and 2 GEM workers on a CNN: each rank writes one trace,
    named by its rank, into <metrics>_profile beside --metrics, Chrome trace JSON that holds
    steps 5 to 8 and no other: the workers' convolutions and matrix products, the master's
    applied batches and its kernel; and kineto says nothing on stderr."""
    h5 = tmp_path / "run.h5"
    res = train(3, "--model", "mnist-cnn", "--dataset", "synthetic", "--synthetic-size", "512",
                "--batch-size", "16", "--max-steps", "12", "--eval-every", "0",
                "--profile-steps", "5:8", "--metrics", str(h5), timeout=300)
    assert res.returncode == 0, res.stderr
    folder = tmp_path / "run_profile"
    assert sorted(p.name for p in folder.iterdir()) == [f"rank{r}.pt.trace.json"
                                                        for r in range(3)]
    for rank in range(3):
        names = _trace_names(folder / f"rank{rank}.pt.trace.json")
        assert _profiler_steps(names) == [5, 6, 7, 8], rank
        if rank == 0:
            assert {"gem_mpi.apply", "gem_mpi.kernel", "gem_mpi.record"} <= names
        else:
            assert {"aten::conv2d", "aten::addmm", "gem_mpi.compute",
                    "gem_mpi.payload"} <= names
    assert "USDT" not in res.stderr and "profiler_start" not in res.stderr


def test_worker_ranks_run_at_the_nice_value_asked_and_the_master_at_its_own():
    """--worker-nice 3 (on a node with more ranks than cores 'auto' gives 10): the workers
    step aside when the master has an update to apply; --verbose's placement line shows each
    rank's nice value where it is not 0."""
    res = train(3, *quadratic_args("--worker-nice", "3", "--verbose", dim=100, steps=20,
                                   eval_every=0))
    assert res.returncode == 0, res.stderr
    assert "; workers at nice +3" in res.stderr, res.stderr
    base = os.getpriority(os.PRIO_PROCESS, 0)  # the ranks start at pytest's
    [line] = [ln for ln in res.stderr.splitlines() if "gem_mpi: placement:" in ln]
    master, *workers = line.split("rank ")[1:]
    assert master.startswith("0 (master") and ("nice" in master) == (base != 0), line
    assert len(workers) == 2 and all(f", nice {base + 3})" in w for w in workers), line
