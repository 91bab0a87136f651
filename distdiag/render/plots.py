"""The report's figures, each a plain function ``plot_x(report, ax=None) -> Axes`` (as PyDarshan does).

Every function takes a :class:`distdiag.pipeline.Report` (or what
:func:`as_report` turns into one: the ``distdiag.load`` frames, a
:class:`distdiag.run.Run`, a run directory), draws on ``ax`` when given, else
on a fresh :class:`matplotlib.figure.Figure` (no pyplot: no global state, no
GUI backend, safe in a server or a test), and returns the Axes. A function
raises :class:`NoData` when the run holds nothing it could draw (no file
events, no Slurm accounting, ...); ``PLOTS`` says which figures the HTML
report shows and ``available(report)`` which of them apply.

Text from the job (op names, host names, paths) goes into the figure as
plain text: ``text.parse_math`` is off, so a ``$`` in a path is a dollar,
not TeX. The figures are rasterized (PNG) by the HTML renderer, so no job
string reaches its markup through a plot.

Drawing stays vectorized: one PolyCollection per timeline lane and one
image per matrix, whatever the number of events (capped by ``max_bars``:
the longest events are kept, the rest are too short to see anyway).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import pandas as pd

from distdiag.breakdown import COLUMNS, LABELS, MAX_STEP_ROWS, per_step, step_breakdown
from distdiag.match import MatchState
from distdiag.schema import FILE_KINDS, Kind

if TYPE_CHECKING:
    from distdiag.match import Collectives
    from distdiag.run import Run

log = logging.getLogger(__name__)

#: the rc settings every figure is drawn (and saved) under
RC: dict[str, Any] = {"text.parse_math": False, "text.usetex": False, "font.size": 9, "axes.titlesize": 10}

#: a timeline draws at most this many rectangles per lane, the longest ones: a
#: 1,000-pixel-wide figure cannot show more, and Agg's time grows with them
#: (16 ranks x 20,000 events: 1.0 s CPU at 20,000 against 2.6 s at 50,000)
MAX_BARS = 20_000
#: a heatmap keeps at most this many columns (collectives are binned beyond)
MAX_HEATMAP_COLS = 400
#: ranks shown in the timeline and breakdown bars before sampling
MAX_RANKS = 64

_BREAKDOWN_COLORS = {
    "compute_s": "#4c9f70", "startup_s": "#b8d8be", "comm_wait_s": "#d1495b", "comm_transfer_s": "#2e86ab", "io_s": "#8d6a9f",
    "input_wait_s": "#edae49", "h2d_s": "#6c4b3a", "other_s": "#9e9e9e",
}  # fmt: skip


class NoData(ValueError):
    """The run holds nothing this figure could draw."""


def as_report(x: Any) -> Any:
    """A Report from a Report, the ``distdiag.load`` frames, a Run or a run-dir path."""
    from distdiag.run import Run

    if hasattr(x, "findings") and hasattr(x, "collectives") and hasattr(x, "breakdown") and hasattr(x, "config"):
        return x  # a Report
    rep = getattr(x, "report", None)
    if rep is not None:
        return rep  # RunFrames
    from distdiag.pipeline import analyze, analyze_run

    if isinstance(x, Run):
        return analyze_run(x)
    if isinstance(x, (str, Path)):
        return analyze(x)
    raise TypeError(f"cannot plot a {type(x).__name__}: pass a Report, distdiag.load(...), a Run or a run dir")


def _axes(ax: Any, figsize: tuple[float, float]) -> Any:
    if ax is not None:
        return ax
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, layout="constrained")
    return fig.add_subplot()


def _rc() -> Any:
    import matplotlib

    return matplotlib.rc_context(RC)  # type: ignore[arg-type]


def _t0_ns(run: Run) -> int:
    return int(run.start_ns)


def _rank_rows(ranks: np.ndarray, named: list[int], limit: int) -> np.ndarray:
    """At most ``limit`` ranks: every named one plus an even spread of the rest."""
    ranks = np.asarray(ranks, np.int64)
    if len(ranks) <= limit:
        return ranks
    keep = np.unique(np.asarray([r for r in named if r in set(ranks.tolist())], np.int64))[:limit]
    rest = np.setdiff1d(ranks, keep)
    n = limit - len(keep)
    pick = rest[np.linspace(0, len(rest) - 1, n).round().astype(np.int64)] if n > 0 and len(rest) else rest[:0]
    return np.union1d(keep, pick)


def _rects(y: np.ndarray, x0: np.ndarray, x1: np.ndarray, h: float) -> np.ndarray:
    """Vertices (n, 4, 2) of rectangles [x0, x1] x [y, y + h]: one PolyCollection, no loop."""
    v = np.empty((len(y), 4, 2))
    v[:, 0, 0] = v[:, 1, 0] = x0
    v[:, 2, 0] = v[:, 3, 0] = x1
    v[:, 0, 1] = v[:, 3, 1] = y
    v[:, 1, 1] = v[:, 2, 1] = y + h
    return v


def _longest(dur: np.ndarray, limit: int) -> np.ndarray:
    """Indices of the ``limit`` longest intervals (all when fewer)."""
    if len(dur) <= limit:
        return np.arange(len(dur))
    return np.sort(np.argpartition(-dur, limit)[:limit])


def _with_inflight(run: Run) -> np.ndarray:
    """The events plus the calls a rank was still inside of (a phase, a read), ending where its record ends."""
    inf = run.inflight
    if len(inf) == 0:
        return run.events
    inf = inf.copy()
    end = np.asarray(run.rank_bounds()[1], np.int64)
    inf["t1_ns"] = np.maximum(inf["t0_ns"], end[np.clip(inf["rank"], 0, len(end) - 1)])
    return np.concatenate([run.events, inf])


# ----------------------------------------------------------------------------------
# the figures


def plot_timeline(report: Any, ax: Any = None, max_ranks: int = MAX_RANKS, max_bars: int = MAX_BARS) -> Any:
    """Per-rank timeline on the aligned clock: compute phases, collectives (waiting vs
    transferring) and file I/O in three lanes per rank."""
    from matplotlib.collections import PolyCollection
    from matplotlib.patches import Patch

    report = as_report(report)
    run, colls = report.run, report.collectives
    ev = _with_inflight(run)
    named = sorted({int(r) for f in report.findings for r in f.ranks})
    rows = _rank_rows(run.rank_ids, named, max_ranks)
    if len(rows) == 0:
        raise NoData("no rank to draw")
    row_of = np.full(int(max(rows.max(), run.world_size)) + 1, -1, np.int64)
    row_of[rows] = np.arange(len(rows))
    t0 = _t0_ns(run)

    def lane(ranks: np.ndarray, a_ns: np.ndarray, b_ns: np.ndarray, off: float, h: float) -> tuple[np.ndarray, ...]:
        ranks = np.asarray(ranks, np.int64)
        ok = (ranks >= 0) & (ranks < len(row_of))
        ok[ok] &= row_of[ranks[ok]] >= 0
        ok &= b_ns >= a_ns
        a = (a_ns[ok] - t0) / 1e9
        b = (b_ns[ok] - t0) / 1e9
        keep = _longest(b - a, max_bars)
        return row_of[ranks[ok]][keep] + off, a[keep], b[keep], np.full(len(keep), h)

    layers: list[tuple[str, str, tuple[np.ndarray, ...]]] = []
    phase_kinds = np.array([Kind.PHASE, Kind.FORWARD, Kind.BACKWARD, Kind.OPTIMIZER], np.uint8)
    m = np.isin(ev["kind"], phase_kinds)
    layers.append(("compute phase", "#4c9f70", lane(ev["rank"][m], ev["t0_ns"][m], ev["t1_ns"][m], 0.05, 0.28)))
    m = ev["kind"] == Kind.INPUT_WAIT
    layers.append(("input wait", "#edae49", lane(ev["rank"][m], ev["t0_ns"][m], ev["t1_ns"][m], 0.05, 0.28)))
    m = ev["kind"] == Kind.H2D
    layers.append(("host-to-device", "#6c4b3a", lane(ev["rank"][m], ev["t0_ns"][m], ev["t1_ns"][m], 0.05, 0.28)))
    # Collectives: waiting (arrival -> last member's arrival), then the transfer.
    end = np.asarray(run.rank_bounds()[1], np.int64)
    t1 = np.where(colls.m_t1_ns >= 0, colls.m_t1_ns, end[np.clip(colls.m_rank, 0, len(end) - 1)])
    # never completed (a member never came or never left): waiting throughout
    never = (colls.g_state[colls.m_group] == MatchState.IN_FLIGHT) | (colls.g_exit_ns[colls.m_group] < 0)
    split = np.where(never, t1, np.clip(colls.g_last_ns[colls.m_group], colls.m_t0_ns, t1))
    layers.append(("collective: waiting", "#d1495b", lane(colls.m_rank, colls.m_t0_ns, split, 0.36, 0.28)))
    layers.append(("collective: transfer", "#2e86ab", lane(colls.m_rank, split, t1, 0.36, 0.28)))
    m = np.isin(ev["kind"], np.array(sorted(FILE_KINDS), np.uint8))
    layers.append(("file I/O", "#8d6a9f", lane(ev["rank"][m], ev["t0_ns"][m], ev["t1_ns"][m], 0.67, 0.28)))

    ax = _axes(ax, (11, max(2.5, 0.35 * len(rows) + 1.5)))
    with _rc():
        handles = []
        for label, color, (y, a, b, h) in layers:  # six lanes
            if len(y) == 0:
                continue
            verts = _rects(y, a, b, float(h[0]))
            # a zero-width rectangle still shows as a line: short calls stay visible
            coll = PolyCollection(verts, facecolors=color, edgecolors=color, linewidths=0.3)  # type: ignore[arg-type]
            ax.add_collection(coll)
            handles.append(Patch(color=color, label=label))
        ax.set_xlim(0, max(run.wall_s, 1e-6))
        ax.set_ylim(-0.1, len(rows))
        ax.set_yticks(np.arange(len(rows)) + 0.5)
        ax.set_yticklabels([f"rank {r}" for r in rows])
        ax.invert_yaxis()
        ax.set_xlabel("seconds since the first rank started (aligned clocks)")
        more = f" ({len(rows)} of {len(run.ranks)} ranks)" if len(rows) < len(run.ranks) else ""
        ax.set_title("Timeline per rank: compute phases, collectives, file I/O" + more)
        if handles:
            ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    return ax


def _main_comm(colls: Collectives) -> int:
    """The communicator with the most matched collectives (string id)."""
    ids, counts = np.unique(colls.g_comm, return_counts=True)
    return int(ids[np.argmax(counts)])


def _step_index(run: Run, rank: np.ndarray, t_ns: np.ndarray) -> np.ndarray | None:
    """Per (rank, instant): how many of that rank's ``distdiag.step()`` marks came before it.

    None unless every rank in ``rank`` marked at least two steps. Vectorized:
    steps sorted by (rank, t) and the queries share one key, rank * span + t,
    so one searchsorted finds each query's place among its own rank's steps.
    """
    ev = run.events
    st = ev[ev["kind"] == Kind.STEP]
    if len(st) == 0 or len(rank) == 0:
        return None
    s_rank = st["rank"].astype(np.int64)
    counts = np.bincount(s_rank, minlength=int(max(s_rank.max(), rank.max())) + 1)
    if counts[np.unique(rank)].min() < 2:
        return None
    lo = min(int(st["t0_ns"].min()), int(t_ns.min()))
    span = max(int(st["t0_ns"].max()), int(t_ns.max())) - lo + 1
    skey = np.sort(s_rank * span + (st["t0_ns"] - lo))
    qkey = rank.astype(np.int64) * span + (t_ns - lo)
    first = np.concatenate([[0], np.cumsum(counts)])[rank]
    n: np.ndarray = np.searchsorted(skey, qkey, side="right") - first
    return n


def wait_matrix(report: Any, comm: str | None = None, max_cols: int = MAX_HEATMAP_COLS,
                by: str = "auto") -> tuple[np.ndarray, np.ndarray, int, str]:  # fmt: skip
    """(ranks, matrix [rank, column] of wait seconds, units per column, what a column is).

    ``by="step"``: columns are iterations (the ``distdiag.step()`` marks of
    each rank; column 0 is before the first), a cell sums the rank's waits in
    every collective it entered during that step. ``by="collective"``:
    columns are the collectives of one communicator in sequence order (the
    busiest one unless ``comm`` names another). ``"auto"``: steps when every
    rank marked them, else collectives. Beyond ``max_cols`` columns are
    binned (summed). A rank's wait in a collective is the last member's
    arrival minus its own arrival; NaN where the rank has nothing.
    """
    report = as_report(report)
    colls = report.collectives
    run = report.run
    if len(colls) == 0:
        raise NoData("no matched collectives")
    wait_all = np.maximum(0, colls.g_last_ns[colls.m_group] - colls.m_t0_ns) / 1e9
    if by in ("auto", "step") and comm is None:
        step = _step_index(run, colls.m_rank.astype(np.int64), colls.m_t0_ns)
        if step is not None:
            ranks = np.unique(colls.m_rank).astype(np.int64)
            mat, per_col = _binned(ranks, np.searchsorted(ranks, colls.m_rank), step, wait_all, max_cols)
            return ranks, mat, per_col, "step"
        if by == "step":
            raise NoData("the ranks marked no steps (distdiag.step())")
    cid = _main_comm(colls) if comm is None else run.sid(comm)
    if cid < 0:
        raise NoData(f"no communicator {comm!r}")
    groups = np.flatnonzero(colls.g_comm == cid)
    order = groups[np.argsort(colls.g_seq[groups], kind="stable")]
    col_of = np.full(len(colls), -1, np.int64)
    col_of[order] = np.arange(len(order))
    mine = col_of[colls.m_group] >= 0
    ranks = np.unique(colls.m_rank[mine]).astype(np.int64)
    row = np.searchsorted(ranks, colls.m_rank[mine])
    mat, per_col = _binned(ranks, row, col_of[colls.m_group[mine]], wait_all[mine], max_cols)
    return ranks, mat, per_col, f"collective on communicator '{run.s(cid)}'"


def _binned(ranks: np.ndarray, row: np.ndarray, col: np.ndarray, val: np.ndarray,
            max_cols: int) -> tuple[np.ndarray, int]:  # fmt: skip
    """Sum ``val`` into a [rank, column] matrix, ``per_col`` columns to a bin; NaN where empty."""
    n = int(col.max()) + 1 if len(col) else 1
    per_col = max(1, -(-n // max_cols))
    n_cols = -(-n // per_col)
    flat = row * n_cols + col // per_col
    mat = np.bincount(flat, weights=val, minlength=len(ranks) * n_cols).reshape(len(ranks), n_cols)
    seen = np.bincount(flat, minlength=len(ranks) * n_cols).reshape(len(ranks), n_cols) > 0
    mat[~seen] = np.nan
    return mat, per_col


def plot_wait_heatmap(report: Any, ax: Any = None, comm: str | None = None, max_cols: int = MAX_HEATMAP_COLS,
                      by: str = "auto") -> Any:  # fmt: skip
    """Rank x step (or x collective index) heatmap of the time each rank waited for the others."""
    ranks, mat, per_col, what = wait_matrix(report, comm, max_cols, by)
    ax = _axes(ax, (11, max(2.2, 0.25 * len(ranks) + 1.5)))
    with _rc():
        im = ax.imshow(mat * 1e3, aspect="auto", interpolation="nearest", cmap="magma_r",
                       extent=(-0.5, mat.shape[1] * per_col - 0.5, len(ranks) - 0.5, -0.5))  # fmt: skip
        step = max(1, len(ranks) // 32)
        ax.set_yticks(np.arange(0, len(ranks), step))
        ax.set_yticklabels([f"rank {r}" for r in ranks[::step]])
        ax.set_xlabel(f"{what} index" + (f" ({per_col} per column)" if per_col > 1 else ""))
        ax.set_title("Time each rank waited for the last one to arrive" + (", per step" if what == "step" else ""))
        summed = what == "step" or per_col > 1
        ax.figure.colorbar(im, ax=ax, label="wait (ms, summed)" if summed else "wait (ms)", fraction=0.03, pad=0.01)
    return ax


def plot_breakdown(report: Any, ax: Any = None, max_ranks: int = MAX_RANKS) -> Any:
    """Stacked bars per rank: compute, waiting, transfer, I/O, input wait, H2D, other (seconds)."""
    report = as_report(report)
    df = report.breakdown
    if len(df) == 0:
        raise NoData("no rank recorded any time")
    named = sorted({int(r) for f in report.findings for r in f.ranks})
    rows = _rank_rows(df["rank"].to_numpy(), named, max_ranks)
    sub = df[df["rank"].isin(rows)].sort_values("rank")
    ax = _axes(ax, (11, max(2.2, 0.3 * len(sub) + 1.5)))
    with _rc():
        y = np.arange(len(sub))
        left = np.zeros(len(sub))
        for col in COLUMNS:  # seven categories
            v = sub[col].to_numpy(dtype=float)
            ax.barh(y, v, left=left, color=_BREAKDOWN_COLORS[col], label=LABELS[col], height=0.75)
            left += v
        ax.set_yticks(y)
        ax.set_yticklabels([f"rank {r} ({h})" if h else f"rank {r}" for r, h in zip(sub["rank"], sub["host"])])
        ax.invert_yaxis()
        ax.set_xlabel("seconds")
        more = f" ({len(sub)} of {len(df)} ranks)" if len(sub) < len(df) else ""
        ax.set_title("Where each rank's wall-clock went" + more)
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    return ax


# -- per step ---------------------------------------------------------------------------------
#: the per-step figure draws at most this many bars; longer runs bin consecutive steps
#: exactly as ``breakdown.per_step`` in the JSON does (same limit, same rule)
MAX_STEP_BARS = MAX_STEP_ROWS
#: the HTML report's table of the slowest steps lists this many
MAX_SLOW_STEPS = 10
#: why a run has no per-step figure or table (the HTML report says it in one line)
NO_STEPS = ("the run recorded no STEP rows (they come from a torch optimizer's step(), "
            "or from distdiag.step() in the training loop)")  # fmt: skip


def per_step_of(report: Any) -> pd.DataFrame:
    """:func:`distdiag.breakdown.per_step` of the report's step table (median and max over ranks per step).

    The step table is ``step_breakdown``'s, cached on ``run.cache`` by the
    breakdown stage (not recomputed); its one group-by over (rank, step) rows is
    cached there too (``run.cache.per_step``), so the figure and the table share it.
    """
    report = as_report(report)
    run = report.run
    steps = step_breakdown(run, report.collectives)
    hit = run.cache.per_step
    if hit is not None and hit[0] is steps:
        return hit[1]
    agg = per_step(steps)
    run.cache.per_step = (steps, agg)
    return agg


@dataclass(frozen=True)
class StepBars:
    """The per-step figure's data: one bar per step, or per ``bin`` consecutive steps past ``max_bars``.

    A bar's values are, per column, the mean over its steps of the median over
    ranks (seconds); with ``bin == 1`` simply each step's median over ranks.
    The rule is :func:`distdiag.breakdown.per_step_json`'s: bar ``i`` holds the
    steps ``s`` with ``s // bin == i``, ``bin = ceil(steps / max_bars)``.
    """

    #: steps in the run (distinct step indices)
    steps: int
    #: steps per bar
    bin: int
    #: per bar: its first step and how many steps it holds
    first: np.ndarray
    count: np.ndarray
    #: per column of COLUMNS: per bar, the mean over its steps of the median over ranks (s)
    median_s: dict[str, np.ndarray]
    #: per bar: the mean over its steps of the slowest rank's step time (s)
    max_wall_s: np.ndarray


def step_bars(report: Any, max_bars: int = MAX_STEP_BARS) -> StepBars:
    """The bars of :func:`plot_steps` (raises NoData when the run has no steps)."""
    agg = per_step_of(report)
    n = len(agg)
    if n == 0:
        raise NoData(NO_STEPS)
    bin_ = max(1, math.ceil(n / max(1, max_bars)))
    step = agg["step"].to_numpy(np.int64)
    # one bincount per column over the per-step rows (a bar = steps s with s // bin == i)
    _, inv, count = np.unique(step // bin_, return_inverse=True, return_counts=True)
    first = np.full(len(count), np.iinfo(np.int64).max)
    np.minimum.at(first, inv, step)

    def mean(col: str) -> np.ndarray:
        return np.bincount(inv, weights=agg[col].to_numpy(np.float64), minlength=len(count)) / count

    return StepBars(steps=n, bin=bin_, first=first, count=count,
                    median_s={c: mean(f"median_{c}") for c in COLUMNS}, max_wall_s=mean("max_wall_s"))  # fmt: skip


def slowest_steps(report: Any, limit: int = MAX_SLOW_STEPS) -> pd.DataFrame:
    """The ``limit`` slowest steps, slowest first: step, t_s (earliest start), ranks, median_wall_s,
    max_wall_s, max_rank (the rank with the max), top_col and top_s (that rank's largest column in the step).

    Slowest = the largest step time of the slowest rank (``max_wall_s``), ties
    broken by the median then by the earlier step: in a synchronous job every
    rank waits for that one, so it is what the step cost. Only the chosen
    steps' (rank, step) rows are read to find the rank and its column.
    """
    report = as_report(report)
    agg = per_step_of(report)
    cols = ["step", "t_s", "ranks", "median_wall_s", "max_wall_s", "max_rank", "top_col", "top_s"]
    if len(agg) == 0:
        return pd.DataFrame({c: [] for c in cols})
    a_step = agg["step"].to_numpy(np.int64)
    a_max = agg["max_wall_s"].to_numpy(np.float64)
    a_med = agg["median_wall_s"].to_numpy(np.float64)
    top = np.lexsort((a_step, -a_med, -a_max))[:limit]
    steps = step_breakdown(report.run, report.collectives)
    s_step = steps["step"].to_numpy(np.int64)
    sub = np.flatnonzero(np.isin(s_step, a_step[top]))
    s_step = s_step[sub]
    s_rank = steps["rank"].to_numpy(np.int64)[sub]
    s_wall = steps["wall_s"].to_numpy(np.float64)[sub]
    # per step, its slowest rank (the lowest rank on a tie): first row in (step, -wall, rank) order
    o = np.lexsort((s_rank, -s_wall, s_step))
    lead = o[np.r_[True, s_step[o][1:] != s_step[o][:-1]]]
    part = steps[list(COLUMNS)].to_numpy(np.float64)[sub[lead]]
    which = np.argmax(part, axis=1)
    by_step = {int(s): i for i, s in enumerate(s_step[lead])}  # at most ``limit`` steps
    pick = np.array([by_step[int(s)] for s in a_step[top]], np.int64)
    return pd.DataFrame({
        "step": a_step[top], "t_s": agg["t_s"].to_numpy(np.float64)[top],
        "ranks": agg["ranks"].to_numpy(np.int64)[top], "median_wall_s": a_med[top], "max_wall_s": a_max[top],
        "max_rank": s_rank[lead][pick], "top_col": np.asarray(COLUMNS)[which[pick]],
        "top_s": part[pick, which[pick]],
    }, columns=cols)  # fmt: skip


def plot_steps(report: Any, ax: Any = None, max_bars: int = MAX_STEP_BARS) -> Any:
    """Stacked bars per step (binned past ``max_bars``): each breakdown column's median over ranks, and a
    dash at the slowest rank's step time.

    Each column is one PolyCollection of ``n_bars`` rectangles, labelled like the
    per-rank figure's bars (``ax.bar`` adds one patch per bar: 200 bars x 7
    columns took 1.5 s of CPU to draw and save, the collections 0.3 s).
    """
    from matplotlib.collections import PolyCollection
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    bars = step_bars(report, max_bars)
    n_bars = len(bars.first)
    ax = _axes(ax, (11, 3.6))
    with _rc():
        top = max(float(bars.max_wall_s.max()), float(np.sum(list(bars.median_s.values()), axis=0).max()))
        scale, unit = (1.0, "s") if top >= 1.0 else (1e3, "ms")
        # a bar spans its steps on the step axis; single steps keep a gap between them
        half = bars.count * (0.85 if bars.bin == 1 else 1.0) / 2
        x = bars.first + (bars.count - 1) / 2
        bottom = np.zeros(n_bars)
        dash: dict[str, Any] = {"linestyle": "none", "marker": "_", "color": "k", "label": "slowest rank's step"}
        handles: list[Any] = [Line2D([], [], markersize=10, **dash)]
        for col in COLUMNS:  # seven categories, one collection each
            v = bars.median_s[col] * scale
            color = _BREAKDOWN_COLORS[col]
            verts = _rects(bottom, x - half, x + half, 0.0)
            verts[:, 1, 1] = verts[:, 2, 1] = bottom + v
            coll = PolyCollection(verts, facecolors=color, edgecolors="none")  # type: ignore[arg-type]
            coll.set_label(LABELS[col])
            coll.set_gid(f"steps-{col}")
            ax.add_collection(coll)
            handles.append(Patch(color=color, label=LABELS[col]))
            bottom += v
        ax.plot(x, bars.max_wall_s * scale, markersize=max(3.0, min(12.0, 600 / n_bars)), **dash)
        ax.set_xlim(-0.5, float(bars.first[-1] + bars.count[-1]) - 0.5)
        ax.set_ylim(0, top * scale * 1.08)  # room for the dashes on the tallest bars
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("step" + (f" ({bars.bin} steps per bar: means of their medians)" if bars.bin > 1 else ""))
        ax.set_ylabel(unit)
        ax.set_title(f"Where each step's time went, median over ranks ({bars.steps} steps)")
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    return ax


def link_matrix_of(report: Any) -> dict[str, Any] | None:
    """The slow_link finding's matrix (``evidence["matrix"]``), else the run's measured one, else None."""
    report = as_report(report)
    for f in report.findings:
        m = f.evidence.get("matrix") if isinstance(f.evidence, dict) else None
        if isinstance(m, dict) and m.get("units") and m.get("bw_MB_per_s"):
            return m
    try:
        from distdiag.links import link_matrix

        lm = link_matrix(report.run)
    except Exception:  # the matrix is a nicety: a run it cannot be built for has no figure
        log.debug("no link matrix", exc_info=True)
        return None
    return None if lm is None or len(lm.units) < 2 else lm.to_json()


def plot_link_matrix(report: Any, ax: Any = None) -> Any:
    """Node x node (or rank x rank) bandwidth matrix, MB/s; the slow link stands out."""
    m = link_matrix_of(report)
    if m is None:
        raise NoData("no link measurements")
    names = [str(u) for u in m["units"]]
    bw = np.array([[np.nan if v is None else float(v) for v in row] for row in m["bw_MB_per_s"]], float)
    ax = _axes(ax, (6.5, 5.5))
    with _rc():
        im = ax.imshow(bw, cmap="viridis", interpolation="nearest")
        n = len(names)
        step = max(1, n // 24)
        ax.set_xticks(np.arange(0, n, step))
        ax.set_xticklabels(names[::step], rotation=60, ha="right")
        ax.set_yticks(np.arange(0, n, step))
        ax.set_yticklabels(names[::step])
        if n <= 10:
            for (i, j), v in np.ndenumerate(bw):  # at most 100 cells
                if np.isfinite(v):
                    ax.text(j, i, f"{v:.0f}", ha="center", va="center", fontsize=7, color="w")
        ax.set_title(f"Link bandwidth between {m.get('unit', 'unit')}s (MB/s, {m.get('source', '')})")
        ax.figure.colorbar(im, ax=ax, label="MB/s", fraction=0.046, pad=0.04)
    return ax


#: file operations that touch metadata, not data
METADATA_KINDS = (Kind.FILE_OPEN, Kind.FILE_CLOSE, Kind.FILE_STAT, Kind.FILE_LISTDIR)


def plot_metadata_rate(report: Any, ax: Any = None, bin_s: float | None = None) -> Any:
    """File-system metadata operations per second over time (all ranks), by operation."""
    report = as_report(report)
    run = report.run
    ev = run.events
    m = np.isin(ev["kind"], np.array(METADATA_KINDS, np.uint8))
    if not m.any():
        raise NoData("no file events")
    t = (ev["t0_ns"][m] - _t0_ns(run)) / 1e9
    k = ev["kind"][m]
    wall = max(float(run.wall_s), float(t.max()) if len(t) else 0.0, 1e-3)
    bin_s = bin_s or max(1e-3, wall / 120)
    n_bins = int(np.ceil(wall / bin_s)) + 1
    b = np.clip((t / bin_s).astype(np.int64), 0, n_bins - 1)
    x = np.arange(n_bins) * bin_s
    ax = _axes(ax, (11, 3.2))
    with _rc():
        bottom = np.zeros(n_bins)
        colors = {Kind.FILE_OPEN: "#8d6a9f", Kind.FILE_STAT: "#2e86ab", Kind.FILE_LISTDIR: "#edae49",
                  Kind.FILE_CLOSE: "#9e9e9e"}  # fmt: skip
        for kind in METADATA_KINDS:  # four operations
            rate = np.bincount(b[k == kind], minlength=n_bins) / bin_s
            if rate.any():
                ax.bar(x, rate, width=bin_s, bottom=bottom, align="edge", color=colors[kind],
                       label=kind.name.lower().removeprefix("file_"))  # fmt: skip
                bottom += rate
        ax.set_xlim(0, wall)
        ax.set_xlabel("seconds since the first rank started")
        ax.set_ylabel("operations / s")
        ax.set_title(f"File-system metadata operations per second, all ranks ({bin_s * 1e3:.3g} ms bins)")
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    return ax


def plot_slurm_timeline(report: Any, ax: Any = None) -> Any:
    """The job's life in Slurm: submit, eligible, start, ranks' first work, end (seconds since submission)."""
    report = as_report(report)
    view = report.slurm
    if view is None or view.acct is None or not view.timeline:
        raise NoData(view.why if view is not None else "no Slurm accounting")
    tl = [t for t in view.timeline if t.get("t_s") is not None]
    ts = np.array([float(t["t_s"]) for t in tl])
    ax = _axes(ax, (11, 2.8))
    with _rc():
        by = {t["what"]: float(t["t_s"]) for t in tl}
        spans = [("queued", by.get("submit"), by.get("start"), "#9e9e9e"),
                 ("launch", by.get("start"), by.get("last rank first work"), "#edae49"),
                 ("running", by.get("last rank first work", by.get("start")), by.get("end", by.get("last event")),
                  "#4c9f70")]  # fmt: skip
        for label, a, b, color in spans:  # three spans
            if a is not None and b is not None and b >= a:
                ax.barh(0, b - a, left=a, height=0.4, color=color, label=f"{label} {b - a:.3g} s")
        ax.scatter(ts, np.zeros(len(ts)), marker="|", s=300, color="k", zorder=3)
        span = max(float(ts.max()), 1e-9) if len(ts) else 1.0
        for i, t in enumerate(tl):  # a dozen instants
            # labels on the right half hang to the left, so none runs off the axes
            right = float(t["t_s"]) > 0.6 * span
            ax.annotate(str(t["what"]), (float(t["t_s"]), 0.2), xytext=(0, 16 + 11 * (i % 5)),
                        textcoords="offset points", fontsize=7, ha="right" if right else "left",
                        arrowprops={"arrowstyle": "-", "lw": 0.4})  # fmt: skip
        ax.set_yticks([])
        ax.set_ylim(-0.5, 2.2)
        ax.set_xlabel("seconds since submission")
        ax.set_title(f"Slurm timeline of job {view.acct.job_id}")
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    return ax


def plot_gpu(report: Any, ax: Any = None, metric: str = "sm_util_pct") -> Any:
    """One line per (rank, GPU) of an NVML metric over time (SM utilization by default)."""
    report = as_report(report)
    run = report.run
    g = run.gpu
    if len(g) == 0:
        raise NoData("no GPU samples")
    t = (g["t_ns"] - _t0_ns(run)) / 1e9
    key = g["rank"].astype(np.int64) * 1024 + g["gpu"]
    ax = _axes(ax, (11, 3.0))
    with _rc():
        keys = np.unique(key)
        for kk in keys[:32]:  # a line per GPU, at most 32
            m = key == kk
            o = np.argsort(t[m])
            ax.plot(t[m][o], g[metric][m][o], lw=0.8, label=f"rank {kk // 1024} gpu {kk % 1024}")
        ax.set_xlabel("seconds since the first rank started")
        ax.set_ylabel(metric)
        ax.set_title(f"GPU {metric} per device" + (f" (32 of {len(keys)})" if len(keys) > 32 else ""))
        if len(keys) <= 8:
            ax.legend(fontsize=7, frameon=False)
    return ax


# ----------------------------------------------------------------------------------
# the list the HTML report draws


@dataclass(frozen=True)
class Plot:
    name: str
    title: str
    fn: Callable[..., Any]
    #: what the figure answers, one sentence under it in the report
    caption: str


PLOTS: list[Plot] = [
    Plot("timeline", "Timeline", plot_timeline,
         "Each rank's phases, collectives (red: waiting for others, blue: transferring) and file I/O on one clock."),
    Plot("wait_heatmap", "Waiting per collective", plot_wait_heatmap,
         "Dark cells: a rank waited long for the last arriver. A light row among dark ones is the late rank."),
    Plot("breakdown", "Per-rank breakdown", plot_breakdown, "Where each rank's wall-clock went."),
    Plot("link_matrix", "Link matrix", plot_link_matrix, "Measured bandwidth between nodes; a dark cell is a slow link."),
    Plot("metadata_rate", "Metadata operations", plot_metadata_rate,
         "Opens, stats, directory listings and closes per second across all ranks."),
    Plot("slurm_timeline", "Slurm timeline", plot_slurm_timeline,
         "Submission, start, the ranks' first work and the end of the job."),
    Plot("gpu", "GPU utilization", plot_gpu, "NVML samples per device."),
]  # fmt: skip


def figure_png(fn: Callable[..., Any], report: Any, dpi: int = 90) -> bytes:
    """Draw ``fn(report)`` on a fresh figure and return it as PNG bytes (raises NoData)."""
    import io

    from matplotlib.backends.backend_agg import FigureCanvasAgg

    with _rc():
        ax = fn(report)
        fig = ax.figure
        FigureCanvasAgg(fig)
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()
