"""The MPI stacks clusters use, each run for real on this machine: the transport stress test
(nothing torn, lost or duplicated, every worker served) and a short GEM training run that
learns. The settings each stack needs are the ones docs/ARCHITECTURE.md's "Working MPI
configuration" table lists; real InfiniBand/RDMA hardware is not among them.

A stack whose software is missing fails with the install hint (tools/install.sh installs
it); GEM_MPI_MPICH=0 leaves MPICH out of both the install and this module.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from conftest import PROGS, REPO, mpi_env
from helpers import assert_exactly_once, quadratic_args

# where tools/install.sh puts the libmpi.so.12 -> Debian's libmpich.so.12 link that
# mpi4py's wheel needs to load MPICH (MPI4PY_MPIABI=mpich)
MPICH_LIB = Path(os.environ.get("GEM_MPI_MPICH_LIB", Path.home() / ".cache/gem_mpi/mpich/lib"))
INSTALL_HINT = "run tools/install.sh (it installs Debian's mpich and the library link)"

LOOPBACK_TCP = ["--mca", "btl", "self,tcp", "--mca", "btl_tcp_if_include", "lo",
                "--mca", "oob_tcp_if_include", "lo"]
# name -> (launcher, launcher options, environment)
STACKS: dict[str, tuple[str, list[str], dict[str, str]]] = {
    "openmpi-sm": ("mpirun", ["--oversubscribe", "--mca", "btl", "self,vader",
                              "--mca", "osc", "rdma"], {}),
    # one node, Open MPI's shared-memory one-sided component: Get runs at memcpy speed
    "openmpi-osc-sm": ("mpirun", ["--oversubscribe", "--mca", "btl", "self,vader",
                                  "--mca", "osc", "sm"], {}),
    "openmpi-tcp": ("mpirun", ["--oversubscribe", "--mca", "pml", "ob1", *LOOPBACK_TCP,
                               "--mca", "osc", "pt2pt"], {}),
    "openmpi-ucx": ("mpirun", ["--oversubscribe", "--mca", "pml", "ucx", "--mca", "osc", "ucx",
                               "--mca", "pml_ucx_tls", "any", "--mca", "pml_ucx_devices", "any",
                               *LOOPBACK_TCP], {"UCX_TLS": "tcp,self,sm",
                                                "UCX_NET_DEVICES": "lo"}),
    "mpich": ("mpiexec.mpich", [], {"MPI4PY_MPIABI": "mpich",
                                    "LD_LIBRARY_PATH": str(MPICH_LIB)}),
}
SELECTED = [s for s in STACKS if s != "mpich" or os.environ.get("GEM_MPI_MPICH", "1") != "0"]


def launch(stack: str, n: int, args: list[str], timeout: float = 90
           ) -> subprocess.CompletedProcess:
    launcher, options, extra = STACKS[stack]
    if shutil.which(launcher) is None:
        pytest.fail(f"{stack}: {launcher} is missing; {INSTALL_HINT}")
    if stack == "mpich" and not (MPICH_LIB / "libmpi.so.12").exists():
        pytest.fail(f"mpich: {MPICH_LIB}/libmpi.so.12 is missing; {INSTALL_HINT}")
    env = {**mpi_env(), **extra}
    if stack == "mpich":  # Open MPI's variables mean nothing to it
        env = {k: v for k, v in env.items() if not k.startswith("OMPI_")}
    return subprocess.run([launcher, "-n", str(n), *options, sys.executable, *args],
                          capture_output=True, text=True, timeout=timeout, check=False,
                          env=env, cwd=str(REPO))


@pytest.mark.parametrize("stack", SELECTED)
def test_transport_and_training_on_each_stack(stack, tmp_path):
    # the transport: 4 workers x 100 updates of 10 000 floats
    workers, steps = 4, 100
    out = tmp_path / "report.json"
    res = launch(stack, workers + 1, [str(PROGS / "transport_stress.py"), "10000", str(steps),
                                      str(out)])
    assert res.returncode == 0, res.stdout + res.stderr
    r = json.loads(out.read_text())
    log = np.array(r["log"])
    total = workers * steps
    assert r["torn"] == 0
    assert len(log) == total
    assert_exactly_once(log[:, 0], log[:, 1], range(1, workers + 1), steps)
    assert sorted(log[:, 2].tolist() + r["done_tickets"]) == list(range(total + workers))
    assert r["theta_min"] == r["theta_max"] == float(total) == r["version"]
    first_half = Counter(log[: total // 2, 0].tolist())  # every worker served early on
    assert min(first_half.get(w, 0) for w in range(1, workers + 1)) >= 0.25 * total / 2 / workers

    # a short GEM run that learns
    metrics = tmp_path / "run.h5"
    res = launch(stack, 3, ["-m", "gem_mpi.train",
                            *quadratic_args(dim=2000, method="gem", steps=300, eval_every=0,
                                            metrics=metrics)])
    assert res.returncode == 0, res.stdout + res.stderr
    from gem_mpi.outputs.analysis import load_run

    u = load_run(metrics).updates
    assert len(u["loss"]) == 2 * 300
    assert np.mean(u["loss"][-50:]) < 0.5 * np.mean(u["loss"][:50])


def _accuracy(res: subprocess.CompletedProcess) -> float:
    found = re.findall(r"test accuracy ([0-9.]+) %", res.stdout + res.stderr)
    assert found, res.stdout + res.stderr
    return float(found[-1])


@pytest.mark.parametrize("stack", SELECTED)
def test_mnist_cnn_learns_on_each_stack(stack):
    """The paper's net on Fashion-MNIST, 2 workers x 150 steps: about 77 % on every stack."""
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


def _job_ranks(launcher_pid: int) -> dict[int, int]:
    """MPI rank -> pid of the ranks below a launcher process, whatever the launcher (Open
    MPI's OMPI_COMM_WORLD_RANK, MPICH's PMI_RANK; MPICH's proxy starts its own session)."""
    table = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True,
                           check=False).stdout.split()
    children: dict[int, list[int]] = {}
    for pid, ppid in zip(map(int, table[::2]), map(int, table[1::2])):
        children.setdefault(ppid, []).append(pid)
    pids, todo = [], [launcher_pid]
    while todo:
        for child in children.get(todo.pop(), []):
            pids.append(child)
            todo.append(child)
    out = {}
    for pid in pids:
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for item in environ:
            key, _, value = item.partition(b"=")
            if key in (b"OMPI_COMM_WORLD_RANK", b"PMI_RANK") and b"python" in Path(
                    f"/proc/{pid}/cmdline").read_bytes():
                out[int(value)] = pid
    return out


@pytest.mark.parametrize("stack", SELECTED)
def test_a_killed_worker_ends_the_job_and_the_resume_recovers(stack, tmp_path):
    """SIGKILL of a worker mid-run: the launcher ends the whole job (no hang), and a resume
    from the last checkpoint finishes the run with every update applied exactly once."""
    import signal
    import time

    from gem_mpi.outputs.analysis import load_run

    workers, steps = 3, 2000
    args = ["-m", "gem_mpi.train",
            *quadratic_args(method="downpour", dim=2000, steps=steps, eval_every=0,
                            metrics=tmp_path / "run.h5", checkpoint_dir=tmp_path,
                            checkpoint_every=0.3)]
    launcher, options, extra = STACKS[stack]
    launch(stack, 1, ["-c", "pass"])  # the launcher and its libraries are there (or fail)
    env = {**mpi_env(), **extra}
    if stack == "mpich":
        env = {k: v for k, v in env.items() if not k.startswith("OMPI_")}
    proc = subprocess.Popen([launcher, "-n", str(workers + 1), *options, sys.executable, *args],
                            env=env, cwd=str(REPO), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        ranks: dict[int, int] = {}
        while not (list(tmp_path.glob("checkpoint_*.h5")) and len(ranks) == workers + 1):
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "the job never got going"
            time.sleep(0.2)
            ranks = _job_ranks(proc.pid)
        os.kill(ranks[2], signal.SIGKILL)
        t0 = time.monotonic()
        proc.communicate(timeout=60)  # the job must end, not hang
        ended = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode != 0 and ended < 60
    res = launch(stack, workers + 1, [*args, "--resume", "auto"], timeout=180)
    assert res.returncode == 0, res.stdout + res.stderr
    u = load_run(tmp_path / "run.h5").updates
    assert_exactly_once(u["worker"], u["seq"], range(1, workers + 1), steps)


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
