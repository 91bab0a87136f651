"""``distdiag demo``: run the built-in 4-rank MPI job with one slow rank, then analyze it.

Needs the ``mpi`` extra (mpi4py and an MPI with ``mpiexec``: the PyPI ``mpich``
wheel does). No cluster, no Slurm.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="distdiag demo", description=__doc__)
    p.add_argument("--ranks", "-n", type=int, default=4)
    p.add_argument("--slow-rank", type=int, default=2)
    p.add_argument("--delay-s", type=float, default=0.05)
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--dir", default=None, help="run dir (default: distdiag-demo-<time> in the cwd)")
    p.add_argument("--format", choices=["text", "json"], default="text")
    a = p.parse_args(argv)

    mpiexec = shutil.which("mpiexec")
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        mpiexec = None
    if mpiexec is None:
        print("distdiag: the demo needs MPI: pip install 'distdiag[mpi]' (mpi4py + the mpich wheel)", file=sys.stderr)
        return 2
    run_dir = Path(a.dir or f"distdiag-demo-{time.strftime('%Y%m%d-%H%M%S')}")
    wrap = [sys.executable, "-m", "distdiag.wrap"]
    cmd = [mpiexec, "-n", str(a.ranks), *wrap, "--dir", str(run_dir), sys.executable, "-m", "distdiag.demo_job",
           "--slow-rank", str(a.slow_rank), "--delay-s", str(a.delay_s), "--iters", str(a.iters)]
    print("distdiag demo: " + " ".join(os.path.basename(c) if c in (mpiexec, sys.executable) else c for c in cmd),
          file=sys.stderr)
    rc = subprocess.call(cmd)
    if rc != 0:
        print(f"distdiag: the demo job failed (exit code {rc})", file=sys.stderr)
        return rc
    from distdiag.cli import main as cli_main

    return cli_main(["analyze", str(run_dir), "--format", a.format])
