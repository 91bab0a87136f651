"""The analysis pipeline: ``load_run -> align -> match -> detectors -> Report``.

Each stage is a function of its inputs (see STYLE.md); this module only wires
them together, runs every registered detector (one failing detector becomes a
warning, never a lost report), sets each finding's ``fraction`` of the
wall-clock and ranks the findings by ``cost_s``: the first one is the verdict.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from distdiag import clocks, replay
from distdiag.breakdown import COLUMNS, INFO_COLUMNS, breakdown, per_step_json, step_breakdown
from distdiag.analysis import Analysis
from distdiag.children import ChildIO, children_io
from distdiag.critical_path import needs_costs
from distdiag.gpu_timeline import gpu_json
from distdiag.config import Config, load_config
from distdiag.detectors import load_all
from distdiag.findings import Finding
from distdiag.match import Collectives, MatchState, collectives_of
from distdiag.passes import analysis_passes, run_local
from distdiag.ranking import coverage, rank_findings
from distdiag.ranks import rank_ranges
from distdiag.roles import role_of
from distdiag.run import Run, load_run, stream_out, streamed_kinds_for
from distdiag.slurm import needs_rank_firsts
from distdiag.slurm import accounting_of as slurm_accounting_of

log = logging.getLogger(__name__)

REPORT_SCHEMA = "distdiag.report/1"


@dataclass
class Report:
    """Everything a renderer needs: the aligned run, the ranked findings, the breakdown."""

    run: Run
    findings: list[Finding]
    breakdown: pd.DataFrame
    collectives: Collectives
    config: Config = field(default_factory=Config)
    #: Slurm accounting and timeline (distdiag.slurm.SlurmView), None when not computed
    slurm: Any = None
    #: the categories above 10% of a rank's wall-clock and what explains them (distdiag.ranking.coverage)
    coverage: list[dict[str, Any]] = field(default_factory=list)
    #: rank -> its forked children's file I/O (DataLoader workers; distdiag.children)
    children: dict[int, ChildIO] = field(default_factory=dict)

    @property
    def verdict(self) -> Finding | None:
        """The binding constraint: the costliest finding, or None for a healthy job."""
        return self.findings[0] if self.findings else None

    def to_json(self) -> dict[str, Any]:
        """The stable JSON contract (DESIGN.md, "The JSON report")."""
        run = self.run
        per_rank = []
        for row in self.breakdown.itertuples(index=False):  # one per rank
            d = {"rank": int(row.rank), "host": str(row.host), "wall_s": float(row.wall_s)}
            d.update({c: float(getattr(row, c)) for c in (*COLUMNS, *INFO_COLUMNS)})
            per_rank.append(d)
        return {
            "schema": REPORT_SCHEMA,
            "run": {
                "ranks": int(run.world_size),
                "hosts": run.hosts,
                "job_id": run.job_id,
                "wall_s": float(run.wall_s),
                "missing_ranks": [int(r) for r in run.missing_ranks],
                "warnings": list(run.warnings),
                # {"available": false, "why": "..."} outside Slurm; see distdiag/slurm.py
                **({"slurm": _jsonable(self.slurm.to_json())} if self.slurm is not None else {}),
                # only for a run read from PyTorch profiler traces (distdiag/kineto.py)
                **({"input": input_json(run)} if run.source == "kineto" else {}),
            },
            "findings": [_jsonable(f.to_json()) for f in self.findings],
            # per rank with forked children (DataLoader workers): their file I/O (distdiag/children.py)
            "children": [self.children[r].to_json() for r in sorted(self.children)],
            "breakdown": {"per_rank": per_rank, "per_step": per_step_json(step_breakdown(run, self.collectives)),
                          "coverage": _jsonable(self.coverage),
                          # only for a run timed on the GPU (CUDA events, distdiag/gpu_timeline.py)
                          **({"gpu": _jsonable(g)} if (g := gpu_json(run, self.config)) is not None else {})},
        }


def input_json(run: Run) -> dict[str, Any]:
    """``run.input`` of the JSON report for a run read from Kineto traces: the format, the
    files, how the clocks were aligned and the largest alignment bound (ms; None when a rank
    could not be aligned)."""
    model = run.cache.clock_model
    methods = sorted({m.method for m in model.ranks.values()}) if model is not None else []
    b = np.asarray(getattr(model, "bound_ns", []), np.float64)
    b = b[[r for r in run.ranks if r < len(b)]] if len(b) else b
    worst = float(b.max()) / 1e6 if len(b) else 0.0
    return {
        "format": "kineto",
        "files": len(run.ranks),
        "clock_methods": methods,
        "clock_bound_ms": round(worst, 4) if np.isfinite(worst) else None,
    }


def _jsonable(x: Any) -> Any:
    """Evidence may hold numpy scalars/arrays: make it plain JSON types."""
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return _jsonable(x.tolist())
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, float) and not np.isfinite(x):
        return None
    return x


def _incomplete_warnings(run: Run, colls: Collectives, limit: int = 3) -> list[str]:
    """One line per collective that never completed (a rank hung or died in it)."""
    bad = np.flatnonzero(colls.g_state == MatchState.IN_FLIGHT)
    out = []
    for g in bad[:limit]:  # a handful
        sl = colls.members(int(g))
        inside = colls.m_rank[sl][colls.m_t1_ns[sl] < 0]
        never = colls.missing_ranks(int(g))
        line = (
            f"{colls.op_name(int(g))} #{int(colls.g_seq[g])} on communicator '{colls.comm_name(int(g))}' never "
            f"completed: rank(s) {rank_ranges(inside.tolist())} were inside it (in flight) when their record ends"
        )
        if len(never):
            line += f"; rank(s) {rank_ranges(never.tolist())} never entered it"
        out.append(line)
    if len(bad) > limit:
        out.append(f"... and {len(bad) - limit} more collectives in flight")
    return out


#: an attribution to one rank needs its lateness above this many clock-alignment bounds
ATTRIBUTION_BOUNDS = 3.0


def _clock_bounds(findings: list[Finding], run: Run) -> None:
    """Each finding that names ranks carries their clock-alignment bound (``clock_bound_ms``:
    the largest of the named ranks' and of the reference's, at the end of their records);
    a finding named by arrivals across clocks (its ``Role.attributed_by``: a straggler's
    median lateness, a serial section's median lone window) under ATTRIBUTION_BOUNDS times
    the run's largest bound says that the clocks cannot tell which rank it was (issue 20
    item 6)."""
    model = run.cache.clock_model
    b = getattr(model, "bound_ns", None)
    if b is None or len(b) == 0:
        return
    bound = np.asarray(b, dtype=np.float64)
    finite = bound[np.isfinite(bound)]
    worst_ms = float(finite.max()) / 1e6 if len(finite) else float("inf")
    for f in findings:  # a handful
        named = [r for r in f.ranks if 0 <= r < len(bound)]
        if not named:
            continue
        mine = float(bound[named].max()) / 1e6
        f.evidence["clock_bound_ms"] = round(mine, 4) if np.isfinite(mine) else None
        by = role_of(f.kind).attributed_by
        late = f.evidence.get(by[0]) if by is not None else None
        if by is not None and late is not None and float(late) < ATTRIBUTION_BOUNDS * worst_ms:
            f.evidence["attribution"] = "uncertain"
            f.summary += (
                f"; but its {by[1]} ({float(late):.3g} ms) is under {ATTRIBUTION_BOUNDS:g}x the clocks' "
                f"alignment bound ({worst_ms:.3g} ms): the clocks cannot tell for sure {by[2]}"
            )


def _sweep(run: Run, colls: Collectives, cfg: Config) -> None:
    """The per-rank passes the analysis reads, in one sweep over the bands (:mod:`distdiag.passes`;
    a streamed run reads each band from the rank files once for all): the Slurm view's per-rank
    firsts (where it reads them), the critical path of input waits and copies (where
    ``input_bound`` or ``h2d_copy`` price rows), the breakdown and each rank's end of start-up,
    each cached on the run where its stage looks. A sweep that fails leaves each stage to make
    its own pass, as before."""
    try:
        todo = analysis_passes(colls, needs_rank_firsts(run), needs_costs(run, cfg))
        got = run_local(run, list(todo.values()))
    except Exception:  # each stage's own pass says what is wrong, or makes it
        log.debug("sweep", exc_info=True)
        return
    for name, value in zip(todo, got):  # a handful
        run.cache.put(name, value)


def analyze_run(run: Run, cfg: Config | None = None, inplace: bool = False, split: Any = None) -> Report:
    """Align, match, detect and rank on an already loaded run.

    ``inplace=True`` gives ``run``'s event table to the analysis: the clock
    mapping rewrites its time columns instead of copying the whole table (see
    :func:`distdiag.clocks.align`), and a streamed run's collective rows are let go
    (``run.coll_rows`` set to None) once matched, though the caller still holds ``run``
    (1.8 GB of 3.9 at 1024 x 10^5 stayed resident to the end); use it when nothing else
    reads ``run``.

    ``split`` (``distdiag analyze --parallel``, :mod:`distdiag.parallel`): its
    ``matched(run, colls)`` is called once the collectives are matched (the analysis ranks
    sweep the per-rank passes over their blocks of bands, and rank 0 caches each pass's
    result where the serial sweep would), its ``done(run)`` after the detectors (timing).
    """
    cfg = cfg or Config()
    given = run
    run = clocks.align(run, inplace=inplace)
    colls = collectives_of(run)
    run.warnings.extend(_incomplete_warnings(run, colls))
    # A streamed run lets its collective rows go once matched: the match keeps what the
    # cross-rank stages read, the per-rank ones read them from the files (distdiag.bands).
    run = stream_out(run)
    if inplace:  # the caller's run holds them too (its frame is alive until this returns)
        given.coll_rows = given.coll_sigs = None
    del given
    if split is not None:
        split.matched(run, colls)
    if split is None or not getattr(split, "workers", 0):  # else the analysis ranks make the parts
        _sweep(run, colls, cfg)
    # Slurm accounting (cached on the run: queue_wait and launch_overhead read it too).
    slurm_view = slurm_accounting_of(run)
    dets = load_all()
    names = cfg.detectors or list(dets)
    unknown = [n for n in names if n not in dets]
    if unknown:
        run.warnings.append(f"config names unknown detectors {unknown} (known: {sorted(dets)}); skipped")
    inputs = Analysis(run, colls, cfg)  # what every detector reads
    findings: list[Finding] = []
    for name in names:  # one per detector
        fn = dets.get(name)
        if fn is None:
            continue
        try:
            got = fn(inputs)
        except Exception as e:  # one broken detector must not cost the whole report
            log.debug("detector %s failed", name, exc_info=True)
            run.warnings.append(f"detector '{name}' failed ({type(e).__name__}: {e}); its findings are missing")
            continue
        for f in got:  # a handful per detector
            if not np.isfinite(float(f.cost_s)):
                run.warnings.append(f"detector '{name}' gave a {f.kind} finding without a finite cost; dropped")
                continue
            findings.append(f)
    # what each cause saves, replayed without it (distdiag/replay.py), before the ranking shares seconds
    model = None
    try:
        model = replay.price(findings, run, colls)
    except Exception as e:  # never costs the report
        log.debug("replay", exc_info=True)
        run.warnings.append(f"the replay could not price the findings ({type(e).__name__}: {e})")
    # One ranking: each second counted once (the replayed causes removed one after another), shares,
    # order (distdiag/ranking.py)
    findings = rank_findings(findings, run, colls, cfg, model)
    run.cache.replay_model = model = None  # its arrays go with it: the report does not replay
    _clock_bounds(findings, run)
    if split is not None:
        split.done(run)
    bd = breakdown(run, colls)
    kids = _children(findings, run, cfg)
    # never silent: each category above 10% of a rank's wall, and what explains it (distdiag/ranking.py)
    return Report(run=run, findings=findings, breakdown=bd, collectives=colls, config=cfg, slurm=slurm_view,
                  coverage=coverage(findings, bd, run, cfg, colls), children=kids)  # fmt: skip


#: an input-bound rank's advice names the file system when each of its loader processes spent
#: at least this share of what the input wait costs in file calls (distdiag.children). Against
#: the wait, not the workers' lifetime: persistent workers live on after the loop, idle (seen:
#: a DDP job's workers spent 1.3 s each on a slow mount, all of the 1.29 s input wait, and 20%
#: of their 6.4 s lives)
CHILD_IO_SHARE = 0.25


def _children(findings: list[Finding], run: Run, cfg: Config) -> dict[int, ChildIO]:
    """The ranks' forked children's file I/O (distdiag.children); an input-bound rank's
    finding carries its children's (``evidence.children_io``): where its data comes from."""
    try:
        kids = children_io(run, int(cfg.value("children", "max_files", 4096)))
    except Exception as e:  # never costs the report
        log.debug("children", exc_info=True)
        run.warnings.append(f"the forked processes' files could not be read ({type(e).__name__}: {e})")
        return {}
    for f in findings:  # a handful
        mine = [kids[r] for r in f.ranks if r in kids]
        if f.kind == "input_bound" and mine:
            top = max(mine, key=lambda c: c.io_s)
            f.evidence["children_io"] = top.to_json()
            # the workers mostly wait on files: the storage feeds the loader, not its CPU
            each = top.io_s / max(top.processes, 1)
            if top.by_fs and f.cost_s > 0 and each >= CHILD_IO_SHARE * float(f.cost_s):
                fs, (n, secs, _b) = max(top.by_fs.items(), key=lambda kv: kv[1][1])
                f.advice += (f" Its {top.processes} loader processes spend {top.io_s:.2f} s in file calls, "
                             f"{each:.2f} s each against the {float(f.cost_s):.2f} s the wait for input costs "
                             f"(mostly {fs}, {1e3 * secs / max(n, 1):.3g} ms a call): the file system feeds the "
                             "loader, so more workers help only while it scales; stage the data on local disk or in "
                             "memory, or pack small files into shards.")  # fmt: skip
    return kids


def analyze(run_dir: str | Path, cfg: Config | None = None, stream: bool = False) -> Report:
    """Load the run directory and analyze it. Raises DistdiagError when nothing can be analyzed.

    ``stream=True`` lets a large run be analyzed streaming (:func:`distdiag.run.streamed_kinds_for`):
    the report is the same, the memory that of the cross-rank rows plus one band (see
    ``Config.stream_events``), but
    ``report.run.events`` then lacks the compute phases (the pandas API and the HTML
    report want them: they call this with the default)."""
    if cfg is None:
        cfg = load_config()
    kinds = streamed_kinds_for(run_dir, cfg.stream_events) if stream else ()
    run = load_run(run_dir, streamed_kinds=kinds, max_trace_bytes=cfg.kineto_max_trace_bytes)
    return analyze_run(run, cfg, inplace=True)  # nobody else holds the run
