"""Bad input: one readable line from rank 0, exit code 2 on every rank, no traceback, no hang.

What the options and the data decide is checked in this process: ``config.parse``, then
``gem_mpi.run.preflight.validate`` as rank 0 runs it for a job of 3 ranks (the data
included). A few real ``mpirun`` jobs (marked mpi) check the contract around it: the line
comes from rank 0 alone, every rank exits 2, nothing else is printed; and a rank's unhandled
error aborts the whole job.
"""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import h5py
import pytest
from helpers import PROGS, mpirun, quadratic_args, train

from gem_mpi import config
from gem_mpi.errors import UsageError
from gem_mpi.run.preflight import validate

QUAD = quadratic_args(steps=5)
SYNTHETIC_CNN = ["--model", "mnist-cnn", "--dataset", "synthetic"]  # after QUAD: overrides it
FASHION_CNN = ["--model", "mnist-cnn", "--dataset", "fashion-mnist"]
A_FILE = str(Path(__file__).resolve())  # exists and is a file; nothing writes to it
WORLD = 3  # the ranks of the jobs these cases ran as: 1 master, 2 workers

BAD_OPTIONS = [
    (["--wire", "f16"], "--wire must be one of float32, bf16"),
    (["--method", "sync", "--wire", "bf16"], "--wire bf16 is for the asynchronous methods"),
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
    (["--config", "/nonexistent/run.toml"], "--config /nonexistent/run.toml: No such file"),
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
    # positive in float64, 0 or inf in the float32 the workers and the kernel compute in
    (["--kappa", "1e-50"], "--kappa must be > 0 and finite in float32"),
    (["--kappa", "1e39"], "--kappa must be > 0 and finite in float32"),
    (["--lr", "1e-50"], "--lr must be > 0 and finite in float32"),
    (["--lr", "1e39"], "--lr must be > 0 and finite in float32"),
    (["--momentum", "0.99999999"], "--momentum must be in [0, 1) in float32"),
    (["--seed", "-1"], "--seed must be in 0..2**63-1"),
    (["--seed", str(2**64)], "--seed must be in 0..2**63-1"),
    (["--poll-max-ms", "1e12"], "--poll-max-ms must be in (0, 1000]"),
    (["--log-every", "1e-9"], "--log-every must be >= 0.1"),
    (["--straggler", "1:inf"], "--straggler factor must be in [1, 1000]"),
    (["--threads", "100000"], "--threads 100000 is more than the"),
    (["--quadratic-dim", str(10**13)], "the master alone needs about"),
    (["--checkpoint-dir", A_FILE], "is not a directory"),
    (["--save", "/tmp"], "--save '/tmp' is a directory"),
    (["--metrics", "/tmp/gem_same.h5", "--save", "/tmp/gem_same.h5"],
     "--metrics and --save are the same file"),
    (["--checkpoint-dir", "/tmp", "--metrics", "/tmp/checkpoint_000000000007.h5"],
     "has the name of a checkpoint file (checkpoint_*.h5) in --checkpoint-dir"),
    (["--checkpoint-dir", "/tmp", "--save", "/tmp/momentum_w00001.h5"],
     "has the name of a checkpoint file (momentum_w*.h5)"),
    # a batch no worker's share of the data can fill
    ([*SYNTHETIC_CNN, "--synthetic-size", "10"],
     "--batch-size 64 exceeds the 10 training samples of --dataset synthetic"),
    ([*SYNTHETIC_CNN, "--synthetic-size", str(10**13)], "each worker would hold"),
    ([*FASHION_CNN, "--batch-size", "70000"],
     "--batch-size 70000 exceeds the 60000 training samples of fashion-mnist"),
    ([*FASHION_CNN, "--batch-size", "40000", "--shard"],
     "exceeds the 30000 training samples of each worker's shard"),
    (["--holdout", "10"], "--holdout holds part of a training set out"),
    ([*FASHION_CNN, "--holdout", "60000"],
     "--holdout 60000 leaves none of the 60000 training samples of fashion-mnist"),
    ([*FASHION_CNN, "--holdout", "59990"],
     "--batch-size 64 exceeds the 10 training samples of fashion-mnist less --holdout"),
]


def _refusal(argv: list[str]) -> str:
    """The line rank 0 prints (after "gem_mpi: error: ") for a job of WORLD ranks."""
    with pytest.raises(UsageError) as refused:
        cfg, help_text = config.parse(argv)
        assert help_text is None
        validate(cfg, WORLD)
    line = str(refused.value)
    assert line and "\n" not in line, line
    return line


@pytest.mark.parametrize(("args", "message"), BAD_OPTIONS)
def test_bad_option_is_one_line_from_rank0(args, message):
    assert message in _refusal([*QUAD, *args])


def test_missing_dataset_is_reported_once(tmp_path):
    line = _refusal(["--dataset", "fashion-mnist", "--data-dir", str(tmp_path / "nothing")])
    assert str(tmp_path / "nothing") in line


@pytest.mark.parametrize("damage", ["truncated", "not-gzip", "wrong-magic"])
def test_damaged_dataset_file_is_one_line(tmp_path, damage):
    src = Path("/usr/share/datasets/fashion-mnist")
    for f in src.glob("*.gz"):
        shutil.copy(f, tmp_path / f.name)
    victim = tmp_path / "train-images-idx3-ubyte.gz"
    raw = gzip.decompress(victim.read_bytes())
    if damage == "truncated":  # (compresslevel 1: level 9 takes seconds on 47 MB)
        victim.write_bytes(gzip.compress(raw[: len(raw) // 2], compresslevel=1))
    elif damage == "not-gzip":
        victim.write_bytes(raw[:1000])
    else:
        victim.write_bytes(gzip.compress(b"\x00\x00\x09\x09" + raw[4:], compresslevel=1))
    assert "train-images" in _refusal(["--data-dir", str(tmp_path)])


def test_metrics_over_the_resume_checkpoint_is_one_line(tmp_path):
    ckpt = tmp_path / "checkpoint_000000000005.h5"
    ckpt.write_bytes(b"a checkpoint")
    line = _refusal([*QUAD, "--resume", str(ckpt), "--metrics", str(ckpt)])
    assert "is the --resume checkpoint" in line
    assert ckpt.read_bytes() == b"a checkpoint"


def _image_folder(root: Path, classes: dict[str, dict[str, int]]) -> Path:
    """root/{train,val}/<class>/ with the given number of images in each class folder."""
    from PIL import Image

    for sub, counts in classes.items():
        for cls, n in counts.items():
            (root / sub / cls).mkdir(parents=True)
            for i in range(n):
                Image.new("RGB", (8, 8), (i, 0, 0)).save(root / sub / cls / f"{i}.png")
    return root


IMAGENET = ["--model", "resnet18", "--dataset", "imagenet", "--max-steps", "1",
            "--eval-every", "0", "--batch-size", "2"]


def test_image_folder_with_an_empty_class_is_one_line(tmp_path):
    root = _image_folder(tmp_path, {"train": {"a": 3, "b": 0}, "val": {"a": 2, "b": 2}})
    line = _refusal([*IMAGENET, "--data-dir", str(root)])
    assert f"class folder {root}/train/b holds no image" in line


def test_image_folder_whose_splits_differ_is_one_line(tmp_path):
    root = _image_folder(tmp_path, {"train": {"a": 2, "b": 2}, "val": {"a": 2, "c": 2}})
    line = _refusal([*IMAGENET, "--data-dir", str(root)])
    assert "not the same (only in train: b; only in val: c)" in line


def test_image_folder_smaller_than_a_batch_per_shard_is_one_line(tmp_path):
    root = _image_folder(tmp_path, {"train": {"a": 2, "b": 1}, "val": {"a": 1, "b": 1}})
    line = _refusal([*IMAGENET, "--shard", "--data-dir", str(root)])
    assert "--batch-size 2 exceeds the 1 training samples of each worker's shard" in line


# --- the contract, in real jobs ----------------------------------------------------------------


def _one_error_line(res) -> str:
    """mpirun exited 2; its output is one "gem_mpi: error:" line, from rank 0 alone, and no
    traceback."""
    assert res.returncode == 2, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("gem_mpi: error:")]
    assert len(lines) == 1, res.stderr
    assert "Traceback" not in res.stderr + res.stdout
    assert not [ln for ln in res.stderr.splitlines() if "rank 1" in ln or "rank 2" in ln]
    return lines[0]


@pytest.mark.mpi
@pytest.mark.parametrize(("args", "message"), [
    (["--lr", "abc"], "invalid float value"),  # the parser's
    (["--momentum", "1"], "--momentum must be in [0, 1)"),  # an option's own rule
    # rank 0 reads the data while the others wait
    ([*FASHION_CNN, "--batch-size", "70000"],
     "--batch-size 70000 exceeds the 60000 training samples of fashion-mnist"),
])
def test_bad_input_is_one_line_from_rank0_and_exit_2_on_every_rank(tmp_path, args, message):
    codes = tmp_path / "codes.txt"  # each rank appends "<rank> <its exit code>"
    res = mpirun(WORLD, [str(PROGS / "exit_code.py"), str(codes), *QUAD, *args], timeout=60)
    assert message in _one_error_line(res)
    assert sorted(codes.read_text().splitlines()) == [f"{r} 2" for r in range(WORLD)]


@pytest.mark.mpi
def test_kernel_threads_beyond_the_cores_are_one_line(monkeypatch):
    """A check made beside validate (the session's, on rank 0) keeps the contract too."""
    monkeypatch.setenv("GEM_NUM_THREADS", "100000")
    assert "GEM_NUM_THREADS 100000 is more than the" in _one_error_line(train(WORLD, *QUAD))


@pytest.mark.mpi
def test_world_of_one_rank_is_refused():
    line = _one_error_line(train(1, *QUAD, timeout=60))
    assert "needs at least 2 MPI ranks" in line


@pytest.mark.mpi
def test_help_prints_once_and_exits_zero():
    res = train(WORLD, "--help", timeout=60)
    assert res.returncode == 0
    assert res.stdout.count("usage: python -m gem_mpi.train") == 1


@pytest.mark.mpi
def test_print_config_prints_once_and_a_run_takes_its_file(tmp_path):
    res = train(WORLD, *QUAD, "--lr", "0.02", "--print-config", timeout=60)
    assert res.returncode == 0 and res.stdout.count("[optim]") == 1, res.stderr
    run = tmp_path / "run.toml"
    run.write_text(res.stdout)
    metrics = tmp_path / "m.h5"
    res = train(WORLD, "--config", str(run), "--metrics", str(metrics), timeout=120)
    assert res.returncode == 0, res.stderr
    with h5py.File(metrics, "r") as f:
        recorded = json.loads(f.attrs["config"])
    assert recorded == {**config.parse([*QUAD, "--lr", "0.02"])[0].as_dict(),
                        "metrics": str(metrics)}


@pytest.mark.mpi
def test_error_on_one_rank_aborts_the_whole_job():
    res = mpirun(4, [str(PROGS / "fail_on_rank.py"), "2", *QUAD, "--max-steps", "100000"],
                 timeout=60)  # a hang would hit the timeout and fail the test
    assert res.returncode == 1, res.stderr  # MPI_Abort with the code of a failed run
    assert res.stderr.count("RuntimeError: injected failure on rank 2") == 1
    assert "[rank 2]" in res.stderr
    assert "[rank 1]" not in res.stderr and "[rank 3]" not in res.stderr
