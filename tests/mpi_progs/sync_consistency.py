"""Run SyncTrainer steps (the code --method sync runs) and check after every step that
every rank holds the same parameters and optimizer state, bit for bit. Prints SYNC-OK on rank 0."""

import hashlib
import sys

import numpy as np

from gem_mpi import config
from gem_mpi.baseline.sync import SyncTrainer
from gem_mpi.problem import build_problem
from gem_mpi.run.rank import local_placement
from gem_mpi.transport import start_mpi

comm = start_mpi("multiple")  # as the launcher does for --method sync
cfg, _ = config.parse(["--method", "sync", *sys.argv[2:]])
steps = int(sys.argv[1])
trainer = SyncTrainer(cfg, comm, build_problem(cfg.data, with_theta0=False),
                      local_placement(comm))
before = trainer.theta()
for step in range(steps):
    trainer.step()
    state = np.concatenate([trainer.theta(), *trainer.shared_state().values()])
    digests = comm.allgather(hashlib.sha256(state.tobytes()).hexdigest())
    sums = comm.allgather(float(np.sum(state, dtype=np.float64)))
    if len(set(digests)) != 1:
        print(f"step {step}: ranks differ: sums {sums}", flush=True)
        comm.Abort(1)
moved = float(np.max(np.abs(trainer.theta() - before)))
trainer.close()
if comm.Get_rank() == 0:
    print(f"SYNC-OK {steps} steps, max |θ - θ0| {moved:.3g}", flush=True)
