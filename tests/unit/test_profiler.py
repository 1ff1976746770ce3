"""--profile-steps A:B in-process: the range as parsed, the trace folder, and what
:class:`~gem_mpi.run.profiler.StepProfiler` writes around a small torch loop (a real MPI job's
traces: tests/test_training_loop.py)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from gem_mpi import config
from gem_mpi.config import OutputConfig, step_range
from gem_mpi.run.profiler import StepProfiler, trace_name


@pytest.mark.parametrize("text, steps", [
    ("5:8", (5, 8)), ("0:0", (0, 0)), ("3:3", (3, 3)), ("0:11", (0, 11)),
    ("5:2", None), ("-1:3", None), ("x", None), ("5", None), ("1:2:3", None), ("a:b", None),
    (":4", None), ("2.5:4", None),
])
def test_a_step_range_is_two_step_numbers_in_order(text, steps):
    assert step_range(text) == steps


def test_the_traces_go_to_the_folder_given_or_beside_the_metrics():
    cfg, _ = config.parse(["--profile-steps", "5:8", "--metrics", "runs/a.h5"])
    assert cfg.outputs.profile_steps == "5:8" and cfg.outputs.trace_dir == "runs/a_profile"
    cfg, _ = config.parse(["--metrics", "a.h5", "--profile-dir", "traces"])
    assert cfg.outputs.trace_dir == "traces"
    assert OutputConfig().trace_dir is None


def _events(path: Path) -> list[dict]:
    return json.loads(path.read_text())["traceEvents"]


def _steps(events: list[dict]) -> list[str]:
    return sorted({e["name"] for e in events if e["name"].startswith("ProfilerStep#")})


def _loop(out: OutputConfig, steps: int) -> None:
    """``steps`` steps of a small model, its forward and backward on a thread of its own
    (as --worker-mode overlap computes), a matrix product on the loop's own."""
    model, x = torch.nn.Linear(16, 16), torch.randn(8, 16)
    with StepProfiler(out, rank=7) as prof, ThreadPoolExecutor(1) as pool:
        for _ in range(steps):
            with prof.range("gem_mpi.compute"):
                pool.submit(lambda: model(x).sum().backward()).result()
            torch.mm(x, x.T)
            prof.tick()
    prof.tick()  # closed: nothing happens


def test_the_trace_holds_exactly_the_steps_asked_and_every_threads_operators(tmp_path):
    _loop(OutputConfig(profile_steps="2:4", profile_dir=str(tmp_path / "p")), steps=8)
    events = _events(tmp_path / "p" / trace_name(7))
    assert _steps(events) == ["ProfilerStep#2", "ProfilerStep#3", "ProfilerStep#4"]
    names = {e["name"] for e in events}
    assert {"aten::mm", "aten::addmm", "gem_mpi.compute"} <= names
    threads = {e["tid"] for e in events if e["name"] in ("aten::mm", "aten::addmm")}
    assert len(threads) == 2  # the compute thread's operators are there too


def test_a_loop_that_ends_early_writes_what_it_recorded(tmp_path):
    _loop(OutputConfig(profile_steps="0:20", profile_dir=str(tmp_path)), steps=2)
    assert {"ProfilerStep#0", "ProfilerStep#1"} <= set(_steps(_events(tmp_path / trace_name(7))))


def test_without_profile_steps_nothing_is_written(tmp_path):
    _loop(OutputConfig(profile_dir=str(tmp_path)), steps=3)
    assert not list(tmp_path.iterdir())
