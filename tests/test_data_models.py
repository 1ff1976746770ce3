"""Data and model tests on the real Fashion-MNIST installed by Debian's dataset-fashion-mnist."""

from __future__ import annotations

import gzip
import itertools
import math
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from gem_mpi.errors import DataError, UsageError
from gem_mpi.problem import models
from gem_mpi.problem.batches import epoch_indices, iterate_batches, steps_per_epoch
from gem_mpi.problem.datasets import check_dataset, load_split
from gem_mpi.problem.idx import DEBIAN_FASHION_MNIST_DIR
from gem_mpi.problem.spec import DataSpec, dataset_spec
from gem_mpi.problem.splits import ArraySplit, Split

FASHION = DEBIAN_FASHION_MNIST_DIR
REPO = Path(__file__).resolve().parents[1]
IDX_NAMES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)

pytestmark = pytest.mark.skipif(
    not (FASHION / "t10k-labels-idx1-ubyte.gz").is_file(),
    reason="needs the Debian package dataset-fashion-mnist",
)


@pytest.fixture(scope="module")
def train() -> Split:
    return load_split("fashion-mnist", None, "train", "mnist-cnn")


@pytest.fixture(scope="module")
def test_split() -> Split:
    return load_split("fashion-mnist", None, "test", "mnist-cnn")


def _fashion_copy(directory: Path) -> Path:
    """A data dir of symlinks to the real files, one of which a test can then spoil."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in IDX_NAMES:
        (directory / f"{name}.gz").symlink_to(FASHION / f"{name}.gz")
    return directory


# --------------------------------------------------------------------------- loading


def test_lengths_and_storage(train: Split, test_split: Split) -> None:
    assert len(train) == 60_000
    assert len(test_split) == 10_000
    assert isinstance(train, ArraySplit)
    assert train.images.dtype == np.uint8 and train.images.shape == (60_000, 28, 28)
    assert train.spec == DataSpec(channels=1, image_size=28, num_classes=10)
    assert sorted(np.unique(train.labels).tolist()) == list(range(10))


def test_batch_shape_dtype_normalisation(test_split: ArraySplit) -> None:
    batches = list(
        iterate_batches(test_split, 4096, 1, seed=0, shuffle=False, drop_last=False)
    )
    assert [len(y) for _, y in batches] == [4096, 4096, 1808]
    x, y = batches[0]
    assert x.shape == (4096, 1, 28, 28) and x.dtype == torch.float32
    assert y.shape == (4096,) and y.dtype == torch.int64
    assert not x.requires_grad and x.device.type == "cpu"
    expected = (torch.from_numpy(test_split.images[0].astype(np.float32)) / 255 - 0.2860) / 0.3530
    torch.testing.assert_close(x[0, 0], expected)
    assert y[0].item() == int(test_split.labels[0])
    everything = torch.cat([b[0] for b in batches])
    assert abs(everything.mean().item()) < 0.05
    assert abs(everything.std().item() - 1.0) < 0.05


def test_alexnet_gets_upsampled_batches() -> None:
    split = load_split("fashion-mnist", None, "test", "alexnet")
    assert split.spec == DataSpec(channels=1, image_size=64, num_classes=10)
    x, _ = next(iterate_batches(split, 2, 1, seed=0))
    assert x.shape == (2, 1, 64, 64) and x.dtype == torch.float32
    out = models.build_model("alexnet", split.spec)(x)
    assert out.shape == (2, 10)
    torch.testing.assert_close(out.exp().sum(dim=1), torch.ones(2))


# --------------------------------------------------------------------------- order and shards


def _labels(batches) -> torch.Tensor:
    return torch.cat([y for _, y in batches])


def test_shuffle_is_deterministic_per_seed(train: Split) -> None:
    def first(seed: int, n: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
        it = iterate_batches(train, 128, 1, seed=seed)
        return [next(it) for _ in range(n)]

    a, b, c = first(1), first(1), first(2)
    for (xa, ya), (xb, yb) in zip(a, b, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not torch.equal(_labels(a), _labels(c))
    # every epoch is a fresh permutation
    assert not torch.equal(epoch_indices(60_000, 0, 1), epoch_indices(60_000, 1, 1))
    assert torch.equal(epoch_indices(60_000, 1, 1), epoch_indices(60_000, 1, 1))
    assert torch.equal(epoch_indices(10, 0, 1, shuffle=False), torch.arange(10))


def test_shards_are_disjoint_and_cover(train: ArraySplit) -> None:
    n, count = len(train), 7
    shards = [epoch_indices(n, 3, seed=5, shard=(i, count)) for i in range(count)]
    for i, indices in enumerate(shards):
        assert torch.all(indices % count == i)
    union = torch.cat(shards)
    assert len(union) == n and torch.equal(union.sort().values, torch.arange(n))

    # the batches really come from that order, and their count is steps_per_epoch
    shard = (2, count)
    steps = steps_per_epoch(train, 100, shard)
    assert steps == len(shards[2]) // 100 == 85
    assert steps_per_epoch(train, 100, shard, drop_last=False) == 86
    batches = list(iterate_batches(train, 100, 2, seed=5, shard=shard))
    assert len(batches) == 2 * steps
    want = np.concatenate(
        [train.labels[epoch_indices(n, e, 5, shard)[: steps * 100].numpy()] for e in (0, 1)]
    )
    assert torch.equal(_labels(batches), torch.from_numpy(want.astype(np.int64)))


def test_iteration_argument_errors(test_split: Split) -> None:
    with pytest.raises(UsageError, match="batch size"):
        iterate_batches(test_split, 5_000, 1, seed=0, shard=(0, 3))
    with pytest.raises(UsageError, match="shard"):
        iterate_batches(test_split, 10, 1, seed=0, shard=(3, 3))
    with pytest.raises(UsageError):
        steps_per_epoch(test_split, 0)


def test_synthetic_is_deterministic_and_shaped() -> None:
    small = load_split("synthetic", None, "train", "mnist-cnn", synthetic_size=1000)
    assert len(small) == 1000
    assert len(load_split("synthetic", None, "test", "resnet18")) == 10_000
    a = list(iterate_batches(small, 100, 2, seed=3))
    b = list(iterate_batches(small, 100, 2, seed=3))
    c = list(iterate_batches(small, 100, 1, seed=4))
    assert len(a) == 20
    assert all(
        torch.equal(x1, x2) and torch.equal(y1, y2) for (x1, y1), (x2, y2) in zip(a, b, strict=True)
    )
    assert not torch.equal(a[0][0], a[1][0]) and not torch.equal(a[0][0], c[0][0])
    x, y = a[0]
    assert x.shape == (100, 1, 28, 28) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert 0 <= int(y.min()) and int(y.max()) < 10
    big = load_split("synthetic", None, "train", "resnet18", synthetic_size=4)
    x, y = next(iterate_batches(big, 2, 1, seed=0))
    assert x.shape == (2, 3, 224, 224) and int(y.max()) < 1000


# --------------------------------------------------------------------------- dataset checks


def test_check_dataset_accepts_real_and_copied_data(tmp_path: Path) -> None:
    """It returns the number of training samples (0 for synthetic data: it has no files)."""
    assert check_dataset("fashion-mnist", None) == 60000
    copy = _fashion_copy(tmp_path / "FashionMNIST" / "raw")
    assert check_dataset("fashion-mnist", str(copy)) == 60000
    assert check_dataset("fashion-mnist", str(tmp_path)) == 60000  # FashionMNIST/raw/ below
    assert check_dataset("synthetic", None) == 0


def _spoiled(tmp_path: Path, name: str, content: bytes) -> Path:
    directory = _fashion_copy(tmp_path / "d")
    target = directory / name
    target.unlink()
    target.write_bytes(content)
    return directory


def test_truncated_gzip_is_rejected(tmp_path: Path) -> None:
    whole = (FASHION / "t10k-labels-idx1-ubyte.gz").read_bytes()
    directory = _spoiled(tmp_path, "t10k-labels-idx1-ubyte.gz", whole[: len(whole) // 2])
    with pytest.raises(DataError, match="t10k-labels-idx1-ubyte.gz.*gzip") as err:
        check_dataset("fashion-mnist", str(directory))
    assert "\n" not in str(err.value)


def test_gzip_with_short_content_is_rejected(tmp_path: Path) -> None:
    raw = gzip.decompress((FASHION / "t10k-labels-idx1-ubyte.gz").read_bytes())
    directory = _spoiled(tmp_path, "t10k-labels-idx1-ubyte.gz", gzip.compress(raw[:5000]))
    with pytest.raises(DataError, match="truncated"):
        check_dataset("fashion-mnist", str(directory))
    with pytest.raises(DataError, match="truncated"):
        load_split("fashion-mnist", str(directory), "test", "mnist-cnn")


def test_uncompressed_files_are_checked_against_header(tmp_path: Path) -> None:
    directory = _fashion_copy(tmp_path / "d")
    (directory / "train-labels-idx1-ubyte.gz").unlink()
    header = bytes([0, 0, 8, 1]) + (60_000).to_bytes(4, "big")
    (directory / "train-labels-idx1-ubyte").write_bytes(header + bytes(59_999))
    with pytest.raises(DataError, match="train-labels-idx1-ubyte is truncated"):
        check_dataset("fashion-mnist", str(directory))
    (directory / "train-labels-idx1-ubyte").write_bytes(header + bytes(60_000))
    check_dataset("fashion-mnist", str(directory))  # plain IDX is accepted too


def test_wrong_magic_is_rejected(tmp_path: Path) -> None:
    directory = _spoiled(
        tmp_path, "train-images-idx3-ubyte.gz", gzip.compress(b"<html>not found</html>" * 10)
    )
    with pytest.raises(DataError, match="not an IDX file"):
        check_dataset("fashion-mnist", str(directory))


def test_missing_data_is_reported(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        check_dataset("fashion-mnist", str(tmp_path / "nowhere"))
    with pytest.raises(DataError, match="not found"):
        check_dataset("fashion-mnist", str(tmp_path))
    (tmp_path / "t10k-images-idx3-ubyte.gz").symlink_to(FASHION / "t10k-images-idx3-ubyte.gz")
    with pytest.raises(DataError, match="lacks t10k-labels-idx1-ubyte"):
        load_split("fashion-mnist", str(tmp_path), "test", "mnist-cnn")
    with pytest.raises(DataError, match="imagenet"):
        check_dataset("imagenet", str(tmp_path))
    with pytest.raises(DataError, match="--data-dir"):
        load_split("imagenet", None, "train", "resnet18")


def test_mnist_found_on_disk_or_reported_offline(tmp_path: Path, monkeypatch) -> None:
    _fashion_copy(tmp_path / "MNIST" / "raw")  # same IDX format: stands in for MNIST
    split = load_split("mnist", str(tmp_path), "test", "mnist-cnn")
    x, _ = next(iterate_batches(split, 10_000, 1, seed=0, shuffle=False))
    assert abs(x.mean().item() - (0.2868 - 0.1307) / 0.3081) < 0.05  # MNIST statistics used

    def no_network(*args, **kwargs):
        raise OSError("Name or service not known")

    fake = types.ModuleType("torchvision")
    fake.datasets = types.SimpleNamespace(MNIST=no_network)
    monkeypatch.setitem(sys.modules, "torchvision", fake)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match="could not be downloaded.*--dataset fashion-mnist"):
        check_dataset("mnist", str(empty))


def test_unknown_names_are_usage_errors(test_split: Split) -> None:
    with pytest.raises(UsageError, match="fashion-mnist"):
        check_dataset("cifar10", None)
    with pytest.raises(UsageError, match="synthetic"):
        load_split("cifar10", None, "train", "mnist-cnn")
    with pytest.raises(UsageError, match="resnet18"):
        dataset_spec("fashion-mnist", "vgg")
    with pytest.raises(UsageError, match="train"):
        load_split("fashion-mnist", None, "validation", "mnist-cnn")
    with pytest.raises(UsageError, match="mnist-cnn, alexnet, resnet18"):
        models.build_model("vgg", test_split.spec)
    with pytest.raises(UsageError, match="mnist-cnn"):
        dataset_spec("imagenet", "mnist-cnn")


def test_dataset_specs() -> None:
    assert dataset_spec("mnist", "resnet18") == DataSpec(1, 28, 10)
    assert dataset_spec("fashion-mnist", "alexnet") == DataSpec(1, 64, 10)
    assert dataset_spec("imagenet", "alexnet") == DataSpec(3, 224, 1000)
    assert dataset_spec("synthetic", "mnist-cnn") == DataSpec(1, 28, 10)
    assert dataset_spec("synthetic", "resnet18") == DataSpec(3, 224, 1000)


# --------------------------------------------------------------------------- models


def test_mnist_cnn_is_the_papers_net(test_split: Split) -> None:
    model = models.build_model("mnist-cnn", test_split.spec)
    assert sum(p.numel() for p in model.parameters()) == 163_790
    x, _ = next(iterate_batches(test_split, 16, 1, seed=0))
    out = model(x)
    assert out.shape == (16, 10)
    torch.testing.assert_close(out.exp().sum(dim=1), torch.ones(16))


def test_resnet18_on_single_channel_28px() -> None:
    spec = dataset_spec("fashion-mnist", "resnet18")
    model = models.build_model("resnet18", spec).eval()
    out = model(torch.randn(2, 1, 28, 28))
    assert out.shape == (2, 10)
    torch.testing.assert_close(out.exp().sum(dim=1), torch.ones(2))


class _Uniform(torch.nn.Module):
    """Equal log-probabilities: loss log(10) and argmax 0, so evaluate's result is known."""

    def __init__(self) -> None:
        super().__init__()
        self.drop = torch.nn.Dropout()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert not self.training and not torch.is_grad_enabled()
        return torch.full((x.shape[0], 10), -math.log(10.0))


def test_evaluate(test_split: Split) -> None:
    batches = list(itertools.islice(iterate_batches(test_split, 50, 1, seed=0), 3))
    labels = _labels(batches)
    model = _Uniform().train()
    model.drop.eval()  # a mixed state must come back exactly
    loss, acc = models.evaluate(model, batches, torch.device("cpu"))
    assert loss == pytest.approx(math.log(10.0))
    assert acc == pytest.approx((labels == 0).float().mean().item())
    assert model.training and not model.drop.training
    assert all(math.isnan(v) for v in models.evaluate(model, [], torch.device("cpu")))

    cnn = models.build_model("mnist-cnn", test_split.spec)
    loss, acc = models.evaluate(cnn, batches, torch.device("cpu"))
    assert 1.5 < loss < 3.5 and 0.0 <= acc <= 1.0
    assert cnn.training


@pytest.mark.mpi
def test_mnist_path_never_imports_torchvision() -> None:
    code = textwrap.dedent("""
        import sys
        import torch
        from gem_mpi.problem import models
        from gem_mpi.problem.batches import iterate_batches
        from gem_mpi.problem.datasets import check_dataset, load_split
        for dataset in ("fashion-mnist", "synthetic"):
            split = load_split(dataset, None, "test", "mnist-cnn", synthetic_size=256)
            model = models.build_model("mnist-cnn", split.spec)
            batches = iterate_batches(split, 128, 1, seed=0)
            models.evaluate(model, batches, torch.device("cpu"))
        check_dataset("fashion-mnist", None)
        assert "torchvision" not in sys.modules, "torchvision was imported"
    """)
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr


def test_imagenet_folder_tree(tmp_path: Path) -> None:
    from PIL import Image  # comes with torchvision, which the imagenet path needs anyway

    rng = np.random.default_rng(0)
    for sub in ("train", "val"):
        for cls in ("n01", "n02"):
            (tmp_path / sub / cls).mkdir(parents=True)
            for i in range(3):
                pixels = rng.integers(0, 256, (40, 48, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(tmp_path / sub / cls / f"{i}.png")
    check_dataset("imagenet", str(tmp_path))
    train_split = load_split("imagenet", str(tmp_path), "train", "resnet18")
    val_split = load_split("imagenet", str(tmp_path), "test", "resnet18")
    assert len(train_split) == len(val_split) == 6
    batches = list(iterate_batches(train_split, 2, 2, seed=0, shard=(0, 2)))
    assert len(batches) == 2 * steps_per_epoch(train_split, 2, (0, 2)) == 2
    x, y = batches[0]
    assert x.shape == (2, 3, 224, 224) and x.dtype == torch.float32 and y.dtype == torch.int64
    val = list(iterate_batches(val_split, 4, 1, seed=0, shuffle=False, drop_last=False))
    assert _labels(val).tolist() == [0, 0, 0, 1, 1, 1]
    out = models.build_model("resnet18", val_split.spec).eval()(val[0][0])
    assert out.shape == (4, 1000)

    (tmp_path / "val" / "n03").mkdir()
    with pytest.raises(DataError, match="class folders"):
        check_dataset("imagenet", str(tmp_path))


def test_start_skips_batches_exactly():
    """A resumed worker sees the batches it would have seen: the stream's tail."""
    for name, size in (("fashion-mnist", None), ("synthetic", 2000)):
        split = load_split(name, None, "train", "mnist-cnn", synthetic_size=size)
        full = list(iterate_batches(split, 64, 2, seed=3, shard=(1, 3)))
        for start in (0, 1, 5, len(full) // 2, len(full) - 1, len(full)):
            tail = list(iterate_batches(split, 64, 2, seed=3, shard=(1, 3), start=start))
            assert len(tail) == len(full) - start
            for (x, y), (x2, y2) in zip(tail, full[start:]):
                assert torch.equal(x, x2) and torch.equal(y, y2)


def test_unpacked_fashion_mnist_holds_the_same_bytes_and_is_written_once(tmp_path):
    """tools/install.sh's copy (gem_mpi.problem.idx.unpack): the IDX bytes of Debian's gzip
    files, read as they are; a second unpack writes nothing; a torn copy is written again."""
    from gem_mpi.problem.idx import read_split, unpack

    dest = tmp_path / "FashionMNIST" / "raw"
    assert len(unpack(FASHION, dest)) == 4
    for name in IDX_NAMES:
        assert (dest / name).read_bytes() == gzip.decompress((FASHION / f"{name}.gz").read_bytes())
    assert not list(dest.glob(".*"))  # no temporary file left
    assert unpack(FASHION, dest) == []
    x, y = read_split("fashion-mnist", str(tmp_path), "test")
    x0, y0 = read_split("fashion-mnist", str(FASHION), "test")
    assert np.array_equal(x, x0) and np.array_equal(y, y0)
    labels = dest / "t10k-labels-idx1-ubyte"
    labels.write_bytes(labels.read_bytes()[:100])
    assert unpack(FASHION, dest) == [labels]
    assert np.array_equal(read_split("fashion-mnist", str(tmp_path), "test")[1], y0)
