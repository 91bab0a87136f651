#!/bin/bash
# Inside an allocation (salloc, or an sbatch script): an mpi4py program on
# every task, then the analysis.
#   salloc -N2 --ntasks-per-node=4 launchers/srun-mpi.sh python train.py
# The PyPI mpich wheel can hang in MPI_Init under Slurm's pmi2 plugin (README,
# "MPI under srun"); with it, let its Hydra start the ranks (Slurm starts one
# proxy per node, with --mpi=none):
#   DISTDIAG_LAUNCH="mpiexec -launcher slurm" salloc -N2 --ntasks-per-node=4 launchers/srun-mpi.sh python train.py
set -uo pipefail
export DISTDIAG_DIR=${DISTDIAG_DIR:-$PWD/distdiag-${SLURM_JOB_ID:?run inside a Slurm allocation}}
LAUNCH=${DISTDIAG_LAUNCH:-srun --mpi=${DISTDIAG_SRUN_MPI:-pmi2}}
[[ ${LAUNCH%% *} != *mpiexec* ]] || export HYDRA_LAUNCHER_EXTRA_ARGS=${HYDRA_LAUNCHER_EXTRA_ARGS:---mpi=none}
# shellcheck disable=SC2086  # LAUNCH is a word list on purpose
$LAUNCH distdiag-wrap "$@"
rc=$?
distdiag analyze "$DISTDIAG_DIR"
exit "$rc"
