"""A plain mpi4py program, run under distdiag-wrap by tests/test_mpi_hook.py.

It knows nothing about distdiag. It binds COMM_WORLD by name at import (the
hook must already have swapped it in), runs collectives on the world, a Dup
and a Split, some point-to-point, and prints one line per rank that the test
compares with an unwrapped run.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI
from mpi4py.MPI import COMM_WORLD as comm

rank, size = comm.Get_rank(), comm.Get_size()
total = 0.0
x = np.full(1024, float(rank))
y = np.empty_like(x)
for i in range(5):
    comm.Allreduce(x, y, op=MPI.SUM)
    total += float(y[0])
    total += comm.allreduce(i)
dup = comm.Dup()
half = comm.Split(rank % 2, rank)
total += half.allreduce(rank) + dup.bcast(rank * 3 if rank == 0 else None, root=0)
req = comm.Isend(x[:10], dest=(rank + 1) % size, tag=5)
buf = np.empty(10)
comm.Recv(buf, source=(rank - 1) % size, tag=5)
req.Wait()
total += float(buf[0])
half.Free()
dup.Free()
print(f"rank {rank} total {total} type {type(comm).__name__};", flush=True)
