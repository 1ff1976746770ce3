"""Running the experiments' jobs one at a time, resumably, and saying how long it will take.

Each run is a real ``mpirun … python -m gem_mpi.train`` job (as ``gem_mpi.bench compare``
launches them) that writes ``<results>/<run>.h5`` and checkpoints into ``<run>.ckpt/`` every
minute with ``--resume auto``: run the harness again and a finished run (its summary says
finished, or it diverged: exit 4, recorded as such) is skipped, an interrupted one continues
from its checkpoint. ``<run>.json`` beside it records the exact command, every attempt
(start, end, exit code, wall time), the commit and the machine, for the report to quote;
``<run>.log`` keeps rank 0's output.

SIGINT or SIGTERM to the harness is forwarded to the running ``mpirun`` as SIGUSR1 (the
master checkpoints and the job exits 3) and the harness stops after it; a second one
terminates the job. The jobs run in their own session, so that Ctrl-C on a terminal reaches
the harness only, not every rank at once (which would kill them without a checkpoint).
"""

from __future__ import annotations

import ast
import contextlib
import datetime
import fcntl
import json
import math
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gem_mpi.config import synchronous
from gem_mpi.outputs import analysis, runfile
from gem_mpi.outputs.files import atomic_write
from gem_mpi.reproduce import experiments as ex
from gem_mpi.reproduce.imagefolder import generate

REPO = Path(__file__).resolve().parents[2]
CHECKPOINT_EVERY_S = 60
EXIT_STOPPED, EXIT_DIVERGED = 3, 4  # gem_mpi.train's exit codes (docs/RELIABILITY.md)
DONE = ("finished", "diverged")
# ranks beyond which one machine keeps the job's memory in check (tools/scale.sh's settings)
MANY_RANKS = 40
# GB per rank training the paper's net on Fashion-MNIST: the CUDA build of torch (about
# 0.28 GB after import alone: docs/SCALE.md), and the CPU-only one (0.21 GB: 101 ranks took
# 20.9 GB PSS here, the data held by every rank)
TORCH_RANK_GB, CPU_TORCH_RANK_GB = 0.3, 0.21

# Assumed training rates on the 2-core development machine, in samples per second of the
# whole job (docs/PERFORMANCE.md, and 1-rank sync measured at 47 steps/s of b 64), and the
# job's start-up (about 2 s per rank: docs/SCALE.md). Finished runs correct them.
ASSUMED_RATE = {("mnist-cnn", "async"): 6000.0, ("mnist-cnn", "sync"): 4500.0,
                ("mnist-cnn", "sync1"): 3000.0, ("alexnet", "async"): 19.0,
                ("alexnet", "sync1"): 20.0, ("gpt", "async"): 300.0, ("gpt", "sync"): 300.0}


def rate_key(run: ex.Run) -> tuple[str, str]:
    kind = "async" if not synchronous(run.method) else "sync1" if run.ranks == 1 else "sync"
    return run.model, kind


def assumed_seconds(run: ex.Run) -> float:
    rate = ASSUMED_RATE.get(rate_key(run), 3000.0)
    return 8.0 + 2.0 * run.ranks + run.samples / rate


# --- what a run has left on disk ----------------------------------------------------------

@dataclass(frozen=True)
class Paths:
    metrics: Path
    checkpoints: Path
    record: Path
    log: Path
    memory: Path

    @classmethod
    def of(cls, results: Path, run: ex.Run) -> Paths:
        base = results / run.name
        return cls(Path(f"{base}.h5"), Path(f"{base}.ckpt"), Path(f"{base}.json"),
                   Path(f"{base}.log"), Path(f"{base}.mem.json"))


def load_record(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def save_record(path: Path, record: dict) -> None:
    atomic_write(str(path), lambda tmp: Path(tmp).write_text(json.dumps(record, indent=1)))


def status(results: Path, run: ex.Run) -> str:
    """finished, diverged (both done), stopped or failed (to be resumed), or new."""
    return status_of(results, run.name)


def status_of(results: Path, name: str) -> str:
    """:func:`status` of the run called ``name``."""
    base = results / name
    p = Paths(Path(f"{base}.h5"), Path(f"{base}.ckpt"), Path(f"{base}.json"),
              Path(f"{base}.log"), Path(f"{base}.mem.json"))
    record = load_record(p.record) or {}
    if p.metrics.exists():
        try:
            data = runfile.load_run(p.metrics)
        except (runfile.RunFileError, OSError):
            data = None
        if data is not None and data.finished:
            return "finished"
        if data is not None and analysis.diverged(data):
            return "diverged"
    if record.get("status") in ("diverged", "stopped", "failed"):
        return record["status"]
    return "stopped" if p.metrics.exists() or p.checkpoints.exists() else "new"


# --- E10's and E11's main runs wait for their tuning runs -------------------------------

def tuning_losses(results: Path, run: ex.Run) -> dict[float, float] | None:
    """η → final validation loss of the run's tuning runs (a diverged one: inf), or None
    while any of them is not done."""
    losses = {}
    for name, lr in run.tuned_by:
        path = results / f"{name}.h5"
        try:
            data = runfile.load_run(path) if path.exists() else None
        except (runfile.RunFileError, OSError):
            data = None
        if data is not None and analysis.diverged(data):
            losses[lr] = math.inf
        elif data is not None and data.finished:
            losses[lr] = float(analysis.final_test(data).loss)
        elif status_of(results, name) == "diverged":
            losses[lr] = math.inf
        else:
            return None
    return losses


def tuned(results: Path, run: ex.Run) -> ex.Run | None:
    """The run with the η its tuning runs chose (ex.choose_lr), or None while they are
    not all done; a run tuned by none is itself."""
    if not run.tuned_by:
        return run
    losses = tuning_losses(results, run)
    return None if losses is None else run.with_lr(ex.choose_lr(losses))


def waits_text(results: Path, run: ex.Run) -> str:
    """What a main run waits for, said in the plan and the harness's lines."""
    left = [name for name, _ in run.tuned_by if status_of(results, name) not in DONE]
    return (f"waits for its tuning runs ({len(left)} of {len(run.tuned_by)} not done: "
            f"{', '.join(left)}), whose validation losses choose its --lr")


# --- how a job is launched here -----------------------------------------------------------

def cpu_python() -> str | None:
    """The CPU-only torch environment of tools/scale.sh (less memory per rank), or None."""
    venv = os.environ.get("GEM_MPI_SCALE_VENV") or os.path.expanduser(
        "~/.cache/gem_mpi/venv-cpu")
    py = os.path.join(venv, "bin", "python")
    return py if os.access(py, os.X_OK) else None


def cores() -> int:
    return len(os.sched_getaffinity(0))


def as_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def command(run: ex.Run, results: Path, log_every: float) -> list[str]:
    """The job's exact argv: mpirun, then gem_mpi.train with the harness's outputs."""
    p = Paths.of(results, run)
    python = (cpu_python() if run.cpu_env else None) or sys.executable
    mpirun = ["mpirun", "-n", str(run.ranks)]
    if as_root():
        mpirun.append("--allow-run-as-root")
    if run.ranks > cores():
        mpirun.append("--oversubscribe")
    mpirun += ["--mca", "btl", "self,vader"]  # one machine: shared memory, no TCP port
    if run.ranks > MANY_RANKS:
        mpirun += ["-x", "MALLOC_TRIM_THRESHOLD_=0"]
    train = [python, "-m", "gem_mpi.train", *run.options, "--metrics", str(p.metrics),
             "--checkpoint-dir", str(p.checkpoints), "--checkpoint-every",
             str(CHECKPOINT_EVERY_S), "--resume", "auto", "--log-every", f"{log_every:g}"]
    if run.memwatch:
        watch = [sys.executable, str(REPO / "tools" / "memwatch.py"), "--json", str(p.memory),
                 "--"]
        return [*watch, *mpirun, *train]
    return [*mpirun, *train]


def job_env() -> dict[str, str]:
    """The checkout's gem_mpi on every rank, whatever the directory the harness runs in."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"]
                                     if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def memory_needed_gb(run: ex.Run) -> float:
    if run.model == "alexnet":
        return ex.alexnet_memory_gb(run.workers)
    per_rank = CPU_TORCH_RANK_GB if run.cpu_env and cpu_python() else TORCH_RANK_GB
    return run.ranks * per_rank


def memory_available_gb() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return float("inf")


def why_not_here(run: ex.Run) -> str:
    """Why launching this run would only exhaust this machine's memory ("" when it fits)."""
    need, have = memory_needed_gb(run), memory_available_gb()
    if need <= have:
        return ""
    fix = ""
    if run.cpu_env and not cpu_python():
        fix = ("; build the CPU-only environment of tools/scale.sh first (GEM_MPI_VENV="
               "~/.cache/gem_mpi/venv-cpu GEM_MPI_TORCH=2.13.0 GEM_MPI_TORCHVISION=none "
               "GEM_MPI_HOROVOD=0 bash tools/install.sh)")
    return f"needs about {need:.0f} GB of memory, {have:.0f} GB available{fix}"


# --- provenance -----------------------------------------------------------------------------

def _git(*args: str) -> subprocess.CompletedProcess[str] | None:
    """One git command in the checkout; None when git cannot run."""
    try:
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True,
                              text=True, check=False, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None


def git_state() -> dict[str, object]:
    def out(*args: str) -> str:
        done = _git(*args)
        return done.stdout.strip() if done is not None else ""
    commit = out("rev-parse", "HEAD") or "unknown"
    dirty = bool(out("status", "--porcelain", "--untracked-files=no"))
    return {"commit": commit, "dirty": dirty}


#: What a run executes: the package without the harness, the benchmarks and the offline
#: analysis, and the extension.
RUN_CODE = ("gem_mpi", "csrc", "CMakeLists.txt", "setup.py", ":(exclude)gem_mpi/reproduce",
            ":(exclude)gem_mpi/bench", ":(exclude)gem_mpi/outputs/analysis.py",
            ":(exclude)gem_mpi/outputs/runfile.py", ":(exclude)gem_mpi/outputs/figures.py")


def _python_code(source: str) -> str:
    """A module's code without its comments and docstrings (its syntax tree), so that a run
    is not said to have run other code because a comment changed since."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return source
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                and body and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree)


def _run_code_differs(commit: str, head: str) -> bool | None:
    """Whether the code a run executes differs between two commits, up to comments and
    docstrings in Python; None when git cannot tell."""
    names = _git("diff", "--name-only", commit, head, "--", *RUN_CODE)
    if names is None or names.returncode != 0:
        return None
    for path in names.stdout.split():
        if not path.endswith(".py"):
            return True
        old, new = _git("show", f"{commit}:{path}"), _git("show", f"{head}:{path}")
        if old is None or new is None:
            return None
        if old.returncode or new.returncode:  # added or removed
            return True
        if _python_code(old.stdout) != _python_code(new.stdout):
            return True
    return False


def code_changed_since(commits: list[str], head: str = "HEAD"
                       ) -> tuple[str, list[str]] | None:
    """``head`` and the commits whose run code differs from it; None when git cannot tell.

    Runs made over several sessions carry several commits: this says whether they
    still describe the code users get.
    """
    rev = _git("rev-parse", "--short=12", head)
    if rev is None or rev.returncode != 0:
        return None
    changed = []
    for commit in commits:
        differs = _run_code_differs(commit, head)
        if differs is None:
            return None
        if differs:
            changed.append(commit)
    return rev.stdout.strip(), changed


#: Where --rerun-older-code keeps the files of the runs it reruns, one folder per commit.
OLDER_CODE = "older-code"


def older_code(runs: list[ex.Run], results: Path) -> dict[str, str] | None:
    """The done runs (name: commit) whose record says they ran other code than HEAD's, or
    uncommitted changes; None when git cannot tell.

    Results gathered over many sessions mix commits: these are the runs to make again so
    that every figure describes the code users get.
    """
    done: dict[str, tuple[str, bool]] = {}
    for run in runs:
        record = load_record(Paths.of(results, run).record)
        if record and record.get("status") in DONE:
            done[run.name] = (str(record.get("git_commit", "unknown")),
                              bool(record.get("git_dirty")))
    commits = sorted({c for c, _ in done.values() if c != "unknown"})
    verdict = code_changed_since(commits)
    if verdict is None:
        return None
    changed = set(verdict[1])
    return {name: commit for name, (commit, dirty) in done.items()
            if dirty or commit == "unknown" or commit in changed}


def set_aside(results: Path, run: ex.Run, commit: str) -> Path:
    """Move a run's files into ``<results>/older-code/<commit>/`` so that it starts anew;
    they are kept, never deleted or overwritten."""
    p = Paths.of(results, run)
    files = [f for f in (p.metrics, p.record, p.log, p.memory, p.checkpoints) if f.exists()]
    base = results / OLDER_CODE / commit[:12]
    dest, k = base, 1
    while any((dest / f.name).exists() for f in files):
        dest, k = base.with_name(f"{base.name}.{k}"), k + 1
    dest.mkdir(parents=True, exist_ok=True)
    for f in files:
        f.rename(dest / f.name)
    return dest


def machine() -> str:
    """CPU, cores, memory, OS and MPI: what the wall times depend on."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f
                    if line.startswith("model name")), cpu)
    try:
        mpi = subprocess.run(["mpirun", "--version"], capture_output=True, text=True,
                             check=False, timeout=30).stdout.splitlines()[0].strip()
    except (OSError, subprocess.SubprocessError, IndexError):
        mpi = "mpirun not found"
    return (f"{cpu}, {cores()} cores, {ex.machine_memory_gb():.0f} GiB, "
            f"{platform.system()} {platform.release()}, {mpi}, Python "
            f"{platform.python_version()}")


def now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def fmt_s(seconds: float) -> str:
    s = round(max(seconds, 0))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


# --- estimates ------------------------------------------------------------------------------

class Estimates:
    """Seconds per run: the assumed rate, corrected per kind of job by the finished runs'
    measured wall times in the same results directory."""

    def __init__(self, runs: list[ex.Run], results: Path) -> None:
        spent: dict[tuple[str, str], list[float]] = {}
        for run in runs:
            record = load_record(Paths.of(results, run).record)
            if not record or record.get("status") != "finished":
                continue
            wall = sum(s.get("wall_s", 0.0) for s in record.get("segments", []))
            if wall > 0:
                pair = spent.setdefault(rate_key(run), [0.0, 0.0])
                pair[0] += wall
                pair[1] += assumed_seconds(run)
        self.factor = {k: a / b for k, (a, b) in spent.items() if b > 0}
        self.measured = {k: v for k, v in spent.items()}

    def seconds(self, run: ex.Run) -> float:
        return assumed_seconds(run) * self.factor.get(rate_key(run), 1.0)

    def basis(self) -> str:
        rates = ", ".join(f"{m} {k} {r:g}" for (m, k), r in ASSUMED_RATE.items())
        text = (f"estimates: start-up 8 s + 2 s per rank, then samples at assumed rates "
                f"(samples/s of the whole job on a 2-core machine: {rates})")
        if self.factor:
            fixed = ", ".join(f"{m} {k} ×{f:.2f}" for (m, k), f in self.factor.items())
            text += f", corrected by the finished runs measured here ({fixed})"
        else:
            text += "; no finished run here yet to measure them"
        return text


def plan_text(runs: list[ex.Run], results: Path, log_every: float,
              older: dict[str, str] | None = None) -> str:
    """Every run with its state, estimate and exact command, then the total; ``older``
    (from :func:`older_code`) marks the done runs that will be made again."""
    est = Estimates(runs, results)
    older = older or {}
    lines, left, todo = [], 0.0, 0
    for i, planned in enumerate(runs, 1):
        run = tuned(results, planned) or planned
        state = status(results, run)
        seconds = est.seconds(run)
        if run.tuned_by and state not in DONE:
            state += (f", η {run.lr:g} chosen by its tuning runs" if math.isfinite(run.lr)
                      else "; " + waits_text(results, run))
        if run.name in older:
            state += (f" with older code ({older[run.name][:12]}): --rerun-older-code sets "
                      "it aside and runs it again")
        if state not in DONE:
            left += seconds
            todo += 1
        warn = why_not_here(run)
        lines.append(f"[{i}/{len(runs)}] {run.name}: {run.experiment} {run.variant}, "
                     f"{run.ranks} ranks, {run.steps} steps × b {run.batch} per worker, "
                     f"estimated {fmt_s(seconds)}, {state}"
                     + (f"; WILL NOT RUN HERE: {warn}" if warn else ""))
        lines.append("    " + shlex.join(command(run, results, log_every)))
    lines.append(f"{len(runs)} runs, {len(runs) - todo} done, {todo} to run: estimated "
                 f"wall time {fmt_s(left)} ({est.basis()})")
    return "\n".join(lines)


# --- running --------------------------------------------------------------------------------

def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError), \
                    open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry))
    return out


def _mpirun_pid(proc: subprocess.Popen, wrapped: bool) -> int:
    """The mpirun of the job: the process itself, or memwatch's child."""
    if not wrapped:
        return proc.pid
    for pid in _children(proc.pid):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/comm") as f:
            if f.read().strip() in ("mpirun", "orterun", "prterun", "mpiexec"):
                return pid
    return proc.pid


class Harness:
    """Runs a list of runs in order, skipping what is done; one job at a time."""

    def __init__(self, results: Path, budget: ex.Budget, lock: Path | None = None,
                 say: Callable[[str], None] | None = None, heartbeat_s: float = 60.0,
                 older: dict[str, str] | None = None) -> None:
        self.results, self.budget, self.lock = results, budget, lock
        # done runs of older code to make again (:func:`older_code`): each is set aside
        # only when its job starts, so that a stop leaves every other run where it was
        self.older = dict(older or {})
        self.say = say or (lambda text: print(f"reproduce: {text}", flush=True))
        self.heartbeat_s = heartbeat_s
        self.proc: subprocess.Popen | None = None
        self.wrapped = False
        self.signals = 0
        self.git = git_state()
        self.machine = machine()

    # signals: the first stops the job with a checkpoint, the second terminates it
    def _on_signal(self, signum: int, _frame: object) -> None:
        self.signals += 1
        proc = self.proc
        if proc is None or proc.poll() is not None:
            self.say(f"signal {signum}: stopping")
            return
        if self.signals == 1:
            self.say(f"signal {signum}: SIGUSR1 to mpirun, the run checkpoints and stops "
                     "(exit 3); the same command resumes it (a second signal terminates it)")
            with contextlib.suppress(ProcessLookupError):
                os.kill(_mpirun_pid(proc, self.wrapped), signal.SIGUSR1)
        else:
            self.say(f"signal {signum} again: terminating the job")
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)

    def run(self, runs: list[ex.Run]) -> int:
        """0 when every run is done, 1 when some failed, 3 when stopped by a signal."""
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            return self._run_all(runs)
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)

    def _run_all(self, runs: list[ex.Run]) -> int:
        self.results.mkdir(parents=True, exist_ok=True)
        states = {r.name: "older code" if r.name in self.older else status(self.results, r)
                  for r in runs}
        failed: list[str] = []
        done_before = sum(s in DONE for s in states.values())
        if done_before:
            self.say(f"{done_before} of {len(runs)} runs already done: skipped")
        if done_before < len(runs):
            est = Estimates(runs, self.results)
            total = sum(est.seconds(r) for r in runs if states[r.name] not in DONE)
            self.say(f"{len(runs) - done_before} runs to run, estimated {fmt_s(total)} "
                     f"({est.basis()}); --plan lists their commands")
        for i, run in enumerate(runs, 1):
            if self.signals:
                return EXIT_STOPPED
            if states[run.name] in DONE:
                continue
            ready = tuned(self.results, run)
            if ready is None:  # its tuning runs failed, or were not selected (--seeds, --ns)
                self.say(f"[{i}/{len(runs)}] {run.name}: not run: "
                         f"{waits_text(self.results, run)}")
                failed.append(run.name)
                continue
            if ready.tuned_by and run.name not in self.older:
                self.say(f"[{i}/{len(runs)}] {run.name}: η {ready.lr:g}, chosen by its tuning "
                         f"runs ({run.experiment}'s rule)")
            run = ready
            est = Estimates(runs, self.results)  # corrected by the runs finished so far
            left = sum(est.seconds(r) for r in runs[i:] if states[r.name] not in DONE)
            outcome = self._one(run, f"[{i}/{len(runs)}]", est.seconds(run), left)
            states[run.name] = outcome
            if outcome == "stopped":
                return EXIT_STOPPED
            if outcome == "failed":
                failed.append(run.name)
        if failed:
            self.say(f"{len(failed)} run(s) failed: {', '.join(failed)} (their .log files "
                     "say why); running the same command again retries them")
            return 1
        self.say(f"all {len(runs)} runs done")
        return 0

    def _one(self, run: ex.Run, tag: str, estimate: float, after: float) -> str:
        p = Paths.of(self.results, run)
        record = load_record(p.record) or {}
        why = why_not_here(run)
        if why:
            self.say(f"{tag} {run.name}: not run: {why}")
            if run.name not in self.older:  # a done run's files stay as they are
                self._save(p, run, record, None, "failed", note=why)
            return "failed"
        if run.model == "alexnet":
            self.say(f"{tag} generating the image folder for {run.name}")
            generate(ex.imagefolder_dir(str(self.results)), self.budget.e8_folder)
        with self._locked(tag, run):
            if self.signals:
                return "stopped"
            if run.name in self.older:
                commit = self.older.pop(run.name)
                dest = set_aside(self.results, run, commit)
                record = {}
                self.say(f"{tag} {run.name} ran older code ({commit[:12]}): its files "
                         f"moved to {dest}; running it again")
            p.checkpoints.mkdir(parents=True, exist_ok=True)
            cmd = command(run, self.results, self.budget.log_every)
            eta = datetime.datetime.now() + datetime.timedelta(seconds=estimate + after)
            resumed = " (resuming)" if p.metrics.exists() else ""
            self.say(f"{tag} {run.name}{resumed}: {run.ranks} ranks, estimated "
                     f"{fmt_s(estimate)}; all left done in about {fmt_s(estimate + after)} "
                     f"(ETA {eta:%H:%M})")
            segment = {"started": now(), "command": shlex.join(cmd)}
            t0 = time.monotonic()
            with open(p.log, "a") as log:
                log.write(f"=== {segment['started']} {segment['command']}\n")
                log.flush()
                self.wrapped = run.memwatch
                self.proc = subprocess.Popen(cmd, env=job_env(), stdout=log,
                                             stderr=subprocess.STDOUT, start_new_session=True)
                rc = self._wait(tag, run, t0, estimate, after)
                self.proc = None
        wall = time.monotonic() - t0
        segment.update(ended=now(), exit_code=rc, wall_s=round(wall, 1))
        outcome = self._outcome(p, rc)
        if self.signals and outcome == "failed":
            outcome = "stopped"  # ended by our signal before its ranks could catch it
        self._save(p, run, record, segment, outcome)
        if outcome in DONE:
            shutil.rmtree(p.checkpoints, ignore_errors=True)  # only a resume needs them
        tail = "" if outcome in DONE + ("stopped",) else ": " + self._tail(p.log)
        self.say(f"{tag} {run.name}: {outcome} (exit {rc}) after {fmt_s(wall)}{tail}")
        return outcome

    @contextlib.contextmanager
    def _locked(self, tag: str, run: ex.Run):
        """Hold --lock while the job runs, so that other heavy work waits its turn (and the
        wall-clock figures are not shared with it)."""
        if self.lock is None:
            yield
            return
        with open(self.lock, "a") as f:
            said = False
            while not self.signals:
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if not said:
                        self.say(f"{tag} {run.name}: waiting for the lock {self.lock}")
                        said = True
                    time.sleep(1.0)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def _wait(self, tag: str, run: ex.Run, t0: float, estimate: float, after: float) -> int:
        assert self.proc is not None
        while True:
            try:
                return self.proc.wait(timeout=self.heartbeat_s)
            except subprocess.TimeoutExpired:
                spent = time.monotonic() - t0
                rest = max(estimate - spent, 0.0) + after
                eta = datetime.datetime.now() + datetime.timedelta(seconds=rest)
                self.say(f"{tag} {run.name} running for {fmt_s(spent)} (estimated "
                         f"{fmt_s(estimate)}); all left done in about {fmt_s(rest)} "
                         f"(ETA {eta:%H:%M})")

    @staticmethod
    def _outcome(p: Paths, rc: int) -> str:
        if rc == EXIT_DIVERGED:
            return "diverged"
        if rc == EXIT_STOPPED:
            return "stopped"
        if rc == 0:
            try:
                return "finished" if runfile.load_run(p.metrics).finished else "failed"
            except (runfile.RunFileError, OSError):
                return "failed"
        return "failed"

    @staticmethod
    def _tail(log: Path, lines: int = 3) -> str:
        with contextlib.suppress(OSError):
            return " | ".join(log.read_text(errors="replace").strip().splitlines()[-lines:])
        return ""

    def _save(self, p: Paths, run: ex.Run, record: dict, segment: dict | None, outcome: str,
              note: str = "") -> None:
        segments = list(record.get("segments", [])) + ([segment] if segment else [])
        memory = load_record(p.memory) if run.memwatch else None
        record = {
            "name": run.name, "experiment": run.experiment, "variant": run.variant,
            "n": run.n, "seed": run.seed, "method": run.method, "ranks": run.ranks,
            "command": segment["command"] if segment else record.get("command", ""),
            "cwd": os.getcwd(), "pythonpath": str(REPO), "metrics": str(p.metrics),
            "status": outcome, "note": note, "segments": segments,
            "wall_s": round(sum(s.get("wall_s", 0.0) for s in segments), 1),
            "git_commit": self.git["commit"], "git_dirty": self.git["dirty"],
            "machine": self.machine, "budget": self.budget.name,
            **({"memory": memory} if memory else {}),
        }
        save_record(p.record, record)
