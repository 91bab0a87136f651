"""4 MPI ranks; rank HANG_RANK never reaches the Barrier the others enter.

Before it hangs, the hanging rank reads a file (DATA) and then sits in
``distdiag.phase("evaluate")`` sleeping forever, as a rank stuck in its own
code would. Each rank writes its pid to PIDDIR/<rank>.pid.

usage: hang_barrier.py PIDDIR DATA HANG_RANK
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
from mpi4py import MPI

import distdiag

piddir, data, hang_rank = sys.argv[1], sys.argv[2], int(sys.argv[3])
comm = MPI.COMM_WORLD
rank = comm.Get_rank()
buf = np.ones(256)
out = np.empty_like(buf)
for _ in range(5):
    comm.Allreduce(buf, out, op=MPI.SUM)
with open(os.path.join(piddir, f"{rank}.pid"), "w") as f:
    f.write(str(os.getpid()))
if rank == hang_rank:
    with open(data, "rb") as f:
        f.read()
    with distdiag.phase("evaluate"):
        while True:  # stuck in its own code: no collective, no recorded call
            time.sleep(0.05)
comm.Barrier()  # HANG-SITE: the others wait here forever
