#!/bin/bash
# Inside an allocation: a PyTorch program that calls
# torch.distributed.init_process_group("nccl" or "gloo") with the default
# env:// method, one task per GPU. Slurm's variables become torch's.
#   sbatch -N2 --ntasks-per-node=4 --gpus-per-node=4 launchers/srun-torch.sh python train.py
set -uo pipefail
export DISTDIAG_DIR=${DISTDIAG_DIR:-$PWD/distdiag-${SLURM_JOB_ID:?run inside a Slurm allocation}}
MASTER_ADDR=${MASTER_ADDR:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)}
MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}
export MASTER_ADDR MASTER_PORT
# RANK/WORLD_SIZE/LOCAL_RANK per task: set inside each task from its own SLURM_* values.
srun bash -c 'RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID exec distdiag-wrap "$@"' _ "$@"
rc=$?
distdiag analyze "$DISTDIAG_DIR"
exit "$rc"
