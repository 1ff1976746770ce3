"""Jobs across several nodes on one machine, two ways (docs/ARCHITECTURE.md, "Working MPI
configuration"):

- Open MPI across three network namespaces (tests/netns.py): node 0 holds the master alone,
  nodes 1 and 2 two workers each; mpirun reaches them through a launch agent, MPI talks TCP
  over the nodes' own 169.254.77.0/24 link.
- MPICH with MPIR_CVAR_NUM_CLIQUES=2: its ranks split into two "nodes" (cliques, round robin
  over the ranks) that share no memory; run inside one namespace, so that what goes through
  its network module stays on that namespace's loopback.

Each runs the transport stress program, a GEM run that learns, and a worker killed mid-run
then `--resume auto`, and the tests check what MPI and gem_mpi decide per node.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import netns
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
from stacks import launch, stack_command

pytestmark = pytest.mark.mpi  # every test here launches mpirun or another process

SLOTS = [1, 2, 2]  # the master alone on node 0, two workers on each of nodes 1 and 2
# Open MPI across nodes over TCP: osc pt2pt (what gem_mpi's refusal names; osc rdma cannot
# make windows over btl tcp), no binding (every "node" has the same two cores).
TCP = ["--mca", "pml", "ob1", "--mca", "btl", "self,vader,tcp", "--bind-to", "none"]
ACROSS = [*TCP, "--mca", "osc", "pt2pt"]
SM_KEY = "alloc_shared_noncontig"  # the window info key only Open MPI's osc sm sets


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    with netns.cluster(SLOTS, tmp_path_factory.mktemp("nodes")) as cluster:
        yield cluster


def across(nodes: netns.Cluster, n: int, args: list[str], options: list[str] = ACROSS,
           timeout: float = 120) -> subprocess.CompletedProcess:
    """Run python ``args`` on ``n`` ranks across the nodes; never hangs past ``timeout``."""
    env = {k: v for k, v in mpi_env().items() if k != "GEM_NUM_THREADS"}
    return subprocess.run(nodes.mpirun(n, options, [sys.executable, *args]),
                          capture_output=True, text=True, timeout=timeout, check=False,
                          env={**env, **nodes.env()}, cwd=str(REPO))


def in_node0(nodes: netns.Cluster) -> tuple[str, ...]:
    return ("ip", "netns", "exec", nodes.nodes[0].netns)


def gem_lines(res: subprocess.CompletedProcess) -> list[str]:
    return [ln for ln in res.stderr.splitlines() if ln.startswith("gem_mpi:")]


def test_open_mpi_sees_three_nodes_and_never_picks_osc_sm_across_them(nodes, tmp_path):
    """MPI's shared-memory split follows the namespaces' host names; with osc sm allowed
    and preferred (``--mca osc sm,pt2pt``), the window across nodes is not sm's, while the
    same options on one node give sm's."""
    probe = [str(PROGS / "node_probe.py"), str(tmp_path / "across.json")]
    res = across(nodes, 5, probe, [*TCP, "--mca", "osc", "sm,pt2pt"])
    assert res.returncode == 0, res.stdout + res.stderr
    seen = json.loads((tmp_path / "across.json").read_text())
    hosts = [n.hostname for n in nodes.nodes]
    assert [r["host"] for r in seen] == [hosts[0], hosts[1], hosts[1], hosts[2], hosts[2]]
    assert [(r["local_rank"], r["local_size"]) for r in seen] == [
        (0, 1), (0, 2), (1, 2), (0, 2), (1, 2)]
    assert all(SM_KEY not in r["window_info"] for r in seen), seen

    one = subprocess.run(["mpirun", "-n", "2", "--oversubscribe", "--mca", "btl", "self,vader",
                          "--mca", "osc", "sm,pt2pt", sys.executable, str(PROGS / "node_probe.py"),
                          str(tmp_path / "one.json")], capture_output=True, text=True,
                         timeout=60, check=False, env=mpi_env(), cwd=str(REPO))
    assert one.returncode == 0, one.stderr
    assert all(SM_KEY in r["window_info"] for r in json.loads((tmp_path / "one.json").read_text()))


@pytest.mark.parametrize("osc, says", [
    ("sm", ("--mca osc sm serves the ranks of one node only, and this job spans 3 nodes: use "
           "--mca osc pt2pt over TCP")),
    (None, ("cannot create the one-sided windows gem_mpi needs (MPI_ERR_WIN: invalid window); "
           "with Open MPI over TCP (across nodes too) use --mca osc pt2pt")),
])
def test_a_component_that_cannot_work_across_nodes_is_refused_with_one_line(nodes, osc, says):
    """Forced osc sm, or Open MPI's own choice over TCP (osc rdma): one line, exit 2."""
    options = [*TCP, *(["--mca", "osc", osc] if osc else [])]
    res = across(nodes, 5, ["-m", "gem_mpi.train", *quadratic_args(steps=10)], options)
    assert res.returncode == 2, res.stdout + res.stderr
    lines = gem_lines(res)
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("gem_mpi: error: Open MPI 4.")
    assert says in lines[0]
    assert "Traceback" not in res.stderr


def test_transport_stress_across_nodes(nodes, tmp_path):
    """4 workers (2 per node) x 100 updates of 10 000 floats to the master on node 0."""
    out = tmp_path / "report.json"
    res = across(nodes, 5, [str(PROGS / "transport_stress.py"), "10000", "100", str(out)])
    assert res.returncode == 0, res.stdout + res.stderr
    assert_stress_report(out, 4, 100)


def test_gem_learns_across_nodes_with_budgets_per_node(nodes, tmp_path):
    """GEM on the quadratic; --verbose's placement line shows the budgets taken per node:
    the master, alone on its node, keeps all its cores for its kernel and its evaluation
    (on one node with 4 workers it would get 1), each worker half its node's cores."""
    metrics = tmp_path / "run.h5"
    res = across(nodes, 5, ["-m", "gem_mpi.train", "--verbose",
                            *quadratic_args(dim=2000, method="gem", steps=300, eval_every=0,
                                            metrics=metrics)])
    assert res.returncode == 0, res.stdout + res.stderr
    assert_learns(metrics, 4, 300)
    cores = len(os.sched_getaffinity(0))
    per_worker = max(1, (os.cpu_count() or 1) // 2)
    h = [n.hostname for n in nodes.nodes]
    w = [f"rank {r} (local {local}/2: cpu, {per_worker} threads)"
         for r, local in ((1, 0), (2, 1), (3, 0), (4, 1))]
    assert (f"gem_mpi: placement: 3 node(s); {h[0]}: rank 0 (master, local 0/1: kernel {cores} "
            f"threads, evaluation {cores} threads); {h[1]}: {w[0]}, {w[1]}; {h[2]}: {w[2]}, "
            f"{w[3]}") in gem_lines(res), res.stderr
    assert f"master kernel: C++ extension gem_mpi.algorithm._core ({cores} thread(s))" in res.stderr


def test_a_killed_worker_across_nodes_ends_the_job_and_the_resume_recovers(nodes, tmp_path):
    """SIGKILL of worker 3, alone on node 2 (a daemon's child, not mpirun's): the job ends,
    and --resume auto finishes it with every update applied exactly once."""
    workers = 3
    env = {**mpi_env(), **nodes.env()}
    kill_worker_mid_run(nodes.mpirun(workers + 1, ACROSS, [sys.executable,
                                                           *kill_run_args(tmp_path, workers)]),
                        env, REPO, tmp_path, workers + 1, victim=3)
    assert_resumed_exactly_once(lambda args: across(nodes, workers + 1, args, timeout=180),
                                tmp_path, workers)


# --- MPICH, two cliques -------------------------------------------------------------------

def test_mpich_cliques_split_the_ranks_into_nodes(nodes, tmp_path):
    """MPIR_CVAR_NUM_CLIQUES=2 changes MPI_COMM_TYPE_SHARED: ranks 0, 2, 4 on one "node",
    1, 3 on the other (round robin); the transport stress test over it."""
    probe = [str(PROGS / "node_probe.py"), str(tmp_path / "cliques.json")]
    res = launch("mpich-cliques", 5, probe, prefix=in_node0(nodes))
    assert res.returncode == 0, res.stdout + res.stderr
    seen = json.loads((tmp_path / "cliques.json").read_text())
    assert [(r["local_rank"], r["local_size"]) for r in seen] == [
        (0, 3), (0, 2), (1, 3), (1, 2), (2, 3)]
    out = tmp_path / "report.json"
    res = launch("mpich-cliques", 5, [str(PROGS / "transport_stress.py"), "10000", "100",
                                      str(out)], prefix=in_node0(nodes))
    assert res.returncode == 0, res.stdout + res.stderr
    assert_stress_report(out, 4, 100)


def test_mpich_cliques_learn_and_resume_a_killed_worker(nodes, tmp_path):
    """GEM learns over two cliques (with the per-node placement line), and a worker killed
    mid-run is resumed with every update exactly once."""
    metrics = tmp_path / "learn" / "run.h5"
    metrics.parent.mkdir()
    res = launch("mpich-cliques", 3, ["-m", "gem_mpi.train", "--verbose",
                                      *quadratic_args(dim=2000, method="gem", steps=300,
                                                      eval_every=0, metrics=metrics)],
                 timeout=180, prefix=in_node0(nodes))
    assert res.returncode == 0, res.stdout + res.stderr
    assert_learns(metrics, 2, 300)
    cores = len(os.sched_getaffinity(0))
    assert any(ln.startswith("gem_mpi: placement: 2 node(s); ") and
               f"rank 0 (master, local 0/2: kernel {max(1, cores - 1)} threads" in ln
               and "rank 1 (local 0/1: cpu" in ln for ln in gem_lines(res)), res.stderr

    workers = 3
    command, env = stack_command("mpich-cliques", workers + 1,
                                 kill_run_args(tmp_path, workers))
    kill_worker_mid_run([*in_node0(nodes), *command], env, REPO, tmp_path, workers + 1)
    assert_resumed_exactly_once(
        lambda args: launch("mpich-cliques", workers + 1, args, timeout=180,
                            prefix=in_node0(nodes)), tmp_path, workers)
