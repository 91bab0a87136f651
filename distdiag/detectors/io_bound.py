"""io_bound: a rank spends a large share of the run in file-system calls and no other
finding says why (issue 20 item 2: never silent on a subsystem that holds the wall-clock).

``metadata_storm`` needs many ranks hammering one file system at once, ``io_bandwidth``
large files; a single rank that opens, stats and reads thousands of small files from a
slow shared file system (or a job whose every rank does so at its own pace) fits
neither, and read "healthy". This detector says the file system binds.

Which time: per rank, its file calls after its startup (the startup's imports are the
``startup`` finding's: :func:`distdiag.breakdown.startup_ends`), merged into bursts
across gaps shorter than ``gap_ms`` (2 ms: the program's own loop between two reads,
``os.path.join`` and the like, is the reading's too; measured on a rank reading 600
small files from the slow FUSE mount, these gaps held 0.12 s of its 1.16 s loss). The
most-held rank's bursts are the cost: what the job would save were the file system to take
no time on that rank; an upper bound (the calls still cost their healthy latency, and
calls the other ranks did not wait for shorten nothing), stated in the evidence. The
evidence gives per mount the calls, seconds, the latency per metadata call (median, p90),
the data calls' bytes and throughput, and the busiest paths.

Imports: a rank's imports after its startup (a lazy ``import``, the program's own
``import`` statements inside its first ``distdiag.phase``) are file calls too, on module
paths and the directories the import system searches
(:func:`distdiag.import_files.import_paths`). On a node-local file system they are not
counted: their calls are fast and the bursts they make are the modules' own code running
between them, slower the more loaded the machine (the demo job's ``import mpi4py`` inside
a phase, 520 calls, made 0.06 s of bursts with one core busy beside it, and over 0.4 s on a
loaded CI machine: priced above the straggler it ran with). On a shared file system (not
``LOCAL_FSTYPES``) they count: there the file system binds the imports.

Reported from ``min_share`` (0.1) of the wall-clock. When ``metadata_storm`` or
``io_bandwidth`` names the cause, their seconds are this finding's first: the ranking
keeps only the rest here, reported while it is still ``min_share`` of the run
(:func:`distdiag.ranking.rank_findings`).

The bursts of the rank named are what the finding claims in the ranking (a straggler
whose lateness they cover is their symptom): :attr:`Finding.claims`.

Settings (``[analyze.io_bound]``): ``min_share`` (0.1), ``top`` (5), ``gap_ms`` (2).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from distdiag.import_files import import_paths, shared_fs_rows
from distdiag.intervals import union_length_by_key
from distdiag.analysis import Analysis
from distdiag.detectors import register
from distdiag.roles import Role
from distdiag.findings import Finding
from distdiag.rows import calls_of, rows_of, weighted_median, weighted_quantile
from distdiag.schema import FILE_KINDS, Kind

_META = np.zeros(256, bool)
_META[[int(Kind.FILE_OPEN), int(Kind.FILE_CLOSE), int(Kind.FILE_STAT), int(Kind.FILE_LISTDIR)]] = True

ADVICE = (
    "read fewer, larger files (pack small files into shards: WebDataset, HDF5, TFRecord), stage the data "
    "to node-local storage or /dev/shm before the run, cache stats and listings, or read in DataLoader "
    "workers so compute hides it"
)


def bursts(r: np.ndarray, t0: np.ndarray, t1: np.ndarray, gap_ns: float) -> tuple[np.ndarray, ...]:
    """(rank, b0, b1): the intervals (sorted by (rank, t0) here when not) merged per rank across
    gaps shorter than ``gap_ns``. Worked example (ms), gap 2: [0, 1) [1.5, 3) [9, 10) -> [0, 3) [9, 10)."""
    if len(r) == 0:
        return r, t0, t1
    if not bool(np.all((r[1:] > r[:-1]) | ((r[1:] == r[:-1]) & (t0[1:] >= t0[:-1])))):
        o = np.lexsort((t0, r))
        r, t0, t1 = r[o], t0[o], t1[o]
    lo = int(t0.min())
    span = int(t1.max()) - lo + 1
    key = r * span  # each rank in its own band: one running max never carries into the next rank
    reach = np.maximum.accumulate(key + (t1 - lo))
    new = np.r_[True, (r[1:] != r[:-1]) | ((key[1:] + (t0[1:] - lo)) - reach[:-1] >= gap_ns)]
    at = np.flatnonzero(new)
    b1 = np.maximum.reduceat(key + (t1 - lo), at) - key[at] + lo
    return r[at], t0[at], b1


@register("io_bound", requires=("startup_ends",),
          role=Role(tier=0, replay_claims="claims", removal=1, subsystem=True,
                    explained_by=("metadata_storm", "io_bandwidth")))
def detect(an: Analysis) -> list[Finding]:
    run, cfg = an.run, an.cfg
    min_share = float(cfg.value("io_bound", "min_share", 0.1))
    top = int(cfg.value("io_bound", "top", 5))
    wall_s = float(run.wall_s)
    if wall_s <= 0:
        return []
    rows = rows_of(run, tuple(int(k) for k in FILE_KINDS))
    if len(rows) == 0:
        return []
    ev = run.events
    rows = rows[~(import_paths(run, ev["name_id"][rows]) & ~shared_fs_rows(run, rows))]  # see "Imports"
    if len(rows) == 0:
        return []
    r = ev["rank"][rows].astype(np.int64)
    t0 = ev["t0_ns"][rows].astype(np.int64)
    t1 = np.maximum(ev["t1_ns"][rows].astype(np.int64), t0)
    _, end = run.rank_bounds()
    after = an.startup_ends()
    n = len(end)
    t0c = np.maximum(t0, after[r])
    t1c = np.minimum(np.maximum(t1, t0c), end[r])
    keep = t1c > t0c
    if not keep.any():
        return []
    br, b0, b1 = bursts(r[keep], t0c[keep], t1c[keep], float(cfg.value("io_bound", "gap_ms", 2.0)) * 1e6)
    per_rank = union_length_by_key(br, b0, b1, n)
    worst = int(np.argmax(per_rank))
    cost_s = float(per_rank[worst]) / 1e9
    if cost_s < min_share * wall_s:
        return []
    on = br == worst
    claims = (br[on].astype(np.int64), b0[on].astype(np.int64), b1[on].astype(np.int64))
    # evidence: the most-held rank's calls per mount
    mine = keep & (r == worst)
    rows_m = rows[mine]
    dur = (t1c[mine] - t0c[mine]).astype(np.float64)
    kind = ev["kind"][rows_m]
    aux = ev["aux"][rows_m].astype(np.int64)
    nbytes = ev["nbytes"][rows_m].astype(np.float64)
    n_of = calls_of(ev[rows_m])  # 1, or the calls a sum stands for
    lat = dur / n_of
    mounts: list[dict[str, Any]] = []
    ua, ainv = np.unique(aux, return_inverse=True)
    by_secs = ua[np.argsort(-np.bincount(ainv, weights=dur, minlength=len(ua)), kind="stable")]
    for a in by_secs[:top]:  # the `top` mounts it spent most time on (not the first ids)
        on = aux == a
        meta = on & _META[kind]
        data = on & ~_META[kind]
        d_s = float(dur[data].sum()) / 1e9
        mounts.append({
            "mount": run.s(int(a)) if a > 0 else "?",
            "calls": int(n_of[on].sum()), "seconds": round(float(dur[on].sum()) / 1e9, 4),
            "metadata_calls": int(n_of[meta].sum()),
            "metadata_latency_ms": ({"median": round(weighted_median(lat[meta], n_of[meta]) / 1e6, 4),
                                     "p90": round(weighted_quantile(lat[meta], n_of[meta], 0.9) / 1e6, 4)}
                                    if meta.any() else None),
            "data_bytes": int(nbytes[data].sum()),
            "data_MB_per_s": round(float(nbytes[data].sum()) / d_s / 1e6, 3) if d_s > 0 else None,
        })  # fmt: skip
    mounts.sort(key=lambda m: -m["seconds"])
    # the busiest paths (by seconds) of that rank
    nid = ev["name_id"][rows_m].astype(np.int64)
    u, inv = np.unique(nid, return_inverse=True)
    secs = np.bincount(inv, weights=dur, minlength=len(u))
    paths = [run.s(int(u[j])) for j in np.argsort(-secs)[:top]]
    share = cost_s / wall_s
    m0 = mounts[0]
    lat = m0["metadata_latency_ms"]
    summary = (
        f"the file system binds: rank {worst} spent {cost_s:.3g} s ({share:.0%} of the run) in {int(mine.sum())} "
        f"file calls after its startup, most on {m0['mount']}"
        + (f" ({m0['metadata_calls']} metadata calls at a median {lat['median']:.3g} ms)" if lat else "")
    )
    return [
        Finding(
            kind="io_bound",
            cost_s=cost_s,
            summary=summary,
            ranks=[worst],
            hosts=run.hosts_of([worst]),
            paths=paths,
            advice=ADVICE,
            claims=claims,
            evidence={
                "share_of_wall": round(share, 4),
                "calls": int(calls_of(ev[rows[mine]]).sum()),
                "file_time_s": round(float(dur.sum()) / 1e9, 4),
                "bursts": int(on.sum()),
                "between_calls_s": round(cost_s - float(union_length_by_key(r[mine], t0c[mine], t1c[mine], n)[worst]) / 1e9, 4),
                "ranks_over_min_share": int((per_rank >= min_share * wall_s * 1e9).sum()),
                "by_mount": mounts,
                "counterfactual": ("the file system took no time on this rank after its startup (its file calls and the gaps "
                                   "under gap_ms between them): an upper bound"),
            },
        )
    ]
