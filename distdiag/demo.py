"""``distdiag demo``: run the built-in 4-rank MPI job with one slow rank, analyze it, and check the price.

Needs the ``mpi`` extra (mpi4py and an MPI with ``mpiexec``: the PyPI ``mpich``
wheel does). No cluster, no Slurm.

The demo runs the job twice under ``distdiag-wrap``: with the slow rank, and
its healthy twin without it. What the slow rank cost the job is the
difference of the two loops' wall-clocks, which is not the sleep it was given
when the ranks outnumber the cores (the others get the sleeper's core). The
demo prints all three: what was injected, what the job lost, and what
distdiag priced.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from distdiag.findings import Finding

_JOB_LINE = re.compile(r"injected delay ([0-9.]+) s on rank (-?[0-9]+), loop ([0-9.]+) s")


@dataclass(frozen=True)
class JobRun:
    """What the demo job printed of itself."""

    injected_s: float
    loop_s: float


def _job_env() -> dict[str, str]:
    """The job's environment: each rank behaves as if it had a core of its own, as on a cluster.

    One BLAS thread per rank: numpy's OpenBLAS otherwise starts a thread per
    core in every rank, and they spin (4 ranks on 2 cores: the healthy loop
    took 3.6-4.6 s instead of 0.2-0.4 s, noise larger than the injected delay).
    MPICH's waiting ranks sleep between polls: spinning, they take the core of
    a rank that works, which a waiting rank on a cluster does not.
    """
    env = dict(os.environ)
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env.setdefault(var, "1")
    env.setdefault("MPIR_CVAR_ENABLE_HEAVY_YIELD", "1")
    return env


def _run_job(cmd: list[str], env: dict[str, str]) -> JobRun | int:
    """Run one job, pass its output through; its self-report, or its exit code when it failed."""
    p = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env)
    sys.stderr.write(p.stdout)
    if p.returncode != 0:
        return p.returncode
    m = _JOB_LINE.search(p.stdout)
    if m is None:
        print("distdiag: the demo job did not report its loop time", file=sys.stderr)
        return 1
    return JobRun(injected_s=float(m.group(1)), loop_s=float(m.group(3)))


def _priced_s(findings: list[Finding], slow_rank: int) -> float:
    """What the report charges to the slow rank (its straggler and serial-section findings)."""
    return float(sum(f.cost_s for f in findings if f.kind in ("straggler", "serial_section") and f.ranks == [slow_rank]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="distdiag demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
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
    env = _job_env()

    def job(slow_rank: int, into: Path) -> list[str]:
        return [mpiexec, "-n", str(a.ranks), sys.executable, "-m", "distdiag.wrap", "--dir", str(into),
                sys.executable, "-m", "distdiag.demo_job", "--slow-rank", str(slow_rank), "--delay-s",
                str(a.delay_s), "--iters", str(a.iters)]  # fmt: skip

    cmd = job(a.slow_rank, run_dir)
    print("distdiag demo: " + " ".join(os.path.basename(c) if c in (mpiexec, sys.executable) else c for c in cmd),
          file=sys.stderr)
    faulty = _run_job(cmd, env)
    if isinstance(faulty, int):
        print(f"distdiag: the demo job failed (exit code {faulty})", file=sys.stderr)
        return faulty
    print("distdiag demo: the same job without the slow rank, to measure what it cost", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="distdiag-demo-healthy-") as tmp:
        healthy = _run_job(job(-1, Path(tmp) / "run"), env)
    if isinstance(healthy, int):
        print(f"distdiag: the demo's healthy twin failed (exit code {healthy})", file=sys.stderr)
        return healthy

    from distdiag.config import load_config
    from distdiag.pipeline import analyze
    from distdiag.render import render

    report = analyze(run_dir, load_config(None))
    sys.stdout.write(render(report, a.format))
    sys.stdout.flush()
    priced_s = _priced_s(report.findings, a.slow_rank)
    lost_s = faulty.loop_s - healthy.loop_s
    print(f"\ndistdiag demo: injected {faulty.injected_s:.3f} s of sleep on rank {a.slow_rank}; the job lost"
          f" {lost_s:.2f} s to it ({faulty.loop_s:.2f} s against {healthy.loop_s:.2f} s without it);"
          f" distdiag priced {priced_s:.2f} s. Run dir: {run_dir}",
          file=sys.stderr if a.format == "json" else sys.stdout)  # fmt: skip
    return 0
