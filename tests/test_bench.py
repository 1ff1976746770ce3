"""The benchmark commands run and report what they say (no timing threshold: these
machines are shared and noisy; the figures are for people, the structure is for tests)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from helpers import REPO, mpi_env, mpirun

from gem_mpi.bench import gpu
from gem_mpi.config import WORKER_MODES


@pytest.mark.mpi
def test_bench_kernel_reports_ratios_to_numpy_and_triad(tmp_path):
    from gem_mpi.bench import kernel as bench

    out = tmp_path / "k.json"
    res = subprocess.run([sys.executable, "-m", "gem_mpi.bench", "kernel", "--sizes", "1000",
                          "20000", "--no-torch", "--json", str(out)], capture_output=True,
                         text=True, timeout=300, check=False, env=mpi_env(), cwd=REPO)
    assert res.returncode == 0, res.stderr
    result = json.loads(out.read_text())
    rows = result["rows"]
    threads = result["threads"]
    assert threads == list(range(1, len(os.sched_getaffinity(0)) + 1))  # 1 to the cores
    assert [(r["elements"], r["threads"]) for r in rows] == [
        (n, t) for n in (1000, 20000) for t in threads]
    assert all(r["fused_vs_triad"] > 0 and r["speedup_vs_1_thread"] > 0 for r in rows)
    assert "fused/triad" in res.stdout and "×numpy" in res.stdout and "×1 thread" in res.stdout
    # the pool against spawned threads, side by side, for every thread count above 1
    assert [(r["elements"], r["threads"]) for r in result["dispatch"]] == [
        (n, t) for n in bench.DISPATCH_SIZES for t in threads if t > 1]
    assert all(r["pool_s"] > 0 and r["spawn_s"] > 0 for r in result["dispatch"])
    if len(threads) > 1:
        assert "the persistent pool against threads spawned per call" in res.stdout
    # every variant timed was first checked against the numpy reference, and the header says so
    [line] = [ln for ln in res.stdout.splitlines() if ln.startswith("validated before timing")]
    assert "gem_step_numpy" in line and "fused C++ (θ bit-identical" in line
    assert "at every thread count" in line
    assert "memcpy" in line and "triad" in line and "torch" not in line  # --no-torch
    assert "FAILED" not in line and "invalid" not in res.stdout
    assert "timings are cache-warm" in res.stdout


def test_bench_kernel_refuses_to_time_a_torch_step_that_differs_from_the_reference(
        monkeypatch, capsys):
    pytest.importorskip("torch")
    from gem_mpi.bench import kernel as bench

    right = bench._torch_gem

    def off_by_a_little(*args):  # θ moved by 1e-3 Δθ more than the rule says
        step = right(*args)

        def wrong(theta, delta, a, s):
            out = step(theta, delta, a, s)
            theta.add_(delta * 1e-3)
            return out

        return wrong

    result = bench.bench_kernel([2000], [1], with_torch=True)  # the real one first: within
    assert result["failed"] == [] and result["rows"][0]["torch_max_abs_diff"] <= 1e-6
    assert "speedup_vs_torch" in result["rows"][0]
    monkeypatch.setattr(bench, "_torch_gem", off_by_a_little)
    result = bench.bench_kernel([2000], [1], with_torch=True)
    [row] = result["rows"]
    assert result["failed"] == ["torch"] and "torch_s" not in row
    assert row["torch_max_abs_diff"] > 1e-6
    bench.print_kernel(result)
    out = capsys.readouterr().out
    assert "FAILED, not timed: torch" in out
    assert out.splitlines()[4].split()[8] == "invalid"  # the ×torch column of the one row
    assert ("torch at 2000 elements on 1 thread(s): invalid, not timed: θ differs from the "
            "reference") in out


@pytest.mark.mpi
def test_bench_master_splits_the_masters_time(tmp_path):
    out = tmp_path / "m.json"
    res = mpirun(3, ["-m", "gem_mpi.bench", "master", "--sizes", "5000", "--updates", "200",
                     "--worker-step-ms", "50", "--json", str(out)], timeout=300)
    assert res.returncode == 0, res.stderr
    [row] = json.loads(out.read_text())["rows"]
    # workers of 50 ms a step ask 20 upd/s each: the master's rate over that
    assert row["workers_served"] == pytest.approx(row["updates_per_s"] * 0.05)
    assert row["workers_served_by_kernel"] == pytest.approx(50 / row["apply_ms"])
    assert "workers taking 50 ms a step ask 20.0 upd/s each" in res.stdout
    assert row["workers"] == 2 and row["updates"] == 200
    assert row["ratio_to_bound"] > 0 and row["apply_ratio_to_bound"] > 0
    assert abs(sum(row["time_split"].values()) - 1.0) < 0.2  # wait+apply+metrics+mpi ≈ wall


@pytest.mark.mpi
def test_bench_master_puts_k_masters_side_by_side(tmp_path):
    """--masters 1 2: a row each, with the same workers; every update applied by every
    shard, and the busiest master streams half the bytes with θ cut in two."""
    out = tmp_path / "m.json"
    res = mpirun(4, ["-m", "gem_mpi.bench", "master", "--sizes", "5000", "--updates", "200",
                     "--masters", "1", "2", "--json", str(out)], timeout=300)
    assert res.returncode == 0, res.stderr
    one, two = json.loads(out.read_text())["rows"]
    assert (one["masters"], two["masters"]) == (1, 2)
    assert one["workers"] == two["workers"] == 2
    assert one["updates"] == two["updates"] == 200
    assert two["bytes_per_master"] * 2 == one["bytes_per_master"]
    assert "bytes/master" in res.stdout


@pytest.mark.mpi
def test_bench_transport_compares_get_put_with_memcpy(tmp_path):
    out = tmp_path / "t.json"
    res = mpirun(2, ["-m", "gem_mpi.bench", "transport", "--sizes", "10000", "--json",
                     str(out)], timeout=300)
    assert res.returncode == 0, res.stderr
    [row] = json.loads(out.read_text())["rows"]
    assert row["floats"] == 10000 and "Get/memcpy" in res.stdout


@pytest.mark.mpi
def test_bench_overhead_measures_the_ceiling_and_splits_every_rank_s_time(tmp_path):
    """Real runs: the ceiling processes, then GEM with 2 workers and 1 or 2 masters; each
    worker's timers and the master's must account for (nearly) all of their wall time, the
    rest shown as 'other'."""
    out = tmp_path / "o.json"
    res = subprocess.run([sys.executable, "-m", "gem_mpi.bench", "overhead", "--workers", "2",
                          "--methods", "gem", "--steps", "40", "--ceiling-steps", "20",
                          "--worker-modes", "pipelined", "--masters", "1", "2",
                          "--json", str(out)], capture_output=True, text=True, timeout=300,
                         env=mpi_env(), cwd=REPO, check=False)
    assert res.returncode == 0, res.stderr
    result = json.loads(out.read_text())
    assert result["ceiling_steps_per_s"] > 0 and len(result["ceiling_each"]) >= 1
    # the ceilings bracket every run: one point before the first, one after each
    points = result["ceilings"]
    assert len(points) == 3 and all(p["total"] > 0 and p["shared"] > 0 for p in points)
    rows = result["rows"]
    # a row per number of masters (--repeat's medians: tests/unit/test_bench_cli.py)
    assert [(r["mode"], r["masters"], r["repeat"]) for r in rows] == [
        ("pipelined", 1, 1), ("pipelined", 2, 1)]
    for i, row in enumerate(rows):
        assert row["method"] == "gem" and row["workers"] == 2 and row["updates"] == 80
        assert row["via"] == 1 and "via 1: mpirun" in res.stdout
        assert row["ratio"] > 0 and row["shared_ceiling"] > 0 and row["ratio_shared"] > 0
        # against the mean of the two points around it
        assert row["shared_ceiling"] == pytest.approx((points[i]["shared"] +
                                                      points[i + 1]["shared"]) / 2)
        assert row["drift"] == pytest.approx(points[i + 1]["shared"] / points[i]["shared"])
        assert row["compute_vs_plain"] > 0
        w, m = row["worker_split"], row["master_split"]
        assert w["compute"] > 0 and m["apply"] > 0
        assert all(v >= 0 for k, v in w.items() if k != "other")
        assert abs(w["other"]) < 0.25 and abs(m["other"]) < 0.25  # the timers cover the wall
        # the master's CPU: some, and no more than its threads could take over its wall time
        assert 0 < row["master_cpu"] <= len(os.sched_getaffinity(0)) + 0.05
    assert "ceiling:" in res.stdout and "m:cpu" in res.stdout and "w:compute" in res.stdout
    assert "vs shared" in res.stdout and "c/plain" in res.stdout
    # the table's row of 2 masters: method, mode, masters, loaders, workers, via, run
    assert re.search(r"^ +gem +pipelined +2 +0 +2 +1 +1 ", res.stdout, re.MULTILINE)
    assert "medians over" not in res.stdout  # one run per row: nothing to sum up
    assert "one worker's loop alone" not in res.stdout  # no loader processes asked for


@pytest.mark.mpi
def test_bench_overhead_sets_loader_processes_side_by_side(tmp_path):
    """--loader-workers 0 2: each run with either, and one worker's loop alone with either,
    its time split into waiting for batches and computing (a benchmark: no timing asserted)."""
    out = tmp_path / "o.json"
    res = subprocess.run([sys.executable, "-m", "gem_mpi.bench", "overhead", "--workers", "1",
                          "--methods", "gem", "--steps", "20", "--ceiling-steps", "10",
                          "--worker-modes", "wait", "--shared-max", "0", "--loader-workers",
                          "0", "2", "--json", str(out)], capture_output=True, text=True,
                         timeout=300, env=mpi_env(), cwd=REPO, check=False)
    assert res.returncode == 0, res.stderr
    result = json.loads(out.read_text())
    assert [(r["loaders"], r["updates"]) for r in result["rows"]] == [(0, 20), (2, 20)]
    split = result["loader_split"]
    assert [r["loaders"] for r in split] == [0, 2]
    assert all(r["load_ms"] > 0 and r["compute_ms"] > 0 and r["steps_per_s"] > 0
               for r in split)
    assert "one worker's loop alone, by --loader-workers" in res.stdout
    assert "2 loaders" in res.stdout and "DataLoader" not in res.stderr


@pytest.mark.mpi
def test_bench_lm_dry_run_trains_the_language_model_under_each_method(tmp_path):
    """The GPU check's language-model rows, on the CPU (--cpu, tiny sizes): GEM-AdamW,
    Gap-Aware-AdamW, delayed Nesterov with local steps (and --dylu, worker 2 twice as slow)
    and DDP-AdamW, each a real mpirun job at equal samples, each learning; tokens/s and
    losses against DDP's in the JSON."""
    out = tmp_path / "lm.json"
    res = subprocess.run([sys.executable, "-m", "gem_mpi.bench", "lm", "--cpu", "--workers",
                          "2", "--max-steps", "40", "--batch-size", "8", "--test-bytes", "4096",
                          "--lr", "0.005", "--speeds", "1,2", "--json", str(out)],
                         capture_output=True, text=True, timeout=400, check=False,
                         env=mpi_env(), cwd=REPO)
    assert res.returncode == 0, res.stdout + res.stderr
    result = json.loads(out.read_text())
    assert result["ok"] and [r["row"] for r in result["rows"]] == [
        "gem-adamw", "gap-aware-adamw", "dn-adamw", "dn-adamw-dylu", "ddp-adamw"]
    samples = {r["row"]: r["samples"] for r in result["rows"]}
    dylu = samples.pop("dn-adamw-dylu")  # its slower worker trains fewer of its parts
    assert len(set(samples.values())) == 1 and 0 < dylu <= samples["ddp-adamw"]  # equal samples
    assert all(r["tokens_per_s"] > 0 and r["gpu_busy"] is None for r in result["rows"])
    assert result["rows"][-1]["tokens_per_s_vs_ddp"] == 1.0
    assert "gem_mpi.bench lm: ok" in res.stdout and "speeds 1,2" in res.stdout
    bad = subprocess.run([sys.executable, "-m", "gem_mpi.bench", "lm", "--rows", "gem,ddp"],
                         capture_output=True, text=True, timeout=60, check=False, cwd=REPO)
    assert bad.returncode == 2 and "no row gem, ddp; the rows: gem-adamw" in bad.stderr


@pytest.mark.mpi
def test_bench_gpu_dry_run_checks_learning_theta_and_the_masters_kernel(tmp_path):
    """The GPU check's own path, on the CPU (--cpu; CI has no GPU): the plain loop at both
    precisions, calibration, the matrix (the overlap order of --modes, float32) and the best
    row (the same order in bf16, which the output compares with it) as real mpirun jobs of a user's model and dataset, the
    verdicts and images/s against the plain loop's in the JSON; MPS skipped with its reason,
    the floor not measured. (Every order trains in tests/test_training_loop.py.)"""
    out = tmp_path / "g.json"
    res = subprocess.run([sys.executable, "-m", "gem_mpi.bench", "gpu", "--cpu", "--workers",
                          "2", "--seconds", "3", "--image-size", "32", "--batch-size", "32",
                          "--calibration-steps", "4", "--plain-steps", "3", "--wires",
                          "float32", "--modes", "overlap", "--best", "overlap:bf16:float32",
                          "--mpirun", "mpirun --oversubscribe", "--json", str(out)],
                         capture_output=True, text=True, timeout=400, check=False,
                         env=mpi_env(), cwd=REPO)
    assert res.returncode == 0, res.stdout + res.stderr
    result = json.loads(out.read_text())
    assert result["ok"] and result["device"].startswith("cpu (dry run")
    assert [(r["mode"], r["amp"], r["wire"], r["mps"]) for r in result["rows"]] == [
        ("overlap", "off", "float32", "off"), ("overlap", "bf16", "float32", "off")]
    plain = result["plain_images_per_s"]
    assert set(plain) == {"off", "bf16"} and all(v > 0 for v in plain.values())
    assert result["mps"]["state"] == "skipped" and result["gpu_floor"] == 0.85
    for r in result["rows"]:
        assert r["kernel"].startswith("C++ extension") and r["theta_finite"] and r["loss_fell"]
        assert [w["worker"] for w in r["workers"]] == [1, 2]
        assert all(w["steps"] >= 4 and w["gpu"] != w["gpu"] for w in r["workers"])  # NaN
        assert all(w["gpu_floor_met"] is None for w in r["workers"])
        assert r["gpu_floor_met"] is None
        # images/s of the device: every worker's steps/s × the batch, against the plain
        # loop's at the row's precision
        assert r["images_per_s"] == pytest.approx(
            32 * sum(w["steps_per_s"] for w in r["workers"]))
        assert r["plain_images_per_s"] == plain[r["amp"]]
        assert r["efficiency"] == pytest.approx(r["images_per_s"] / plain[r["amp"]])
    assert "gem_mpi.bench gpu: ok" in res.stdout and "dry run" in res.stdout
    assert "plain loop (the same model, batches and precision on the same CPU" in res.stdout
    assert "mps: skipped (--cpu" in res.stdout
    assert "overlap (float32 wire, mps off): bf16 " in res.stdout
    assert "steps/s per worker against float32" in res.stdout
    assert ("overlap, amp bf16, float32 wire, mps off: 2 workers × " in res.stdout
            and "efficiency" in res.stdout)
    assert ("floor: GPU-busy share ≥ 0.85 per worker with the best order: not measured"
            in res.stdout)


def test_bench_gpu_matrix_adds_the_best_combination_and_its_mps_rows():
    """Every mode × amp × wire, --best once beside them, and the rows run again under MPS:
    --best's (--mps-rows best), every one (all), none without a --best."""
    import argparse

    Combo, combo_of, matrix = gpu.Combo, gpu.combo_of, gpu.matrix
    best = combo_of(gpu.best_default())
    assert best == Combo("overlap", "bf16", "bf16" if "bf16" in gpu.WIRES else "float32")
    args = argparse.Namespace(modes=list(WORKER_MODES), amps=["off"], wires=["float32"],
                              best=best, mps_rows="best")
    rows, again = matrix(args)
    assert rows == [*(Combo(m, "off", "float32") for m in WORKER_MODES), best]
    assert again == [Combo(best.mode, best.amp, best.wire, "on")]
    args.mps_rows = "all"
    assert matrix(args)[1] == [Combo(c.mode, c.amp, c.wire, "on") for c in rows]
    args.amps, args.mps_rows = ["off", "bf16"], "best"
    args.best = combo_of("overlap:bf16:float32")  # in the matrix already: not twice
    assert matrix(args)[0].count(args.best) == 1
    args.best = combo_of("none")
    assert args.best is None and matrix(args)[1] == []
    with pytest.raises(argparse.ArgumentTypeError, match="MODE:AMP:WIRE"):
        combo_of("overlap:fp16:float32")


def test_bench_gpu_prints_the_floor_per_worker_and_for_the_best_row(capsys):
    """The GPU half of the printout, on a result made here (no GPU in CI): each worker's
    share against the floor, the best row by images/s, MPS rows labelled, the verdict
    never the exit status."""
    split = dict.fromkeys(gpu.SHOWN, 0.1)

    def row(mode: str, mps: str, shares: list[float], per_s: float) -> dict:
        workers = [{**split, "worker": i + 1, "steps_per_s": per_s, "gpu": g,
                    "gpu_floor_met": g >= gpu.GPU_FLOOR} for i, g in enumerate(shares)]
        return {"mode": mode, "amp": "bf16", "wire": "float32", "mps": mps,
                "kernel": "C++ extension", "apply_ms": 7.0, "updates": 300,
                "job_s": 50.0, "updates_per_s": 30.0, "staleness": 2.0, "utilisation": 90.0,
                "loss_first": 2.0, "loss_last": 0.1, "loss_fell": True, "theta_finite": True,
                "master": dict.fromkeys(("wait", "apply", "mpi", "metrics"), 0.25),
                "images_per_s": 64 * per_s * len(shares), "plain_images_per_s": 2000.0,
                "efficiency": 64 * per_s * len(shares) / 2000.0,
                "gpu_floor_met": all(g >= gpu.GPU_FLOOR for g in shares), "workers": workers}

    result = {"machine": "m", "device": "NVIDIA H100", "torch": "t", "cuda": "c",
              "workers": 3, "image_size": 224, "batch_size": 64, "lr": 0.01, "launcher": "l",
              "mps": {"asked": "auto", "state": "on", "why": ""}, "plain_steps": 200,
              "plain_images_per_s": {"bf16": 2000.0}, "gpu_floor": gpu.GPU_FLOOR, "ok": True,
              "rows": [row("overlap", "off", [0.9, 0.8, 0.86], 9.0),
                       row("overlap", "on", [0.9, 0.88, 0.86], 10.0)]}
    gpu.print_gpu(result)
    out = capsys.readouterr().out
    assert "mps: on: its daemon started and served a CUDA client" in out
    assert "overlap, amp bf16, float32 wire, mps off: gpu per worker 0.90, 0.80, 0.86: below " \
           "it (worker 2)" in out
    assert "overlap, amp bf16, float32 wire, mps on: gpu per worker 0.90, 0.88, 0.86: meets " \
           "the floor" in out
    assert ("the best row by images/s per GPU is overlap, amp bf16, float32 wire, mps on "
            "(gpu per worker 0.90, 0.88, 0.86): met") in out
    assert "3 workers × 10.00 steps/s × b 64 = 1920 images/s on the GPU against the plain " \
           "loop's 2000 (amp bf16): efficiency 0.96" in out
    assert [ln.split()[-1] for ln in out.splitlines() if ln.lstrip().startswith("overlap ")
            and ln.split()[3] == "off"] == ["met", "below", "met"]


@pytest.mark.mpi
def test_bench_gpu_mps_daemon_is_checked_with_a_client_and_stopped(tmp_path, monkeypatch):
    """The MPS daemon's life, with a stand-in nvidia-cuda-mps-control on PATH (no GPU
    here): started in the folders of $CUDA_MPS_*_DIRECTORY, a client run under it, its
    server list read, quit at the end; a daemon that cannot start, or whose client fails,
    is one line and no MPS rows (a failed client's daemon stopped too)."""
    bin_dir, pipe, log = tmp_path / "bin", tmp_path / "pipe", tmp_path / "log"
    bin_dir.mkdir()
    control = bin_dir / "nvidia-cuda-mps-control"
    control.write_text("""#!/usr/bin/env bash
calls="$CUDA_MPS_LOG_DIRECTORY/calls"
if [[ "${1:-}" == -d ]]; then
  echo -d >>"$calls"
  [[ -n "${MPS_FAIL:-}" ]] && { echo "cannot start here" >&2; exit 1; }
  touch "$CUDA_MPS_PIPE_DIRECTORY/control"; exit 0
fi
read -r cmd; echo "$cmd" >>"$calls"
case "$cmd" in
  get_server_list) [[ -e "$CUDA_MPS_PIPE_DIRECTORY/control" ]] && echo 4242 ;;
  quit) rm -f "$CUDA_MPS_PIPE_DIRECTORY/control" ;;
esac
exit 0
""")
    control.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(pipe))
    monkeypatch.setenv("CUDA_MPS_LOG_DIRECTORY", str(log))
    calls = log / "calls"

    monkeypatch.setattr(gpu, "_PROBE", "print(1)")
    daemon = gpu._Mps(str(tmp_path))
    assert daemon.start() is None and daemon.running
    daemon.stop()
    assert calls.read_text().split() == ["-d", "get_server_list", "quit"]
    assert not (pipe / "control").exists() and not daemon.running

    calls.unlink()
    monkeypatch.setattr(gpu, "_PROBE", "raise SystemExit('no CUDA device here')")
    assert gpu._Mps(str(tmp_path)).start() == ("a CUDA client failed under its daemon: no "
                                              "CUDA device here")
    assert calls.read_text().split() == ["-d", "quit"]

    calls.unlink()
    monkeypatch.setenv("MPS_FAIL", "1")
    assert gpu._Mps(str(tmp_path)).start() == ("nvidia-cuda-mps-control -d failed (exit 1): "
                                              "cannot start here")
    assert calls.read_text().split() == ["-d"]


@pytest.mark.mpi
def test_bench_overlap_prints_a_row_per_order_against_the_compute_ceiling(tmp_path):
    """A tiny overlap bench (1 worker, both orders, both wires, real mpirun jobs): the JSON's shape, the
    bytes from the payload layout, each ratio a share of the compute-only ceiling."""
    out = tmp_path / "v.json"
    n = 5000
    res = subprocess.run([sys.executable, "-m", "gem_mpi.bench", "overlap", "--params", str(n),
                          "--step-ms", "10", "--workers", "1", "--orders", "wait", "pipelined",
                          "--wires", "float32", "bf16", "--gradient-at", "own", "pulled",
                          "--steps", "8", "--mpirun", "mpirun --oversubscribe",
                          "--json", str(out)], capture_output=True, text=True, timeout=300,
                         check=False, env=mpi_env(), cwd=REPO)
    assert res.returncode == 0, res.stdout + res.stderr
    result = json.loads(out.read_text())
    assert result["params"] == n and result["ceiling_steps_per_s"] == pytest.approx(100.0)
    [cap] = result["capacity"]
    assert cap["workers"] == 1 and cap["updates_per_s"] > 0 and cap["threads"] >= 1
    rows = result["rows"]
    # a waiting worker has nothing in flight: one row, the first point's
    assert [(r["workers"], r["order"], r["wire"], r["at"]) for r in rows] == [
        (1, "wait", "float32", "own"), (1, "pipelined", "float32", "own"),
        (1, "pipelined", "float32", "pulled"), (1, "wait", "bf16", "own"),
        (1, "pipelined", "bf16", "own"), (1, "pipelined", "bf16", "pulled")]
    for r in rows:
        assert 0 < r["ratio"] <= 1.05
        assert r["ratio"] == pytest.approx(r["steps_per_s"] / 100.0)
        assert r["updates"] == 8 and r["steps_per_s_each"] == [r["steps_per_s"]]
        # Δθ, κ|m|, s: 4 bytes each, or 2 + 2 + 4 on the bf16 wire
        per_param = 12 if r["wire"] == "float32" else 8
        assert r["bytes_per_update"] == r["bytes_committed"] == per_param * n
        assert r["bytes_pulled"] == 4 * n
        assert set(r["worker_split"]) >= {"compute", "commit", "pull", "wait", "other"}
        assert r["worker_split"]["compute"] > 0 and r["compute_ms"] > 0
        assert 0 < r["hidden_ratio"] <= 1.05 and r["host_ms"] == pytest.approx(
            10.0 / r["hidden_ratio"] - 10.0)
        assert set(r["master_split"]) == {"wait", "apply", "mpi", "metrics", "other"}
        assert r["bound"] in ("master", "worker") and r["apply_ms"] > 0
    assert "master capacity, 1 worker(s)" in res.stdout
    assert "1 worker(s): best ratio" in res.stdout
