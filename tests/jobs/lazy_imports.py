"""Test job: ranks that import a package of small modules after they first meet (lazy imports).

Run under ``mpiexec -n 2 distdiag-wrap python tests/jobs/lazy_imports.py DIR [DIR...] --modules N``:
rank r imports from the r-th DIR (the last for the ranks past them), which holds the package ``lazymods`` (modules ``m000``... whose bodies compute for
``--body-ms``, as a module's own code does between its import's file calls). After the
first Barrier each rank imports them inside ``distdiag.phase("setup")``, then runs 20
steps of 20 ms compute and an ``Allreduce``. Every DIR on the local disk: a healthy job
whose imports are the interpreter's work; rank 0's on the slow FUSE mount (tests/slowfs.py):
the file system holds its imports, and the other ranks wait for it.

Rank 0 prints ``loop <s> s``: the wall-clock from the first Barrier to the last (tests/truth.py).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time

import numpy as np
from mpi4py import MPI

import distdiag


def write_package(root: str, modules: int, body_ms: float) -> None:
    """``root/lazymods/__init__.py`` and ``m000.py``... each computing ``body_ms`` at import."""
    import os

    pkg = os.path.join(root, "lazymods")
    os.makedirs(pkg, exist_ok=True)
    open(os.path.join(pkg, "__init__.py"), "w").close()
    body = f"import time\n_t = time.perf_counter() + {body_ms / 1e3!r}\nwhile time.perf_counter() < _t:\n    pass\n"
    for i in range(modules):
        with open(os.path.join(pkg, f"m{i:03d}.py"), "w") as f:
            f.write(body)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir", nargs="+")
    ap.add_argument("--modules", type=int, default=200)
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    where = args.dir[min(comm.Get_rank(), len(args.dir) - 1)]
    buf = np.ones(1024)
    out = np.empty_like(buf)
    comm.Barrier()
    t0 = time.perf_counter()
    with distdiag.phase("setup"):
        sys.path.insert(0, where)
        for i in range(args.modules):
            importlib.import_module(f"lazymods.m{i:03d}")
    for _ in range(20):
        t_end = time.perf_counter() + 0.02
        while time.perf_counter() < t_end:  # compute: a fixed time, not work
            pass
        comm.Allreduce(buf, out)
    comm.Barrier()
    if comm.Get_rank() == 0:
        print(f"loop {time.perf_counter() - t0:.4f} s", flush=True)


if __name__ == "__main__":
    main()
