"""h2d_copy: host-to-device copies that hold up the iteration.

Priced like the input wait (see :mod:`distdiag.critical_path`): per
iteration, on the critical path across ranks, only the copy time that no
compute phase of the rank overlaps. A ``non_blocking`` copy from pinned memory
records only its enqueue, so a copy that really overlaps costs (correctly)
little. The achieved rate (bytes / copy time) tells pageable from pinned memory:
PCIe 4.0 x16 moves ~25 GB/s from pinned buffers, far less from pageable ones.

On a run timed on the GPU (CUDA events, :mod:`distdiag.gpu_timeline`) each copy
also has its GPU-side span: the evidence then gives the copies' time on the GPU
and the rate over it (``gpu_copy_s``, ``gpu_achieved_gb_per_s``: the bus's real
rate, where a ``non_blocking`` copy's CPU row holds only its enqueue), and the
pageable-memory advice follows that rate. The price stays the CPU rows' (what
held the iteration up on its critical path).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from distdiag.analysis import Analysis
from distdiag.detectors import register
from distdiag.roles import Role
from distdiag.findings import Finding
from distdiag.rows import rows_of
from distdiag.schema import Kind

if TYPE_CHECKING:
    from distdiag.run import Run

#: Below this achieved rate (GB/s) the copies probably come from pageable memory.
PAGEABLE_GBPS = 8.0
#: copy rows per block while they are totalled
_BLOCK = 1 << 20


def _copy_totals(run: Run) -> tuple[int, int, int]:
    """(copies, ns copying, bytes) over the H2D rows: the columns of a block of rows at a
    time (integer sums, exact in any grouping), not a copy of the 73-byte rows: a DDP job
    copies every step, so these rows can be an eighth of the table."""
    rows = rows_of(run, Kind.H2D)
    ev = run.events
    dur_ns = nbytes = 0
    for lo in range(0, len(rows), _BLOCK):  # blocks of rows
        r = rows[lo : lo + _BLOCK]
        dur_ns += int(np.maximum(ev["t1_ns"][r] - ev["t0_ns"][r], 0).sum())
        nbytes += int(ev["nbytes"][r].sum())
    return len(rows), dur_ns, nbytes


def _gpu_copy_totals(run: Run) -> tuple[int, int, int]:
    """(copies with a GPU span, ns on the GPU, their bytes): the GPU_SPAN rows of H2D copies,
    whose ``nbytes`` the load set to their copy's bytes (:func:`distdiag.gpu_timeline.substitute_collective_times`);
    (0, 0, 0) on a run not timed on the GPU."""
    sp = rows_of(run, Kind.GPU_SPAN)
    if len(sp) == 0:
        return 0, 0, 0
    ev = run.events
    sp = sp[(ev["aux"][sp] == int(Kind.H2D)) & (ev["nbytes"][sp] > 0)]
    if len(sp) == 0:
        return 0, 0, 0
    dur = np.maximum(ev["t1_ns"][sp] - ev["t0_ns"][sp], 0)
    return int(len(sp)), int(dur.sum()), int(ev["nbytes"][sp].sum())


@register("h2d_copy", requires=("costs",),
          role=Role(tier=0, claims=(Kind.H2D,), replay_claims="unhidden", removal=0))
def detect(an: Analysis) -> list[Finding]:
    run, cfg = an.run, an.cfg
    p = an.priced(Kind.H2D, float(cfg.value("h2d_copy", "min_fraction", 0.02)))
    if p is None:
        return []
    cost_s, n_it, named = p.cost_s, p.n_it, p.named
    n, dur_ns, nbytes = _copy_totals(run)
    dur_s = float(dur_ns) / 1e9
    gbps = nbytes / dur_s / 1e9 if dur_s > 0 else 0.0
    g_n, g_ns, g_bytes = _gpu_copy_totals(run)
    g_gbps = g_bytes / (g_ns / 1e9) / 1e9 if g_ns > 0 else 0.0
    rate = g_gbps if g_n else gbps  # the bus's own rate where the GPU timed the copies
    advice = "Overlap the copies with compute: DataLoader(pin_memory=True) and tensor.to(device, non_blocking=True), prefetch the next batch on a side stream, or copy fewer, larger tensors."
    if rate < PAGEABLE_GBPS:
        advice = f"At {rate:.3g} GB/s the copies likely come from pageable memory: " + advice
    return [
        Finding(
            kind="h2d_copy",
            cost_s=cost_s,
            summary=(
                f"host-to-device copies hold up the iteration: {cost_s:.3g} s not hidden by compute over {n_it} steps "
                f"({nbytes / 1e9:.3g} GB in {n} copies at {gbps:.3g} GB/s)"
            ),
            ranks=named,
            hosts=run.hosts_of(named),
            evidence={
                "steps": n_it,
                "copies": n,
                "bytes": nbytes,
                "copy_s": round(dur_s, 4),
                "achieved_gb_per_s": round(gbps, 3),
                "h2d_s_per_rank": p.per_rank_s,
                **({"gpu_copies": g_n, "gpu_copy_s": round(g_ns / 1e9, 4), "gpu_achieved_gb_per_s": round(g_gbps, 3)}
                   if g_n else {}),  # fmt: skip
            },
            advice=advice,
        )
    ]
