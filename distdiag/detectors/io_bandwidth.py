"""I/O bandwidth: large reads or writes (checkpoints, dataset shards) that hold the job.

A rank that writes a 10 GB checkpoint at 200 MB/s spends 50 s in ``write``;
if the other ranks meanwhile sit in the next all-reduce, the whole job lost
those 50 s. If they were writing their own shards at the same time, the job
lost them too (the file system's bandwidth binds). If they kept computing, the
write cost nothing.

How (vectorized over events; loops over ranks only):

1. Data rows (FILE_READ / FILE_WRITE, ``nbytes`` > 0; also the byte-less
   FILE_WRITE rows of ``fsync``) are grouped per (rank, file). A file is
   *large* when the rank moved at least ``min_bytes`` through it. Its rows,
   plus the opens and closes of that file (a close flushes, a checkpoint's
   cost includes them), are merged per rank into I/O *episodes* on the
   aligned timeline.
2. For every episode of rank r and every other rank q: how much of the
   episode q spent *stalled*: waiting (inside a blocking collective, a Wait
   on non-blocking ones as DDP's buckets are, a blocking receive) or in its
   own large I/O. The episode's cost is the median of that over the
   other ranks: what the job as a whole could not overlap. With one rank
   (or no other rank recorded) the whole episode counts.
3. The finding is charged the largest per-rank cost (episodes of different
   ranks at the same time hold the job once, not once per rank); it names
   the ranks whose cost passes the threshold, their files, the achieved
   bandwidth per rank (bytes / time in those calls) and job-wide (all bytes /
   the union of all episodes on the timeline).

Worked example: rank 0 writes 256 MiB in 1.2 s at iteration 10; ranks 1-3
enter the all-reduce of iteration 10 right after their compute and wait there
1.15 s of those 1.2 s: the cost is 1.15 s, at 213 MiB/s.

Settings (``[analyze.io_bandwidth]``): ``min_bytes`` (64 MiB), ``gap_s`` (0.05:
rows closer than this merge into one episode), ``min_fraction`` ([analyze],
0.02), ``top`` (5).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from distdiag.analysis import Analysis
from distdiag.detectors import register
from distdiag.roles import Role
from distdiag.findings import Finding
from distdiag.intervals import covered_within, union_by_key, union_length
from distdiag.bands import n_ranks
from distdiag.passes import RowsPass, run_local
from distdiag.rows import events_of
from distdiag.schema import Kind

if TYPE_CHECKING:
    from distdiag.run import Run

log = logging.getLogger(__name__)

ADVICE = (
    "Take the large transfer off the critical path: write checkpoints asynchronously (a background thread, "
    "torch.distributed.checkpoint async_save) or to node-local storage and copy out in the background; "
    "shard them so every rank writes 1/N; read dataset shards ahead of use; on Lustre/GPFS stripe large "
    "files across more targets."
)

_DATA = np.array([Kind.FILE_READ, Kind.FILE_WRITE], np.uint8)
_OPEN_CLOSE = np.array([Kind.FILE_OPEN, Kind.FILE_CLOSE], np.uint8)
#: a rank inside one of these is waiting for someone (blocking collective,
#: Wait on non-blocking ones, as DDP's buckets are, a blocking receive)
_STALL = np.array([Kind.COLL, Kind.WAIT, Kind.RECV], np.uint8)


def _stall_rows(run: Run) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rank as int64, t0, t1) of the rows of the stall kinds (blocking collectives, waits,
    receives) that ended (t1 >= t0), in table order: from the run's kind index, or, for the
    kinds a streamed run keeps on disk (its collective rows once matched), band by band
    (:mod:`distdiag.bands`), same rows. Only the three columns the overlap reads are kept
    (24 B a row, not a 73-byte event row: a streamed run's collective rows are its bulk)."""
    streamed = set(getattr(run, "streamed_kinds", ()))
    if streamed & {int(k) for k in _STALL}:  # a few dozen bands, one at a time: only three columns outlive a band
        rank, t0, t1 = run_local(run, [RowsPass(_STALL, ("rank", "t0_ns", "t1_ns"), _ended)])[0]
        return rank.astype(np.int64), t0, t1
    st = events_of(run, _STALL)
    ok = st["t1_ns"] >= st["t0_ns"]
    return st["rank"][ok].astype(np.int64), st["t0_ns"][ok], st["t1_ns"][ok]


def _ended(ev: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Which of the rows ``rows`` ended (t1 >= t0)."""
    return ev["t1_ns"][rows] >= ev["t0_ns"][rows]  # type: ignore[no-any-return]


@register("io_bandwidth",
          role=Role(tier=0, replay_claims="claims", removal=0))
def detect(an: Analysis) -> list[Finding]:
    run, cfg = an.run, an.cfg
    sec = "io_bandwidth"
    min_bytes = int(cfg.value(sec, "min_bytes", 64 << 20))
    gap_ns = int(float(cfg.value(sec, "gap_s", 0.05)) * 1e9)
    min_fraction = float(cfg.value(sec, "min_fraction", 0.02))
    top = int(cfg.value(sec, "top", 5))
    wall_s = run.wall_s
    if wall_s <= 0:
        return []
    # Rows by the run's kind index (distdiag.rows): the file and stall rows are
    # few; the masks over the whole table were a scan per kind (same rows, same order).
    data = events_of(run, _DATA)
    data = data[data["t1_ns"] >= data["t0_ns"]]
    if len(data) == 0:
        return []
    n = n_ranks(run)  # world size, or more when a file names a larger rank (no read of the table's rank column)

    # 1. large files per rank
    df = pd.DataFrame({"rank": data["rank"], "name": data["name_id"], "nbytes": data["nbytes"], "kind": data["kind"]})
    per_file = df.groupby(["rank", "name"], sort=False)["nbytes"].sum()
    large = per_file[per_file >= min_bytes]
    if large.empty:
        return []
    large_keys = np.array([r * (len(run.strings) + 1) + nm for r, nm in large.index], np.int64)
    io = events_of(run, np.r_[_DATA, _OPEN_CLOSE])
    pair_key = io["rank"].astype(np.int64) * (len(run.strings) + 1) + io["name_id"]
    io = io[np.isin(pair_key, large_keys) & (io["t1_ns"] >= io["t0_ns"])]
    e_rank, e_t0, e_t1 = union_by_key(io["rank"], io["t0_ns"], io["t1_ns"], gap_ns)

    # 2. what the other ranks did during each episode
    st_rank, st_t0, st_t1 = _stall_rows(run)
    s_rank = np.r_[st_rank, e_rank]
    s_t0 = np.r_[st_t0, e_t0]
    s_t1 = np.r_[st_t1, e_t1]
    del st_rank, st_t0, st_t1
    m_rank, m_t0, m_t1 = union_by_key(s_rank, s_t0, s_t1)
    present = np.array(sorted(run.ranks), np.int64)
    overlap = np.zeros((n, len(e_rank)))
    for q in present:  # per rank: vectorized over episodes
        mine = m_rank == q
        overlap[q] = covered_within(m_t0[mine], m_t1[mine], e_t0, e_t1)
    ep_len = (e_t1 - e_t0).astype(np.float64)
    ep_cost = np.zeros(len(e_rank))
    for r in np.unique(e_rank):  # ranks with large I/O: few
        others = present[present != r]
        cols = e_rank == r
        ep_cost[cols] = np.median(overlap[others][:, cols], axis=0) if len(others) else ep_len[cols]
    rank_cost = np.bincount(e_rank, weights=ep_cost, minlength=n)
    rank_busy = np.bincount(e_rank, weights=ep_len, minlength=n)
    cost_ns = float(rank_cost.max())
    if cost_ns < min_fraction * wall_s * 1e9:
        return []
    blamed = np.flatnonzero(rank_cost >= min_fraction * wall_s * 1e9)

    # 3. evidence: bytes, time inside the calls, bandwidth, files
    dsel = data[np.isin(data["rank"].astype(np.int64) * (len(run.strings) + 1) + data["name_id"], large_keys)]
    d_rank = dsel["rank"].astype(np.int64)
    call_ns = (dsel["t1_ns"] - dsel["t0_ns"]).astype(np.float64)
    rb = np.bincount(d_rank, weights=dsel["nbytes"].astype(np.float64), minlength=n)
    rt = np.bincount(d_rank, weights=call_ns, minlength=n)
    wrote = np.bincount(d_rank, weights=(dsel["kind"] == Kind.FILE_WRITE) * dsel["nbytes"].astype(np.float64), minlength=n)
    job_span_s = union_length(e_t0, e_t1) / 1e9
    per_rank = [
        {
            "rank": int(r),
            "cost_s": float(rank_cost[r] / 1e9),
            "io_s": float(rank_busy[r] / 1e9),
            "bytes": int(rb[r]),
            "written_bytes": int(wrote[r]),
            "mb_per_s": float(rb[r] / (rt[r] / 1e9) / 1e6) if rt[r] > 0 else None,
        }
        for r in np.flatnonzero(rank_busy > 0)
    ]
    files = large.reset_index().sort_values("nbytes", ascending=False)
    files = files[files["rank"].isin(blamed)].head(top)
    top_files: list[dict[str, Any]] = [{"rank": int(f.rank), "path": run.s(int(f.name)), "bytes": int(f.nbytes)} for f in files.itertuples()]
    fs_ids = np.unique(dsel["aux"][np.isin(d_rank, blamed)])
    fss = [run.s(int(i)) for i in fs_ids if i > 0]
    r0 = int(blamed[np.argmax(rank_cost[blamed])])
    direction = "wrote" if wrote[r0] >= rb[r0] / 2 else "read"
    mbps = rb[r0] / (rt[r0] / 1e9) / 1e6 if rt[r0] > 0 else float("nan")
    n_waiting = len(present) - 1
    job_mbps = float(rb.sum() / job_span_s / 1e6) if job_span_s > 0 else None
    who = f"rank {r0}" if len(blamed) == 1 else f"ranks {', '.join(str(int(x)) for x in blamed)} (largest: rank {r0})"
    summary = (
        f"{who} {direction} {rb[r0] / 2**20:.0f} MiB ({top_files[0]['path'] if top_files else '?'}) at {mbps:.0f} MB/s,"
        f" {rank_busy[r0] / 1e9:.2f} s in I/O"
        + (f" while the other {n_waiting} rank(s) could not proceed" if n_waiting else "")
        + f"; the job lost {cost_ns / 1e9:.2f} s"
    )
    # what the finding claims (the ranking, the replay's counterfactual): the blamed ranks' episodes,
    # not all their file calls (a rank's imports and small reads are not its checkpoint: counting
    # them priced a 0.16 s checkpoint at 0.20 s)
    ours = np.isin(e_rank, blamed)
    return [
        Finding(
            kind="io_bandwidth",
            cost_s=cost_ns / 1e9,
            summary=summary,
            ranks=[int(x) for x in blamed],
            hosts=run.hosts_of(blamed.tolist()),
            paths=[f["path"] for f in top_files],
            advice=ADVICE,
            evidence={
                "file_systems": fss,
                "per_rank": per_rank,
                "job_mb_per_s": job_mbps,
                "job_io_span_s": job_span_s,
                "episodes": int(len(e_rank)),
                "top_files": top_files,
                "min_bytes": min_bytes,
            },
            claims=(e_rank[ours].astype(np.int64), e_t0[ours].astype(np.int64), e_t1[ours].astype(np.int64)),
        )
    ]
