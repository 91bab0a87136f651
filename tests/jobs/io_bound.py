"""Test job: a rank that reads its samples one small file each, every iteration (an io-bound rank).

Run under ``mpiexec -n 2 distdiag-wrap python tests/jobs/io_bound.py --data A --data B ...``:
rank r reads ``--per-iter`` files of its own (``s00000.bin``...) from the r-th
``--data`` directory each iteration, as a loader without workers does, then
computes for ``--compute-s`` and joins an ``Allreduce``. Put rank 0's directory on
the slow FUSE mount (tests/slowfs.py) and rank 1's on the local disk: rank 0 is
held by its file system, the other waits for it. Both local: the healthy twin.

Rank 0 prints ``loop <s> s``: the job's wall-clock between the first and the last
Barrier (tests/truth.py).
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
from mpi4py import MPI

ap = argparse.ArgumentParser()
ap.add_argument("--data", action="append", required=True)
ap.add_argument("--iters", type=int, default=10)
ap.add_argument("--per-iter", type=int, default=60)
ap.add_argument("--nfiles", type=int, default=500)
ap.add_argument("--compute-s", type=float, default=0.02)
args = ap.parse_args()

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
data = args.data[rank % len(args.data)]
buf = np.ones(1024)
out = np.empty_like(buf)
a = np.random.default_rng(rank).random((64, 64))
comm.Barrier()
t_job = time.perf_counter()
k = 0
for it in range(args.iters):
    for _ in range(args.per_iter):
        with open(os.path.join(data, f"s{k % args.nfiles:05d}.bin"), "rb") as f:
            f.read()
        k += 1
    t_end = time.perf_counter() + args.compute_s
    while time.perf_counter() < t_end:  # compute: a fixed time, not work
        a = a @ a
        a /= np.abs(a).max() + 1.0
    comm.Allreduce(buf, out)
comm.Barrier()
if rank == 0:
    print(f"loop {time.perf_counter() - t_job:.4f} s", flush=True)
