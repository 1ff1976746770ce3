"""A torch worker's mini-batches: its data stream, each batch made just after its dropout seed
is set (so the masks are a function of (seed, worker, step) however the batch is made), and on
a GPU the next one made and sent ahead while the device still computes this step."""

from __future__ import annotations

from gem_mpi.config import Config
from gem_mpi.run.rank import data_stream, own_plan, seed_dropout, worker_data


class WorkerBatches:
    """Worker ``rank``'s batches from ``start_seq`` on: its own stream, or ``plan`` (its
    dealt batches, :mod:`gem_mpi.problem.elastic`), to which :meth:`extend` adds more."""

    def __init__(self, cfg: Config, rank: int, n_workers: int, start_seq: int,
                 plan: list | None, device: object) -> None:
        import torch

        self.torch, self.device = torch, device
        self.seed, self.rank = cfg.data.seed, rank
        data = self.data = worker_data(cfg)
        self.n_workers, self.plan = n_workers, plan
        self.steps, self.batches = data_stream(data, rank, n_workers, start_seq, plan)
        self._next: tuple | None = None  # (seq, x, y, ready event): a batch on its way (GPU)

    def batch(self, seq: int) -> tuple:
        """Mini-batch ``seq`` on the device: the one prefetched, else made now. Its dropout
        seed is set just before it is made, so both ways draw the same masks."""
        torch = self.torch
        if self._next is not None:
            next_seq, x, y, ready = self._next
            self._next = None
            if next_seq == seq:
                torch.cuda.current_stream().wait_event(ready)
                return x, y
        seed_dropout(self.seed, self.rank, seq)  # randomness a function of (seed, worker, step)
        x, y = next(self.batches)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def prefetch(self, seq: int, copies: object) -> None:
        """Make mini-batch ``seq`` and start its copy to the device on the side stream
        ``copies``."""
        torch = self.torch
        if seq >= self.steps:
            return
        seed_dropout(self.seed, self.rank, seq)
        x, y = next(self.batches)
        x, y = x.pin_memory(), y.pin_memory()
        compute = torch.cuda.current_stream()
        with torch.cuda.stream(copies):
            x = x.to(self.device, non_blocking=True)
            y = y.to(self.device, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        x.record_stream(compute)  # allocated on the side stream, used on the compute one
        y.record_stream(compute)
        self._next = (seq, x, y, ready)

    def extend(self, runs: list) -> list:
        """Dealt ``runs`` more batches (a departed worker's) after its own plan: the stream
        goes on with them. Returns the runs added, as the plan now holds them."""
        own = own_plan(self.data, self.n_workers, self.rank, self.plan)
        start, self.plan = self.steps, own + list(runs)
        self.batches.close()
        self._next = None
        self.steps, self.batches = data_stream(self.data, self.rank, self.n_workers, start,
                                               self.plan)
        return self.plan[len(own):]

    def close(self) -> None:
        """End the data stream: its loader processes (--loader-workers) stop now."""
        self.batches.close()
