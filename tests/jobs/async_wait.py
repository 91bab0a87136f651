"""A non-blocking all-reduce that one rank posts late, waited on at once: `python async_wait.py torch|mpi N SLEEP`.

Every rank posts N non-blocking all-reduces (torch ``async_op=True`` on gloo,
or mpi4py ``Iallreduce``) and waits on each right away; rank 1 sleeps SLEEP
seconds before posting each one. The other ranks' waits are waiting for rank 1.

Each rank prints what it measured itself, ``async_wait: rank R loop L s waited
W s``: L the loop's wall-clock (first post to the last wait's return), W the
time it spent inside the waits. That is the truth a test holds the breakdown
to: how long a rank really waited is not the injected sleep when ranks
outnumber cores.
"""

from __future__ import annotations

import sys
import time


def main() -> None:
    backend, n, sleep = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    waited = 0.0
    if backend == "torch":
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank = dist.get_rank()
        t = torch.ones(1024)
        t_loop = time.perf_counter()
        for _ in range(n):
            if rank == 1:
                time.sleep(sleep)
            w = dist.all_reduce(t, async_op=True)
            t0 = time.perf_counter()
            w.wait()
            waited += time.perf_counter() - t0
        loop = time.perf_counter() - t_loop
        dist.barrier()
        dist.destroy_process_group()
    else:
        import numpy as np
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        rank = comm.Get_rank()
        a, b = np.ones(1024), np.empty(1024)
        t_loop = time.perf_counter()
        for _ in range(n):
            if rank == 1:
                time.sleep(sleep)
            req = comm.Iallreduce(a, b)
            t0 = time.perf_counter()
            req.Wait()
            waited += time.perf_counter() - t0
        loop = time.perf_counter() - t_loop
        comm.Barrier()
    print(f"async_wait: rank {rank} loop {loop:.6f} s waited {waited:.6f} s", flush=True)


if __name__ == "__main__":
    main()
