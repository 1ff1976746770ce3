"""What a run's rate of updates means in samples, tokens and FLOPs: samples/s per worker and
in total, tokens/s for text, the model FLOPs per sample counted once by torch's
``FlopCounterMode``, and the model FLOPs utilisation (MFU) against the workers' accelerator's
peak, as torchtitan computes it (its bf16 dense peak, the unit every MFU figure is quoted in).
On the CPU there is no peak that means anything: the achieved FLOP/s is reported instead."""

from __future__ import annotations

import copy
import glob
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gem_mpi.config import FLOPS_OFF, FLOPS_ON, TEXT, Config, synchronous
from gem_mpi.problem import Problem

# bf16 dense peak FLOP/s of one device, by a substring of its name (the first that matches,
# so the more specific names first); NVIDIA's and AMD's data sheets, as torchtitan's table
PEAKS: tuple[tuple[str, float], ...] = (
    ("GH200", 989e12), ("H200", 989e12), ("H100 NVL", 835e12), ("H100 PCIe", 756e12),
    ("H100", 989e12), ("H800", 989e12), ("B200", 2250e12), ("B100", 1750e12),
    ("A100", 312e12), ("A800", 312e12), ("L40S", 362e12), ("L40", 181e12),
    ("A10G", 70e12), ("L4", 121e12), ("MI300X", 1307e12), ("MI325X", 1307e12),
    ("MI250X", 383e12), ("V100", 125e12), ("A6000", 155e12))


def peak_flops(device_name: str | None) -> float:
    """The bf16 dense peak of a device named ``device_name``, 0.0 when it is unknown (or
    None: no accelerator)."""
    if not device_name:
        return 0.0
    for key, peak in PEAKS:
        if key.lower() in device_name.lower():
            return peak
    return 0.0


def accelerator_name() -> str | None:
    """The GPU the workers of this node train on, as NVIDIA's driver names it (read from
    /proc, so rank 0, a CPU rank, starts no CUDA context), else torch's name, else None."""
    for info in sorted(glob.glob("/proc/driver/nvidia/gpus/*/information")):
        with open(info, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith("Model:"):
                    return line.split(":", 1)[1].strip()
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return None


def flops_per_sample(model: Any, batch: tuple[Any, Any], loss: Callable[[Any, Any], Any]
                     ) -> float:
    """Model FLOPs of one training sample, forward and backward, counted by torch on a copy
    of ``model`` (rank 0's stays as it was: no BatchNorm statistics, no gradients)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    x, y = batch
    twin = copy.deepcopy(model).train()
    counter = FlopCounterMode(display=False)
    with counter:
        loss(twin(x), y).backward()
    return counter.get_total_flops() / max(len(x), 1) if torch.is_tensor(x) else 0.0


@dataclass(frozen=True)
class Throughput:
    """What one update (or synchronous step) trains on, to read its rate as samples/s."""

    samples: float  # samples one update or step trains on (all workers' for a step)
    workers: int
    tokens: int = 0  # tokens of one sample (text: its context); 0 for other data
    flops: float = 0.0  # model FLOPs of one sample, forward and backward; 0: not counted
    peak: float = 0.0  # one worker's device's peak FLOP/s; 0: none known (the CPU)
    note: str = ""  # why the FLOPs were not counted, for rank 0 to say

    def rates(self, per_s: float) -> dict[str, float]:
        """The scalars of ``per_s`` updates (steps) per second."""
        samples = per_s * self.samples
        out = {"samples_per_s": samples, "samples_per_s_per_worker": samples / self.workers}
        if self.tokens:
            out["tokens_per_s"] = samples * self.tokens
        if self.flops:
            out["model_flops_per_s"] = samples * self.flops
            if self.peak:
                out["mfu"] = samples * self.flops / (self.peak * self.workers)
        return out

    def text(self, per_s: float) -> str:
        """The progress line's words for ``per_s``."""
        r = self.rates(per_s)
        words = [(f"{r['samples_per_s']:.0f} samples/s "
                  f"({r['samples_per_s_per_worker']:.0f}/worker)")]
        if "tokens_per_s" in r:
            words.append(f"{r['tokens_per_s']:.0f} tok/s")
        if "mfu" in r:
            words.append(f"MFU {100 * r['mfu']:.1f}%")
        elif "model_flops_per_s" in r:
            words.append(f"{r['model_flops_per_s'] / 1e9:.2f} GFLOP/s (CPU: no MFU)")
        return ", ".join(words)


def measure(cfg: Config, n_workers: int, problem: Problem, split: Any = None) -> Throughput:
    """The run's :class:`Throughput`: its samples per update or step from the options, and,
    for a torch model, its FLOPs per sample counted once on two samples of ``split`` (the
    evaluation's, which rank 0 holds already: no training set loaded for it)."""
    d = cfg.data
    samples = d.batch_size * (n_workers if synchronous(cfg.method)
                              else cfg.runtime.group_size * cfg.optim.local_steps)
    tokens = d.context if d.dataset == TEXT else 0
    flops = peak = 0.0
    note = ""
    wanted = cfg.monitor.flops
    if problem.model is not None and problem.loss is not None and wanted != FLOPS_OFF:
        peak = peak_flops(accelerator_name())
        if peak or wanted == FLOPS_ON:  # auto: only where an MFU can be told
            from gem_mpi.problem.batches import iterate_batches

            try:
                batch = next(iter(iterate_batches(split, 2, 1, 0, shuffle=False,
                                                  drop_last=False)))
                flops = flops_per_sample(problem.model, batch, problem.loss.mean)
            except Exception as exc:  # noqa: BLE001 - a model torch's counter cannot follow
                note = (f"the model's FLOPs could not be counted ({type(exc).__name__}: "
                        f"{exc}): no FLOP/s or MFU is reported")
    return Throughput(samples, n_workers, tokens, flops, peak, note)
