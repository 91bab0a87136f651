"""input_bound: the compute sits idle waiting for the data loader.

What removing the input wait would save is not the sum of the waits: a wait hidden
behind compute costs nothing, and in a synchronous job one iteration lasts as long
as its slowest rank. The cost is the input wait's on the critical path, iteration by
iteration (:mod:`distdiag.critical_path`, which prices ``h2d_copy``'s copies in the
same pass).
"""

from __future__ import annotations

import logging

import numpy as np

from distdiag.analysis import Analysis
from distdiag.detectors import register
from distdiag.roles import Role
from distdiag.findings import Finding
from distdiag.schema import Kind

log = logging.getLogger(__name__)


@register("input_bound", requires=("costs",),
          role=Role(tier=0, claims=(Kind.INPUT_WAIT,), replay_claims="unhidden", removal=0))
def detect(an: Analysis) -> list[Finding]:
    run, cfg = an.run, an.cfg
    p = an.priced(Kind.INPUT_WAIT, float(cfg.value("input_bound", "min_fraction", 0.02)))
    if p is None:
        return []
    cost_s, n_it, named = p.cost_s, p.n_it, p.named
    per_step_ms = float(np.median(p.per_iter_ns[p.per_iter_ns > 0])) / 1e6 if np.any(p.per_iter_ns > 0) else 0.0
    compute_step_ms = 1e3 * float(np.median(p.busy_s)) / n_it
    return [
        Finding(
            kind="input_bound",
            cost_s=cost_s,
            summary=(
                f"the data loader keeps the compute waiting: {cost_s:.3g} s of input wait not hidden by compute "
                f"({per_step_ms:.3g} ms per step against {compute_step_ms:.3g} ms of work per step) over {n_it} steps"
            ),
            ranks=named,
            hosts=run.hosts_of(named) if hasattr(run, "hosts_of") else [],
            evidence={
                "steps": n_it,
                "median_unhidden_wait_per_step_ms": round(per_step_ms, 3),
                "median_work_per_step_ms": round(compute_step_ms, 3),
                "input_wait_s_per_rank": p.per_rank_s,
                "loader_calls": p.count,
            },
            advice=(
                "Feed the model faster: more DataLoader workers (num_workers), prefetch_factor, pin_memory, "
                "persistent_workers; cache or pre-decode the data, or move augmentation to the GPU."
            ),
        )
    ]
