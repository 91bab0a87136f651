"""network_bound: the job spends a large share of its wall-clock with every rank waiting
for the network to move a collective's bytes, and no other finding names why.

A slow link is found when a bandwidth per pair exists (``--probe-links``, or large
point-to-point transfers); without one, a job whose collectives are slow on every rank
alike showed no finding at all and read "healthy" (issue 20: a 4-rank DDP job with one
node's link throttled, 60% of its time in collective transfers). This detector says
which subsystem binds, so the report is never silent on it.

Which collectives: complete groups of two or more members whose transfer phase (last
arrival to the median member's exit) is at least ``NETWORK_BOUND_RATIO`` (4) times their
arrival spread (everyone was there; the bytes were not; a non-blocking one, DDP's buckets,
whatever its spread: nobody waits at its launch) and at least 1 ms, and that move
bytes. Their transfer windows are put on the aligned timeline and merged per member rank
(DDP's buckets in flight together count once): the most-held rank's union is the time the
job waited on the network (sub-communicators taking turns do not add up).

Cost: what the job would save were the transfers at the bandwidth the fabric delivers
(issue 20): each such collective's transfer at ``bus bytes / fabric bandwidth``, its
excess over that taken out, per rank the union of the excess windows. The fabric's
bandwidth comes from ``[analyze.network_bound] fabric_MB_per_s`` (the bus bandwidth one
rank's link delivers, as ``nccl-tests`` reports it), else from the link probe (the median
pair's bandwidth it measured); without either nothing tells the floor, and the price is
the network taking no time: an upper bound, stated as such. A job whose transfers run
at the fabric's bandwidth is not slowed by the network it has: no finding (the report's
coverage still says the collective transfers hold the run, to communicate less). The
evidence gives the bus bandwidth each (op, size) achieved, and the advice the command
that measures the links. The finding is reported from ``min_share`` (0.1) of the
wall-clock. When ``slow_link`` names a link, its seconds are this finding's first: the
ranking keeps only the rest here, reported while it is still ``min_share`` of the run
(:func:`distdiag.ranking.rank_findings`).

Settings (``[analyze.network_bound]``): ``min_share`` (0.1), ``top`` (5), ``fabric_MB_per_s`` (0: unknown).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from distdiag.analysis import Analysis
from distdiag.detectors import register
from distdiag.roles import Role
from distdiag.findings import Finding
from distdiag.intervals import union_length_by_key
from distdiag.links import collective_transfers, network_bound, probe_matrix, small_bursts, small_limits, tail_ns, union_s
from distdiag.replay import Change

if TYPE_CHECKING:
    from distdiag.run import Run
    from distdiag.config import Config

ADVICE = (
    "measure the links to see whether one is slow: rerun with `distdiag-wrap --probe-links` "
    "(`srun distdiag-wrap --probe-links python train.py`); if none is, communicate less or "
    "overlap it (larger DDP buckets, gradient compression, fewer all-reduces per step) or "
    "use a faster fabric"
)


#: a transfer cut longer than any transfer: the replay's "the network took no time"
_NO_TIME_NS = 1 << 60


def _size_class(nbytes: np.ndarray) -> np.ndarray:
    """Power-of-4 size classes (1 KiB, 4 KiB, ...), for the evidence."""
    out: np.ndarray = np.floor(np.log2(np.maximum(nbytes, 1)) / 2).astype(np.int64) * 2
    return out


def _human(b: float) -> str:
    for unit, k in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if b >= 1 << k:
            return f"{b / (1 << k):.3g} {unit}"
    return f"{b:.0f} B"


def fabric_bw(run: Run, cfg: Config) -> tuple[float, str]:
    """(bytes/s the fabric delivers, where that comes from), or (0.0, "") when unknown:
    ``fabric_MB_per_s`` in the config, else the median pair the link probe measured."""
    conf = float(cfg.value("network_bound", "fabric_MB_per_s", 0.0) or 0.0)
    if conf > 0:
        return conf * 1e6, "config ([analyze.network_bound] fabric_MB_per_s)"
    try:
        m = probe_matrix(run)
    except Exception:  # a damaged probe table: as unknown
        return 0.0, ""
    if m is None:
        return 0.0, ""
    bw = m.pairs()[2]
    bw = bw[np.isfinite(bw) & (bw > 0)]
    if len(bw) == 0:
        return 0.0, ""
    return float(np.median(bw)), f"the link probe (the median of {len(bw)} pairs)"


@register("network_bound", requires=("collectives",),
          role=Role(removal=1, subsystem=True))
def detect(an: Analysis) -> list[Finding]:
    run, cfg = an.run, an.cfg
    min_share = float(cfg.value("network_bound", "min_share", 0.1))
    top = int(cfg.value("network_bound", "top", 5))
    wall_s = float(run.wall_s)
    if wall_s <= 0:
        return []
    colls = an.colls
    if len(colls) == 0:
        return []
    # Cheap bound first (one pass, no sort): the union of (last exit - last arrival) over
    # the groups holds the union below; most runs stop here (collective_transfers sorts
    # every member row: +12% of a 2.5 M-event analysis when it ran on every run)
    if len(colls.m_t1_ns):
        tail = tail_ns(colls)
        up = tail > 0
        if union_s(colls.g_last_ns[up], colls.g_last_ns[up] + tail[up]) < min_share * wall_s:
            return []
    ct = collective_transfers(run, colls)
    sel = network_bound(ct) & (ct.bus_bytes > 0)
    # small calls back to back are small_collectives' (fuse them): each costs its latency, not its
    # bytes (2,000 Iallreduce of 8 bytes then a Waitall a step: "0.0 MB/s bus bandwidth")
    sel &= ~small_bursts(run, colls, *small_limits(cfg)).cut[ct.group]
    if not sel.any():
        return []
    # at the fabric's bandwidth each transfer takes bus bytes / bandwidth; what it took beyond that
    # is the network's excess (all of it when the fabric is unknown: the upper bound)
    fabric, fabric_from = fabric_bw(run, cfg)
    ideal_ns = np.zeros(len(ct), np.int64)
    if fabric > 0:
        ideal_ns = np.minimum(ct.bus_bytes / fabric * 1e9, ct.transfer_s * 1e9).astype(np.int64)
    # per rank, the union of the windows of the groups it is a member of; the job is held as
    # long as its most-held rank (sub-communicators taking turns do not add up)
    n_groups = len(colls.g_start) - 1
    w0 = np.zeros(n_groups, np.int64)
    w1 = np.zeros(n_groups, np.int64)
    cut = np.zeros(n_groups, np.int64)
    ideal_g = np.zeros(n_groups, np.int64)
    ideal_g[ct.group[sel]] = ideal_ns[sel]
    w0[ct.group[sel]] = ct.last_arrival_ns[sel] + ideal_ns[sel]
    w1[ct.group[sel]] = ct.last_arrival_ns[sel] + (ct.transfer_s[sel] * 1e9).astype(np.int64)
    cut[ct.group[sel]] = np.maximum(w1[ct.group[sel]] - w0[ct.group[sel]], 0) if fabric > 0 else _NO_TIME_NS
    chosen = np.zeros(n_groups, bool)
    chosen[ct.group[sel]] = True
    members = np.flatnonzero(chosen[colls.m_group])
    grp = colls.m_group[members]
    t0, t1 = w0[grp], w1[grp]
    m_rank = colls.m_rank[members].astype(np.int64)
    n_ranks = int(max(int(run.world_size), int(m_rank.max()) + 1))
    per_rank = union_length_by_key(m_rank, t0, t1, n_ranks)
    cost_s = float(per_rank.max()) / 1e9
    held_s = cost_s  # the whole transfers (no fabric known): the windows are the transfers
    if fabric > 0:  # the most-held rank's union of the whole transfer windows, for the evidence
        t_full = w0[grp] - ideal_g[grp]
        held_s = float(union_length_by_key(m_rank, t_full, t1, n_ranks).max()) / 1e9
    if cost_s < min_share * wall_s:
        return []
    # evidence: per (op, size class) the calls, seconds and bus bandwidth achieved
    ops = ct.op[sel].astype(np.int64)
    cls = _size_class(ct.nbytes[sel].astype(np.float64))
    key = ops * 64 + cls
    uniq, inv = np.unique(key, return_inverse=True)
    secs = np.bincount(inv, weights=ct.transfer_s[sel], minlength=len(uniq))
    bus = np.bincount(inv, weights=ct.bus_bytes[sel], minlength=len(uniq))
    n = np.bincount(inv, minlength=len(uniq))
    by = []
    for j in np.argsort(-secs, kind="stable")[: max(1, top)]:  # a handful of (op, size) rows
        op, c = divmod(int(uniq[j]), 64)
        by.append({"op": run.s(op), "size": f"~{_human(float(1 << c))}", "calls": int(n[j]),
                   "transfer_s": round(float(secs[j]), 4),
                   "bus_bw_MB_per_s": round(float(bus[j] / secs[j]) / 1e6, 3) if secs[j] > 0 else None})  # fmt: skip
    total_bus = float(ct.bus_bytes[sel].sum())
    total_s = float(ct.transfer_s[sel].sum())
    bw = total_bus / total_s if total_s > 0 else float("nan")
    share = cost_s / wall_s
    worst = by[0] if by else {"op": "collectives", "size": "?", "bus_bw_MB_per_s": None}
    summary = (
        f"the network binds: for {cost_s:.3g} s ({share:.0%} of the run) every rank waited on collectives "
        f"moving their bytes ({int(sel.sum())} calls, mostly {worst['op']} of {worst['size']} at "
        f"{worst['bus_bw_MB_per_s']} MB/s bus bandwidth); no rank was late, so no rank is to blame"
    )
    if fabric > 0:
        summary += f"; the fabric delivers {fabric / 1e6:.4g} MB/s, so {cost_s:.3g} s of it is the network falling short"
        what = (f"the network-bound collectives' transfers at the fabric's {fabric / 1e6:.4g} MB/s bus bandwidth "
                f"(from {fabric_from})")
    else:
        what = "the network-bound collectives' transfers taking no time (an upper bound)"
    return [
        Finding(
            kind="network_bound",
            cost_s=cost_s,
            summary=summary,
            evidence={
                "share_of_wall": round(share, 4),
                "calls": int(sel.sum()),
                "transfer_union_s": round(held_s, 4),
                "bus_bw_MB_per_s": round(bw / 1e6, 3) if np.isfinite(bw) else None,
                "by_op_and_size": by,
                "counterfactual": (f"the transfers at the fabric's bandwidth, {fabric / 1e6:.4g} MB/s from {fabric_from}"
                                   if fabric > 0 else
                                   "the network took no time: an upper bound (no measured fabric bandwidth)"),
                "fabric_MB_per_s": round(fabric / 1e6, 3) if fabric > 0 else None,
                "localize": "distdiag-wrap --probe-links",
            },
            advice=ADVICE,
            # each member's transfer by the same share (a slow fabric spreads the exits too)
            change=Change(what, transfer_cut_ns=np.where(chosen, cut, 0).astype(np.int64),
                          transfer_ref_ns=np.where(chosen, w1 - w0 + ideal_g, 0).astype(np.int64)),
        )
    ]
