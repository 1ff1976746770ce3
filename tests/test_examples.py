"""Your own model and data, for real: examples/ run as a user runs them (from the example's
directory, so MODULE is found as Python finds it), through real mpirun jobs, and bad user
code ends in one line from rank 0 with exit 2. The in-process checks of every bad input are
tests/unit/test_user_code.py."""

from __future__ import annotations

import math
import re
import subprocess
import sys
import time
from pathlib import Path

import h5py
import pytest
import torch
from helpers import REPO, mpi_env, mpirun_cmd, signal_when, steps_written

from gem_mpi.outputs.runfile import load_run

pytestmark = pytest.mark.mpi  # every test here launches mpirun or another process

EXAMPLES = REPO / "examples"
USER_CODE = REPO / "tests" / "user_code"
REGRESSION = ["--model", "regression:make_model", "--dataset", "regression:make_dataset",
              "--loss", "mse", "--lr", "0.02", "--batch-size", "32", "--eval-every", "0"]


def run(n: int, args: list[str], cwd: Path, timeout: float = 300,
        **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(mpirun_cmd(n, args), capture_output=True, text=True, check=False,
                          timeout=timeout, cwd=str(cwd), env={**mpi_env(), **env})


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small image folder (Fashion-MNIST as PNG files), made by the example's own script."""
    out = tmp_path_factory.mktemp("images")
    res = subprocess.run([sys.executable, "make_images.py", str(out), "--per-class", "120",
                          "--test-per-class", "30"], cwd=EXAMPLES / "image_cnn",
                         capture_output=True, text=True, timeout=120, check=False,
                         env=mpi_env())
    assert res.returncode == 0, res.stderr
    assert "1200 training and 300 test images in 10 classes" in res.stdout
    return out


def test_a_cnn_of_ones_own_on_an_image_folder_from_the_command_line(images, tmp_path):
    """examples/image_cnn: the user's CNN and ImageFolder, GEM, metrics, the saved model."""
    res = run(3, ["-m", "gem_mpi.train", "--model", "image_cnn:make_model", "--dataset",
                  "image_cnn:image_folder", "--epochs", "3", "--eval-every", "40",
                  "--metrics", str(tmp_path / "m.h5"), "--save", str(tmp_path / "cnn.pt")],
              EXAMPLES / "image_cnn", IMAGE_DIR=str(images))
    assert res.returncode == 0, res.stderr
    assert "gem on image_cnn:make_model/image_cnn:image_folder: 1 master + 2 workers" in res.stderr
    acc = float(re.search(r"test accuracy ([\d.]+) %", res.stderr).group(1))
    assert acc > 60.0, res.stderr  # 10 classes: chance is 10 %
    run_ = load_run(tmp_path / "m.h5")
    assert run_.config["model"] == "image_cnn:make_model" and run_.config["loss"] is None
    assert len(run_.updates["seq"]) == 2 * 3 * (1200 // 64)  # every step of both workers
    assert len(run_.eval["clock"]) >= 2
    # the saved state_dict loads into a fresh model of the user's factory
    sys.path.insert(0, str(EXAMPLES / "image_cnn"))
    try:
        import os

        os.environ["IMAGE_DIR"] = str(images)
        from image_cnn import make_model

        make_model().load_state_dict(torch.load(tmp_path / "cnn.pt", weights_only=True))
    finally:
        sys.path.remove(str(EXAMPLES / "image_cnn"))


def test_a_non_vision_model_from_python_returns_the_trained_model(tmp_path):
    """examples/regression/train.py: gem_mpi.fit with the user's functions, --loss mse; rank 0
    gets the trained model back; no accuracy where the targets are not class indices."""
    res = run(3, ["train.py", "--metrics", str(tmp_path / "r.h5"), "--epochs", "1"],
              EXAMPLES / "regression")
    assert res.returncode == 0, res.stderr
    m = re.search(r"finished: test mse of the returned model ([\d.]+) \(the variance of the "
                  r"targets is ([\d.]+)\)", res.stdout)
    assert m, res.stdout + res.stderr
    mse, var = float(m.group(1)), float(m.group(2))
    assert mse < 0.25 * var  # learnt most of it in one epoch per worker
    assert res.stdout.count("finished:") == 1  # rank 0 alone has the model
    with h5py.File(tmp_path / "r.h5", "r") as f:
        assert math.isnan(f["summary/test_accuracy"][()])
        # the run's own evaluation of θ is the returned model's test loss
        assert f["summary/test_loss"][()] == pytest.approx(mse, abs=6e-5)  # printed to 4 places
        assert f.attrs["method"] == "gem"


def test_a_users_model_trains_synchronously_on_horovod(tmp_path):
    res = run(2, ["-m", "gem_mpi.train", "--method", "sync", *REGRESSION, "--max-steps", "200",
                  "--save", str(tmp_path / "m.pt")], EXAMPLES / "regression")
    assert res.returncode == 0, res.stderr
    assert "done: 200 synchronous steps of 2 workers" in res.stderr
    assert "test accuracy n/a" in res.stderr
    assert (tmp_path / "m.pt").exists()


def test_a_users_run_stopped_by_signal_resumes_with_every_update_once(tmp_path):
    """Checkpoints and --resume auto with the user's model: stop mid-run, resume, and every
    worker's steps appear exactly once in the one metrics file. Worker 1 is made 30 times
    slower for the first part (a runtime option, free to change at a resume), so the stop
    comes mid-run however fast the machine."""
    args = ["-m", "gem_mpi.train", *REGRESSION, "--epochs", "2", "--metrics",
            str(tmp_path / "r.h5"), "--checkpoint-dir", str(tmp_path), "--checkpoint-every",
            "0", "--resume", "auto"]
    proc = subprocess.Popen(mpirun_cmd(3, [*args, "--straggler", "1:30"]), env=mpi_env(),
                            cwd=str(EXAMPLES / "regression"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    t0 = time.monotonic()
    # mid-run: 8 s in and training (a SIGUSR1 before the ranks' handlers are set, in their
    # start-up, ends a rank by the signal's default action)
    err = signal_when(proc, lambda: time.monotonic() - t0 > 8
                      and steps_written(tmp_path / "r.h5") > 0)
    assert proc.returncode == 3, err
    assert "stopped by signal" in err
    res = run(3, args, EXAMPLES / "regression")
    assert res.returncode == 0, res.stderr
    assert "resuming" in res.stderr
    run_ = load_run(tmp_path / "r.h5")
    steps = 2 * (16384 // 32)
    for worker in (1, 2):
        seqs = sorted(run_.updates["seq"][run_.updates["worker"] == worker].tolist())
        assert seqs == list(range(steps))
    assert run_.summary["finished"] == 1.0


def test_bad_user_code_is_one_line_from_rank_0_and_exit_2():
    """One job for the path from rank 0's check of the user's code to every rank's exit 2;
    each case (the code raising, an import failing, a loss that cannot take the output) is
    tests/unit/test_user_code.py's, in-process."""
    res = run(3, ["-m", "gem_mpi.train", "--model", "plugins:raises", "--dataset",
                  "plugins:blobs", "--batch-size", "8"], USER_CODE, timeout=120)
    assert res.returncode == 2, res.stderr
    says = "--model 'plugins:raises': raises() raised RuntimeError: cannot find my weights file"
    assert res.stderr.count("gem_mpi: error:") == 1 and says in res.stderr
    assert "Traceback" not in res.stderr


def test_bad_input_from_python_raises_the_same_line_on_every_rank(tmp_path):
    script = tmp_path / "fit_bad.py"
    script.write_text(
        "import sys\nimport gem_mpi\nfrom mpi4py import MPI\n"
        f"sys.path.insert(0, {str(USER_CODE)!r})\n"
        "import plugins\n"
        "try:\n"
        "    gem_mpi.fit(plugins.not_a_module, plugins.blobs, batch_size=8)\n"
        "except gem_mpi.UsageError as exc:\n"
        "    print(f'rank {MPI.COMM_WORLD.Get_rank()} caught: {exc}')\n"
        "try:\n"
        "    gem_mpi.fit(plugins.mlp, plugins.blobs, learning_rate=0.1)\n"
        "except gem_mpi.UsageError as exc:\n"
        "    print(f'rank {MPI.COMM_WORLD.Get_rank()} caught: {exc}')\n")
    res = run(3, [str(script)], tmp_path, timeout=120)
    assert res.returncode == 0, res.stderr
    line = "caught: --model 'plugins:not_a_module' returned a dict, not a torch.nn.Module"
    assert res.stdout.count(line) == 3, res.stdout  # every rank raises it
    assert res.stderr.count("gem_mpi: error:") == 1  # rank 0 says it once
    assert res.stdout.count("caught: gem_mpi.fit: no option 'learning_rate'") == 3
    assert "Traceback" not in res.stderr


def test_the_resnet_example_and_its_single_process_reference_both_train(tmp_path):
    """examples/fashion_resnet as its README runs it, cut to 60 steps: gem_mpi with bf16, a
    warm-up and cosine and a loader process per worker, and the plain PyTorch loop it is
    compared with; both learn, and the metrics file records every setting."""
    h5 = tmp_path / "r.h5"
    res = run(3, ["-m", "gem_mpi.train", "--model", "fashion_resnet:make_model", "--loss",
                  "cross_entropy", "--shard", "--batch-size", "64", "--lr", "0.05", "--amp",
                  "bf16", "--lr-schedule", "cosine", "--warmup-steps", "10",
                  "--loader-workers", "1", "--eval-every", "0", "--max-steps", "60",
                  "--metrics", str(h5)], EXAMPLES / "fashion_resnet")
    assert res.returncode == 0, res.stderr
    acc = float(re.search(r"test accuracy ([\d.]+) %", res.stderr).group(1))
    assert acc > 40.0, res.stderr  # 10 classes: chance is 10 %
    cfg = load_run(h5).config
    assert (cfg["amp"], cfg["lr_schedule"], cfg["loader_workers"]) == ("bf16", "cosine", 1)
    ref = subprocess.run([sys.executable, "reference.py", "--max-steps", "120",
                          "--warmup-steps", "20"], cwd=EXAMPLES / "fashion_resnet",
                         capture_output=True, text=True, timeout=300, check=False,
                         env=mpi_env())
    assert ref.returncode == 0, ref.stderr
    assert float(re.search(r"test accuracy ([\d.]+) %", ref.stdout).group(1)) > 40.0
