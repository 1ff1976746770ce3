"""Outputs that cannot be written: a read-only directory, a file system that runs low or
fills up. Real file systems: small tmpfs mounts and a read-only bind mount (needs root with
the right to mount; skipped where mounting is not allowed). And what is an HDF5 write error
during a write: HDF5's and h5py's own reports, not any text on stderr."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import h5py
import numpy as np
import pytest
from helpers import quadratic_args, train

from gem_mpi.outputs import checkpoint
from gem_mpi.outputs.files import h5py_write_errors, os_reason
from gem_mpi.outputs.runfile import load_run

QUAD = quadratic_args(method="downpour", dim=1000, eval_every=0)


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


@pytest.mark.mpi
def test_low_space_stops_cleanly_and_resume_finishes(small_fs, tmp_path):
    fs = small_fs("4m")
    h5, ck = fs / "run.h5", tmp_path / "ck"
    ck.mkdir()
    args = [*QUAD, "--max-steps", "30000", "--metrics", str(h5), "--min-free-mb", "3",
            "--checkpoint-dir", str(ck), "--checkpoint-every", "0"]
    res = train(3, *args, timeout=300)
    assert res.returncode == 5, res.stderr  # an output could not be written
    [line] = _error_lines(res.stderr)
    assert "below --min-free-mb 3" in line and "free space, then --resume auto" in line
    assert "Traceback" not in res.stderr
    run = load_run(h5)  # closed properly: readable, unfinished, rows = applied updates
    assert run.summary["finished"] == 0.0
    n = run.updates["clock"].size
    assert 0 < n < 60000 and np.array_equal(run.updates["clock"], np.arange(n))
    state = checkpoint.load(checkpoint.latest(str(ck)))
    assert state.clock == n == state.rows_updates
    # space freed (the file system grown), the run continues in the same file to the end
    _mount("-o", "remount,size=64m", str(fs))
    res = train(3, *args, "--resume", "auto", timeout=300)
    assert res.returncode == 0, res.stderr
    run = load_run(h5)
    assert run.summary["finished"] == 1.0
    assert np.array_equal(run.updates["clock"], np.arange(60000))


@pytest.mark.mpi
def test_disk_full_while_writing_metrics_is_one_line_and_a_readable_file(small_fs, tmp_path):
    fs = small_fs("1m")
    h5, ck = fs / "run.h5", tmp_path / "ck"
    ck.mkdir()
    res = train(3, *QUAD, "--max-steps", "40000", "--metrics", str(h5), "--min-free-mb", "0",
                "--checkpoint-dir", str(ck), "--checkpoint-every", "0", timeout=300)
    assert res.returncode == 5, res.stderr  # an output could not be written
    [line] = _error_lines(res.stderr)
    assert "writing failed (No space left on device)" in line
    assert "Traceback" not in res.stderr and "Segmentation" not in res.stderr
    if "could not be repaired" in line:  # never deleted: moved aside, bytes kept
        assert not h5.exists() and (fs / "run.h5.damaged").exists()
    else:  # cut back to the rows that reached the disk: no row of zeros read back as data
        # (none may have: with osc sm the first 2-second flush can outgrow the 1 MB)
        run = load_run(h5)
        n = run.updates["clock"].size
        assert np.array_equal(run.updates["clock"], np.arange(n))
        assert np.all(run.updates["worker"] > 0)
    assert checkpoint.latest(str(ck)) is not None


@pytest.mark.mpi
def test_checkpoint_on_a_full_disk_leaves_no_partial_file(small_fs, tmp_path):
    ck = small_fs("64k")  # θ of 100 000 floats (400 kB) cannot fit
    res = train(3, *quadratic_args(method="downpour", dim=100000, steps=3000, eval_every=0,
                                   metrics=tmp_path / "run.h5", checkpoint_dir=ck,
                                   checkpoint_every=0.2), timeout=300)
    assert res.returncode == 5, res.stderr  # an output could not be written
    [line] = _error_lines(res.stderr)
    assert "checkpoint" in line and "No space left on device" in line
    assert "there is no earlier one" in line and "Traceback" not in res.stderr
    assert [p.name for p in ck.iterdir()] == [".gem_mpi.lock"]  # no temporary file left
    assert load_run(tmp_path / "run.h5").summary["finished"] == 0.0


@pytest.mark.mpi
def test_save_that_does_not_fit_leaves_no_partial_file(small_fs, tmp_path):
    fs = small_fs("64k")  # θ of 100 000 floats (400 kB) cannot fit
    res = train(3, *quadratic_args(method="downpour", dim=100000, steps=20, eval_every=0,
                                   save=fs / "theta.npy", checkpoint_dir=tmp_path,
                                   checkpoint_every=0), timeout=300)
    assert res.returncode == 5, res.stderr  # an output could not be written
    [line] = _error_lines(res.stderr)
    assert "--save" in line and "No space left on device" in line
    assert "Traceback" not in res.stderr
    assert list(fs.iterdir()) == []  # neither the file nor its temporary
    assert checkpoint.latest(str(tmp_path)) is not None  # θ itself is not lost


@pytest.mark.mpi
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


# --- what h5py_write_errors turns into an exception, and what it leaves alone ---------------

# HDF5's error-stack report as HDF5 2.0 prints it for a write on a full disk (abridged to its
# first and last entries); the OS error's time stamp ends in a newline, so that entry's
# text runs onto an unindented line
HDF5_DIAG = """\
HDF5-DIAG: Error detected in HDF5 (2.0.0):
  #000: /src/H5D.c line 1360 in H5Dwrite(): can't synchronously write data
    major: Dataset
    minor: Write failed
  #016: /src/H5FDsec2.c line 770 in H5FD__sec2_write(): file write failed: time = Wed Dec  2 19:53:34 2026
, filename = '/tmp/fsx/a.h5', file descriptor = 3, errno = 28, error message = 'No space left on device', offset = 65536
    major: Low-level I/O
    minor: Write failed
"""


def test_stderr_text_with_error_in_it_that_is_not_hdf5s_passes_through(capsys):
    text = "worker 2: Error: batch 7 skipped\nRuntimeError: not from h5py\n"
    with h5py_write_errors():
        sys.stderr.write(text[:20])
        t = threading.Thread(target=lambda: sys.stderr.write(text[20:]))  # any thread
        t.start()
        t.join()
    assert capsys.readouterr().err == text  # unchanged, and nothing raised


def test_an_unraisable_exception_not_from_h5py_goes_to_the_usual_hook(monkeypatch):
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)

    class Finalizer:
        def __del__(self) -> None:
            raise ValueError("Error in a finalizer that is not h5py's")

    with h5py_write_errors():
        obj = Finalizer()
        del obj
    assert [type(info.exc_value) for info in seen] == [ValueError]


def test_an_hdf5_error_report_raises_oserror_and_the_rest_passes_through(capsys):
    with pytest.raises(OSError) as caught, h5py_write_errors():
        sys.stderr.write("before: Error in a log line\n" + HDF5_DIAG + "after\n")
    assert os_reason(caught.value) == "No space left on device"
    assert str(caught.value).startswith("HDF5: file write failed: time = ")
    assert capsys.readouterr().err == "before: Error in a log line\nafter\n"


@pytest.mark.mpi
def test_a_write_that_fails_as_h5py_frees_a_file_is_one_exception(small_fs, capsys):
    """The real case: h5py writes the file's metadata as the File object is freed, finds
    the disk full, and only prints the error (sys.excepthook, then sys.unraisablehook)."""
    fs = small_fs("64k")
    with pytest.raises((OSError, RuntimeError), match="No space left on device"), \
            h5py_write_errors():
        f = h5py.File(fs / "a.h5", "w", libver="latest", rdcc_nbytes=0)
        for i in range(400):  # ~180 kB of metadata, held in HDF5's cache until the close
            f.create_group(f"g{i}").attrs["a"] = np.arange(20)
        del f
    assert capsys.readouterr().err == ""  # raised, not printed
