"""Run a command and report the peak memory of its whole process tree.

    python tools/memwatch.py [--json OUT] -- mpirun -n 101 python -m gem_mpi.train ...

Samples every second: the sum of PSS (proportional set size: shared pages split between
their users, so the sum is the tree's real footprint) and of private memory over every
descendant, the largest single process, and the machine's used memory (MemTotal −
MemAvailable) above what it was at the start. Exits with the command's exit code.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        tree.setdefault(ppid, []).append(int(entry))
    return tree


def _tree(root: int) -> list[int]:
    tree, out, todo = _children(), [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(tree.get(pid, []))
    return out


def _rollup(pid: int) -> tuple[int, int, str]:
    """(PSS kB, private kB, command name) of one process; zeros if it is gone."""
    pss = private = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key == "Pss":
                    pss = int(rest.split()[0])
                elif key in ("Private_Clean", "Private_Dirty"):
                    private += int(rest.split()[0])
        with open(f"/proc/{pid}/comm") as f:
            name = f.read().strip()
    except OSError:
        return 0, 0, ""
    return pss, private, name


def _used_kb() -> int:
    info = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            info[key] = int(rest.split()[0])
    return info["MemTotal"] - info["MemAvailable"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="also write the figures to this JSON file")
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given")
    base = _used_kb()
    t0 = time.monotonic()
    proc = subprocess.Popen(command)
    peak = {"pss_kb": 0, "private_kb": 0, "used_kb": 0, "ranks": 0, "max_rank_pss_kb": 0,
            "max_rank_private_kb": 0}
    while proc.poll() is None:
        rows = [_rollup(pid) for pid in _tree(proc.pid)]
        python = [r for r in rows if r[2].startswith("python")]
        peak["pss_kb"] = max(peak["pss_kb"], sum(r[0] for r in rows))
        peak["private_kb"] = max(peak["private_kb"], sum(r[1] for r in rows))
        peak["used_kb"] = max(peak["used_kb"], _used_kb() - base)
        peak["ranks"] = max(peak["ranks"], len(python))
        if python:
            peak["max_rank_pss_kb"] = max(peak["max_rank_pss_kb"], max(r[0] for r in python))
            peak["max_rank_private_kb"] = max(peak["max_rank_private_kb"],
                                              max(r[1] for r in python))
        time.sleep(args.interval)
    wall = time.monotonic() - t0
    mb = 1024.0
    report = {
        "exit_code": proc.returncode,
        "wall_s": round(wall, 1),
        "ranks": peak["ranks"],
        "peak_tree_pss_mb": round(peak["pss_kb"] / mb),
        "peak_tree_private_mb": round(peak["private_kb"] / mb),
        "peak_machine_used_mb": round(peak["used_kb"] / mb),
        "mean_rank_pss_mb": round(peak["pss_kb"] / mb / max(peak["ranks"], 1)),
        "max_rank_pss_mb": round(peak["max_rank_pss_kb"] / mb),
        "max_rank_private_mb": round(peak["max_rank_private_kb"] / mb),
    }
    print("memwatch: " + ", ".join(f"{k} {v}" for k, v in report.items()), file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
