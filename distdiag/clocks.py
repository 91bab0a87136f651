"""Clock alignment: map every rank's timestamps onto rank 0's timeline.

Each rank stamps events with its own monotonic clock, whose zero is arbitrary
(boot time, per node). The shim measures, against the reference rank, clock
exchanges: this rank sends at ``t_send`` and gets the reply at ``t_recv`` (its
clock), the reference stamped ``t_ref`` (its clock) in between. Assuming the
two legs take equal time, the reference clock read ``t_ref`` at local time
``(t_send + t_recv) / 2``, so

    offset = t_ref - (t_send + t_recv) / 2        local + offset = reference

and the error of that estimate is at most half the round trip, so the sample
with the smallest RTT is the best one. Worked example: send at 1000, reply at
1040 (RTT 40 ns), reference stamped 5030: offset = 5030 - 1020 = 4010; the
true offset lies within 4010 ± 20.

This first version fits one constant offset per rank (no drift). Without
samples it falls back to the system clocks: each rank recorded
``wall_ns_at_start`` (time.time_ns) and ``mono_ns_at_start`` (the event clock)
at the same instant, so ``wall - mono`` maps the rank's clock onto wall time,
and the difference to rank 0's ``wall - mono`` maps it onto rank 0's clock --
as good as NTP between the nodes (milliseconds), which is stated as a warning.
"""

from __future__ import annotations

import logging

import numpy as np

from distdiag.run import Run, _ranges

log = logging.getLogger(__name__)


def _min_rtt_offsets(run: Run, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(offset_ns, has_sample) per rank from the min-RTT sync sample, vectorized."""
    off = np.zeros(n, np.int64)
    has = np.zeros(n, bool)
    s = run.sync
    if len(s) == 0:
        return off, has
    rtt = s["t_recv_ns"] - s["t_send_ns"]
    ok = (rtt >= 0) & (s["rank"] >= 0) & (s["rank"] < n)
    s, rtt = s[ok], rtt[ok]
    if len(s) == 0:
        return off, has
    order = np.lexsort((rtt, s["rank"]))  # per rank, smallest RTT first
    s = s[order]
    ranks, first = np.unique(s["rank"], return_index=True)
    best = s[first]
    # (t_send + t_recv) / 2 without overflowing int64
    mid = best["t_send_ns"] + (best["t_recv_ns"] - best["t_send_ns"]) // 2
    off[ranks] = best["t_ref_ns"] - mid
    has[ranks] = True
    return off, has


def align(run: Run) -> Run:
    """A new Run whose event, in-flight and GPU times and rank bounds are on rank 0's clock."""
    if run.aligned:
        return run
    n = max(run.world_size, max(run.ranks, default=-1) + 1)
    off, has = _min_rtt_offsets(run, n)
    warnings = list(run.warnings)
    present = sorted(run.ranks)
    ref = 0 if 0 in run.ranks else (present[0] if present else 0)
    if 0 in run.ranks:
        off[0] = 0
        has[0] = True  # the reference needs no sample
    need = [r for r in present if not has[r]]
    if need:
        ref_info = run.ranks.get(ref)
        ref_map = None
        if ref_info is not None and ref_info.wall_ns_at_start is not None and ref_info.mono_ns_at_start is not None:
            ref_map = ref_info.wall_ns_at_start - ref_info.mono_ns_at_start
        fell_back = []
        for r in need:  # ranks without samples: a handful
            i = run.ranks[r]
            if ref_map is not None and i.wall_ns_at_start is not None and i.mono_ns_at_start is not None:
                off[r] = (i.wall_ns_at_start - i.mono_ns_at_start) - ref_map
                fell_back.append(r)
        if fell_back and len(present) > 1:
            warnings.append(
                f"no clock-sync samples for ranks {_ranges(fell_back)}: their alignment rests on the system clocks "
                "(NTP, typically off by milliseconds); waits shorter than that are not trustworthy"
            )
        unaligned = sorted(set(need) - set(fell_back))
        if unaligned and len(present) > 1:
            warnings.append(f"ranks {_ranges(unaligned)} have neither clock-sync samples nor start times: left unaligned")

    ev = run.events.copy()
    shift = off[ev["rank"]]
    ev["t0_ns"] += shift
    ev["t1_ns"] += shift
    inf = run.inflight.copy()
    inf["t0_ns"] += off[inf["rank"]]  # t1 == -1 (never left) stays -1
    gpu = run.gpu.copy()
    gpu["t_ns"] += off[gpu["rank"]]
    import dataclasses

    ranks = {
        r: dataclasses.replace(i, start_ns=i.start_ns + int(off[r]), end_ns=i.end_ns + int(off[r]))
        for r, i in run.ranks.items()
    }
    return run.replace(
        events=ev, inflight=inf, gpu=gpu, ranks=ranks, warnings=warnings, aligned=True, offset_ns=off
    )
