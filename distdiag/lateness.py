"""Who waits for whom at a collective, and how late a rank made the others: the rules the
straggler and serial-section detectors, the ranking and the replay share (one rule each, so
they judge rooted collectives and lateness alike).

* one-to-many collectives (bcast, scatter): the others wait for the root only;
  many-to-one (reduce, gather): only the root waits (:data:`ONE_TO_MANY`, :data:`MANY_TO_ONE`,
  :func:`nobody_waits`, :func:`holds_others`, :func:`root_world_ranks`);
* a late arriver's own lateness, less what it inherited from leaving its previous
  collective late (:func:`own_lateness_ns`); the groups that are launch skew, not work
  (:func:`startup_groups`); a node's charge from the last arrival on another host
  (:func:`other_host_last_ns`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from distdiag.match import Collectives, MatchState, group_blocks, member_gaps_ns

if TYPE_CHECKING:
    from distdiag.run import Run


#: Rooted collectives that do not synchronize everyone. One-to-many (the
#: root sends): the others wait for the root only, a late non-root delays
#: nobody. Many-to-one (the root collects): only the root waits, for the
#: others; a late root delays nobody.
ONE_TO_MANY = frozenset({"Bcast", "Ibcast", "bcast", "Scatter", "Scatterv", "Iscatter", "Iscatterv", "scatter",
                         "broadcast"})  # fmt: skip
MANY_TO_ONE = frozenset({"Reduce", "Ireduce", "reduce", "Gather", "Gatherv", "Igather", "Igatherv", "gather"})


#: :func:`wait_scheme`: every member waits for every member; a non-root for the root (one-to-many);
#: the root for every member, a non-root for nobody (many-to-one)
EVERY_MEMBER, FROM_ROOT, TO_ROOT = 0, 1, 2


def wait_scheme(run: Run, colls: Collectives) -> np.ndarray:
    """Per group (int8): whom its members wait for, :data:`EVERY_MEMBER`, :data:`FROM_ROOT` (a rooted
    one-to-many collective) or :data:`TO_ROOT` (a rooted many-to-one one)."""
    root = root_world_ranks(run, colls)

    def ids(names: frozenset[str]) -> np.ndarray:
        return np.array([i for i in (run.sid(n) for n in names) if i >= 0], np.int64)

    scheme = np.full(len(colls), EVERY_MEMBER, np.int8)
    rooted = root >= 0
    scheme[rooted & np.isin(colls.g_op, ids(ONE_TO_MANY))] = FROM_ROOT
    scheme[rooted & np.isin(colls.g_op, ids(MANY_TO_ONE))] = TO_ROOT
    return scheme


def nobody_waits(run: Run, colls: Collectives) -> np.ndarray:
    """Per group: True where the last arriver made nobody wait (see ONE_TO_MANY / MANY_TO_ONE).

    :func:`holds_others` is its negation.
    """
    if len(colls) == 0:
        return np.zeros(0, bool)
    root = root_world_ranks(run, colls)  # every member names the root (else ROOT_MISMATCH)
    rooted = root >= 0

    def ids(names: frozenset[str]) -> np.ndarray:
        return np.array([i for i in (run.sid(n) for n in names) if i >= 0], np.int64)

    last_is_root = colls.g_last_rank.astype(np.int64) == root
    one_to_many = rooted & np.isin(colls.g_op, ids(ONE_TO_MANY))
    many_to_one = rooted & np.isin(colls.g_op, ids(MANY_TO_ONE))
    return np.asarray((one_to_many & ~last_is_root) | (many_to_one & last_is_root))


def one_to_many_root_late(run: Run, colls: Collectives) -> np.ndarray:
    """Per group: True where the last arriver is the root of a one-to-many collective
    (bcast, scatter): the others waited for what only the root had to prepare."""
    if len(colls) == 0:
        return np.zeros(0, bool)
    root = root_world_ranks(run, colls)
    ids = np.array([i for i in (run.sid(n) for n in ONE_TO_MANY) if i >= 0], np.int64)
    return np.asarray((root >= 0) & (colls.g_last_rank.astype(np.int64) == root) & np.isin(colls.g_op, ids))


def root_world_ranks(run: Run, colls: Collectives) -> np.ndarray:
    """Per group: its root as a world rank (-1: not rooted).

    The mpi4py hook records a rooted call's root in its communicator's own numbering; on a
    communicator made by Split/Create (a ``COMM_CREATE`` row per member: ``peer`` = the
    member's rank in it) that is not the world rank. The root is the member whose own
    rank in the group's communicator is the recorded one. Only groups on communicators
    whose numbering differs from the world's are looked up (a few, in most jobs); on the
    others (COMM_WORLD, torch's global ``src``) the recorded root is the world rank."""
    root = colls.m_peer[colls.g_start[:-1]].astype(np.int64)
    cached = run.cache.root_world_ranks
    if cached is not None and cached[0] is colls:
        return np.asarray(cached[1])
    out = root
    from distdiag.rows import events_of
    from distdiag.schema import Kind

    cc = events_of(run, (Kind.COMM_CREATE,))
    if len(cc):
        renumbered = np.unique(cc["name_id"][cc["peer"].astype(np.int64) != cc["rank"].astype(np.int64)])
        groups = np.flatnonzero((root >= 0) & np.isin(colls.g_comm, renumbered))
        if len(groups):
            # (world rank, communicator) -> the member's own rank in it
            span = int(max(int(cc["name_id"].max()), int(colls.g_comm.max()))) + 1
            t_key = cc["rank"].astype(np.int64) * span + cc["name_id"].astype(np.int64)
            o = np.argsort(t_key, kind="stable")
            t_key, t_local = t_key[o], cc["peer"].astype(np.int64)[o]
            sizes = (colls.g_start[groups + 1] - colls.g_start[groups]).astype(np.int64)
            rows = np.repeat(colls.g_start[groups], sizes) + (np.arange(int(sizes.sum())) - np.repeat(np.cumsum(sizes) - sizes, sizes))
            m_rank = colls.m_rank[rows].astype(np.int64)
            q = m_rank * span + np.repeat(colls.g_comm[groups].astype(np.int64), sizes)
            at = np.minimum(np.searchsorted(t_key, q), max(len(t_key) - 1, 0))
            local = np.where(t_key[at] == q, t_local[at], -1)
            hit = local == np.repeat(root[groups], sizes)
            # per group, the world rank of the member that is the root (-1 if none said so)
            who = np.where(hit, m_rank, -1)
            starts = np.cumsum(sizes) - sizes
            found = np.maximum.reduceat(who, starts) if len(who) else np.zeros(0, np.int64)
            out = root.copy()
            out[groups] = np.where(found >= 0, found, root[groups])
    run.cache.root_world_ranks = (colls, out)
    return np.asarray(out)


def holds_others(run: Run, colls: Collectives) -> np.ndarray:
    """Per group: True where the last arriver really made the others wait.

    False for one-to-many collectives whose last arriver is not the root and
    many-to-one collectives whose last arriver is the root: the straggler
    detector's rule (:func:`nobody_waits`).
    """
    return np.asarray(~nobody_waits(run, colls))


def own_lateness_ns(run: Run, colls: Collectives) -> np.ndarray:
    """Per group: ``last - second_to_last`` arrival, less what the last arriver inherited.

    A rank leaving its previous collective late arrives late at the next one
    with no extra work of its own. Each member's previous exit is its arrival
    minus its own gap (:func:`distdiag.match.member_gaps_ns` with the
    completions of non-blocking collectives counted as exits: a DDP step starts
    after the previous step's buckets completed; counting only blocking ones
    made a DDP rank's *launch* skew, its last blocking "exit", look inherited
    at every bucket, and hid a real straggler that had started late); the amount by which the last
    arriver left later than the second-to-last is subtracted, and the result
    lies in ``[0, last - second_to_last]``. Worked example: ranks leave
    all-reduce k at 10.0 (rank 0) and 10.04 ms (rank 1, behind the slow link),
    compute 5 ms each and arrive at k+1 at 15.0 and 15.045 ms: rank 1 is
    charged 0.005 ms, not 0.045. (At a rank's first collective the "exit" is
    its start; those groups are launch skew and never charged.)
    """
    gap = (colls.g_last_ns - colls.g_second_ns).astype(np.int64)
    if len(gap) == 0:
        return np.asarray(gap)
    own = member_gaps_ns(run, colls, async_exits=True)
    last_row = colls.g_start[1:] - 1
    second_row = np.maximum(last_row - 1, colls.g_start[:-1])
    left_last = colls.m_t0_ns[last_row] - own[last_row]
    left_second = colls.m_t0_ns[second_row] - own[second_row]
    inherited = np.maximum(left_last - left_second, 0)
    return np.asarray(np.clip(gap - inherited, 0, gap))


def startup_groups(colls: Collectives) -> np.ndarray:
    """Per group: True where it is some member's first collective of the run.

    The first collective is where the ranks meet after launch: a rank that is
    late there is late from imports, interpreter start-up or a slow node
    launch, not from the work every rank repeats. That wait is launch overhead
    (see launch_overhead), so the straggler detector leaves it out; otherwise
    a healthy job on a loaded machine blames whichever rank imported last
    (measured here: 0.6 s at the first Barrier of a 4 s healthy run at load 18).
    """
    out = np.zeros(len(colls.g_seq), bool)
    n = len(colls.m_rank)
    if n == 0:
        return out
    # Each rank's first row: its earliest arrival, the lowest member row among equal
    # ones (what a stable sort by (rank, t0) puts first), found without sorting
    # (the per-rank minimum, then the first row that equals it), by blocks of
    # member rows (whole-column passes held ~17 bytes per member row, measured).
    rank, t0 = colls.m_rank, colls.m_t0_ns
    first_t0 = np.full(int(rank.max()) + 1, np.iinfo(np.int64).max, np.int64)
    rows = _early_rows(colls)
    if rows is not None:  # only the rows that can be a rank's first (see _early_rows)
        r_rank, r_t0 = rank[rows], t0[rows]
        np.minimum.at(first_t0, r_rank, r_t0)
        cand = rows[r_t0 == first_t0[r_rank]]
    else:
        for a in range(0, n, _ROWS):  # per block of member rows
            np.minimum.at(first_t0, rank[a : a + _ROWS], t0[a : a + _ROWS])
        cand = np.concatenate([
            np.flatnonzero(t0[a : a + _ROWS] == first_t0[rank[a : a + _ROWS]]) + a for a in range(0, n, _ROWS)
        ])  # fmt: skip
    _, i = np.unique(rank[cand], return_index=True)
    out[colls.m_group[cand[i]]] = True
    return out


def _early_rows(colls: Collectives) -> np.ndarray | None:
    """The member rows (ascending) of the groups whose first arrival is no later than a bound on
    every rank's first arrival; None where no such bound is at hand or those rows are many.

    The bound: each rank's earliest arrival in the first block of member rows (groups go by
    (communicator, seq), so that is the start of a communicator's history), the latest of
    them over the ranks that used any communicator (``comm_members``: every rank with a
    member row is among them, as match builds them from the same rows; a rank without a
    row in the block makes the bound infinite: None). A rank's first arrival is at most its
    bound, and a group whose first (sorted) arrival is later than the bound holds no
    arrival as early, so its rows cannot be anyone's first: the per-rank minimum and the
    rows equal to it come out the same from the early rows alone. A pass of ``minimum.at``
    and a gather over every member row (~8 ns a member, measured) becomes one over the
    first block and the early groups' rows (64 x 100k: 3.2 M members, ~27 -> ~2 ms).
    """
    rank, t0 = colls.m_rank, colls.m_t0_ns
    users = [m for m in colls.comm_members.values() if len(m)]  # one per communicator
    if not users or len(rank) <= _ROWS:
        return None
    who = np.unique(np.concatenate(users).astype(np.int64))
    first_t0 = np.full(int(max(int(rank.max()), int(who.max()))) + 1, np.iinfo(np.int64).max, np.int64)
    np.minimum.at(first_t0, rank[:_ROWS], t0[:_ROWS])
    bound = int(first_t0[who].max())
    if bound == np.iinfo(np.int64).max:
        return None
    g = np.flatnonzero(t0[colls.g_start[:-1]] <= bound)  # members sorted by arrival: a group's first
    sizes = np.diff(colls.g_start)[g]
    total = int(sizes.sum())
    if total > len(rank) // 4:
        return None
    # the groups' row ranges, concatenated in order (ascending)
    return np.repeat(colls.g_start[g] - (np.cumsum(sizes) - sizes), sizes) + np.arange(total)


#: Member rows per block of the passes over member rows.
_ROWS = 1 << 18


def host_indices(run: Run, colls: Collectives) -> tuple[np.ndarray, np.ndarray]:
    """(per rank, per group): the index in ``run.hosts`` of each rank's host and of each
    group's last arriver's (-1: unknown)."""
    hosts = run.hosts
    n_rank = int(max(run.world_size, int(colls.m_rank.max()) + 1))
    host_of_rank = np.full(n_rank, -1, np.int32)
    for r, info in run.ranks.items():  # one per rank
        host_of_rank[r] = hosts.index(info.host) if info.host in hosts else -1
    return host_of_rank, host_of_rank[colls.m_rank[colls.g_start[1:] - 1]]


def other_host_last_ns(run: Run, colls: Collectives, groups: np.ndarray) -> np.ndarray:
    """Per group of ``groups`` (indices): the last arrival among members on another host than
    the last arriver's, the node-level charge's start (the straggler detector's node findings); int64 minimum
    where there is none or the group was not asked for (ranking's explanation of a node)."""
    host_of_rank, h_last = host_indices(run, colls)
    return other_host_last_ns_from(colls, host_of_rank, h_last, groups)


#: Rows :func:`other_host_last_ns_from` steps back from the last arriver, group by group,
#: before it takes the remaining groups whole (a node of 8 ranks all late needs 8).
_STEPS = 16


def other_host_last_ns_from(colls: Collectives, host_of_rank: np.ndarray, h_last: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """Per group: the last arrival among members on another host than the last arriver's
    (``h_last``), computed for ``groups`` (indices); int64 minimum where there is none
    or the group was not asked for.

    Members come sorted by arrival, so that is the arrival of the latest member row
    whose host differs: found by stepping back from the second-to-last row, all
    groups at once, a row per step. Usually the first step finds it (the
    second-to-last arriver is on another node); groups still open after
    ``_STEPS`` steps (many late ranks on one node) are taken whole, by blocks of
    groups (a pass over every member row by blocks, with a ``np.unique`` per
    block, was the detector's largest cost after the member gaps: 0.33 s of 1.3
    at 1024 x 10k, measured).
    """
    no_t = np.iinfo(np.int64).min
    out = np.full(len(colls), no_t, np.int64)
    first = colls.g_start[:-1]
    pend = groups
    row = colls.g_start[1:][pend] - 2
    for _ in range(_STEPS):  # a row per step, every open group at once
        inside = row >= first[pend]  # groups with no row left have no other host
        pend, row = pend[inside], row[inside]
        if len(pend) == 0:
            return out
        other = host_of_rank[colls.m_rank[row]] != h_last[pend]
        out[pend[other]] = colls.m_t0_ns[row[other]]
        pend, row = pend[~other], row[~other] - 1
    if len(pend) == 0:
        return out
    left = np.zeros(len(colls), bool)
    left[pend] = True
    for g_lo, g_hi, a, b in group_blocks(colls):  # per block of ~262,144 member rows
        sub = left[g_lo:g_hi]
        if not sub.any():
            continue
        mh = host_of_rank[colls.m_rank[a:b]]
        gb = colls.m_group[a:b] - g_lo
        t_other = np.where(mh != h_last[g_lo:g_hi][gb], colls.m_t0_ns[a:b], no_t)
        blk = np.maximum.reduceat(t_other, colls.g_start[g_lo:g_hi] - a)
        out[g_lo:g_hi][sub] = blk[sub]
    return out


def charged_windows(f: Any, run: Run, colls: Collectives) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """A straggler finding's windows as a symptom (:attr:`distdiag.findings.Finding.windows`): per
    collective it charges, the late rank, its stretch of own work before it, the charge.

    The stretch runs from the rank's previous collective to its arrival: a
    cause anywhere in it made the rank late (a loader wait at the start of the
    iteration delays the arrival as much as one at the end), but explains at
    most the charge (``last - second-to-last arrival``; a node's: from the last
    arrival on another host).
    """
    if len(colls) == 0 or not f.ranks:
        return None
    ok = (colls.g_state == MatchState.COMPLETE) & (colls.g_n_members >= 2) & holds_others(run, colls)
    ok &= ~startup_groups(colls)  # launch skew: the straggler detector leaves each rank's first collective out
    g = np.flatnonzero(ok & np.isin(colls.g_last_rank, np.asarray(f.ranks)))
    if len(g) == 0:
        return None
    last_row = colls.g_start[1:][g] - 1
    gap = member_gaps_ns(run, colls)[last_row]
    t1 = colls.g_last_ns[g].astype(np.int64)
    charge = own_lateness_ns(run, colls)[g]  # what the straggler detector charged
    if f.evidence.get("level") == "host":
        # a slow node: charged from the last arrival on any other host
        other = other_host_last_ns(run, colls, g)[g]
        charge = t1 - np.where(other > np.iinfo(np.int64).min, other, colls.g_second_ns[g])
    return colls.g_last_rank[g].astype(np.int64), t1 - gap, t1, charge
