"""Streaming analysis (issue 10): a large run keeps the compute phases out of the
in-memory table and reads them band by band from the rank files
(distdiag.run._Stream, distdiag.bands). The report must be the in-memory one,
byte for byte, and a stage that still asks ``run.events`` for streamed rows must
fail loudly rather than see none.

Each run dir here is analyzed both ways with ``Config.stream_events`` = -1
(never stream) and 0 (always): synthetic runs with every fault, one whose clock
model is wrong so that the causality repair moves times (the streamed rows must
be repaired the same way), one with per-rank string ids and ranks whose rows
come out of time order, and a real two-rank DDP job (gloo on the CPU) with its
forward/backward/optimizer phases and input waits.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest
from factories import reorder_strings_and_rows

from distdiag import bands
from distdiag.config import Config
from distdiag.pipeline import analyze
from distdiag.render import render
from distdiag.run import STREAMED_KINDS, DistdiagError, load_run, streamed_kinds_for
from distdiag.rows import rows_of
from distdiag.schema import Kind
from distdiag.synth import synth


def _json(run_dir: Path, stream_events: int) -> str:
    cfg = dataclasses.replace(Config(), stream_events=stream_events)
    rep = analyze(run_dir, cfg, stream=True)
    assert bool(rep.run.streamed_kinds) == (stream_events == 0)
    return render(rep, "json")  # type: ignore[no-any-return]


def _same_both_ways(run_dir: Path) -> dict:
    a, b = _json(run_dir, -1), _json(run_dir, 0)
    assert a == b
    return json.loads(a)  # type: ignore[no-any-return]


def test_streamed_bands_equal_the_table_when_the_clock_repair_moves_times(tmp_path: Path) -> None:
    d = tmp_path / "run"
    synth(d, ranks=8, events=2000, fault="straggler", ranks_per_host=2)
    # rank 5's clock samples claim an offset 3 ms off: the model is confidently wrong,
    # the causality check repairs rank 5's times (and with them its streamed rows)
    with h5py.File(d / "rank-00005.h5", "r+") as f:
        s = f["clock_sync"][...]
        s["t_ref_ns"] -= 3_000_000
        f["clock_sync"][...] = s
    from distdiag.clocks import align

    mem = align(load_run(d), inplace=True)
    st = align(load_run(d, streamed_kinds=STREAMED_KINDS), inplace=True)
    assert mem.cache.clock_model.repairs, "the corrupted samples must force a repair"
    assert not np.isin(st.events["kind"], STREAMED_KINDS).any()
    assert bands.time_bounds(st) == bands.time_bounds(mem)
    assert (bands.rank_rows(st) == bands.rank_rows(mem)).all()
    n = 0
    for x, y in zip(bands.bands(mem, 1000), bands.bands(st, 1000), strict=True):
        assert (x.r_lo, x.r_hi) == (y.r_lo, y.r_hi)
        assert x.events.tobytes() == y.events.tobytes()
        assert (x.rows(Kind.FORWARD) == y.rows(Kind.FORWARD)).all()
        n += 1
    assert n > 4
    _same_both_ways(d)


def test_streaming_with_per_rank_string_ids_and_rows_out_of_time_order(tmp_path: Path) -> None:
    d = tmp_path / "run"
    synth(d, ranks=6, events=3000, fault="serial", ranks_per_host=2)
    # another string order on rank 2 (ids follow the order a rank first met a string), and its
    # rows flushed out of time order
    reorder_strings_and_rows(d / "rank-00002.h5")
    mem = load_run(d)
    r2 = mem.events[mem.events["rank"] == 2]
    assert (np.diff(r2["t0_ns"]) >= 0).all()  # sorted on load
    r0 = mem.events[mem.events["rank"] == 0]
    assert mem.s(int(r2["name_id"][0])) == mem.s(int(r0["name_id"][0]))  # ids remapped onto one table
    _same_both_ways(d)


def test_a_real_ddp_job_streams_to_the_same_report(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from test_torch_ddp import torchrun

    torchrun(tmp_path, ["--steps", "12", "--batch", "8"], nproc=2)
    d = tmp_path / "run"
    st = load_run(d, streamed_kinds=STREAMED_KINDS)
    mem = load_run(d)
    phases = np.isin(mem.events["kind"], STREAMED_KINDS).sum()
    assert phases > 0 and len(st.events) == len(mem.events) - phases
    _same_both_ways(d)


def test_a_stage_asking_run_events_for_streamed_rows_fails_loudly(tmp_path: Path) -> None:
    synth(tmp_path / "run", ranks=4, events=500, ranks_per_host=2)  # two hosts: link probe rows stay resident
    st = load_run(tmp_path / "run", streamed_kinds=STREAMED_KINDS)
    with pytest.raises(RuntimeError, match="streamed"):
        rows_of(st, (Kind.STEP, Kind.FORWARD))
    with pytest.raises(RuntimeError, match="streamed"):
        rows_of(st, Kind.COLL)  # kept apart for the match, not in the table
    resident = np.unique(st.events["kind"])
    assert len(rows_of(st, resident)) == len(st.events) > 0  # the table's own kinds are served as before


def test_the_size_rule_and_a_file_changed_between_the_passes(tmp_path: Path) -> None:
    d = tmp_path / "run"
    synth(d, ranks=4, events=500)
    assert {int(Kind.FORWARD), int(Kind.COLL)} <= set(STREAMED_KINDS)  # the phases and the collectives
    assert streamed_kinds_for(d, -1) == ()
    assert streamed_kinds_for(d, 0) == STREAMED_KINDS
    assert streamed_kinds_for(d, 10**9) == ()
    assert streamed_kinds_for(d, 100) == STREAMED_KINDS  # 4 x 500 rows > 100
    st = load_run(d, streamed_kinds=STREAMED_KINDS)
    shutil.copy(d / "rank-00000.h5", d / "rank-00001.h5")  # another file under rank 1's name
    with h5py.File(d / "rank-00001.h5", "r+") as f:
        f.attrs["rank"] = 1
        ev = f["events"][...]
        f["events"].resize((len(ev) - 10,))
    with pytest.raises(DistdiagError, match="changed while it was analyzed"):
        list(bands.bands(st))


def test_once_matched_the_collective_rows_leave_the_table(tmp_path: Path) -> None:
    """After the match a streamed run drops its collective rows too (pipeline.analyze_run):
    the per-rank stages read them from the files."""
    synth(tmp_path / "run", ranks=8, events=1000, fault="straggler", ranks_per_host=4)
    cfg = dataclasses.replace(Config(), stream_events=0)
    rep = analyze(tmp_path / "run", cfg, stream=True)
    assert {int(Kind.COLL), int(Kind.COLL_ASYNC)} <= set(rep.run.streamed_kinds)
    assert not np.isin(rep.run.events["kind"], [int(Kind.COLL), int(Kind.FORWARD)]).any()
    assert rep.run.coll_rows is None and len(rep.collectives.m_rank) > 0  # matched, then let go
    assert rep.verdict is not None and rep.verdict.kind == "straggler"


def test_io_stalls_and_the_datatype_fallback_read_collective_rows_from_the_bands(tmp_path: Path) -> None:
    from test_fileio_detectors import write_ckpt_run
    from test_match_columns import _write_differing_run

    write_ckpt_run(tmp_path / "ckpt", others_wait=True)
    rep = _same_both_ways(tmp_path / "ckpt")
    assert any(f["kind"] == "io_bandwidth" for f in rep["findings"])  # its stall rows include collectives
    _write_differing_run(tmp_path / "mismatch", repeat=True)  # a repeated row: the datatypes' fallback path
    rep = _same_both_ways(tmp_path / "mismatch")
    assert any(f["kind"] == "collective_mismatch" for f in rep["findings"])


def test_collective_rows_kept_apart_for_the_match_are_compact_and_exact(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A streamed run keeps its collective rows for the match in 37-byte rows (run.COLL_ROW_DTYPE)
    plus a small table of their (op, bytes, root, site, datatype): damaged string ids are
    counted as the table's remap counts them, two files claiming one rank take the copying
    path, and the exact fallback of the sig table (a hash collision) gives the same report."""
    from distdiag import run as runmod

    d = tmp_path / "run"
    synth(d, ranks=6, events=1200, fault="straggler", ranks_per_host=3)
    with h5py.File(d / "rank-00003.h5", "r+") as f:  # ids beyond the string table, in collective and phase rows
        ev = f["events"][...]
        ev["name_id"][::97] = 999
        ev["site_id"][5::101] = -3
        f["events"][...] = ev
    with h5py.File(d / "rank-00001.h5", "r+") as f:  # claims rank 4 too: skipped, so the kept parts have a hole
        f.attrs["rank"] = 4
    st = load_run(d, streamed_kinds=streamed_kinds_for(d, 0))
    assert sorted(st.ranks) == [0, 2, 3, 4, 5]
    assert st.coll_rows is not None and st.coll_rows.dtype.itemsize == 37 and st.coll_sigs is not None
    assert len(st.coll_sigs) < 20 and len(st.coll_rows) > 0
    rep = _same_both_ways(d)
    assert any("string ids point outside" in w for w in rep["run"]["warnings"])
    assert any("appears in both" in w for w in rep["run"]["warnings"])
    monkeypatch.setattr(runmod, "_SIG_MIX", np.zeros(5, np.uint64))  # every row one hash: the exact way
    _same_both_ways(d)
