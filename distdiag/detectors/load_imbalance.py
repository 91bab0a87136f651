"""load_imbalance: the ranks wait at their collectives for whichever rank got the most work
this time, and no rank is the one that is always late.

A straggler is a rank slower at the work every rank does; a serial section is one rank
working while the others wait. A load imbalance that moves between ranks is neither: at
each collective some rank does more than the others (a variable-length batch, an uneven
mesh partition, a rotating duty), a different one each time, so every rank is last about
as often and the straggler detector rightly names none. The ranks then spend much of the
run waiting in collectives that no finding explained, and the report said "healthy".

Measure: at each collective every member waits for (all-reduce, barrier, all-gather, ...,
blocking or not: a DDP job's gradient buckets), each member's *work* is its own time since
its previous collective's exit, a non-blocking one's completion included
(:func:`distdiag.match.member_gaps_ns` with ``async_exits``). The collective costs the job ``max - mean`` of
its members' work: with the same work spread evenly, every member would arrive at the
mean. Over the run, the load balance is ``sum(mean) / sum(max)`` (the POP Centre of
Excellence's load-balance efficiency, here per collective: 1 is perfectly balanced).

Counterfactual (the price, :class:`distdiag.replay.Change` ``balance``): at each such
collective the members' work before it at their mean (the work rebalanced, its total
kept), replayed; a non-blocking collective's members launch after their group's mean
segment. The detector's own price, ``sum(max - mean)``, is the check beside it.

Worked example: 4 ranks compute 20 ms a step, and at step i rank ``i % 4`` computes
40 ms more. Each all-reduce waits for a 60 ms rank while the others did 20 ms: the mean
is 30 ms, so each step costs 30 ms; 40 steps cost 1.2 s, the load balance is 30/60 =
0.5. The same job with the extra work spread evenly (10 ms more on every rank each step)
ran 1.19 s shorter.

Point-to-point exchanges count too (a halo, where each step's work ends in ``Sendrecv`` or
``Isend``/``Irecv`` + ``Waitall`` with the neighbours: the ranks wait there, not at a
collective): every rank's k-th replayed point-to-point call between two collectives is one
exchange (:func:`distdiag.replay.p2p_work`), each rank's work before it its own time since its
previous rendezvous, and it weighs in the load balance and the top rank's share as a collective
does. Counterfactual (``Change.balance_p2p``): that work at the exchange's mean too. A rank
there waits for its neighbours only, and a late rank's delay spreads or dies out along them,
so ``sum(max - mean)`` is no price: the replay's is (a 4-rank line, each step's duty rotating:
0.84 s saved, 0.84 priced, 1.21 summed).

Not in scope: the rooted one-to-many and many-to-one collectives (bcast, reduce: whether
a member's lateness holds anyone depends on the root), each rank's first collective or
exchange (launch skew: ``startup``, ``launch_overhead``).

Reported when the load balance is under ``max_balance`` (0.8; the line under which
POP's reports flag an efficiency: a healthy run of 4 ranks with ±1 ms of jitter on 5 ms
of work measured 0.89), the price is ``min_fraction`` (0.05) of the wall-clock, and no
rank takes ``max_top_share`` (0.67) of it (a rank late most of the time is a straggler or
a serial section, which their detectors price). The ranking removes it after every other
cause (``Role.removal`` 4): it keeps only what they leave.
Settings (``[analyze.load_imbalance]``): ``max_balance``, ``min_fraction``, ``max_top_share``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from distdiag.analysis import Analysis
from distdiag.detectors import register
from distdiag.evidence import secs, tally
from distdiag.findings import Finding
from distdiag.lateness import EVERY_MEMBER, startup_groups, wait_scheme
from distdiag.match import Collectives, MatchState, group_blocks, member_gaps_ns
from distdiag.replay import Change
from distdiag.roles import Role
from distdiag.schema import Kind

if TYPE_CHECKING:
    from distdiag.run import Run

ADVICE = (
    "spread the work of each step evenly over the ranks: partition by cost rather than by count (bucket or "
    "pack variable-length samples by length, weight mesh partitions by their work), hand out work "
    "dynamically, or give the rank that has the extra duty this step less of the shared work; if every "
    "rank is given the same work, the variation is the machine's (OS noise, frequency scaling, memory "
    "placement): pin the ranks to cores and keep system services off them"
)

COUNTERFACTUAL_P2P = (
    "; at each point-to-point exchange (every rank's k-th call between two collectives: a halo's), the "
    "ranks' work since their previous rendezvous at its mean"
)

COUNTERFACTUAL = (
    "at each collective every member waits for (not the rooted ones), the members' work since their previous "
    "collective at its mean: the same work spread evenly over them"
)


@register("load_imbalance", requires=("collectives",), role=Role(removal=4))
def detect(an: Analysis) -> list[Finding]:
    run, cfg, colls = an.run, an.cfg, an.colls
    wall_s = float(run.wall_s)
    if len(colls) == 0 or wall_s <= 0:
        return []
    max_balance = float(cfg.value("load_imbalance", "max_balance", 0.8))
    min_fraction = float(cfg.value("load_imbalance", "min_fraction", 0.05))
    max_top_share = float(cfg.value("load_imbalance", "max_top_share", 0.67))

    sizes = np.diff(colls.g_start)
    coll = np.zeros(len(colls), bool)
    nz = sizes > 0
    kind = colls.m_kind[colls.g_start[:-1][nz]]  # a group's members share their kind
    coll[nz] = (kind == Kind.COLL) | (kind == Kind.COLL_ASYNC)
    ok = (colls.g_state == MatchState.COMPLETE) & (colls.g_n_members >= 2) & coll
    ok &= ~startup_groups(colls) & (wait_scheme(run, colls) == EVERY_MEMBER)
    p2p = _exchanges(run, colls, min_fraction * wall_s)
    if not ok.any() and p2p is None:
        return []
    # a DDP step's work begins where its previous step's buckets completed
    work = np.asarray(member_gaps_ns(run, colls, async_exits=True))
    gs, mx, mean, top = _most_loaded(colls, work, ok)
    n_coll = len(gs)
    last_row = colls.g_start[1:][gs] - 1  # the groups' last arrivers' rows: their op and call site
    ops, sites = colls.m_op[last_row], colls.m_site[last_row]
    if p2p is not None:
        mx, mean, top = np.r_[mx, p2p.mx], np.r_[mean, p2p.mean], np.r_[top, p2p.top]
        ops, sites = np.r_[ops, p2p.op], np.r_[sites, p2p.site]
    if len(mx) == 0:
        return []
    excess = np.maximum(mx - mean, 0.0)
    cost_s = float(excess.sum()) / 1e9
    balance = float(mean.sum() / mx.sum()) if mx.sum() > 0 else 1.0
    if balance >= max_balance or cost_s < min_fraction * wall_s:
        return []
    n = int(max(int(run.world_size), int(colls.m_rank.max()) + 1))
    per_rank = np.bincount(top, weights=excess, minlength=n)
    top_rank = int(np.argmax(per_rank))
    top_share = float(per_rank[top_rank] / excess.sum()) if excess.sum() > 0 else 1.0
    if top_share > max_top_share and (p2p is not None or not _moves_without_offsets(
            colls, work, ok, n, max_top_share, max_balance, min_fraction * wall_s)):  # fmt: skip
        return []  # one rank most of the time: the straggler's or the serial section's
    n_top = int(np.count_nonzero(per_rank > 0))
    n_p2p = len(excess) - n_coll
    where = f"{n_coll} collective{'s' if n_coll != 1 else ''}"
    if n_p2p:
        where += f" and {n_p2p} point-to-point exchange{'s' if n_p2p != 1 else ''}"
    # At collectives every member waits for the last: sum(max - mean) is what spreading the work
    # saves. At a halo's exchanges a rank waits for its neighbours only, and a late rank's delay
    # spreads or dies out along them: only the replay says what it costs (an open line's ends wait
    # for one neighbour: 0.84 s saved where sum(max - mean) is 1.21)
    saves = f"and spread evenly it would save {secs(cost_s)}" if not n_p2p else "and the replay prices spreading it evenly"
    summary = (
        f"load imbalance: at {where} the ranks waited for the most-loaded member, "
        f"{n_top} different ranks in turn (none holding more than {top_share:.0%} of the wait); "
        f"the work between {'rendezvous' if n_p2p else 'collectives'} is balanced to {balance:.0%} (mean / max), "
        f"{saves}"
    )
    f = Finding(
        kind="load_imbalance",
        cost_s=cost_s,
        summary=summary,
        ranks=[],
        hosts=[],
        advice=ADVICE,
        evidence={
            "load_balance": round(balance, 4),
            "collectives": n_coll,
            "p2p_exchanges": n_p2p,
            "most_loaded_ranks": n_top,
            "top_rank": top_rank,
            "top_rank_share": round(top_share, 4),
            "excess_s_per_collective": {"median": round(float(np.median(excess)) / 1e9, 6),
                                        "max": round(float(excess.max()) / 1e9, 6)},  # fmt: skip
            "per_op": tally(ops, excess, run, limit=5, key="excess_s", ndigits=4),
            "top_sites": tally(sites, excess, run, limit=5, key="excess_s", ndigits=4),
            "counterfactual": COUNTERFACTUAL + (COUNTERFACTUAL_P2P if n_p2p else ""),
        },
        change=Change("the work before each collective every member waits for spread evenly over its members"
                      + (", and before each point-to-point exchange over its ranks" if n_p2p else ""),
                      balance=True, balance_p2p=n_p2p > 0),  # fmt: skip
    )
    return [f]


@dataclass(frozen=True)
class _Exchanges:
    """The point-to-point exchanges (:func:`distdiag.replay.p2p_work`): per exchange, its ranks'
    largest and mean work (ns), the rank of its first event at the largest, and that event's op
    and call site (string ids)."""

    mx: np.ndarray
    mean: np.ndarray
    top: np.ndarray
    op: np.ndarray
    site: np.ndarray


def _exchanges(run: Run, colls: Collectives, min_s: float) -> _Exchanges | None:
    """The run's point-to-point exchanges, as the replay model groups them (a halo: each rank's
    k-th call between two collectives), with each rank's work before its call: its own time
    since its previous rendezvous. None when the run replays none, or no rank spent ``min_s``
    inside them."""
    from distdiag.links import p2p_transfers
    from distdiag.replay import model_of, p2p_work

    if not len(p2p_transfers(run)["send_row"]):
        return None
    m = model_of(run, colls)
    W = m.waits
    if W is None or W.p2p is None:
        return None
    # waiting at exchanges is time inside them: where no rank spent min_s there, no imbalance at
    # them can cost that much, and the plain replay that reads the work before them is spared
    held = np.bincount(W.rank[W.p2p], weights=(W.exit_ns - W.entry_ns)[W.p2p])
    if not len(held) or float(held.max()) < min_s * 1e9:
        return None
    got = p2p_work(m)
    if got is None or not len(got[0]):
        return None
    grp, ev, rank, seg = got
    assert W.p2p_row_event is not None and W.p2p_site is not None
    st = np.flatnonzero(np.r_[True, grp[1:] != grp[:-1]])
    size = np.diff(np.r_[st, len(grp)])
    mx = np.maximum.reduceat(seg, st)
    mean = np.add.reduceat(seg, st) / size
    at = np.flatnonzero(seg == mx[grp])
    first = at[np.r_[True, grp[at][1:] != grp[at][:-1]]]  # one an exchange: its first event at the largest
    row = np.full(len(W.rank), -1, np.int64)
    np.maximum.at(row, W.p2p_row_event, W.p2p_rows)  # an event's last row: a Sendrecv's, a post's, a wait's
    top_row = row[ev[first]]
    op = np.where(top_row >= 0, run.events["name_id"][np.maximum(top_row, 0)], 0).astype(np.int64)
    return _Exchanges(mx.astype(np.float64), mean, rank[first], op, W.p2p_site[ev[first]])


def _moves_without_offsets(colls: Collectives, work_ns: np.ndarray, ok: np.ndarray, n: int, max_top_share: float,
                           max_balance: float, min_s: float) -> bool:  # fmt: skip
    """Whether the groups ``ok`` are still an imbalance that moves (no rank over ``max_top_share`` of
    the excess, the balance under ``max_balance``, the excess ``min_s`` or more) once each rank's
    constant lead or lag is taken out of its work: its mean work over its groups' means.

    A rank late at most collectives is the straggler's (or the serial section's) to price, unless a
    duty that rotates holds the ranks beside it: 2 ranks, 40 ms more on rank ``step % 2``, rank 1
    20 ms slower every step, and rank 1 takes 75% of the excess (30 ms at its turns, 10 at the
    other's); without its 10 ms of lag over the mean, each rank takes half. A straggler alone
    leaves its jitter, a serial section every 5th collective most of its lone work."""
    _, mx, mean, top = _most_loaded(colls, work_ns, ok, shift=_offsets(colls, work_ns, ok, n))
    excess = np.maximum(mx - mean, 0.0)
    total = float(excess.sum())
    if total < min_s * 1e9 or mx.sum() <= 0 or float(mean.sum() / mx.sum()) >= max_balance:
        return False
    return float(np.bincount(top, weights=excess, minlength=n).max()) / total <= max_top_share


def _offsets(colls: Collectives, work_ns: np.ndarray, ok: np.ndarray, n: int) -> np.ndarray:
    """Per rank: its mean work over its groups' mean work (ns) at the groups ``ok``, by blocks of groups."""
    total, count = np.zeros(n), np.zeros(n)
    for g_lo, g_hi, a, b in group_blocks(colls):  # per block of ~2^18 members
        sizes = np.diff(colls.g_start[g_lo : g_hi + 1])
        ne = sizes > 0
        keep = ok[g_lo:g_hi][ne]
        if not keep.any():
            continue
        w = work_ns[a:b].astype(np.float64)
        st = (colls.g_start[g_lo:g_hi] - a)[ne]
        mg = np.repeat(np.arange(len(st)), sizes[ne])
        use = keep[mg]
        rk = colls.m_rank[a:b][use].astype(np.int64)
        total += np.bincount(rk, weights=(w - (np.add.reduceat(w, st) / sizes[ne])[mg])[use], minlength=n)
        count += np.bincount(rk, minlength=n)
    out: np.ndarray = total / np.maximum(count, 1)
    return out


def _most_loaded(colls: Collectives, work_ns: np.ndarray, ok: np.ndarray,
                 shift: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
    """For the groups ``ok``: (their indices, their members' largest and mean work in ns, the rank of
    their first member with the largest), by blocks of groups (members come group by group, so a
    block's are one slice: its temporaries stay a few MB, whatever the run's size). ``shift``: per
    rank, ns taken off its members' work first."""
    out: list[tuple[np.ndarray, ...]] = []
    for g_lo, g_hi, a, b in group_blocks(colls):  # per block of ~2^18 members
        sizes = np.diff(colls.g_start[g_lo : g_hi + 1])
        ne = sizes > 0  # reduceat's segments: the block's groups that have members
        keep = ok[g_lo:g_hi][ne]
        if not keep.any():
            continue
        w = work_ns[a:b] if shift is None else work_ns[a:b] - shift[colls.m_rank[a:b]]
        st = (colls.g_start[g_lo:g_hi] - a)[ne]
        mx = np.maximum.reduceat(w, st)
        mean = np.add.reduceat(w, st) / sizes[ne]
        mg = np.repeat(np.arange(len(st)), sizes[ne])  # each member's group among them
        at = np.flatnonzero(w == mx[mg])
        first = at[np.r_[True, mg[at][1:] != mg[at][:-1]]]  # one a group: its first member at the largest
        out.append((np.flatnonzero(ne)[keep] + g_lo, mx[keep].astype(np.float64), mean[keep],
                    colls.m_rank[a:b][first][keep].astype(np.int64)))  # fmt: skip
    if not out:
        z = np.zeros(0, np.int64)
        return z, np.zeros(0), np.zeros(0), z
    return tuple(np.concatenate([o[i] for o in out]) for i in range(4))  # type: ignore[return-value]
