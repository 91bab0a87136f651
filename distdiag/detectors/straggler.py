"""Straggler: a rank the others keep waiting for at collectives.

For every complete collective group, the last member to arrive holds everyone
else back. Had it arrived together with the second-to-last, the collective
(and so the job, when collectives synchronize it) would have finished
``last - second_to_last`` earlier, and no earlier: then the second-to-last
would be the one everybody waits for. So that difference is what the last
arriver costs at that collective, and the sum over the groups a rank arrived
last at is what removing its lateness saves. Each group is charged to exactly
one rank, so the costs of different ranks never double-count.

Worked example: arrivals at 10.0, 10.1, 10.2 and 13.0 ms (rank 3 last): the
others waited until 13.0, but removing rank 3's lateness only brings the
collective forward to 10.2, so rank 3 is charged 2.8 ms, not 3.0 and not the
sum of the three waits (8.7 ms).

A healthy job has ranks arriving in random order with jitter: every rank is
last now and then and collects charges by chance. With enough jitter those
chance sums can pass the wall-clock threshold on every rank alike (measured:
±1 ms of jitter on 5 ms of compute gives each of 4 ranks ~2% of the
wall-clock). That is noise the ranks share, not a rank to blame, so a rank is
reported only when its sum also stands out from its peers: more than
``peer_ratio`` times the median sum of the other ranks. A real straggler
stands out by far (its peers are rarely last: their median is near 0), also
when two ranks straggle at once.

Lateness a rank inherits is not its own: when the previous collective let
the last arriver out later than the second-to-last (a ring all-reduce over one
slow link releases the ranks downstream of it last; measured in the netns
test: rank 1 last at 9 of 10 bucket all-reduces, 44 ms behind, with the slow
link on node 2), the arrival gap is discounted by that exit gap (see
:func:`own_lateness_ns`); the slow link is slow_link's finding.

Each rank's first collective is left out: waits there are launch skew
(imports, start-up), which launch_overhead prices (see :func:`startup_groups`).

Rooted collectives that do not synchronize everyone are charged only when
someone really waited: a late non-root of a broadcast/scatter, or a late root
of a reduce/gather, delays nobody (ONE_TO_MANY / MANY_TO_ONE).

A whole slow node is a straggler too, found at host level (see
:func:`_fold_hosts`).

Settings (``[analyze.straggler]``): ``min_fraction`` (share of wall-clock,
default the [analyze] one, 0.02), ``peer_ratio`` (2.0), ``top_sites`` (5).

Cost (issue 10): every pass over member rows goes by blocks of whole groups
(``group_blocks``), and the host fold steps back from each group's last
arriver instead of scanning every member (see :func:`distdiag.lateness.other_host_last_ns_from`);
its participation counts are made only for a host it reports. Measured, same
findings and the same JSON on every synth fault and 1024 x 10k: detect alone
on an aligned run, member gaps cached, 0.46-0.52 -> 0.09-0.10 s of CPU at
1024 x 10k (5.1 M member rows) and 0.35 -> 0.07 s at 64 x 100k (6.4 M); the
analysis stage (``bench_scale.py --stages --baseline --repeat 2``, load 5-8)
1.16 -> 0.99 s at 1024 x 10k and 0.73 -> 0.44 s at 64 x 100k. What is left,
~0.4-0.8 s, and all of the stage's transient (+13.1 B/event at 1024 x 10k,
+10.0 at 64 x 100k, the same before and after) is the first call of
:func:`distdiag.match.member_gaps_ns` (its (rank, arrival) order: two
run-wide int64 permutations and gathers in rank order), which the detector
pays for serial_section and the ranking.

Then (issue 10, 100k events a rank): :func:`startup_groups` looks only at
the early rows (:func:`distdiag.lateness.startup_groups`: a bound on every rank's first arrival
from the first block of members), :func:`_ops_per_rank` finds the blamed
ranks' rows by compares, not a gather per member row. Detect alone, member
gaps cached: ~75 -> ~34-40 ms at 64 x 100k (startup_groups 27 -> 2.5 ms);
the stage (``--stages --baseline <worktree of 3599750> --repeat 2``, load
2-3) 0.31-0.34 -> 0.26-0.32 s at 64 x 100k, 0.48-0.58 -> 0.40-0.53 s at
1024 x 10k: the rest is still the member gaps. Same JSON (every synth fault,
1024 x 10k).
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from distdiag.analysis import Analysis
from distdiag.detectors import register
from distdiag.roles import Role
from distdiag.findings import Finding
from distdiag.intervals import band_of
from distdiag.evidence import secs, tally
from distdiag.lateness import charged_windows, host_indices, nobody_waits, other_host_last_ns_from, own_lateness_ns, startup_groups
from distdiag.match import MatchState, group_blocks, member_gaps_ns
from distdiag.ranks import rank_ranges
from distdiag.replay import Change, group_medians, peer_excess

if TYPE_CHECKING:
    from distdiag.match import Collectives
    from distdiag.run import Run

log = logging.getLogger(__name__)


@register("straggler", requires=("collectives",),
          role=Role(tier=2, removal=3, attributed_by=("median_wait_ms", "median lateness", "which rank was late")))
def detect(an: Analysis) -> list[Finding]:
    run, cfg = an.run, an.cfg
    colls = an.colls
    if len(colls) == 0:
        return []
    min_fraction = float(cfg.value("straggler", "min_fraction", 0.02))
    top_sites = int(cfg.value("straggler", "top_sites", 5))
    peer_ratio = float(cfg.value("straggler", "peer_ratio", 2.0))
    wall_s = run.wall_s
    if wall_s <= 0:
        return []

    complete = (colls.g_state == MatchState.COMPLETE) & (colls.g_n_members >= 2)
    complete &= ~startup_groups(colls)
    ok = complete & ~nobody_waits(run, colls)
    g_idx = np.flatnonzero(ok)
    if len(g_idx) == 0:
        return []
    wait_ns = own_lateness_ns(run, colls)[g_idx]
    last = colls.g_last_rank[g_idx].astype(np.int64)
    n = int(max(run.world_size, colls.m_rank.max() + 1))
    cost_ns = np.bincount(last, weights=wait_ns, minlength=n)
    n_last = np.bincount(last, minlength=n)
    # Complete groups each rank took part in: the denominator of "last at x%".
    n_member = _members_per_rank(colls, complete, n)
    # the lateness partners waited for at point-to-point calls (a halo exchange), charged alike
    p2p = p2p_lateness(run, colls, min_fraction * wall_s * 1e9, cost_ns)
    p2p = P2PLateness(*(a[p2p.rank < n] for a in p2p))
    p2p_ns = np.bincount(p2p.rank, weights=p2p.ns, minlength=n)
    cost_ns = cost_ns + p2p_ns
    in_p2p = (np.bincount(run.events["rank"][_p2p_rows(run)], minlength=n) > 0)[:n]

    # The last arriver's own member row of each group: its op and call site.
    last_row = colls.g_start[1:][g_idx] - 1
    ops = colls.m_op[last_row]
    sites = colls.m_site[last_row]

    took_part = (n_member > 0) | in_p2p
    blamed: list[tuple[int, float]] = []  # (rank, its peers' median charge), ranks over threshold: few
    for r_ in np.flatnonzero(cost_ns > min_fraction * wall_s * 1e9):
        r = int(r_)
        peers = took_part.copy()
        peers[r] = False
        peer_median_ns = float(np.median(cost_ns[peers])) if peers.any() else 0.0
        if cost_ns[r] <= peer_ratio * peer_median_ns:
            log.debug("rank %d: %.3f s of waits, but its peers' median is %.3f s: shared jitter", r,
                      cost_ns[r] / 1e9, peer_median_ns / 1e9)  # fmt: skip
            continue
        blamed.append((r, peer_median_ns))
    rank_ops = _ops_per_rank(colls, complete, [r for r, _ in blamed])
    slow = np.zeros(n, bool)  # the blamed ranks: no rank's typical peer is one of them
    slow[[r for r, _ in blamed]] = True
    like, refs = _like_peers(run, colls, ok, slow, [r for r, _ in blamed])
    like_p2p = _like_peers_p2p(run, colls, slow, [r for r, _ in blamed])

    findings = []
    ev = run.events
    for r, peer_median_ns in blamed:  # the blamed ranks: few
        mine = last == r
        cost_s = float(cost_ns[r]) / 1e9
        n_coll = int(n_member[r])
        frac_last = float(n_last[r]) / max(1, n_coll)
        p_mine = p2p.rank == r
        p_rows = p2p.row[p_mine]
        w = np.r_[wait_ns[mine], p2p.ns[p_mine]]
        per_op = tally(np.r_[ops[mine], ev["name_id"][p_rows]], w, run, limit=10)
        by_site = tally(np.r_[sites[mine], ev["site_id"][p_rows]], w, run, limit=top_sites)
        my_ops = rank_ops[r]
        op_word = f"{run.s(int(my_ops[0]))} calls" if len(my_ops) == 1 else "collectives"
        if p2p_ns[r] > cost_ns[r] - p2p_ns[r]:  # held mostly at point-to-point calls
            names = sorted({run.s(int(i)) for i in np.unique(ev["name_id"][p_rows])})
            summary = (
                f"rank {r} kept its point-to-point partners waiting at {int(p_mine.sum())} calls "
                f"({', '.join(names[:3])}); the others waited {secs(cost_s)}"
            )
        else:
            summary = (
                f"rank {r} arrived last at {frac_last:.0%} of {n_coll} {op_word}; "
                f"the others waited {secs(cost_s)}"
            )
        host = run.host_of(r)
        top_site = next(iter(by_site.keys()), "")
        where = f" (top call site {top_site})" if top_site and top_site != "?" else ""
        findings.append(
            Finding(
                kind="straggler",
                cost_s=cost_s,
                summary=summary,
                ranks=[r],
                hosts=[host] if host else [],
                evidence={
                    "count": int(n_last[r]),
                    "collectives": n_coll,
                    "fraction_last": round(frac_last, 4),
                    "wait_s": cost_s,
                    "median_wait_ms": float(np.median(w)) / 1e6,
                    "max_wait_ms": float(w.max()) / 1e6,
                    "peers_median_wait_s": peer_median_ns / 1e9,
                    "per_op": per_op,
                    "top_sites": by_site,
                },
                change=Change(f"rank {r}'s work before each collective at the other members' median"
                              + (" plus a typical peer's excess over it" if r in like else "")
                              + (", and before each point-to-point call at that of the ranks calling from the same line"
                                 + (" plus a typical peer's excess over it" if r in like_p2p else "")
                                 if p_mine.any() else ""),
                              median_ranks=np.array([r], np.int64), like_peers={r: like[r]} if r in like else {},
                              like_p2p={r: like_p2p[r]} if r in like_p2p else {},
                              peer_ref={r: refs[r]} if r in refs else {}),
                advice=(
                    f"Find what rank {r}{' on ' + host if host else ''} does before its "
                    f"{'point-to-point calls and collectives' if p_mine.any() else 'collectives'}{where} "
                    "that the others do not: uneven data or work split, extra I/O or logging on that rank, "
                    "or a slower/busier node."
                ),
            )
        )
    for f in findings:  # point-to-point lateness, where a blamed rank had some (else the JSON is as before)
        p_mine = p2p.rank == f.ranks[0]
        if p_mine.any():
            f.evidence["p2p_late_calls"] = int(p_mine.sum())
            f.evidence["p2p_wait_s"] = float(p2p_ns[f.ranks[0]]) / 1e9
    out = _fold_hosts(run, colls, ok, cost_ns, findings, min_fraction, peer_ratio, wall_s, top_sites)
    for f in out:  # as a symptom: what a cause in the late rank's stretches explains (distdiag.ranking)
        f.windows = functools.partial(charged_windows, f)
    return out


def _members_per_rank(colls: Collectives, groups: np.ndarray, n: int) -> np.ndarray:
    """Per rank: how many of ``groups`` (a mask per group) it took part in. By blocks of
    whole groups: a member-size mask and int64 copy of the ranks all at once were ~13
    bytes per member row, the detector's peak after the member gaps (measured)."""
    out = np.zeros(n, np.int64)
    for g_lo, g_hi, a, b in group_blocks(colls):  # per block of ~262,144 member rows
        sel = groups[g_lo:g_hi]
        if not sel.any():
            continue
        r = colls.m_rank[a:b]
        if not sel.all():
            r = r[np.repeat(sel, np.diff(colls.g_start[g_lo : g_hi + 1]))]
        out += np.bincount(r, minlength=n)
    return out


def _ops_per_rank(colls: Collectives, groups: np.ndarray, ranks: list[int]) -> dict[int, np.ndarray]:
    """rank -> the distinct op ids (ascending) of its member rows in ``groups``, for a few
    ranks, in one pass by blocks of whole groups."""
    out = {r: np.zeros(0, np.int64) for r in ranks}
    if not ranks:
        return out
    n_op = int(colls.m_op.max()) + 1
    keys = []
    for _g_lo, _g_hi, a, b in group_blocks(colls):  # per block of ~262,144 member rows
        # np.isin compares row by row for a few ranks (~0.3 ns a row each, not a gather's ~2-4)
        sel = np.flatnonzero(np.isin(colls.m_rank[a:b], ranks))
        sel = sel[groups[colls.m_group[a:b][sel]]]  # the few selected rows' groups, not a repeat over all
        k = colls.m_rank[a:b][sel].astype(np.int64)
        k *= n_op
        k += colls.m_op[sel + a]  # the selected rows only (m_op is per group: a slice would build the block's)
        keys.append(np.unique(k))
    pairs = np.unique(np.concatenate(keys))
    for r in ranks:  # a few
        out[r] = pairs[pairs // n_op == r] % n_op
    return out


#: member rows of the ranks :func:`p2p_lateness` looks at, up to which their collectives' exits
#: count as where a rank left before a point-to-point call (past it: the point-to-point calls' only)
P2P_COLL_ROWS = 1 << 24


class P2PLateness(NamedTuple):
    """Per late point-to-point event (a call a partner waited for): its rank, its ``run.events``
    row and what its lateness cost the partners who waited (ns, its own: less what it inherited)."""

    rank: np.ndarray
    row: np.ndarray
    ns: np.ndarray


def p2p_lateness(run: Run, colls: Collectives, min_ns: float, have_ns: np.ndarray | None = None) -> P2PLateness:
    """The lateness at point-to-point rendezvous (issue 20), as :func:`own_lateness_ns` at collectives.

    A blocking receive, or the WAIT that completes an ``Irecv``
    (:func:`distdiag.links.p2p_waits`), waits for its sender's arrival (its call or its ``Isend``):
    the sender is late by ``send t0 - wait t0`` (at most the wait's length). A blocking send that
    came first and returned after its receiver came waited for it (a rendezvous send, or a
    ``Sendrecv``), and so did the WAIT that completes an ``Isend`` of ``replay.EAGER_BYTES`` or
    more: the receiver is late by ``receive t0 - wait t0``. Pairs come from
    :func:`distdiag.links.p2p_transfers`. One call's lateness is charged once, at the largest wait
    it caused (a ``Sendrecv`` in a ring that holds both neighbours costs the run one wait, not
    two). What the late rank inherited is subtracted: how much later it left its previous
    rendezvous (a collective or a point-to-point call) than the rank that waited, at most as long
    as it was held there (a pipeline stage late because it waited for the stage before; not a
    rank that came last to its previous call); a late rank's first rendezvous is launch skew and
    never charged. Ranks whose charge before that subtraction,
    plus ``have_ns[rank]`` (their charges elsewhere), stays under ``min_ns`` are left out (their
    previous exits are not looked up)."""
    from distdiag.links import p2p_transfers, p2p_waits
    from distdiag.replay import EAGER_BYTES
    from distdiag.schema import Kind

    z = np.zeros(0, np.int64)
    tr = p2p_transfers(run)
    ms, mr = tr["send_row"], tr["recv_row"]
    if len(ms) == 0:
        return P2PLateness(z, z, z)
    ev = run.events
    kind = ev["kind"]

    def col(name: str, rows: np.ndarray) -> np.ndarray:
        return np.asarray(ev[name][rows], dtype=np.int64)

    w_recv, w_send = p2p_waits(run)
    # where each side waits: its blocking call, or the WAIT completing its request (an Isend's only
    # when it is large enough to need its receiver)
    rw = np.where(kind[mr] == Kind.RECV, mr, w_recv)
    sw = np.where(kind[ms] == Kind.SEND, ms, np.where(tr["nbytes"] >= EAGER_BYTES, w_send, -1))
    s0, r0 = col("t0_ns", ms), col("t0_ns", mr)
    rw0, rw1 = col("t0_ns", np.maximum(rw, 0)), col("t1_ns", np.maximum(rw, 0))
    sw0, sw1 = col("t0_ns", np.maximum(sw, 0)), col("t1_ns", np.maximum(sw, 0))
    recv_waits = (rw >= 0) & (s0 > rw0)
    send_waits = (sw >= 0) & (r0 > sw0) & (sw1 > r0)  # it came first and stayed until the receiver did
    late_row = np.r_[ms[recv_waits], mr[send_waits]]
    wait_row = np.r_[rw[recv_waits], sw[send_waits]]
    gap = np.r_[np.minimum(s0 - rw0, rw1 - rw0)[recv_waits], (r0 - sw0)[send_waits]]
    if len(late_row) == 0:
        return P2PLateness(z, z, z)
    late_r, wait_r = col("rank", late_row), col("rank", wait_row)
    n = int(max(int(late_r.max()), int(wait_r.max()), int(colls.m_rank.max()) if len(colls) else 0)) + 1
    raw = np.bincount(late_r, weights=gap, minlength=n)
    if have_ns is not None:
        raw[: len(have_ns)] += have_ns[:n]
    keep = raw[late_r] >= min_ns
    late_row, wait_row, gap, late_r, wait_r = late_row[keep], wait_row[keep], gap[keep], late_r[keep], wait_r[keep]
    if len(late_row) == 0:
        return P2PLateness(z, z, z)
    # where each rank left its previous rendezvous before each arrival asked about
    who = np.flatnonzero(np.bincount(np.r_[late_r, wait_r]) > 0)
    q_r, q_t = np.r_[late_r, wait_r], np.r_[col("t0_ns", late_row), col("t0_ns", wait_row)]
    left, held = _left_before(run, colls, who, q_r, q_t)
    left_late, left_wait = left[: len(late_row)], left[len(late_row) :]
    # inherited: how much later it left than the waiter, at most what it waited there itself (a rank
    # that came last to its previous rendezvous left it late by its own doing)
    inherited = np.minimum(np.maximum(left_late - np.maximum(left_wait, 0), 0), held[: len(late_row)])
    own = np.clip(gap - inherited, 0, gap)
    own[left_late < 0] = 0  # the late rank's first rendezvous: launch skew
    # one charge per late call: its largest (a Sendrecv's SEND and RECV rows are one call, at one
    # (rank, t0)); run.events comes by (rank, t0), so the rows' order is the calls'
    o = np.argsort(late_row, kind="stable")
    lr, lo_own = late_row[o], own[o]
    key_r, key_t = late_r[o], col("t0_ns", lr)
    first = np.flatnonzero(np.r_[True, (np.diff(key_r) != 0) | (np.diff(key_t) != 0)])
    best = np.maximum.reduceat(lo_own, first)
    # one lateness, several calls: a rank late at its send and then, having done nothing in between,
    # at its receive (two neighbours waiting at once) costs the run one wait. Calls that follow the
    # rank's previous late call with no work of its own between (it left that call and came to this
    # one at once: under a tenth of the charge) form a stretch, charged once: as its largest call
    c_r, c_t = key_r[first], key_t[first]
    c_left = left_late[o][first]
    # where the rank went on from a late call: a blocking call's return, a post's own start (three
    # Isends to three neighbours, each waited for: one lateness)
    posted = np.isin(kind[lr[first]], (Kind.SEND_ASYNC, Kind.RECV_ASYNC))
    c_exit = np.where(posted, c_t, col("t1_ns", lr[first]))
    went_on = np.maximum(c_left[1:], c_exit[:-1])
    cont = np.r_[False, (c_r[1:] == c_r[:-1]) & (c_left[1:] <= c_exit[:-1]) & (c_t[1:] - went_on < best[1:] // 10)]
    rows = lr[first]  # each call's first row: any row of the call names it alike
    if cont.any():  # each stretch: its largest call, once (by stretch, the largest first)
        stretch = np.cumsum(~cont)
        o2 = np.lexsort((-best, stretch))
        pick = o2[np.r_[True, stretch[o2][1:] != stretch[o2][:-1]]]
        c_r, rows, best = c_r[pick], rows[pick], best[pick]
    keep = best > 0
    return P2PLateness(c_r[keep], rows[keep], best[keep])


def _p2p_rows(run: Run) -> np.ndarray:
    from distdiag.rows import rows_of
    from distdiag.schema import Kind

    return rows_of(run, (Kind.SEND, Kind.RECV))


def _left_before(run: Run, colls: Collectives, who: np.ndarray, q_rank: np.ndarray,
                 q_t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """Per query: the latest exit (ns) of rank ``q_rank`` from a rendezvous (a collective member
    row's return, a blocking point-to-point call's or a wait's) at or before ``q_t`` (-1 where none), and how long that
    call took (0 where none). The ranks
    ``who`` (ascending, holding every query's) only: their member rows, by blocks of whole groups,
    while they are at most :data:`P2P_COLL_ROWS` (else only the point-to-point calls count)."""
    from distdiag.rows import rows_of
    from distdiag.schema import Kind

    ev = run.events
    p_rows = rows_of(run, (Kind.SEND, Kind.RECV, Kind.WAIT))  # rendezvous: a post is none (the rank goes on)
    p_rows = p_rows[np.isin(ev["rank"][p_rows], who)]
    ex_r = [ev["rank"][p_rows].astype(np.int64)]
    ex_t = [ev["t1_ns"][p_rows].astype(np.int64)]
    ex_0 = [ev["t0_ns"][p_rows].astype(np.int64)]
    got = 0
    for _g_lo, _g_hi, a, b in group_blocks(colls):  # per block of ~262,144 member rows
        sel = np.flatnonzero(np.isin(colls.m_rank[a:b], who))
        got += len(sel)
        if got > P2P_COLL_ROWS:
            ex_r, ex_t, ex_0 = ex_r[:1], ex_t[:1], ex_0[:1]
            break
        ex_r.append(colls.m_rank[a:b][sel].astype(np.int64))
        ex_t.append(colls.m_t1_ns[a:b][sel].astype(np.int64))
        ex_0.append(colls.m_t0_ns[a:b][sel].astype(np.int64))
    r, t, t_in = np.concatenate(ex_r), np.concatenate(ex_t), np.concatenate(ex_0)
    ok = t >= t_in
    r, t, t_in = r[ok], t[ok], t_in[ok]
    out = np.full(len(q_rank), -1, np.int64)
    held = np.zeros(len(q_rank), np.int64)
    if len(r) == 0:
        return out, held
    band = band_of(int(who.max()) + 1, t, q_t)
    if band is None:
        return out, held
    lo, span = band
    key = r * span + (t - lo)
    o = np.argsort(key, kind="stable")
    key, dur = key[o], (t - t_in)[o]
    at = np.searchsorted(key, q_rank * span + (q_t - lo), side="right") - 1
    hit = (at >= 0) & (key[np.maximum(at, 0)] // span == q_rank)
    out[hit] = key[at[hit]] - q_rank[hit] * span + lo
    held[hit] = dur[at[hit]]
    return out, held


def _fold_hosts(
    run: Run,
    colls: Collectives,
    ok: np.ndarray,
    rank_cost_ns: np.ndarray,
    rank_findings: list[Finding],
    min_fraction: float,
    peer_ratio: float,
    wall_s: float,
    top_sites: int,
) -> list[Finding]:
    """Add host-level stragglers (a slow node), replacing the rank findings they explain.

    When every rank of one node is late, they arrive last together: the
    last-minus-second-to-last gap is only the jitter between them, so no single
    rank looks guilty, yet everyone on the other nodes waits for that node. The
    node-level charge of a collective is therefore ``last arrival - last
    arrival from any other host``: what the job would save if that node's
    lateness were removed. Worked example: arrivals n0: 10.0, 10.1 ms; n1:
    13.0, 13.1 ms: rank-level charge 0.1 ms, node n1's charge 13.1 - 10.1 = 3.0 ms.

    A node is reported when its charge passes the wall-clock threshold, stands
    out from the other nodes' (``peer_ratio``), is not one rank's doing (it
    exceeds 1.5x the largest charge of a single rank on it) and its ranks are late
    together (all of them after every other host's last arrival at ``HOST_TOGETHER``
    of the collectives it was last at: ranks taking turns at a duty, one of them a
    straggler, make a host last at half of them one rank at a time); the node's
    rank findings are then folded into it, so one cause is counted once.
    """
    hosts = run.hosts
    if len(hosts) < 2:
        return rank_findings
    host_of_rank, h_last = host_indices(run, colls)
    # Per group, the last arrival from another host than the last arriver's (see
    # other_host_last_ns_from); only the groups that can be charged.
    no_t = np.iinfo(np.int64).min
    other_max = other_host_last_ns_from(colls, host_of_rank, h_last, np.flatnonzero(ok & (h_last >= 0)))
    use = ok & (other_max > no_t) & (h_last >= 0)
    if not use.any():
        return rank_findings
    g = np.flatnonzero(use)
    wait_ns = (colls.g_last_ns[g] - other_max[g]).astype(np.float64)
    hl = h_last[g]
    cost_ns = np.bincount(hl, weights=wait_ns, minlength=len(hosts))
    n_last = np.bincount(hl, minlength=len(hosts))

    rank_cost = {f.ranks[0]: f.cost_s for f in rank_findings}
    blamed: list[tuple[int, np.ndarray, list[int]]] = []  # (host, other hosts' charges, its ranks)
    together: np.ndarray | None = None
    for h_ in np.flatnonzero(cost_ns > min_fraction * wall_s * 1e9):  # hosts over threshold: few
        h = int(h_)
        others = np.delete(cost_ns, h)
        if len(others) and cost_ns[h] <= peer_ratio * float(np.median(others)):
            continue
        if together is None:
            together = _late_together(colls, host_of_rank, g, other_max, h_last)
        # a slow node's ranks are late together; ranks taking turns at a duty, one of them also a
        # straggler, make a host last half the time with one rank at a time (4 ranks on 2 hosts:
        # the host was priced 0.30 s where fixing the straggler saved 0.10)
        if float(together[hl == h].mean()) < HOST_TOGETHER:
            continue
        ranks_here = sorted(r for r, i in run.ranks.items() if i.host == hosts[h])
        if len(ranks_here) < 2:
            continue  # one rank per node: the rank finding says it all
        single = max((rank_cost.get(r, 0.0) for r in ranks_here), default=0.0)
        # largest single-rank charge on this host, reported or not (detect's per-rank charges)
        if cost_ns[h] / 1e9 <= 1.5 * max(single, float(rank_cost_ns[ranks_here].max()) / 1e9):
            continue
        blamed.append((h, others, ranks_here))
    if not blamed:
        return rank_findings
    n_part = _hosts_per_group(colls, host_of_rank, use, len(hosts), [h for h, _, _ in blamed])
    slow = np.zeros(len(rank_cost_ns), bool)  # every blamed rank and host: a typical peer is none of them
    slow[[r for f in rank_findings for r in f.ranks if r < len(slow)]] = True
    for _, _, ranks_here in blamed:
        slow[ranks_here] = True

    out_hosts: list[Finding] = []
    folded: set[int] = set()
    for h, others, ranks_here in blamed:  # the blamed hosts: few
        mine = hl == h
        last_ranks = colls.g_last_rank[g][mine]
        ur, cnt = np.unique(last_ranks, return_counts=True)
        cost_s = float(cost_ns[h]) / 1e9
        frac = float(n_last[h]) / max(1, int(n_part[h]))
        sites = colls.m_site[colls.g_start[1:][g][mine] - 1]  # the last arrivers' own rows
        by_site = tally(sites, wait_ns[mine], run, limit=top_sites)
        host_like, host_refs = _like_peers(run, colls, ok, slow, ranks_here)
        out_hosts.append(
            Finding(
                kind="straggler",
                cost_s=cost_s,
                summary=(
                    f"host {hosts[h]} (ranks {rank_ranges(ranks_here)}) arrived last at {frac:.0%} of "
                    f"{int(n_part[h])} collectives; the other hosts waited {secs(cost_s)}"
                ),
                ranks=ranks_here,
                hosts=[hosts[h]],
                evidence={
                    "count": int(n_last[h]),
                    "collectives": int(n_part[h]),
                    "fraction_last": round(frac, 4),
                    "wait_s": cost_s,
                    "median_wait_ms": float(np.median(wait_ns[mine])) / 1e6,
                    "other_hosts_median_wait_s": float(np.median(others)) / 1e9 if len(others) else 0.0,
                    "last_arrivers": {str(int(r)): int(c) for r, c in zip(ur, cnt)},
                    "top_sites": by_site,
                    "level": "host",
                },
                change=Change(f"the work of host {hosts[h]}'s ranks before each collective at the other "
                              "members' median plus a typical peer's excess over it",
                              median_ranks=np.asarray(ranks_here, np.int64),
                              like_peers=host_like, like_p2p=_like_peers_p2p(run, colls, slow, ranks_here),
                              peer_ref=host_refs),
                advice=(
                    f"Every rank on {hosts[h]} is late, not one: look at the node (a slower or throttled CPU/GPU, "
                    "other jobs on it, a slower file system mount, a different software stack)."
                ),
            )
        )
        folded.update(ranks_here)
    return out_hosts + [f for f in rank_findings if f.ranks[0] not in folded]


#: groups sampled per straggler for its excess table (:func:`_like_peers`): ~5 per quantile
_TABLE_GROUPS = 512
#: a collective of this many members or fewer takes a straggler's pace from a rolling mean
#: (:func:`_peer_ref`), not from its own median
FEW_MEMBERS = 3
#: collectives of one call site that rolling mean takes (a multiple of 2, 3, 4, 6 and 8: a duty
#: rotating over that many ranks averages out whole)
REF_WINDOW = 24


def _like_peers(run: Run, colls: Collectives, ok: np.ndarray, slow: np.ndarray,
                ranks: list[int]) -> tuple[dict[int, tuple[np.ndarray, np.ndarray]], dict[int, np.ndarray]]:
    """Per rank of ``ranks``: the table mapping its excess over the median of the members that
    are not ``slow`` (its work since its previous collective, :func:`distdiag.match.member_gaps_ns`,
    minus theirs) to those members' own excess over it (:func:`distdiag.replay.peer_excess`), read
    off up to ``_TABLE_GROUPS`` of its ``ok`` groups evenly spread over the run. The replay then
    takes the rank to a typical peer's pace, not to the median at every collective: a peer
    also takes its turns at a duty that rotates, and is sometimes last by jitter.

    And per rank that has collectives of ``FEW_MEMBERS`` members or fewer (a job of 2 or 3 ranks):
    the reference those take instead of their median (:func:`_peer_ref`; ``Change.peer_ref``)."""
    gaps = member_gaps_ns(run, colls, async_exits=True)
    out: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    refs: dict[int, np.ndarray] = {}
    for r in ranks:  # the blamed ranks: few
        rows = np.flatnonzero(colls.m_rank == r)
        g = colls.m_group[rows].astype(np.int64)
        keep = ok[g]
        rows, g = rows[keep], g[keep]
        ref = _peer_ref(gaps, colls, rows, g, slow)
        if ref is not None:
            refs[r] = ref
        table = _excess_table(gaps, colls.m_rank, colls.g_start, g, slow, r, ref)
        if table is not None:
            out[r] = table
    return out, refs


def _peer_ref(gaps: np.ndarray, colls: Collectives, rows: np.ndarray, g: np.ndarray,
              slow: np.ndarray) -> np.ndarray | None:  # fmt: skip
    """Per group (``len(colls)``; NaN elsewhere): the pace a straggler's member row of ``rows`` (in
    its groups ``g``, ascending) is measured from where the group has 2 to ``FEW_MEMBERS`` members
    (a job, or a communicator, of 2 or 3 ranks), some not ``slow``: the mean of those members'
    median work (``gaps``) over the ``REF_WINDOW`` collectives of its call site around it. None
    where no group is such. (Two slow ranks of a node among 4 keep their groups' median: with
    jitter, the rolling mean priced that node 2.6% under what the model says, the median 0.1%.)

    At the median of one or two peers, a peer's own variation is lost: with 2 ranks, the other
    rank's work *is* the median, so its turns of a rotating duty look like no excess at all,
    and the straggler at that pace loses its own turns too (priced 0.86 s where fixing it saves
    0.30 s, a 2-rank DDP job). Over a window the duty averages out and the peer's turns stay
    its excess, which the straggler's table maps to."""
    sizes, at, local, _, peer = _rows_of(colls.g_start, g, colls.m_rank, slow)
    n_peer = np.bincount(local[peer], minlength=len(g))
    sel = np.flatnonzero((n_peer > 0) & (sizes <= FEW_MEMBERS))
    if not len(sel):
        return None
    med, _ = group_medians(gaps[at][peer], local[peer], len(g))
    site = colls.m_site[rows[sel]].astype(np.int64)
    o = np.lexsort((colls.g_last_ns[g[sel]], site))  # by call site, then time
    x, s_o = med[sel][o], site[o]
    head = np.flatnonzero(np.r_[True, s_o[1:] != s_o[:-1]])
    end = np.r_[head[1:], len(o)]
    block = np.repeat(np.arange(len(head)), end - head)
    i = np.arange(len(o))
    lo = np.maximum(head[block], i - REF_WINDOW // 2)
    hi = np.minimum(end[block], i + REF_WINDOW // 2)
    cs = np.r_[0.0, np.cumsum(x)]
    ref = np.full(len(colls), np.nan)
    ref[g[sel][o]] = (cs[hi] - cs[lo]) / (hi - lo)
    return ref


def _like_peers_p2p(run: Run, colls: Collectives, slow: np.ndarray,
                    ranks: list[int]) -> dict[int, tuple[np.ndarray, np.ndarray]]:  # fmt: skip
    """:func:`_like_peers` at the point-to-point exchanges (a halo's: each rank's k-th replayed
    call between two collectives, :func:`distdiag.replay.p2p_work`), for the replay's pace there
    (``Change.like_p2p``). A table of its own: work before an exchange is not work between
    collectives (in a halo with an all-reduce every other step, a neighbour's time between
    collectives holds its waits for the straggler)."""
    from distdiag.links import p2p_transfers
    from distdiag.replay import model_of, p2p_work

    if not ranks or not len(p2p_transfers(run)["send_row"]):
        return {}
    got = p2p_work(model_of(run, colls))
    if got is None or not len(got[0]):
        return {}
    grp, _, rank, seg = got
    start = np.searchsorted(grp, np.arange(int(grp[-1]) + 2))  # an exchange's events are one slice
    out: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for r in ranks:  # the blamed ranks: few
        table = _excess_table(seg, rank, start, grp[rank == r], slow, r)
        if table is not None:
            out[r] = table
    return out


def _excess_table(v: np.ndarray, rank: np.ndarray, start: np.ndarray, g: np.ndarray, slow: np.ndarray,
                  r: int, ref: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray] | None:  # fmt: skip
    """Rank ``r``'s table (:func:`distdiag.replay.peer_excess`) read off up to ``_TABLE_GROUPS`` of
    its groups ``g`` (ascending), evenly spread: per group (rows ``start[g]:start[g + 1]`` of the
    values ``v`` and their ``rank``), its value and the others' that are not ``slow``, less the
    median of those, or less ``ref[group]`` where that is given (:func:`_peer_ref`). None where no
    group has both."""
    if not len(g):
        return None
    g = g[np.unique(np.linspace(0, len(g) - 1, min(len(g), _TABLE_GROUPS)).round().astype(np.int64))]
    _, at, local, rk, peer = _rows_of(start, g, rank, slow)
    pace, has = group_medians(v[at][peer], local[peer], len(g))
    if ref is not None:
        rg = ref[g]
        pace = np.where(np.isfinite(rg), rg, pace)
    mine = (rk == r) & has[local]
    on = peer & has[local]
    if not mine.any() or not on.any():
        return None
    return peer_excess(v[at][mine] - pace[local[mine]], v[at][on] - pace[local[on]])


def _rows_of(start: np.ndarray, g: np.ndarray, rank: np.ndarray,
             slow: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
    """The rows of the groups ``g`` (rows ``start[g]:start[g + 1]``, their ``rank``): (each group's
    size, the rows, each row's group among ``g``, its rank, whether that rank is not ``slow``)."""
    sizes = (start[g + 1] - start[g]).astype(np.int64)
    at = np.repeat(start[g] - (np.cumsum(sizes) - sizes), sizes) + np.arange(int(sizes.sum()), dtype=np.int64)
    local = np.repeat(np.arange(len(g), dtype=np.int64), sizes)
    rk = rank[at].astype(np.int64)
    peer = ~slow[np.minimum(rk, len(slow) - 1)] & (rk < len(slow))
    return sizes, at, local, rk, peer


#: a host is a straggler of its own when all its ranks in a collective arrived after every other
#: host's last at this share of the collectives it was last at, or more
HOST_TOGETHER = 0.8


def _late_together(colls: Collectives, host_of_rank: np.ndarray, groups: np.ndarray, other_max: np.ndarray,
                   h_last: np.ndarray) -> np.ndarray:  # fmt: skip
    """Per group of ``groups`` (ascending): True where every member on its last arriver's host
    (``h_last``) arrived after the last arrival from any other host (``other_max``), by blocks of
    whole groups."""
    early = np.zeros(len(colls), bool)  # per group: one of the last host's ranks came before the others' last
    for g_lo, g_hi, a, b in group_blocks(colls):  # per block of ~2^18 member rows
        grp = colls.m_group[a:b].astype(np.int64)
        mine = host_of_rank[colls.m_rank[a:b]] == h_last[grp]
        bad = mine & (colls.m_t0_ns[a:b] <= other_max[grp])
        if bad.any():
            early[np.unique(grp[bad])] = True
    out: np.ndarray = ~early[groups]
    return out


def _hosts_per_group(colls: Collectives, host_of_rank: np.ndarray, use: np.ndarray, n_hosts: int,
                     wanted: list[int]) -> np.ndarray:
    """Per host: how many of the ``use`` groups it took part in, counted for the
    ``wanted`` hosts only (the reported ones: few; 0 for the others), by blocks of
    whole groups (distinct (group, host) pairs: groups never span blocks)."""
    n_part = np.zeros(n_hosts, np.int64)
    want = np.isin(host_of_rank, np.asarray(wanted, np.int64))  # per rank
    for g_lo, g_hi, a, b in group_blocks(colls):  # per block of ~262,144 member rows
        u = use[g_lo:g_hi]
        if not u.any():
            continue
        sel = want[colls.m_rank[a:b]]
        sel &= np.repeat(u, np.diff(colls.g_start[g_lo : g_hi + 1]))
        if sel.any():
            gh = colls.m_group[a:b][sel].astype(np.int64)  # m_group is int32: widened before the product
            gh -= g_lo
            gh *= n_hosts
            gh += host_of_rank[colls.m_rank[a:b][sel]]
            n_part += np.bincount(np.unique(gh) % n_hosts, minlength=n_hosts)
    return n_part


