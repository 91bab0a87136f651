"""The breakdown is tallied band of ranks by band of ranks (distdiag.bands, BAND_EVENTS rows a band):
the tables must not depend on where the bands fall, nor on whether the compute phases are in
``run.events`` or come only band by band from the files (a streamed run)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from distdiag import bands
from distdiag import breakdown as bd
from distdiag.clocks import align
from distdiag.match import collectives_of
from distdiag.run import Run, load_run
from distdiag.schema import Kind
from factories import coll, make_run, write_rank


def _take_steps(run: Run) -> pd.DataFrame:
    """The step table the last breakdown left in ``run.cache``, taken out: the next one is made anew."""
    steps = run.cache.step_breakdown
    assert steps is not None
    run.cache.step_breakdown = None
    return steps


def _row(t0_ms: float, t1_ms: float, kind: int, name: str, s: list[str]) -> tuple[Any, ...]:
    r = list(coll(t0_ms, t1_ms, -1, s, op=name, comm=""))
    r[2] = int(kind)
    return tuple(r)


def _ddp_run(run_dir: Path, ranks: int = 5, steps: int = 6) -> None:
    """DDP-like rows: backward with two buckets (the last rank launches late), optimizer, STEP;
    a read in flight on rank 2."""
    for rank in range(ranks):  # a handful of ranks and steps: test data
        s = [""]
        rows = []
        for k in range(steps):
            t = 10 + 120 * k
            late = 7 * (rank == ranks - 1) + k
            rows += [_row(t, t + 3, Kind.INPUT_WAIT, "DataLoader.__next__", s),
                     _row(t + 5, t + 100, Kind.BACKWARD, "Tensor.backward", s),
                     coll(t + 40 + rank, t + 70, 2 * k, s, op="ddp_bucket_allreduce", comm="ddp0:default",
                          kind=Kind.COLL_ASYNC),
                     coll(t + 80 + late, t + 96 + k, 2 * k + 1, s, op="ddp_bucket_allreduce", comm="ddp0:default",
                          kind=Kind.COLL_ASYNC),
                     _row(t + 100, t + 110, Kind.OPTIMIZER, "SGD", s),
                     _row(t + 110, t + 110, Kind.STEP, "optimizer_step", s)]  # fmt: skip
        inflight = [_row(10 + 120 * steps, -1, Kind.FILE_READ, "read", s)] if rank == 2 else None
        write_rank(run_dir, rank, ranks, rows, s, inflight=inflight, end_mono_ns=(30 + 120 * steps) * 1_000_000)


@pytest.mark.parametrize("kind", ["mpi", "ddp"])
def test_band_size_changes_no_number(tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if kind == "mpi":
        make_run(tmp_path / "r", world_size=6, iters=40, io_ms=0.5, slow_rank=3, slow_ms=2.0, killed_ranks=(4,))
    else:
        _ddp_run(tmp_path / "r")
    run = align(load_run(tmp_path / "r"))
    colls = collectives_of(run)
    monkeypatch.setattr(bands, "BAND_EVENTS", 1 << 40)
    one = bd.breakdown(run, colls)
    one_steps = _take_steps(run)
    assert len(list(bands.bands(run))) == 1
    for band in (1, 17, 100):  # one rank a band, a few, uneven
        monkeypatch.setattr(bands, "BAND_EVENTS", band)
        assert len(list(bands.bands(run))) > 1
        got = bd.breakdown(run, colls)
        pd.testing.assert_frame_equal(got, one, check_exact=True)
        pd.testing.assert_frame_equal(_take_steps(run), one_steps, check_exact=True)
        pd.testing.assert_frame_equal(bd.step_breakdown(run, colls), one_steps, check_exact=True)
        _take_steps(run)
    assert one["wall_s"].gt(0).all()
    if kind == "ddp":
        assert len(one_steps) == 5 * 6
        assert one["comm_exposed_s"].gt(0).all() and one["comm_overlapped_s"].gt(0).all()
        assert one.set_index("rank").loc[2, "io_s"] == pytest.approx(0.020)  # the read in flight until the end
    else:
        assert one["io_s"].gt(0).all() and one["comm_wait_s"].gt(0).any()
    np.testing.assert_allclose(one[list(bd.COLUMNS)].sum(axis=1), one["wall_s"], rtol=1e-9)


class _FromTable:
    """A stand-in for the streaming loader's reader (``run.stream``, see distdiag.bands): it
    holds the whole aligned table and gives each band a fresh copy of its rows, every kind."""

    def __init__(self, full: np.ndarray, n: int) -> None:
        self.full = full
        self.bounds = bands.first_rows(full["rank"], n)
        self.reads = 0

    def rank_rows(self, n: int) -> np.ndarray:
        assert n == len(self.bounds) - 1
        return self.bounds

    def read_band(self, run: Any, r_lo: int, r_hi: int) -> np.ndarray:
        self.reads += 1
        return self.full[self.bounds[r_lo] : self.bounds[r_hi]].copy()


def _streamed(run: Run) -> Run:
    """``run`` as the streaming loader leaves it: the compute phases gone from ``run.events``."""
    phases = np.array([int(Kind.PHASE), int(Kind.FORWARD), int(Kind.BACKWARD), int(Kind.OPTIMIZER)])
    keep = ~np.isin(run.events["kind"], phases)
    assert not keep.all()  # the run has phase rows to stream
    out = run.replace(events=run.events[keep])
    out.streamed_kinds = tuple(int(k) for k in phases)
    out.stream = _FromTable(run.events, len(run.rank_bounds()[0]))
    return out


@pytest.mark.parametrize("kind", ["ddp", "phases_first"])
@pytest.mark.parametrize("band_events", [1 << 40, 1, 23])
def test_streamed_phases_give_the_same_tables(
    tmp_path: Path, kind: str, band_events: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The breakdown reads the phases (backward: exposed async time; every phase kind: where step 0
    starts) only from its bands: a run whose table lacks them, whose bands are copies read from
    elsewhere (no offset into run.events), gives the in-memory run's tables to the nanosecond."""
    if kind == "ddp":
        _ddp_run(tmp_path / "r")
    else:  # a forward phase opens step 0 on every rank, long after the rank's start (no loader wait)
        for rank in range(3):
            s = [""]
            rows = []
            for k in range(4):
                t = 50 + 30 * k + rank
                rows += [_row(t, t + 20, Kind.FORWARD, "forward", s), coll(t + 20, t + 25, k, s),
                         _row(t + 26, t + 26, Kind.STEP, "step", s)]  # fmt: skip
            write_rank(tmp_path / "r", rank, 3, rows, s, end_mono_ns=200_000_000)
    run = align(load_run(tmp_path / "r"))
    colls = collectives_of(run)
    monkeypatch.setattr(bands, "BAND_EVENTS", band_events)
    want = bd.breakdown(run, colls)
    want_steps = _take_steps(run)
    srun = _streamed(run)
    got = bd.breakdown(srun, colls)
    assert srun.stream.reads == len(list(bands.band_edges(srun.stream.bounds, band_events)))
    pd.testing.assert_frame_equal(got, want, check_exact=True)
    pd.testing.assert_frame_equal(_take_steps(srun), want_steps, check_exact=True)
    pd.testing.assert_frame_equal(bd.step_breakdown(srun, colls), want_steps, check_exact=True)
    if kind == "ddp":
        assert want["comm_exposed_s"].gt(0).all()  # needs the backward rows
    else:  # step 0 runs from the forward phase at 50 ms (+ rank), not from the rank's start
        first = want_steps[want_steps["step"] == 0].set_index("rank")
        np.testing.assert_allclose(first["wall_s"], 0.026)
