"""The user's model, dataset and loss, checked in-process by rank 0's validation: each bad
input is one UsageError line saying which and why (tests/test_examples.py runs the good ones,
and one bad one from the command line and one from Python, through mpirun)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gem_mpi import config
from gem_mpi.errors import UsageError
from gem_mpi.run.preflight import validate

USER_CODE = Path(__file__).resolve().parents[1] / "user_code"
GOOD = {"model": "plugins:mlp", "dataset": "plugins:blobs"}


@pytest.fixture(autouse=True)
def user_code_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(USER_CODE))


def check(**options: object) -> None:
    validate(config.Config.of(**{**GOOD, "batch_size": 8, **options}), 3)


def test_a_model_and_dataset_of_ones_own_pass_every_check() -> None:
    check()
    check(loss="plugins:half_ce")
    check(loss="cross_entropy")


BAD = [
    # (options, what the one line must say)
    ({"model": "nowhere_module:make"}, "cannot import 'nowhere_module' (ModuleNotFoundError"),
    ({"model": "broken_import:make"}, ("cannot import 'broken_import' (ModuleNotFoundError: "
                                      "No module named 'this_package_does_not_exist')")),
    ({"model": "plugins:missing"}, "has no 'missing'"),
    ({"model": "plugins:NOT_A_FUNCTION"}, "'NOT_A_FUNCTION' is a int, not a function"),
    ({"model": "plugins:raises"}, "raises() raised RuntimeError: cannot find my weights file"),
    ({"model": "plugins:not_a_module"}, "returned a dict, not a torch.nn.Module"),
    ({"model": "plugins:no_parameters"}, "the model has no parameters to train"),
    ({"model": "plugins:float64"}, "is torch.float64; gem_mpi trains float32 parameters"),
    ({"dataset": "plugins:iterable"}, "returned a _Stream, not a map-style dataset"),
    ({"dataset": "plugins:empty"}, "empty('train') is empty"),
    ({"dataset": "plugins:not_pairs"}, ("sample 0 of 'train' is a Tensor, not an (input, "
                                       "target) pair")),
    ({"dataset": "plugins:wrong_shape"}, ("--model 'plugins:mlp' cannot take a batch of "
                                         "--dataset 'plugins:wrong_shape' (inputs (4, 7)")),
    ({"dataset": "plugins:float_targets"}, ("--loss cross_entropy cannot take the model's "
                                           "output (4, 3) torch.float32 with the targets "
                                           "(4, 2) torch.float32")),
    ({"loss": "mse"}, ("--loss mse cannot take the model's output (4, 3) torch.float32 "
                      "with the targets (4,) torch.int64 of --dataset 'plugins:blobs': "
                      "ValueError: mse compares outputs and targets of one shape")),
    ({"loss": "plugins:vector_loss"}, ("--loss plugins:vector_loss returned a tensor of "
                                      "shape (4,), not a scalar tensor")),
    ({"loss": "hinge"}, "unknown --loss 'hinge'; choose from cross_entropy, nll, mse"),
    ({"loss": "plugins"}, "unknown --loss 'plugins'"),
    ({"model": "mnist-cnn"}, ("--dataset 'plugins:blobs' is a dataset of your own and --model "
                             "mnist-cnn is built for the built-in datasets")),
    ({"model": "quadratic", "dataset": "synthetic", "loss": "mse"},
     "--model quadratic has its own objective"),
    ({"model": "mymodel"}, "unknown --model 'mymodel'; choose from mnist-cnn"),
    ({"batch_size": 1000}, "--batch-size 1000 exceeds the 600 training samples"),
]


@pytest.mark.parametrize("options,says", BAD, ids=[str(b[0]) for b in BAD])
def test_each_bad_input_is_one_line_saying_which_and_why(options: dict, says: str) -> None:
    with pytest.raises(UsageError) as err:
        check(**options)
    line = str(err.value)
    assert says in line
    assert "\n" not in line


def test_functions_given_from_python_are_found_by_their_recorded_name() -> None:
    from gem_mpi.problem.user import register, resolve

    def make() -> object:  # a closure: not importable by its name
        return None

    name = register(make, "model")
    assert name.endswith(":test_functions_given_from_python_are_found_by_their_recorded_name."
                         "<locals>.make")
    assert resolve(name, "--model") is make
    with pytest.raises(UsageError, match="expected a function, got int"):
        register(3, "model")


def test_a_users_loss_is_weighed_by_the_batch_in_the_evaluation() -> None:
    import torch

    from gem_mpi.problem.loss import make_loss

    out, y = torch.randn(5, 3), torch.tensor([0, 1, 2, 1, 0])
    ce = make_loss(None, "plugins:mlp")
    assert ce.name == "cross_entropy"
    assert make_loss(None, "mnist-cnn").name == "nll"  # the built-in models keep theirs
    mine = make_loss("plugins:half_ce", "plugins:mlp")
    torch.testing.assert_close(mine.total(out, y), 0.5 * ce.total(out, y))
