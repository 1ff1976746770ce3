"""The GPU check: 1 master + n workers sharing one CUDA device, a row per worker order,
precision, wire format and CUDA MPS setting.

The workload is ResNet-18 (11.7 M parameters, 10 outputs) on generated 224×224 images that a
network can learn (each class a smooth pattern of its own under noise), named to
``gem_mpi.train`` as a user's model and dataset (``gem_mpi.bench.gpu:resnet18``,
``gem_mpi.bench.gpu:images``), so the check runs the path a user's own model takes.

First the plain loop (``gem_mpi.bench.overhead``'s ceiling: one process, momentum SGD, no
MPI) trains the same model on the same batches at each precision the rows use, on the same
GPU: the images/s a GPU gives without gem_mpi. A short calibration run then sizes the step
budget so that each row trains for about ``--seconds``. The rows: every ``--modes`` ×
``--amps`` × ``--wires`` (by default each worker order in float32), plus ``--best`` (the
combination suited to a GPU: the overlap order with bf16 autocast, on the bf16 wire once
``WIRES`` has it), and, where CUDA MPS's daemon starts (``--mps auto``), the best one again
with the workers as MPS clients (``--mps-rows all``: every row). Per row: each worker's time
split (from the run's metrics file), the share of its wall time the GPU had its step queued
(CUDA events: θ's copy in until Δθ is on the host) against the floor ``GPU_FLOOR``, the
images/s of the GPU summed over the workers sharing it against the plain loop's (the
scaling efficiency DDP and Horovod publish), the device's utilisation sampled by NVML,
whether the loss fell, and whether the saved θ is finite. ``--cpu`` runs the same on the
CPU (a dry run of the command, tiny sizes; no MPS), saying so in every line it prints.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from typing import Self

import numpy as np

from gem_mpi.bench import Subcommands, _machine
from gem_mpi.bench.compare import run_training
from gem_mpi.bench.overhead import ceiling
from gem_mpi.bench.overlap import WIRES  # one table of wire formats for both benches
from gem_mpi.config import AMP_BF16, AMP_MODES, AMP_OFF, OVERLAP, WORKER_MODES
from gem_mpi.outputs import analysis

CLASSES = 10
_TRAIN, _TEST = 512, 128  # images held by each rank (a class pattern plus noise each)
MODEL = "gem_mpi.bench.gpu:resnet18"
DATASET = "gem_mpi.bench.gpu:images"
_SIDE = "GEM_MPI_GPU_CHECK_SIDE"  # the images' side, from --image-size
SHOWN = ("compute", "load", "payload", "commit", "wait", "backoff", "pull")
# the GPU-busy share each worker should reach with the best order (a verdict
# printed beside the rows, not a failure of the check)
GPU_FLOOR = 0.85
MPS_CONTROL = "nvidia-cuda-mps-control"
# one CUDA client, run under a freshly started MPS daemon before any row depends on it
_PROBE = "import torch; x = torch.ones(1, device='cuda'); torch.cuda.synchronize(); print(x.item())"


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


def best_default() -> str:
    """The combination suited to a GPU worker: the overlap order under bf16 autocast, on
    the bf16 wire when ``WIRES`` has it (``--best``'s default)."""
    return f"{OVERLAP}:{AMP_BF16}:{'bf16' if 'bf16' in WIRES else 'float32'}"


@dataclass(frozen=True)
class Combo:
    """One row's settings: worker order, precision, wire format, and whether the workers
    are CUDA MPS clients."""
    mode: str
    amp: str
    wire: str
    mps: str = "off"

    @property
    def label(self) -> str:
        return f"{self.mode}, amp {self.amp}, {self.wire} wire, mps {self.mps}"


def combo_of(text: str) -> Combo | None:
    """--best's MODE:AMP:WIRE (or 'none'), each part one of its option's choices."""
    if text == "none":
        return None
    parts = text.split(":")
    if (len(parts) != 3 or parts[0] not in WORKER_MODES or parts[1] not in AMP_MODES
            or parts[2] not in WIRES):
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected MODE:AMP:WIRE with MODE one of {', '.join(WORKER_MODES)}, "
            f"AMP one of {', '.join(AMP_MODES)}, WIRE one of {', '.join(WIRES)}; or none")
    return Combo(*parts)


def matrix(args: argparse.Namespace) -> tuple[list[Combo], list[Combo]]:
    """(the rows without MPS, the rows to run again under MPS where its daemon starts):
    every mode × amp × wire, then ``--best`` unless it is among them already."""
    rows = [Combo(m, a, w) for a in args.amps for w in args.wires for m in args.modes]
    best = args.best
    if best is not None and best not in rows:
        rows.append(best)
    again = rows if args.mps_rows == "all" else [c for c in rows if c == best]
    return rows, [Combo(c.mode, c.amp, c.wire, "on") for c in again]


def _train_args(args: argparse.Namespace, combo: Combo, steps: int, save: str) -> list[str]:
    return ["--model", MODEL, "--dataset", DATASET, "--loss", "cross_entropy",
            "--amp", combo.amp, "--lr", str(args.lr), "--batch-size", str(args.batch_size),
            "--max-steps", str(steps), "--epochs", str(_epochs(steps, args.batch_size)),
            "--eval-every", "0", "--log-every", "30", "--bn-batches", "2",  # on rank 0's CPU
            "--worker-mode", combo.mode, "--save", save, *WIRES[combo.wire]]


def _epochs(steps: int, batch_size: int) -> int:
    """Epochs enough for ``steps`` whole batches (a partial batch is dropped)."""
    return -(-steps // max(1, _TRAIN // batch_size))


def _finite_theta(path: str) -> bool:
    import torch

    state = torch.load(path, map_location="cpu", weights_only=True)
    return all(bool(torch.isfinite(v).all()) for v in state.values() if v.is_floating_point())


class _Mps:
    """CUDA MPS for the ranks sharing the GPU: its control daemon started with the pipe
    and log folders of $CUDA_MPS_PIPE_DIRECTORY and $CUDA_MPS_LOG_DIRECTORY (the ranks
    inherit them; tools/gpu_check.sh sets them and stops the daemon in its exit trap),
    else folders under ``folder``; one CUDA client is run under it before any row, so that
    a daemon that starts but cannot serve is found out; stopped by :meth:`stop`."""
    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.running = False

    def _control(self, command: str) -> subprocess.CompletedProcess:
        return subprocess.run([MPS_CONTROL], input=command + "\n", capture_output=True,
                              text=True, timeout=30, check=False)

    def start(self) -> str | None:
        """None once the workers' runs will be MPS clients, else why not (one line)."""
        if shutil.which(MPS_CONTROL) is None:
            return f"{MPS_CONTROL} is not on PATH"
        for var, sub in (("CUDA_MPS_PIPE_DIRECTORY", "mps-pipe"),
                         ("CUDA_MPS_LOG_DIRECTORY", "mps-log")):
            os.environ.setdefault(var, os.path.join(self.folder, sub))
            os.makedirs(os.environ[var], exist_ok=True)
        try:
            res = subprocess.run([MPS_CONTROL, "-d"], capture_output=True, text=True,
                                 timeout=30, check=False)
            if res.returncode != 0:
                return f"{MPS_CONTROL} -d failed (exit {res.returncode}): {_tail(res)}"
            self.running = True
            probe = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True,
                                   text=True, timeout=60, check=False)
            if probe.returncode != 0:
                self.stop()
                return f"a CUDA client failed under its daemon: {_tail(probe)}"
            if not self._control("get_server_list").stdout.strip():
                self.stop()
                return "its daemon started no server for a CUDA client"
        except subprocess.TimeoutExpired as e:
            self.stop()
            return f"{' '.join(map(str, e.cmd))[:60]} did not finish in {e.timeout:g} s"
        return None

    def stop(self) -> None:
        if self.running:
            self.running = False
            try:
                self._control("quit")
            except subprocess.TimeoutExpired:
                pass  # tools/gpu_check.sh's exit trap says quit again


def _tail(res: subprocess.CompletedProcess) -> str:
    lines = (res.stderr or res.stdout or "").strip().splitlines()
    return lines[-1] if lines else "no output"


def _row(run: object, combo: Combo, steps: int, job_s: float, util: float | None,
         finite: bool, batch_size: int, plain: dict) -> dict:
    """A row's verdicts and figures; images/s are the GPU's, summed over the workers
    sharing it (all of them in this check), against the plain loop's at its precision."""
    wt, u = run.worker_time, run.updates
    workers = []
    for w in range(len(wt["wall"])):
        wall = float(wt["wall"][w])
        row = {k: float(wt[k][w]) / wall for k in SHOWN}
        done = int(np.sum(u["worker"] == w + 1))  # this worker's applied updates
        gpu = float(wt["gpu"][w]) / wall
        row.update(worker=w + 1, wall_s=wall, gpu=gpu, steps=done, steps_per_s=done / wall,
                   gpu_floor_met=None if np.isnan(gpu) else bool(gpu >= GPU_FLOOR))
        workers.append(row)
    loss = np.asarray(u["loss"], np.float64)
    k = max(1, len(loss) // 10)
    first, last = float(np.mean(loss[:k])), float(np.mean(loss[-k:]))
    summary = run.summary
    master = {k: summary[f"master_{k}_s"] / summary["wall_s"]
              for k in ("wait", "apply", "mpi", "metrics")}
    images = batch_size * sum(w["steps_per_s"] for w in workers)
    met = [w["gpu_floor_met"] for w in workers]
    return {"mode": combo.mode, "amp": combo.amp, "wire": combo.wire, "mps": combo.mps,
            "steps": steps, "job_s": job_s, "kernel": str(run.attrs["kernel"]),
            "master": master, "apply_ms": 1e3 * summary["master_apply_s"] / summary["updates"],
            "updates": analysis.applied_updates(run),
            "updates_per_s": analysis.updates_per_second(run),
            "staleness": float(np.mean(u["staleness"])), "loss_first": first,
            "loss_last": last, "loss_fell": last < first, "theta_finite": finite,
            "utilisation": util, "images_per_s": images,
            "plain_images_per_s": plain[combo.amp],
            "efficiency": images / plain[combo.amp],
            "gpu_floor_met": None if None in met else all(met), "workers": workers}


def _one_gpu(torch: object) -> str | None:
    """With several GPUs visible, the ranks are shown the first only: every worker shares
    it, as the check means (the ranks take GPUs round robin otherwise)."""
    if torch.cuda.device_count() <= 1:
        return None
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    os.environ["CUDA_VISIBLE_DEVICES"] = first
    return first


def _say(text: str) -> None:
    print(f"gem_mpi.bench gpu: {text}", file=sys.stderr, flush=True)


def bench_gpu(args: argparse.Namespace) -> dict:
    """The plain loop at each precision, a calibration, then each row; the verdicts are in
    each row. CUDA is never started in this process before the MPS daemon has stopped (a
    client started before it would not be one of its)."""
    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not args.cpu:
        raise SystemExit("bench gpu: no CUDA device is visible to torch; this check is for a "
                         "GPU machine (--cpu runs it on the CPU as a dry run)")
    first = _one_gpu(torch) if cuda else None
    if first is not None:
        _say(f"several GPUs: CUDA_VISIBLE_DEVICES={first} for every rank (one GPU shared)")
    os.environ[_SIDE] = str(args.image_size)  # the ranks' images (they inherit it)
    ranks = args.workers + 1
    plain_rows, mps_rows = matrix(args)
    if args.cpu or not cuda:
        mps = {"asked": args.mps, "state": "skipped",
               "why": "--cpu runs on the CPU: no GPU for the workers to share"}
    elif args.mps == "off":
        mps = {"asked": args.mps, "state": "off", "why": "--mps off"}
    elif not mps_rows:
        mps = {"asked": args.mps, "state": "off", "why": "no row to run under it (--best none "
               "with --mps-rows best)"}
    else:
        mps = {"asked": args.mps, "state": "pending", "why": ""}
    device = "cuda:0" if cuda and not args.cpu else "cpu"
    options = {"model": MODEL, "dataset": DATASET, "loss": "cross_entropy",
               "batch_size": args.batch_size, "lr": args.lr,
               "epochs": _epochs(10 + args.plain_steps, args.batch_size)}
    plain = {}
    for amp in dict.fromkeys(c.amp for c in plain_rows + mps_rows):
        [rate] = ceiling(options, 1, args.plain_steps, device, amp, threads=None)
        plain[amp] = args.batch_size * rate
        _say(f"plain loop (one process, momentum SGD, no MPI) on {device}, amp {amp}: "
             f"{plain[amp]:.0f} images/s")
    rows = []
    with tempfile.TemporaryDirectory(prefix="gem_gpu_check_") as out:
        save = os.path.join(out, "model.pt")
        cal, _ = run_training(args.mpirun, ranks,
                              _train_args(args, Combo("wait", AMP_OFF, "float32"),
                                          args.calibration_steps, save),
                              os.path.join(out, "calibration.h5"), "gpu")

        rate = analysis.updates_per_second(cal)  # updates/s of all workers, after start-up
        steps = max(args.calibration_steps, int(args.seconds * rate / args.workers))
        later = mps_rows if mps["state"] == "pending" else []
        _say(f"calibration {rate:.1f} upd/s with {args.workers} workers: {steps} steps per "
             f"worker for about {args.seconds:g} s per row; {len(plain_rows)} rows"
             f"{f', then {len(later)} under MPS where it starts' if later else ''}: "
             + "; ".join(c.label for c in plain_rows + later))

        def run(combo: Combo) -> None:
            name = f"{combo.mode}-{combo.amp}-{combo.wire}-mps{combo.mps}.h5"
            with _Utilisation() as util:
                result, job_s = run_training(args.mpirun, ranks,
                                             _train_args(args, combo, steps, save),
                                             os.path.join(out, name), "gpu")
            rows.append(_row(result, combo, steps, job_s, util.mean, _finite_theta(save),
                             args.batch_size, plain))

        for combo in plain_rows:
            run(combo)
        if mps["state"] == "pending":
            daemon = _Mps(out)
            try:
                why = daemon.start()
                mps.update(state="on" if why is None else "unavailable", why=why or "")
                _say(f"mps: {_mps_line(mps)}")
                if why is None:
                    for combo in mps_rows:
                        run(combo)
            finally:
                daemon.stop()
    name = torch.cuda.get_device_name(0) if device != "cpu" else "cpu (dry run: --cpu)"
    return {"bench": "gpu", "machine": _machine(), "device": name,
            "torch": torch.__version__, "cuda": torch.version.cuda, "workers": args.workers,
            "batch_size": args.batch_size, "image_size": args.image_size, "lr": args.lr,
            "launcher": args.mpirun, "model": MODEL, "dataset": DATASET,
            "gpu_floor": GPU_FLOOR, "mps": mps, "plain_steps": args.plain_steps,
            "plain_images_per_s": plain, "rows": rows,
            "ok": all(r["loss_fell"] and r["theta_finite"] and r["kernel"].startswith("C++")
                      for r in rows)}


def _mps_line(mps: dict) -> str:
    if mps["state"] == "on":
        return "on: its daemon started and served a CUDA client; the rows marked mps on ran " \
               "as its clients"
    if mps["state"] == "unavailable":
        return f"unavailable ({mps['why']}); the rows run without it"
    return f"{mps['state']} ({mps['why']})"


def _label(r: dict) -> str:
    return f"{r['mode']}, amp {r['amp']}, {r['wire']} wire, mps {r['mps']}"


def _shares(r: dict) -> str:
    return ", ".join(f"{w['gpu']:.2f}" for w in r["workers"])


def print_gpu(result: dict) -> None:
    on_cpu = result["device"].startswith("cpu")
    floor = result["gpu_floor"]
    print(f"gem_mpi.bench gpu: {result['machine']}; device {result['device']}, torch "
          f"{result['torch']} (CUDA {result['cuda']}); 1 master + {result['workers']} workers "
          f"sharing it; ResNet-18 (10 classes) on generated {result['image_size']}² images, b "
          f"{result['batch_size']}, lr {result['lr']}; launcher: {result['launcher']}")
    print(f"mps: {_mps_line(result['mps'])}")
    plain = ", ".join(f"amp {a} {v:.0f}" for a, v in result["plain_images_per_s"].items())
    print(f"plain loop (the same model, batches and precision on the same "
          f"{'CPU' if on_cpu else 'GPU'}: one process, momentum SGD, no MPI, "
          f"{result['plain_steps']} steps after 10 of warm-up), images/s: {plain}")
    print("per worker, shares of its wall time: compute (forward, backward, Δθ on the host; "
          "overlap: waiting for the compute thread), load (θ to the device), payload (m, "
          "κ|m|), commit, wait (+ backoff sleeps), pull; gpu = the GPU's own time from θ's "
          f"copy in to Δθ on the host, over wall time; floor: gpu ≥ {floor:.2f}")
    cols = ["mode", "amp", "wire", "mps", "worker", "steps/s", *SHOWN, "gpu", "floor"]
    print(" ".join(f"{c:>9}" for c in cols))
    for r in result["rows"]:
        for w in r["workers"]:
            met = w["gpu_floor_met"]
            vals = [r["mode"], r["amp"], r["wire"], r["mps"], w["worker"],
                    f"{w['steps_per_s']:.1f}", *(f"{100 * w[k]:.1f}%" for k in SHOWN),
                    "n/a" if met is None else f"{100 * w['gpu']:.1f}%",
                    "n/a" if met is None else "met" if met else "below"]
            print(" ".join(f"{v!s:>9}" for v in vals))
    per = {(r["mode"], r["amp"], r["wire"], r["mps"]):
           np.mean([w["steps_per_s"] for w in r["workers"]]) for r in result["rows"]}
    for (mode, amp, wire, mps), bf in per.items():
        off = per.get((mode, AMP_OFF, wire, mps))
        if amp == AMP_BF16 and off:
            print(f"{mode} ({wire} wire, mps {mps}): bf16 {bf:.2f} steps/s per worker "
                  f"against float32 {off:.2f}: {bf / off:.2f}x")
    where = "the CPU (dry run)" if on_cpu else "the GPU"
    for r in result["rows"]:
        n = len(r["workers"])
        mean = np.mean([w["steps_per_s"] for w in r["workers"]])
        print(f"{_label(r)}: {n} workers × {mean:.2f} steps/s × b {result['batch_size']} = "
              f"{r['images_per_s']:.0f} images/s on {where} against the plain loop's "
              f"{r['plain_images_per_s']:.0f} (amp {r['amp']}): efficiency "
              f"{r['efficiency']:.2f}")
    for r in result["rows"]:
        util = "n/a" if r["utilisation"] is None else f"{r['utilisation']:.0f}%"
        m = r["master"]
        print(f"{_label(r)}: master kernel {r['kernel']}"
              f"{'' if r['kernel'].startswith('C++') else ' (NOT THE C++ EXTENSION)'}: "
              f"{r['apply_ms']:.1f} ms per update; master time idle {100 * m['wait']:.0f}%, "
              f"apply {100 * m['apply']:.0f}%, mpi {100 * m['mpi']:.0f}%, metrics "
              f"{100 * m['metrics']:.0f}%")
        print(f"{_label(r)}: {r['updates']} updates in {r['job_s']:.0f} s of job "
              f"({r['updates_per_s']:.1f} upd/s while training), mean staleness "
              f"{r['staleness']:.2f}, device utilisation {util} (NVML, busy samples); loss "
              f"{r['loss_first']:.3f} -> {r['loss_last']:.3f} "
              f"({'fell' if r['loss_fell'] else 'DID NOT FALL'}), θ "
              f"{'finite' if r['theta_finite'] else 'NOT FINITE'}")
    _print_floor(result)
    print(f"gem_mpi.bench gpu: {'ok' if result['ok'] else 'FAILED'}")


def _print_floor(result: dict) -> None:
    """The issue's floor, per row and for the best one: a verdict, never the exit status."""
    floor, rows = result["gpu_floor"], result["rows"]
    said = f"floor: GPU-busy share ≥ {floor:.2f} per worker with the best order"
    if not rows:
        return
    if any(r["gpu_floor_met"] is None for r in rows):
        print(f"{said}: not measured (no GPU time on the CPU: --cpu dry run); a verdict, not "
              "a failure of the check")
        return
    for r in rows:
        below = [str(w["worker"]) for w in r["workers"] if not w["gpu_floor_met"]]
        print(f"{_label(r)}: gpu per worker {_shares(r)}: "
              + ("meets the floor" if not below else f"below it (worker {', '.join(below)})"))
    best = max(rows, key=lambda r: r["images_per_s"])
    print(f"{said}: the best row by images/s per GPU is {_label(best)} (gpu per worker "
          f"{_shares(best)}): {'met' if best['gpu_floor_met'] else 'NOT MET'}; rows meeting "
          f"it: {'; '.join(_label(r) for r in rows if r['gpu_floor_met']) or 'none'} (a "
          "verdict, not a failure of the check)")


def register(sub: Subcommands) -> argparse.ArgumentParser:
    """``gpu``: its options, and what runs and prints it."""
    p = sub.add_parser("gpu", help="the GPU check: 1 master + n workers sharing one CUDA "
                       "device, ResNet-18 on generated images, against the plain loop on the "
                       "same device; a row per worker order, precision, wire format and CUDA "
                       "MPS setting, each for about --seconds; exits 1 unless the loss fell "
                       "and θ stayed finite (run it outside mpirun; tools/gpu_check.sh "
                       "prepares a bare GPU machine)")
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--seconds", type=float, default=30.0, help="training time per row")
    p.add_argument("--modes", nargs="+", default=list(WORKER_MODES), choices=WORKER_MODES,
                   help="worker orders (--worker-mode), each with every --amps and --wires")
    p.add_argument("--amps", nargs="+", default=[AMP_OFF], choices=AMP_MODES,
                   help="the workers' precisions (--amp), each with every mode; where a row "
                   "has a bf16 twin, bf16's steps/s are printed against float32's")
    p.add_argument("--wires", nargs="+", default=["float32"], choices=list(WIRES),
                   help="wire formats of an update, each with every mode")
    p.add_argument("--best", type=combo_of, default=combo_of(best_default()),
                   help="MODE:AMP:WIRE, one more row beside the matrix (the combination suited "
                   f"to a GPU; default {best_default()}), or 'none'")
    p.add_argument("--mps", default="auto", choices=["auto", "off"],
                   help="auto: where CUDA MPS's daemon starts, run rows again with the workers "
                   "as its clients (--mps-rows), then stop it; off: never")
    p.add_argument("--mps-rows", default="best", choices=["best", "all"],
                   help="the rows run again under MPS: --best's, or every row")
    p.add_argument("--plain-steps", type=int, default=200,
                   help="timed steps of the plain loop (one process, no MPI) at each "
                   "precision, after 10 of warm-up")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--calibration-steps", type=int, default=20,
                   help="steps per worker of the run that sizes the others")
    p.add_argument("--cpu", action="store_true", help="a dry run on the CPU (no CUDA, no MPS)")
    p.add_argument("--mpirun", default="mpirun --oversubscribe --mca btl self,vader",
                   help="launcher command line (one node)")
    p.set_defaults(run=bench_gpu, show=print_gpu)
    return p
