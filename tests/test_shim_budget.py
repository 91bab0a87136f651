"""A rank file's byte budget (issue 17 item 5): past ``max_file_bytes`` the shim keeps
recording in a degraded form (1 row in ``sample_every``, the rest counted per (kind, name)
in ``/counters``), the file stays near its budget, and the analyzer says so.

Real wrapped processes: one doing 1.7 x 10^5 ``os.stat`` calls (10^5 over 100 files,
then 2 x 10^4 distinct missing paths, so the string table is bounded too) under a 300 kB
budget, with its twin under the default budget (1 GiB) that must record everything and
say nothing; and a 2-rank MPI job whose all-reduces, sampled by sequence number on each
rank, still match.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
from helpers import run_wrapped_mpi, single_process_env

from distdiag import clocks
from distdiag.match import MatchState, collectives_of
from distdiag.pipeline import analyze
from distdiag.run import load_run
from distdiag.schema import Kind

PY = sys.executable
BUDGET = 300_000

JOB = """\
import os, sys
d, n, uniq = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
os.makedirs(d, exist_ok=True)
files = [os.path.join(d, f"f{i}") for i in range(100)]
for p in files:
    open(p, "w").close()
for i in range(n):
    os.stat(files[i % 100])
for i in range(uniq):
    try:
        os.stat(os.path.join(d, f"missing-{i:06d}"))
    except FileNotFoundError:
        pass
print("stats", n + uniq)
"""


def _record(tmp: Path, name: str, **env: str) -> Path:
    (tmp / "job.py").write_text(JOB)
    run = tmp / name
    p = subprocess.run(
        [PY, "-m", "distdiag.wrap", "--dir", str(run), PY, str(tmp / "job.py"), str(tmp / f"data-{name}"), "150000", "20000"],
        env=single_process_env(DISTDIAG_FLUSH_INTERVAL_S="0.05", **env), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout == "stats 170000\n" and p.stderr == ""
    return run


def _stats(f: h5py.File) -> int:
    """FILE_STAT calls the file holds: rows written plus rows counted only."""
    kept = int((f["events"]["kind"] == Kind.FILE_STAT).sum())
    if "counters" not in f:
        return kept
    c = f["counters"][:]
    return kept + int(c["count"][c["kind"] == Kind.FILE_STAT].sum())


def test_a_rank_past_its_budget_keeps_a_sample_counts_the_rest_and_the_report_says_so(tmp_path: Path) -> None:
    small = _record(tmp_path, "small", DISTDIAG_MAX_FILE_BYTES=str(BUDGET))
    full = _record(tmp_path, "full")  # the twin: default budget (1 GiB), never reached
    small_file, full_file = small / "rank-00000.h5", full / "rank-00000.h5"
    with h5py.File(small_file) as fs, h5py.File(full_file) as ff:
        assert "counters" not in ff and "budget_reached_mono_ns" not in ff.attrs
        n_full = _stats(ff)
        assert n_full >= 170_000  # every call recorded (plus the interpreter's own few)
        # nothing lost: every call is a row or in a counter, as many as the twin recorded
        assert _stats(fs) == n_full
        assert int(fs.attrs["rows_counted_only"]) == int(fs["counters"]["count"].sum()) > 150_000
        assert int(fs.attrs["budget_bytes"]) == BUDGET and int(fs.attrs["sample_every"]) == 64
        ev = fs["events"][:]
        strings = [s.decode() for s in fs["strings"][:]]
        # the milestones stay, with their names, however late they come
        shim = {strings[i] for i in ev["name_id"][ev["kind"] == Kind.SHIM]}
        assert "target_end" in shim
        # the string table stopped growing too: most of the 2 x 10^4 missing paths are not in it
        assert sum(s.startswith(str(tmp_path / "data-small" / "missing-")) for s in strings) < 5_000
        # a counter's name is a string of the file, or -1 ("other names")
        ids = fs["counters"]["name_id"][:]
        assert ((ids == -1) | ((ids >= 0) & (ids < len(strings)))).all()
    # the file ends near its budget (HDF5's own overhead included); the twin's is far larger
    assert small_file.stat().st_size < 1.5 * BUDGET < full_file.stat().st_size / 10

    said = [w for w in analyze(small).run.warnings if "recording budget" in w]
    assert len(said) == 1 and "rank 0 reached its recording budget of 300000 bytes" in said[0], said
    assert "file_stat taking" in said[0]
    assert not [w for w in analyze(full).run.warnings if "recording budget" in w]


COLL_JOB = """\
import numpy as np
from mpi4py import MPI
c = MPI.COMM_WORLD
x = np.zeros(4)
for i in range(30000):
    c.Allreduce(MPI.IN_PLACE, x)
print("sum", int(x[0]))
"""


def test_collectives_sampled_past_the_budget_still_match_across_ranks(tmp_path: Path) -> None:
    env = single_process_env(DISTDIAG_MAX_FILE_BYTES=str(BUDGET), DISTDIAG_FLUSH_INTERVAL_S="0.05")
    run_dir = run_wrapped_mpi(tmp_path, COLL_JOB, n=2, env=env)
    for r in (0, 1):
        with h5py.File(run_dir / f"rank-{r:05d}.h5") as f:
            ev = f["events"][:]
            allreduce = ev[(ev["kind"] == Kind.COLL) & (ev["seq"] >= 0)]
            c = f["counters"][:]
            assert len(allreduce) + int(c["count"][c["kind"] == Kind.COLL].sum()) >= 30_000
            late = allreduce[allreduce["t0_ns"] > int(f.attrs["budget_reached_mono_ns"])]
            assert len(late) > 10 and (late["seq"] % 64 == 0).all()
    run = clocks.align(load_run(run_dir))
    assert len([w for w in run.warnings if "recording budget" in w]) == 2, run.warnings
    colls = collectives_of(run)
    # the sampled calls are the same calls on both ranks: every group is complete
    assert len(colls.g_state) > 100
    assert (colls.g_state == MatchState.COMPLETE).all(), np.unique(colls.g_state, return_counts=True)
