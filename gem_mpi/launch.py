"""``python -m gem_mpi.launch``: run a training job under mpirun, and relaunch it from its newest
checkpoint when, and only when, a restart can fix what ended it: at most ``--max-restarts``
times, after a back-off that doubles each time.

MPI ends the whole job when a rank dies (docs/RELIABILITY.md, "A lost worker": no stack we run
lets rank 0 go on with gem_mpi's windows), so surviving a loss is a restart: the job resumes
from its newest checkpoint, and an asynchronous run resumes on fewer workers (the departed
worker's unseen data dealt to the others). Run it outside mpirun, on the node that launches::

    python -m gem_mpi.launch -n 5 --max-restarts 2 -- --checkpoint-dir ck --checkpoint-every 60 ...

What ended the job decides (the exit codes of docs/RELIABILITY.md):

- a rank killed (128 + its signal: 137 for an OOM kill or a lost node) or a stuck worker (6):
  restart on one worker fewer (a group of ``--group-size`` ranks, so that groups keep their
  size; a synchronous method, whose every rank is a worker, on as many ranks as before);
- an unhandled error (1): restart on as many ranks, if the run got further than at the last
  start (a newer checkpoint); an error before any progress would recur, and ends it;
- finished (0), refused (2), stopped by a signal (3), diverged (4), an output that cannot be
  written (5): no restart can change these; the launcher exits with the code.

SIGUSR1 and SIGTERM sent to the launcher go to the job (mpirun passes them to the ranks: a
checkpoint and exit 3), and a job ended after one is not restarted.
"""
from __future__ import annotations

import argparse
import shlex
import signal
import subprocess
import sys
import time
import uuid

from gem_mpi import config
from gem_mpi.errors import UsageError
from gem_mpi.outputs import checkpoint
from gem_mpi.run.preflight import validate
from gem_mpi.run.supervisor import EXIT_CODES, EXIT_USAGE, Outcome, say

# a run that ended by itself: its code is the answer, a restart would not change it
FINAL = {EXIT_CODES[Outcome.FINISHED]: "finished", EXIT_USAGE: "was refused",
         EXIT_CODES[Outcome.STOPPED]: "was stopped by a signal",
         EXIT_CODES[Outcome.DIVERGED]: "diverged",
         EXIT_CODES[Outcome.OUTPUT_FAILED]: "could not write an output (a full disk?): "
                                            "free space, then run the launcher again"}
STUCK, CRASHED = EXIT_CODES[Outcome.STUCK], EXIT_CODES[Outcome.FAILED]
BACKOFF_MAX = 300.0  # seconds: the longest wait before a restart
FORWARDED = (signal.SIGUSR1, signal.SIGTERM)


def lost_rank(code: int) -> bool:
    """Whether exit ``code`` says a rank was lost: killed by a signal, or stuck."""
    return code > 128 or code == STUCK


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m gem_mpi.launch", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", type=int, required=True, help="MPI ranks of the first attempt")
    p.add_argument("--max-restarts", type=int, default=3,
                   help="relaunches after a lost rank or a passing error (default 3)")
    p.add_argument("--backoff", type=float, default=10.0, metavar="S",
                   help="seconds before the first restart, doubled before each next one, at "
                   f"most {BACKOFF_MAX:g} (default 10)")
    p.add_argument("--mpirun", default="mpirun", help="the launcher's command line, to which "
                   "-n N and the python command are added (default: mpirun)")
    p.add_argument("train", nargs=argparse.REMAINDER,
                   help="-- then gem_mpi.train's options")
    return p


def plan(argv: list[str]) -> tuple[argparse.Namespace, list[str], int]:
    """(the launcher's options, the training options with --resume auto, the fewest ranks a
    restart may use); UsageError for what cannot work."""
    args = _parser().parse_args(argv)
    train = args.train[1:] if args.train[:1] == ["--"] else args.train
    cfg, _ = config.parse(train)
    if cfg is None:
        raise UsageError("python -m gem_mpi.launch: give gem_mpi.train's options after --")
    if not cfg.outputs.checkpoint_dir:
        raise UsageError("python -m gem_mpi.launch restarts from a checkpoint: give "
                         "--checkpoint-dir (and --checkpoint-every)")
    if args.max_restarts < 0:
        raise UsageError(f"--max-restarts {args.max_restarts} must be >= 0")
    if not 0 <= args.backoff <= BACKOFF_MAX:
        raise UsageError(f"--backoff {args.backoff:g} must be in [0, {BACKOFF_MAX:g}]")
    # a lost worker is dropped: one rank, or its group's G ranks (groups keep their size)
    args.drop = 0 if config.synchronous(cfg.method) else cfg.runtime.group_size
    fewest = args.n if config.synchronous(cfg.method) else (cfg.runtime.masters
                                                            + cfg.runtime.group_size)
    if args.n < fewest:
        raise UsageError(f"-n {args.n}: a job needs at least {fewest} ranks")
    validate(cfg, args.n, data=False)  # the options, before any job: one line, exit 2
    out = cfg.outputs
    if not out.run_id:  # every restart continues this run, never another in the directory
        continued = checkpoint.resolve(out.resume, out.checkpoint_dir, None)
        rid = (checkpoint.run_of(continued) if continued else None) or uuid.uuid4().hex
        train = [*train, "--run-id", rid]
    if not out.resume:
        train = [*train, "--resume", "auto"]  # the first attempt starts afresh if none yet
    return args, train, fewest


class _Job:
    """The running mpirun, and the signals that reach it through the launcher."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.signalled: int | None = None
        for sig in FORWARDED:
            signal.signal(sig, self._forward)

    def _forward(self, signum: int, frame: object) -> None:
        self.signalled = signum
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signum)

    def run(self, cmd: list[str]) -> int:
        self.proc = subprocess.Popen(cmd)
        while True:
            try:
                return self.proc.wait()
            except KeyboardInterrupt:  # mpirun got the SIGINT too: wait for it to end
                continue


def main(argv: list[str] | None = None) -> int:
    try:
        args, train, fewest = plan(sys.argv[1:] if argv is None else argv)
    except UsageError as exc:
        say(f"error: {exc}")
        return EXIT_USAGE
    ranks, job = args.n, _Job()
    out = config.parse(train)[0].outputs
    directory, run_id = out.checkpoint_dir, out.run_id
    newest = checkpoint.latest(directory, run_id)  # where the last start began
    for attempt in range(args.max_restarts + 1):
        again = ["--resume", "auto"] if attempt else []  # a restart: from the newest
        cmd = [*shlex.split(args.mpirun), "-n", str(ranks), sys.executable, "-m",
               "gem_mpi.train", *train, *again]
        code = job.run(cmd)
        done = f" after {attempt} restart(s), on {ranks} ranks" if attempt else ""
        if code in FINAL:
            if attempt or code == EXIT_CODES[Outcome.OUTPUT_FAILED]:
                say(f"launch: the run {FINAL[code]}{done}")
            return code
        if job.signalled is not None:
            say(f"launch: the job ended (exit {code}) after {signal.Signals(job.signalled).name}"
                f"; not restarted{done}")
            return code
        reached = checkpoint.latest(directory, run_id)
        if lost_rank(code):
            why = f"the job lost a rank (exit {code})"
            ranks = max(fewest, ranks - args.drop)
        elif code == CRASHED and reached != newest:
            why = "the job failed with an error (exit 1) after it made progress"
        else:
            what = "failed with an error" if code == CRASHED else f"ended with exit {code}"
            say(f"launch: the job {what} before any new checkpoint: a restart would end the "
                f"same way, so none is made{done}; its messages are above")
            return code
        if attempt == args.max_restarts:
            say(f"launch: {why} and --max-restarts {args.max_restarts} are used up; "
                "--resume auto continues it")
            return code
        wait = min(args.backoff * 2 ** attempt, BACKOFF_MAX)
        say(f"launch: {why}; restart {attempt + 1} of {args.max_restarts} on {ranks} ranks, "
            f"from the newest checkpoint, in {wait:g} s")
        newest = reached
        time.sleep(wait)
        if job.signalled is not None:  # a stop asked for while waiting: nothing to stop
            say(f"launch: {signal.Signals(job.signalled).name} before the restart: not "
                "restarted; --resume auto continues it")
            return EXIT_CODES[Outcome.STOPPED]
    return 1  # not reached: the loop returns


if __name__ == "__main__":
    sys.exit(main())
