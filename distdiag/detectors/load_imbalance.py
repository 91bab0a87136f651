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

Not in scope: the rooted one-to-many and many-to-one collectives (bcast, reduce: whether
a member's lateness holds anyone depends on the root), point-to-point calls (a halo
exchange's imbalance stays in the coverage's line), each rank's first collective (launch
skew: ``startup``, ``launch_overhead``).

Reported when the load balance is under ``max_balance`` (0.8; the line under which
POP's reports flag an efficiency: a healthy run of 4 ranks with ±1 ms of jitter on 5 ms
of work measured 0.89), the price is ``min_fraction`` (0.05) of the wall-clock, and no
rank takes ``max_top_share`` (0.67) of it (a rank late most of the time is a straggler or
a serial section, which their detectors price). The ranking removes it after every other
cause (``Role.removal`` 4): it keeps only what they leave.
Settings (``[analyze.load_imbalance]``): ``max_balance``, ``min_fraction``, ``max_top_share``.
"""

from __future__ import annotations

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

ADVICE = (
    "spread the work of each step evenly over the ranks: partition by cost rather than by count (bucket or "
    "pack variable-length samples by length, weight mesh partitions by their work), hand out work "
    "dynamically, or give the rank that has the extra duty this step less of the shared work; if every "
    "rank is given the same work, the variation is the machine's (OS noise, frequency scaling, memory "
    "placement): pin the ranks to cores and keep system services off them"
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
    if not ok.any():
        return []
    # a DDP step's work begins where its previous step's buckets completed
    gs, mx, mean, top = _most_loaded(colls, np.asarray(member_gaps_ns(run, colls, async_exits=True)), ok)
    excess = np.maximum(mx - mean, 0.0)
    cost_s = float(excess.sum()) / 1e9
    balance = float(mean.sum() / mx.sum()) if mx.sum() > 0 else 1.0
    if balance >= max_balance or cost_s < min_fraction * wall_s:
        return []
    n = int(max(int(run.world_size), int(colls.m_rank.max()) + 1))
    per_rank = np.bincount(top, weights=excess, minlength=n)
    top_rank = int(np.argmax(per_rank))
    top_share = float(per_rank[top_rank] / excess.sum()) if excess.sum() > 0 else 1.0
    if top_share > max_top_share:
        return []  # one rank most of the time: the straggler's or the serial section's
    n_top = int(np.count_nonzero(per_rank > 0))
    last_row = colls.g_start[1:][gs] - 1  # the groups' last arrivers' rows: their op and call site
    summary = (
        f"load imbalance: at {len(gs)} collectives the ranks waited for the most-loaded member, "
        f"{n_top} different ranks in turn (none holding more than {top_share:.0%} of the wait); "
        f"the work between collectives is balanced to {balance:.0%} (mean / max), and spread evenly "
        f"it would save {secs(cost_s)}"
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
            "collectives": int(len(gs)),
            "most_loaded_ranks": n_top,
            "top_rank": top_rank,
            "top_rank_share": round(top_share, 4),
            "excess_s_per_collective": {"median": round(float(np.median(excess)) / 1e9, 6),
                                        "max": round(float(excess.max()) / 1e9, 6)},  # fmt: skip
            "per_op": tally(colls.m_op[last_row], excess, run, limit=5, key="excess_s", ndigits=4),
            "top_sites": tally(colls.m_site[last_row], excess, run, limit=5, key="excess_s", ndigits=4),
            "counterfactual": COUNTERFACTUAL,
        },
        change=Change("the work before each collective every member waits for spread evenly over its members",
                      balance=True),  # fmt: skip
    )
    return [f]


def _most_loaded(colls: Collectives, work_ns: np.ndarray,
                 ok: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
    """For the groups ``ok``: (their indices, their members' largest and mean work in ns, the rank of
    their first member with the largest), by blocks of groups (members come group by group, so a
    block's are one slice: its temporaries stay a few MB, whatever the run's size)."""
    out: list[tuple[np.ndarray, ...]] = []
    for g_lo, g_hi, a, b in group_blocks(colls):  # per block of ~2^18 members
        sizes = np.diff(colls.g_start[g_lo : g_hi + 1])
        ne = sizes > 0  # reduceat's segments: the block's groups that have members
        keep = ok[g_lo:g_hi][ne]
        if not keep.any():
            continue
        w = work_ns[a:b]
        st = (colls.g_start[g_lo:g_hi] - a)[ne]
        mx = np.maximum.reduceat(w, st)
        mean = np.add.reduceat(w, st) / sizes[ne]
        mg = np.repeat(np.arange(len(st)), sizes[ne])  # each member's group among them
        at = np.flatnonzero(w == mx[mg])
        first = at[np.r_[True, mg[at][1:] != mg[at][:-1]]]  # one a group: its first member at the largest
        out.append((np.flatnonzero(ne)[keep] + g_lo, mx[keep].astype(np.float64), mean[keep],
                    colls.m_rank[a:b][first][keep].astype(np.int64)))  # fmt: skip
    return tuple(np.concatenate([o[i] for o in out]) for i in range(4))  # type: ignore[return-value]
