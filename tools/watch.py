"""Follow a gem_mpi run while it trains, from another process or another node.

    python tools/watch.py RUN.h5 [--interval 5] [--timeout 300] [--wait 0]

The master writes its metrics file single-writer/multiple-reader (HDF5 SWMR), so this
reads it while it grows without disturbing the run. Every --interval seconds it prints one
line: updates so far and the rate at the master, the recent worker loss and staleness
(and median π for GEM), the last evaluation. It exits 0 when the run has finished
(summary/finished == 1), 1 with a message when no row has been added for --timeout seconds
while the run is unfinished (crashed, killed or hung), and 2 on a path that is missing, not
HDF5 or not a gem_mpi run (with --wait S it first waits up to S seconds for the file to
appear, for a watch started together with the run).
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import numpy as np

from gem_mpi.outputs import analysis as an
from gem_mpi.outputs import runfile

PROG = "watch.py"
WINDOW = 200  # rows the loss/staleness/π figures of a line are taken over, at least
MAX_READ = 5000  # rows read per line at most, however fast the run goes


def _open(path: str, wait: float, interval: float) -> runfile.RunFollower:
    """Open the run, retrying for up to ``wait`` seconds (the file may not exist yet, or
    its writer may not have switched SWMR on yet)."""
    deadline = time.monotonic() + wait
    while True:
        try:
            return runfile.RunFollower(path)
        except runfile.RunFileError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(min(1.0, interval))


def status_line(fo: runfile.RunFollower, prev_rows: int, prev_time: float) -> tuple[str, float]:
    """One compact line about the rows since the previous one; returns it and the master
    time of the last row."""
    n = fo.n_updates()
    # the rows since the previous line, at least the last WINDOW, at most MAX_READ
    start = max(0, n - WINDOW if prev_rows < 0 else min(prev_rows, n - WINDOW), n - MAX_READ)
    cols = fo.updates(start, ["time", "loss", "staleness", "worker", "pi_median"])
    t = cols.get("time")
    now = float(t[-1]) if t is not None and t.size else math.nan
    parts = [f"t {now:7.1f} s" if math.isfinite(now) else "t       - s",
             f"{n} updates" if n else "0 updates (none flushed yet)"]
    new = n - prev_rows
    if prev_rows >= 0 and math.isfinite(now) and now > prev_time:
        parts[-1] += f" (+{new}, {new / (now - prev_time):.1f}/s)"
    elif math.isfinite(now) and now > 0:
        parts[-1] += f" ({n / now:.1f}/s)"
    if n:
        loss = cols.get("loss")
        if loss is not None and loss.size:
            parts.append(f"loss {np.nanmean(loss.astype(np.float64)):.4g}")
        tau = cols.get("staleness")
        if tau is not None and tau.size:
            parts.append(f"staleness {tau.mean():.2f} (n-1 = {fo.n_workers - 1})")
        pi = cols.get("pi_median")
        if pi is not None and pi.size:
            med = np.nanmedian(an.weighted_row_median(pi, fo.tensor_sizes))
            parts.append(f"median π {med:.3g}")
        w = cols.get("worker")
        if w is not None and w.size and fo.n_workers:
            parts.append(f"workers {np.unique(w).size}/{fo.n_workers}")
    ev = fo.last_eval()
    if ev is not None:
        acc = ev.get("test_accuracy", math.nan)
        acc_text = f"acc {100 * acc:.2f} %, " if math.isfinite(acc) else ""
        parts.append(f"eval {acc_text}loss {ev.get('test_loss', math.nan):.4g} at "
                     f"{ev.get('clock', math.nan):.0f}")
    return " | ".join(parts), now


def follow(fo: runfile.RunFollower, interval: float, timeout: float) -> int:
    """Print a status line every interval until the run finishes or stops growing."""
    print(f"{PROG}: {fo.path}: {fo.label}, {fo.model}; a line every {interval:g} s until "
          "it finishes", flush=True)
    rows, evals, master_t = -1, -1, 0.0
    last_growth = time.monotonic()
    while True:
        fo.refresh()
        finished = fo.finished()
        n, e = fo.n_updates(), fo.n_evals()
        if (n, e) != (rows, evals):
            last_growth = time.monotonic()
        line, now = status_line(fo, rows, master_t)
        idle = time.monotonic() - last_growth
        print(line + (f" | no new rows for {idle:.1f} s" if idle >= interval else ""),
              flush=True)
        rows, evals, master_t = n, e, now if math.isfinite(now) else master_t
        if finished:
            s = fo.summary()
            acc = s.get("test_accuracy", math.nan)
            acc_text = f", test accuracy {100 * acc:.2f} %" if math.isfinite(acc) else ""
            wall = s.get("wall_s", math.nan)
            print(f"{PROG}: finished: {s.get('updates', math.nan):.0f} updates in {wall:.1f} s"
                  f" ({s.get('updates', math.nan) / wall:.1f}/s), test loss "
                  f"{s.get('test_loss', math.nan):.4g}{acc_text}", flush=True)
            return 0
        if idle > timeout:
            print(f"{PROG}: error: {fo.path}: no new rows for {idle:.0f} s (--timeout "
                  f"{timeout:g}) and summary/finished is not set: the run crashed, was "
                  f"killed or hangs ({n} updates written)", file=sys.stderr, flush=True)
            return 1
        time.sleep(interval)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python tools/watch.py",
        description="Follow a gem_mpi run's HDF5 metrics file while it trains (HDF5 SWMR: "
        "from another process or node), one status line every few seconds. Exit code 0 "
        "when the run finishes, 1 when the file stops growing for --timeout seconds "
        "before it finishes, 2 when the path is not a gem_mpi run.")
    p.add_argument("run", metavar="RUN.h5", help="the metrics file the run writes")
    p.add_argument("--interval", type=float, default=5.0, help="seconds between lines")
    p.add_argument("--timeout", type=float, default=300.0, help="give up after this many "
                   "seconds without a new row in an unfinished run")
    p.add_argument("--wait", type=float, default=0.0, help="wait up to this many seconds "
                   "for the file to appear and become readable (0: fail at once)")
    return p


def main(argv: list[str]) -> int:
    """Follow one run; returns the exit code."""
    args = build_parser().parse_args(argv)
    if not (args.interval > 0 and args.timeout > 0 and args.wait >= 0):
        print(f"{PROG}: error: --interval and --timeout must be > 0, --wait >= 0",
              file=sys.stderr)
        return 2
    with _open(args.run, args.wait, args.interval) as fo:
        return follow(fo, args.interval, args.timeout)


if __name__ == "__main__":
    runfile.cli(PROG, main)
