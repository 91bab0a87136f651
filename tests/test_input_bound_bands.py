"""input_bound's critical path is computed band of ranks by band of ranks (distdiag.bands):
its numbers must not depend on where the bands fall, and must be those of the
whole-table computation it replaced (the same floats, so the same JSON)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from distdiag import bands as bd
from distdiag import critical_path as cp
from distdiag.breakdown import AUTO_STEP_NAME, WINDOW_KINDS
from distdiag.clocks import align
from distdiag.critical_path import (
    COMPUTE_KINDS,
    _collective_waits,
    critical_path_cost,
    critical_path_costs,
    priced,
)
from distdiag.intervals import covered_within, union_banded
from distdiag.match import MatchState, collectives_of
from distdiag.run import STREAMED_KINDS, load_run
from distdiag.schema import Kind
from factories import MS, write_rank

KEYS = ("cost_ns", "per_iter_ns", "rank_ns", "busy_ns", "n_iter", "ranks", "count")


def _irregular_run(run_dir: Path, steps: str, world: int = 9, iters: int = 23, seed: int = 5) -> None:
    """A DDP-like run with ns-irregular times and the odd ranks a real run has.

    Per iteration a rank waits on the loader one to three times (the last wait
    sometimes starts inside the forward phase: partly hidden), copies to the
    device, runs forward and backward, all-reduces ("world", blocking) and
    marks the step. Rank 4 has a file but no rows; rank 2 only all-reduces and
    marks steps (no window rows); rank 7 marks no step; rank 5 skips the last
    iterations (fewer steps). ``steps``: "auto" marks with the optimizer hook's
    name on most ranks and distdiag.step()'s "step" on some (the hook's win),
    "user" only with "step".
    """
    rng = np.random.default_rng(seed)
    strings = ["", "DataLoader.__next__", "Tensor.to", "forward", "backward", "Allreduce", "world", AUTO_STEP_NAME,
               "step", "job.py:7"]  # fmt: skip
    sid = {s: i for i, s in enumerate(strings)}

    def row(t0: int, t1: int, kind: int, name: str, comm: str = "", seq: int = -1, nbytes: int = 0) -> tuple[Any, ...]:
        return (int(t0), int(t1), int(kind), sid[name], sid[comm], seq, -1, nbytes, 0, sid["job.py:7"], 0, 0.0)

    T = 50 * MS + rng.integers(0, 3 * MS, world)
    rows: list[list[tuple[Any, ...]]] = [[] for _ in range(world)]
    for i in range(iters):  # test data: a few hundred rows
        arrive = np.zeros(world, np.int64)
        fwd_end = np.zeros(world, np.int64)
        for r in range(world):
            t = int(T[r])
            if r in (2, 4) or (r == 5 and i >= iters - 4):
                arrive[r] = t + int(rng.integers(1, 5 * MS))
                continue
            for _ in range(int(rng.integers(1, 4))):
                d = int(rng.integers(1, 9 * MS)) * (r % 3 != 1)  # ranks 1, 4, 7: a zero-length wait
                rows[r].append(row(t, t + d, Kind.INPUT_WAIT, "DataLoader.__next__"))
                t += d + int(rng.integers(0, MS))
            h = int(rng.integers(1, 3 * MS))
            rows[r].append(row(t, t + h, Kind.H2D, "Tensor.to", nbytes=int(rng.integers(1, 1 << 24))))
            t += h
            f = int(rng.integers(5 * MS, 20 * MS))
            rows[r].append(row(t, t + f, Kind.FORWARD, "forward"))
            if rng.random() < 0.4:  # a prefetch wait that starts inside the forward phase
                p = t + f - int(rng.integers(1, 3 * MS))
                rows[r].append(row(p, p + int(rng.integers(1, 6 * MS)), Kind.INPUT_WAIT, "DataLoader.__next__"))
            fwd_end[r] = t + f
            arrive[r] = t + f + int(rng.integers(5 * MS, 25 * MS))
        done = int(arrive.max()) + int(rng.integers(MS // 2, 2 * MS))
        for r in range(world):
            if r == 4 or (r == 5 and i >= iters - 4):
                continue
            if r != 2:
                rows[r].append(row(int(fwd_end[r]), int(arrive[r]), Kind.BACKWARD, "backward"))
            rows[r].append(row(int(arrive[r]), done, Kind.COLL, "Allreduce", "world", seq=i, nbytes=1 << 20))
            if r != 7:
                name = AUTO_STEP_NAME if steps == "auto" and r % 4 != 3 else "step"
                rows[r].append(row(done + 1000, done + 1000, Kind.STEP, name))
            T[r] = done + 1000 + int(rng.integers(0, MS))
    end = int(T.max()) + 20 * MS
    for r in range(world):
        write_rank(run_dir, r, world, sorted(rows[r]), strings, end_mono_ns=end)


def _whole_table_cost(run: Any, kind: int) -> dict[str, Any]:
    """The computation as it was before bands (reads run.events whole; one rank at a time
    for the windows): the reference the band-by-band one must equal, float for float."""
    ev = run.events
    ranks = np.unique(ev["rank"])
    tmin = int(min(ev["t0_ns"].min(), ev["t1_ns"].min()))
    tmax = int(max(ev["t0_ns"].max(), ev["t1_ns"].max()))
    span = tmax - tmin + 1
    R = len(ranks)

    def rix(m: np.ndarray) -> np.ndarray:
        return np.searchsorted(ranks, ev["rank"][m]).astype(np.int64)

    tm = ev["kind"] == kind
    target = ev[tm]
    cm = np.isin(ev["kind"], COMPUTE_KINDS)
    cs, ce = union_banded(rix(cm), ev["t0_ns"][cm] - tmin, ev["t1_ns"][cm] - tmin, span)
    tr = rix(tm)
    a0 = target["t0_ns"] - tmin + tr * span
    a1 = np.maximum(target["t1_ns"], target["t0_ns"]) - tmin + tr * span
    unhidden = (a1 - a0) - covered_within(cs, ce, a0, a1)
    steps = ev[ev["kind"] == Kind.STEP]
    auto = run.sid(AUTO_STEP_NAME)
    if auto >= 0 and np.any(steps["name_id"] == auto):
        steps = steps[steps["name_id"] == auto]
    srix = np.searchsorted(ranks, steps["rank"]).astype(np.int64)
    st = steps["t0_ns"] - tmin + srix * span
    so = np.argsort(st, kind="stable")
    st, srix = st[so], srix[so]
    n_steps = np.bincount(srix, minlength=R)
    first_step = np.concatenate([[0], np.cumsum(n_steps)])
    n_iter = int(n_steps.max()) + 1 if len(st) else 1
    wm = np.isin(ev["kind"], WINDOW_KINDS)
    wr = rix(wm)
    w_start = np.full(R, np.iinfo(np.int64).max)
    w_end = np.full(R, np.iinfo(np.int64).min)
    np.minimum.at(w_start, wr, ev["t0_ns"][wm] - tmin + wr * span)
    np.maximum.at(w_end, wr, np.maximum(ev["t1_ns"][wm], ev["t0_ns"][wm]) - tmin + wr * span)
    L = np.full((R, n_iter), np.nan)
    for r in np.flatnonzero(w_start <= w_end):  # a test: one rank at a time
        b = np.concatenate([[w_start[r]], st[first_step[r] : first_step[r + 1]], [max(w_end[r], w_start[r])]])
        L[r, : len(b) - 1] = np.maximum(np.diff(b), 0)
    A = np.zeros((R, n_iter))
    np.add.at(A, (tr, np.clip(np.searchsorted(st, a0) - first_step[tr], 0, n_iter - 1)), unhidden)
    W = np.zeros((R, n_iter))
    colls = collectives_of(run)
    ok = (colls.g_state == MatchState.COMPLETE)[colls.m_group]
    m_r = np.searchsorted(ranks, colls.m_rank[ok]).astype(np.int64)
    m_t0 = colls.m_t0_ns[ok] - tmin
    m_last = colls.g_last_ns[colls.m_group[ok]] - tmin
    keep = m_last > m_t0
    ws, we = union_banded(m_r[keep], m_t0[keep], m_last[keep], span)
    wrank = ws // span
    np.add.at(W, (wrank, np.clip(np.searchsorted(st, ws) - first_step[wrank], 0, n_iter - 1)), (we - ws) * 1.0)
    Lz = np.nan_to_num(L)
    B = np.clip(Lz - A - W, 0, None)
    valid = ~np.isnan(L)
    AB = np.where(valid, np.minimum(A, Lz) + B, -np.inf)
    Bv = np.where(valid, B, -np.inf)
    per_iter = np.where(valid.any(axis=0), AB.max(axis=0) - Bv.max(axis=0), 0.0)
    per_iter = np.clip(np.nan_to_num(per_iter, neginf=0.0, posinf=0.0), 0, None)
    return {"cost_ns": float(per_iter.sum()), "per_iter_ns": per_iter, "rank_ns": A.sum(axis=1),
            "busy_ns": B.sum(axis=1), "n_iter": n_iter, "ranks": ranks, "count": len(target)}  # fmt: skip


def _assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    for k in KEYS:
        g, w = got[k], want[k]
        if isinstance(w, np.ndarray):
            assert g.shape == w.shape, k
            np.testing.assert_array_equal(g, w, err_msg=k, strict=False)
        else:
            assert g == w, k


@pytest.mark.parametrize("steps", ["auto", "user"])
@pytest.mark.parametrize("kind", [Kind.INPUT_WAIT, Kind.H2D])
def test_band_size_changes_no_number(tmp_path: Path, steps: str, kind: int, monkeypatch: pytest.MonkeyPatch) -> None:
    _irregular_run(tmp_path / "r", steps)
    run = align(load_run(tmp_path / "r"))
    one = critical_path_cost(run, kind, band_events=1 << 40)
    assert len(list(bd.bands(run, 1 << 40))) == 1
    assert list(one["ranks"]) == [0, 1, 2, 3, 5, 6, 7, 8]  # rank 4: no row
    assert one["n_iter"] == 23 + 1 and one["count"] > 0
    assert one["cost_ns"] > 0 and np.count_nonzero(one["per_iter_ns"]) > 10
    assert one["rank_ns"][list(one["ranks"]).index(2)] == 0 and one["rank_ns"].max() > 0
    _assert_same(one, _whole_table_cost(run, kind))
    for band in (1, 60, 250):  # one rank a band (a band of rank 4 alone has no row), a few, uneven
        assert len(list(bd.bands(run, band))) > 1
        _assert_same(critical_path_cost(run, kind, band_events=band), one)
    for cells in (1, 3 * 24):  # tables of one rank, of three: the bands' ranks in chunks
        monkeypatch.setattr(cp, "_TABLE_CELLS", cells)
        _assert_same(critical_path_cost(run, kind, band_events=1 << 40), one)
        _assert_same(critical_path_cost(run, kind, band_events=250), one)
    monkeypatch.undo()
    # both kinds in one pass: the windows, phases and waits they share made once
    other = Kind.H2D if kind == Kind.INPUT_WAIT else Kind.INPUT_WAIT
    both = critical_path_costs(run, (other, kind), band_events=60)
    _assert_same(both[int(kind)], one)
    _assert_same(both[int(other)], critical_path_cost(run, other, band_events=1 << 40))
    monkeypatch.setattr(bd, "BAND_EVENTS", 1)  # the detectors' default
    p = priced(run, kind, 0.0)
    assert p is not None and p.cost_s == one["cost_ns"] / 1e9
    np.testing.assert_array_equal(p.busy_s, one["busy_ns"] / 1e9)
    assert set(run.cache.priced_costs) == {int(Kind.INPUT_WAIT), int(Kind.H2D)}  # the other one is priced too
    # streamed: the compute phases are not in run.events, only in the bands read from the files
    st = align(load_run(tmp_path / "r", streamed_kinds=STREAMED_KINDS), inplace=True)
    assert not np.isin(st.events["kind"], COMPUTE_KINDS).any()
    for band in (1 << 40, 60):
        _assert_same(critical_path_cost(st, kind, band_events=band), one)


def test_worked_example_and_a_rank_without_rows(tmp_path: Path) -> None:
    """The module docstring's example, per iteration (ms): rank 0 waits 40 on input (10 of it
    under a forward phase it started early), computes 30; rank 2 computes 30, waits 40 for rank 0
    at the all-reduce; rank 1 (between them) has a file and no row."""
    s = ["", "DataLoader.__next__", "forward", "Allreduce", "world", AUTO_STEP_NAME]
    rows: dict[int, list[tuple[Any, ...]]] = {0: [], 1: [], 2: []}

    def row(t0: float, t1: float, kind: int, name: int, seq: int = -1) -> tuple[Any, ...]:
        return (int(t0 * MS), int(t1 * MS), int(kind), name, 4 if seq >= 0 else 0, seq, -1, 8, 0, 0, 0, 0.0)

    for i in range(3):
        t = 10 + 100 * i
        rows[0] += [row(t, t + 40, Kind.INPUT_WAIT, 1), row(t + 30, t + 70, Kind.FORWARD, 2),
                    row(t + 70, t + 71, Kind.COLL, 3, i), row(t + 72, t + 72, Kind.STEP, 5)]  # fmt: skip
        rows[2] += [row(t, t + 30, Kind.FORWARD, 2), row(t + 30, t + 71, Kind.COLL, 3, i),
                    row(t + 72, t + 72, Kind.STEP, 5)]  # fmt: skip
    for r, rr in rows.items():
        write_rank(tmp_path / "r", r, 3, sorted(rr), s, end_mono_ns=400 * MS)
    run = align(load_run(tmp_path / "r"))
    for band in (1 << 40, 1):
        got = critical_path_cost(run, Kind.INPUT_WAIT, band_events=band)
        assert list(got["ranks"]) == [0, 2] and got["n_iter"] == 4
        np.testing.assert_array_equal(got["rank_ns"], [3 * 30 * MS, 0])  # 10 of each 40 hidden by the forward
        # iteration 0 runs from each rank's first window row (t = 10) to its step mark (t = 82):
        # rank 0: a 30 + b 42 (40 computing, 2 in the all-reduce after the last arrival); rank 2: b 32
        # (40 of its 72 waiting for rank 0): max(72, 32) - max(42, 32) = 30; then windows of 100
        # (from one mark to the next) with 30 of the wait unhidden; the last: the window ends at the
        # rank's last window row (t = 280): empty
        np.testing.assert_array_equal(got["per_iter_ns"], [30 * MS, 30 * MS, 30 * MS, 0])
        assert got["cost_ns"] == 90 * MS


def test_collective_waits_by_blocks_of_members(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _irregular_run(tmp_path / "r", "auto")
    run = align(load_run(tmp_path / "r"))
    tmin, tmax = bd.time_bounds(run)
    one = _collective_waits(run, tmin, tmax - tmin + 1)
    assert len(one[0]) > 100
    monkeypatch.setattr("distdiag.critical_path._MEMBER_BLOCK", 7)
    got = _collective_waits(run, tmin, tmax - tmin + 1)
    np.testing.assert_array_equal(got[0], one[0])
    np.testing.assert_array_equal(got[1], one[1])


@pytest.mark.parametrize("streamed", [False, True])
def test_blocks_of_bands_put_together_are_the_one_pass(tmp_path: Path, streamed: bool) -> None:
    # --parallel: each analysis rank prices its block of bands (critical_path_part) with only
    # its ranks' members of the match (parallel._members_of), rank 0 puts them together
    from distdiag.critical_path import PRICED_KINDS, costs_of_parts, critical_path_part
    from distdiag.parallel import _members_of

    _irregular_run(tmp_path / "r", "auto")
    run = align(load_run(tmp_path / "r", streamed_kinds=STREAMED_KINDS if streamed else ()), inplace=True)
    want = critical_path_costs(run, PRICED_KINDS, band_events=60)
    colls = collectives_of(run)
    for n in (1, 2, 3, 7, 50):  # 50: more blocks than bands
        parts = []
        for j in range(n):  # per analysis rank
            edges = bd.part_edges(run, (j, n), 60)
            own = run.replace()  # an analysis rank's copy: its ranks' members only
            own.cache.collectives = _members_of(colls, edges[0][0], edges[-1][1]) if edges else colls
            parts.append(critical_path_part(own, PRICED_KINDS, (j, n), 60))
        got = costs_of_parts(run, PRICED_KINDS, parts)
        assert list(got) == list(want)
        for k in PRICED_KINDS:
            _assert_same(got[k], want[k])
