"""Where each rank's wall-clock went: the per-rank and per-step breakdown of the report.

Columns (seconds, per rank, between the rank's shim start and end):

* ``comm_wait_s``: inside a blocking collective before its last member arrived
  (waiting for others). For a collective that never completed (a member never
  came, or the rank was still inside it when its record ends), all of it.
  Plus the *exposed* part of non-blocking collectives before their last member
  posted (see below).
* ``comm_transfer_s``: inside a blocking collective after the last member
  arrived (the communication itself), plus the exposed part of non-blocking
  collectives after their last member posted.
* ``io_s``: file-system calls (open, stat, listdir, read, write, close).
* ``input_wait_s``: blocked in the data loader. ``h2d_s``: host-to-device copies.
* ``other_s``: other recorded calls: point-to-point, Wait/Test loops
  (``Work.wait``, ``MPI_Wait``) on point-to-point requests, communicator
  creation, collectives without a sequence number. A wait on a non-blocking
  *collective* (``dist.all_reduce(..., async_op=True).wait()``, ``Iallreduce``
  then ``Wait``) is that collective's exposed time instead: it is split like a
  blocking collective at the collective's last arrival, into ``comm_wait_s``
  and ``comm_transfer_s`` (and counted in ``comm_exposed_s``).
* ``compute_s``: the rest: time outside every call above. User phases
  (forward, backward, optimizer, ``distdiag.phase``) count as compute, minus
  the calls recorded inside them and minus exposed communication.

These seven (``COLUMNS``) add up to ``wall_s`` (more only where two threads
ran calls of different categories at once, see below). Two more columns are
information only and are *not* part of that sum (``INFO_COLUMNS``):

* ``comm_exposed_s``: the exposed part of non-blocking collectives; already
  counted in ``comm_wait_s`` + ``comm_transfer_s``.
* ``comm_overlapped_s``: the part of non-blocking collectives' spans that ran
  while the rank computed (hidden behind its own work: counted in ``compute_s``).

Exposed versus overlapped non-blocking collectives (``COLL_ASYNC``: DDP's
gradient buckets, ``async_op=True``). A bucket's row runs from the moment DDP
launched its all-reduce during backward (the bucket's last gradient was ready)
to the moment its Work completed. While later buckets are still being
launched, autograd is still producing gradients: the all-reduce runs behind
the rank's own compute. Once the last bucket of a backward is launched,
autograd has no gradient left to produce; what remains of the backward phase
is DDP's finalize waiting for the buckets in flight. So, per ``BACKWARD`` row
[b0, b1] of a rank, with c = the latest launch of a non-blocking collective
inside it (the end of backward's compute):

    exposed = union of the rank's non-blocking spans launched in [b0, b1),
              clipped to [c, b1]

Every launch inside the backward is at or before c, so the exposed time is one
interval [c, Y) per backward (Y: the latest completion, at most b1). It is split
like a blocking collective: while one of the buckets still in flight lacked a
member rank's launch (matched by comm key and seq), the rank waits for others
(``comm_wait_s``: [c, L), L the latest such moment); after that, transfer
(``comm_transfer_s``: [L, Y)).
What the rule cannot see: autograd work after the last launch (gradients of
inputs that are not parameters) counts as exposed while a bucket is in flight.
Non-blocking spans outside a backward phase are exposed only where the
program blocked on them: in a ``Work.wait``/``MPI_Wait`` row that names the
collective (comm, seq, op), split at the collective's last arrival like a
blocking one (the early ranks wait for the late poster, then the transfer).

Worked example (ms): a backward phase [0, 100); bucket 1 launched at 40,
completed at 70; bucket 2 launched at 80 (c = 80), completed at 95; the last
rank launched bucket 2 at 85. Bucket 1 ended before c: hidden. Bucket 2 is
exposed over [80, 95): 5 ms waiting for the late rank, 10 ms transfer. The
backward phase counts 85 ms of compute; ``comm_overlapped_s`` = spans
(30 + 15) - exposed 15 = 30 ms.

Each column is the union of its intervals (two threads reading files at once
count once), so a column never exceeds the rank's wall-clock; columns of
different categories running at once on different threads may overlap, and
``compute_s`` is what no category covers.

Per step (:func:`step_breakdown`, ``breakdown.per_step`` in the JSON): the same
columns per (rank, step). Steps are the rank's ``STEP`` rows (the optimizer
step hook's ``optimizer_step`` rows when there are any, else ``distdiag.step()``
rows); step k of a rank runs from its STEP row k-1 to its STEP row k, the n-th
step is the same iteration on every rank. Step 0 starts at the rank's first
compute-phase row (loader wait, copy, forward, backward, optimizer, phase) when
one comes before its first STEP row, else at the rank's start. Time after the
last STEP row is no step. A call crossing a step boundary is split at it.

Cost: everything above is per rank, so it is computed band of ranks by band of
ranks (``BAND_EVENTS`` event rows a band; the event table is sorted by rank, so
a band's events are a slice of it): the temporaries (~150 bytes an interval)
scale with a band, not the run, and no number depends on where bands fall
(tests/test_breakdown_bands.py). What is run-wide is kept to one int32 per
member row (their order by rank, built chunk by chunk) and the band bounds
(a binary search over the rank column, never a copy of it).
benchmarks/bench_breakdown.py and ``benchmarks/bench_scale.py --stages``
measure it.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np
import pandas as pd

from distdiag.match import Collectives, MatchState, collectives_of
from distdiag.run import Run
from distdiag.schema import FILE_KINDS, P2P_KINDS, Kind

log = logging.getLogger(__name__)

#: the columns that add up to a rank's wall_s
COLUMNS = ("compute_s", "comm_wait_s", "comm_transfer_s", "io_s", "input_wait_s", "h2d_s", "other_s")
#: information only, not part of that sum (see the module docstring)
INFO_COLUMNS = ("comm_exposed_s", "comm_overlapped_s")
#: what each column means, in words (the text renderer and the breakdown figure)
LABELS = {
    "compute_s": "compute", "comm_wait_s": "waiting in collectives", "comm_transfer_s": "collective transfer",
    "io_s": "file I/O", "input_wait_s": "input wait", "h2d_s": "host-to-device", "other_s": "other calls",
    "comm_exposed_s": "exposed async collectives", "comm_overlapped_s": "async collectives hidden behind compute",
}  # fmt: skip
# category codes for the union computation (compute is what is left)
_WAIT, _XFER, _IO, _INPUT, _H2D, _OTHER = range(6)
_N_CAT = 6
_ASYNC = 6  # a non-blocking collective's whole span: only counted for comm_overlapped_s
_OTHER_KINDS = tuple(int(k) for k in P2P_KINDS) + (int(Kind.WAIT), int(Kind.COMM_CREATE))
# event kind -> category code (_NONE: not one of these; collectives are handled apart)
_NONE = 255
_CAT_OF_KIND = np.full(256, _NONE, np.uint8)
for _cat, _kinds in ((_IO, FILE_KINDS), (_INPUT, (Kind.INPUT_WAIT,)), (_H2D, (Kind.H2D,)), (_OTHER, _OTHER_KINDS)):
    assert (_CAT_OF_KIND[[int(k) for k in _kinds]] == _NONE).all()  # one category a kind (a module constant)
    _CAT_OF_KIND[[int(k) for k in _kinds]] = _cat
#: rows whose start opens a rank's step 0 (before the first one: start-up)
_WINDOW_KINDS = (Kind.INPUT_WAIT, Kind.H2D, Kind.FORWARD, Kind.BACKWARD, Kind.OPTIMIZER, Kind.PHASE)
#: the optimizer hook's STEP rows; preferred over distdiag.step() rows when both exist
AUTO_STEP_NAME = "optimizer_step"
#: breakdown.per_step in the JSON holds at most this many rows; longer runs bin consecutive steps
MAX_STEP_ROWS = 200


def union_ns(key: np.ndarray, t0: np.ndarray, t1: np.ndarray, n_keys: int) -> np.ndarray:
    """Per key, the total length of the union of intervals [t0, t1) (also metadata_storm's blocked time).

    Sweep: sorted by (key, t0), an interval adds what sticks out past the
    furthest end seen so far in its key. [0,10) [2,5) [8,12) -> 10 + 0 + 2 = 12.
    """
    if len(key) == 0:
        return np.zeros(n_keys)
    return _union(key.astype(np.int64), t0, t1, n_keys, _band(int(key.max()), t0, t1))


def _union(key: np.ndarray, t0: np.ndarray, t1: np.ndarray, n_keys: int, band: tuple[int, int] | None) -> np.ndarray:
    """union_ns with ``band`` from :func:`_band` of these intervals or of any superset of them.

    In band coordinates (``key * span - lo + t``) every key's times lie in
    ``[key * span, (key + 1) * span)``, so sorting the starts sorts by (key,
    t0), and one running max of the ends over the whole array never carries a
    value into the next key: at a key's first interval the previous keys' ends
    all lie below its start. The sweep then needs no key-boundary mask and no
    conversion back from band coordinates: 3 gathers and ~8 passes, not the
    ~20 of a sort by (key, t0) and a sweep in times.
    """
    if len(key) == 0:
        return np.zeros(n_keys)
    if band is None:  # astronomically long runs
        o = np.lexsort((t0, key))
        return _sweep(key[o], t0[o], t1[o], n_keys)
    lo, span = band
    s0 = key * span
    s0 -= lo
    s1 = s0 + t1
    s0 += t0
    o = np.argsort(s0, kind="stable")  # timsort: the input is a few sorted runs
    s0, s1, key = s0[o], s1[o], key[o]
    del o
    # reach[i]: the furthest end before interval i (its key's, or below its start)
    reach = np.empty_like(s1)
    reach[0] = np.iinfo(np.int64).min
    np.maximum.accumulate(s1[:-1], out=reach[1:])
    np.maximum(reach, s0, out=reach)
    np.subtract(s1, reach, out=reach)
    np.maximum(reach, 0, out=reach)
    return np.bincount(key, weights=reach, minlength=n_keys)


def _band(key_max: int, t0: np.ndarray, t1: np.ndarray) -> tuple[int, int] | None:
    """(lo, span) that put every key's times into its own band ``key * span - lo``, for keys up to
    ``key_max`` (any upper bound); None when int64 overflows."""
    lo = min(int(t0.min()), int(t1.min()))
    span = max(int(t0.max()), int(t1.max())) - lo + 1
    return (lo, span) if key_max < np.iinfo(np.int64).max // span - 1 else None


def _sweep(key: np.ndarray, t0: np.ndarray, t1: np.ndarray, n_keys: int) -> np.ndarray:
    """union_ns on intervals already sorted by (key, t0), for runs too long for band coordinates."""
    covered = pd.Series(t1).groupby(key).cummax().to_numpy()  # the grouped running max
    prev = np.empty_like(covered)
    prev[1:] = covered[:-1]
    first = np.r_[True, key[1:] != key[:-1]]
    prev[first] = np.iinfo(np.int64).min
    contrib = np.maximum(t0, prev, out=prev)
    np.subtract(t1, contrib, out=contrib)
    np.maximum(contrib, 0, out=contrib)
    return np.bincount(key, weights=contrib, minlength=n_keys)


def _at_or_before(b_rank: np.ndarray, b_t: np.ndarray, q_rank: np.ndarray, q_t: np.ndarray) -> np.ndarray:
    """Per query, how many marks of its own rank lie at or before ``q_t``.

    ``b_*`` (the marks) must be sorted by (rank, t). Marks of rank 0 at 5, 9
    and of rank 1 at 2; query (0, 9) -> 2, (1, 1) -> 0.
    """
    if len(b_t) == 0 or len(q_t) == 0:
        return np.zeros(len(q_t), np.int64)
    q_rank = q_rank.astype(np.int64)
    top = max(int(b_rank.max()), int(q_rank.max()))
    below = np.concatenate([[0], np.cumsum(np.bincount(b_rank.astype(np.int64), minlength=top + 1))])[q_rank]
    return _marks_up_to(b_rank, b_t, q_rank, q_t) - below


def _marks_up_to(b_rank: np.ndarray, b_t: np.ndarray, q_rank: np.ndarray, q_t: np.ndarray) -> np.ndarray:
    """Per query, how many marks sort at or before (q_rank, q_t) in (rank, t) order; marks sorted so.

    So ``result - 1`` is the index of the query's rank's last mark at or before
    it, when that mark's rank is the query's. Like :func:`union_ns`, each
    rank's times go into their own band (rank * span), so one binary search
    over all marks finds it.
    """
    nb, nq = len(b_t), len(q_t)
    b_rank = b_rank.astype(np.int64)
    q_rank = q_rank.astype(np.int64)
    lo = min(int(b_t.min()), int(q_t.min()))
    span = max(int(b_t.max()), int(q_t.max())) - lo + 1
    top = max(int(b_rank.max()), int(q_rank.max()))
    if top < np.iinfo(np.int64).max // span - 1:
        marks = b_rank * span + (b_t.astype(np.int64) - lo)
        return np.searchsorted(marks, q_rank * span + (q_t.astype(np.int64) - lo), side="right")
    # astronomically long runs: one lexsort of marks and queries together (a mark first at equal times)
    rank = np.concatenate([b_rank, q_rank])
    t = np.concatenate([b_t, q_t]).astype(np.int64)
    is_q = np.concatenate([np.zeros(nb, np.int8), np.ones(nq, np.int8)])
    order = np.lexsort((is_q, t, rank))
    seen = np.cumsum(order < nb)
    out = np.empty(nq, np.int64)
    q = order >= nb
    out[order[q] - nb] = seen[q]
    return out


class _Band:
    """A band of ranks [r_lo, r_hi): its event rows (a view: the table is sorted by rank) and its collective rows."""

    def __init__(self, run: Run, colls: Collectives, r_lo: int, r_hi: int, e_lo: int, e_hi: int,
                 rows: np.ndarray, first: np.ndarray, bounds: tuple[np.ndarray, np.ndarray],
                 one_kind: int | None) -> None:  # fmt: skip
        self.r_lo, self.r_hi = r_lo, r_hi
        self.start, self.end = bounds  # run.rank_bounds(), once for every band (O(ranks) each call)
        self.ev = run.events[e_lo:e_hi]
        # the band's kind column, contiguous (1 byte a row): every per-kind mask reads it, not the 73-byte rows
        self.kind = np.ascontiguousarray(self.ev["kind"])
        self.rows = rows
        # one kind for every member (an MPI run: all blocking): no gather from the member table
        self.m_kind = colls.m_kind[rows] if one_kind is None else np.full(len(rows), one_kind, np.uint8)
        self.m_t1 = colls.m_t1_ns[rows]
        # the rows' ranks (int64) without a gather: rows come sorted by rank, ``first`` their offsets
        self.m_rank = np.repeat(np.arange(r_lo, r_hi), np.diff(first[r_lo : r_hi + 1]))


def _rows_by_rank(colls: Collectives, n: int, chunk: int = 1 << 18) -> tuple[np.ndarray, np.ndarray]:
    """(order, first): the member rows sorted by rank, in the table's order within a rank; rank r's are
    ``order[first[r]:first[r + 1]]``.

    A stable radix sort on 16 bits, once (not a mask per band). With a rank's rows
    in table order its intervals come in a few sorted runs, which the unions'
    (key, t0) sorts merge 2-3x faster than rows interleaved by group.
    Chunk by chunk of ``chunk`` rows (a chunk's rows of rank r go after the
    earlier chunks' ones), straight into an int32 ``order``: one argsort of the
    whole column made an int64 copy and then the int32 one (6 -> 2 bytes an
    event of peak at 1,024 x 10k).
    """
    r = colls.m_rank
    m = len(r)
    bounds = range(0, m, chunk)
    total = np.zeros(n, np.int64)
    for a in bounds:  # a chunk at a time: bincount casts to int64
        total += np.bincount(r[a : a + chunk], minlength=n)
    first = np.zeros(n + 1, np.int64)
    np.cumsum(total, out=first[1:])
    order = np.empty(m, np.int32 if m < np.iinfo(np.int32).max else np.int64)
    seen = first[:-1].copy()  # where each rank's next rows go
    for a in bounds:  # a few dozen chunks
        rc = r[a : a + chunk]
        o = np.argsort(rc.astype(np.uint16) if n <= 1 << 16 else rc, kind="stable")
        cnt = np.bincount(rc, minlength=n)
        # the chunk's sorted rows of rank q are o[c_first[q]:...]; they go to seen[q], seen[q] + 1, ...
        base = seen - (np.cumsum(cnt) - cnt)
        order[base[rc[o]] + np.arange(len(o))] = o + a
        seen += cnt
    return order, first


def _bands(run: Run, n: int, band_events: int) -> list[tuple[int, int, int, int]]:
    """(r_lo, r_hi, e_lo, e_hi): consecutive ranks holding about ``band_events`` event rows each."""
    bounds = _first_rows(run.events["rank"], n)
    total = int(bounds[-1])
    k = max(1, math.ceil(total / max(1, band_events)))
    edges = np.unique(np.r_[0, np.searchsorted(bounds, np.arange(1, k) * (total / k)), n])
    return [(int(a), int(b), int(bounds[a]), int(bounds[b])) for a, b in zip(edges[:-1], edges[1:])]


def _first_rows(rank: np.ndarray, n: int) -> np.ndarray:
    """Per r in 0..n, the first row whose rank is >= r in the rank-sorted column ``rank`` (a strided view).

    One binary search per rank, all ranks at once (~log2(rows) steps over n + 1
    lanes): ``np.searchsorted`` would copy the strided int32 column, then cast it
    to int64 for int64 queries (12 bytes an event of transient, breakdown's peak).
    """
    q = np.arange(n + 1)
    lo = np.zeros(n + 1, np.int64)
    hi = np.full(n + 1, len(rank), np.int64)
    while True:  # ~log2(rows) steps
        act = np.flatnonzero(lo < hi)
        if len(act) == 0:
            return lo
        mid = (lo[act] + hi[act]) >> 1
        below = rank[mid] < q[act]
        lo[act[below]] = mid[below] + 1
        hi[act[~below]] = mid[~below]


def _collective_intervals(colls: Collectives, b: _Band, rank_end: np.ndarray) -> tuple[np.ndarray, ...]:
    """(rank, cat, t0, t1) of the wait and transfer parts of every blocking collective of the band."""
    blocking = b.m_kind == Kind.COLL
    rows = b.rows[blocking]
    g = colls.m_group[rows]
    rank = b.m_rank[blocking]
    t0 = colls.m_t0_ns[rows]
    t1 = b.m_t1[blocking]
    open_ = t1 < 0
    t1 = np.where(open_, rank_end[rank], t1)  # still inside at the end of its record
    return _split_at_last_arrival(colls, g, rank, t0, t1)


def _split_at_last_arrival(
    colls: Collectives, g: np.ndarray, rank: np.ndarray, t0: np.ndarray, t1: np.ndarray
) -> tuple[np.ndarray, ...]:
    """(rank, cat, t0, t1): each [t0, t1) of group g cut at the group's last arrival into wait and transfer."""
    state = colls.g_state[g]
    # A member who never came, or one that never left: everyone inside waited throughout.
    never = (state == MatchState.IN_FLIGHT) | (colls.g_exit_ns[g] < 0)
    # A group missing a rank whose file is lost did complete (everyone left):
    # the present members' last arrival is then the best estimate of the split.
    last = colls.g_last_ns[g]
    split = np.where(never, t1, np.clip(last, t0, t1))
    ranks = np.concatenate([rank, rank])
    cats = np.concatenate([np.full(len(rank), _WAIT, np.uint8), np.full(len(rank), _XFER, np.uint8)])
    return ranks, cats, np.concatenate([t0, split]), np.concatenate([split, t1])


def _exposed_async(b: _Band, colls: Collectives) -> tuple[np.ndarray, ...]:
    """(rank, cat, t0, t1) of the exposed pieces of the band's non-blocking collectives (module docstring)."""
    ev = b.ev
    a = (b.m_kind == Kind.COLL_ASYNC) & (b.m_t1 >= 0)
    bm = b.kind == Kind.BACKWARD
    if not a.any() or not bm.any():
        z = np.zeros(0, np.int64)
        return z, z.astype(np.uint8), z, z
    rows = b.rows[a]
    a_rank = b.m_rank[a]
    a0 = colls.m_t0_ns[rows].astype(np.int64)
    a1 = np.maximum(b.m_t1[a].astype(np.int64), a0)
    g = colls.m_group[rows]
    b_rank = ev["rank"][bm].astype(np.int64)
    b0 = ev["t0_ns"][bm].astype(np.int64)
    b1 = np.maximum(ev["t1_ns"][bm].astype(np.int64), b0)
    if not _sorted_by_rank_time(b_rank, b0):  # the table is sorted by (rank, t0): never, but cheap to check
        o = np.lexsort((b0, b_rank))
        b_rank, b0, b1 = b_rank[o], b0[o], b1[o]
    # the backward row each launch falls in: the rank's last one that began at or before it
    j = _marks_up_to(b_rank, b0, a_rank, a0) - 1
    jj = np.maximum(j, 0)
    inside = (j >= 0) & (b_rank[jj] == a_rank) & (a0 < b1[jj])
    # c: the last launch inside each backward (its compute ended there)
    c = b0.copy()
    np.maximum.at(c, j[inside], a0[inside])
    # Every launch in a backward is at or before its c, so every exposed piece
    # starts at c: per backward the exposed time is one interval [c, Y), Y the
    # latest completion (up to b1), and its wait part is [c, L), L the latest
    # moment one of those buckets still lacked a member's launch.
    y = np.minimum(a1, b1[jj])
    keep = inside & (y > c[jj])
    jk = j[keep]
    y = y[keep]
    gk = g[keep]
    never = (colls.g_state[gk] == MatchState.IN_FLIGHT) | (colls.g_exit_ns[gk] < 0)
    lasts = np.where(never, y, np.clip(colls.g_last_ns[gk], c[jk], y))
    Y = c.copy()
    L = c.copy()
    np.maximum.at(Y, jk, y)
    np.maximum.at(L, jk, lasts)
    hit = np.flatnonzero(Y > c)
    rank = np.concatenate([b_rank[hit], b_rank[hit]])
    cats = np.concatenate([np.full(len(hit), _WAIT, np.uint8), np.full(len(hit), _XFER, np.uint8)])
    return rank, cats, np.concatenate([c[hit], L[hit]]), np.concatenate([L[hit], Y[hit]])


def _waits_on_async(b: _Band, colls: Collectives) -> tuple[np.ndarray, np.ndarray]:
    """(rows, groups): the band's WAIT rows that wait on one of the rank's non-blocking collectives.

    A ``Work.wait`` / ``MPI_Wait`` row names what it waits for (comm key, seq and
    op, recorded by the shim; seq is -1 for point-to-point). It is linked to the
    rank's COLL_ASYNC member row with the same (rank, comm, seq, op): one sort of
    both key sets together, no loop per row.
    """
    ev = b.ev
    w = np.flatnonzero(b.kind == Kind.WAIT)
    w = w[ev["seq"][w] >= 0]
    am = b.rows[b.m_kind == Kind.COLL_ASYNC]
    z = np.zeros(0, np.int64)
    if len(w) == 0 or len(am) == 0:
        return z, z
    g = colls.m_group[am]
    nm = len(am)
    r = np.concatenate([b.m_rank[b.m_kind == Kind.COLL_ASYNC], ev["rank"][w]]).astype(np.int64)
    c = np.concatenate([colls.g_comm[g], ev["comm_id"][w]]).astype(np.int64)
    q = np.concatenate([colls.g_seq[g], ev["seq"][w]]).astype(np.int64)
    o = np.concatenate([colls.m_op[am], ev["aux"][w]]).astype(np.int64)
    is_w = np.r_[np.zeros(nm, np.int8), np.ones(len(w), np.int8)]
    order = np.lexsort((is_w, o, q, c, r))  # within one key: the member first, then its waits
    rs, cs, qs, os_ = r[order], c[order], q[order], o[order]
    new_key = np.r_[True, (rs[1:] != rs[:-1]) | (cs[1:] != cs[:-1]) | (qs[1:] != qs[:-1]) | (os_[1:] != os_[:-1])]
    key_start = np.maximum.accumulate(np.where(new_key, np.arange(len(order)), 0))
    head = order[key_start]  # the first row of each sorted row's key: a member when there is one
    hit = (order >= nm) & (head < nm)
    return w[order[hit] - nm], g[head[hit]]


def _intervals(run: Run, colls: Collectives, b: _Band) -> dict[str, np.ndarray]:
    """Every categorized interval of the band's ranks, clipped to the rank's record.

    ``rank`` (int64), ``cat`` (uint8: one of the category codes, or ``_ASYNC``
    for a non-blocking collective's whole span), ``t0``, ``t1`` (int64) and
    ``exposed`` (bool: an exposed piece of a non-blocking collective). Within
    a rank, intervals come in the same order whatever the band.
    """
    start, end = b.start, b.end
    ev = b.ev
    kind = b.kind
    r_ev = ev["rank"]  # a view (int32)

    parts_rank, parts_cat, parts_t0, parts_t1, parts_exp = [], [], [], [], []

    def put(rank: np.ndarray, cat: np.ndarray | int, t0: np.ndarray, t1: np.ndarray, exposed: bool = False) -> None:
        parts_rank.append(rank)
        parts_cat.append(np.broadcast_to(np.asarray(cat, np.uint8), (len(rank),)))
        parts_t0.append(t0)
        parts_t1.append(t1)
        parts_exp.append(np.broadcast_to(exposed, (len(rank),)))

    # Every event row's category in one table lookup (not a mask per category);
    # collectives without a sequence number are other calls.
    code = _CAT_OF_KIND[kind]
    coll = np.flatnonzero(kind == Kind.COLL)
    inf = run.inflight
    if len(inf):
        inf = inf[(inf["rank"] >= b.r_lo) & (inf["rank"] < b.r_hi)]
    # The match's members are the COLL rows with seq >= 0 (and in-flight rows): when
    # the band has no in-flight row and as many blocking members as COLL rows, no
    # COLL row has seq < 0, and the seq column (a gather from the 73-byte rows,
    # 6% of the breakdown) need not be read. Otherwise it is.
    if len(inf) or len(coll) != np.count_nonzero(b.m_kind == Kind.COLL):
        code[coll[ev["seq"][coll] < 0]] = _OTHER
    del coll
    linked, lg = _waits_on_async(b, colls)
    code[linked] = _NONE  # a wait on a non-blocking collective is that collective's exposed time
    sel = np.flatnonzero(code != _NONE)
    put(r_ev[sel], code[sel], ev["t0_ns"][sel], ev["t1_ns"][sel])
    del code, sel
    if len(linked):
        wr, wc, w0, w1 = _split_at_last_arrival(
            colls, lg, r_ev[linked].astype(np.int64), ev["t0_ns"][linked], ev["t1_ns"][linked]
        )
        put(wr, wc, w0, w1, exposed=True)
    # In-flight rows that are not collectives (a rank killed inside a read): until the end.
    if len(inf):
        ic = _CAT_OF_KIND[inf["kind"]]  # the same table as the event rows'
        m = np.flatnonzero(ic != _NONE)
        ir = inf["rank"][m].astype(np.int64)
        put(ir, ic[m], inf["t0_ns"][m], end[ir])
    cr, cc, c0, c1 = _collective_intervals(colls, b, end)
    put(cr, cc, c0, c1)
    del cr, cc, c0, c1
    er, ec, e0, e1 = _exposed_async(b, colls)
    put(er, ec, e0, e1, exposed=True)
    am = (b.m_kind == Kind.COLL_ASYNC) & (b.m_t1 >= 0)
    put(b.m_rank[am], _ASYNC, colls.m_t0_ns[b.rows[am]], b.m_t1[am])

    rank_of = np.concatenate(parts_rank, dtype=np.int64, casting="same_kind")
    del parts_rank
    # Clip to the rank's record: nothing before its start or after its end counts.
    lo, hi = start[rank_of], end[rank_of]
    t0 = np.concatenate(parts_t0, dtype=np.int64, casting="same_kind")
    del parts_t0
    np.clip(t0, lo, hi, out=t0)
    t1 = np.concatenate(parts_t1, dtype=np.int64, casting="same_kind")
    del parts_t1
    np.clip(t1, lo, hi, out=t1)
    del lo, hi
    np.maximum(t0, t1, out=t1)
    return {
        "rank": rank_of,
        "cat": np.concatenate(parts_cat),
        "t0": t0,
        "t1": t1,
        "exposed": np.concatenate(parts_exp, dtype=bool),
    }


class _Tally:
    """Per key (ns): each category's union, ``busy`` (the union of all of them), ``exposed``, ``overlapped``.

    Filled band by band: a band's keys are one contiguous range ``[k_lo, k_hi)``.
    """

    def __init__(self, n_keys: int) -> None:
        self.per_cat = np.zeros((n_keys, _N_CAT))
        self.busy = np.zeros(n_keys)
        self.exposed = np.zeros(n_keys)
        self.overlapped = np.zeros(n_keys)

    def add(self, k_lo: int, k_hi: int, key: np.ndarray, cat: np.ndarray, t0: np.ndarray, t1: np.ndarray,
            ex: np.ndarray) -> None:  # fmt: skip
        """Tally intervals whose keys (relative to ``k_lo``) lie in ``[0, k_hi - k_lo)``.

        (One sort by (key, t0) shared by the three key-wide unions measured 25%
        slower than four :func:`union_ns` calls: those sort nearly sorted runs.)
        """
        n = k_hi - k_lo
        if len(key) == 0:
            return
        own = cat != _ASYNC
        spans = not own.all()  # no non-blocking spans (MPI runs): no copies, no overlapped union
        k, c, a, b = (key[own], cat[own], t0[own], t1[own]) if spans else (key, cat, t0, t1)
        # one band for every union below (each covers a subset of these intervals; keys < n * _N_CAT)
        band = _band(n * _N_CAT, t0, t1)
        kc = k * _N_CAT
        kc += c
        self.per_cat[k_lo:k_hi] = _union(kc, a, b, n * _N_CAT, band).reshape(n, _N_CAT)
        del c, kc
        busy = _union(k, a, b, n, band)
        del k, a, b
        self.busy[k_lo:k_hi] = busy
        self.exposed[k_lo:k_hi] = _union(key[ex], t0[ex], t1[ex], n, band)
        # the async spans' time outside every category = |spans U busy| - |busy|
        # (no spans: none; MPI runs skip the sort)
        if spans:
            self.overlapped[k_lo:k_hi] = np.maximum(0.0, _union(key, t0, t1, n, band) - busy)


def _columns(t: _Tally, span_ns: np.ndarray, rows: np.ndarray) -> dict[str, np.ndarray]:
    """The seconds columns for the keys ``rows`` of a tally."""
    pc = t.per_cat
    return {
        "wall_s": span_ns[rows] / 1e9,
        "compute_s": np.maximum(0.0, span_ns - t.busy)[rows] / 1e9,
        "comm_wait_s": pc[rows, _WAIT] / 1e9,
        "comm_transfer_s": pc[rows, _XFER] / 1e9,
        "io_s": pc[rows, _IO] / 1e9,
        "input_wait_s": pc[rows, _INPUT] / 1e9,
        "h2d_s": pc[rows, _H2D] / 1e9,
        "other_s": pc[rows, _OTHER] / 1e9,
        "comm_exposed_s": t.exposed[rows] / 1e9,
        "comm_overlapped_s": t.overlapped[rows] / 1e9,
    }


#: ranks are tallied in bands of consecutive ranks holding about this many event rows
#: each, so the temporaries (~150 bytes per interval) scale with a band, not the run.
#: Measured (2.56 M events, bench_breakdown's DDP run / a synth run): 2^20 -> 2^18
#: took +63 -> +45 / +54 -> +26 bytes a run's event of peak and no more CPU (a bit less).
#: Then (1,024 x 10k synth run, breakdown alone, first call in a fresh process, two runs):
#: 2^18 / 2^17 / 2^16 / 2^15: +3.6 / +2.3 / +1.9 / +1.9 B/event (1.9 of it the rank
#: order, see _rows_by_rank), 1.50-1.67 / 1.39-1.68 / 1.33-1.45 / 1.33-1.34 s of CPU
#: (a band's temporaries stay in cache); a band costs ~0.2 ms of fixed overhead
BAND_EVENTS = 1 << 16


def _compute(run: Run, colls: Collectives, ranks: bool) -> tuple[_Tally | None, pd.DataFrame]:
    """The per-rank tally (when ``ranks``) and the per-step table, band of ranks by band of ranks.

    Every number is a rank's own: a band's intervals, unions and step pieces
    involve only its ranks' rows (the event table is sorted by rank, so a
    band's events are a slice of it), and the result does not depend on the
    band size (each union is a sum of whole nanoseconds, exact in float64).
    """
    start, end = run.rank_bounds()
    n = len(start)
    tally = _Tally(n) if ranks else None
    steps = _Steps(run, n)
    if tally is None and steps.n == 0:
        return None, steps.frame(run)
    order, first = _rows_by_rank(colls, n)
    mk = colls.m_kind
    one_kind = int(mk[0]) if len(mk) and bool(np.all(mk == mk[0])) else None
    for r_lo, r_hi, e_lo, e_hi in _bands(run, n, BAND_EVENTS):  # a few bands, each vectorized
        b = _Band(run, colls, r_lo, r_hi, e_lo, e_hi, order[first[r_lo] : first[r_hi]], first, (start, end),
                  one_kind)
        iv = _intervals(run, colls, b)
        if tally is not None:
            tally.add(r_lo, r_hi, iv["rank"] - r_lo, iv["cat"], iv["t0"], iv["t1"], iv["exposed"])
        steps.add(r_lo, r_hi, iv)
        del iv, b
    return tally, steps.frame(run)


def breakdown(run: Run, colls: Collectives | None = None) -> pd.DataFrame:
    """One row per present rank: rank, host, wall_s, the COLUMNS and INFO_COLUMNS, in seconds.

    Also leaves :func:`step_breakdown`'s table in ``run.cache`` (computed from the same intervals).
    """
    if colls is None:
        colls = collectives_of(run)
    start, end = run.rank_bounds()
    t, steps = _compute(run, colls, ranks=True)
    assert t is not None
    # the per-step table from the same intervals (small: one row per STEP row); the JSON and text read it
    run.cache["step_breakdown"] = steps
    present = np.array(sorted(run.ranks), np.int64)
    df = pd.DataFrame({"rank": present, "host": [run.host_of(r) for r in present]})
    for name, col in _columns(t, (end - start).astype(np.float64), present).items():
        df[name] = col
    return df


# -- per step -------------------------------------------------------------------------------
def step_marks(run: Run) -> tuple[np.ndarray, np.ndarray]:
    """(rank, t_ns) of the STEP rows that end steps, sorted by (rank, t): see the module docstring."""
    ev = run.events
    m = ev["kind"] == Kind.STEP
    auto = run.sid(AUTO_STEP_NAME)
    if auto >= 0:
        m_auto = m & (ev["name_id"] == auto)
        if m_auto.any():
            m = m_auto
    rank = ev["rank"][m].astype(np.int64)
    t = ev["t0_ns"][m].astype(np.int64)
    if _sorted_by_rank_time(rank, t):  # the table is sorted so
        return rank, t
    o = np.lexsort((t, rank))
    return rank[o], t[o]


def _sorted_by_rank_time(rank: np.ndarray, t: np.ndarray) -> bool:
    """Whether rows are in (rank, t) order."""
    return bool(np.all((rank[1:] > rank[:-1]) | ((rank[1:] == rank[:-1]) & (t[1:] >= t[:-1]))))


def step_breakdown(run: Run, colls: Collectives | None = None) -> pd.DataFrame:
    """One row per (rank, step): rank, step, t_s (start, from the run's start), wall_s, COLUMNS, INFO_COLUMNS.

    Cached on ``run.cache["step_breakdown"]`` (the JSON, text and frames read it).
    """
    cached = run.cache.get("step_breakdown")
    if cached is not None:
        return cached  # type: ignore[no-any-return]
    if colls is None:
        colls = collectives_of(run)
    _, df = _compute(run, colls, ranks=False)
    run.cache["step_breakdown"] = df
    return df


class _Steps:
    """step_breakdown's table, tallied band by band from the bands' categorized intervals."""

    def __init__(self, run: Run, n: int) -> None:
        self.s_rank, self.s_t = s_rank, s_t = step_marks(run)
        self.n = len(s_t)
        if self.n == 0:
            return
        start, _ = run.rank_bounds()
        self.n_per = n_per = np.bincount(s_rank, minlength=n)
        self.first = np.concatenate([[0], np.cumsum(n_per)])  # rank r's marks: first[r]:first[r + 1]
        self.k_of = np.arange(len(s_t)) - self.first[s_rank]
        # step windows [w0, s_t): step 0 from the rank's first phase row before its first mark, else its start
        ev = run.events
        wm = np.isin(ev["kind"], np.array([int(k) for k in _WINDOW_KINDS], np.uint8))
        phase0 = np.full(n, np.iinfo(np.int64).max)
        np.minimum.at(phase0, ev["rank"][wm].astype(np.int64), ev["t0_ns"][wm].astype(np.int64))
        del wm
        w0 = np.empty_like(s_t)
        w0[1:] = s_t[:-1]
        z = self.k_of == 0
        r0 = s_rank[z]
        w0[z] = np.where(phase0[r0] < s_t[z], np.maximum(phase0[r0], start[r0]), start[r0])
        self.w0 = np.minimum(w0, s_t)
        self.tally = _Tally(len(s_t))

    def add(self, r_lo: int, r_hi: int, iv: dict[str, np.ndarray]) -> None:
        """Tally the band's intervals, cut at the step marks: piece i of an interval lies in step k0 + i."""
        if self.n == 0:
            return
        s_rank, s_t, n_per, first, w0 = self.s_rank, self.s_t, self.n_per, self.first, self.w0
        k_lo, k_hi = int(first[r_lo]), int(first[r_hi])
        if k_hi == k_lo:
            return
        rank, t0, t1 = iv["rank"], iv["t0"], iv["t1"]
        if len(rank) == 0:
            return
        # searched among the band's own marks only (a slice: the marks are sorted by rank), not the run's
        b_rank, b_t = s_rank[k_lo:k_hi], s_t[k_lo:k_hi]
        before = first[rank] - k_lo  # the band's marks of lower ranks than each interval's
        k0 = _marks_up_to(b_rank, b_t, rank, t0) - before
        ok = (t1 > t0) & (k0 < n_per[rank])
        # most calls end in the step they began in: search again only for those that cross its mark
        k1 = k0.copy()
        cross = np.flatnonzero(ok & (t1 > s_t[first[rank] + np.minimum(k0, n_per[rank] - 1)]))
        if len(cross):
            rc = rank[cross]
            k1[cross] = np.minimum(_marks_up_to(b_rank, b_t, rc, t1[cross] - 1) - before[cross], n_per[rc] - 1)
            del rc
        del before
        del cross
        idx = np.flatnonzero(ok)
        del ok
        reps = (k1 - k0 + 1)[idx]
        del k1
        idx = np.repeat(idx, reps)
        k = k0[idx] + np.arange(len(idx)) - np.repeat(np.cumsum(reps) - reps, reps)
        del k0, reps
        key = first[rank[idx]] + k
        del k
        p0 = np.maximum(t0[idx], w0[key])
        p1 = np.minimum(t1[idx], s_t[key])
        np.maximum(p0, p1, out=p1)
        self.tally.add(k_lo, k_hi, key - k_lo, iv["cat"][idx], p0, p1, iv["exposed"][idx])

    def frame(self, run: Run) -> pd.DataFrame:
        cols = ["rank", "step", "t_s", "wall_s", *COLUMNS, *INFO_COLUMNS]
        if self.n == 0:
            return pd.DataFrame({c: np.zeros(0, np.int64 if c in ("rank", "step") else np.float64) for c in cols})
        data: dict[str, Any] = {"rank": self.s_rank, "step": self.k_of, "t_s": (self.w0 - run.start_ns) / 1e9}
        data.update(_columns(self.tally, (self.s_t - self.w0).astype(np.float64), np.arange(self.n)))
        return pd.DataFrame(data, columns=cols)


#: the per-step columns aggregated over ranks
_STEP_COLS = ("wall_s", *COLUMNS, *INFO_COLUMNS)


def per_step(steps: pd.DataFrame) -> pd.DataFrame:
    """One row per step index across ranks: step, ranks, t_s (earliest start), median_<col> and max_<col>."""
    cols = ["step", "ranks", "t_s"] + [f"{a}_{c}" for a in ("median", "max") for c in _STEP_COLS]
    if len(steps) == 0:
        return pd.DataFrame({c: [] for c in cols})
    g = steps.groupby("step", sort=True)
    out = pd.DataFrame({"ranks": g["rank"].size(), "t_s": g["t_s"].min()})
    med = g[list(_STEP_COLS)].median()
    mx = g[list(_STEP_COLS)].max()
    for c in _STEP_COLS:  # a handful of columns
        out[f"median_{c}"] = med[c]
        out[f"max_{c}"] = mx[c]
    return out.reset_index()[cols]


def step_summary(steps: pd.DataFrame) -> dict[str, Any]:
    """Over every step: how many, the step time (median over ranks) median/p90/max, each column's share.

    ``share``: the column's seconds over all ranks and steps divided by the
    steps' wall-clock over all ranks (the COLUMNS add up to 1).
    """
    if len(steps) == 0:
        return {"steps": 0}
    agg = per_step(steps)
    dur = agg["median_wall_s"].to_numpy()
    wall = float(steps["wall_s"].sum()) or 1.0
    return {
        "steps": int(len(agg)),
        "step_s": {
            "median": float(np.median(dur)),
            "p90": float(np.percentile(dur, 90)),
            "max": float(dur.max()),
            "max_rank_median": float(np.median(agg["max_wall_s"].to_numpy())),
        },
        "share": {c: float(steps[c].sum()) / wall for c in (*COLUMNS, *INFO_COLUMNS)},
    }


def per_step_json(steps: pd.DataFrame, max_rows: int = MAX_STEP_ROWS) -> dict[str, Any]:
    """``breakdown.per_step`` of the JSON report.

    ``rows``: one per step, ``{"step", "steps": 1, "ranks", "t_s", "median":
    {wall_s, COLUMNS, INFO_COLUMNS}, "max": {...}}`` (median and max over the
    ranks that recorded the step). Over ``max_rows`` steps, each row stands for
    ``bin`` consecutive steps (``step`` = the first, ``steps`` = how many): its
    values are the means of those steps' medians and maxima, so a 100k-step run
    gives ``max_rows`` rows that still show a trend and still add up (mean x
    steps = total). ``summary`` (:func:`step_summary`) covers every step.
    """
    agg = per_step(steps)
    n = len(agg)
    out: dict[str, Any] = {"summary": step_summary(steps), "bin": 1, "rows": []}
    if n == 0:
        return out
    bin_ = max(1, math.ceil(n / max(1, max_rows)))
    out["bin"] = int(bin_)
    vals = [f"{a}_{c}" for a in ("median", "max") for c in _STEP_COLS]
    if bin_ > 1:
        b = agg["step"].to_numpy() // bin_
        g = agg.groupby(b, sort=True)
        binned = g[vals].mean()
        binned["step"] = g["step"].min()
        binned["steps"] = g["step"].size()
        binned["ranks"] = g["ranks"].min()
        binned["t_s"] = g["t_s"].min()
        agg = binned.reset_index(drop=True)
    else:
        agg = agg.assign(steps=1)
    rec = agg.to_dict("list")
    rows = []
    for i in range(len(agg)):  # at most max_rows
        rows.append({
            "step": int(rec["step"][i]), "steps": int(rec["steps"][i]), "ranks": int(rec["ranks"][i]),
            "t_s": float(rec["t_s"][i]),
            "median": {c: float(rec[f"median_{c}"][i]) for c in _STEP_COLS},
            "max": {c: float(rec[f"max_{c}"][i]) for c in _STEP_COLS},
        })  # fmt: skip
    out["rows"] = rows
    return out
