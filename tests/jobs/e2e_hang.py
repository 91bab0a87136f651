"""A 4-rank MPI job that gets stuck: rank HANG_RANK never reaches the
Allreduce the others block in. Each rank writes its pid to PIDDIR so the test
can SIGKILL exactly these processes."""

from __future__ import annotations

import os
import sys
import time

import numpy as np
from mpi4py import MPI

piddir, hang_rank = sys.argv[1], int(sys.argv[2])
comm = MPI.COMM_WORLD
rank = comm.Get_rank()
with open(os.path.join(piddir, f"{rank}.pid"), "w") as f:
    f.write(str(os.getpid()))
buf = np.ones(1024)
out = np.empty_like(buf)
for it in range(5):
    comm.Allreduce(buf, out, op=MPI.SUM)
comm.Barrier()
if rank == hang_rank:
    while True:  # stuck outside any collective, as a rank in a deadlock would be
        time.sleep(0.1)
comm.Allreduce(buf, out, op=MPI.SUM)  # the others wait here forever
