"""gpu_underutilized: "utilization lies". NVML says busy, the math says otherwise.

NVML's SM utilization is the share of time *any* kernel ran, not how much of
the GPU it used: a GPU running one small memory-bound kernel after another
reads 100% busy while reaching 5% of its peak FLOP/s. So the detector compares
what the program says it computed (``distdiag.step(flops=...)``) per second
with the device's peak from ``configs/gpus.toml``:

    achieved = sum(flops of steps 2..n) / (t_step_n - t_step_1)   per rank
    mfu      = achieved / peak                                    (model FLOPs utilization)

A rank is flagged when its GPU reads busy (mean SM utilization over the steps
>= ``busy_pct``) and ``mfu`` < ``max_mfu``. Cost: the step time the job would
save running at ``target_mfu`` (a well-tuned job's efficiency, 0.4 by default;
a stated assumption, in the evidence): ``T_steps * (1 - mfu / target_mfu)``,
the median over flagged ranks (they run in lockstep, so not summed).

Where the run was timed on the GPU (CUDA events, :mod:`distdiag.gpu_timeline`),
"busy" is the GPU's own: the share of the rank's step window its kernels ran
(``kernels_s / window_s``), not NVML's utilization (seed 003: "utilization
lies": NVML reads 100% for one tiny kernel after another, and also when
kernels wait on a slow input pipeline between bursts it samples between). A
rank without NVML samples is judged then too (its device name, for the peak,
still comes from NVML's ``gpu_names``; or ``peak_tflops``). The evidence says
which (``busy_source``).

Memory-bound signature: memory-controller utilization high (>= ``mem_bound_pct``)
while FLOP/s are low: the kernels wait on memory, usually because each one
gets too little work: raise the batch size (or fuse kernels).
"""

from __future__ import annotations

import logging

import numpy as np

from distdiag.analysis import Analysis
from distdiag.detectors import register
from distdiag.findings import Finding
from distdiag.gpu_peaks import gpu_names, gpus_file, load_table, peak_for
from distdiag.rows import events_of
from distdiag.schema import Kind

log = logging.getLogger(__name__)


@register("gpu_underutilized", requires=("gpu",))
def detect(an: Analysis) -> list[Finding]:
    run, cfg = an.run, an.cfg
    gpu = run.gpu
    wall_s = run.wall_s
    gb = an.gpu_breakdown()  # the GPU's own busy time, when the run was timed on the GPU
    own_busy = gb["_kernels_s"] if gb is not None else {}
    own_window = gb["_window_s"] if gb is not None else {}
    if (len(gpu) == 0 and not own_busy) or wall_s <= 0:
        return []
    # the run's kind index (distdiag.rows), not a scan; STEP rows stay in run.events on a
    # streamed run (only the compute phases are streamed), so no pass over distdiag.bands
    steps = events_of(run, Kind.STEP)
    steps = steps[steps["value"] > 0]
    if len(steps) == 0:
        return []  # no flops from distdiag.step: achieved throughput unknown
    busy_pct = float(cfg.value("gpu_underutilized", "busy_pct", 80.0))
    max_mfu = float(cfg.value("gpu_underutilized", "max_mfu", 0.25))
    target_mfu = float(cfg.value("gpu_underutilized", "target_mfu", 0.4))
    mem_bound_pct = float(cfg.value("gpu_underutilized", "mem_bound_pct", 50.0))
    precision = str(cfg.value("gpu_underutilized", "precision", "bf16"))
    peak_override = float(cfg.value("gpu_underutilized", "peak_tflops", 0.0))
    min_fraction = float(cfg.value("gpu_underutilized", "min_fraction", cfg.min_fraction))
    path = gpus_file(cfg)
    table = load_table(str(path)) if path is not None and path.is_file() else []

    # per rank: step window and flops (vectorized over steps with bincount)
    steps = steps[np.lexsort((steps["t0_ns"], steps["rank"]))]
    ranks, first = np.unique(steps["rank"], return_index=True)
    last = np.append(first[1:], len(steps)) - 1
    t_first = steps["t0_ns"][first]
    t_last = steps["t0_ns"][last]
    idx = np.searchsorted(ranks, steps["rank"])
    flops = np.bincount(idx, weights=steps["value"], minlength=len(ranks)) - steps["value"][first]
    dur_s = (t_last - t_first) / 1e9
    names = gpu_names(run, np.union1d(np.unique(gpu["rank"]), np.array(sorted(own_busy), np.int64)))

    # per rank: mean SM and memory utilization of its GPU samples inside its step window
    g_idx = np.searchsorted(ranks, gpu["rank"])
    valid = (g_idx < len(ranks)) & (ranks[np.minimum(g_idx, len(ranks) - 1)] == gpu["rank"])
    gi = np.minimum(g_idx, len(ranks) - 1)
    inside = valid & (gpu["t_ns"] >= t_first[gi]) & (gpu["t_ns"] <= t_last[gi]) & ~np.isnan(gpu["sm_util_pct"])
    n_s = np.bincount(gi[inside], minlength=len(ranks))
    sm = np.bincount(gi[inside], weights=gpu["sm_util_pct"][inside], minlength=len(ranks)) / np.maximum(n_s, 1)
    mem_ok = inside & ~np.isnan(gpu["mem_util_pct"])
    mem = np.bincount(gi[mem_ok], weights=gpu["mem_util_pct"][mem_ok], minlength=len(ranks)) / np.maximum(
        np.bincount(gi[mem_ok], minlength=len(ranks)), 1
    )
    n_gpus = np.bincount(gi[inside & (gpu["gpu"] >= 0)], minlength=len(ranks))  # samples, for evidence

    flagged = []
    for k, r in enumerate(ranks):  # per rank: bounded by the number of ranks with GPU samples
        source = "nvml"
        if int(r) in own_busy and own_window.get(int(r), 0) > 0:
            sm[k] = 100.0 * own_busy[int(r)] / own_window[int(r)]  # the GPU's own busy share
            n_s[k] = max(n_s[k], 1)
            source = "cuda_events"
        if n_s[k] == 0 or dur_s[k] <= 0:
            continue
        dev = next(iter(names.get(int(r), {}).values()), "")
        if peak_override > 0:
            entry, peak_tf, mem_gbps = "configured peak_tflops", peak_override, 0.0
        else:
            hit = peak_for(dev, table, precision) if dev else None
            if hit is None:
                continue
            entry, peak_tf, mem_gbps = hit
        achieved_tf = flops[k] / dur_s[k] / 1e12
        mfu = achieved_tf / peak_tf
        if sm[k] < busy_pct or mfu >= max_mfu:
            continue
        cost = dur_s[k] * max(0.0, 1.0 - mfu / target_mfu)
        flagged.append((int(r), dev, entry, peak_tf, achieved_tf, mfu, float(sm[k]), float(mem[k]), cost, int(n_gpus[k]),
                        source))  # fmt: skip
    if not flagged:
        return []
    cost_s = float(np.median([f[8] for f in flagged]))
    if cost_s < min_fraction * wall_s:
        return []
    med_mfu = float(np.median([f[5] for f in flagged]))
    med_sm = float(np.median([f[6] for f in flagged]))
    med_mem = float(np.median([f[7] for f in flagged]))
    memory_bound = med_mem >= mem_bound_pct
    r0 = flagged[0]
    if memory_bound:
        advice = (
            f"Memory-bound signature (memory-controller {med_mem:.0f}% busy, {100 * med_mfu:.1f}% of peak FLOP/s): "
            "each kernel gets too little work; raise the batch size (or micro-batch), fuse kernels (torch.compile)."
        )
    else:
        advice = (
            "NVML 'utilization' only means some kernel was running: use bf16/fp16 tensor cores (autocast), "
            "larger matrix shapes, torch.compile / fused kernels, and profile the top kernels."
        )
    named = [f[0] for f in flagged]
    return [
        Finding(
            kind="gpu_underutilized",
            cost_s=cost_s,
            summary=(
                f"GPUs read {med_sm:.0f}% busy but reach {100 * med_mfu:.1f}% of the {r0[2]}'s peak "
                f"{precision} FLOP/s ({r0[4]:.3g} of {r0[3]:.4g} TFLOP/s)"
                + ("; memory-bound: raise the batch size" if memory_bound else "")
            ),
            ranks=named,
            hosts=run.hosts_of(named),
            evidence={
                "precision": precision,
                "target_mfu_assumed": target_mfu,
                "memory_bound": memory_bound,
                "busy_source": sorted({f[10] for f in flagged}),
                "per_rank": {
                    f[0]: {"device": f[1], "peak_tflops": f[3], "achieved_tflops": round(f[4], 3), "mfu": round(f[5], 4),
                           "sm_util_pct": round(f[6], 1), "mem_util_pct": round(f[7], 1), "samples": f[9],
                           "busy_source": f[10]}
                    for f in flagged
                },  # fmt: skip
            },
            advice=advice,
        )
    ]
