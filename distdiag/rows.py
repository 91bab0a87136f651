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

Where it lives, and why it is only built on the final table: the index is
cached in ``run.cache[KEY]`` on first use. :meth:`distdiag.run.Run.replace`
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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Union

import numpy as np

#: run.cache key of the :class:`KindIndex`
KEY = "rows.kind_index"

#: one kind (an int or a schema.Kind) or several (any iterable of ints, a uint8 array)
Kinds = Union[int, np.integer, Iterable[int], np.ndarray]

_N_KINDS = 256  # the kind column is uint8
#: rows per block of the build: its temporaries (~10 B a row) stay a few MB
_BLOCK_ROWS = 1 << 20


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
        k = _kind_ids(kinds)
        return int((self.starts[k + 1] - self.starts[k]).sum())

    def rows(self, kinds: Kinds) -> np.ndarray:
        """int64 row numbers of ``kinds``, ascending (what ``np.flatnonzero(mask)`` gave)."""
        k = _kind_ids(kinds)
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


def _kind_ids(kinds: Kinds) -> np.ndarray:
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
    block's rows are stably sorted by kind (numpy's radix sort of 1-byte keys,
    O(rows)) and copied to their kind's next free place in the order. A block
    is ascending rows, and blocks go in row order, so every kind's slice comes
    out ascending. One ``argsort`` of the whole column would give the same
    order, but as int64: a +13 B/event transient at the first detector, which
    set the analysis' peak RSS (1228 -> 1309 MB at 1024 x 10k, measured); in
    blocks the transient is the kind copy and a few MB.
    """
    n = len(table)
    kind = np.ascontiguousarray(table["kind"], dtype=np.uint8)  # the one strided read
    starts = np.zeros(_N_KINDS + 1, np.int64)
    edges = range(0, n, block_rows)
    per_block = np.zeros((len(edges), _N_KINDS), np.int64)
    for i, a in enumerate(edges):  # per block of rows: O(1) numpy calls each
        per_block[i] = np.bincount(kind[a : a + block_rows], minlength=_N_KINDS)
    np.cumsum(per_block.sum(axis=0), out=starts[1:])
    order = np.empty(n, np.int32 if n < 2**31 else np.int64)
    # where each (block, kind) run goes: its kind's start plus the earlier blocks' rows of it
    at = starts[:-1] + np.cumsum(per_block, axis=0) - per_block
    present = np.flatnonzero(starts[1:] > starts[:-1])
    for i, a in enumerate(edges):  # per block of rows
        o = np.argsort(kind[a : a + block_rows], kind="stable")
        o += a
        lo = 0
        for k in present:  # the kinds present in the run: a handful to a few dozen
            c = int(per_block[i, k])
            if c:
                order[at[i, k] : at[i, k] + c] = o[lo : lo + c]
                lo += c
    return KindIndex(table=table, order=order, starts=starts)


def kind_index(run: Any) -> KindIndex:
    """``run``'s :class:`KindIndex`, built on first use and cached in ``run.cache[KEY]``."""
    got = run.cache.get(KEY)
    if isinstance(got, KindIndex) and got.table is run.events:
        return got
    idx = build(run.events)
    run.cache[KEY] = idx
    return idx


def rows_of(run: Any, kinds: Kinds) -> np.ndarray:
    """int64 row numbers into ``run.events`` of the rows of ``kinds``, ascending:
    the rows ``np.isin(run.events["kind"], kinds)`` selects, in the same order."""
    return kind_index(run).rows(kinds)


def count_of(run: Any, kinds: Kinds) -> int:
    """How many rows of ``run.events`` have one of ``kinds`` (0 for an absent kind: no copy)."""
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


def events_of(run: Any, kinds: Kinds) -> np.ndarray:
    """The rows of ``kinds`` (a copy, in table order): ``run.events[np.isin(kind, kinds)]``."""
    return run.events.take(rows_of(run, kinds))
