"""The same model trained the way a user would without gem_mpi: one process, torch's
DataLoader with loader processes, momentum SGD, bf16 autocast, linear warm-up then cosine
(LambdaLR), BatchNorm's own running statistics, one pass over the test set at the end.

    python reference.py --epochs 3 --batch-size 64 --lr 0.05 --warmup-steps 60

It reads Fashion-MNIST through gem_mpi's loader only to get the very tensors a gem_mpi run
trains on (the same scaling); everything else is plain PyTorch.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F
from fashion_resnet import make_model
from torch.utils.data import DataLoader, TensorDataset

from gem_mpi.problem.batches import iterate_batches
from gem_mpi.problem.datasets import load_split


def tensors(split: str) -> TensorDataset:
    data = load_split("fashion-mnist", None, split, "fashion_resnet:make_model")
    xs, ys = zip(*iterate_batches(data, 1000, 1, 0, shuffle=False, drop_last=False))
    return TensorDataset(torch.cat(xs), torch.cat(ys))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--warmup-steps", type=int, default=60)
    ap.add_argument("--loader-workers", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-steps", type=int, default=0, help="stop after this many (0: all)")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    train, test = tensors("train"), tensors("test")
    loader = DataLoader(train, batch_size=args.batch_size, shuffle=True, drop_last=True,
                        num_workers=args.loader_workers,
                        persistent_workers=args.loader_workers > 0)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    steps = args.epochs * len(loader)
    if args.max_steps:
        steps = min(steps, args.max_steps)

    def factor(step: int) -> float:  # gem_mpi's warm-up and cosine, step by step
        if step < args.warmup_steps:
            return (step + 1) / args.warmup_steps
        done = (step - args.warmup_steps) / (steps - args.warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * done))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    t0 = time.perf_counter()
    model.train()
    done = 0
    for _ in range(args.epochs):
        for x, y in loader:
            if done == steps:
                break
            done += 1
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
    wall = time.perf_counter() - t0
    model.eval()
    correct, total, loss_sum = 0, 0, 0.0
    with torch.no_grad():
        for x, y in DataLoader(test, batch_size=1000):
            out = model(x)
            loss_sum += float(F.cross_entropy(out, y, reduction="sum"))
            correct += int((out.argmax(1) == y).sum())
            total += len(y)
    print(f"reference: {steps} steps of batch {args.batch_size} in {wall:.1f} s, "
          f"test loss {loss_sum / total:.4f}, test accuracy {100 * correct / total:.2f} %")


if __name__ == "__main__":
    main()
