"""Where each rank's wall-clock went: the per-rank breakdown of the report.

Columns (seconds, per rank, between the rank's shim start and end):

* ``comm_wait_s``: inside a blocking collective before its last member arrived
  (waiting for others). For a collective that never completed (a member never
  came, or the rank was still inside it when its record ends), all of it.
* ``comm_transfer_s``: inside a blocking collective after the last member
  arrived (the communication itself).
* ``io_s``: file-system calls (open, stat, listdir, read, write, close).
* ``input_wait_s``: blocked in the data loader. ``h2d_s``: host-to-device copies.
* ``other_s``: other recorded calls: point-to-point, Wait/Test loops,
  communicator creation, collectives without a sequence number.
* ``compute_s``: the rest: time outside every call above. User phases
  (forward, backward, optimizer, ``distdiag.phase``) count as compute, minus
  the calls recorded inside them.

Non-blocking collectives (``COLL_ASYNC``) overlap the program's own work by
design: the time the program blocked on them is in its Wait rows, so their
post-to-completion span is not counted.

Each column is the union of its intervals (two threads reading files at once
count once), so a column never exceeds the rank's wall-clock; columns of
different categories running at once on different threads may overlap, and
``compute_s`` is what no category covers.
"""

from __future__ import annotations

import logging

import numpy as np
import pandas as pd

from distdiag.match import Collectives, MatchState, collectives_of
from distdiag.run import Run
from distdiag.schema import FILE_KINDS, P2P_KINDS, Kind

log = logging.getLogger(__name__)

COLUMNS = ("compute_s", "comm_wait_s", "comm_transfer_s", "io_s", "input_wait_s", "h2d_s", "other_s")
#: what each column means, in words (the text renderer and the breakdown figure)
LABELS = {
    "compute_s": "compute", "comm_wait_s": "waiting in collectives", "comm_transfer_s": "collective transfer",
    "io_s": "file I/O", "input_wait_s": "input wait", "h2d_s": "host-to-device", "other_s": "other calls",
}  # fmt: skip
# category codes for the union computation (compute is what is left)
_WAIT, _XFER, _IO, _INPUT, _H2D, _OTHER = range(6)
_N_CAT = 6
_OTHER_KINDS = tuple(int(k) for k in P2P_KINDS) + (int(Kind.WAIT), int(Kind.COMM_CREATE))


def union_ns(key: np.ndarray, t0: np.ndarray, t1: np.ndarray, n_keys: int) -> np.ndarray:
    """Per key, the total length of the union of intervals [t0, t1) (also metadata_storm's blocked time).

    Sweep: sorted by (key, t0), an interval adds what sticks out past the
    furthest end seen so far in its key. [0,10) [2,5) [8,12) -> 10 + 0 + 2 = 12.
    """
    if len(key) == 0:
        return np.zeros(n_keys)
    # Sort by (key, t0) and take the running max of t1 inside each key, both
    # without a Python loop: offset every key's times into its own disjoint
    # band (key * span), so one sort orders by (key, t0) and one running max
    # over the whole array never carries a value from one key into the next.
    key = key.astype(np.int64)
    lo = min(int(t0.min()), int(t1.min()))
    span = max(int(t0.max()), int(t1.max())) - lo + 1
    if int(key.max()) < np.iinfo(np.int64).max // span - 1:
        base = key * span - lo
        order = np.argsort(base + t0, kind="stable")  # timsort: the input is a few sorted runs
        key, t0, t1, base = key[order], t0[order], t1[order], base[order]
        covered = np.maximum.accumulate(base + t1) - base
    else:  # astronomically long runs: sort by two keys and let pandas do the grouped running max
        order = np.lexsort((t0, key))
        key, t0, t1 = key[order], t0[order], t1[order]
        covered = pd.Series(t1).groupby(key).cummax().to_numpy()
    prev = np.empty_like(covered)
    prev[1:] = covered[:-1]
    first = np.r_[True, key[1:] != key[:-1]]
    prev[first] = np.iinfo(np.int64).min
    contrib = np.maximum(0, t1 - np.maximum(t0, prev))
    return np.bincount(key, weights=contrib.astype(np.float64), minlength=n_keys)


def _collective_intervals(colls: Collectives, rank_end: np.ndarray) -> tuple[np.ndarray, ...]:
    """(rank, cat, t0, t1) of the wait and transfer parts of every blocking collective."""
    blocking = colls.m_kind == Kind.COLL
    g = colls.m_group[blocking]
    rank = colls.m_rank[blocking].astype(np.int64)
    t0 = colls.m_t0_ns[blocking]
    t1 = colls.m_t1_ns[blocking]
    open_ = t1 < 0
    t1 = np.where(open_, rank_end[rank], t1)  # still inside at the end of its record
    state = colls.g_state[g]
    # A member who never came, or one that never left: everyone inside waited throughout.
    never = (state == MatchState.IN_FLIGHT) | (colls.g_exit_ns[g] < 0)
    # A group missing a rank whose file is lost did complete (everyone left):
    # the present members' last arrival is then the best estimate of the split.
    last = colls.g_last_ns[g]
    split = np.where(never, t1, np.clip(last, t0, t1))
    ranks = np.concatenate([rank, rank])
    cats = np.concatenate([np.full(len(rank), _WAIT), np.full(len(rank), _XFER)])
    a = np.concatenate([t0, split])
    b = np.concatenate([split, t1])
    return ranks, cats, a, b


def breakdown(run: Run, colls: Collectives | None = None) -> pd.DataFrame:
    """One row per present rank: rank, host, wall_s and the COLUMNS, in seconds."""
    if colls is None:
        colls = collectives_of(run)
    start, end = run.rank_bounds()
    n = len(start)
    ev = run.events
    kind = ev["kind"]
    r_all = ev["rank"].astype(np.int64)

    parts_rank, parts_cat, parts_t0, parts_t1 = [], [], [], []

    def add(mask: np.ndarray, cat: int) -> None:
        parts_rank.append(r_all[mask])
        parts_cat.append(np.full(int(mask.sum()), cat, np.int64))
        parts_t0.append(ev["t0_ns"][mask])
        parts_t1.append(ev["t1_ns"][mask])

    add(np.isin(kind, np.array(sorted(FILE_KINDS), np.uint8)), _IO)
    add(kind == Kind.INPUT_WAIT, _INPUT)
    add(kind == Kind.H2D, _H2D)
    add(np.isin(kind, np.array(_OTHER_KINDS, np.uint8)) | ((kind == Kind.COLL) & (ev["seq"] < 0)), _OTHER)
    # In-flight rows that are not collectives (a rank killed inside a read): until the end.
    inf = run.inflight
    if len(inf):
        ik = inf["kind"]
        ir = inf["rank"].astype(np.int64)
        for cat_code, m in (
            (_IO, np.isin(ik, np.array(sorted(FILE_KINDS), np.uint8))),
            (_INPUT, ik == Kind.INPUT_WAIT),
            (_H2D, ik == Kind.H2D),
            (_OTHER, np.isin(ik, np.array(_OTHER_KINDS, np.uint8))),
        ):
            parts_rank.append(ir[m])
            parts_cat.append(np.full(int(m.sum()), cat_code, np.int64))
            parts_t0.append(inf["t0_ns"][m])
            parts_t1.append(end[ir[m]])
    cr, cc, c0, c1 = _collective_intervals(colls, end)
    parts_rank.append(cr)
    parts_cat.append(cc)
    parts_t0.append(c0)
    parts_t1.append(c1)

    rank_of = np.concatenate(parts_rank)
    cat = np.concatenate(parts_cat)
    # Clip to the rank's record: nothing before its start or after its end counts.
    t0 = np.clip(np.concatenate(parts_t0), start[rank_of], end[rank_of])
    t1 = np.clip(np.concatenate(parts_t1), start[rank_of], end[rank_of])
    t1 = np.maximum(t0, t1)

    per_cat = union_ns(rank_of * _N_CAT + cat, t0, t1, n * _N_CAT).reshape(n, _N_CAT)
    busy = union_ns(rank_of, t0, t1, n)
    span = (end - start).astype(np.float64)

    present = np.array(sorted(run.ranks), np.int64)
    df = pd.DataFrame(
        {
            "rank": present,
            "host": [run.host_of(r) for r in present],
            "wall_s": span[present] / 1e9,
            "compute_s": np.maximum(0.0, span - busy)[present] / 1e9,
            "comm_wait_s": per_cat[present, _WAIT] / 1e9,
            "comm_transfer_s": per_cat[present, _XFER] / 1e9,
            "io_s": per_cat[present, _IO] / 1e9,
            "input_wait_s": per_cat[present, _INPUT] / 1e9,
            "h2d_s": per_cat[present, _H2D] / 1e9,
            "other_s": per_cat[present, _OTHER] / 1e9,
        }
    )
    return df
