"""``--method gap-aware``: Δθ divided by 1 + |θ − s|/C at the master, exact.

The fused C++ step is held bit for bit to the numpy reference (θ and v) for every thread
count and both wires; a non-finite update is rejected whole; the worker and master rules in
lockstep equal the single-process replay; real runs under mpirun (both kernels, the wait and
overlap orders, float32 and bf16 wires, two masters) and a stop, then a killed worker, each
followed by a resume, equal the replay of their event log bit for bit; bad options are one
line.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import (
    QuadraticSlice,
    assert_exactly_once,
    checkpoint_after_start,
    quadratic_args,
    signal_when,
    stop_then_kill,
    train,
    train_background,
)

from gem_mpi import config
from gem_mpi.algorithm import kernel as gem
from gem_mpi.algorithm.kernel import BF16_NEAREST_EVEN, GapAware, Kernel, gap_step_numpy
from gem_mpi.algorithm.optim import AdamW
from gem_mpi.algorithm.reference import replay
from gem_mpi.algorithm.rule import MasterRule, WorkerRule
from gem_mpi.config import (
    DOWNPOUR,
    GAP_AWARE,
    OPT_ADAMW,
    WIRE_BF16,
    WIRE_F32,
    AdamWConfig,
    GapAwareConfig,
    OptimConfig,
)
from gem_mpi.engine.shards import shard_cut
from gem_mpi.errors import UsageError
from gem_mpi.outputs.runfile import load_run
from gem_mpi.problem.quadratic import Quadratic
from gem_mpi.protocol import layout, update_payload
from gem_mpi.run.preflight import validate

f32 = np.float32
DECAY, EPS = 0.999, 1e-8


def _bits(x: np.ndarray) -> np.ndarray:
    return x.view(np.uint32)


def _inputs(n: int, seed: int, wire: str):
    """θ, s near θ (gaps of a few steps), v of earlier steps, and a few Δθ on ``wire``."""
    rng = np.random.default_rng(seed)
    theta = rng.normal(size=n).astype(f32)
    s = theta + rng.normal(scale=3e-2, size=n).astype(f32)
    v = np.abs(rng.normal(scale=1e-4, size=n)).astype(f32)
    v[1::7] = 0  # parameters that never moved: C = ε
    deltas = []
    for _ in range(3):
        d = rng.normal(scale=1e-2, size=n).astype(f32)
        d[1::11] = 0
        if wire == WIRE_BF16:
            q = np.empty(n, np.uint16)
            gem.to_bf16_numpy(d, q, BF16_NEAREST_EVEN)
            d = q
        deltas.append(d)
    return theta, s, v, deltas


def _c_step(core, theta, d, s, ga: GapAware, t: int, threads: int):
    return core.gap_step(theta, d, s, ga.v, float(ga.decay), float(ga.gain),
                         float(ga.bias(t)), float(ga.eps), threads)


@pytest.mark.parametrize("wire", [WIRE_F32, WIRE_BF16])
@pytest.mark.parametrize("n", [1, 63, 4_097, 100_003])
@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_gap_step_is_the_numpy_reference_for_every_thread_count(core, wire, n, threads):
    """θ and v bit for bit after several steps (the bias correction's t = 1, 2, 900); the
    mean of 1/P to the rounding of its sum."""
    theta, s, v, deltas = _inputs(n, n + threads, wire)
    ref = GapAware.of(v.copy(), DECAY, EPS)
    ext = GapAware.of(v.copy(), DECAY, EPS)
    th_ref, th_ext = theta.copy(), theta.copy()
    for t, d in zip((1, 2, 900), deltas):
        mean_ref = gap_step_numpy(th_ref, d, s, ref, t)
        mean_ext = _c_step(core, th_ext, d, s, ext, t, threads)
        assert np.array_equal(_bits(th_ext), _bits(th_ref))
        assert np.array_equal(_bits(ext.v), _bits(ref.v))
        assert mean_ext == pytest.approx(mean_ref, rel=1e-6)
        assert 0 < mean_ref <= 1
    assert not np.array_equal(th_ref, theta)


def test_the_formulas_one_element_at_a_time():
    """The reference against the docstring's formulas on a few scalars, in float64: P = 1
    without a gap (Δθ applied whole); a gap of one C halves the step."""
    theta = np.array([1.0, 1.0, 2.0], f32)
    s = np.array([1.0, 0.5, 2.0], f32)
    d = np.array([0.25, 0.25, 0.0], f32)
    ga = GapAware.of(np.zeros(3, f32), 0.9, 1e-8)
    mean = gap_step_numpy(theta, d, s, ga, 1)
    # t = 1: v = 0.1·Δθ², b = 0.1, C = |Δθ| + ε; gaps 0, 0.5 (two C), 0
    assert ga.v.tolist() == pytest.approx([0.1 * 0.0625, 0.1 * 0.0625, 0.0], rel=1e-6)
    assert theta.tolist() == pytest.approx([1.25, 1.0 + 0.25 / 3, 2.0], rel=1e-6)
    assert mean == pytest.approx((1 + 1 / 3 + 1 / (1 + 0 / 1e-8)) / 3, rel=1e-6)


@pytest.mark.parametrize("extension", [False, True], ids=["numpy", "c++"])
@pytest.mark.parametrize("where", ["delta", "s", "inf", "overflow"])
def test_non_finite_update_is_rejected_whole(core, extension, where):
    """NaN in Δθ or s, Inf in Δθ, or a finite Δθ whose square overflows v: nothing written,
    on either kernel, for every thread count."""
    n = 4_097
    theta, s, v, (d, *_) = _inputs(n, 5, WIRE_F32)
    s = s.copy()
    if where == "delta":
        d[4000] = np.nan
    elif where == "s":
        s[17] = np.nan
    elif where == "inf":
        d[0] = np.inf
    else:
        d[2048] = f32(1e20)  # (1e20)² is beyond float32
    for threads in (1, 3):
        kernel = Kernel(np.array([0, 100, n]), prefer_extension=extension, threads=threads)
        ga = GapAware.of(v.copy(), DECAY, EPS)
        th = theta.copy()
        assert kernel.gap_step(th, d, s, ga, 5) is None
        assert np.array_equal(_bits(th), _bits(theta))
        assert np.array_equal(_bits(ga.v), _bits(v))


def test_gap_step_refuses_wrong_arrays(core):
    x = np.ones(4, f32)
    v = np.zeros(4, f32)
    with pytest.raises(ValueError, match="float32"):
        core.gap_step(x, x.astype(np.float64), x, v, 0.9, 0.1, 0.1, 1e-8)
    with pytest.raises(ValueError, match="elements"):
        core.gap_step(x, x, x, np.zeros(3, f32), 0.9, 0.1, 0.1, 1e-8)
    with pytest.raises(ValueError, match="read-only"):
        ro = np.zeros(4, f32)
        ro.flags.writeable = False
        core.gap_step(x, x, x, ro, 0.9, 0.1, 0.1, 1e-8)
    with pytest.raises(ValueError, match="decay"):
        core.gap_step(x, x, x, v, 1.0, 0.0, 0.1, 1e-8)
    with pytest.raises(ValueError, match="eps"):
        core.gap_step(x, x, x, v, 0.9, 0.1, 0.1, 0.0)


# --- the rules in lockstep ------------------------------------------------------------------

def _post(slot: np.ndarray, parts: tuple[np.ndarray, ...]) -> int:
    raw, offset = slot.view(np.uint8), 0
    for part in parts:
        raw[offset:offset + part.nbytes] = part.view(np.uint8)
        offset += (part.nbytes + 3) // 4 * 4
    return offset // 4


def _lockstep(optim: OptimConfig, q: Quadratic, extension: bool, workers: int, rounds: int,
              gap: GapAwareConfig | None = None, adamw: AdamWConfig | None = None):
    """``workers`` workers each computing at θ pulled at the start of a round, their updates
    applied one after the other (staleness 0 .. workers − 1): θ and the event log. ``adamw``:
    each worker's update is its own AdamW step d (else Δθ = −η·g)."""
    lay = layout(optim, q.dim, workers)
    own = [AdamW(np.zeros(q.dim, f32), adamw) for _ in range(workers)] if adamw else []
    _, sizes = q.tensors()
    kernel = Kernel(np.cumsum([0, *sizes]), prefer_extension=extension)
    master = MasterRule(optim, kernel, q.dim, workers, gap)
    rules = [WorkerRule(optim, np.zeros(q.dim, f32),
                        extension=kernel.extension if extension else None)
             for _ in range(workers)]
    slot = np.full(lay.payload_floats, np.nan, f32)
    theta, clock = q.theta0(), 0
    log: dict[str, list[int]] = {"worker": [], "version_pulled": [], "staleness": []}
    for _ in range(rounds):
        pulled, version = theta.copy(), clock
        for w, rule in enumerate(rules, start=1):
            delta, _ = q.step(pulled, q.target(w), optim.lr)
            if own:
                g = q.h * (pulled - q.target(w))
                eta = float(f32(optim.lr))  # η as the schedule gives it, in float32
                delta = own[w - 1].step(g, pulled, eta, np.empty_like(pulled))
            assert _post(slot, rule.payload(delta, pulled)) in lay.update_lengths
            ok, stats = master.apply(theta, slot, clock - version, clock)
            assert ok and 0 < stats.scale_mean <= 1
            for k, x in zip(log, (w, version, clock - version)):
                log[k].append(x)
            clock += 1
    return theta, {k: np.array(x) for k, x in log.items()}


@pytest.mark.parametrize("wire", [WIRE_F32, WIRE_BF16])
@pytest.mark.parametrize("extension", [False, True], ids=["numpy", "c++"])
def test_worker_and_master_rules_are_the_replay(wire, extension):
    """Through the payload layout (odd θ: a pad after the bf16 Δθ), stale updates penalised:
    θ is the replay's bit for bit, and not DOWNPOUR's."""
    q, lr = Quadratic(257, 3), 0.3
    optim = OptimConfig(method=GAP_AWARE, lr=lr, wire=wire)
    gap = GapAwareConfig(ga_decay=0.99, ga_eps=1e-7)
    theta, log = _lockstep(optim, q, extension, workers=3, rounds=5, gap=gap)
    ref = replay(log, q, GAP_AWARE, lr, wire=wire, ga_decay=0.99, ga_eps=1e-7)
    assert np.array_equal(_bits(theta), _bits(ref.theta))
    assert not np.array_equal(theta, replay(log, q, DOWNPOUR, lr, wire=wire).theta)


@pytest.mark.parametrize("wire", [WIRE_F32, WIRE_BF16])
@pytest.mark.parametrize("extension", [False, True], ids=["numpy", "c++"])
def test_adamw_workers_and_the_master_are_the_replay(wire, extension):
    """--optimizer adamw: each worker sends its AdamW step d (weight decay included) and the
    master divides it by its penalty, v averaging d²: the replay's AdamW bit for bit, and
    not DOWNPOUR's over the same steps (stale steps were penalised)."""
    q, lr = Quadratic(257, 3), 0.01
    adamw = AdamWConfig(betas="0.9,0.99", weight_decay=0.1)
    optim = OptimConfig(method=GAP_AWARE, lr=lr, wire=wire, optimizer=OPT_ADAMW)
    theta, log = _lockstep(optim, q, extension, workers=3, rounds=5, adamw=adamw)
    ref = replay(log, q, GAP_AWARE, lr, wire=wire, adamw=adamw)
    assert np.array_equal(_bits(theta), _bits(ref.theta))
    assert not np.array_equal(theta, replay(log, q, DOWNPOUR, lr, wire=wire,
                                            adamw=adamw).theta)


@pytest.mark.parametrize("extension", [False, True], ids=["numpy", "c++"])
def test_one_worker_is_downpour_exactly(extension):
    """No gap (each update computed at the θ it is applied to): P = 1, Δθ/1 = Δθ, bit for bit."""
    q, lr = Quadratic(300, 1), 0.2
    theta, log = _lockstep(OptimConfig(method=GAP_AWARE, lr=lr), q, extension, 1, 8)
    assert np.array_equal(_bits(theta), _bits(replay(log, q, DOWNPOUR, lr).theta))


def test_the_payload_is_delta_and_s_on_either_wire():
    for wire, per_param in ((WIRE_F32, 8), (WIRE_BF16, 6)):
        p = update_payload(OptimConfig(method=GAP_AWARE, wire=wire), 1000)
        assert p.parts == ("delta", "s") and p.kept is None
        assert p.bytes_committed == per_param * 1000


# --- options ----------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["--ga-decay", "1"], "^--ga-decay must be in \\[0, 1\\)"),
    (["--ga-decay", "-0.1"], "^--ga-decay must be"),
    (["--ga-decay", "0.99999999"], "^--ga-decay must be"),  # 1.0 in float32
    (["--ga-eps", "0"], "^--ga-eps must be > 0"),
    (["--ga-eps", "1e-50"], "^--ga-eps must be .*finite in float32"),
    (["--gem-shift", "paper"], "^--gem-shift paper is GEM's: --method gap-aware"),
    (["--gem-proxy", "global"], "^--gem-proxy global is GEM's: --method gap-aware"),
])
def test_bad_gap_aware_options_are_one_line(argv, message):
    cfg, _ = config.parse(["--method", "gap-aware", *argv])
    with pytest.raises(UsageError, match=message):
        validate(cfg, 5, data=False)


@pytest.mark.parametrize("method", ["gem", "downpour", "adaptive", "sync"])
def test_gap_aware_options_belong_to_gap_aware(method):
    for option in ("--ga-decay", "--ga-eps"):
        cfg, _ = config.parse(["--method", method, option, "0.5"])
        with pytest.raises(UsageError, match=f"^{option} 0.5 is Gap-Aware's: --method {method}"):
            validate(cfg, 5, data=False)
    cfg, _ = config.parse(["--method", "gap-aware", "--ga-decay", "0", "--ga-eps", "1e-3",
                           "--worker-mode", "overlap", "--wire", "bf16"])
    validate(cfg, 5, data=False)


# --- real runs ----------------------------------------------------------------------------

DIM, STEPS, WORKERS, LR = 2001, 40, 4, 0.05


def _replay_run(u, q, wire: str, **rule: object) -> np.ndarray:
    return replay(u, q, GAP_AWARE, LR, window=len(u["worker"]) + 1, wire=wire, **rule).theta


@pytest.mark.mpi
@pytest.mark.parametrize("kernel, mode, wire, masters", [
    ("extension", "wait", WIRE_F32, 1),
    ("numpy", "overlap", WIRE_F32, 1),
    ("extension", "overlap", WIRE_BF16, 1),
    ("numpy", "wait", WIRE_BF16, 1),
    ("extension", "overlap", WIRE_F32, 2),
    ("numpy", "wait", WIRE_BF16, 2),
])
def test_gap_aware_run_equals_the_replay_bit_for_bit(tmp_path, kernel, mode, wire, masters):
    """Each master's θ (each shard's slice, with its own event order and clock) is the
    replay of its log bit for bit; stale updates were penalised (the mean scale < 1)."""
    h5, out = tmp_path / "run.h5", tmp_path / "theta.npy"
    extra = ["--worker-mode", mode, "--wire", wire, "--ga-decay", "0.99",
             *(["--no-extension"] if kernel == "numpy" else [])]
    res = train(WORKERS + masters, *quadratic_args(
        *extra, method=GAP_AWARE, dim=DIM, steps=STEPS, lr=LR, metrics=h5, save=out,
        eval_every=0, masters=masters))
    assert res.returncode == 0, res.stdout + res.stderr
    theta = np.load(out)
    run = load_run(h5)
    q = Quadratic(DIM, 0)
    _, sizes = q.tensors()
    ends = np.concatenate([[0], np.cumsum(sizes)])
    logs = [run.updates, *[run.other[f"shard{k}"] for k in range(1, masters)]]
    for u, (a, b) in zip(logs, shard_cut(sizes, masters)):
        lo, hi = int(ends[a]), int(ends[b])
        assert_exactly_once(u["worker"], u["seq"], range(1, WORKERS + 1), STEPS)
        assert u["clock"].tolist() == list(range(WORKERS * STEPS))
        ref = _replay_run(u, QuadraticSlice(q, lo, hi), wire, ga_decay=0.99)
        assert np.array_equal(_bits(theta[lo:hi]), _bits(ref))
        scale = u["ga_scale_mean"]
        assert np.all((scale > 0) & (scale <= 1))
        assert np.all(scale[u["staleness"] == 0] == 1)  # no gap, no penalty
        if (u["staleness"] > 0).any():
            assert scale[u["staleness"] > 0].min() < 1
    assert "pi_median_all" not in run.updates


@pytest.mark.mpi
@pytest.mark.parametrize("masters", [1, 2])
def test_stop_or_crash_then_resume_is_exact(tmp_path, masters):
    """v is the master's: every checkpoint holds it (each shard its slice), so a resume after
    a stop (SIGUSR1) and, with one master, after a killed worker replays bit for bit, every
    update exactly once: the one-master run is stopped, resumed, its worker 2 killed,
    resumed again. (The stop lands at the first checkpoint, every 0.1 s: by update ~1500
    here, ~6000 at 4× the speed, the kill as far again, of 4 × 4000.)"""
    steps = 4000
    args = quadratic_args("--worker-mode", "overlap", method=GAP_AWARE, dim=2000, steps=steps,
                          lr=LR, metrics=tmp_path / "run.h5", save=tmp_path / "theta.npy",
                          checkpoint_dir=tmp_path, checkpoint_every=0.1, eval_every=0,
                          masters=masters)
    if masters == 1:
        _, killed = stop_then_kill(WORKERS + masters, args, tmp_path, masters + 1)
        assert "Gap-Aware's step average v restored from the checkpoint" in killed
    else:
        proc = train_background(WORKERS + masters, *args)
        err = signal_when(proc, checkpoint_after_start(tmp_path))
        assert proc.returncode == 3, err
    res = train(WORKERS + masters, *args, "--resume", "auto", timeout=300)
    assert res.returncode == 0, res.stderr
    assert "Gap-Aware's step average v restored from the checkpoint" in res.stderr
    run = load_run(tmp_path / "run.h5")
    assert run.attrs["resumes"] >= (2 if masters == 1 else 1)
    theta, q = np.load(tmp_path / "theta.npy"), Quadratic(2000, 0)
    _, sizes = q.tensors()
    ends = np.concatenate([[0], np.cumsum(sizes)])
    logs = [run.updates, *[run.other[f"shard{k}"] for k in range(1, masters)]]
    for u, (a, b) in zip(logs, shard_cut(sizes, masters)):
        lo, hi = int(ends[a]), int(ends[b])
        assert_exactly_once(u["worker"], u["seq"], range(1, WORKERS + 1), steps)
        assert u["clock"].tolist() == list(range(WORKERS * steps))
        ref = _replay_run(u, QuadraticSlice(q, lo, hi), WIRE_F32)
        assert np.array_equal(_bits(theta[lo:hi]), _bits(ref))
