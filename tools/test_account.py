"""Sum up tools/test.sh's process accounting (GEM_MPI_TEST_ACCOUNT=FILE): where the suite's
CPU goes, by test file and by test, and how much of it is processes that imported torch.

    GEM_MPI_TEST_ACCOUNT=/tmp/account.jsonl tools/test.sh
    python tools/test_account.py /tmp/account.jsonl --top 30
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def load(path: Path) -> list[dict]:
    """The rows, one per process; a line cut short by a full disk is skipped."""
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def totals(rows: list[dict], key: str) -> list[tuple[str, dict[str, float]]]:
    """Per ``key`` ("file" or "test"): processes, torch processes, CPU s, torch CPU s; the
    most CPU first. The pytest processes themselves count under "(pytest)"."""
    sums: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for r in rows:
        test = r["test"] or "(pytest)"
        name = test.split("::")[0] if key == "file" else test
        s = sums[name]
        s["processes"] += 1
        s["cpu_s"] += r["cpu_s"]
        if r["torch"]:
            s["torch"] += 1
            s["torch_cpu_s"] += r["cpu_s"]
    return sorted(sums.items(), key=lambda kv: -kv[1]["cpu_s"])


def _table(title: str, items: list[tuple[str, dict[str, float]]], top: int) -> str:
    lines = [title, f"{'CPU s':>8} {'procs':>6} {'torch':>6} {'torch CPU s':>11}  name"]
    for name, s in items[:top]:
        lines.append(f"{s['cpu_s']:8.1f} {int(s['processes']):6d} {int(s['torch']):6d} "
                     f"{s['torch_cpu_s']:11.1f}  {name}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("file", type=Path)
    parser.add_argument("--top", type=int, default=25, help="rows of the per-test table")
    args = parser.parse_args(argv)
    rows = load(args.file)
    cpu = sum(r["cpu_s"] for r in rows)
    torch_rows = [r for r in rows if r["torch"]]
    torch_cpu = sum(r["cpu_s"] for r in torch_rows)
    print(f"{len(rows)} processes, {cpu:.0f} CPU s; {len(torch_rows)} imported torch, "
          f"{torch_cpu:.0f} CPU s ({torch_cpu / max(cpu, 1e-9):.0%})")
    print(_table("by file:", totals(rows, "file"), 10**6))
    print(_table(f"the {args.top} tests of most CPU:", totals(rows, "test"), args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
