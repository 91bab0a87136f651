"""The GPU's own timeline: collectives' GPU times, and the per-rank, per-step GPU breakdown.

Input: ``Kind.GPU_SPAN`` rows (``distdiag.shim.hooks.cuda_events``): the GPU-side
span of a collective or a phase, measured by a CUDA event pair on its stream and
placed on the rank's host clock, so after ``distdiag.clocks.align`` on the run's.

**Collectives** (:func:`substitute_collective_times`, called by ``distdiag.run``
as each rank's rows are read, the one place): a blocking collective with a GPU
span gets the span's start as its arrival (``t0_ns``) and its end as its exit
(``t1_ns``). So the match, the straggler, serial-section and network findings
of a GPU job speak of the GPU timeline: a rank whose GPU is slow reaches the
NCCL kernel late although its CPU enqueued it on time. The CPU enqueue time
stays in the span row (``nbytes``, the join key) and in the rank file.
``DISTDIAG_COLLECTIVE_TIMES=cpu`` in the analyzer's environment keeps the CPU
times (the CPU's view of the same run).

**Breakdown** (:func:`gpu_breakdown`): per rank and per step (the windows
between the rank's step marks, ``distdiag.breakdown.step_marks``), the GPU's time
split into, by priority where spans overlap:

    kernels_s   inside a FORWARD, BACKWARD or OPTIMIZER span
    h2d_s       inside a host-to-device copy's span (and no compute span)
    nccl_s      inside a collective's span (and none of the above)
    idle_input_s  none of these, while the rank's CPU waited on its data loader (INPUT_WAIT)
    idle_other_s  none of these otherwise

A phase's span runs from the GPU reaching the phase's first queued work to the
end of its last, so a gap inside a phase (kernels launched too slowly to keep
the GPU fed) counts as the phase's: ``kernels_s`` is an upper bound of kernel
time, exact for a GPU that the CPU keeps ahead of. A Kineto trace (CUPTI) is
the per-kernel truth; ``benchmarks/gpu_check.py`` compares the two on a real
GPU (not yet run: no GPU where this was written; the code is tested against
``tests/fake_cuda``).

Throughput against the device's peak: the step marks' flops
(``distdiag.step(flops=...)``) over the window, and over the kernels' busy time,
against ``configs/gpus.toml`` (the NVML device name in ``gpu_names``).

Vectorized: a sweep over the span boundaries of a block of ranks at a time
(sorted once on a shifted axis, rank * span; ~2^20 boundaries a block, so the
transient stays ~80 MB whatever the run's size), no loop per event.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import numpy as np

from distdiag.schema import Kind

if TYPE_CHECKING:
    from distdiag.config import Config
    from distdiag.run import Run

#: categories, in priority order (a moment belongs to the first whose span covers it)
CATEGORIES = ("kernels_s", "h2d_s", "nccl_s", "idle_input_s", "idle_other_s")
_COMPUTE = (int(Kind.FORWARD), int(Kind.BACKWARD), int(Kind.OPTIMIZER))
_COMM = (int(Kind.COLL), int(Kind.COLL_ASYNC))
#: per-step rows in the JSON report at most (the first ones; the text says when cut)
MAX_STEPS_JSON = 1000


def collective_times_mode() -> str:
    """``gpu`` (default) or ``cpu``: which times the analysis gives GPU-timed collectives."""
    v = os.environ.get("DISTDIAG_COLLECTIVE_TIMES", "gpu").strip().lower()
    return "cpu" if v == "cpu" else "gpu"


def substitute_collective_times(ev: np.ndarray) -> int:
    """In place, on ONE rank's rows as read from its file: join each GPU_SPAN row to the row
    it times (its ``aux`` is that row's kind, its ``nbytes`` that row's t0, its ``seq`` that
    row's seq). Then the span's ``nbytes`` becomes the timed row's bytes (0 when it joins
    nothing: the key is a time of the rank's own clock, meaningless once the clocks are
    aligned), and a collective with a span takes the span's t0/t1 (not when
    ``collective_times_mode()`` is ``cpu``). Returns how many collectives did."""
    if len(ev) == 0:
        return 0
    kind = ev["kind"]
    span = np.flatnonzero(kind == Kind.GPU_SPAN)
    if len(span) == 0:
        return 0
    tgt = np.flatnonzero(kind != Kind.GPU_SPAN)
    key = ev["nbytes"][span]
    nb = np.zeros(len(span), np.int64)
    n_done = 0
    if len(tgt):
        ct0 = ev["t0_ns"][tgt]
        if len(ct0) > 1 and not bool(np.all(ct0[1:] >= ct0[:-1])):  # rows come sorted, mostly
            o = np.argsort(ct0, kind="stable")
            tgt, ct0 = tgt[o], ct0[o]
        pos = np.minimum(np.searchsorted(ct0, key), len(ct0) - 1)
        hit = tgt[pos]
        ok = (ct0[pos] == key) & (ev["kind"][hit] == ev["aux"][span]) & (ev["seq"][hit] == ev["seq"][span])
        nb[ok] = ev["nbytes"][hit[ok]]
        coll = ok & np.isin(ev["aux"][span], _COMM) & (ev["seq"][span] >= 0) & (ev["t1_ns"][span] >= ev["t0_ns"][span])
        if coll.any() and collective_times_mode() == "gpu":
            dst, src = hit[coll], span[coll]
            t0 = ev["t0_ns"]
            t1 = ev["t1_ns"]
            t0[dst] = t0[src]
            t1[dst] = t1[src]
            n_done = int(len(dst))
    ev["nbytes"][span] = nb
    return n_done


def _spans(run: Run) -> np.ndarray:
    """The run's GPU_SPAN rows (a copy of their columns: a few per step and rank)."""
    from distdiag.rows import events_of

    spans: np.ndarray = events_of(run, Kind.GPU_SPAN)
    return spans


def gpu_breakdown(run: Run, cfg: Config | None = None) -> dict[str, Any] | None:
    """Per rank and per step GPU time by category (see the module docstring), or None
    when the run has no GPU spans of phases. ``cfg``: the analysis's :class:`~distdiag.config.Config`
    (the peaks table and precision of ``[analyze.gpu_underutilized]``; None: the defaults).
    Cached on ``run.cache.gpu_breakdown`` per those two settings."""
    from distdiag.config import Config
    from distdiag.gpu_peaks import gpus_file

    cfg = cfg if cfg is not None else Config()
    key = (str(gpus_file(cfg)), str(cfg.value("gpu_underutilized", "precision", "bf16")))
    got = run.cache.gpu_breakdown
    if got is not None and got[0] == key:
        return got[1]
    out = _gpu_breakdown(run, cfg)
    run.cache.gpu_breakdown = (key, out)
    return out


#: span boundaries per block of ranks in the sweep (its transient: ~80 bytes a boundary)
BLOCK_BOUNDARIES = 1 << 20


def _gpu_breakdown(run: Run, cfg: Config) -> dict[str, Any] | None:
    from distdiag.breakdown import step_marks
    from distdiag.rows import events_of

    sp = _spans(run)
    if len(sp) == 0:
        return None
    sk = sp["aux"].astype(np.int64)
    cat = np.full(len(sp), -1, np.int64)
    cat[np.isin(sk, _COMPUTE)] = 0
    cat[sk == int(Kind.H2D)] = 1
    cat[np.isin(sk, _COMM)] = 2
    keep = cat >= 0
    n_coll = int(np.count_nonzero(cat == 2))
    sp, cat = sp[keep], cat[keep]
    if not np.any(cat != 2):  # collectives alone: no phases timed, no breakdown to make
        return None
    o = np.argsort(sp["rank"], kind="stable")  # by rank (the table's order already: a check)
    sp, cat = sp[o], cat[o]
    ranks_all = np.unique(sp["rank"]).astype(np.int64)
    n_r = len(ranks_all)
    mrank, mt = step_marks(run)  # sorted by (rank, t)
    sel = np.isin(mrank, ranks_all)
    mrank, mt = mrank[sel], mt[sel]
    inp = events_of(run, Kind.INPUT_WAIT)
    inp = inp[np.isin(inp["rank"], ranks_all)]
    inp = inp[np.argsort(inp["rank"], kind="stable")]
    n_marks = np.bincount(np.searchsorted(ranks_all, mrank), minlength=n_r) if len(mrank) else np.zeros(n_r, np.int64)
    n_steps = max(1, int(n_marks.max()) - 1) if len(mrank) else 1
    rank_tot = np.zeros((n_r, 5))
    step_tot = np.zeros((n_steps, 5))
    window_ns = np.zeros(n_r, np.int64)
    # blocks of ranks whose boundaries fit BLOCK_BOUNDARIES (and whose (rank, step) cells a
    # bound too): a few numpy calls a block, whatever the run's size
    sp_at = np.searchsorted(sp["rank"], ranks_all)
    in_at = np.searchsorted(inp["rank"], ranks_all)
    mk_at = np.searchsorted(mrank, ranks_all)
    per_rank = np.diff(np.append(sp_at, len(sp))) * 2 + np.diff(np.append(in_at, len(inp))) * 2 + n_marks
    cells = max(1, (1 << 22) // (n_steps * 5))
    lo = 0
    while lo < n_r:  # one iteration per block of ranks
        hi = lo + 1
        acc = int(per_rank[lo])
        while hi < n_r and hi - lo < cells and acc + int(per_rank[hi]) <= BLOCK_BOUNDARIES:
            acc += int(per_rank[hi])
            hi += 1
        s_end = int(sp_at[hi]) if hi < n_r else len(sp)
        i_end = int(in_at[hi]) if hi < n_r else len(inp)
        m_end = int(mk_at[hi]) if hi < n_r else len(mrank)
        rt, st, wn = _sweep(sp[int(sp_at[lo]) : s_end], cat[int(sp_at[lo]) : s_end], inp[int(in_at[lo]) : i_end],
                            mrank[int(mk_at[lo]) : m_end], mt[int(mk_at[lo]) : m_end], ranks_all[lo:hi], n_steps)  # fmt: skip
        rank_tot[lo:hi] = rt
        step_tot += st
        window_ns[lo:hi] = wn
        lo = hi
    rank_tot /= 1e9
    step_tot /= 1e9
    window_s = window_ns / 1e9
    peak = _peaks(run, ranks_all, cfg)
    flops = _flops(run, ranks_all, mrank, mt, n_marks)
    out_ranks = []
    for i, r in enumerate(ranks_all.tolist()):  # one per rank with GPU spans
        d: dict[str, Any] = {"rank": int(r), "window_s": round(float(window_s[i]), 6),
                             "steps": int(max(0, n_marks[i] - 1))}  # fmt: skip
        tot_r = float(rank_tot[i].sum())
        for k, c in enumerate(CATEGORIES):
            d[c] = round(float(rank_tot[i, k]), 6)
            d[c.replace("_s", "_share")] = round(float(rank_tot[i, k]) / tot_r, 4) if tot_r > 0 else 0.0
        if flops[i] > 0 and window_s[i] > 0:
            d["achieved_tflops"] = float(f"{flops[i] / window_s[i] / 1e12:.4g}")
            busy = float(rank_tot[i, 0])
            if busy > 0:
                d["achieved_tflops_while_busy"] = float(f"{flops[i] / busy / 1e12:.4g}")
            pk = peak.get(int(r))
            if pk is not None:
                d["device"], d["peak_tflops"] = pk
                d["mfu"] = float(f"{flops[i] / window_s[i] / 1e12 / pk[1]:.4g}")
        out_ranks.append(d)
    n_real_steps = int(max(0, n_marks.max() - 1)) if len(mrank) else 0
    per_step = []
    for s in range(min(n_real_steps, MAX_STEPS_JSON)):  # bounded
        tot_s = float(step_tot[s].sum())
        row: dict[str, Any] = {"step": s}
        for k, c in enumerate(CATEGORIES):
            row[c] = round(float(step_tot[s, k]), 6)  # summed over ranks
        row["share"] = {c.replace("_s", ""): (round(float(step_tot[s, k]) / tot_s, 4) if tot_s > 0 else 0.0)
                        for k, c in enumerate(CATEGORIES)}  # fmt: skip
        per_step.append(row)
    all_tot = rank_tot.sum(axis=0)
    grand = float(all_tot.sum())
    return {
        "source": "cuda_events",
        "collective_times": collective_times_mode(),
        "collectives_gpu_timed": n_coll,
        "share": {c.replace("_s", ""): (round(float(all_tot[k]) / grand, 4) if grand > 0 else 0.0)
                  for k, c in enumerate(CATEGORIES)},  # fmt: skip
        "per_rank": out_ranks,
        "per_step": per_step,
        "steps_cut": max(0, n_real_steps - MAX_STEPS_JSON),
        "_kernels_s": {int(r): float(rank_tot[i, 0]) for i, r in enumerate(ranks_all.tolist())},
        "_window_s": {int(r): float(window_s[i]) for i, r in enumerate(ranks_all.tolist())},
    }


def _sweep(sp: np.ndarray, cat: np.ndarray, inp: np.ndarray, mrank: np.ndarray, mt: np.ndarray, ranks: np.ndarray,
           n_steps: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
    """One block of ranks: per rank the ns of each category in its window, per step (summed
    over the block's ranks) the same, and each rank's window (ns). All rows are the block's.

    One sweep: every span's start (+1) and end (-1) in its category, the CPU's input waits as
    a fourth count, the step marks as boundaries of no count, sorted on a shifted axis (rank
    position * the block's time range + t) so that ranks never meet; a cumulative sum gives
    the spans active in each segment, and the segment goes to the first category active."""
    n_r = len(ranks)
    z = np.zeros(0, np.int64)
    t_lo = int(min(sp["t0_ns"].min(), mt.min() if len(mt) else sp["t0_ns"].min(),
                   inp["t0_ns"].min() if len(inp) else sp["t0_ns"].min()))  # fmt: skip
    t_hi = int(max(sp["t1_ns"].max(), mt.max() if len(mt) else sp["t1_ns"].max(),
                   inp["t1_ns"].max() if len(inp) else sp["t1_ns"].max()))  # fmt: skip
    span_len = t_hi - t_lo + 1

    def axis(rank: np.ndarray, t: np.ndarray) -> np.ndarray:
        return np.searchsorted(ranks, rank).astype(np.int64) * span_len + (t.astype(np.int64) - t_lo)

    a0 = axis(sp["rank"], sp["t0_ns"])
    a1 = axis(sp["rank"], np.maximum(sp["t1_ns"], sp["t0_ns"]))
    ia0 = axis(inp["rank"], inp["t0_ns"]) if len(inp) else z
    ia1 = axis(inp["rank"], np.maximum(inp["t1_ns"], inp["t0_ns"])) if len(inp) else z
    am = axis(mrank, mt) if len(mt) else z
    pos = np.concatenate([a0, a1, ia0, ia1, am])
    which = np.concatenate([cat, cat, np.full(len(ia0), 3), np.full(len(ia1), 3), np.full(len(am), -1)])
    delta = np.concatenate([np.ones(len(a0), np.int64), -np.ones(len(a1), np.int64), np.ones(len(ia0), np.int64),
                            -np.ones(len(ia1), np.int64), np.zeros(len(am), np.int64)])  # fmt: skip
    o = np.argsort(pos, kind="stable")
    pos, which, delta = pos[o], which[o], delta[o]
    del o
    counts = np.zeros((len(pos), 4), np.int32)
    w = which >= 0
    counts[np.flatnonzero(w), which[w]] = delta[w]
    np.cumsum(counts, axis=0, out=counts)  # spans of each category active after each boundary
    active = counts[:-1] > 0
    del counts
    seg_cat = np.where(active[:, 0], 0, np.where(active[:, 1], 1, np.where(active[:, 2], 2,
                                                                           np.where(active[:, 3], 3, 4))))  # fmt: skip
    del active
    s0 = pos[:-1]
    seg_len = np.diff(pos)
    seg_rank = s0 // span_len
    # per rank: window [first mark, last mark] when it has >= 2 marks, else [first, last span]
    w_lo = np.full(n_r, np.iinfo(np.int64).max, np.int64)
    w_hi = np.full(n_r, np.iinfo(np.int64).min, np.int64)
    ri = np.searchsorted(ranks, sp["rank"])
    np.minimum.at(w_lo, ri, a0)
    np.maximum.at(w_hi, ri, a1)
    n_marks = np.zeros(n_r, np.int64)
    if len(am):
        rm = np.searchsorted(ranks, mrank)
        n_marks = np.bincount(rm, minlength=n_r)
        first = np.searchsorted(rm, np.arange(n_r))  # marks come sorted by (rank, t)
        last = np.searchsorted(rm, np.arange(n_r), side="right") - 1
        use = n_marks >= 2
        w_lo[use], w_hi[use] = am[first[use]], am[last[use]]
    inside = (seg_len > 0) & (s0 >= w_lo[seg_rank]) & (pos[1:] <= w_hi[seg_rank])
    if len(am):
        before = np.searchsorted(am, s0, side="right")  # am ascends: ranks are apart on the axis
        first_of = np.searchsorted(am, seg_rank * span_len, side="left")
        step = np.where(n_marks[seg_rank] >= 2, before - first_of - 1, 0)
    else:
        step = np.zeros(len(s0), np.int64)
    inside &= (step >= 0) & (step < n_steps)
    lens = seg_len[inside].astype(np.float64)
    rc = seg_rank[inside] * 5 + seg_cat[inside]
    rank_tot = np.bincount(rc, weights=lens, minlength=n_r * 5).reshape(n_r, 5)
    sc = step[inside] * 5 + seg_cat[inside]
    step_tot = np.bincount(sc, weights=lens, minlength=n_steps * 5).reshape(n_steps, 5)
    return rank_tot, step_tot, np.maximum(w_hi - w_lo, 0)


def _n_gpu_timed_collectives(sp: np.ndarray) -> int:
    return int(np.count_nonzero(np.isin(sp["aux"], _COMM)))


def _flops(run: Run, ranks: np.ndarray, mrank: np.ndarray, mt: np.ndarray, n_marks: np.ndarray) -> np.ndarray:
    """Per rank: the flops of the STEP rows (``distdiag.step(flops=...)``) after its first step
    mark and up to its last (its window), as the program gave them."""
    from distdiag.rows import events_of

    st = events_of(run, Kind.STEP)
    out = np.zeros(len(ranks), np.float64)
    if len(st) == 0 or len(mrank) == 0:
        return out
    st = st[np.isin(st["rank"], ranks) & (st["value"] > 0)]
    if len(st) == 0:
        return out
    ri = np.searchsorted(ranks, st["rank"])
    rm = np.searchsorted(ranks, mrank)
    first = np.searchsorted(rm, np.arange(len(ranks)))
    last = np.searchsorted(rm, np.arange(len(ranks)), side="right") - 1
    has = n_marks >= 2
    lo = np.where(has, mt[np.minimum(first, len(mt) - 1)], 0)
    hi = np.where(has, mt[np.maximum(last, 0)], -1)
    t = st["t0_ns"].astype(np.int64)
    ok = (t > lo[ri]) & (t <= hi[ri])
    return np.bincount(ri[ok], weights=st["value"][ok], minlength=len(ranks)).astype(np.float64)


def _peaks(run: Run, ranks: np.ndarray, cfg: Config) -> dict[int, tuple[str, float]]:
    """rank -> (table entry, peak TFLOP/s at the configured precision) from the rank file's
    ``gpu_names`` and the peaks table (``configs/gpus.toml``, or ``[analyze.gpu_underutilized]
    gpus_file``); ranks without a known device are left out."""
    try:
        from distdiag.gpu_peaks import gpu_names, gpus_file, load_table, peak_for

        path = gpus_file(cfg)
        table = load_table(str(path)) if path is not None and path.is_file() else []
        precision = str(cfg.value("gpu_underutilized", "precision", "bf16"))
        names = gpu_names(run, ranks)
    except Exception:
        return {}
    out = {}
    for r, nm in names.items():  # per rank with a name
        dev = next(iter(nm.values()), "")
        hit = peak_for(dev, table, precision) if dev else None
        if hit is not None:
            out[int(r)] = (hit[0], hit[1])
    return out


def gpu_json(run: Run, cfg: Config | None = None) -> dict[str, Any] | None:
    """``breakdown.gpu`` of the JSON report (DESIGN.md), or None without GPU spans."""
    b = gpu_breakdown(run, cfg)
    if b is None:
        return None
    return {k: v for k, v in b.items() if not k.startswith("_")}


def gpu_text(run: Run, cfg: Config | None = None) -> list[str]:
    """The text report's lines for the GPU breakdown (none without GPU spans)."""
    b = gpu_breakdown(run, cfg)
    if b is None:
        return []
    sh = b["share"]
    lines = [
        "GPU timeline (CUDA events; collectives on the "
        + ("GPU's" if b["collective_times"] == "gpu" else "CPU's") + " timeline):",
        f"  GPU compute (kernels) {100 * sh['kernels']:.0f}%   Idle, waiting on input {100 * sh['idle_input']:.0f}%   "
        f"Host<->Device copies {100 * sh['h2d']:.0f}%   NCCL {100 * sh['nccl']:.0f}%   Other idle {100 * sh['idle_other']:.0f}%",
    ]
    mfu = [d for d in b["per_rank"] if "mfu" in d]
    if mfu:
        m = float(np.median([d["mfu"] for d in mfu]))
        lines.append(f"  throughput: {100 * m:.1f}% of the {mfu[0]['device']}'s peak (median over {len(mfu)} ranks)")
    return lines
