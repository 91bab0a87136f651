"""End to end: real `mpiexec -n 4 distdiag-wrap` jobs, analyzed by the real CLI.

These are the acceptance tests of the first slice (issue 2): a rank that
really sleeps is named as the straggler with the right cost; a healthy job
stays silent; a job killed with SIGKILL leaves readable files and the analyzer
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
from pathlib import Path

import h5py
import pytest

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


def run_demo_job(tmp_path: Path, slow_rank: int, delay_s: float, iters: int) -> tuple[Path, float]:
    _need_mpi()
    run_dir = tmp_path / "run"
    cmd = [MPIEXEC, "-n", "4", *WRAP, "--dir", str(run_dir), sys.executable, "-m", "distdiag.demo_job",
           "--slow-rank", str(slow_rank), "--delay-s", str(delay_s), "--iters", str(iters)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stdout + p.stderr
    m = re.search(r"injected delay ([0-9.]+) s", p.stdout)
    assert m, p.stdout
    return run_dir, float(m.group(1))


def test_sleeping_rank_is_named_straggler_with_its_cost(tmp_path: Path) -> None:
    run_dir, injected_s = run_demo_job(tmp_path, slow_rank=2, delay_s=0.05, iters=40)
    assert injected_s == pytest.approx(2.0)
    rep = analyze_json(run_dir)
    assert rep["schema"] == "distdiag.report/1"
    assert rep["run"]["ranks"] == 4 and rep["run"]["missing_ranks"] == []
    top = rep["findings"][0]
    assert top["kind"] == "straggler", rep["findings"]
    assert top["ranks"] == [2]
    assert top["cost_s"] == pytest.approx(injected_s, rel=0.25)
    # one ranking: nobody else is blamed for what rank 2 did
    others = [f for f in rep["findings"] if f["kind"] == "straggler" and f["ranks"] != [2]]
    assert all(f["fraction"] < 0.02 for f in others), others


def test_healthy_job_has_no_straggler(tmp_path: Path) -> None:
    run_dir, injected_s = run_demo_job(tmp_path, slow_rank=-1, delay_s=0.0, iters=40)
    assert injected_s == 0.0
    rep = analyze_json(run_dir)
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
