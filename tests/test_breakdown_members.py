"""A band's collective members are read from its own event rows (distdiag.breakdown._Band), or,
when that cannot be (the match dropped a duplicate row), gathered from the match's member table:
both ways must give the same tables, to the nanosecond."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from test_breakdown_bands import _ddp_run, _take_steps

from distdiag import bands
from distdiag import breakdown as bd
from distdiag.clocks import align
from distdiag.match import collectives_of
from distdiag.run import Run, load_run
from distdiag.schema import Kind
from factories import coll, make_run, write_rank


def _as(kind: int, row: tuple[Any, ...], aux: int = 0) -> tuple[Any, ...]:
    r = list(row)
    r[2] = int(kind)
    r[8] = aux
    return tuple(r)


def _mixed_run(run_dir: Path, ranks: int = 4, iters: int = 8, dup: bool = False) -> None:
    """Two communicators whose groups interleave in time (so a rank's members in group order are not in
    time order), a collective without a seq, file reads, Iallreduce + a Wait that names it, a step mark
    per iteration, and rank 3 killed inside an all-reduce nobody else entered (in flight)."""
    for rank in range(ranks):  # a handful of ranks and iterations: test data
        s = [""]
        rows = []
        for k in range(iters):
            t = 10 + 50 * k
            rows.append(coll(t + 3 * (rank == k % ranks), t + 5, k, s))  # world: one rank late
            if rank < 2:
                rows.append(coll(t + 6, t + 8 + rank, k, s, comm="pair"))
            rows.append(coll(t + 10, t + 11, -1, s, op="Barrier"))  # no seq: other calls
            rows.append(_as(Kind.FILE_READ, coll(t + 12, t + 15, -1, s, op="read", comm="")))
            a = coll(t + 16 + rank, t + 30, k, s, op="Iallreduce", comm="async", kind=Kind.COLL_ASYNC)
            rows.append(a)
            rows.append(_as(Kind.WAIT, coll(t + 25, t + 30, k, s, op="Wait", comm="async"), aux=a[3]))
            rows.append(_as(Kind.STEP, coll(t + 40, t + 40, -1, s, op="optimizer_step", comm="")))
            if dup and rank == 1 and k == 3:
                rows.append(coll(t + 3, t + 4, k, s))  # the same (world, seq) twice: a damaged file
        rows.sort(key=lambda r: r[0])
        inflight = [coll(10 + 50 * iters, -1, iters, s)] if rank == 3 else None
        write_rank(run_dir, rank, ranks, rows, s, inflight=inflight, end_mono_ns=(30 + 50 * iters) * 1_000_000)


def _tables(run: Run) -> tuple[pd.DataFrame, pd.DataFrame]:
    run.cache.step_breakdown = None
    per_rank = bd.breakdown(run, collectives_of(run))
    return per_rank, _take_steps(run)


def _spy_on_from_events(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Record, per band, whether it read its members from its own event rows."""
    took: list[bool] = []
    from_events = bd._Band._from_events

    def spy(self: Any, ctx: Any) -> bool:
        took.append(from_events(self, ctx))
        return took[-1]

    monkeypatch.setattr(bd._Band, "_from_events", spy)
    return took


@pytest.mark.parametrize("kind", ["mpi", "ddp", "mixed"])
@pytest.mark.parametrize("band_events", [1 << 40, 17])
def test_members_from_event_rows_equal_members_from_the_match(
    tmp_path: Path, kind: str, band_events: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    if kind == "mpi":
        make_run(tmp_path / "r", world_size=6, iters=40, io_ms=0.5, slow_rank=3, slow_ms=2.0, killed_ranks=(4,))
    elif kind == "ddp":
        _ddp_run(tmp_path / "r")
    else:
        _mixed_run(tmp_path / "r")
    run = align(load_run(tmp_path / "r"))
    monkeypatch.setattr(bands, "BAND_EVENTS", band_events)
    took = _spy_on_from_events(monkeypatch)
    per_rank, steps = _tables(run)
    assert took and all(took)  # every band read its members from its own rows
    monkeypatch.setattr(bd._Band, "_from_events", lambda self, ctx: False)
    got, got_steps = _tables(run)
    pd.testing.assert_frame_equal(got, per_rank, check_exact=True)
    pd.testing.assert_frame_equal(got_steps, steps, check_exact=True)
    np.testing.assert_allclose(per_rank[list(bd.COLUMNS)].sum(axis=1), per_rank["wall_s"], rtol=1e-9)
    if kind == "mixed":
        b = per_rank.set_index("rank")
        assert (b["comm_wait_s"] > 0).all() and (b["io_s"] > 0).all() and (b["other_s"] > 0).all()
        assert (b["comm_exposed_s"] > 0).all()
        assert len(steps) == 4 * 8
        # rank 3 sits in its last all-reduce from its start there to its end: waiting throughout
        assert b.loc[3, "comm_wait_s"] > b.loc[0, "comm_wait_s"] + 0.015


def test_a_duplicate_row_falls_back_to_the_member_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _mixed_run(tmp_path / "r", dup=True)
    run = align(load_run(tmp_path / "r"))
    assert collectives_of(run).n_dup == 1
    took = _spy_on_from_events(monkeypatch)
    per_rank, steps = _tables(run)
    assert took and not any(took)
    np.testing.assert_allclose(per_rank[list(bd.COLUMNS)].sum(axis=1), per_rank["wall_s"], rtol=1e-9)
    # the dropped duplicate (inside rank 1's first all-reduce of iteration 3) changes nothing
    clean = tmp_path / "clean"
    _mixed_run(clean)
    want, want_steps = _tables(align(load_run(clean)))
    pd.testing.assert_frame_equal(per_rank, want, check_exact=True)
    pd.testing.assert_frame_equal(steps, want_steps, check_exact=True)

