"""Small collectives called back to back (tests/test_small_collectives.py).

Every rank all-reduces ``--values`` doubles, ``--per-call`` of them a call (``--per-call 1``:
one value a call, the fault; ``--per-call`` as large as ``--values``: one call, the fused
twin), ``--steps`` times with ``--work-s`` of work (asleep) before each step. ``--nonblocking
each``: each call an ``Iallreduce`` waited for at once; ``--nonblocking all``: the step's calls
posted, then one ``Waitall``. Rank 0 prints ``loop <s> s``: the first Barrier to the last.
"""

import argparse
import time

import numpy as np
from mpi4py import MPI


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--values", type=int, default=2000)
    ap.add_argument("--per-call", type=int, default=1)
    ap.add_argument("--work-s", type=float, default=0.02)
    ap.add_argument("--nonblocking", choices=["each", "all"])
    a = ap.parse_args()
    comm = MPI.COMM_WORLD
    x = np.ones(a.values)
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(a.steps):
        time.sleep(a.work_s)
        calls = range(0, a.values, a.per_call)
        if a.nonblocking == "all":
            MPI.Request.Waitall([comm.Iallreduce(MPI.IN_PLACE, x[i : i + a.per_call]) for i in calls])
        elif a.nonblocking == "each":
            for i in calls:
                comm.Iallreduce(MPI.IN_PLACE, x[i : i + a.per_call]).Wait()
        else:
            for i in calls:
                comm.Allreduce(MPI.IN_PLACE, x[i : i + a.per_call])
    comm.Barrier()
    if comm.Get_rank() == 0:
        print(f"loop {time.perf_counter() - t0:.4f} s", flush=True)


if __name__ == "__main__":
    main()
