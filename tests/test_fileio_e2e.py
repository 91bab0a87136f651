"""End to end on a real slow file system: `mpiexec -n 4 distdiag-wrap` jobs whose data
sits on the FUSE mount of tests/slowfs.py (serialized, slow metadata server).

* 4 ranks each open and read 500 small files at start, then train: the
  verdict is `metadata_storm`, naming the mount, costing what the storm cost
  the job (the same job with its files on a fast local directory, the slow
  mount's backing one, runs in the same test: the difference of their
  wall-clocks), and its window on the aligned timeline covers the real
  loading phase; the fast twin has no storm;
* the same job importing 50 modules from the mount: an import storm, priced
  the same way against the same imports from the fast directory;
* the same job reading one packed file: no `metadata_storm`;
* a rank that writes a large checkpoint while the others wait: `io_bandwidth`
  names the rank and the file, with the cost the job measured against the
  same job without the checkpoint.

The slow server's speed depends on the load (it is a Python FUSE server on 2
shared cores): the storms cost 0.7-4.6 s a run here, so each faulty run is
held to what it lost, its own wall-clock against the median of its twins'.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest
from helpers import run_in_session

from slowfs import slow_mount_over
from truth import Saving, measure_saving

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
WALK_DIRS, WALK_FILES = 10, 300


@pytest.fixture(scope="module")
def slow_mount(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The slow mount (tests only read it; one per module); its backing directory is :func:`fast_dir`."""
    def fill(backing: Path) -> None:
        payload = os.urandom(SAMPLE_BYTES)
        for i in range(NFILES):
            (backing / f"s{i:05d}.bin").write_bytes(payload)
        mods = backing / "pylib"
        mods.mkdir()
        for i in range(NMODULES):
            (mods / f"m{i:05d}.py").write_text(f"VALUE = {i}\n")
        (backing / "packed.bin").write_bytes(payload * NFILES)
        for d in range(WALK_DIRS):  # the tree the walk mode reads: 300 files in 10 directories
            sub = backing / "tree" / f"d{d:02d}"
            sub.mkdir(parents=True)
            for i in range(WALK_FILES // WALK_DIRS):
                (sub / f"f{i:03d}.bin").write_bytes(payload)

    with slow_mount_over(tmp_path_factory.mktemp("slowfs"), LATENCY_MS, fill) as mnt:
        yield mnt


def run_job(run_dir: Path, *args: str, env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Run io_storm.py on 4 ranks; each rank's record, by rank (``loop_s``: the job's wall-clock)."""
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


@dataclass(frozen=True)
class AB:
    """A job with its fault and its twin without it, by turns: each run's records and run dir."""

    saving: Saving
    faulty: list[tuple[Path, list[dict[str, Any]]]]
    healthy: list[Path]


def run_ab(tmp: Path, faulty_args: list[str], healthy_args: list[str], env: dict[str, str] | None = None,
           pairs: int = 2) -> AB:  # fmt: skip
    runs: dict[bool, list[tuple[Path, list[dict[str, Any]]]]] = {True: [], False: []}

    def run(is_faulty: bool, i: int) -> float:
        d = tmp / f"{'faulty' if is_faulty else 'healthy'}{i}"
        recs = run_job(d, *(faulty_args if is_faulty else healthy_args), env=env)
        runs[is_faulty].append((d, recs))
        return float(recs[0]["loop_s"])

    saving = measure_saving(run, pairs=pairs)
    return AB(saving, runs[True], [d for d, _ in runs[False]])


def fast_dir(slow_mount: Path) -> Path:
    """The slow mount's backing directory: the same files on the local disk (see ``slow_mount``)."""
    return slow_mount.parent / "backing"


def test_small_file_storm_on_slow_mount_is_the_verdict(slow_mount: Path, tmp_path: Path) -> None:
    ab = run_ab(tmp_path, ["--mode", "files", "--data", str(slow_mount), "--nfiles", str(NFILES)],
                ["--mode", "files", "--data", str(fast_dir(slow_mount)), "--nfiles", str(NFILES)])  # fmt: skip
    costs = []
    for i, (run_dir, recs) in enumerate(ab.faulty):
        rep = analyze_json(run_dir)
        top = rep["findings"][0]
        assert top["kind"] == "metadata_storm", [(f["kind"], f["cost_s"]) for f in rep["findings"]]
        ev = top["evidence"]
        assert ev["mount"] == str(slow_mount) and ev["fstype"].startswith("fuse")
        assert top["ranks"] == [0, 1, 2, 3]
        assert str(slow_mount) in top["paths"]
        # (nearly) every open is inside the storm window: 4 ranks x 500 files; the
        # first few, before the queue builds up, may fall outside it
        assert ev["calls_by_kind"]["open"] >= 0.95 * 4 * NFILES
        costs.append(top["cost_s"])
        # the window on the aligned timeline covers the real loading phase (one host: one monotonic clock)
        real_t0 = min(r["t0_ns"] for r in recs)
        real_t1 = max(r["t1_ns"] for r in recs)
        w0 = min(w["t0_ns"] for w in ev["windows"])
        w1 = max(w["t1_ns"] for w in ev["windows"])
        slack_ns = 0.25 * (real_t1 - real_t0)
        assert w0 <= real_t0 + slack_ns and w1 >= real_t1 - slack_ns, (w0, w1, real_t0, real_t1)
        # and the per-rank breakdown puts the time the ranks measured in their file calls in io_s
        io = [r["io_s"] for r in rep["breakdown"]["per_rank"]]
        assert min(io) >= 0.75 * min(r["blocked_s"] for r in recs)
    # The price is what the storm cost this run: its wall-clock against the fast twins'.
    # Measured (10 sets of 2 pairs, 2 cores, load 3-9): the faulty runs lost 2.6-4.6 s,
    # the fast twins ran 0.21-0.40 s (spread 0.003-0.07 s), each price within 0.28 s
    # (6%) of its run's loss. The margin, 10% plus the healthy spread, fails a price
    # scaled by 1.25 or 0.75.
    _storm_priced_twins_silent(ab, costs, rel=0.10, what="metadata_storm cost")


def _storm_priced_twins_silent(ab: AB, costs: list[float], rel: float, what: str) -> None:
    """Each faulty run's price against what that run lost; every fast twin without a storm."""
    print(f"{what}: priced {', '.join(f'{c:.3f}' for c in costs)} s: {ab.saving}")
    for i, c in enumerate(costs):
        ab.saving.assert_prices(c, i, rel=rel, what=what)
    for d in ab.healthy:  # the same files on a fast directory: no storm
        rep = analyze_json(d)
        assert [f for f in rep["findings"] if f["kind"] == "metadata_storm"] == [], rep["findings"]


def test_a_walk_storm_is_priced_with_the_calls_made_from_c(slow_mount: Path, tmp_path: Path) -> None:
    """``os.walk`` + stat + read (issue 20): the walk stats each entry from C (``DirEntry``),
    out of the hooks' sight, so the recorded calls covered about half of each rank's storm
    and the price was 75% of what the storm cost. The gaps between a rank's recorded calls
    in which it was in no collective nor entered or left one are the storm's too."""
    ab = run_ab(tmp_path, ["--mode", "walk", "--data", str(slow_mount / "tree")],
                ["--mode", "walk", "--data", str(fast_dir(slow_mount) / "tree")])  # fmt: skip
    costs = []
    for run_dir, recs in ab.faulty:
        rep = analyze_json(run_dir)
        top = rep["findings"][0]
        assert top["kind"] == "metadata_storm", [(f["kind"], f["cost_s"]) for f in rep["findings"]]
        assert sum(w["unrecorded_s"] for w in top["evidence"]["windows"]) > 0
        costs.append(top["cost_s"])
    # measured: 4.14-4.17 s against 4.27-4.28 s lost; before, 3.2-3.4 s (75%): fails at 15%
    _storm_priced_twins_silent(ab, costs, rel=0.15, what="metadata_storm cost (walk)")


def test_packed_file_on_slow_mount_is_no_storm(slow_mount: Path, tmp_path: Path) -> None:
    recs = run_job(tmp_path / "run", "--mode", "packed", "--data", str(slow_mount / "packed.bin"))
    assert all(r["nbytes"] == NFILES * SAMPLE_BYTES for r in recs)
    rep = analyze_json(tmp_path / "run")
    assert [f for f in rep["findings"] if f["kind"] == "metadata_storm"] == [], rep["findings"]


def test_checkpoint_while_others_wait_is_named_by_io_bandwidth(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt.bin"
    # The write takes 0.2-1.1 s (page cache or disk), so each run is held to its own loss, and
    # against a 0.2 s loss the rest of the job must vary little and be measured well: hence 10
    # iterations, 3 pairs, and the bytes made before the job's clock starts. (Before, every rank
    # made them inside the timed span: a run whose rest was 0.05 s faster than its twins' then
    # "lost" 0.13 s to a 0.20 s write; 2 of 5 sets failed.)
    job = ["--mode", "ckpt", "--iters", "10", "--ckpt-path", str(ckpt)]
    ab = run_ab(tmp_path, [*job, "--ckpt-rank", "1", "--ckpt-mb", "256"], [*job, "--ckpt-rank", "-1"], pairs=3)
    costs = []
    for run_dir, recs in ab.faulty:
        measured = recs[1]
        assert measured["nbytes"] == 256 << 20 and ckpt.stat().st_size == 256 << 20
        rep = analyze_json(run_dir)
        io = [f for f in rep["findings"] if f["kind"] == "io_bandwidth"]
        assert len(io) == 1, rep["findings"]
        f = io[0]
        assert f["ranks"] == [1] and f["paths"] == [str(ckpt)]
        assert f["evidence"]["per_rank"][0]["written_bytes"] == 256 << 20
        # it is among the top two causes (a straggler finding may describe the same lateness)
        assert f in rep["findings"][:2]
        costs.append(f["cost_s"])
    print(f"io_bandwidth priced {', '.join(f'{c:.3f}' for c in costs)} s: {ab.saving}")
    for i, c in enumerate(costs):
        # The price is what the checkpoint cost this run, against the same job without one;
        # the disk's speed varies from run to run. Measured (5 sets of 3 pairs, 2 cores, load
        # 3-6): the faulty runs lost 0.21-1.11 s, the twins ran 0.10-0.28 s (spread 0.01-0.07 s),
        # each price within 0.06 s of its run's loss: the replay removed every file call of the
        # writing rank, its imports too (CI: a 0.156 s loss priced 0.200 s). With the checkpoint's
        # episodes alone (6 sets, beside a busy core: losses 0.18-1.01 s), within 0.02 s. The
        # margin, 10% plus the healthy spread, fails a price scaled by 1.25 or 0.75.
        ab.saving.assert_prices(c, i, rel=0.10, what="io_bandwidth cost")
    for d in ab.healthy:  # no checkpoint, no finding
        rep = analyze_json(d)
        assert [f for f in rep["findings"] if f["kind"] == "io_bandwidth"] == [], rep["findings"]


@pytest.fixture(scope="module")
def import_ab(slow_mount: Path, tmp_path_factory: pytest.TempPathFactory) -> AB:
    """50 modules imported from the slow mount, and the same from its fast backing directory, by turns."""
    return run_ab(tmp_path_factory.mktemp("imports"),
                  ["--mode", "imports", "--data", str(slow_mount / "pylib"), "--nfiles", str(NMODULES)],
                  ["--mode", "imports", "--data", str(fast_dir(slow_mount) / "pylib"), "--nfiles", str(NMODULES)],
                  env={"PYTHONDONTWRITEBYTECODE": "1"})  # fmt: skip


def test_import_storm_from_slow_mount_is_a_metadata_storm(slow_mount: Path, import_ab: AB) -> None:
    """The shim is installed before the program runs, so its imports are seen."""
    for run_dir, _ in import_ab.faulty:
        rep = analyze_json(run_dir)
        top = rep["findings"][0]
        assert top["kind"] == "metadata_storm", [(f["kind"], f["cost_s"]) for f in rep["findings"]]
        assert top["evidence"]["mount"] == str(slow_mount)
        assert top["evidence"]["import_share"] >= 0.5 and "imports" in top["summary"]
        assert top["paths"][0] == str(slow_mount / "pylib")
    for d in import_ab.healthy:  # the same imports from a fast directory: no storm
        rep = analyze_json(d)
        assert [f for f in rep["findings"] if f["kind"] == "metadata_storm"] == [], rep["findings"]


def test_import_storm_price_is_what_it_cost_the_job(import_ab: AB) -> None:
    costs = [analyze_json(run_dir)["findings"][0]["cost_s"] for run_dir, _ in import_ab.faulty]
    print(f"import storm priced {', '.join(f'{c:.3f}' for c in costs)} s: {import_ab.saving}")
    for i, c in enumerate(costs):
        # The price is what importing from the slow mount cost this run, against the same
        # imports from the fast directory. Measured (12 sets of 2 pairs, 2 cores, load 3-9):
        # the faulty runs lost 0.68-3.2 s, priced 0.71-1.01 of that from the recorded calls
        # alone (an xfail until the storm also took the unseen stretches between them); now
        # 0.77-0.79 s lost, priced 0.77-0.80 s. The margin: 10% plus the healthy spread.
        import_ab.saving.assert_prices(c, i, rel=0.10, what="import storm cost")
