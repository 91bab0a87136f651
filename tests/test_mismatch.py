"""collective_mismatch: ranks disagree about the n-th collective on a communicator.

Real jobs: 4 MPI ranks where rank 1 passes another count to the Allreduce at
seq 5 (MPICH either hangs, for an empty buffer, or aborts the job at once, for
a shorter one; what was flushed before is what the analyzer sees). Unit cases
(rank files through the shim's writer) cover every state, the silent cases,
and matching by sequence number whatever the clocks say.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import wait_for_writers

from distdiag.pipeline import analyze
from factories import MS, coll, write_rank

JOB = Path(__file__).parent / "jobs" / "mismatch_allreduce.py"
REPO = Path(__file__).resolve().parent.parent
WRAP = [sys.executable, "-m", "distdiag.wrap"]
SITE_LINE = next(i for i, s in enumerate(JOB.read_text().splitlines(), 1) if "MISMATCH-SITE" in s)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DISTDIAG_", "SLURM_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["DISTDIAG_FLUSH_INTERVAL_S"] = "0.1"
    return env


def _analyze_json(run_dir: Path) -> dict[str, Any]:
    p = subprocess.run([sys.executable, "-m", "distdiag.cli", "analyze", str(run_dir), "--format", "json"],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    return dict(json.loads(p.stdout))


def _run_job(tmp_path: Path, bad_count: int) -> Path:
    """Run the job; if it hangs, SIGKILL its rank processes (by the pids they wrote) after 1 s."""
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        pytest.fail("mpiexec not found: install the 'mpi' extra (mpi4py + mpich)")
    run_dir, piddir = tmp_path / "run", tmp_path / "pids"
    piddir.mkdir()
    cmd = [mpiexec, "-n", "4", "timeout", "-s", "KILL", "60", *WRAP, "--dir", str(run_dir),
           sys.executable, str(JOB), str(piddir), "1", str(bad_count)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(), cwd=tmp_path)
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while len(list(piddir.glob("*.pid"))) < 4 and proc.poll() is None:
            assert time.monotonic() < deadline, "ranks did not reach the mismatch in 60 s"
            time.sleep(0.05)
        time.sleep(0.2)
        pids = [int(p.read_text()) for p in piddir.glob("*.pid") if p.read_text().strip()]
        try:
            proc.wait(timeout=1.5)  # an abort ends the job by itself
        except subprocess.TimeoutExpired:
            for pid in pids:  # hung: kill exactly the ranks this test started
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    wait_for_writers(run_dir)  # the aborted ranks' helpers finish their files
    return run_dir


@pytest.mark.mpi
def test_allreduce_with_another_count_on_rank_1_is_a_size_mismatch_at_its_seq(tmp_path: Path) -> None:
    rep = _analyze_json(_run_job(tmp_path, bad_count=0))
    top = rep["findings"][0]
    assert top["kind"] == "collective_mismatch", [(f["kind"], f["summary"]) for f in rep["findings"]]
    ev = top["evidence"]
    assert (ev["state"], ev["op"], ev["comm"], ev["seq"]) == ("size", "Allreduce", "world", 5)
    assert top["ranks"] == [1]
    assert ev["values"] == {"0": [1], "8192": [0, 2, 3]}
    assert ev["site"].endswith(f"mismatch_allreduce.py:{SITE_LINE}")
    assert "8192 bytes on ranks 0, 2, 3; 0 bytes on rank 1" in top["summary"]
    assert ev["ends_job"] is True and top["cost_s"] > 0.5
    # rank 1 went on to the Barrier alone: that is the mismatch's echo, not a second hang
    assert [f["kind"] for f in rep["findings"]].count("hang") == 0


@pytest.mark.mpi
def test_a_mismatch_that_aborts_mpich_leaves_a_report_that_names_rank_1(tmp_path: Path) -> None:
    """count 512: MPICH aborts within milliseconds, before rank 1 flushes its call. The
    files hold the others inside Allreduce #5 and rank 1 never in it: rank 1 is named."""
    rep = _analyze_json(_run_job(tmp_path, bad_count=512))
    assert rep["run"]["ranks"] == 4
    named = [f for f in rep["findings"] if f["kind"] in ("hang", "collective_mismatch")]
    if named:  # the others' in-flight Allreduce reached the disk before the abort
        assert named[0]["ranks"] == [1], named
        assert rep["findings"][0] is named[0] or rep["findings"][0] == named[0]


# -- unit cases ------------------------------------------------------------------------


def _write(tmp_path: Path, seq5: dict[int, dict[str, Any]], n_ranks: int = 4, offsets_ms: Any = None,
           inflight_at_5: bool = False) -> Path:
    """Ranks call Allreduce #0..#7 on world; ``seq5[r]`` overrides rank r's call at seq 5."""
    for r in range(n_ranks):
        s = [""]
        off = 0.0 if offsets_ms is None else offsets_ms[r]
        rows, inf = [], None
        for i in range(8):
            kw: dict[str, Any] = {"op": "Allreduce", "nbytes": 64}
            if i == 5:
                kw.update(seq5.get(r, {}))
                if kw.pop("skip", False):
                    continue
                if inflight_at_5:
                    inf = [coll(off + 10.0 * i + r, -1, i, s, **kw)]
                    break
            rows.append(coll(off + 10.0 * i + 0.1 * r, off + 10.0 * i + 2, i, s, **kw))
        extra: dict[str, Any] = dict(closed_cleanly=False, exit_code=None, end_mono_ns=None,
                                     last_flush_mono_ns=int((off + 1000.0) * MS)) if inflight_at_5 else {}  # fmt: skip
        write_rank(tmp_path, r, n_ranks, rows, s, inflight=inf, **extra)
    return tmp_path


def _mismatch(run_dir: Path) -> list[Any]:
    return [f for f in analyze(run_dir).findings if f.kind == "collective_mismatch"]


@pytest.mark.parametrize(
    "seq5, state, odd, text",
    [
        ({1: {"op": "Bcast", "root": 0}}, "type", [1], "Allreduce on ranks 0, 2, 3; Bcast on rank 1"),
        ({1: {"nbytes": 32}}, "size", [1], "64 bytes on ranks 0, 2, 3; 32 bytes on rank 1"),
        ({r: {"op": "Reduce", "root": 1 if r == 3 else 0} for r in range(4)}, "root", [3],
         "root 0 on ranks 0, 1, 2; root 1 on rank 3"),
    ],
)  # fmt: skip
def test_each_state_explains_itself_and_names_the_odd_rank(
    tmp_path: Path, seq5: dict[int, dict[str, Any]], state: str, odd: list[int], text: str
) -> None:
    got = _mismatch(_write(tmp_path, seq5))
    assert len(got) == 1
    f = got[0]
    assert (f.evidence["state"], f.evidence["seq"], f.ranks) == (state, 5, odd)
    assert text in f.summary, f.summary
    assert f.evidence["completed"] is True and f.cost_s == 0.0 and not f.evidence["ends_job"]


@pytest.mark.parametrize("odd", [0, 1])
def test_a_one_against_one_tie_is_broken_by_the_calls_before_it(tmp_path: Path, odd: int) -> None:
    """Seen: MPICH aborted within milliseconds and only ranks 0 and 1 had their Allreduce #5 on
    disk, one value each; the smaller value was taken as the common one and rank 0 named. The
    communicator's Allreduce #4, which every rank agreed on, says which value is the odd one."""
    got = _mismatch(_write(tmp_path, {odd: {"nbytes": 32}}, n_ranks=2))
    assert len(got) == 1 and got[0].ranks == [odd], [(f.ranks, f.summary) for f in got]
    assert "as many ranks on each side" not in got[0].summary


def test_a_tie_with_no_call_before_it_names_both_and_says_why(tmp_path: Path) -> None:
    for r in range(2):
        s = [""]
        write_rank(tmp_path, r, 2, [coll(0.1 * r, 2.0, 0, s, op="Allreduce", nbytes=64 if r == 0 else 32)], s)
    got = _mismatch(tmp_path)
    assert len(got) == 1 and got[0].ranks == [0, 1]
    assert "as many ranks on each side, and no earlier call of it to tell which is odd" in got[0].summary


def test_different_datatypes_are_a_dtype_mismatch(tmp_path: Path) -> None:
    # Same op and bytes, but rank 2 sends MPI_FLOAT where the others send MPI_DOUBLE (aux = dtype string id).
    for r in range(4):
        s = ["", "MPI_FLOAT"] if r == 2 else [""]  # different local ids: the loader maps them
        rows = []
        for i in range(4):
            row = list(coll(10.0 * i + 0.1 * r, 10.0 * i + 2, i, s))
            dt = "MPI_FLOAT" if (r == 2 and i == 3) else "MPI_DOUBLE"
            if dt not in s:
                s.append(dt)
            row[8] = s.index(dt)
            rows.append(tuple(row))
        write_rank(tmp_path, r, 4, rows, s)
    got = _mismatch(tmp_path)
    assert len(got) == 1 and got[0].evidence["state"] == "dtype" and got[0].ranks == [2]
    assert got[0].evidence["seq"] == 3
    assert "MPI_DOUBLE on ranks 0, 1, 3; MPI_FLOAT on rank 2" in got[0].summary


def test_a_rank_that_skipped_a_collective_is_missing_and_the_shift_is_counted(tmp_path: Path) -> None:
    # rank 3 skips the Allreduce at seq 5 and calls its Barrier (others' seq 6) as its seq 5 ... a
    # shift: here modelled as rank 3 never recording seq 5 while its record goes on.
    got = _mismatch(_write(tmp_path, {3: {"skip": True}}))
    assert len(got) == 1
    f = got[0]
    assert f.evidence["state"] == "missing" and f.ranks == [3]
    assert "rank(s) 3 never called it" in f.summary


def test_matching_is_by_sequence_never_by_time(tmp_path: Path) -> None:
    # clocks seconds apart: rank 1's size-mismatched call at seq 5 is 7 s "later" on its own
    # clock than the others', which would line it up with no one by time
    got = _mismatch(_write(tmp_path, {1: {"nbytes": 32}}, offsets_ms=[0.0, 7000.0, -3000.0, 0.0]))
    assert len(got) == 1 and got[0].evidence["seq"] == 5 and got[0].ranks == [1]


def test_in_flight_mismatch_ends_the_job_and_ranks_first(tmp_path: Path) -> None:
    got = _write(tmp_path, {1: {"nbytes": 32}}, inflight_at_5=True)
    rep = analyze(got)
    top = rep.findings[0]
    assert top.kind == "collective_mismatch" and top.evidence["ends_job"] is True
    assert top.evidence["stuck_wait_s"] == pytest.approx(1.0 - 0.053, abs=0.01)
    assert top.cost_s == pytest.approx(rep.run.wall_s)  # a job that died in it lost the whole run
    assert "hang" not in [f.kind for f in rep.findings]


def test_healthy_run_and_legitimately_different_sizes_are_silent(tmp_path: Path) -> None:
    assert _mismatch(_write(tmp_path / "ok", {})) == []
    # gathers of different sizes (v-variants, pickled objects) and bcast payloads are not compared
    assert _mismatch(_write(tmp_path / "v", {r: {"op": "Allgatherv", "nbytes": 8 * (r + 1)} for r in range(4)})) == []


@pytest.mark.parametrize("inflight", [False, True])
def test_member_datatypes_found_again_from_the_rows_equal_the_matchs(
    tmp_path: Path, inflight: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the match's gathered aux (or after it dropped a duplicate) member_aux finds each
    member's row again by (comm, seq, rank), in-flight rows included: the same datatype ids;
    streamed too (the collective rows read back band by band: one band, and bands of 5 rows)."""
    from dataclasses import replace

    import numpy as np

    from distdiag.mismatch import member_aux
    from distdiag.match import collectives_of
    from distdiag.run import load_run

    for r in range(4):
        s = [""]
        rows = [coll(10.0 * i + 0.1 * r, 10.0 * i + 2, i, s) for i in range(6)]
        inf = [rows.pop()] if inflight and r == 3 else None  # rank 3 killed inside its last call
        for tab in (rows, inf or []):
            for j, row in enumerate(tab):
                s.append(f"T{r}_{row[5]}")  # a datatype of its own per (rank, seq)
                tab[j] = (*row[:8], len(s) - 1, *row[9:])
        write_rank(tmp_path, r, 4, rows, s, inflight=inf)
    run = load_run(tmp_path)
    colls = collectives_of(run)
    assert colls.m_aux is not None and colls.n_dup == 0 and len(colls.m_rank) == 24
    want = colls.m_aux.astype(np.int64)
    assert int(want.min()) > 0 and len(np.unique(want)) == 24
    np.testing.assert_array_equal(member_aux(run, replace(colls, m_aux=None)), want)
    assert len(run.inflight) == int(inflight)
    import distdiag.bands
    from distdiag.run import STREAMED_KINDS, stream_out
    from distdiag.schema import COMM_KINDS

    streamed = load_run(tmp_path, streamed_kinds=STREAMED_KINDS)
    s_colls = collectives_of(streamed)
    streamed = stream_out(streamed)  # the collective rows now only in the files
    assert not np.isin(streamed.events["kind"], [int(k) for k in COMM_KINDS]).any()
    for band_events in (1 << 20, 5):
        monkeypatch.setattr(distdiag.bands, "BAND_EVENTS", band_events)
        np.testing.assert_array_equal(member_aux(streamed, replace(s_colls, m_aux=None)), want)
