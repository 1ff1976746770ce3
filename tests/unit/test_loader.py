"""--loader-workers in-process: the loader processes give the batches the worker's own
process makes, bit for bit, for every kind of dataset, from any start and on any shard; they
hand torch's generator back as making the batch left it (the model's dropout draws on from
there); they ignore the stop signals and end on close(). The bad inputs are one line.
tests/test_loader_workers.py runs them in real mpirun jobs."""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from gem_mpi import config
from gem_mpi.errors import UsageError
from gem_mpi.problem import loader as loader_module
from gem_mpi.problem.datasets import load_split
from gem_mpi.problem.idx import DEBIAN_FASHION_MNIST_DIR
from gem_mpi.problem.loader import LoaderBatches, load_batches
from gem_mpi.problem.seeds import seed_step
from gem_mpi.problem.splits import Split
from gem_mpi.problem.user import register
from gem_mpi.run import preflight
from gem_mpi.run.rank import data_stream

pytestmark = pytest.mark.mpi  # loader processes are processes: out of the fast loop

SEED, WORKER = 3, 2  # the (seed, worker) each step's generator is seeded from
FASHION = DEBIAN_FASHION_MNIST_DIR / "train-images-idx3-ubyte.gz"


class _Augmented(Dataset):
    """A user's dataset whose samples draw from torch's global generator (augmentation)."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(11)
        self.x, self.y = torch.randn(n, 5, generator=g), torch.arange(n) % 3

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i] + 0.1 * torch.randn(5), self.y[i]


def augmented(split: str) -> Dataset:
    return _Augmented(90 if split == "train" else 30)


def _image_folder(root: Path) -> Path:
    """An ImageFolder tree (train/ and val/, two classes) of small random PNG images."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for sub in ("train", "val"):
        for label in ("a", "b"):
            folder = root / sub / label
            folder.mkdir(parents=True)
            for i in range(6):
                pixels = rng.integers(0, 256, (20, 24, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(folder / f"{i}.png")
    return root


def _split(kind: str, tmp_path: Path) -> Split:
    if kind == "fashion-mnist":
        return load_split("fashion-mnist", None, "train", "mnist-cnn")
    if kind == "alexnet-upsampled":  # the arrays' batches resized on the way (bilinear)
        return load_split("fashion-mnist", None, "train", "alexnet")
    if kind == "synthetic":
        return load_split("synthetic", None, "train", "mnist-cnn", synthetic_size=500)
    if kind == "user":
        return load_split(register(augmented, "--dataset"), None, "train", "")
    # imagenet's ImageFolder: decoding, RandomResizedCrop and flips drawn from the generator
    return load_split("imagenet", str(_image_folder(tmp_path)), "train", "alexnet")


def _take(split: Split, workers: int, batch: int, epochs: int, count: int, start: int,
          shard: tuple[int, int] | None) -> list[tuple[torch.Tensor, ...]]:
    """``count`` batches as a worker takes them (its step's seed set first), each with a
    draw from the generator after it (what the model's dropout would draw)."""
    stream = load_batches(split, batch, epochs, seed=SEED * 100_003 + WORKER, shard=shard,
                          start=start, workers=workers, step_seed=(SEED, WORKER))
    out = []
    try:
        for step in range(start, start + count):
            seed_step(SEED, WORKER, step)
            x, y = next(stream)
            out.append((x, y, torch.rand(4)))
    finally:
        stream.close()
    return out


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bytes(a.numpy()) == bytes(b.numpy())


needs_fashion = pytest.mark.skipif(not FASHION.is_file(),
                                   reason="needs the Debian package dataset-fashion-mnist")


@pytest.mark.parametrize("kind, batch, epochs, count, start, shard", [
    pytest.param("fashion-mnist", 64, 2, 12, 0, None, marks=needs_fashion),
    pytest.param("fashion-mnist", 32, 2, 9, 620, (1, 3), marks=needs_fashion),  # epoch edge
    pytest.param("alexnet-upsampled", 8, 1, 5, 40, None, marks=needs_fashion),
    ("synthetic", 50, 3, 14, 7, None),
    ("synthetic", 20, 2, 8, 3, (0, 2)),
    ("user", 8, 4, 30, 0, None),
    ("user", 7, 5, 11, 9, (2, 3)),  # a shard of 30 samples: 4 batches an epoch
    ("imagenet", 4, 3, 7, 2, None),
])
def test_loader_processes_give_the_in_process_batches_bit_for_bit(
        tmp_path, kind, batch, epochs, count, start, shard):
    split = _split(kind, tmp_path)
    mine = _take(split, 0, batch, epochs, count, start, shard)
    loaded = _take(split, 2, batch, epochs, count, start, shard)
    assert len(mine) == len(loaded) == count
    for step, (a, b) in enumerate(zip(mine, loaded, strict=True), start):
        for part, u, v in zip(("input", "target", "the draw after"), a, b, strict=True):
            assert _same_bits(u, v), f"{kind}: step {step}, {part} differs"
    if kind in ("user", "imagenet"):  # the generator mattered: another seed differs
        other = load_batches(split, batch, epochs, seed=SEED * 100_003 + WORKER, shard=shard,
                             start=start, workers=1, step_seed=(SEED + 1, WORKER))
        x, _ = next(other)
        other.close()
        assert not torch.equal(x, loaded[0][0])


def test_the_stream_ends_where_the_plan_ends():
    split = load_split("synthetic", None, "train", "mnist-cnn", synthetic_size=100)
    stream = load_batches(split, 25, 2, seed=1, start=5, workers=2, step_seed=(0, 1))
    assert len([b for b in stream]) == 3  # 8 batches in all, from the 6th on
    stream.close()
    stream.close()  # twice: nothing left to end


def _children() -> set[int]:
    """Live processes whose parent is this one (from /proc; zombies are ended)."""
    me, out = os.getpid(), set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == me and fields[0] != "Z":
            out.add(int(entry.name))
    return out


def test_loader_processes_ignore_stop_signals_and_end_on_close():
    """A stop signal sent to the whole job reaches the loader processes too: the rank handles
    it and closes its loader, so they must outlive the signal, then end on close()."""
    before = _children()
    split = load_split("synthetic", None, "train", "mnist-cnn", synthetic_size=400)
    stream = load_batches(split, 10, 2, seed=1, workers=2, step_seed=(0, 1))
    assert isinstance(stream, LoaderBatches)
    next(stream)
    loaders = _children() - before
    assert len(loaders) == 2
    for pid in loaders:
        for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
            os.kill(pid, sig)
    time.sleep(0.3)
    for _ in range(20):  # they go on making batches
        next(stream)
    assert _children() - before == loaders
    stream.close()
    assert not _children() & loaders


def test_a_stop_signal_during_the_loaders_start_does_not_kill_them(monkeypatch):
    """A scheduler signals every process of the job: one that lands before a loader process
    has set its signals (held here for 0.5 s) waits, blocked, and is then dropped."""
    start = loader_module._follow_the_rank

    def slow_start(parent: int, worker_id: int) -> None:
        time.sleep(0.5)
        start(parent, worker_id)

    monkeypatch.setattr(loader_module, "_follow_the_rank", slow_start)
    before = _children()
    split = load_split("synthetic", None, "train", "mnist-cnn", synthetic_size=400)
    stream = load_batches(split, 10, 2, seed=1, workers=2, step_seed=(0, 1))
    loaders = _children() - before
    assert len(loaders) == 2
    for pid in loaders:  # still in slow_start's sleep
        os.kill(pid, signal.SIGTERM)
    for _ in range(20):
        next(stream)
    assert _children() - before == loaders
    stream.close()


def test_data_stream_takes_loader_workers_from_the_config():
    cfg = config.Config.of(dataset="synthetic", synthetic_size=300, batch_size=30, epochs=2,
                           max_steps=15, loader_workers=2)
    steps, stream = data_stream(cfg.data, 2, 3, start_seq=4)
    try:
        assert steps == 15 and isinstance(stream, LoaderBatches)
    finally:
        stream.close()
    _, own = data_stream(dataclasses.replace(cfg.data, loader_workers=0), 2, 3, start_seq=4)
    assert not isinstance(own, LoaderBatches)


# --- bad input: one line, before anything runs ----------------------------------------------


def _validate(*argv: str) -> None:
    cfg, _ = config.parse(list(argv))
    preflight.validate(cfg, 3, data=False)


def test_loader_workers_bad_input_is_one_line(monkeypatch):
    with pytest.raises(UsageError, match=r"^--loader-workers must be >= 0, got -1$"):
        _validate("--loader-workers", "-1")
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    _validate("--loader-workers", "4")
    with pytest.raises(UsageError, match=r"^--loader-workers 5 is more than the 4 cores of "
                                         r"rank 0's node \(each worker rank starts"):
        _validate("--loader-workers", "5")
    with pytest.raises(UsageError, match=r"^--model quadratic uses no data: --loader-workers "
                                         r"does not apply$"):
        _validate("--model", "quadratic", "--dataset", "synthetic", "--loader-workers", "1")
    _validate("--model", "quadratic", "--dataset", "synthetic", "--loader-workers", "0")
