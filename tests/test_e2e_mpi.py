"""End to end: real `mpiexec -n 4 distdiag-wrap` jobs, analyzed by the real CLI.

These are the acceptance tests of the first slice (issue 2): a rank that
really sleeps is named as the straggler, priced at what the sleep cost the
job (measured against its healthy twin in the same test, tests/truth.py); the
healthy twin stays silent; a job killed with SIGKILL leaves readable files and the analyzer
reports the collective the ranks were stuck in.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import h5py
import pytest
from helpers import wait_for_writers
from truth import Saving, loop_s, measure_saving

pytestmark = pytest.mark.mpi

MPIEXEC = shutil.which("mpiexec")
WRAP = [sys.executable, "-m", "distdiag.wrap"]


def _need_mpi() -> None:
    if MPIEXEC is None:
        pytest.fail("mpiexec not found: install the 'mpi' extra (mpi4py + mpich)")


def analyze_json(run_dir: Path) -> dict:
    p = subprocess.run([sys.executable, "-m", "distdiag.cli", "analyze", str(run_dir), "--format", "json"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def run_demo_job(run_dir: Path, slow_rank: int, delay_s: float, iters: int) -> tuple[float, float]:
    """Run the demo job on 4 ranks under the wrapper; the delay it injected and its loop's wall-clock."""
    _need_mpi()
    cmd = [MPIEXEC, "-n", "4", *WRAP, "--dir", str(run_dir), sys.executable, "-m", "distdiag.demo_job",
           "--slow-rank", str(slow_rank), "--delay-s", str(delay_s), "--iters", str(iters)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stdout + p.stderr
    m = re.search(r"injected delay ([0-9.]+) s", p.stdout)
    assert m, p.stdout
    return float(m.group(1)), loop_s(p.stdout)


@dataclass(frozen=True)
class DemoAB:
    """The demo job with rank 2 sleeping 50 ms before each of 40 Allreduces, and its healthy twin,
    alternating: what the sleep cost is measured, not assumed (4 ranks on 2 cores)."""

    saving: Saving
    faulty_dirs: list[Path]
    healthy_dirs: list[Path]
    injected_s: float


@pytest.fixture(scope="module")
def demo_ab(tmp_path_factory: pytest.TempPathFactory) -> DemoAB:
    tmp = tmp_path_factory.mktemp("demo_ab")
    dirs: dict[bool, list[Path]] = {True: [], False: []}
    injected: list[float] = []

    def run(faulty: bool, i: int) -> float:
        d = tmp / f"{'faulty' if faulty else 'healthy'}{i}"
        dirs[faulty].append(d)
        inj, loop = run_demo_job(d, slow_rank=2 if faulty else -1, delay_s=0.05 if faulty else 0.0, iters=40)
        if faulty:
            injected.append(inj)
        return loop

    saving = measure_saving(run, pairs=2)
    return DemoAB(saving, dirs[True], dirs[False], injected[0])


def test_sleeping_rank_is_named_straggler_with_its_cost(demo_ab: DemoAB) -> None:
    assert demo_ab.injected_s == pytest.approx(2.0)
    rep = analyze_json(demo_ab.faulty_dirs[0])
    assert rep["schema"] == "distdiag.report/1"
    assert rep["run"]["ranks"] == 4 and rep["run"]["missing_ranks"] == []
    top = rep["findings"][0]
    assert top["kind"] == "straggler", rep["findings"]
    assert top["ranks"] == [2]
    # The price is what this run lost to the sleep: its loop against the healthy twin's.
    # Measured (2 cores, load 6-10 from other jobs): faulty loops 2.12-2.27 s, healthy
    # 0.09-0.68 s (spread 0.03-0.37 s a pair), lost 1.97-2.06 s, priced 1.98-1.99 s. The
    # margin, 8% plus the healthy spread, fails a price off by 25% (checked both ways).
    demo_ab.saving.assert_prices(top["cost_s"], 0, rel=0.08, what="straggler cost")
    # one ranking: nobody else is blamed for what rank 2 did
    others = [f for f in rep["findings"] if f["kind"] == "straggler" and f["ranks"] != [2]]
    assert all(f["fraction"] < 0.02 for f in others), others


def test_healthy_job_has_no_straggler(demo_ab: DemoAB) -> None:
    for d in demo_ab.healthy_dirs:  # every healthy twin stays silent
        rep = analyze_json(d)
        loud = [f for f in rep["findings"] if f["kind"] == "straggler" and f["fraction"] >= 0.02]
        assert loud == [], loud
        assert len(rep["breakdown"]["per_rank"]) == 4


def test_sigkilled_job_leaves_readable_files_and_the_stuck_collective(tmp_path: Path) -> None:
    _need_mpi()
    run_dir = tmp_path / "run"
    piddir = tmp_path / "pids"
    piddir.mkdir()
    job = Path(__file__).parent / "jobs" / "e2e_hang.py"
    env = dict(os.environ, DISTDIAG_FLUSH_INTERVAL_S="0.2")
    proc = subprocess.Popen([MPIEXEC, "-n", "4", *WRAP, "--dir", str(run_dir), sys.executable, str(job), str(piddir), "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        deadline = time.monotonic() + 60
        while len(list(piddir.glob("*.pid"))) < 4 and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(2.0)  # ranks 0, 2, 3 are now blocked in the Allreduce; several flush intervals pass
        pids = [int(p.read_text()) for p in piddir.glob("*.pid")]
        assert len(pids) == 4
        for pid in pids:  # exactly the rank processes this test started
            os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    files = sorted(run_dir.glob("rank-*.h5"))
    assert len(files) == 4
    wait_for_writers(run_dir)  # the killed ranks' helpers finish their files
    for f in files:
        with h5py.File(f, "r") as h:
            assert len(h["events"]) > 0
            assert not h.attrs.get("closed_cleanly", False)
    rep = analyze_json(run_dir)
    text = json.dumps(rep)
    # the stuck collective is reported: either as a hang finding or as a warning
    hang = [f for f in rep["findings"] if f["kind"] == "hang"]
    if hang:
        assert hang[0]["ranks"] == [1], hang
    else:
        assert "Allreduce" in text and "flight" in text, rep["run"]["warnings"]
