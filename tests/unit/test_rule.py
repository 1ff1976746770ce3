"""The update rule's two halves in one process, no MPI: the worker's momentum in numpy and in
torch, and worker rule -> master rule for one worker against gem_mpi.algorithm.reference."""

from __future__ import annotations

import numpy as np
import pytest

from gem_mpi.algorithm.kernel import Kernel
from gem_mpi.algorithm.reference import replay
from gem_mpi.algorithm.rule import MasterRule, Momentum, WorkerRule, global_decay
from gem_mpi.config import (
    ADAPTIVE,
    DOWNPOUR,
    GEM,
    PROXY_GLOBAL,
    PROXY_LOCAL,
    SHIFT_OTHERS,
    SHIFT_PAPER,
    OptimConfig,
)
from gem_mpi.problem.quadratic import Quadratic
from gem_mpi.protocol import layout

f32 = np.float32


def _bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, np.float32).view(np.uint32)


@pytest.mark.parametrize("mu, kappa", [(0.9, 1.0), (0.5, 2.5), (0.99, 0.3)])
def test_momentum_in_numpy_and_torch_agree_bit_for_bit(mu, kappa):
    """m ← μ·m + Δθ and a = κ|m| are float32 multiplies and adds done one by one, in the same
    order, in both libraries (torch multiplies a float32 tensor by a Python float in float32),
    so m, the m before the last fold, and a must be the same bits, step after step."""
    torch = pytest.importorskip("torch")
    optim = OptimConfig(method=GEM, momentum=mu, kappa=kappa)
    rng = np.random.default_rng(0)
    n = 10_007
    host = Momentum.zeros_like(np.zeros(n, f32), optim)
    dev = Momentum.zeros_like(torch.zeros(n, dtype=torch.float32), optim)
    for _ in range(25):
        delta = (rng.normal(size=n) * 10.0 ** rng.integers(-6, 2)).astype(f32)
        a_np = host.fold(delta)
        a_t = dev.fold(torch.from_numpy(delta.copy()))
        assert a_t.dtype == torch.float32
        m_t, prev_t = (state["m"] for state in dev.arrays())
        assert np.array_equal(_bits(a_np), _bits(a_t.numpy()))
        assert np.array_equal(_bits(host.m), _bits(m_t))
        assert np.array_equal(_bits(host.prev), _bits(prev_t))
    assert host.folded == dev.folded == 25


def _post(slot: np.ndarray, parts: tuple[np.ndarray, ...]) -> int:
    """What Mailbox.post does to a slot's payload area: the parts one after the other from
    the start; whatever lies beyond them (the kept part) is left as it is."""
    offset = 0
    for part in parts:
        slot[offset:offset + part.size] = part
        offset += part.size
    return offset


def _one_worker(method: str, shift: str, steps: int, extension: bool,
                proxy: str = PROXY_LOCAL, stats: list | None = None):
    """One worker and the master, in lockstep: pull θ, Δθ of the quadratic at it, the worker
    rule's payload into the slot, the master rule applies it. Returns θ, the event log the
    metrics would hold, and the payload lengths sent; ``stats`` receives each GemStats."""
    q, lr, n_workers = Quadratic(257, 3), 0.3, 1
    optim = OptimConfig(method=method, gem_shift=shift, gem_proxy=proxy, lr=lr, momentum=0.9,
                        kappa=1.5)
    sizes = layout(optim, q.dim, n_workers)
    _, tensor_sizes = q.tensors()
    kernel = Kernel(np.cumsum([0, *tensor_sizes]), prefer_extension=extension)
    assert (kernel.extension is not None) == extension, kernel.why_not
    master = MasterRule(optim, kernel, q.dim, n_workers)
    worker = WorkerRule(optim, np.zeros(q.dim, f32))
    slots = np.full((n_workers, sizes.payload_floats), np.nan, f32)  # the mailbox, rank 0
    theta, target, sent = q.theta0(), q.target(1), []
    for _ in range(steps):
        pulled = theta.copy()  # the worker waits until its own update was applied
        delta, _ = q.step(pulled, target, lr)
        sent.append(_post(slots[0], worker.payload(delta, pulled)))
        before = theta.copy()
        ok, st = master.apply(theta, slots[0], staleness=0, clock=0)
        assert ok
        if stats is not None:
            stats.append(st)
        kept = master.kept(slots)
        if kept is not None:  # the paper's shift: θ just before this update, in the slot
            assert np.array_equal(_bits(kept[0]), _bits(before))
    log = {"worker": np.ones(steps, np.int64), "version_pulled": np.arange(steps),
           "staleness": np.zeros(steps, np.int64)}
    return theta, log, sent, sizes, (q, lr, optim)


@pytest.mark.parametrize("extension", [False, True], ids=["numpy", "c++"])
@pytest.mark.parametrize("shift", [SHIFT_OTHERS, SHIFT_PAPER])
def test_gem_worker_rule_then_master_rule_is_the_reference(shift, extension):
    """θ after six updates equals the single-process replay of the same log bit for bit, in
    both readings of the shift, and the two readings give different θ (one worker: with
    'others' |θ − s| is 0, with 'paper' it is the worker's own previous step)."""
    theta, log, sent, sizes, (q, lr, optim) = _one_worker(GEM, shift, 6, extension)
    ref = replay(log, q, GEM, lr, momentum=optim.momentum, kappa=optim.kappa,
                 pi_max=optim.pi_max, eps=optim.eps, shift=shift)
    assert np.array_equal(_bits(theta), _bits(ref.theta))
    other = replay(log, q, GEM, lr, momentum=optim.momentum, kappa=optim.kappa,
                   pi_max=optim.pi_max, eps=optim.eps,
                   shift=SHIFT_PAPER if shift == SHIFT_OTHERS else SHIFT_OTHERS)
    assert not np.array_equal(theta, other.theta)
    n = q.dim
    # what the worker sent is what the master accepts: s with the first update only when the
    # master keeps it
    assert all(length in sizes.update_lengths for length in sent)
    assert sent == ([3 * n] + [2 * n] * 5 if shift == SHIFT_PAPER else [3 * n] * 6)


@pytest.mark.parametrize("method", [DOWNPOUR, ADAPTIVE])
def test_fixed_scale_rules_are_the_reference(method):
    theta, log, sent, _, (q, lr, _) = _one_worker(method, SHIFT_OTHERS, 6, False)
    assert np.array_equal(_bits(theta), _bits(replay(log, q, method, lr).theta))
    assert sent == [q.dim] * 6


@pytest.mark.parametrize("shift, pi2", [(SHIFT_OTHERS, 1.9), (SHIFT_PAPER, 0.9)])
def test_a_fixed_update_twice_gives_the_paper_s_numbers(shift, pi2):
    """One worker, Δθ = −0.1 twice, μ 0.9, κ 1: π = 1 at the first step; at the second
    κ|m| = 0.19 and |θ − s| is 0 ('others') or the first step's 0.1 ('paper'), so π = 1.9 or
    0.9, through both rules as the run wires them."""
    optim = OptimConfig(method=GEM, gem_shift=shift, momentum=0.9, kappa=1.0)
    sizes = layout(optim, 1, 1)
    master = MasterRule(optim, Kernel(np.array([0, 1]), prefer_extension=False), 1)
    worker = WorkerRule(optim, np.zeros(1, f32))
    slots = np.zeros((1, sizes.payload_floats), f32)
    theta, delta, pis = np.zeros(1, f32), np.array([-0.1], f32), []
    for _ in range(2):
        before = theta.copy()
        _post(slots[0], worker.payload(delta, theta.copy()))
        master.apply(theta, slots[0], staleness=0, clock=0)
        pis.append(float((theta - before)[0] / delta[0]))
    np.testing.assert_allclose(pis, [1.0, pi2], rtol=1e-5)


def _stats_bits(stats) -> list[tuple]:
    return [(s.pi_median.tobytes(), s.clamp_frac.tobytes(), s.clamp_low_frac.tobytes(),
             s.zero_delta_frac.tobytes(), s.pi_median_all, s.energy_central, s.energy_proxy)
            for s in stats]


@pytest.mark.parametrize("extension", [False, True], ids=["numpy", "c++"])
@pytest.mark.parametrize("shift", [SHIFT_OTHERS, SHIFT_PAPER])
def test_the_global_proxy_with_one_worker_is_local_gem_bit_for_bit(shift, extension):
    """One worker: μ_g = μ and c = 1, so the master's m is the worker's m, a the worker's κ|m|,
    θ and every recorded statistic the same bits as local GEM's, through both rules and the
    kernel; the replay's global proxy agrees; and the worker sent no κ|m| (Δθ and s, or Δθ
    alone once the master keeps s)."""
    steps, got = 12, {}
    for proxy in (PROXY_LOCAL, PROXY_GLOBAL):
        stats: list = []
        theta, log, sent, _, (q, lr, optim) = _one_worker(GEM, shift, steps, extension, proxy,
                                                          stats)
        got[proxy] = (theta, _stats_bits(stats), sent)
    (theta_l, stats_l, sent_l), (theta_g, stats_g, sent_g) = got[PROXY_LOCAL], got[PROXY_GLOBAL]
    assert np.array_equal(_bits(theta_l), _bits(theta_g))
    assert stats_l == stats_g
    assert any(0 < s[4] < optim.pi_max for s in stats_g)  # π neither all clamped nor all 0
    ref = replay(log, q, GEM, lr, momentum=optim.momentum, kappa=optim.kappa,
                 pi_max=optim.pi_max, eps=optim.eps, shift=shift, proxy=PROXY_GLOBAL,
                 n_workers=1)
    assert np.array_equal(_bits(theta_g), _bits(ref.theta))
    n = q.dim
    assert sent_l == ([3 * n] + [2 * n] * (steps - 1) if shift == SHIFT_PAPER
                      else [3 * n] * steps)
    assert sent_g == ([2 * n] + [n] * (steps - 1) if shift == SHIFT_PAPER else [2 * n] * steps)


def test_a_global_proxy_worker_keeps_no_momentum():
    optim = OptimConfig(method=GEM, gem_proxy=PROXY_GLOBAL)
    worker = WorkerRule(optim, np.zeros(5, f32))
    assert worker.momentum is None and worker.sends_s
    delta, s = np.ones(5, f32), np.zeros(5, f32)
    assert [p is q for p, q in zip(worker.payload(delta, s), (delta, s))] == [True, True]


@pytest.mark.parametrize("mu", [0.0, 0.5, 0.9, 0.99])
def test_global_decay_is_one_proxy_step_per_round_of_n_updates(mu):
    """One worker: (μ, 1) exactly. n workers: μ_g^n = μ (a round of n updates decays m like
    one proxy step), and a constant Δθ builds |m| = Δθ/(1 − μ), the proxy's own, at every n:
    the round's updates are averaged into the step, not summed."""
    assert global_decay(mu, 1) == (f32(mu), f32(1.0))
    proxy = 1.0 / (1.0 - float(f32(mu)))  # the proxy's |m| for Δθ = 1
    for n in (2, 5, 10, 30, 100):
        mu_g, gain = global_decay(mu, n)
        assert mu_g.dtype == gain.dtype == np.float32
        np.testing.assert_allclose(float(mu_g) ** n, f32(mu), rtol=1e-5, atol=1e-30)
        np.testing.assert_allclose(float(gain) / (1.0 - float(mu_g)), proxy, rtol=1e-6)
    # the float32 recursion the kernel runs, Δθ = 1, to e^-30 of its start (its rounding
    # error grows as c shrinks: up to 3e-4 of |m| at μ 0.99 and n = 100)
    mu = min(mu, 0.9)
    for n in (2, 5, 10, 30):
        mu_g, gain = global_decay(mu, n)
        m = f32(0.0)
        for _ in range(int(30 / (1 - float(mu_g)))):
            m = mu_g * m + gain * f32(1.0)
        np.testing.assert_allclose(float(m), 1.0 / (1.0 - float(f32(mu))), rtol=1e-4)
