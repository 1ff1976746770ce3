"""The typed checkpoint (gem_mpi.outputs.checkpoint.Checkpoint) without MPI: what is written
is what is read, a method leaves out what it does not have, a shard's slice and the join of
every shard's state are inverse, and a file of another format, a damaged file and a resume
that changes a setting other than --lr are one line."""

from __future__ import annotations

import dataclasses

import h5py
import numpy as np
import pytest

from gem_mpi import config
from gem_mpi.config import Config
from gem_mpi.errors import UsageError
from gem_mpi.outputs import checkpoint
from gem_mpi.outputs.checkpoint import Checkpoint
from gem_mpi.protocol import ShardState

N, WORKERS = 10, 3


def _async(**extra) -> Checkpoint:
    rng = np.random.default_rng(0)
    return Checkpoint(theta=rng.normal(size=N).astype(np.float32), clock=17, run_id="r1",
                      elapsed_s=1.5, config={"lr": 0.05, "masters": 1}, n_workers=WORKERS,
                      rows_updates=17, rows_eval=2, rows_rejected=1, tickets=18,
                      next_seq=np.array([5, 6, 7], np.int64), **extra)


def _same(a: Checkpoint, b: Checkpoint) -> None:
    for f in dataclasses.fields(Checkpoint):
        if f.name in ("path", "changes"):
            continue
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            assert x is not None and y is not None and np.array_equal(x, y), f.name
            assert np.asarray(x).dtype == np.asarray(y).dtype, f.name
        else:
            assert x == y, f.name


def test_what_is_saved_is_what_is_loaded(tmp_path):
    ckpt = _async(kept_s=np.ones((WORKERS, N), np.float32),
                  proxy_m=np.full(N, 0.5, np.float32))
    path = checkpoint.save(str(tmp_path), ckpt)
    back = checkpoint.load(path)
    _same(ckpt, back)
    assert back.path == path and back.changes == {} and back.rows == (17, 2, 1)
    assert back.momentum is None and back.shard_clock is None


def test_a_synchronous_checkpoint_has_no_tickets_or_next_seq(tmp_path):
    theta = np.arange(N, dtype=np.float32)
    ckpt = Checkpoint(theta=theta, clock=9, run_id="s", elapsed_s=0.0, config={},
                      n_workers=2, momentum=theta * 2)
    path = checkpoint.save(str(tmp_path), ckpt)
    with h5py.File(path, "r") as f:
        assert "tickets" not in f.attrs and "next_seq" not in f
    back = checkpoint.load(path)
    assert back.tickets is None and back.next_seq is None
    assert np.array_equal(back.momentum, theta * 2)


def test_unknown_fields_are_refused_where_the_checkpoint_is_made():
    with pytest.raises(TypeError):
        Checkpoint(theta=np.zeros(1, np.float32), clock=0, run_id="", elapsed_s=0.0,
                   config={}, n_workers=1, ticket=3)  # a misspelt field fails at once


def test_a_shard_and_the_join_of_every_shard_are_inverse():
    bounds = [(0, 4), (4, 7), (7, N)]
    whole = _async(kept_s=np.arange(WORKERS * N, dtype=np.float32).reshape(WORKERS, N),
                   proxy_m=np.arange(N, dtype=np.float32),
                   shard_clock=np.array([17, 16, 15], np.int64),
                   shard_tickets=np.array([18, 17, 16], np.int64))
    parts = [whole.shard(k, b) for k, b in enumerate(bounds)]
    for k, ((lo, hi), part) in enumerate(zip(bounds, parts)):
        assert np.array_equal(part.theta, whole.theta[lo:hi])
        assert np.array_equal(part.kept_s, whole.kept_s[:, lo:hi])
        assert part.clock == whole.shard_clock[k] and part.tickets == whole.shard_tickets[k]
        assert part.shard_clock is None and part.run_id == whole.run_id
    joined = ShardState.join([ShardState(p.theta, p.clock, p.tickets, p.next_seq, p.kept_s,
                                         p.proxy_m) for p in parts])
    _same(whole, dataclasses.replace(whole, **joined))
    parts[0].theta[0] += 1  # a shard's slice is its own copy
    assert whole.theta[0] != parts[0].theta[0]


def test_a_checkpoint_of_another_format_is_one_line(tmp_path):
    path = checkpoint.save(str(tmp_path), _async())
    with h5py.File(path, "r+") as f:
        f.attrs["gem_mpi_checkpoint"] = checkpoint.FORMAT - 1
    with pytest.raises(UsageError, match=f"checkpoint format {checkpoint.FORMAT - 1}, this "
                                         f"gem_mpi reads format {checkpoint.FORMAT}") as exc:
        checkpoint.load(path)
    assert "\n" not in str(exc.value)


def test_changes_and_compatibility_read_the_typed_checkpoint():
    ckpt = _async()
    ckpt.config = Config.of(lr=0.05).as_dict()
    now = Config.of(lr=0.02).as_dict()
    checkpoint.check_compatible(ckpt, now, WORKERS)
    assert checkpoint.changes(ckpt, now)["lr"] == [0.05, 0.02]
    checkpoint.check_compatible(ckpt, now, WORKERS + 1)  # asynchronous: any number
    ckpt.config = Config.of(method="sync").as_dict()
    with pytest.raises(UsageError, match="run of 3 workers, this one has 4"):
        checkpoint.check_compatible(ckpt, Config.of(method="sync").as_dict(), WORKERS + 1)


def test_a_synchronous_adamw_checkpoint_keeps_its_state_and_is_refused_without_it(tmp_path):
    """AdamW's second moment and step counts (DiLoCo: each worker's, a row each) come back
    as written; a checkpoint of its settings without them is one line, not a resume at 0 (a
    momentum-SGD one, all a format-3 file before them held, still resumes)."""
    theta, tensors = np.arange(N, dtype=np.float32), 4
    state = {"momentum": theta * 2, "adam_v": theta ** 2,
             "adam_t": np.full(tensors, 9, np.int64),
             "inner_m": np.ones((2, N), np.float32), "inner_v": np.full((2, N), 3, np.float32),
             "inner_t": np.full((2, tensors), 9, np.int64)}
    config = Config.of(method="diloco", optimizer="adamw").as_dict()
    ckpt = Checkpoint(theta=theta, clock=9, run_id="s", elapsed_s=0.0, config=config,
                      n_workers=2, **state)
    back = checkpoint.load(checkpoint.save(str(tmp_path), ckpt))
    _same(ckpt, back)
    checkpoint.check_compatible(back, config, 2)
    for method, gone in (("sync", "adam_t"), ("diloco", "inner_v")):
        config = Config.of(method=method, optimizer="adamw").as_dict()
        back.config = config
        with pytest.raises(UsageError, match=f"holds no {gone}, the optimizer state a --method "
                                             f"{method} --optimizer adamw run") as exc:
            checkpoint.check_compatible(dataclasses.replace(back, **{gone: None}), config, 2)
        assert "\n" not in str(exc.value)
    sgd = Config.of(method="sync").as_dict()
    checkpoint.check_compatible(Checkpoint(theta=theta, clock=9, run_id="s", elapsed_s=0.0,
                                           config=sgd, n_workers=2, momentum=theta), sgd, 2)


def test_the_newest_k_are_kept_and_an_abandoned_future_is_dropped(tmp_path):
    def names() -> list[str]:
        return sorted(p.name for p in tmp_path.glob("checkpoint_*.h5"))

    theta = np.zeros(N, np.float32)
    for clock in (10, 20, 30):
        checkpoint.save(str(tmp_path), Checkpoint(theta=theta, clock=clock, run_id="r",
                                                  elapsed_s=0.0, config={}, n_workers=1), keep=2)
    assert names() == [checkpoint.NAME.format(clock=c) for c in (20, 30)]
    # a resume from clock 20 (30 held a diverging θ) writes 25: 30 is no longer the newest
    checkpoint.save(str(tmp_path), Checkpoint(theta=theta, clock=25, run_id="r", elapsed_s=0.0,
                                              config={}, n_workers=1), keep=2)
    assert names() == [checkpoint.NAME.format(clock=c) for c in (20, 25)]
    assert checkpoint.latest(str(tmp_path)).endswith(checkpoint.NAME.format(clock=25))


def _of(run_id: str, clock: int) -> Checkpoint:
    return dataclasses.replace(_async(), run_id=run_id, clock=clock)


def test_a_run_keeps_and_deletes_only_its_own_checkpoints(tmp_path):
    d = str(tmp_path)
    foreign = checkpoint.save(d, _of("other", 50))
    for clock in (10, 20, 30):
        checkpoint.save(d, _of("mine", clock), keep=2)
    mine = [p for _, p in checkpoint.listed(d) if checkpoint.run_of(p) == "mine"]
    assert [checkpoint.load(p).clock for p in mine] == [20, 30]
    # a later clock of another run is not "a future this run abandoned"
    assert checkpoint.run_of(foreign) == "other" and checkpoint.load(foreign).clock == 50
    assert checkpoint.latest(d) == foreign and checkpoint.latest(d, "mine") == mine[-1]


def test_resume_auto_continues_only_the_run_it_names(tmp_path):
    d = str(tmp_path)
    assert checkpoint.resolve("auto", d, None) is None  # nothing yet: start afresh
    own = checkpoint.save(d, _of("mine", 10))
    assert checkpoint.resolve("auto", d, None) == own  # the one run there
    assert checkpoint.resolve("auto", d, "mine") == own
    assert checkpoint.resolve("auto", d, "new") is None  # a named new run starts afresh
    foreign = checkpoint.save(d, _of("other", 20))
    assert checkpoint.resolve("auto", d, "mine") == own  # never the newer foreign one
    with pytest.raises(UsageError, match=r"holds checkpoints of 2 runs, .*mine.*--run-id"):
        checkpoint.resolve("auto", d, None)
    with pytest.raises(UsageError, match="is a checkpoint of run other, not of --run-id mine"):
        checkpoint.resolve(foreign, d, "mine")
    assert checkpoint.resolve(foreign, d, None) == foreign
    # a new run named like one that has checkpoints here would delete them as its own
    with pytest.raises(UsageError, match="holds checkpoints of run mine already"):
        checkpoint.resolve(None, d, "mine")
    assert checkpoint.resolve(None, d, None) is None and checkpoint.resolve(None, None, "x") is None


def _downpour(*extra: str) -> dict:
    """The recorded settings of tests/test_checkpoint.py's run, with ``extra`` options."""
    cfg, _ = config.parse(["--model", "quadratic", "--dataset", "synthetic", "--method",
                           "downpour", "--quadratic-dim", "2000", "--lr", "0.05", *extra])
    return cfg.as_dict()


@pytest.mark.parametrize("option, value", [
    ("--momentum", "0.5"), ("--kappa", "2"), ("--gem-shift", "paper"), ("--eps", "1e-8"),
    ("--pi-max", "3"), ("--seed", "1"), ("--quadratic-dim", "3000")])
def test_a_resume_may_change_lr_and_refuses_any_other_setting_in_one_line(tmp_path, option,
                                                                          value):
    """What rank 0 decides before anything is written (gem_mpi.session._resume): --lr may
    change; any other setting of the rule or the data is one line naming it, on as many
    workers as the checkpoint's and on others (an elastic resume). That the line reaches
    the user from rank 0 with exit 2 and the files untouched is tests/test_checkpoint.py's
    (a --momentum change under mpirun)."""
    path = checkpoint.save(str(tmp_path), dataclasses.replace(_async(), config=_downpour()))
    ckpt = checkpoint.load(path)  # the settings as a resume reads them back
    for workers in (WORKERS, WORKERS - 2, WORKERS + 2):
        checkpoint.check_compatible(ckpt, _downpour("--lr", "0.02"), workers)
        with pytest.raises(UsageError) as exc:
            checkpoint.check_compatible(ckpt, _downpour(option, value), workers)
        was = ckpt.config[option[2:].replace("-", "_")]
        assert f"{option} was {was!r}, now " in str(exc.value)
        assert "a resume may change only --lr" in str(exc.value) and "\n" not in str(exc.value)


def test_a_damaged_checkpoint_is_one_line(tmp_path):
    """Not HDF5 at all, or one bit of θ flipped (its checksum): refused, not resumed."""
    bad = tmp_path / "bad.h5"
    bad.write_bytes(b"not hdf5 at all" * 10)
    with pytest.raises(UsageError, match="not a readable checkpoint") as exc:
        checkpoint.load(str(bad))
    assert "\n" not in str(exc.value)
    path = checkpoint.save(str(tmp_path), _async())
    with h5py.File(path, "r+") as f:
        theta = f["theta"][()]
        theta.view(np.uint32)[7] ^= 1 << 3
        f["theta"][...] = theta
    with pytest.raises(UsageError, match="theta does not match its checksum") as exc:
        checkpoint.load(path)
    assert "\n" not in str(exc.value)


def test_another_cut_of_theta_cannot_continue_a_checkpoint():
    """Each shard's clock and tickets are its own: a checkpoint of --masters 2 resumed with
    --masters 1 is one line (tests/test_shards.py's stop is resumed with the same cut)."""
    ckpt = dataclasses.replace(_async(), config=_downpour("--masters", "2"))
    checkpoint.check_compatible(ckpt, _downpour("--masters", "2"), WORKERS)
    with pytest.raises(UsageError, match="was written by a run of --masters 2, this one has "
                                         "--masters 1; resume with --masters 2") as exc:
        checkpoint.check_compatible(ckpt, _downpour(), WORKERS)
    assert "\n" not in str(exc.value)
