"""The MPI stacks clusters use, each run for real on this machine: the transport stress test
(nothing torn, lost or duplicated, every worker served) and a short GEM training run that
learns. The settings each stack needs are the ones docs/ARCHITECTURE.md's "Working MPI
configuration" table lists; real InfiniBand/RDMA hardware is not among them.

A stack whose software is missing fails with the install hint (tools/install.sh installs
it); GEM_MPI_MPICH=0 leaves Debian's MPICH out of both the install and this module, and
GEM_MPI_STACKS=0 the stacks from PyPI's wheels (Open MPI 5, MPICH 5, Intel MPI), each of which
runs in a virtualenv of its own (tools/wheel_venv.sh) with that venv's mpiexec and python.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from helpers import (
    PROGS,
    REPO,
    assert_learns,
    assert_resumed_exactly_once,
    assert_stress_report,
    kill_run_args,
    kill_worker_mid_run,
    mpi_env,
    quadratic_args,
)
from stacks import SELECTED, STACKS, WHEEL_STACKS, launch, stack_command

pytestmark = pytest.mark.mpi  # every test here launches mpirun or another process


@pytest.mark.parametrize("stack", SELECTED)
def test_transport_and_training_on_each_stack(stack, tmp_path):
    # the transport: 4 workers x 100 updates of 10 000 floats
    workers, steps = 4, 100
    out = tmp_path / "report.json"
    res = launch(stack, workers + 1, [str(PROGS / "transport_stress.py"), "10000", str(steps),
                                      str(out)])
    assert res.returncode == 0, res.stdout + res.stderr
    assert_stress_report(out, workers, steps)

    # a short GEM run that learns, its workers computing on a thread beside the one that
    # calls MPI (--worker-mode overlap: MPI_THREAD_FUNNELED, checked on every rank)
    metrics = tmp_path / "run.h5"
    res = launch(stack, 3, ["-m", "gem_mpi.train",
                            *quadratic_args("--worker-mode", "overlap", dim=2000, method="gem",
                                            steps=300, eval_every=0, metrics=metrics)])
    assert res.returncode == 0, res.stdout + res.stderr
    assert_learns(metrics, 2, 300)


def _accuracy(res: subprocess.CompletedProcess) -> float:
    found = re.findall(r"test accuracy ([0-9.]+) %", res.stdout + res.stderr)
    assert found, res.stdout + res.stderr
    return float(found[-1])


@pytest.mark.parametrize("stack", [s for s in SELECTED if s not in WHEEL_STACKS])
def test_mnist_cnn_learns_on_each_stack(stack):
    """The paper's net on Fashion-MNIST, 2 workers x 150 steps: about 77 % on every stack
    (the wheel stacks, kept short, learn the quadratic only)."""
    res = launch(stack, 3, ["-m", "gem_mpi.train", "--method", "gem", "--max-steps", "150",
                            "--eval-every", "0"], timeout=180)
    assert res.returncode == 0, res.stdout + res.stderr
    assert _accuracy(res) > 65


@pytest.mark.parametrize("stack", ["openmpi-tcp", "openmpi-ucx"])
def test_sync_on_open_mpi_transports(stack):
    """--method sync (Horovod, MPI_THREAD_MULTIPLE) over TCP and UCX; shared memory is
    tests/test_sync.py's."""
    res = launch(stack, 2, ["-m", "gem_mpi.train", "--method", "sync", "--max-steps", "60",
                            "--eval-every", "0"], timeout=180)
    assert res.returncode == 0, res.stdout + res.stderr
    assert _accuracy(res) > 55


def _sync_on_mpich_is_refused_with_one_line():
    res = launch("mpich", 2, ["-m", "gem_mpi.train", "--method", "sync", "--model",
                              "mnist-cnn", "--dataset", "synthetic", "--max-steps", "2"])
    assert res.returncode == 2, res.stdout + res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("gem_mpi:")]
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("gem_mpi: error: --method sync: Horovod here is built against "
                               "Open MPI, and this job runs on MPICH 4.")
    assert "Open MPI's mpirun" in lines[0]


if "mpich" in SELECTED:  # GEM_MPI_MPICH=0 leaves it out (as it leaves out the install)
    test_sync_on_mpich_is_refused_with_one_line = _sync_on_mpich_is_refused_with_one_line


@pytest.mark.parametrize("stack", [s for s in SELECTED if s in WHEEL_STACKS])
def test_sync_on_a_wheel_stack_is_refused_with_one_line(stack):
    """Horovod is built against Debian's Open MPI 4: under MPICH 5 or Intel MPI it would load
    a second MPI, under Open MPI 5 its import fails on a symbol 5 lacks. One line, exit 2."""
    res = launch(stack, 2, ["-m", "gem_mpi.train", "--method", "sync", "--model",
                            "mnist-cnn", "--dataset", "synthetic", "--max-steps", "2"])
    assert res.returncode == 2, res.stdout + res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("gem_mpi:")]
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("gem_mpi: error: --method sync: Horovod here is built against ")
    assert "mpirun" in lines[0] and "asynchronous method" in lines[0]


def test_a_stack_that_cannot_make_the_windows_is_refused_with_one_line():
    """Open MPI's osc rdma over btl tcp: every rank's Win.Allocate fails (MPI_ERR_WIN)."""
    launcher, options, extra = STACKS["openmpi-tcp"]
    STACKS["openmpi-tcp-rdma"] = (launcher, [*options[:-1], "rdma"], extra)
    try:
        res = launch("openmpi-tcp-rdma", 3, ["-m", "gem_mpi.train",
                                             *quadratic_args(steps=10)])
    finally:
        del STACKS["openmpi-tcp-rdma"]
    assert res.returncode == 2, res.stdout + res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("gem_mpi:")]
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("gem_mpi: error: Open MPI 4.")
    assert "cannot create the one-sided windows" in lines[0]
    assert "--mca osc pt2pt" in lines[0]
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize("stack", SELECTED)
def test_a_killed_worker_ends_the_job_and_the_resume_recovers(stack, tmp_path):
    """SIGKILL of a worker mid-run: the launcher ends the whole job (no hang), and a resume
    from the last checkpoint finishes the run with every update applied exactly once."""
    workers = 3
    launch(stack, 1, ["-c", "pass"])  # the launcher and its libraries are there (or fail)
    command, env = stack_command(stack, workers + 1, kill_run_args(tmp_path, workers))
    kill_worker_mid_run(command, env, REPO, tmp_path, workers + 1)
    assert_resumed_exactly_once(lambda args: launch(stack, workers + 1, args, timeout=180),
                                tmp_path, workers)


def test_one_node_jobs_get_open_mpi_s_shared_memory_windows_unless_the_user_chose():
    """start_mpi puts osc rdma's priority just below osc sm's (sm then serves any job on one
    node, rdma still a job across nodes); a user's own --mca osc choice is left alone."""
    # Rank 0 prints every rank's view in one line: two ranks printing at once may interleave.
    prog = ("import os; from gem_mpi.transport import start_mpi; c = start_mpi(); "
            "seen = c.gather(f\"{os.environ.get('OMPI_MCA_osc_rdma_priority')} "
            "{os.environ.get('OMPI_MCA_osc')}\"); "
            "c.Get_rank() == 0 and print('|'.join(seen))")

    def ranks_say(*options: str) -> set[str]:
        res = subprocess.run(["mpirun", "-n", "2", "--oversubscribe", "--mca", "btl",
                              "self,vader", *options, sys.executable, "-c", prog],
                             capture_output=True, text=True, timeout=60, check=False,
                             env=mpi_env(), cwd=str(REPO))
        assert res.returncode == 0, res.stderr
        seen = res.stdout.strip().split("|")
        assert len(seen) == 2, res.stdout
        return set(seen)

    assert ranks_say() == {"99 None"}
    assert ranks_say("--mca", "osc", "rdma") == {"None rdma"}
    assert ranks_say("--mca", "osc_rdma_priority", "101") == {"101 None"}
