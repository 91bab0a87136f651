"""The built-in demo job: a small MPI "training loop" with one slow rank.

Run by ``distdiag demo`` as ``mpiexec -n 4 distdiag-wrap python -m distdiag.demo_job``.
Each iteration every rank does a little real numpy work, then an
``Allreduce`` of a gradient-sized buffer and a ``Barrier`` now and then; the
slow rank sleeps ``--delay-s`` extra before its Allreduce, as a rank on a
loaded node would. Rank 0 prints the injected delay and the loop's wall-clock
(first Barrier to the final reduction): what the delay cost the job is the
loop's wall-clock against the same job's without it, which is less than the
injected sleep when ranks outnumber cores (the others get the sleeper's core).
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="distdiag.demo_job")
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--slow-rank", type=int, default=2, help="-1: no slow rank")
    p.add_argument("--delay-s", type=float, default=0.05)
    p.add_argument("--work-n", type=int, default=96, help="matrix size of each rank's compute")
    p.add_argument("--nbytes", type=int, default=1 << 18)
    a = p.parse_args(argv)

    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    rng = np.random.default_rng(rank)
    m = rng.standard_normal((a.work_n, a.work_n))
    grad = np.ones(a.nbytes // 8)
    out = np.empty_like(grad)
    injected_s = 0.0
    comm.Barrier()
    t0 = time.perf_counter()
    for it in range(a.iters):
        for _ in range(3):
            m = np.tanh(m @ m.T / a.work_n)
        if rank == a.slow_rank:
            time.sleep(a.delay_s)
            injected_s += a.delay_s
        comm.Allreduce(grad, out, op=MPI.SUM)
        if it % 10 == 9:
            comm.Barrier()
    total = comm.allreduce(injected_s, op=MPI.SUM)
    loop_s = time.perf_counter() - t0
    if rank == 0:
        print(f"demo: {comm.Get_size()} ranks, {a.iters} iterations, injected delay {total:.3f} s on rank {a.slow_rank},"
              f" loop {loop_s:.3f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
