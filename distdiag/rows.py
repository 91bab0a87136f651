"""One kind index per analysis: the rows of every event kind, found in one pass.

Most detectors want a handful of rows of a few kinds (the STEP marks, the file
calls, the probes) out of ``run.events``, a table of 73-byte rows. A mask
``run.events["kind"] == k`` reads a strided byte out of every row: at 102 M
events each such scan costs ~0.6-1 s of CPU, and the detectors, the Slurm
view and the ranking made a dozen of them (~13 s at 1,024 x 100,000, the
lead's profile). Here the kind column is read ONCE, into a stable order of
the row numbers by kind (numpy's radix sort for 1-byte keys: O(n)); the rows
of kind ``k`` are then the slice ``order[starts[k]:starts[k + 1]]``,
ascending: the same rows, in the same (rank, t0_ns) order, as the boolean
mask gave. A set of kinds merges its (few, sorted) slices with one stable
sort of the selected rows only.

    rows_of(run, kinds)    int64 row numbers into run.events, ascending
    count_of(run, kinds)   how many rows (no copy; 0 for an absent kind)
    events_of(run, kinds)  the rows themselves (run.events.take(rows_of(...)))
    unique_sorted(values)  np.unique(values, return_index=True), one pass when ascending
    calls_of(rows)         how many calls each file row stands for (1, or a sum's)
    weighted_quantile(x, w, q), weighted_median(x, w): each x counted w times (numpy's when all w are 1)

Where it lives, and why it is only built on the final table: the index is
cached in ``run.cache.kind_index`` on first use. :meth:`distdiag.run.Run.replace`
gives every new run an empty cache, and :func:`distdiag.clocks.align` returns
such a new run (as does the causality repair inside it), so an index built on
the raw run never reaches the aligned one. Neither reorders rows: each rank's
clock map is monotone and rows are sorted by (rank, t0_ns) before and after;
they rewrite only the time columns, never ``kind``. After ``align``,
``pipeline.analyze_run`` only reads the table (match, Slurm view, detectors,
ranking, breakdown): so the index built by the first consumer serves all of
them. As a guard against a table swapped under the same run object
(``run.events = ...``), the index keeps a reference to the table it was built
from and is rebuilt when ``run.events`` is another array (it is not a copy:
the run holds that table anyway).

The build counts and places each kind's rows by compares when a block holds
a few kinds (the usual case), not by a sort of every block: see :func:`build`.

Memory: the order is int32 below 2**31 rows (4 bytes an event, held to the end
of the analysis with the run; int64 above), plus a transient 1 B/event while
it is built (the contiguous kind column; the sort goes by blocks, see
:func:`build`).

Measured (issue 10; ``benchmarks/bench_scale.py --grid '' --stages 1024x10000
--baseline <worktree of 95bf99e> --repeat 2`` on a checkout of d356c2f, 10.27 M
events, CPU s best of 2 alternating children per tree, load 6-9 on 2 cores)::

    stage                   CPU s before -> after    transient B/event before -> after
    det input_bound         0.23 -> 0.18 (builds the index: ~0.17 s)   4.0 -> 7.1 (4 held)
    det h2d_copy            0.22 -> 0.00                               4.0 -> 0
    det metadata_storm      0.19 -> 0.00                               3.0 -> 0
    det io_bandwidth        0.14 -> 0.00                               5.0 -> 0
    det slow_link           0.07 -> 0.01                               0.2 -> 0.5
    det serial_section      0.20 -> 0.22                               4.0 -> 4.5
    det collective_mismatch 0.05 -> 0.05                               4.0 -> 4.0
    these stages together   1.10 -> 0.46                peak RSS 1227 -> 1228 MB

(the synthetic run has collectives, forward phases and probe rows only: the
file and copy detectors now find no row of their kinds without reading the
table; input_bound no longer sorts the rank column for np.unique when no
input wait exists; serial_section's rows are half the table, its cost its
own.) The whole analysis' CPU (9.5-11.2 s per child) is within the noise of
read + pack on this shared machine. One ``argsort`` of the whole column
instead of the blockwise build: the same order, but +16 B/event at
input_bound, which then set the peak (1228 -> 1309 MB, measured).

Then the build by compares (:func:`build`; issue 10, 100k events a rank).
The index still holds every kind's rows: ``distdiag.breakdown`` reads the
order of the dominant kinds (COLL, the phases) band by band, so a lazy
index of the rare kinds only would move the cost there. ``--stages RxM
--baseline <worktree of 3599750> --repeat 2``, best CPU of 2 alternating
children per tree, load 2-3::

    stage              64 x 100k (6.4 M events)        1024 x 10k (10.3 M)
    det input_bound    0.11-0.15 -> 0.08-0.09 s         0.20-0.24 -> 0.13-0.14 s
      its transient    7.1 -> 3.2 B/event               6.3 -> 4.0 B/event

(input_bound finds no INPUT_WAIT row here: the stage is the index build.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Union

import numpy as np

if TYPE_CHECKING:
    from distdiag.run import Run

#: one kind (an int or a schema.Kind) or several (any iterable of ints, a uint8 array)
Kinds = Union[int, np.integer, Iterable[int], np.ndarray]

_N_KINDS = 256  # the kind column is uint8
#: rows per block of the build: its temporaries (~10 B a row) stay in the CPU's caches
#: (64 x 100k, best of 5 builds: 2**15 rows 13.0, 2**16 12.0, 2**18 12.5, 2**20 13.6 ns a row)
_BLOCK_ROWS = 1 << 16
#: blocks with at most this many kinds are counted and filled by one compare per kind
#: (each ~0.15 ns a row plus the kind's own rows), more by bincount and a stable argsort
_FEW_KINDS = 8


@dataclass(frozen=True)
class KindIndex:
    """Row numbers of a table grouped by kind (see the module docstring)."""

    #: the table indexed (identity-checked by :func:`kind_index`; not copied)
    table: np.ndarray
    #: row numbers sorted stably by kind: ascending within each kind
    order: np.ndarray
    #: int64, 257 entries: kind k's rows are ``order[starts[k]:starts[k + 1]]``
    starts: np.ndarray

    def count(self, kinds: Kinds) -> int:
        """Rows of ``kinds`` (no copy)."""
        k = kind_ids(kinds)
        return int((self.starts[k + 1] - self.starts[k]).sum())

    def rows(self, kinds: Kinds) -> np.ndarray:
        """int64 row numbers of ``kinds``, ascending (what ``np.flatnonzero(mask)`` gave)."""
        k = kind_ids(kinds)
        lo, hi = self.starts[k], self.starts[k + 1]
        have = np.flatnonzero(hi > lo)
        if len(have) == 0:
            return np.zeros(0, np.int64)
        if len(have) == 1:
            return self.order[lo[have[0]] : hi[have[0]]].astype(np.int64)
        # a few ascending runs: one stable sort merges them (timsort / radix, measured
        # ~11 ms for 10^6 rows), on the order's own 4-byte type before widening
        both = np.concatenate([self.order[lo[i] : hi[i]] for i in have])  # a handful of kinds
        both.sort(kind="stable")
        return both.astype(np.int64)


def kind_ids(kinds: Kinds) -> np.ndarray:
    """The distinct kind values of ``kinds`` in 0..255, as int64 (others match no row)."""
    if isinstance(kinds, (int, np.integer)):
        k = np.array([int(kinds)], np.int64)
    elif isinstance(kinds, np.ndarray):
        k = np.unique(kinds.astype(np.int64).ravel())
    else:  # a tuple, list, set of ints or schema.Kind
        k = np.unique(np.fromiter((int(x) for x in kinds), np.int64))
    return k[(k >= 0) & (k < _N_KINDS)]


def build(table: np.ndarray, block_rows: int = _BLOCK_ROWS) -> KindIndex:
    """The :class:`KindIndex` of ``table`` (a structured array with a uint8 ``kind``).

    A counting sort in bounded blocks: the kind column is read once (the one
    strided pass, into a 1-byte contiguous copy), counted per block, and each
    block's rows of each kind are copied to that kind's next free place in the
    order. A block is ascending rows, and blocks go in row order, so every
    kind's slice comes out ascending. One ``argsort`` of the whole column
    would give the same order, but as int64: a +13 B/event transient at the
    first detector, which set the analysis' peak RSS (1228 -> 1309 MB at
    1024 x 10k, measured); in blocks the transient is the kind copy and a few MB.

    A run holds a handful of kinds (collectives and phases dominate): a block
    with at most :data:`_FEW_KINDS` kinds is counted by one compare per kind
    (``count_nonzero``, ~0.15 ns a row each, where ``bincount`` takes ~2.9:
    it widens the bytes to intp) and its rows of a kind are found by
    ``flatnonzero`` of that compare, added to the block's first row straight
    into the order's slice (no stable argsort of the block, ~6-7 ns a row,
    and no copy of its result). A block with a kind not seen in the earlier
    blocks (the compares' counts do not add up to its rows) is counted by
    ``bincount``, and a block of many kinds is sorted as before. Measured on
    the synthetic tables (3 kinds: collectives, forward phases, shim marks;
    CPU s of the build alone, best of 8 / 6 builds alternating with the
    previous build in one process, load 2-4): 64 x 100k (6.4 M rows) 0.111-0.123
    -> 0.092-0.098 s (17-19 -> 14-15 ns a row), 1024 x 10k (10.3 M rows) 0.196
    -> 0.145 s. Of what is left, ~5.5 ns a row is the strided read itself.
    The order is the same array (checked on those tables and in tests/test_rows.py).
    """
    n = len(table)
    kind = np.ascontiguousarray(table["kind"], dtype=np.uint8)  # the one strided read
    starts = np.zeros(_N_KINDS + 1, np.int64)
    edges = range(0, n, block_rows)
    per_block = np.zeros((len(edges), _N_KINDS), np.int64)
    seen = np.zeros(_N_KINDS, bool)
    known = np.zeros(0, np.int64)  # the kinds seen in the blocks so far
    for i, a in enumerate(edges):  # per block of rows: O(1) numpy calls each, or one per kind seen
        blk = kind[a : a + block_rows]
        if 0 < len(known) <= _FEW_KINDS:
            got = np.array([np.count_nonzero(blk == k) for k in known], np.int64)  # a few kinds
            if int(got.sum()) == len(blk):  # no other kind in the block
                per_block[i, known] = got
                continue
        per_block[i] = np.bincount(blk, minlength=_N_KINDS)
        seen |= per_block[i] > 0
        known = np.flatnonzero(seen)
    np.cumsum(per_block.sum(axis=0), out=starts[1:])
    order = np.empty(n, np.int32 if n < 2**31 else np.int64)
    # where each (block, kind) run goes: its kind's start plus the earlier blocks' rows of it
    at = starts[:-1] + np.cumsum(per_block, axis=0) - per_block
    for i, a in enumerate(edges):  # per block of rows
        blk = kind[a : a + block_rows]
        here = np.flatnonzero(per_block[i])
        if len(here) <= _FEW_KINDS:
            for k in here:  # a few kinds: each one's rows by a compare, placed with the block's offset
                dst = order[at[i, k] : at[i, k] + per_block[i, k]]
                np.add(np.flatnonzero(blk == k), a, out=dst, casting="unsafe")  # rows < len(order)'s type
            continue
        o = np.argsort(blk, kind="stable")
        o += a
        lo = 0
        for k in here:  # the kinds present in the block: a few dozen at most
            c = int(per_block[i, k])
            order[at[i, k] : at[i, k] + c] = o[lo : lo + c]
            lo += c
    return KindIndex(table=table, order=order, starts=starts)


def kind_index(run: Run) -> KindIndex:
    """``run``'s :class:`KindIndex`, built on first use and cached in ``run.cache.kind_index``."""
    got = run.cache.kind_index
    if isinstance(got, KindIndex) and got.table is run.events:
        return got
    idx = build(run.events)
    run.cache.kind_index = idx
    return idx


def _resident(run: Run, kinds: Kinds) -> None:
    """Raise when ``kinds`` names a kind the run streams (not in ``run.events``): a stage that
    asks for those rows here would silently see none; it must read them through a pass
    (distdiag.passes: a sweep over the bands)."""
    streamed = getattr(run, "streamed_kinds", ())
    if streamed and np.isin(kind_ids(kinds), np.asarray(streamed, np.int64)).any():
        raise RuntimeError(
            f"rows of kinds {sorted(set(kind_ids(kinds).tolist()) & set(streamed))} are streamed on this run: "
            "read them through a pass over the bands (distdiag.passes), not run.events"
        )


def rows_of(run: Run, kinds: Kinds) -> np.ndarray:
    """int64 row numbers into ``run.events`` of the rows of ``kinds``, ascending:
    the rows ``np.isin(run.events["kind"], kinds)`` selects, in the same order."""
    _resident(run, kinds)
    return kind_index(run).rows(kinds)


def count_of(run: Run, kinds: Kinds) -> int:
    """How many rows of ``run.events`` have one of ``kinds`` (0 for an absent kind: no copy)."""
    _resident(run, kinds)
    return kind_index(run).count(kinds)


def unique_sorted(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(values, return_index=True)`` (the distinct values and each one's first
    position), in one pass when ``values`` is already ascending: the rank column of
    the table's rows (sorted by (rank, t0_ns)) is, so its sort is saved; else np.unique."""
    v = np.ascontiguousarray(values)
    if len(v) == 0 or not bool(np.all(v[1:] >= v[:-1])):
        u, first = np.unique(v, return_index=True)
        return u, first
    first = np.flatnonzero(np.r_[True, v[1:] != v[:-1]])
    return v[first], first


def events_of(run: Run, kinds: Kinds) -> np.ndarray:
    """The rows of ``kinds`` (a copy, in table order): ``run.events[np.isin(kind, kinds)]``."""
    return np.asarray(run.events.take(rows_of(run, kinds)))


def calls_of(rows: np.ndarray) -> np.ndarray:
    """How many calls each file row stands for: ``seq`` where the row sums several (small
    reads/writes summed per file and thread; calls the libc interposer's full ring or rate
    rule summed per (call, directory, thread), name ``<dir>/*``: ``distdiag.shim.preload``),
    else 1 (every other file row has seq -1). Files written before read/write sums carried
    their calls in ``seq`` count such a sum as 1 call."""
    return np.asarray(np.maximum(rows["seq"], 1).astype(np.int64))


def weighted_quantile(x: np.ndarray, w: np.ndarray, q: float) -> float:
    """The ``q`` quantile of ``x`` with each value counted ``w`` times (the value at which the
    running weight reaches ``q`` of the total); ``np.quantile`` itself when every weight is 1.
    NaN for no values."""
    if len(x) == 0:
        return float("nan")
    if (w == 1).all():
        return float(np.quantile(x, q))
    o = np.argsort(x, kind="stable")
    c = np.cumsum(w[o])
    return float(x[o][min(int(np.searchsorted(c, q * c[-1])), len(o) - 1)])


def weighted_median(x: np.ndarray, w: np.ndarray) -> float:
    """:func:`weighted_quantile` at 0.5 (``np.median`` when every weight is 1)."""
    return weighted_quantile(x, w, 0.5)
