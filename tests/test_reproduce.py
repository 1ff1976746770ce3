"""``python -m gem_mpi.reproduce`` end to end at the quick budget: every experiment as real
mpirun jobs, the report with its claims table, the skip of finished runs, the plan; and, with
a stand-in for mpirun, that a signal stops the running job with a checkpoint (SIGUSR1) and
that the next invocation resumes it."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import REPO, mpi_env

from gem_mpi.reproduce import experiments as ex
from gem_mpi.reproduce import runner
from gem_mpi.reproduce.report import _same_code

pytestmark = pytest.mark.mpi  # every test here launches mpirun or another process

# E11 (the language model, 30 jobs, about 7 minutes at the quick budget) is not run here
EXPERIMENTS = [f"E{i}" for i in range(1, 11)]
QUICK_RUNS = len(ex.select(ex.experiments(ex.quick_budget(), "r"), EXPERIMENTS))


def reproduce(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gem_mpi.reproduce", *args],
                          capture_output=True, text=True, timeout=timeout, check=False,
                          env=mpi_env(), cwd=REPO)


@pytest.fixture(scope="module")
def quick(tmp_path_factory) -> Path:
    """Every experiment at the quick budget, once for the module (about 4.5 minutes)."""
    results = tmp_path_factory.mktemp("reproduce") / "results"
    res = reproduce("--quick", *EXPERIMENTS, "--results", str(results))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert f"all {QUICK_RUNS} runs done" in res.stdout
    return results


def test_quick_runs_write_metrics_and_records(quick):
    records = sorted(quick.glob("*.json"))
    records = [p for p in records if not p.name.endswith(".mem.json")]
    assert len(records) == QUICK_RUNS
    for path in records:
        rec = json.loads(path.read_text())
        assert rec["status"] == "finished", rec
        [segment] = rec["segments"]
        assert segment["exit_code"] == 0 and segment["wall_s"] > 0
        assert "gem_mpi.train" in rec["command"] and f"--metrics {quick}" in rec["command"]
        assert re.fullmatch(r"[0-9a-f]{40}|unknown", rec["git_commit"]) and rec["machine"]
        assert (quick / f"{rec['name']}.h5").is_file()
        assert not (quick / f"{rec['name']}.ckpt").exists()  # done: checkpoints removed
    e1 = json.loads((quick / "e1-gem-paper-n002-s0.json").read_text())["command"]
    assert "--gem-shift paper" in e1
    e9 = json.loads((quick / "e9-global-lr0.1-n002-s0.json").read_text())["command"]
    assert "--gem-proxy global" in e9 and "--lr 0.1" in e9
    # E10: DDP and DiLoCo run every rank as a worker; the same budget and straggler for all
    # each at the η its tuning runs chose (quick: of 0.05 and 0.1, on the held-out images)
    for method, ranks in (("gem", 3), ("ddp", 2), ("diloco", 2)):
        rec = json.loads((quick / f"e10-{method}-straggler-tuned-n002-s0.json").read_text())
        assert rec["ranks"] == ranks and f"mpirun -n {ranks} " in rec["command"], rec
        assert f"--method {method} " in rec["command"] and "--max-steps 20" in rec["command"]
        assert "--straggler 2:5" in rec["command"] and "--holdout" not in rec["command"]
        assert re.search(r"--lr (0\.05|0\.1) ", rec["command"]), rec["command"]
        tune = json.loads((quick / f"e10-tune-{method}-lr0.1-n002-s100.json").read_text())
        assert "--holdout 10000" in tune["command"] and "--lr 0.1 " in tune["command"]
        assert "--straggler" not in tune["command"]
    e10 = json.loads((quick / "e10-diloco-even-tuned-n002-s0.json").read_text())["command"]
    assert "--diloco-steps 20" in e10 and "--straggler" not in e10
    e8 = json.loads((quick / "e8-gem-n002-s0.json").read_text())
    assert e8["memory"]["peak_tree_pss_mb"] > 0  # measured by tools/memwatch.py
    assert (quick / "imagenet_synth" / "train").is_dir()


def test_report_pages_figures_and_claims(quick, tmp_path):
    out = tmp_path / "report"
    res = reproduce("--quick", "--report", "--results", str(quick), "--out", str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    for e in EXPERIMENTS:
        page = (out / f"{e}.md").read_text()
        assert (out / f"{e}.png").stat().st_size > 1000, e
        assert "![" in page and "Not run yet" not in page, e
        if e != "E3":  # it shows E1's runs
            assert re.search(r"`[0-9a-f]{64}`", page), e  # sha256 of each HDF5 file
            assert "mpirun -n" in page and "gem_mpi.train" in page, e
    # E8 draws GEM beside its proxy with the same setting, to tell GEM's failure from the setting's
    assert "| e8-msgd-n001-s0 | 0.05 | finished |" in (out / "E8.md").read_text()
    assert "| share of π clamped to 0 or π_max |" in (out / "E3.md").read_text()
    e3 = (out / "E3.md").read_text()
    assert "| Δθ = 0 (in the clamped share) |" in e3
    # staleness as it was: τ's histogram, the workers' spread, π against τ and at the end
    assert "## Staleness, and π at the end of a run" in e3 and "| 95th percentile of τ |" in e3
    assert re.search(r"In \d of 2 runs the median π of the last 5% of updates", e3)
    assert (out / "E3_staleness.png").stat().st_size > 1000
    # E5: its own runs, trained on 50 000 and validated on the 10 000 held out
    e5 = (out / "E5.md").read_text()
    assert "--holdout 10000" in e5 and "| GEM | 1 of 1 |" in e5 and "| momentum SGD | 1 of 1 |" in e5
    # E9 shows its global-proxy runs beside E1's and E6's local-proxy (gem-others) runs
    e9 = (out / "E9.md").read_text()
    for row in ("| 0.05 (E1) | 3 | global | 1/1 |", "| 0.05 (E1) | 3 | local | 1/1 |",
                "| 0.1 (E6) | 2 | global | 1/1 |", "| 0.1 (E6) | 2 | local | 1/1 |"):
        assert row in e9, row
    # E10: GEM against DDP and DiLoCo per cell, by the rule fixed before the runs
    e10 = (out / "E10.md").read_text()
    for case in ("no straggler", "worker 2, 5× slower"):
        for method in ("GEM", "DDP", "DiLoCo"):
            assert re.search(rf"\| 2 \| {case} \| {method} \| (0\.05|0\.1) \| 1/1 \| "
                             r"0/1 \|", e10), (case, method)
        for rival in ("DDP", "DiLoCo"):
            assert re.search(rf"- n = 2, {case}, against {rival}: \*\*(GEM wins|GEM loses|"
                             r"mixed|even)\*\*\. time to 95 %: GEM ", e10), (case, rival)
    assert "fixed in `gem_mpi/reproduce/experiments.py`" in e10
    tuned = e10.split("## The η each method's tuning chose")[1].split("## Verdicts")[0]
    for method in ("GEM", "DDP", "DiLoCo"):  # both η's validation losses, the lower chosen
        assert re.search(rf"\| 2 \| {method} \| \d\.\d{{4}} \| \d\.\d{{4}} \| "
                         r"\*\*(0\.05|0\.1)\*\* \|", tuned), (method, tuned)
    assert "--method ddp" in e10 and "--method diloco" in e10
    # --pages: only the pages named, and no README
    only = tmp_path / "only"
    res = reproduce("--quick", "--report", "--pages", "E10", "--results", str(quick),
                    "--out", str(only))
    assert res.returncode == 0, res.stderr[-3000:]
    assert sorted(p.name for p in only.iterdir()) == ["E10.md", "E10.png"]
    assert (only / "E10.md").read_text() == e10
    # the runs' commits are checked against HEAD: they describe the code users get (or, run
    # from a checkout with uncommitted changes, the page says that cannot be checked)
    assert ("were made with uncommitted changes" if runner.git_state()["dirty"] else
            "is the same at each of them as at") in (out / "E1.md").read_text()
    readme = (out / "README.md").read_text()
    assert "momentum SGD (1 rank, the same η, μ, b): loss" in readme
    claims = readme.split("## Claims")[1].split("## Deviations")[0]
    rows = [ln for ln in claims.splitlines() if ln.startswith("| ") and "claim of" not in ln]
    assert len(rows) == 14
    # E11 is not run here: its row says so, and every other row has its numbers
    e11 = [row for row in rows if "[E11](E11.md)" in row]
    assert len(e11) == 1 and "not run yet" in e11[0]
    rows = [row for row in rows if row not in e11]
    claims = "\n".join(rows)
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[5].strip("*") in ("yes", "partly", "no"), row
        assert re.search(r"\d\.\d", cells[4]), row  # real numbers, from the runs
        # the paper's own numbers beside them (E9's proposal has none)
        assert re.search(r"\d", cells[2]) or cells[2].startswith("none:"), row
    assert "not run yet" not in claims
    assert "the quick budget" in readme
    assert "| data | MNIST |" not in readme  # MNIST itself: no deviation
    assert "--dataset mnist" in (out / "E1.md").read_text()


def test_code_changed_since_tells_runs_of_older_code_apart():
    head, changed = runner.code_changed_since(["HEAD"])
    assert re.fullmatch(r"[0-9a-f]{12}", head) and changed == []
    root = subprocess.run(["git", "-C", str(REPO), "rev-list", "--max-parents=0", "HEAD"],
                          capture_output=True, text=True, check=True).stdout.split()[0]
    assert runner.code_changed_since([root, "HEAD"]) == (head, [root])
    assert "is the same at each of them as at" in _same_code({head})
    assert f"has changed since {root}" in _same_code({head, root})
    assert "cannot be checked" in _same_code({f"{head} (uncommitted changes)"})
    # a comment changed (b76e54a: engine/master.py's CHECK_S comment) is the same code; a
    # change of the pull's back-off (3bae3ad: transport/idioms.py) is not
    comment_only = ("4171816f93935f6c077b75264e3f51ec10b8e525",
                    "b76e54afb6d2595e22e8c55f8087201b06bae167")
    assert runner.code_changed_since([comment_only[0]], comment_only[1]) == (
        comment_only[1][:12], [])
    pull = ("f604dc8e8c512712d71269c9c629cd1d8df6de25", "3bae3ada2528d8a371afbea410564cbb54f33c24")
    assert runner.code_changed_since([pull[0]], pull[1]) == (pull[1][:12], [pull[0]])
    assert runner._python_code('"""doc"""\nx = 1  # one\n') == runner._python_code("x = 1\n")
    assert runner._python_code("x = 1\n") != runner._python_code("x = 2\n")


def test_second_invocation_skips_finished_runs(quick):
    before = {p.name: p.stat().st_mtime for p in quick.glob("*.h5")}
    t0 = time.monotonic()
    res = reproduce("--quick", *EXPERIMENTS, "--results", str(quick))
    assert res.returncode == 0, res.stderr[-3000:]
    assert time.monotonic() - t0 < 60
    assert f"{QUICK_RUNS} of {QUICK_RUNS} runs already done: skipped" in res.stdout
    assert {p.name: p.stat().st_mtime for p in quick.glob("*.h5")} == before


def test_plan_lists_every_run_with_command_and_estimate(quick):
    res = reproduce("--quick", "--plan", *EXPERIMENTS, "--results", str(quick))
    assert res.returncode == 0, res.stderr
    commands = [ln for ln in res.stdout.splitlines() if "gem_mpi.train" in ln]
    assert len(commands) == QUICK_RUNS
    assert all("mpirun -n" in c and "--resume auto" in c for c in commands)
    assert res.stdout.count(", finished") == QUICK_RUNS
    assert "estimated wall time" in res.stdout and "corrected by the finished runs" in res.stdout
    full = reproduce("--plan", "E1", "--results", str(quick.parent / "none"))
    assert full.returncode == 0 and "48 runs, 0 done, 48 to run: estimated wall time" in \
        full.stdout and "assumed rates" in full.stdout
    assert "--dataset mnist" in full.stdout and "--dataset fashion-mnist" not in full.stdout
    # the earlier set: the same grid on Fashion-MNIST, in results/fashion-mnist/ by default
    fashion = reproduce("--plan", "E1", "--dataset", "fashion-mnist")
    assert fashion.returncode == 0 and "48 runs" in fashion.stdout
    assert "--dataset fashion-mnist" in fashion.stdout
    assert "--metrics results/fashion-mnist/e1-" in fashion.stdout


def test_rerun_older_code_sets_aside_and_remakes_only_runs_of_other_code(quick, tmp_path):
    results = tmp_path / "results"
    shutil.copytree(quick, results)
    head = runner.git_state()["commit"]
    root = subprocess.run(["git", "-C", str(REPO), "rev-list", "--max-parents=0", "HEAD"],
                          capture_output=True, text=True, check=True).stdout.split()[0]
    e4 = [r.name for r in ex.select(ex.experiments(ex.quick_budget(), str(results)), ["E4"])]
    old = e4[0]
    for name in e4:  # HEAD's code, clean, except one run made at the first commit
        path = results / f"{name}.json"
        rec = json.loads(path.read_text())
        rec.update(git_commit=root if name == old else head, git_dirty=False)
        path.write_text(json.dumps(rec))
    before = {n: (results / f"{n}.h5").stat().st_mtime for n in e4}
    plan = reproduce("--quick", "--plan", "E4", "--rerun-older-code", "--results", str(results))
    assert plan.returncode == 0, plan.stderr
    assert plan.stdout.count("with older code") == 1 and f"{old}: " in plan.stdout
    assert f"{len(e4)} runs, {len(e4) - 1} done, 1 to run" in plan.stdout
    assert (results / f"{old}.h5").is_file()  # --plan moves nothing
    res = reproduce("--quick", "E4", "--rerun-older-code", "--results", str(results))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    kept = results / runner.OLDER_CODE / root[:12]
    assert "1 done run(s) ran older code than HEAD's" in res.stdout
    assert f"{old} ran older code ({root[:12]}): its files moved to {kept}; running it " \
        "again" in res.stdout
    assert json.loads((kept / f"{old}.json").read_text())["git_commit"] == root
    assert (kept / f"{old}.h5").is_file() and (kept / f"{old}.log").is_file()
    assert json.loads((results / f"{old}.json").read_text())["git_commit"] == head
    after = {n: (results / f"{n}.h5").stat().st_mtime for n in e4}
    assert after[old] != before[old]
    assert {n: t for n, t in after.items() if n != old} == \
        {n: t for n, t in before.items() if n != old}
    # the same run set aside again from the same commit never overwrites the first copy
    rec = json.loads((results / f"{old}.json").read_text())
    (results / f"{old}.json").write_text(json.dumps({**rec, "git_commit": root}))
    run = next(r for r in ex.experiments(ex.quick_budget(), str(results))["E4"].runs
               if r.name == old)
    second = runner.set_aside(results, run, root)
    assert second == kept.with_name(f"{root[:12]}.1") and (kept / f"{old}.h5").is_file()


def test_seeds_selects_one_seed_and_refuses_an_unknown_one(tmp_path):
    res = reproduce("--plan", "E1", "E6", "--seeds", "0", "--results", str(tmp_path))
    assert res.returncode == 0, res.stderr
    names = re.findall(r"^\[\d+/\d+\] (\S+):", res.stdout, re.MULTILINE)
    assert names and all(n.endswith("-s0") for n in names)
    assert names[0].startswith("e1-") and names[-1].startswith("e6-")
    assert f"{len(names)} runs, 0 done" in res.stdout and len(names) == (48 + 39) // 3
    bad = reproduce("--plan", "--seeds", "7", "--results", str(tmp_path))
    assert bad.returncode == 2 and "no run has seed 7" in bad.stderr


# A stand-in for the mpirun job: the first time it waits for SIGUSR1 and exits 3 (stopped
# with a checkpoint); the next time it "finishes" by copying a finished metrics file.
FAKE_JOB = """
import shutil, signal, sys, time
marker, source, metrics = sys.argv[1:]
signal.signal(signal.SIGUSR1, lambda *_: sys.exit(3))
try:
    open(marker, "x").close()
except FileExistsError:
    shutil.copy(source, metrics)
    sys.exit(0)
time.sleep(120)
sys.exit(1)
"""


def test_signal_stops_the_job_with_sigusr1_and_the_next_run_resumes(quick, tmp_path,
                                                                    monkeypatch):
    results = tmp_path / "results"
    run = ex.experiments(ex.quick_budget(), str(results))["E1"].runs[0]
    paths = runner.Paths.of(results, run)
    source = quick / f"{run.name}.h5"
    monkeypatch.setattr(runner, "command", lambda r, res, log_every: [
        sys.executable, "-c", FAKE_JOB, str(tmp_path / "marker"), str(source),
        str(paths.metrics)])
    harness = runner.Harness(results, ex.quick_budget(), say=lambda _: None)

    def interrupt() -> None:
        marker = tmp_path / "marker"
        while not marker.exists():  # made once the job has installed its SIGUSR1 handler
            time.sleep(0.05)  # (a fixed second was not always enough on loaded cores)
        os.kill(os.getpid(), signal.SIGINT)  # as Ctrl-C does

    threading.Thread(target=interrupt, daemon=True).start()
    assert harness.run([run]) == runner.EXIT_STOPPED
    rec = json.loads(paths.record.read_text())
    assert rec["status"] == "stopped" and rec["segments"][0]["exit_code"] == 3
    assert runner.status(results, run) == "stopped"
    harness = runner.Harness(results, ex.quick_budget(), say=lambda _: None)
    assert harness.run([run]) == 0
    rec = json.loads(paths.record.read_text())
    assert rec["status"] == "finished"
    assert [s["exit_code"] for s in rec["segments"]] == [3, 0]
    assert runner.status(results, run) == "finished"
    shutil.rmtree(results)
