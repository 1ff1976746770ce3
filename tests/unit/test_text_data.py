"""``--dataset text`` in-process: samples are windows whose targets are the next bytes, the
splits are disjoint by file and a function of the names alone, and the language model's
output is what nll_loss and the evaluation take."""

from __future__ import annotations

import numpy as np
import torch

from gem_mpi.problem import text
from gem_mpi.problem.models import ByteGPT, evaluate
from gem_mpi.problem.spec import dataset_spec
from gem_mpi.problem.splits import TextSplit


def _corpus(tmp_path, files: int = 40):
    for i in range(files):
        (tmp_path / f"d{i % 3}").mkdir(exist_ok=True)
        (tmp_path / f"d{i % 3}" / f"f{i}.txt").write_text(f"file {i}: " + "abc" * (i + 5))
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01binary")  # not text: never read
    return tmp_path


def test_the_splits_are_disjoint_by_file_and_a_function_of_the_names(tmp_path):
    root = _corpus(tmp_path)
    found = text.files(root, default=False)
    assert len(found) == 40 and all(p.suffix == ".txt" for p in found)
    test = {p for p in found if text.in_test(p, root)}
    assert 0 < len(test) < 40
    train, held = text.read_split(str(root), "train"), text.read_split(str(root), "test")
    assert len(train) + len(held) == sum(p.stat().st_size for p in found)
    assert len(text.read_split(str(root), "test", limit=7)) == 7


def test_a_sample_is_a_window_and_its_next_bytes():
    data = np.frombuffer(bytes(range(100)), np.uint8)
    split = TextSplit("train", dataset_spec("text", "gpt", context=8), data)
    assert len(split) == 99 // 8
    x, y = split.make(torch.tensor([0, 3]), 0, 0, 0)
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (2, 8)
    assert x[1].tolist() == list(range(24, 32)) and y[1].tolist() == list(range(25, 33))


def test_the_model_predicts_every_position_and_is_causal():
    torch.manual_seed(0)
    model = ByteGPT(256, 16, layers=1, heads=2, width=16)
    x = torch.randint(0, 256, (3, 16))
    out = model(x)
    assert out.shape == (3, 256, 16)  # classes on dim 1: nll_loss over every position
    x2 = x.clone()
    x2[:, 10] = (x2[:, 10] + 1) % 256
    assert torch.equal(model(x2)[..., :10], out[..., :10])  # no position sees the future
    loss, acc = evaluate(model, [(x, x)], torch.device("cpu"))
    assert abs(loss - torch.nn.functional.nll_loss(out, x).item()) < 1e-5 and 0 <= acc <= 1


def test_holdout_holds_whole_training_files_apart_and_never_a_test_file(tmp_path):
    """--holdout on text: one training file in ten (by name) is validation, out of training;
    the test split is the same as without it; --holdout N evaluates its first N bytes."""
    from gem_mpi.config import DataConfig
    from gem_mpi.problem.datasets import evaluation_split, training_split

    root = _corpus(tmp_path, files=80)
    found = text.files(root, default=False)
    kinds = {p: text.split_of(p, root, holdout=True) for p in found}
    val = [p for p in found if kinds[p] == "validation"]
    assert val and all(not text.in_test(p, root) for p in val)
    assert {text.split_of(p, root, holdout=False) for p in val} == {"train"}
    size = {k: sum(p.stat().st_size for p in found if kinds[p] == k) for k in set(kinds.values())}
    assert len(text.read_split(str(root), "validation")) == size["validation"]
    assert len(text.read_split(str(root), "train", holdout=True)) == size["train"]
    assert len(text.read_split(str(root), "train")) == size["train"] + size["validation"]
    assert len(text.read_split(str(root), "test")) == size["test"]
    held = b"".join(p.read_bytes() for p in val)
    data = DataConfig(dataset="text", model="gpt", data_dir=str(root), context=4, holdout=20)
    ev, tr = evaluation_split(data), training_split(data)
    assert ev.split == "validation" and bytes(ev.data) == held[:20]  # type: ignore[attr-defined]
    assert len(tr.data) == size["train"]  # type: ignore[attr-defined]
    assert held not in bytes(tr.data)  # type: ignore[attr-defined]
