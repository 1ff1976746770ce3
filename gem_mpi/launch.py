"""``python -m gem_mpi.launch``: run a training job under mpirun, and relaunch it from its newest
checkpoint with one worker fewer each time it loses a rank, at most ``--max-restarts`` times.

MPI ends the whole job when a rank dies (docs/RELIABILITY.md, "A lost worker": no stack we run
lets rank 0 go on with gem_mpi's windows), so surviving a loss is a restart: the job resumes
from its newest checkpoint, and an asynchronous run resumes on fewer workers (the departed
worker's unseen data dealt to the others). Run it outside mpirun, on the node that launches::

    python -m gem_mpi.launch -n 5 --max-restarts 2 -- --checkpoint-dir ck --checkpoint-every 60 ...

Only a lost rank (the job killed, aborted or stuck: any exit but 0–4) restarts; a finished (0),
refused (2), stopped (3) or diverged (4) run ends the launcher with its code. On one node the
launcher cannot tell which worker's slot was lost, so it drops one worker per restart; a
synchronous method (every rank a worker, fixed count) restarts on as many ranks as before.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys

from gem_mpi import config
from gem_mpi.errors import UsageError
from gem_mpi.run.preflight import validate
from gem_mpi.run.supervisor import EXIT_USAGE, say

# a run that ended by itself: its code is the answer, a restart would not change it
FINAL = {0: "finished", 2: "refused", 3: "stopped by a signal", 4: "diverged"}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m gem_mpi.launch", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", type=int, required=True, help="MPI ranks of the first attempt")
    p.add_argument("--max-restarts", type=int, default=3,
                   help="relaunches after a lost rank (default 3)")
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
    fewest = args.n if config.synchronous(cfg.method) else cfg.runtime.masters + 1
    if args.n < fewest:
        raise UsageError(f"-n {args.n}: a job needs at least {fewest} ranks")
    validate(cfg, args.n, data=False)  # the options, before any job: one line, exit 2
    if not cfg.outputs.resume:
        train = [*train, "--resume", "auto"]  # the first attempt starts afresh if none yet
    return args, train, fewest


def main(argv: list[str] | None = None) -> int:
    try:
        args, train, fewest = plan(sys.argv[1:] if argv is None else argv)
    except UsageError as exc:
        say(f"error: {exc}")
        return EXIT_USAGE
    ranks = args.n
    for attempt in range(args.max_restarts + 1):
        cmd = [*shlex.split(args.mpirun), "-n", str(ranks), sys.executable, "-m",
               "gem_mpi.train", *train]
        code = subprocess.run(cmd, check=False).returncode
        if code in FINAL:
            if attempt:
                say(f"launch: the run {FINAL[code]} after {attempt} restart(s), on {ranks} "
                    "ranks")
            return code
        if attempt == args.max_restarts:
            say(f"launch: the job lost a rank (exit {code}) and --max-restarts "
                f"{args.max_restarts} are used up; --resume auto continues it")
            return code
        ranks = max(fewest, ranks - 1)
        say(f"launch: the job lost a rank (exit {code}); restart {attempt + 1} of "
            f"{args.max_restarts} on {ranks} ranks, from the newest checkpoint")
    return 1  # not reached: the loop returns


if __name__ == "__main__":
    sys.exit(main())
