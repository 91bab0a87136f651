"""Test job: the same FLOPs a step done by a slow kernel or by a fast one (a compute-bound job).

Run under ``mpiexec -n 2 distdiag-wrap python tests/jobs/compute_bound.py --kernel K``
with ``OPENBLAS_NUM_THREADS=1`` (one core a rank). Each of ``--steps`` steps multiplies
two ``--n`` x ``--n`` float64 matrices (``2 n^3`` FLOPs), then joins an ``Allreduce``
and marks the step with ``distdiag.step(flops=2 n^3)``:

* ``--kernel fast``: one ``A @ B`` (BLAS dgemm: what the core delivers);
* ``--kernel tiled``: the same product tile by tile (``--tile``), in Python loops, as
  hand-written code often is: the same FLOPs, several times slower.

Rank 0 prints ``loop <s> s``: the job's wall-clock between its first and last Barrier.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

ap = argparse.ArgumentParser()
ap.add_argument("--kernel", choices=("fast", "tiled"), default="fast")
ap.add_argument("--steps", type=int, default=100)
ap.add_argument("--n", type=int, default=384)
ap.add_argument("--tile", type=int, default=32)
args = ap.parse_args()

n = args.n
rng = np.random.default_rng(0)
A = rng.random((n, n))
B = rng.random((n, n))
FLOPS = 2.0 * n**3


def fast() -> np.ndarray:
    return A @ B


def tiled() -> np.ndarray:
    t = args.tile
    C = np.zeros((n, n))
    for i in range(0, n, t):
        for j in range(0, n, t):
            acc = C[i : i + t, j : j + t]
            for k in range(0, n, t):
                acc += A[i : i + t, k : k + t] @ B[k : k + t, j : j + t]
    return C


import distdiag  # noqa: E402
from mpi4py import MPI  # noqa: E402

comm = MPI.COMM_WORLD
kernel = fast if args.kernel == "fast" else tiled
buf = np.ones(16)
out = np.empty_like(buf)
comm.Barrier()
t_job = time.perf_counter()
for _ in range(args.steps):
    C = kernel()
    buf[0] = C[0, 0]
    comm.Allreduce(buf, out)
    distdiag.step(flops=FLOPS)
comm.Barrier()
if comm.Get_rank() == 0:
    print(f"loop {time.perf_counter() - t_job:.4f} s", flush=True)
