"""Bad input: one readable line from rank 0, a non-zero exit everywhere, no hang."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import PROGS, mpirun, train

QUAD = ["--model", "quadratic", "--dataset", "synthetic", "--max-steps", "5"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--lr", "0"], "--lr must be > 0"),
        (["--lr", "nan"], "--lr must be > 0"),
        (["--momentum", "1"], "--momentum must be in [0, 1)"),
        (["--momentum", "-0.1"], "--momentum must be in [0, 1)"),
        (["--kappa", "0"], "--kappa must be > 0"),
        (["--pi-max", "-1"], "--pi-max must be > 0"),
        (["--eps", "1e-50"], "--eps must be > 0 and finite in float32"),
        (["--gem-shift", "mine"], "--gem-shift must be one of others, paper"),
        (["--batch-size", "0"], "--batch-size must be > 0"),
        (["--lr", "abc"], "invalid float value"),
        (["--method", "sgd"], "unknown --method 'sgd'"),
        (["--model", "vgg"], "unknown --model 'vgg'"),
        (["--dataset", "cifar"], "unknown --dataset 'cifar'"),
        (["--no-such-option"], "unrecognized arguments"),
        (["--metrics", "/nonexistent/dir/run.h5"], "does not exist"),
        (["--save", "/nonexistent/dir/model.pt"], "does not exist"),
        (["--eval-every", "-1"], "--eval-every must be >= 0"),
        (["--straggler", "9:2"], "--straggler worker must be in 1..2"),
        (["--straggler", "x"], "--straggler wants WORKER:FACTOR"),
        (["--divergence-factor", "1"], "--divergence-factor must be > 1"),
        (["--checkpoint-every", "-1"], "--checkpoint-every must be >= 0"),
        (["--checkpoint-dir", "/nonexistent"], "does not exist"),
        (["--resume", "/nonexistent.h5"], "no such file"),
        (["--resume", "auto"], "--resume auto needs --checkpoint-dir"),
        (["--model", "quadratic", "--dataset", "fashion-mnist"], "--model quadratic uses no data"),
    ],
)
def test_bad_option_is_one_line_from_rank0(args, message):
    res = train(3, *QUAD, *args, timeout=60)
    assert res.returncode != 0
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("gem_mpi: error:")]
    assert len(lines) == 1, res.stderr
    assert message in lines[0]
    assert "Traceback" not in res.stderr + res.stdout


def test_missing_dataset_is_reported_once(tmp_path):
    res = train(3, "--dataset", "fashion-mnist", "--data-dir", str(tmp_path / "nothing"),
                timeout=120)
    assert res.returncode != 0
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("gem_mpi: error:")]
    assert len(lines) == 1, res.stderr
    assert "Traceback" not in res.stderr


def test_world_of_one_rank_is_refused():
    res = train(1, *QUAD, timeout=60)
    assert res.returncode != 0
    assert res.stderr.count("needs at least 2 MPI ranks") == 1


def test_help_prints_once_and_exits_zero():
    res = train(3, "--help", timeout=60)
    assert res.returncode == 0
    assert res.stdout.count("usage: python -m gem_mpi.train") == 1


def test_error_on_one_rank_aborts_the_whole_job():
    res = mpirun(4, [str(PROGS / "fail_on_rank.py"), "2", *QUAD, "--max-steps", "100000"],
                 timeout=60)  # a hang would hit the timeout and fail the test
    assert res.returncode != 0
    assert res.stderr.count("RuntimeError: injected failure on rank 2") == 1
    assert "[rank 2]" in res.stderr
    assert "[rank 1]" not in res.stderr and "[rank 3]" not in res.stderr


@pytest.mark.parametrize("damage", ["truncated", "not-gzip", "wrong-magic"])
def test_damaged_dataset_file_is_one_line(tmp_path, damage):
    import gzip
    import shutil

    src = Path("/usr/share/datasets/fashion-mnist")
    for f in src.glob("*.gz"):
        shutil.copy(f, tmp_path / f.name)
    victim = tmp_path / "train-images-idx3-ubyte.gz"
    raw = gzip.decompress(victim.read_bytes())
    if damage == "truncated":
        victim.write_bytes(gzip.compress(raw[: len(raw) // 2]))
    elif damage == "not-gzip":
        victim.write_bytes(raw[:1000])
    else:
        victim.write_bytes(gzip.compress(b"\x00\x00\x09\x09" + raw[4:]))
    res = train(3, "--data-dir", str(tmp_path), timeout=120)
    assert res.returncode != 0
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("gem_mpi: error:")]
    assert len(lines) == 1, res.stderr
    assert "train-images" in lines[0]
    assert "Traceback" not in res.stderr
