"""The floor of each rank's startup: what the startup counterfactual keeps (its imports and its
communicator creation) and what it removes, a pass that the ``startup`` detector prices and the
report's coverage reads (:func:`distdiag.ranking.coverage`: a category the floor holds is
explained), so that the ranking imports no detector.

A rank's startup runs from its start to its first collective, point-to-point call, compute
phase or step (:func:`distdiag.breakdown.startup_ends`). Its floor is its imports (its file
calls on modules and the gaps between them: :func:`import_time_ns`) and its communicator
creations (``MPI_Init``); the price of the rest is :attr:`Floor.cost_s`. The rules and a worked
example: :mod:`distdiag.detectors.startup`. Settings (``[analyze.startup]``):
``healthy_call_ms`` (1.0), ``import_gap_s`` (1.0).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from distdiag.breakdown import startup_ends
from distdiag.import_files import is_module_path, shared_fs_rows
from distdiag.intervals import union_length_by_key
from distdiag.rows import rows_of
from distdiag.schema import FILE_KINDS, Kind

if TYPE_CHECKING:
    from distdiag.config import Config
    from distdiag.run import Run


@dataclass(frozen=True)
class Floor:
    """The startup floor of a run's ranks. Arrays over ``present`` (the ranks, ascending):
    ``s0`` starts, ``e`` startup ends (ns); arrays over every rank id (``n``): ``imp`` import
    time (ns), ``m`` where the startup would end (start + imports, ns), ``excess`` the module
    file calls' time over the healthy latency on shared file systems (ns), ``file_s`` their
    file calls' seconds, ``calls`` their count. ``kept``: rank -> {breakdown column: seconds of
    it the counterfactual keeps} (``startup_s`` the imports, ``io_s`` their file calls,
    ``other_s`` the communicator creation, ``comm_wait_s`` the wait at the first rendezvous for
    the last rank's floor). ``cost_s``: what the counterfactual removes (the
    job's first step at the latest rank's floor), reported or not."""

    present: np.ndarray
    s0: np.ndarray
    e: np.ndarray
    imp: np.ndarray
    m: np.ndarray
    excess: np.ndarray
    file_s: np.ndarray
    calls: np.ndarray
    kept: dict[int, dict[str, float]]
    healthy_ns: float
    cost_s: float


def _none(run: Run, key: tuple[float, float]) -> Floor | None:
    """No floor to tell, remembered for the run."""
    run.cache.startup_floor[key] = None
    return None


def floor_of(run: Run, cfg: Config) -> Floor | None:
    """The run's startup :class:`Floor` (computed once per run and settings), or None where there is
    none to tell: no wall-clock, no module file rows (the fileio hook off: the imports cannot be
    told from the setup), no rank whose startup lasted."""
    healthy_ns = float(cfg.value("startup", "healthy_call_ms", 1.0)) * 1e6
    gap_ns = float(cfg.value("startup", "import_gap_s", 1.0)) * 1e9
    key = (healthy_ns, gap_ns)
    if key in run.cache.startup_floor:
        return run.cache.startup_floor[key]
    if float(run.wall_s) <= 0 or not run.ranks:
        return _none(run, key)
    mods = module_rows(run)
    if len(mods) == 0:
        return _none(run, key)
    start, _ = run.rank_bounds()
    ends = startup_ends(run)
    present = np.array(sorted(run.ranks), np.int64)
    s0, e = start[present].astype(np.int64), ends[present]
    if not (e > s0).any():
        return _none(run, key)
    ev = run.events
    # the floor: the imports and the communicator creations (MPI_Init: mpi4py's import of MPI,
    # which waits for every rank to start), both kept by the counterfactual
    init = rows_of(run, (int(Kind.COMM_CREATE),))
    is_file = np.r_[np.ones(len(mods), bool), np.zeros(len(init), bool)]
    if len(init):
        mods = np.concatenate([mods, init])
        o = np.argsort(mods, kind="stable")  # back to table order: (rank, t0)
        mods, is_file = mods[o], is_file[o]
    r = ev["rank"][mods].astype(np.int64)
    t0 = ev["t0_ns"][mods].astype(np.int64)
    t1 = np.maximum(ev["t1_ns"][mods].astype(np.int64), t0)
    inside = (t0 < ends[r]) & (t1 > start[r])
    mods, is_file = mods[inside], is_file[inside]
    r, t0, t1 = r[inside], t0[inside], np.minimum(t1[inside], ends[r[inside]])
    n = len(start)
    site = ev["site_id"][mods].astype(np.int64)
    imp = import_time_ns(r, t0, t1, start.astype(np.int64), n, gap_ns, site)
    m = start.astype(np.int64) + imp.astype(np.int64)  # where the rank's startup would end
    excess = np.zeros(n)
    # only on shared file systems: a local disk's slow call is the loaded machine's (a deschedule)
    slow = is_file & shared_fs_rows(run, mods)
    np.add.at(excess, r, np.where(slow, np.maximum(0.0, (t1 - t0) - healthy_ns), 0.0))
    file_s = np.bincount(r, weights=np.where(is_file, t1 - t0, 0), minlength=n) / 1e9
    calls = np.bincount(r[is_file], minlength=n)
    # the floor the counterfactual keeps, per breakdown column, for the report's coverage
    # (distdiag.ranking.coverage): the imports, their file calls, the communicator creation
    init_s = union_length_by_key(r[~is_file], t0[~is_file], t1[~is_file], n) / 1e9
    e_cf = float((m[present] - excess[present]).max())
    # and at the first rendezvous, the wait for the last rank to get there that the counterfactual
    # keeps (for the latest rank's floor): at most the rank's recorded wait there, from its
    # startup's end to the last rank's (a rank that finished MPI_Init 0.34 s before another
    # waited 0.27 s in the first Barrier of a healthy 4-rank job, in its comm_wait_s)
    first_wait_s = np.maximum(0.0, np.minimum(float(e.max()) - e, e_cf - (m[present] - excess[present]))) / 1e9
    kept = {int(q): {"startup_s": float(imp[q]) / 1e9, "io_s": float(file_s[q]), "other_s": float(init_s[q]),
                     "comm_wait_s": float(first_wait_s[i])}
            for i, q in enumerate(present)}  # fmt: skip
    cost_s = max(0.0, (int(e.max()) - e_cf) / 1e9)
    fl = Floor(present=present, s0=s0, e=e, imp=imp, m=m, excess=excess, file_s=file_s, calls=calls,
               kept=kept, healthy_ns=healthy_ns, cost_s=cost_s)  # fmt: skip
    run.cache.startup_floor[key] = fl
    return fl


def module_rows(run: Run) -> np.ndarray:
    """The run's file rows on module paths (imports), ascending (one test a distinct path)."""
    rows = rows_of(run, tuple(int(k) for k in FILE_KINDS))
    if len(rows) == 0:
        return rows
    nid = run.events["name_id"][rows]
    uniq, inv = np.unique(nid, return_inverse=True)
    is_mod = np.fromiter((is_module_path(run.s(int(u))) for u in uniq), bool, len(uniq))  # distinct paths
    return np.asarray(rows[is_mod[inv]])


def import_time_ns(r: np.ndarray, t0: np.ndarray, t1: np.ndarray, start: np.ndarray, n: int, gap_ns: float,
                   site: np.ndarray | None = None) -> np.ndarray:
    """Per rank, its import time: the union of its module file calls ``[t0, t1)`` and the gaps
    between them shorter than ``gap_ns`` or between two calls from the same call site ``site``
    (one ``import`` statement, or one call that imports lazily), and from its ``start`` to the
    first one (the interpreter and the shim before the program's first import: never setup).

    Rows sorted by (rank, t0) (sorted here when not). Each row adds what sticks out past the
    furthest end before it in its rank (``reach``, the rank's start for its first row), plus
    the gap before it when that is under ``gap_ns``. Worked example (ms), start 0, gap 500:
    [10, 20) [100, 130) [900, 910) -> 10 + 10 + 80 + 30 + 0 + 10 = 140; with sites 5, 7, 7:
    the 770 ms between the last two count too: 910."""
    if len(r) == 0:
        return np.zeros(n)
    if site is None:
        site = np.zeros(len(r), np.int64)
    if not bool(np.all((r[1:] > r[:-1]) | ((r[1:] == r[:-1]) & (t0[1:] >= t0[:-1])))):
        o = np.lexsort((t0, r))
        r, t0, t1, site = r[o], t0[o], t1[o], site[o]
    lo = int(min(int(t0.min()), int(start[r].min())))
    span = int(t1.max()) - lo + 1
    key = r * span  # each rank in its own band: one running max over all rows never crosses ranks
    reach = np.empty(len(r), np.int64)
    reach[1:] = np.maximum.accumulate(key[:-1] + (t1[:-1] - lo))
    first = np.r_[True, r[1:] != r[:-1]]
    reach[first] = key[first] + (start[r[first]] - lo)
    reach = np.maximum(reach, key + (start[r] - lo)) - key + lo  # back to times; never before the start
    gap = t0 - reach
    same = np.r_[False, (site[1:] == site[:-1]) & (site[1:] > 0)] | first  # a rank's lead-in always counts
    got = np.maximum(0, t1 - np.maximum(t0, reach)) + np.where((gap > 0) & ((gap < gap_ns) | same), gap, 0)
    return np.bincount(r, weights=got.astype(np.float64), minlength=n)
