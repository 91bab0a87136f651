"""Which matched collectives mismatch: a member passed another op, size, root or datatype, or
skipped the collective while the others completed it. The ``collective_mismatch`` detector
reports them; ``hang`` leaves a deadlock inside a mismatched collective to it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from distdiag.match import Collectives, GroupColumn, MatchState
from distdiag.passes import RowsPass, run_local
from distdiag.rows import rows_of
from distdiag.schema import COMM_KINDS

if TYPE_CHECKING:
    from distdiag.run import Run

_COMM_ARR = np.array(sorted(int(k) for k in COMM_KINDS), np.uint8)


def _sequenced(ev: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Which of the collective rows ``rows`` carry a sequence number (the matched ones)."""
    return ev["seq"][rows] >= 0  # type: ignore[no-any-return]
MISMATCH_STATES = (MatchState.OP_MISMATCH, MatchState.SIZE_MISMATCH, MatchState.ROOT_MISMATCH)


def member_aux(run: Run, colls: Collectives) -> np.ndarray | GroupColumn:
    """The ``aux`` (datatype id) of every member row of ``colls``, aligned with ``m_rank``.

    Matching gathers it (``colls.m_aux``, a :class:`~distdiag.match.GroupColumn`:
    one value per group plus the members that differ; returned as it is, never
    materialized): then no second pass over the event table (it cost 0.2 us and
    50 bytes of peak RSS per event at 2.6 M events). Without it, or when match
    dropped repeated rows, the rows are found again by (comm, seq, rank), which
    is unique per member (match keeps one row each): a plain int64 array.
    """
    if colls.m_aux is not None and colls.n_dup == 0:
        return colls.m_aux
    out = np.zeros(len(colls.m_rank), np.int64)
    if len(out) == 0:
        return out
    # the member rows: the events' from the run's kind index (distdiag.rows: no scan of
    # the table's kinds), the in-flight rows' by a mask (a handful per rank)
    fields = ("comm_id", "seq", "rank", "aux")
    ev, inf = run.events, run.inflight
    picks: list[list[np.ndarray]] = []  # per table: the member rows' fields
    if set(getattr(run, "streamed_kinds", ())) & {int(k) for k in _COMM_ARR}:
        # a streamed run's collective rows are on disk once matched: band by band, in table
        # order, each band's fields taken before the next is read (no band is kept)
        picks.append(run_local(run, [RowsPass(_COMM_ARR, fields, _sequenced)])[0])
    else:
        sel = rows_of(run, _COMM_ARR)
        sel = sel[ev["seq"][sel] >= 0]
        picks.append([ev[f][sel] for f in fields])
    if len(inf):
        sel = np.flatnonzero(np.isin(inf["kind"], _COMM_ARR) & (inf["seq"] >= 0))
        picks.append([inf[f][sel] for f in fields])
    c, s, r, a = (np.concatenate([p[i] for p in picks]).astype(np.int64) for i in range(len(fields)))
    if len(c) == 0:
        return out
    n_s = int(max(s.max(), colls.g_seq.max())) + 1
    n_r = int(max(r.max(), colls.m_rank.max())) + 1
    key = (c * n_s + s) * n_r + r
    # First row per key. Rows come sorted by (rank, t0), so within a rank each
    # communicator's seqs ascend: a stable sort of the key merges a few long runs
    # (timsort), and on a repeated key (damaged files only) keeps the earliest, as match does.
    o = np.argsort(key, kind="stable")
    k_sorted = key[o]
    first = np.r_[True, k_sorted[1:] != k_sorted[:-1]]
    uk, ua = k_sorted[first], a[o][first]
    mkey = (colls.g_comm[colls.m_group].astype(np.int64) * n_s + colls.g_seq[colls.m_group]) * n_r + colls.m_rank
    pos = np.clip(np.searchsorted(uk, mkey), 0, len(uk) - 1)
    hit = uk[pos] == mkey
    out[hit] = ua[pos[hit]]
    return out


#: :func:`mismatches`' answer: ``(bad, dtype_bad, skipped, aux)``
Mismatches = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | GroupColumn]


def mismatches(run: Run, colls: Collectives) -> Mismatches:
    """``(bad, dtype_bad, skipped, aux)``: per group, whether it mismatches (any state), whether
    by datatype, whether a member skipped it; and the members' datatype ids (:func:`member_aux`).
    Cached on the run."""
    got = run.cache.collective_mismatch
    if got is not None and got[0] is colls:
        return got[1]
    starts = colls.g_start[:-1]
    aux = member_aux(run, colls)
    # dtype: the members that recorded one (aux > 0) disagree, and nothing else does.
    # Per group: the largest recorded id (-1: none) and the smallest (big: none).
    big = np.iinfo(np.int64).max
    if isinstance(aux, GroupColumn):
        # from the group values and the exceptions alone: no member-size array (a group
        # with no exception holds one value, so its smallest and largest agree)
        a_max = aux.group_max().astype(np.int64)
        gv = aux.group_values.astype(np.int64)
        a_min = np.where(gv > 0, gv, big)
        rec = aux.exc_values > 0
        np.minimum.at(a_min, aux.exc_groups()[rec], aux.exc_values[rec])  # exceptions: few
    else:  # rare (no gathered aux, or a dropped duplicate): the member array
        # (a group's largest recorded id is its largest id when that is > 0, else there is none)
        a_max = np.maximum.reduceat(aux, starts)
        a_min = np.minimum.reduceat(np.where(aux > 0, aux, big), starts)
    a_max[a_max <= 0] = -1
    dtype_bad = (a_max > 0) & (a_min != a_max) & ~np.isin(colls.g_state, MISMATCH_STATES)
    inside_any = np.minimum.reduceat(colls.m_t1_ns, starts) < 0
    _, end = run.rank_bounds()
    # Present members all left, some never came, yet their record goes on past it: skipped.
    skipped = np.zeros(len(colls), bool)
    cand = np.flatnonzero((colls.g_state == MatchState.MISSING_RANKS) & ~inside_any & ~dtype_bad)
    present = np.array(sorted(run.ranks), np.int64)
    for g in cand[:1000]:  # groups short of a member that completed anyway: rare
        miss = colls.missing_ranks(int(g))
        miss = miss[np.isin(miss, present)]
        skipped[g] = len(miss) > 0 and bool((end[miss] > colls.g_exit_ns[g]).all())
    bad = np.isin(colls.g_state, MISMATCH_STATES) | dtype_bad | skipped
    out = (bad, dtype_bad, skipped, aux)
    run.cache.collective_mismatch = (colls, out)
    return out
