"""A job for the clock tests and benchmark: collectives (MPI mode) or sleeps (plain
mode), with ground truth about this rank's clock.

Ground truth: libfaketime fakes every clock call that goes through libc, but
not a raw ``clock_gettime`` system call. So each rank reads the kernel's true
CLOCK_MONOTONIC (shared by every process on the host) through
``syscall(SYS_clock_gettime)`` next to its (possibly faked) ``perf_counter_ns``,
and saves the pairs to ``--truth-dir/truth-RANK.npy``: columns (true_ns,
perf_ns, uncertainty_ns). A test fits perf = a + b * true per rank and knows
exactly how every rank's clock maps onto rank 0's.

In MPI mode rank 0 also prints the loop's wall-clock (``loop <s> s``, first
Barrier to the final reduction), so a test compares a cost with what the
same job saves without its slow rank (tests/truth.py).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import select
import time
from pathlib import Path

import numpy as np

_SYS_CLOCK_GETTIME = 228  # x86_64
_CLOCK_MONOTONIC = 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_libc = ctypes.CDLL(None, use_errno=True)
_ts = _Timespec()


def true_ns() -> int:
    """The kernel's CLOCK_MONOTONIC, bypassing libfaketime (a raw system call)."""
    _libc.syscall(_SYS_CLOCK_GETTIME, _CLOCK_MONOTONIC, ctypes.byref(_ts))
    return _ts.tv_sec * 1_000_000_000 + _ts.tv_nsec


class Truth:
    def __init__(self) -> None:
        self.rows: list[tuple[int, int, int]] = []

    def sample(self, tries: int = 5) -> None:
        best = None
        for _ in range(tries):  # keep the tightest bracket
            a = time.perf_counter_ns()
            t = true_ns()
            b = time.perf_counter_ns()
            if best is None or b - a < best[2]:
                best = (t, a + (b - a) // 2, b - a)
        assert best is not None
        self.rows.append(best)

    def save(self, d: Path, rank: int) -> None:
        d.mkdir(parents=True, exist_ok=True)
        np.save(d / f"truth-{rank}.npy", np.array(self.rows, dtype=np.int64))


def _rank() -> tuple[int, int]:
    for r, s in (("PMI_RANK", "PMI_SIZE"), ("RANK", "WORLD_SIZE")):
        if r in os.environ:
            return int(os.environ[r]), int(os.environ[s])
    return 0, 1


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["mpi", "plain"], default="mpi")
    p.add_argument("--truth-dir", type=Path, required=True)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--delay-s", type=float, default=0.03)
    p.add_argument("--work-s", type=float, default=0.01)
    p.add_argument("--poll", action="store_true", help="Iallreduce + sleep/Test instead of a blocking Allreduce")
    a = p.parse_args()
    truth = Truth()
    truth.sample()
    injected_s = 0.0
    if a.mode == "mpi":
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        rank = comm.Get_rank()
        buf = np.ones(1024)
        out = np.empty_like(buf)
        comm.Barrier()
        t_loop = true_ns()
        for it in range(a.iters):
            t_end = time.perf_counter() + a.work_s
            x = 0
            while time.perf_counter() < t_end:  # pure-Python compute: holds the GIL
                x += 1
            if rank == a.slow_rank:
                # select's timeout is relative (libfaketime only scales it by the rate);
                # time.sleep turns it into an absolute deadline, which libfaketime overshoots
                select.select([], [], [], a.delay_s)
                injected_s += a.delay_s
            if a.poll:
                # Wait without burning a core: on 2 cores, 3 ranks busy-polling in a blocking
                # Allreduce decide when the 4th gets to run, and that noise is the cost's.
                req = comm.Iallreduce(buf, out, op=MPI.SUM)
                while not req.Test():
                    time.sleep(0.0002)
            else:
                comm.Allreduce(buf, out, op=MPI.SUM)
            if it % 5 == 4:
                comm.Barrier()
            truth.sample()
        total = comm.allreduce(injected_s, op=MPI.SUM)
        loop_s = (true_ns() - t_loop) / 1e9  # the true clock: this rank's own may be skewed
        if rank == 0:
            print(f"clock_job: injected delay {total:.4f} s on rank {a.slow_rank}, loop {loop_s:.4f} s", flush=True)
    else:
        rank, _size = _rank()
        for _ in range(a.iters):
            t_end = time.perf_counter() + a.work_s
            x = 0
            while time.perf_counter() < t_end:
                x += 1
            time.sleep(a.work_s)
            truth.sample()
    truth.sample()
    truth.save(a.truth_dir, rank)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
