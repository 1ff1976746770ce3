"""The benchmark commands run and report what they say (no timing threshold: these
machines are shared and noisy; the figures are for people, the structure is for tests)."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import REPO, mpi_env, mpirun


def test_bench_kernel_reports_ratios_to_numpy_and_triad(tmp_path):
    out = tmp_path / "k.json"
    res = subprocess.run([sys.executable, "-m", "gem_mpi.bench", "kernel", "--sizes", "1000",
                          "20000", "--no-torch", "--json", str(out)], capture_output=True,
                         text=True, timeout=300, check=False, env=mpi_env(), cwd=REPO)
    assert res.returncode == 0, res.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["elements"] for r in rows] == [1000, 20000]
    assert "fused/triad" in res.stdout and "×numpy" in res.stdout


def test_bench_master_splits_the_masters_time(tmp_path):
    out = tmp_path / "m.json"
    res = mpirun(3, ["-m", "gem_mpi.bench", "master", "--sizes", "5000", "--updates", "200",
                     "--json", str(out)], timeout=300)
    assert res.returncode == 0, res.stderr
    [row] = json.loads(out.read_text())["rows"]
    assert row["workers"] == 2 and row["updates"] == 200
    assert row["ratio_to_bound"] > 0 and row["apply_ratio_to_bound"] > 0
    assert abs(sum(row["time_split"].values()) - 1.0) < 0.2  # wait+apply+metrics+mpi ≈ wall


def test_bench_transport_compares_get_put_with_memcpy(tmp_path):
    out = tmp_path / "t.json"
    res = mpirun(2, ["-m", "gem_mpi.bench", "transport", "--sizes", "10000", "--json",
                     str(out)], timeout=300)
    assert res.returncode == 0, res.stderr
    [row] = json.loads(out.read_text())["rows"]
    assert row["floats"] == 10000 and "Get/memcpy" in res.stdout
