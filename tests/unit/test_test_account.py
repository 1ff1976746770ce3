"""tools/test_account.py: the suite's process accounting summed by file and by test
(tests/accounting/sitecustomize.py writes the rows; a real run: tools/test.sh with
GEM_MPI_TEST_ACCOUNT set)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "tools" / "test_account.py"
_spec = importlib.util.spec_from_file_location("test_account", TOOL)
assert _spec is not None and _spec.loader is not None
account = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(account)

ROWS = [
    {"test": "tests/test_a.py::test_one", "argv": ["train.py"], "torch": True, "rank": "0",
     "cpu_s": 3.0, "wall_s": 4.0},
    {"test": "tests/test_a.py::test_one", "argv": ["train.py"], "torch": True, "rank": "1",
     "cpu_s": 2.5, "wall_s": 4.0},
    {"test": "tests/test_b.py::test_two[x]", "argv": ["train.py"], "torch": False, "rank": "0",
     "cpu_s": 0.4, "wall_s": 1.0},
    {"test": "", "argv": ["pytest"], "torch": True, "rank": None, "cpu_s": 10.0, "wall_s": 60.0},
]


def test_rows_are_summed_by_file_and_by_test_the_most_cpu_first(tmp_path, capsys):
    path = tmp_path / "account.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS) + '{"test": "cut sh',
                    encoding="utf-8")  # a last line cut short is skipped
    by_file = account.totals(account.load(path), "file")
    assert [name for name, _ in by_file] == ["(pytest)", "tests/test_a.py", "tests/test_b.py"]
    a = dict(by_file)["tests/test_a.py"]
    assert (a["processes"], a["torch"], a["cpu_s"], a["torch_cpu_s"]) == (2, 2, 5.5, 5.5)
    assert account.main([str(path), "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("4 processes, 16 CPU s; 3 imported torch, 16 CPU s (97%)")
    assert "tests/test_b.py::test_two[x]" not in out.split("tests of most CPU:")[1]
