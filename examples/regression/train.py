"""Train regression.py's MLP with GEM from Python. Every rank runs this script:

    mpirun -n 5 python train.py [--metrics run.h5]

Rank 0 gets the trained model back; the other ranks get how the run ended.
"""

from __future__ import annotations

import argparse
import sys

import torch
from regression import make_dataset, make_model

import gem_mpi


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--metrics", default=None)
    p.add_argument("--epochs", type=int, default=2)
    a = p.parse_args()
    try:
        result = gem_mpi.fit(make_model, make_dataset, loss="mse", method="gem", lr=0.02,
                             batch_size=32, epochs=a.epochs, eval_every=0, metrics=a.metrics)
    except gem_mpi.UsageError:
        return 2  # rank 0 has printed the one line
    if result.model is not None:  # rank 0
        x, y = make_dataset("test")[:]
        with torch.no_grad():
            mse = torch.nn.functional.mse_loss(result.model(x), y).item()
        print(f"{result.outcome}: test mse of the returned model {mse:.4f} (the variance of "
              f"the targets is {y.var().item():.4f})")
    return result.exit_code


if __name__ == "__main__":
    sys.exit(main())
