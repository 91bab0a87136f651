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
judges them, :data:`distdiag.lateness.ONE_TO_MANY`):

* most collectives (all-reduce, barrier, all-gather, ...): every member;
* one-to-many (bcast, scatter): a non-root its own arrival and the root's;
  the root only its own;
* many-to-one (reduce, gather): the root every member; a non-root only itself.

Scope (say it where a number depends on it): the rendezvous are the complete
blocking collectives (``Kind.COLL``) whose members all returned, and the
complete non-blocking ones whose every member's wait the run shows
(:func:`_waits`: a ``WAIT`` row, or DDP's finalize inside a ``BACKWARD`` row).
Those are replayed as each rank's **launch** (its segment before it, as an
arrival's; the rank goes on), the group's **done** (per member: the last
launch' it waits for plus its transfer, the completion it saw less that
launch) and the rank's **wait** (it ends at the later of its entry' and the
groups it holds being done', plus what the wait recorded after both).
Receives matched with their sends whose completion the run shows (a blocking
receive; an ``Irecv`` completed in a WAIT row) are rendezvous too
(:func:`_p2p_events`), replayed in the batches of the launches and waits
(:func:`_levels`). Receives no wait completes (a test loop), non-blocking
collectives no wait shows (a test loop, a future never waited) and their waits
are inside the segments, replayed as recorded (:func:`_coupling` says when they couple the ranks); a hang's open
collective and everything after it is the rank's tail, as recorded. The
run's ``end`` per rank is its last exit' plus the tail it recorded after its
last rendezvous.

Cost: one step per blocking collective group and per non-blocking group's
done, numpy over its members (a step costs a few µs plus ~10 ns a member),
and one per batch of launches and waits, numpy over the batch (a rank's 1st,
2nd, ... such event between two group steps: :func:`_schedule`): 1024 ranks x
50k all-reduces replays in ~1 s. Steps are replayed in the order of their
key (a group's last arrival or launch, a launch's time, a wait's exit),
which is each rank's own order when the collectives synchronize; a run
whose rooted collectives let a rank run ahead so far that this order breaks
it is said to be not replayable (:attr:`Model.reason`), never replayed wrong.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from distdiag import intervals, links
from distdiag.lateness import EVERY_MEMBER, FROM_ROOT, root_world_ranks, wait_scheme
from distdiag.match import Collectives, by_rank_in_order
from distdiag.schema import Kind

if TYPE_CHECKING:
    from distdiag.run import Run

@dataclass(frozen=True)
class Change:
    """One counterfactual: what differs from the recorded run. Every field may be empty.

    ``median_ranks``: these ranks' segments before each collective they join
    run at the median of the other members' segments before it, where that is
    shorter (a straggler at its peers' pace). ``like_peers``: for some of those ranks,
    a map of its excess over that median to a typical peer's (:func:`peer_excess`): the
    blocking collective's segment then runs that much over the median, never longer than
    recorded (a straggler that also takes its turns at work every rank does, a duty that
    rotates, keeps those turns: at the median it would lose them too and be priced for
    them, 0.60 s against 0.20 s saved). ``transfer_cut_ns``:
    per group, every member's transfer after the arrivals it waits for is this
    much shorter, down to 0 (a slow link's collectives at the median pair's
    bandwidth; ``p2p_rows``/``p2p_cut_ns``: the same for the replayed point-to-point
    calls). ``transfer_ref_ns``: per group, the transfer the cut was read from
    (the median member's); given, each member's transfer is cut in that
    proportion instead (``cut / ref`` of it, at most all of it): a slow link
    spreads the members' exits as much as it lengthens them (a ring's last
    member ends 10-15% after its median one on a throttled node), and the
    members after the median would otherwise keep that spread, each step
    passing it on to the next one's arrivals. ``drop_rank``/``drop_t0``/``drop_t1``: rank-time intervals (ns) taken
    out of the segments they fall in, or out of the rank's tail after its last
    rendezvous (a serial section's lone windows, a storm's blocked time, a loader's waits).
    Time is dropped as rank-time, never as a length cut from a segment, so that two causes
    claiming the same stretch count it once (:meth:`plus`). ``balance``: at each collective
    every member waits for (all-reduce, barrier, all-gather, ...: not the rooted one-to-many
    and many-to-one ones, where who waits depends on the root), the members' segments before
    it run at their mean (the same work spread evenly over the members: a load imbalance
    rebalanced; each rank's segment before its first rendezvous, launch skew, is kept); a
    non-blocking one's members launch after their group's mean recorded segment."""

    what: str
    median_ranks: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    transfer_cut_ns: np.ndarray | None = None
    transfer_ref_ns: np.ndarray | None = None
    drop_rank: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    drop_t0: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    drop_t1: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    #: point-to-point calls whose transfer is shorter: their ``run.events`` rows, by how much (ns)
    #: and their start (ns); a call the replay keeps in the segments is not changed
    p2p_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    p2p_cut_ns: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    p2p_t_ns: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    balance: bool = False
    #: ``balance`` for the replayed point-to-point calls too: each one's segment at the mean of its
    #: exchange's (:func:`p2p_work`: every rank's k-th call between two collectives, a halo's exchange)
    balance_p2p: bool = False
    #: per rank of ``median_ranks`` that has one: (its excess quantiles, a typical peer's), ns
    like_peers: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    #: the same at the point-to-point exchanges (read off them: work before an exchange is not
    #: work between collectives)
    like_p2p: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    #: per rank of ``median_ranks`` whose collectives have one or two peers (a job of 2 or 3 ranks):
    #: per group, the pace its excess is measured from there instead of the median (NaN: the
    #: median), and the excess may be negative (:func:`distdiag.detectors.straggler._peer_ref`)
    peer_ref: dict[int, np.ndarray] = field(default_factory=dict)

    def plus(self, other: Change) -> Change:
        """Both changes at once (the cumulative ranking: the first cause removed, then the next).
        Dropped rank-time counts once where both drop it (the replay takes the union)."""
        cut, ref = self.transfer_cut_ns, self.transfer_ref_ns
        if other.transfer_cut_ns is not None:  # two causes of one slow transfer: the larger share
            if cut is None:
                cut, ref = other.transfer_cut_ns, other.transfer_ref_ns
            else:
                cut, ref = _larger_cut(cut, ref, other.transfer_cut_ns, other.transfer_ref_ns)
        return Change(
            what=f"{self.what}; {other.what}",
            median_ranks=np.union1d(self.median_ranks, other.median_ranks).astype(np.int64),
            transfer_cut_ns=cut,
            transfer_ref_ns=ref,
            drop_rank=np.concatenate([self.drop_rank, other.drop_rank]).astype(np.int64),
            drop_t0=np.concatenate([self.drop_t0, other.drop_t0]).astype(np.int64),
            drop_t1=np.concatenate([self.drop_t1, other.drop_t1]).astype(np.int64),
            p2p_rows=np.concatenate([self.p2p_rows, other.p2p_rows]).astype(np.int64),  # a row twice: the larger cut
            p2p_cut_ns=np.concatenate([self.p2p_cut_ns, other.p2p_cut_ns]).astype(np.int64),
            p2p_t_ns=np.concatenate([self.p2p_t_ns, other.p2p_t_ns]).astype(np.int64),
            balance=self.balance or other.balance,
            balance_p2p=self.balance_p2p or other.balance_p2p,
            like_peers={**other.like_peers, **self.like_peers},
            like_p2p={**other.like_p2p, **self.like_p2p},
            peer_ref={**other.peer_ref, **self.peer_ref},
        )

    def reaches(self, m: Model, t_ns: int) -> bool:
        """True when the change alters the run at or after ``t_ns`` (a straggler's pace: always)."""
        if self.balance or self.balance_p2p or len(self.median_ranks) or (len(self.drop_t1) and bool((self.drop_t1 > t_ns).any())):
            return True
        if len(self.p2p_t_ns) and bool((self.p2p_t_ns[self.p2p_cut_ns > 0] >= t_ns).any()):
            return True
        cut = self.transfer_cut_ns
        return cut is not None and bool((m.colls.g_last_ns[m.order][cut[m.order] > 0] > t_ns).any())

    def touches(self, m: Model) -> bool:
        """True when the change alters something the replay replays (else it would price 0 wrongly)."""
        if len(self.median_ranks) or len(self.drop_rank):
            return True
        if self.balance and bool((m.scheme[m.order] == EVERY_MEMBER).any()):
            return True
        if self.balance_p2p and (got := p2p_work(m)) is not None and len(got[0]) > 0:
            return True
        if len(self.p2p_rows) and m.waits is not None and len(m.waits.p2p_rows):
            if bool(np.isin(self.p2p_rows[self.p2p_cut_ns > 0], m.waits.p2p_rows).any()):
                return True
        cut = self.transfer_cut_ns
        return cut is not None and bool((cut[m.order] > 0).any())


def _larger_cut(a: np.ndarray, a_ref: np.ndarray | None, b: np.ndarray,
                b_ref: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:  # fmt: skip
    """Per group, the larger of two transfer cuts, as (cut, ref): a proportional cut (with its
    ref) counts as its share of the ref, a plain one as a share of the same ref."""
    if a_ref is None and b_ref is None:
        return np.maximum(a, b), None
    ref = np.maximum(a_ref if a_ref is not None else 0, b_ref if b_ref is not None else 0).astype(np.int64)
    return np.maximum(a, b), np.where(ref > 0, ref, 0).astype(np.int64)


@dataclass
class Waits:
    """The ranks' own events around non-blocking collectives, replayed one rank at a time: the
    **launches** (the rank goes on) and the **waits**, where a rank blocks on them as the
    breakdown reads it (:mod:`distdiag.breakdown`): a ``WAIT`` row (``MPI_Wait``, ``Work.wait``)
    that holds a member's completion, or else, for DDP's buckets, the ``BACKWARD`` row that holds
    its launch, entered at the rank's last launch inside it (autograd has no gradient left to
    produce). One row per event, in replay order: its rank, entry and exit (ns; a launch's are
    its time), ``launch`` and, for a launch, ``ref``: its member's position in the async members'
    own numbering (``a_off``); for a wait, the members it waits for (``cov``, CSR by event in
    ``cov_start``; a launch's range is empty). ``batch_end[i]``: where the batch that event i
    opens ends."""

    rank: np.ndarray
    entry_ns: np.ndarray
    exit_ns: np.ndarray
    cov_start: np.ndarray
    cov: np.ndarray
    batch_end: np.ndarray
    #: per group: where its members begin in the async members' numbering (-1: not a replayed async group)
    a_off: np.ndarray
    n_async: int
    #: the ``run.events`` rows of the waits (``WAIT`` or ``BACKWARD``), ascending
    rows: np.ndarray
    #: per async member (``a_off`` numbering): its completion as seen, no later than its wait's end
    seen_ns: np.ndarray
    launch: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))
    ref: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    #: per entry of ``cov`` as :func:`_waits` made it: the event of the wait holding it (for _schedule's CSR)
    cov_of: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    #: per async member: its recorded segment before the launch (filled by the first plain replay)
    seg_ns: np.ndarray | None = None
    #: the point-to-point events' dependencies (:class:`_P2P`), as pairs of event indices sorted
    #: by ``dep_e`` once :func:`_schedule` ran, and where each event's begin (``dep_start``, CSR);
    #: None when the run has none replayed
    dep_e: np.ndarray | None = None
    dep_p: np.ndarray | None = None
    dep_start: np.ndarray | None = None
    p2p: np.ndarray | None = None
    #: the ``run.events`` rows of the point-to-point events, ascending
    p2p_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    #: per event: a point-to-point event's call site (string id; -1 for the others)
    p2p_site: np.ndarray | None = None
    #: per entry of ``p2p_rows``: its event
    p2p_row_event: np.ndarray | None = None
    #: per event: a point-to-point event's recorded segment before it where its rank is past its
    #: first rendezvous, else -1 (filled by the first plain replay; :func:`p2p_work`)
    p2p_seg_ns: np.ndarray | None = None
    #: :func:`p2p_work`'s result, made once
    exchanges: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None


@dataclass
class Model:
    """The run's rendezvous graph, ready to replay (:func:`model`)."""

    colls: Collectives
    #: the groups replayed, in replay order
    order: np.ndarray
    #: per group: whom its members wait for (:func:`distdiag.lateness.wait_scheme`) and the root's world rank
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
    #: the launches and waits of non-blocking collectives (:class:`Waits`), replayed in steps of their own
    waits: Waits | None = None
    #: the replay's steps in order: per step, 0 (a blocking group of ``order``'s), 1 (a batch of
    #: launches and waits: ``waits.batch_end`` closes it) or 2 (a non-blocking group of ``order``'s:
    #: when it is done, from its members' launches), and the group, or the batch's first event
    step_kind: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int8))
    step_ref: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    #: per step, what a batch holds (:func:`_step_bits`), made by the first replay
    step_bits: np.ndarray | None = None

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


def model_of(run: Run, colls: Collectives) -> Model:
    """:func:`model`, made once per run and collectives (a detector that reads it, then the pricing)."""
    got = run.cache.replay_model
    if got is None or got[0] is not colls:
        got = run.cache.replay_model = (colls, model(run, colls))
    return got[1]


def model(run: Run, colls: Collectives) -> Model:
    """The replay model of ``run`` (aligned) from its matched collectives."""
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
    done = (colls.g_state == MatchState.COMPLETE) & (colls.g_exit_ns >= 0)  # every member returned
    ok = blocking & done
    # non-blocking collectives whose every member's wait the run shows are rendezvous too
    waits, waited = _waits(run, colls, (~blocking) & nz & done & (colls.g_n_members >= 2))
    groups = np.flatnonzero(ok | waited)
    order = groups[np.lexsort((groups, colls.g_first_ns[groups], colls.g_last_ns[groups]))]
    root = root_world_ranks(run, colls).astype(np.int64)
    scheme = wait_scheme(run, colls)
    p2p = _p2p_events(run, waits.rows if waits is not None else np.zeros(0, np.int64))
    in_order = False  # the order check passed on the model kept (it depends on the steps alone)
    for with_p2p in ((True, False) if p2p is not None else (False,)):
        w = _with_p2p(waits, p2p, n_g) if with_p2p else waits
        m = Model(colls, order, scheme, root, start, end, present, wall, waits=w)
        try:
            m.step_kind, m.step_ref = _schedule(colls, order, w)  # also puts the events in replay order
        except _Unschedulable:  # point-to-point calls the steps cannot hold: kept as recorded instead
            continue
        if with_p2p:
            if not _in_each_ranks_order(m):
                continue
            in_order = True
        break
    m.coupled_from_ns, m.coupled_why = _coupling(run, colls, ok | waited, blocking, wall, m.waits)
    if not in_order and not _in_each_ranks_order(m):
        m.reason = ("a rank's collectives replayed out of its own order (rooted collectives let ranks run "
                    "ahead): not replayable one group at a time")  # fmt: skip
    return m


#: a blocking send of this many bytes or more waits for its receiver to arrive (MPI's rendezvous
#: protocol; a smaller one is eager: it returns once the message is buffered), where the run
#: cannot show which (the receiver arrived first)
EAGER_BYTES = 64 * 1024


@dataclass
class _P2P:
    """The replayed point-to-point events: per event its rank, entry and exit (ns; a post's exit
    is its entry: the rank goes on), and the dependencies, as pairs: event ``dep_e`` leaves no
    earlier than event ``dep_p`` arrives (a receive's completion after its sender's arrival; a
    send held by its receiver after the receiver's). ``rows``: the ``run.events`` rows the events
    replay (sends, receives, posts and the WAIT rows that complete them), ascending, and
    ``row_event`` each one's event (a request's row: the event it completes in)."""

    rank: np.ndarray
    entry_ns: np.ndarray
    exit_ns: np.ndarray
    dep_e: np.ndarray
    dep_p: np.ndarray
    rows: np.ndarray
    row_event: np.ndarray
    site: np.ndarray


def _p2p_events(run: Run, taken: np.ndarray) -> _P2P | None:
    """The point-to-point rendezvous (issue 20): every receive matched with its send
    (:func:`distdiag.links.p2p_transfers`) whose completion the run shows: a blocking ``Recv``,
    or an ``Irecv`` completed in a WAIT row (:func:`distdiag.links.p2p_waits`; not one of
    ``taken``, the rows the non-blocking collectives' waits hold). Events: one per blocking call
    (a ``Sendrecv``'s SEND and RECV rows, same rank and times, are one), one per ``Isend`` and
    ``Irecv`` post (the rank goes on), one per WAIT row that completes them. A receive completes
    no earlier than its sender's arrival (its call or its post). A send is held by its receiver
    (its call or its post) when it, or the wait completing an ``Isend``, stayed until the
    receiver came, and either sent ``EAGER_BYTES`` or more or came first itself with nothing else
    to wait for (a ``Sendrecv`` or ``Waitall`` held by its own receive's sender is not held by the
    receiver). Receives no wait completes stay in the segments, as recorded (:func:`_coupling`)."""
    from distdiag.links import p2p_transfers, p2p_waits

    tr = p2p_transfers(run)
    ms, mr = tr["send_row"], tr["recv_row"]
    if len(ms) == 0:
        return None
    w_recv, w_send = p2p_waits(run)
    ev = run.events
    kind = ev["kind"]
    if len(taken):
        w_recv = np.where(np.isin(w_recv, taken), -1, w_recv)
        w_send = np.where(np.isin(w_send, taken), -1, w_send)
    k_s, k_r = kind[ms], kind[mr]
    ok = (k_r == Kind.RECV) | ((k_r == Kind.RECV_ASYNC) & (w_recv >= 0))
    ok &= (k_s == Kind.SEND) | (k_s == Kind.SEND_ASYNC)
    if not ok.any():
        return None
    ms, mr, nb, w_recv, w_send, k_s = ms[ok], mr[ok], tr["nbytes"][ok], w_recv[ok], w_send[ok], k_s[ok]
    n_p = len(ms)
    # every row an event stands for: the pairs' own rows, then the waits completing them
    # np.unique hashes (2.5 s for 6 M here); the wait rows come as runs in row order, which timsort
    # merges (2 M: 4 ms, against 128 for introsort)
    waits_u = np.sort(np.r_[w_recv[w_recv >= 0], w_send[w_send >= 0]], kind="stable")
    waits_u = waits_u[np.r_[True, waits_u[1:] != waits_u[:-1]]] if len(waits_u) else waits_u
    rows = np.concatenate([ms, mr, waits_u])
    o = np.argsort(rows, kind="stable")  # row order: run.events comes by (rank, t0)
    rows_o = rows[o]
    r = ev["rank"][rows_o].astype(np.int64)
    t0 = ev["t0_ns"][rows_o].astype(np.int64, copy=False)
    t1 = np.maximum(ev["t1_ns"][rows_o], t0)
    k = kind[rows_o]
    blocking = (k == Kind.SEND) | (k == Kind.RECV)
    # one event per (rank, t0, t1) of blocking rows (a Sendrecv's two are next to each other); a
    # post or a wait is one of its own (a wait that holds several requests is listed once)
    same = (np.diff(r) == 0) & (np.diff(t0) == 0) & (np.diff(t1) == 0) & blocking[1:] & blocking[:-1]
    new = np.r_[True, ~same]
    eid_o = np.cumsum(new) - 1
    eid = np.empty(len(rows), np.int64)
    eid[o] = eid_o
    head = np.flatnonzero(new)
    e_entry = t0[head]
    e_exit = np.where(blocking | (k == Kind.WAIT), t1, t0)[head]  # a post: the rank goes on
    n_e = len(head)
    at = np.empty(len(rows), np.int64)
    at[o] = np.arange(len(rows), dtype=np.int64)
    send_e, recv_e = eid[:n_p], eid[n_p : 2 * n_p]
    wait_e = eid[2 * n_p :]  # the events of waits_u, in its (ascending) order

    def wait_event(w: np.ndarray) -> np.ndarray:
        if not len(waits_u):
            return np.full(len(w), -1, np.int64)
        return np.where(w >= 0, wait_e[np.minimum(np.searchsorted(waits_u, w), len(waits_u) - 1)], -1)

    # where each side completes: its blocking call, or the wait that completes its request
    recv_done = np.where(w_recv >= 0, wait_event(w_recv), recv_e)
    send_done = np.where(w_send >= 0, wait_event(w_send), np.where(k_s == Kind.SEND, send_e, -1))
    t0_s, t0_r = t0[at[:n_p]], t0[at[n_p : 2 * n_p]]
    # a receive's completion waits for its sender's arrival
    a_in = np.full(n_e, np.iinfo(np.int64).min, np.int64)
    np.maximum.at(a_in, recv_done, t0_s)
    # a send held by its receiver's arrival
    d = np.maximum(send_done, 0)
    held = (send_done >= 0) & (e_exit[d] > t0_r) & (
        (nb >= EAGER_BYTES) | ((e_entry[d] < t0_r) & (a_in[d] < t0_r)))  # fmt: skip
    dep_e = np.r_[recv_done, send_done[held]]
    dep_p = np.r_[send_e, recv_e[held]]
    # each row's event (for cuts and the coupling check): a request's is the one it completes in
    row_ev = eid.copy()
    row_ev[n_p : 2 * n_p] = recv_done
    row_ev[:n_p] = np.where(send_done >= 0, send_done, send_e)
    site = ev["site_id"][rows_o[head]].astype(np.int64)
    return _P2P(r[head], e_entry, e_exit, dep_e.astype(np.int64), dep_p.astype(np.int64), rows_o.astype(np.int64),
                row_ev[o], site)  # fmt: skip


def _with_p2p(waits: Waits | None, p2p: _P2P | None, n_g: int) -> Waits | None:
    """``waits`` with the point-to-point events appended (a Waits of those alone when None)."""
    if p2p is None:
        return waits
    z = np.zeros(0, np.int64)
    w = waits if waits is not None else Waits(z, z, z, z, z, z, np.full(n_g, -1, np.int64), 0, z, z,
                                                np.zeros(0, bool), z, z)  # fmt: skip
    n_w, n_p = len(w.rank), len(p2p.rank)
    cat = np.concatenate
    return Waits(cat([w.rank, p2p.rank]), cat([w.entry_ns, p2p.entry_ns]), cat([w.exit_ns, p2p.exit_ns]),
                 w.cov_start, w.cov, w.batch_end, w.a_off, w.n_async, w.rows, w.seen_ns,
                 cat([w.launch, np.zeros(n_p, bool)]), cat([w.ref, np.full(n_p, -1, np.int64)]), w.cov_of,
                 w.seg_ns, dep_e=p2p.dep_e + n_w, dep_p=p2p.dep_p + n_w,
                 p2p=cat([np.zeros(n_w, bool), np.ones(n_p, bool)]), p2p_rows=p2p.rows,
                 p2p_site=cat([np.full(n_w, -1, np.int64), p2p.site]), p2p_row_event=p2p.row_event + n_w)  # fmt: skip


class _Unschedulable(ValueError):
    """The point-to-point events cannot be put in steps (a partner after a collective its rank
    makes first, or chains deeper than :data:`MAX_LEVEL_ROUNDS`)."""


#: how far past a WAIT row's or a BACKWARD row's end a completion may be seen and still be its (the
#: completion is stamped just after the wait returns): the point-to-point waits' rule too
WAIT_SLACK_NS = links.WAIT_SLACK_NS


def _waits(run: Run, colls: Collectives, cand: np.ndarray) -> tuple[Waits | None, np.ndarray]:
    """(the waits, per group: True where every member's completion lies in a wait) for the
    non-blocking groups ``cand`` (complete, two or more members). A member's completion c lies in
    a ``WAIT`` row [w0, w1] of its rank with post <= w0 <= c <= w1 + slack; else in a ``BACKWARD``
    row [b0, b1] that holds its launch, waited from the rank's last launch of a
    non-blocking collective inside it (the breakdown's rule for DDP's finalize). A member in
    neither (a test loop, a future never waited) leaves its group out: the replay keeps it as
    recorded, inside the segments (:func:`_coupling`). All ranks at once in band coordinates."""
    n_g = len(colls)
    waited = np.zeros(n_g, bool)
    a_rows = np.flatnonzero(cand[colls.m_group])
    if len(a_rows) == 0:
        return None, waited
    r_a = colls.m_rank[a_rows].astype(np.int64)
    p_a = colls.m_t0_ns[a_rows].astype(np.int64, copy=False)
    c_a = np.maximum(colls.m_t1_ns[a_rows], p_a).astype(np.int64, copy=False)
    # the members by rank (then group: about time), so that the searches below walk in order
    by_r = np.argsort(r_a.astype(np.uint16) if int(r_a.max()) < 1 << 16 else r_a, kind="stable")
    wid = np.full(len(a_rows), -1, np.int64)  # per async member: its wait (an index into the rows below)
    w_r: list[np.ndarray] = []
    w_0: list[np.ndarray] = []
    w_1: list[np.ndarray] = []
    w_bw: list[np.ndarray] = []
    w_row: list[np.ndarray] = []
    for kind in (Kind.WAIT, Kind.BACKWARD):  # two kinds: the explicit waits, then DDP's finalize
        free = wid < 0
        if not free.any():
            continue
        rows, r, t0, t1 = _kind_rows(run, int(kind), lambda: np.unique(r_a[free]))
        if len(rows) == 0:
            continue
        t1 = np.maximum(t1, t0)
        # a WAIT row holds the completion; a BACKWARD row the launch (DDP's completion callback runs on
        # another thread and may be stamped after the backward returned)
        at = c_a if kind == Kind.WAIT else p_a
        slack = WAIT_SLACK_NS if kind == Kind.WAIT else 0
        band = intervals.band_of(int(max(r.max(), r_a.max())) + 1, t0, p_a, ends=(t1 + slack, c_a))
        if band is None:
            continue
        lo, span = band
        o = None
        j = np.empty(len(a_rows), np.int64)
        if kind == Kind.WAIT:
            # the rank's last wait entered at or before the completion, which must hold it (entered
            # after the post, left no more than the slack before it): not the first wait ending
            # within the slack of it, which with calls 30 us apart is an earlier one
            key = r * span + (t0 - lo)  # the run's rows come by (rank, t0)
            if not bool(np.all(key[1:] >= key[:-1])):
                o = np.argsort(key, kind="stable")
                key = key[o]
            j[by_r] = np.searchsorted(key, (r_a * span + (at - lo))[by_r], side="right") - 1
            jj = np.maximum(j, 0)
            if o is not None:
                jj = o[jj]
            hit = free & (j >= 0) & (r[jj] == r_a) & (t0[jj] >= p_a) & (at <= t1[jj] + slack)
        else:
            key = r * span + (t1 + slack - lo)
            if not bool(np.all(key[1:] >= key[:-1])):  # by (rank, end) too, unless they nest
                o = np.argsort(key, kind="stable")
                key = key[o]
            j[by_r] = np.searchsorted(key, (r_a * span + (at - lo))[by_r])  # the first row ending at or after it
            jj = np.minimum(j, len(key) - 1)  # the row itself
            if o is not None:
                jj = o[jj]
            hit = free & (j < len(key)) & (r[jj] == r_a) & (t0[jj] <= at)
        wid[hit] = int(sum(len(x) for x in w_r)) + jj[hit]
        w_r.append(r)
        w_0.append(t0)
        w_1.append(t1)
        w_bw.append(np.full(len(r), kind == Kind.BACKWARD))
        w_row.append(rows)
    cov_m = wid >= 0
    g_a = colls.m_group[a_rows]
    n_cov = np.bincount(g_a[cov_m], minlength=n_g)
    waited = cand & (n_cov == colls.g_n_members) & (n_cov == np.diff(colls.g_start))
    if not waited.any():
        return None, waited
    # the async members of the waited groups, numbered group by group (a_off), and their waits
    sizes = np.where(waited, np.diff(colls.g_start), 0).astype(np.int64)
    a_off = np.where(waited, np.cumsum(sizes) - sizes, -1).astype(np.int64)
    kept = waited[g_a] & cov_m
    sel = by_r[kept[by_r]]  # by rank: each rank's waits then come in order (no sort below)
    # each column the kept members need, gathered once rank by rank (the members come group by group,
    # so these gathers read far apart: the fewer the better); their ranks, ascending, need none
    rows_k, wid_k, t0_k, c_k, g_k = a_rows[sel], wid[sel], p_a[sel], c_a[sel], g_a[sel]
    n_r = int(r_a.max()) + 1
    r_k = np.repeat(np.arange(n_r, dtype=np.int64), np.bincount(r_a[kept], minlength=n_r))
    pos = a_off[g_k] + (rows_k - colls.g_start[g_k])
    # the waits that hold a replayed member (u) and each member's (inv): by marks, not a sort
    held = np.zeros(int(sum(len(x) for x in w_r)), bool)
    held[wid_k] = True
    u = np.flatnonzero(held)
    inv = (np.cumsum(held) - 1)[wid_k]
    all_r, all_0, all_1 = np.concatenate(w_r)[u], np.concatenate(w_0)[u], np.concatenate(w_1)[u]
    is_bw = np.concatenate(w_bw)[u]
    # a BACKWARD's wait is entered at the rank's last launch inside it; an explicit wait at its start
    # every wait holds a member: reduceat over non-empty runs (by rank, the members come by wait)
    by_w = np.arange(len(inv)) if bool(np.all(inv[1:] >= inv[:-1])) else np.argsort(inv, kind="stable")
    w_at = np.flatnonzero(np.r_[True, np.diff(inv[by_w]) != 0])
    last_post = np.maximum.reduceat(t0_k[by_w], w_at)
    # a completion is seen no later than the wait on it ends: a BACKWARD returns once DDP's finalize
    # has its buckets (the callback's stamp may come after); a WAIT row's completion is stamped
    # just after it (within the slack): the wait ends at the later of the two
    seen = np.where(is_bw[inv], np.minimum(c_k, all_1[inv]), c_k)
    last_done = np.maximum.reduceat(seen[by_w], w_at)
    entry = np.where(is_bw, np.minimum(last_post, all_1), all_0)
    exit_ = np.maximum(all_1, last_done)
    seen_a = np.zeros(int(sizes.sum()), np.int64)
    seen_a[pos] = seen
    # the events: every async member's launch (numbered as a_off), then the waits
    n_a = int(sizes.sum())
    # the launches: the members kept, by rank (then group: about time), as the waits come, so that
    # _schedule's sort by (rank, time) merges two sorted runs
    launch_t = np.ascontiguousarray(t0_k)
    cat = np.concatenate
    w_rows = cat(w_row)[u].astype(np.int64)  # rows: -1 where streamed
    if len(w_rows) > 1 and not bool(np.all(w_rows[1:] >= w_rows[:-1])):  # one kind's rows come sorted
        w_rows.sort()
    waits = Waits(cat([r_k, all_r]), cat([launch_t, entry]), cat([launch_t, exit_]),
                  np.zeros(0, np.int64), pos, np.zeros(0, np.int64), a_off, n_a, w_rows, seen_a,
                  cat([np.ones(n_a, bool), np.zeros(len(u), bool)]),
                  cat([pos, np.full(len(u), -1, np.int64)]))  # fmt: skip
    waits.cov_of = n_a + inv
    return waits, waited


def _kind_rows(run: Run, kind: int, ranks: Callable[[], np.ndarray]) -> tuple[np.ndarray, ...]:
    """(row in ``run.events`` or -1 where streamed, rank, t0, t1) of the rows of ``kind`` of
    the bands of the ranks ``ranks()`` gives (all of the run's rows of ``kind`` when it is
    resident: then ``ranks`` is not called); int64."""
    from distdiag.bands import bands
    from distdiag.rows import rows_of

    if kind not in getattr(run, "streamed_kinds", ()):
        rows = rows_of(run, (kind,))
        ev = run.events
        return (rows, ev["rank"][rows].astype(np.int64), ev["t0_ns"][rows].astype(np.int64, copy=False),
                ev["t1_ns"][rows].astype(np.int64, copy=False))  # fmt: skip
    got = []
    for band in bands(run, ranks=ranks()):  # streamed: the bands of the ranks asked about, read again
        rr = band.rows(kind)
        got.append((band.rank_of(rr).astype(np.int64), band.events["t0_ns"][rr].astype(np.int64),
                    band.events["t1_ns"][rr].astype(np.int64)))  # fmt: skip
    if not got:
        z = np.zeros(0, np.int64)
        return z, z, z, z
    r, t0, t1 = (np.concatenate(x) for x in zip(*got))
    return np.full(len(r), -1, np.int64), r, t0, t1


def _schedule(colls: Collectives, order: np.ndarray, waits: Waits | None) -> tuple[np.ndarray, np.ndarray]:
    """The replay's steps (kind, ref) and the launches and waits put in replay order (``waits``
    rewritten).

    Keys: a blocking group its last arrival; a launch its own time; a non-blocking group, when it
    is done, its last launch (after the launches at that instant); a wait its exit (after the
    groups it holds: each was launched before it). A rank's own events come in its own order
    (the order check, :func:`_in_each_ranks_order`, says where not). The launches and waits
    between two group steps form one run; a run is cut into batches by each rank's 1st, 2nd, ...
    event in it, and each batch is one step: numpy over its events, as over a group's members."""
    is_async = np.zeros(len(colls), bool)
    if waits is not None:
        is_async[order] = waits.a_off[order] >= 0
    g_kind = np.where(is_async[order], 2, 0).astype(np.int8)
    if waits is None or len(waits.rank) == 0:
        return g_kind, order.astype(np.int64)
    n_e, n_o = len(waits.rank), len(order)
    e_key = np.where(waits.launch, waits.entry_ns, waits.exit_ns)
    g_key = colls.g_last_ns[order].astype(np.int64)
    k_lo = int(min(e_key.min(), g_key.min()) if n_o else e_key.min())
    k_span = int(max(e_key.max(), g_key.max()) if n_o else e_key.max()) - k_lo + 1
    if k_span >= np.iinfo(np.int64).max // 8 or int(waits.rank.max()) + 1 >= np.iinfo(np.int64).max // (4 * k_span) - 1:
        raise OverflowError("times too far apart for the replay's schedule")
    # one int64 key each: time, then the tie (a launch 0, a blocking group 1, a group's done 2, a wait
    # 3): a group's and an event's never collide; groups re-sorted by it (a few thousand)
    gk = (g_key - k_lo) * 4 + np.where(g_kind == 2, 2, 1)
    go = np.argsort(gk, kind="stable")
    order, g_kind, gk = order[go], g_kind[go], gk[go]
    goes_on = waits.launch if waits.p2p is None else waits.launch | (waits.p2p & (waits.exit_ns == waits.entry_ns))
    ek = (e_key - k_lo) * 4 + np.where(goes_on, 0, 3)
    run = np.searchsorted(gk, ek)  # per event: how many group steps come before it
    # each rank's 1st, 2nd, ... event within its run, by (rank, key): within a rank the run grows
    # with the key, so each (run, rank) is one block (launches and waits each come by rank: two runs
    # for the stable sort to merge)
    w = np.argsort(waits.rank * (4 * k_span) + ek, kind="stable")
    r_w, run_w = waits.rank[w], run[w]
    blk = np.r_[True, (run_w[1:] != run_w[:-1]) | (r_w[1:] != r_w[:-1])]
    at = np.flatnonzero(blk)
    occ = np.empty(n_e, np.int64)
    occ[w] = np.arange(n_e) - np.repeat(at, np.diff(np.r_[at, n_e]))
    if waits.dep_e is not None and waits.dep_p is not None:  # point-to-point partners: a batch at or after theirs
        occ = _levels(run, occ, w, blk, waits.dep_e, waits.dep_p)
    # replay order of the events: by run, then occurrence (a batch's events are of distinct ranks: any order)
    perm = np.argsort(run * (int(occ.max()) + 1) + occ, kind="stable")
    run_p, occ_p = run[perm], occ[perm]
    starts = np.flatnonzero(np.r_[True, (run_p[1:] != run_p[:-1]) | (occ_p[1:] != occ_p[:-1])])
    ends = np.r_[starts[1:], n_e]
    # the CSR of the members each wait holds, in the new order (a launch holds none): the members
    # come grouped by their wait already where the waits are (rank, time)-ordered as the launches
    ev_of = waits.cov_of
    if len(ev_of) > 1 and not bool(np.all(ev_of[1:] >= ev_of[:-1])):
        oc = np.argsort(ev_of, kind="stable")
        ev_of, waits.cov = ev_of[oc], waits.cov[oc]
    counts = np.bincount(ev_of, minlength=n_e)
    old_start = np.cumsum(counts) - counts
    c_new = counts[perm]
    cov_start = np.zeros(n_e + 1, np.int64)
    np.cumsum(c_new, out=cov_start[1:])
    take = np.repeat(old_start[perm] - cov_start[:-1], c_new) + np.arange(int(cov_start[-1]), dtype=np.int64)
    waits.rank, waits.entry_ns, waits.exit_ns = waits.rank[perm], waits.entry_ns[perm], waits.exit_ns[perm]
    waits.launch, waits.ref = waits.launch[perm], waits.ref[perm]
    if waits.dep_e is not None and waits.dep_p is not None and waits.p2p is not None:
        new_of = np.empty(n_e, np.int64)
        new_of[perm] = np.arange(n_e, dtype=np.int64)
        de, dp = new_of[waits.dep_e], new_of[waits.dep_p]
        od = np.argsort(de, kind="stable")
        waits.dep_e, waits.dep_p = de[od], dp[od]
        waits.dep_start = np.zeros(n_e + 1, np.int64)  # CSR of the sorted dep_e: counts, summed
        np.cumsum(np.bincount(waits.dep_e, minlength=n_e), out=waits.dep_start[1:])
        waits.p2p = waits.p2p[perm]
        if waits.p2p_site is not None:
            waits.p2p_site = waits.p2p_site[perm]
        if waits.p2p_row_event is not None:
            waits.p2p_row_event = new_of[waits.p2p_row_event]
    waits.cov, waits.cov_start = waits.cov[take], cov_start
    waits.batch_end = np.zeros(n_e, np.int64)
    waits.batch_end[starts] = ends
    # steps: group j (j groups before it) after the batches of run j, which have j groups before them
    s_run = np.r_[np.arange(n_o, dtype=np.int64), run_p[starts]]
    s_after = np.r_[np.ones(n_o, np.int8), np.zeros(len(starts), np.int8)]  # a batch before the group of its run
    s_occ = np.r_[np.zeros(n_o, np.int64), occ_p[starts]]
    so = np.lexsort((s_occ, s_after, s_run))
    kind = np.r_[g_kind, np.ones(len(starts), np.int8)][so]
    ref = np.r_[order.astype(np.int64), starts.astype(np.int64)][so]
    return kind, ref


#: rounds of :func:`_levels` before point-to-point chains count as too deep to replay in steps
MAX_LEVEL_ROUNDS = 64


def _levels(run: np.ndarray, occ: np.ndarray, w: np.ndarray, blk: np.ndarray, de: np.ndarray,
            dp: np.ndarray) -> np.ndarray:  # fmt: skip
    """Each event's batch within its run (its rank's 1st, 2nd, ... step there), raised so that an
    event comes no earlier than the partners whose arrival it waits for, and each rank's batches
    still rise one by one at least: the least such
    levels, by rounds of "at least my partners', then after my rank's previous" (numpy over all
    events a round). Event ``de[i]`` waits for event ``dp[i]``'s arrival. A partner in a later
    run than the event (a collective between them in the steps' order) or a chain deeper than
    :data:`MAX_LEVEL_ROUNDS` raises :class:`_Unschedulable`. ``w``: the events by (rank, key);
    ``blk``: where a (run, rank) block begins in that order."""
    if bool((run[dp] > run[de]).any()):
        raise _Unschedulable("a point-to-point partner after a collective its rank makes first")
    same = run[dp] == run[de]
    de, dp = de[same], dp[same]
    if len(de) == 0:
        return occ
    bid = np.cumsum(blk) - 1  # per position in w: its (run, rank) block
    occ_w = occ[w]
    lvl = occ
    for _ in range(MAX_LEVEL_ROUNDS):
        need = lvl.copy()
        np.maximum.at(need, de, lvl[dp])
        v = need[w] - occ_w  # >= 0: a level is never below the event's place in its block
        big = int(v.max()) + 1
        v = np.maximum.accumulate(v + bid * big) - bid * big  # running max within each block
        new = np.empty_like(lvl)
        new[w] = v + occ_w
        if np.array_equal(new, lvl):
            return lvl
        lvl = new
    raise _Unschedulable(f"point-to-point calls chained more than {MAX_LEVEL_ROUNDS} deep between two collectives")


#: the share of the replayed groups that non-blocking ones may reach, and of the wall-clock that
#: any rank may spend in blocking point-to-point calls and waits, before the replay stops there
ASYNC_SHARE = 0.01
P2P_SHARE = 0.05


def _coupling(run: Run, colls: Collectives, ok: np.ndarray, blocking: np.ndarray, wall_ns: int,
              waits: Waits | None = None) -> tuple[int, str]:  # fmt: skip
    """(from when, why) the ranks synchronize through what the replay does not model: complete
    non-blocking collectives of two or more members that are not replayed (``ok``: those whose
    waits the run does not show, :func:`_waits`) past ``ASYNC_SHARE`` of the replayed ones, or
    a rank's blocking point-to-point calls and waits (other than the replayed waits) past
    ``P2P_SHARE`` of the wall-clock. (int64 max, "") when neither."""
    from distdiag.match import MatchState
    from distdiag.rows import rows_of

    t = int(np.iinfo(np.int64).max)
    why = []
    nb = (~blocking) & (colls.g_state == MatchState.COMPLETE) & (colls.g_n_members >= 2) & ~ok  # waited: replayed
    n_async = int(nb.sum())
    if n_async > ASYNC_SHARE * max(int(ok.sum()), 1):
        t = min(t, int(colls.g_first_ns[nb].min()))
        why.append(f"{n_async} non-blocking collectives (DDP's gradient buckets, Iallreduce, ...)")
    rows = rows_of(run, (int(Kind.SEND), int(Kind.RECV), int(Kind.WAIT)))
    if waits is not None and len(waits.rows):
        rows = rows[~np.isin(rows, waits.rows)]
    if waits is not None and len(waits.p2p_rows):  # replayed rendezvous
        rows = rows[~np.isin(rows, waits.p2p_rows, assume_unique=True)]
        # and the other half of a replayed call: a Sendrecv's to or from MPI_PROC_NULL (a line's end
        # rank in a halo that is not periodic), same rank and times, waits for nobody else
        rows = rows[~_same_call(run, rows, waits.p2p_rows)]
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


def _same_call(run: Run, rows: np.ndarray, of: np.ndarray) -> np.ndarray:
    """Per row of ``rows`` (``run.events``): True where a row of ``of`` (ascending) next to it has its
    rank, start and end: the other half of one call (a ``Sendrecv``'s two rows are written one
    after the other, and the table comes by (rank, start)). Integer searches, not a sort of
    (rank, start, end) keys: those sort as bytes, 3.4 s for a million against a million."""
    out = np.zeros(len(rows), bool)
    if not len(rows) or not len(of):
        return out
    ev = run.events
    n = len(ev)
    rank, t0, t1 = ev["rank"][rows], ev["t0_ns"][rows], ev["t1_ns"][rows]
    for d in (-1, 1):
        nb = np.clip(rows + d, 0, n - 1)
        at = np.minimum(np.searchsorted(of, nb), len(of) - 1)
        hit = (of[at] == nb) & (nb == rows + d)
        if hit.any():
            hit &= (ev["rank"][nb] == rank) & (ev["t0_ns"][nb] == t0) & (ev["t1_ns"][nb] == t1)
            out |= hit
    return out


def _events(m: Model, want: np.ndarray) -> tuple[np.ndarray, ...]:
    """The replayed events of the ranks in ``want`` (bool by rank), in no particular order:
    (step, position in the step, rank, arrival, exit). A blocking member arrives at its call and
    leaves at its return; a launch of a non-blocking one leaves when it arrives (the rank goes
    on); a wait arrives at its entry and leaves at its exit."""
    c = m.colls
    step_of = np.full(len(c), -1, np.int64)
    gsteps = np.flatnonzero(m.step_kind == 0)
    step_of[m.step_ref[gsteps]] = gsteps
    rows = np.flatnonzero((step_of[c.m_group] >= 0) & want[c.m_rank])
    g = c.m_group[rows]
    st = step_of[g]
    pos = rows - c.g_start[g]
    r = c.m_rank[rows].astype(np.int64)
    arr = c.m_t0_ns[rows].astype(np.int64)
    ext = c.m_t1_ns[rows].astype(np.int64)
    W = m.waits
    if W is None:
        return st, pos, r, arr, ext
    bsteps = np.flatnonzero(m.step_kind == 1)
    first = m.step_ref[bsteps]  # each batch's first wait, ascending
    wi = np.flatnonzero(want[W.rank])
    b = np.searchsorted(first, wi, side="right") - 1
    return (np.r_[st, bsteps[b]], np.r_[pos, wi - first[b]], np.r_[r, W.rank[wi]], np.r_[arr, W.entry_ns[wi]],
            np.r_[ext, W.exit_ns[wi]])  # fmt: skip


#: events a block of :func:`_in_each_ranks_order` takes (its temporaries stay in cache)
_ORDER_ROWS = 1 << 17


def _in_each_ranks_order(m: Model) -> bool:
    """True when replaying the steps in order meets every rank's events (collectives, launches,
    waits) in the order it made them: taken step by step, then stably by rank, arrivals never go
    back within a rank.

    By blocks of whole steps of ~:data:`_ORDER_ROWS` events, as ``match._member_gaps_in_member_order``
    walks the members (:func:`distdiag.match.by_rank_in_order`: a block sorted stably by rank in
    cache, each rank's last arrival carried from block to block). The run-wide stable sort by rank and its
    gathers (which jump a group's length at every row) cost 7.2 s at 1024 x 10^5 events (51 M
    members), the most of the model's 7.4 (benchmarks/NOTES.md, "The replay's order check")."""
    n_s = len(m.step_kind)
    if n_s == 0:
        return True
    gs, W = m.colls.g_start, m.waits
    is_g = m.step_kind == 0
    is_b = m.step_kind == 1  # a non-blocking group's step (2) holds no event: its launches are the ranks'
    ref = m.step_ref
    start = np.zeros(n_s, np.int64)
    size = np.zeros(n_s, np.int64)
    start[is_g] = gs[ref[is_g]]
    size[is_g] = gs[ref[is_g] + 1] - start[is_g]
    with_waits = W is not None and bool(is_b.any())
    if with_waits:
        assert W is not None
        start[is_b] = ref[is_b]
        size[is_b] = W.batch_end[ref[is_b]] - ref[is_b]
    ends = np.cumsum(size)  # where each step's events end in the order of the steps
    n_e = int(ends[-1])
    if n_e == 0:
        return True
    n_rank = max(int(m.colls.m_rank.max(initial=0)), int(W.rank.max(initial=0)) if W is not None else 0) + 1
    none = np.iinfo(np.int64).min
    carry = np.full(n_rank, none, np.int64)  # per rank: its last arrival in the steps so far
    s_lo = 0
    while s_lo < n_s:  # per block of whole steps
        a = int(ends[s_lo - 1]) if s_lo else 0
        s_hi = max(s_lo + 1, int(np.searchsorted(ends, a + _ORDER_ROWS, side="right")))
        sz = size[s_lo:s_hi]
        b = int(ends[s_hi - 1])
        idx = np.repeat(start[s_lo:s_hi] - (ends[s_lo:s_hi] - sz), sz) + np.arange(a, b, dtype=np.int64)
        if not with_waits:
            r, t = m.colls.m_rank[idx], m.colls.m_t0_ns[idx]
        else:
            assert W is not None
            on_g = np.repeat(is_g[s_lo:s_hi], sz)
            r = np.where(on_g, m.colls.m_rank[np.where(on_g, idx, 0)], W.rank[np.where(on_g, 0, idx)])
            t = np.where(on_g, m.colls.m_t0_ns[np.where(on_g, idx, 0)], W.entry_ns[np.where(on_g, 0, idx)])
        s_lo = s_hi
        if len(r) and by_rank_in_order(r, t, carry) is None:
            return False
    return True


def _replay(m: Model, change: Change | None) -> np.ndarray:
    """The replay loop: each rank's end (ns, indexed by rank); one step per group in ``m.order``
    and per batch of waits (:func:`_schedule`)."""
    c = m.colls
    n = len(m.start_ns)
    rec_last = m.start_ns.copy()  # per rank: its latest recorded rendezvous exit (its start before the first)
    new_last = m.start_ns.copy()  # the same, replayed
    started = np.zeros(n, bool)  # past its first rendezvous (the launch skew before it is startup's)
    slow = np.zeros(n, bool)
    cuts: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    cap = cap_ref = None
    tail_cut = np.zeros(n, np.int64)
    if change is not None:
        slow[change.median_ranks[(change.median_ranks >= 0) & (change.median_ranks < n)]] = True
        c_s, c_p, c_ns, tail_cut = _cuts_of_drops(m, change.drop_rank, change.drop_t0, change.drop_t1)
        if len(c_s):
            o = np.argsort(c_s, kind="stable")
            bounds = np.flatnonzero(np.diff(c_s[o])) + 1
            for idx in np.split(o, bounds):  # one entry per changed step: a Python step per step, as the loop
                cuts[int(c_s[idx[0]])] = (c_p[idx], c_ns[idx])
        cap = change.transfer_cut_ns
        cap_ref = change.transfer_ref_ns
    any_slow = bool(slow.any())
    like = change.like_peers if change is not None and any_slow else {}
    like_p = change.like_p2p if change is not None and any_slow else {}
    refs = change.peer_ref if change is not None and any_slow else {}
    balance = change is not None and change.balance
    gs, m_rank, m_t0, m_t1 = c.g_start, c.m_rank, c.m_t0_ns, c.m_t1_ns
    scheme, root = m.scheme, m.root
    W = m.waits
    slow_p = peer_p = None  # per event: a point-to-point event of a slow rank; of another rank
    if any_slow and W is not None and W.p2p is not None:
        slow_p = W.p2p & slow[W.rank]
        peer_p = W.p2p & ~slow[W.rank]
    n_a = W.n_async if W is not None else 0
    launch_new = np.zeros(n_a, np.int64)  # per async member: its launch, replayed
    done_rec = np.zeros(n_a, np.int64)  # per async member: its collective done, recorded and replayed
    done_new = np.zeros(n_a, np.int64)
    med_a = _launch_medians(m, slow) if (any_slow and W is not None and W.n_async) else None
    ref_a = _launch_refs(m, refs) if (refs and med_a is not None) else None
    mean_a = None
    if balance and W is not None and W.n_async:
        paced = None
        if med_a is not None:  # the straggler removed too: the mean of the work at its peers' pace
            _, _, mem, rec = _async_groups(m)
            r_a = m.colls.m_rank[mem].astype(np.int64)
            paced = _at_peer_pace(rec, (med_a >= 0) & slow[r_a], med_a, r_a, like, ref_a)
        mean_a = _launch_means(m, paced)
    #: per event: a point-to-point event's arrival, replayed (its partners read it in its batch or later)
    p2p_new = np.zeros(len(W.rank), np.int64) if W is not None and W.p2p is not None else None
    p2p_cut = _p2p_cuts(W, change) if W is not None and p2p_new is not None and change is not None else None
    fill_seg = fill_p2p = None
    if W is not None and W.seg_ns is None and change is None:
        fill_seg = W.seg_ns = np.zeros(n_a, np.int64)
    if W is not None and W.p2p is not None and W.p2p_seg_ns is None and change is None:
        fill_p2p = W.p2p_seg_ns = np.full(len(W.rank), -1, np.int64)
    in_x = _exchanged(m) if (change is not None and change.balance_p2p and p2p_new is not None) else None
    if m.step_bits is None:
        m.step_bits = _step_bits(m)
    steps = zip(m.step_kind.tolist(), m.step_ref.tolist(), m.step_bits.tolist())
    for s, (kind, ref, bits) in enumerate(steps):  # one step per group or batch
        if kind == 1:  # a batch of launches and waits, one per rank: numpy over them
            assert W is not None
            i0, i1 = ref, int(W.batch_end[ref])
            r = W.rank[i0:i1]
            entry, ext, is_l, a_i = W.entry_ns[i0:i1], W.exit_ns[i0:i1], W.launch[i0:i1], W.ref[i0:i1]
            seg = entry - rec_last[r]
            if fill_seg is not None and bits & _HAS_LAUNCH:  # the recorded segments, for the medians (once per model)
                fill_seg[a_i[is_l]] = seg[is_l]
            if fill_p2p is not None and bits & _HAS_P2P:  # and the point-to-point events' (p2p_work)
                fill_p2p[i0:i1] = np.where(W.p2p[i0:i1] & started[r], seg, -1)  # type: ignore[index]
            if med_a is not None:  # a straggler's launch after its peers' pace before it
                med = np.where(is_l, med_a[np.maximum(a_i, 0)], -1)
                ref_l = None if ref_a is None else np.where(is_l, ref_a[np.maximum(a_i, 0)], np.nan)
                seg = _at_peer_pace(seg, (med >= 0) & slow[r] & started[r], med, r, like, ref_l)
            if mean_a is not None and bits & _HAS_LAUNCH:  # each launch after its group's mean segment
                mean = np.where(is_l, mean_a[np.maximum(a_i, 0)], -1)
                seg = np.where((mean >= 0) & started[r], mean, seg)
            if p2p_new is not None:
                is_p = W.p2p[i0:i1]  # type: ignore[index]
                if slow_p is not None and peer_p is not None and bits & _HAS_P2P:
                    sl_p, pe_p = slow_p[i0:i1] & started[r], peer_p[i0:i1]
                    # where every exchange of the batch comes from one line (a halo), no line is asked
                    site = None if bits & _ONE_SITE else W.p2p_site[i0:i1]  # type: ignore[index]
                    seg = _p2p_pace(seg, sl_p, pe_p, site, r, like_p)
                if in_x is not None and bits & _HAS_P2P:  # the batch's exchange after its mean segment
                    seg = _balanced(seg, in_x[i0:i1])
            hit = cuts.get(s) if change is not None else None
            if hit is not None:
                seg = seg.copy()
                np.subtract.at(seg, hit[0], hit[1])
                np.maximum(seg, 0, out=seg)
            arr_new = new_last[r] + seg
            if bits & _HAS_LAUNCH:
                launch_new[a_i[is_l]] = arr_new[is_l]
            out_rec, out_new = entry, arr_new  # a launch: the rank goes on from it
            if p2p_new is not None and bits & _HAS_P2P:  # a rendezvous: at the later of it and its partners
                p2p_new[i0:i1] = arr_new
                ref_rec, ref_new = entry.copy(), arr_new.copy()
                k0, k1 = int(W.dep_start[i0]), int(W.dep_start[i1])  # type: ignore[index]
                if k1 > k0:  # the partners each event waits for: their arrivals, recorded and replayed
                    q, e_loc = W.dep_p[k0:k1], W.dep_e[k0:k1] - i0  # type: ignore[index]
                    np.maximum.at(ref_rec, e_loc, W.entry_ns[q])
                    np.maximum.at(ref_new, e_loc, p2p_new[q])
                xfer = ext - ref_rec
                if p2p_cut is not None:
                    c_p = p2p_cut[i0:i1]
                    xfer = np.where(c_p > 0, np.maximum(xfer - c_p, np.minimum(xfer, 0)), xfer)
                out_rec = np.where(is_p, ext, out_rec)
                out_new = np.where(is_p, ref_new + xfer, out_new)
            if not bits & _NO_WAIT:
                cs = W.cov_start[i0 : i1 + 1]
                held = W.cov[cs[0] : cs[-1]]
                at = np.minimum(cs[:-1] - cs[0], max(len(held) - 1, 0))  # a launch's empty range: unused
                d_new = np.maximum.reduceat(done_new[held], at)
                d_rec = np.maximum.reduceat(done_rec[held], at)
                exit_new = np.maximum(arr_new, d_new) + (ext - np.maximum(entry, d_rec))
                is_w = ~is_l if p2p_new is None else ~(is_l | is_p)
                out_rec = np.where(is_w, ext, out_rec)
                out_new = np.where(is_w, exit_new, out_new)
            rec_last[r] = np.maximum(rec_last[r], out_rec)
            new_last[r] = np.maximum(new_last[r], out_new)
            started[r] = True
            continue
        g = ref
        lo, hi = int(gs[g]), int(gs[g + 1])
        r = m_rank[lo:hi]
        t0 = m_t0[lo:hi]
        t1 = m_t1[lo:hi]
        if kind == 2:  # a non-blocking group: done for each member at its last launch' plus its transfer
            assert W is not None
            a0 = int(W.a_off[g])
            arr_new = launch_new[a0 : a0 + len(r)]
            t1 = W.seen_ns[a0 : a0 + len(r)]  # its completion as seen, no later than its wait's end
        else:
            seg = t0 - rec_last[r]
            if change is not None:
                if any_slow:
                    sl = slow[r] & started[r]
                    if sl.any() and not sl.all():
                        ref_g = None
                        if refs:
                            ref_g = np.full(len(r), np.nan)
                            for k in np.flatnonzero(sl).tolist():  # the slow members: few
                                got = refs.get(int(r[k]))
                                if got is not None:
                                    ref_g[k] = got[g]
                        seg = _at_peer_pace(seg, sl, _median(seg[~sl]), r, like, ref_g)
                if balance and scheme[g] == EVERY_MEMBER:
                    seg = _balanced(seg, started[r])
                hit = cuts.get(s)
                if hit is not None:
                    seg = seg.copy()
                    np.subtract.at(seg, hit[0], hit[1])
                    np.maximum(seg, 0, out=seg)
            arr_new = new_last[r] + seg
        sch = int(scheme[g])
        if sch == EVERY_MEMBER:
            ref_rec = np.full(len(r), t0.max())
            ref_new = np.full(len(r), arr_new.max())
        else:
            at_root = r == root[g]
            if not at_root.any():  # the root never came: as every member
                ref_rec = np.full(len(r), t0.max())
                ref_new = np.full(len(r), arr_new.max())
            elif sch == FROM_ROOT:  # one-to-many: a non-root waits for the root
                k = int(np.argmax(at_root))
                ref_rec = np.maximum(t0, t0[k])
                ref_new = np.maximum(arr_new, arr_new[k])
            else:  # many-to-one: the root waits for everyone, the others for nobody
                ref_rec = np.where(at_root, t0.max(), t0)
                ref_new = np.where(at_root, arr_new.max(), arr_new)
        transfer = t1 - ref_rec
        if cap is not None and cap[g] > 0:
            if cap_ref is not None and cap_ref[g] > 0:  # each member's transfer by the same share
                share = min(float(cap[g]) / float(cap_ref[g]), 1.0)  # rint: the ref's own member loses cap exactly
                transfer = np.where(transfer > 0, transfer - np.rint(transfer * share).astype(np.int64), transfer)
            else:
                transfer = np.maximum(transfer - cap[g], np.minimum(transfer, 0))
        if kind == 2:
            done_rec[a0 : a0 + len(r)] = t1
            done_new[a0 : a0 + len(r)] = ref_new + transfer
            continue
        exit_new = ref_new + transfer
        rec_last[r] = np.maximum(rec_last[r], t1)
        new_last[r] = np.maximum(new_last[r], exit_new)
        started[r] = True
    end = m.end_ns.copy()
    tail = np.maximum(m.end_ns - rec_last - tail_cut, 0)  # after the last rendezvous, as recorded
    out = new_last + tail
    end[m.present] = out[m.present]
    return end


#: :func:`_step_bits`: a batch holds a launch; a point-to-point event; no wait that completes a non-blocking
#: collective (launches and point-to-point events alone); point-to-point events from one line only (or none)
_HAS_LAUNCH, _HAS_P2P, _NO_WAIT, _ONE_SITE = 1, 2, 4, 8


def _step_bits(m: Model) -> np.ndarray:
    """Per step of ``m``: what its batch holds, as :data:`_HAS_LAUNCH` | :data:`_HAS_P2P` |
    :data:`_NO_WAIT` | :data:`_ONE_SITE` (0 for a group's step). Once per model, numpy over the
    batches, so that the replay loop asks a Python int instead of three or four ``any``/``all``
    a batch."""
    bits = np.zeros(len(m.step_kind), np.int64)
    W = m.waits
    at = np.flatnonzero(m.step_kind == 1)
    if W is None or not len(at):
        return bits
    lo = m.step_ref[at]
    end = W.batch_end[lo]
    p2p = W.p2p if W.p2p is not None else np.zeros(len(W.rank), bool)
    # the batches tile the events in replay order, each from its first event to batch_end (none empty)
    o = np.argsort(lo, kind="stable")
    lo_o, end_o = lo[o], end[o]
    assert bool(np.all(lo_o[1:] == end_o[:-1])) and int(lo_o[0]) == 0 and int(end_o[-1]) == len(W.rank)
    has_l = np.logical_or.reduceat(W.launch, lo_o)
    has_p = np.logical_or.reduceat(p2p, lo_o)
    no_w = np.logical_and.reduceat(W.launch | p2p, lo_o)
    one = ~has_p
    if W.p2p is not None and W.p2p_site is not None and has_p.any():
        big = np.iinfo(np.int64).max
        site = W.p2p_site.astype(np.int64, copy=False)
        lo_s = np.minimum.reduceat(np.where(p2p, site, big), lo_o)
        hi_s = np.maximum.reduceat(np.where(p2p, site, -big), lo_o)
        one |= lo_s == hi_s
    b = np.empty(len(at), np.int64)
    b[o] = has_l * _HAS_LAUNCH + has_p * _HAS_P2P + no_w * _NO_WAIT + one * _ONE_SITE
    bits[at] = b
    return bits


def _p2p_cuts(W: Waits, change: Change) -> np.ndarray | None:
    """Per event: how much shorter its transfer is under ``change`` (the largest cut of its rows),
    None when the change cuts none of the replayed point-to-point calls."""
    if not len(change.p2p_rows) or W.p2p_row_event is None or not len(W.p2p_rows):
        return None
    at = np.minimum(np.searchsorted(W.p2p_rows, change.p2p_rows), len(W.p2p_rows) - 1)
    hit = (W.p2p_rows[at] == change.p2p_rows) & (change.p2p_cut_ns > 0)
    if not hit.any():
        return None
    out = np.zeros(len(W.rank), np.int64)
    np.maximum.at(out, W.p2p_row_event[at[hit]], change.p2p_cut_ns[hit])
    return out


def _p2p_pace(seg: np.ndarray, slow: np.ndarray, peers: np.ndarray, site: np.ndarray | None, ranks: np.ndarray,
              like: dict[int, tuple[np.ndarray, np.ndarray]]) -> np.ndarray:  # fmt: skip
    """A batch's segments with each slow rank's before a point-to-point call at its peers' pace
    before a call from the same line in the batch (a halo exchange: every rank's k-th exchange):
    their median, plus a typical peer's excess over it where ``like`` has the rank's table
    (:func:`_at_peer_pace`), where that is shorter; a call no peer makes from its line keeps its
    own (a pipeline's stages run different code). ``site``: each event's line; None when the
    batch's point-to-point events all come from one (then no line is asked)."""
    if not slow.any() or not peers.any():
        return seg
    if site is None:
        return _at_peer_pace(seg, slow, _median(seg[peers]), ranks, like)
    out = seg
    at = site[slow]
    for s in ([int(at[0])] if bool((at == at[0]).all()) else np.unique(at).tolist()):  # a few sites
        on = site == s
        same = peers & on
        if same.any():
            out = _at_peer_pace(out, slow & on, _median(seg[same]), ranks, like)
    return out


def _at_peer_pace(seg: np.ndarray, slow: np.ndarray, pace: float | np.ndarray, ranks: np.ndarray,
                  like: dict[int, tuple[np.ndarray, np.ndarray]], ref: np.ndarray | None = None) -> np.ndarray:
    """Segments with each slow one's (``slow``) over ``pace`` (the others' median: one, or one
    each) at a typical peer's excess over it instead: its excess mapped through its rank's
    quantile table in ``like`` (at the pace itself where its rank has none), never longer than
    recorded. ``ref``: per segment, the pace of a rank whose collectives have one or two peers
    (:attr:`Change.peer_ref`; NaN: ``pace``), from which its excess is mapped also where it is
    negative. The slow ones are few (one for a rank's straggler): a Python step each."""
    use_ref = None if ref is None else slow & np.isfinite(ref)
    hit = np.flatnonzero(slow & (seg > pace) if use_ref is None else (slow & ~use_ref & (seg > pace)) | use_ref)
    if not len(hit):
        return seg
    p = np.broadcast_to(np.asarray(pace, np.float64), seg.shape)
    out = seg.copy()
    for i in hit.tolist():
        table = like.get(int(ranks[i])) if like else None
        if use_ref is not None and use_ref[i]:
            assert ref is not None
            base = float(ref[i])
            e = float(seg[i]) - base
            e_new = min(e, float(np.interp(e, table[0], table[1]))) if table is not None else min(e, 0.0)
            out[i] = max(0, int(base + e_new))
            continue
        e = float(seg[i]) - float(p[i])
        e_new = max(0.0, min(e, float(np.interp(e, table[0], table[1])))) if table is not None else 0.0
        out[i] = int(float(p[i]) + e_new)
    return out


def peer_excess(own_ns: np.ndarray, peers_ns: np.ndarray, q: int = 101) -> tuple[np.ndarray, np.ndarray]:
    """The table that maps a straggler's excess over its peers' median to a typical peer's
    (:attr:`Change.like_peers`): ``q`` quantiles of each (ns), the straggler's k-th to the
    peers' k-th. Where the straggler's quantiles tie (it is 20 ms over the median at most
    collectives), the tied ones map to the mean of the peers' over the same quantiles, so
    that np.interp reads a strictly increasing table.

    Worked example: 4 ranks, rank 1 20 ms slower at every step, and 40 ms more on rank
    ``step % 4``: rank 1's excess is 20 ms at 3 of 4 steps and 60 ms at its own turn; a peer's
    is 0, or 40 at its turn (a quarter of its steps). The table maps 20 to 0 and 60 to 40:
    rank 1 at its peers' pace still takes its turns, and the replay saves its 20 ms only."""
    at = np.linspace(0.0, 1.0, q)
    xf = np.quantile(np.asarray(own_ns, np.float64), at)
    xt = np.quantile(np.asarray(peers_ns, np.float64), at)
    u, inv = np.unique(xf, return_inverse=True)
    return u, np.bincount(inv, weights=xt) / np.bincount(inv)


def _balanced(seg: np.ndarray, started: np.ndarray) -> np.ndarray:
    """A group's members' segments with those of the ``started`` ones (past their first
    rendezvous) at their mean, rounded down: the same work spread evenly over them."""
    k = int(np.count_nonzero(started))
    if k < 2:
        return seg
    out = seg.copy()
    out[started] = int(seg[started].sum()) // k
    return out


def p2p_work(m: Model) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """The replayed point-to-point calls as a halo's exchanges: the point-to-point events of one
    batch (:func:`_schedule`: each rank's k-th such event between two collective steps, raised
    past the partners it waits for), of two ranks or more past their first rendezvous, are one
    exchange, whatever line each comes from (an odd-even ring's even ranks send first where its
    odd ones receive). Returns (per event of an exchange, in exchange order: its exchange, its
    event, its rank, its recorded segment before it, ns), or None when the model replays no
    point-to-point call. Where ranks make different numbers of calls a step and no collective
    realigns them, the k-th calls drift apart: an exchange then holds different steps' work
    (a line's end ranks calling with ``MPI_PROC_NULL`` make as many calls as the others)."""
    W = m.waits
    if W is None or W.p2p is None or not W.p2p.any() or m.reason:
        return None
    if W.exchanges is not None:
        return W.exchanges
    if W.p2p_seg_ns is None:
        _replay(m, None)  # fills W.p2p_seg_ns
    assert W.p2p_seg_ns is not None
    # the batches tile the events in replay order: an event's batch is how many batches start at or before it
    starts = np.zeros(len(W.rank), np.int64)
    starts[m.step_ref[m.step_kind == 1]] = 1
    ev = np.flatnonzero(W.p2p_seg_ns >= 0)
    b = np.cumsum(starts)[ev]  # non-decreasing
    new = np.r_[True, b[1:] != b[:-1]] if len(ev) else np.zeros(0, bool)
    grp = np.cumsum(new) - 1
    keep = np.bincount(grp)[grp] >= 2 if len(ev) else np.zeros(0, bool)
    ev, grp = ev[keep], grp[keep]
    if len(grp):  # numbered 0, 1, ... again
        grp = np.cumsum(np.r_[True, grp[1:] != grp[:-1]]) - 1
    grp = grp.astype(np.int64)
    W.exchanges = (grp, ev, W.rank[ev].astype(np.int64), W.p2p_seg_ns[ev])
    return W.exchanges


def _exchanged(m: Model) -> np.ndarray:
    """Per event of ``m.waits``: True where it is in an exchange (:func:`p2p_work`: a batch's
    point-to-point events past their ranks' first rendezvous, two or more)."""
    out = np.zeros(len(m.waits.rank) if m.waits is not None else 0, bool)
    got = p2p_work(m)
    if got is not None:
        out[got[1]] = True
    return out


def _median(x: np.ndarray) -> float:
    """``np.median(x)`` of a non-empty integer array, the same float, a quarter of its cost (~2 us
    against ~8 on 256 values: the replay takes one per batch of a paced straggler): one partition
    for the middle value or two, averaged as ``np.mean`` averages them."""
    h = len(x) // 2
    if len(x) % 2:
        return float(np.partition(x, h)[h])
    p = np.partition(x, (h - 1, h))
    return (float(p[h - 1]) + float(p[h])) / 2


def _launch_medians(m: Model, slow: np.ndarray) -> np.ndarray:
    """Per async member (``a_off`` numbering): the median of its group's recorded segments before
    the launch over the members whose ranks are not ``slow`` (-1 where none is, or none is slow):
    a straggler's launch at its peers' pace, as a blocking member's arrival. The segments come
    from one plain replay per model (:attr:`Waits.seg_ns`)."""
    c = m.colls
    g_w, sizes, mem, seg = _async_groups(m)
    peer = ~slow[c.m_rank[mem]]
    grp = np.repeat(np.arange(len(g_w), dtype=np.int64), sizes)
    med, has = group_medians(seg[peer], grp[peer], len(g_w))
    ok = has & (np.bincount(grp[peer], minlength=len(g_w)) < sizes)  # some member is slow
    return np.repeat(np.where(ok, np.floor(med).astype(np.int64), -1), sizes)


def _launch_refs(m: Model, refs: dict[int, np.ndarray]) -> np.ndarray:
    """Per async member (``a_off`` numbering): its group's :attr:`Change.peer_ref` of its rank (NaN
    where its rank has none, or none there)."""
    g_w, sizes, mem, _ = _async_groups(m)
    out = np.full(len(mem), np.nan)
    grp = np.repeat(g_w, sizes)
    rk = m.colls.m_rank[mem]
    for r, ref in refs.items():  # the slow ranks: few
        on = rk == r
        out[on] = ref[grp[on]]
    return out


def group_medians(v: np.ndarray, grp: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Per group ``0..n-1``: the median of its values ``v`` (``grp`` says whose each is; float, the
    middle two averaged) and whether it has any. One sort by (group, value), no loop."""
    o = np.lexsort((v, grp))
    vs, k = v[o].astype(np.float64), np.bincount(grp, minlength=n)
    first = np.cumsum(k) - k
    has = k > 0
    if len(vs) == 0:
        return np.zeros(n), has
    lo = np.minimum(first + np.maximum(k - 1, 0) // 2, len(vs) - 1)
    hi = np.minimum(first + k // 2, len(vs) - 1)
    return np.where(has, (vs[lo] + vs[hi]) / 2, 0.0), has


def _async_groups(m: Model) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The replayed async groups in the async members' numbering (``a_off`` order): (the groups,
    their sizes, each async member's member row, its recorded segment before its launch:
    :attr:`Waits.seg_ns`, which the first call fills by one plain replay)."""
    W = m.waits
    assert W is not None
    c = m.colls
    g_w = np.flatnonzero(W.a_off >= 0)
    g_w = g_w[np.argsort(W.a_off[g_w], kind="stable")]
    sizes = (c.g_start[g_w + 1] - c.g_start[g_w]).astype(np.int64)
    mem = np.repeat(c.g_start[g_w] - W.a_off[g_w], sizes) + np.arange(W.n_async, dtype=np.int64)
    if W.seg_ns is None:
        _replay(m, None)  # fills W.seg_ns: each launch's recorded segment, as the loop reads it
    assert W.seg_ns is not None
    return g_w, sizes, mem, W.seg_ns


def _launch_means(m: Model, seg: np.ndarray | None = None) -> np.ndarray:
    """Per async member (``a_off`` numbering): the mean of its group's recorded segments before
    the launch (or of ``seg``, one per async member: a straggler's at its peers' pace), rounded
    down (a balanced counterfactual's launch, as :func:`_balanced` sets a blocking member's
    arrival); -1 in a group whose members do not all wait for each other.
    Unlike a blocking group's, the mean is over every member: a group's members are past their
    first rendezvous alike (a DDP step's buckets), and the loop applies it only to those that are."""
    g_w, sizes, _, recorded = _async_groups(m)
    if seg is None:
        seg = recorded
    first = np.cumsum(sizes) - sizes
    nz = sizes > 0
    mean = np.full(len(g_w), -1, np.int64)
    mean[nz] = np.add.reduceat(seg, first[nz]) // sizes[nz]
    mean[m.scheme[g_w] != EVERY_MEMBER] = -1
    return np.repeat(mean, sizes)


def _cuts_of_drops(m: Model, rank: np.ndarray, t0: np.ndarray, t1: np.ndarray) -> tuple[np.ndarray, ...]:
    """Rank-time intervals as segment cuts: (step, position in the step, ns) per piece that falls
    in a segment (the stretch from an event's exit to the rank's next arrival: :func:`_events`),
    and per rank the ns that fall in its tail after its last event. Overlapping intervals of one
    rank count once (their union); time inside a collective or a wait is not a segment's and is left.

    All ranks at once in band coordinates (:mod:`distdiag.intervals`): each rank's
    intervals and segments shifted into its own band, one union, one covered-within.
    Raises :class:`OverflowError` for times too far apart for int64 bands."""
    n = len(m.start_ns)
    ok = (rank >= 0) & (rank < n) & (t1 > t0)
    rank, t0, t1 = rank[ok].astype(np.int64), t0[ok].astype(np.int64), t1[ok].astype(np.int64)
    z = np.zeros(0, np.int64)
    tail = np.zeros(n, np.int64)
    if len(rank) == 0:
        return z, z, z, tail
    want = np.zeros(n, bool)
    want[rank] = True
    e_st, e_pos, m_r, arr, ext = _events(m, want)
    o = np.lexsort((arr, m_r))  # each rank's events in its own order
    e_st, e_pos, m_r, arr, ext = e_st[o], e_pos[o], m_r[o], arr[o], ext[o]
    # each segment: [the rank's latest exit before it (its start before the first), its arrival)
    first = np.r_[True, m_r[1:] != m_r[:-1]] if len(m_r) else np.zeros(0, bool)
    prev = np.empty(len(m_r), np.int64)
    if len(m_r):
        prev[1:] = ext[:-1]
        prev[first] = m.start_ns[m_r[first]]
    named = np.unique(rank)
    last_exit = m.start_ns[named].astype(np.int64)  # per rank named: its last event's exit
    if len(m_r):
        np.maximum.at(last_exit, np.searchsorted(named, m_r), ext)
    starts = (t0, last_exit, prev) if len(m_r) else (t0, last_exit)
    band = intervals.band_of(len(named), *starts, ends=(t1, last_exit, ext) if len(m_r) else (t1, last_exit))
    if band is None:
        raise OverflowError("times too far apart for the replay's band coordinates")
    lo, span = band
    top = span - 1  # a band's last ns: past every interval of its rank
    k_iv = np.searchsorted(named, rank)
    seg_s, seg_e = intervals.union_banded(k_iv, t0 - lo, t1 - lo, span)
    if len(m_r):
        shift = np.searchsorted(named, m_r) * span - lo
        # the running max of exits within each rank (an exit earlier than one before it never reopens
        # a segment): in band coordinates one running max never carries a value into the next rank
        a = np.maximum.accumulate(prev + shift)
        cov = intervals.covered_within(seg_s, seg_e, np.minimum(a, arr + shift), arr + shift)
        hit = cov > 0
        s_out, p_out, ns_out = e_st[hit], e_pos[hit], cov[hit]
    else:
        s_out = p_out = ns_out = z
    k = np.arange(len(named), dtype=np.int64) * span
    tail[named] = intervals.covered_within(seg_s, seg_e, k + (last_exit - lo), k + top)
    return s_out, p_out, ns_out, tail


def price(findings: list[Any], run: Run, colls: Collectives) -> Model | None:
    """Each finding that states its counterfactual (``Finding.change``) gets ``evidence.replay``:
    the wall-clock the replay saves without it, and the counterfactual in words. Returns the
    model (for :func:`cumulate`), None when nothing was replayed."""
    for f in findings:  # a handful
        if f.change is None:
            f.change = claims_change(f, run)
    mine = [f for f in findings if f.change is not None]
    if not mine or len(colls) == 0:
        return None
    m = model_of(run, colls)
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


def claims_change(f: Any, run: Run) -> Change | None:
    """A mechanism finding's counterfactual from its claims (:func:`distdiag.claims.claims_of`: the
    rank-time of its rows, e.g. an input-bound rank's loader waits): that time removed."""
    from distdiag.claims import claims_of
    from distdiag.roles import role_of

    how = role_of(f.kind).replay_claims
    if not how:
        return None  # not a mechanism, or one that states its own (a link's transfers; a storm's windows)
    got = claims_of(f, run)
    if got is None:
        return None
    r, t0, t1 = got
    if how == "unhidden":  # the detector prices what compute did not hide (input waits, copies): so does the replay
        r, t0, t1 = unhidden(run, r, t0, t1)
        return Change(f"the {f.kind} rows of the finding's ranks that compute did not hide removed", drop_rank=r,
                      drop_t0=t0, drop_t1=t1)  # fmt: skip
    what = f"the {f.kind} rows of the finding's ranks" if f.claims is None else f"the rank-time the {f.kind} finding claims"
    return Change(f"{what} removed", drop_rank=r, drop_t0=t0, drop_t1=t1)


def unhidden(run: Run, rank: np.ndarray, t0: np.ndarray, t1: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The rank-time intervals less what the rank's compute covered (its compute phases, and on a
    GPU-timed run its GPU's busy spans: :func:`distdiag.critical_path.compute_rows`): a
    loader wait the GPU spends running queued kernels costs nothing, and taking it out of the
    replay would price it. Band by band of the ranks named (a streamed run reads only theirs)."""
    from distdiag.bands import bands
    from distdiag.critical_path import compute_rows

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
