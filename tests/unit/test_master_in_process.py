"""The asynchronous engine in one process: ``Master`` serves and applies the updates of
scripted workers, and of the real worker orders in threads, through the in-memory windows of
tests/fakes.py, under its real supervisor, metrics file and kernel; θ is then the numpy
reference's replay of the metrics file's log, bit for bit. The same properties under mpirun
are tests/test_train_invariants.py's; these run in the fast loop."""

import threading

import numpy as np
import pytest

from gem_mpi import config
from gem_mpi.algorithm.kernel import Kernel
from gem_mpi.algorithm.reference import replay
from gem_mpi.algorithm.rule import WorkerRule
from gem_mpi.engine.master import Master
from gem_mpi.engine.orders import ORDERS, wait_order
from gem_mpi.engine.steps import QuadraticSteps
from gem_mpi.engine.worker_step import WorkerStep
from gem_mpi.outputs.runfile import load_run
from gem_mpi.problem import build_problem
from gem_mpi.protocol import DONE, FINISHED, layout
from gem_mpi.run.supervisor import Outcome, StopFlag
from gem_mpi.session import supervise
from tests.fakes import MemoryWindows

f32 = np.float32
DIM, WORKERS, STEPS, LR = 37, 3, 8, 0.1


def _cfg(tmp_path, **options) -> config.Config:
    """A worker thread that fails sends nothing more: the master ends the run after 30 s
    (--worker-timeout) and the test fails, where it would wait for its DONE forever."""
    return config.Config.of(model="quadratic", dataset="synthetic", quadratic_dim=DIM,
                            max_steps=STEPS, lr=LR, metrics=str(tmp_path / "run.h5"),
                            eval_every=0, log_every=60.0, worker_timeout=30.0, **options)


def _workers(board: MemoryWindows, cfg: config.Config, q, errors: list) -> None:
    """WORKERS workers in rounds: each pulls θ at the round's start, then they commit one
    after the other (staleness 0, 1, 2 within a round), each Δθ = −η∇f_w at the θ it pulled,
    the payload made by the worker's rule; then each signs off DONE."""
    try:
        rules = [WorkerRule(cfg.optim, np.zeros(DIM, f32)) for _ in range(WORKERS)]
        for seq in range(STEPS):
            pulls = [board.pull() for _ in range(WORKERS)]
            for w, (s, version) in enumerate(pulls, start=1):
                delta = f32(-LR) * (q.h * (s - q.target(w)))
                board.update(w, seq, version, rules[w - 1].payload(delta, s),
                             loss=float(seq))
            for w in range(1, WORKERS + 1):
                board.wait_applied(w)
        for w in range(1, WORKERS + 1):
            board.done(w, STEPS)
    except Exception as exc:  # noqa: BLE001 (seen by the test, not lost in the thread)
        errors.append(exc)


def _serve(tmp_path, **options):
    cfg = _cfg(tmp_path, **options)
    problem = build_problem(cfg.data, with_theta0=True)
    lay = layout(cfg.optim, problem.n_params, WORKERS)
    board = MemoryWindows()
    kernel = Kernel(problem.offsets, prefer_extension=False)
    master = Master(cfg, None, lay, problem, kernel, endpoint=board.master)
    supervise(master, cfg, problem, StopFlag(), None, "in-process")
    errors: list = []
    workers = threading.Thread(target=_workers, args=(board, cfg, problem.quadratic, errors))
    workers.start()
    outcome = master.run()
    workers.join(10)
    assert not errors, errors
    return cfg, problem, master, board, outcome


@pytest.mark.parametrize("method, options", [
    ("gem", {}), ("gem", {"gem_shift": "paper"}), ("gem", {"gem_proxy": "global"}),
    ("downpour", {}), ("adaptive", {}), ("gap-aware", {"ga_decay": 0.9}),
], ids=["gem", "gem-paper", "gem-global", "downpour", "adaptive", "gap-aware"])
def test_the_master_applies_every_update_once_as_the_reference(tmp_path, method, options):
    cfg, problem, master, board, outcome = _serve(tmp_path, method=method, **options)
    assert outcome is Outcome.FINISHED and board.stop_code == FINISHED
    run = load_run(tmp_path / "run.h5")
    u = run.updates
    assert sorted(zip(u["worker"].tolist(), u["seq"].tolist())) == [
        (w, s) for w in range(1, WORKERS + 1) for s in range(STEPS)]
    assert u["clock"].tolist() == list(range(WORKERS * STEPS))
    assert u["staleness"].tolist() == [0, 1, 2] * STEPS  # the rounds' order
    o = cfg.optim
    ref = replay(u, problem.quadratic, method, LR, momentum=o.momentum, pi_max=o.pi_max,
                 shift=o.gem_shift, proxy=o.gem_proxy, n_workers=WORKERS,
                 ga_decay=cfg.gap_aware.ga_decay, ga_eps=cfg.gap_aware.ga_eps)
    assert np.array_equal(master.final_theta, ref.theta)
    assert run.summary["finished"] == 1.0


def test_a_poisoned_update_is_rejected_and_named(tmp_path):
    """An update holding a NaN leaves θ untouched, is counted against its worker and the
    run goes on: the rejection is the master's decision, made in-process."""
    cfg = _cfg(tmp_path, method="downpour")
    problem = build_problem(cfg.data, with_theta0=True)
    lay = layout(cfg.optim, problem.n_params, 1)
    board = MemoryWindows()
    master = Master(cfg, None, lay, problem, Kernel(problem.offsets, prefer_extension=False),
                    endpoint=board.master)
    supervise(master, cfg, problem, StopFlag(), None, "in-process")

    def worker() -> None:
        bad = np.full(DIM, np.nan, f32)
        good = np.full(DIM, 0.5, f32)
        board.update(1, 0, 0, (bad,))
        board.update(1, 1, 0, (good,))
        board.done(1, 2)

    t = threading.Thread(target=worker)
    t.start()
    assert master.run() is Outcome.FINISHED
    t.join(10)
    assert master.rejected == {1: 1}
    assert np.array_equal(master.final_theta, problem.theta0 + f32(0.5))


def _real_worker(board: MemoryWindows, cfg: config.Config, problem, rank: int,
                 errors: list) -> None:
    """Worker ``rank`` as run_worker sets it up, on its in-memory endpoint: its order's
    loop, then DONE."""
    try:
        steps = QuadraticSteps(cfg.optim, cfg.data, problem, rank)
        ep = board.worker(rank, problem.n_params)
        w = WorkerStep(cfg, rank, steps, ep, WorkerRule(cfg.optim, steps.momentum_like()),
                       None, 1.0)
        order = ORDERS.get(cfg.optim.worker_mode, wait_order)
        stopped, version = order(w, 0, ep.pull())
        assert not stopped
        ep.commit(DONE, steps.steps, version, parts=(w.time_split(),))
    except Exception as exc:  # noqa: BLE001 (seen by the test, not lost in the thread)
        errors.append(exc)


@pytest.mark.parametrize("mode", ["wait", "pipelined", "overlap"])
@pytest.mark.parametrize("method, shift", [("gem", "others"), ("gem", "paper"),
                                           ("adaptive", "others")])
def test_the_three_worker_orders_against_the_master_replay_bit_for_bit(tmp_path, mode,
                                                                       method, shift):
    """The real worker orders (gem_mpi.engine.orders) of 3 workers in threads against the
    real master, in one process: whatever the interleaving, every update is applied once
    and θ is the reference's replay of the log."""
    cfg = _cfg(tmp_path, method=method, worker_mode=mode, gem_shift=shift)
    problem = build_problem(cfg.data, with_theta0=True)
    lay = layout(cfg.optim, problem.n_params, WORKERS)
    board = MemoryWindows()
    master = Master(cfg, None, lay, problem, Kernel(problem.offsets, prefer_extension=False),
                    endpoint=board.master)
    supervise(master, cfg, problem, StopFlag(), None, "in-process")
    errors: list = []
    threads = [threading.Thread(target=_real_worker, args=(board, cfg, problem, r, errors))
               for r in range(1, WORKERS + 1)]
    for t in threads:
        t.start()
    assert master.run() is Outcome.FINISHED
    for t in threads:
        t.join(10)
    assert not errors, errors
    u = load_run(tmp_path / "run.h5").updates
    assert sorted(zip(u["worker"].tolist(), u["seq"].tolist())) == [
        (w, s) for w in range(1, WORKERS + 1) for s in range(STEPS)]
    ref = replay(u, problem.quadratic, method, LR, momentum=cfg.optim.momentum,
                 pi_max=cfg.optim.pi_max, shift=shift, n_workers=WORKERS)
    assert np.array_equal(master.final_theta, ref.theta)
