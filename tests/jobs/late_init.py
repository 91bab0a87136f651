"""Rank 1 is busy on its own for ``BUSY_S`` seconds before ``from mpi4py import
MPI`` (it opens a file in a loop, which the fileio hook records); rank 0
imports at once and so waits in MPI_Init for rank 1. Meanwhile a thread of
rank 0 keeps opening a file (a prefetching data loader), so rank 0 records
activity all through its MPI_Init: only the MPI_Init span tells that it was
waiting. Run by tests/test_mpi_init_span.py under distdiag-wrap, ``mpiexec -n 2``.
"""

from __future__ import annotations

import os
import sys
import threading
import time

BUSY_S = float(sys.argv[1]) if len(sys.argv) > 1 else 2.0
stop = threading.Event()


def prefetch() -> None:
    while not stop.wait(0.005):
        with open(__file__, "rb") as f:
            f.read(16)


if os.environ.get("PMI_RANK") == "1":
    end = time.monotonic() + BUSY_S
    while time.monotonic() < end:
        with open(__file__, "rb") as f:
            f.read(16)
else:
    loader = threading.Thread(target=prefetch, daemon=True)
    loader.start()

from mpi4py import MPI  # noqa: E402  (MPI_Init runs here)

comm = MPI.COMM_WORLD
comm.Barrier()
stop.set()
print(f"rank {comm.Get_rank()} done", flush=True)
