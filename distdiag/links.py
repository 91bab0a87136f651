"""Link bandwidth: which pair of nodes moves bytes slowly, measured three ways.

1. **Probe** (``distdiag-wrap --probe-links``, :mod:`distdiag.shim.probe`):
   ``Kind.PROBE`` rows named "probe_bw" are symmetric exchanges of a known size
   between two ranks; bandwidth = bytes each way / duration. Per pair the
   *fastest* of its steps of at least ``MIN_BW_BYTES`` counts: on busy shared
   cores noise only ever slows a transfer down, never speeds it up, and small
   steps are dominated by latency. "probe_lat" rows give the best round trip.
2. **Point-to-point** (passive): every send matched with its receive by
   (communicator, source, destination, n-th message), MPI's non-overtaking
   order. The transfer runs from the moment both sides were in the call
   (``max(send.t0, recv.t0)``) to the receive's return; bandwidth = bytes /
   that. Only messages of at least ``MIN_BW_BYTES`` make a matrix entry (an
   8-byte message measures latency, not bandwidth).
3. **Collectives** (passive): per matched collective, the transfer phase is the
   time after its last member arrived (median member exit minus last arrival):
   before that everyone waited for a rank, after it for the network. Bus
   bandwidth = bus bytes / transfer phase, where bus bytes is what each rank
   moves over its link in a ring: all-reduce ``2(n-1)/n * S``, all-gather
   ``(n-1) * s`` (``s`` = each rank's piece), reduce-scatter and all-to-all
   ``(n-1)/n * S``, broadcast / reduce ``S`` (NCCL-tests' convention). A
   collective that is slow in its transfer phase while everyone arrived on
   time points at the network, not at a rank.

Units: hosts when the run spans more than one host (links are node pairs);
else ranks (links are rank pairs on one node), labelled ``rank N``.

Everything is vectorized over events; the matrices are units x units (small).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from distdiag.intervals import union_length
from distdiag.match import Collectives, MatchState, collectives_of
from distdiag.rows import events_of, rows_of
from distdiag.run import Run
from distdiag.schema import Kind

log = logging.getLogger(__name__)

#: transfers smaller than this measure latency, not bandwidth
MIN_BW_BYTES = 64 << 10

#: bus bytes per byte of the recorded nbytes, as a function of the group size n
_ALLREDUCE = ("allreduce", "all_reduce", "iallreduce", "ddp_bucket_allreduce", "all_reduce_coalesced")
_ALLGATHER = ("allgather", "all_gather", "iallgather", "all_gather_into_tensor", "_all_gather_base", "allgatherv")
_REDSCAT = ("reduce_scatter", "reduce_scatter_block", "ireduce_scatter_block", "reduce_scatter_tensor",
            "_reduce_scatter_base", "ireduce_scatter")  # fmt: skip
_ALLTOALL = ("alltoall", "all_to_all", "all_to_all_single", "ialltoall", "alltoallv")
_ZERO = ("barrier", "ibarrier", "monitored_barrier")


def bus_factor(op: str, n: int) -> float:
    """Bytes each rank moves over its link per recorded byte, for a ring of n ranks."""
    o = op.lower()
    if n < 2 or o in _ZERO:
        return 0.0
    if o in _ALLREDUCE:
        return 2.0 * (n - 1) / n
    if o in _ALLGATHER:
        return float(n - 1)
    if o in _REDSCAT or o in _ALLTOALL:
        return (n - 1) / n
    return 1.0  # broadcast, reduce, gather, scatter, scan: the payload crosses once


@dataclass
class Units:
    """The endpoints links connect: hosts, or ranks when there is one host."""

    kind: str  # "host" | "rank"
    names: list[str]
    #: rank -> unit index (-1 for ranks without a file)
    of_rank: np.ndarray

    def __len__(self) -> int:
        return len(self.names)


def units_of(run: Run) -> Units:
    n = max(run.world_size, max(run.ranks, default=-1) + 1)
    of_rank = np.full(n, -1, np.int64)
    hosts = run.hosts
    if len(hosts) > 1:
        idx = {h: i for i, h in enumerate(hosts)}
        for r, info in run.ranks.items():  # one per rank
            of_rank[r] = idx[info.host]
        return Units("host", hosts, of_rank)
    ranks = sorted(run.ranks)
    for i, r in enumerate(ranks):
        of_rank[r] = i
    return Units("rank", [f"rank {r}" for r in ranks], of_rank)


@dataclass
class LinkMatrix:
    """Symmetric unit x unit measurements; NaN where a pair was not measured."""

    units: Units
    source: str  # "probe" | "p2p"
    bw_bytes_per_s: np.ndarray  # [u, u]
    latency_s: np.ndarray  # [u, u] best round trip (probe only; NaN otherwise)
    samples: np.ndarray  # [u, u] transfers that made the entry
    extra: dict[str, Any] = field(default_factory=dict)

    def pairs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(i, j, bw) of every measured unordered pair i < j."""
        i, j = np.triu_indices(len(self.units), 1)
        bw = self.bw_bytes_per_s[i, j]
        ok = np.isfinite(bw)
        return i[ok], j[ok], bw[ok]

    def to_json(self) -> dict[str, Any]:
        def mat(a: np.ndarray, scale: float, nd: int) -> list[list[float | None]]:
            return [[None if not np.isfinite(v) else round(float(v) * scale, nd) for v in row] for row in a]

        return {
            "source": self.source,
            "unit": self.units.kind,
            "units": list(self.units.names),
            "bw_MB_per_s": mat(self.bw_bytes_per_s, 1e-6, 2),
            "latency_us": mat(self.latency_s, 1e6, 1),
            "samples": self.samples.astype(int).tolist(),
            **self.extra,
        }


def _symmetric_fill(n: int, key_i: np.ndarray, key_j: np.ndarray, vals: np.ndarray, how: str) -> tuple[np.ndarray, np.ndarray]:
    """Reduce ``vals`` per unordered pair (max or min) into an n x n matrix (NaN = none)."""
    out = np.full((n, n), np.nan)
    cnt = np.zeros((n, n), np.int64)
    if len(vals) == 0:
        return out, cnt
    a, b = np.minimum(key_i, key_j), np.maximum(key_i, key_j)
    flat = a * n + b
    init = -np.inf if how == "max" else np.inf
    acc_flat = np.full(n * n, init)
    (np.maximum if how == "max" else np.minimum).at(acc_flat, flat, vals)
    acc = acc_flat.reshape(n, n)
    c = np.bincount(flat, minlength=n * n).reshape(n, n)
    seen = c > 0
    out[seen] = acc[seen]
    out = np.where(np.isfinite(out), out, np.nan)
    out = np.fmin(out, out.T)  # fill the lower triangle from the upper one
    cnt = c + c.T
    return out, cnt


def probe_matrix(run: Run) -> LinkMatrix | None:
    """The probe's measurements as a unit x unit matrix, or None without probe rows."""
    ev = events_of(run, Kind.PROBE)  # the run's kind index (distdiag.rows), not a scan
    if len(ev) == 0:
        return None
    span_id = run.sid("probe")
    span = ev[ev["name_id"] == span_id] if span_id >= 0 else ev[:0]
    units = units_of(run)
    n = len(units)
    peer_ok = (ev["peer"] >= 0) & (ev["peer"] < len(units.of_rank))
    ev = ev[peer_ok]
    ui = units.of_rank[ev["rank"]]
    uj = units.of_rank[ev["peer"]]
    ok = (ui >= 0) & (uj >= 0) & (ui != uj)
    ev, ui, uj = ev[ok], ui[ok], uj[ok]
    dur_s = np.maximum(ev["t1_ns"] - ev["t0_ns"], 1) / 1e9
    bw_id, lat_id = run.sid("probe_bw"), run.sid("probe_lat")
    is_bw = ev["name_id"] == bw_id
    big = is_bw & (ev["nbytes"] >= MIN_BW_BYTES)
    # a pair only measured with small steps (a very slow link) still gets an entry
    small_only = is_bw & ~big
    bw = ev["nbytes"] / dur_s
    m_big, c_big = _symmetric_fill(n, ui[big], uj[big], bw[big], "max")
    m_small, c_small = _symmetric_fill(n, ui[small_only], uj[small_only], bw[small_only], "max")
    bw_m = np.where(np.isfinite(m_big), m_big, m_small)
    is_lat = ev["name_id"] == lat_id
    lat_m, _ = _symmetric_fill(n, ui[is_lat], uj[is_lat], dur_s[is_lat], "min")
    extra = {}
    if len(span):
        extra["probe_s"] = round(float(np.max(span["t1_ns"] - span["t0_ns"])) / 1e9, 3)
        extra["probe_rounds"] = int(span["aux"].max())
    return LinkMatrix(units, "probe", bw_m, lat_m, c_big + c_small, extra)


def p2p_transfers(run: Run) -> dict[str, np.ndarray]:
    """Matched point-to-point transfers (columns src, dst, nbytes, t0_ns, t1_ns, xfer_s, and the
    ``run.events`` rows of each side: send_row, recv_row).

    Sends and receives pair up by (communicator, source, destination, n-th
    message between them): MPI and gloo deliver messages between one pair in
    order. ``peer`` is taken as a global rank (true for torch.distributed and
    for MPI's COMM_WORLD). Cached on the run.
    """
    got = run.cache.p2p_transfers
    if got is not None:
        return got
    ev = run.events
    peer = ev["peer"]
    # row indices, not row copies: selecting whole packed rows is the slow part;
    # the rows of each side from the run's kind index (distdiag.rows), ascending. A column is
    # gathered by fancy indexing, not take: take copies the (strided) column whole before it
    # gathers (benchmarks/NOTES.md, "Gathering a column of the table")
    si = rows_of(run, (Kind.SEND, Kind.SEND_ASYNC))
    si = si[(peer[si] >= 0) & (ev["t1_ns"][si] >= ev["t0_ns"][si])]
    ri = rows_of(run, (Kind.RECV, Kind.RECV_ASYNC))
    ri = ri[(peer[ri] >= 0) & (ev["t1_ns"][ri] >= ev["t0_ns"][ri])]
    out: dict[str, np.ndarray] = {k: np.zeros(0, np.int64) for k in ("src", "dst", "nbytes", "t0_ns", "t1_ns",
                                                                       "send_row", "recv_row")}  # fmt: skip
    out["xfer_s"] = np.zeros(0)
    if len(si) and len(ri):
        both = np.concatenate([si, ri])
        rank = ev["rank"][both].astype(np.int64)
        other = peer[both].astype(np.int64)
        # one table of both sides: (comm, src, dst, t0, side); side 0 = send, 1 = receive
        side = np.r_[np.zeros(len(si), np.int64), np.ones(len(ri), np.int64)]
        is_send = side == 0
        comm = ev["comm_id"][both].astype(np.int64)
        src = np.where(is_send, rank, other)
        dst = np.where(is_send, other, rank)
        t0 = ev["t0_ns"][both]
        rb = max(int(src.max()), int(dst.max()), 1).bit_length()
        if comm.max() < (1 << max(0, 61 - 2 * rb)):
            # (comm, src, dst) packed into one int64 (with the side as its last bit)
            pk = (comm << (2 * rb)) | (src << rb) | dst
            # run.events is sorted by (rank, t0) and every (comm, src, dst, side)
            # run belongs to one rank (src of sends, dst of receives), so a
            # stable sort on the packed key alone leaves each run in time order
            in_order = all(
                bool(np.all((np.diff(rank[sl]) > 0) | (np.diff(t0[sl]) >= 0)))
                for sl in (slice(0, len(si)), slice(len(si), None))
            )
            key = pk * 2 + side
            order = np.argsort(key, kind="stable") if in_order else np.lexsort((t0, key))
        else:
            order = np.lexsort((t0, side, dst, src, comm))
            pk = np.unique(np.stack([comm, src, dst]), axis=1, return_inverse=True)[1].ravel()
        pk, side_o = pk[order], side[order]
        # n-th message of its (comm, src, dst, side) run = position minus the run's start
        newpair = np.r_[True, pk[1:] != pk[:-1]]
        new = newpair | np.r_[True, side_o[1:] != side_o[:-1]]
        run_start = np.maximum.accumulate(np.where(new, np.arange(len(new)), 0))
        nth = np.arange(len(new)) - run_start
        # pair id: the same for the send and receive runs of one (comm, src, dst)
        pair = np.cumsum(newpair) - 1
        mkey = pair * (int(nth.max()) + 1) + nth
        o_s = side_o == 0
        _, a, b = np.intersect1d(mkey[o_s], mkey[~o_s], assume_unique=True, return_indices=True)
        ms = both[order[o_s][a]]  # event rows of the matched sends
        mr = both[order[~o_s][b]]  # and of their receives
        t0_all, t1_all, nb_all = ev["t0_ns"], ev["t1_ns"], ev["nbytes"]
        start_ns = np.maximum(t0_all[ms], t0_all[mr])
        end_ns = t1_all[mr]
        out = {
            "src": ev["rank"][ms].astype(np.int64),
            "dst": ev["rank"][mr].astype(np.int64),
            "nbytes": np.maximum(nb_all[ms], nb_all[mr]).astype(np.int64),
            "t0_ns": start_ns.astype(np.int64),
            "t1_ns": end_ns.astype(np.int64),
            "xfer_s": np.maximum(end_ns - start_ns, 1) / 1e9,
            "send_row": ms.astype(np.int64),
            "recv_row": mr.astype(np.int64),
        }
    run.cache.p2p_transfers = out
    return out


#: how far past a WAIT row's end a request's completion may be stamped and still be that wait's
#: (the completion is stamped just after the wait returns)
WAIT_SLACK_NS = 1_000_000


def p2p_waits(run: Run) -> tuple[np.ndarray, np.ndarray]:
    """Per matched transfer (:func:`p2p_transfers`): the ``run.events`` row of the ``WAIT`` that holds
    its receive's completion (an ``Irecv`` completed in ``Wait``/``Waitall``) and of the one that
    holds its send's (an ``Isend``'s); -1 where the side is blocking or no wait holds it. A request
    posted at p and completed at c is held by its rank's WAIT row [w0, w1] with p <= w0 <= c <=
    w1 + :data:`WAIT_SLACK_NS`. Cached on the run."""
    got = run.cache.p2p_waits
    if got is not None:
        return got
    tr = p2p_transfers(run)
    ev = run.events
    out = []
    w_rows = rows_of(run, (Kind.WAIT,))  # their columns, read once for both sides
    r_w = ev["rank"][w_rows].astype(np.int64)
    w0 = ev["t0_ns"][w_rows].astype(np.int64, copy=False)
    w1 = np.maximum(ev["t1_ns"][w_rows], w0) + WAIT_SLACK_NS
    for col, kind in (("recv_row", Kind.RECV_ASYNC), ("send_row", Kind.SEND_ASYNC)):
        rows = tr[col]
        hold = np.full(len(rows), -1, np.int64)
        mine = np.flatnonzero(ev["kind"][rows] == kind) if len(rows) else rows
        if len(mine) and len(w_rows):
            q = rows[mine]
            r_q = ev["rank"][q].astype(np.int64)
            p_q = ev["t0_ns"][q].astype(np.int64, copy=False)
            c_q = np.maximum(ev["t1_ns"][q], p_q)
            lo = int(min(w0.min(), p_q.min()))
            span = int(max(w1.max(), c_q.max())) - lo + 1
            if int(max(r_w.max(), r_q.max())) + 1 < np.iinfo(np.int64).max // span - 1:
                key = r_w * span + (w1 - lo)  # by (rank, end): the first ending at or after c
                o = np.argsort(key, kind="stable")
                j = np.searchsorted(key[o], r_q * span + (c_q - lo))
                jj = o[np.minimum(j, len(o) - 1)]
                hit = (j < len(o)) & (r_w[jj] == r_q) & (w0[jj] <= c_q) & (w0[jj] >= p_q)
                hold[mine[hit]] = w_rows[jj[hit]]
        out.append(hold)
    got = (out[0], out[1])
    run.cache.p2p_waits = got
    return got


def p2p_matrix(run: Run, tr: dict[str, np.ndarray] | None = None) -> LinkMatrix | None:
    """Effective bandwidth per unit pair from large matched transfers (bytes / time, both directions)."""
    tr = p2p_transfers(run) if tr is None else tr
    big = tr["nbytes"] >= MIN_BW_BYTES
    if not big.any():
        return None
    units = units_of(run)
    n = len(units)
    ui = units.of_rank[np.clip(tr["src"][big], 0, len(units.of_rank) - 1)]
    uj = units.of_rank[np.clip(tr["dst"][big], 0, len(units.of_rank) - 1)]
    ok = (ui >= 0) & (uj >= 0) & (ui != uj)
    if not ok.any():
        return None
    ui, uj = ui[ok], uj[ok]
    a, b = np.minimum(ui, uj), np.maximum(ui, uj)
    flat = a * n + b
    nbytes = np.bincount(flat, weights=tr["nbytes"][big][ok], minlength=n * n).reshape(n, n)
    secs = np.bincount(flat, weights=tr["xfer_s"][big][ok], minlength=n * n).reshape(n, n)
    cnt = np.bincount(flat, minlength=n * n).reshape(n, n)
    with np.errstate(invalid="ignore", divide="ignore"):
        bw = np.where(cnt > 0, nbytes / secs, np.nan)
    bw = np.fmin(bw, bw.T)
    return LinkMatrix(units, "p2p", bw, np.full((n, n), np.nan), cnt + cnt.T)


def link_matrix(run: Run) -> LinkMatrix | None:
    """The best available matrix: the probe's, else the passive point-to-point one."""
    return probe_matrix(run) or p2p_matrix(run)


@dataclass
class CollectiveTransfers:
    """One row per complete collective group with at least two members."""

    group: np.ndarray  # index into Collectives
    op: np.ndarray  # string id
    n_members: np.ndarray
    nbytes: np.ndarray  # max member nbytes
    bus_bytes: np.ndarray  # float
    last_arrival_ns: np.ndarray
    arrival_spread_s: np.ndarray  # last minus first arrival
    transfer_s: np.ndarray  # median member exit minus last arrival, >= 0
    bus_bw_bytes_per_s: np.ndarray  # NaN when bus_bytes == 0
    kind: np.ndarray  # u1: COLL or COLL_ASYNC

    def __len__(self) -> int:
        return len(self.group)


def collective_transfers(run: Run, colls: Collectives | None = None) -> CollectiveTransfers:
    colls = collectives_of(run) if colls is None else colls
    ok = (colls.g_state == MatchState.COMPLETE) & (colls.g_n_members >= 2)
    g = np.flatnonzero(ok)
    # median member exit per group: members sorted by exit within their group
    order = np.lexsort((colls.m_t1_ns, colls.m_group))
    t1_sorted = colls.m_t1_ns[order]
    mid = colls.g_start[:-1] + (colls.g_start[1:] - colls.g_start[:-1]) // 2
    med_exit = t1_sorted[np.minimum(mid, max(len(t1_sorted) - 1, 0))] if len(t1_sorted) else np.zeros(0, np.int64)
    nb_max = colls.m_nbytes.group_max()  # per group, from its value and exceptions
    kind_first = colls.m_kind[colls.g_start[:-1]] if len(colls.m_kind) else np.zeros(0, np.uint8)
    nm = colls.g_n_members[g].astype(np.int64)
    ops = colls.g_op[g]
    # bus factor per (op, n): few distinct pairs, computed once each
    factor = np.zeros(len(g))
    if len(g):
        pairs, inv = np.unique(np.stack([ops.astype(np.int64), nm]), axis=1, return_inverse=True)
        f = np.array([bus_factor(run.s(int(o)), int(k)) for o, k in pairs.T])  # distinct (op, n): a handful
        factor = f[inv.ravel()]
    bus = nb_max[g] * factor
    transfer_s = np.maximum(med_exit[g] - colls.g_last_ns[g], 0) / 1e9
    with np.errstate(invalid="ignore", divide="ignore"):
        bw = np.where((bus > 0) & (transfer_s > 0), bus / np.maximum(transfer_s, 1e-12), np.nan)
    return CollectiveTransfers(
        group=g,
        op=ops,
        n_members=nm,
        nbytes=nb_max[g],
        bus_bytes=bus,
        last_arrival_ns=colls.g_last_ns[g],
        arrival_spread_s=(colls.g_last_ns[g] - colls.g_first_ns[g]) / 1e9,
        transfer_s=transfer_s,
        bus_bw_bytes_per_s=bw,
        kind=kind_first[g] if len(kind_first) else np.zeros(0, np.uint8),
    )


def group_unit_mask(colls: Collectives, groups: np.ndarray, rank_in: np.ndarray) -> np.ndarray:
    """Per group in ``groups``: does any member satisfy ``rank_in`` (a bool array over ranks)?"""
    if len(groups) == 0:
        return np.zeros(0, bool)
    r = colls.m_rank.astype(np.int64)
    hit = np.zeros(len(r), bool)
    inside = r < len(rank_in)
    hit[inside] = rank_in[r[inside]]
    per_group = np.logical_or.reduceat(hit, colls.g_start[:-1]) if len(hit) else np.zeros(0, bool)
    out: np.ndarray = per_group[groups]
    return out


def union_s(t0_ns: np.ndarray, t1_ns: np.ndarray) -> float:
    """Length of the union of intervals, in seconds (network_bound, slow_link)."""
    return union_length(t0_ns, t1_ns) / 1e9


#: a collective is network-bound when its transfer phase is this many times
#: longer than the spread of its arrivals (everyone was there; the bytes were not)
NETWORK_BOUND_RATIO = 4.0


def tail_ns(colls: Collectives) -> np.ndarray:
    """Per group: its last member's exit minus its last arrival (ns; negative where a member is
    still inside): the transfer at its longest, in one pass over the member rows, no sort (the
    cheap bound before :func:`collective_transfers`, whose transfer ends at the median exit)."""
    if len(colls.m_t1_ns) == 0:
        return np.zeros(len(colls), np.int64)
    at = np.minimum(colls.g_start[:-1], len(colls.m_t1_ns) - 1)
    out: np.ndarray = np.maximum.reduceat(colls.m_t1_ns, at) - colls.g_last_ns
    return out


#: a collective moving at most this many bytes a member is small: its time is per-call latency on
#: any fabric (NCCL's and MPI's small-message protocols run up to tens of KiB)
SMALL_BYTES = 64 << 10
#: a small collective following its previous one within this much of a member's work is "back to back"
BACK_TO_BACK_NS = 1_000_000


def small_limits(cfg: Any) -> tuple[int, int]:
    """``[analyze.small_collectives]`` ``max_bytes`` and ``max_gap_us`` (in ns): what makes a
    collective small and its calls back to back (small_collectives', network_bound's and the
    coverage line's one definition)."""
    return (int(cfg.value("small_collectives", "max_bytes", SMALL_BYTES)),
            int(float(cfg.value("small_collectives", "max_gap_us", BACK_TO_BACK_NS / 1e3)) * 1e3))  # fmt: skip


@dataclass(frozen=True)
class SmallBursts:
    """Small collectives called back to back (:func:`small_bursts`), per group: ``fused`` (the
    calls that follow their communicator's previous one of the same op directly: fused into it),
    ``cut`` (the calls whose transfer the fused counterfactual takes away: the fused ones, and the
    first call of a non-blocking burst, whose completion is seen only where the ranks wait for the
    whole burst) and ``tail`` (last arrival to last exit, ns, >= 0)."""

    fused: np.ndarray
    cut: np.ndarray
    tail: np.ndarray


def small_bursts(run: Run, colls: Collectives, max_bytes: int, max_gap_ns: int) -> SmallBursts:
    """Which collectives are small ones called back to back: complete, of two or more members, at
    most ``max_bytes`` a member, repeating their communicator's previous collective's op, and no
    member worked longer than ``max_gap_ns`` since its previous collective's exit or completion
    (:func:`distdiag.match.member_gaps_ns`), nor longer than the call itself took (last arrival
    to last exit): nothing but the loop stands between the calls, and they could be one.
    Blocking or not: ``Iallreduce(...).Wait()`` one by one, or 2,000 ``Iallreduce`` then one
    ``Waitall``, cost a call's latency each like blocking ones (measured: 0.92 and 3.11 s against
    0.21 s for the same bytes in one call a step)."""
    from distdiag.match import member_gaps_ns

    n = len(colls)
    none = np.zeros(n, bool)
    if n == 0 or len(colls.m_t1_ns) == 0:
        return SmallBursts(none, none, np.zeros(n, np.int64))
    gs = colls.g_start
    sizes = np.diff(gs)
    first = np.minimum(gs[:-1], len(colls.m_t1_ns) - 1)
    kind = colls.m_kind[first]  # a group's members share their kind
    is_async = (sizes > 0) & (kind == Kind.COLL_ASYNC)
    ok = (colls.g_state == MatchState.COMPLETE) & (colls.g_n_members >= 2) & (((sizes > 0) & (kind == Kind.COLL)) | is_async)
    ok &= colls.m_nbytes.group_max() <= max_bytes
    tail = np.maximum(tail_ns(colls), 0)
    if not ok.any():
        return SmallBursts(none, none, tail)
    # one pass per block of the run-wide gaps: the largest member's work before each group
    gap = np.maximum.reduceat(np.asarray(member_gaps_ns(run, colls, async_exits=True)), first)
    # the same call again: the communicator's previous collective (groups are in (comm, seq) order)
    # was of the same op (an all-reduce after a bcast is no burst of one thing to fuse)
    same = np.zeros(n, bool)
    same[1:] = (colls.g_comm[1:] == colls.g_comm[:-1]) & (colls.g_op[1:] == colls.g_op[:-1])
    fused = ok & same & (gap <= max_gap_ns) & (gap <= tail)
    head = np.zeros(n, bool)  # a non-blocking burst's first call, whose next call is fused into it
    head[:-1] = is_async[:-1] & ok[:-1] & ~fused[:-1] & fused[1:] & same[1:]
    return SmallBursts(fused, fused | head, tail)


def network_bound(ct: CollectiveTransfers, min_transfer_s: float = 1e-3) -> np.ndarray:
    """Per collective: transfer phase long while every rank arrived on time.

    A non-blocking collective (DDP's gradient buckets) is exempt from the arrival-spread test:
    nobody waits at its launch, so a spread of launches (the ranks' backward passes a few ms
    apart, more beside a loaded core) is no late rank, and the transfer after the last launch
    is the network's all the same. (Seen: a throttled 4-node DDP job beside a busy core had 4 of
    its 10 bucket all-reduces at 264-310 ms transfers after launches 75-97 ms apart, ratio 2.9-3.7,
    left out: network_bound priced 1.78 s against 2.88 s of transfers.)"""
    spread_ok = (ct.transfer_s > NETWORK_BOUND_RATIO * ct.arrival_spread_s) | (ct.kind == Kind.COLL_ASYNC)
    ok: np.ndarray = (ct.transfer_s >= min_transfer_s) & spread_ok
    return ok


def transfer_summary(run: Run, colls: Collectives | None = None) -> Any:
    """Per (communicator, op): count, bytes, transfer and wait time, bus bandwidth,
    and the share of network-bound collectives, as a pandas DataFrame (for notebooks)."""
    import pandas as pd

    colls = collectives_of(run) if colls is None else colls
    ct = collective_transfers(run, colls)
    st = np.asarray(run.strings, dtype=object)
    df = pd.DataFrame(
        {
            "comm": st[colls.g_comm[ct.group]] if len(ct) else [],
            "op": st[ct.op] if len(ct) else [],
            "n_ranks": ct.n_members,
            "nbytes": ct.nbytes,
            "bus_bytes": ct.bus_bytes,
            "transfer_s": ct.transfer_s,
            "arrival_spread_s": ct.arrival_spread_s,
            "network_bound": network_bound(ct),
        }
    )
    if df.empty:
        return df
    g = df.groupby(["comm", "op"], sort=False)
    out = g.agg(
        count=("transfer_s", "size"),
        n_ranks=("n_ranks", "max"),
        bus_bytes=("bus_bytes", "sum"),
        transfer_s=("transfer_s", "sum"),
        arrival_spread_s=("arrival_spread_s", "sum"),
        network_bound_share=("network_bound", "mean"),
    ).reset_index()
    with np.errstate(invalid="ignore", divide="ignore"):
        out["bus_bw_MB_per_s"] = np.where(out["transfer_s"] > 0, out["bus_bytes"] / out["transfer_s"] / 1e6, np.nan)
    return out.sort_values("transfer_s", ascending=False, kind="stable").reset_index(drop=True)
