"""``python -m gem_mpi.chaos``: break real runs on purpose, resume them as a user would, and
check that nothing was lost or done twice.

For ``--minutes`` it starts real ``mpirun`` jobs of the quadratic problem, one asynchronous
method after another (GEM with its proxy at the master, DOWNPOUR, adaptive, delayed Nesterov,
Gap-Aware; every third run with two masters, but delayed Nesterov's), injects a random fault into each start (SIGKILL
of a worker or of the master, SIGUSR1 to mpirun as Slurm sends it, a worker hung with
SIGSTOP for 20 s, past the master's watchdog, a full disk as ``--min-free-mb`` sees it),
resumes with ``--resume auto`` until the run finishes, and then checks every invariant on the
run's files: each update (worker, seq) applied exactly once, the clock and the rows without
a gap, the run finished, and (one master) θ equal bit for bit to the numpy replay of the
applied updates. It prints the faults by kind, the resumes, and the updates lost and
duplicated; any broken invariant fails it (exit 1)::

    python -m gem_mpi.chaos --minutes 30 --seed 1
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from gem_mpi.algorithm.reference import replay
from gem_mpi.outputs import checkpoint
from gem_mpi.outputs.runfile import RunFileError, load_run
from gem_mpi.problem.quadratic import Quadratic

METHODS = ("gem", "downpour", "adaptive", "dn", "gap-aware")
FAULTS = ("kill-worker", "kill-master", "sigusr1", "hang", "full-disk")
DIM, STEPS, LR = 2000, 5000, 0.05
START_TIMEOUT = 90.0  # seconds one start may take, fault and all, before chaos gives up
# a stopped worker is let go after this: one stopped for good after the run's end, once the
# other ranks have left, holds mpirun until something kills it (docs/RELIABILITY.md)
HANG_S = 20.0


def _continue(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)


@dataclass
class Tally:
    """What the chaos did and found."""

    faults: collections.Counter = field(default_factory=collections.Counter)
    harmless: int = 0  # injected, and the start finished all the same (it came at the end)
    runs: int = 0
    resumes: int = 0
    lost: int = 0
    duplicated: int = 0
    broken: list[str] = field(default_factory=list)


def job_processes(leader: int) -> list[int]:
    """The live processes of the session ``leader`` (an mpirun started in a session of its
    own): Open MPI puts each rank in a process group of its own, so a signal to mpirun's
    group reaches mpirun alone, but the ranks stay in its session. A zombie has ended."""
    live = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == leader and fields[0] != "Z":
            live.append(int(entry.name))
    return live


def kill_job(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """SIGKILL mpirun and every rank of its session, and return once none of them is alive
    (their file locks free): a dead mpirun alone leaves its ranks running for a while."""
    deadline = time.monotonic() + timeout
    while True:
        alive = job_processes(proc.pid)
        if not alive:
            break
        for pid in alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {alive} of job {proc.pid} outlived SIGKILL")
        time.sleep(0.05)
    proc.wait(timeout=timeout)


def rank_pids(mpirun_pid: int) -> dict[int, int]:
    """MPI rank -> pid of the processes an mpirun started (from their environment)."""
    out = {}
    kids = subprocess.run(["pgrep", "-P", str(mpirun_pid)], capture_output=True, text=True,
                          check=False).stdout.split()
    for pid in map(int, kids):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for item in env:
            if item.startswith(b"OMPI_COMM_WORLD_RANK="):
                out[int(item.split(b"=")[1])] = pid
    return out


@dataclass(frozen=True)
class Setting:
    method: str
    workers: int
    masters: int

    def args(self, workdir: Path) -> list[str]:
        extra = ["--gem-proxy", "global"] if self.method == "gem" else []
        return ["--model", "quadratic", "--dataset", "synthetic", "--quadratic-dim", str(DIM),
                "--method", self.method, "--max-steps", str(STEPS), "--lr", str(LR),
                "--eval-every", "0", "--metrics", str(workdir / "run.h5"), "--save",
                str(workdir / "theta.npy"), "--checkpoint-dir", str(workdir),
                "--checkpoint-every", "0.2", "--worker-timeout", "3", "--exit-timeout", "5",
                "--masters", str(self.masters), *extra]

    @property
    def ranks(self) -> int:
        return self.masters + self.workers


def _inject(fault: str, proc: subprocess.Popen, setting: Setting, rng: random.Random,
            ready: Callable[[], bool]) -> bool:
    """Wait until ``ready()`` or the job ends, then inject ``fault``; whether it was."""
    deadline = time.monotonic() + 60
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    time.sleep(rng.uniform(0.0, 0.6))  # somewhere in the run, not at a checkpoint's edge
    pids = rank_pids(proc.pid)
    if proc.poll() is not None or len(pids) < setting.ranks:
        return False
    worker = rng.randrange(setting.masters, setting.ranks)
    try:
        if fault == "kill-worker":
            os.kill(pids[worker], signal.SIGKILL)
        elif fault == "kill-master":
            os.kill(pids[0], signal.SIGKILL)
        elif fault == "sigusr1":
            proc.send_signal(signal.SIGUSR1)
        elif fault == "hang":  # hung for HANG_S, well past --worker-timeout, then let go
            os.kill(pids[worker], signal.SIGSTOP)
            wake = threading.Timer(HANG_S, _continue, (pids[worker],))
            wake.daemon = True
            wake.start()
    except ProcessLookupError:
        return False
    return True


def run_once(setting: Setting, workdir: Path, rng: random.Random, deadline: float,
             tally: Tally, python: str, mpirun: list[str]) -> None:
    """One run, broken and resumed until it finishes, then checked."""
    tally.runs += 1
    first = True
    for _start in range(100):
        fault = rng.choice(FAULTS) if time.monotonic() < deadline else None
        args = setting.args(workdir) + ([] if first else ["--resume", "auto"])
        if fault == "full-disk":
            args += ["--min-free-mb", "1e12"]  # as a disk with less than a terabyte free
        newest = checkpoint.latest(str(workdir))
        proc = subprocess.Popen([*mpirun, "-n", str(setting.ranks), python, "-m",
                                 "gem_mpi.train", *args], stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        injected = fault == "full-disk"
        if fault not in (None, "full-disk"):
            injected = _inject(fault, proc, setting, rng,
                               lambda before=newest: checkpoint.latest(str(workdir))
                               not in (None, before))
        try:
            _, err = proc.communicate(timeout=START_TIMEOUT)
        except subprocess.TimeoutExpired:
            kill_job(proc)
            proc.communicate()
            tally.broken.append(f"{setting}: a start did not end in {START_TIMEOUT:g} s "
                                f"(fault {fault})")
            return
        first = False
        if injected and proc.returncode == 0:
            tally.harmless += 1
        elif injected:
            tally.faults[fault] += 1
        if proc.returncode == 0:
            break
        if proc.returncode == 2:
            tally.broken.append(f"{setting}: a resume was refused: {err.strip()[-300:]}")
            return
        tally.resumes += 1
    check(setting, workdir, tally)


def check(setting: Setting, workdir: Path, tally: Tally) -> None:
    """Every invariant of a finished run on its files."""
    try:
        run = load_run(workdir / "run.h5")
    except RunFileError as exc:
        tally.broken.append(f"{setting}: its metrics file cannot be read: {exc}")
        return
    u = run.updates
    pairs = collections.Counter(zip(u["worker"].tolist(), u["seq"].tolist(), strict=True))
    # the budget is every worker's STEPS updates; a worker that gets SIGTERM (mpirun sends it
    # to the others when a rank dies) leaves the run, its unseen batches dealt to the others
    # (docs/RELIABILITY.md), which then take more than STEPS
    budget = setting.workers * STEPS
    lost = max(0, budget - len(pairs))
    duplicated = sum(c - 1 for c in pairs.values() if c > 1) + max(0, len(pairs) - budget)
    for w in range(1, setting.workers + 1):  # each worker's updates 0, 1, ... without a gap
        seqs = sorted(s for (v, s) in pairs if v == w)
        if seqs != list(range(len(seqs))):
            tally.broken.append(f"{setting} in {workdir}: worker {w}'s updates have a gap")
    tally.lost += lost
    tally.duplicated += duplicated
    if lost or duplicated:
        tally.broken.append(f"{setting} in {workdir}: {lost} updates lost, {duplicated} "
                            "duplicated")
    if run.summary.get("finished") != 1.0:
        tally.broken.append(f"{setting}: the metrics file does not say finished")
    if u["clock"].tolist() != list(range(len(u["clock"]))):
        tally.broken.append(f"{setting}: the clock column has a gap or a repeat")
    if setting.masters == 1 and not lost and not duplicated:
        ref = replay(u, Quadratic(DIM, 0), setting.method, LR,
                     proxy="global" if setting.method == "gem" else "local",
                     n_workers=setting.workers)
        if not np.array_equal(np.load(workdir / "theta.npy"), ref.theta):
            tally.broken.append(f"{setting}: θ differs from the replay of its updates")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gem_mpi.chaos", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=30.0, help="how long faults are injected "
                   "(the run then under way is finished and checked)")
    p.add_argument("--seed", type=int, default=0, help="the faults' and settings' seed")
    p.add_argument("--mpirun", default="mpirun --oversubscribe",
                   help="the launcher's command line (default: mpirun --oversubscribe)")
    p.add_argument("--keep", metavar="DIR", help="keep each run's files in DIR")
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    deadline = time.monotonic() + 60 * args.minutes
    tally = Tally()
    root = Path(args.keep or tempfile.mkdtemp(prefix="gem_chaos_"))
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    k = 0
    while time.monotonic() < deadline:
        method = METHODS[k % len(METHODS)]  # dn has one master only (its cycle's clock)
        setting = Setting(method, workers=rng.choice((2, 3)),
                          masters=2 if k % 3 == 2 and method != "dn" else 1)
        workdir = root / f"run{k:04d}"
        workdir.mkdir()
        run_once(setting, workdir, rng, deadline, tally, sys.executable, args.mpirun.split())
        if not args.keep and not tally.broken:
            shutil.rmtree(workdir)
        k += 1
    faults = ", ".join(f"{kind} {tally.faults[kind]}" for kind in FAULTS)
    print(f"chaos: {(time.monotonic() - t0) / 60:.1f} min, {tally.runs} runs, "
          f"{sum(tally.faults.values())} faults that ended a start ({faults}; "
          f"{tally.harmless} more came too late to), {tally.resumes} resumes; "
          f"updates lost {tally.lost}, duplicated {tally.duplicated}")
    for line in tally.broken:
        print(f"chaos: BROKEN: {line}")
    if tally.broken and not args.keep:
        print(f"chaos: the broken runs' files are in {root}")
    ok = not tally.broken and tally.lost == 0 and tally.duplicated == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
