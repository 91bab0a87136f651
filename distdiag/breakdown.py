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
* ``startup_s``: the rank's time from its start (the shim's) to its first
  collective, point-to-point call, compute phase or step (``STARTUP_END_KINDS``:
  its first rendezvous with its peers or its first step) that no call above
  covers: imports' own code, the dataset build, the model. Its file calls stay
  ``io_s`` (imports), its communicator creation ``other_s`` (``MPI_Init``). A
  rank with none of those rows has no startup (nothing tells it from its work).
  Per step it is non-zero only in a step 0 that began at the rank's start.
* ``compute_s``: the rest: time outside every call above. User phases
  (forward, backward, optimizer, ``distdiag.phase``) count as compute, minus
  the calls recorded inside them and minus exposed communication.

These eight (``COLUMNS``) add up to ``wall_s`` (more only where two threads
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
ranks (:func:`distdiag.bands.bands`, ``distdiag.bands.BAND_EVENTS`` event rows
a band, every kind, sorted by (rank, t0)): the temporaries scale with a band,
not the run, and no number depends on where bands fall
(tests/test_breakdown_bands.py). The compute phases (forward, backward,
optimizer, ``distdiag.phase``) are read only from the bands: a streamed run
(``run.streamed_kinds``) holds them nowhere else, and its bands are fresh
arrays read from the rank files, not views of ``run.events`` (so no row
number here crosses a band: a band's rows of a kind are ``Band.rows``,
offsets into its own events). What is run-wide is the band bounds
(:func:`distdiag.bands.rank_rows`), one count of members per rank and the
STEP rows that end steps (a resident kind, from the run's kind index,
distdiag.rows); a band's rows of a kind come from that index too when the
band is a view of the table, so neither scans the kind column. The band size
(measured for the breakdown, 1,024 x 10k, breakdown alone: 2^18 / 2^17 / 2^16
/ 2^15 rows took 1.50-1.67 / 1.39-1.68 / 1.33-1.45 / 1.33-1.34 s of CPU and
~2 B/event of transient each; a band costs ~0.2 ms of fixed overhead) is
2^16.

A band reads its collective members' columns (t0, t1, comm, seq) from its own
event rows, block by block of whole rows, and looks up only their group
((comm, seq) -> group: a dense table); gathering them from the match's member
table, which is sorted by group, cost a cache and TLB miss per member and
column (:class:`_Band`; the member table stays the fallback, e.g. when the
match dropped a duplicate row: tests/test_breakdown_members.py). Intervals
stay in parts (a category's intervals from one source, in (rank, t0) order),
so most unions need no sort: the union skips it when its starts are sorted,
skips the running maximum when its ends are, and sums per key with
``np.add.reduceat``. The busy union runs over a collective's span, not its two
pieces. benchmarks/bench_breakdown.py and ``benchmarks/bench_scale.py
--stages`` measure it.

What the breakdown costs, measured step by step: ``benchmarks/NOTES.md``.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import pandas as pd

from distdiag.bands import Band, bands
from distdiag.intervals import band_of, union_length_in_band
from distdiag.match import Collectives, MatchState, collectives_of
from distdiag.passes import Pass, run_local, sweep
from distdiag.rows import kind_index
from distdiag.run import Run
from distdiag.schema import COMM_KINDS, FILE_KINDS, P2P_KINDS, PHASE_KINDS, Kind

log = logging.getLogger(__name__)

#: the columns that add up to a rank's wall_s (startup_s: issue 20, added after the others, never renamed)
COLUMNS = ("compute_s", "startup_s", "comm_wait_s", "comm_transfer_s", "io_s", "input_wait_s", "h2d_s", "other_s")
#: information only, not part of that sum (see the module docstring)
INFO_COLUMNS = ("comm_exposed_s", "comm_overlapped_s")
#: what each column means, in words (the text renderer and the breakdown figure)
LABELS = {
    "compute_s": "compute", "startup_s": "startup", "comm_wait_s": "waiting in collectives", "comm_transfer_s": "collective transfer",
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
#: the kinds with a category
_CAT_KINDS = tuple(int(k) for k in np.flatnonzero(_CAT_OF_KIND != _NONE))


#: rows whose start ends a rank's startup: its first collective or point-to-point call (a rendezvous
#: with its peers), compute phase or step (the same kinds as launch_overhead's "first useful work")
STARTUP_END_KINDS = tuple(sorted(int(k) for k in COMM_KINDS | P2P_KINDS | PHASE_KINDS | {Kind.STEP}))
_IS_STARTUP_END = np.zeros(256, bool)
_IS_STARTUP_END[list(STARTUP_END_KINDS)] = True
#: rows whose start opens a rank's step 0 (before the first one: start-up)
WINDOW_KINDS = (Kind.INPUT_WAIT, Kind.H2D, Kind.FORWARD, Kind.BACKWARD, Kind.OPTIMIZER, Kind.PHASE)
#: the optimizer hook's STEP rows; preferred over distdiag.step() rows when both exist
AUTO_STEP_NAME = "optimizer_step"
#: breakdown.per_step in the JSON holds at most this many rows; longer runs bin consecutive steps
MAX_STEP_ROWS = 200


def _marks_up_to(b_rank: np.ndarray, b_t: np.ndarray, q_rank: np.ndarray, q_t: np.ndarray) -> np.ndarray:
    """Per query, how many marks sort at or before (q_rank, q_t) in (rank, t) order; marks sorted so.

    So ``result - 1`` is the index of the query's rank's last mark at or before
    it, when that mark's rank is the query's. Like :func:`distdiag.intervals.union_length_by_key`, each
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


#: kinds whose rows (with a sequence number) are the match's members
_IS_COMM = np.zeros(256, bool)
_IS_COMM[[int(Kind.COLL), int(Kind.COLL_ASYNC)]] = True


class _Ctx:
    """What every band reads: the rank bounds, the member rows' rank offsets, and the (comm, seq) ->
    group lookup that lets a band take its members' columns from its own event rows."""

    def __init__(self, run: Run, colls: Collectives, n: int) -> None:
        self.colls = colls
        self.start, self.end = run.rank_bounds()  # O(ranks) each call: once for every band
        self.lead = run.lead_ins()
        self.m_first = _member_first(colls, n)  # rank r's member rows, counted
        self._order: np.ndarray | None = None
        # the split of a member's span at its group's last arrival: min(max(split_at[g], t0), t1)
        # (a group that never completed: its members waited throughout, split at their own t1)
        never = (colls.g_state == MatchState.IN_FLIGHT) | (colls.g_exit_ns < 0)
        self.split_at = np.where(never, np.iinfo(np.int64).max, colls.g_last_ns).astype(np.int64)
        # the lookup works only when the members are exactly the event (and in-flight) rows of
        # COLL/COLL_ASYNC kind with seq >= 0: no duplicate was dropped (else: the member table)
        self.lookup = _GroupLookup(colls) if colls.n_dup == 0 else None

    def order(self) -> np.ndarray:
        """The member rows by rank (:func:`_rows_by_rank`), built on first use: bands whose members come
        from their event rows never need it."""
        if self._order is None:
            self._order = _rows_by_rank(self.colls, self.m_first)
        return self._order


class _GroupLookup:
    """(comm, seq) -> group row: the groups are sorted by ``comm * n_seq + seq`` (distdiag.match),
    so a dense table (or a binary search when the keys are sparse) finds each row's group."""

    def __init__(self, colls: Collectives) -> None:
        gs, gc = colls.g_seq, colls.g_comm
        self.ok = False
        self.n_g = ng = len(gs)
        if ng == 0 or int(gs.min()) < 0 or int(gc.min()) < 0:
            return
        self.n_seq = int(gs.max()) + 1
        self.c_max = int(gc.max())
        if (self.c_max + 1) * self.n_seq >= 1 << 62:  # absurd ids (damaged files): the member table instead
            return
        gk = gc.astype(np.int64) * self.n_seq + gs
        if not bool(np.all(gk[1:] > gk[:-1])):
            return
        self.gk = gk
        self.table: np.ndarray | None = None
        if int(gk[-1]) < 8 * ng + (1 << 16):  # dense keys (one communicator, seq 0, 1, ...): one gather
            self.table = np.full(int(gk[-1]) + 1, -1, np.int64)
            self.table[gk] = np.arange(ng)
        self.ok = True

    def __call__(self, comm: np.ndarray, seq: np.ndarray) -> np.ndarray | None:
        """The group of each (comm, seq >= 0), or None when one has none."""
        if not self.ok:
            return None
        comm = comm.astype(np.int64)
        if len(comm) and (int(comm.min()) < 0 or int(comm.max()) > self.c_max or int(seq.max()) >= self.n_seq):
            return None
        key = comm * self.n_seq
        key += seq
        if self.table is not None:
            g = self.table[key]
            return None if len(g) and int(g.min()) < 0 else g
        g = np.searchsorted(self.gk, key)
        np.minimum(g, self.n_g - 1, out=g)
        return g if bool(np.all(self.gk[g] == key)) else None


def _member_first(colls: Collectives, n: int, chunk: int = 1 << 18) -> np.ndarray:
    """Per r in 0..n, how many member rows have a rank below r (chunk by chunk: bincount casts to int64)."""
    r = colls.m_rank
    total = np.zeros(n, np.int64)
    for a in range(0, len(r), chunk):  # a few dozen chunks
        total += np.bincount(r[a : a + chunk], minlength=n)
    first = np.zeros(n + 1, np.int64)
    np.cumsum(total, out=first[1:])
    return first


class _Band:
    """A band of ranks [r_lo, r_hi) (a :class:`distdiag.bands.Band`: its event rows, every kind, a view of
    the table or read from the files), their ranks, and its collective members' columns rank by rank (``m_rank``, ``m_kind``, ``m_g``, ``m_t0``, ``m_t1``).

    The members come from the band's own event rows (and in-flight rows) when the
    match kept every COLL/COLL_ASYNC row with a seq: their columns are then read
    from the band's own rows, which are in cache, and only their group
    is looked up. Gathering them from the member table instead (sorted by group,
    so a band's members are spread over all of it) cost a cache and TLB miss
    per member and column: ~40% of the breakdown at 1,024 x 10k. The member
    table is the fallback (duplicates dropped, a count that differs).
    Within a rank, the members' order differs between the two (table order,
    group order): no number depends on it (every union is order-free).
    """

    def __init__(self, ctx: _Ctx, band: Band) -> None:
        self.r_lo, self.r_hi = r_lo, r_hi = band.r_lo, band.r_hi
        self.start, self.end = ctx.start, ctx.end
        self.lead = ctx.lead
        self.band = band
        self.ev = band.events  # a view of run.events, or the rows read from the files (streamed)
        self.ev_first = band.first  # rank r's rows: ev_first[r - r_lo]:ev_first[r - r_lo + 1]
        self.inf = band.inflight
        self.n_members = int(ctx.m_first[r_hi] - ctx.m_first[r_lo])
        if not self._from_events(ctx):
            self._from_members(ctx)

    def rows(self, *kinds: int) -> np.ndarray:
        """The band's rows of ``kinds`` (offsets into ``ev``), ascending."""
        return self.band.rows(kinds)

    def rank_of(self, rows: np.ndarray, ascending: bool = True) -> np.ndarray:
        """The rank (int64) of each of the band's rows ``rows``."""
        if ascending:  # one repeat: the rows of each rank are a run
            n_of = np.diff(np.searchsorted(rows, self.ev_first))
            return np.repeat(np.arange(self.r_lo, self.r_hi, dtype=np.int64), n_of)
        return self.band.rank_of(rows)

    def _from_events(self, ctx: _Ctx) -> bool:
        ev, inf = self.ev, self.inf
        ci = self.rows(int(Kind.COLL), int(Kind.COLL_ASYNC))
        cols = _take(ev, ci, ("seq", "comm_id", "t0_ns", "t1_ns", "kind"))
        seq = cols["seq"]
        ok = seq >= 0
        #: COLL rows without a sequence number: no member (other calls)
        self.coll_no_seq = ci[:0] if ok.all() else ci[~ok & (cols["kind"] == Kind.COLL)]
        if not ok.all():
            ci = ci[ok]
            cols = {f: c[ok] for f, c in cols.items()}
            seq = cols["seq"]
        im = np.zeros(0, np.int64)
        if len(inf):
            im = np.flatnonzero(_IS_COMM[inf["kind"]] & (inf["seq"] >= 0))
        if len(ci) + len(im) != self.n_members or ctx.lookup is None:
            return False
        inf_m = inf[im] if len(im) else None

        def col(f: str) -> np.ndarray:  # the members' column: event rows, then in-flight rows
            c = cols[f] if f in cols else ev[f][ci]
            return c if inf_m is None else np.concatenate([c, inf_m[f]])

        g = ctx.lookup(col("comm_id"), seq if len(im) == 0 else np.concatenate([seq, inf["seq"][im]]))
        if g is None:
            return False
        self.m_g = g
        self.m_rank = self.rank_of(ci)
        self.m_kind = cols["kind"]
        if len(im):
            self.m_rank = np.concatenate([self.m_rank, inf["rank"][im].astype(np.int64)])
            self.m_kind = np.concatenate([self.m_kind, inf["kind"][im]])
        self.m_t0 = col("t0_ns")
        self.m_t1 = col("t1_ns")
        self._op: Callable[[], np.ndarray] = lambda: col("name_id")
        return True

    def _from_members(self, ctx: _Ctx) -> None:
        colls, r_lo, r_hi = ctx.colls, self.r_lo, self.r_hi
        rows = ctx.order()[ctx.m_first[r_lo] : ctx.m_first[r_hi]]
        self.m_kind = colls.m_kind[rows]
        self.m_g = colls.m_group[rows]
        self.m_t0 = colls.m_t0_ns[rows]
        self.m_t1 = colls.m_t1_ns[rows]
        # the rows' ranks (int64) without a gather: rows come sorted by rank
        self.m_rank = np.repeat(np.arange(r_lo, r_hi), np.diff(ctx.m_first[r_lo : r_hi + 1]))
        self._op = lambda: colls.m_op[rows]
        # The match's members are the COLL rows with seq >= 0 (and in-flight rows): when
        # the band has no in-flight row and as many blocking members as COLL rows, no
        # COLL row has seq < 0, and the seq column need not be read. Otherwise it is.
        coll = self.rows(int(Kind.COLL))
        if len(self.inf) or len(coll) != np.count_nonzero(self.m_kind == Kind.COLL):
            coll = coll[self.ev["seq"][coll] < 0]
        else:
            coll = coll[:0]
        self.coll_no_seq = coll

    def m_op(self) -> np.ndarray:
        """The members' op (name id)."""
        return self._op()


#: rows a block of :func:`_take` (300 kB of 73-byte rows: stays in L2), measured best of 4k-64k
_TAKE_ROWS = 1 << 12


def _take(tab: np.ndarray, idx: np.ndarray, fields: tuple[str, ...]) -> dict[str, np.ndarray]:
    """``{f: tab[f][idx]}``, block by block of whole rows (``take`` copies a 73-byte row at once).

    A field gathered straight from the table re-reads each row's cache line per
    field; measured on a band's collective rows (half its rows), 4 fields: 2.4x
    faster so (as distdiag.match's gather, in smaller blocks).
    """
    out = {f: np.empty(len(idx), tab.dtype[f]) for f in fields}
    for lo in range(0, len(idx), _TAKE_ROWS):  # a few blocks a band
        sub = tab.take(idx[lo : lo + _TAKE_ROWS])
        for f in fields:  # a few fields
            out[f][lo : lo + len(sub)] = sub[f]
    return out


def _rows_by_rank(colls: Collectives, first: np.ndarray, chunk: int = 1 << 18) -> np.ndarray:
    """The member rows sorted by rank, in the table's order within a rank: rank r's are
    ``order[first[r]:first[r + 1]]`` (``first``: :func:`_member_first`). Built only for bands
    whose members cannot be read from their own event rows (:class:`_Band`).

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
    n = len(first) - 1
    order = np.empty(m, np.int32 if m < np.iinfo(np.int32).max else np.int64)
    seen = first[:-1].copy()  # where each rank's next rows go
    for a in range(0, m, chunk):  # a few dozen chunks
        rc = r[a : a + chunk]
        o = np.argsort(rc.astype(np.uint16) if n <= 1 << 16 else rc, kind="stable")
        cnt = np.bincount(rc, minlength=n)
        # the chunk's sorted rows of rank q are o[c_first[q]:...]; they go to seen[q], seen[q] + 1, ...
        base = seen - (np.cumsum(cnt) - cnt)
        order[base[rc[o]] + np.arange(len(o))] = o + a
        seen += cnt
    return order


def _collective_spans(b: _Band) -> tuple[np.ndarray, ...]:
    """(rank, g, t0, t1) of every blocking collective member of the band (t1: the rank's end when in flight)."""
    blocking = b.m_kind == Kind.COLL
    every = bool(blocking.all())  # an MPI run: no copies
    g = b.m_g if every else b.m_g[blocking]
    rank = b.m_rank if every else b.m_rank[blocking]
    t0 = b.m_t0 if every else b.m_t0[blocking]
    t1 = b.m_t1 if every else b.m_t1[blocking]
    open_ = t1 < 0
    if open_.any():
        t1 = np.where(open_, b.end[rank], t1)  # still inside at the end of its record
    return rank, g, t0, t1


def _split_at_last_arrival(ctx: _Ctx, g: np.ndarray, t0: np.ndarray, t1: np.ndarray) -> np.ndarray:
    """Where each [t0, t1) of group g is cut at the group's last arrival: [t0, split) waits, [split, t1) transfers.

    A member who never came, or one that never left: everyone inside waited
    throughout (``split_at`` is then past every time: the split is t1). A group
    missing a rank whose file is lost did complete (everyone left): the present
    members' last arrival is then the best estimate of the split. So the split is
    ``clip(split_at[g], t0, t1)``, written as numpy's clip is defined.
    """
    split: np.ndarray = np.maximum(ctx.split_at[g], t0)
    np.minimum(split, t1, out=split)
    return split


def _exposed_async(b: _Band, ctx: _Ctx, a: np.ndarray) -> tuple[np.ndarray, ...]:
    """(rank, c, L, Y) per backward with exposed time: [c, L) waiting, [L, Y) transfer (module docstring);
    ``a``: the band's finished non-blocking members (a mask of its members)."""
    ev = b.ev
    z = np.zeros(0, np.int64)
    if not a.any():
        return z, z, z, z
    bm = b.rows(int(Kind.BACKWARD))
    if len(bm) == 0:
        return z, z, z, z
    a_rank = b.m_rank[a]
    a0 = b.m_t0[a].astype(np.int64)
    a1 = np.maximum(b.m_t1[a].astype(np.int64), a0)
    g = b.m_g[a]
    b_rank = b.rank_of(bm)
    got = _take(ev, bm, ("t0_ns", "t1_ns"))
    b0 = got["t0_ns"].astype(np.int64, copy=False)
    b1 = np.maximum(got["t1_ns"], b0)
    del got
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
    # the wait part's end per bucket: clip(split_at, c, y), as in _split_at_last_arrival
    lasts = np.maximum(ctx.split_at[g[keep]], c[jk])
    np.minimum(lasts, y, out=lasts)
    Y = c.copy()
    L = c.copy()
    np.maximum.at(Y, jk, y)
    np.maximum.at(L, jk, lasts)
    hit = np.flatnonzero(Y > c)
    return b_rank[hit], c[hit], L[hit], Y[hit]


def _waits_on_async(b: _Band, colls: Collectives, am: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(rows, groups): the band's WAIT rows that wait on one of the rank's non-blocking collectives.

    A ``Work.wait`` / ``MPI_Wait`` row names what it waits for (comm key, seq and
    op, recorded by the shim; seq is -1 for point-to-point). It is linked to the
    rank's COLL_ASYNC member row with the same (rank, comm, seq, op): one sort of
    both key sets together, no loop per row. ``am``: the band's non-blocking members (a mask).
    """
    ev = b.ev
    z = np.zeros(0, np.int64)
    if not am.any():
        return z, z
    w = b.rows(int(Kind.WAIT))
    w = w[ev["seq"][w] >= 0]
    if len(w) == 0:
        return z, z
    g = b.m_g[am]
    nm = len(g)
    r = np.concatenate([b.m_rank[am], b.rank_of(w)]).astype(np.int64)
    c = np.concatenate([colls.g_comm[g], ev["comm_id"][w]]).astype(np.int64)
    q = np.concatenate([colls.g_seq[g], ev["seq"][w]]).astype(np.int64)
    o = np.concatenate([b.m_op()[am], ev["aux"][w]]).astype(np.int64)
    is_w = np.r_[np.zeros(nm, np.int8), np.ones(len(w), np.int8)]
    order = np.lexsort((is_w, o, q, c, r))  # within one key: the member first, then its waits
    rs, cs, qs, os_ = r[order], c[order], q[order], o[order]
    new_key = np.r_[True, (rs[1:] != rs[:-1]) | (cs[1:] != cs[:-1]) | (qs[1:] != qs[:-1]) | (os_[1:] != os_[:-1])]
    key_start = np.maximum.accumulate(np.where(new_key, np.arange(len(order)), 0))
    head = order[key_start]  # the first row of each sorted row's key: a member when there is one
    hit = (order >= nm) & (head < nm)
    return w[order[hit] - nm], g[head[hit]]


#: intervals: rank (int64), t0, t1 (int64, t0 <= t1)
_Ivs = tuple[np.ndarray, np.ndarray, np.ndarray]


class _Intervals:
    """A band's intervals, clipped to each rank's record (:func:`_intervals`), in parts.

    * ``cat``: per category code, its parts; every categorized interval is in one.
    * ``exposed``: parts whose union per rank is that of the exposed pieces of
      non-blocking collectives (each exposed wait and transfer joined, as for ``busy``).
    * ``busy``: parts whose union per rank is the union of every category's:
      a collective's wait and transfer pieces [t0, split) [split, t1) joined
      into its span [t0, t1) (clipping keeps them adjacent).
    * ``spans``: the non-blocking collectives' whole spans (``comm_overlapped_s`` only).

    Each part comes in (rank, t0) order, or nearly (the event rows are sorted
    so, a rank's collectives come in time order), so a union over one part
    usually skips its sort, and parts are concatenated only where a union
    needs more than one (a category fed by two sources, the busy union of a
    run with file I/O as well as collectives).
    """

    def __init__(self) -> None:
        self.cat: dict[int, list[_Ivs]] = {}
        self.exposed: list[_Ivs] = []
        self.busy: list[_Ivs] = []
        self.spans: list[_Ivs] = []
        self.startup: list[_Ivs] = []

    def put(self, cat: int, part: _Ivs) -> None:
        if len(part[0]):
            self.cat.setdefault(cat, []).append(part)

    def map(self, fn: Any) -> _Intervals:
        """The same parts, each replaced by ``fn(part)``."""
        out = _Intervals()
        memo: dict[int, _Ivs] = {}  # a part can be in two lists (exposed, busy): mapped once

        def once(parts: list[_Ivs]) -> list[_Ivs]:
            return [memo[id(p)] if id(p) in memo else memo.setdefault(id(p), fn(p)) for p in parts]

        out.cat = {c: once(ps) for c, ps in self.cat.items()}
        out.exposed = once(self.exposed)
        out.busy = once(self.busy)
        out.spans = once(self.spans)
        out.startup = once(self.startup)
        return out

    def all_parts(self) -> list[_Ivs]:
        return [p for ps in self.cat.values() for p in ps] + self.busy + self.spans + self.startup


def _one(parts: list[_Ivs]) -> _Ivs:
    """The parts as one (rank, t0, t1), end to end."""
    if len(parts) == 1:
        return parts[0]
    if not parts:
        z = np.zeros(0, np.int64)
        return z, z, z
    r, a, b = zip(*parts)
    return np.concatenate(r), np.concatenate(a), np.concatenate(b)


def _intervals(ctx: _Ctx, b: _Band) -> _Intervals:
    """The band's intervals (:class:`_Intervals`), clipped to each rank's record."""
    start, end = b.start, b.end
    ev = b.ev
    iv = _Intervals()
    # The band's record bounds: a part whose times all lie in every rank's record needs no clip
    # (the usual case: the ranks start before the band's first call and end after its last).
    lo_max = int(start[b.r_lo : b.r_hi].max()) if b.r_hi > b.r_lo else 0
    hi_min = int(end[b.r_lo : b.r_hi].min()) if b.r_hi > b.r_lo else 0

    def clip(rank: np.ndarray, *ts: np.ndarray) -> list[np.ndarray]:
        """The times clipped to their rank's record: nothing before its start or after its end counts."""
        ts64 = [t.astype(np.int64, copy=False) for t in ts]
        if len(rank) == 0 or all(int(t.min()) >= lo_max and int(t.max()) <= hi_min for t in ts64):
            return ts64
        lo, hi = start[rank], end[rank]
        return [np.clip(t, lo, hi) for t in ts64]

    def pieces(rank: np.ndarray, t0: np.ndarray, split: np.ndarray, t1: np.ndarray, exposed: bool) -> None:
        """A wait piece [t0, split) and a transfer piece [split, t1) each; their joined span [t0, t1) is busy."""
        if len(rank) == 0:
            return
        t0, split, t1 = clip(rank, t0, split, t1)
        span = (rank, t0, np.maximum(t0, t1))
        iv.busy.append(span)
        if exposed:  # the exposed union, like the busy one, over the joined span: one part, not two
            iv.exposed.append(span)
        iv.put(_WAIT, (rank, t0, np.maximum(t0, split)))
        iv.put(_XFER, (rank, split, np.maximum(split, t1)))

    # The event rows with a category (collectives without a sequence number are other calls;
    # a wait on a non-blocking collective is that collective's exposed time instead).
    is_async = b.m_kind == Kind.COLL_ASYNC
    linked, lg = _waits_on_async(b, ctx.colls, is_async)
    sel = b.rows(*_CAT_KINDS)
    if len(b.coll_no_seq):
        sel = np.union1d(sel, b.coll_no_seq)
    if len(linked):
        sel = np.setdiff1d(sel, linked, assume_unique=True)
    got = _take(ev, sel, ("t0_ns", "t1_ns", "kind"))
    code = np.take(_CAT_OF_KIND, got["kind"])
    code[code == _NONE] = _OTHER  # the COLL rows without a seq: the only selected rows without a category
    e_rank = b.rank_of(sel)
    e0, e1 = clip(e_rank, got["t0_ns"], got["t1_ns"])
    del sel, got
    # In-flight rows that are not collectives (a rank killed inside a read): until the end.
    inf = b.inf
    if len(inf):
        ic = _CAT_OF_KIND[inf["kind"]]  # the same table as the event rows'
        mi = np.flatnonzero(ic != _NONE)
        ir = inf["rank"][mi].astype(np.int64)
        i0, i1 = clip(ir, inf["t0_ns"][mi], end[ir])
        e_rank, code = np.concatenate([e_rank, ir]), np.concatenate([code, ic[mi]])
        e0, e1 = np.concatenate([e0, i0]), np.concatenate([e1, i1])
    e1 = np.maximum(e0, e1)
    if len(code):
        part = (e_rank, e0, e1)
        iv.busy.append(part)  # (rank, t0) order (but for in-flight rows)
        if int(code.min()) == int(code.max()):
            iv.put(int(code[0]), part)  # the same part (cut once per step)
        else:  # by category: a radix sort of 1-byte codes, then one slice a category
            o = np.argsort(code, kind="stable")
            code, e_rank, e0, e1 = code[o], e_rank[o], e0[o], e1[o]
            cuts = np.searchsorted(code, np.arange(_N_CAT + 1))
            for c in range(_N_CAT):  # six categories
                sl = slice(int(cuts[c]), int(cuts[c + 1]))
                iv.put(c, (e_rank[sl], e0[sl], e1[sl]))
    del code, e_rank, e0, e1

    cr, cg, c0, c1 = _collective_spans(b)
    pieces(cr, c0, _split_at_last_arrival(ctx, cg, c0, c1), c1, False)
    del cr, cg, c0, c1
    if len(linked):
        lr = b.rank_of(linked, ascending=False)
        l0, l1 = ev["t0_ns"][linked], ev["t1_ns"][linked]
        pieces(lr, l0, _split_at_last_arrival(ctx, lg, l0, l1), l1, True)
    am = is_async & (b.m_t1 >= 0)
    xr, xc, xl, xy = _exposed_async(b, ctx, am)
    pieces(xr, xc, xl, xy, True)
    if am.any():
        sr = b.m_rank[am]
        s0, s1 = clip(sr, b.m_t0[am], b.m_t1[am])
        iv.spans.append((sr, s0, np.maximum(s0, s1)))
    ends = _band_startup_ends(b.band, start, end, b.lead)
    rr = np.flatnonzero(ends > start[b.r_lo : b.r_hi]) + b.r_lo
    if len(rr):
        iv.startup.append((rr, start[rr].astype(np.int64), ends[rr - b.r_lo]))
    return iv


def _band_startup_ends(band: Band, start: np.ndarray, end: np.ndarray, lead: np.ndarray | None = None) -> np.ndarray:
    """Per rank of the band (r_lo, r_lo + 1, ...), where its startup ends (int64 ns): the start of its
    first row of STARTUP_END_KINDS (recorded or in flight), within its record; its start when it
    has none (a rank that never meets a peer nor steps has no startup to tell apart from its work).
    Never before its program's first line: ``lead`` (per rank, :meth:`Run.lead_ins`) after its
    start, where its process started before its shim (the interpreter's start, recorded by the
    libc interposer, is start-up whatever the program does after it).

    A rank's rows of those kinds are one run of the band's rows of them (rows are sorted by
    (rank, t0)): its first one is the earliest, one gather a rank, no loop over ranks. The rows
    are found by one pass over the band's kind column: the kind index's rows of a dozen kinds,
    merged or one lookup each, and a minimum over each run of them cost +20-50% of an MPI run's
    breakdown (64 x 20k events, one collective a row)."""
    n = band.r_hi - band.r_lo
    first = np.full(n, np.iinfo(np.int64).max)
    rows = np.flatnonzero(_IS_STARTUP_END[band.events["kind"]])  # one pass over a byte a row
    if len(rows):
        lo = np.searchsorted(rows, band.first)  # rank r_lo + i's rows: rows[lo[i]:lo[i + 1]]
        has = np.flatnonzero(lo[1:] > lo[:-1])
        first[has] = band.events["t0_ns"][rows[lo[has]]]
    inf = band.inflight
    if len(inf):
        m = _IS_STARTUP_END[inf["kind"]]
        if m.any():
            np.minimum.at(first, inf["rank"][m].astype(np.int64) - band.r_lo, inf["t0_ns"][m].astype(np.int64))
    s0 = start[band.r_lo : band.r_hi].astype(np.int64)
    floor = s0 if lead is None else s0 + lead[band.r_lo : band.r_hi]
    out = np.where(first == np.iinfo(np.int64).max, floor, np.maximum(first, floor))
    return np.clip(out, s0, np.maximum(s0, end[band.r_lo : band.r_hi].astype(np.int64)))


def startup_ends(run: Run) -> np.ndarray:
    """Per rank (index = rank, every rank of the bands), where its startup ends on the aligned
    timeline (ns): see :func:`_band_startup_ends`. One pass over the bands' rows of those kinds
    (:class:`StartupEndsPass`; the pipeline's sweep makes it with the other passes); cached on
    ``run.cache.startup_ends`` (the startup detector and the breakdown's coverage read it)."""
    got = run.cache.startup_ends
    if got is not None:
        return got
    out: np.ndarray = run_local(run, [StartupEndsPass()])[0]
    run.cache.startup_ends = out
    return out


class _EndsAcc:
    """:class:`StartupEndsPass`'s accumulator: every rank's end (its start where no band set it)."""

    def __init__(self, run: Run, part: tuple[int, int] | None) -> None:
        self.start, self.end = run.rank_bounds()
        self.lead = run.lead_ins()
        self.part = part
        self.out = self.start.astype(np.int64).copy()
        self.r_first, self.r_last = -1, -1  # the ranks of the bands added: [r_first, r_last)


class StartupEndsPass(Pass[_EndsAcc, _EndsAcc | tuple[int, int, np.ndarray] | None, np.ndarray]):
    """:func:`startup_ends` as a per-rank pass (:mod:`distdiag.passes`): a block's part is its
    ranks' ends ``(r_lo, r_hi, ends)`` (None when it holds no band); every band's, the whole array."""

    def begin(self, run: Run, part: tuple[int, int] | None) -> _EndsAcc:
        return _EndsAcc(run, part)

    def add(self, acc: _EndsAcc, band: Band) -> None:
        acc.r_first = band.r_lo if acc.r_first < 0 else acc.r_first
        acc.r_last = band.r_hi
        acc.out[band.r_lo : band.r_hi] = _band_startup_ends(band, acc.start, acc.end, acc.lead)

    def part(self, acc: _EndsAcc) -> _EndsAcc | tuple[int, int, np.ndarray] | None:
        if acc.part is None:
            return acc
        if acc.r_first < 0:
            return None
        return acc.r_first, acc.r_last, acc.out[acc.r_first : acc.r_last].copy()

    def reduce(self, run: Run, parts: list[_EndsAcc | tuple[int, int, np.ndarray] | None]) -> np.ndarray:
        if len(parts) == 1 and isinstance(parts[0], _EndsAcc):
            whole: np.ndarray = parts[0].out
            return whole
        start, _ = run.rank_bounds()
        out: np.ndarray = start.astype(np.int64).copy()
        for p in parts:  # one per block
            if isinstance(p, tuple):
                out[p[0] : p[1]] = p[2]
        return out


class _Tally:
    """Per key (ns): each category's union, ``busy`` (the union of all of them), ``exposed``, ``overlapped``.

    Filled band by band: a band's keys are one contiguous range ``[k_lo, k_hi)``.
    """

    def __init__(self, n_keys: int) -> None:
        self.per_cat = np.zeros((n_keys, _N_CAT))
        self.busy = np.zeros(n_keys)
        self.exposed = np.zeros(n_keys)
        self.overlapped = np.zeros(n_keys)
        self.startup = np.zeros(n_keys)

    def add(self, k_lo: int, k_hi: int, iv: _Intervals) -> None:
        """Tally a band's intervals, whose ranks are keys here (in ``[k_lo, k_hi)``).

        One union per category (over its parts, usually one), one over the busy
        parts (a collective's span once, not its two pieces), one over the exposed
        parts and, with non-blocking spans, one over the busy parts and the spans.
        """
        n = k_hi - k_lo
        parts = [p for p in iv.all_parts() if len(p[0])]
        if not parts:
            return
        # one band for every union below (each covers a subset of these intervals; keys - k_lo < n)
        band = band_of(n, *(p[1] for p in parts), ends=tuple(p[2] for p in parts))
        for c, ps in iv.cat.items():  # a few categories
            self.per_cat[k_lo:k_hi, c] = union_length_in_band(*_one(ps), n, band, k_lo)
        busy_parts = _one(iv.busy)
        busy = union_length_in_band(*busy_parts, n, band, k_lo) if iv.busy else np.zeros(n)
        self.busy[k_lo:k_hi] = busy
        # startup: the part of each key's startup piece [a, b) (one a key: a rank's one interval, or
        # its piece in one step) that no call covers = (b - a) - |busy clipped to [a, b)|. Clipping
        # keeps the busy parts' (key, t0) order, so the union needs no sort (a union of busy with
        # the pieces appended would sort every busy interval again).
        if iv.startup:
            sk, sa, sb = _one(iv.startup)
            a = np.zeros(n, np.int64)
            b = np.zeros(n, np.int64)
            a[sk - k_lo] = sa
            b[sk - k_lo] = sb
            bk, b0, b1 = busy_parts
            early = np.flatnonzero(b0 < int(sb.max())) if len(bk) else bk  # most calls come after
            if len(early):
                kk = bk[early] - k_lo
                lo = np.maximum(b0[early], a[kk])
                hi = np.minimum(b1[early], b[kk])
                m = hi > lo
                covered = union_length_in_band(bk[early][m], lo[m], hi[m], n, band, k_lo)
            else:
                covered = np.zeros(n)
            self.startup[k_lo:k_hi] = np.maximum(0.0, (b - a) - covered)
        if iv.exposed:
            self.exposed[k_lo:k_hi] = union_length_in_band(*_one(iv.exposed), n, band, k_lo)
        # the async spans' time outside every category = |spans U busy| - |busy|
        # (no spans: none; MPI runs skip the sort)
        if iv.spans:
            both = _one([busy_parts, *iv.spans])
            self.overlapped[k_lo:k_hi] = np.maximum(0.0, union_length_in_band(*both, n, band, k_lo) - busy)


def _columns(t: _Tally, span_ns: np.ndarray, rows: np.ndarray) -> dict[str, np.ndarray]:
    """The seconds columns for the keys ``rows`` of a tally."""
    pc = t.per_cat
    return {
        "wall_s": span_ns[rows] / 1e9,
        "compute_s": np.maximum(0.0, span_ns - t.busy - t.startup)[rows] / 1e9,
        "startup_s": t.startup[rows] / 1e9,
        "comm_wait_s": pc[rows, _WAIT] / 1e9,
        "comm_transfer_s": pc[rows, _XFER] / 1e9,
        "io_s": pc[rows, _IO] / 1e9,
        "input_wait_s": pc[rows, _INPUT] / 1e9,
        "h2d_s": pc[rows, _H2D] / 1e9,
        "other_s": pc[rows, _OTHER] / 1e9,
        "comm_exposed_s": t.exposed[rows] / 1e9,
        "comm_overlapped_s": t.overlapped[rows] / 1e9,
    }


@dataclass
class BreakdownPart:
    """What the bands of one block (:func:`distdiag.bands.part_edges`) add to the breakdown:
    the per-rank tally rows of ranks ``[r_lo, r_hi)`` and the per-step tally rows
    ``[k_lo, k_hi)`` of those ranks' steps, with their step-0 starts (``w0``).

    ``distdiag analyze --parallel`` has the analysis ranks compute the blocks of a streamed
    run (each reads its ranks' files again); rank 0 puts the parts in place
    (:meth:`BreakdownPass.reduce`). Each band writes only its own ranks' and steps' rows, so
    the parts fill disjoint slices and the tables are those of one pass, exactly (the
    breakdown does not depend on the band size)."""

    r_lo: int
    r_hi: int
    ranks: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]  # per_cat, busy, exposed, overlapped, startup
    k_lo: int
    k_hi: int
    steps: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None
    w0: np.ndarray | None


_Slices = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def _slices(t: _Tally, lo: int, hi: int) -> _Slices:
    return (t.per_cat[lo:hi].copy(), t.busy[lo:hi].copy(), t.exposed[lo:hi].copy(), t.overlapped[lo:hi].copy(),
            t.startup[lo:hi].copy())  # fmt: skip


def _put(t: _Tally, lo: int, hi: int, got: _Slices) -> None:
    t.per_cat[lo:hi], t.busy[lo:hi], t.exposed[lo:hi], t.overlapped[lo:hi], t.startup[lo:hi] = got


def breakdown_part(run: Run, colls: Collectives, part: tuple[int, int]) -> BreakdownPart | None:
    """Block ``part = (j, n)`` of the breakdown's bands (see :class:`BreakdownPart`); None when the
    block holds no band (more blocks than bands)."""
    got = sweep(run, [BreakdownPass(colls)], part)[0]
    assert got is None or isinstance(got, BreakdownPart)
    return got


def _tallies(run: Run, colls: Collectives, ranks: bool) -> Tallies:
    """The per-rank tally (when ``ranks``) and the per-step one: the sweep's, when one made them
    with the other per-rank passes (``run.cache.tallies``: the pipeline's, or ``--parallel``'s
    blocks put together on rank 0), else one sweep over every band."""
    done = run.cache.tallies
    if done is not None and (done[0] is not None or not ranks):
        return done
    got: Tallies = run_local(run, [BreakdownPass(colls, ranks)])[0]
    return got


def _compute(run: Run, colls: Collectives, ranks: bool) -> tuple[_Tally | None, pd.DataFrame]:
    """The per-rank tally (when ``ranks``) and the per-step table, band of ranks by band of ranks.

    Every number is a rank's own: a band's intervals, unions and step pieces
    involve only its ranks' rows (:func:`distdiag.bands.bands`: every kind, the
    phases included, whether streamed or not), and the result does not depend on the
    band size (each union is a sum of whole nanoseconds, exact in float64).
    """
    tally, steps = _tallies(run, colls, ranks)
    return tally, steps.frame(run)


def breakdown(run: Run, colls: Collectives | None = None) -> pd.DataFrame:
    """One row per present rank: rank, host, wall_s, the COLUMNS and INFO_COLUMNS, in seconds.

    Also leaves :func:`step_breakdown`'s table in ``run.cache.step_breakdown`` (computed from the same intervals).
    """
    if colls is None:
        colls = collectives_of(run)
    start, end = run.rank_bounds()
    t, steps = _compute(run, colls, ranks=True)
    assert t is not None
    # the per-step table from the same intervals (small: one row per STEP row); the JSON and text read it
    run.cache.step_breakdown = steps
    present = np.array(sorted(run.ranks), np.int64)
    df = pd.DataFrame({"rank": present, "host": [run.host_of(r) for r in present]})
    for name, col in _columns(t, (end - start).astype(np.float64), present).items():
        df[name] = col
    return df


# -- per step -------------------------------------------------------------------------------
def step_marks(run: Run) -> tuple[np.ndarray, np.ndarray]:
    """(rank, t_ns) of the STEP rows that end steps, sorted by (rank, t): see the module docstring."""
    ev = run.events
    m = kind_index(run).rows(int(Kind.STEP))
    auto = run.sid(AUTO_STEP_NAME)
    if auto >= 0:
        m_auto = m[ev["name_id"][m] == auto]  # the STEP rows' names only, not the whole column
        if len(m_auto):
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

    Cached on ``run.cache.step_breakdown`` (the JSON, text and frames read it).
    """
    cached = run.cache.step_breakdown
    if cached is not None:
        return cached
    if colls is None:
        colls = collectives_of(run)
    _, df = _compute(run, colls, ranks=False)
    run.cache.step_breakdown = df
    return df


class _Steps:
    """step_breakdown's table, tallied band by band from the bands' categorized intervals."""

    def __init__(self, run: Run, n: int) -> None:
        self.s_rank, self.s_t = s_rank, s_t = step_marks(run)
        self.n = len(s_t)
        if self.n == 0:
            return
        self.start, _ = run.rank_bounds()
        self.n_per = n_per = np.bincount(s_rank, minlength=n)
        self.first = np.concatenate([[0], np.cumsum(n_per)])  # rank r's marks: first[r]:first[r + 1]
        self.k_of = np.arange(len(s_t)) - self.first[s_rank]
        # step windows [w0, s_t): step k > 0 from the rank's previous mark; step 0 from the rank's first
        # phase row when that comes before its first mark, else its start: set band by band (_open)
        self.w0 = w0 = np.empty_like(s_t)
        w0[1:] = s_t[:-1]
        z = self.k_of == 0
        w0[z] = self.start[s_rank[z]]
        np.minimum(w0, s_t, out=w0)
        self.tally = _Tally(len(s_t))

    def add(self, b: _Band, iv: _Intervals) -> None:
        """Tally the band's intervals, each part cut at the step marks (:meth:`_cut`)."""
        if self.n == 0:
            return
        k_lo, k_hi = int(self.first[b.r_lo]), int(self.first[b.r_hi])
        if k_hi == k_lo:
            return
        self._open(b, k_lo, k_hi)
        self.tally.add(k_lo, k_hi, iv.map(lambda part: self._cut(k_lo, k_hi, *part)))

    def _open(self, b: _Band, k_lo: int, k_hi: int) -> None:
        """Where step 0 of each of the band's ranks starts (``w0`` of its first mark): the rank's
        earliest phase row (WINDOW_KINDS) when that comes before the mark, not before the rank's start.

        Read from the band's own rows (the phases are the kinds a streamed run holds only band by
        band): a rank's rows of one kind are one run of the band's rows of that kind, one minimum a
        run (reduceat), then the minimum over the kinds.
        """
        phase0 = np.full(b.r_hi - b.r_lo, np.iinfo(np.int64).max)
        for k in WINDOW_KINDS:  # six kinds
            wi = b.rows(int(k))
            if len(wi) == 0:
                continue
            lo = np.searchsorted(wi, b.ev_first)  # rank r_lo + i's rows of kind k: wi[lo[i]:lo[i + 1]]
            has = np.flatnonzero(lo[1:] > lo[:-1])
            mn = np.minimum.reduceat(b.ev["t0_ns"][wi].astype(np.int64), lo[has])
            phase0[has] = np.minimum(phase0[has], mn)
        z = k_lo + np.flatnonzero(self.k_of[k_lo:k_hi] == 0)  # the band's ranks' first marks
        r0 = self.s_rank[z]
        p0, s0, t = phase0[r0 - b.r_lo], self.start[r0], self.s_t[z]
        self.w0[z] = np.minimum(np.where(p0 < t, np.maximum(p0, s0), s0), t)

    def _cut(self, k_lo: int, k_hi: int, rank: np.ndarray, t0: np.ndarray, t1: np.ndarray) -> tuple[np.ndarray, ...]:
        """(key, p0, p1): the intervals cut at the step marks: piece i of an interval lies in step
        k0 + i, whose row in the per-step table is ``key``; [p0, p1) the piece. Pieces come in the
        intervals' order."""
        s_rank, s_t, n_per, first, w0 = self.s_rank, self.s_t, self.n_per, self.first, self.w0
        if len(rank) == 0:
            z = np.zeros(0, np.int64)
            return z, z, z
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
        return key, p0, p1

    def frame(self, run: Run) -> pd.DataFrame:
        cols = ["rank", "step", "t_s", "wall_s", *COLUMNS, *INFO_COLUMNS]
        if self.n == 0:
            return pd.DataFrame({c: np.zeros(0, np.int64 if c in ("rank", "step") else np.float64) for c in cols})
        data: dict[str, Any] = {"rank": self.s_rank, "step": self.k_of, "t_s": (self.w0 - run.start_ns) / 1e9}
        data.update(_columns(self.tally, (self.s_t - self.w0).astype(np.float64), np.arange(self.n)))
        return pd.DataFrame(data, columns=cols)


#: :class:`BreakdownPass`'s result: (per-rank tally or None, per-step tally)
Tallies = tuple[_Tally | None, _Steps]


class _BdAcc:
    """:class:`BreakdownPass`'s accumulator: the tallies of the bands of block ``part`` (None: every band)."""

    def __init__(self, run: Run, colls: Collectives, ranks: bool, part: tuple[int, int] | None) -> None:
        start, _ = run.rank_bounds()
        n = len(start)  # == distdiag.bands.n_ranks(run): every rank of 0..n is in one band
        self.run, self.part = run, part
        self.r_first, self.r_last = -1, -1  # the ranks of the bands added: [r_first, r_last)
        self.tally = _Tally(n) if ranks else None
        self.steps = _Steps(run, n)
        # nothing to tally (no per-rank table asked, no step marks): no context, no band read
        self.ctx = None if self.tally is None and self.steps.n == 0 else _Ctx(run, colls, n)


class BreakdownPass(Pass[_BdAcc, _BdAcc | BreakdownPart | None, Tallies]):
    """The breakdown's tallies as a per-rank pass (:mod:`distdiag.passes`): each band's
    categorized intervals, tallied per rank (when ``ranks``) and per step. The part of every
    band is its accumulator, whole; a block's is a :class:`BreakdownPart` (only its ranks' and
    steps' rows, None when the block holds no band); the result is ``(per-rank tally or None,
    per-step tally)``."""

    def __init__(self, colls: Collectives, ranks: bool = True) -> None:
        self.colls, self.ranks = colls, ranks

    def begin(self, run: Run, part: tuple[int, int] | None) -> _BdAcc:
        return _BdAcc(run, self.colls, self.ranks, part)

    def add(self, acc: _BdAcc, band: Band) -> None:
        acc.r_first = band.r_lo if acc.r_first < 0 else acc.r_first
        acc.r_last = band.r_hi
        if acc.ctx is None:
            return
        b = _Band(acc.ctx, band)
        iv = _intervals(acc.ctx, b)
        if acc.tally is not None:
            acc.tally.add(b.r_lo, b.r_hi, iv)
        acc.steps.add(b, iv)

    def part(self, acc: _BdAcc) -> _BdAcc | BreakdownPart | None:
        if acc.part is None:
            return acc
        if acc.r_first < 0:  # more blocks than bands: this one holds none
            return None
        r_lo, r_hi = acc.r_first, acc.r_last
        tally, steps = acc.tally, acc.steps
        assert tally is not None  # a block is tallied per rank (--parallel's breakdown)
        if steps.n:
            k_lo, k_hi = int(steps.first[r_lo]), int(steps.first[r_hi])
            return BreakdownPart(r_lo, r_hi, _slices(tally, r_lo, r_hi), k_lo, k_hi, _slices(steps.tally, k_lo, k_hi),
                                 steps.w0[k_lo:k_hi].copy())  # fmt: skip
        return BreakdownPart(r_lo, r_hi, _slices(tally, r_lo, r_hi), 0, 0, None, None)

    def reduce(self, run: Run, parts: list[_BdAcc | BreakdownPart | None]) -> Tallies:
        if len(parts) == 1 and isinstance(parts[0], _BdAcc):  # every band's, whole
            return parts[0].tally, parts[0].steps
        start, _ = run.rank_bounds()
        n = len(start)
        tally = _Tally(n) if self.ranks else None
        steps = _Steps(run, n)
        for p in parts:  # one per analysis rank
            if not isinstance(p, BreakdownPart):
                continue  # a block with no band
            if tally is not None:
                _put(tally, p.r_lo, p.r_hi, p.ranks)
            if steps.n and p.steps is not None and p.w0 is not None:
                _put(steps.tally, p.k_lo, p.k_hi, p.steps)
                steps.w0[p.k_lo : p.k_hi] = p.w0
        return tally, steps


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


def step_summary(steps: pd.DataFrame, agg: pd.DataFrame | None = None) -> dict[str, Any]:
    """Over every step: how many, the step time (median over ranks) median/p90/max, each column's share.

    ``share``: the column's seconds over all ranks and steps divided by the
    steps' wall-clock over all ranks (the COLUMNS add up to 1). ``agg``:
    ``per_step(steps)`` when the caller has it.
    """
    if len(steps) == 0:
        return {"steps": 0}
    if agg is None:
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
    out: dict[str, Any] = {"summary": step_summary(steps, agg), "bin": 1, "rows": []}
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
