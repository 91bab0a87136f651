"""compute_bound: the ranks' own work holds the run and runs well under the peak the
hardware delivers: what faster kernels would save (issue 20 item 2).

A balanced job that spends 90% of its time computing is what a well-tuned job looks
like: compute binding is no fault, and without a measure of how fast the compute
could be there is no honest price. So this is a finding only when both are known:

* the work: FLOPs per step (``distdiag.step(flops=...)``: the STEP rows' ``value``);
* the peak: ``[analyze.compute_bound] peak_flops_per_s`` (per rank: one rank's share
  of the hardware, e.g. a core's or a GPU's dense FLOP/s; 0 = unknown, the default).

Otherwise the report's coverage says "compute binds" in a line, with no cost
(:data:`distdiag.ranking.BINDS`), and healthy compute-heavy jobs stay without
findings. GPUs with NVML samples are ``gpu_underutilized``'s.

Counterfactual: each rank's compute in its steps (the breakdown's ``compute_s`` per
step: outside every recorded call, startup excluded) at the peak: ``flops / peak``
instead of the recorded time. The most-held rank's saving is the cost (the ranks meet
at every collective, so the slowest one's compute sets the pace)::

    cost_s = max_r (compute_r - flops_r / peak)

Worked example: 30 steps of 33.5 MFLOP on a core whose dgemm runs 10 GFLOP/s, each
step's compute taking 20 ms: 0.60 s against 0.10 s at the peak: cost 0.50 s.

Reported when compute holds ``min_share`` (0.1) of the rank's wall-clock, the cost
is ``min_fraction`` (the [analyze] one, 2%) of the run, and that rank runs under
``max_of_peak`` (0.5) of the peak: "slow kernels" is a claim about kernels well under
what the hardware delivers. A rank at 70-80% of a measured peak is within what load
alone does to a rate (beside a busy core, one rank of a healthy 2-rank job at the peak
measured 0.7 of it and was priced 0.057 s, 11% of its run) and no kernel change is
advised for it; the coverage line still says that compute binds.
Settings (``[analyze.compute_bound]``): ``peak_flops_per_s`` (0), ``min_share`` (0.1),
``max_of_peak`` (0.5), ``min_fraction``.
"""

from __future__ import annotations


import numpy as np

from distdiag.breakdown import step_marks
from distdiag.analysis import Analysis
from distdiag.detectors import register
from distdiag.findings import Finding
from distdiag.rows import kind_index
from distdiag.schema import Kind

ADVICE = (
    "the compute runs under the hardware's peak: use larger, fused kernels (batch small matrix products, "
    "vectorize Python loops, a better BLAS or mixed precision), and profile the slowest step's kernels"
)


@register("compute_bound", requires=("collectives", "breakdown"))
def detect(an: Analysis) -> list[Finding]:
    run, cfg = an.run, an.cfg
    peak = float(cfg.value("compute_bound", "peak_flops_per_s", 0.0))
    min_share = float(cfg.value("compute_bound", "min_share", 0.1))
    max_of_peak = float(cfg.value("compute_bound", "max_of_peak", 0.5))
    min_fraction = float(cfg.value("compute_bound", "min_fraction", getattr(cfg, "min_fraction", 0.02)))
    wall_s = float(run.wall_s)
    if peak <= 0 or wall_s <= 0:
        return []
    rows = kind_index(run).rows(int(Kind.STEP))
    if len(rows) == 0 or not (run.events["value"][rows] > 0).any():
        return []
    s_rank, _ = step_marks(run)
    if len(s_rank) == 0:
        return []
    steps = an.step_breakdown()
    n = int(max(int(run.world_size), int(s_rank.max()) + 1))
    # the STEP rows that end steps, in step_marks' order: their flops belong to the step they end
    ev = run.events
    m = rows
    from distdiag.breakdown import AUTO_STEP_NAME

    auto = run.sid(AUTO_STEP_NAME)
    if auto >= 0 and (ev["name_id"][m] == auto).any():
        m = m[ev["name_id"][m] == auto]
    flops = np.bincount(ev["rank"][m].astype(np.int64), weights=ev["value"][m].astype(np.float64), minlength=n)
    compute = np.bincount(steps["rank"].to_numpy(np.int64), weights=steps["compute_s"].to_numpy(np.float64),
                          minlength=n)  # fmt: skip
    wall_r = run.rank_bounds()
    span = (wall_r[1] - wall_r[0]).astype(np.float64)[:n] / 1e9
    have = np.flatnonzero((flops > 0) & (compute > 0))
    if len(have) == 0:
        return []
    saving = np.maximum(0.0, compute[have] - flops[have] / peak)
    j = int(np.argmax(saving))
    rank = int(have[j])
    cost_s = float(saving[j])
    share = float(compute[rank] / span[rank]) if span[rank] > 0 else 0.0
    if share < min_share or cost_s < min_fraction * wall_s:
        return []
    achieved = flops[have] / compute[have]
    ratio = float(achieved[j] / peak)
    if ratio >= max_of_peak:
        return []  # near the peak: no kernel to blame (the coverage says compute binds)
    summary = (
        f"compute binds and runs at {ratio:.0%} of the peak: rank {rank} computed {compute[rank]:.3g} s "
        f"({share:.0%} of its run) at {achieved[j] / 1e9:.3g} GFLOP/s against {peak / 1e9:.3g} GFLOP/s; "
        f"at the peak it would take {flops[rank] / peak:.3g} s"
    )
    return [
        Finding(
            kind="compute_bound",
            cost_s=cost_s,
            summary=summary,
            ranks=[rank],
            hosts=run.hosts_of([rank]),
            advice=ADVICE,
            evidence={
                "share_of_wall": round(share, 4),
                "compute_s": round(float(compute[rank]), 4),
                "flops": float(flops[rank]),
                "achieved_flops_per_s": {"min": float(achieved.min()), "median": float(np.median(achieved)),
                                         "max": float(achieved.max())},  # fmt: skip
                "peak_flops_per_s": peak,
                "of_peak": round(ratio, 4),
                "counterfactual": "each rank's compute in its steps at peak_flops_per_s (flops / peak)",
            },
        )
    ]
