"""The input critical path: what the job would save without a kind of wait (the input wait,
host-to-device copies), iteration by iteration.

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

On a run timed on the GPU (``Kind.GPU_SPAN`` rows, CUDA events) the GPU's own
busy spans (kernels, collectives) count as compute: an input wait the GPU
spends running queued work is hidden, one it spends idle is not.

It prices the input wait (``input_bound``) and host-to-device copies (``h2d_copy``)
in one pass. The tables are filled band of ranks by band (:mod:`distdiag.bands`): a
streamed run's compute phases are only there (see :func:`critical_path_cost`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from distdiag.bands import Band, event_ranks, time_bounds
from distdiag.breakdown import WINDOW_KINDS, step_marks  # the window and step marks the breakdown uses
from distdiag.intervals import covered_within, union_banded, union_sorted
from distdiag.match import MatchState, collectives_of
from distdiag.passes import Pass, run_local, sweep
from distdiag.rows import count_of
from distdiag.schema import Kind

if TYPE_CHECKING:
    from distdiag.config import Config
    from distdiag.run import Run

log = logging.getLogger(__name__)

#: Phases that keep the compute busy (an input wait overlapping one is hidden).
COMPUTE_KINDS = (Kind.FORWARD, Kind.BACKWARD, Kind.OPTIMIZER, Kind.PHASE)
#: GPU spans (CUDA events, :mod:`distdiag.gpu_timeline`) of these kinds keep the GPU busy too:
#: on a GPU-timed run an input wait is hidden while the rank's GPU still runs queued
#: kernels or a collective, whatever its CPU does (the GPU's own busy time, not NVML's
#: "utilization"). A copy's own span is not among them: it would hide the copy itself.
GPU_BUSY_KINDS = (int(Kind.FORWARD), int(Kind.BACKWARD), int(Kind.OPTIMIZER), int(Kind.COLL), int(Kind.COLL_ASYNC))


def compute_rows(band: Band) -> np.ndarray:
    """The band's rows that keep the rank busy: its compute phases, and on a GPU-timed run
    its GPU spans of kernels and collectives (offsets into ``band.events``, ascending)."""
    rows = band.rows(COMPUTE_KINDS)
    g = band.rows(Kind.GPU_SPAN)
    if len(g) == 0:
        return rows
    g = g[np.isin(band.events["aux"][g], GPU_BUSY_KINDS)]
    return np.union1d(rows, g) if len(g) else rows


def _iteration(st: np.ndarray, first_step: np.ndarray, t: np.ndarray, r: np.ndarray, n_iter: int) -> np.ndarray:
    """The iteration of times ``t`` (shifted by rank ``r``): how many of rank r's step marks
    (``st[first_step[r]:first_step[r + 1]]``, shifted alike, ascending) come before each."""
    return np.asarray(np.clip(np.searchsorted(st, t, side="left") - first_step[r], 0, n_iter - 1))


def _cell_sums(r: np.ndarray, i: np.ndarray, v: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """The (rank, iteration) table of the sums of ``v`` (as float64) by cell: what
    ``np.add.at(zeros, (r, i), v)`` gives, the same additions in the same (row) order,
    by one bincount (several times faster than ufunc.at)."""
    flat = r * shape[1] + i
    return np.bincount(flat, weights=v, minlength=shape[0] * shape[1]).reshape(shape)


#: cells (ranks x iterations) of one table of :func:`critical_path_costs` at most (8 MB of
#: float64): a band of ranks with few rows each in a run where some rank has many steps
#: is done in chunks of ranks
_TABLE_CELLS = 1 << 20
#: members per block while the collective waits are gathered (their temporaries: one block's)
_MEMBER_BLOCK = 1 << 18


def _collective_waits(run: Run, tmin: int, span: int) -> tuple[np.ndarray, np.ndarray]:
    """Each rank's waits for other ranks at complete collectives, merged: (start, end) of
    segments shifted by ``rank * span`` (times from ``tmin``), ascending, so by (rank, start).

    A member waits from its own arrival to the last member's arrival; a rank's
    waits are unioned. From the matched collectives (cross-rank data,
    resident), for the bands to slice. The waits are written by blocks of
    members into two arrays (16 B a waiting member; the pages of members that
    do not wait are never touched), then unioned in place (:func:`distdiag.intervals.union_sorted`).
    """
    colls = collectives_of(run)
    n = len(colls.m_rank)
    complete = colls.g_state == MatchState.COMPLETE
    s = np.empty(n, np.int64)
    e = np.empty(n, np.int64)
    k = 0
    for lo in range(0, n, _MEMBER_BLOCK):  # blocks of members
        g = colls.m_group[lo : lo + _MEMBER_BLOCK]
        last = colls.g_last_ns[g]
        t0 = colls.m_t0_ns[lo : lo + _MEMBER_BLOCK]
        keep = complete[g] & (last > t0)
        shift = colls.m_rank[lo : lo + _MEMBER_BLOCK][keep].astype(np.int64) * span - tmin
        m = len(shift)
        np.add(t0[keep], shift, out=s[k : k + m])
        np.add(last[keep], shift, out=e[k : k + m])
        k += m
    return union_sorted(s[:k], e[:k])


def _fold(band: Band, r_lo: int, r_hi: int, rows: dict[Any, np.ndarray], todo: list[int], ranks: np.ndarray,
          acc: dict[int, tuple[np.ndarray, ...]], any_valid: np.ndarray, w_s: np.ndarray, w_e: np.ndarray,
          marks: tuple[np.ndarray, np.ndarray], tmin: int, span: int, n_iter: int) -> None:  # fmt: skip
    """One table of :func:`critical_path_costs`: ranks ``[r_lo, r_hi)`` of ``band``, whose rows of
    each set (``rows``: offsets into ``band.events``) are given, folded into ``acc`` and ``any_valid``;
    ``marks``: the run's step marks, (rank, t_ns) sorted so (:func:`distdiag.breakdown.step_marks`)."""
    nb = r_hi - r_lo
    p_lo, p_hi = np.searchsorted(ranks, [r_lo, r_hi])
    if p_hi == p_lo:
        return  # none of these ranks has an event
    ev = band.events
    t0, t1 = ev["t0_ns"], ev["t1_ns"]

    # the ranks' step marks, shifted by their rank (table rank r = rank - r_lo): sorted, as the marks are
    m_lo, m_hi = np.searchsorted(marks[0], [r_lo, r_hi])
    sr = marks[0][m_lo:m_hi] - r_lo
    st = marks[1][m_lo:m_hi] - tmin + sr * span
    first_step = np.concatenate([[0], np.cumsum(np.bincount(sr, minlength=nb))])  # rank r's marks: st[f[r]:f[r+1]]

    # L: the windows [first window row, step_0, ..., step_{n-1}, end of the last window row]
    L = np.full((nb, n_iter), np.nan)
    w = rows["window"]
    if len(w):
        wr = band.rank_of(w) - r_lo  # ascending: the band's rows go by rank
        g = np.flatnonzero(np.r_[True, wr[1:] != wr[:-1]])
        have = np.zeros(nb, bool)
        have[wr[g]] = True
        w_start = np.zeros(nb, np.int64)
        w_end = np.zeros(nb, np.int64)
        w_t0 = t0[w]
        w_start[wr[g]] = np.minimum.reduceat(w_t0.astype(np.int64) - tmin + wr * span, g)
        w_end[wr[g]] = np.maximum.reduceat(np.maximum(t1[w], w_t0).astype(np.int64) - tmin + wr * span, g)
        # (w_end >= w_start: a row ends at or after its start)
        # window k of rank r ends at its k-th mark and starts at the mark before (the first: at w_start)
        m = have[sr]
        k = np.arange(len(st)) - first_step[sr]
        prev = np.r_[np.int64(0), st[:-1]]
        prev[k == 0] = w_start[sr[k == 0]]
        L[sr[m], k[m]] = np.maximum(st[m] - prev[m], 0)
        # the last window: from the last mark (or w_start) to the end
        n_r = np.diff(first_step)
        hv = np.flatnonzero(have)
        last = w_start[hv]
        marked = n_r[hv] > 0
        last[marked] = st[first_step[hv[marked] + 1] - 1]
        L[hv, n_r[hv]] = np.maximum(w_end[hv] - last, 0)
    Lz = np.nan_to_num(L)
    valid = ~np.isnan(L)
    any_valid |= valid.any(axis=0)
    mine = ranks[p_lo:p_hi] - r_lo

    # w: waiting for other ranks at collectives (merged run-wide, sliced here)
    W = np.zeros((nb, n_iter))
    j0, j1 = np.searchsorted(w_s, [r_lo * span, r_hi * span])
    if j1 > j0:
        ws = w_s[j0:j1] - r_lo * span
        wr_b = ws // span
        W = _cell_sums(wr_b, _iteration(st, first_step, ws, wr_b, n_iter), (w_e[j0:j1] - w_s[j0:j1]) * 1.0, W.shape)

    cs = ce = None  # the compute phases' union, per rank: made once, when a kind has rows here
    for kind in todo:  # one or two kinds
        # a: the kind's time that no compute phase of the same rank overlaps
        A = np.zeros((nb, n_iter))
        t = rows[kind]
        if len(t):  # a[r, i]: sums in row (t0) order
            if cs is None or ce is None:
                c = rows["compute"]
                cs, ce = union_banded(band.rank_of(c) - r_lo, t0[c] - tmin, t1[c] - tmin, span)
            tr = band.rank_of(t) - r_lo
            a0 = t0[t].astype(np.int64) - tmin + tr * span
            a1 = np.maximum(t1[t].astype(np.int64), t0[t]) - tmin + tr * span
            unhidden = (a1 - a0) - covered_within(cs, ce, a0, a1)
            A = _cell_sums(tr, _iteration(st, first_step, a0, tr, n_iter), unhidden, A.shape)
        B = np.clip(Lz - A - W, 0, None)
        rank_ns, busy_ns, ab_max, b_max = acc[kind]
        np.maximum(ab_max, np.where(valid, np.minimum(A, Lz) + B, -np.inf).max(axis=0), out=ab_max)
        np.maximum(b_max, np.where(valid, B, -np.inf).max(axis=0), out=b_max)
        rank_ns[p_lo:p_hi] = A[mine].sum(axis=1)
        busy_ns[p_lo:p_hi] = B[mine].sum(axis=1)


def critical_path_cost(run: Run, kind: int, band_events: int | None = None) -> dict[str, Any]:
    """Per-iteration critical-path cost of the time ranks spend in ``kind`` rows.

    Returns ``cost_ns`` (total), ``per_iter_ns`` (array), ``rank_ns`` (each rank's
    unhidden time in ``kind``), ``busy_ns`` (each rank's own work), ``n_iter`` and
    ``ranks`` (the rank ids of the rows of the per-rank arrays). One kind of
    :func:`critical_path_costs`, which prices several kinds in one pass.

    Band by band (:func:`distdiag.bands.bands`, ``band_events`` rows each): a
    rank's a, b and window lengths need only its own rows (the compute phases
    are streamed kinds), so each band fills its ranks' rows of the per-rank x
    iteration tables and folds them into the run-wide results: the per-rank
    sums, and per iteration the running maxima of ``a + b`` and ``b`` (a max
    is exact in any grouping). What is run-wide comes first: the ranks with
    events and the time bounds (:mod:`distdiag.bands`), the number of
    iterations (the most STEP rows of a rank, + 1; STEP rows are resident)
    and the collective waits w. Times are shifted by ``band rank * span``
    inside a band instead of ``run rank * span``: every number taken from them
    is a difference of two times of one rank, so the same integer. Each table
    cell sums the same rows in the same (t0) order and each row of the tables
    has the run's ``n_iter`` columns, so the floats are those of one band:
    nothing depends on the band size (tests/test_input_bound_bands.py; the
    row sums need the run's column count: numpy's pairwise sum groups a row's
    additions by its length).

    Memory: the tables (a, L, w, b) of one band's ranks x iterations at a
    time, not of all ranks (and at most :data:`_TABLE_CELLS` cells each: a
    band of ranks with few rows each, in a run where some rank has many
    steps, goes in chunks of ranks); the run-wide collective waits, 16 B a
    waiting member. Measured (issue 10, ``benchmarks/bench_input_bound.py
    --size 64x100000 --baseline <worktree of daba0eb> --repeat 2-3``: a
    DDP-like run, 6.4 M events, 800 k each of input waits, copies, bucket
    all-reduces, step marks; best CPU s of 2-3 alternating children per tree
    in each of three runs, peak RSS over the RSS before): input_bound then
    h2d_copy, as the pipeline runs them, 2.7-2.8 -> 0.9-1.05 s (both kinds in
    one pass, :func:`priced`), +68 -> +2-3 B/event (the whole-table one:
    run-wide masks and row copies, then ~105 B a member to merge the
    collective waits: 34 B now); either alone 1.3-1.5 -> 0.83-0.94 s.
    Streamed (the phases read again from the rank files, once): 1.25-1.6 s
    for both, +3-6 B/event. Same JSON, byte for byte, on that run, 256 x 10k
    and 1024 x 1k ones, the synth faults, 1024 x 10k and the torch
    detectors' simulated runs.
    """
    return critical_path_costs(run, (kind,), band_events)[int(kind)]


def critical_path_costs(run: Run, kinds: tuple[int, ...], band_events: int | None = None) -> dict[int, dict[str, Any]]:
    """:func:`critical_path_cost` of each of ``kinds``, in one pass over the bands: the windows,
    the compute phases' union and the collective waits are the same for every kind, and a
    streamed run reads its phases from the rank files once for all (a pass each was 0.3 s of
    1.1 at 64 x 100k, the read of the phases again)."""
    got: dict[int, dict[str, Any]] = run_local(run, [CostsPass(kinds)], band_events)[0]
    return got


@dataclass
class CostPart:
    """What the bands of one block (:func:`distdiag.bands.part_edges`; all of them for
    ``part=None``) give :func:`critical_path_costs`: per kind with rows, the per-rank sums of
    the block's ranks (positions ``[p_lo, p_hi)`` of :func:`distdiag.bands.event_ranks`)
    and the block's per-iteration maxima, and which iterations had a valid window. Blocks
    that cover every band put together (:func:`costs_of_parts`) are the one pass exactly:
    a rank's sums come from its block alone, a maximum is exact in any grouping.
    ``distdiag analyze --parallel`` computes a block on each analysis rank."""

    p_lo: int
    p_hi: int
    acc: dict[int, tuple[np.ndarray, ...]]  # kind -> (rank_ns, busy_ns, ab_max, b_max)
    any_valid: np.ndarray


class _CostAcc:
    """:class:`CostsPass`'s accumulator: the run-wide facts of the pass, and the block's sums."""

    def __init__(self, run: Run, todo: list[int]) -> None:
        self.ranks = event_ranks(run)
        self.todo = todo
        self.tmin, tmax = time_bounds(run)
        self.span = tmax - self.tmin + 1
        self.marks = step_marks(run)  # STEP rows are resident
        # iteration i of a rank: the window after its i-th step mark; n_iter: the most marks a rank has, + 1
        self.n_iter = n_iter = int(np.bincount(self.marks[0]).max()) + 1 if len(self.marks[0]) else 1
        self.w_s, self.w_e = _collective_waits(run, self.tmin, self.span)
        # per kind: each rank's a and b summed; per iteration the max over ranks of a + b and of b
        # (valid windows only)
        R = len(self.ranks)
        self.acc: dict[int, tuple[np.ndarray, ...]] = {
            k: (np.zeros(R), np.zeros(R), np.full(n_iter, -np.inf), np.full(n_iter, -np.inf)) for k in todo
        }
        self.any_valid = np.zeros(n_iter, bool)
        self.chunk = max(1, _TABLE_CELLS // n_iter)  # ranks per table
        self.r_first, self.r_last = -1, -1  # the block's ranks: [r_first, r_last)


class CostsPass(Pass[_CostAcc | None, CostPart | None, dict[int, dict[str, Any]]]):
    """:func:`critical_path_costs` of ``kinds`` as a per-rank pass (:mod:`distdiag.passes`); its
    part is a :class:`CostPart` (None when no kind has rows), its result
    :func:`costs_of_parts`'s."""

    def __init__(self, kinds: tuple[int, ...]) -> None:
        self.kinds = kinds

    def begin(self, run: Run, part: tuple[int, int] | None) -> _CostAcc | None:
        todo = [int(k) for k in self.kinds if count_of(run, k) > 0]
        return _CostAcc(run, todo) if todo else None

    def add(self, acc: _CostAcc | None, band: Band) -> None:
        if acc is None:
            return
        acc.r_first = band.r_lo if acc.r_first < 0 else acc.r_first
        acc.r_last = band.r_hi
        todo, chunk = acc.todo, acc.chunk
        rows: dict[Any, np.ndarray] = {"window": band.rows(WINDOW_KINDS)}
        rows.update({k: band.rows(k) for k in todo})
        if any(len(rows[k]) for k in todo):
            rows["compute"] = compute_rows(band)
        for r_lo in range(band.r_lo, band.r_hi, chunk):  # one chunk, unless ranks with few rows meet many steps
            r_hi = min(band.r_hi, r_lo + chunk)
            if chunk < band.r_hi - band.r_lo:  # the rows of ranks [r_lo, r_hi): their offsets are a range
                e0, e1 = band.first[r_lo - band.r_lo], band.first[r_hi - band.r_lo]
                sub = {k: v[np.searchsorted(v, e0) : np.searchsorted(v, e1)] for k, v in rows.items()}
            else:
                sub = rows
            _fold(band, r_lo, r_hi, sub, todo, acc.ranks, acc.acc, acc.any_valid, acc.w_s, acc.w_e, acc.marks,
                  acc.tmin, acc.span, acc.n_iter)  # fmt: skip

    def part(self, acc: _CostAcc | None) -> CostPart | None:
        if acc is None:
            return None
        p_lo, p_hi = (0, 0) if acc.r_first < 0 else (int(x) for x in np.searchsorted(acc.ranks, [acc.r_first, acc.r_last]))
        return CostPart(p_lo, p_hi, acc.acc, acc.any_valid)

    def reduce(self, run: Run, parts: list[CostPart | None]) -> dict[int, dict[str, Any]]:
        return costs_of_parts(run, self.kinds, parts)


def critical_path_part(run: Run, kinds: tuple[int, ...], part: tuple[int, int] | None,
                       band_events: int | None = None) -> CostPart | None:  # fmt: skip
    """:class:`CostsPass` over the bands of ``part`` (see :class:`CostPart`); None when no kind has rows."""
    got: CostPart | None = sweep(run, [CostsPass(kinds)], part, band_events)[0]
    return got


def costs_of_parts(run: Run, kinds: tuple[int, ...], parts: list[CostPart | None]) -> dict[int, dict[str, Any]]:
    """:func:`critical_path_costs` from the :class:`CostPart` s of blocks that cover every band once."""
    ranks = event_ranks(run)
    R = len(ranks)
    counts = {int(k): count_of(run, k) for k in kinds}
    out: dict[int, dict[str, Any]] = {}
    for k, n in counts.items():  # a kind without rows: nothing to price
        if n == 0:
            out[k] = {"cost_ns": 0, "per_iter_ns": np.zeros(0), "rank_ns": np.zeros(R), "busy_ns": np.zeros(R),
                      "n_iter": 0, "ranks": ranks, "count": 0}  # fmt: skip
    got = [p for p in parts if p is not None]
    if not got:
        return out
    first = got[0]
    acc = {k: tuple(a.copy() for a in v) for k, v in first.acc.items()}
    any_valid = first.any_valid.copy()
    for p in got[1:]:  # per block (one per analysis rank): its ranks' sums, the maxima over all
        for kind, (rank_ns, busy_ns, ab_max, b_max) in acc.items():  # one or two kinds
            o_rank, o_busy, o_ab, o_b = p.acc[kind]
            rank_ns[p.p_lo : p.p_hi] = o_rank[p.p_lo : p.p_hi]
            busy_ns[p.p_lo : p.p_hi] = o_busy[p.p_lo : p.p_hi]
            np.maximum(ab_max, o_ab, out=ab_max)
            np.maximum(b_max, o_b, out=b_max)
        any_valid |= p.any_valid
    n_iter = len(any_valid)
    for kind in acc:  # one or two kinds
        rank_ns, busy_ns, ab_max, b_max = acc[kind]
        per_iter = np.where(any_valid, ab_max - b_max, 0.0)
        per_iter = np.clip(np.nan_to_num(per_iter, neginf=0.0, posinf=0.0), 0, None)
        out[kind] = {
            "cost_ns": float(per_iter.sum()),
            "per_iter_ns": per_iter,
            "rank_ns": rank_ns,
            "busy_ns": busy_ns,
            "n_iter": int(n_iter),
            "ranks": ranks,
            "count": counts[kind],
        }
    return out


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


#: the kinds :func:`priced` prices in one pass (``input_bound``'s and ``h2d_copy``'s)
PRICED_KINDS = (int(Kind.INPUT_WAIT), int(Kind.H2D))


def needs_costs(run: Run, cfg: Config | None) -> bool:
    """Whether a detector will price rows by :func:`priced` (a pass over every band): one that
    requires ``costs`` is enabled, there is a wall-clock, and rows of the priced kinds (as
    :func:`priced` asks). A wrong yes costs a pass, never the report."""
    from distdiag.detectors import required

    if "costs" not in required(cfg.detectors if cfg is not None else None) or run.wall_s <= 0:
        return False
    return any(count_of(run, k) > 0 for k in PRICED_KINDS)


def priced(run: Run, kind: int, min_fraction: float) -> Priced | None:
    """:func:`critical_path_cost` of ``kind``, or None when it stays under
    ``min_fraction`` of the wall-clock (or nothing was recorded).

    Shared by ``input_bound`` and ``h2d_copy``, which price their rows alike.
    """
    wall_s = run.wall_s
    if wall_s <= 0 or count_of(run, kind) == 0:  # nothing recorded: no pass over the table
        return None
    costs = run.cache.priced_costs  # read-only: the other detector reads it too
    if costs is None or int(kind) not in costs:  # both kinds in one pass (the first detector to ask)
        costs = critical_path_costs(run, tuple(sorted({*PRICED_KINDS, int(kind)})))
        run.cache.priced_costs = costs
    res = costs[int(kind)]
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
