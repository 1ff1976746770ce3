"""tools/report.py, compare.py and watch.py on real runs: finished, killed, live, and not runs.

Every run here is a real ``mpirun`` job (the quadratic model for speed, one short
Fashion-MNIST GEM run), so the tools are checked against files the master really wrote.
The numbers the tools print are checked against the HDF5 data read directly with h5py.
"""

from __future__ import annotations

import csv
import math
import re
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
from helpers import REPO, kill_job, mpi_env, quadratic_args, train, train_background

from gem_mpi.outputs.analysis import smooth, weighted_row_median
from gem_mpi.outputs.runfile import RunFileError, RunFollower

TOOLS = REPO / "tools"
QUAD = quadratic_args()
REPORT_FIGURES = ["loss.png", "eval.png", "pi_median.png", "pi_heatmap.png", "staleness.png",
                  "energy.png", "throughput.png", "workers.png"]
GEM_ONLY = ["pi_median.png", "pi_heatmap.png", "energy.png"]


def tool(name: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOLS / name), *args], capture_output=True,
                          text=True, timeout=timeout, check=False, env=mpi_env(), cwd=str(REPO))


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from the IHDR chunk, after checking the PNG signature."""
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", f"{path.name} is not a PNG"
    assert head[12:16] == b"IHDR"
    return struct.unpack(">II", head[16:24])


def check_png(path: Path) -> None:
    assert path.is_file(), f"{path.name} missing"
    width, height = png_size(path)
    assert width >= 300 and height >= 200, (path.name, width, height)
    assert 5_000 < path.stat().st_size < 400_000, (path.name, path.stat().st_size)


def h5(path: Path) -> dict:
    """The raw file, read with h5py alone (not through gem_mpi), to check the tools."""
    with h5py.File(path, "r", libver="latest", swmr=True) as f:
        return {g: {k: f[g][k][()] for k in f[g]} for g in ("updates", "eval", "summary")}


def summary_table(text: str) -> dict[str, str]:
    """The key/value table at the top of summary.md."""
    head = text.split("\n## ")[0]
    return dict(re.findall(r"^\| ([^|]+?) \| (.*) \|$", head, re.MULTILINE))


def printed(value: float, decimals: int) -> object:
    """A value as the report prints it: half a unit of the last decimal, plus float slack
    (2.3125 prints as 2.312 under round-half-even)."""
    return pytest.approx(value, abs=0.5 * 10.0 ** -decimals + 1e-9)


def worker_table(text: str) -> dict[int, int]:
    part = text.split("## Per-worker updates")[1].split("\n## ")[0]
    rows = re.findall(r"^\| (\d+) \| (\d+) \|", part, re.MULTILINE)
    return {int(w): int(c) for w, c in rows}


def _quad(path: Path, ranks: int, method: str, *extra: str) -> Path:
    res = train(ranks, *QUAD, "--method", method, "--quadratic-dim", "2000", "--max-steps",
                "80", "--eval-every", "60", "--metrics", str(path), *extra, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Finished runs: GEM with 2 and 3 workers, DOWNPOUR and adaptive, Fashion-MNIST GEM."""
    d = tmp_path_factory.mktemp("runs")
    out = {
        "gem3": _quad(d / "gem3.h5", 4, "gem"),
        "gem2": _quad(d / "gem2.h5", 3, "gem"),
        "downpour3": _quad(d / "downpour3.h5", 4, "downpour"),
        "adaptive2": _quad(d / "adaptive2.h5", 3, "adaptive"),
    }
    fashion = d / "fashion.h5"
    res = train(5, "--max-steps", "60", "--eval-every", "100", "--metrics", str(fashion),
                timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    out["fashion"] = fashion
    return out


def _stop(proc: subprocess.Popen, grace: float = 0) -> str:
    """End a background mpirun and return its stderr: let it finish for ``grace`` seconds,
    then SIGTERM, then SIGKILL to its whole session."""
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.terminate()
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        kill_job(proc)
        _, err = proc.communicate(timeout=30)
    return err or ""


@pytest.fixture(scope="module")
def crashed(tmp_path_factory) -> Path:
    """A run killed half-way: SIGKILL to the whole job once the master has flushed some rows,
    so the master dies without writing its summary (and before any evaluation). (SIGTERM or
    SIGUSR1 would now stop it cleanly, with a summary that says unfinished.)"""
    path = tmp_path_factory.mktemp("crash") / "crashed.h5"
    proc = train_background(4, *QUAD, "--quadratic-dim", "20000", "--max-steps", "1000000",
                            "--eval-every", "0", "--metrics", str(path))
    rows, deadline = 0, time.monotonic() + 60
    try:
        while rows == 0 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
            try:
                with RunFollower(path) as fo:
                    rows = fo.n_updates()
            except RunFileError:
                pass  # not created yet, or SWMR not switched on yet
        ended_alone = proc.poll() is not None
        if not ended_alone:
            kill_job(proc)
    finally:
        err = _stop(proc)
    assert rows > 0 and not ended_alone, f"rows {rows}, ended alone {ended_alone}: {err}"
    assert proc.returncode != 0
    return path


# --- gem_mpi.outputs.analysis -----------------------------------------------------------------------

def test_weighted_median_and_smoothing():
    pi = np.array([[0.5, 2.0, 1.0], [0.5, np.nan, 1.0], [np.nan, np.nan, np.nan]])
    med = weighted_row_median(pi, np.array([1, 10, 1]))
    assert med[0] == 2.0 and med[1] == 0.5 and np.isnan(med[2])  # lower median, NaN skipped
    assert weighted_row_median(pi[:1], None)[0] == 1.0  # no sizes: equal weights
    y = np.array([1.0, np.nan, 3.0, 5.0])
    np.testing.assert_allclose(smooth(y, 2), [1.0, 1.0, 3.0, 4.0])
    np.testing.assert_allclose(smooth(np.full(500, 7.0)), 7.0)


# --- report.py ------------------------------------------------------------------------------

@pytest.mark.mpi
def test_report_fashion_gem_numbers_match_the_file(runs, tmp_path):
    res = tool("report.py", str(runs["fashion"]), "-o", str(tmp_path))
    assert res.returncode == 0, res.stderr
    for name in REPORT_FIGURES:
        check_png(tmp_path / name)
    text = (tmp_path / "summary.md").read_text()
    table, raw = summary_table(text), h5(runs["fashion"])
    u, s = raw["updates"], raw["summary"]
    assert s["finished"] == 1.0 and table["status"].startswith("finished")
    assert table["updates"] == str(len(u["worker"])) == str(int(s["updates"])) == "240"
    assert table["workers"] == "4" and table["method"] == "gem"
    mean_tau = float(re.match(r"mean ([\d.]+)", table["staleness"]).group(1))
    assert mean_tau == printed(u["staleness"].mean(), 3)
    assert "theory: n − 1 = 3" in table["staleness"]
    acc = float(re.match(r"([\d.]+) %", table["test accuracy"]).group(1))
    assert acc == printed(100 * s["test_accuracy"], 2)
    assert acc == printed(100 * raw["eval"]["test_accuracy"][-1], 2)
    assert float(table["wall time"].split()[0]) == printed(s["wall_s"], 2)
    ranks, counts = np.unique(u["worker"], return_counts=True)
    assert worker_table(text) == dict(zip(ranks.tolist(), counts.tolist()))
    final = float(table["final training loss"].split()[0])
    assert final == pytest.approx(u["loss"][-24:].mean(), rel=1e-3)  # last 10 % of 240
    assert "## Not plotted" not in text
    for name in REPORT_FIGURES:
        assert f"]({name})" in text


@pytest.mark.mpi
def test_report_downpour_skips_gem_figures_and_says_so(runs, tmp_path):
    # a stale GEM figure from an earlier report in the same folder must not survive
    (tmp_path / "energy.png").write_bytes(b"an old figure")
    res = tool("report.py", str(runs["downpour3"]), "-o", str(tmp_path))
    assert res.returncode == 0, res.stderr
    text = (tmp_path / "summary.md").read_text()
    for name in REPORT_FIGURES:
        if name in GEM_ONLY:
            assert not (tmp_path / name).exists()
            assert re.search(rf"^- `{name}`: .*method downpour records none \(GEM only\)",
                             text, re.MULTILINE), text
        else:
            check_png(tmp_path / name)
    assert "median π" not in summary_table(text)
    assert worker_table(text) == {1: 80, 2: 80, 3: 80}
    # the quadratic has no accuracy: said, not plotted
    assert summary_table(text)["test accuracy"].startswith("n/a")
    assert "test accuracy not plotted" in text


@pytest.mark.mpi
def test_report_without_staleness_columns(runs, tmp_path):
    """A run without staleness/ticket columns (what a synchronous baseline would write)."""
    path = tmp_path / "sync.h5"
    shutil.copy(runs["adaptive2"], path)
    with h5py.File(path, "r+") as f:
        for name in ("staleness", "ticket", "version_pulled", "queue"):
            del f["updates"][name]
    res = tool("report.py", str(path), "-o", str(tmp_path / "rep"))
    assert res.returncode == 0, res.stderr
    text = (tmp_path / "rep" / "summary.md").read_text()
    assert not (tmp_path / "rep" / "staleness.png").exists()
    assert "- `staleness.png`: no staleness column" in text
    assert "/updates has no ticket, version_pulled, staleness, queue column(s)" in text
    assert summary_table(text)["staleness"].startswith("n/a")
    for name in ("loss.png", "eval.png", "throughput.png", "workers.png"):
        check_png(tmp_path / "rep" / name)


@pytest.mark.mpi
def test_report_on_a_killed_run(crashed, tmp_path):
    res = tool("report.py", str(crashed), "-o", str(tmp_path))
    assert res.returncode == 0, res.stderr
    assert "UNFINISHED" in res.stdout
    raw = h5(crashed)
    assert math.isnan(raw["summary"]["finished"]) and len(raw["eval"]["clock"]) == 0
    text = (tmp_path / "summary.md").read_text()
    table = summary_table(text)
    assert table["status"].startswith("**unfinished**")
    assert table["updates"] == str(len(raw["updates"]["worker"]))
    assert f"covers the {len(raw['updates']['worker'])} updates and 0 evaluations" in \
        table["status"]
    assert table["test accuracy"] == "n/a (none: the run has no evaluation)"
    assert "- `eval.png`: no evaluation rows (the run ended before its first evaluation)" in text
    assert float(table["wall time"].split()[0]) == printed(
        raw["updates"]["time"][-1], 2)
    for name in ("loss.png", "pi_median.png", "staleness.png", "workers.png"):
        check_png(tmp_path / name)


@pytest.mark.mpi
def test_report_on_a_run_cut_short_after_evaluations(runs, tmp_path):
    """A finished file set up as a crash leaves it: summary NaN, rows and evaluations kept.
    The test numbers must then come from the last evaluation written."""
    path = tmp_path / "cut.h5"
    shutil.copy(runs["gem3"], path)
    with h5py.File(path, "r+") as f:
        for name in f["summary"]:
            f["summary"][name][()] = np.nan
    res = tool("report.py", str(path), "-o", str(tmp_path / "rep"))
    assert res.returncode == 0, res.stderr
    raw = h5(path)
    table = summary_table((tmp_path / "rep" / "summary.md").read_text())
    assert table["status"].startswith("**unfinished**")
    ev = raw["eval"]
    loss = float(table["test loss"].split()[0])
    assert loss == pytest.approx(ev["test_loss"][-1], rel=1e-3)
    assert f"at clock {int(ev['clock'][-1])}; the run did not finish" in table["test loss"]
    check_png(tmp_path / "rep" / "eval.png")


@pytest.mark.mpi
@pytest.mark.parametrize("name", ["report.py", "compare.py", "watch.py"])
def test_not_a_run_is_one_line_and_exit_2(name, tmp_path):
    text = tmp_path / "notes.h5"
    text.write_text("not HDF5\n")
    plain = tmp_path / "plain.h5"
    with h5py.File(plain, "w") as f:
        f["x"] = [1, 2, 3]
    cases = [(tmp_path / "missing.h5", "no such file"), (text, "not an HDF5 file"),
             (plain, "not a gem_mpi run (no gem_mpi_schema attribute)")]
    for path, message in cases:
        res = tool(name, str(path), "-o", str(tmp_path / "out")) if name != "watch.py" else \
            tool(name, str(path))
        assert res.returncode == 2, (path, res.stdout, res.stderr)
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"{name}: error: "), res.stderr
        assert message in lines[0] and "Traceback" not in res.stderr
    assert not (tmp_path / "out").exists()  # nothing written for a bad input


@pytest.mark.mpi
@pytest.mark.parametrize("name", ["report.py", "compare.py", "watch.py"])
def test_help(name):
    res = tool(name, "--help")
    assert res.returncode == 0 and "usage: python tools/" + name in res.stdout


# --- compare.py -----------------------------------------------------------------------------

@pytest.mark.mpi
def test_compare_table_and_figures(runs, crashed, tmp_path):
    paths = [runs[k] for k in ("gem3", "gem2", "downpour3", "adaptive2")] + [crashed]
    res = tool("compare.py", *map(str, paths), "-o", str(tmp_path))
    assert res.returncode == 0, res.stderr
    for name in ("loss_steps.png", "loss_time.png", "final_loss.png"):
        check_png(tmp_path / name)
    with (tmp_path / "compare.csv").open() as f:
        rows = {r["run"]: r for r in csv.DictReader(f)}
    assert set(rows) == {p.stem for p in paths}
    for path in paths:
        row, raw = rows[path.stem], h5(path)
        u, s = raw["updates"], raw["summary"]
        n = len(u["worker"])
        assert int(row["updates"]) == n
        k = max(1, round(0.1 * n))
        assert float(row["final_train_loss"]) == pytest.approx(u["loss"][-k:].mean(), rel=1e-4)
        wall = s["wall_s"] if s["finished"] == 1.0 else u["time"][-1]
        assert float(row["wall_s"]) == pytest.approx(wall, rel=1e-4)
        assert float(row["updates_per_s"]) == pytest.approx(n / wall, rel=1e-4)
        if s["finished"] == 1.0:
            assert row["status"] == "finished"
            assert float(row["test_loss"]) == pytest.approx(s["test_loss"], rel=1e-4)
        else:
            assert row["status"] == "unfinished" and row["test_loss"] == ""
        assert row["test_accuracy"] == ""  # the quadratic model classifies nothing
    assert (rows["gem3"]["method"], rows["gem3"]["workers"]) == ("gem", "3")
    md = (tmp_path / "compare.md").read_text()
    assert "| `crashed` | gem | 3 | quadratic/synthetic | **unfinished** |" in md
    assert "![final_loss.png](final_loss.png)" in md


@pytest.mark.mpi
def test_compare_fails_whole_on_one_bad_file(runs, tmp_path):
    res = tool("compare.py", str(runs["gem3"]), str(tmp_path / "nope.h5"), "-o",
               str(tmp_path / "out"))
    assert res.returncode == 2 and "nope.h5: no such file" in res.stderr
    assert not (tmp_path / "out").exists()


# --- watch.py -------------------------------------------------------------------------------

@pytest.mark.mpi
def test_watch_follows_a_live_run_to_its_end(tmp_path):
    path = tmp_path / "live.h5"
    proc = train_background(4, *QUAD, "--quadratic-dim", "300000", "--max-steps", "300",
                            "--eval-every", "100", "--metrics", str(path))
    try:
        res = tool("watch.py", str(path), "--wait", "60", "--interval", "0.5", "--timeout",
                   "60", timeout=180)
        err = _stop(proc, grace=60)  # the ranks still shut down after the summary is out
    finally:
        if proc.poll() is None:
            _stop(proc)
    assert proc.returncode == 0, err
    assert res.returncode == 0, res.stdout + res.stderr
    status = [ln for ln in res.stdout.splitlines() if re.match(r"t +[\d.]+ s \| \d+ updates",
                                                               ln)]
    assert status, res.stdout
    assert res.stdout.splitlines()[-1].startswith("watch.py: finished: 900 updates in ")
    # it watched while the run trained: it saw rows before the last one
    assert any(int(re.search(r"\| (\d+) updates", ln).group(1)) < 900 for ln in status), \
        res.stdout
    raw = h5(path)
    assert raw["summary"]["finished"] == 1.0 and len(raw["updates"]["worker"]) == 900


@pytest.mark.mpi
def test_watch_gives_up_on_a_run_that_stopped(crashed):
    res = tool("watch.py", str(crashed), "--interval", "0.2", "--timeout", "1")
    assert res.returncode == 1
    assert "no new rows for" in res.stderr and "crashed, was killed or hangs" in res.stderr
    assert "Traceback" not in res.stderr
    assert re.search(r"\| \d+ updates", res.stdout)
