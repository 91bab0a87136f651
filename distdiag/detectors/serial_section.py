"""serial_section: one rank works on a code path the others do not run, and they wait for it (Amdahl).

The pattern: rank 0 preprocesses, logs, evaluates or checkpoints while every
other rank has already entered the next collective (a ``bcast``, a
``Barrier``) and waits there. A straggler looks the same at that collective:
it arrives last. What tells them apart is what happened *before* it:

* **the others had nothing to do**: between their previous collective and this
  one the waiting ranks' own work (their *gap*: arrival minus the exit of their
  previous collective) is near zero next to the late rank's. Precisely: the
  median gap of the other members is at most ``idle_ratio`` (0.1) times the
  late rank's gap. A straggler is slower at the work every rank does, so the
  others' gaps are comparable to its own (ratio ~0.5-1);
* **and** something says it is a different code path, not a slow rank:
  - *intermittent*: at that call site the rank is late-while-the-others-idle at
    no more than ``max_share`` (0.5) of its calls (``if step % 100 == 0 and
    rank == 0: evaluate()``); a rank on a slow node is late at (nearly) all;
  - *the call site differs*: the late rank reached the collective from another
    line than the rank that arrived before it (``if rank == 0: ...; bcast``
    written in two branches);
  - *recorded activity*: the late rank's gap holds recorded calls (file I/O,
    phases, point-to-point) covering at least ``activity_share`` (0.1) of it,
    the others' gaps are (near) empty by the first condition;
  - *the root prepares*: the late rank is the root of a one-to-many collective
    (bcast, scatter): it alone prepares what it sends, however often and from
    whichever line (the commonest serial section: ``if step % 5 == 4: cfg =
    evaluate() if rank == 0 else None; cfg = comm.bcast(cfg)``, late at every
    call of that line with nothing else recorded, was called a straggler).
  A rank that sleeps before every all-reduce with nothing recorded is, by this
  rule, a straggler (a loaded node looks exactly like that).

Cost. Per serial collective: ``last arrival - last arrival of an idle
rank`` (idle: own gap at most ``idle_ratio`` of the last arriver's), what the
collective (and the job) would gain were the serial work gone or overlapped.
With one busy rank that is the straggler detector's ``last - second-to-last``.
Worked example: ranks 1-3 enter a bcast at 10.00, 10.01, 10.02 s, rank 0 at
10.31 s after 300 ms of logging: 0.29 s. With "a few" busy ranks (rank 0 of
each node writes its part) the charge runs from the last idle rank, and the
finding names every rank busy in at least half of its windows; a bcast whose
last arriver is a busy non-root still counts when its root is busy too (the
others wait for the root, the last busy rank holds the next collective).
The ranking (:mod:`distdiag.ranking`) then takes these seconds away from the
straggler findings of the same ranks, so they count once.

Amdahl: ``s`` = the serial seconds over the run's wall-clock. Adding ranks can
at best shrink the rest of the run to nothing, so more ranks make this job at
most ``1/s`` times faster (5% serial caps you at 20x).

Settings (``[analyze.serial_section]``, documented in configs/default.toml):
``idle_ratio`` (0.1), ``max_share`` (0.5), ``activity_share`` (0.1),
``min_window_ms`` (1.0), ``min_fraction`` ([analyze], 0.02), ``top`` (5).

Cost (issue 10): the others' median gap, a sort of every member's (group,
gap) key, is decided by counting instead (:func:`_others_at_most`) and only
for the groups the cheaper tests left; the root's busyness only where it
decides, the lead rank only for the serial groups (:func:`_lead`); per-member
group values by ``np.repeat`` (a group's rows are contiguous), not gathers.
Same findings and the same JSON on every synth fault and 1024 x 10k.
Measured (``bench_scale.py --grid '' --stages RxM --baseline <worktree of
3599750> --repeat 2``, best CPU of 2 alternating children per tree, load
2-3): the stage 0.12 -> 0.04-0.05 s at 64 x 100k (3.2 M member rows), 0.22-0.24
-> 0.08-0.10 s at 1024 x 10k; its transient reads +0.6 -> +4.0 B/event only
because input_bound's, just before, shrank (7.1 -> 3.2 B/event) and no longer
leaves freed pages for it: the analysis' peak RSS is unchanged (798 -> 795 MB,
1221 -> 1217 MB).

Bands (issue 10): the late rank's recorded activity inside its window
(:func:`_activity_ns`) and what it did there (:func:`_what_it_did`) read the
activity rows through :func:`distdiag.bands.bands`, not ``run.events``: the
compute phases among those kinds are streamed. Each window goes to its rank's
band, bands without a window are skipped, none past the last one's is read,
and every section's evidence comes from one pass. Same JSON as before (every
synth fault, 1024 x 10k, 256 x 10k, and the serial fault at 256 x 10k and
1024 x 3k, rank 700). Measured (baseline module and this one in one process,
alternating, best CPU, tracemalloc peak): the serial fault at 256 x 10k,
detector 0.15 -> 0.05 s and 51 -> 28 MB; windows on every rank of 1024 x 10k
(5,000 windows, all 157 bands): activity 0.34 -> 0.31 s and 205 -> 1.8 MB,
what it did 0.46 -> 0.42 s and 580 -> 5.9 MB (it copied every activity row of
the windows' ranks before).
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np

from distdiag.bands import Band, bands
from distdiag.analysis import Analysis
from distdiag.detectors import register
from distdiag.roles import Role
from distdiag.findings import Finding, Windows
from distdiag.evidence import secs, tally
from distdiag.lateness import holds_others, one_to_many_root_late, root_world_ranks
from distdiag.match import Collectives, MatchState, group_blocks, member_gaps_ns
from distdiag.ranks import rank_ranges
from distdiag.replay import Change
from distdiag.schema import Kind

if TYPE_CHECKING:
    from distdiag.run import Run

log = logging.getLogger(__name__)

#: Recorded calls that count as "the late rank did something" in its gap.
_ACTIVITY_KINDS = np.array(
    [Kind.FILE_OPEN, Kind.FILE_CLOSE, Kind.FILE_STAT, Kind.FILE_LISTDIR, Kind.FILE_READ, Kind.FILE_WRITE,
     Kind.PHASE, Kind.INPUT_WAIT, Kind.H2D, Kind.FORWARD, Kind.BACKWARD, Kind.OPTIMIZER,
     Kind.SEND, Kind.RECV, Kind.WAIT],
    np.uint8,
)  # fmt: skip

ADVICE = (
    "Take the work off the critical path or share it: run it on every rank (each on 1/N), overlap it with the "
    "next steps (a background thread or process, async checkpoint/eval), or do it less often."
)


def _others_median(colls: Collectives, gap: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Per group of ``want``: the median gap of the members other than the last arriver.

    By blocks of whole groups (:func:`distdiag.match.group_blocks`): a group's
    median needs only its own members, and the temporaries stay block-sized
    (all at once they were ~32 bytes per collective row, the detector's peak:
    +16 B/event at 1024 x 10k, measured).

    ``want`` (bool per group) limits the work to those groups: the others'
    medians come out 0, and a block with no wanted group is skipped without
    a pass. Only the groups :func:`_others_at_most` cannot decide by counting,
    and the serial groups' evidence, come here (the sort here was over half of
    the detector's own CPU)."""
    n_g = len(colls)
    out = np.zeros(n_g, np.float64)
    last_row = colls.g_start[1:] - 1
    for g_lo, g_hi, a, b in group_blocks(colls):  # per block of ~262,144 member rows
        w = want[g_lo:g_hi]
        if not w.any():
            continue
        keep = w[colls.m_group[a:b] - g_lo]  # members of the wanted groups
        keep[last_row[g_lo:g_hi] - a] = False
        g = colls.m_group[a:b][keep] - g_lo
        v = gap[a:b][keep]
        if len(g) == 0:
            continue
        nb = g_hi - g_lo
        # sort the gaps within each group: one sort of values keyed (group, gap) in
        # int64 (a tenth of a lexsort's time); gaps are >= 0
        mult = int(v.max()) + 1
        if nb < np.iinfo(np.int64).max // mult - 1:
            key = g.astype(np.int64)
            key *= mult
            key += v
            key.sort()
            g = key // mult
            v = key - g * mult
            del key
        else:  # astronomically long gaps
            order = np.lexsort((v, g))
            g, v = g[order], v[order]
        cnt = np.bincount(g, minlength=nb)
        first = np.concatenate([[0], np.cumsum(cnt)[:-1]])
        has = cnt > 0
        lo = first + (cnt - 1) // 2
        hi = first + cnt // 2
        blk = out[g_lo:g_hi]
        blk[has] = (v[lo[has]] + v[hi[has]]) / 2.0
    return out


def _others_at_most(colls: Collectives, gap: np.ndarray, x: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Per group: ``_others_median(colls, gap)[g] <= x[g]`` where ``want[g]`` (False elsewhere).

    The same verdicts as that comparison, mostly without the sort: with
    ``cnt`` other members, ``lo = (cnt - 1) // 2`` and ``hi = cnt // 2``, the
    median is ``(v[lo] + v[hi]) / 2`` of the sorted gaps, and ``le``, how many
    of them satisfy ``v <= x`` (numpy compares the int gaps as float64, as
    the median is; that map is monotone), decides it: ``le > hi`` makes
    both middle values ``<= x`` (so their mean is), ``le <= lo`` makes
    ``v[lo] > x`` (so the mean is, as ``v[hi] >= v[lo]``). Only a group with
    ``le == lo + 1 < hi + 1`` (even count, ``x`` between the two middle
    values) needs the values: those few go to :func:`_others_median`, which
    sorts the members of those groups only. A group with no other member has
    median 0. One compare and one ``reduceat`` per block of groups instead of
    a sort of every member's (group, gap) key: at 64 x 100k (50,000 groups of
    64 members) ~0.13 -> ~0.02 s of CPU (cProfile of the detector alone).
    """
    n_g = len(colls)
    out = np.zeros(n_g, bool)
    amb = np.zeros(n_g, bool)
    sizes = np.diff(colls.g_start)
    if n_g == 0 or int(sizes.min()) == 0:  # no empty group comes out of match; if one did: the sort
        return want & (_others_median(colls, gap, want=want) <= x)
    last_row = colls.g_start[1:] - 1
    for g_lo, g_hi, a, b in group_blocks(colls):  # per block of ~262,144 member rows
        w = want[g_lo:g_hi]
        if not w.any():
            continue
        xb = x[g_lo:g_hi]
        # every member of the block, each against its group's x (a group's rows are
        # contiguous: a repeat, not a gather), counted per group by one reduceat; the
        # last arriver's own verdict taken back out
        le_m = gap[a:b] <= np.repeat(xb, sizes[g_lo:g_hi])
        le = np.add.reduceat(le_m, colls.g_start[g_lo:g_hi] - a, dtype=np.int64)
        le -= le_m[last_row[g_lo:g_hi] - a]
        del le_m
        cnt = sizes[g_lo:g_hi] - 1  # the others
        lo = (cnt - 1) // 2
        hi = cnt // 2
        verdict = le > hi
        verdict |= (cnt == 0) & (xb >= 0.0)  # no other member: median 0
        out[g_lo:g_hi] = verdict & w
        amb[g_lo:g_hi] = w & (cnt > 0) & (le == lo + 1) & (hi > lo)
    if amb.any():
        med = _others_median(colls, gap, want=amb)
        out[amb] = med[amb] <= x[amb]
    return out


def _lead(colls: Collectives, idle_m: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Per group: the lowest busy (not idle) rank among its members, int32 max where none; set
    for the groups of ``want`` (bool per group; read only those). By blocks of whole groups,
    skipping the blocks without a wanted group (the serial groups: usually few, so no pass over
    every member)."""
    big = np.iinfo(np.int32).max
    out = np.full(len(colls), big, np.int32)
    for g_lo, g_hi, a, b in group_blocks(colls):  # per block of ~262,144 member rows
        if want[g_lo:g_hi].any():
            ranks = np.where(idle_m[a:b], np.int32(big), colls.m_rank[a:b].astype(np.int32, copy=False))
            out[g_lo:g_hi] = np.minimum.reduceat(ranks, colls.g_start[g_lo:g_hi] - a)
    return out


def _by_band(run: Run, rank: np.ndarray) -> Iterator[tuple[Band, np.ndarray]]:
    """Per band of :func:`distdiag.bands.bands` holding ranks of ``rank`` (one query per entry):
    the band and the indices of its queries. Only the bands holding a queried rank
    are made (a streamed run reads no other file)."""
    order = np.argsort(rank, kind="stable")
    r_sorted = rank[order]
    for band in bands(run, ranks=np.unique(r_sorted)):  # the bands of the queried ranks
        i, j = np.searchsorted(r_sorted, [band.r_lo, band.r_hi])
        if j > i:
            yield band, order[i:j]


def _activity_ns(run: Run, rank: np.ndarray, a_ns: np.ndarray, b_ns: np.ndarray) -> np.ndarray:
    """Per window [a, b] of rank ``rank``: ns of recorded activity calls starting inside it (capped at b - a).

    Band by band (:mod:`distdiag.bands`: the compute phases among the activity
    kinds are streamed): each window is answered from its rank's band by a
    prefix sum over the band's activity rows. The prefix sum is exact int64 ns,
    converted after the difference, so the result does not depend on where the
    bands fall (a float64 prefix sum over the whole run, as before, gave the same
    numbers while the run's activity stays under 2^53 ns, ~104 days of rank-time).
    """
    out = np.zeros(len(rank), np.float64)
    if len(rank) == 0:
        return out
    for band, q in _by_band(run, rank):
        ev = band.events
        rows = band.rows(_ACTIVITY_KINDS)  # ascending, so sorted by (rank, t0) like the band
        if len(rows) == 0:
            continue
        et0 = ev["t0_ns"][rows]
        dur = ev["t1_ns"][rows]
        dur -= et0
        np.maximum(dur, 0, out=dur)
        csum = np.zeros(len(rows) + 1, np.int64)
        np.cumsum(dur, out=csum[1:])
        del dur
        qr, qa, qb = rank[q], a_ns[q], b_ns[q]
        # one composite (rank, t0) key for both searches
        lo_t = int(min(et0.min(), qa.min()))
        span = int(max(et0.max(), qb.max())) - lo_t + 1
        key = ev["rank"][rows].astype(np.int64)
        del rows
        key -= band.r_lo
        key *= span
        et0 -= lo_t
        key += et0
        del et0
        qk = (qr - band.r_lo) * span
        i0 = np.searchsorted(key, qk + (qa - lo_t), side="left")
        i1 = np.searchsorted(key, qk + (qb - lo_t), side="right")
        out[q] = np.minimum((csum[i1] - csum[i0]).astype(np.float64), (qb - qa).astype(np.float64))
    return out


@register("serial_section", requires=("collectives",),
          role=Role(tier=1, removal=2,
                    attributed_by=("median_window_ms", "median lone window", "which rank worked alone")))
def detect(an: Analysis) -> list[Finding]:
    run, cfg = an.run, an.cfg
    colls = an.colls
    wall_s = run.wall_s
    if len(colls) == 0 or wall_s <= 0:
        return []
    idle_ratio = float(cfg.value("serial_section", "idle_ratio", 0.1))
    max_share = float(cfg.value("serial_section", "max_share", 0.5))
    activity_share = float(cfg.value("serial_section", "activity_share", 0.1))
    min_window_ns = float(cfg.value("serial_section", "min_window_ms", 1.0)) * 1e6
    min_fraction = float(cfg.value("serial_section", "min_fraction", 0.02))
    top = int(cfg.value("serial_section", "top", 5))

    complete = (colls.g_state == MatchState.COMPLETE) & (colls.g_n_members >= 2)
    last_row = colls.g_start[1:] - 1
    blocking = colls.m_kind[last_row] == Kind.COLL
    if not (complete & blocking).any():
        return []
    gap = member_gaps_ns(run, colls)
    gap_last = gap[last_row].astype(np.float64)
    # "A few" ranks can work while the rest wait (rank 0 of every node): a
    # member is idle when its own gap is at most idle_ratio of the last
    # arriver's; the busy ones are the section's ranks, and the charge runs
    # from the last idle arrival to the last arrival (for one busy rank that
    # is the straggler's last - second-to-last).
    # (member-size temporaries one at a time: they set the detector's peak)
    sizes = np.diff(colls.g_start)  # a group's member rows are contiguous: repeats, not gathers
    thr = np.repeat(gap_last, sizes)
    thr *= idle_ratio
    idle_m = gap <= thr
    del thr
    starts = colls.g_start[:-1]
    t_idle = np.where(idle_m, colls.m_t0_ns, np.iinfo(np.int64).min)
    t_idle_last = np.maximum.reduceat(t_idle, starts)
    del t_idle
    t_idle_last = np.where(t_idle_last > np.iinfo(np.int64).min, t_idle_last, colls.g_second_ns)
    charge = (colls.g_last_ns - t_idle_last).astype(np.float64)
    # Who held whom: a late non-root of a bcast delays nobody there, unless the
    # root is one of the busy ranks too (the few work, the rest wait for the
    # root, and the last busy rank holds the next collective): then the
    # section's charge still runs to the last busy arrival. (Whether the root
    # is busy is looked at only in the groups where it decides: not held.)
    held = holds_others(run, colls)
    ok = complete & blocking & held
    root = root_world_ranks(run, colls)
    need = complete & blocking & ~held
    for g_lo, g_hi, a, b in group_blocks(colls) if need.any() else ():  # per block of ~262,144 member rows
        w = need[g_lo:g_hi]
        if w.any():
            busy_root = (colls.m_rank[a:b] == np.repeat(root[g_lo:g_hi], sizes[g_lo:g_hi])) & ~idle_m[a:b]
            rb = np.maximum.reduceat(busy_root.astype(np.int8), starts[g_lo:g_hi] - a) > 0
            ok[g_lo:g_hi] |= w & rb
    idle = ok & (charge >= min_window_ns)
    if not idle.any():
        return []
    # the others' median gap last, for the groups the tests above left only
    idle &= _others_at_most(colls, gap, idle_ratio * gap_last, want=idle)
    if not idle.any():
        return []

    # intermittent: per (rank, call site), late-while-idle at no more than max_share of its calls
    n_rank = int(max(run.world_size, int(colls.m_rank.max()) + 1))
    n_site = int(colls.m_site.max()) + 1
    # calls per (rank, site) in complete groups, by blocks of groups (member-size keys)
    calls = np.zeros(n_rank * n_site, np.int64)
    for _g_lo, _g_hi, a, b in group_blocks(colls):  # per block of ~262,144 member rows
        mem_ok = complete[colls.m_group[a:b]]
        rs_key = colls.m_rank[a:b][mem_ok].astype(np.int64)
        rs_key *= n_site
        rs_key += colls.m_site[a:b][mem_ok]
        calls += np.bincount(rs_key, minlength=n_rank * n_site)
    g_key = colls.m_rank[last_row].astype(np.int64) * n_site + colls.m_site[last_row].astype(np.int64)
    late = np.bincount(g_key[idle], minlength=n_rank * n_site)
    intermittent = late[g_key] <= max_share * calls[g_key]
    # the rank before it (a waiting one) came from another line
    site_differs = (colls.m_site[last_row] != colls.m_site[np.maximum(last_row - 1, starts)]) & (
        colls.m_site[last_row] > 0
    )
    cand = np.flatnonzero(idle)
    c_rank = colls.g_last_rank[cand].astype(np.int64)
    c_b = colls.g_last_ns[cand].astype(np.int64)
    c_a = c_b - gap[last_row[cand]]
    active = np.zeros(len(colls), bool)
    active[cand] = _activity_ns(run, c_rank, c_a, c_b) >= activity_share * gap_last[cand]
    # the root prepares what it sends: the late rank is the root of a bcast/scatter (the
    # others idle since their previous collective, by `idle` above): only it runs that
    # work, at every call of the site (the commonest serial section, issue 20)
    root_prepares = one_to_many_root_late(run, colls)
    serial = cand[intermittent[cand] | site_differs[cand] | active[cand] | root_prepares[cand]]
    if len(serial) == 0:
        return []

    in_serial = np.zeros(len(colls), bool)
    in_serial[serial] = True
    s_lead = np.clip(_lead(colls, idle_m, in_serial)[serial], 0, n_rank - 1).astype(np.int64)
    others = _others_median(colls, gap, want=in_serial)  # for the evidence: the serial groups' only
    per_lead_ns = np.bincount(s_lead, weights=charge[serial], minlength=n_rank)
    # lead rank -> (late_rank, gap_t0_ns, idle_last_ns, last_ns), one entry per serial collective: the
    # late rank's stretch of own work [gap_t0, last] and the charged window [last idle arrival, last
    # arrival] inside it (the finding's windows as a symptom, and its claims as a cause)
    windows: dict[int, tuple[np.ndarray, ...]] = {}
    findings = []
    t_run0 = run.start_ns
    leads = [int(k) for k in np.flatnonzero(per_lead_ns >= min_fraction * wall_s * 1e9)]  # over threshold: few
    sections = [serial[s_lead == k] for k in leads]
    # what the late ranks did in their stretches, every section in one pass over the bands
    sec_of = np.repeat(np.arange(len(leads)), [len(m) for m in sections])
    g_all = np.concatenate(sections) if sections else np.zeros(0, np.int64)
    lr_all = last_row[g_all]
    dids = _what_it_did(run, sec_of, colls.g_last_rank[g_all].astype(np.int64), colls.m_t0_ns[lr_all] - gap[lr_all],
                        colls.m_t0_ns[lr_all], len(leads), top)  # fmt: skip
    for k, mine, did in zip(leads, sections, dids):
        lr = last_row[mine]
        late_rank = colls.g_last_rank[mine].astype(np.int64)
        windows[k] = (late_rank, (colls.g_last_ns[mine] - gap[lr]).astype(np.int64),
                      t_idle_last[mine].astype(np.int64), colls.g_last_ns[mine].astype(np.int64))  # fmt: skip
        # the section's ranks: busy in at least half of its windows
        busy_rows = np.flatnonzero(np.isin(colls.m_group, mine) & ~idle_m)
        br, bc = np.unique(colls.m_rank[busy_rows], return_counts=True)
        ranks = sorted({k, *(int(x) for x in br[bc * 2 >= len(mine)])})
        # removed in the replay: every busy member's stretch from the last idle arrival to its own (the
        # few ranks that work together all arrive late; taking one's window alone saves nothing)
        b_t0 = t_idle_last[colls.m_group[busy_rows]].astype(np.int64)
        b_t1 = colls.m_t0_ns[busy_rows].astype(np.int64)
        on = b_t1 > b_t0
        drop = (colls.m_rank[busy_rows][on].astype(np.int64), b_t0[on], b_t1[on])
        cost_s = float(per_lead_ns[k]) / 1e9
        s = cost_s / wall_s
        coll_sites = tally(colls.m_site[lr], charge[mine], run, top, key="s", ndigits=4)
        ops = tally(colls.g_op[mine], charge[mine], run, top, key="s", ndigits=4)
        # the late rank's previous collective: where the serial stretch starts
        prev_site = _prev_sites(run, colls, late_rank, colls.m_t0_ns[lr] - gap[lr], top)
        top_site = next(iter(coll_sites), "?")
        top_op = next(iter(ops), "collective")
        # how many of the lead rank's calls at that site were serial
        site_id = run.sid(top_site) if top_site != "?" else 0
        n_calls = int(calls[k * n_site + site_id]) if 0 <= site_id < n_site else 0
        n_here = int(np.count_nonzero(colls.m_site[lr] == site_id))
        every = f"{n_here} of {n_calls}" if n_calls else str(len(mine))
        cap = 1.0 / s if s > 0 else float("inf")
        who = f"rank {k} works alone" if len(ranks) == 1 else f"ranks {rank_ranges(ranks)} work"
        summary = (
            f"{who} while the others wait in {top_op} ({every} calls at {_short(top_site)}): "
            f"{secs(cost_s)} serial = {s:.0%} of the run (Amdahl: more ranks can speed it up {cap:.3g}x at most)"
        )
        wins = [
            {"t0_s": round((int(a) - t_run0) / 1e9, 4), "dur_s": round((int(b) - int(a)) / 1e9, 4),
             "op": run.s(int(colls.g_op[g])), "seq": int(colls.g_seq[g])}
            for g, a, b in zip(mine[:10], windows[k][2][:10], windows[k][3][:10])
        ]  # fmt: skip
        findings.append(
            Finding(
                kind="serial_section",
                cost_s=cost_s,
                summary=summary,
                # removed: each lone window (the late rank working while the others wait in the collective), as
                # rank-time, so that a cause claiming the same time (an I/O finding) counts it once with it
                change=Change(f"{'rank' if len(ranks) == 1 else 'ranks'} {rank_ranges(ranks)}'s lone windows before "
                              "the collectives removed", drop_rank=drop[0], drop_t0=drop[1], drop_t1=drop[2]),  # fmt: skip
                ranks=ranks,
                hosts=run.hosts_of(ranks),
                claims=(windows[k][0], windows[k][2], windows[k][3]),
                windows=functools.partial(_stretches, windows[k]),
                evidence={
                    "lead_rank": k,
                    "serial_fraction": round(s, 4),
                    "amdahl_speedup_cap": round(cap, 3) if np.isfinite(cap) else None,
                    "windows": int(len(mine)),
                    "median_window_ms": round(float(np.median(charge[mine])) / 1e6, 3),
                    "collective_sites": coll_sites,
                    "previous_collective_sites": prev_site,
                    "in_between": did,
                    "others_median_gap_ms": round(float(np.median(others[mine])) / 1e6, 3),
                    "why_serial": {
                        "intermittent": int(np.count_nonzero(intermittent[mine])),
                        "call_site_differs": int(np.count_nonzero(site_differs[mine])),
                        "recorded_activity": int(np.count_nonzero(active[mine])),
                        "root_prepares": int(np.count_nonzero(root_prepares[mine])),
                    },
                    "first_windows": wins,
                },
                advice=ADVICE,
            )
        )
    return findings


def _stretches(w: tuple[np.ndarray, ...], run: Run, colls: Collectives) -> Windows:
    """A section's windows as a symptom: per serial collective, the late rank's stretch of own work
    and the charge (its lone window's length)."""
    rank, g0, idle_last, last = w
    return rank, g0, last, last - idle_last


def _prev_sites(run: Run, colls: Collectives, rank: np.ndarray, t_ns: np.ndarray, limit: int) -> dict[str, int]:
    """Call sites of the collectives of ``rank[i]`` that ended at ``t_ns[i]`` (where its serial stretch starts)."""
    mine = np.isin(colls.m_rank, rank) & (colls.m_t1_ns >= 0)
    if not mine.any():
        return {}
    # one sorted key per (rank, exit time): rank in the high bits, time below
    lo = int(min(colls.m_t1_ns[mine].min(), t_ns.min()))
    span = int(max(colls.m_t1_ns[mine].max(), t_ns.max())) - lo + 1
    key = colls.m_rank[mine].astype(np.int64) * span + (colls.m_t1_ns[mine] - lo)
    sites = colls.m_site[mine]
    o = np.argsort(key)
    key, sites = key[o], sites[o]
    q = rank.astype(np.int64) * span + (t_ns.astype(np.int64) - lo)
    k = np.searchsorted(key, q, side="right") - 1
    hit = (k >= 0) & (key[np.maximum(k, 0)] == q)
    u, c = np.unique(sites[k[hit]], return_counts=True)
    order = np.argsort(-c)[:limit]
    return {run.s(int(u[i])) or "?": int(c[i]) for i in order}


def _what_it_did(
    run: Run, sec: np.ndarray, rank: np.ndarray, a_ns: np.ndarray, b_ns: np.ndarray, n_sec: int, limit: int
) -> list[list[dict[str, Any]]]:
    """Per section ``0..n_sec``: the recorded calls of ``rank[i]`` inside its stretch [a_ns[i], b_ns[i]]
    (the windows ``i`` with ``sec[i]`` that section), grouped by (kind, name, site), longest first.

    One pass over the bands (:mod:`distdiag.bands`) for every section: each
    window is answered from its rank's band, and a section's calls are kept in
    the run's row order (bands in rank order, rows ascending in a band), so its
    sums add the same numbers in the same order whatever the band size.
    """
    picked: list[list[np.ndarray]] = [[] for _ in range(n_sec)]
    for band, q in _by_band(run, rank):
        rows = band.rows(_ACTIVITY_KINDS)
        if len(rows) == 0:
            continue
        ev = band.events
        r_rows = ev["rank"][rows]
        for s in np.unique(sec[q]):  # the sections with windows in this band: few
            qs = q[sec[q] == s]
            got = rows[np.isin(r_rows, rank[qs])]
            if len(got) == 0:
                continue
            t0 = ev["t0_ns"][got]
            # windows of one rank never overlap; key them by (rank, start) like the events
            # (ties, degenerate zero-length windows, resolved to the longest)
            lo = int(min(t0.min(), a_ns[qs].min()))
            span = int(max(t0.max(), b_ns[qs].max())) - lo + 1
            wr = (rank[qs] - band.r_lo) * span
            wa = wr + (a_ns[qs].astype(np.int64) - lo)
            wb = wr + (b_ns[qs].astype(np.int64) - lo)
            o = np.lexsort((wb, wa))
            a, b = wa[o], wb[o]
            et = (ev["rank"][got].astype(np.int64) - band.r_lo) * span + (t0.astype(np.int64) - lo)
            k = np.searchsorted(a, et, side="right") - 1
            inside = (k >= 0) & (et <= b[np.maximum(k, 0)])
            if inside.any():
                picked[s].append(ev.take(got[inside]))
    return [_calls(run, np.concatenate(p), limit) if p else [] for p in picked]


def _calls(run: Run, e: np.ndarray, limit: int) -> list[dict[str, Any]]:
    """Event rows ``e`` grouped by (kind, name, site): the ``limit`` longest in all, with count and seconds."""
    key = np.stack([e["kind"].astype(np.int64), e["name_id"].astype(np.int64), e["site_id"].astype(np.int64)], 1)
    u, inv, cnt = np.unique(key, axis=0, return_inverse=True, return_counts=True)
    inv = inv.reshape(-1)
    dur = np.bincount(inv, weights=np.maximum(0, e["t1_ns"] - e["t0_ns"]).astype(np.float64))
    out = []
    for i in np.argsort(-dur)[:limit]:  # a handful
        out.append({"call": f"{Kind(int(u[i, 0])).name.lower()} {run.s(int(u[i, 1]))}".strip(),
                    "site": run.s(int(u[i, 2])) or "?", "count": int(cnt[i]), "s": round(float(dur[i]) / 1e9, 4)})  # fmt: skip
    return out


def _short(site: str) -> str:
    """/long/path/to/train.py:42 -> train.py:42 (the evidence keeps the full path)."""
    return site.rsplit("/", 1)[-1]

