"""--loader-workers in real mpirun jobs: one GEM worker (--worker-mode wait, deterministic)
trains the same θ bit for bit with its batches made by loader processes (from a resume that
changed --loader-workers) as by itself; and every ending (finished, stopped
by SIGUSR1, diverged, a killed worker) leaves no loader process behind and does not hang.
tests/unit/test_loader.py checks the batches themselves, for every kind of dataset."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import (
    checkpoint_after_start,
    kill_rank_when,
    rank_pids,
    signal_when,
    train,
    train_background,
)

from gem_mpi.outputs.runfile import load_run

pytestmark = pytest.mark.mpi

STEPS = 300  # one worker's steps: a few seconds, long enough to be stopped mid-run


def _args(tmp: Path, loaders: int, *extra: str) -> list[str]:
    """Fashion-MNIST, mnist-cnn, one GEM worker that waits for each of its updates."""
    return ["--max-steps", str(STEPS), "--eval-every", "0", "--worker-mode", "wait",
            "--loader-workers", str(loaders), "--metrics", str(tmp / "run.h5"),
            "--save", str(tmp / "model.pt"), *extra]


def _state(directory: Path) -> Path:
    return directory / "model.pt"


def _same_theta(a: Path, b: Path) -> None:
    """Two saved models, tensor by tensor, bit for bit."""
    sa, sb = (torch.load(p, weights_only=True) for p in (a, b))
    assert list(sa) == list(sb)
    for name in sa:
        assert sa[name].dtype == sb[name].dtype == torch.float32
        assert torch.equal(sa[name].view(torch.int32), sb[name].view(torch.int32)), name


def _live(marker: str) -> dict[int, int]:
    """pid -> parent pid of every live process whose command line holds ``marker`` (this
    test's directory, in every argv of its job: mpirun, the ranks and their forks, the loader
    processes). A zombie has ended."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if marker.encode() in cmdline and state != "Z":
            out[int(entry.name)] = int(ppid)
    return out


def _none_left(marker: str, within: float = 10.0) -> None:
    """No process of the job is alive (now, or within ``within`` seconds)."""
    deadline = time.monotonic() + within
    while (left := _live(marker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"left behind: {left}"


def _loaders_running(proc, marker: str, also: Callable[[], bool] = lambda: True
                     ) -> Callable[[], bool]:
    """Ready once the worker (rank 1) has its 2 loader processes (and ``also``)."""
    def ready() -> bool:
        worker = rank_pids(proc).get(1)
        forks = [pid for pid, ppid in _live(marker).items() if ppid == worker]
        return worker is not None and len(forks) >= 2 and also()
    return ready


@pytest.fixture(scope="module")
def made_here(tmp_path_factory) -> Path:
    """The reference run: the worker makes its batches itself."""
    tmp = tmp_path_factory.mktemp("own")
    res = train(2, *_args(tmp, 0), timeout=300)
    assert res.returncode == 0, res.stderr
    return tmp


def test_sync_workers_train_the_same_theta_with_loader_processes(tmp_path):
    """--method sync: every rank a worker, each with its own loader processes."""
    for loaders in (0, 2):
        out = tmp_path / str(loaders)
        out.mkdir()
        res = train(2, *_args(out, loaders, "--method", "sync", "--max-steps", "40"),
                    timeout=300)
        assert res.returncode == 0, res.stderr
        _none_left(str(out), within=0)
    _same_theta(tmp_path / "0" / "model.pt", tmp_path / "2" / "model.pt")


def test_stopped_without_loader_processes_then_resumed_with_them_is_exact(made_here, tmp_path):
    """Stopped (SIGUSR1) while the worker makes its batches itself, resumed with 2 loader
    processes (a resume may change --loader-workers): they continue the worker's batches
    where it stopped, so θ and every update's loss are the reference run's bit for bit; the
    finished run closes them before the job ends. (A stop while they run: the signal tests
    below.)"""
    extra = ("--checkpoint-dir", str(tmp_path), "--checkpoint-every", "0.3")
    proc = train_background(2, *_args(tmp_path, 0, *extra))
    err = signal_when(proc, checkpoint_after_start(tmp_path))
    assert proc.returncode == 3, err
    assert "Traceback" not in err
    assert 0 < load_run(tmp_path / "run.h5").summary["updates"] < STEPS
    res = train(2, *_args(tmp_path, 2, *extra, "--resume", "auto"), timeout=300)
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr and "Warning" not in res.stderr
    assert "--loader-workers 0 -> 2" in res.stderr
    _none_left(str(tmp_path), within=0)  # closed by the worker, before the job ended
    _same_theta(_state(made_here), _state(tmp_path))
    own, loaded = load_run(made_here / "run.h5"), load_run(tmp_path / "run.h5")
    assert (own.updates["loss"] == loaded.updates["loss"]).all()
    assert json.loads(loaded.attrs["resume_log"])[-1]["changes"] == {"loader_workers": [0, 2]}


def test_a_diverged_run_leaves_no_loader_process(tmp_path):
    """η 1e20 takes θ beyond float32's range within a step or two, whatever the CPU: η 3
    diverged on some machines and on others ended at a dead network's bounded loss."""
    res = train(2, *_args(tmp_path, 2, "--lr", "1e20"), timeout=300)
    assert res.returncode == 4, res.stderr
    assert "the run diverged" in res.stderr and "Traceback" not in res.stderr
    _none_left(str(tmp_path))


def test_a_killed_worker_ends_the_job_and_its_loader_processes(tmp_path):
    """SIGKILL to the worker rank (an OOM kill): mpirun ends the job; the worker's loader
    processes die with it (its parent-death signal), none is left to run on."""
    proc = train_background(2, *_args(tmp_path, 2, "--max-steps", "100000", "--epochs", "5"))
    t0 = time.monotonic()
    code = kill_rank_when(proc, _loaders_running(proc, str(tmp_path)), rank=1)
    assert code != 0 and time.monotonic() - t0 < 90
    # at once: torch's own watchdog would take its loop's 5 s poll to notice
    _none_left(str(tmp_path), within=1.0)


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM])
def test_a_signal_to_the_whole_job_stops_it_cleanly(tmp_path, sig):
    """A scheduler signals every process of the job, the loader processes too: they ignore
    it, the rank stops the run (exit 3) and ends them."""
    extra = ("--checkpoint-dir", str(tmp_path), "--checkpoint-every", "0.3",
             "--max-steps", "100000", "--epochs", "5")
    proc = train_background(2, *_args(tmp_path, 2, *extra))
    err = signal_when(proc, _loaders_running(proc, str(tmp_path)), sig=sig, whole_job=True)
    assert "Traceback" not in err and "DataLoader worker" not in err, err
    if sig == signal.SIGUSR1:  # mpirun forwards it and goes on: the run stops itself
        assert proc.returncode == 3, err
    _none_left(str(tmp_path))
    assert os.path.isfile(tmp_path / "run.h5")
