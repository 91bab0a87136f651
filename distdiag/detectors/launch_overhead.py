"""Launch overhead: from the job's start to the slowest rank's first useful work.

Once Slurm starts the job, the nodes are the job's, but nothing useful runs
until every rank has been launched (srun, the MPI/PMI wire-up), started Python,
imported its libraries, initialized (``MPI_Init``, ``init_process_group``) and
met its peers. The first collective, point-to-point call, compute phase or
step of a rank is its first useful work; the slowest rank's decides when the
job as a whole gets going, since the others wait for it at the first
collective. The job would finish that much earlier were the launch instant,
so the cost is ``max over ranks(first useful work) - job start``.

The evidence splits it at the slowest rank: job start -> its shim start
(batch script before srun, srun, process launch, interpreter start) and shim
start -> first useful work (imports, init, rendezvous), plus the spread of the
ranks' shim starts (a slow node or file system shows as one late rank).

Worked example: job start 12:00:00 (sacct, whole seconds); rank 3 of 4
started its shim at +2.4 s, reached its first all-reduce at +9.1 s (it
imported torch from a slow shared file system); the others were ready by
+4 s: cost 9.1 s, rank 3 named.

The fraction is of the job's turnaround (submit to end), like queue_wait's;
an overhead within sacct's one-second resolution is not a finding.

The rank named is the one busy longest on its own before its first recorded
rendezvous (distdiag.slurm.rank_busy_until). MPI_Init runs inside ``import
mpi4py.MPI``; the mpi4py hook records that import as COMM_WORLD's COMM_CREATE
span, so a rank waiting in MPI_Init counts as ready from the moment its
import began, whatever its other threads record meanwhile
(tests/test_mpi_init_span.py: rank 1 opens files for 2 s before its import,
rank 0's loader thread opens files all through its MPI_Init; rank 1 is
named). A program that initializes MPI itself (``mpi4py.rc.initialize =
False``) or a hook installed after the import leaves an instant there, and
the name is a best guess again; the cost is right either way.

Settings (``[analyze.launch_overhead]``): ``min_fraction`` (share of
turnaround, default the [analyze] one, 0.02).
"""

from __future__ import annotations

import logging

from distdiag.analysis import Analysis
from distdiag.detectors import register
from distdiag.findings import Finding
from distdiag.slurm import RESOLUTION_S

log = logging.getLogger(__name__)


@register("launch_overhead", requires=("slurm",))
def detect(an: Analysis) -> list[Finding]:
    run, cfg = an.run, an.cfg
    view = an.slurm()
    a = view.acct
    turnaround_s = view.turnaround_s
    first = view.rank_first_work_s
    if a is None or not a.start_s or not turnaround_s or not view.rank_last_event_s:
        return []
    min_fraction = float(cfg.value("launch_overhead", "min_fraction", 0.02))
    # A rank whose record holds no useful work never got going (stuck in init
    # or rendezvous until it was killed): its whole record is launch.
    stuck = sorted(r for r in view.rank_last_event_s if r not in first)
    ready = dict(first)
    ready.update({r: view.rank_last_event_s[r] for r in stuck})
    latest = max(ready, key=lambda r: ready[r])
    ready_s = ready[latest]
    cost_s = max(0.0, ready_s - a.start_s)
    if cost_s <= RESOLUTION_S or cost_s / turnaround_s < min_fraction:
        return []
    starts = view.rank_start_s
    # Whom did the others wait for? The rendezvous (MPI_Init, init_process_group)
    # makes every rank reach its first work together, so name the rank busy the
    # longest on its own before it (distdiag.slurm.rank_busy_until), unless some
    # rank never got going at all.
    busy = view.rank_busy_until_s
    if stuck or not busy:
        slowest = latest
    else:
        # Ties (ranks with nothing recorded before the rendezvous): the later first work.
        slowest = max(busy, key=lambda r: (round(busy[r], 2), ready.get(r, 0.0)))
    shim_start_s = starts.get(slowest, ready_s)
    launch_s = max(0.0, shim_start_s - a.start_s)
    init_s = max(0.0, ready_s - shim_start_s)
    own_s = max(0.0, busy[slowest] - shim_start_s) if slowest in busy else init_s
    spread_s = (max(starts.values()) - min(starts.values())) if starts else 0.0
    last_started = max(starts, key=lambda r: starts[r]) if starts else slowest
    # Time before the first job step (srun) began: the batch script's own setup.
    step_starts = [s["start_s"] for s in a.steps if s.get("start_s")]
    before_step_s = max(0.0, min(step_starts) - a.start_s) if step_starts else None
    host = run.host_of(slowest)
    hosts = run.hosts_of(sorted({int(slowest), *stuck}))
    if stuck:
        summary = (
            f"rank(s) {_short(stuck)} never reached useful work (no collective, phase or step in their record): "
            f"{cost_s:.1f} s from job start to the end of rank {slowest}'s record went to launch, imports, "
            f"init or rendezvous; {cost_s / turnaround_s:.0%} of the job's {turnaround_s:.0f} s turnaround"
        )
    else:
        summary = (
            f"{cost_s:.1f} s from job start to the ranks' first useful work, waiting for rank {slowest}"
            + (f" on {host}" if host else "")
            + f" ({launch_s:.1f} s until its process ran, then {own_s:.1f} s busy with imports and setup "
            f"before its rendezvous): {cost_s / turnaround_s:.0%} of the job's {turnaround_s:.0f} s turnaround"
        )
    advice = (
        "imports and init dominate: keep the Python environment on node-local storage or in a container image, "
        "and import only what the job needs"
        if own_s >= launch_s
        else "launch dominates: check what the batch script does before srun, and srun/PMI wire-up at this scale"
    )
    per_rank = {
        int(r): {
            "shim_start_s": round(starts[r] - a.start_s, 3) if r in starts else None,
            "first_work_s": round(first[r] - a.start_s, 3) if r in first else None,
            "busy_until_s": round(busy[r] - a.start_s, 3) if r in busy else None,
        }
        for r in sorted(set(starts) | set(first))
    }
    return [
        Finding(
            kind="launch_overhead",
            cost_s=cost_s,
            summary=summary,
            advice=advice,
            ranks=sorted({int(slowest), *stuck}),
            hosts=hosts,
            evidence={
                "fraction_of": "turnaround",
                "turnaround_s": float(turnaround_s),
                "job_id": a.job_id,
                "job_start_to_shim_start_s": launch_s,
                "shim_start_to_first_work_s": init_s,
                "shim_start_to_rendezvous_s": own_s,
                "shim_start_spread_s": spread_s,
                "last_rank_started": int(last_started),
                "ranks_without_useful_work": stuck,
                "job_start_to_first_step_s": before_step_s,
                "resolution_s": RESOLUTION_S,
                "accounting": view.origin,
                "per_rank": per_rank,
            },
        )
    ]


def _short(xs: list[int]) -> str:
    return ", ".join(str(x) for x in xs[:8]) + (f" (+{len(xs) - 8} more)" if len(xs) > 8 else "")
