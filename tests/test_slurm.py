"""The batch scripts under jobs/, submitted to a real Slurm.

``tools/slurm_local.sh`` installs (the first time, from Debian's packages) and starts a
single-node Slurm on this machine; it is quick when Slurm already runs. Each test submits
the actual scripts with ``sbatch`` and small overrides (few workers, the numpy quadratic
instead of the default Fashion-MNIST net, small budgets), waits for the jobs by polling
``scontrol`` under a hard deadline (a job still running then is cancelled and the test fails
with its log), and checks the job's final state and exit code, its log, and the HDF5 files.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from helpers import REPO, assert_exactly_once, mpi_env, quadratic_args

from gem_mpi.outputs import checkpoint
from gem_mpi.outputs.runfile import RunFileError, RunFollower, load_run

pytestmark = pytest.mark.mpi  # every test here launches mpirun or another process

JOBS = REPO / "jobs"
# the numpy test problem: no torch in any rank, so 101 ranks fit in memory (tools/scale.sh)
QUAD = " ".join(quadratic_args(dim=1000, eval_every=0, poll_max_ms=20))
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
         "PREEMPTED", "BOOT_FAIL", "DEADLINE"}


@pytest.fixture(scope="module")
def slurm() -> None:
    """A running one-node Slurm. When it is not up yet, tools/slurm_local.sh needs root (it
    installs Debian packages, writes /etc/slurm/slurm.conf, starts munged, slurmctld and
    slurmd): without root these tests skip with that reason (a failure on CI, which runs as
    root with GEM_MPI_NO_SKIPS=1)."""
    res = subprocess.run(["bash", str(REPO / "tools" / "slurm_local.sh")], capture_output=True,
                         text=True, timeout=900, check=False)
    if res.returncode != 0 and os.geteuid() != 0:
        last = (res.stderr.strip().splitlines() or ["no message"])[-1]
        pytest.skip(f"Slurm is not running and starting it needs root ({last})")
    assert res.returncode == 0, f"tools/slurm_local.sh failed:\n{res.stderr}"


def job_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The tests' MPI environment (the checkout's gem_mpi first on PYTHONPATH) with no GEM_*
    setting from outside except the python to use, output under tmp_path, plus ``extra``."""
    env = {k: v for k, v in mpi_env().items()
           if not k.startswith(("GEM_", "SLURM_", "SBATCH_")) or k in ("GEM_MPI_VENV", "GEM_MPI_PY")}
    env["GEM_OUT_DIR"] = str(tmp_path / "runs")
    env.update(extra)
    return env


def sbatch(script: Path | None, *options: str, env: dict[str, str], cwd: Path) -> str:
    """Submit the script (None: a --wrap option) from ``cwd``; returns the job id."""
    cmd = ["sbatch", "--parsable", *options, *([str(script)] if script else [])]
    res = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=60,
                         check=False)
    assert res.returncode == 0, f"{' '.join(cmd)} failed: {res.stderr}"
    return res.stdout.strip().split(";")[0]


def records(job: str) -> list[dict[str, str]]:
    """``scontrol show job`` as one dict per job (an array: one per task or pending range)."""
    res = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True,
                         text=True, timeout=60, check=False)
    out = []
    for line in res.stdout.splitlines() if res.returncode == 0 else []:
        fields = (item.partition("=") for item in line.split())
        out.append({key: value for key, sep, value in fields if sep})
    return out


def logs(cwd: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-6000:]}"
                     for p in sorted(cwd.glob("*.out")))


def wait(job: str, timeout: float, cwd: Path, until=None) -> list[dict[str, str]]:
    """Poll until every record of the job has ended (or ``until(records)`` is true); past
    ``timeout`` seconds, cancel the job and fail with the logs in ``cwd``."""
    deadline = time.monotonic() + timeout
    while True:
        recs = records(job)
        if recs and (until(recs) if until else all(r["JobState"] in ENDED for r in recs)):
            return recs
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job], timeout=60, check=False)
            states = [(r.get("JobId"), r.get("JobState"), r.get("Restarts")) for r in recs]
            pytest.fail(f"job {job} not done after {timeout} s: {states}\n{logs(cwd)}")
        time.sleep(0.5)


def ended_ok(rec: dict[str, str], log: str) -> None:
    assert (rec["JobState"], rec["ExitCode"]) == ("COMPLETED", "0:0"), log


def test_slurm_local_is_idempotent_and_quick_when_running(slurm):
    t0 = time.monotonic()
    res = subprocess.run(["bash", str(REPO / "tools" / "slurm_local.sh")], capture_output=True,
                         text=True, timeout=120, check=False)
    took = time.monotonic() - t0
    assert res.returncode == 0 and res.stderr == "", res.stderr  # nothing to do, nothing said
    assert took < 5, f"second start took {took:.1f} s"
    status = subprocess.run(["bash", str(REPO / "tools" / "slurm_local.sh"), "status"],
                            timeout=60, check=False)
    assert status.returncode == 0
    conf = Path("/etc/slurm/slurm.conf").read_text()
    assert conf.startswith("# gem_mpi local test cluster")


def test_gem_100_asks_for_101_tasks_and_runs_every_task_to_completion(slurm, tmp_path):
    """The default script: Slurm reads its request as 101 tasks (``sbatch --test-only``,
    nothing run: 101 ranks are tools/scale.sh's scale check, not a test), and the script as
    is, with 17 of them (srun --mpi=pmix), the quadratic instead of the paper's net and 5
    steps per worker, runs every task to completion."""
    test = subprocess.run(["sbatch", "--test-only", str(JOBS / "gem_mnist_100.sbatch")],
                          env=job_env(tmp_path), cwd=tmp_path, capture_output=True, text=True,
                          timeout=60, check=False)
    assert test.returncode == 0 and " using 101 processors " in test.stderr, test.stderr
    env = job_env(tmp_path, GEM_TRAIN_ARGS=f"{QUAD} --max-steps 5")
    job = sbatch(JOBS / "gem_mnist_100.sbatch", "--ntasks=17", env=env, cwd=tmp_path)
    [rec] = wait(job, 300, tmp_path)
    log_path = tmp_path / f"gem_mnist_100_{job}.out"  # %x_%j
    log = log_path.read_text()
    ended_ok(rec, log)
    assert rec["NumTasks"] == "17"
    assert "17 ranks (1 master + 16 workers)" in log
    assert "srun --mpi=pmix --ntasks=17 " in log
    assert "gem_jobs: done" in log
    runs = tmp_path / "runs"
    run = load_run(runs / f"gem_mnist_100_{job}.h5")
    assert run.attrs["n_workers"] == 16 and run.config["method"] == "gem"
    assert run.config["model"] == "quadratic"  # GEM_TRAIN_ARGS came last and won
    assert Counter(run.updates["worker"].tolist()) == {w: 5 for w in range(1, 17)}
    assert run.summary["finished"] == 1.0
    assert (runs / f"gem_mnist_100_{job}.pt").is_file()  # --save
    assert list((runs / f"gem_mnist_100_{job}.ckpt").glob("checkpoint_*.h5"))


def test_sweep_array_of_2x2_runs_then_the_dependent_analysis(slurm, tmp_path):
    """jobs/submit_sweep.sh: a 4-task array (2 methods × 2 worker counts, launched with
    mpirun inside the allocation), and the analysis job after it (afterok)."""
    env = job_env(tmp_path, GEM_SWEEP_METHODS="gem downpour", GEM_SWEEP_WORKERS="2 3",
                  GEM_LAUNCHER="mpirun", GEM_TRAIN_ARGS=f"{QUAD} --max-steps 40")
    res = subprocess.run(["bash", str(JOBS / "submit_sweep.sh")], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 0, res.stderr
    ids = dict(item.split("=", 1) for item in res.stdout.split())
    sweep, analysis, sweep_dir = ids["sweep_job"], ids["analysis_job"], Path(ids["sweep_dir"])
    assert sweep_dir == tmp_path / "runs" / f"gem_sweep_{sweep}"
    assert records(analysis)[0]["Dependency"] == f"afterok:{sweep}_*(unfulfilled)"

    tasks = wait(sweep, 240, tmp_path)
    [done] = wait(analysis, 240, tmp_path)
    assert sorted(int(r["ArrayTaskId"]) for r in tasks) == [0, 1, 2, 3]
    for rec in tasks:
        i = rec["ArrayTaskId"]
        log = (tmp_path / f"gem_sweep_{sweep}_{i}.out").read_text()  # %x_%A_%a
        ended_ok(rec, log)
        assert rec["NumTasks"] == "4"  # sized for the largest run: 3 workers + 1
        assert "launching: mpirun -n " in log
    expected = {"gem_w2": ("gem", 2), "downpour_w2": ("downpour", 2),
                "gem_w3": ("gem", 3), "downpour_w3": ("downpour", 3)}
    assert {p.stem for p in sweep_dir.glob("*.h5")} == set(expected)
    for stem, (method, workers) in expected.items():
        run = load_run(sweep_dir / f"{stem}.h5")
        assert (run.config["method"], int(run.attrs["n_workers"])) == (method, workers)
        assert len(run.updates["worker"]) == 40 * workers
        assert run.summary["finished"] == 1.0

    log = (tmp_path / f"gem_analysis_{analysis}.out").read_text()
    ended_ok(done, log)
    last_task_end = max(r["EndTime"] for r in tasks)
    assert done["StartTime"] >= last_task_end  # ISO timestamps sort as text
    out = sweep_dir / "analysis"
    with (out / "compare" / "compare.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert sorted((r["method"], r["workers"]) for r in rows) == sorted(
        (m, str(w)) for m, w in expected.values())
    assert all(r["status"] == "finished" for r in rows)
    for name in ("compare.md", "final_loss.png", "loss_steps.png"):
        assert (out / "compare" / name).stat().st_size > 0
    for stem in expected:
        assert "finished" in (out / stem / "summary.md").read_text()
    assert "compare.md" in log and "gem_jobs: done" in log


def _rows(path: Path) -> int:
    try:
        with RunFollower(path) as follower:
            return follower.n_updates()
    except (RunFileError, OSError):
        return 0  # not there yet, or not in SWMR mode yet


def test_time_limit_checkpoints_requeues_and_resumes(slurm, tmp_path):
    """A real time limit: --time=1 and Slurm's warning (--signal=B:USR1@5, sent 25 to 55 s
    after the start). The master checkpoints, the job requeues itself and the next run
    resumes from the checkpoint, into the same metrics file. That run is then stopped too
    (scancel --signal=USR1 to the batch shell, as the warning would), and with
    GEM_MAX_RESTARTS=1 the job ends: exit 3, explained, never TIMEOUT."""
    env = job_env(tmp_path, GEM_TRAIN_ARGS=f"{QUAD} --max-steps 100000000",
                  GEM_MAX_RESTARTS="1")
    job = sbatch(JOBS / "gem_mnist_100.sbatch", "--ntasks=3", "--time=1",
                 "--signal=B:USR1@5", env=env, cwd=tmp_path)
    log_path = tmp_path / f"gem_mnist_100_{job}.out"

    def resumed(recs: list[dict[str, str]]) -> bool:
        return (recs[0]["JobState"] in ENDED
                or (log_path.exists() and "; resuming " in log_path.read_text()))

    wait(job, 150, tmp_path, until=resumed)
    [rec] = records(job)
    assert rec["JobState"] == "RUNNING" and rec["Restarts"] == "1", log_path.read_text()
    first = int(re.search(r"stopped by signal 10 at update (\d+)", log_path.read_text())[1])
    metrics = tmp_path / "runs" / f"gem_mnist_100_{job}.h5"
    deadline = time.monotonic() + 60
    while _rows(metrics) <= first and time.monotonic() < deadline:
        time.sleep(0.5)  # the resumed run adds updates
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], timeout=60, check=True)
    [rec] = wait(job, 120, tmp_path)
    log = log_path.read_text()
    assert (rec["JobState"], rec["ExitCode"], rec["Restarts"]) == ("FAILED", "3:0", "1"), log
    assert "DUE TO TIME LIMIT" not in log
    assert log.count("gem_jobs: SIGUSR1: the time limit is near") == 2
    assert f"requeueing job {job} (restart 1 of at most 1)" in log
    assert f"from {tmp_path}/runs/gem_mnist_100_{job}.ckpt/checkpoint_{first:012d}.h5" \
           f" at update {first}" in log and "; resuming run " in log
    assert "not requeued (restart 1, GEM_MAX_RESTARTS=1)" in log
    assert f"GEM_RUN_NAME=gem_mnist_100_{job}" in log and log.rstrip().endswith("exit 3")
    run = load_run(metrics)
    clock = run.updates["clock"]
    assert len(clock) > first
    assert np.array_equal(clock, np.arange(len(clock)))  # one log across both runs
    assert run.summary["finished"] == 0.0  # stopped, and says so
    ckpt = Path(checkpoint.latest(str(tmp_path / "runs" / f"gem_mnist_100_{job}.ckpt")))
    assert ckpt.name == f"checkpoint_{len(clock):012d}.h5"  # the second stop's checkpoint


def test_requeued_run_finishes_with_every_update_once(slurm, tmp_path):
    """The stop-requeue-resume cycle to the end, with mpirun inside the allocation: the
    warning is sent to the batch shell once the run has written rows; the job requeues,
    resumes and completes its budget."""
    env = job_env(tmp_path, GEM_TRAIN_ARGS=f"{QUAD} --max-steps 20000",
                  GEM_LAUNCHER="mpirun")
    job = sbatch(JOBS / "gem_mnist_100.sbatch", "--ntasks=3", env=env, cwd=tmp_path)
    metrics = tmp_path / "runs" / f"gem_mnist_100_{job}.h5"
    deadline = time.monotonic() + 60
    while _rows(metrics) == 0 and time.monotonic() < deadline:
        time.sleep(0.3)
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], timeout=60, check=True)
    [rec] = wait(job, 150, tmp_path)
    log = (tmp_path / f"gem_mnist_100_{job}.out").read_text()
    ended_ok(rec, log)
    assert rec["Restarts"] == "1"
    assert "launching: mpirun -n 3 " in log and "requeueing job" in log
    assert "; resuming " in log and "gem_jobs: done in " in log.rstrip().splitlines()[-1]
    run = load_run(metrics)
    u = run.updates
    assert_exactly_once(u["worker"], u["seq"], (1, 2), 20000)  # the resume dropped and redid
    assert np.array_equal(u["clock"], np.arange(40000))
    assert run.summary["finished"] == 1.0


def _task_pid(job: str, rank: int) -> int | None:
    """The pid of the job's python rank ``rank`` (srun's task: jobs/lib/bind.sh execs it)."""
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            environ = (proc / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if b"gem_mpi.train" in argv and f"SLURM_JOB_ID={job}".encode() in environ and \
                f"SLURM_PROCID={rank}".encode() in environ:
            return int(proc.name)
    return None


@pytest.mark.parametrize("rank", [2, 0], ids=["worker", "master"])
def test_a_killed_rank_ends_the_job_and_resume_auto_finishes(slurm, tmp_path, rank):
    """SIGKILL of one rank (no MPI_Abort: an OOM kill, a lost node): the step ends within
    seconds, not after --worker-timeout 1800 (a dead worker) or never (a dead master: the
    workers would poll its stop word); the job fails. The scripts pass srun
    --kill-on-bad-exit=1 for that; here (Open MPI 4.1, srun --mpi=pmix) Open MPI also learns
    of the lost rank from PMIx and ends the step itself, so only the option's presence tells
    the two apart: plain srun leaves a step with a killed task running. A new job with the
    run's name resumes from its periodic checkpoint and completes the budget, every update
    once."""
    steps = 15000  # per worker: several seconds, so that a checkpoint comes first
    args = f"{QUAD} --max-steps {steps} --checkpoint-every 1 --worker-timeout 1800"
    env = job_env(tmp_path, GEM_TRAIN_ARGS=args)
    job = sbatch(JOBS / "gem_mnist_100.sbatch", "--ntasks=3", env=env, cwd=tmp_path)
    stem = tmp_path / "runs" / f"gem_mnist_100_{job}"
    log_path = tmp_path / f"gem_mnist_100_{job}.out"
    deadline = time.monotonic() + 90
    pid = None
    while time.monotonic() < deadline:
        assert records(job)[0]["JobState"] not in ENDED, logs(tmp_path)
        pid = _task_pid(job, rank)
        if pid and list(stem.with_suffix(".ckpt").glob("checkpoint_*.h5")):
            break
        time.sleep(0.2)
    assert pid, f"no checkpoint or no rank {rank} after 90 s\n{logs(tmp_path)}"
    os.kill(pid, 9)
    t0 = time.monotonic()
    [rec] = wait(job, 60, tmp_path)  # fails the test (and cancels the job) after 60 s
    took = time.monotonic() - t0
    log = log_path.read_text()
    assert rec["JobState"] == "FAILED" and rec["ExitCode"] != "0:0", log
    assert took < 60 and "--kill-on-bad-exit=1" in log
    assert "gem_jobs: done" not in log

    env = job_env(tmp_path, GEM_TRAIN_ARGS=args, GEM_RUN_NAME=stem.name)
    again = sbatch(JOBS / "gem_mnist_100.sbatch", "--ntasks=3", env=env, cwd=tmp_path)
    [rec] = wait(again, 150, tmp_path)
    log = (tmp_path / f"gem_mnist_100_{again}.out").read_text()
    ended_ok(rec, log)
    assert "; resuming run " in log and f" from {stem}.ckpt/checkpoint_" in log
    run = load_run(stem.with_suffix(".h5"))
    u = run.updates
    assert_exactly_once(u["worker"], u["seq"], (1, 2), steps)
    assert run.summary["finished"] == 1.0


def test_elastic_job_resumes_on_the_nodes_of_its_next_run(slurm, tmp_path):
    """jobs/submit_elastic.sh 1-2 on partition "two": the first run gets both nodes (4 tasks:
    1 master + 3 workers); gemnode2 is drained and the time limit's warning sent, so the
    requeued run (its node range given back) gets one node (2 tasks) and resumes the
    checkpoint on 1 worker, the batches not done dealt to it: the budget of the first start
    whole, in one log. A bad range is one line, exit 2."""
    tcp = {"OMPI_MCA_osc": "pt2pt", "OMPI_MCA_pml": "ob1", "OMPI_MCA_btl": "self,tcp",
           "OMPI_MCA_btl_tcp_if_include": "lo"}
    steps = 3000  # per worker: the first run is stopped within its first seconds
    env = job_env(tmp_path, GEM_TRAIN_ARGS=f"{QUAD} --max-steps {steps}", **tcp)
    res = subprocess.run([str(JOBS / "submit_elastic.sh"), "1-2", "--parsable",
                          "--partition=two", "--ntasks-per-node=2"], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=60, check=False)
    assert res.returncode == 0, res.stderr
    job = res.stdout.strip().split(";")[0]
    metrics = tmp_path / "runs" / f"gem_elastic_{job}.h5"
    log_path = tmp_path / f"gem_elastic_{job}.out"
    try:
        deadline = time.monotonic() + 90
        while _rows(metrics) == 0 and time.monotonic() < deadline:
            time.sleep(0.3)
        [rec] = records(job)
        assert rec["NodeList"] == "gemnode[1-2]", logs(tmp_path)
        subprocess.run(["scontrol", "update", "NodeName=gemnode2", "State=DRAIN",
                        "Reason=gem_mpi test"], timeout=60, check=True)
        subprocess.run(["scancel", "--batch", "--signal=USR1", job], timeout=60, check=True)
        [rec] = wait(job, 180, tmp_path)
    finally:
        subprocess.run(["scontrol", "update", "NodeName=gemnode2", "State=RESUME"],
                       timeout=60, check=False)
    log = log_path.read_text()
    ended_ok(rec, log)
    assert rec["Restarts"] == "1" and rec["NodeList"] == "gemnode1"
    assert "4 ranks (1 master + 3 workers)" in log and "2 ranks (1 master + 1 workers)" in log
    assert "workers 3 -> 1" in log
    run = load_run(metrics)
    assert np.array_equal(run.updates["clock"], np.arange(3 * steps))  # nothing lost, no more
    assert [s["workers"] for s in json.loads(run.attrs["segments"])] == [3, 1]
    assert run.summary["finished"] == 1.0
    assert "requeued on any 1-2 nodes of 2 tasks each" in log
    bad = subprocess.run([str(JOBS / "submit_elastic.sh"), "3-2"], capture_output=True,
                         text=True, timeout=60, check=False)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1, bad.stderr


def test_a_job_across_two_nodes_gets_the_cross_node_transport(slurm, tmp_path):
    """Partition "two": two Slurm nodes on this host, each its own slurmd (Debian's Slurm is
    built with MULTIPLE_SLURMD; tools/slurm_local.sh). srun --mpi=pmix tells Open MPI which
    ranks share a node, so the job spans 2 nodes as on a cluster: Open MPI's default one-sided
    component cannot make the windows there, and the run stops at start-up with one line
    naming --mca osc pt2pt (exit 2); with pt2pt over TCP it trains, every update once."""
    args = f"{QUAD} --max-steps 100 --verbose"
    options = ["--partition=two", "--nodes=2", "--ntasks=3"]
    env = job_env(tmp_path, GEM_TRAIN_ARGS=args)
    job = sbatch(JOBS / "gem_mnist_100.sbatch", *options, env=env, cwd=tmp_path)
    [rec] = wait(job, 120, tmp_path)
    log = (tmp_path / f"gem_mnist_100_{job}.out").read_text()
    assert rec["NodeList"] == "gemnode[1-2]" and rec["JobState"] == "FAILED", log
    lines = [ln for ln in log.splitlines() if ln.startswith("gem_mpi: error:")]
    assert len(lines) == 1 and "cannot create the one-sided windows" in lines[0], log
    assert "--mca osc pt2pt" in lines[0]

    tcp = {"OMPI_MCA_osc": "pt2pt", "OMPI_MCA_pml": "ob1", "OMPI_MCA_btl": "self,vader,tcp",
           "OMPI_MCA_btl_tcp_if_include": "lo"}
    env = job_env(tmp_path, GEM_TRAIN_ARGS=args, **tcp)
    job = sbatch(JOBS / "gem_mnist_100.sbatch", *options, env=env, cwd=tmp_path)
    [rec] = wait(job, 120, tmp_path)
    log = (tmp_path / f"gem_mnist_100_{job}.out").read_text()
    ended_ok(rec, log)
    assert rec["NodeList"] == "gemnode[1-2]"
    assert "gem_mpi: placement: 2 node(s)" in log
    run = load_run(tmp_path / "runs" / f"gem_mnist_100_{job}.h5")
    assert_exactly_once(run.updates["worker"], run.updates["seq"], (1, 2), 100)
    assert run.summary["finished"] == 1.0


def test_sharded_job_puts_master_k_on_node_k(slurm, tmp_path):
    """jobs/gem_sharded.sbatch on partition "two": K = 2 masters (one per node, the default),
    master k on node k and the workers round robin (srun's cyclic distribution), so MPI's own
    node split groups ranks {0, 2} and {1, 3}; every shard
    applies every update once. Block placement would group {0, 1} and {2, 3}. No vader: with
    two ranks on each of two Slurm nodes that are one host, both nodes' shared-memory
    segments land in the same /dev/shm and the ranks crash in their first collective (seen
    with a bare mpi4py barrier too); a real cluster's nodes have a /dev/shm each."""
    tcp = {"OMPI_MCA_osc": "pt2pt", "OMPI_MCA_pml": "ob1", "OMPI_MCA_btl": "self,tcp",
           "OMPI_MCA_btl_tcp_if_include": "lo"}
    env = job_env(tmp_path, GEM_TRAIN_ARGS=f"{QUAD} --max-steps 100 --verbose", **tcp)
    job = sbatch(JOBS / "gem_sharded.sbatch", "--partition=two", "--nodes=2",
                 "--ntasks-per-node=4", "--ntasks=4", env=env, cwd=tmp_path)
    [rec] = wait(job, 180, tmp_path)
    log = (tmp_path / f"gem_sharded_{job}.out").read_text()
    ended_ok(rec, log)
    assert rec["NodeList"] == "gemnode[1-2]"
    [line] = [ln for ln in log.splitlines() if "gem_mpi: placement: 2 node(s)" in ln]
    groups = [re.findall(r"rank (\d+) \(", part) for part in line.split(";")[1:]]
    assert sorted(groups) == [["0", "2"], ["1", "3"]], line
    assert "2 masters (θ's shards: " in log
    run = load_run(tmp_path / "runs" / f"gem_sharded_{job}.h5")
    for u in (run.updates, run.other["shard1"]):
        assert_exactly_once(u["worker"], u["seq"], (1, 2), 100)
    assert run.summary["finished"] == 1.0


def test_groups_job_puts_one_group_on_each_node(slurm, tmp_path):
    """jobs/gem_groups.sbatch on partition "two": 2 nodes × 3 tasks, the master and a group
    of 2 on the first node, a group of 2 on the second; each group's ranks on one node (MPI's
    own node split), each group one worker whose updates all arrive. TCP, as the sharded
    test's (two Slurm nodes on one host)."""
    tcp = {"OMPI_MCA_osc": "pt2pt", "OMPI_MCA_pml": "ob1", "OMPI_MCA_btl": "self,tcp",
           "OMPI_MCA_btl_tcp_if_include": "lo"}
    env = job_env(tmp_path, GEM_MODEL="mnist-cnn", GEM_DATASET="fashion-mnist",
                  GEM_TRAIN_ARGS="--max-steps 20 --eval-every 0 --threads 1 --verbose", **tcp)
    job = sbatch(JOBS / "gem_groups.sbatch", "--partition=two", "--nodes=2",
                 "--ntasks-per-node=3", env=env, cwd=tmp_path)
    [rec] = wait(job, 240, tmp_path)
    log = (tmp_path / f"gem_groups_{job}.out").read_text()
    ended_ok(rec, log)
    assert rec["NodeList"] == "gemnode[1-2]"
    assert "one group of 2 ranks on each of gemnode1 gemnode2" in log
    groups = sorted(ln.split("gem_mpi: ")[1] for ln in log.splitlines()
                    if "gem_mpi: group " in ln)
    assert [g.split(" (leader")[0] for g in groups] == ["group 1: ranks 1, 2",
                                                        "group 2: ranks 3, 4"], groups
    assert "on the node of rank 0," in groups[0] and "on the node of rank 3," in groups[1]
    run = load_run(next((tmp_path / "runs").glob("*.h5")))
    assert run.n_workers == 2 and run.config["group_size"] == 2
    assert_exactly_once(run.updates["worker"], run.updates["seq"], (1, 2), 20)


def test_sync_baseline_job_trains_every_rank_a_worker(slurm, tmp_path):
    """The synchronous baseline as a batch job: 2 tasks are 2 workers (no master), the
    effective batch splits over both, the run writes its step metrics and its model. The
    python comes from PATH here, as after a `module load` (no virtualenv at GEM_MPI_VENV)."""
    pytest.importorskip("horovod.torch", reason="tools/install.sh builds Horovod")
    venv_bin = str(Path(os.environ.get("GEM_MPI_VENV", Path.home() / ".cache/gem_mpi/venv"))
                   / "bin")
    env = job_env(tmp_path, GEM_MPI_VENV=str(tmp_path / "no-venv"),
                  PATH=venv_bin + os.pathsep + os.environ["PATH"], GEM_MODEL="mnist-cnn",
                  GEM_DATASET="fashion-mnist", GEM_EFFECTIVE_BATCH="128",
                  GEM_TRAIN_ARGS="--max-steps 30 --eval-every 0")
    env.pop("GEM_MPI_PY", None)
    job = sbatch(JOBS / "sync_baseline.sbatch", "--ntasks=2", "--cpus-per-task=1", env=env,
                 cwd=tmp_path)
    [rec] = wait(job, 240, tmp_path)
    log = (tmp_path / f"gem_sync_{job}.out").read_text()
    ended_ok(rec, log)
    assert f"python: {venv_bin}/python3 (python3 from PATH)" in log
    assert "2 ranks (2 workers, no master)" in log and "effective batch 128 = 2 workers × 64" in log
    assert "done: 30 synchronous steps of 2 workers" in log
    [h5] = (tmp_path / "runs").glob("*.h5")
    run = load_run(h5)
    assert run.config["batch_size"] == 64 and run.attrs["n_workers"] == 2
    assert run.updates["seq"].tolist() == list(range(30))
    assert list((tmp_path / "runs").glob("*.pt"))


def test_an_examples_batch_script_trains_the_users_model(slurm, tmp_path):
    """examples/regression/regression.sbatch submitted from elsewhere: its directory reaches
    every rank's PYTHONPATH (srun), so the user's MODULE:FUNCTION is found on each."""
    env = job_env(tmp_path, GEM_EPOCHS="1", GEM_TRAIN_ARGS="--max-steps 100 --eval-every 0")
    job = sbatch(REPO / "examples" / "regression" / "regression.sbatch", "--ntasks=3",
                 "--cpus-per-task=1", env=env, cwd=tmp_path)
    [rec] = wait(job, 240, tmp_path)
    log = (tmp_path / f"gem_regression_{job}.out").read_text()
    ended_ok(rec, log)
    assert "gem on regression:make_model/regression:make_dataset: 1 master + 2 workers" in log
    assert "done: 200 updates" in log and "test accuracy n/a" in log
    [h5] = (tmp_path / "runs").glob("*.h5")
    assert load_run(h5).config["loss"] == "mse"
    assert list((tmp_path / "runs").glob("*.pt"))


def test_a_new_job_does_not_take_over_another_jobs_files(slurm, tmp_path):
    """A sweep task whose file exists already (an earlier job's) refuses to start: exit 2,
    one line, the file untouched; with GEM_RESUME=1 it would resume it."""
    sweep_dir = tmp_path / "sweep"
    sweep_dir.mkdir()
    (sweep_dir / "gem_w2.h5").write_bytes(b"an earlier run")
    env = job_env(tmp_path, GEM_SWEEP_DIR=str(sweep_dir), GEM_SWEEP_METHODS="gem",
                  GEM_SWEEP_WORKERS="2", GEM_TRAIN_ARGS=f"{QUAD} --max-steps 5")
    job = sbatch(JOBS / "sweep_stability.sbatch", "--array=0", "--ntasks=3", env=env,
                 cwd=tmp_path)
    [rec] = wait(job, 60, tmp_path)
    log = (tmp_path / f"gem_sweep_{job}_0.out").read_text()
    assert (rec["JobState"], rec["ExitCode"]) == ("FAILED", "2:0"), log
    assert f"{sweep_dir}/gem_w2.h5 or {sweep_dir}/gem_w2.ckpt/ exists already" in log
    assert "GEM_RESUME=1" in log and "launching:" not in log
    assert (sweep_dir / "gem_w2.h5").read_bytes() == b"an earlier run"


def test_alexnet_splits_the_effective_batch_of_1024(slurm, tmp_path):
    """8 and 16 workers get b = 128 and 64 (then the preflight, which checks the data too,
    finds no ImageNet at GEM_DATA_DIR: gem_mpi's one-line error, exit 2, nothing launched);
    3 workers cannot split 1024 and nothing is launched."""
    env = job_env(tmp_path, GEM_DATA_DIR=str(tmp_path / "imagenet"))
    jobs = {n: sbatch(JOBS / "alexnet_imagenet.sbatch", f"--ntasks={n}", "--cpus-per-task=1",
                      env=env, cwd=tmp_path) for n in (9, 17, 4)}
    for n, job in jobs.items():
        [rec] = wait(job, 120, tmp_path)
        log = (tmp_path / f"gem_alexnet_{job}.out").read_text()
        assert (rec["JobState"], rec["ExitCode"]) == ("FAILED", "2:0"), log
        if n == 4:
            assert "the effective batch 1024 does not split evenly over 3 workers" in log
            assert "launching:" not in log
            continue
        b = 1024 // (n - 1)
        assert f"effective batch 1024 = {n - 1} workers × {b}" in log
        assert f"imagenet: {tmp_path}/imagenet/train does not exist" in log
        assert "(nothing was launched)" in log and "launching:" not in log


def test_gpu_binding_by_local_rank_under_srun_and_mpirun(slurm, tmp_path):
    """jobs/lib/bind.sh: the master sees no GPU, worker on local rank L sees GPU L mod G of
    the node's list (CUDA_VISIBLE_DEVICES as Slurm sets it, or GEM_GPUS_PER_NODE)."""
    bind = JOBS / "lib" / "bind.sh"
    show = "rank=$OMPI_COMM_WORLD_RANK${SLURM_PROCID} gpu=[${CUDA_VISIBLE_DEVICES-unset}]"
    # under mpirun, SLURM_PROCID describes the daemon, not the rank: show only OMPI's there
    wrap = (f"srun --mpi=pmix -n 5 bash {bind} sh -c 'echo srun {show}'; "
            f"mpirun -n 5 bash {bind} sh -c 'unset SLURM_PROCID; echo mpirun {show}'")
    cases = {"list": ({"CUDA_VISIBLE_DEVICES": "4,5,7"}, ["", "5", "7", "4", "5"]),
             "count": ({"GEM_GPUS_PER_NODE": "2"}, ["", "1", "0", "1", "0"]),
             "none": ({}, ["", "unset", "unset", "unset", "unset"])}
    for name, (extra, gpus) in cases.items():
        env = job_env(tmp_path, **extra)
        if "CUDA_VISIBLE_DEVICES" not in extra:
            env.pop("CUDA_VISIBLE_DEVICES", None)
        job = sbatch(None, "--ntasks=5", f"--output={name}_%j.out", f"--wrap={wrap}", env=env,
                     cwd=tmp_path)
        [rec] = wait(job, 60, tmp_path)
        log = (tmp_path / f"{name}_{job}.out").read_text()
        ended_ok(rec, log)
        for launcher in ("srun", "mpirun"):
            pattern = rf"^{launcher} rank=(\d+) gpu=\[([^\]]*)\]$"
            got = dict(re.findall(pattern, log, re.MULTILINE))
            assert got == {str(r): g for r, g in enumerate(gpus)}, (name, launcher, log)


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_scripts_are_shellcheck_clean():
    scripts = [*JOBS.glob("*.sbatch"), *JOBS.glob("*.sh"), *JOBS.glob("lib/*.sh"),
               *(REPO / "examples").glob("*/*.sbatch"),
               REPO / "tools" / "slurm_local.sh"]
    res = subprocess.run(["shellcheck", "-x", "-s", "bash", *map(str, scripts)], cwd=REPO,
                         capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 0, res.stdout
