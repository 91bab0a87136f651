"""compute_bound on a real 2-rank MPI job: the same FLOPs a step by a slow kernel (a matrix
product tile by tile in Python) or by BLAS's (issue 20 item 2).

The peak is measured here, on this machine: the best rate of the fast kernel on one core
(``tests/jobs/compute_bound.py --peak``), given as ``[analyze.compute_bound]
peak_flops_per_s``. The truth is measured too: the tiled job and the fast one by turns,
2 pairs, their own wall-clock between their first and last Barrier. The fast twin is a
compute-bound job at the peak, what a well-tuned job looks like: no finding, and the
report's coverage says in a line that compute binds; without a peak, neither job gets a
finding.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import run_in_session

from distdiag.config import Config
from distdiag.pipeline import Report, analyze
from truth import Saving, loop_s, measure_saving

pytestmark = pytest.mark.mpi

REPO = Path(__file__).resolve().parent.parent
JOB = REPO / "tests" / "jobs" / "compute_bound.py"
MPIEXEC = shutil.which("mpiexec")
ENV = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def peak_flops_per_s() -> float:
    p = subprocess.run([sys.executable, str(JOB), "--peak"], capture_output=True, text=True, env=ENV, timeout=120)
    assert p.returncode == 0, p.stderr
    m = re.search(r"peak ([0-9.e+]+)", p.stdout)
    assert m, p.stdout
    return float(m.group(1))


def run_job(run_dir: Path, kernel: str) -> float:
    if MPIEXEC is None:
        pytest.fail("mpiexec not found: install the 'mpi' extra (mpi4py + mpich)")
    cmd = [MPIEXEC, "-n", "2", sys.executable, "-m", "distdiag.wrap", "--dir", str(run_dir),
           sys.executable, str(JOB), "--kernel", kernel]  # fmt: skip
    return loop_s(run_in_session(cmd, 240, cwd=REPO, env=ENV, check=True).stdout)


@dataclass(frozen=True)
class ComputeAB:
    saving: Saving
    peak: float
    faulty: list[Path]
    healthy: list[Path]


@pytest.fixture(scope="module")
def compute_ab(tmp_path_factory: pytest.TempPathFactory) -> ComputeAB:
    tmp = tmp_path_factory.mktemp("compute_bound")
    peak = peak_flops_per_s()
    dirs: dict[bool, list[Path]] = {True: [], False: []}

    def one(faulty: bool, i: int) -> float:
        d = tmp / f"{'tiled' if faulty else 'fast'}{i}"
        dirs[faulty].append(d)
        return run_job(d, "tiled" if faulty else "fast")

    return ComputeAB(measure_saving(one, pairs=2), peak, dirs[True], dirs[False])


def _cfg(peak: float) -> Config:
    cfg = Config()
    cfg.sections.setdefault("compute_bound", {})["peak_flops_per_s"] = peak
    return cfg


def test_slow_kernels_are_compute_bound_priced_at_the_peak(compute_ab: ComputeAB) -> None:
    print(f"peak {compute_ab.peak / 1e9:.3g} GFLOP/s; {compute_ab.saving}")
    for i, d in enumerate(compute_ab.faulty):
        rep = analyze(d, _cfg(compute_ab.peak))
        kinds = [(f.kind, round(f.cost_s, 3)) for f in rep.findings]
        top = rep.findings[0]
        assert top.kind == "compute_bound", kinds
        ev = top.evidence
        assert ev["of_peak"] < 0.5 and ev["peak_flops_per_s"] == compute_ab.peak, ev
        assert "counterfactual" in ev
        cov = {c["category"]: c for c in rep.coverage}
        assert "compute_bound" in cov["compute_s"]["explained_by"], cov
        compute_ab.saving.assert_prices(float(top.cost_s), i, rel=0.25, what="compute_bound")
        # without a peak nothing prices it: no finding, the coverage line says compute binds
        plain = analyze(d, Config())
        assert not [f for f in plain.findings if f.kind == "compute_bound"]
        c = {c["category"]: c for c in plain.coverage}["compute_s"]
        assert c["explained_by"] or c["binds"].startswith("compute binds"), c


def test_the_fast_twin_at_the_peak_has_no_finding(compute_ab: ComputeAB) -> None:
    for d in compute_ab.healthy:
        rep = analyze(d, _cfg(compute_ab.peak))
        wall = float(rep.run.wall_s)
        assert not [(f.kind, round(f.cost_s, 3)) for f in rep.findings if f.cost_s > 0.02 * wall]
        assert not [f for f in rep.findings if f.kind == "compute_bound"]
