"""A load imbalance that moves between ranks (tests/test_load_imbalance.py).

Every rank computes ``--work-s`` a step, then all-reduces; ``--extra-s`` of work more goes
each step to rank ``step % size`` (``--rotate``), or is spread evenly over every rank
(``--even``: the same total work, balanced; the healthy twin), or to nobody. ``--slow-rank R
--slow-s X``: rank R also works X s more every step (a straggler beside the imbalance). Rank 0
prints ``loop <s> s``: the first Barrier to the last.
"""

import argparse
import time

import numpy as np
from mpi4py import MPI


def work(s: float) -> None:
    """``s`` seconds of the rank's own work, asleep: with more ranks than cores it costs no core."""
    time.sleep(s)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--work-s", type=float, default=0.02)
    ap.add_argument("--extra-s", type=float, default=0.04)
    how = ap.add_mutually_exclusive_group()
    how.add_argument("--rotate", action="store_true")
    how.add_argument("--even", action="store_true")
    ap.add_argument("--slow-rank", type=int, default=-1)
    ap.add_argument("--slow-s", type=float, default=0.0)
    a = ap.parse_args()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    x = np.ones(1024)
    comm.Barrier()
    t0 = time.perf_counter()
    for step in range(a.steps):
        s = a.work_s
        if a.rotate and step % size == rank:
            s += a.extra_s
        elif a.even:
            s += a.extra_s / size
        if rank == a.slow_rank:
            s += a.slow_s
        work(s)
        comm.Allreduce(MPI.IN_PLACE, x)
    comm.Barrier()
    if rank == 0:
        print(f"loop {time.perf_counter() - t0:.4f} s", flush=True)


if __name__ == "__main__":
    main()
