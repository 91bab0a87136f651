"""Replay: the run as work segments between rendezvous, replayed with changed durations.

Issue 20's what-if model (the ByteDance what-if analysis, OSDI'25, arXiv
2505.05713, for any MPI / PyTorch job). From the matched collectives:

* per rank, the **work segments** between its rendezvous: a segment is the
  rank's own time from its previous rendezvous exit (or its start) to its
  arrival at the next one;
* per member of a collective, the **transfer** after the arrivals it waits
  for: its exit minus the latest arrival it depends on.

Replaying the recorded durations reproduces the recorded exits exactly
(``arrival' = previous exit' + segment``, ``exit' = max arrival' over the members
it waits for + transfer``). A counterfactual (:class:`Change`) changes durations
and replays; ``saving_s`` is the recorded wall-clock minus the replayed one:
what the job would save without that cause, with every later rendezvous
absorbing or passing on the change as it does in the run.

What a member waits for (the collective's semantics, as the straggler detector
judges them, :data:`distdiag.detectors.straggler.ONE_TO_MANY`):

* most collectives (all-reduce, barrier, all-gather, ...): every member;
* one-to-many (bcast, scatter): a non-root its own arrival and the root's;
  the root only its own;
* many-to-one (reduce, gather): the root every member; a non-root only itself.

Scope (say it where a number depends on it): the rendezvous are the complete
blocking collectives (``Kind.COLL``) whose members all returned. Non-blocking
collectives, point-to-point calls and waits are inside the segments, replayed
as recorded; a hang's open collective and everything after it is the rank's
tail, as recorded. The run's ``end`` per rank is its last exit' plus the tail
it recorded after its last rendezvous.

Cost: one step per collective group, numpy over its members (a step costs a
few µs plus ~10 ns a member): 1024 ranks x 50k all-reduces replays in ~1 s.
Groups are replayed in the order of their last arrival, which is each rank's
own order when the collectives synchronize; a run whose rooted collectives
let a rank run ahead so far that this order breaks it is said to be not
replayable (:attr:`Model.reason`), never replayed wrong.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from distdiag import intervals
from distdiag.match import Collectives
from distdiag.schema import Kind

#: member roles: whom a member waits for
_ALL, _ROOT, _SELF, _EVERYONE_AT_ROOT = 0, 1, 2, 3


@dataclass(frozen=True)
class Change:
    """One counterfactual: what differs from the recorded run. Every field may be empty.

    ``median_ranks``: these ranks' segments before each collective they join
    run at the median of the other members' segments before it, where that is
    shorter (a straggler at its peers' pace). ``transfer_cut_ns``:
    per group, every member's transfer after the arrivals it waits for is this
    much shorter, down to 0 (a slow link's collectives at the median pair's
    bandwidth). ``drop_rank``/``drop_t0``/``drop_t1``: rank-time intervals (ns) taken
    out of the segments they fall in, or out of the rank's tail after its last
    rendezvous (a serial section's lone windows, a storm's blocked time, a loader's waits).
    Time is dropped as rank-time, never as a length cut from a segment, so that two causes
    claiming the same stretch count it once (:meth:`plus`)."""

    what: str
    median_ranks: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    transfer_cut_ns: np.ndarray | None = None
    drop_rank: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    drop_t0: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    drop_t1: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    def plus(self, other: Change) -> Change:
        """Both changes at once (the cumulative ranking: the first cause removed, then the next).
        Dropped rank-time counts once where both drop it (the replay takes the union)."""
        cut = self.transfer_cut_ns
        if other.transfer_cut_ns is not None:  # two causes of one slow transfer: the larger cut
            cut = other.transfer_cut_ns if cut is None else np.maximum(cut, other.transfer_cut_ns)
        return Change(
            what=f"{self.what}; {other.what}",
            median_ranks=np.union1d(self.median_ranks, other.median_ranks).astype(np.int64),
            transfer_cut_ns=cut,
            drop_rank=np.concatenate([self.drop_rank, other.drop_rank]).astype(np.int64),
            drop_t0=np.concatenate([self.drop_t0, other.drop_t0]).astype(np.int64),
            drop_t1=np.concatenate([self.drop_t1, other.drop_t1]).astype(np.int64),
        )

    def reaches(self, m: Model, t_ns: int) -> bool:
        """True when the change alters the run at or after ``t_ns`` (a straggler's pace: always)."""
        if len(self.median_ranks) or (len(self.drop_t1) and bool((self.drop_t1 > t_ns).any())):
            return True
        cut = self.transfer_cut_ns
        return cut is not None and bool((m.colls.g_last_ns[m.order][cut[m.order] > 0] > t_ns).any())

    def touches(self, m: Model) -> bool:
        """True when the change alters something the replay replays (else it would price 0 wrongly)."""
        if len(self.median_ranks) or len(self.drop_rank):
            return True
        cut = self.transfer_cut_ns
        return cut is not None and bool((cut[m.order] > 0).any())


@dataclass
class Model:
    """The run's rendezvous graph, ready to replay (:func:`model`)."""

    colls: Collectives
    #: the groups replayed, in replay order
    order: np.ndarray
    #: per group: the member role scheme (0 all, 1 one-to-many, 2 many-to-one) and the root's world rank
    scheme: np.ndarray
    root: np.ndarray
    #: indexed by rank: the rank's start and end (ns), True where the rank is in the run
    start_ns: np.ndarray
    end_ns: np.ndarray
    present: np.ndarray
    #: the recorded run's wall-clock (first start to last end), ns
    wall_ns: int
    #: why the run cannot be replayed ("" when it can)
    reason: str = ""
    #: from this time (ns) on the ranks also synchronize through what the replay keeps as recorded
    #: (non-blocking collectives, point-to-point calls and waits): a change there is not replayed
    coupled_from_ns: int = np.iinfo(np.int64).max
    coupled_why: str = ""

    def replay(self, change: Change | None = None) -> np.ndarray:
        """Each rank's end (ns, indexed by rank) when the run is replayed with ``change``."""
        return _replay(self, change)

    def saving_s(self, change: Change) -> float:
        """Recorded wall-clock minus the wall-clock replayed with ``change`` (seconds, >= 0 by construction
        only when the change shortens durations, which every :class:`Change` does)."""
        end = self.replay(change)
        first = int(self.start_ns[self.present].min()) if self.present.any() else 0
        new_wall = int(end[self.present].max()) - first if self.present.any() else 0
        return (self.wall_ns - new_wall) / 1e9


def model(run: Any, colls: Collectives) -> Model:
    """The replay model of ``run`` (aligned) from its matched collectives."""
    from distdiag.detectors.straggler import MANY_TO_ONE, ONE_TO_MANY, root_world_ranks
    from distdiag.match import MatchState

    start, end = run.rank_bounds()
    present = np.zeros(len(start), bool)
    present[np.fromiter(run.ranks, np.int64, len(run.ranks))] = True
    wall = int(end[present].max() - start[present].min()) if present.any() else 0
    n_g = len(colls)
    if n_g == 0:
        return Model(colls, np.zeros(0, np.int64), np.zeros(0, np.int8), np.zeros(0, np.int64), start, end, present,
                     wall)  # fmt: skip
    sizes = np.diff(colls.g_start)
    first = colls.g_start[:-1]
    blocking = np.zeros(n_g, bool)
    nz = sizes > 0
    blocking[nz] = colls.m_kind[first[nz]] == Kind.COLL  # a group's members share their kind
    # every member returned: the last exit is known
    ok = blocking & (colls.g_state == MatchState.COMPLETE) & (colls.g_exit_ns >= 0)
    groups = np.flatnonzero(ok)
    order = groups[np.lexsort((groups, colls.g_first_ns[groups], colls.g_last_ns[groups]))]
    root = root_world_ranks(run, colls).astype(np.int64)

    def ids(names: frozenset[str]) -> np.ndarray:
        return np.array([i for i in (run.sid(n) for n in names) if i >= 0], np.int64)

    scheme = np.zeros(n_g, np.int8)
    rooted = root >= 0
    scheme[rooted & np.isin(colls.g_op, ids(ONE_TO_MANY))] = 1
    scheme[rooted & np.isin(colls.g_op, ids(MANY_TO_ONE))] = 2
    m = Model(colls, order, scheme, root, start, end, present, wall)
    m.coupled_from_ns, m.coupled_why = _coupling(run, colls, ok, blocking, wall)
    if not _in_each_ranks_order(colls, order):
        m.reason = ("a rank's collectives replayed out of its own order (rooted collectives let ranks run "
                    "ahead): not replayable one group at a time")  # fmt: skip
    return m


def _in_each_ranks_order(colls: Collectives, order: np.ndarray) -> bool:
    """True when replaying the groups in ``order`` meets every rank's collectives in the order it
    called them: the members taken group by group in ``order``, then stably by rank, have
    arrivals that never go back within a rank. (One stable sort by the rank column: 0.06 s against
    0.64 s for a sort by (rank, arrival, place) at 1024 ranks x 5,000 groups.)"""
    if len(order) == 0:
        return True
    gs = colls.g_start
    sizes = (gs[order + 1] - gs[order]).astype(np.int64)
    first = np.cumsum(sizes) - sizes  # where each group's members begin in the gathered order
    rows = np.repeat(gs[order].astype(np.int64) - first, sizes) + np.arange(int(sizes.sum()), dtype=np.int64)
    r = colls.m_rank[rows]
    # stable sorts of 16-bit keys are radix sorts: 4x faster than of the int32 column (5M members)
    o = np.argsort(r.astype(np.uint16) if int(r.max()) < 1 << 16 else r, kind="stable")
    r, t = r[o], colls.m_t0_ns[rows][o]
    return not bool(((r[1:] == r[:-1]) & (t[1:] < t[:-1])).any())


#: the share of the replayed groups that non-blocking ones may reach, and of the wall-clock that
#: any rank may spend in blocking point-to-point calls and waits, before the replay stops there
ASYNC_SHARE = 0.01
P2P_SHARE = 0.05


def _coupling(run: Any, colls: Collectives, ok: np.ndarray, blocking: np.ndarray, wall_ns: int) -> tuple[int, str]:
    """(from when, why) the ranks synchronize through what the replay does not model: complete
    non-blocking collectives of two or more members (DDP's gradient buckets) past ``ASYNC_SHARE``
    of the blocking ones, or a rank's blocking point-to-point calls and waits past ``P2P_SHARE``
    of the wall-clock. (int64 max, "") when neither."""
    from distdiag.match import MatchState
    from distdiag.rows import rows_of

    t = int(np.iinfo(np.int64).max)
    why = []
    nb = (~blocking) & (colls.g_state == MatchState.COMPLETE) & (colls.g_n_members >= 2)
    n_async = int(nb.sum())
    if n_async > ASYNC_SHARE * max(int(ok.sum()), 1):
        t = min(t, int(colls.g_first_ns[nb].min()))
        why.append(f"{n_async} non-blocking collectives (DDP's gradient buckets, Iallreduce, ...)")
    rows = rows_of(run, (int(Kind.SEND), int(Kind.RECV), int(Kind.WAIT)))
    if len(rows) and wall_ns > 0:
        ev = run.events
        r = ev["rank"][rows].astype(np.int64)
        t0 = ev["t0_ns"][rows].astype(np.int64)
        held = intervals.union_length_by_key(r, t0, np.maximum(ev["t1_ns"][rows], t0), int(r.max()) + 1)
        if float(held.max()) > P2P_SHARE * wall_ns:
            t = min(t, int(t0.min()))
            why.append(f"point-to-point calls and waits (up to {float(held.max()) / 1e9:.3g} s a rank)")
    if not why:
        return t, ""
    return t, ("from then on the ranks also synchronize through " + " and ".join(why) + ", which the replay "
               "keeps as recorded: a change there is not replayed")  # fmt: skip


def _replay(m: Model, change: Change | None) -> np.ndarray:
    """The replay loop: each rank's end (ns, indexed by rank); one step per group in ``m.order``."""
    c = m.colls
    n = len(m.start_ns)
    rec_last = m.start_ns.copy()  # per rank: its latest recorded rendezvous exit (its start before the first)
    new_last = m.start_ns.copy()  # the same, replayed
    started = np.zeros(n, bool)  # past its first rendezvous (the launch skew before it is startup's)
    slow = np.zeros(n, bool)
    cuts: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    cap = None
    tail_cut = np.zeros(n, np.int64)
    if change is not None:
        slow[change.median_ranks[(change.median_ranks >= 0) & (change.median_ranks < n)]] = True
        c_g, c_r, c_ns, tail_cut = _cuts_of_drops(m, change.drop_rank, change.drop_t0, change.drop_t1)
        if len(c_g):
            o = np.argsort(c_g, kind="stable")
            bounds = np.flatnonzero(np.diff(c_g[o])) + 1
            for idx in np.split(o, bounds):  # one entry per changed group: a Python step per group, as the loop
                cuts[int(c_g[idx[0]])] = (c_r[idx], c_ns[idx])
        cap = change.transfer_cut_ns
    any_slow = bool(slow.any())
    gs, m_rank, m_t0, m_t1 = c.g_start, c.m_rank, c.m_t0_ns, c.m_t1_ns
    scheme, root = m.scheme, m.root
    for g in m.order.tolist():  # one step per collective group: numpy over its members
        lo, hi = int(gs[g]), int(gs[g + 1])
        r = m_rank[lo:hi]
        t0 = m_t0[lo:hi]
        t1 = m_t1[lo:hi]
        seg = t0 - rec_last[r]
        if change is not None:
            if any_slow:
                s = slow[r] & started[r]
                if s.any() and not s.all():
                    med = np.median(seg[~s])
                    seg = np.where(s & (seg > med), np.int64(med), seg)
            hit = cuts.get(g)
            if hit is not None:
                at = _positions(r, hit[0])
                okp = at < len(r)
                seg = seg.copy()
                np.subtract.at(seg, at[okp], hit[1][okp])
                np.maximum(seg, 0, out=seg)
        arr_new = new_last[r] + seg
        sch = int(scheme[g])
        if sch == _ALL:
            ref_rec = np.full(len(r), t0.max())
            ref_new = np.full(len(r), arr_new.max())
        else:
            at_root = r == root[g]
            if not at_root.any():  # the root never came: as every member
                ref_rec = np.full(len(r), t0.max())
                ref_new = np.full(len(r), arr_new.max())
            elif sch == 1:  # one-to-many: a non-root waits for the root
                k = int(np.argmax(at_root))
                ref_rec = np.maximum(t0, t0[k])
                ref_new = np.maximum(arr_new, arr_new[k])
            else:  # many-to-one: the root waits for everyone, the others for nobody
                ref_rec = np.where(at_root, t0.max(), t0)
                ref_new = np.where(at_root, arr_new.max(), arr_new)
        transfer = t1 - ref_rec
        if cap is not None and cap[g] > 0:
            transfer = np.maximum(transfer - cap[g], np.minimum(transfer, 0))
        exit_new = ref_new + transfer
        rec_last[r] = np.maximum(rec_last[r], t1)
        new_last[r] = np.maximum(new_last[r], exit_new)
        started[r] = True
    end = m.end_ns.copy()
    tail = np.maximum(m.end_ns - rec_last - tail_cut, 0)  # after the last rendezvous, as recorded
    out = new_last + tail
    end[m.present] = out[m.present]
    return end


def _cuts_of_drops(m: Model, rank: np.ndarray, t0: np.ndarray, t1: np.ndarray) -> tuple[np.ndarray, ...]:
    """Rank-time intervals as segment cuts: (group, rank, ns) per piece that falls in a segment
    (the stretch from a rendezvous exit to the rank's next arrival), and per rank the ns
    that fall in its tail after its last rendezvous. Overlapping intervals of one rank
    count once (their union); time inside a collective is not a segment's and is left.

    All ranks at once in band coordinates (:mod:`distdiag.intervals`): each rank's
    intervals and segments shifted into its own band, one union, one covered-within.
    Raises :class:`OverflowError` for times too far apart for int64 bands."""
    c = m.colls
    n = len(m.start_ns)
    ok = (rank >= 0) & (rank < n) & (t1 > t0)
    rank, t0, t1 = rank[ok].astype(np.int64), t0[ok].astype(np.int64), t1[ok].astype(np.int64)
    z = np.zeros(0, np.int64)
    tail = np.zeros(n, np.int64)
    if len(rank) == 0:
        return z, z, z, tail
    # the rendezvous members of the ranks named: the replay's own (m.order's groups)
    in_play = np.zeros(len(c), bool)
    in_play[m.order] = True
    want = np.zeros(n, bool)
    want[rank] = True
    rows = np.flatnonzero(in_play[c.m_group] & want[c.m_rank])
    rows = rows[np.lexsort((c.m_t0_ns[rows], c.m_rank[rows]))]
    m_r = c.m_rank[rows].astype(np.int64)
    arr = c.m_t0_ns[rows].astype(np.int64)
    ext = c.m_t1_ns[rows].astype(np.int64)
    # each segment: [the rank's latest exit before it (its start before the first), its arrival)
    first = np.r_[True, m_r[1:] != m_r[:-1]] if len(m_r) else np.zeros(0, bool)
    prev = np.empty(len(rows), np.int64)
    if len(rows):
        prev[1:] = ext[:-1]
        prev[first] = m.start_ns[m_r[first]]
    named = np.unique(rank)
    last_exit = m.start_ns[named].astype(np.int64)  # per rank named: its last rendezvous exit
    if len(rows):
        np.maximum.at(last_exit, np.searchsorted(named, m_r), ext)
    starts = (t0, last_exit, prev) if len(rows) else (t0, last_exit)
    band = intervals.band_of(len(named), *starts, ends=(t1, last_exit, ext) if len(rows) else (t1, last_exit))
    if band is None:
        raise OverflowError("times too far apart for the replay's band coordinates")
    lo, span = band
    top = span - 1  # a band's last ns: past every interval of its rank
    k_iv = np.searchsorted(named, rank)
    seg_s, seg_e = intervals.union_banded(k_iv, t0 - lo, t1 - lo, span)
    if len(rows):
        shift = np.searchsorted(named, m_r) * span - lo
        # the running max of exits within each rank (an exit earlier than one before it never reopens
        # a segment): in band coordinates one running max never carries a value into the next rank
        a = np.maximum.accumulate(prev + shift)
        cov = intervals.covered_within(seg_s, seg_e, np.minimum(a, arr + shift), arr + shift)
        hit = cov > 0
        g_out, r_out, ns_out = c.m_group[rows][hit].astype(np.int64), m_r[hit], cov[hit]
    else:
        g_out = r_out = ns_out = z
    k = np.arange(len(named), dtype=np.int64) * span
    tail[named] = intervals.covered_within(seg_s, seg_e, k + (last_exit - lo), k + top)
    return g_out, r_out, ns_out, tail


def _positions(r: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Index in ``r`` of each rank in ``want`` (len(r) where absent); r unsorted."""
    o = np.argsort(r, kind="stable")
    at = np.searchsorted(r[o], want)
    found = np.where(at < len(r), o[np.minimum(at, len(r) - 1)], len(r))
    return np.where((at < len(r)) & (r[np.minimum(found, len(r) - 1)] == want), found, len(r))


def price(findings: list[Any], run: Any, colls: Collectives) -> Model | None:
    """Each finding that states its counterfactual (``Finding.change``) gets ``evidence.replay``:
    the wall-clock the replay saves without it, and the counterfactual in words. Returns the
    model (for :func:`cumulate`), None when nothing was replayed."""
    for f in findings:  # a handful
        if f.change is None:
            f.change = claims_change(f, run)
    mine = [f for f in findings if f.change is not None]
    if not mine or len(colls) == 0:
        return None
    m = model(run, colls)
    for f in mine:  # a handful
        why = m.reason or ("" if f.change.touches(m) else NOT_REPLAYED)
        if not why and f.change.reaches(m, m.coupled_from_ns):
            why = m.coupled_why
        if why:
            f.evidence["replay"] = {"saving_s": None, "counterfactual": f.change.what, "why_not": why}
            continue
        f.evidence["replay"] = {"saving_s": round(max(0.0, m.saving_s(f.change)), 6),
                                "counterfactual": f.change.what}  # fmt: skip
    return m


def cumulate(ranked: list[Any], m: Model, keep: Callable[[Any, float], bool] | None = None) -> list[Any]:
    """The causes removed one after another in the order given: each replayed finding's
    ``evidence.replay`` gets ``together_s`` (the saving with it and every replayed finding before it
    removed at once) and ``after_above_s`` (what it adds to those before it: its own share, each
    second counted once by construction). ``keep(f, after_above_s)``, when given, decides whether the
    finding stays removed for those after it (False: it is left in the run, and out of the returned
    list). Returns the findings kept. Measured: a serial section replayed at 1.20 s and a straggler on
    another rank at 0.40 s, together 1.60 s, against 1.60 s saved by the job run without both
    (tests/test_ranking.py)."""
    acc: Change | None = None
    before = 0.0
    out = []
    for f in ranked:  # a handful: one replay each
        rp = f.evidence.get("replay")
        if f.change is None or not isinstance(rp, dict) or rp.get("saving_s") is None:
            out.append(f)
            continue
        trial = f.change if acc is None else acc.plus(f.change)
        # the first alone: its own saving, replayed already; removing more never lengthens the run
        together = float(rp["saving_s"]) if acc is None else max(before, m.saving_s(trial))
        added = max(0.0, together - before)
        if keep is not None and not keep(f, added):
            continue
        rp["together_s"] = round(together, 6)
        rp["after_above_s"] = round(added, 6)
        acc, before = trial, together
        out.append(f)
    return out


def overlap_s(m: Model, a: Any, b: Any) -> float:
    """The seconds two replayed findings both save: each alone, less both at once (>= 0)."""
    sa, sb = float(a.evidence["replay"]["saving_s"]), float(b.evidence["replay"]["saving_s"])
    return max(0.0, sa + sb - max(0.0, m.saving_s(a.change.plus(b.change))))


#: why a change the replay cannot see is not priced (rather than priced 0)
NOT_REPLAYED = ("it changes only non-blocking collectives or point-to-point calls, which the replay keeps as "
                "recorded inside the work segments")  # fmt: skip


def claims_change(f: Any, run: Any) -> Change | None:
    """A mechanism finding's counterfactual from its claims (:func:`distdiag.ranking._claims`: the
    rank-time of its rows, e.g. an input-bound rank's loader waits): that time removed."""
    from distdiag.ranking import CLAIMED_KINDS, _claims

    if f.kind not in CLAIMED_KINDS or f.kind in ("slow_link", "metadata_storm"):
        return None  # those state their own (transfers; the storm's windows with the unseen gaps)
    got = _claims(f, run)
    if got is None:
        return None
    r, t0, t1 = got
    if f.kind in ("input_bound", "h2d_copy"):  # the detector prices what compute did not hide: so does the replay
        r, t0, t1 = unhidden(run, r, t0, t1)
        return Change(f"the {f.kind} rows of the finding's ranks that compute did not hide removed", drop_rank=r,
                      drop_t0=t0, drop_t1=t1)  # fmt: skip
    return Change(f"the {f.kind} rows of the finding's ranks removed", drop_rank=r, drop_t0=t0, drop_t1=t1)


def unhidden(run: Any, rank: np.ndarray, t0: np.ndarray, t1: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The rank-time intervals less what the rank's compute covered (its compute phases, and on a
    GPU-timed run its GPU's busy spans: :func:`distdiag.detectors.input_bound.compute_rows`): a
    loader wait the GPU spends running queued kernels costs nothing, and taking it out of the
    replay would price it. Band by band of the ranks named (a streamed run reads only theirs)."""
    from distdiag.bands import bands
    from distdiag.detectors.input_bound import compute_rows

    if len(rank) == 0:
        return rank, t0, t1
    out_r, out_0, out_1 = [rank[:0]], [t0[:0]], [t1[:0]]
    for band in bands(run, ranks=np.unique(rank)):  # a few dozen bands at most
        mine = (rank >= band.r_lo) & (rank < band.r_hi)
        if not mine.any():
            continue
        r, a0, a1 = rank[mine].astype(np.int64), t0[mine].astype(np.int64), t1[mine].astype(np.int64)
        rows = compute_rows(band)
        if len(rows) == 0:
            out_r.append(r)
            out_0.append(a0)
            out_1.append(a1)
            continue
        cr = band.rank_of(rows).astype(np.int64)
        c0 = band.events["t0_ns"][rows].astype(np.int64)
        c1 = np.maximum(band.events["t1_ns"][rows], c0).astype(np.int64)
        lim = intervals.band_of(band.r_hi - band.r_lo, a0, c0, ends=(a1, c1))
        if lim is None:
            raise OverflowError("times too far apart for the replay's band coordinates")
        lo, span = lim
        a_s, a_e = intervals.union_banded(r - band.r_lo, a0 - lo, a1 - lo, span)
        b_s, b_e = intervals.union_banded(cr - band.r_lo, c0 - lo, c1 - lo, span)
        s_, e_ = intervals.subtract_sorted(a_s, a_e, b_s, b_e)
        k = s_ // span
        out_r.append(k + band.r_lo)
        out_0.append(s_ - k * span + lo)
        out_1.append(e_ - k * span + lo)
    return np.concatenate(out_r), np.concatenate(out_0), np.concatenate(out_1)
