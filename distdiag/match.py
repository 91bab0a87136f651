"""Collective matching across ranks: by (communicator key, sequence number), never by time.

Every collective a hook records carries ``comm_id`` (the communicator key, the
same string on every rank that shares the communicator) and ``seq`` (that
communicator's collective counter on this rank: 0, 1, 2, ...). The n-th
collective on a communicator is the same call on every member rank, whatever
the clocks say, so grouping rows by (comm key, seq) matches them exactly,
like the PyTorch flight recorder does. Timestamps only describe each match.

Members of a communicator: the set of ranks that ever used its key (in any
event or in flight). A group with fewer members than that is incomplete: some
rank never reached it (``MISSING_RANKS``) or a rank was still inside it when
its file ended (``IN_FLIGHT``).

Everything here is columnar: one row per group (``Collectives.g_*``) and one
row per (group, member) (``Collectives.m_*``), members of group ``g`` at
``m_*[g_start[g]:g_start[g+1]]`` sorted by arrival. The member columns that
SPMD ranks agree on (op, bytes, root, site, datatype) are kept per group plus
the members that differ (:class:`GroupColumn`, read like arrays): the match
is the cross-rank store a streamed analysis keeps whole, at 25 bytes a member.

Split (``analyze --parallel``): a group's facts come from its own rows plus
two run-wide facts (the communicators' membership and the key's radix,
:class:`MatchScope`), so contiguous ranges of the (comm, seq) key matched
apart and concatenated are the whole match exactly (:func:`split_match`,
:func:`match_part`, :func:`merge_collectives`; the section near the end says
how, ``benchmarks/bench_match_ranges.py`` what it costs).
"""

from __future__ import annotations

import enum
import functools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, overload

import numpy as np
from numpy.lib.mixins import NDArrayOperatorsMixin

from distdiag.run import COMM_TABLE, Run
from distdiag.schema import COMM_KINDS, Kind

log = logging.getLogger(__name__)


class MatchState(enum.IntEnum):
    """How a collective group matched; ``describe()`` says it in words."""

    COMPLETE = 0
    MISSING_RANKS = 1
    IN_FLIGHT = 2
    OP_MISMATCH = 3
    SIZE_MISMATCH = 4
    ROOT_MISMATCH = 5

    def describe(self) -> str:
        return _STATE_TEXT[self]


_STATE_TEXT = {
    MatchState.COMPLETE: "every member rank of the communicator entered and left it",
    MatchState.MISSING_RANKS: "some member ranks of the communicator never entered it",
    MatchState.IN_FLIGHT: "some member ranks were still inside it when their record ends",
    MatchState.OP_MISMATCH: "member ranks called different operations at this sequence number",
    MatchState.SIZE_MISMATCH: "member ranks passed different byte counts to an operation that needs equal ones",
    MatchState.ROOT_MISMATCH: "member ranks named different roots",
}

#: Ops whose members must pass equal byte counts (the v/w variants, gathers of
#: pickled objects and broadcasts legitimately differ, so they are not checked).
SIZE_CHECKED_OPS = frozenset(
    {
        "Allreduce", "Iallreduce", "Reduce", "Ireduce", "Allgather", "Iallgather",
        "Alltoall", "Ialltoall", "Reduce_scatter_block", "Ireduce_scatter_block",
        "Scan", "Iscan", "Exscan", "Iexscan", "Gather", "Igather",
        "all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "reduce",
    }
)  # fmt: skip


class GroupColumn(NDArrayOperatorsMixin):
    """A member column that is constant within almost every group, stored per group.

    SPMD ranks call the n-th collective of a communicator with the same op, byte
    count, root, datatype and (usually) call site, so a member column such as
    ``m_op`` holds the same value on every member of nearly every group. It is
    kept as one value per group (``group_values``: the value of the group's
    FIRST member in member order, i.e. its first arriver: free to take while
    matching, no count needed; a per-group mode would save exceptions only in
    mismatched groups, which are rare) plus the members that differ from it
    (``exc_rows``: their member rows, sorted; ``exc_values``: their values).
    ``m_group`` (the Collectives' own column, shared, not copied) maps a member
    to its group. At 1024 x 100k (51 M members) the five such columns took 28
    bytes a member as plain arrays; this takes ~0 (a few bytes per group).

    It reads like the 1-D array it replaces, read-only: ``col[i]`` (a numpy
    scalar), ``col[a:b]``, ``col[int array]``, ``col[bool mask]`` give plain
    ndarrays of ``dtype``, computed for the asked rows only (a gather of the
    group values, then the exceptions in range patched in: a subset never
    materializes the whole column); ``len``, ``dtype``, ``shape``, ``max()``,
    ``min()`` without materializing. ``np.asarray(col)``, ``astype`` and any
    ufunc or operator (``col == 3``) materialize the whole column, transiently.
    ``group_max()`` / ``varies()`` give per-group facts from the exceptions alone.
    """

    __slots__ = ("group_values", "exc_rows", "exc_values", "m_group")

    def __init__(self, group_values: np.ndarray, m_group: np.ndarray, exc_rows: np.ndarray, exc_values: np.ndarray) -> None:
        self.group_values = group_values
        self.m_group = m_group
        self.exc_rows = exc_rows.astype(np.int64, copy=False)
        self.exc_values = exc_values.astype(group_values.dtype, copy=False)

    @classmethod
    def from_array(cls, values: np.ndarray, m_group: np.ndarray, g_start: np.ndarray) -> GroupColumn:
        """The column of a plain member array (members of group g at ``g_start[g]:g_start[g + 1]``)."""
        values = np.asarray(values)
        gv = values[g_start[:-1]] if len(values) else values[:0]
        rows = np.flatnonzero(values != gv[m_group]) if len(values) else np.zeros(0, np.int64)
        return cls(gv, m_group, rows, values[rows])

    @property
    def dtype(self) -> np.dtype:
        return self.group_values.dtype

    @property
    def shape(self) -> tuple[int]:
        return (len(self.m_group),)

    ndim = 1

    @property
    def size(self) -> int:
        return len(self.m_group)

    def __len__(self) -> int:
        return len(self.m_group)

    def __repr__(self) -> str:
        return (f"GroupColumn({len(self)} members, {len(self.group_values)} groups, "
                f"{len(self.exc_rows)} exceptions, dtype={self.dtype})")  # fmt: skip

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        if copy is False:
            raise ValueError("a GroupColumn has no array to view: np.asarray makes one (a copy)")
        out = self.group_values[self.m_group]
        out[self.exc_rows] = self.exc_values
        got: np.ndarray = out if dtype is None else out.astype(dtype, copy=False)
        return got

    def astype(self, dtype: Any, copy: bool = True) -> np.ndarray:
        """The whole column as a plain array of ``dtype`` (materialized: a transient)."""
        return np.asarray(self).astype(dtype, copy=False)

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        if any(isinstance(o, GroupColumn) for o in kwargs.get("out", ())):
            return NotImplemented  # read-only
        args = [np.asarray(x) if isinstance(x, GroupColumn) else x for x in inputs]
        return getattr(ufunc, method)(*args, **kwargs)

    @overload
    def __getitem__(self, key: int | np.integer) -> Any: ...
    @overload
    def __getitem__(self, key: slice | np.ndarray | list[Any]) -> np.ndarray: ...

    def __getitem__(self, key: Any) -> Any:
        n = len(self.m_group)
        if isinstance(key, slice):
            start, stop, step = key.indices(n)
            if step != 1:
                return self._take(np.arange(start, stop, step))
            out = self.group_values[self.m_group[start:stop]]
            if len(self.exc_rows) and stop > start:
                i, j = np.searchsorted(self.exc_rows, (start, stop))
                out[self.exc_rows[i:j] - start] = self.exc_values[i:j]
            return out
        if isinstance(key, (int, np.integer)) and not isinstance(key, (bool, np.bool_)):
            i = int(key)
            if not -n <= i < n:
                raise IndexError(f"index {i} is out of bounds for a column of {n} members")
            i %= n
            if len(self.exc_rows):
                p = int(np.searchsorted(self.exc_rows, i))
                if p < len(self.exc_rows) and self.exc_rows[p] == i:
                    return self.exc_values[p]
            return self.group_values[self.m_group[i]]
        if isinstance(key, tuple) or key is None or key is Ellipsis:
            return np.asarray(self)[key]  # numpy's own semantics, on a materialized copy
        k = np.asarray(key)
        if k.dtype == bool and k.ndim == 1:
            return self._mask(k)
        if k.size == 0 and k.dtype.kind not in "iub":
            k = k.astype(np.intp)
        if k.dtype.kind in "iu":
            return self._take(k)
        return np.asarray(self)[key]  # any other key: numpy's own semantics, on a materialized copy

    def _take(self, idx: np.ndarray) -> np.ndarray:
        """Rows ``idx`` (integers of any shape, negative ones from the end)."""
        n = len(self.m_group)
        if idx.size and int(idx.min()) < 0:
            idx = np.where(idx < 0, idx + n, idx)
            if int(idx.min()) < 0:
                raise IndexError(f"index {int(idx.min()) - n} is out of bounds for a column of {n} members")
        out: np.ndarray = self.group_values[self.m_group[idx]]  # raises numpy's IndexError when out of range
        if len(self.exc_rows) and out.size:
            flat = idx.reshape(-1)
            p = np.searchsorted(self.exc_rows, flat)
            np.minimum(p, len(self.exc_rows) - 1, out=p)
            hit = self.exc_rows[p] == flat
            if hit.any():
                out.reshape(-1)[hit] = self.exc_values[p[hit]]
        return out

    def _mask(self, mask: np.ndarray) -> np.ndarray:
        """Rows where ``mask`` (one flag per row) is True."""
        out: np.ndarray = self.group_values[self.m_group[mask]]  # raises numpy's IndexError on a wrong length
        e = self.exc_rows
        if len(e) and len(out):
            hit = mask[e]
            if hit.any():
                # an exception's place in the output: the True flags before its row,
                # counted between consecutive exceptions (no row-sized cumsum)
                seg = np.add.reduceat(mask, e, dtype=np.int64)
                before = np.empty(len(e), np.int64)
                before[0] = np.count_nonzero(mask[: e[0]])
                np.cumsum(seg[:-1], out=before[1:])
                before[1:] += before[0]
                out[before[hit]] = self.exc_values[hit]
        return out

    def max(self, *args: Any, **kwargs: Any) -> Any:
        """The largest value (every group has a member, its first one holds ``group_values``)."""
        if args or kwargs or len(self) == 0:
            return np.asarray(self).max(*args, **kwargs)
        m = self.group_values.max()
        return max(m, self.exc_values.max()) if len(self.exc_values) else m

    def min(self, *args: Any, **kwargs: Any) -> Any:
        """The smallest value (see :meth:`max`)."""
        if args or kwargs or len(self) == 0:
            return np.asarray(self).min(*args, **kwargs)
        m = self.group_values.min()
        return min(m, self.exc_values.min()) if len(self.exc_values) else m

    def exc_groups(self) -> np.ndarray:
        """The group of each exception (ascending, like ``exc_rows``)."""
        return self.m_group[self.exc_rows]

    def varies(self) -> np.ndarray:
        """Per group: True where its members do not all hold one value."""
        out = np.zeros(len(self.group_values), bool)
        out[self.exc_groups()] = True
        return out

    def group_max(self) -> np.ndarray:
        """Per group: the largest value among its members (``np.maximum.reduceat`` over the groups)."""
        out = self.group_values.copy()
        np.maximum.at(out, self.exc_groups(), self.exc_values)  # exceptions: few
        return out


@dataclass
class Collectives:
    """Matched collectives, columnar. Times are on the run's timeline (aligned if the run was)."""

    # one row per group ---------------------------------------------------------
    g_comm: np.ndarray  # i4 global string id of the communicator key
    g_seq: np.ndarray  # i8
    g_op: np.ndarray  # i4 string id of the op (the most common name among members)
    g_state: np.ndarray  # i1 MatchState
    g_n_members: np.ndarray  # i4 ranks that entered it
    g_n_expected: np.ndarray  # i4 ranks that ever used the communicator
    g_first_ns: np.ndarray  # i8 first arrival
    g_last_ns: np.ndarray  # i8 last arrival (t0 of the last arriver)
    g_second_ns: np.ndarray  # i8 second-to-last arrival (== last when one member)
    g_last_rank: np.ndarray  # i4 the last arriver
    g_exit_ns: np.ndarray  # i8 last exit among members (-1 when one is still in flight)
    g_start: np.ndarray  # i8 [n_groups + 1]: member rows of group g are g_start[g]:g_start[g+1]
    # one row per (group, member), sorted by (group, arrival) -----------------------
    # plain arrays, 25 bytes a member:
    m_group: np.ndarray  # i4 (i8 only past 2^31 - 1 groups); index arrays with it, never multiply it unwidened
    m_rank: np.ndarray  # i4
    m_t0_ns: np.ndarray  # i8 arrival
    m_t1_ns: np.ndarray  # i8 exit, -1 when still inside (in flight)
    m_kind: np.ndarray  # u1
    # one value per group plus the members that differ (:class:`GroupColumn`), read like arrays:
    m_op: GroupColumn  # i4
    m_nbytes: GroupColumn  # i8
    m_peer: GroupColumn  # i4 root for rooted collectives
    m_site: GroupColumn  # i4
    #: comm key id -> sorted member ranks
    comm_members: dict[int, np.ndarray]
    strings: np.ndarray
    #: i8 per member: ``aux`` of its row (the datatype's string id); None when not gathered
    m_aux: GroupColumn | None = None
    #: rows dropped because they repeated a (comm, seq, rank) (damaged files only)
    n_dup: int = 0

    def __len__(self) -> int:
        return len(self.g_seq)

    @property
    def complete(self) -> np.ndarray:
        done: np.ndarray = self.g_state == MatchState.COMPLETE
        return done

    def members(self, g: int) -> slice:
        return slice(int(self.g_start[g]), int(self.g_start[g + 1]))

    def member_ranks(self, g: int) -> np.ndarray:
        return self.m_rank[self.members(g)]

    def missing_ranks(self, g: int) -> np.ndarray:
        """Ranks of the communicator that never entered group ``g``."""
        return np.setdiff1d(self.comm_members.get(int(self.g_comm[g]), np.zeros(0, np.int32)), self.member_ranks(g))

    def op_name(self, g: int) -> str:
        return str(self.strings[self.g_op[g]])

    def comm_name(self, g: int) -> str:
        return str(self.strings[self.g_comm[g]])

    def to_frame(self) -> Any:
        """One row per group as a pandas DataFrame (for notebooks)."""
        import pandas as pd

        st = np.asarray(self.strings, dtype=object)
        return pd.DataFrame(
            {
                "comm": st[self.g_comm],
                "seq": self.g_seq,
                "op": st[self.g_op],
                "state": [MatchState(s).name for s in self.g_state],
                "n_members": self.g_n_members,
                "n_expected": self.g_n_expected,
                "first_ns": self.g_first_ns,
                "second_last_ns": self.g_second_ns,
                "last_ns": self.g_last_ns,
                "last_rank": self.g_last_rank,
                "exit_ns": self.g_exit_ns,
            }
        )


def _empty(strings: np.ndarray) -> Collectives:
    z = np.zeros(0, np.int64)
    g = z.astype(np.int32)

    def col(dt: Any) -> GroupColumn:
        return GroupColumn(z.astype(dt), g, z, z)

    return Collectives(
        g_comm=z.astype(np.int32), g_seq=z, g_op=z.astype(np.int32), g_state=z.astype(np.int8),
        g_n_members=z.astype(np.int32), g_n_expected=z.astype(np.int32), g_first_ns=z, g_last_ns=z,
        g_second_ns=z, g_last_rank=z.astype(np.int32), g_exit_ns=z, g_start=np.zeros(1, np.int64),
        m_group=g, m_rank=z.astype(np.int32), m_t0_ns=z, m_t1_ns=z, m_op=col(np.int32), m_nbytes=col(np.int64),
        m_peer=col(np.int32), m_site=col(np.int32), m_kind=z.astype(np.uint8),
        comm_members={}, strings=strings, m_aux=col(np.int64),
    )  # fmt: skip


#: The event fields match_collectives sorts by (read in table order, first pass).
_KEY_FIELDS = ("t0_ns", "rank", "comm_id", "seq")
#: The other fields it keeps (read in the matched order, second pass): plain member
#: columns (the hot ones, read by every detector) ...
_HOT_FIELDS = ("t0_ns", "t1_ns", "kind", "rank")
#: ... and per-group ones (:class:`GroupColumn`): event field -> (Collectives field, dtype).
_GROUP_FIELDS = {
    "name_id": ("m_op", np.int32),
    "nbytes": ("m_nbytes", np.int64),
    "peer": ("m_peer", np.int32),
    "site_id": ("m_site", np.int32),
    "aux": ("m_aux", np.int64),
}
#: Rows per block of :func:`_gather_members` (300 kB of 73-byte rows: stays in L2). At 64 x 100k
#: (3.2 M rows in match order, best of 3-4 interleaved, CPU s): 2^16 rows 0.20-0.27,
#: 2^12 0.15-0.19, 2^11 0.12-0.24 (noisier), measured.
_GATHER_ROWS = 1 << 12


def _gather_members(
    take: Any, n: int, dtype: np.dtype, starts: np.ndarray
) -> tuple[dict[str, np.ndarray], dict[str, GroupColumn], np.ndarray]:
    """The member columns from the matched rows, by blocks of whole rows in member
    order (``take(lo, hi)``: the rows of members ``lo:hi`` of the ``n``, as a
    structured block): ``_HOT_FIELDS`` as plain arrays, ``_GROUP_FIELDS`` as
    :class:`GroupColumn` columns, made in the same pass: each block first sets the
    values of the groups that start in it (their first member's), then keeps
    its rows that differ from their group's value (any group of the block has
    its value by then: members come group by group). No member-size copy of a
    per-group field exists at any time (the five took 28 bytes a member).

    The in-flight rows travel in the same blocks (``take`` merges them), so the
    rows are gathered once, in order, straight from the tables: no table-order
    copy of each field to permute afterwards (that copy and its permuted twin
    were the match's peak: ~37 bytes per collective row held through the sort,
    measured)."""
    n_g = len(starts)
    # the member rows' group (part of the result): int32 up to 2^31 - 1 groups
    gid = np.repeat(np.arange(n_g, dtype=np.int32 if n_g < 1 << 31 else np.int64), np.diff(np.append(starts, n)))
    hot = {f: np.empty(n, dtype[f]) for f in _HOT_FIELDS}
    gv = {f: np.empty(n_g, dt) for f, (_, dt) in _GROUP_FIELDS.items()}
    exc: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {f: [] for f in _GROUP_FIELDS}
    p = 0  # groups before p started in earlier blocks
    buf = {f: np.empty(_GATHER_ROWS, dt) for f, (_, dt) in _GROUP_FIELDS.items()}  # a block's values, contiguous
    chg = np.empty(_GATHER_ROWS, bool)
    tmp = np.empty(_GATHER_ROWS, bool)
    inner = np.empty(_GATHER_ROWS, bool)
    for lo in range(0, n, _GATHER_ROWS):  # per block of 4,096 member rows
        sub = take(lo, min(n, lo + _GATHER_ROWS))
        hi = lo + len(sub)
        k = hi - lo
        for f in _HOT_FIELDS:  # three
            hot[f][lo:hi] = sub[f]
        q = p + int(np.searchsorted(starts[p:], hi))
        first = starts[p:q] - lo
        g0 = int(gid[lo])  # the group of the block's first row (began here or before)
        # A member differs from its group's first iff some value changes between two
        # neighbours inside the group: a compare a field on the block's contiguous
        # copy (the 73-byte stride of the rows made it 3x slower, measured), no
        # gather of the group values; the exact rows only in a block with a change.
        c, t, ins = chg[: k - 1], tmp[: k - 1], inner[: k - 1]
        ins.fill(True)
        ins[first[first > 0] - 1] = False  # (row i, i + 1) where i + 1 starts a group
        c.fill(False)
        edge = False
        for f in _GROUP_FIELDS:  # five
            v = buf[f][:k]
            v[:] = sub[f]
            gv[f][p:q] = v[first]
            np.not_equal(v[1:], v[:-1], out=t)
            c |= t
            edge |= bool(v[0] != gv[f][g0])  # the first row against its group (when it began before)
        c &= ins
        if edge or c.any():  # rare: the rows unlike their group's first
            g = gid[lo:hi]
            for f in _GROUP_FIELDS:  # five
                v = buf[f][:k]
                d = np.flatnonzero(v != gv[f][g])
                if len(d):
                    exc[f].append((d + lo, v[d]))
        p = q
    cols = {}
    for f, (name, dt) in _GROUP_FIELDS.items():  # five
        rows = np.concatenate([r for r, _ in exc[f]]) if exc[f] else np.zeros(0, np.int64)
        vals = np.concatenate([v for _, v in exc[f]]) if exc[f] else np.zeros(0, dt)
        cols[name] = GroupColumn(gv[f], gid, rows, vals)
    return hot, cols, gid


#: Table rows per block of :func:`select_keys` (300 kB of 73-byte rows: stays in L2;
#: 0.28 s at 1024x10k, 0.30 with 2^14 rows, 0.34 with 2^15, measured).
_SELECT_ROWS = 1 << 12


def select_keys(ev: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(indices of the collective rows of ``ev``, ``{f: ev[f][those]}`` for the sort keys),
    in one pass over the table by blocks of ``_SELECT_ROWS`` rows: each block's kind
    and seq pick its rows, whose key fields are read while the block is in cache.
    The outputs are allocated for every row but only the selected ones are written,
    so only their pages are ever touched (numpy's large arrays are mmapped lazily):
    no count pass, no concatenation. Measured at 1024x10k (CPU s): 0.53 (a
    strided pass for kind, one for seq, then blocked gathers of whole selected
    rows) -> 0.28."""
    sel = KeySelector(len(ev), ev.dtype)
    sel.add(ev, 0)
    return sel.result()


class KeySelector:
    """:func:`select_keys` fed block by block, in table order: whoever streams the
    event table anyway (:func:`distdiag.clocks.align`'s mapping pass) selects the
    collective rows of each block while its rows are in cache, and leaves the
    result in ``run.cache.selected_keys`` for :func:`match_collectives` (no second
    pass over the table). ``add`` takes consecutive blocks from row 0 on; the match
    takes the result only for the very table it was fed and fed to its end.
    Measured at 64 x 100k (6.4 M rows, mapping then selection, CPU s, 6
    alternating runs of each, twice, a loaded 2-core machine): separate passes
    min 0.39-0.41 / median 0.50-0.56, fused min 0.32-0.38 / median 0.44."""

    def __init__(self, n_ev: int, dtype: np.dtype) -> None:
        self.is_comm = COMM_TABLE
        self.sel_idx = np.empty(n_ev, np.int64)
        self.out = {f: np.empty(n_ev, dtype[f]) for f in _KEY_FIELDS}
        self.k = 0
        self.next = 0

    def add(self, blk: np.ndarray, lo: int) -> None:
        """Select from ``blk``, the table's rows ``lo:lo + len(blk)``."""
        if lo != self.next:
            raise ValueError(f"blocks out of order: {lo} after {self.next}")
        self.next = lo + len(blk)
        k, sel_idx, out = self.k, self.sel_idx, self.out
        for a in range(0, len(blk), _SELECT_ROWS):  # per block of 4,096 table rows
            sb = blk[a : a + _SELECT_ROWS]
            m = self.is_comm[sb["kind"]]  # np.isin by a 256-entry table: one gather (half isin's time)
            m &= sb["seq"] >= 0
            i = np.flatnonzero(m)
            j = k + len(i)
            sel_idx[k:j] = i
            sel_idx[k:j] += lo + a
            sub = sb.take(i)  # whole rows: a strided gather per field is slower, measured
            for f in _KEY_FIELDS:  # four fields
                out[f][k:j] = sub[f]
            k = j
        self.k = k

    def result(self) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        return self.sel_idx[: self.k], {f: a[: self.k] for f, a in self.out.items()}


class _Expanded:
    """A streamed run's compact collective rows (``COLL_ROW_DTYPE``) read as event rows:
    :meth:`take` gives ``RUN_EVENT_DTYPE`` rows, the other fields from the run's sig table
    (``tid`` and ``value``, which the match never reads, are 0). Blocks only: the match
    gathers by blocks of rows (:func:`_gather_members`)."""

    def __init__(self, rows: np.ndarray, sigs: np.ndarray) -> None:
        from distdiag.run import RUN_EVENT_DTYPE

        self.rows, self.sigs, self.dtype = rows, sigs, RUN_EVENT_DTYPE

    def take(self, idx: np.ndarray) -> np.ndarray:
        c = self.rows.take(idx)
        out = np.zeros(len(c), self.dtype)
        for f in ("t0_ns", "t1_ns", "kind", "comm_id", "seq", "rank"):  # the kept columns
            out[f] = c[f]
        s = self.sigs.take(c["sig"])
        for f in s.dtype.names or ():  # op, bytes, root, site, datatype
            out[f] = s[f]
        return out


def match_collectives(run: Run, scope: MatchScope | None = None) -> Collectives:
    """Group every collective row (finished or in flight) by (comm key, seq).

    ``scope``: the run-wide facts when ``run`` holds only some of the run's
    collective rows (one key range of a split match, :func:`match_part`): the
    communicators' membership and the key's radix come from it instead of
    from these rows, and the repeated-row warning is left to the caller (it
    warns once, with the total: :func:`warn_repeats`). Without it (the
    default) both come from the rows, and the warning goes to ``run.warnings``.

    Memory: the working set is a few columns per collective row, never a copy
    of the event table. Two passes: the table by blocks, picking the
    collective rows and their four sort keys (t0, rank, comm, seq: 24 bytes a
    row; align does it in its mapping pass, :class:`KeySelector`), then, once
    the (group, arrival) order is known, the other fields of those rows
    straight in that order (blocks of whole rows). The int64 keys
    are built in place and dropped once used; comm and seq go before the sort
    when the groups' keys decode to them, t0 once the order is known, and the
    order packs and decodes by blocks of groups. Measured at 1,024 ranks x
    10,000 events (5.1 M collective rows): the match's peak went from ~113 to
    ~75 bytes per collective row, then to its result's 57 (align's transient
    33.5 -> 29.6 B/event, all of it the kept match).

    Then (issue 10) the result: 57 -> 25 bytes a member. ``m_group`` is int32;
    op, nbytes, root, site and datatype are :class:`GroupColumn` columns (a value
    per group plus the members that differ, built in the gather's pass); the
    ranks come with the gathered rows (no ``rank[order]`` held through the
    sort); repeated ranks are counted by blocks of groups (no int64 group id
    and pair key per row); the keys are built in seq's own array and sorted
    in it (:func:`_key_groups`); :func:`arrival_order`'s last take runs by
    blocks (``np.take(out=)`` onto its own index copied the index first).
    ``bench_scale.py --stages --baseline <worktree of 485fb9d> --repeat 2``,
    best of 2 alternating children: at 1024 x 10k, kept after align 27.6 ->
    12.4 B/event; align's transient 28.8 -> 17.6 B/event (now the sort, ~32
    bytes a collective row: selection index, t0, the keys sorted in place and
    the packed arrivals; or the gather, ~33: row index, group, the plain
    columns); whole-run peak RSS 1209 -> 1054 MB; align 1.17 -> 1.06 s of
    CPU. At 64 x 100k: align 29.0 -> 17.5 B/event, 0.88 -> 0.55 s (0.63 ->
    0.58 in a quieter run), peak 797 -> 696-702 MB. At 1024 x 100k (51 M
    members) the kept match is ~1.3 GB instead of ~2.9.

    CPU (issue 10; align, which includes this match, best of alternating runs
    on the loaded 2-core machine, see the commit messages for each step):
    1024 x 10k 2.2-2.5 -> 1.7 s. Where it went: the selection and key gather
    (two strided passes over the table, then a blocked gather of the rows)
    0.53 -> 0.28 s in one blocked pass; the (comm, seq, arrival) order 0.55 ->
    0.35 s (:func:`arrival_order`); the repeated-row check 0.10 -> 0.05 s (a
    flag per (group, rank) instead of a sort).

    Then at 64 x 100k (6.4 M events, 3.2 M collective rows; ``bench_scale.py
    --grid "" --stages 64x100000 --baseline <worktree of 3599750> --repeat 2``,
    best of 2 alternating children, two runs): align 1.32 -> 0.77 and 1.00 ->
    0.83 s of CPU (180-220 -> 120-130 ns/event), transient unchanged (28.9-29.0
    B/event). From: the gather by 4,096-row blocks, the arrival order's fewer
    random gathers and in-cache block sorts, align's mapping by blocks and its
    selection in that pass (:class:`KeySelector`), the causality count against
    ``g_last_ns`` (see :func:`distdiag.clocks._count_violations`). At 1024 x 10k
    no change beyond the noise was measured (1.86 -> 1.95 s, one run, a loaded
    machine: read + pack, not touched, went 3.24 -> 4.06 in the same run).
    """
    if run.coll_remote is not None and scope is None:
        # --parallel: the collective rows stay on the analysis ranks that read them, which
        # match them by key ranges (distdiag.parallel._Remote.match: split, match, merge)
        return run.coll_remote.match(run)  # type: ignore[no-any-return]
    ev: Any = run.events
    inf = run.inflight
    # A streamed run keeps its collective rows apart, compact (distdiag.run.COLL_ROW_DTYPE):
    # their other fields come back by their sig when gathered (:class:`_Expanded`).
    if run.coll_rows is not None and run.coll_sigs is not None:
        ev = _Expanded(run.coll_rows, run.coll_sigs)
    # The selection and the sort keys in ONE pass over the table, by blocks that
    # stay in cache (a strided pass per field re-read each 73-byte row once per
    # field, measured), or the one align's mapping pass made (:class:`KeySelector`).
    pre = run.cache.selected_keys
    run.cache.selected_keys = None  # taken once
    rows = ev.rows if isinstance(ev, _Expanded) else ev
    if pre is not None and pre[0] is rows and pre[1].next == len(rows):
        sel_idx, got = pre[1].result()
    else:
        sel_idx, got = select_keys(rows)
    del rows
    del pre
    inf_idx, got_inf = select_keys(inf)  # the in-flight rows: a handful per rank
    n = len(sel_idx) + len(inf_idx)
    if n == 0:
        return _empty(run.strings)
    if len(inf_idx):
        got = {f: np.concatenate([got[f], got_inf[f]]) for f in _KEY_FIELDS}
    del got_inf
    t0_raw, rank, comm, seq = (got.pop(f) for f in _KEY_FIELDS)
    del got
    # One int64 key per (comm, seq) (:func:`group_keys`); comm ids index the string
    # table and seqs count calls, so the products stay far below 2^63.
    # (Damaged files can hold absurd seqs that overflow the keys: the grouping
    # is then wrong but consistent, and comm/seq are then never decoded from a key.)
    n_seq = min(int(seq.max()) + 1, _I64_MAX)  # a seq of INT64_MAX: the radix must stay an int64
    if scope is not None:
        if n_seq > scope.n_seq:
            raise ValueError(f"a row's seq {n_seq - 1} is past the scope's radix {scope.n_seq}: not the run's scope")
        n_seq = scope.n_seq  # the run's: the keys, and so the groups' order, are the whole match's
    # Without overflow (comm >= 0, 0 <= seq < n_seq) a key is one (comm, seq):
    # the groups' comm and seq are then decoded from their keys, and the keys
    # are built in seq's own array (no third int64 column at the match's peak).
    decodable = int(comm.min()) >= 0 and (int(comm.max()) + 1) * n_seq < 1 << 63
    if decodable:
        gkey = seq
        for a in range(0, n, _ORDER_ROWS):  # per block: seq + comm * n_seq, in place
            c = comm[a : a + _ORDER_ROWS].astype(np.int64)
            c *= n_seq
            gkey[a : a + _ORDER_ROWS] += c
        del c
    else:
        gkey = comm.astype(np.int64)
        gkey *= n_seq
        gkey += seq

    # Communicator membership: every rank that ever used the key, over all the
    # run's rows (a part of a split match gets it with its scope).
    if scope is None:
        comm_ids, comm_size, comm_members = _membership(comm_pairs(comm, rank))
    else:
        comm_ids, comm_size, comm_members = scope.membership
    # Decodable keys: comm and seq (12 bytes a row) go before the sort, the match's peak.
    if decodable:
        del comm, seq
    del rank  # the members' ranks come again with their rows, in member order

    # Order by (comm, seq), then arrival, then row (:func:`arrival_order`); the
    # keys' array becomes the key order (no copy of it in the sort).
    order, starts, gk = _arrival_order(gkey, t0_raw, consume=True)
    del t0_raw, gkey
    if decodable:
        g_comm = (gk // n_seq).astype(np.int32)
        g_seq = (gk % n_seq).astype(np.int64)
    else:
        head = order[starts]  # each group's first row
        g_comm = comm[head].astype(np.int32)
        g_seq = seq[head].astype(np.int64)
        del comm, seq, head
    del gk

    # The member columns, gathered from the rows in member order: ``pick`` says
    # which rows (table rows; or positions in the table's selection, then the
    # in-flight rows', merged block by block when there are in-flight rows).
    if len(inf_idx) == 0:  # the usual case: the order as rows of the event table
        pick = sel_idx[order]
        del order, sel_idx

        def take(lo: int, hi: int) -> np.ndarray:
            blk: np.ndarray = ev.take(pick[lo:hi])
            return blk

    else:
        pick = order
        del order
        n_ev = len(sel_idx)

        def take(lo: int, hi: int) -> np.ndarray:  # the block's event rows and in-flight rows, merged
            o = pick[lo:hi]
            from_ev = o < n_ev
            blk = np.empty(len(o), ev.dtype)
            blk[from_ev] = ev.take(sel_idx[o[from_ev]])
            blk[~from_ev] = inf.take(inf_idx[o[~from_ev] - n_ev])
            return blk

    hot, cols, gid = _gather_members(take, len(pick), ev.dtype, starts)
    m_rank = hot["rank"]

    # A rank can appear twice in one (comm, seq) only through a damaged file or
    # a hook bug; keep its earliest row so every member counts once: its first
    # in member order (members go by arrival, ties in row order).
    n_dup = _count_dups(starts, m_rank)
    if n_dup:
        if scope is None:
            run.warnings.append(repeat_warning(n_dup))
        keep = _first_of_each_rank(starts, m_rank)
        del hot, cols, gid, m_rank
        kept = np.add.reduceat(keep, starts, dtype=np.int64)  # every group keeps its first member
        starts = np.cumsum(kept) - kept
        pick = pick[keep]
        del keep, kept
        hot, cols, gid = _gather_members(take, len(pick), ev.dtype, starts)
        m_rank = hot["rank"]
    del take, pick, inf_idx
    n_g = len(starts)
    g_start = np.append(starts, len(m_rank)).astype(np.int64)
    n_mem = np.diff(g_start).astype(np.int32)
    last_idx = g_start[1:] - 1
    second_idx = np.maximum(last_idx - 1, starts)
    n_exp = comm_size[np.searchsorted(comm_ids, g_comm)].astype(np.int32)
    m_t0 = hot["t0_ns"]

    # Op: the most common name among members; mismatch when any member differs
    # (from its group's first: a member min != max, said by the exceptions alone).
    op = cols["m_op"]
    op_mismatch = op.varies()
    g_op = op.group_values.astype(np.int64)
    if op_mismatch.any():  # rare: only then pay for a per-group mode
        sel = op_mismatch[gid]
        g_op[op_mismatch] = _mode_per_group(op[sel], gid[sel], n_g)[op_mismatch]

    # Root: rooted collectives carry the root in peer (>= 0 on every member).
    peer = cols["m_peer"]
    root_mismatch = peer.varies() & (peer.group_max() >= 0)

    # Size: only for ops that require equal counts on every member.
    checked_ids = np.array([run.sid(o) for o in SIZE_CHECKED_OPS if run.sid(o) >= 0], np.int64)
    size_mismatch = np.isin(g_op, checked_ids) & cols["m_nbytes"].varies() & ~op_mismatch

    t1 = hot["t1_ns"]
    in_flight = np.minimum.reduceat(t1, starts) < 0
    missing = n_mem < n_exp

    state = np.full(n_g, MatchState.COMPLETE, np.int8)
    # Incompleteness first, mismatches override it: a mismatch explains why a
    # group never completed, the reverse is not true.
    state[missing] = MatchState.MISSING_RANKS
    state[in_flight] = MatchState.IN_FLIGHT
    state[root_mismatch] = MatchState.ROOT_MISMATCH
    state[size_mismatch] = MatchState.SIZE_MISMATCH
    state[op_mismatch] = MatchState.OP_MISMATCH

    exit_ns = np.maximum.reduceat(t1, starts)
    exit_ns[in_flight] = -1

    return Collectives(
        g_comm=g_comm,
        g_seq=g_seq,
        g_op=g_op.astype(np.int32),
        g_state=state,
        g_n_members=n_mem,
        g_n_expected=n_exp,
        g_first_ns=m_t0[starts].astype(np.int64),
        g_last_ns=m_t0[last_idx].astype(np.int64),
        g_second_ns=m_t0[second_idx].astype(np.int64),
        g_last_rank=m_rank[last_idx].astype(np.int32),
        g_exit_ns=exit_ns.astype(np.int64),
        g_start=g_start,
        m_group=gid,
        m_rank=m_rank.astype(np.int32, copy=False),
        m_t0_ns=m_t0.astype(np.int64, copy=False),
        m_t1_ns=t1.astype(np.int64, copy=False),
        m_kind=hot["kind"].astype(np.uint8, copy=False),
        m_op=op,
        m_nbytes=cols["m_nbytes"],
        m_peer=peer,
        m_site=cols["m_site"],
        comm_members=comm_members,
        strings=run.strings,
        m_aux=cols["m_aux"],
        n_dup=n_dup,
    )


# ----------------------------------------------------------------------------------
# The match split by key ranges (issue 10: ``analyze --parallel`` matches on K ranks)
#
# Groups are ordered by their key (:func:`group_keys`: comm-major, then seq), and
# every fact of a group comes from its own rows plus two run-wide facts (the
# communicators' membership, the key's radix: :class:`MatchScope`). So the rows
# of a contiguous range of keys, matched with the run's scope, give exactly the
# whole match's groups of that range, and the ranges' matches, in key order, are
# concatenated (:func:`merge_collectives`), never re-interleaved. The pieces,
# in the order a parallel analysis uses them:
#
# 1. the scope: :func:`comm_pairs` and the largest seq of any block of rows, united
#    (:meth:`MatchScope.union`; an allreduce of the max, a gather of the pairs);
# 2. the ranges: :func:`key_ranges` over the keys, or over (distinct key, row count)
#    pairs gathered from the blocks: K - 1 cut keys that split the ROWS evenly;
# 3. each range's rows (:class:`MatchPart`, :func:`split_match` serially: table
#    order kept, so ties in arrival fall as in the whole match), matched by
#    :func:`match_part`;
# 4. :func:`merge_collectives` of the parts in range order, then
#    :func:`warn_repeats` once on the run.


def repeat_warning(n_dup: int) -> str:
    """The run warning for ``n_dup`` collective rows dropped as repeats of a (comm, seq, rank)."""
    return f"{n_dup} collective rows repeat a (communicator, seq, rank): counted once"


def warn_repeats(run: Run, colls: Collectives) -> None:
    """Add the repeated-row warning for ``colls`` (a merged split match) to ``run.warnings``,
    as :func:`match_collectives` adds it for a whole match: once, with the total."""
    if colls.n_dup:
        run.warnings.append(repeat_warning(colls.n_dup))


def comm_pairs(comm: np.ndarray, rank: np.ndarray) -> np.ndarray:
    """The distinct (communicator id, rank) pairs of collective rows, as sorted int64
    ``comm << 32 | rank`` (both are int32 columns). A union over any split of the rows
    (``np.unique(np.concatenate(...))``) is the pairs of all: compute it per block of
    rows wherever they are. Rows usually come rank by rank, so only the rows where
    (rank, comm) changes can add a pair: the unique pairs of those few rows are the
    unique pairs of all (any order is still right, only slower)."""
    n = len(comm)
    if n == 0:
        return np.zeros(0, np.int64)
    chg = np.ones(n, bool)
    np.not_equal(comm[1:], comm[:-1], out=chg[1:])
    chg[1:] |= rank[1:] != rank[:-1]
    c = comm[chg].astype(np.int64)
    c <<= 32
    c |= rank[chg].astype(np.int64) & 0xFFFFFFFF
    return np.unique(c)


def _membership(pairs: np.ndarray) -> tuple[np.ndarray, np.ndarray, dict[int, np.ndarray]]:
    """(communicator ids ascending, their sizes, comm id -> sorted member ranks) of :func:`comm_pairs`."""
    comm = pairs >> 32
    rank = (pairs & 0xFFFFFFFF).astype(np.int32)
    comm_ids, cstart = np.unique(comm, return_index=True)
    members = {int(c): m for c, m in zip(comm_ids, np.split(rank, cstart[1:]))}  # per communicator
    return comm_ids, np.diff(np.append(cstart, len(pairs))), members


@dataclass(frozen=True)
class MatchScope:
    """What a part of a split match needs from the whole run (a few kB, shipped as is).

    ``pairs``: :func:`comm_pairs` of every collective row of the run (table and
    in flight): a group's expected member count is its communicator's size over
    the whole run, which no part can see. ``n_seq``: the largest seq of any
    collective row, plus one: the radix of :func:`group_keys`, so a part's keys
    and group order are the whole match's even when a damaged file's absurd seq
    makes the keys wrap."""

    pairs: np.ndarray
    n_seq: int

    @classmethod
    def of_rows(cls, comm: np.ndarray, seq: np.ndarray, rank: np.ndarray) -> MatchScope:
        """The scope of some collective rows (one block of a run's: unite them with :meth:`union`)."""
        return cls(comm_pairs(comm, rank), int(seq.max()) + 1 if len(seq) else 0)

    @classmethod
    def union(cls, scopes: list[MatchScope]) -> MatchScope:
        """The scope of the rows of all ``scopes`` together."""
        pairs = np.unique(np.concatenate([s.pairs for s in scopes])) if scopes else np.zeros(0, np.int64)
        return cls(pairs, max((s.n_seq for s in scopes), default=0))

    @functools.cached_property
    def membership(self) -> tuple[np.ndarray, np.ndarray, dict[int, np.ndarray]]:
        """(communicator ids ascending, their sizes, ``Collectives.comm_members``), computed once."""
        return _membership(self.pairs)


def group_keys(comm: np.ndarray, seq: np.ndarray, n_seq: int) -> np.ndarray:
    """The int64 key :func:`match_collectives` groups and orders rows by: ``comm * n_seq + seq``
    (comm-major: a communicator's groups by seq, then the next communicator's)."""
    k = comm.astype(np.int64)
    k *= n_seq
    k += seq
    return k


@dataclass(frozen=True)
class KeyRanges:
    """K contiguous ranges of group keys: part p holds the keys in ``[cuts[p-1], cuts[p])``
    (the first from the lowest key, the last to the highest). A cut is a key, so a
    group (one key) never straddles two parts. Comm-major keys make the ranges seq
    ranges of each communicator in turn: with one dominant communicator, its seq
    ranges."""

    n_seq: int
    cuts: np.ndarray  # int64, ascending, K - 1 of them (equal ones leave a part empty)

    def __len__(self) -> int:
        return len(self.cuts) + 1

    def part_of(self, comm: np.ndarray, seq: np.ndarray) -> np.ndarray:
        """Per row: the part (0..K-1) its (comm, seq) falls in."""
        return np.searchsorted(self.cuts, group_keys(comm, seq, self.n_seq), side="right")


def key_ranges(keys: np.ndarray, k: int, n_seq: int, counts: np.ndarray | None = None) -> KeyRanges:
    """K ranges of group keys holding about equal ROW counts (a part's match costs by rows).

    ``keys``: one :func:`group_keys` value per row; or, with ``counts``, keys and the
    rows each stands for, in any order and repeated (each block's
    ``np.unique(keys, return_counts=True)``, concatenated: a histogram small enough
    to gather). Cut p is the key at sorted row position ``p * n // K``: the rows
    before it go to earlier parts, so a part holds n/K rows give or take one group.
    Both forms give the same cuts. Rows: ``np.partition`` at the K - 1 positions
    (linear); histogram: a sort of its keys."""
    k = max(1, int(k))
    if counts is None:
        n = len(keys)
        q = (np.arange(1, k, dtype=np.int64) * n) // k
        cuts = np.partition(keys, q)[q] if n and k > 1 else np.zeros(0, np.int64)
    else:
        o = np.argsort(keys, kind="stable")
        cum = np.cumsum(np.asarray(counts, np.int64)[o])
        n = int(cum[-1]) if len(cum) else 0
        q = (np.arange(1, k, dtype=np.int64) * n) // k
        cuts = np.asarray(keys)[o][np.searchsorted(cum, q, side="right")] if n and k > 1 else np.zeros(0, np.int64)
    return KeyRanges(n_seq, cuts.astype(np.int64))


@dataclass
class MatchPart:
    """The input of one key range's match, raw numpy buffers (with the run's ``strings``
    and :class:`MatchScope`, what :func:`match_part` needs; ``nbytes`` to ship).

    ``rows``: the range's collective rows in the run's table order, either a
    streamed run's compact ``COLL_ROW_DTYPE`` rows (37 B; their other fields in
    ``sigs``, the run's whole sig table, a few rows) or event-table rows
    (``RUN_EVENT_DTYPE``, 73 B; ``sigs`` None). ``inflight``: the range's in-flight
    collective rows, in order (they come after the table rows, as in the whole
    match). The order within each matters: members are sorted by arrival, ties
    by row order."""

    rows: np.ndarray
    sigs: np.ndarray | None
    inflight: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.rows.nbytes + self.inflight.nbytes + (0 if self.sigs is None else self.sigs.nbytes))


def split_match(run: Run, k: int) -> tuple[MatchScope, list[MatchPart]]:
    """The run's scope and its collective rows split into ``k`` key ranges (serially: what
    the analysis ranks of a parallel run do on their own rows, then exchange).
    One selection pass over the rows the match reads (a streamed run's kept
    collective rows, else the table), one over the in-flight rows; each part's
    rows taken in table order (a stable sort by part)."""
    streamed = run.coll_rows is not None and run.coll_sigs is not None
    src = run.coll_rows if streamed else run.events
    assert src is not None  # for mypy: streamed says coll_rows is there
    sel, got = select_keys(src)
    isel, igot = select_keys(run.inflight)
    scope = MatchScope.union([MatchScope.of_rows(g["comm_id"], g["seq"], g["rank"]) for g in (got, igot)])
    pk = [group_keys(g["comm_id"], g["seq"], scope.n_seq) for g in (got, igot)]
    ranges = key_ranges(np.concatenate(pk), k, scope.n_seq)
    picks = []
    for idx, keys, tab in ((sel, pk[0], src), (isel, pk[1], run.inflight)):  # the table's rows, the in-flight rows
        part = np.searchsorted(ranges.cuts, keys, side="right")
        o = np.argsort(part, kind="stable")
        bounds = np.searchsorted(part[o], np.arange(len(ranges) + 1))
        picks.append([tab.take(idx[o[a:b]]) for a, b in zip(bounds[:-1], bounds[1:])])  # per part
    sigs = run.coll_sigs if streamed else None
    return scope, [MatchPart(rows, sigs, inf) for rows, inf in zip(*picks)]


def match_part(part: MatchPart, scope: MatchScope, strings: np.ndarray) -> Collectives:
    """The match of one key range: exactly the whole match's groups of that range
    (:func:`merge_collectives` puts the ranges back together). Adds no warning:
    the repeats it dropped are in ``n_dup`` (:func:`warn_repeats` after the merge)."""
    from distdiag.run import RUN_EVENT_DTYPE, RUN_GPU_DTYPE, RUN_SYNC_DTYPE

    compact = part.sigs is not None
    run = Run(
        path=Path("."), ranks={}, events=np.zeros(0, RUN_EVENT_DTYPE) if compact else part.rows, strings=strings,
        sync=np.zeros(0, RUN_SYNC_DTYPE), inflight=part.inflight, gpu=np.zeros(0, RUN_GPU_DTYPE), world_size=0,
        job_id="", coll_rows=part.rows if compact else None, coll_sigs=part.sigs,
    )  # fmt: skip
    return match_collectives(run, scope)


def merge_collectives(parts: list[Collectives]) -> Collectives:
    """The match of consecutive key ranges, ``parts`` in ascending range order, as one:
    the group columns concatenated, ``g_start`` and ``m_group`` offset (``m_group``
    int32 unless the total passes 2^31 - 1 groups, as the whole match chooses), the
    :class:`GroupColumn` columns' group values and exceptions concatenated (the
    exceptions' rows offset), ``n_dup`` summed. ``comm_members`` is the run's (every
    part holds its scope's); none when there are no groups, as a whole match of no
    rows. Each column is written once into its result array: the peak is the parts
    plus the result. The repeated-row warning: :func:`warn_repeats`."""
    if not parts:
        raise ValueError("merge_collectives needs at least one part (the whole match of one range)")
    n_g = np.array([len(p) for p in parts], np.int64)
    n_m = np.array([len(p.m_rank) for p in parts], np.int64)
    g_off = np.append(0, np.cumsum(n_g))
    m_off = np.append(0, np.cumsum(n_m))
    total_g, total_m = int(g_off[-1]), int(m_off[-1])

    def cat(get: Any, n: int, off: np.ndarray | None = None, dtype: Any = None) -> np.ndarray:
        """``get(part)`` of every part into one array (``off[i]`` added to part i's)."""
        arrs = [get(p) for p in parts]
        out = np.empty(n, dtype if dtype is not None else arrs[0].dtype)
        a = 0
        for i, x in enumerate(arrs):  # per part
            out[a : a + len(x)] = x
            if off is not None and off[i]:
                out[a : a + len(x)] += off[i]
            a += len(x)
        return out

    g_start = np.empty(total_g + 1, np.int64)
    g_start[:-1] = cat(lambda p: p.g_start[:-1], total_g, m_off, np.int64)
    g_start[-1] = total_m
    gid = cat(lambda p: p.m_group, total_m, g_off, np.int32 if total_g < 1 << 31 else np.int64)

    def column(name: str) -> GroupColumn:
        cols = [getattr(p, name) for p in parts]
        return GroupColumn(
            np.concatenate([c.group_values for c in cols]), gid,
            cat(lambda p: getattr(p, name).exc_rows, sum(len(c.exc_rows) for c in cols), m_off, np.int64),
            np.concatenate([c.exc_values for c in cols]),
        )  # fmt: skip

    has_aux = [p.m_aux is not None for p in parts]
    if any(has_aux) and not all(has_aux):
        raise ValueError("some parts gathered m_aux and some did not: match them alike")
    members = next((p.comm_members for p in parts if len(p)), {})
    g = {f: cat(lambda p, f=f: getattr(p, f), total_g) for f in _MERGED_GROUP_FIELDS}
    m = {f: cat(lambda p, f=f: getattr(p, f), total_m) for f in _MERGED_MEMBER_FIELDS}
    return Collectives(
        **g, g_start=g_start, m_group=gid, **m,
        m_op=column("m_op"), m_nbytes=column("m_nbytes"), m_peer=column("m_peer"), m_site=column("m_site"),
        comm_members=members, strings=parts[0].strings, m_aux=column("m_aux") if all(has_aux) else None,
        n_dup=int(sum(p.n_dup for p in parts)),
    )  # fmt: skip


#: The plain columns :func:`merge_collectives` concatenates as they are.
_MERGED_GROUP_FIELDS = ("g_comm", "g_seq", "g_op", "g_state", "g_n_members", "g_n_expected", "g_first_ns",
                        "g_last_ns", "g_second_ns", "g_last_rank", "g_exit_ns")  # fmt: skip
_MERGED_MEMBER_FIELDS = ("m_rank", "m_t0_ns", "m_t1_ns", "m_kind")


def _rank_pairs(starts: np.ndarray, m_rank: np.ndarray) -> Any:
    """(a, key, pairs) for blocks of whole groups, members ``a:a + len(key)``: one int64 per
    member naming its (group within the block, rank), equal for a repeated rank.
    Block-local group numbers keep the keys small (no overflow, whatever the ids);
    ``pairs``: the keys' range, 0 up to it."""
    n = len(m_rank)
    if n == 0:
        return
    r_lo = int(m_rank.min())
    span = int(m_rank.max()) - r_lo + 1
    gs = np.append(starts, n).astype(np.int64)
    for g_lo, g_hi, a, b in _blocks_of_groups(gs, _GAP_ROWS):  # per block of ~262,144 members
        key = np.repeat(np.arange(g_hi - g_lo, dtype=np.int64), np.diff(gs[g_lo : g_hi + 1]))
        key *= span
        key += m_rank[a:b]
        key -= r_lo
        yield a, key, (g_hi - g_lo) * span


def _count_dups(starts: np.ndarray, m_rank: np.ndarray) -> int:
    """Members that repeat a (group, rank): members minus distinct pairs, by blocks of
    groups. A flag per (group, rank) when that is at most a few bytes a member (groups
    near complete: one scatter), else a sort of the block's pairs."""
    dup = 0
    for _a, key, n_pairs in _rank_pairs(starts, m_rank):  # per block of ~262,144 members
        if n_pairs <= 4 * len(key) + (1 << 20):
            seen = np.zeros(n_pairs, bool)
            seen[key] = True
            dup += len(key) - int(np.count_nonzero(seen))
        else:
            key.sort()
            dup += int(np.count_nonzero(key[1:] == key[:-1]))
    return dup


def _first_of_each_rank(starts: np.ndarray, m_rank: np.ndarray) -> np.ndarray:
    """Per member: True for the first member of its (group, rank) in member order."""
    keep = np.zeros(len(m_rank), bool)
    for a, key, _ in _rank_pairs(starts, m_rank):  # per block of ~262,144 members
        _, first = np.unique(key, return_index=True)  # the first occurrence of each
        keep[a + first] = True
    return keep


def _mode_per_group(values: np.ndarray, gid: np.ndarray, n_g: int) -> np.ndarray:
    """The most frequent value per group (ties: the smallest), vectorized."""
    pairs = np.stack([gid.astype(np.int64), values.astype(np.int64)], axis=1)
    uniq, counts = np.unique(pairs, axis=0, return_counts=True)
    # sort by (group, -count, value): the first row per group is its mode
    order = np.lexsort((uniq[:, 1], -counts, uniq[:, 0]))
    uniq = uniq[order]
    first = np.r_[True, uniq[1:, 0] != uniq[:-1, 0]]
    out = np.zeros(n_g, np.int64)
    out[uniq[first, 0]] = uniq[first, 1]
    return out


def collectives_of(run: Run) -> Collectives:
    """The run's matched collectives, computed once and cached on the run."""
    c = run.cache.collectives
    if c is None:
        c = match_collectives(run)
        run.cache.collectives = c
    # distdiag.clocks.align leaves its match here, with the warnings a match adds.
    if run.cache.collectives_warnings is not None:
        run.warnings.extend(run.cache.collectives_warnings)
        run.cache.collectives_warnings = None
    return c


def member_gaps_ns(run: Run, colls: Collectives, async_exits: bool = False) -> np.ndarray:
    """Per member row: its own time since its previous blocking collective (or its start), in ns.

    Computed once per collectives table (straggler, serial_section and the
    ranking all read it) and kept in ``run.cache.member_gaps``; do not write into it.

    The rank's blocking collectives run one after another on its thread, so
    sorting its rows by arrival, the gap of a row is its arrival minus the
    latest exit among the rows before it (the running maximum, so an
    exit-less in-flight row never makes a gap negative).

    ``async_exits=True``: the completions of non-blocking collectives count as
    exits too (a DDP step cannot start before its previous step's buckets
    completed: that completion, not the rank's start, is where the ranks last
    lined up). The straggler's inherited-lateness discount reads this one;
    without any non-blocking collective it is the same array.
    """
    if async_exits and not np.any(colls.m_kind == Kind.COLL_ASYNC):
        async_exits = False
    hit = run.cache.member_gaps.get(async_exits)
    if hit is not None and hit[0] is colls:
        return hit[1]
    gap = _member_gaps_ns(run, colls, async_exits)
    gap.flags.writeable = False  # shared by every reader
    run.cache.member_gaps[async_exits] = (colls, gap)
    return gap


#: Member rows per block of :func:`_member_gaps_ns` (its temporaries are per block).
_GAP_ROWS = 1 << 18


def group_blocks(colls: Collectives, rows: int = 1 << 18) -> Any:
    """(g_lo, g_hi, a, b) for blocks of whole groups ``g_lo:g_hi`` whose member rows
    ``a:b`` number about ``rows`` (a larger group is a block of its own): member
    passes by blocks keep their temporaries a few MB, whatever the run's size."""
    return _blocks_of_groups(colls.g_start, rows)


def _blocks_of_groups(gs: np.ndarray, rows: int) -> Any:
    """:func:`group_blocks` for group starts ``gs`` (n_groups + 1 of them, the last one the row count)."""
    ng = len(gs) - 1
    g_lo = 0
    while g_lo < ng:  # per block
        g_hi = min(ng, max(g_lo + 1, int(np.searchsorted(gs, gs[g_lo] + rows, side="right")) - 1))
        yield g_lo, g_hi, int(gs[g_lo]), int(gs[g_hi])
        g_lo = g_hi


def _bits(v: int) -> int:
    """Bits that hold the non-negative integers up to ``v``."""
    return max(1, int(v).bit_length())


def stable_order(key: np.ndarray) -> np.ndarray:
    """``np.argsort(key, kind="stable")`` of integer keys.

    numpy timsorts wide integer keys for a stable argsort, but sorts plain
    int64 values with a vectorized quicksort (AVX-512 where the CPU has it)
    several times faster. So when the key's span and the row index fit in 63
    bits together, each row becomes the one value ``(key - min) << b | index``:
    all distinct, so any sort orders them as a stable sort would (ties by
    index), and the low ``b`` bits are the order. Otherwise (a span near 2^63)
    numpy's stable argsort. Measured on the 5.1 M (comm, seq) keys of the
    1024x10k run (CPU s): 0.38 (timsort) -> 0.20 (two stable 16-bit radix
    passes, since dropped: the packed value fits every span under 2^32 up to
    2^31 rows) -> 0.11 (packed)."""
    return _stable_order_keys(key)[0]


def _stable_order_keys(key: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(:func:`stable_order` of ``key``, ``key`` in that order): when the order comes from
    the packed values, the sorted keys are their high bits, decoded by one
    sequential pass instead of a gather ``key[order]`` (a random read a row)."""
    if len(key) == 0:
        return np.zeros(0, np.intp), key[:0]
    lo = int(key.min())
    span = int(key.max()) - lo
    b = _bits(len(key) - 1)
    if _bits(span) + b <= 63:
        k = key.astype(np.int64)  # a copy, made the packed value in place
        k -= lo
        k <<= b
        k |= np.arange(len(key), dtype=np.int64)
        k.sort()
        sk = k >> b
        sk += lo
        k &= (1 << b) - 1
        return k, sk.astype(key.dtype, copy=False)
    # The span and the index do not fit one int64: keys spread over near 2^63 (damaged
    # ones), or spans under 2^32 with more than 2^31 rows. numpy's stable sort.
    o = np.argsort(key, kind="stable")
    return o, key[o]


def arrival_order(gkey: np.ndarray, t0: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(``np.lexsort((t0, gkey))``, the start of each run of equal keys in it): rows by
    (group key, arrival), ties in row order, and where each group begins.

    Two sorts of distinct packed int64 values (see :func:`stable_order`): the
    rows by key first (stable, so each group's rows keep their row order), then
    within the groups by ``(group number, t0 - the group's first t0, position
    in the group)``, which fits 63 bits unless a group's arrivals spread over
    days or the groups are huge; then a stable sort of the arrivals within the
    groups does it. Arrivals relative to the group, not to the run: a run's
    span and the row index together (hours of ns and 26 bits of rows) would
    not fit. The packed values are built and decoded by blocks of whole groups,
    so the whole-size arrays are the key order and the packed values (16 bytes
    a row). Measured at 1024x10k (5.1 M rows, CPU s): 0.55 (a stable argsort
    of t0, a timsort merging the ranks' runs, then one of the keys) -> 0.3-0.4.

    Then (issue 10, at 64 x 100k: 3.2 M rows): the sorted keys decoded from
    the first sort's packed values (no gather ``gkey[order]``); the arrivals
    gathered once in key order, into the packed values' own array (the
    second pass packs them in place: no second random gather of t0); and
    the second sort done block by block of whole groups, each block packed,
    sorted and decoded while it is in cache (the values never cross a block's
    groups, so the blocks' sorts are the whole sort). CPU s, interleaved runs:
    0.20-0.27 -> 0.15-0.19."""
    order, starts, _ = _arrival_order(gkey, t0, consume=False)
    return order, starts


def _arrival_order(gkey: np.ndarray, t0: np.ndarray, consume: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`arrival_order`, and each group's key. ``consume=True``: ``gkey`` (int64,
    writable, the caller's to lose) is sorted in place into the key order (see
    :func:`_key_groups`), so the sort holds 8 bytes a row over the keys, not 16."""
    n = len(gkey)
    if n == 0:
        return np.zeros(0, np.intp), np.zeros(0, np.intp), gkey[:0]
    t0 = np.asarray(t0, dtype=np.int64)
    o, starts, gkeys = _key_groups(gkey, consume)
    ng = len(starts)
    gs = np.append(starts, n).astype(np.int64)
    counts = np.diff(gs)
    blocks = list(_blocks_of_groups(gs, _ORDER_ROWS))
    # t0 differences cannot overflow int64 when the whole range spans < 2^62
    if int(t0.max()) - int(t0.min()) < 1 << 62:
        key = np.empty(n, np.int64)  # the arrivals in key order first, then their packed values
        gmin = np.empty(ng, np.int64)
        spread = 0
        for g_lo, g_hi, a, b in blocks:  # per block of ~ _ORDER_ROWS rows: each group's first arrival
            ts = key[a:b]
            np.take(t0, o[a:b], out=ts)
            at = gs[g_lo:g_hi] - a
            mn = np.minimum.reduceat(ts, at)
            gmin[g_lo:g_hi] = mn
            spread = max(spread, int((np.maximum.reduceat(ts, at) - mn).max()))
        bt, bp, bg = _bits(spread), _bits(int(counts.max()) - 1), _bits(ng - 1)
        if bg + bt + bp <= 63:
            low = (1 << bp) - 1
            for g_lo, g_hi, a, b in blocks:  # per block: (group, arrival - first arrival, position) packed, sorted, decoded
                c = counts[g_lo:g_hi]
                k = key[a:b]
                k -= np.repeat(gmin[g_lo:g_hi], c)
                k <<= bp
                k |= np.left_shift(np.repeat(np.arange(g_lo, g_hi, dtype=np.int64), c), bt + bp)
                pos = np.arange(a, b, dtype=np.int64)
                first = np.repeat(gs[g_lo:g_hi], c)
                pos -= first
                k |= pos
                k.sort()  # within the block's groups: each group's values stay in its own range
                k &= low
                k += first
            del gmin
            for a in range(0, n, _ORDER_ROWS):  # per block: key = o[key], in place (np.take with out=key
                k = key[a : a + _ORDER_ROWS]  # copies the whole index first: +8 bytes a row at the match's peak)
                k[:] = o[k]
            return key, starts, gkeys
    # arrivals spread too far for the packed key: a stable sort by t0, then by group
    gid = np.repeat(np.arange(ng, dtype=np.int64), counts)
    by_t0 = np.argsort(t0[o], kind="stable")
    o2 = stable_order(gid[by_t0])
    return o[by_t0[o2]], starts, gkeys


def _key_groups(key: np.ndarray, consume: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(:func:`stable_order` of ``key``, where each run of equal keys starts in it, each
    run's key), as :func:`_stable_order_keys` sorts, but the run starts and keys are
    read off the sorted packed values by blocks: no sorted copy of the keys. With
    ``consume`` an int64 writable ``key`` is packed, sorted and decoded in its own
    array, which is returned as the order (a copy of the keys and of the sorted
    keys, 16 bytes a row, avoided)."""
    n = len(key)
    lo = int(key.min())
    span = int(key.max()) - lo
    b = _bits(n - 1)
    if _bits(span) + b > 63:  # see _stable_order_keys
        o, gk = _stable_order_keys(key)
        newg = np.r_[True, gk[1:] != gk[:-1]]
        starts = np.flatnonzero(newg)
        return o, starts, gk[starts]
    mine = consume and key.dtype == np.int64 and key.flags.writeable
    k = key if mine else key.astype(np.int64)
    for a in range(0, n, _ORDER_ROWS):  # per block: (key - lo) << b | index, in place
        blk = k[a : a + _ORDER_ROWS]
        blk -= lo
        blk <<= b
        blk |= np.arange(a, a + len(blk), dtype=np.int64)
    # the values are distinct (each holds its index), so any sort gives the same order; a stable
    # one is timsort, which merges the runs the rows come in (each rank's rows by sequence number):
    # at 1024 x 10^5 (51 M rows, 1,024 runs) 0.45 s against quicksort's 4.1-4.2 (benchmarks/NOTES.md,
    # "The match's key sort"); on keys in no order at all it is ~17% slower (0.76 s against 0.65 at 10 M)
    k.sort(kind="stable")
    newg = np.empty(n, bool)
    newg[0] = True
    for a in range(0, n - 1, _ORDER_ROWS):  # per block: pairs (i, i + 1) for i in a:hi
        hi = min(n - 1, a + _ORDER_ROWS)
        x = k[a : hi + 1] >> b
        np.not_equal(x[1:], x[:-1], out=newg[a + 1 : hi + 1])
    starts = np.flatnonzero(newg)
    del newg
    gkeys = k[starts] >> b
    gkeys += lo
    k &= (1 << b) - 1
    return k, starts, gkeys.astype(key.dtype, copy=False)


#: Rows per block of :func:`arrival_order`'s packing and second sort (512 kB of values:
#: sorted in cache). At 64 x 100k (3.2 M rows, CPU s, 4 interleaved runs): 2^18 rows
#: 0.17-0.26, 2^16 0.15-0.21, 2^14 0.14-0.19, measured; 2^16 keeps the blocks' Python
#: overhead small when groups are large.
#: the largest int64 (a radix past it would not fit the key's dtype)
_I64_MAX = (1 << 63) - 1
_ORDER_ROWS = 1 << 16


def rank_time_order(colls: Collectives) -> np.ndarray:
    """``np.lexsort((colls.m_t0_ns, colls.m_rank))``: member rows by (rank, arrival), ties
    in member order. Done as lexsort does it, one stable sort per key, but the
    rank pass sorts a 16-bit copy of the ranks, which numpy radix-sorts in linear
    time, and the arrival pass runs on times that come nearly in order (groups
    go by sequence number), which timsort takes in few merges: 0.22 s instead of
    0.60 (lexsort) or 0.67 (one stable sort of an int64 (rank, t0) key) at 5.1 M
    members, measured. The second permutation is composed in place.

    The same order as ``arrival_order(colls.m_rank, colls.m_t0_ns)[0]``, kept
    apart because member arrivals come nearly sorted (timsort's good case) while
    arrival_order packs and sorts from scratch: 0.018 s against 0.042 at 256 x
    10k (1.28 M members, CPU, 4 alternating runs each), measured."""
    n = len(colls.m_rank)
    if n == 0:
        return np.zeros(0, np.int64)
    if int(colls.m_rank.min()) < 0 or int(colls.m_rank.max()) >= 1 << 16:
        return np.lexsort((colls.m_t0_ns, colls.m_rank))
    by_t0 = np.argsort(colls.m_t0_ns, kind="stable")
    r16 = colls.m_rank.astype(np.uint16)[by_t0]
    order = np.argsort(r16, kind="stable")
    del r16
    # order[i] = by_t0[order[i]]: elementwise, each index read before its slot is written
    np.take(by_t0, order, out=order, mode="clip")
    return order


def by_rank_in_order(r: np.ndarray, t: np.ndarray, carry: np.ndarray) -> tuple[np.ndarray, ...] | None:
    """One block of events taken in order (their ranks ``r``, arrivals ``t``), regrouped by rank:
    ``(o, r[o], t[o], first, last)``, ``o`` the stable order by rank (a 16-bit radix sort of a
    block in cache where the ranks allow), ``first``/``last`` each rank's first and last event in
    it; or None when a rank's arrival goes back, within the block or against ``carry`` (indexed
    by rank: its last arrival in the blocks before, int64 min for none), which is moved on to
    this block's. The step of the walks by blocks with a per-rank carry that stand in for a
    run-wide sort by rank: :func:`_member_gaps_in_member_order`, ``replay._in_each_ranks_order``."""
    small = len(r) == 0 or (int(r.min()) >= 0 and int(r.max()) < 1 << 16)
    o = np.argsort(r.astype(np.uint16) if small else r, kind="stable")
    r_s, t_s = r[o], t[o].astype(np.int64, copy=False)
    first = np.ones(len(o), bool)
    np.not_equal(r_s[1:], r_s[:-1], out=first[1:])
    prev = np.empty_like(t_s)
    prev[1:] = t_s[:-1]
    prev[first] = carry[r_s[first]]
    if bool((t_s < prev).any()):
        return None
    last = np.ones(len(o), bool)
    last[:-1] = first[1:]
    carry[r_s[last]] = t_s[last]
    return o, r_s, t_s, first, last


def _member_gaps_in_member_order(run: Run, colls: Collectives, async_exits: bool = False) -> np.ndarray | None:
    """:func:`_member_gaps_ns` by blocks of whole groups in member order, or None when
    some rank's rows in member order do not come in arrival order.

    Member order is (comm, seq): on one communicator (or several that every rank
    goes through in the same time order) each rank's rows already come by
    arrival, so the (rank, arrival) order is the stable order by rank, which a
    block sorts locally (a 16-bit radix pass on block-sized columns in cache);
    each rank's running maximum of exits and last arrival carry from block to
    block. That skips :func:`rank_time_order` (two run-wide int64 permutations)
    and its gathers in rank order, which jump a group's length at every row.
    The order is checked as it goes (each arrival at least the rank's previous
    one; equal ones keep member order, as rank_time_order does); the first row
    out of order gives up, and the caller takes the global order.
    Measured at 1024 x 10k (5.1 M member rows): 0.72-0.87 -> 0.47-0.54 s of CPU,
    peak +20 -> +14 bytes per member row (8 of them the result; the rest
    block-sized, ~30 MB at any size)."""
    n = len(colls.m_rank)
    start, _ = run.rank_bounds()
    last_r = len(start) - 1
    n_rank = int(colls.m_rank.max()) + 1
    if int(colls.m_rank.min()) < 0 or n_rank > 1 << 16:
        return None
    rstart = start[np.minimum(np.arange(n_rank), last_r)].astype(np.int64)
    none = np.iinfo(np.int64).min
    carry_x = np.full(n_rank, none, np.int64)  # per rank: the latest exit so far (none: no exit yet)
    carry_t0 = np.full(n_rank, none, np.int64)  # per rank: its last arrival so far
    gap = np.empty(n, np.int64)
    for _g_lo, _g_hi, a, b in group_blocks(colls, _GAP_ROWS // 2):  # per block of ~131,072 member rows
        got = by_rank_in_order(colls.m_rank[a:b], colls.m_t0_ns[a:b], carry_t0)
        if got is None:
            return None  # a rank's rows out of arrival order: the global order it is
        o, r_s, t0, first, last = got
        x = colls.m_t1_ns[a:b][o]
        x = np.where(x < 0, t0, x)  # the exit, the arrival while in flight
        if not async_exits:
            x[colls.m_kind[a:b][o] != Kind.COLL] = none  # non-blocking posts do not end the rank's work
        seed = carry_x[r_s[first]]
        # each rank's running maximum over the block, seeded with its carry: values
        # relative to the block's smallest (1 and up; 0 for no exit), shifted into
        # disjoint bands per rank so one accumulate serves all
        base = int(t0.min())
        for v in (x, seed):  # two
            real = v[v != none]
            if len(real):
                base = min(base, int(real.min()))
        rel = np.where(x == none, 0, x - (base - 1))
        rel_seed = np.where(seed == none, 0, seed - (base - 1))
        span = max(int(rel.max()), int(rel_seed.max())) + 1
        if span * len(seed) >= 1 << 62:
            return None  # the bands would overflow int64 (a run of years)
        band = np.cumsum(first, dtype=np.int64)
        band -= 1
        band *= span
        rel += band
        rel[first] = np.maximum(rel[first], rel_seed + band[first])
        np.maximum.accumulate(rel, out=rel)
        rel -= band
        del band
        # the latest exit before each row: the running maximum one row up, the carry at a rank's first
        prev = np.empty_like(rel)
        prev[1:] = rel[:-1]
        prev[first] = rel_seed
        prev_exit = np.where(prev == 0, none, prev + (base - 1))
        np.maximum(prev_exit, rstart[r_s], out=prev_exit)
        t0 -= prev_exit
        np.maximum(t0, 0, out=t0)
        gap[a + o] = t0
        carry_x[r_s[last]] = np.where(rel[last] == 0, none, rel[last] + (base - 1))
    return gap


def _member_gaps_ns(run: Run, colls: Collectives, async_exits: bool = False) -> np.ndarray:
    """See :func:`member_gaps_ns`. The rows are taken in (rank, arrival) order by blocks
    of ``_GAP_ROWS``: every temporary is block-sized (one full-size pass held ~50
    bytes per collective row at once, the straggler detector's peak, measured); the
    running maximum and the previous row carry over from one block to the next.

    First tried without that order: :func:`_member_gaps_in_member_order`."""
    n = len(colls.m_rank)
    if n == 0:
        return np.zeros(0, np.int64)
    fast = _member_gaps_in_member_order(run, colls, async_exits)
    if fast is not None:
        return fast
    start, _ = run.rank_bounds()
    last_r = len(start) - 1
    # Bounds of the banded exits: over all rows, in any order (block by block).
    lo, hi = np.iinfo(np.int64).max, np.iinfo(np.int64).min
    for a in range(0, n, _GAP_ROWS):  # per block of member rows
        t0 = colls.m_t0_ns[a : a + _GAP_ROWS]
        x = colls.m_t1_ns[a : a + _GAP_ROWS]
        x = np.where(x < 0, t0, x)  # the exit, the arrival while in flight
        rs = start[np.minimum(colls.m_rank[a : a + _GAP_ROWS], last_r)]
        lo = min(lo, int(t0.min()), int(x.min()), int(rs.min()))
        hi = max(hi, int(t0.max()), int(x.max()))
    span = hi - lo + 2
    order = rank_time_order(colls)
    gap = np.empty(n, np.int64)
    carry_x = carry_r = 0
    for a in range(0, n, _GAP_ROWS):  # per block of rows in (rank, arrival) order
        o = order[a : a + _GAP_ROWS]
        r_s = colls.m_rank[o]  # int32
        rstart = start[np.minimum(r_s, last_r)]
        t0_s = colls.m_t0_ns[o].astype(np.int64)
        x = colls.m_t1_ns[o].astype(np.int64)
        open_ = x < 0
        x[open_] = t0_s[open_]
        # running max of exits within each rank: shift ranks into disjoint bands
        band = r_s.astype(np.int64)
        band *= span
        # exits of blocking rows only; non-blocking posts do not end the rank's work
        x -= lo
        x += band
        if not async_exits:
            nb = colls.m_kind[o] != Kind.COLL
            x[nb] = band[nb]
        np.maximum.accumulate(x, out=x)
        if a:
            np.maximum(x, carry_x, out=x)  # the running max goes on across the block edge
        # row i > 0: the latest exit before it (x[i - 1]) when one of its own rank is there
        if a == 0:
            prev_x, prev_r, rows = x[:-1], r_s[:-1], slice(1, None)
        else:
            prev_x, prev_r, rows = np.r_[carry_x, x[:-1]], np.r_[carry_r, r_s[:-1]], slice(0, None)
        pe = prev_x - band[rows]
        none = (pe <= 0) | (r_s[rows] != prev_r)
        pe += lo
        np.maximum(pe, rstart[rows], out=pe)
        pe[none] = rstart[rows][none]
        # the gap: arrival minus the previous exit (the rank's start for its first row), at least 0
        if a == 0:
            t0_s[0] -= rstart[0]
        t0_s[rows] -= pe
        np.maximum(t0_s, 0, out=t0_s)
        gap[o] = t0_s
        carry_x, carry_r = int(x[-1]), int(r_s[-1])
    return gap
