"""load_run and clocks.align on real rank files (written by the shim's writer)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from distdiag.clocks import align
from distdiag.errors import DistdiagError
from distdiag.run import RUN_EVENT_DTYPE, load_run
from distdiag.schema import Kind
from factories import MS, coll, make_run, set_attr, truncate_copy, write_foreign_h5, write_rank


def test_healthy_run_loads_every_rank_into_one_table(tmp_path: Path) -> None:
    t = make_run(tmp_path / "r", iters=50, io_ms=0.5)
    run = load_run(tmp_path / "r")
    assert run.world_size == 4
    assert sorted(run.ranks) == [0, 1, 2, 3]
    assert run.missing_ranks == [] and run.warnings == []
    assert run.hosts == ["node0", "node1"]
    assert run.job_id == "4242"
    assert run.events.dtype == RUN_EVENT_DTYPE
    assert len(run.events) == 4 * 50 * 2
    # sorted by (rank, t0)
    r, t0 = run.events["rank"], run.events["t0_ns"]
    assert np.all(np.diff(r) >= 0)
    assert np.all((np.diff(t0) >= 0) | (np.diff(r) > 0))
    assert all(run.ranks[i].closed_cleanly for i in range(4))
    assert all(run.ranks[i].n_events == 100 for i in range(4))
    assert t.files[2] == run.ranks[2].path


def test_string_ids_are_remapped_onto_one_global_table(tmp_path: Path) -> None:
    # Every rank numbers its strings in its own order; after loading, one id means one string.
    make_run(tmp_path / "r", iters=20, io_ms=0.5, shuffle_strings=True, seed=3)
    run = load_run(tmp_path / "r")
    colls = run.events_of([Kind.COLL])
    assert len(colls) == 80
    assert len(np.unique(colls["name_id"])) == 1 and run.s(int(colls["name_id"][0])) == "Allreduce"
    assert len(np.unique(colls["comm_id"])) == 1 and run.s(int(colls["comm_id"][0])) == "world"
    reads = run.events_of([Kind.FILE_READ])
    assert {run.s(int(i)) for i in reads["name_id"]} == {"/data/shard-000.bin"}
    assert run.s(0) == "" and run.sid("world") == int(colls["comm_id"][0]) and run.sid("nope") == -1
    # the per-rank string tables really were different on disk
    import h5py

    tables = []
    for f in sorted((tmp_path / "r").glob("rank-*.h5")):
        with h5py.File(f) as h:
            tables.append(list(h["strings"].asstr()[:]))
    assert len({tuple(t) for t in tables}) > 1


def test_align_recovers_each_ranks_clock_offset_from_sync_samples(tmp_path: Path) -> None:
    t = make_run(tmp_path / "r", iters=10, clock_offsets_ms=[0, 2500.0, -1300.0, 40.0])
    run = load_run(tmp_path / "r")
    a = align(run)
    assert a.aligned and not run.aligned
    # the factory's RTTs are symmetric, so the min-RTT estimate is exact
    np.testing.assert_array_equal(a.offset_ns, t.offset_ns)
    # the n-th collective now starts within its compute jitter on every rank
    c = a.events_of([Kind.COLL])
    first = c[c["seq"] == 0]["t0_ns"]
    assert first.max() - first.min() < 1 * MS
    assert a.wall_s == pytest.approx(t.wall_ns / 1e9, rel=1e-6)
    assert run.wall_s > 3.0  # before alignment the clocks are seconds apart


def test_align_without_sync_samples_still_aligns_and_says_so(tmp_path: Path) -> None:
    # No clock-sync samples: align() falls back (system clocks, or collective
    # exits in the clock engineer's model) and names the ranks in a warning.
    t = make_run(tmp_path / "r", iters=10, sync=False, clock_offsets_ms=[0, 2500.0, -1300.0, 40.0])
    a = align(load_run(tmp_path / "r"))
    assert np.abs(a.offset_ns - t.offset_ns).max() < 0.5 * MS
    assert any("no clock-sync samples for ranks 1-3" in w for w in a.warnings), a.warnings


def test_missing_rank_is_listed_and_the_rest_analyzed(tmp_path: Path) -> None:
    make_run(tmp_path / "r", iters=10, skip_ranks=[2])
    run = load_run(tmp_path / "r")
    assert run.missing_ranks == [2]
    assert sorted(run.ranks) == [0, 1, 3]
    assert any("1 of 4 ranks have no usable file: 2" in w for w in run.warnings), run.warnings


def test_killed_rank_is_loaded_with_its_in_flight_collective(tmp_path: Path) -> None:
    make_run(tmp_path / "r", iters=10, killed_ranks=[1])
    run = load_run(tmp_path / "r")
    assert not run.ranks[1].closed_cleanly and run.ranks[1].exit_code is None
    assert len(run.inflight) == 1 and int(run.inflight["rank"][0]) == 1 and run.inflight["t1_ns"][0] == -1
    assert run.s(int(run.inflight["name_id"][0])) == "Allreduce"
    assert any(w.startswith("rank 1 did not close its file") and "Allreduce (in flight)" in w for w in run.warnings)


def test_foreign_hdf5_file_is_skipped_with_a_reason(tmp_path: Path) -> None:
    make_run(tmp_path / "r", iters=5, skip_ranks=[1])
    write_foreign_h5(tmp_path / "r" / "rank-00001.h5")
    run = load_run(tmp_path / "r")
    assert run.missing_ranks == [1]
    assert any("rank-00001.h5 is an HDF5 file but not a distdiag rank file" in w for w in run.warnings)


def test_only_foreign_files_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "r").mkdir()
    write_foreign_h5(tmp_path / "r" / "rank-00000.h5")
    with pytest.raises(DistdiagError, match="not a distdiag rank file"):
        load_run(tmp_path / "r")


def test_other_schema_version_says_which_distdiag_reads_it(tmp_path: Path) -> None:
    t = make_run(tmp_path / "r", iters=5)
    set_attr(t.files[3], "distdiag_schema", 99)
    set_attr(t.files[3], "distdiag_version", "9.1.0")
    run = load_run(tmp_path / "r")
    assert run.missing_ranks == [3]
    w = [w for w in run.warnings if "rank-00003.h5" in w]
    assert w and "schema 99" in w[0] and "distdiag==9.1.0" in w[0]
    for f in t.files.values():
        set_attr(f, "distdiag_schema", 99)
    with pytest.raises(DistdiagError, match="schema 99"):
        load_run(tmp_path / "r")


def test_duplicate_rank_keeps_the_file_whose_name_matches(tmp_path: Path) -> None:
    t = make_run(tmp_path / "r", iters=5)
    shutil.copy(t.files[1], tmp_path / "r" / "rank-00007.h5")  # claims rank 1 inside
    run = load_run(tmp_path / "r")
    assert sorted(run.ranks) == [0, 1, 2, 3]
    assert run.ranks[1].path.name == "rank-00001.h5"
    assert any("rank 1 appears in both" in w and "skipping rank-00007.h5" in w for w in run.warnings)


@pytest.mark.parametrize("where", [0, 8, 512, 2048, 0.25, 0.5, 0.75, 0.95, -1])
def test_truncated_file_never_crashes_and_is_reported(tmp_path: Path, where: float) -> None:
    t = make_run(tmp_path / "r", iters=5000)  # two 4096-row chunks: cuts land in data and metadata
    src = t.files[2]
    size = src.stat().st_size
    cut = int(size * where) if isinstance(where, float) else (size + where if where < 0 else where)
    tmp = tmp_path / "orig.h5"
    shutil.move(src, tmp)
    truncate_copy(tmp, src, cut)
    run = load_run(tmp_path / "r")  # never raises: three ranks are intact
    assert {0, 1, 3} <= set(run.ranks)
    if 2 in run.ranks:
        # whatever survived is a prefix of what was written, and the loss is said
        assert run.ranks[2].n_events <= 5000
        if run.ranks[2].n_events < 5000:
            assert any("rank-00002.h5" in w and "damaged" in w for w in run.warnings), run.warnings
    else:
        assert run.missing_ranks == [2]
        assert any(w.startswith(("rank-00002.h5 cannot be", "rank-00002.h5 is not an HDF5")) for w in run.warnings)


def test_only_a_truncated_file_is_an_error_that_says_so(tmp_path: Path) -> None:
    t = make_run(tmp_path / "src", iters=10, world_size=2)
    (tmp_path / "r").mkdir()
    truncate_copy(t.files[0], tmp_path / "r" / "rank-00000.h5", 1000)
    with pytest.raises(DistdiagError, match="rank-00000.h5 cannot be opened as HDF5 \\(truncated or corrupt"):
        load_run(tmp_path / "r")


def test_empty_and_nonexistent_dirs_are_errors(tmp_path: Path) -> None:
    with pytest.raises(DistdiagError, match="does not exist"):
        load_run(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("x")
    with pytest.raises(DistdiagError, match="holds no rank-\\*.h5 files \\(did the job run under distdiag-wrap\\?\\)"):
        load_run(tmp_path / "empty")
    (tmp_path / "f.h5").write_text("x")
    with pytest.raises(DistdiagError, match="is not a directory"):
        load_run(tmp_path / "f.h5")


def test_rank_without_any_event_still_loads(tmp_path: Path) -> None:
    s = [""]
    write_rank(tmp_path / "r", 0, 2, [coll(1, 2, 0, s)], s)
    write_rank(tmp_path / "r", 1, 2, [], [""])
    run = load_run(tmp_path / "r")
    assert sorted(run.ranks) == [0, 1] and run.ranks[1].n_events == 0
    assert len(run.events) == 1
