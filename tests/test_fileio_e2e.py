"""End to end on a real slow file system: `mpiexec -n 4 distdiag-wrap` jobs whose data
sits on the FUSE mount of tests/slowfs.py (serialized, slow metadata server).

* 4 ranks each open and read 500 small files at start, then train: the
  verdict is `metadata_storm`, naming the mount, costing what the ranks
  really spent blocked (measured by the job itself: ±25% for data files,
  0.6-1.1x for an import phase, whose own Python work is no metadata time), and its window on
  the aligned timeline covers the real loading phase;
* the same job reading one packed file: no `metadata_storm`;
* a rank that writes a large checkpoint while the others wait: `io_bandwidth`
  names the rank and the file, with the cost the job measured.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
from helpers import run_in_session

from slowfs import fuse_available, mount_slowfs

pytestmark = [pytest.mark.mpi, pytest.mark.fuse]

REPO = Path(__file__).resolve().parent.parent
JOB = REPO / "tests" / "jobs" / "io_storm.py"
MPIEXEC = shutil.which("mpiexec")
NFILES = 500
SAMPLE_BYTES = 256
#: per metadata request of the slow server; each Python open makes ~8 FUSE requests
LATENCY_MS = 0.1
JOB_TIMEOUT_S = 240
NMODULES = 50


@pytest.fixture
def slow_mount(tmp_path: Path) -> Iterator[Path]:
    if not os.path.exists("/dev/fuse"):
        pytest.skip("/dev/fuse is absent: no FUSE on this machine")
    why = fuse_available()
    assert why is None, why  # FUSE exists, so the packages must too (CI installs them)
    backing = tmp_path / "backing"
    backing.mkdir()
    payload = os.urandom(SAMPLE_BYTES)
    for i in range(NFILES):
        (backing / f"s{i:05d}.bin").write_bytes(payload)
    mods = backing / "pylib"
    mods.mkdir()
    for i in range(NMODULES):
        (mods / f"m{i:05d}.py").write_text(f"VALUE = {i}\n")
    (backing / "packed.bin").write_bytes(payload * NFILES)
    with mount_slowfs(backing, tmp_path / "mnt", LATENCY_MS) as mnt:
        yield mnt


def run_job(run_dir: Path, *args: str, env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    if MPIEXEC is None:
        pytest.fail("mpiexec not found: install the 'mpi' extra (mpi4py + mpich)")
    cmd = [MPIEXEC, "-n", "4", sys.executable, "-m", "distdiag.wrap", "--dir", str(run_dir),
           sys.executable, str(JOB), *args]  # fmt: skip
    # its own session, so a timeout kills mpiexec *and* its ranks (they would keep the mount busy)
    out = run_in_session(cmd, JOB_TIMEOUT_S, cwd=REPO, env={**os.environ, **(env or {})}, check=True).stdout
    # mpiexec forwards the ranks' lines, sometimes run together: find the records, not the lines
    recs = [json.loads(m) for m in re.findall(r"IOSTORM (\{[^{}]*\})", out)]
    assert sorted(r["rank"] for r in recs) == [0, 1, 2, 3], out
    return sorted(recs, key=lambda r: r["rank"])


def analyze_json(run_dir: Path) -> dict[str, Any]:
    p = subprocess.run([sys.executable, "-m", "distdiag.cli", "analyze", str(run_dir), "--format", "json"],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)  # type: ignore[no-any-return]


def test_small_file_storm_on_slow_mount_is_the_verdict(slow_mount: Path, tmp_path: Path) -> None:
    recs = run_job(tmp_path / "run", "--mode", "files", "--data", str(slow_mount), "--nfiles", str(NFILES))
    rep = analyze_json(tmp_path / "run")
    top = rep["findings"][0]
    assert top["kind"] == "metadata_storm", [(f["kind"], f["cost_s"]) for f in rep["findings"]]
    ev = top["evidence"]
    assert ev["mount"] == str(slow_mount) and ev["fstype"].startswith("fuse")
    assert top["ranks"] == [0, 1, 2, 3]
    assert str(slow_mount) in top["paths"]
    # (nearly) every open is inside the storm window: 4 ranks x 500 files; the
    # first few, before the queue builds up, may fall outside it
    assert ev["calls_by_kind"]["open"] >= 0.95 * 4 * NFILES
    # the cost is what the ranks really lost: they loaded side by side, so the job lost the slowest one's time
    blocked_s = max(r["blocked_s"] for r in recs)
    assert top["cost_s"] == pytest.approx(blocked_s, rel=0.25)
    # the window on the aligned timeline covers the real loading phase (one host: one monotonic clock)
    real_t0 = min(r["t0_ns"] for r in recs)
    real_t1 = max(r["t1_ns"] for r in recs)
    w0 = min(w["t0_ns"] for w in ev["windows"])
    w1 = max(w["t1_ns"] for w in ev["windows"])
    slack_ns = 0.25 * (real_t1 - real_t0)
    assert w0 <= real_t0 + slack_ns and w1 >= real_t1 - slack_ns, (w0, w1, real_t0, real_t1)
    # and the per-rank breakdown puts that time in io_s
    io = [r["io_s"] for r in rep["breakdown"]["per_rank"]]
    assert min(io) >= 0.75 * min(r["blocked_s"] for r in recs)


def test_packed_file_on_slow_mount_is_no_storm(slow_mount: Path, tmp_path: Path) -> None:
    recs = run_job(tmp_path / "run", "--mode", "packed", "--data", str(slow_mount / "packed.bin"))
    assert all(r["nbytes"] == NFILES * SAMPLE_BYTES for r in recs)
    rep = analyze_json(tmp_path / "run")
    assert [f for f in rep["findings"] if f["kind"] == "metadata_storm"] == [], rep["findings"]


def test_checkpoint_while_others_wait_is_named_by_io_bandwidth(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt.bin"
    recs = run_job(tmp_path / "run", "--mode", "ckpt", "--ckpt-rank", "1", "--ckpt-mb", "256", "--ckpt-path", str(ckpt))
    measured = recs[1]
    assert measured["nbytes"] == 256 << 20 and ckpt.stat().st_size == 256 << 20
    rep = analyze_json(tmp_path / "run")
    io = [f for f in rep["findings"] if f["kind"] == "io_bandwidth"]
    assert len(io) == 1, rep["findings"]
    f = io[0]
    assert f["ranks"] == [1] and f["paths"] == [str(ckpt)]
    assert f["cost_s"] == pytest.approx(measured["blocked_s"], rel=0.25)
    assert f["evidence"]["per_rank"][0]["written_bytes"] == 256 << 20
    # it is among the top two causes (a straggler finding may describe the same lateness)
    assert f in rep["findings"][:2]


def test_import_storm_from_slow_mount_is_a_metadata_storm(slow_mount: Path, tmp_path: Path) -> None:
    """The shim is installed before the program runs, so its imports are seen."""
    recs = run_job(tmp_path / "run", "--mode", "imports", "--data", str(slow_mount / "pylib"), "--nfiles", str(NMODULES),
                   env={"PYTHONDONTWRITEBYTECODE": "1"})  # fmt: skip
    rep = analyze_json(tmp_path / "run")
    top = rep["findings"][0]
    assert top["kind"] == "metadata_storm", [(f["kind"], f["cost_s"]) for f in rep["findings"]]
    assert top["evidence"]["mount"] == str(slow_mount)
    assert top["evidence"]["import_share"] >= 0.5 and "imports" in top["summary"]
    assert top["paths"][0] == str(slow_mount / "pylib")
    # The job times the whole import phase; the storm is the metadata calls in
    # it. The import system's own Python work between those calls is the rest:
    # measured 0.76-0.81 of the phase in 8 runs here, with this tree and the
    # previous session's alike (a full suite once saw 0.74).
    blocked = max(r["blocked_s"] for r in recs)
    assert 0.6 * blocked <= top["cost_s"] <= 1.1 * blocked, (top["cost_s"], blocked)
