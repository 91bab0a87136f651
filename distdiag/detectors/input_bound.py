"""input_bound: the compute sits idle waiting for the data loader.

What removing the input wait would save is not simply the sum of the waits:
a wait hidden behind compute costs nothing, and in a synchronous job one
iteration lasts as long as its slowest rank. So the cost is computed per
iteration (the windows between a rank's ``STEP`` rows; the n-th step is the
same iteration on every rank) on the critical path:

    a[r, i]  input wait of rank r in iteration i that no compute phase overlaps
    w[r, i]  time rank r spent waiting for *other* ranks at collectives
             (from its arrival to the last member's arrival, as matched by
             ``distdiag.match``)
    b[r, i]  the rest of the window: rank r's own work  = L[r, i] - a - w
    cost_i = max_r (a + b) - max_r b

Worked example (ms): two ranks, both wait 40 on input and compute 30: each
iteration lasts 70 and would last 30: cost 40. Only rank 0 waits 40, rank 1
computes 30 and then waits 40 for rank 0 in the all-reduce (w = 40, b = 30):
cost = max(70, 30) - max(30, 30) = 40: the wait is on the critical path. Rank 0
waits 40 but rank 1 computes 70 (a slower rank, not the input, binds): cost
max(70, 70) - max(30, 70) = 0.

The same machinery prices host-to-device copies (``h2d_copy``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from distdiag.breakdown import AUTO_STEP_NAME, WINDOW_KINDS  # the window and step marks the breakdown uses
from distdiag.detectors import register
from distdiag.findings import Finding
from distdiag.match import MatchState, collectives_of
from distdiag.rows import count_of, events_of, rows_of, unique_sorted
from distdiag.schema import Kind

log = logging.getLogger(__name__)

#: Phases that keep the compute busy (an input wait overlapping one is hidden).
COMPUTE_KINDS = (Kind.FORWARD, Kind.BACKWARD, Kind.OPTIMIZER, Kind.PHASE)


def merge_intervals(t0: np.ndarray, t1: np.ndarray, group: np.ndarray, span: int) -> tuple[np.ndarray, np.ndarray]:
    """Union of intervals per group, as disjoint sorted segments on a shifted axis.

    Each group's times are shifted by ``group * span`` (span > any time range)
    so all groups merge in one vectorized pass without touching each other.
    """
    if len(t0) == 0:
        z = np.zeros(0, np.int64)
        return z, z
    s = t0.astype(np.int64) + group.astype(np.int64) * span
    e = np.maximum(t1.astype(np.int64), t0.astype(np.int64)) + group.astype(np.int64) * span
    o = np.argsort(s, kind="stable")
    s, e = s[o], e[o]
    run_end = np.maximum.accumulate(e)
    new = np.ones(len(s), bool)
    new[1:] = s[1:] > run_end[:-1]
    starts = s[new]
    idx = np.flatnonzero(new)
    ends = np.maximum.reduceat(e, idx)
    return starts, ends


def covered(seg_s: np.ndarray, seg_e: np.ndarray, t: np.ndarray) -> np.ndarray:
    """C(t): length of the union segments before t (segments sorted, disjoint)."""
    if len(seg_s) == 0:
        return np.zeros(len(t), np.int64)
    lens = seg_e - seg_s
    before = np.concatenate([[0], np.cumsum(lens)])
    k = np.searchsorted(seg_s, t, side="right") - 1
    inside = np.where(k >= 0, np.clip(t - seg_s[np.maximum(k, 0)], 0, lens[np.maximum(k, 0)]), 0)
    return before[np.maximum(k, 0)] * (k >= 0) + inside


def _step_rows(run: Any) -> np.ndarray:
    steps = events_of(run, Kind.STEP)
    if len(steps) == 0:
        return steps
    auto = run.sid(AUTO_STEP_NAME) if hasattr(run, "sid") else -1
    if auto is not None and auto >= 0 and np.any(steps["name_id"] == auto):
        steps = steps[steps["name_id"] == auto]
    return steps


def critical_path_cost(run: Any, kind: int) -> dict[str, Any]:
    """Per-iteration critical-path cost of the time ranks spend in ``kind`` rows.

    Returns ``cost_ns`` (total), ``per_iter_ns`` (array), ``rank_ns`` (each rank's
    unhidden time in ``kind``), ``busy_ns`` (each rank's own work), ``n_iter`` and
    ``ranks`` (the rank ids of the rows of the per-rank arrays).
    """
    ev = run.events
    ranks = unique_sorted(ev["rank"])[0] if len(ev) else np.zeros(0, np.int32)
    empty = {"cost_ns": 0, "per_iter_ns": np.zeros(0), "rank_ns": np.zeros(len(ranks)), "busy_ns": np.zeros(len(ranks)),
             "n_iter": 0, "ranks": ranks, "count": 0}  # fmt: skip
    # Row numbers from the run's kind index (distdiag.rows), not masks over the
    # whole table: the same rows in the same order, without a scan per kind.
    t_idx = rows_of(run, kind)
    if len(t_idx) == 0:
        return empty
    target = ev.take(t_idx)
    tmin = int(min(ev["t0_ns"].min(), ev["t1_ns"].min()))
    tmax = int(max(ev["t0_ns"].max(), ev["t1_ns"].max()))
    span = tmax - tmin + 1
    R = len(ranks)

    def rix(idx: np.ndarray) -> np.ndarray:  # rank -> row 0..R-1 of the rows ``idx``
        return np.searchsorted(ranks, ev["rank"][idx])

    # 1. the target's time that no compute phase of the same rank overlaps
    c_idx = rows_of(run, COMPUTE_KINDS)
    cs, ce = merge_intervals(ev["t0_ns"][c_idx] - tmin, ev["t1_ns"][c_idx] - tmin, rix(c_idx), span)
    tr = rix(t_idx).astype(np.int64)
    a0 = target["t0_ns"].astype(np.int64) - tmin + tr * span
    a1 = np.maximum(target["t1_ns"].astype(np.int64), target["t0_ns"]) - tmin + tr * span
    unhidden = (a1 - a0) - (covered(cs, ce, a1) - covered(cs, ce, a0))

    # 2. iteration windows from the STEP rows
    steps = _step_rows(run)
    srix = np.searchsorted(ranks, steps["rank"]).astype(np.int64)
    st = steps["t0_ns"].astype(np.int64) - tmin + srix * span
    so = np.argsort(st, kind="stable")
    st, srix = st[so], srix[so]
    n_steps = np.bincount(srix, minlength=R)
    first_step = np.concatenate([[0], np.cumsum(n_steps)])  # index of rank r's first step in st
    n_iter = int(n_steps.max()) + 1 if len(st) else 1

    def iteration(t_shifted: np.ndarray, r: np.ndarray) -> np.ndarray:
        return np.searchsorted(st, t_shifted, side="left") - first_step[r]

    w_idx = rows_of(run, WINDOW_KINDS)
    wr = rix(w_idx).astype(np.int64)
    w_start = np.full(R, np.iinfo(np.int64).max)
    w_end = np.full(R, np.iinfo(np.int64).min)
    w_t0 = ev["t0_ns"][w_idx]
    np.minimum.at(w_start, wr, w_t0.astype(np.int64) - tmin + wr * span)
    np.maximum.at(w_end, wr, np.maximum(ev["t1_ns"][w_idx], w_t0).astype(np.int64) - tmin + wr * span)
    have = w_start <= w_end
    # boundaries[r] = [start, step_0, ..., step_{n-1}, end]: window i = (b[i], b[i+1]]
    L = np.full((R, n_iter), np.nan)
    for r in np.flatnonzero(have):  # per rank: a handful of array ops, not per event
        b = np.concatenate([[w_start[r]], st[first_step[r] : first_step[r + 1]], [max(w_end[r], w_start[r])]])
        L[r, : len(b) - 1] = np.maximum(np.diff(b), 0)

    A = np.zeros((R, n_iter))
    it = np.clip(iteration(a0, tr), 0, n_iter - 1)
    np.add.at(A, (tr, it), unhidden)

    # 3. waiting for other ranks at collectives: [own arrival, last arrival], merged per rank
    W = np.zeros((R, n_iter))
    colls = collectives_of(run)
    if len(colls):
        ok = (colls.g_state == MatchState.COMPLETE)[colls.m_group]
        m_r = np.searchsorted(ranks, colls.m_rank[ok]).astype(np.int64)
        m_t0 = colls.m_t0_ns[ok].astype(np.int64) - tmin
        m_last = colls.g_last_ns[colls.m_group[ok]].astype(np.int64) - tmin
        keep = (m_last > m_t0) & (m_r < R)
        if np.any(keep):
            ws, we = merge_intervals(m_t0[keep], m_last[keep], m_r[keep], span)
            wrank = ws // span
            wit = np.clip(iteration(ws, wrank), 0, n_iter - 1)
            np.add.at(W, (wrank, wit), (we - ws).astype(np.float64))

    Lz = np.nan_to_num(L)
    B = np.clip(Lz - A - W, 0, None)
    valid = ~np.isnan(L)
    AB = np.where(valid, np.minimum(A, Lz) + B, -np.inf)
    Bv = np.where(valid, B, -np.inf)
    any_valid = valid.any(axis=0)
    per_iter = np.where(any_valid, AB.max(axis=0, initial=-np.inf) - Bv.max(axis=0, initial=-np.inf), 0.0)
    per_iter = np.clip(np.nan_to_num(per_iter, neginf=0.0, posinf=0.0), 0, None)
    return {
        "cost_ns": float(per_iter.sum()),
        "per_iter_ns": per_iter,
        "rank_ns": A.sum(axis=1),
        "busy_ns": B.sum(axis=1),
        "n_iter": int(n_iter),
        "ranks": ranks,
        "count": int(len(target)),
    }


@dataclass
class Priced:
    """One kind's critical-path cost as the detectors report it (see :func:`priced`)."""

    cost_s: float
    #: steps judged: the windows between ``STEP`` rows
    n_it: int
    #: the ranks that lost at least half as much as the worst one
    named: list[int]
    #: rank -> its own unhidden time of this kind, s (rounded for the evidence)
    per_rank_s: dict[int, float]
    per_iter_ns: np.ndarray
    busy_s: np.ndarray
    count: int


def priced(run: Any, kind: int, min_fraction: float) -> Priced | None:
    """:func:`critical_path_cost` of ``kind``, or None when it stays under
    ``min_fraction`` of the wall-clock (or nothing was recorded).

    Shared by ``input_bound`` and ``h2d_copy``, which price their rows alike.
    """
    wall_s = run.wall_s
    if wall_s <= 0 or count_of(run, kind) == 0:  # nothing recorded: no pass over the table
        return None
    res = critical_path_cost(run, kind)
    cost_s = res["cost_ns"] / 1e9
    if res["count"] == 0 or cost_s < min_fraction * wall_s:
        return None
    rank_s = res["rank_ns"] / 1e9
    return Priced(
        cost_s=cost_s,
        n_it=max(int(res["n_iter"]) - 1, 1),
        named=[int(r) for r, v in zip(res["ranks"], rank_s) if v >= 0.5 * rank_s.max()],
        per_rank_s={int(r): round(float(v), 4) for r, v in zip(res["ranks"], rank_s)},
        per_iter_ns=res["per_iter_ns"],
        busy_s=res["busy_ns"] / 1e9,
        count=int(res["count"]),
    )


@register("input_bound")
def detect(run: Any, cfg: Any) -> list[Finding]:
    p = priced(run, Kind.INPUT_WAIT, float(cfg.value("input_bound", "min_fraction", 0.02)))
    if p is None:
        return []
    cost_s, n_it, named = p.cost_s, p.n_it, p.named
    per_step_ms = float(np.median(p.per_iter_ns[p.per_iter_ns > 0])) / 1e6 if np.any(p.per_iter_ns > 0) else 0.0
    compute_step_ms = 1e3 * float(np.median(p.busy_s)) / n_it
    return [
        Finding(
            kind="input_bound",
            cost_s=cost_s,
            summary=(
                f"the data loader keeps the compute waiting: {cost_s:.3g} s of input wait not hidden by compute "
                f"({per_step_ms:.3g} ms per step against {compute_step_ms:.3g} ms of work per step) over {n_it} steps"
            ),
            ranks=named,
            hosts=run.hosts_of(named) if hasattr(run, "hosts_of") else [],
            evidence={
                "steps": n_it,
                "median_unhidden_wait_per_step_ms": round(per_step_ms, 3),
                "median_work_per_step_ms": round(compute_step_ms, 3),
                "input_wait_s_per_rank": p.per_rank_s,
                "loader_calls": p.count,
            },
            advice=(
                "Feed the model faster: more DataLoader workers (num_workers), prefetch_factor, pin_memory, "
                "persistent_workers; cache or pre-decode the data, or move augmentation to the GPU."
            ),
        )
    ]
