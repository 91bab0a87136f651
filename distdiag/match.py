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
``m_*[g_start[g]:g_start[g+1]]`` sorted by arrival.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from distdiag.run import Run
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
    m_group: np.ndarray  # i8
    m_rank: np.ndarray  # i4
    m_t0_ns: np.ndarray  # i8 arrival
    m_t1_ns: np.ndarray  # i8 exit, -1 when still inside (in flight)
    m_op: np.ndarray  # i4
    m_nbytes: np.ndarray  # i8
    m_peer: np.ndarray  # i4 root for rooted collectives
    m_site: np.ndarray  # i4
    m_kind: np.ndarray  # u1
    #: comm key id -> sorted member ranks
    comm_members: dict[int, np.ndarray]
    strings: np.ndarray
    #: i8 per member: ``aux`` of its row (the datatype's string id); None when not gathered
    m_aux: np.ndarray | None = None
    #: rows dropped because they repeated a (comm, seq, rank) (damaged files only)
    n_dup: int = 0

    def __len__(self) -> int:
        return len(self.g_seq)

    @property
    def complete(self) -> np.ndarray:
        return self.g_state == MatchState.COMPLETE

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
    return Collectives(
        g_comm=z.astype(np.int32), g_seq=z, g_op=z.astype(np.int32), g_state=z.astype(np.int8),
        g_n_members=z.astype(np.int32), g_n_expected=z.astype(np.int32), g_first_ns=z, g_last_ns=z,
        g_second_ns=z, g_last_rank=z.astype(np.int32), g_exit_ns=z, g_start=np.zeros(1, np.int64),
        m_group=z, m_rank=z.astype(np.int32), m_t0_ns=z, m_t1_ns=z, m_op=z.astype(np.int32), m_nbytes=z,
        m_peer=z.astype(np.int32), m_site=z.astype(np.int32), m_kind=z.astype(np.uint8),
        comm_members={}, strings=strings,
    )  # fmt: skip


#: The event fields match_collectives reads.
_MATCH_FIELDS = ("t0_ns", "t1_ns", "kind", "name_id", "comm_id", "seq", "peer", "nbytes", "site_id", "aux", "rank")
#: Rows per block of :func:`_gather` (4.7 MB of 73-byte rows: stays in cache).
_GATHER_ROWS = 1 << 16


def _gather(tab: np.ndarray, idx: np.ndarray, fields: tuple[str, ...]) -> dict[str, np.ndarray]:
    """``{f: tab[f][idx]}`` for every field, in one pass over the rows (blocks of whole rows)."""
    out = {f: np.empty(len(idx), tab.dtype[f]) for f in fields}
    for lo in range(0, len(idx), _GATHER_ROWS):  # per block of 65,536 rows
        sub = tab[idx[lo : lo + _GATHER_ROWS]]
        for f in fields:  # a dozen fields
            out[f][lo : lo + len(sub)] = sub[f]
    return out


def match_collectives(run: Run) -> Collectives:
    """Group every collective row (finished or in flight) by (comm key, seq).

    Memory: the working set is a few columns per collective row (~60 bytes),
    never a copy of the event table. The fields are gathered in one pass, then
    each is put in (group, arrival) order and its table-order copy dropped;
    the int64 keys are built in place and dropped once the order is known.
    """
    kinds = np.array(sorted(int(k) for k in COMM_KINDS), np.uint8)
    ev, inf = run.events, run.inflight
    sel_idx = np.flatnonzero(np.isin(ev["kind"], kinds) & (ev["seq"] >= 0))
    inf_idx = np.zeros(0, np.int64)
    if len(inf):
        inf_idx = np.flatnonzero(np.isin(inf["kind"], kinds) & (inf["seq"] >= 0))
    n_ev = len(sel_idx)
    n = n_ev + len(inf_idx)
    if n == 0:
        return _empty(run.strings)

    # Every field match needs, gathered in ONE pass over the selected rows in
    # blocks that stay in cache (a strided gather per field re-read each 73-byte
    # row once per field: 12 passes, 1.1 s of 1.8 at 2.6 M events, measured).
    got = _gather(ev, sel_idx, _MATCH_FIELDS)
    if len(inf_idx):
        got_inf = _gather(inf, inf_idx, _MATCH_FIELDS)
        got = {f: np.concatenate([got[f], got_inf[f]]) for f in _MATCH_FIELDS}

    def col(f: str, at: np.ndarray | None = None) -> np.ndarray:
        """Field ``f`` of the collective rows (events, then in-flight rows), in order ``at``;
        each field is taken once (its table-order copy is dropped)."""
        rows = got.pop(f)
        return rows if at is None else rows[at]

    t0_raw = col("t0_ns")
    rank = col("rank").astype(np.int64)
    n_rank = int(rank.max()) + 1
    # One int64 key per (comm, seq) and per (comm, seq, rank); comm ids index
    # the string table and seqs count calls, so the products stay far below 2^63.
    # (Damaged files can hold absurd seqs that overflow the keys: the grouping
    # is then wrong but consistent, and comm/seq are never decoded from a key.)
    comm = col("comm_id")
    seq = col("seq")
    n_seq = int(seq.max()) + 1
    gkey = comm.astype(np.int64)
    gkey *= n_seq
    gkey += seq
    rkey = gkey * n_rank
    rkey += rank

    # Order by (comm, seq), then arrival, then rank: two stable int64 sorts.
    order = np.argsort(t0_raw, kind="stable")
    order = order[np.argsort(gkey[order], kind="stable")]

    # A rank can appear twice in one (comm, seq) only through a damaged file or
    # a hook bug; keep its earliest row so every member counts once.
    srk = np.sort(rkey)
    n_dup = int(np.count_nonzero(srk[1:] == srk[:-1]))
    del srk
    if n_dup:
        run.warnings.append(f"{n_dup} collective rows repeat a (communicator, seq, rank): counted once")
        o2 = np.lexsort((t0_raw, rkey))
        first = np.r_[True, rkey[o2][1:] != rkey[o2][:-1]]
        keep = np.zeros(n, bool)
        keep[o2[first]] = True
        order = order[keep[order]]
    del rkey

    # Communicator membership: every rank that ever used the key.
    cr = np.unique(comm.astype(np.int64) * n_rank + rank)
    cr_comm, cr_rank = cr // n_rank, cr % n_rank
    comm_ids, cstart = np.unique(cr_comm, return_index=True)
    comm_members = {int(c): m.astype(np.int32) for c, m in zip(comm_ids, np.split(cr_rank, cstart[1:]))}
    comm_size = np.diff(np.append(cstart, len(cr)))

    gk = gkey[order]
    del gkey
    newg = np.r_[True, gk[1:] != gk[:-1]]
    gid = np.cumsum(newg) - 1
    starts = np.flatnonzero(newg)
    g_comm = comm[order[starts]].astype(np.int32)
    g_seq = seq[order[starts]].astype(np.int64)
    del gk, newg, comm, seq
    n_g = len(starts)
    g_start = np.append(starts, len(gid)).astype(np.int64)
    n_mem = np.diff(g_start).astype(np.int32)
    last_idx = g_start[1:] - 1
    second_idx = np.maximum(last_idx - 1, starts)
    n_exp = comm_size[np.searchsorted(comm_ids, g_comm)].astype(np.int32)
    rows = {f: col(f, order) for f in ("t1_ns", "kind", "name_id", "peer", "nbytes", "site_id", "aux")}
    rows["t0_ns"] = t0_raw[order]
    rows["rank"] = rank[order]
    del rank, order, t0_raw, got

    # Op: the most common name among members; mismatch when any member differs.
    op = rows["name_id"]
    op_min = np.minimum.reduceat(op, starts)
    op_max = np.maximum.reduceat(op, starts)
    op_mismatch = op_min != op_max
    g_op = op[starts].astype(np.int64)
    if op_mismatch.any():  # rare: only then pay for a per-group mode
        sel = op_mismatch[gid]
        g_op[op_mismatch] = _mode_per_group(op[sel], gid[sel], n_g)[op_mismatch]

    # Root: rooted collectives carry the root in peer (>= 0 on every member).
    peer = rows["peer"]
    rooted = np.maximum.reduceat(peer, starts) >= 0
    root_mismatch = rooted & (np.minimum.reduceat(peer, starts) != np.maximum.reduceat(peer, starts))

    # Size: only for ops that require equal counts on every member.
    checked_ids = np.array([run.sid(o) for o in SIZE_CHECKED_OPS if run.sid(o) >= 0], np.int64)
    nb = rows["nbytes"]
    size_mismatch = (
        np.isin(g_op, checked_ids)
        & (np.minimum.reduceat(nb, starts) != np.maximum.reduceat(nb, starts))
        & ~op_mismatch
    )

    t1 = rows["t1_ns"]
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
        g_first_ns=rows["t0_ns"][starts].astype(np.int64),
        g_last_ns=rows["t0_ns"][last_idx].astype(np.int64),
        g_second_ns=rows["t0_ns"][second_idx].astype(np.int64),
        g_last_rank=rows["rank"][last_idx].astype(np.int32),
        g_exit_ns=exit_ns.astype(np.int64),
        g_start=g_start,
        m_group=gid.astype(np.int64, copy=False),
        m_rank=rows["rank"].astype(np.int32),
        m_t0_ns=rows["t0_ns"].astype(np.int64, copy=False),
        m_t1_ns=t1.astype(np.int64, copy=False),
        m_op=op.astype(np.int32, copy=False),
        m_nbytes=nb.astype(np.int64, copy=False),
        m_peer=peer.astype(np.int32, copy=False),
        m_site=rows["site_id"].astype(np.int32, copy=False),
        m_kind=rows["kind"].astype(np.uint8, copy=False),
        comm_members=comm_members,
        strings=run.strings,
        m_aux=rows["aux"].astype(np.int64, copy=False),
        n_dup=n_dup,
    )


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
    c = run.cache.get("collectives")
    if c is None:
        c = match_collectives(run)
        run.cache["collectives"] = c
    # distdiag.clocks.align leaves its match here, with the warnings a match adds.
    run.warnings.extend(run.cache.pop("collectives_warnings", ()))
    return c  # type: ignore[no-any-return]


def member_gaps_ns(run: Any, colls: Collectives) -> np.ndarray:
    """Per member row: its own time since its previous blocking collective (or its start), in ns.

    Computed once per collectives table (straggler, serial_section and the
    ranking all read it) and kept in ``run.cache``; do not write into it.

    The rank's blocking collectives run one after another on its thread, so
    sorting its rows by arrival, the gap of a row is its arrival minus the
    latest exit among the rows before it (the running maximum, so an
    exit-less in-flight row never makes a gap negative).
    """
    hit = run.cache.get("member_gaps")
    if hit is not None and hit[0] is colls:
        return hit[1]  # type: ignore[no-any-return]
    gap = _member_gaps_ns(run, colls)
    gap.flags.writeable = False  # shared by every reader
    run.cache["member_gaps"] = (colls, gap)
    return gap


def _member_gaps_ns(run: Any, colls: Collectives) -> np.ndarray:
    n = len(colls.m_rank)
    if n == 0:
        return np.zeros(0, np.int64)
    # Few full-size temporaries (this runs on every collective row): work in the
    # sorted order, in place, and free each one once it is used.
    order = np.lexsort((colls.m_t0_ns, colls.m_rank))
    r_s = colls.m_rank[order]  # int32
    start, _ = run.rank_bounds()
    rstart = start[np.minimum(r_s, len(start) - 1)]
    t0_s = colls.m_t0_ns[order].astype(np.int64)
    x = colls.m_t1_ns[order].astype(np.int64)  # the exit, the arrival while in flight
    open_ = x < 0
    x[open_] = t0_s[open_]
    del open_
    # running max of exits within each rank: shift ranks into disjoint bands
    lo = int(min(t0_s.min(), x.min(), rstart.min()))
    span = int(max(t0_s.max(), x.max())) - lo + 2
    band = r_s.astype(np.int64)
    band *= span
    # exits of blocking rows only; non-blocking posts do not end the rank's work
    x -= lo
    x += band
    nb = colls.m_kind[order] != Kind.COLL
    x[nb] = band[nb]
    del nb
    np.maximum.accumulate(x, out=x)
    # row i > 0: the latest exit before it (x[i - 1]) when one of its own rank is there
    pe = x[:-1] - band[1:]
    del x, band
    none = (pe <= 0) | (r_s[1:] != r_s[:-1])
    pe += lo
    np.maximum(pe, rstart[1:], out=pe)
    pe[none] = rstart[1:][none]
    del none
    # the gap: arrival minus the previous exit (the rank's start for its first row), at least 0
    t0_s[0] -= rstart[0]
    t0_s[1:] -= pe
    del pe, rstart
    np.maximum(t0_s, 0, out=t0_s)
    gap = np.empty(n, np.int64)
    gap[order] = t0_s
    return gap
