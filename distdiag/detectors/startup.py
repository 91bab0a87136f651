"""startup: the time from the ranks' start to the job's first step that the job need not spend.

Every rank starts (its shim's start: the interpreter is up, the program not yet run),
imports, initializes (``init_process_group``, ``MPI_Init``), builds its dataset and
model, and only then meets its peers or steps: its *startup* ends at its first
collective, point-to-point call, compute phase or step
(:data:`distdiag.breakdown.STARTUP_END_KINDS`; the breakdown's ``startup_s`` is the
part of it no recorded call covers). The job's first step begins when the last rank
gets there (they meet at the first collective), at ``E = max_r e_r``.

Counterfactual (the price): each rank runs its **imports** as recorded, except that
its file calls among them on a shared file system (NFS, Lustre, FUSE...: not
:data:`distdiag.import_files.LOCAL_FSTYPES`) take at most ``healthy_call_ms`` (1 ms) each (a node-local disk's
slow calls are the loaded machine's: under a load of 3-6 on 2 cores, 0.1-0.16 s of
torch's import calls took over 1 ms each); its communicator creations (``MPI_Init``,
which mpi4py runs inside ``import mpi4py.MPI`` and which waits for every rank to
start: 0.5 s of a 2-rank job's 0.95 s startup here) are kept too; and the rest of its startup (``init_process_group``'s wait, the dataset
build, the model) takes no time. A rank's imports are its file calls on modules
(``.py``, ``.pyc``, ``.so``, ``.pth``, ``__pycache__``) in its startup and the gaps
between them: every gap between two calls from the same call site (the fileio hook
names the program's line: one ``import torch`` statement, or one ``DDP(model)`` that
imports lazily: a module's own code running, a shared library loading), and a gap
between two sites when shorter than ``import_gap_s`` (1 s; measured on torch's
import here, the longest gap inside one statement was 0.23 s on an idle machine and
0.58-0.75 s under a load of 3-6 on 2 cores: a setup shorter than that between two
import statements is counted as imports, a conservative price), from the rank's
start on (the lead-in from its start to its first import, the interpreter's and
the shim's, always: under a load of 8 it took 2.4 s). Imports come in bursts: the program's own at the
top, and lazy ones later (DDP's constructor imported ``torch._dynamo`` and sympy
for ~2 s, after the dataset build): every burst counts. So, with ``i_r`` a rank's
import time and ``x_r`` the excess of its module file calls over the healthy
latency::

    cost_s = E - max_r (s_r + i_r - x_r)

An upper bound for the setup part (a dataset built once and cached, or built lazily
by the loader's workers, still costs something), the imports kept at each rank's own
pace. Why not "every rank at the fastest rank's pace" (issue 20's wording): ranks
importing torch side by side on shared cores differ by 5-10% run to run, which would
price a healthy twin's noise at several percent of a short run; a rank whose imports
are slow because its file system is, is priced by the excess; the spread of the
ranks' imports is in the evidence.

Worked example: two ranks start at 0; rank 0 imports for 2.0 s, rank 1 for 2.1 s
(its module files took 0.6 ms each, 0.4 ms above healthy, 500 of them: x = 0.2 s);
both then build the dataset for 3 s and meet at DDP's first broadcast at 5.15 s.
E' = max(2.0, 2.1 - 0.2) = 2.0: cost 3.15 s.

Without module file rows (the fileio hook off: ``DISTDIAG_HOOKS=fileio=0``) the
imports cannot be told from the setup: no finding (the report's coverage says so).
Under Slurm, ``launch_overhead`` prices job start to the last rank's first work,
which holds this window: the ranking keeps that one (:mod:`distdiag.ranking`).

Reported from ``min_fraction`` (the [analyze] one, 2%) of the wall-clock.
Settings (``[analyze.startup]``): ``min_fraction``, ``healthy_call_ms`` (1.0),
``import_gap_s`` (1.0).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import numpy as np

from distdiag.analysis import Analysis
from distdiag.breakdown import startup_ends
from distdiag.detectors import register
from distdiag.roles import Role
from distdiag.findings import Finding, Windows
from distdiag.replay import Change
from distdiag.startup_floor import floor_of

if TYPE_CHECKING:
    from distdiag.match import Collectives
    from distdiag.run import Run


ADVICE = (
    "cache what the setup builds (save the prepared dataset once and load it; build it lazily in the "
    "DataLoader workers), run more steps per launch so startup is amortized, and keep the Python "
    "environment on node-local storage if its imports are slow"
)


@register("startup", requires=("startup_ends",),
          role=Role(tier=2, removal=1, subsystem=True, explained_by=("launch_overhead",)))
def detect(an: Analysis) -> list[Finding]:
    run, cfg = an.run, an.cfg
    wall_s = float(run.wall_s)
    if wall_s <= 0 or not run.ranks:
        return []
    min_fraction = float(cfg.value("startup", "min_fraction", getattr(cfg, "min_fraction", 0.02)))
    fl = floor_of(run, cfg)
    if fl is None:
        return []
    present, s0, e, imp, m, excess, file_s, calls = fl.present, fl.s0, fl.e, fl.imp, fl.m, fl.excess, fl.file_s, fl.calls
    healthy_ns, cost_s = fl.healthy_ns, fl.cost_s
    e_job = int(e.max())
    if cost_s < min_fraction * wall_s:
        return []
    last = int(present[int(np.argmax(e))])
    t_first = int(s0.min())
    imports_s = imp[present] / 1e9
    setup_s = np.maximum(0, e - m[present]) / 1e9
    share = cost_s / wall_s
    per_rank = {int(q): {"imports_s": round(float(imports_s[i]), 4), "setup_s": round(float(setup_s[i]), 4),
                         "startup_s": round(float((e[i] - s0[i]) / 1e9), 4),
                         "module_file_calls": int(calls[q]), "module_file_s": round(float(file_s[q]), 4),
                         "module_file_excess_s": round(float(excess[q]) / 1e9, 4)}
                for i, q in enumerate(present[:16])}  # fmt: skip
    slow_files_s = float(excess[present].max()) / 1e9
    summary = (
        f"startup: the job's first step began {(e_job - t_first) / 1e9:.3g} s after its first rank started; "
        f"{cost_s:.3g} s of it ({share:.0%} of the run) was not imports (waiting for rank {last}: "
        f"{float(setup_s[int(np.argmax(e))]):.3g} s of init, dataset and model building besides "
        f"{float(imports_s[int(np.argmax(e))]):.3g} s of imports before its first step)"
        + (f" and {slow_files_s:.3g} s to slow module files" if slow_files_s >= 0.005 else "")
    )
    f = Finding(
        kind="startup",
        cost_s=cost_s,
        summary=summary,
        ranks=[last],
        hosts=run.hosts_of([last]),
        advice=ADVICE,
        evidence={
            "share_of_wall": round(share, 4),
            "first_step_s": round((e_job - t_first) / 1e9, 4),
            "imports_s": {"min": round(float(imports_s.min()), 4), "max": round(float(imports_s.max()), 4)},
            "setup_s": {"min": round(float(setup_s.min()), 4), "max": round(float(setup_s.max()), 4)},
            "slow_module_files_s": round(slow_files_s, 4),
            "healthy_call_ms": healthy_ns / 1e6,
            "counterfactual": (
                "each rank's imports and communicator creation (MPI_Init) as recorded (module file "
                "calls on shared file systems at most healthy_call_ms each), then straight to its first "
                "step: the setup (init_process_group's wait, dataset, model) taking no time; an upper "
                "bound for the setup"
            ),
            "per_rank": per_rank,
        },
        # for the replay: each rank's setup (its imports' end, less their excess, to its first step) removed
        change=Change("each rank straight from its imports to its first step (the setup taking no time)",
                      drop_rank=present, drop_t0=np.maximum(s0, (m[present] - excess[present]).astype(np.int64)),
                      drop_t1=e.astype(np.int64)),  # fmt: skip
    )
    f.windows = functools.partial(_startup_window, f)  # as a symptom (distdiag.ranking)
    return [f]


def _startup_window(f: Finding, run: Run, colls: Collectives) -> Windows | None:
    """The finding's window as a symptom: its binding rank's start-up, charged with the part of the
    price that its module files' excess over the healthy latency makes (its ``module_file_excess_s``):
    what a metadata storm among those files explains. The setup the price also holds (dataset,
    model, init) is no file system's, and stays."""
    if not f.ranks:
        return None
    r = int(f.ranks[0])
    per = (f.evidence.get("per_rank") or {}).get(r) or {}
    excess_s = float(per.get("module_file_excess_s", f.evidence.get("slow_module_files_s", 0.0)))
    start, _ = run.rank_bounds()
    ends = startup_ends(run)
    if r >= len(start) or excess_s <= 0:
        return None
    one = np.array([r], np.int64)
    return one, start[one].astype(np.int64), ends[one].astype(np.int64), np.array([int(min(excess_s, f.cost_s) * 1e9)])
