"""Bands of ranks: the unit of every per-rank pass over the events (issue 10).

A :class:`Band` is the event rows of consecutive ranks ``[r_lo, r_hi)``, every
kind, sorted by (rank, t0_ns), on the run's aligned timeline with global
string ids: exactly the rows ``run.events`` holds for those ranks. A stage
whose numbers are each rank's own (the breakdown's unions, the critical path
of input waits, a rank's activity inside a window, its last calls) loops over
:func:`bands` and combines what each band gives, instead of reading
``run.events`` whole. Nothing it computes may depend on the band size: a test
runs each such stage with one band and with many and compares.

Why: streaming (``distdiag/run.py``, "Then streaming") holds only the
cross-rank data (the matched collectives, sync rows, the few rows of sparse
kinds) for the whole run and reads the bulk (compute phases, collective rows)
one band at a time, so that the peak is the cross-rank data plus one band
instead of the whole table. The
stages see one interface either way:

* in memory (what :func:`distdiag.run.load_run` gives today), a band is a view
  of ``run.events`` (no copy) and its kind rows come from the run's kind index
  (:mod:`distdiag.rows`);
* streamed (:attr:`distdiag.run.Run.streamed_kinds` not empty), ``run.events``
  lacks those kinds and :func:`bands` reads each band's rows again from the
  rank files (``distdiag.run._Stream.read_band``).

Run-wide facts a per-band stage needs up front come from here too, over ALL
events, streamed or not: :func:`time_bounds`, :func:`event_ranks`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np

from distdiag.rows import Kinds, kind_ids, build, kind_index

if TYPE_CHECKING:
    from distdiag.run import Run

#: event rows per band (the breakdown measured 2^16-2^18 as the knee: temporaries stay in
#: cache-sized pieces, and per-band overhead is a few numpy calls)
BAND_EVENTS = 1 << 16


@dataclass
class Band:
    """The event rows of ranks ``[r_lo, r_hi)`` (see the module docstring)."""

    r_lo: int
    r_hi: int
    #: RUN_EVENT_DTYPE rows of these ranks, every kind, sorted by (rank, t0_ns), aligned
    events: np.ndarray
    #: rank r's rows are ``events[first[r - r_lo]:first[r - r_lo + 1]]`` (int64, r_hi - r_lo + 1 entries)
    first: np.ndarray
    #: the in-flight rows of these ranks (RUN_EVENT_DTYPE, t1_ns == -1)
    inflight: np.ndarray
    #: offset of ``events[0]`` in ``run.events`` when the band is a view of it; None when read from the files
    e_lo: int | None = None
    _run: Run | None = field(default=None, repr=False)
    _kidx: Any = field(default=None, repr=False)

    def rows(self, kinds: Kinds) -> np.ndarray:
        """int64 offsets into :attr:`events` of the rows of ``kinds``, ascending."""
        if self.e_lo is not None and self._run is not None:  # a view of run.events: slices of the run's kind index
            return _rows_in(kind_index(self._run), kinds, self.e_lo, self.e_lo + len(self.events))
        if self._kidx is None:
            self._kidx = build(self.events)
        got: np.ndarray = self._kidx.rows(kinds)
        return got

    def rank_of(self, rows: np.ndarray) -> np.ndarray:
        """The rank (int64) of each of the band's rows ``rows`` (offsets into :attr:`events`)."""
        return np.searchsorted(self.first, rows, side="right") - 1 + self.r_lo


def _rows_in(kidx: Any, kinds: Kinds, e_lo: int, e_hi: int) -> np.ndarray:
    """The rows of ``kinds`` in ``[e_lo, e_hi)`` as int64 offsets from ``e_lo``, ascending:
    each kind's rows are an ascending slice of the kind index, so two binary searches a kind."""
    order, starts = kidx.order, kidx.starts
    parts = []
    for k in kind_ids(kinds):  # a few kinds
        sl = order[starts[k] : starts[k + 1]]
        if len(sl):
            # bounds of the slice's own type: int64 ones would make searchsorted cast the whole slice
            a, b = np.searchsorted(sl, np.array([e_lo, e_hi], sl.dtype))
            if b > a:
                parts.append(sl[a:b])
    if not parts:
        return np.zeros(0, np.int64)
    got = parts[0].astype(np.int64) if len(parts) == 1 else np.sort(np.concatenate(parts)).astype(np.int64)
    got -= e_lo
    return got


def first_rows(rank: np.ndarray, n: int) -> np.ndarray:
    """Per r in 0..n, the first row whose rank is >= r in the rank-sorted column ``rank`` (a strided view).

    One binary search per rank, all ranks at once (~log2(rows) steps over n + 1
    lanes): ``np.searchsorted`` would copy the strided int32 column, then cast it
    to int64 for int64 queries (12 bytes an event of transient).
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


def n_ranks(run: Run) -> int:
    """The rank axis every per-rank array uses: world size, or more when a file names a larger rank."""
    return max(int(run.world_size), max(run.ranks, default=-1) + 1)


def rank_rows(run: Run) -> np.ndarray:
    """Per rank r in 0..n_ranks, the number of event rows of ranks < r over ALL events (streamed
    kinds included): rank r has ``rank_rows[r + 1] - rank_rows[r]`` rows. Cached on the run."""
    got = run.cache.rank_rows
    if got is not None:
        return got
    n = n_ranks(run)
    out: np.ndarray = run.stream.rank_rows(n) if getattr(run, "streamed_kinds", ()) else first_rows(run.events["rank"], n)
    run.cache.rank_rows = out
    return out


def band_edges(bounds: np.ndarray, band_events: int) -> list[tuple[int, int]]:
    """(r_lo, r_hi): consecutive ranks holding about ``band_events`` rows each (``bounds``: :func:`rank_rows`)."""
    n = len(bounds) - 1
    total = int(bounds[-1])
    k = max(1, math.ceil(total / max(1, band_events)))
    edges = np.unique(np.r_[0, np.searchsorted(bounds, np.arange(1, k) * (total / k)), n])
    return [(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:])]


def part_edges(run: Run, part: tuple[int, int], band_events: int | None = None) -> list[tuple[int, int]]:
    """The bands of block ``j`` of ``n`` (``part = (j, n)``): the run's bands cut into ``n``
    contiguous blocks of about equal band counts (:func:`distdiag.parallel.block_of`'s rule),
    as (r_lo, r_hi) pairs; every band is in exactly one block. ``distdiag analyze --parallel``
    gives block j to analysis rank j (see :func:`bands`' ``part``)."""
    band_events = BAND_EVENTS if band_events is None else band_events
    edges = band_edges(rank_rows(run), band_events)
    j, n = part
    return edges[(j * len(edges)) // n : ((j + 1) * len(edges)) // n]


def bands(
    run: Run, band_events: int | None = None, ranks: np.ndarray | None = None, part: tuple[int, int] | None = None
) -> Iterator[Band]:
    """The run's events as :class:`Band` s of about ``band_events`` rows (default :data:`BAND_EVENTS`),
    in rank order; every rank of ``0..n_ranks(run)`` is in exactly one band.

    ``ranks``: only the bands holding one of these ranks (a streamed run reads only
    their files: a stage that asks about a few ranks should say which).
    ``part``: only the bands of :func:`part_edges` ``(j, n)``."""
    band_events = BAND_EVENTS if band_events is None else band_events
    bounds = rank_rows(run)
    inf = run.inflight
    streamed = bool(getattr(run, "streamed_kinds", ()))
    want = None
    if ranks is not None:
        want = np.zeros(len(bounds), bool)
        r = np.asarray(ranks, np.int64)
        want[r[(r >= 0) & (r < len(bounds) - 1)]] = True
    edges = band_edges(bounds, band_events) if part is None else part_edges(run, part, band_events)
    for r_lo, r_hi in edges:  # a few dozen bands
        if want is not None and not want[r_lo:r_hi].any():
            continue
        b_inf = inf[(inf["rank"] >= r_lo) & (inf["rank"] < r_hi)] if len(inf) else inf
        first = bounds[r_lo : r_hi + 1] - bounds[r_lo]
        if streamed:
            ev = run.stream.read_band(run, r_lo, r_hi)
            yield Band(r_lo, r_hi, ev, first, b_inf)
        else:
            e_lo, e_hi = int(bounds[r_lo]), int(bounds[r_hi])
            yield Band(r_lo, r_hi, run.events[e_lo:e_hi], first, b_inf, e_lo=e_lo, _run=run)


def time_bounds(run: Run) -> tuple[int, int]:
    """(min, max) over the t0_ns and t1_ns of ALL events (streamed kinds included), aligned;
    (0, 0) without events. Cached on the run."""
    got = run.cache.time_bounds
    if got is not None:
        return got
    out: tuple[int, int]
    if getattr(run, "streamed_kinds", ()):
        out = run.stream.time_bounds(run)
    elif len(run.events):
        ev = run.events
        out = (int(min(ev["t0_ns"].min(), ev["t1_ns"].min())), int(max(ev["t0_ns"].max(), ev["t1_ns"].max())))
    else:
        out = (0, 0)
    run.cache.time_bounds = out
    return out


def event_ranks(run: Run) -> np.ndarray:
    """The ranks with at least one event row (ALL events), ascending int64."""
    b = rank_rows(run)
    return np.flatnonzero(np.diff(b) > 0).astype(np.int64)
