"""io_bound on a real slow file system: one rank of an MPI job reads its samples one small
file each from the FUSE mount of tests/slowfs.py, the other from the local disk (issue 20
item 2: never silent on a subsystem that holds the wall-clock).

No metadata storm (one rank, its own pace), no large file: before this detector the report
said "straggler rank 0" at best, blaming a rank for its file system. The healthy twin
reads the same files from the mount's backing directory on both ranks. By turns, 2 pairs;
the truth is the job's own wall-clock between its first and last Barrier.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Iterator

import pytest
from helpers import run_in_session

from distdiag.config import Config
from distdiag.pipeline import Report, analyze
from slowfs import slow_mount_over
from truth import Twins, loop_s, measure_twins

pytestmark = [pytest.mark.mpi, pytest.mark.fuse]

REPO = Path(__file__).resolve().parent.parent
JOB = REPO / "tests" / "jobs" / "io_bound.py"
MPIEXEC = shutil.which("mpiexec")
NFILES = 500
LATENCY_MS = 0.1


@pytest.fixture(scope="module")
def mount(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    def fill(backing: Path) -> None:
        payload = os.urandom(256)
        for i in range(NFILES):
            (backing / f"s{i:05d}.bin").write_bytes(payload)

    with slow_mount_over(tmp_path_factory.mktemp("iobound"), LATENCY_MS, fill) as mnt:
        yield mnt


def run_job(run_dir: Path, data0: Path, data1: Path) -> float:
    if MPIEXEC is None:
        pytest.fail("mpiexec not found: install the 'mpi' extra (mpi4py + mpich)")
    cmd = [MPIEXEC, "-n", "2", sys.executable, "-m", "distdiag.wrap", "--dir", str(run_dir),
           sys.executable, str(JOB), "--data", str(data0), "--data", str(data1), "--nfiles", str(NFILES)]  # fmt: skip
    out = run_in_session(cmd, 240, cwd=REPO, env=dict(os.environ), check=True).stdout
    return loop_s(out)


IoAB = Twins[Report]


@pytest.fixture(scope="module")
def io_ab(mount: Path, tmp_path_factory: pytest.TempPathFactory) -> IoAB:
    tmp = tmp_path_factory.mktemp("iobound_runs")
    fast = mount.parent / "backing"
    twins = measure_twins(tmp, lambda d, faulty: run_job(d, mount if faulty else fast, fast), pairs=2)
    return twins.map(lambda d: analyze(d, Config()))


def test_a_rank_held_by_its_file_system_is_io_bound(io_ab: IoAB, mount: Path) -> None:
    print(io_ab.saving)
    for i, rep in enumerate(io_ab.faulty):
        kinds = [(f.kind, round(f.cost_s, 3)) for f in rep.findings]
        top = rep.findings[0]
        assert top.kind == "io_bound", kinds
        assert top.ranks == [0] and str(mount) in top.evidence["by_mount"][0]["mount"], top.evidence
        lat = top.evidence["by_mount"][0]["metadata_latency_ms"]
        assert lat is not None and lat["median"] > 0.1, lat  # the slow server's latency, in the evidence
        # each second once: the straggler this makes of rank 0 is the file system's
        assert not [f for f in rep.findings if f.kind == "straggler" and f.cost_s > 0.02 * rep.run.wall_s], kinds
        cov = {c["category"]: c for c in rep.coverage}
        assert "io_bound" in cov["io_s"]["explained_by"], cov
        print(f"io_bound priced {top.cost_s:.3f} s (faulty run {i}): {io_ab.saving}")
        io_ab.saving.assert_prices(float(top.cost_s), i, rel=0.25, what="io_bound")


def test_healthy_twin_reads_the_same_files_locally_and_is_silent(io_ab: IoAB) -> None:
    for rep in io_ab.healthy:
        wall = float(rep.run.wall_s)
        # 2% plus the healthy runs' measured spread, as the other twins: a rank descheduled on
        # a loaded machine is late for real in that run (seen: a 19 ms straggler, 2.1% of 0.9 s)
        bound = 0.02 * wall + io_ab.saving.noise_s
        # A straggler up to 3.5%: with a busy core beside the suite, one of the two ranks can
        # share its core for most of the ~1 s run and be late for real at most collectives
        # (seen: rank 0 last at 8 of 11 all-reduces by ~3 ms, 30.5 ms = 3.0% of 1.01 s, while
        # the two healthy loops differed by 1.6 ms: in the other run rank 1 was the one); the
        # analyzer is right to name it, and the loops' spread cannot show it. No other kind.
        late = 0.035 * wall + io_ab.saving.noise_s
        over = [(f.kind, f.cost_s) for f in rep.findings if f.cost_s > (late if f.kind == "straggler" else bound)]
        assert not over, (bound, late, str(io_ab.saving))
        assert not [f for f in rep.findings if f.kind == "io_bound"]
        cov = {c["category"]: c for c in rep.coverage}
        assert "io_s" not in cov, cov
