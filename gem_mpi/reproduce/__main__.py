"""``python -m gem_mpi.reproduce``: run the paper's experiments, then report on them.

    python -m gem_mpi.reproduce --plan            # every run, its command, an estimate
    python -m gem_mpi.reproduce all               # run E1–E11 one job at a time (resumable)
    python -m gem_mpi.reproduce E1 E3             # only these (E3 shows E1's runs)
    python -m gem_mpi.reproduce all --seeds 0     # one seed of everything first, the rest later
    python -m gem_mpi.reproduce all --rerun-older-code   # remake runs of code older than HEAD's
    python -m gem_mpi.reproduce --report          # docs/results/ from results/mnist/*.h5
    python -m gem_mpi.reproduce --dataset fashion-mnist --report   # the Fashion-MNIST set
    python -m gem_mpi.reproduce --quick all --report --out /tmp/r   # the harness's own test
    python -m gem_mpi.reproduce E10 --report --pages E10   # only E10's page, not README.md

Run it again after an interruption (Ctrl-C, SIGTERM, a reboot) and it skips finished runs
and resumes the interrupted one from its checkpoint. With --rerun-older-code, a done run
whose record says it ran other code than HEAD's (comments and docstrings aside; the
harness, benchmarks and analysis excluded) or uncommitted changes has its files moved into
<results>/older-code/<commit>/ when its job starts, and is run again. Exit status: 0 when
every run named is done, 1 when some failed (their .log files say why), 3 when stopped by a
signal, 2 on a usage error.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gem_mpi.reproduce import claims, report, runner
from gem_mpi.reproduce import experiments as ex
from gem_mpi.reproduce.results import Results


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m gem_mpi.reproduce", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("experiments", nargs="*", metavar="EXPERIMENT",
                   help="E1 … E11, or all (none with --plan: all)")
    p.add_argument("--plan", action="store_true", help="print every run with its command "
                   "and an estimated wall time, and run nothing")
    p.add_argument("--seeds", type=int, nargs="+", metavar="SEED", help="only the runs with "
                   "these seeds (default: every seed the budget has), so that one seed of "
                   "every experiment can finish before the others start")
    p.add_argument("--ns", type=int, nargs="+", metavar="N", help="only the runs with these "
                   "numbers of workers (e.g. E1 at n = 5 and 10 with a core per worker: "
                   "tools/cores_check.sh)")
    p.add_argument("--rerun-older-code", action="store_true", help="run again the done "
                   "runs made with other code than HEAD's (their files are kept in "
                   "<results>/older-code/<commit>/), so that every figure describes the "
                   "committed code")
    p.add_argument("--report", action="store_true", help="write the pages from the results "
                   "(after running the experiments named, if any)")
    p.add_argument("--pages", nargs="+", metavar="EXPERIMENT", help="with --report, write "
                   "only these experiments' pages, and not README.md (whose claims need "
                   "every experiment's runs)")
    p.add_argument("--quick", action="store_true", help="tiny budgets (a few dozen steps per "
                   "worker, fewer workers and seeds), to test the harness end to end")
    p.add_argument("--dataset", choices=ex.DATASETS, default=ex.DATASETS[0],
                   help="the paper's data (mnist, the default) or the earlier set's "
                   "(fashion-mnist)")
    p.add_argument("--results", type=Path, help="where runs write (default results/DATASET/, "
                   "results/quick/DATASET/ with --quick)")
    p.add_argument("--out", type=Path, help="where --report writes (default docs/results/ for "
                   "mnist, docs/results/fashion-mnist/ for fashion-mnist; <results>/report/ "
                   "with --quick)")
    p.add_argument("--lock", type=Path, help="hold an exclusive flock on this file while each "
                   "job runs (e.g. /tmp/heavy.lock), so that other heavy work waits its turn")
    p.add_argument("--heartbeat", type=float, default=60.0, help="seconds between progress "
                   "lines while a job runs")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    budget = (ex.quick_budget if args.quick else ex.full_budget)(args.dataset)
    results = args.results or Path("results/quick" if args.quick else "results") / args.dataset
    docs = runner.REPO / "docs" / "results"
    out = args.out or (results / "report" if args.quick else
                       docs if args.dataset == ex.DATASETS[0] else docs / args.dataset)
    exps = ex.experiments(budget, str(results))
    names = [e.upper() for e in args.experiments]
    if names == ["ALL"] or (args.plan and not names):
        names = list(exps)
    unknown = [e for e in names if e not in exps]
    if unknown:
        parser.error(f"unknown experiment(s) {', '.join(unknown)}: choose from "
                     f"{', '.join(exps)} or all")
    pages = [e.upper() for e in args.pages or []]
    if [e for e in pages if e not in exps]:
        bad = ", ".join(e for e in pages if e not in exps)
        parser.error(f"--pages: unknown experiment(s) {bad}")
    if pages and not args.report:
        parser.error("--pages needs --report")
    if not names and not args.report:
        parser.error("name the experiments to run (E1 … E11 or all), or pass --plan or "
                     "--report")
    runs = ex.select(exps, names)
    if args.seeds is not None:
        unknown_seeds = sorted(set(args.seeds) - set(budget.seeds))
        if unknown_seeds:
            parser.error(f"no run has seed {', '.join(map(str, unknown_seeds))}: the "
                         f"{budget.name} budget's seeds are "
                         f"{', '.join(map(str, budget.seeds))}")
        # a kept run's tuning runs stay (their seed is none of the budget's: E10's, E11's)
        tuning = {name for r in runs if r.seed in args.seeds for name, _ in r.tuned_by}
        runs = [r for r in runs if r.seed in args.seeds or r.name in tuning]
    if args.ns is not None:
        unknown_ns = sorted(set(args.ns) - {r.n for r in runs})
        if unknown_ns:
            parser.error(f"no run of {', '.join(names) or 'these experiments'} has n = "
                         f"{', '.join(map(str, unknown_ns))}")
        runs = [r for r in runs if r.n in args.ns]
    older: dict[str, str] = {}
    if args.rerun_older_code:
        found = runner.older_code(runs, results)
        if found is None:
            parser.error("--rerun-older-code: git cannot tell which code the runs ran (is "
                         f"{runner.REPO} a git checkout that holds their commits?)")
        older = found
    if args.plan:
        print(runner.plan_text(runs, results, budget.log_every, older))
        return 0
    if older:
        print(f"reproduce: {len(older)} done run(s) ran older code than HEAD's: each is set "
              f"aside into {results / runner.OLDER_CODE}/<commit>/ when its job starts, and "
              "run again", flush=True)
    rc = 0
    if runs:
        rc = runner.Harness(results, budget, args.lock, heartbeat_s=args.heartbeat,
                            older=older).run(runs)
    if args.report and rc != runner.EXIT_STOPPED:
        res = Results(results, exps, budget)
        written = report.write_pages(res, budget, out, pages or None)
        if pages:
            print(f"reproduce: wrote {', '.join(map(str, written))}", flush=True)
        else:
            readme = claims.write_readme(res, budget, out)
            print(f"reproduce: wrote {readme} and {len(written)} pages in {out}", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
