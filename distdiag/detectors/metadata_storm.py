"""Metadata storm: many ranks hammer one file system's metadata server at once.

The classic start-up failure: every rank opens thousands of small files (or
imports a Python stack from the parallel file system) at the same moment; the
metadata server serves them one at a time, each call waits behind everyone
else's, and the bandwidth sits unused. Darshan counts opens per file, not
*when* they happened across ranks; here the storm is a window on the job's
aligned timeline.

How (vectorized over events; loops only over file systems and windows):

1. Metadata calls (FILE_OPEN, FILE_CLOSE, FILE_STAT, FILE_LISTDIR) are grouped
   by file system (``aux`` = "fstype:mountpoint") and binned on the aligned
   timeline (``bin_s``). A bin is *hot* when the job-wide rate is at least
   ``min_rate_per_s`` and, on average, at least ``min_blocked_ranks`` ranks are
   blocked in metadata calls during it (sum of call durations / bin length).
   Hot bins closer than ``gap_bins`` merge into windows; a window needs at
   least ``min_calls`` calls (four ranks opening one packed file each is
   not a storm, however slow the server).
2. The server is *saturated* when latency grows with concurrency: for each call,
   the number of other metadata calls on the same file system in flight when
   it started (two ``searchsorted`` over the sorted starts and ends); the
   median latency of calls that had company over that of calls that ran
   alone must be at least ``min_latency_ratio``, or the median latency in the
   window at least ``slow_latency_ms`` (a metadata call that slow is a server
   problem whatever the concurrency). A window in which no call ever had
   company (one process at its own pace, or ranks taking turns) is no storm,
   unless its calls are imports (the import storm, one process's as well: at
   scale every rank imports the same files at once); a slow file system held
   by one rank's serial reads is ``io_bound``'s. With no company the latency
   ratio is 1: a loaded machine's slow bin is no sign of concurrency. That median is of file accesses
   (:func:`_accesses`): the libc interposer records an open as open + fstat +
   close, the Python hooks as one open row; both give the same latency. Fast
   local disks fail both: a storm of
   5 µs stats costs nothing. On node-local file systems (``LOCAL_FSTYPES``:
   ext4, xfs, tmpfs, ...) there is no server to saturate, and calls slow
   down with concurrency because ranks compete for CPUs; there only a median
   of at least ``local_slow_latency_ms`` counts.
3. Cost: per rank, the union of its file-call intervals on that file system
   inside the window (the small reads of a storm wait behind the same
   server, so they count) and of the gaps between them in which the rank was
   in no collective nor entered or left one: calls the hooks do not see (``os.walk``'s
   per-entry stats from C, C readers) are the storm's too, up to the rank's
   next rendezvous (measured: a walk + stat + read of 300 files on 1 ms-class
   FUSE was priced at 75% of what it cost the job from the recorded calls
   alone, now 97%; compute between file calls outside any collective counts as
   storm time as well).
   The finding is charged the *largest* of those:
   ranks of a synchronous job continue together, so the job is held as long
   as its most-blocked rank; the others' blocked time ran alongside it.
   Worked example: 4 ranks each blocked 6.0, 6.1, 5.9, 6.0 s in one window
   before a barrier: the job would have been ~6.1 s shorter, not 24 s.

Settings (``[analyze.metadata_storm]``): ``bin_s`` (0.1), ``min_rate_per_s``
(20: a saturated server's rate is *low*, it is its throughput; the rate only
rules out one long call that is not a storm), ``min_calls`` (100), ``min_blocked_ranks`` (0.5), ``gap_bins`` (2; below 0 reads as 0), ``min_latency_ratio``
(2.0), ``slow_latency_ms`` (1.0), ``local_slow_latency_ms`` (10.0), ``min_fraction`` ([analyze], 0.02), ``top`` (5).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import pandas as pd

from distdiag.intervals import union_length_by_key
from distdiag.analysis import Analysis
from distdiag.detectors import register
from distdiag.roles import Role
from distdiag.findings import Finding
from distdiag.import_files import LOCAL_FSTYPES
from distdiag.replay import Change
from distdiag.rows import calls_of, events_of, weighted_median
from distdiag.schema import FILE_KINDS, Kind

if TYPE_CHECKING:
    from distdiag.match import Collectives
    from distdiag.run import Run

log = logging.getLogger(__name__)

META_KINDS = np.array([Kind.FILE_OPEN, Kind.FILE_CLOSE, Kind.FILE_STAT, Kind.FILE_LISTDIR], np.uint8)
_FILE_KINDS = np.array(sorted(FILE_KINDS), np.uint8)
_IMPORT_SUFFIXES = (".py", ".pyc", ".so", ".pth")
# node-local file systems (distdiag.import_files.LOCAL_FSTYPES): no metadata server to saturate.
# Their calls slow down with concurrency mostly because the ranks compete for CPUs (an
# oversubscribed node), so only a much slower median counts as a storm there.

ADVICE = (
    "Take the load off the metadata server: stage the files to node-local storage (/tmp, NVMe) once per node; "
    "pack small files into a few large ones (one HDF5/tar/WebDataset shard per rank); read once on one rank and "
    "broadcast; for imports, install the Python environment on local disk or in a container image."
)


def _idle_gaps(rank: np.ndarray, t0: np.ndarray, t1: np.ndarray, colls: Collectives) -> tuple[np.ndarray, ...]:
    """(rank, start, end) of each gap between consecutive file calls of a rank in which it
    neither was inside a collective nor entered or left one: the storm's time the hooks did
    not see (calls made from C: os.walk's per-entry stats, C readers), up to the rank's
    next rendezvous. Compute the rank did there outside any collective counts too (see
    the module docstring)."""
    z = np.zeros(0, np.int64)
    if len(rank) < 2:
        return z, z, z
    ranks, dense = np.unique(rank, return_inverse=True)  # dense keys: no overflow from rank ids
    lo = int(t0.min())
    span = int(max(int(t1.max()), int(t0.max())) - lo) + 2
    if span * (len(ranks) + 1) >= 1 << 62:
        return z, z, z  # a window too long to key: no unseen time added (the recorded calls stay)
    o = np.lexsort((t0, dense))
    r, a, b = dense[o].astype(np.int64), t0[o], t1[o]
    # the furthest end so far within each rank: on (rank, time) keys one running max never
    # carries a value into the next rank
    end = np.maximum.accumulate(r * span + (b - lo)) - r * span + lo
    ok = (r[1:] == r[:-1]) & (a[1:] > end[:-1])
    g_r, g_a, g_b = r[1:][ok], end[:-1][ok], a[1:][ok]
    if len(g_r) and len(colls):
        # the rank's collectives overlapping the window, their ends clipped to it
        pos = np.searchsorted(ranks, colls.m_rank)
        mine = (pos < len(ranks)) & (ranks[np.minimum(pos, len(ranks) - 1)] == colls.m_rank)
        hi = lo + span - 1
        c_t1 = np.where(colls.m_t1_ns < 0, hi, colls.m_t1_ns)  # still inside at its last flush
        mine &= (colls.m_t0_ns <= hi) & (c_t1 >= lo)
        m_r = pos[mine].astype(np.int64) * span
        k0 = np.sort(m_r + (np.clip(colls.m_t0_ns[mine], lo, hi) - lo))
        k1 = np.sort(m_r + (np.clip(c_t1[mine], lo, hi) - lo))
        k_a, k_b = g_r * span + (g_a - lo), g_r * span + (g_b - lo)
        inside = np.searchsorted(k0, k_a, side="right") > np.searchsorted(k1, k_a, side="right")
        moved = (np.searchsorted(k0, k_b, side="left") > np.searchsorted(k0, k_a, side="right")) | (
            np.searchsorted(k1, k_b, side="left") > np.searchsorted(k1, k_a, side="right"))
        keep = ~(inside | moved)
        g_r, g_a, g_b = g_r[keep], g_a[keep], g_b[keep]
    return ranks[g_r].astype(np.int64), g_a, g_b


def _hot_windows(b0: np.ndarray, b1: np.ndarray, n_of: np.ndarray, dur: np.ndarray,
                 hot_of: Callable[[np.ndarray, np.ndarray], np.ndarray], gap_bins: int) -> list[tuple[int, int]]:
    """Runs of hot bins ``[first, last]``, merging runs whose gap is <= ``gap_bins``. Per bin, the
    calls and busy ns: each row's in the bin it starts in (``b0``), but an overflow sum's
    (``n_of`` > 1: calls made one after another for as long as the row lasts) spread evenly
    over the bins ``[b0, b1]`` it spans, so a storm the interposer summed is as hot, bin by
    bin, as the calls it stands for; ``hot_of(calls, busy_ns)`` says which bins are hot.

    The bins are not made one by one: they are cut into segments where some row's bins begin or
    end, and a segment's bins hold the same sums (each row alone in its start bin is a segment of
    one bin; a sum adds the same share to each bin it spans). So the memory follows the rows,
    not the time they span: a run dir is untrusted, and one timestamp flipped 63 days ahead
    made 55 M bins of 0.1 s, 1.4 GB (``benchmarks/fuzz_rundirs.py --flips``, seed 10923). The sums
    are added in the order the bins' were (each bin's rows in row order, the sums after): the
    same numbers."""
    one = n_of <= 1
    multi = np.flatnonzero(~one)  # a few: one per (call, directory, thread) and drain
    m0 = b0[multi]
    m1 = np.maximum(b1[multi], m0)
    cuts = np.unique(np.concatenate([b0[one], b0[one] + 1, b1[one] + 1, m0, m1 + 1, [0]]))
    n_seg = len(cuts) - 1  # segment j: bins cuts[j] .. cuts[j + 1] - 1
    seg_one = np.searchsorted(cuts, b0[one], side="right") - 1
    calls = np.bincount(seg_one, weights=n_of[one].astype(np.float64), minlength=n_seg)
    busy = np.bincount(seg_one, weights=dur[one], minlength=n_seg)
    if len(multi):
        k = (m1 - m0 + 1).astype(np.int64)  # the bins a sum spans
        s_lo = np.searchsorted(cuts, m0, side="right") - 1
        n_s = np.searchsorted(cuts, m1, side="right") - s_lo  # the segments it spans
        rep = np.repeat(np.arange(len(multi)), n_s)
        segs = s_lo[rep] + (np.arange(int(n_s.sum())) - np.repeat(np.cumsum(n_s) - n_s, n_s))
        calls += np.bincount(segs, weights=(n_of[multi] / k)[rep], minlength=n_seg)
        busy += np.bincount(segs, weights=(dur[multi] / k)[rep], minlength=n_seg)
    hot = np.flatnonzero(hot_of(calls, busy))
    if len(hot) == 0:
        return []
    first, last = cuts[hot], cuts[hot + 1] - 1
    breaks = np.flatnonzero(first[1:] - last[:-1] - 1 > max(0, gap_bins))
    return list(zip(np.r_[first[0], first[breaks + 1]].tolist(), np.r_[last[breaks], last[-1]].tolist()))


def concurrency_at_start(t0: np.ndarray, t1: np.ndarray) -> np.ndarray:
    """For each call, how many *other* calls were in flight when it started."""
    s0 = np.sort(t0)
    s1 = np.sort(t1)
    started = np.searchsorted(s0, t0, side="right")  # includes itself and ties
    ended = np.searchsorted(s1, t0, side="right")
    out: np.ndarray = np.maximum(0, started - ended - 1)
    return out


#: calls of the libc interposer (distdiag.shim.preload: ``comm_id`` "libc:<call>") on a
#: descriptor or directory stream: they belong to the access that opened it
_FD_CALLS = ("fstat", "close", "fclose", "closedir", "readdir", "getdents64", "lseek")


def _accesses(meta: np.ndarray, dur: np.ndarray, fd_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Metadata calls as file accesses, for the latency test: a call on a path starts one,
    and the calls on what it opened that follow on the same rank and path join it (libc's
    ``open`` + ``fstat`` + ``close`` of one file is the one Python-level ``open`` row the
    Python hooks make; a Python FILE_CLOSE row joins its open). The median latency is of
    accesses, so it does not depend on which capture recorded the calls. Returns, per call,
    the index of its access, and each access's latency: its summed duration over the calls
    its first row stands for (an overflow sum of N opens in a directory, and the sum of their
    closes after it, are N accesses). ``meta`` is in (rank, t0) order."""
    n = len(meta)
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.float64)
    joins = (meta["kind"] == int(Kind.FILE_CLOSE)) | np.isin(meta["comm_id"], fd_ids)
    same = np.zeros(n, bool)
    same[1:] = (meta["rank"][1:] == meta["rank"][:-1]) & (meta["name_id"][1:] == meta["name_id"][:-1])
    first = ~(joins & same)
    idx = np.cumsum(first) - 1
    return idx, np.bincount(idx, weights=dur.astype(np.float64)) / calls_of(meta[first])


def _import_share(run: Run, name_id: np.ndarray) -> float:
    """The share of these calls' distinct files that are Python modules; from 0.5 the calls are an
    import storm (one process's, too: at scale every rank imports the same files at once)."""
    names = np.asarray(run.strings, dtype=object)[np.unique(name_id)].astype(str)
    return float(pd.Series(names).str.endswith(_IMPORT_SUFFIXES).mean()) if len(names) else 0.0


def _latency_by_concurrency(lat_ns: np.ndarray, w: np.ndarray, conc: np.ndarray, max_level: int = 8) -> dict[str, float]:
    """Median latency per call in ms (``w``: the calls of each row) per concurrency level
    (0 = ran alone), for the evidence."""
    lv = np.minimum(conc, max_level)
    out = {}
    for level in np.unique(lv):  # at most max_level + 1
        on = lv == level
        out[str(int(level)) + ("+" if level == max_level else "")] = weighted_median(lat_ns[on], w[on]) / 1e6
    return out


def _top_paths(run: Run, name_id: np.ndarray, dur_ns: np.ndarray, calls: np.ndarray, top: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The directories and files that took the most blocked time (calls, seconds). An
    overflow sum's name is its directory + ``/*``: that directory's "file"."""
    ids, inv = np.unique(name_id, return_inverse=True)
    per_file_s = np.bincount(inv, weights=dur_ns.astype(np.float64)) / 1e9
    per_file_n = np.bincount(inv, weights=calls).astype(np.int64)
    paths = pd.Series(np.asarray(run.strings, dtype=object)[ids].astype(str))
    dirs = paths.str.rpartition("/")[0].replace("", "/")
    files = pd.DataFrame({"path": paths, "dir": dirs, "calls": per_file_n, "blocked_s": per_file_s})
    by_dir = (
        files.groupby("dir", sort=False)
        .agg(calls=("calls", "sum"), files=("path", "size"), blocked_s=("blocked_s", "sum"))
        .sort_values("blocked_s", ascending=False)
        .head(top)
    )
    top_dirs = [
        {"dir": str(d), "calls": int(r.calls), "files": int(r.files), "blocked_s": float(r.blocked_s)}
        for d, r in by_dir.iterrows()
    ]
    top_files = [
        {"path": str(r.path), "calls": int(r.calls), "blocked_s": float(r.blocked_s)}
        for r in files.sort_values("blocked_s", ascending=False).head(top).itertuples()
    ]
    return top_dirs, top_files


@register("metadata_storm", requires=("collectives",),
          role=Role(tier=0, claims=(Kind.FILE_OPEN, Kind.FILE_CLOSE, Kind.FILE_STAT, Kind.FILE_LISTDIR),
                    removal=0))
def detect(an: Analysis) -> list[Finding]:
    run, cfg = an.run, an.cfg
    sec = "metadata_storm"
    bin_s = float(cfg.value(sec, "bin_s", 0.1))
    min_rate = float(cfg.value(sec, "min_rate_per_s", 20.0))
    min_blocked = float(cfg.value(sec, "min_blocked_ranks", 0.5))
    min_calls = int(cfg.value(sec, "min_calls", 100))
    gap_bins = int(cfg.value(sec, "gap_bins", 2))
    min_ratio = float(cfg.value(sec, "min_latency_ratio", 2.0))
    slow_ms = float(cfg.value(sec, "slow_latency_ms", 1.0))
    local_slow_ms = float(cfg.value(sec, "local_slow_latency_ms", 10.0))
    min_fraction = float(cfg.value(sec, "min_fraction", 0.02))
    top = int(cfg.value(sec, "top", 5))
    wall_s = run.wall_s
    if wall_s <= 0:
        return []

    fev = events_of(run, _FILE_KINDS)  # the run's kind index: no scan of the whole table
    fev = fev[(fev["aux"] > 0) & (fev["t1_ns"] >= fev["t0_ns"])]
    if len(fev) == 0:
        return []
    is_meta = np.isin(fev["kind"], META_KINDS)
    fd_ids = np.array([i for i in (run.sid(f"libc:{c}") for c in _FD_CALLS) if i >= 0], np.int64)
    colls = an.colls  # the ranks' rendezvous: where a storm's unseen stretch ends
    bin_ns = int(bin_s * 1e9)
    n_ranks_all = int(max(run.world_size, int(fev["rank"].max()) + 1))

    findings = []
    for fs_id in np.unique(fev["aux"][is_meta]):  # one per file system: a handful
        fs_all = fev[fev["aux"] == fs_id]
        meta = fs_all[np.isin(fs_all["kind"], META_KINDS)]
        t0 = meta["t0_ns"]
        dur = meta["t1_ns"] - t0
        n_of = calls_of(meta)  # 1, or the calls a sum stands for
        lat = dur / n_of  # per call
        base = int(t0.min())
        b = (t0 - base) // bin_ns
        wins = _hot_windows(b, (meta["t1_ns"] - base) // bin_ns, n_of, dur.astype(np.float64),
                            lambda calls, busy_ns: (calls / bin_s >= min_rate) & (busy_ns / bin_ns >= min_blocked),
                            gap_bins)  # fmt: skip
        if not wins:
            continue
        fs_name = run.s(int(fs_id))
        fstype, _, mount = fs_name.partition(":")
        conc = concurrency_at_start(t0, meta["t1_ns"])
        acc_start, acc_dur = _accesses(meta, dur, fd_ids)
        alone = conc == 0  # the server's own service time, measured on this fs
        lat_alone_ms = weighted_median(lat[alone], n_of[alone]) / 1e6

        w_rows: list[dict[str, Any]] = []
        total_cost_ns = 0.0
        all_ranks: set[int] = set()
        sel_all = np.zeros(len(meta), bool)
        blocked_ivs: list[tuple[np.ndarray, ...]] = []  # per window: the ranks' blocked stretches
        for lo, hi in wins:  # storm windows: few
            in_w = (b >= lo) & (b <= hi)
            n_calls = int(n_of[in_w].sum())
            if n_calls < min_calls:
                continue  # a few slow opens are not a storm
            w0 = int(t0[in_w].min())
            w1 = int(meta["t1_ns"][in_w].max())
            w_w = n_of[in_w]
            c_w = conc[in_w]
            lat_ms = weighted_median(acc_dur[acc_start[in_w]], w_w) / 1e6  # per file access
            crowd = c_w >= 1
            lat_crowd_ms = weighted_median(lat[in_w][crowd], w_w[crowd]) / 1e6 if crowd.any() else lat_ms
            # with no call in company the latency cannot have grown with concurrency (a window of a
            # loaded machine is slower than the run's median, alone as well)
            ratio = lat_crowd_ms / lat_alone_ms if lat_alone_ms > 0 and crowd.any() else 1.0
            if not crowd.any() and _import_share(run, meta["name_id"][in_w]) < 0.5:
                continue  # one process's calls at its own pace, never two at once: io_bound's, no storm
            if fstype in LOCAL_FSTYPES:
                if lat_ms < local_slow_ms:
                    continue  # local disk: CPU contention, not a saturated server
            elif not (ratio >= min_ratio or lat_ms >= slow_ms):
                continue  # busy but fast: the server keeps up
            # every file call on this fs inside the window blocks its rank, and so do the
            # short gaps between a rank's calls: calls made from C (os.walk's per-entry
            # stats, readers in C) that the hooks do not see
            fa = fs_all[(fs_all["t1_ns"] > w0) & (fs_all["t0_ns"] < w1)]
            r = fa["rank"].astype(np.int64)
            a_ns, b_ns = np.maximum(fa["t0_ns"], w0), np.minimum(fa["t1_ns"], w1)
            seen = union_length_by_key(r, a_ns, b_ns, n_ranks_all)
            g_r, g_a, g_b = _idle_gaps(r, a_ns, b_ns, colls)
            ivs = (np.concatenate([r, g_r]), np.concatenate([a_ns, g_a]), np.concatenate([b_ns, g_b]))
            blocked = union_length_by_key(*ivs, n_ranks_all)
            blocked_ivs.append(ivs)
            cost_ns = float(blocked.max())
            ranks = np.flatnonzero(blocked > 0)
            all_ranks.update(int(x) for x in ranks)
            total_cost_ns += cost_ns
            sel_all |= in_w
            w_rows.append(
                {
                    "t0_ns": w0,
                    "t1_ns": w1,
                    "start_s": (w0 - run.start_ns) / 1e9,
                    "dur_s": (w1 - w0) / 1e9,
                    "calls": n_calls,
                    "rate_per_s": n_calls / max((w1 - w0) / 1e9, bin_s),
                    "ranks": ranks.tolist(),
                    "blocked_s_per_rank": {str(int(x)): float(blocked[x] / 1e9) for x in ranks},
                    "unrecorded_s": float((blocked - seen).max() / 1e9) if len(blocked) else 0.0,
                    "cost_s": cost_ns / 1e9,
                    "latency_ms_median": lat_ms,
                    "latency_ms_with_company": lat_crowd_ms,
                    "mean_calls_in_flight": float(c_w.mean()),
                    "failed_calls": int((meta["value"][in_w] != 0).sum()),
                }
            )
        if not w_rows or total_cost_ns < min_fraction * wall_s * 1e9:
            continue
        sel = meta[sel_all]
        w_sel = n_of[sel_all]
        top_dirs, top_files = _top_paths(run, sel["name_id"], sel["t1_ns"] - sel["t0_ns"], w_sel, top)
        import_share = _import_share(run, sel["name_id"])
        kinds = {Kind(int(k)).name.removeprefix("FILE_").lower(): int(w_sel[sel["kind"] == k].sum()) for k in np.unique(sel["kind"])}
        w_rows.sort(key=lambda w: -w["cost_s"])
        w = w_rows[0]
        lat_txt = (
            f"median latency {w['latency_ms_with_company']:.2f} ms with other calls in flight vs {lat_alone_ms:.2f} ms alone"
            if np.isfinite(lat_alone_ms)
            else f"median latency {w['latency_ms_median']:.2f} ms"
        )
        what = "imports" if import_share >= 0.5 else "metadata calls"
        summary = (
            f"metadata storm on {fstype} at {mount}: {int(w_sel.sum())} {what} from {len(all_ranks)} ranks"
            f" at {w['rate_per_s']:.0f}/s in {len(w_rows)} window(s) (largest {w['start_s']:.1f}-{w['start_s'] + w['dur_s']:.1f} s);"
            f" {lat_txt}; the most-blocked rank lost {total_cost_ns / 1e9:.2f} s"
        )
        findings.append(
            Finding(
                kind="metadata_storm",
                cost_s=total_cost_ns / 1e9,
                summary=summary,
                ranks=sorted(all_ranks),
                hosts=run.hosts_of(sorted(all_ranks)),
                paths=[d["dir"] for d in top_dirs],
                advice=ADVICE,
                # the counterfactual: every rank's blocked stretches in the windows (its calls on this
                # file system and the unseen gaps between them) take no time
                change=Change(f"the ranks' blocked time in the storm windows on {mount} removed",
                              drop_rank=np.concatenate([x[0] for x in blocked_ivs]).astype(np.int64),
                              drop_t0=np.concatenate([x[1] for x in blocked_ivs]).astype(np.int64),
                              drop_t1=np.concatenate([x[2] for x in blocked_ivs]).astype(np.int64)),  # fmt: skip
                evidence={
                    "fs": fs_name,
                    "fstype": fstype,
                    "mount": mount,
                    "windows": w_rows[:top],
                    "n_windows": len(w_rows),
                    "calls_by_kind": kinds,
                    "latency_ms_alone": lat_alone_ms,
                    "latency_ms_by_calls_in_flight": _latency_by_concurrency(lat[sel_all], w_sel, conc[sel_all]),
                    "top_dirs": top_dirs,
                    "top_files": top_files,
                    "import_share": import_share,
                },
            )
        )
    return findings
