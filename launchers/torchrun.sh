#!/bin/bash
# torchrun on one node (or one torchrun per node, e.g. from srun), each worker
# under distdiag.wrap, then the analysis.
#   launchers/torchrun.sh 4 train.py --epochs 3
set -uo pipefail
n=${1:?usage: $0 NPROC_PER_NODE train.py [args]}; shift
export DISTDIAG_DIR=${DISTDIAG_DIR:-$PWD/distdiag-$(date +%Y%m%d-%H%M%S)}
torchrun --standalone --nproc-per-node "$n" -m distdiag.wrap "$@"
rc=$?
distdiag analyze "$DISTDIAG_DIR"
exit "$rc"
