"""Every ending of a run, in-process: the supervisor drives a fake engine (plain gradient
descent on the numpy quadratic, one row per update) and ends the run; each test checks the
outcome, the checkpoint written or not, the metrics file's summary and the one line said."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest

from gem_mpi.config import Config
from gem_mpi.outputs import checkpoint
from gem_mpi.problem import Problem, build_problem
from gem_mpi.run.monitor import Watchdog
from gem_mpi.run.supervisor import (
    EXIT_CODES,
    FINISHED,
    Checkpointer,
    Outcome,
    RunSupervisor,
    StopFlag,
    Verdict,
)

QUAD = {"method": "downpour", "model": "quadratic", "dataset": "synthetic",
        "quadratic_dim": 100}


class FakeEngine:
    """The Engine protocol on a numpy θ: ``updates`` steps of gradient descent, each heard
    from worker 1 and recorded; ``script(engine)`` runs before each step (a test's fault)."""

    noun = "update"

    def __init__(self, problem: Problem, updates: int, script=None, lr: float = 0.1) -> None:
        self.q = problem.quadratic
        self.theta_ = problem.theta0.copy()
        self.clock, self.updates, self.lr = 0, updates, lr
        self.script = script or (lambda engine: None)
        self.sup: RunSupervisor | None = None
        self.loaded: checkpoint.Checkpoint | None = None
        self.loss_scale = 1.0

    @property
    def position(self) -> int:
        return self.clock

    def theta(self) -> np.ndarray:
        return self.theta_

    def state(self) -> dict:
        return {"theta": self.theta_.copy(), "clock": self.clock, "tickets": self.clock,
                "next_seq": np.array([self.clock], np.int64)}

    def load_state(self, ckpt: checkpoint.Checkpoint) -> None:
        self.loaded = ckpt
        self.theta_, self.clock = ckpt.theta.copy(), int(ckpt.clock)

    def summary(self) -> dict:
        return {"rejected": 0}

    def done_line(self, fields: dict) -> str:
        return f"done: {fields['updates']} fake updates"

    def loop(self) -> Verdict:
        sup = self.sup
        while self.clock < self.updates:
            verdict = sup.between_batches()
            if verdict is not None:
                return verdict
            self.script(self)
            diff = self.theta_ - self.q.center
            loss = self.loss_scale * 0.5 * float(np.dot(self.q.h * diff, diff))
            self.theta_ -= np.float32(self.lr) * self.q.h * diff
            sup.heard(1)
            if sup.recording:
                sup.record_update({"time": sup.elapsed(), "worker": 1, "seq": self.clock,
                                   "ticket": self.clock, "version_pulled": self.clock,
                                   "clock": self.clock, "staleness": 0, "loss": loss,
                                   "queue": 1, "compute_s": 0.0, "apply_s": 0.0})
            sup.observe(loss, self.clock, self.theta_)
            self.clock += 1
            if sup.eval_due(self.clock - 1):
                sup.evaluate(self.theta_, self.clock)
        return FINISHED


def _run(tmp_path: Path, updates: int = 50, script=None, n_workers: int = 1,
         resumed: dict | None = None, stop: StopFlag | None = None, **options):
    cfg = Config.of(**{**QUAD, "metrics": str(tmp_path / "run.h5"),
                       "checkpoint_dir": str(tmp_path / "ck"), "checkpoint_every": 0.0,
                       "eval_every": 10, **options})
    (tmp_path / "ck").mkdir(exist_ok=True)
    problem = build_problem(cfg.data, with_theta0=True)
    engine = FakeEngine(problem, updates, script)
    stop = stop if stop is not None else StopFlag()
    sup = RunSupervisor(cfg, problem, n_workers, engine, "numpy", stop, resumed)
    engine.sup = sup
    return sup, engine, stop


def _summary(path: Path) -> dict:
    with h5py.File(path, "r") as f:
        return {k: float(v[()]) for k, v in f["summary"].items() if v.shape == ()}


def _clocks(path: Path) -> np.ndarray:
    with h5py.File(path, "r") as f:
        return f["updates/clock"][()]


def _error_lines(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.startswith("gem_mpi: error")]


def test_finished(tmp_path, capsys):
    sup, engine, _ = _run(tmp_path)
    assert sup.run() is Outcome.FINISHED
    summary = _summary(tmp_path / "run.h5")
    assert summary["finished"] == 1.0 and summary["diverged"] == 0.0
    assert summary["updates"] == 50 and np.isfinite(summary["test_loss"])
    assert np.array_equal(_clocks(tmp_path / "run.h5"), np.arange(50))
    state = checkpoint.load(checkpoint.latest(str(tmp_path / "ck")))
    assert state.clock == 50 == state.rows_updates
    assert np.array_equal(state.theta, engine.theta_)
    assert "gem_mpi: done: 50 fake updates" in capsys.readouterr().err


def test_a_safetensors_save_holds_the_final_theta_the_run_id_and_the_config(tmp_path):
    from safetensors import safe_open

    sup, engine, _ = _run(tmp_path, save=str(tmp_path / "theta.safetensors"))
    assert sup.run() is Outcome.FINISHED
    with safe_open(tmp_path / "theta.safetensors", "np") as f:
        meta = f.metadata()
        assert np.array_equal(f.get_tensor("theta"), engine.theta_)
    with h5py.File(tmp_path / "run.h5", "r") as h5:  # as the metrics file records them
        assert meta["run_id"] == sup.run_id == h5.attrs["run_id"]
        assert json.loads(meta["config"]) == sup.cfg.as_dict() == json.loads(h5.attrs["config"])


def test_stopped_by_a_signal_checkpoints_and_resumes_to_the_same_end(tmp_path, capsys):
    def signal_at_20(engine):
        if engine.clock == 20:
            stop(10, None)  # as SIGUSR1 would

    stop = StopFlag()
    sup, _, _ = _run(tmp_path, script=signal_at_20, stop=stop)
    assert sup.run() is Outcome.STOPPED and EXIT_CODES[Outcome.STOPPED] == 3
    path = checkpoint.latest(str(tmp_path / "ck"))
    err = capsys.readouterr().err
    assert f"stopped by signal 10 at update 21: checkpoint {path}; continue with" in err
    summary = _summary(tmp_path / "run.h5")
    assert summary["finished"] == 0.0 and summary["diverged"] == 0.0
    resumed = checkpoint.load(path)
    assert resumed.clock == 21 == resumed.rows_updates and resumed.path == path

    # the resume (as session._resume hands it over) continues the same file to the end
    cfg = sup.cfg
    resumed.changes = checkpoint.changes(resumed, cfg.as_dict())
    sup2, engine2, _ = _run(tmp_path, resumed=resumed)
    assert engine2.loaded is resumed and engine2.position == 21
    assert sup2.run() is Outcome.FINISHED
    assert np.array_equal(_clocks(tmp_path / "run.h5"), np.arange(50))
    sup3, engine3, _ = _run(tmp_path, metrics=str(tmp_path / "whole.h5"),
                            checkpoint_dir=None)  # the same run, uninterrupted
    assert sup3.run() is Outcome.FINISHED
    assert np.array_equal(engine2.theta_, engine3.theta_)  # bit for bit


def test_diverged_keeps_the_last_good_checkpoint(tmp_path, capsys):
    def blow_up(engine):
        if engine.clock == 10:
            engine.sup.checkpointer.save()  # a periodic save, before things go wrong
        if engine.clock >= 30:
            engine.loss_scale *= 1e3

    sup, _, _ = _run(tmp_path, updates=1000, script=blow_up)
    assert sup.run() is Outcome.DIVERGED and EXIT_CODES[Outcome.DIVERGED] == 4
    last = checkpoint.latest(str(tmp_path / "ck"))
    assert checkpoint.load(last).clock == 10  # none written at the divergence
    [line] = [ln for ln in capsys.readouterr().err.splitlines() if "diverged" in ln]
    assert f"the last good state is {last}" in line and "Lower --lr (or --kappa)" in line
    summary = _summary(tmp_path / "run.h5")
    assert summary["finished"] == 0.0 and summary["diverged"] == 1.0


def test_low_space_is_a_verdict_with_a_checkpoint_and_one_line(tmp_path, capsys):
    """The metrics file's file system is looked at when the file is opened: a disk already
    below --min-free-mb stops the run at its first check, with a checkpoint."""
    sup, _, _ = _run(tmp_path, min_free_mb=1e12)
    assert sup.run() is Outcome.OUTPUT_FAILED and EXIT_CODES[Outcome.OUTPUT_FAILED] == 5
    [line] = _error_lines(capsys.readouterr().err)
    assert line.startswith("gem_mpi: error: stopped at update 0: --metrics")
    assert "below --min-free-mb 1e+12" in line and "free space, then --resume auto" in line
    state = checkpoint.load(checkpoint.latest(str(tmp_path / "ck")))
    assert state.clock == 0 == state.rows_updates
    assert _summary(tmp_path / "run.h5")["finished"] == 0.0


def test_a_checkpoint_that_cannot_be_written_is_a_verdict_and_one_line(tmp_path, capsys):
    sup, _, _ = _run(tmp_path, checkpoint_dir=str(tmp_path / "none" / "ck"),
                     checkpoint_every=1e-9)
    assert sup.run() is Outcome.OUTPUT_FAILED
    [line] = _error_lines(capsys.readouterr().err)
    assert "checkpoint" in line and "writing failed" in line
    assert "there is no earlier one" in line
    assert _summary(tmp_path / "run.h5")["finished"] == 0.0


def test_a_stuck_worker_is_a_verdict_and_the_caller_ends_the_job(tmp_path, capsys):
    now = [0.0]

    def tick(engine):
        now[0] += 1.0  # one second per update, as far as the watchdog knows

    sup, _, _ = _run(tmp_path, updates=1000, script=tick, n_workers=2, worker_timeout=5)
    sup.watchdog = Watchdog(2, 5.0, clock=lambda: now[0])  # worker 2 never speaks
    assert sup.run() is Outcome.STUCK  # returned: nothing here aborted the process
    [line] = _error_lines(capsys.readouterr().err)
    assert line.startswith("gem_mpi: error: worker 2 (rank 2) has sent nothing for 6 s "
                           "(--worker-timeout 5): it or its node is stuck; ending the job "
                           "at update 6; checkpoint ")
    assert line.endswith(": --resume auto continues")
    state = checkpoint.load(checkpoint.latest(str(tmp_path / "ck")))
    assert state.clock == 6 == state.rows_updates
    assert _summary(tmp_path / "run.h5")["finished"] == 0.0


def test_without_outputs_nothing_is_written(tmp_path, capsys):
    sup, _, _ = _run(tmp_path, metrics=None, checkpoint_dir=None)
    assert sup.run() is Outcome.FINISHED
    assert list(tmp_path.rglob("*.h5")) == []
    assert "done: 50 fake updates" in capsys.readouterr().err


class Part:
    def __init__(self, **state) -> None:
        self.value = state

    def state(self) -> dict:
        return self.value


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _state(clock: int) -> Part:
    return Part(theta=np.arange(3, dtype=np.float32), clock=clock, tickets=clock,
                next_seq=np.array([clock]), rows_updates=clock, rows_eval=0, rows_rejected=0)


def test_checkpointer_composes_the_parts_into_one_file(tmp_path):
    ck = Checkpointer(str(tmp_path), 0.0, {"lr": 0.1}, 1,
                      [_state(7), Part(elapsed_s=2.5, run_id="abc")])
    path = ck.save()
    state = checkpoint.load(path)
    assert np.array_equal(state.theta, np.arange(3, dtype=np.float32))
    assert state.clock == 7 and state.run_id == "abc" and state.elapsed_s == 2.5
    assert state.config == {"lr": 0.1} and state.n_workers == 1 and state.tickets == 7


def test_checkpointer_saves_when_due(tmp_path):
    clock = FakeClock()
    part = _state(1)
    ck = Checkpointer(str(tmp_path), 10.0, {}, 1, [part, Part(elapsed_s=0.0, run_id="r")],
                      clock=clock)
    clock.now = 9.9
    assert ck.maybe_save() is None and checkpoint.latest(str(tmp_path)) is None
    clock.now = 10.0
    assert ck.maybe_save() == checkpoint.latest(str(tmp_path))
    part.value = _state(2).value
    clock.now = 15.0
    assert ck.maybe_save() is None  # 5 s after that save
    clock.now = 20.0
    assert checkpoint.load(ck.maybe_save()).clock == 2
    assert len(list(tmp_path.iterdir())) == 1  # the older one is dropped


def test_checkpointer_without_a_directory_writes_nothing(tmp_path):
    clock = FakeClock()
    ck = Checkpointer(None, 10.0, {}, 1, [_state(1)], clock=clock)
    clock.now = 1e6
    assert ck.maybe_save() is None and ck.save() is None


@pytest.mark.parametrize("outcome", list(Outcome))
def test_every_outcome_has_an_exit_code(outcome):
    assert isinstance(EXIT_CODES[outcome], int)
