"""gem_mpi.fit on plugins.bn_cnn (a BatchNorm CNN) with --save: every rank runs

    python fit_bn.py SAVE METRICS RETURNED

and rank 0 writes the model fit returned to RETURNED (torch.save of its state_dict), for
tests/test_training_loop.py to hold against the file --save wrote."""

from __future__ import annotations

import sys

import torch
from plugins import bn_cnn

import gem_mpi


def main() -> int:
    save, metrics, returned = sys.argv[1:4]
    result = gem_mpi.fit(bn_cnn, "fashion-mnist", loss="cross_entropy", max_steps=150,
                         eval_every=0, bn_batches=20, metrics=metrics, save=save)
    if result.model is not None:  # rank 0
        torch.save(result.model.state_dict(), returned)
    return result.exit_code


if __name__ == "__main__":
    sys.exit(main())
