#!/bin/bash
# Without Slurm: N ranks with mpiexec (the PyPI mpich wheel or your MPI), then the analysis.
#   launchers/mpiexec.sh 4 python train.py
set -uo pipefail
n=${1:?usage: $0 NRANKS python train.py [args]}; shift
export DISTDIAG_DIR=${DISTDIAG_DIR:-$PWD/distdiag-$(date +%Y%m%d-%H%M%S)}
mpiexec -n "$n" distdiag-wrap "$@"
rc=$?
distdiag analyze "$DISTDIAG_DIR"
exit "$rc"
