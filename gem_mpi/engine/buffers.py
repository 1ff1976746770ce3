"""A torch worker's buffers: Δθ = −η·g's on the device, taking turns under --worker-mode
overlap (:class:`DeltaTurns`), and on a GPU the page-locked host buffers and side streams that
carry θ in and Δθ, the loss and κ|m| out beside the compute (:class:`HostCopies`)."""

from __future__ import annotations

import contextlib
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np

from gem_mpi.algorithm.optim import States
from gem_mpi.algorithm.stepsize import Schedule
from gem_mpi.run.local_step import LocalStep

if TYPE_CHECKING:  # torch is imported when a step is made, never on import
    import torch


class DeltaTurns:
    """g's flat buffer (the parameters' .grad views) and Δθ's: one of each, or overlapped two
    Δθ buffers (step k's is still being sent while step k+1's is computed) and, on the CPU,
    two g buffers too: there −η·g and g's zeroing are the sending thread's (:meth:`settle`),
    so each turn's g must outlive the next step's backward."""

    grads: list[torch.Tensor]
    deltas: list[torch.Tensor]
    grad: torch.Tensor | None  # the step's g (None once released)
    delta: torch.Tensor | None  # the step's Δθ (None once released)

    def __init__(self, local: LocalStep, n: int, lr: float, schedule: Schedule,
                 overlapped: bool, on_gpu: bool, own: States | None = None) -> None:
        """``lr``: η; ``schedule``: η per step, unless constant; ``own``: the worker's own
        optimizer (:func:`gem_mpi.algorithm.optim.own_optimizer`; None: Δθ = −η·g), whose
        step is made on the compute thread, in step order, so it is never deferred."""
        torch = self.torch = local.torch
        self.local, self.lr, self.schedule = local, lr, schedule
        self.deferred = overlapped and not on_gpu and own is None
        self.grads = [torch.zeros(n, dtype=torch.float32, device=local.device)
                      for _ in range(2 if self.deferred else 1)]
        self.lrs = [lr] * len(self.grads)  # each turn's η, for settle
        self.grad = self.grads[0]
        local.bind_grads(self.grad)
        self.deltas = [torch.empty(n, dtype=torch.float32, device=local.device)
                       for _ in range(2 if overlapped else 1)]
        self.delta = self.deltas[0]
        self.own = own

    def begin(self, seq: int) -> int:
        """Step ``seq``'s turn, its g ready for the backward: zeroed now, or (deferred) the
        turn's own buffer, zeroed by the settle of two steps ago."""
        turn = seq % len(self.deltas)
        if self.deferred:
            self.grad = self.grads[turn]
            self.local.bind_grads(self.grad)
        else:
            assert self.grad is not None, "a step after release()"
            self.grad.zero_()
        return turn

    def make(self, turn: int, seq: int, theta: torch.Tensor) -> torch.Tensor | None:
        """Δθ = −η·g of step ``seq`` (AdamW: its step d at ``theta``, the θ it was computed
        at) into the turn's buffer; None when deferred (η kept for settle)."""
        lr = self.lr if self.schedule.constant else float(self.schedule.eta(seq))
        self.delta = self.deltas[turn]
        if self.deferred:
            self.lrs[turn] = lr
            return None
        if self.own is not None:
            assert self.grad is not None, "a step after release()"
            return self.own.step(self.grad, theta, lr, out=self.delta)
        self.torch.mul(self.grad, -lr, out=self.delta)  # Δθ, on the device
        return self.delta

    def difference(self, turn: int, local: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
        """Δ = θ_H − θ₀ of --local-steps (``local`` after the steps, ``theta`` as pulled)
        into the turn's buffer."""
        self.delta = self.deltas[turn]
        return self.torch.sub(local, theta, out=self.delta)

    def pending(self, seq: int, delta: np.ndarray | None) -> tuple[np.ndarray, float]:
        """Step ``seq``'s Δθ as (v, q), Δθ = q·v: as computed (q = 1), or (deferred) its g
        and −η, which :meth:`settle` multiplies later (the same float32 product)."""
        if delta is not None:
            return delta, 1.0
        turn = seq % len(self.deltas)
        return self.grads[turn].numpy(), -self.lrs[turn]

    def settle(self, seq: int, delta: np.ndarray | None) -> np.ndarray:
        """Step ``seq``'s Δθ on the host: as computed, or (deferred) −ηg made now, its g
        zeroed for the step after next; on the thread that sends it."""
        if delta is not None:
            return delta
        turn = seq % len(self.deltas)
        self.torch.mul(self.grads[turn], -self.lrs[turn], out=self.deltas[turn])
        self.grads[turn].zero_()
        return self.deltas[turn].numpy()

    def release(self) -> None:
        """Drop the device buffers, so that their memory can go back."""
        self.grads = self.deltas = []
        self.grad = self.delta = None


class HostCopies:
    """θ pulled into page-locked memory (three buffers overlapped: see
    :func:`gem_mpi.engine.orders.overlap_order`) reaches ``flat``, which the parameters
    view, in one asynchronous copy; Δθ (one page-locked buffer per Δθ turn), the loss and
    κ|m| come back on side streams, each ordered after the compute by an event."""

    pull_buffers: list[np.ndarray]
    _pinned: dict[int, torch.Tensor]  # a pull buffer's address: its page-locked tensor
    flat: torch.Tensor | None  # None once the worker gave its GPU back
    delta_hosts: list[torch.Tensor]
    _a_host: torch.Tensor | None
    loss_host: torch.Tensor
    stream: torch.cuda.Stream
    _a_copies: torch.cuda.Stream | None

    def __init__(self, torch: ModuleType, device: torch.device, n: int, overlapped: bool,
                 turns: int, points: bool = False) -> None:
        """``points``: one θ buffer more, for the gradient point
        (:mod:`gem_mpi.engine.points`), loaded as the pulls are."""
        self.torch, self.device = torch, device
        pinned = [torch.empty(n, dtype=torch.float32, pin_memory=True)
                  for _ in range((3 if overlapped else 1) + (1 if points else 0))]
        self.pull_buffers = [p.numpy() for p in pinned]
        self._pinned = {b.ctypes.data: p for b, p in zip(self.pull_buffers, pinned)}
        self.flat = torch.empty(n, dtype=torch.float32, device=device)
        self.delta_hosts = [torch.empty(n, dtype=torch.float32, pin_memory=True)
                            for _ in range(turns)]
        self._a_host = None  # κ|m|'s page-locked copy: made at its first use (the global
        # proxy sends no κ|m|, so its workers never pin θ's size a third time)
        self.loss_host = torch.empty(1, dtype=torch.float32, pin_memory=True)
        self.stream = torch.cuda.Stream(device)  # host <-> device beside the compute
        self._a_copies = None  # κ|m|'s copies, made on the thread that folds m (host())

    def load(self, theta: np.ndarray) -> torch.cuda.Event:
        """Start θ's copy into ``flat``; returns the timing event recorded before it."""
        torch = self.torch
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        src = self._pinned.get(theta.ctypes.data)
        assert self.flat is not None, "a step after the GPU was given back"
        self.flat.copy_(torch.from_numpy(theta) if src is None else src, non_blocking=True)
        return start

    def to_host(self, pairs: tuple[tuple[torch.Tensor, torch.Tensor], ...],
                timing: bool = False,
                stream: torch.cuda.Stream | None = None) -> torch.cuda.Event:
        """Copy each (device source, page-locked destination) on a side stream (default: the
        compute's copies), after the work queued so far on this thread's current stream;
        returns the event that marks them done."""
        torch = self.torch
        copies = self.stream if stream is None else stream
        computed = torch.cuda.Event()
        computed.record()
        done = torch.cuda.Event(enable_timing=timing)
        with torch.cuda.stream(copies):
            copies.wait_event(computed)
            for src, dst in pairs:
                src.record_stream(copies)
                dst.copy_(src, non_blocking=True)
            done.record()
        return done

    def back(self, turn: int, delta: torch.Tensor, loss: torch.Tensor) -> torch.cuda.Event:
        """Start the copies of Δθ (into its turn's host buffer) and the loss to the host;
        returns the timing event that marks them done."""
        delta_host = self.delta_hosts[turn]
        return self.to_host(((delta, delta_host),
                             (loss.detach().reshape(1), self.loss_host)), timing=True)

    def host(self, a: torch.Tensor) -> np.ndarray:
        """A device array on the host (κ|m| before it is sent)."""
        if self._a_host is None:
            self._a_host = self.torch.empty(a.numel(), dtype=self.torch.float32,
                                            pin_memory=True)
            self._a_copies = self.torch.cuda.Stream(self.device)
        self.to_host(((a, self._a_host),), stream=self._a_copies).synchronize()
        return self._a_host.numpy()

    def comm_stream(self) -> contextlib.AbstractContextManager:
        """A CUDA stream of its own for the thread that folds m and sends (the current
        stream is per thread), so that its work never queues behind the next step's."""
        return self.torch.cuda.stream(self.torch.cuda.Stream(self.device))

    def compute_thread(self) -> None:
        """On the compute thread, first: the worker's GPU is its current device (CUDA's
        current device is per thread, and a new thread's is device 0), so that its events and
        streams are that device's."""
        self.torch.cuda.set_device(self.device)
