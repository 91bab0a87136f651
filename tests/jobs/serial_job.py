"""A small mpi4py "training loop" with injectable causes, run under distdiag-wrap by tests/test_serial_section.py.

Every iteration: every rank computes ``--work-s`` (a sleep standing in for
compute: on 2 shared cores a busy loop would measure the machine, not the
job), ``Allreduce`` of a gradient, then a ``bcast`` of the "config" from rank 0.

* ``--serial-rank R --serial-s S --every K``: before every K-th bcast rank R
  alone does S seconds of extra work (evaluation / logging: a sleep and a line
  appended to a log file) while the others wait in the bcast: a serial section.
* ``--bcast-every K --no-log``: the bcast only at every K-th iteration, and the
  serial work writes nothing: with ``--every K`` the textbook serial section (the
  root prepares the next thing and broadcasts it from one line, late at every call
  of it, nothing else recorded; issue 20).
* ``--slow-rank Q --slow-s D``: rank Q computes D seconds longer in every
  iteration (a rank on a loaded node): a straggler at the Allreduce.
* ``--halo-bytes B``: after the compute, every iteration, each rank swaps B bytes with its
  neighbours in a ring (``Sendrecv`` to the right, from the left: a halo exchange), so a
  slow rank holds its right neighbour first, through a point-to-point call.

It knows nothing about distdiag. Rank 0 prints the injected seconds and the
loop's wall-clock (``loop <s> s``: from the first Barrier to the final
reduction), so a test measures what a fault cost by running the job with and
without it (tests/truth.py): with 4 ranks on 2 cores the injected sleep is not
that saving.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
from mpi4py import MPI


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=25)
    p.add_argument("--work-s", type=float, default=0.02)
    p.add_argument("--serial-rank", type=int, default=-1)
    p.add_argument("--serial-s", type=float, default=0.3)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow-s", type=float, default=0.0)
    p.add_argument("--log", default=os.devnull)
    p.add_argument("--bcast-every", type=int, default=1, help="bcast only at every K-th iteration (its own line)")
    p.add_argument("--no-log", action="store_true", help="the serial work writes nothing (no recorded calls)")
    p.add_argument("--halo-bytes", type=int, default=0, help="a ring Sendrecv of this many bytes each iteration")
    p.add_argument("--halo-nonblocking", action="store_true", help="the halo by Irecv + Isend + Waitall instead")
    a = p.parse_args()

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    grad = np.ones(4096)
    out = np.empty_like(grad)
    serial_s = slow_s = 0.0
    cfg = {"lr": 0.1}
    size = comm.Get_size()
    halo = np.full(max(a.halo_bytes, 0) // 8, float(rank))
    halo_in = np.empty_like(halo)
    comm.Barrier()
    t0 = time.perf_counter()
    for it in range(a.iters):
        time.sleep(a.work_s)
        if rank == a.slow_rank:
            time.sleep(a.slow_s)
            slow_s += a.slow_s
        if a.halo_bytes > 0 and a.halo_nonblocking:
            reqs = [comm.Irecv(halo_in, source=(rank - 1) % size), comm.Isend(halo, dest=(rank + 1) % size)]
            MPI.Request.Waitall(reqs)
        elif a.halo_bytes > 0:
            comm.Sendrecv(halo, dest=(rank + 1) % size, recvbuf=halo_in, source=(rank - 1) % size)
        comm.Allreduce(grad, out, op=MPI.SUM)
        if rank == a.serial_rank and it % a.every == a.every - 1:
            time.sleep(a.serial_s)  # evaluation / logging that only this rank runs
            if not a.no_log:
                with open(a.log, "a") as f:
                    f.write(f"iter {it} loss {float(out[0]):.3f}\n")
            serial_s += a.serial_s
        if it % a.bcast_every == a.bcast_every - 1:
            cfg = comm.bcast(cfg, root=0)
    tot = comm.allreduce(np.array([serial_s, slow_s]), op=MPI.SUM)
    loop_s = time.perf_counter() - t0
    if rank == 0:
        print(f"serial_job: injected serial {tot[0]:.3f} s slow {tot[1]:.3f} s, loop {loop_s:.3f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
