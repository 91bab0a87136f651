"""small_collectives: the ranks call small collectives back to back, and each call costs its
latency whatever it carries.

A job that all-reduces its values one by one (a metric per call, a gradient per parameter
without DDP's buckets, a loop over a list of scalars) pays a collective's per-call latency
(the rendezvous, the protocol's round trips: tens of microseconds on a fabric, more with a
busy core) once per value. Before, such a job read "no cause priced": 100,000 all-reduces
of 64 bytes on 4 ranks took 3.59 s, the same bytes in 50 calls 0.006 s, and only a ``binds:``
line said that collective transfers held the run. network_bound leaves them out on purpose:
its collectives take a millisecond or more (a shorter transfer is no measure of a link).

Which collectives (:func:`distdiag.links.small_bursts`, network_bound's exclusion too): complete
ones of two or more members, blocking or not, that move at most ``max_bytes`` (64 KiB) a
member, that repeat their communicator's previous collective's op, and that follow the
members' previous collective directly: no member worked longer than ``max_gap_us`` (1 ms)
since its previous collective's exit or completion (:func:`distdiag.match.member_gaps_ns`),
nor longer than the call itself took (last arrival to last exit): then nothing but the loop
stands between the calls, and they could be one. The first call of each such burst is not
one of them: it stays, as the fused call. Non-blocking calls cost their latency as well:
``Iallreduce(...).Wait()`` one by one, or a step's 2,000 ``Iallreduce`` then one ``Waitall``
(before, that one read ``network_bound`` at "0.0 MB/s", and this one nothing).

Cost (the price, :class:`distdiag.replay.Change` ``transfer_cut_ns``): the burst fused into its
first call, replayed: the other calls' transfers (last arrival to exit) take no time, and the
waits at them go with the arrivals they no longer spread. A non-blocking burst's first call
goes too: its completion is seen only where the ranks wait for the whole burst, so its
recorded transfer is the burst's (the one fused call's own latency, tens of microseconds, is
left out). The loop's own time between the calls is kept (fused, it would go too: the price is
a lower bound of that much). The detector's own price, the union of the calls' transfers, is
the check beside it.

Worked example: 4 ranks, 100,000 all-reduces of 8 doubles back to back, 36 us a call on 2
cores: 99,991 of them follow the previous one within 1 us; replayed without their transfers
the run ends 3.47 s sooner; the same job with the same bytes in 50 calls ran 3.58 s shorter.

Not in scope: small collectives with work between them (a step's one all-reduce: it cannot
be fused with the next step's, which needs this one's result; a non-blocking one's latency
overlaps that work).

Settings (``[analyze.small_collectives]``): ``min_fraction`` (0.05), ``max_bytes`` (65536),
``max_gap_us`` (1000).
"""

from __future__ import annotations

import numpy as np

from distdiag.analysis import Analysis
from distdiag.detectors import register
from distdiag.evidence import secs, tally
from distdiag.findings import Finding
from distdiag.links import small_bursts, small_limits, union_s
from distdiag.replay import Change
from distdiag.roles import Role
from distdiag.schema import Kind

ADVICE = (
    "fuse the small collectives into fewer, larger ones: gather the values into one buffer and call "
    "once (MPI: one Allreduce of an array, not one per value; PyTorch: flatten the tensors into one, "
    "all-reduce the step's metrics together, keep DDP's gradient buckets, or make them larger with "
    "bucket_cap_mb)"
)

COUNTERFACTUAL = (
    "the small collectives that follow their previous one directly fused into the first of each burst: "
    "the others' transfers taking no time (the loop's own time between them kept)"
)

#: a transfer cut longer than any transfer: the call takes no time
_NO_TIME_NS = 1 << 60


@register("small_collectives", requires=("collectives",), role=Role(removal=2))
def detect(an: Analysis) -> list[Finding]:
    run, cfg, colls = an.run, an.cfg, an.colls
    wall_s = float(run.wall_s)
    if len(colls) == 0 or wall_s <= 0 or len(colls.m_t1_ns) == 0:
        return []
    min_fraction = float(cfg.value("small_collectives", "min_fraction", 0.05))
    b = small_bursts(run, colls, *small_limits(cfg))
    fused, xfer = b.fused, b.tail
    # the calls' transfers, each second once: a non-blocking burst's calls complete together, in its wait
    det_s = union_s(colls.g_last_ns[b.cut], colls.g_last_ns[b.cut] + xfer[b.cut])
    if not fused.any() or det_s < min_fraction * wall_s:
        return []
    g = np.flatnonzero(fused)
    n_calls = len(g)
    bursts = int(np.count_nonzero(~fused[np.maximum(g - 1, 0)] | (g == 0)))  # calls whose predecessor stays
    row = colls.g_start[:-1][g]  # each group's first member row: its op and call site
    # a call's time: its transfer; a non-blocking one's completes with its burst's in the wait, so
    # each of them is its share of the calls' union
    n_cut = int(np.count_nonzero(b.cut))
    each = np.where(colls.m_kind[row] == Kind.COLL_ASYNC, det_s * 1e9 / max(n_cut, 1), xfer[g]).astype(np.float64)
    per_call_us = float(np.median(each)) / 1e3
    size = int(np.median(colls.m_nbytes.group_max()[g]))
    per_op = tally(colls.m_op[row], each, run, limit=5, key="transfer_s", ndigits=4)
    top_op = next(iter(per_op), "collective")
    summary = (
        f"{n_calls:,} small collectives ({top_op} of ~{size:,} bytes a member) called back to back, "
        f"{per_call_us:.3g} us a call: each costs its per-call latency whatever it carries; fused, "
        f"the job would save {secs(det_s)}"
    )
    return [
        Finding(
            kind="small_collectives",
            cost_s=det_s,
            summary=summary,
            ranks=[],
            hosts=[],
            advice=ADVICE,
            evidence={
                "calls": n_calls,
                "bursts": bursts,
                "median_bytes": size,
                "median_call_us": round(per_call_us, 3),
                "detector_cost_s": round(det_s, 4),
                "per_op": per_op,
                "top_sites": tally(colls.m_site[row], each, run, limit=5, key="transfer_s", ndigits=4),
                "counterfactual": COUNTERFACTUAL,
            },
            change=Change("the small collectives called back to back fused into one call per burst",
                          transfer_cut_ns=np.where(b.cut, _NO_TIME_NS, 0).astype(np.int64)),
        )
    ]
