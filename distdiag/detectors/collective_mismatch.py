"""Collective mismatch: member ranks disagree about the n-th collective on a communicator.

MPI (and NCCL/gloo) require every member of a communicator to call the same
collectives in the same order, with matching counts, datatypes and roots. A
rank that calls something else crashes the job ("Message truncated"), hangs
it, or silently computes garbage. Matching is flight-recorder style, by
(communicator, seq) (:mod:`distdiag.match`), never by time: the n-th
collective a rank called on a communicator is compared with the n-th of every
other member, whatever the clocks say.

States, each explained in words in the finding:

* ``type``: different operations at one seq (``Allreduce`` vs ``Bcast``);
* ``size``: the same operation with different byte counts, where the op needs
  equal ones (:data:`distdiag.match.SIZE_CHECKED_OPS`);
* ``dtype``: different datatypes (``aux`` = datatype name id: "MPI_DOUBLE" vs
  "MPI_FLOAT"); ranks that recorded no datatype are not compared;
* ``root``: different roots of a rooted collective;
* ``missing``: the other members finished the collective and a member never
  called it although its record goes on past it (it skipped one: its later
  collectives are shifted, so everything after it mismatches too).

Per communicator only the first mismatched seq is described (later groups on
it are usually the shift's echo; they are counted). The odd ranks out are the
ones whose value differs from the most common one.

Cost: when the mismatched collective never completed (a member was still
inside it when the record ends) the job died or hung there: the cost is the
time from the last arrival to the end of the record of those inside, and the
finding ends the job (``evidence["ends_job"]``, listed first). A mismatch the
job survived costs no measured seconds (cost 0): it is a correctness bug.

Cost (issue 10): a group's smallest and largest datatype id come from the
match's ``m_aux`` (:class:`~distdiag.match.GroupColumn`) group values and
exceptions, no member-size pass (the measured step before it, a ``reduceat``
per bound without ``np.where``: :func:`distdiag.mismatch.mismatches` ~25 -> ~7-9 ms at 64 x
100k, 3.2 M member rows; the stage 0.02-0.07 -> 0.01-0.02 s).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import numpy as np

from distdiag.analysis import Analysis
from distdiag.detectors import register
from distdiag.findings import Finding
from distdiag.match import Collectives, GroupColumn, MatchState
from distdiag.mismatch import mismatches
from distdiag.ranks import rank_list

if TYPE_CHECKING:
    from distdiag.run import Run

log = logging.getLogger(__name__)


def _mode(values: np.ndarray, colls: Collectives | None = None, g: int = -1, column: Any = None) -> int | None:
    """The most common of ``values`` (the members' values at group ``g``). A tie (two of four
    ranks' calls reached the disk before an abort: one value each) is broken by the value the
    communicator's latest earlier completed collective of the same op agreed on (``column``: the
    member column the values come from); None when that does not decide (no odd rank then)."""
    u, c = np.unique(values, return_counts=True)
    top = u[c == c.max()]
    if len(top) == 1:
        return int(top[0])
    if colls is None or column is None:
        return None
    prev = np.flatnonzero((colls.g_comm == colls.g_comm[g]) & (colls.g_op == colls.g_op[g])
                          & (colls.g_seq < colls.g_seq[g]) & colls.complete)  # fmt: skip
    if len(prev) == 0:
        return None
    last = int(prev[np.argmax(colls.g_seq[prev])])
    pu, pc = np.unique(np.asarray(column[colls.members(last)]), return_counts=True)
    agreed = int(pu[np.argmax(pc)])
    return agreed if agreed in top else None


def _by_value(values: np.ndarray, ranks: np.ndarray, fmt: Any) -> str:
    """'8192 bytes on ranks 0, 2, 3; 0 bytes on rank 1' (most common first)."""
    u, c = np.unique(values, return_counts=True)
    parts = []
    for v in u[np.argsort(-c, kind="stable")]:  # distinct values: a handful
        rs = ranks[values == v]
        parts.append(f"{fmt(v)} on rank{'s' if len(rs) > 1 else ''} {rank_list(rs)}")
    return "; ".join(parts)


def _describe(run: Run, colls: Collectives, g: int, aux: np.ndarray | GroupColumn, dtype_bad: bool) -> dict[str, Any]:
    """State, odd ranks out and a sentence for one mismatched group."""
    sl = colls.members(g)
    ranks = colls.m_rank[sl].astype(np.int64)
    op = colls.op_name(g)
    head = f"{op} #{int(colls.g_seq[g])} on communicator '{colls.comm_name(g)}'"
    st = int(colls.g_state[g])
    values: dict[str, Any] = {}
    column: Any = None  # where the members' values come from, for a tie's history (_mode)
    if st == MatchState.OP_MISMATCH:
        v = colls.m_op[sl]
        state = "type"
        text = f"ranks called different operations as collective #{int(colls.g_seq[g])} on '{colls.comm_name(g)}': " + \
            _by_value(v, ranks, lambda x: run.s(int(x)))
        values = {run.s(int(x)): sorted(int(r) for r in ranks[v == x]) for x in np.unique(v)}
    elif st == MatchState.SIZE_MISMATCH:
        v, column = colls.m_nbytes[sl], colls.m_nbytes
        state = "size"
        text = f"{head}: ranks passed different sizes: " + _by_value(v, ranks, lambda x: f"{int(x)} bytes")
        values = {str(int(x)): sorted(int(r) for r in ranks[v == x]) for x in np.unique(v)}
    elif st == MatchState.ROOT_MISMATCH:
        v, column = colls.m_peer[sl], colls.m_peer
        state = "root"
        text = f"{head}: ranks named different roots: " + _by_value(v, ranks, lambda x: f"root {int(x)}")
        values = {str(int(x)): sorted(int(r) for r in ranks[v == x]) for x in np.unique(v)}
    elif dtype_bad:
        a = aux[sl]
        known = a > 0
        v, ranks, column = a[known], ranks[known], aux
        state = "dtype"
        text = f"{head}: ranks passed different datatypes: " + _by_value(v, ranks, lambda x: run.s(int(x)))
        values = {run.s(int(x)): sorted(int(r) for r in ranks[v == x]) for x in np.unique(v)}
    else:
        missing = colls.missing_ranks(g).astype(np.int64)
        _, end = run.rank_bounds()
        after = (end[missing] - int(colls.g_exit_ns[g])) / 1e9 if len(missing) else np.zeros(0)
        return {
            "state": "missing",
            "odd": [int(r) for r in missing],
            "text": (
                f"{head}: ranks {rank_list(ranks)} completed it; rank(s) {rank_list(missing)} never called it, "
                f"though their record goes on {float(after.min()) if len(after) else 0:.3g} s past it"
            ),
            "values": {"completed": [int(r) for r in ranks], "never_called": [int(r) for r in missing]},
        }
    mode = _mode(v, colls, g, column)
    if mode is None:  # a tie nothing decides: every member is named, and the text says why
        return {"state": state, "odd": [int(r) for r in ranks], "values": values,
                "text": text + " (as many ranks on each side, and no earlier call of it to tell which is odd)"}  # fmt: skip
    odd = ranks[v != mode]
    return {"state": state, "odd": [int(r) for r in odd], "text": text, "values": values}


@register("collective_mismatch", requires=("collectives",))
def detect(an: Analysis) -> list[Finding]:
    run, colls = an.run, an.colls
    if len(colls) == 0:
        return []
    bad, dtype_bad, _, aux = mismatches(run, colls)
    idx = np.flatnonzero(bad)
    if len(idx) == 0:
        return []
    inside_any = np.minimum.reduceat(colls.m_t1_ns, colls.g_start[:-1]) < 0
    _, end = run.rank_bounds()
    comm = colls.g_comm[idx]
    first_of_comm = idx[np.r_[True, comm[1:] != comm[:-1]]]
    findings = []
    for g_ in first_of_comm:  # one per communicator with a mismatch: a handful
        g = int(g_)
        d = _describe(run, colls, g, aux, bool(dtype_bad[g]))
        n_later = int(np.count_nonzero(comm == colls.g_comm[g])) - 1
        sl = colls.members(g)
        never_done = bool(inside_any[g])
        cost_ns = 0
        if never_done:
            inside = colls.m_rank[sl][colls.m_t1_ns[sl] < 0].astype(np.int64)
            cost_ns = max(0, int(end[inside].max()) - int(colls.m_t0_ns[sl].max()))
        site_ids, cnt = np.unique(colls.m_site[sl], return_counts=True)
        site = run.s(int(site_ids[np.argmax(cnt)])) if len(site_ids) else ""
        sites = {int(r): run.s(int(s)) for r, s in zip(colls.m_rank[sl], colls.m_site[sl])}
        summary = d["text"]
        if never_done:
            summary += f"; the job ended inside it ({cost_ns / 1e9:.1f} s stuck)"
        if n_later:
            summary += f"; {n_later} later collective(s) on it mismatch too"
        odd = d["odd"]
        findings.append(
            Finding(
                kind="collective_mismatch",
                cost_s=cost_ns / 1e9,
                summary=summary,
                ranks=odd,
                hosts=run.hosts_of(odd),
                evidence={
                    "state": d["state"],
                    "comm": colls.comm_name(g),
                    "seq": int(colls.g_seq[g]),
                    "op": colls.op_name(g),
                    "values": d["values"],
                    "site": site,
                    "sites": sites,
                    "completed": not never_done,
                    "ends_job": never_done,
                    "later_mismatches": n_later,
                },
                advice=(
                    "Make every rank call the same collectives in the same order with matching counts, datatypes "
                    f"and roots: look for a rank-dependent branch or size before {colls.op_name(g)}"
                    + (f" at {site}" if site else "") + "."
                ),
            )
        )
    return findings
