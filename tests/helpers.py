"""What many tests share: the launchers of real jobs (``mpirun``, a training run, one in the
background, a signal or a kill once it is ready), the command line of a run on the numpy
quadratic, the check that every update of a run was applied exactly once, and the checks any
MPI setup must pass (tests/test_mpi_stacks.py's stacks, tests/test_multinode.py's nodes):
the transport stress report, a run that learns, a worker killed mid-run then resumed."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROGS = Path(__file__).resolve().parent / "mpi_progs"


def mpi_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def mpirun_cmd(n: int, args: list[str]) -> list[str]:
    return ["mpirun", "--oversubscribe", "-n", str(n), sys.executable, *args]


def mpirun(n: int, args: list[str], timeout: float = 300, cwd: Path | None = None
           ) -> subprocess.CompletedProcess:
    """Run ``args`` (after the python executable) on n ranks; never hangs past ``timeout``."""
    return subprocess.run(mpirun_cmd(n, args), capture_output=True, text=True, timeout=timeout,
                          check=False, env=mpi_env(), cwd=str(cwd or REPO))


def train(n: int, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return mpirun(n, ["-m", "gem_mpi.train", *args], timeout=timeout)


def train_background(n: int, *args: str, env: dict[str, str] | None = None
                     ) -> subprocess.Popen:
    """Start a training job and return at once (in its own session; stdout discarded,
    stderr piped): for tests that watch or kill a run while it trains. The caller ends it."""
    return subprocess.Popen(mpirun_cmd(n, ["-m", "gem_mpi.train", *args]),
                            env={**mpi_env(), **(env or {})}, cwd=str(REPO),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def wait_until(proc: subprocess.Popen, ready: Callable[[], bool], timeout: float = 90) -> None:
    """Poll ``ready()`` while the background job runs; fail if it ends or times out first."""
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, "the job never got ready"
        time.sleep(0.1)


def signal_when(proc: subprocess.Popen, ready: Callable[[], bool], sig: int = signal.SIGUSR1,
                whole_job: bool = False, timeout: float = 120) -> str:
    """Once ``ready()`` (the job still running), send ``sig`` to mpirun (or, ``whole_job``,
    to every process of the job, as a scheduler does); returns the job's stderr after it
    ended. The job is killed whatever happens."""
    try:
        wait_until(proc, ready, timeout)
        if whole_job:
            signal_job(proc, sig)
        else:
            proc.send_signal(sig)
        return proc.communicate(timeout=60)[1]
    finally:
        if proc.poll() is None:
            kill_job(proc)


def kill_rank_when(proc: subprocess.Popen, ready: Callable[[], bool], rank: int) -> int:
    """Once ``ready()``, SIGKILL MPI rank ``rank`` of the job (a node lost, an OOM kill);
    returns the job's exit code once it ended. The job is killed whatever happens."""
    try:
        wait_until(proc, ready)
        os.kill(rank_pids(proc)[rank], signal.SIGKILL)
        proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            kill_job(proc)
    return proc.returncode


def kill_job(proc: subprocess.Popen) -> None:
    """SIGKILL mpirun and every rank of its job; returns once none is alive."""
    from gem_mpi.chaos import kill_job as kill

    kill(proc)


def signal_job(proc: subprocess.Popen, sig: int) -> None:
    """``sig`` to every process of a background job (mpirun and each rank, which Open MPI
    puts in process groups of their own), as a scheduler signals a job."""
    from gem_mpi.chaos import job_processes

    for pid in job_processes(proc.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def rank_pids(proc: subprocess.Popen) -> dict[int, int]:
    """MPI rank -> pid of the ranks a background mpirun started (from their environment)."""
    from gem_mpi.chaos import rank_pids as of_mpirun

    return of_mpirun(proc.pid)

QUADRATIC = ("--model", "quadratic", "--dataset", "synthetic")


def quadratic_args(*extra: str, dim: int | None = None, method: str | None = None,
                   steps: int | None = None, **options: object) -> list[str]:
    """``--model quadratic --dataset synthetic``, then ``--method``, ``--quadratic-dim`` and
    ``--max-steps`` when given, then each option (``eval_every=0`` is ``--eval-every 0``),
    then ``extra`` as it is (a later repeat of an option overrides it)."""
    args = list(QUADRATIC)
    named = {"method": method, "quadratic_dim": dim, "max_steps": steps, **options}
    for name, value in named.items():
        if value is not None:
            args += [f"--{name.replace('_', '-')}", str(value)]
    return [*args, *extra]


def assert_exactly_once(workers: Iterable, seqs: Iterable, worker_ids: Iterable[int],
                        steps: int) -> None:
    """Each of ``worker_ids``' updates 0 .. steps − 1 is in the log once: none lost, none
    applied twice (``workers``, ``seqs``: the log's columns)."""
    pairs = Counter(zip((int(w) for w in workers), (int(s) for s in seqs)))
    assert set(pairs) == {(w, s) for w in worker_ids for s in range(steps)}
    assert max(pairs.values()) == 1  # nothing applied twice, nothing missing


def assert_stress_report(report: Path, workers: int, steps: int) -> None:
    """tests/mpi_progs/transport_stress.py's report: no torn pull, each update exactly once,
    every ticket used once, θ exact, every worker served in the first half of the run."""
    import numpy as np

    r = json.loads(Path(report).read_text())
    log = np.array(r["log"])
    total = workers * steps
    assert r["torn"] == 0
    assert len(log) == total
    assert_exactly_once(log[:, 0], log[:, 1], range(1, workers + 1), steps)
    assert sorted(log[:, 2].tolist() + r["done_tickets"]) == list(range(total + workers))
    assert r["theta_min"] == r["theta_max"] == float(total) == r["version"]
    # every worker served early on: none starved. (A share of the fair one is the OS's to
    # give: with another test's job on the same 2 cores, a quarter of it failed once.)
    first_half = Counter(log[: total // 2, 0].tolist())
    served = {w: first_half.get(w, 0) for w in range(1, workers + 1)}
    assert min(served.values()) > 0, served


def assert_learns(metrics: Path, workers: int, steps: int) -> None:
    """A run's metrics file holds every update, and the loss of its last 50 is below half
    that of its first 50."""
    import numpy as np

    from gem_mpi.outputs.runfile import load_run

    u = load_run(metrics).updates
    assert len(u["loss"]) == workers * steps
    assert np.mean(u["loss"][-50:]) < 0.5 * np.mean(u["loss"][:50])


def job_ranks(launcher_pid: int) -> dict[int, int]:
    """MPI rank -> pid of the ranks below a launcher process, whatever the launcher (Open
    MPI's OMPI_COMM_WORLD_RANK, MPICH's PMI_RANK; MPICH's proxy starts its own session; on
    other "nodes", below the daemon the launch agent started)."""
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
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        for item in environ:
            key, _, value = item.partition(b"=")
            if key in (b"OMPI_COMM_WORLD_RANK", b"PMI_RANK") and b"python" in cmdline:
                out[int(value)] = pid
    return out


def kill_worker_mid_run(command: list[str], env: dict[str, str], cwd: Path,
                        checkpoint_dir: Path, ranks: int, victim: int = 2) -> None:
    """Start a training job, wait until it has written a checkpoint and all its ranks run,
    SIGKILL rank ``victim``: the launcher must end the whole job (no hang), not with 0."""
    proc = subprocess.Popen(command, env=env, cwd=str(cwd), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        found: dict[int, int] = {}
        while not (list(checkpoint_dir.glob("checkpoint_*.h5")) and len(found) == ranks):
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "the job never got going"
            time.sleep(0.2)
            found = job_ranks(proc.pid)
        os.kill(found[victim], signal.SIGKILL)
        t0 = time.monotonic()
        proc.communicate(timeout=60)  # the job must end, not hang
        ended = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            kill_job(proc)
            proc.communicate()
    assert proc.returncode != 0 and ended < 60


KILL_RUN_STEPS = 2000


def kill_run_args(workdir: Path, workers: int) -> list[str]:
    """The run a killed-worker test kills then resumes: DOWNPOUR on the quadratic,
    checkpointed every 0.3 s, long enough to be killed mid-run."""
    return ["-m", "gem_mpi.train",
            *quadratic_args(method="downpour", dim=2000, steps=KILL_RUN_STEPS, eval_every=0,
                            metrics=workdir / "run.h5", checkpoint_dir=workdir,
                            checkpoint_every=0.3)]


def assert_resumed_exactly_once(
        resume: Callable[[list[str]], subprocess.CompletedProcess], workdir: Path,
        workers: int) -> None:
    """``resume(args)`` runs kill_run_args' run again with --resume auto: it must finish with
    every update of every worker applied exactly once."""
    from gem_mpi.outputs.runfile import load_run

    res = resume([*kill_run_args(workdir, workers), "--resume", "auto"])
    assert res.returncode == 0, res.stdout + res.stderr
    u = load_run(workdir / "run.h5").updates
    assert_exactly_once(u["worker"], u["seq"], range(1, workers + 1), KILL_RUN_STEPS)


class QuadraticSlice:
    """The quadratic (``gem_mpi.problem.quadratic.Quadratic``) restricted to θ's elements
    [lo, hi): what one shard of a --masters run replays."""

    def __init__(self, q: object, lo: int, hi: int) -> None:
        self.q, self.lo, self.hi = q, lo, hi
        self.h, self.dim = q.h[lo:hi], hi - lo

    def theta0(self) -> object:
        return self.q.theta0()[self.lo:self.hi]

    def target(self, worker: int) -> object:
        return self.q.target(worker)[self.lo:self.hi]


def checkpoint_after_start(directory: Path, after: int = 0) -> Callable[[], bool]:
    """Whether ``directory`` holds a checkpoint of more than ``after`` updates (read from its
    name): a run checkpoints while it waits too, so one from before any worker's first update
    (or, resumed, the one it resumed from) would stop or kill it before it started."""
    from gem_mpi.outputs import checkpoint

    def ready() -> bool:
        found = checkpoint.listed(str(directory))
        return bool(found) and found[-1][0] > after
    return ready


def stop_then_kill(n: int, args: list[str], directory: Path, victim: int) -> tuple[str, str]:
    """A run of ``args`` on n ranks, checkpointing into ``directory``: stopped (SIGUSR1) at
    its first checkpoint after start (exit 3), resumed (--resume auto), and rank ``victim``
    SIGKILLed once the resumed run has checkpointed past the stop: that job must end, not
    hang (within 30 s). Two interruptions of one run, which a last --resume auto (the
    caller's) finishes. Returns the stopped job's stderr and the killed one's."""
    from gem_mpi.outputs import checkpoint

    proc = train_background(n, *args)
    stopped = signal_when(proc, checkpoint_after_start(directory))
    assert proc.returncode == 3, stopped
    stopped_at = checkpoint.listed(str(directory))[-1][0]
    proc = train_background(n, *args, "--resume", "auto")
    try:
        wait_until(proc, checkpoint_after_start(directory, after=stopped_at))
        os.kill(rank_pids(proc)[victim], signal.SIGKILL)
        t0 = time.monotonic()
        killed = proc.communicate(timeout=30)[1]
        assert time.monotonic() - t0 < 30
    finally:
        if proc.poll() is None:
            kill_job(proc)
    assert proc.returncode != 0
    return stopped, killed


def running_checkpoint(directory: Path) -> object:
    """The newest checkpoint (``gem_mpi.outputs.checkpoint.Checkpoint``) of a job still
    running, or None: read again when the job replaced it between the listing and the read."""
    from gem_mpi.errors import UsageError
    from gem_mpi.outputs import checkpoint

    while True:
        path = checkpoint.latest(str(directory))
        if path is None:
            return None
        try:
            return checkpoint.load(path)
        except UsageError:
            if os.path.exists(path):
                raise


def steps_written(h5: Path) -> int:
    """Rows in a metrics file being written; 0 until its writer has switched SWMR on (until
    then HDF5's file lock keeps readers out)."""
    from gem_mpi.outputs.runfile import RunFileError, load_run

    try:
        return load_run(h5).updates["seq"].size
    except (RunFileError, OSError):
        return 0


def theta0_state(*options: str) -> dict:
    """θ₀ of the run these options describe, as a state_dict (θ₀ depends on the model and
    --seed alone, whatever the method)."""
    from gem_mpi import config
    from gem_mpi.problem import build_problem

    cfg, _ = config.parse(list(options))
    return build_problem(cfg.data, with_theta0=False).model.state_dict()


def single_process(args: list[str], optimizer: Callable) -> dict:
    """The run ``args`` describe trained in one plain process over worker 1's batches and
    dropout masks, with ``optimizer(parameters)`` (torch.optim's), as a state_dict: what one
    worker of a method that matches its proxy must equal."""
    import torch

    from gem_mpi import config
    from gem_mpi.problem import build_problem
    from gem_mpi.run.rank import data_stream, seed_dropout

    cfg, _ = config.parse(args)
    torch.set_num_threads(1)
    model = build_problem(cfg.data, with_theta0=False).model
    model.train()
    opt = optimizer(model.parameters())
    steps, batches = data_stream(cfg.data, 1, 1)
    for step in range(steps):
        seed_dropout(cfg.data.seed, 1, step)
        x, y = next(batches)
        opt.zero_grad()
        torch.nn.functional.nll_loss(model(x), y).backward()
        opt.step()
    return model.state_dict()


# tests/user_code/elastic_probe.py: a dataset whose targets are the samples' indices and a
# loss that is their sum, so each update's loss names the batch it was computed on
PROBE_SAMPLES, PROBE_BATCH, PROBE_SOURCES = 4003, 4, 4


def indexed_probe(tmp: Path, method: str, epochs: int) -> tuple[list[str], dict[str, str]]:
    """The train options and environment of a run of ``method`` over the indexed dataset,
    sharded over its 4 first workers, checkpointing every 0.1 s into ``tmp`` (a stop or a
    departure at a checkpoint lands early in the epochs, even on a machine 4× faster)."""
    args = ["--model", "elastic_probe:linear", "--dataset", "elastic_probe:indexed",
            "--loss", "elastic_probe:index_sum", "--method", method, "--shard",
            "--batch-size", str(PROBE_BATCH), "--epochs", str(epochs),
            "--no-stop-on-divergence", "--metrics", str(tmp / "run.h5"),
            "--checkpoint-dir", str(tmp), "--checkpoint-every", "0.1", "--eval-every", "0"]
    return args, {"PYTHONPATH": f"{REPO / 'tests' / 'user_code'}{os.pathsep}{REPO}"}


def probe_per_epoch() -> list[int]:
    """Batches per epoch of each of the 4 sources (--shard: samples i mod 4 = s − 1)."""
    return [len(range(s, PROBE_SAMPLES, PROBE_SOURCES)) // PROBE_BATCH
            for s in range(PROBE_SOURCES)]


def assert_every_sample_once(rows: Iterable[tuple[list, int, int, float]], seed: int,
                             epochs: int) -> None:
    """Each (plan, seq, worker, loss) row computed batch ``seq`` of its worker's plan (its
    loss is that batch's index sum), and every sample of every epoch was seen once."""
    from gem_mpi.problem import elastic
    from gem_mpi.problem.batches import epoch_indices

    orders: dict[tuple[int, int], object] = {}
    seen: dict[int, Counter] = {e: Counter() for e in range(epochs)}
    for plan, seq, worker, loss in rows:
        s, n, e, j = elastic.batch_of(plan, seq)
        if (s, e) not in orders:
            orders[s, e] = epoch_indices(PROBE_SAMPLES, e, seed + s, (s - 1, n)).numpy()
        batch = orders[s, e][j * PROBE_BATCH:(j + 1) * PROBE_BATCH]
        assert loss == float(batch.sum()), (worker, seq)  # it computed that batch
        seen[e].update(batch.tolist())
    per_epoch = probe_per_epoch()
    for e in range(epochs):
        whole = Counter(int(i) for s in range(1, PROBE_SOURCES + 1)
                        for i in orders[s, e][:per_epoch[s - 1] * PROBE_BATCH])
        assert seen[e] == whole, e  # every sample of the epoch once


def wandb_records(run_dir: Path) -> list:
    """The records of a W&B offline run (its ``run-<id>.wandb`` file), as wandb's own
    protobuf ``Record`` messages: the file is a LevelDB-style log (a 7-byte header, then
    32 KiB blocks of chunks: CRC-32C, length, type 1 full / 2 first / 3 middle / 4 last)."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data = next(run_dir.glob("run-*.wandb")).read_bytes()
    block, pos, part, out = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header: padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            break
        part += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(part)
            out.append(record)
            part = b""
    return out


def wandb_history(run_dir: Path) -> list[dict[str, float]]:
    """Each ``wandb.log`` call of an offline run, as {key: value}."""
    rows = []
    for r in wandb_records(run_dir):
        if r.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in r.history.item})
    return rows


def tensorboard_scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the TensorBoard event files in ``directory``, read by tensorboard's
    own reader: tag -> [(step, value), ...]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)]
            for tag in events.Tags()["scalars"]}
