"""Slow link: one node's (or one pair's) link moves bytes far slower than the rest.

A ring all-reduce runs at the speed of its slowest hop, so one slow link slows
every rank's collectives by the same amount: no rank arrives late, nobody
looks like a straggler, and the time shows up as the collectives' transfer
phase (after the last rank arrived). Naming the link needs a bandwidth per
pair: the active probe's matrix when the run has one, else the passive one
from large point-to-point transfers (:mod:`distdiag.links`).

Which link. On the unit x unit bandwidth matrix (units = hosts, or ranks on
one host):

* a **slow node**: its median pair bandwidth is under ``max_ratio`` of the
  median over all nodes of that statistic. One bad NIC or cable makes every
  pair with that node slow; the median of medians stays on the healthy side
  as long as fewer than half the nodes are bad. Worked example, 4 nodes with
  node2's link at 6 MB/s and the rest at ~1000 MB/s: node medians are 6,
  1000, 1000, 1000 (each healthy node has one slow pair of three), the median
  of medians is 1000, node2 is at 0.6%: slow.
* a **slow pair** between healthy nodes: its bandwidth is under ``max_ratio``
  of the median of the pairs between healthy nodes.

The reference ("the median pair") is the median bandwidth of the pairs that
touch no slow node.

Cost: what the job's collectives and transfers would save at the median
link's bandwidth. A collective whose members include the slow node moves
``bus_bytes`` per rank over its ring; at the slow link that takes at least
``bus_bytes / bw_slow``, at the median link ``bus_bytes / bw_ref``. The saving
per collective is the smaller of that model difference and what the
observation allows (``transfer_s - bus_bytes / bw_ref``, never negative):
small collectives are latency-bound and save nothing. Transfer windows of
overlapping collectives (DDP buckets in flight together) are counted once: the
total is capped at the union of the windows. Point-to-point transfers over the
link add ``nbytes * (1/bw_slow - 1/bw_ref)`` each, capped the same way.

Straggler interplay: a slow link costs time after the last rank arrived, which
the straggler detector never charges (it charges last-minus-second arrival
only); so the two findings never count the same seconds.
"""

from __future__ import annotations

import logging

import numpy as np

from distdiag.analysis import Analysis
from distdiag.detectors import register
from distdiag.roles import Role
from distdiag.schema import Kind
from distdiag.findings import Finding
from distdiag.links import (
    LinkMatrix,
    collective_transfers,
    group_unit_mask,
    link_matrix,
    network_bound,
    p2p_transfers,
    union_s,
)
from distdiag.match import Collectives
from distdiag.replay import Change

log = logging.getLogger(__name__)


def _mbps(bw: float) -> str:
    if bw >= 1e9:
        return f"{bw / 1e9:.3g} GB/s"
    return f"{bw / 1e6:.3g} MB/s"


def _node_medians(m: LinkMatrix) -> np.ndarray:
    bw = m.bw_bytes_per_s.copy()
    np.fill_diagonal(bw, np.nan)
    with np.errstate(all="ignore"):
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN rows: unmeasured units
            out: np.ndarray = np.nanmedian(bw, axis=1)
            return out


def find_slow(m: LinkMatrix, max_ratio: float) -> tuple[list[int], list[tuple[int, int]], float]:
    """(slow units, slow pairs between healthy units, reference bandwidth)."""
    n = len(m.units)
    i, j, bw = m.pairs()
    if n < 3 or len(bw) < 2:
        return [], [], float("nan")  # with one pair there is nothing to compare against
    med = _node_medians(m)
    ref_node = float(np.nanmedian(med))
    slow_units = [int(u) for u in np.flatnonzero(np.isfinite(med) & (med < max_ratio * ref_node))]
    bad = np.zeros(n, bool)
    bad[slow_units] = True
    healthy = ~bad[i] & ~bad[j]
    if not healthy.any():
        return [], [], float("nan")
    ref = float(np.median(bw[healthy]))
    slow_pairs = [(int(a), int(b)) for a, b, v in zip(i[healthy], j[healthy], bw[healthy]) if v < max_ratio * ref]
    return slow_units, slow_pairs, ref


@register("slow_link", requires=("collectives",),
          role=Role(tier=0, claims=(Kind.SEND, Kind.RECV, Kind.WAIT), claims_hosts=True, removal=0))
def detect(an: Analysis) -> list[Finding]:
    run, cfg = an.run, an.cfg
    max_ratio = float(cfg.value("slow_link", "max_ratio", 0.5))
    min_fraction = float(cfg.value("slow_link", "min_fraction", 0.02))
    wall_s = run.wall_s
    m = link_matrix(run)
    if m is None or wall_s <= 0:
        return []
    slow_units, slow_pairs, ref = find_slow(m, max_ratio)
    if not slow_units and not slow_pairs:
        return []
    colls = an.colls
    ct = collective_transfers(run, colls)
    p2p = p2p_transfers(run)
    units = m.units
    n_units = len(units)
    of_rank = units.of_rank
    bw_m = m.bw_bytes_per_s

    findings = []
    targets: list[tuple[list[int], list[tuple[int, int]]]] = [([u], []) for u in slow_units]
    targets += [([], [p]) for p in slow_pairs]
    for su, sp in targets:  # a handful of slow units / pairs
        if su:
            u = su[0]
            others = [v for v in range(n_units) if v != u and np.isfinite(bw_m[u, v])]
            slow_bw = float(np.nanmedian(bw_m[u, others])) if others else float("nan")
            links = [(u, v) for v in others if bw_m[u, v] < max_ratio * ref]
            in_a = of_rank == u
            # collectives crossing the link: the slow node plus at least one other node
            in_b = (of_rank >= 0) & (of_rank != u)
        else:
            a, b = sp[0]
            slow_bw = float(bw_m[a, b])
            links = [(a, b)]
            in_a, in_b = of_rank == a, of_rank == b
        if not np.isfinite(slow_bw) or slow_bw <= 0:
            continue
        # -- collectives over the link ------------------------------------------
        sel = group_unit_mask(colls, ct.group, in_a) & group_unit_mask(colls, ct.group, in_b) & (ct.bus_bytes > 0)
        model_s = ct.bus_bytes[sel] * (1.0 / slow_bw - 1.0 / ref)
        observed_s = ct.transfer_s[sel] - ct.bus_bytes[sel] / ref
        save = np.clip(np.minimum(model_s, observed_s), 0.0, None)
        t0 = ct.last_arrival_ns[sel]
        t1 = t0 + (ct.transfer_s[sel] * 1e9).astype(np.int64)
        coll_cost = min(float(save.sum()), union_s(t0, t1))
        # -- point-to-point over the link ---------------------------------------------
        src_ok = np.clip(p2p["src"], 0, len(of_rank) - 1)
        dst_ok = np.clip(p2p["dst"], 0, len(of_rank) - 1)
        pa, pb = in_a[src_ok], in_b[dst_ok]
        qa, qb = in_a[dst_ok], in_b[src_ok]
        psel = (pa & pb) | (qa & qb)
        p_model = p2p["nbytes"][psel] * (1.0 / slow_bw - 1.0 / ref)
        p_obs = p2p["xfer_s"][psel] - p2p["nbytes"][psel] / ref
        p_save = np.clip(np.minimum(p_model, p_obs), 0.0, None)
        p_cost = min(float(p_save.sum()), union_s(p2p["t0_ns"][psel], p2p["t1_ns"][psel]))
        cost_s = coll_cost + p_cost
        if cost_s < min_fraction * wall_s:
            continue

        names = units.names
        ranks = [int(r) for r in np.flatnonzero(in_a)] if su else [int(r) for r in np.flatnonzero(in_a | in_b)]
        link_names = [[names[x], names[y]] for x, y in links]
        if su:
            what = f"node {names[su[0]]}" if units.kind == "host" else names[su[0]]
        else:
            what = f"{names[sp[0][0]]} <-> {names[sp[0][1]]}"
        sel_idx = np.flatnonzero(sel)
        bus_bw = ct.bus_bw_bytes_per_s[sel_idx]
        bus_bw = bus_bw[np.isfinite(bus_bw)]
        ops: dict[str, dict[str, float]] = {}
        if len(sel_idx):
            uniq, inv = np.unique(ct.op[sel_idx], return_inverse=True)
            tot = np.bincount(inv, weights=save)
            cnt = np.bincount(inv)
            for k in np.argsort(-tot)[:5]:  # a handful of op names
                ops[run.s(int(uniq[k]))] = {"count": int(cnt[k]), "save_s": round(float(tot[k]), 4)}
        summary = (
            f"the link{'s' if su else ''} of {what} move{'' if su else 's'} {_mbps(slow_bw)} against {_mbps(ref)} "
            f"for the median pair ({slow_bw / ref:.1%}); collectives over {'it' if sp else 'them'} "
            f"would finish {cost_s:.3g} s sooner at the median link's bandwidth"
        )
        findings.append(
            Finding(
                kind="slow_link",
                cost_s=cost_s,
                summary=summary,
                ranks=ranks,
                hosts=[names[x] for x in (su or list(sp[0]))] if units.kind == "host" else [],
                change=_change(colls, ct.group[sel], save, ct.transfer_s[sel], what, p2p, psel, p_save),
                links=link_names,
                evidence={
                    "source": m.source,
                    "slow_bw_MB_per_s": round(slow_bw / 1e6, 3),
                    "median_pair_bw_MB_per_s": round(ref / 1e6, 3),
                    "ratio": round(slow_bw / ref, 5),
                    "max_ratio": max_ratio,
                    "collectives_over_link": int(sel.sum()),
                    "collective_transfer_s": round(float(ct.transfer_s[sel].sum()), 4),
                    "collective_save_s": round(coll_cost, 4),
                    # everyone arrived, then the bytes took long: the network, not a rank
                    "network_bound_share": round(float(network_bound(ct)[sel].mean()), 3) if sel.any() else None,
                    "median_bus_bw_MB_per_s": round(float(np.median(bus_bw)) / 1e6, 3) if len(bus_bw) else None,
                    "p2p_transfers_over_link": int(psel.sum()),
                    "p2p_save_s": round(p_cost, 4),
                    "per_op": ops,
                    "matrix": m.to_json(),
                },
                advice=(
                    f"Check the network path of {what}: NIC link speed and errors (ethtool, ip -s link), "
                    "cable/port, switch port counters, traffic shaping or a congested uplink; "
                    "or exclude that node from the allocation."
                ),
            )
        )
    return findings


def _change(colls: Collectives, groups: np.ndarray, save_s: np.ndarray, transfer_s: np.ndarray, what: str,
            p2p: dict[str, np.ndarray], psel: np.ndarray, p_save_s: np.ndarray) -> Change:  # fmt: skip
    """The counterfactual: each collective over the link transfers ``save_s`` sooner than its
    median member's ``transfer_s``, each member by the same share of its own transfer (the
    members a slow ring ends last lose as much of theirs), and each point-to-point transfer
    over it ``p_save_s`` sooner (its receive's and its send's: a send that waits for its
    receiver ends with the transfer too), at the median pair's bandwidth, as priced above."""
    cut = np.zeros(len(colls), np.int64)
    cut[groups] = (save_s * 1e9).astype(np.int64)
    ref = np.zeros(len(colls), np.int64)
    ref[groups] = (transfer_s * 1e9).astype(np.int64)
    p_ns = (p_save_s * 1e9).astype(np.int64)
    rows = np.concatenate([p2p["recv_row"][psel], p2p["send_row"][psel]]).astype(np.int64)
    return Change(f"the collectives{' and point-to-point calls' if psel.any() else ''} over the link(s) of {what} "
                  "at the median pair's bandwidth", transfer_cut_ns=cut, transfer_ref_ns=ref, p2p_rows=rows,
                  p2p_cut_ns=np.concatenate([p_ns, p_ns]), p2p_t_ns=np.concatenate([p2p["t0_ns"][psel]] * 2))  # fmt: skip
