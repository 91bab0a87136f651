"""load_run's packed table (run.Packer) and the in-place analysis give the same results as copies.

The loader copies each rank's rows into one buffer as it reads; the table is
that buffer when ranks come in file order, and a copy otherwise (files named
out of rank order). The capacity comes from the file sizes; a buffer that is
too small grows and re-points what it handed out. All three paths must give
the very same table, and ``analyze_run(inplace=True)`` the same report as the
copying one.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import distdiag.run as run_mod
from distdiag.config import Config
from distdiag.pipeline import analyze_run
from distdiag.render import render
from distdiag.run import load_run
from distdiag.schema import rank_file_name
from factories import make_run


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("pack") / "r"
    make_run(d, iters=40, io_ms=0.5, clock_offsets_ms=[0, 700.0, -300.0, 20.0], slow_rank=2, slow_ms=3.0, shuffle_strings=True)
    return d


def test_the_packed_table_is_the_buffer_and_equals_a_grown_one(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ref = load_run(run_dir)
    assert ref.events.base is not None  # a view of the packing buffer: no copy was made
    monkeypatch.setattr(run_mod, "capacity_rows", lambda files: 1)  # forces the buffer to grow on every rank
    grown = load_run(run_dir)
    assert grown.events.base is not None  # still the (grown) buffer, not a copy: the views were re-pointed
    np.testing.assert_array_equal(grown.events, ref.events)
    assert grown.warnings == ref.warnings


def test_files_named_out_of_rank_order_give_the_same_table(run_dir: Path, tmp_path: Path) -> None:
    ref = load_run(run_dir)
    d = tmp_path / "swapped"
    d.mkdir()
    # rank 1's file named as rank 3's and the other way round: file order is no longer rank order
    names = {0: 0, 1: 3, 2: 2, 3: 1}
    for r, as_r in names.items():
        shutil.copy(run_dir / rank_file_name(r), d / rank_file_name(as_r))
    got = load_run(d)
    assert got.events.base is None  # the fallback: copied into rank order
    np.testing.assert_array_equal(got.events, ref.events)
    assert sorted(got.ranks) == [0, 1, 2, 3]


def test_inplace_analysis_gives_the_copying_analysis_report(run_dir: Path) -> None:
    cfg = Config()
    copied = json.loads(render(analyze_run(load_run(run_dir), cfg), "json"))
    raw = load_run(run_dir)
    t0_before = raw.events["t0_ns"].copy()
    kept = analyze_run(raw, cfg)  # the default copies: the input run stays raw
    np.testing.assert_array_equal(raw.events["t0_ns"], t0_before)
    inplace = json.loads(render(analyze_run(load_run(run_dir), cfg, inplace=True), "json"))
    assert inplace == copied == json.loads(render(kept, "json"))
    assert [f["ranks"] for f in copied["findings"] if f["kind"] == "straggler"] == [[2]], "rank 2 is slow: the report must name it"


def test_the_table_wide_remap_does_not_depend_on_the_block_size(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """assemble's string-id remap runs by blocks of rows: blocks that mix ranks with and
    without an identity lookup (shuffled strings), or that end exactly at a rank's edge,
    remap as one block does. (The time-order check is the scan's: see the next test.)"""
    ref = load_run(run_dir)
    n0 = int(np.count_nonzero(ref.events["rank"] == 0))
    for rows in (n0, n0 + 1, 7):  # a block edge at rank 1's first row, one past it; many blocks
        monkeypatch.setattr(run_mod, "_ASSEMBLE_ROWS", rows)
        np.testing.assert_array_equal(load_run(run_dir).events, ref.events)


def test_the_scan_while_reading_finds_late_rows_across_its_block_edges(run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The packed read scans each block of rows while it is in cache (run._Scan) and
    assemble sorts only the ranks the scan found out of time order: a pair out of
    order exactly across a scan block's edge, or inside one, is still sorted, also
    when the file is read by row ranges."""
    import h5py

    ref = load_run(run_dir)
    d = tmp_path / "late"
    shutil.copytree(run_dir, d)
    j = 10  # rank 1's rows j and j + 1 swapped: the only out-of-order pair
    with h5py.File(d / rank_file_name(1), "r+") as f:
        ev = f["events"][:]
        ev[[j, j + 1]] = ev[[j + 1, j]]
        f["events"][:] = ev
    # the pair across a scan block's edge; many blocks; one block; the file read by row ranges
    for rows, reads in ((j + 1, 1 << 20), (7, 1 << 20), (1 << 20, 1 << 20), (3, 11)):
        monkeypatch.setattr(run_mod, "_PACK_ROWS", rows)
        monkeypatch.setattr(run_mod, "_READ_BLOCK_ROWS", reads)
        got = load_run(d)
        np.testing.assert_array_equal(got.events, ref.events)
        assert [(i.start_ns, i.end_ns) for i in got.ranks.values()] == [(i.start_ns, i.end_ns) for i in ref.ranks.values()]


def test_string_ids_out_of_range_are_found_on_ranks_whose_lookup_is_the_identity(tmp_path: Path) -> None:
    """A rank whose string table maps onto the global one unchanged is skipped by the
    remap only when its scan found every id in range: a corrupt id in name_id, comm_id,
    site_id or a collective's aux (a datatype id) still becomes 0 ("") and is counted."""
    import h5py

    from distdiag.schema import Kind

    d = tmp_path / "r"
    make_run(d, iters=30)  # no shuffling: every rank's lookup is the identity
    ref = load_run(d)
    with h5py.File(d / rank_file_name(2), "r+") as f:
        ev = f["events"][:]
        n_str = len(f["strings"])
        coll = int(np.flatnonzero(ev["kind"] == int(Kind.COLL))[3])
        ev["name_id"][5] = n_str + 100
        ev["comm_id"][6] = -3
        ev["site_id"][7] = n_str
        ev["aux"][coll] = n_str + 7
        f["events"][:] = ev
    got = load_run(d)
    assert any("4 string ids point outside" in w for w in got.warnings), got.warnings
    lo = int(np.searchsorted(got.events["rank"], 2))
    rows = got.events[lo : lo + len(ev)]
    assert rows["name_id"][5] == 0 and rows["comm_id"][6] == 0 and rows["site_id"][7] == 0 and rows["aux"][coll] == 0
    changed = np.zeros(len(got.events), bool)
    changed[[lo + 5, lo + 6, lo + 7, lo + coll]] = True
    np.testing.assert_array_equal(got.events[~changed], ref.events[~changed])


def test_the_packed_read_and_the_salvaging_read_give_the_same_run(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A table the packed read cannot read goes through the salvaging read (_read_table's
    own path) and is scanned afterwards: same table, same rank bounds, same warnings."""
    ref = load_run(run_dir)

    def fails(*a: object, **k: object) -> None:
        raise OSError("damaged (simulated)")

    monkeypatch.setattr(run_mod.Packer, "read_events", fails)
    got = load_run(run_dir)
    np.testing.assert_array_equal(got.events, ref.events)
    assert got.ranks == ref.ranks and got.warnings == ref.warnings
    np.testing.assert_array_equal(got.inflight, ref.inflight)


@pytest.mark.skipif(run_mod._POPULATE_WRITE is None, reason="madvise(MADV_POPULATE_WRITE) is Linux-only")
def test_the_table_is_its_own_mapping_and_each_rank_range_is_faulted_in_at_once(run_dir: Path) -> None:
    import mmap
    import resource

    ref = load_run(run_dir)
    owner = run_mod._owner(ref.events)
    assert isinstance(owner.base, memoryview) and isinstance(owner.base.obj, mmap.mmap)  # new_table's, no copy
    t = run_mod.new_table(1 << 16)  # 4.6 MB, untouched
    part = t[1000:40_000]
    run_mod.populate(part)
    if run_mod._POPULATE_WRITE is None:
        pytest.skip("this kernel refuses MADV_POPULATE_WRITE")
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    part["rank"] = 7  # resident already: (almost) no fault
    populated = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
    rest = t[45_000:]
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    rest["rank"] = 7  # never populated: a fault a 4 kB page
    faulted = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
    assert populated <= 2 and faulted >= rest.nbytes // mmap.PAGESIZE // 2


def test_without_the_mapping_the_table_is_numpys_and_the_same(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ref = load_run(run_dir)
    monkeypatch.setattr(run_mod, "_POPULATE_WRITE", None)  # an older kernel, or not Linux
    plain = load_run(run_dir)
    assert run_mod._owner(plain.events).base is None  # np.empty's buffer
    assert plain.events.tobytes() == ref.events.tobytes()


def test_inplace_analysis_lets_a_streamed_runs_collective_rows_go(run_dir: Path) -> None:
    """A streamed run keeps its collective rows apart for the match (``Run.coll_rows``). With
    ``inplace=True`` the analysis frees them once matched, though its caller still holds the
    run (``distdiag analyze`` does, to the end): nothing keeps their memory past the match
    (1.8 GB of the 3.9 GB peak at 1024 x 10^5). The report is the one the run gives unstreamed."""
    import gc
    import weakref

    from distdiag.run import STREAMED_KINDS

    cfg = Config()
    want = json.loads(render(analyze_run(load_run(run_dir), cfg, inplace=True), "json"))
    run = load_run(run_dir, streamed_kinds=STREAMED_KINDS)
    assert run.coll_rows is not None and len(run.coll_rows) > 0
    base = run.coll_rows
    while isinstance(base.base, np.ndarray):  # the buffer the rows are a view of
        base = base.base
    gone = weakref.ref(base)
    del base
    got = json.loads(render(analyze_run(run, cfg, inplace=True), "json"))
    gc.collect()
    assert gone() is None, "the collective rows outlived the match"
    assert run.coll_rows is None
    assert got == want
