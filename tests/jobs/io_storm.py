"""Test job: a start-up metadata storm, a packed-file start, or a checkpoint that stalls the job.

Run under ``mpiexec -n 4 distdiag-wrap python tests/jobs/io_storm.py ...``. Each mode
loads data, then trains briefly (compute + ``Allreduce`` per iteration), and
prints what it measured itself, one ``IOSTORM {json}`` line per rank, so the
test can hold the analyzer to the truth:

* ``--mode files``: every rank opens and reads ``--nfiles`` small files from
  ``--data`` (a directory, e.g. on the slow FUSE mount), as a data loader that
  keeps one sample per file does. ``blocked_s`` = time inside open/read/close.
* ``--mode walk``: every rank ``os.walk``s ``--data`` (a tree of directories of small
  files), stats and reads every file: the walk's own per-entry stats come from C.
* ``--mode packed``: every rank reads the same samples from one packed file
  (``--data`` is that file).
* ``--mode imports``: every rank imports ``--nfiles`` tiny modules ``m00000``...
  found on ``--data`` (put first on ``sys.path``): an import storm.
* ``--mode ckpt``: rank ``--ckpt-rank`` writes ``--ckpt-mb`` MiB to ``--ckpt-path``
  halfway through training (and fsyncs it), while the others go on to the next
  ``Allreduce`` and wait there. ``blocked_s`` = time the writer spent writing.

``t0_ns``/``t1_ns`` are ``time.perf_counter_ns()`` at the start and end of the
loading (or writing) phase: the clock the shim stamps its events with.

Each record also holds the job's wall-clock, ``loop_s``, from the first
Barrier to the last (one span, each rank's view of it): a test runs the same
job without its fault (the files on a fast local directory, no checkpoint:
``--ckpt-rank -1``) and compares the analyzer's cost with the difference
(tests/truth.py).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
from mpi4py import MPI


def load_files(data: str, nfiles: int) -> int:
    nbytes = 0
    for i in range(nfiles):
        with open(os.path.join(data, f"s{i:05d}.bin"), "rb") as f:
            nbytes += len(f.read())
    return nbytes


def import_modules(data: str, n: int) -> int:
    import importlib
    import sys

    sys.path.insert(0, data)
    for i in range(n):
        importlib.import_module(f"m{i:05d}")
    return 0


def walk_files(data: str) -> int:
    """``os.walk`` the tree, stat every file and read it: the walk's own stats of each entry
    (``DirEntry.is_dir()``) are made from C, out of the Python hooks' sight."""
    nbytes = 0
    for root, _dirs, files in os.walk(data):
        for name in files:
            p = os.path.join(root, name)
            if os.stat(p).st_size:
                with open(p, "rb") as f:
                    nbytes += len(f.read())
    return nbytes


def load_packed(path: str) -> int:
    with open(path, "rb") as f:
        return len(f.read())


def ckpt_bytes() -> memoryview:
    """The checkpoint's bytes, made before the job's clock starts: the test times the I/O only."""
    return memoryview(np.random.default_rng(0).integers(0, 255, 8 << 20, dtype=np.uint8).tobytes())


def train(comm: MPI.Intracomm, iters: int, compute_s: float, ckpt: tuple[int, int, str] | None = None,
          chunk: memoryview | None = None) -> dict[str, float]:  # fmt: skip
    rank = comm.Get_rank()
    buf = np.ones(1024, np.float64)
    out = np.empty_like(buf)
    a = np.random.default_rng(rank).random((64, 64))
    measured: dict[str, float] = {}
    for it in range(iters):
        t_end = time.perf_counter() + compute_s
        while time.perf_counter() < t_end:  # compute: a fixed amount of time, not of work
            a = a @ a
            a /= np.abs(a).max() + 1.0
        if ckpt is not None and it == iters // 2 and rank == ckpt[0]:
            assert chunk is not None
            t0 = time.perf_counter_ns()
            with open(ckpt[2], "wb") as f:
                left = ckpt[1] << 20
                while left > 0:
                    n = min(left, len(chunk))
                    f.write(chunk[:n])
                    left -= n
                f.flush()
                os.fsync(f.fileno())
            t1 = time.perf_counter_ns()
            measured = {"t0_ns": t0, "t1_ns": t1, "blocked_s": (t1 - t0) / 1e9, "nbytes": ckpt[1] << 20}
        comm.Allreduce(buf, out)
    return measured


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("files", "walk", "packed", "imports", "ckpt"), required=True)
    ap.add_argument("--data", default="")
    ap.add_argument("--nfiles", type=int, default=500)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--compute-s", type=float, default=0.005)
    ap.add_argument("--ckpt-rank", type=int, default=0)
    ap.add_argument("--ckpt-mb", type=int, default=256)
    ap.add_argument("--ckpt-path", default="")
    a = ap.parse_args()

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    # made by the writer only (8 MB of random bytes: ~50 ms of CPU, which on 2 cores is noise in
    # the others' loop), before the clock starts
    chunk = ckpt_bytes() if a.mode == "ckpt" and rank == a.ckpt_rank else None
    comm.Barrier()  # everyone starts loading together, as ranks of a real job do
    t_job = time.perf_counter()
    rec: dict[str, float] = {"rank": rank}
    if a.mode in ("files", "walk", "packed", "imports"):
        t0 = time.perf_counter_ns()
        if a.mode == "files":
            nbytes = load_files(a.data, a.nfiles)
        elif a.mode == "walk":
            nbytes = walk_files(a.data)
        elif a.mode == "imports":
            nbytes = import_modules(a.data, a.nfiles)
        else:
            nbytes = load_packed(a.data)
        t1 = time.perf_counter_ns()
        rec.update(t0_ns=t0, t1_ns=t1, blocked_s=(t1 - t0) / 1e9, nbytes=nbytes)
        comm.Barrier()
        train(comm, a.iters, a.compute_s)
    else:
        rec.update(train(comm, a.iters, a.compute_s, (a.ckpt_rank, a.ckpt_mb, a.ckpt_path), chunk))
    comm.Barrier()
    rec["loop_s"] = time.perf_counter() - t_job
    print("IOSTORM " + json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
