"""Clock alignment: map every rank's timestamps onto rank 0's timeline.

Each rank stamps events with its own monotonic clock, whose zero is arbitrary
(boot time, per node) and whose rate differs from the other nodes' by up to
~100 ppm. The shim (:mod:`distdiag.shim.clock`) measures clock exchanges
against the reference rank 0: this rank sends at ``t_send`` and gets the reply
at ``t_recv`` (its clock); the reference stamped ``t_ref`` (its clock) in
between. Whatever the two legs take, the reference read ``t_ref`` at some
local instant in ``[t_send, t_recv]``, so

    offset = t_ref - (t_send + t_recv) / 2        local + offset = reference

is right to within half the round trip (RTT). Worked example: send at 1000,
reply at 1040 (RTT 40 ns), reference stamped 5030: offset = 5030 - 1020 =
4010; the true offset lies within 4010 +- 20. So the sample with the smallest
RTT is the best one, and the RTT is its error bar.

The model, per rank (:func:`fit`):

1. *Knots.* Samples come in rounds (start, every ``sync_interval_s``, exit).
   Per round ("window") keep the one exchange with the smallest RTT: a knot
   ``(x = local mid time, y = offset, e = RTT/2)``. Knots much worse than the
   rank's best (a reference whose thread waited for the GIL) are dropped.
2. *Offset + drift.* A weighted least-squares line ``y = a + b x`` through the
   knots (weights ``1/e^2``). If every knot lies within its own error bar of
   the line, the clock pair is linear over the run and the line is the model
   (it averages the knots' noise). If not (NTP slewed a clock, temperature
   changed its rate), the model is piecewise linear through the knots: between
   two knots the error is at most the larger of their two error bars.
   Outside the knots both extrapolate with the line's slope (the drift).
   Worked example: knots (0 s, 10.000 ms, +-10 us) and (60 s, 10.012 ms,
   +-10 us): slope 12 us / 60 s = 0.2 us/s (0.2 ppm: the rank's clock runs
   0.2 ppm slow); an event at local 30 s gets offset 10.006 ms.
3. *Bound.* Per rank: the knots' error bars (half their RTT) plus the fit
   error: in linear mode the largest ``|resid_k| + e_k`` (the line can be no
   further from the truth at a knot, and between knots no further than at the
   worse end); in piecewise mode the largest ``e_k`` plus half the knots'
   largest second difference (how far the clock bends away from a chord).
   Outside the knots the bound grows with the drift's own uncertainty (the
   end knots' error bars over their distance) per ns of extrapolation; a
   rank with one window grows by ``DRIFT_PRIOR_PPM``. ``ClockModel.bound_ns``
   holds each rank's bound at the worse end of its record. A rank with one window has no drift estimate: its bound
   grows by ``DRIFT_PRIOR_PPM`` per second away from the knot.

Ranks without samples (an old file, a rank killed before its first exchange)
fall back to collective exits: every member of a synchronizing collective
(barrier, all-reduce, ...) leaves it at about the same time, so the aligned
exits of the synced members give one offset sample per collective; their
median (plus a drift when they span long enough) is the model, and the spread
of the exits is the (larger) bound. With neither samples nor shared
collectives, the system clocks (``wall_ns_at_start - mono_ns_at_start``, as
good as NTP: milliseconds) are the last resort. Each fallback is a warning.

Causality (:func:`align`): no member can leave a synchronizing collective
before its last member entered it. After alignment such violations are
counted; each one is impossible ordering that would show as a negative
transfer time, so they are repaired the way Scalasca does (a controlled
logical clock): the violating exit moves forward to the last entry (plus
``MIN_LATENCY_NS``), and the rank's later timestamps move with it by an amount
that decays at rate ``1 - GAMMA`` (the corrected clock runs at ``GAMMA`` times
its speed until it meets the original), so intervals stay nearly intact.
Violations within the two ranks' stated bounds are expected noise; ones beyond
them mean the model is wrong for those ranks and become a warning.

The result of the fit and the causality counts sit in
``run.cache.clock_model`` (a :class:`ClockModel`; ``.to_json()``) after
:func:`align`.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import numpy as np

from distdiag.clockmodel import (  # noqa: F401  (the clock model's home; re-exported for the callers of clocks)
    ClockModel,
    RankClock,
    apply_repairs,
    map_by_rank,
    map_inplace,
    repair_table,
)
from distdiag.ranks import rank_ranges
from distdiag.run import Run

log = logging.getLogger(__name__)

#: The reference rank: its clock is the timeline.
REF_RANK = 0
#: Sync rows further apart than this (same tag) belong to different rounds (a round
#: takes <= 0.1 s; consecutive rounds are >= 0.2 s apart).
WINDOW_GAP_NS = 150_000_000
#: Timer granularity and the reference's stamping jitter: added to every error bar.
ERR_FLOOR_NS = 1_000
#: Knots with an error bar above max(KNOT_KEEP_FACTOR * best, best + KNOT_KEEP_ABS_NS) are dropped.
KNOT_KEEP_FACTOR = 4.0
KNOT_KEEP_ABS_NS = 50_000
#: Drift assumed for a rank with one sync window (two free-running crystals; NTP keeps it lower).
DRIFT_PRIOR_PPM = 100.0
#: Largest drift a fit may report; beyond it a fit is noise (real crystals: < 100 ppm).
MAX_DRIFT = 1e-3
#: The least time between the last member entering a collective and anyone leaving it.
MIN_LATENCY_NS = 1_000
#: Repair passes (each one vectorized); a shift can create a later violation.
MAX_REPAIR_PASSES = 20
#: A bound above this is worth a warning: waits shorter than it are not trustworthy.
WARN_BOUND_NS = 1_000_000

#: Collectives whose every member's exit depends on every member's entry. Not the
#: rooted ones (a Bcast leaf leaves once the root sent) nor the v/w variants (a
#: rank with zero counts may leave before a peer arrives).
SYNC_OPS = frozenset(
    {
        "Barrier", "Ibarrier", "ibarrier", "barrier", "Allreduce", "Iallreduce", "allreduce",
        "Allgather", "Iallgather", "allgather", "Alltoall", "Ialltoall", "alltoall",
        "Reduce_scatter_block", "Ireduce_scatter_block",
        "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor", "_all_gather_base",
        "all_gather_coalesced", "reduce_scatter_tensor", "_reduce_scatter_base", "all_to_all_single",
        "monitored_barrier", "all_gather_object", "ddp_bucket_allreduce",
    }
)  # fmt: skip


# ----------------------------------------------------------------------------------
# fitting


def _knots(sync: np.ndarray) -> np.ndarray:
    """Min-RTT knot per (rank, window), vectorized: columns rank, x (mid), y (offset), e (err), n (samples)."""
    dt = np.dtype([("rank", "<i8"), ("x", "<i8"), ("y", "<i8"), ("e", "<f8"), ("rtt", "<i8"), ("n", "<i8")])
    if len(sync) == 0:
        return np.zeros(0, dt)
    rtt = sync["t_recv_ns"] - sync["t_send_ns"]
    ok = (rtt >= 0) & (sync["ref_rank"] == REF_RANK) & (sync["rank"] >= 0)
    s, rtt = sync[ok], rtt[ok]
    if len(s) == 0:
        return np.zeros(0, dt)
    order = np.lexsort((s["t_send_ns"], s["rank"]))
    s, rtt = s[order], rtt[order]
    new = np.ones(len(s), bool)
    new[1:] = (
        (s["rank"][1:] != s["rank"][:-1])
        | (s["tag"][1:] != s["tag"][:-1])
        | (s["t_send_ns"][1:] - s["t_send_ns"][:-1] > WINDOW_GAP_NS)
    )
    win = np.cumsum(new) - 1
    order = np.lexsort((rtt, win))  # per window, smallest RTT first
    first = order[np.r_[True, win[order][1:] != win[order][:-1]]]
    b = s[first]
    mid = b["t_send_ns"] + rtt[first] // 2  # (t_send + t_recv) / 2 without int64 overflow
    out = np.zeros(len(b), dt)
    out["rank"] = b["rank"]
    out["x"] = mid
    out["y"] = b["t_ref_ns"] - mid
    out["rtt"] = rtt[first]
    out["e"] = rtt[first] / 2.0 + ERR_FLOOR_NS
    out["n"] = np.bincount(win, minlength=len(b))
    return out


def _wls(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> tuple[float, float]:
    """Weighted least-squares line y = a + b x."""
    sw = w.sum()
    mx, my = (w * x).sum() / sw, (w * y).sum() / sw
    sxx = (w * (x - mx) ** 2).sum()
    b = float((w * (x - mx) * (y - my)).sum() / sxx) if sxx > 0 else 0.0
    b = float(np.clip(b, -MAX_DRIFT, MAX_DRIFT))
    return float(my - b * mx), b


def _fit_rank(rank: int, k: np.ndarray) -> RankClock:
    """The model of one rank from its knots (sorted by x)."""
    x0, y0 = int(k["x"][0]), int(k["y"][0])
    e_all = k["e"]
    best = float(e_all.min())
    common = dict(
        rank=rank, x0_ns=x0, y0_ns=y0, n_samples=int(k["n"].sum()), n_windows=len(k),
        best_rtt_ns=int(k["rtt"].min()),
    )  # fmt: skip
    # The line takes every knot (the weights 1/e^2 already make poor ones count little:
    # a poor knot far from the good ones still pins the drift better than none).
    xa = (k["x"] - x0).astype(np.float64)
    ya = (k["y"] - y0).astype(np.float64)
    if len(k) >= 2:
        a, b = _wls(xa, ya, 1.0 / e_all**2)
        resid = ya - (a + b * xa)
        if np.all(np.abs(resid) <= e_all + ERR_FLOOR_NS):
            # Linear clock pair: the line averages the knots' noise. At a knot the line is
            # off by at most |resid| + e (the knot's own error bar); between knots by no
            # more than at the worse end. Where good knots exist, poor ones between them
            # do not widen the bound: their weight left the line where the good ones put it.
            # Outside the good knots' span the bound grows with the drift's uncertainty
            # (bound_at); the line's knots mark that span (the line is the same anywhere).
            good = e_all <= max(KNOT_KEEP_FACTOR * best, best + KNOT_KEEP_ABS_NS)
            bound = float(np.max((np.abs(resid) + e_all)[good]))
            lx = np.array([xa[good].min(), xa[good].max()])
            return RankClock(method="sync", knots_x=lx, knots_y=a + b * lx, slope=b, bound_ns=bound,
                             bound_growth=_slope_err(xa, e_all, resid), **common)  # fmt: skip
    keep = e_all <= max(KNOT_KEEP_FACTOR * best, best + KNOT_KEEP_ABS_NS)
    k, e = k[keep], e_all[keep]
    x = (k["x"] - x0).astype(np.float64)
    y = (k["y"] - y0).astype(np.float64)
    if len(k) == 1 and len(e_all) == 1:
        # No drift estimate: the bound grows with the distance from the one knot.
        return RankClock(method="sync-single", knots_x=x, knots_y=y, slope=0.0, bound_ns=best,
                         bound_growth=DRIFT_PRIOR_PPM * 1e-6, **common)  # fmt: skip
    if len(k) == 1:
        # One good knot and poor ones that disagree with it beyond their error bars:
        # trust the good one, with the line's slope.
        return RankClock(method="sync-single", knots_x=x, knots_y=y, slope=b, bound_ns=best,
                         bound_growth=DRIFT_PRIOR_PPM * 1e-6, **common)  # fmt: skip
    # Piecewise linear through the knots. Between two knots the error is at most the larger
    # of their error bars, plus how far the true curve bends away from the chord (estimated
    # as half the largest second difference of the knots).
    bend = 0.0
    if len(k) >= 3:
        t = (x[1:-1] - x[:-2]) / np.maximum(x[2:] - x[:-2], 1.0)
        chord = y[:-2] + t * (y[2:] - y[:-2])
        bend = float(np.abs(y[1:-1] - chord).max()) / 2.0
    return RankClock(method="sync-piecewise", knots_x=x, knots_y=y, slope=b,
                     bound_ns=float(e.max()) + bend, bound_growth=_slope_err(x, e, np.zeros(len(x))), **common)  # fmt: skip


def _slope_err(x: np.ndarray, e: np.ndarray, resid: np.ndarray) -> float:
    """How wrong the drift can be: the end knots' error bars over their distance.

    Outside the knots (a rank's start-up before its first good exchange, its
    end after the last) the offset is extrapolated with the slope, so the bound
    grows by this per ns of distance. Worked example: knots 1.2 s apart with
    +-10 us each: the slope is good to 20 us / 1.2 s = 17 ppm, so 2 s before the
    first knot the bound is 10 + 33 = 43 us."""
    # The weighted line's slope is pinned by its best-determined knots: take the most
    # favourable pair of knots (sum of |resid| + e over their distance) from the two
    # halves of the span, which is what the weights make the fit follow.
    if len(x) < 2 or x[-1] <= x[0]:
        return DRIFT_PRIOR_PPM * 1e-6
    err = np.abs(resid) + e
    mid = (x[0] + x[-1]) / 2
    lo, hi = x <= mid, x > mid
    if not lo.any() or not hi.any():
        return float(err[0] + err[-1]) / float(x[-1] - x[0])
    # all pairs (left, right): a handful of knots per rank
    pair = (err[lo][:, None] + err[hi][None, :]) / np.maximum(x[hi][None, :] - x[lo][:, None], 1.0)
    return float(pair.min())


def _sync_ops(run: Run) -> np.ndarray:
    return np.array([run.sid(n) for n in SYNC_OPS if run.sid(n) >= 0], np.int64)


def _raw_collectives(run: Run) -> Any:
    """Collectives matched on the raw run: matching is by (comm, seq), so it holds for
    any clock model; only the member times need mapping."""
    c = run.cache.raw_collectives
    if c is None:
        from distdiag.match import match_collectives

        c = match_collectives(run.replace())  # a copy: matching may add warnings
        run.cache.raw_collectives = c
    return c


def _exit_fallback(run: Run, models: dict[int, RankClock], need: list[int]) -> list[int]:
    """Fit ranks in ``need`` from synchronizing-collective exits against aligned ranks; returns those fitted."""
    from distdiag.match import MatchState

    colls = _raw_collectives(run)
    if len(colls) == 0:
        return []
    ok_g = (colls.g_state == MatchState.COMPLETE) & np.isin(colls.g_op, _sync_ops(run)) & (colls.g_n_members >= 2)
    sel = ok_g[colls.m_group] & (colls.m_t1_ns >= 0)
    g, r, t1 = colls.m_group[sel], colls.m_rank[sel].astype(np.int64), colls.m_t1_ns[sel]
    fitted: list[int] = []
    pending = set(need)
    for _pass in range(len(need)):  # each pass aligns ranks next to aligned ones; usually one
        known = np.isin(r, np.fromiter(models, np.int64, len(models)))
        if not known.any() or not pending:
            break
        mapped, _ = map_by_rank(t1[known], r[known], models)
        ng = len(colls)
        # Reference exit of each group: the mean aligned exit of its aligned members,
        # measured from a common base to keep float64 exact.
        base = int(mapped.min())
        cnt = np.bincount(g[known], minlength=ng)
        ref_exit = np.bincount(g[known], weights=(mapped - base).astype(np.float64), minlength=ng)
        has = cnt > 0
        ref_exit = np.where(has, ref_exit / np.maximum(cnt, 1), 0.0)
        spread = np.zeros(ng)
        if (cnt >= 2).any():
            rel = (mapped - base).astype(np.float64)
            mx = _group_reduce(np.maximum, g[known], rel, ng, -np.inf)
            mn = _group_reduce(np.minimum, g[known], rel, ng, np.inf)
            spread[cnt >= 2] = (mx - mn)[cnt >= 2]
        cand = ~known & has[g] & np.isin(r, np.fromiter(pending, np.int64, len(pending)))
        progress = []
        ci = np.flatnonzero(cand)
        ci = ci[np.argsort(r[ci], kind="stable")]  # one sort; each unsynced rank is a slice
        cr = r[ci]
        ranks_u, starts = np.unique(cr, return_index=True)
        for rank, a0, b0 in zip(ranks_u, starts, np.append(starts[1:], len(ci))):  # per unsynced rank
            m = ci[a0:b0]
            x_loc = t1[m]
            x0 = int(x_loc.min())
            x = (x_loc - x0).astype(np.float64)
            # offset sample: reference exit - local exit, relative to the integer bases
            y = (ref_exit[g[m]] + base - x0) - x
            y0 = int(np.median(y))
            y = y - y0
            med = float(np.median(y))
            mad = float(np.median(np.abs(y - med))) * 1.4826
            inl = np.abs(y - med) <= max(3 * mad, 1_000.0)
            slope = 0.0
            a = med
            if inl.sum() >= 8 and np.ptp(x[inl]) >= 0.5e9:
                a, slope = _wls(x[inl], y[inl], np.ones(int(inl.sum())))
            resid = y[inl] - (a + slope * x[inl])
            typical_spread = float(np.median(spread[g[m]])) if (spread[g[m]] > 0).any() else 0.0
            bound = 3 * float(np.median(np.abs(resid))) * 1.4826 + typical_spread + ERR_FLOOR_NS
            lx = np.array([x[inl].min(), x[inl].max()]) if inl.any() else np.array([0.0])
            models[int(rank)] = RankClock(
                rank=int(rank), method="collective-exits", x0_ns=x0, y0_ns=y0,
                knots_x=lx, knots_y=a + slope * lx, slope=slope, bound_ns=bound, n_samples=len(m),
                n_windows=0,
            )  # fmt: skip
            progress.append(int(rank))
        if not progress:
            break
        fitted += progress
        pending -= set(progress)
    return fitted


def fit(run: Run) -> ClockModel:
    """Every present rank's clock model (see the module docstring)."""
    present = sorted(run.ranks)
    ref = REF_RANK if (REF_RANK in run.ranks or len(run.sync)) else (present[0] if present else REF_RANK)
    warnings: list[str] = []
    models: dict[int, RankClock] = {}
    if ref in run.ranks:
        models[ref] = RankClock(rank=ref, method="reference", bound_ns=0.0)
    k = _knots(run.sync)
    if len(k):
        ranks, starts = np.unique(k["rank"], return_index=True)
        ends = np.append(starts[1:], len(k))
        for r, lo, hi in zip(ranks, starts, ends):  # per rank with samples
            r = int(r)
            if r == ref or r not in run.ranks:
                continue
            models[r] = _fit_rank(r, k[lo:hi])

    need = [r for r in present if r not in models]
    if need and len(present) > 1:
        got = _exit_fallback(run, models, need)
        if got:
            b = max(models[r].bound_ns for r in got)
            warnings.append(
                f"no clock-sync samples for ranks {rank_ranges(got)}: aligned from collective exits, "
                f"good to about +-{b / 1e3:.0f} us (synced ranks: a few us)"
            )
        need = [r for r in need if r not in models]
    if need and len(present) > 1:
        ref_info = run.ranks.get(ref)
        fell_back = []
        for r in need:  # ranks with neither samples nor shared collectives: a handful
            i = run.ranks[r]
            if (
                ref_info is not None and ref_info.wall_ns_at_start is not None and ref_info.mono_ns_at_start is not None
                and i.wall_ns_at_start is not None and i.mono_ns_at_start is not None
            ):  # fmt: skip
                off = (i.wall_ns_at_start - i.mono_ns_at_start) - (ref_info.wall_ns_at_start - ref_info.mono_ns_at_start)
                models[r] = RankClock(rank=r, method="wall-clock", y0_ns=off, bound_ns=np.inf)
                fell_back.append(r)
        if fell_back:
            warnings.append(
                f"no clock-sync samples and no shared collectives for ranks {rank_ranges(fell_back)}: their alignment "
                "rests on the system clocks (NTP, typically off by milliseconds); waits shorter than that are not "
                "trustworthy"
            )
        unaligned = [r for r in need if r not in models]
        if unaligned:
            warnings.append(f"ranks {rank_ranges(unaligned)} have neither clock-sync samples nor start times: left unaligned")
        for r in unaligned:
            models[r] = RankClock(rank=r, method="none", bound_ns=np.inf)
    for r in present:
        models.setdefault(r, RankClock(rank=r, method="reference" if r == ref else "none", bound_ns=0.0))

    n = max(run.world_size, max(run.ranks, default=-1) + 1)
    bound = np.full(n, np.inf)
    for r, m in models.items():  # per rank
        info = run.ranks.get(r)
        ends = np.array([info.start_ns, info.end_ns]) if info is not None else np.array([m.x0_ns])
        bound[r] = float(m.bound_at(ends).max())
    single = [r for r, m in models.items() if m.method == "sync-single"]
    if single:
        warnings.append(
            f"ranks {rank_ranges(sorted(single))} have clock samples from one moment only (killed early, or a run "
            f"shorter than the sync interval with no exit samples): drift unknown, bound grows {DRIFT_PRIOR_PPM:.0f} us/s"
        )
    loose = [r for r in present if np.isfinite(bound[r]) and bound[r] > WARN_BOUND_NS and models[r].method != "wall-clock"]
    if loose:
        warnings.append(
            f"clock alignment of ranks {rank_ranges(loose)} is only good to +-{max(bound[r] for r in loose) / 1e6:.1f} ms: "
            "waits shorter than that are not trustworthy"
        )
    return ClockModel(ref_rank=ref, ranks=models, bound_ns=bound, warnings=warnings)


# ----------------------------------------------------------------------------------
# causality


def _group_reduce(ufunc: Any, g: np.ndarray, v: np.ndarray, ng: int, fill: Any) -> np.ndarray:
    """``ufunc`` (np.maximum / np.minimum) of ``v`` per group id ``g``; ``fill`` where a group is empty.

    Member rows come sorted by group, so this is one ``reduceat`` (``ufunc.at`` is ~20x slower)."""
    out = np.full(ng, fill, dtype=np.result_type(v.dtype, np.asarray(fill).dtype))
    if len(g) == 0:
        return out
    if bool((g[1:] >= g[:-1]).all()):
        starts = np.flatnonzero(np.r_[True, g[1:] != g[:-1]])
        out[g[starts]] = ufunc.reduceat(v, starts)
    else:
        ufunc.at(out, g, v)
    return out


def _violations(g: np.ndarray, t0: np.ndarray, t1: np.ndarray, ng: int) -> tuple[np.ndarray, np.ndarray]:
    """(last entry per group, how far each member's exit precedes it; <= 0 when fine)."""
    last = _group_reduce(np.maximum, g, t0, ng, np.iinfo(np.int64).min)
    return last, last[g] - t1


#: Member rows per block of :func:`_count_violations`.
_CHECK_ROWS = 1 << 18


def _count_violations(colls: Any, ok_g: np.ndarray, models: dict[int, RankClock] | None) -> tuple[int, int]:
    """(member exits checked, exits before their group's last entry), the numbers
    :func:`check_causality` counts, computed over blocks of whole groups (members of
    a group are contiguous). ``models``: map the member times first (raw collectives).

    On the collectives' own times (``models`` None) members come by arrival, so
    a group's last entry is its last member's, ``g_last_ns``: a block whose
    checked groups have no member in flight (always, for COMPLETE groups) is
    counted against it, with no selection of members and no group maximum.
    At 64 x 100k (3.2 M members, no violation; CPU s, 3 runs each): 0.039-0.040 ->
    0.011."""
    from distdiag.match import group_blocks

    checked = viol = 0
    counts = np.diff(colls.g_start) if models is None else None
    for g_lo, g_hi, a, b in group_blocks(colls, _CHECK_ROWS):  # per block of ~262,144 member rows
        t1_all = colls.m_t1_ns[a:b]
        if counts is not None:
            c = counts[g_lo:g_hi]
            ok = ok_g[g_lo:g_hi]
            every = bool(ok.all())
            ok_rows = None if every else np.repeat(ok, c)
            open_ = t1_all < 0
            if not every:
                open_ &= ok_rows
            if not open_.any():  # every checked member left: all of them are checked
                late = np.repeat(colls.g_last_ns[g_lo:g_hi], c)
                late -= t1_all
                hit = late > 0
                if ok_rows is not None:
                    hit &= ok_rows
                checked += int(c.sum()) if every else int(c[ok].sum())
                viol += int(np.count_nonzero(hit))
                continue
        g = colls.m_group[a:b]
        sel = ok_g[g] & (t1_all >= 0)
        if sel.any():
            gg = g[sel] - g_lo
            t0 = colls.m_t0_ns[a:b][sel]
            t1 = t1_all[sel]
            if models is not None:
                r = colls.m_rank[a:b][sel].astype(np.int64)
                t0, _ = map_by_rank(t0, r, models)
                t1, _ = map_by_rank(t1, r, models)
            _, late = _violations(gg, t0, t1, g_hi - g_lo)
            checked += int(sel.sum())
            viol += int(np.count_nonzero(late > 0))
    return checked, viol


def check_causality(
    run: Run, model: ClockModel, repair: bool = True, raw_colls: Any = None, inplace: bool = False, colls: Any = None
) -> Run:
    """Count (and repair) exits from synchronizing collectives that precede the last entry.

    ``run`` is aligned; the counts go into ``model``. Returns the repaired run.
    ``raw_colls``: the collectives matched on the run before alignment (their
    times are mapped with ``model``), which saves matching again.
    ``inplace``: repair ``run.events`` in place (align's own table) instead of a copy.
    ``colls``: the collectives already matched on ``run`` (aligned), if any.
    Returns ``run`` itself when nothing was repaired.
    """
    from distdiag.match import MatchState, match_collectives

    if raw_colls is None and colls is None:
        colls = match_collectives(run.replace())
    elif raw_colls is not None:
        colls = raw_colls
    if len(colls) == 0:
        return run
    ok_g = (colls.g_state == MatchState.COMPLETE) & np.isin(colls.g_op, _sync_ops(run)) & (colls.g_n_members >= 2)
    # Count first, by blocks of whole groups (a few MB of temporaries): the usual
    # run has no violation, and then the member-size arrays below (~40 bytes per
    # collective row, the largest transient of align, measured) are never built.
    checked, n_viol = _count_violations(colls, ok_g, model.ranks if raw_colls is not None else None)
    if n_viol == 0:
        model.causality_checked = checked
        model.violations = 0
        return run
    # Some exit is late (so ``sel`` is not empty): the member-size arrays, to locate and repair.
    sel = ok_g[colls.m_group] & (colls.m_t1_ns >= 0)
    g = colls.m_group[sel]
    r = colls.m_rank[sel].astype(np.int64)
    t0 = colls.m_t0_ns[sel].copy()
    t1 = colls.m_t1_ns[sel].copy()
    if raw_colls is not None:
        t0, _ = map_by_rank(t0, r, model.ranks)
        t1, _ = map_by_rank(t1, r, model.ranks)
    ng = len(colls)
    last, late = _violations(g, t0, t1, ng)
    viol = late > 0
    model.causality_checked = int(sel.sum())
    model.violations = int(viol.sum())  # == n_viol: the same test, on the whole array
    model.max_violation_ns = int(late[viol].max())
    # The last arriver of each group (for the pair bound): argmax of t0 per group.
    order = np.lexsort((t0, g))
    last_idx = order[np.r_[g[order][1:] != g[order][:-1], True]]
    last_rank = np.zeros(ng, np.int64)
    last_rank[g[last_idx]] = r[last_idx]
    bnd = model.bound_ns
    pair = bnd[r] + bnd[last_rank[g]]
    beyond = viol & (late > pair)
    model.violations_beyond_bound = int(beyond.sum())
    if beyond.any():
        bad = sorted(set(r[beyond].tolist()) | set(last_rank[g[beyond]].tolist()))
        model.warnings.append(
            f"{int(beyond.sum())} of {model.causality_checked} synchronizing-collective exits preceded the last entry "
            f"by more than the stated clock bounds (max {model.max_violation_ns / 1e3:.0f} us; ranks {rank_ranges(bad)}): "
            "the clock model is off for these ranks; repaired with a controlled logical clock"
        )
    if not repair:
        model.violations_after_repair = model.violations
        return run

    base = int(t0.min())
    ev_min = run.stream.t0_min(model.ranks) if run.stream is not None else None  # streamed rows count too
    if len(run.events):
        ev_min = int(run.events["t0_ns"].min()) if ev_min is None else min(ev_min, int(run.events["t0_ns"].min()))
    if ev_min is not None:
        base = min(base, ev_min)
    model.repair_base = base
    repairs: list[dict[int, tuple[np.ndarray, np.ndarray]]] = []
    for _pass in range(MAX_REPAIR_PASSES):  # each pass vectorized; usually 1-2
        if not viol.any():
            break
        rep: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        vr = r[viol]
        for rank in np.unique(vr):  # ranks with violations
            m = viol & (r == rank)
            rep[int(rank)] = (t1[m].copy(), last[g[m]] + MIN_LATENCY_NS)
        repairs.append(rep)
        t0 = apply_repairs(t0, r, [rep], base)
        t1 = apply_repairs(t1, r, [rep], base)
        last, late = _violations(g, t0, t1, ng)
        viol = late > 0
    model.repairs = repairs
    model.repair_passes = len(repairs)
    model.violations_after_repair = int(viol.sum())

    ev = run.events if inplace else run.events.copy()
    coll = run.coll_rows if (run.coll_rows is None or inplace) else run.coll_rows.copy()
    for tab in (ev,) if coll is None else (ev, coll):  # the table, and the collective rows kept apart
        repair_table(tab, repairs, base)
    if run.coll_remote is not None:  # --parallel: the analysis ranks repair the rows they hold alike
        run.coll_remote.repair(repairs, base)
    inf = run.inflight.copy()
    inf["t0_ns"] = apply_repairs(inf["t0_ns"], inf["rank"].astype(np.int64), repairs, base)
    gpu = run.gpu.copy()
    gpu["t_ns"] = apply_repairs(gpu["t_ns"], gpu["rank"].astype(np.int64), repairs, base)
    ranks = {}
    for rk, i in run.ranks.items():  # per rank: two scalars
        se = apply_repairs(np.array([i.start_ns, i.end_ns]), np.array([rk, rk]), repairs, base)
        ranks[rk] = dataclasses.replace(i, start_ns=int(se[0]), end_ns=int(se[1]))
    # The CLC map is monotone per rank: (rank, t0) order is kept.
    return run.replace(events=ev, inflight=inf, gpu=gpu, ranks=ranks, coll_rows=coll)


# ----------------------------------------------------------------------------------
# the stage


def align(run: Run, repair: bool = True, inplace: bool = False) -> Run:
    """A new Run whose event, in-flight and GPU times and rank bounds are on rank 0's clock.

    ``run.cache.clock_model`` holds the :class:`ClockModel`; ``run.offset_ns``
    each rank's offset at its start. Sync rows stay raw (each rank's own clock).

    ``inplace=True``: the caller gives ``run``'s event table up (the pipeline,
    which loaded it and keeps no other reference): its t0/t1 columns are mapped
    in place, rank slice by rank slice, instead of in a copy of the whole table
    (73 bytes an event, the largest allocation of the analysis). The input
    ``run`` must not be used afterwards. The default copies, so ``run`` stays raw.
    """
    if run.aligned:
        return run
    run = run.replace()  # a private cache for the raw match
    model = fit(run)
    models = model.ranks
    # One collective match per analysis: when fit needed none (every rank has
    # clock samples), the causality check matches the mapped table, and that
    # match is the pipeline's too (cached on the result) unless a repair moved
    # times. When fit matched the raw run (exit fallback), the check maps it.
    raw_colls: Any = run.cache.raw_collectives
    ev = run.events if inplace else run.events.copy()
    # a streamed run keeps its collective rows apart for the match (distdiag.run.COLL_ROW_DTYPE)
    coll = run.coll_rows if (run.coll_rows is None or inplace) else run.coll_rows.copy()
    src = ev if coll is None else coll  # the rows the match reads
    selector: Any = None
    for tab in (ev,) if coll is None else (ev, coll):  # the table, and the collective rows kept apart
        if not len(tab):
            continue
        on_block = None
        # the match below: its selection made in the mapping pass (held rows: matched where they are)
        if raw_colls is None and tab is src and run.coll_remote is None:
            from distdiag.match import KeySelector

            selector = KeySelector(len(tab), tab.dtype)
            on_block = selector.add
        map_inplace(tab, ("t0_ns", "t1_ns"), models, on_block=on_block)
        del on_block  # a bound method: it would keep the selection alive past the match
        # No re-sort: each rank's map is monotone, so (rank, t0) order is kept.
    if run.coll_remote is not None:  # --parallel: the analysis ranks map the rows they hold alike
        run.coll_remote.map(models)
    inf = run.inflight.copy()
    if len(inf):
        inf["t0_ns"], _ = map_by_rank(inf["t0_ns"], inf["rank"], models)  # t1 == -1 (never left) stays -1
    gpu = run.gpu.copy()
    if len(gpu):
        gpu["t_ns"], _ = map_by_rank(gpu["t_ns"], gpu["rank"], models)
    n = max(run.world_size, max(run.ranks, default=-1) + 1)
    off = np.zeros(n, np.int64)
    ranks = {}
    for r, i in run.ranks.items():  # per rank: two scalars
        m = models.get(r)
        if m is None:
            ranks[r] = i
            continue
        se = m.map(np.array([i.start_ns, i.end_ns], np.int64))
        off[r] = int(se[0] - i.start_ns)
        ranks[r] = dataclasses.replace(i, start_ns=int(se[0]), end_ns=int(se[1]))
    out = run.replace(events=ev, inflight=inf, gpu=gpu, ranks=ranks, aligned=True, offset_ns=off, coll_rows=coll)
    aligned_colls: Any = None
    pending: list[str] = []
    try:
        if raw_colls is None:
            from distdiag.match import match_collectives

            probe = out.replace()  # matching may add a warning: kept for collectives_of
            if selector is not None:
                probe.cache.selected_keys = (src, selector)
            del selector
            aligned_colls = match_collectives(probe)
            pending = probe.warnings[len(out.warnings) :]
        # ``out.events`` is align's own table by now (a copy, or the caller's given up with inplace).
        checked = check_causality(out, model, repair=repair, raw_colls=raw_colls, inplace=True, colls=aligned_colls)
        if checked is not out:  # repaired: times moved, the match is stale
            aligned_colls = None
        out = checked
    except Exception as e:  # the check is a refinement: never lose the report to it
        log.debug("causality check failed", exc_info=True)
        model.warnings.append(f"clock causality check failed ({type(e).__name__}: {e}); alignment unrepaired")
        aligned_colls = None
    out.warnings = list(run.warnings) + model.warnings
    out.cache.clock_model = model
    if aligned_colls is not None:
        # distdiag.match.collectives_of takes it (and adds ``pending`` to the
        # warnings then, where a fresh match would have added them).
        out.cache.collectives = aligned_colls
        out.cache.collectives_warnings = pending
    return out
