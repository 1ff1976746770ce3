#!/usr/bin/env bash
# jobs/lib/bind.sh - per-rank wrapper: GPU binding by local rank, then exec the command.
#
#   srun ... jobs/lib/bind.sh python -m gem_mpi.train ...     (or mpirun ... jobs/lib/bind.sh)
#
# Rank 0, the master, is a CPU rank: it sees no GPU (CUDA_VISIBLE_DEVICES=""), unless
# GEM_NO_MASTER=1 (--method sync: every rank is a worker, rank 0 too); with GEM_MASTERS=K
# (--masters K), ranks 0..K-1 are masters and see none. A worker on
# local rank L of its node sees one GPU: entry L mod G of the node's GPU list, which is
# CUDA_VISIBLE_DEVICES as Slurm set it for the job (--gpus-per-node, --gres=gpu:G), or
# 0..GEM_GPUS_PER_NODE-1 where the site sets no CUDA_VISIBLE_DEVICES. With no GPU list the
# environment is left as it is (CPU nodes). A worker that sees a single GPU uses cuda:0, the
# same GPU gem_mpi itself would pick (cuda:<local rank mod GPUs>), and no library can create a
# context on another rank's GPU. GEM_BIND_VERBOSE=1 prints one line per rank.
#
# Ranks come from Open MPI's mpirun (OMPI_COMM_WORLD_*) or from srun (SLURM_PROCID and
# SLURM_LOCALID; under mpirun these describe the daemon, not the rank, hence the order).
set -euo pipefail

rank="${OMPI_COMM_WORLD_RANK:-${SLURM_PROCID:-0}}"
local_rank="${OMPI_COMM_WORLD_LOCAL_RANK:-${SLURM_LOCALID:-0}}"

gpus=()
if [[ -n ${CUDA_VISIBLE_DEVICES:-} && ${CUDA_VISIBLE_DEVICES} != NoDevFiles ]]; then
  IFS=, read -r -a gpus <<<"$CUDA_VISIBLE_DEVICES"
elif [[ ${GEM_GPUS_PER_NODE:-0} -gt 0 ]]; then
  for ((i = 0; i < GEM_GPUS_PER_NODE; i++)); do gpus+=("$i"); done
fi

if ((rank < ${GEM_MASTERS:-1})) && [[ ${GEM_NO_MASTER:-0} != 1 ]]; then
  export CUDA_VISIBLE_DEVICES=""
elif ((${#gpus[@]})); then
  export CUDA_VISIBLE_DEVICES="${gpus[local_rank % ${#gpus[@]}]}"
fi
if [[ ${GEM_BIND_VERBOSE:-0} == 1 ]]; then
  printf 'bind.sh: rank %s local %s on %s: CUDA_VISIBLE_DEVICES=%s\n' "$rank" "$local_rank" \
    "$(hostname -s)" "${CUDA_VISIBLE_DEVICES-<unset>}" >&2
fi
exec "$@"
