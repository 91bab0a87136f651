"""Queue wait: time the job spent in Slurm's queue before it started.

Slurm accounting (:mod:`distdiag.slurm`) gives submit, eligible and start
times in whole seconds. The job would have finished ``start - submit`` earlier
had it started when submitted, so that is the cost, split in the evidence into

* ``submit_to_eligible_s``: held (a dependency, ``--begin``, an association
  or QOS limit) before it could be scheduled at all;
* ``eligible_to_start_s``: eligible, waiting for nodes (other jobs held them).

Worked example: submitted 10:00:00, eligible 10:00:00, started 10:00:21, ended
10:00:27: cost 21 s of a 27 s turnaround (78%): the queue, not the program, is
the binding constraint.

The fraction is of the job's turnaround (submit to end), the wall-clock its
user waited; it is not of the ranks' run time, which starts after the queue.
A wait of at most one second is sacct's resolution, not a finding.

Settings (``[analyze.queue_wait]``): ``min_fraction`` (share of turnaround,
default the [analyze] one, 0.02).
"""

from __future__ import annotations

import logging

from distdiag.analysis import Analysis
from distdiag.detectors import register
from distdiag.findings import Finding
from distdiag.slurm import RESOLUTION_S

log = logging.getLogger(__name__)


@register("queue_wait", requires=("slurm",))
def detect(an: Analysis) -> list[Finding]:
    cfg = an.cfg
    view = an.slurm()
    a = view.acct
    turnaround_s = view.turnaround_s
    if a is None or not a.submit_s or not a.start_s or not turnaround_s:
        return []
    min_fraction = float(cfg.value("queue_wait", "min_fraction", 0.02))
    eligible_s = a.eligible_s or a.submit_s
    held_s = float(max(0, eligible_s - a.submit_s))
    waiting_s = float(max(0, a.start_s - eligible_s))
    cost_s = held_s + waiting_s
    if cost_s <= RESOLUTION_S or cost_s / turnaround_s < min_fraction:
        return []
    parts = []
    if waiting_s:
        parts.append(f"{waiting_s:.0f} s waiting for nodes")
    if held_s:
        parts.append(f"{held_s:.0f} s held (dependency, begin time or limits) before it was eligible")
    summary = (
        f"job {a.job_id} queued {cost_s:.0f} s before it started ({', '.join(parts)}): "
        f"{cost_s / turnaround_s:.0%} of its {turnaround_s:.0f} s from submission to end"
    )
    advice = (
        "ask for fewer nodes or a shorter --time so backfill can start it sooner, use a less busy partition, "
        "or check dependencies and limits (squeue -j JOB -o %r while it waits)"
        if waiting_s >= held_s
        else "the job was held before it could be scheduled: check --dependency, --begin, and association/QOS limits"
    )
    return [
        Finding(
            kind="queue_wait",
            cost_s=cost_s,
            summary=summary,
            advice=advice,
            hosts=[],
            evidence={
                "fraction_of": "turnaround",
                "turnaround_s": float(turnaround_s),
                "job_id": a.job_id,
                "state": a.state,
                "submit_to_eligible_s": held_s,
                "eligible_to_start_s": waiting_s,
                "resolution_s": RESOLUTION_S,
                "accounting": view.origin,
            },
        )
    ]
