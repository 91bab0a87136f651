"""A load imbalance that moves between ranks (tests/test_load_imbalance.py).

Every rank computes ``--work-s`` a step, then all-reduces; ``--extra-s`` of work more goes
each step to rank ``step % size`` (``--rotate``), or is spread evenly over every rank
(``--even``: the same total work, balanced; the healthy twin), or to nobody. ``--slow-rank R
--slow-s X``: rank R also works X s more every step (a straggler beside the imbalance).
``--halo``: after its work each rank exchanges with both neighbours of a ring (two
``Sendrecv``, right then left) before the all-reduce; ``--open``: a line instead of a ring (the
end ranks' missing neighbour is ``MPI.PROC_NULL``); ``--no-allreduce``: the exchange is the
step's only rendezvous. Rank 0 prints ``loop <s> s``: the first Barrier to the last.
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
    ap.add_argument("--halo", action="store_true")
    ap.add_argument("--open", action="store_true")
    ap.add_argument("--no-allreduce", action="store_true")
    a = ap.parse_args()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    x, y = np.ones(1024), np.empty(1024)
    left, right = (rank - 1) % size, (rank + 1) % size
    if a.open:
        left = MPI.PROC_NULL if rank == 0 else left
        right = MPI.PROC_NULL if rank == size - 1 else right
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
        if a.halo:
            comm.Sendrecv(x, dest=right, recvbuf=y, source=left)
            comm.Sendrecv(x, dest=left, recvbuf=y, source=right)
        if not a.no_allreduce:
            comm.Allreduce(MPI.IN_PLACE, x)
    comm.Barrier()
    if rank == 0:
        print(f"loop {time.perf_counter() - t0:.4f} s", flush=True)


if __name__ == "__main__":
    main()
