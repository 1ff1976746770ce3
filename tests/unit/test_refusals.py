"""Bad input that rank 0 decides before any window exists, checked in-process: each is one
UsageError line from ``validate``. That such a line reaches the user as one line from rank 0
and exit 2 on every rank is held by one mpirun job per engine (tests/test_ddp.py,
test_diloco.py, test_groups.py, test_shards.py) and by tests/test_cli.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from gem_mpi import config
from gem_mpi.errors import UsageError
from gem_mpi.run.preflight import validate

USER_CODE = Path(__file__).resolve().parents[1] / "user_code"
QUADRATIC = ("--model", "quadratic", "--dataset", "synthetic")
# a CNN on synthetic data, 12 steps a worker, its metrics (and so its traces) in the cwd
SMALL = ("--dataset", "synthetic", "--synthetic-size", "512", "--batch-size", "16",
         "--max-steps", "12", "--metrics", "run.h5")


@pytest.mark.parametrize("ranks, argv, says", [
    (2, ("--method", "ddp", *QUADRATIC), "--method ddp trains torch models"),
    (2, ("--method", "ddp", "--worker-mode", "overlap"), "--method ddp has no master"),
    (2, ("--method", "ddp", "--wire", "bf16"), "--method ddp averages gradients"),
    (3, ("--worker-mode", "overlap", "--gradient-at", "ahead"),
     "--gradient-at must be one of own, pulled"),
    (2, ("--method", "diloco", *QUADRATIC), "--method diloco trains torch models"),
    (2, ("--method", "diloco", "--worker-mode", "overlap"), "--method diloco has no master"),
    (2, ("--method", "gem", "--diloco-steps", "5"), "--diloco-steps 5 is DiLoCo's"),
    (2, ("--method", "sync", "--diloco-outer-lr", "0.5"), "--diloco-outer-lr 0.5 is DiLoCo's"),
    (2, ("--method", "diloco", "--diloco-steps", "50", "--max-steps", "20"),
     "--diloco-steps 50 is longer than the run"),
    (2, ("--method", "diloco", "--diloco-outer-momentum", "1"), "--diloco-outer-momentum"),
    (3, ("--optimizer", "adamw", "--momentum", "0.5"), "--momentum 0.5 is momentum SGD's"),
    (3, ("--betas", "0.9,0.95"), "--betas 0.9,0.95 is AdamW's: --optimizer sgd does not"),
    (3, ("--weight-decay", "0.1"), "--weight-decay 0.1 is AdamW's"),
    (3, ("--optimizer", "adamw", "--betas", "0.9"), "--betas must be two numbers"),
    (3, ("--optimizer", "adamw", "--betas", "0.9,1"), "--betas must be two numbers"),
    (3, ("--optimizer", "adam"), "--optimizer must be one of sgd, adamw"),
    (2, ("--optimizer", "adamw", "--method", "ddp", "--momentum", "0.5"),
     "--momentum 0.5 is momentum SGD's: --optimizer adamw does not use it"),
    (3, ("--optimizer", "adamw", "--gem-shift", "paper"), "not derived for an AdamW proxy"),
    (3, ("--optimizer", "adamw", "--gem-proxy", "global"), "--gem-proxy global keeps"),
    (3, ("--model", "gpt"), "--model gpt reads --dataset text"),
    (3, ("--dataset", "text"), "not --model mnist-cnn on --dataset text"),
    (3, ("--context", "32"), "--context 32 is for --dataset text"),
    (3, ("--gpt-width", "64"), "--gpt-width 64 is for --model gpt"),
    (3, ("--model", "gpt", "--dataset", "text", "--gpt-heads", "3"), "must divide --gpt-width"),
    (3, ("--model", "gpt", "--dataset", "text", "--data-dir", str(USER_CODE / "nowhere")),
     "is not a directory"),
    (3, ("--method", "sync", "--local-steps", "4"), "--local-steps 4 is for the asynchronous"),
    (3, ("--method", "diloco", "--local-steps", "4"), "its rounds are --diloco-steps"),
    (5, ("--local-steps", "4", "--group-size", "2"), "--local-steps 4 with --group-size 2"),
    (3, ("--local-steps", "4", "--gem-shift", "paper"), "not derived for local steps"),
    (3, ("--local-steps", "4", "--gem-proxy", "global"), "the worker's own H steps"),
    (3, ("--local-steps", "0"), "--local-steps must be > 0"),
    (3, ("--dylu",), "--dylu sets each worker's local steps below --local-steps H: give"),
    (3, ("--method", "dn", "--local-steps", "1", "--dylu"), "give --local-steps H > 1"),
    (3, ("--method", "sync", "--dylu"), "--dylu is for the asynchronous methods: --method sync"),
    (2, ("--method", "diloco", "--local-steps", "4", "--dylu"),
     "--dylu is for the asynchronous methods: --method diloco is synchronous"),
    (3, ("--method", "dn", "--wire", "bf16"), "--wire bf16 with --method dn is not built"),
    (2, ("--method", "ddp", "--worker-nice", "5"), "--worker-nice 5 is for the asynchronous"),
    (3, ("--worker-nice", "20"), "--worker-nice must be 'auto' or an integer in [0, 19]"),
    (3, ("--worker-nice", "-1"), "--worker-nice must be 'auto' or an integer in [0, 19]"),
    (5, ("--method", "dn", "--masters", "2"), "--masters 2 with --method dn is not built"),
    (3, ("--method", "dn", "--gem-shift", "paper"), "--gem-shift paper is GEM's"),
    (3, ("--method", "gem", "--dn-every", "4"), "--dn-every 4 is delayed Nesterov's"),
    (3, ("--method", "dn", "--dn-momentum", "1"), "--dn-momentum must be in [0, 1)"),
    (4, ("--speeds", "1,2"), "--speeds gives 2 factors for the run's 3 workers"),
    (4, ("--speeds", "1,2,0"), "worker 3's factor must be in [1, 1000]"),
    (4, ("--speeds", "1,fast,2"), "--speeds wants numbers"),
    (4, ("--speeds", "1,2,3", "--straggler", "2:3"), "--straggler would be a second one"),
    (4, ("--group-size", "2"), "--group-size 2 must divide the 3 worker ranks"),
    (4, ("--group-size", "2", "--method", "ddp"), "--method ddp is synchronous"),
    (5, ("--group-size", "2", *QUADRATIC), "--model quadratic has none"),
    (3, ("--group-size", "2", "--model", "plugins:mlp", "--dataset", "plugins:blobs",
         "--loss", "cross_entropy", "--batch-size", "400"),
     "--batch-size 400 × --group-size 2 exceeds the 600 training samples"),
    (3, ("--profile-steps", "5:2", *SMALL), "--profile-steps must be A:B, step numbers 0 <= A"),
    (3, ("--profile-steps", "x", *SMALL), "--profile-steps must be A:B"),
    (3, ("--profile-steps=-1:3", *SMALL), "--profile-steps must be A:B"),
    (3, ("--profile-steps", "5:8", "--dataset", "synthetic"), "give --profile-dir DIR"),
    (3, ("--profile-dir", "traces", *SMALL), "--profile-dir 'traces' is for --profile-steps"),
    (3, ("--profile-steps", "2:4", *QUADRATIC, "--metrics", "q.h5"),
     "--model quadratic computes in numpy"),
    (3, ("--profile-steps", "5:12", *SMALL), "ends after the run: each worker takes 12 steps"),
    (2, ("--profile-steps", "5:10", "--method", "diloco", "--diloco-steps", "5", *SMALL),
     "each worker takes 10 steps, 0 to 9"),
    (3, ("--profile-steps", "1:2", *SMALL, "--profile-dir", str(USER_CODE / "plugins.py")),
     "is not a directory"),
])
def test_bad_input_is_one_line_from_the_preflight(monkeypatch, ranks, argv, says):
    monkeypatch.syspath_prepend(str(USER_CODE))
    cfg, _ = config.parse(list(argv))
    with pytest.raises(UsageError) as err:
        validate(cfg, ranks)
    assert says in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("method", ["sync", "ddp", "diloco", "gap-aware", "dn"])
def test_adamw_trains_every_method(method):
    """Accepted by the preflight (its runs: tests/test_sync.py, tests/test_adamw.py)."""
    cfg, _ = config.parse(["--optimizer", "adamw", "--method", method, "--betas", "0.8,0.99"])
    validate(cfg, 2, data=False)


@pytest.mark.parametrize("ranks, argv, says", [
    (4, ("--masters", "4"), "--masters 4 needs at least 5 MPI ranks"),
    (7, ("--masters", "5"), "--masters 5: θ is cut between tensors and this model has only 4"),
    (4, ("--masters", "2", "--method", "sync"), "--masters 2 is for the asynchronous methods"),
    (4, ("--masters", "0"), "--masters must be > 0"),
])
def test_bad_masters_is_one_line_from_rank_0(ranks, argv, says):
    """Rank 0's checks before any window (gem_mpi.session's, the cut of θ between tensors
    included); the line's way to every rank's exit 2: tests/test_shards.py."""
    from gem_mpi.session import _check_on_master

    with pytest.raises(UsageError) as err:
        cfg, _ = config.parse([*QUADRATIC, "--quadratic-dim", "2000", "--max-steps", "5",
                               *argv])
        _check_on_master(cfg, ranks)
    assert says in str(err.value) and "\n" not in str(err.value)
