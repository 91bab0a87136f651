"""4 MPI ranks; at the 6th collective (seq 5 on world) rank BAD_RANK passes BAD_COUNT
doubles to Allreduce where the others pass 1024.

MPICH's reaction depends on the count: a shorter non-empty buffer aborts the job
at once ("Message truncated"); an empty one returns at once on that rank, which
goes on to the Barrier while the others wait in the Allreduce forever. Each
rank writes its pid to PIDDIR/<rank>.pid before the mismatch.

usage: mismatch_allreduce.py PIDDIR BAD_RANK BAD_COUNT
"""

from __future__ import annotations

import os
import sys

import numpy as np
from mpi4py import MPI

piddir, bad_rank, bad_count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
comm = MPI.COMM_WORLD
rank = comm.Get_rank()
buf = np.ones(1024)
out = np.empty_like(buf)
for _ in range(5):
    comm.Allreduce(buf, out, op=MPI.SUM)
with open(os.path.join(piddir, f"{rank}.pid"), "w") as f:
    f.write(str(os.getpid()))
n = bad_count if rank == bad_rank else len(buf)
comm.Allreduce(buf[:n], out[:n], op=MPI.SUM)  # MISMATCH-SITE
comm.Barrier()
