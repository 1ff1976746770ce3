"""Outputs that cannot be written: a read-only directory, a file system that runs low or
fills up. Real file systems: small tmpfs mounts and a read-only bind mount (needs root with
the right to mount; skipped where mounting is not allowed)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import train

from gem_mpi import checkpoint
from gem_mpi.metrics import read_run

QUAD = ["--model", "quadratic", "--dataset", "synthetic", "--method", "downpour",
        "--quadratic-dim", "1000", "--eval-every", "0"]


def _mount(*args: str) -> None:
    res = subprocess.run(["mount", *args], capture_output=True, text=True, check=False)
    if res.returncode != 0:
        pytest.skip(f"cannot mount here ({res.stderr.strip()})")


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[callable]:
    """small_fs(size) -> a directory on a fresh tmpfs of that size, unmounted afterwards."""
    mounted: list[Path] = []

    def make(size: str) -> Path:
        d = tmp_path / f"fs{len(mounted)}"
        d.mkdir()
        _mount("-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(d))
        mounted.append(d)
        return d

    yield make
    for d in mounted:
        subprocess.run(["umount", "-l", str(d)], check=False)


def _error_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("gem_mpi:") and "error" in ln]


def test_low_space_stops_cleanly_and_resume_finishes(small_fs, tmp_path):
    fs = small_fs("4m")
    h5, ck = fs / "run.h5", tmp_path / "ck"
    ck.mkdir()
    args = [*QUAD, "--max-steps", "30000", "--metrics", str(h5), "--min-free-mb", "3",
            "--checkpoint-dir", str(ck), "--checkpoint-every", "0"]
    res = train(3, *args, timeout=300)
    assert res.returncode == 1, res.stderr
    [line] = _error_lines(res.stderr)
    assert "below --min-free-mb 3" in line and "free space, then --resume auto" in line
    assert "Traceback" not in res.stderr
    run = read_run(str(h5))  # closed properly: readable, unfinished, rows = applied updates
    assert run["summary"]["finished"] == 0.0
    n = run["updates"]["clock"].size
    assert 0 < n < 60000 and np.array_equal(run["updates"]["clock"], np.arange(n))
    _, state = checkpoint.load(checkpoint.latest(str(ck)))
    assert state["clock"] == n == state["rows_updates"]
    # space freed (the file system grown), the run continues in the same file to the end
    _mount("-o", "remount,size=64m", str(fs))
    res = train(3, *args, "--resume", "auto", timeout=300)
    assert res.returncode == 0, res.stderr
    run = read_run(str(h5))
    assert run["summary"]["finished"] == 1.0
    assert np.array_equal(run["updates"]["clock"], np.arange(60000))


def test_disk_full_while_writing_metrics_is_one_line_and_a_readable_file(small_fs, tmp_path):
    fs = small_fs("1m")
    h5, ck = fs / "run.h5", tmp_path / "ck"
    ck.mkdir()
    res = train(3, *QUAD, "--max-steps", "40000", "--metrics", str(h5), "--min-free-mb", "0",
                "--checkpoint-dir", str(ck), "--checkpoint-every", "0", timeout=300)
    assert res.returncode == 1, res.stderr
    [line] = _error_lines(res.stderr)
    assert "writing failed (No space left on device)" in line
    assert "Traceback" not in res.stderr and "Segmentation" not in res.stderr
    if "was removed" in line:
        assert not h5.exists()
    else:  # cut back to the rows that reached the disk: no row of zeros read back as data
        run = read_run(str(h5))
        n = run["updates"]["clock"].size
        assert n > 0 and np.array_equal(run["updates"]["clock"], np.arange(n))
        assert np.all(run["updates"]["worker"] > 0)
    assert checkpoint.latest(str(ck)) is not None


def test_checkpoint_on_a_full_disk_leaves_no_partial_file(small_fs, tmp_path):
    ck = small_fs("64k")  # θ of 100 000 floats (400 kB) cannot fit
    res = train(3, "--model", "quadratic", "--dataset", "synthetic", "--method", "downpour",
                "--quadratic-dim", "100000", "--max-steps", "3000", "--eval-every", "0",
                "--metrics", str(tmp_path / "run.h5"), "--checkpoint-dir", str(ck),
                "--checkpoint-every", "0.2", timeout=300)
    assert res.returncode == 1, res.stderr
    [line] = _error_lines(res.stderr)
    assert "checkpoint" in line and "No space left on device" in line
    assert "there is no earlier one" in line and "Traceback" not in res.stderr
    assert list(ck.iterdir()) == []  # no temporary file left
    assert read_run(str(tmp_path / "run.h5"))["summary"]["finished"] == 0.0


def test_save_that_does_not_fit_leaves_no_partial_file(small_fs, tmp_path):
    fs = small_fs("64k")  # θ of 100 000 floats (400 kB) cannot fit
    res = train(3, "--model", "quadratic", "--dataset", "synthetic", "--method", "downpour",
                "--quadratic-dim", "100000", "--max-steps", "20", "--eval-every", "0",
                "--save", str(fs / "theta.npy"), "--checkpoint-dir", str(tmp_path),
                "--checkpoint-every", "0", timeout=300)
    assert res.returncode == 1, res.stderr
    [line] = _error_lines(res.stderr)
    assert "--save" in line and "No space left on device" in line
    assert "Traceback" not in res.stderr
    assert list(fs.iterdir()) == []  # neither the file nor its temporary
    assert checkpoint.latest(str(tmp_path)) is not None  # θ itself is not lost


@pytest.mark.parametrize("option", ["--metrics", "--save", "--checkpoint-dir"])
def test_read_only_directory_is_one_line_before_anything_runs(tmp_path, option):
    ro = tmp_path / "ro"
    ro.mkdir()
    _mount("--bind", str(ro), str(ro))
    try:
        _mount("-o", "remount,bind,ro", str(ro))
        target = str(ro) if option == "--checkpoint-dir" else str(ro / "out.h5")
        res = train(3, *QUAD, "--max-steps", "10", option, target, timeout=120)
    finally:
        subprocess.run(["umount", "-l", str(ro)], check=False)
    assert res.returncode == 2, res.stderr
    [line] = _error_lines(res.stderr)
    assert "is not writable" in line and option in line
    assert list(ro.iterdir()) == []
