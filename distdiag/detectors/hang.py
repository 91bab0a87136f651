"""Hang: the job ended inside a collective that not every member rank entered.

The worst post-mortem is a job that hangs until Slurm kills it at its time
limit (SIGTERM, then SIGKILL ``KillWait`` seconds later) or someone kills it by
hand. Every rank's file still holds what it flushed: its finished events and,
in ``/inflight``, the calls it was inside of at its last flush. From those:

1. **Who was stuck where.** Collectives are matched by (communicator, seq)
   (:mod:`distdiag.match`), never by time. A group with members still inside it
   (``t1 == -1``) while other members of the communicator never entered it is
   a stuck collective. Per communicator the last such group is the one its
   ranks died in.
2. **Who never came.** The communicator's members missing from that group
   (for the world communicator also the ranks that left no file at all).
3. **What they did instead.** For each missing rank: the calls it was inside of
   at its last flush (a collective on another communicator, a file read, an open
   ``distdiag.phase``), else its last recorded event; with call sites, and how
   long it had been at it when its record ends.

Only ranks whose own record goes on ``min_stuck_s`` (``[analyze.hang]``,
default 0.5 s) past the others' arrival count as never entered: the files of
killed ranks end at their own last flushes, and a job aborted mid-run has
ranks a few milliseconds apart in their collectives, which is no hang.

Cost: the wall-clock from the moment the last present member entered the stuck
collective (from then on every rank that could be there waited) to the end of
the record. Had the missing rank come, the collective would have completed
about then; every second after it was lost, and the job did not finish at
all, so :func:`distdiag.ranking.rank_findings` lists a hang first whatever
the costs (``evidence["ends_job"]``).

Worked example: ranks 0, 1, 3 enter Barrier #7 on "world" at 10.0, 10.1 and
10.2 s; rank 2 sits in ``phase("evaluate")`` since 9.5 s; the ranks are
killed, their records end at 70.2 s. Cost = 70.2 - 10.2 = 60 s; rank 2 had
been in "evaluate" for 60.7 s.

A deadlock in which every missing rank is itself stuck in another collective
is reported the same way; the summary then says that the ranks wait on each
other.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import numpy as np

from distdiag.bands import bands
from distdiag.analysis import Analysis
from distdiag.detectors import register
from distdiag.findings import Finding
from distdiag.match import Collectives
from distdiag.ranks import rank_list
from distdiag.schema import COMM_KINDS, FILE_KINDS, Kind

if TYPE_CHECKING:
    from distdiag.run import Run

log = logging.getLogger(__name__)

#: Communicator keys that span every rank of the launch (mpi4py "world", torch "default").
WORLD_KEYS = ("world", "default")
#: Missing ranks described one by one in the evidence (the rest are counted).
MAX_DESCRIBED = 8

_COMM_ARR = np.array(sorted(int(k) for k in COMM_KINDS), np.uint8)
_FILE_ARR = np.array(sorted(int(k) for k in FILE_KINDS), np.uint8)


def _kind_name(k: int) -> str:
    try:
        return Kind(int(k)).name
    except ValueError:
        return f"kind {int(k)}"


def _secs(s: float) -> str:
    return f"{s:.1f} s" if s >= 1 else f"{s * 1e3:.0f} ms"


def _members_of(run: Run, colls: Collectives, comm: int) -> np.ndarray:
    """Every rank of the communicator: the ranks that used its key, plus, for the
    world communicator, the ranks of the launch whose file is missing."""
    m = colls.comm_members.get(int(comm), np.zeros(0, np.int32)).astype(np.int64)
    if run.s(int(comm)) in WORLD_KEYS and run.world_size > 0:
        m = np.union1d(m, np.arange(int(run.world_size), dtype=np.int64))
    return m


def stuck_groups(run: Run, colls: Collectives, min_stuck_ns: int = 0) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """Per communicator, the last group some member died inside while others never entered it.

    A member counts as "never entered" only when its own record goes on at
    least ``min_stuck_ns`` past the moment the last present member entered:
    files of killed ranks end at their last flush, each at its own moment, and
    a record that ends before the others arrived cannot say the rank stayed
    away (an abort kills every rank within milliseconds, mid-collective).
    A member that left no file at all counts (it cannot have been there). And
    the members inside must have been stuck that long themselves, by their own
    records: a job killed mid-run has ranks inside collectives for microseconds.

    Returns ``(group, inside_ranks, missing_ranks)`` tuples.
    """
    if len(colls) == 0:
        return []
    starts = colls.g_start[:-1]
    inside_any = np.minimum.reduceat(colls.m_t1_ns, starts) < 0
    cand = np.flatnonzero(inside_any)
    if len(cand) == 0:
        return []
    # The last candidate per communicator (groups are sorted by (comm, seq)).
    comm = colls.g_comm[cand]
    last = cand[np.r_[comm[1:] != comm[:-1], True]]
    _, end = run.rank_bounds()
    have = np.array(sorted(run.ranks), np.int64)
    out = []
    for g in last:  # one per communicator with a stuck group: a handful
        sl = colls.members(int(g))
        present = colls.m_rank[sl].astype(np.int64)
        inside = present[colls.m_t1_ns[sl] < 0]
        missing = np.setdiff1d(_members_of(run, colls, int(colls.g_comm[g])), present)
        last_arrival = int(colls.m_t0_ns[sl].max())
        if len(inside) == 0 or int(end[inside].max()) - last_arrival < min_stuck_ns:
            continue  # its members were not stuck in it for long: killed mid-run, not hung
        filed = np.isin(missing, have)
        ends = end[np.where(filed, missing, 0)]
        missing = missing[~filed | (ends - last_arrival >= min_stuck_ns)]
        if len(missing):
            out.append((int(g), np.sort(inside), missing))
    return out


def _last_per_comm(run: Run, colls: Collectives) -> dict[str, dict[str, list[int]]]:
    """Per communicator: "<op> #<seq> (left|inside)" -> ranks whose last collective it was."""
    if len(colls) == 0:
        return {}
    comm = colls.g_comm[colls.m_group].astype(np.int64)
    seq = colls.g_seq[colls.m_group]
    rank = colls.m_rank.astype(np.int64)
    o = np.lexsort((seq, rank, comm))
    key_c, key_r = comm[o], rank[o]
    lastrow = o[np.r_[(key_c[1:] != key_c[:-1]) | (key_r[1:] != key_r[:-1]), True]]
    out: dict[str, dict[str, list[int]]] = {}
    labels = {}
    for i in lastrow:  # one per (communicator, rank): bounded by ranks x communicators
        g = int(colls.m_group[i])
        left = bool(colls.m_t1_ns[i] >= 0)
        key = (int(colls.g_comm[g]), int(colls.g_seq[g]), int(colls.m_op[i]), left)
        if key not in labels:
            labels[key] = f"{run.s(key[2])} #{key[1]} ({'left' if left else 'inside'})"
        out.setdefault(run.s(key[0]), {}).setdefault(labels[key], []).append(int(colls.m_rank[i]))
    return out


def _describe(run: Run, ranks: np.ndarray, end_ns: dict[int, int]) -> list[dict[str, Any]]:
    """:func:`_doing` for each of ``ranks`` (ascending, at most MAX_DESCRIBED), in that order.

    A rank's last rows can be of any kind, the compute phases included, which a
    large run streams (absent from ``run.events``): so each rank's rows come
    from its band (:func:`distdiag.bands.bands`), all of them, in table order;
    only the bands holding these ranks are read (a streamed run reads their
    files, no others). A rank's rows are all in one band, whatever the band
    size, so the description does not depend on it."""
    want = [int(r) for r in ranks]
    got: dict[int, dict[str, Any]] = {}
    for band in bands(run, ranks=ranks):  # at most one band a rank wanted; none when no ranks
        for r in want:  # a handful
            if band.r_lo <= r < band.r_hi:
                i = r - band.r_lo
                got[r] = _doing(run, r, end_ns[r], band.events[int(band.first[i]) : int(band.first[i + 1])])
    return [got[r] for r in want]  # every rank of 0..n_ranks is in a band


def _doing(run: Run, rank: int, end_ns: int, ev: np.ndarray) -> dict[str, Any]:
    """What ``rank`` was doing at the end of its record, in words and data (``ev``: its rows, every kind, in order)."""
    if rank not in run.ranks:
        return {"rank": rank, "what": "left no usable file (never started, or its file is lost)", "for_s": None}
    inf = run.inflight[run.inflight["rank"] == rank]
    out: dict[str, Any] = {"rank": rank, "host": run.host_of(rank)}
    if len(inf):
        o = np.argsort(inf["t0_ns"], kind="stable")
        calls = []
        for row in inf[o]:  # the calls open on its threads: a handful
            c = {
                "kind": _kind_name(int(row["kind"])),
                "name": run.s(int(row["name_id"])),
                "site": run.s(int(row["site_id"])),
                "for_s": max(0, end_ns - int(row["t0_ns"])) / 1e9,
                "thread": int(row["tid"]),
            }
            if int(row["kind"]) in COMM_KINDS and int(row["seq"]) >= 0:
                c["comm"] = run.s(int(row["comm_id"]))
                c["seq"] = int(row["seq"])
            calls.append(c)
        out["inflight"] = calls
        # The innermost call tells most: the latest entered one.
        c = calls[-1]
        what = f"inside {c['name'] or c['kind']}"
        if "seq" in c:
            what += f" #{c['seq']} on communicator '{c['comm']}'"
        elif c["kind"] == "PHASE":
            what = f"inside phase '{c['name']}'"
        if c["site"]:
            what += f" at {c['site']}"
        out["what"] = what
        out["for_s"] = c["for_s"]
    if len(ev):
        t_end = np.maximum(ev["t1_ns"], ev["t0_ns"])
        # Our own milestones (shim start, clock rounds) say nothing about the program.
        prog = ev["kind"] != Kind.SHIM
        i = int(np.argmax(np.where(prog, t_end, np.iinfo(np.int64).min))) if prog.any() else int(np.argmax(t_end))
        row = ev[i]
        last: dict[str, Any] = {
            "kind": _kind_name(int(row["kind"])),
            "name": run.s(int(row["name_id"])),
            "site": run.s(int(row["site_id"])),
            "ended_s_before_end": max(0, end_ns - int(t_end[i])) / 1e9,
        }
        if int(row["kind"]) in COMM_KINDS and int(row["seq"]) >= 0:
            last["comm"] = run.s(int(row["comm_id"]))
            last["seq"] = int(row["seq"])
        out["last_event"] = last
        files = np.isin(ev["kind"], _FILE_ARR)
        if files.any():
            j = np.flatnonzero(files)[int(np.argmax(t_end[files]))]
            out["last_file"] = {
                "op": _kind_name(int(ev["kind"][j])),
                "path": run.s(int(ev["name_id"][j])),
                "site": run.s(int(ev["site_id"][j])),
                "s_before_end": max(0, end_ns - int(t_end[j])) / 1e9,
            }
        if "what" not in out:
            desc = f"{last['kind']} {last['name']}" if last["name"] else last["kind"]
            if "seq" in last:
                desc = last["name"] or last["kind"]
                desc += f" #{last['seq']} on '{last['comm']}'"
            where = f" at {last['site']}" if last["site"] else ""
            out["what"] = (
                f"outside any recorded call (computing, sleeping or in code distdiag does not hook) "
                f"since its last event, {desc}{where}"
            )
            out["for_s"] = last["ended_s_before_end"]
    if "what" not in out:
        out["what"] = "recorded no event (killed before its first flush?)"
        out["for_s"] = None
    return out


@register("hang", requires=("collectives",))
def detect(an: Analysis) -> list[Finding]:
    run, cfg = an.run, an.cfg
    colls = an.colls
    min_stuck_s = float(cfg.value("hang", "min_stuck_s", 0.5))
    stuck = stuck_groups(run, colls, int(min_stuck_s * 1e9))
    if not stuck:
        return []
    _, end = run.rank_bounds()
    # The main stuck collective: the one most ranks wait in (then the earliest).
    stuck.sort(key=lambda s: (-len(s[1]), int(colls.g_first_ns[s[0]])))
    g, inside, missing = stuck[0]
    sl = colls.members(g)
    present = colls.m_rank[sl].astype(np.int64)
    t0 = colls.m_t0_ns[sl]
    waiting_end = int(end[inside].max()) if len(inside) else int(run.end_ns)
    cost_ns = max(0, waiting_end - int(t0.max()))
    stuck_s = {int(r): max(0, int(end[r]) - int(t)) / 1e9 for r, t in zip(present, t0)}
    sites = colls.m_site[sl]
    u, cnt = np.unique(sites, return_counts=True)
    site = run.s(int(u[np.argmax(cnt)])) if len(u) else ""
    op = colls.op_name(g)
    comm = colls.comm_name(g)
    seq = int(colls.g_seq[g])

    # Ranks missing from any stuck collective; the culprits are those not
    # themselves stuck inside one (if every one is, the ranks wait on each other).
    all_missing = np.unique(np.concatenate([s[2] for s in stuck]))
    in_flight = colls.m_t1_ns < 0
    all_inside = np.unique(colls.m_rank[in_flight])
    free = np.setdiff1d(all_missing, all_inside)
    deadlock = len(free) == 0
    if deadlock:
        # Ranks stuck inside a mismatched collective (a rank passed another size,
        # op or root) explain the rest: that is collective_mismatch's finding.
        from distdiag.mismatch import mismatches

        bad = mismatches(run, colls)[0]
        in_bad = np.unique(colls.m_rank[in_flight & bad[colls.m_group]])
        if len(in_bad) and np.isin(all_missing, in_bad).all():
            log.info("hang: ranks %s are stuck in a mismatched collective; left to collective_mismatch",
                     all_missing.tolist())
            return []
    culprits = all_missing if deadlock else free
    described = _describe(run, culprits[:MAX_DESCRIBED], {
        int(r): int(end[r]) if int(r) < len(end) and int(r) in run.ranks else waiting_end
        for r in culprits[:MAX_DESCRIBED]})  # fmt: skip

    ranks_txt = rank_list(culprits, MAX_DESCRIBED)
    where = f" at {site}" if site else ""
    first = described[0] if described else {}
    doing = ""
    if first:
        dur = f" for {_secs(first['for_s'])}" if first.get("for_s") is not None else ""
        doing = f"; rank {first['rank']} was {first['what']}{dur}" if "left no" not in first["what"] else (
            f"; rank {first['rank']} {first['what']}")
    if deadlock:
        summary = (
            f"hang: the job ended inside {op} #{seq} on '{comm}'{where} that rank(s) {ranks_txt} never entered: "
            f"they were stuck in other collectives (the ranks wait on each other){doing}"
        )
    else:
        summary = (
            f"hang: rank(s) {ranks_txt} never entered {op} #{seq} on '{comm}'{where}; "
            f"{len(inside)} rank(s) waited in it {_secs(cost_ns / 1e9)} until the job ended{doing}"
        )
    groups = []
    for gg, ins, mis in stuck:  # a handful
        groups.append({
            "comm": colls.comm_name(gg), "seq": int(colls.g_seq[gg]), "op": colls.op_name(gg),
            "inside": [int(x) for x in ins], "never_entered": [int(x) for x in mis],
        })  # fmt: skip
    return [
        Finding(
            kind="hang",
            cost_s=cost_ns / 1e9,
            summary=summary,
            ranks=[int(r) for r in culprits],
            hosts=run.hosts_of(int(r) for r in culprits),
            evidence={
                "ends_job": True,
                "comm": comm,
                "seq": seq,
                "op": op,
                "site": site,
                "inside": [int(x) for x in inside],
                "never_entered": [int(x) for x in missing],
                "stuck_s": stuck_s,
                "deadlock": deadlock,
                "doing": described,
                "stuck_collectives": groups,
                "last_collective": _last_per_comm(run, colls),
            },
            advice=(
                f"Look at what rank(s) {ranks_txt} do before {op}{where}: a branch that skips the collective "
                "on some ranks, an endless loop or wait, or a blocking call (I/O, a receive) that never returns."
            ),
        )
    ]
