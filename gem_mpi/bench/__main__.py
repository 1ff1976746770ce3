"""The command line of ``python -m gem_mpi.bench``: each bench module registers its own
subcommand (``register``), so that a bench's options live beside the code that reads them."""

from __future__ import annotations

import argparse
import json
import sys

import gem_mpi.bench as package
from gem_mpi.algorithm import kernel as gem
from gem_mpi.bench import (
    OptionError,
    compare,
    gpu,
    groups,
    kernel,
    lm,
    master,
    overhead,
    overlap,
    transport,
)

BENCHES = (kernel, master, transport, compare, overhead, gpu, overlap, groups, lm)  # help's order


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gem_mpi.bench", description=package.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    for bench in BENCHES:
        bench.register(sub).add_argument("--json", help="write the results to this file too")
    args = parser.parse_args(argv)
    gem.kernel_threads()  # a bad GEM_NUM_THREADS is refused before anything runs
    try:
        result = args.run(args)
    except OptionError as exc:
        parser.error(str(exc))
    if result is None:  # not rank 0
        return 0
    args.show(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    sys.stdout.flush()
    return 0 if result.get("ok", True) else 1


if __name__ == "__main__":
    sys.exit(main())
