"""The GPU check: 1 master + n workers sharing one CUDA device, each worker mode in turn.

The workload is ResNet-18 (11.7 M parameters, 10 outputs) on generated 224×224 images that a
network can learn (each class a smooth pattern of its own under noise), named to
``gem_mpi.train`` as a user's model and dataset (``gem_mpi.bench.gpu:resnet18``,
``gem_mpi.bench.gpu:images``), so the check runs the path a user's own model takes. A short
calibration run sizes the step budget so that each mode trains for about ``--seconds``;
then, per mode, each worker's time split (from the run's metrics file), the share of its wall
time the GPU had its step queued (CUDA events: θ's copy in until Δθ is on the host), the
device's utilisation sampled by NVML while the run trains, whether the loss fell, and whether
the saved θ is finite. ``--cpu`` runs the same on the CPU (a dry run of the command, tiny
sizes), saying so in every line it prints.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
from typing import Self

import numpy as np

from gem_mpi.bench import _machine
from gem_mpi.bench.compare import run_training
from gem_mpi.outputs import analysis

CLASSES = 10
_TRAIN, _TEST = 512, 128  # images held by each rank (a class pattern plus noise each)
MODEL = "gem_mpi.bench.gpu:resnet18"
DATASET = "gem_mpi.bench.gpu:images"
_SIDE = "GEM_MPI_GPU_CHECK_SIDE"  # the images' side, from --image-size
SHOWN = ("compute", "load", "payload", "commit", "wait", "backoff", "pull")


def resnet18() -> object:
    """torchvision's ResNet-18 with 10 outputs (11.2 M parameters)."""
    import torchvision

    return torchvision.models.resnet18(num_classes=CLASSES)


class _Images:
    """A fixed pool of generated images: class c is pattern c (smooth, from a 7×7 grid
    upsampled) plus Gaussian noise; map-style, so ``gem_mpi.train`` batches it."""
    def __init__(self, split: str, size: int) -> None:
        import torch
        import torch.nn.functional as F

        side = int(os.environ.get(_SIDE, "224"))
        g = torch.Generator().manual_seed(1234)  # the patterns: the same for both splits
        grid = torch.randn(CLASSES, 3, 7, 7, generator=g)
        patterns = F.interpolate(grid, size=(side, side), mode="bilinear", align_corners=False)
        g.manual_seed(1 if split == "train" else 2)
        self.labels = torch.randint(0, CLASSES, (size,), generator=g)
        self.x = patterns[self.labels] + torch.randn(size, 3, side, side, generator=g)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[object, object]:
        return self.x[i], self.labels[i]


def images(split: str) -> _Images:
    return _Images(split, _TRAIN if split == "train" else _TEST)


class _Utilisation:
    """The device's utilisation (NVML, percent), sampled every 0.2 s while a run trains."""
    def __init__(self, index: int = 0) -> None:
        self.samples: list[int] = []
        self._stop = threading.Event()
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            self._read = lambda: pynvml.nvmlDeviceGetUtilizationRates(self._handle).gpu
        except Exception:  # noqa: BLE001 - no NVML (CPU dry run, no driver): not sampled
            self._read = None
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.2):
            self.samples.append(int(self._read()))

    def __enter__(self) -> Self:
        if self._read is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._read is not None:
            self._thread.join()

    @property
    def mean(self) -> float | None:
        busy = [s for s in self.samples if s > 0]  # from the first kernel on, not start-up
        return float(np.mean(busy)) if busy else None


def _train_args(args: argparse.Namespace, mode: str, steps: int, save: str,
                amp: str = "off") -> list[str]:
    return ["--model", MODEL, "--dataset", DATASET, "--loss", "cross_entropy", "--amp", amp,
            "--lr", str(args.lr), "--batch-size", str(args.batch_size),
            "--max-steps", str(steps), "--epochs", str(-(-steps * args.batch_size // _TRAIN)),
            "--eval-every", "0", "--log-every", "30", "--bn-batches", "2",  # on rank 0's CPU
            "--worker-mode", mode, "--save", save]


def _finite_theta(path: str) -> bool:
    import torch

    state = torch.load(path, map_location="cpu", weights_only=True)
    return all(bool(torch.isfinite(v).all()) for v in state.values() if v.is_floating_point())


def _mode_row(run: object, mode: str, steps: int, job_s: float, util: float | None,
              finite: bool, amp: str = "off") -> dict:

    wt, u = run.worker_time, run.updates
    workers = []
    for w in range(len(wt["wall"])):
        wall = float(wt["wall"][w])
        row = {k: float(wt[k][w]) / wall for k in SHOWN}
        done = int(np.sum(u["worker"] == w + 1))  # this worker's applied updates
        row.update(worker=w + 1, wall_s=wall, gpu=float(wt["gpu"][w]) / wall, steps=done,
                   steps_per_s=done / wall)
        workers.append(row)
    loss = np.asarray(u["loss"], np.float64)
    k = max(1, len(loss) // 10)
    first, last = float(np.mean(loss[:k])), float(np.mean(loss[-k:]))
    summary = run.summary
    master = {k: summary[f"master_{k}_s"] / summary["wall_s"]
              for k in ("wait", "apply", "mpi", "metrics")}
    return {"mode": mode, "amp": amp, "steps": steps, "job_s": job_s,
            "kernel": str(run.attrs["kernel"]),
            "master": master, "apply_ms": 1e3 * summary["master_apply_s"] / summary["updates"],
            "updates": analysis.applied_updates(run),
            "updates_per_s": analysis.updates_per_second(run),
            "staleness": float(np.mean(u["staleness"])), "loss_first": first,
            "loss_last": last, "loss_fell": last < first, "theta_finite": finite,
            "utilisation": util, "workers": workers}


def bench_gpu(args: argparse.Namespace) -> dict:
    """Calibrate, then run each worker mode; the verdicts are in each row."""
    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not args.cpu:
        raise SystemExit("bench gpu: no CUDA device is visible to torch; this check is for a "
                         "GPU machine (--cpu runs it on the CPU as a dry run)")
    device = torch.cuda.get_device_name(0) if cuda else "cpu (dry run: --cpu)"
    os.environ[_SIDE] = str(args.image_size)  # the ranks' images (they inherit it)
    ranks = args.workers + 1
    rows = []
    with tempfile.TemporaryDirectory(prefix="gem_gpu_check_") as out:
        save = os.path.join(out, "model.pt")
        cal, _ = run_training(args.mpirun, ranks,
                              _train_args(args, "wait", args.calibration_steps, save),
                              os.path.join(out, "calibration.h5"), "gpu")

        rate = analysis.updates_per_second(cal)  # updates/s of all workers, after start-up
        steps = max(args.calibration_steps, int(args.seconds * rate / args.workers))
        print(f"gem_mpi.bench gpu: calibration {rate:.1f} upd/s with {args.workers} workers: "
              f"{steps} steps per worker for about {args.seconds:g} s per mode",
              file=sys.stderr, flush=True)
        for amp in args.amps:
            for mode in args.modes:
                with _Utilisation() as util:
                    run, job_s = run_training(args.mpirun, ranks,
                                              _train_args(args, mode, steps, save, amp),
                                              os.path.join(out, f"{mode}-{amp}.h5"), "gpu")
                rows.append(_mode_row(run, mode, steps, job_s, util.mean, _finite_theta(save),
                                      amp))
    return {"bench": "gpu", "machine": _machine(), "device": device,
            "torch": torch.__version__, "cuda": torch.version.cuda, "workers": args.workers,
            "batch_size": args.batch_size, "image_size": args.image_size, "lr": args.lr, "launcher": args.mpirun,
            "model": MODEL, "dataset": DATASET, "rows": rows,
            "ok": all(r["loss_fell"] and r["theta_finite"] and r["kernel"].startswith("C++")
                      for r in rows)}


def print_gpu(result: dict) -> None:
    print(f"gem_mpi.bench gpu: {result['machine']}; device {result['device']}, torch "
          f"{result['torch']} (CUDA {result['cuda']}); 1 master + {result['workers']} workers "
          f"sharing it; ResNet-18 (10 classes) on generated {result['image_size']}² images, b "
          f"{result['batch_size']}, lr {result['lr']}; launcher: {result['launcher']}")
    print("per worker, shares of its wall time: compute (forward, backward, Δθ on the host), "
          "load (θ to the device), payload (m, κ|m|), commit, wait (+ backoff sleeps), pull; "
          "gpu = the GPU's own time from θ's copy in to Δθ on the host, over wall time")
    cols = ["mode", "amp", "worker", "steps/s", *SHOWN, "gpu"]
    print(" ".join(f"{c:>9}" for c in cols))
    for r in result["rows"]:
        for w in r["workers"]:
            vals = [r["mode"], r.get("amp", "off"), w["worker"], f"{w['steps_per_s']:.1f}",
                    *(f"{100 * w[k]:.1f}%" for k in SHOWN), f"{100 * w['gpu']:.1f}%"]
            print(" ".join(f"{v!s:>9}" for v in vals))
    per = {(r["mode"], r.get("amp", "off")): np.mean([w["steps_per_s"] for w in r["workers"]])
           for r in result["rows"]}
    for mode, amp in per:
        if amp == "bf16" and (mode, "off") in per:
            print(f"{mode}: bf16 {per[mode, 'bf16']:.2f} steps/s per worker against float32 "
                  f"{per[mode, 'off']:.2f}: {per[mode, 'bf16'] / per[mode, 'off']:.2f}x")
    for r in result["rows"]:
        util = "n/a" if r["utilisation"] is None else f"{r['utilisation']:.0f}%"
        m = r["master"]
        print(f"{r['mode']} ({r.get('amp', 'off')}): master kernel {r['kernel']}"
              f"{'' if r['kernel'].startswith('C++') else ' (NOT THE C++ EXTENSION)'}: "
              f"{r['apply_ms']:.1f} ms per update; master time idle {100 * m['wait']:.0f}%, "
              f"apply {100 * m['apply']:.0f}%, mpi {100 * m['mpi']:.0f}%, metrics "
              f"{100 * m['metrics']:.0f}%")
        print(f"{r['mode']} ({r.get('amp', 'off')}): {r['updates']} updates in {r['job_s']:.0f} s of job "
              f"({r['updates_per_s']:.1f} upd/s while training), mean staleness "
              f"{r['staleness']:.2f}, device utilisation {util} (NVML, busy samples); loss "
              f"{r['loss_first']:.3f} -> {r['loss_last']:.3f} "
              f"({'fell' if r['loss_fell'] else 'DID NOT FALL'}), θ "
              f"{'finite' if r['theta_finite'] else 'NOT FINITE'}")
    print(f"gem_mpi.bench gpu: {'ok' if result['ok'] else 'FAILED'}")
