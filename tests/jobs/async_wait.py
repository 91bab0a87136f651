"""A non-blocking all-reduce that one rank posts late, waited on at once: `python async_wait.py torch|mpi N SLEEP`.

Every rank posts N non-blocking all-reduces (torch ``async_op=True`` on gloo,
or mpi4py ``Iallreduce``) and waits on each right away; rank 1 sleeps SLEEP
seconds before posting each one. The other ranks' waits are waiting for rank 1.
"""

from __future__ import annotations

import sys
import time


def main() -> None:
    backend, n, sleep = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    if backend == "torch":
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank = dist.get_rank()
        t = torch.ones(1024)
        for _ in range(n):
            if rank == 1:
                time.sleep(sleep)
            dist.all_reduce(t, async_op=True).wait()
        dist.barrier()
        dist.destroy_process_group()
    else:
        import numpy as np
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        rank = comm.Get_rank()
        a, b = np.ones(1024), np.empty(1024)
        for _ in range(n):
            if rank == 1:
                time.sleep(sleep)
            comm.Iallreduce(a, b).Wait()
        comm.Barrier()


if __name__ == "__main__":
    main()
