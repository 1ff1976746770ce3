"""``--model gpt --dataset text`` under real mpirun: the language model learns the running
Python's standard-library sources, and trains under each engine (the asynchronous master,
Horovod's sync, DiLoCo; DDP shares sync's trainer)."""

from __future__ import annotations

import math

import pytest
from helpers import train

from gem_mpi.outputs.runfile import load_run

pytestmark = pytest.mark.mpi  # every test here launches mpirun

TINY = ("--model", "gpt", "--dataset", "text", "--context", "32", "--gpt-layers", "1",
        "--gpt-width", "32", "--gpt-heads", "2", "--test-bytes", "8192", "--eval-every", "0",
        "--threads", "1")


def test_gpt_learns_python_with_adamw_gem_workers(tmp_path):
    """From ln 256 = 5.55 nats a byte (uniform) to well below it in 120 updates; the lines
    and the metrics count the bytes trained on."""
    h5 = tmp_path / "run.h5"
    res = train(3, *TINY, "--optimizer", "adamw", "--lr", "0.003", "--batch-size", "16",
                "--max-steps", "60", "--metrics", str(h5), "--log-every", "0.1", "--flops", "on",
                timeout=300)
    assert res.returncode == 0, res.stderr
    assert "gem (AdamW workers) on gpt/text" in res.stderr
    assert " tok/s, " in res.stderr and "samples/s (" in res.stderr  # the progress lines
    run = load_run(h5)
    s = run.summary
    assert s["tokens"] == 120 * 16 * 32
    assert s["tokens_per_s"] == pytest.approx(s["samples_per_s"] * 32)
    assert s["model_flops_per_s"] > 0 and math.isnan(s["mfu"])  # the CPU: no peak, no MFU
    assert s["test_loss"] < 0.7 * math.log(256), s["test_loss"]
    assert f"{s['test_loss'] / math.log(2):.3f} bits/byte" in res.stderr


@pytest.mark.parametrize("method", ["sync", "diloco"])
def test_gpt_trains_under_the_synchronous_engines(tmp_path, method):
    res = train(2, *TINY, "--method", method, "--batch-size", "8", "--max-steps", "20",
                *(("--diloco-steps", "10") if method == "diloco" else ()), timeout=300)
    assert res.returncode == 0, res.stderr
    assert "bits/byte" in res.stderr and f"{method}" in res.stderr
