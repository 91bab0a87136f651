"""The per-rank passes (distdiag.passes) run together in one sweep give what each gives alone,
for any band size and any cut of the bands into blocks (the local executor is one block,
``--parallel`` K of them), in memory and streamed."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, get_args

import numpy as np
import pytest

from distdiag.breakdown import BreakdownPass, StartupEndsPass
from distdiag.cache import PassResult, RunCache
from distdiag.clocks import align
from distdiag.critical_path import PRICED_KINDS, CostsPass
from distdiag.match import collectives_of
from distdiag.parallel import _members_of
from distdiag.passes import RowsPass, analysis_passes, run_local, sweep
from distdiag.bands import part_edges
from distdiag.run import STREAMED_KINDS, load_run, stream_out
from distdiag.slurm import FirstsPass
from test_input_bound_bands import _irregular_run


def _same(a: Any, b: Any, where: str) -> None:
    """The results of one pass, compared exactly: arrays element by element, containers by part."""
    if isinstance(a, np.ndarray):
        np.testing.assert_array_equal(a, b, err_msg=where)
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            _same(a[k], b[k], f"{where}[{k}]")
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    elif a is None or isinstance(a, (int, float, str)):
        assert a == b, where
    else:  # the passes' result objects: their array fields
        fields = {k: v for k, v in vars(a).items() if isinstance(v, (np.ndarray, dict, tuple, list))}
        assert fields, where
        for k, v in fields.items():
            _same(v, getattr(b, k), f"{where}.{k}")


def _results(run: Any, colls: Any) -> list[Any]:
    """Each pass alone, over every band (the local executor, one pass a sweep)."""
    return [run_local(run, [p])[0] for p in (FirstsPass(), CostsPass(PRICED_KINDS), BreakdownPass(colls),
                                             StartupEndsPass())]  # fmt: skip


def _flat(res: list[Any]) -> list[Any]:
    """The breakdown's result as its tallies' arrays (its objects hold the run besides)."""
    firsts, costs, (tally, steps), ends = res
    return [firsts, costs, [tally.per_cat, tally.busy, tally.exposed, tally.overlapped, tally.startup],
            [steps.tally.per_cat, steps.tally.busy, steps.tally.exposed, steps.tally.overlapped, steps.w0], ends]  # fmt: skip


@pytest.mark.parametrize("streamed", [False, True], ids=["in_memory", "streamed"])
@pytest.mark.parametrize("band_events", [60, 1 << 16], ids=["small_bands", "one_band"])
def test_one_sweep_of_every_pass_in_any_blocks_is_each_pass_alone(tmp_path: Path, streamed: bool,
                                                                  band_events: int, monkeypatch: Any) -> None:  # fmt: skip
    _irregular_run(tmp_path / "r", "auto")
    monkeypatch.setattr("distdiag.bands.BAND_EVENTS", band_events)
    run = align(load_run(tmp_path / "r", streamed_kinds=STREAMED_KINDS if streamed else ()), inplace=True)
    colls = collectives_of(run)
    run = stream_out(run)
    want = _flat(_results(run, colls))
    assert want[1][int(PRICED_KINDS[0])]["count"] > 0  # input waits to price
    assert len(want[3][0]) > 0  # steps to tally
    assert (want[4] > run.rank_bounds()[0]).sum() >= 5  # ranks with a start-up
    for n in (1, 2, 3, 50):  # 50: more blocks than bands
        passes = [FirstsPass(), CostsPass(PRICED_KINDS), BreakdownPass(colls), StartupEndsPass()]
        parts = []
        for j in range(n):  # per analysis rank: its own copy of the run, its ranks' members
            edges = part_edges(run, (j, n))
            own = run.replace()
            own.cache.collectives = _members_of(colls, edges[0][0], edges[-1][1]) if edges else colls
            mine = [FirstsPass(), CostsPass(PRICED_KINDS), BreakdownPass(own.cache.collectives), StartupEndsPass()]
            parts.append(sweep(own, mine, (j, n)))
        got = [p.reduce(run, [pp[i] for pp in parts]) for i, p in enumerate(passes)]
        _same(_flat(got), want, f"{n} blocks")


@pytest.mark.parametrize("n", [1, 3])
def test_a_gather_of_rows_is_the_table_s_rows_in_table_order(tmp_path: Path, n: int, monkeypatch: Any) -> None:
    # RowsPass (mismatch's aux, io_bandwidth's stalls on a streamed run): the columns of the
    # kinds' rows that ``keep`` selects, band by band and block by block, are the whole table's
    from distdiag.rows import events_of
    from distdiag.schema import Kind

    _irregular_run(tmp_path / "r", "auto")
    monkeypatch.setattr("distdiag.bands.BAND_EVENTS", 60)
    run = align(load_run(tmp_path / "r"), inplace=True)
    kinds = np.array([Kind.COLL, Kind.INPUT_WAIT], np.uint8)
    fields = ("rank", "t0_ns", "aux")
    ev = events_of(run, kinds)
    keep = ev["t0_ns"] % 3 != 0
    want = [ev[f][keep] for f in fields]
    rp = RowsPass(kinds, fields, lambda e, rows: e["t0_ns"][rows] % 3 != 0)
    got = rp.reduce(run, [sweep(run, [rp], (j, n))[0] for j in range(n)])
    assert len(want[0]) > 100 and len(np.unique(want[0])) > 5
    for f, w, g in zip(fields, want, got):
        np.testing.assert_array_equal(g, w, err_msg=f)


def test_every_pass_of_an_analysis_has_its_attribute_in_the_run_cache() -> None:
    """A sweep puts each result by name (``RunCache.put``): every name must be an attribute."""
    names = set(analysis_passes(colls=object(), firsts=True, costs=True))
    assert names == set(get_args(PassResult))
    assert names <= {f.name for f in dataclasses.fields(RunCache)}
