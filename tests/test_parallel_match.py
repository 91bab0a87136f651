"""``--parallel`` on a streamed run: the collective rows stay on the analysis rank that read
them, which maps, repairs and matches them by key ranges (distdiag.parallel._Remote,
_match_share). Under a real ``mpiexec``, the JSON must be the serial in-memory one, byte
for byte, on the runs that take each path of that exchange:

* a clock model that is confidently wrong (the causality repair moves rank 5's times:
  the held rows are repaired in place, then matched again);
* a rank without clock samples (the fit matches the RAW rows: the exit fallback);
* per-rank string ids and rows out of time order (each file's rows sorted and remapped
  where they are held), damaged string ids and two files claiming one rank;
* rank files whose names are not in rank order (an owner's rows come in file order and
  are re-sorted by rank);
* five communicators with mismatches, in-flight members and a repeated row;
* a real job killed inside a collective (in-flight rows, a missing member).
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from factories import reorder_strings_and_rows
from test_match_ranges import _same as same_match
from test_parallel import MPIEXEC, _run

from distdiag.config import Config
from distdiag.pipeline import analyze
from distdiag.render import render
from distdiag.synth import synth

pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="needs mpiexec (pip install mpich)")


_CHILD = """
import pickle, sys
from distdiag.config import Config
from distdiag.parallel import analyze_parallel
from distdiag.render import render
rep = analyze_parallel(sys.argv[1], Config(stream_events=0))
if rep is not None:
    assert rep.run.cache.parallel["collectives_held"] == (rep.run.cache.parallel["workers"] > 1)
    with open(sys.argv[2], "wb") as f:
        pickle.dump((render(rep, "json"), rep.collectives), f)
"""


def _same(tmp: Path, d: Path, ns: tuple[int, ...] = (2, 3)) -> str:
    """The JSON of ``mpiexec -n N`` streamed analyses equals the serial in-memory one, and so
    does their match, field by field (member order included: ties decide the last arriver)."""
    ser = analyze(d, Config(stream_events=-1))
    text = render(ser, "json")
    for n in ns:
        out = tmp / f"par{n}.pickle"
        got = _run([MPIEXEC or "mpiexec", "-n", str(n), sys.executable, "-c", _CHILD, str(d), str(out)])
        assert got.returncode == 0, got.stderr
        with open(out, "rb") as f:
            par_text, par_colls = pickle.load(f)
        assert par_text == text, n
        same_match(ser.collectives, par_colls)
    return text  # type: ignore[no-any-return]


def test_a_causality_repair_of_the_held_rows(tmp_path: Path) -> None:
    d = tmp_path / "run"
    synth(d, ranks=8, events=2000, fault="straggler", ranks_per_host=2)
    with h5py.File(d / "rank-00005.h5", "r+") as f:  # rank 5's samples 3 ms off: repaired
        s = f["clock_sync"][...]
        s["t_ref_ns"] -= 3_000_000
        f["clock_sync"][...] = s
    ser = _same(tmp_path, d)
    assert "repaired with a controlled logical clock" in ser, "the run must need a repair"


def test_a_rank_without_clock_samples_is_fitted_from_the_raw_match(tmp_path: Path) -> None:
    d = tmp_path / "run"
    synth(d, ranks=6, events=1500, fault="serial", ranks_per_host=2)
    with h5py.File(d / "rank-00003.h5", "r+") as f:
        s = f["clock_sync"][...]
        del f["clock_sync"]
        f.create_dataset("clock_sync", data=s[:0])
    ser = _same(tmp_path, d)
    assert "aligned from collective exits" in ser


def test_per_rank_strings_rows_out_of_order_damaged_ids_and_a_rank_claimed_twice(tmp_path: Path) -> None:
    d = tmp_path / "run"
    synth(d, ranks=9, events=1500, fault="straggler", ranks_per_host=3, seed=4)
    reorder_strings_and_rows(d / "rank-00002.h5")  # another string order, rows flushed out of order
    with h5py.File(d / "rank-00006.h5", "r+") as f:  # ids beyond the string table, collectives included
        ev = f["events"][...]
        ev["comm_id"][::89] = 777
        ev["name_id"][::97] = 999
        f["events"][...] = ev
    with h5py.File(d / "rank-00004.h5", "r+") as f:  # claims rank 7 too: one of the two is skipped
        f.attrs["rank"] = 7
    ser = _same(tmp_path, d)
    assert "string ids point outside" in ser and "appears in both" in ser


def test_rank_files_named_out_of_rank_order_with_tied_arrivals(tmp_path: Path) -> None:
    # One host (one clock). Rank 5 straggles; rank 2 enters every all-reduce at the very
    # nanosecond rank 5 does, so the two tie for last and the serial order (ties by row,
    # i.e. by rank) names rank 5. Their files swap names, so each analysis rank's rows are
    # in rank order but the blocks are not (rank 5's rows reach an owner before rank 2's),
    # and rank 3's rows are flushed out of time order: an owner must put its rows in the
    # serial order, or rank 2 is named.
    from distdiag.schema import Kind

    d = tmp_path / "run"
    synth(d, ranks=8, events=1200, fault="straggler", ranks_per_host=8, seed=6)
    coll = int(Kind.COLL)
    with h5py.File(d / "rank-00005.h5", "r") as f:
        ev5 = f["events"][...]
    c5 = ev5[(ev5["kind"] == coll) & (ev5["seq"] >= 0)]
    late = dict(zip(c5["seq"].tolist(), c5["t0_ns"].tolist()))
    with h5py.File(d / "rank-00002.h5", "r+") as f:
        ev = f["events"][...]
        m = (ev["kind"] == coll) & (ev["seq"] >= 0)
        ev["t0_ns"][m] = [late[q] for q in ev["seq"][m].tolist()]
        f["events"][...] = ev
    with h5py.File(d / "rank-00003.h5", "r+") as f:
        ev = f["events"][...]
        half = len(ev) // 2
        f["events"][...] = np.concatenate([ev[half:], ev[:half]])
    (d / "rank-00002.h5").rename(d / "tmp.h5")
    (d / "rank-00005.h5").rename(d / "rank-00002.h5")
    (d / "tmp.h5").rename(d / "rank-00005.h5")
    _same(tmp_path, d, ns=(2, 3))


def test_five_communicators_with_mismatches_in_flight_members_and_a_repeated_row(tmp_path: Path) -> None:
    from test_match_columns import _write_differing_run

    d = tmp_path / "run"
    _write_differing_run(d, repeat=True)
    ser = _same(tmp_path, d, ns=(2, 3, 4))
    assert '"kind": "collective_mismatch"' in ser and "repeat a (communicator, seq, rank)" in ser


def test_a_job_killed_inside_a_collective(tmp_path: Path) -> None:
    from test_hang import _run_and_kill

    d = _run_and_kill(tmp_path, "kill")
    ser = _same(tmp_path, d)
    assert '"kind": "hang"' in ser


def test_one_analysis_rank_holds_nothing_apart(tmp_path: Path) -> None:
    # K = 1: nothing is held apart (one rank reads and matches everything, as the serial
    # path; the child checks collectives_held is False)
    d = tmp_path / "run"
    synth(d, ranks=4, events=800, fault="straggler", ranks_per_host=2)
    _same(tmp_path, d, ns=(1,))


def test_a_worker_gets_exactly_its_ranks_members(tmp_path: Path) -> None:
    # The breakdown job of an analysis rank carries only its ranks' members
    # (parallel._members_of): every member column, plain or per group with exceptions
    # (op, bytes, root, site, datatype differ on some ranks here), equals the whole
    # match's column at those members.
    from test_match_columns import _write_differing_run

    from distdiag.clocks import align
    from distdiag.match import collectives_of
    from distdiag.parallel import _members_of
    from distdiag.run import load_run

    d = tmp_path / "run"
    _write_differing_run(d, repeat=True)
    colls = collectives_of(align(load_run(d), inplace=True))
    assert len(colls.m_op.exc_rows) and len(colls.m_nbytes.exc_rows)
    for lo, hi in ((0, 12), (0, 1), (3, 7), (11, 12), (5, 5)):
        keep = (colls.m_rank >= lo) & (colls.m_rank < hi)
        sub = _members_of(colls, lo, hi)
        for f in ("m_group", "m_rank", "m_t0_ns", "m_t1_ns", "m_kind", "m_op", "m_nbytes", "m_peer", "m_site", "m_aux"):
            whole, part = np.asarray(getattr(colls, f)), np.asarray(getattr(sub, f))
            assert part.dtype == whole.dtype and np.array_equal(part, whole[keep]), (lo, hi, f)
        assert np.array_equal(sub.g_last_ns, colls.g_last_ns) and sub.n_dup == colls.n_dup


_FIRSTS_CHILD = """
import pickle, sys
from distdiag.config import Config
from distdiag.parallel import analyze_parallel
from distdiag.render import render
rep = analyze_parallel(sys.argv[1], Config(stream_events=0))
if rep is not None:
    st = rep.run.cache.parallel
    with open(sys.argv[2], "wb") as f:
        pickle.dump((render(rep, "json"), rep.run.cache.rank_firsts, "slurm_firsts_s" in st), f)
"""


def test_a_slurm_jobs_per_rank_firsts_come_from_every_analysis_rank(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # A Slurm job's view reads each rank's first useful work, first collective and
    # first rendezvous: one pass over every rank's rows, split over the analysis ranks.
    import json

    from distdiag.clocks import align
    from distdiag.run import load_run
    from distdiag.slurm import _rank_firsts

    d = tmp_path / "run"
    synth(d, ranks=8, events=1000, fault="straggler", ranks_per_host=2, seed=2)
    for fp in sorted(d.glob("rank-*.h5")):
        with h5py.File(fp, "r+") as f:
            env = json.loads(f.attrs["env"])
            env["SLURM_JOB_ID"] = "4242"
            f.attrs["env"] = json.dumps(env)
            f.attrs["job_id"] = "4242"
    monkeypatch.setenv("DISTDIAG_SLURM_OFFLINE", "1")  # no sacct: the view's per-rank facts only
    want = _rank_firsts(align(load_run(d), inplace=True))
    text = render(analyze(d, Config(stream_events=-1)), "json")
    assert '"job_id": "4242"' in text
    for n in (2, 3):
        out = tmp_path / f"firsts{n}.pickle"
        got = _run([MPIEXEC or "mpiexec", "-n", str(n), sys.executable, "-c", _FIRSTS_CHILD, str(d), str(out)])
        assert got.returncode == 0, got.stderr
        with open(out, "rb") as f:
            par_text, firsts, split = pickle.load(f)
        assert split and par_text == text, n
        for field in ("useful_ns", "coll_ns", "rendezvous_ns", "lone"):
            assert np.array_equal(getattr(firsts, field), getattr(want, field)), (n, field)


def test_more_analysis_ranks_than_rank_files(tmp_path: Path) -> None:
    # analysis ranks without a file hold no rows, own empty key ranges and empty blocks of bands
    d = tmp_path / "run"
    synth(d, ranks=2, events=400, fault="none", ranks_per_host=1)
    _same(tmp_path, d, ns=(4,))


_FAULT_CHILD = """
import sys
from mpi4py import MPI
import distdiag.match
import distdiag.parallel
import distdiag.passes
from distdiag.config import Config
from distdiag.render import render
from distdiag.run import DistdiagError
rank, mode = MPI.COMM_WORLD.Get_rank(), sys.argv[3]
def boom(*a, **k):
    raise RuntimeError("injected")
if mode == "jobs" and rank == 0:  # rank 0 cannot make the others' jobs
    distdiag.parallel._members_of = boom
if mode == "part" and rank == 1:  # an analysis rank's sweep of its block of bands fails
    distdiag.passes.sweep = boom
if mode == "match" and rank == 1:  # an analysis rank's share of the match fails
    distdiag.match.match_part = boom
try:
    rep = distdiag.parallel.analyze_parallel(sys.argv[1], Config(stream_events=0))
except DistdiagError as e:
    open(sys.argv[2], "w").write("ERROR " + str(e))
else:
    if rep is not None:
        open(sys.argv[2], "w").write(render(rep, "json"))
"""


@pytest.mark.parametrize("mode", ["jobs", "part", "match"])
def test_a_failure_on_one_analysis_rank_costs_time_or_one_line_never_a_hang(tmp_path: Path, mode: str) -> None:
    # a failed block of bands is computed again on rank 0 (the same report); a failed share
    # of the match is one line on rank 0 (the match cannot be made without it); every rank
    # returns (a hang fails the test at _run's timeout)
    d = tmp_path / "run"
    synth(d, ranks=6, events=800, fault="straggler", ranks_per_host=2)
    out = tmp_path / "out.txt"
    got = _run([MPIEXEC or "mpiexec", "-n", "3", sys.executable, "-c", _FAULT_CHILD, str(d), str(out), mode], 120)
    assert got.returncode == 0, got.stderr
    text = out.read_text()
    if mode == "match":
        assert text.startswith("ERROR analysis rank 1: collective match failed (RuntimeError: injected)"), text
    else:
        assert text == render(analyze(d, Config(stream_events=-1)), "json")
