#!/bin/bash
# Inside an allocation (salloc, or an sbatch script): an mpi4py program on
# every task, then the analysis.
#   salloc -N2 --ntasks-per-node=4 launchers/srun-mpi.sh python train.py
set -uo pipefail
export DISTDIAG_DIR=${DISTDIAG_DIR:-$PWD/distdiag-${SLURM_JOB_ID:?run inside a Slurm allocation}}
srun --mpi="${DISTDIAG_SRUN_MPI:-pmi2}" distdiag-wrap "$@"
rc=$?
distdiag analyze "$DISTDIAG_DIR"
exit "$rc"
