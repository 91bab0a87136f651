"""The clock model as a value: every rank's map from its own clock onto the reference's, and
the causality repairs, applied to rows wherever they are read (:mod:`distdiag.clocks` fits
the model and checks causality; :mod:`distdiag.run`'s stream re-reader and ``--parallel``'s
analysis ranks map the rows they read with it). It imports nothing of the analyzer, so the
loader and the fit do not import each other."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

#: Controlled logical clock: a repaired jump decays at (1 - GAMMA) ns per ns.
GAMMA = 0.99


@dataclass
class RankClock:
    """How one rank's clock maps onto the reference timeline.

    ``offset(t) = y0_ns + interp(t - x0_ns, knots_x, knots_y)``, extrapolated
    with ``slope`` outside the knots; ``t_ref = t + offset(t)``. Bases are
    integers so that float64 only ever holds differences (a clock at 1.8e18 ns
    would lose 256 ns in a float).
    """

    rank: int
    #: "reference" | "sync" (linear) | "sync-piecewise" | "sync-single" |
    #: "collective-exits" | "wall-clock" | "none"
    method: str
    x0_ns: int = 0
    y0_ns: int = 0
    knots_x: np.ndarray = field(default_factory=lambda: np.zeros(1))
    knots_y: np.ndarray = field(default_factory=lambda: np.zeros(1))
    #: offset change per local ns outside (and, in linear mode, between) the knots
    slope: float = 0.0
    #: residual uncertainty of the mapping (ns); inf when unaligned
    bound_ns: float = 0.0
    #: bound growth per ns away from the knots (the drift's uncertainty)
    bound_growth: float = 0.0
    n_samples: int = 0
    n_windows: int = 0
    best_rtt_ns: int = -1

    @property
    def drift_ppm(self) -> float:
        """How much faster this rank's clock runs than the reference's, in ppm.

        ``t_ref = t (1 + slope) + c``, so the rank's rate over the reference's is
        ``1 / (1 + slope)``."""
        return (1.0 / (1.0 + self.slope) - 1.0) * 1e6

    def offset_ns(self, t_ns: np.ndarray) -> np.ndarray:
        """Offset (int64 ns) to add to local times ``t_ns`` (int64 array).

        Between the knots: ``np.interp``'s numbers. With two knots (every linear
        model) they are computed as np.interp computes them, ``(y1 - y0) / (x1 -
        x0) * (x - x0) + y0`` and ``y1`` at ``x1`` (the same float operations in the
        same order: equal to the last bit, checked against np.interp in
        tests/test_clock_model.py), as whole-array arithmetic: np.interp's
        per-element search took half of the mapping's time (8 ns an element,
        measured). Outside them the slope extrapolates. The masks of the
        times at the last knot, before the first and after the last are only
        built when the times' min and max say some exist (two passes instead
        of six in the usual block that lies between the knots)."""
        t = np.asarray(t_ns, dtype=np.int64)
        x = (t - self.x0_ns).astype(np.float64)
        kx, ky = self.knots_x, self.knots_y
        if x.size == 0:
            return np.zeros(t.shape, np.int64)
        x_min, x_max = x.min(), x.max()  # finite: int64 differences
        if len(kx) == 2 and kx.dtype == ky.dtype == np.float64 and kx[1] > kx[0]:
            y = x - kx[0]
            y *= (ky[1] - ky[0]) / (kx[1] - kx[0])
            y += ky[0]
            if x_min <= kx[1] <= x_max:
                at_end = x == kx[1]
                if at_end.any():
                    y[at_end] = ky[1]
        else:
            y = np.interp(x, kx, ky)
        if x_min < kx[0]:
            lo = x < kx[0]
            y[lo] = ky[0] + self.slope * (x[lo] - kx[0])
        if x_max > kx[-1]:
            hi = x > kx[-1]
            y[hi] = ky[-1] + self.slope * (x[hi] - kx[-1])
        np.rint(y, out=y)
        off: np.ndarray = y.astype(np.int64)
        off += self.y0_ns
        return off

    def map(self, t_ns: np.ndarray) -> np.ndarray:
        t = np.asarray(t_ns, dtype=np.int64)
        out: np.ndarray = t + self.offset_ns(t)
        return out

    def bound_at(self, t_ns: np.ndarray) -> np.ndarray:
        """The uncertainty (ns) at local times ``t_ns``: grows away from the knots when drift is unknown."""
        t = np.asarray(t_ns, dtype=np.int64)
        if self.bound_growth == 0.0:
            return np.full(t.shape, self.bound_ns)
        x = (t - self.x0_ns).astype(np.float64)
        dist = np.maximum(self.knots_x[0] - x, 0) + np.maximum(x - self.knots_x[-1], 0)
        out: np.ndarray = self.bound_ns + self.bound_growth * dist
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "method": self.method,
            "offset_ns": int(self.offset_ns(np.array([self.x0_ns]))[0]),
            "drift_ppm": round(self.drift_ppm, 3),
            "bound_us": round(self.bound_ns / 1e3, 3) if np.isfinite(self.bound_ns) else None,
            "bound_growth_ppm": round(self.bound_growth * 1e6, 3),
            "samples": self.n_samples,
            "windows": self.n_windows,
            "best_rtt_us": round(self.best_rtt_ns / 1e3, 3) if self.best_rtt_ns >= 0 else None,
        }


@dataclass
class ClockModel:
    """Every rank's clock model plus what the causality check found."""

    ref_rank: int
    ranks: dict[int, RankClock]
    #: bound per rank at the end of its record (ns), indexed by rank (inf = unaligned)
    bound_ns: np.ndarray
    warnings: list[str] = field(default_factory=list)
    #: member exits of synchronizing collectives checked / before the last entry
    causality_checked: int = 0
    violations: int = 0
    violations_beyond_bound: int = 0
    max_violation_ns: int = 0
    violations_after_repair: int = 0
    repair_passes: int = 0
    #: rank -> (constraint times, lower bounds) per repair pass, on the aligned timeline
    repairs: list[dict[int, tuple[np.ndarray, np.ndarray]]] = field(default_factory=list, repr=False)
    #: the origin the repairs' float arithmetic used (:func:`_clc_map`): rows mapped later
    #: (a streamed band, distdiag.run._Stream) must use the same one to get the same nanoseconds
    repair_base: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "ref_rank": self.ref_rank,
            "ranks": [self.ranks[r].to_json() for r in sorted(self.ranks)],
            "causality": {
                "checked": self.causality_checked,
                "violations": self.violations,
                "beyond_bound": self.violations_beyond_bound,
                "max_violation_us": round(self.max_violation_ns / 1e3, 3),
                "after_repair": self.violations_after_repair,
                "repair_passes": self.repair_passes,
            },
        }


def map_by_rank(times: np.ndarray, ranks: np.ndarray, models: dict[int, RankClock]) -> tuple[np.ndarray, np.ndarray]:
    """(mapped times, mapped?) for any arrays of local times and their ranks; -1 stays -1."""
    out = times.astype(np.int64).copy()
    done = np.zeros(len(times), bool)
    if len(times) == 0:
        return out, done
    is_sorted = bool((ranks[1:] >= ranks[:-1]).all())
    # Events come sorted by rank: then each rank is a slice (views, no gather/scatter).
    order = None if is_sorted else np.argsort(ranks, kind="stable")
    rs = ranks if order is None else ranks[order]
    bounds = np.flatnonzero(np.r_[True, rs[1:] != rs[:-1], True])
    for lo, hi in zip(bounds[:-1], bounds[1:]):  # per rank: numpy inside
        m = models.get(int(rs[lo]))
        if m is None:
            continue
        idx: Any = slice(lo, hi) if order is None else order[lo:hi]
        t = out[idx]
        valid = t != -1
        if valid.all():
            t = m.map(t)
        else:
            t[valid] = m.map(t[valid])
        out[idx] = t
        done[idx] = True
    return out, done


def _rank_spans(ranks: np.ndarray) -> list[tuple[int, int, int]] | None:
    """(rank, lo, hi) of each run of equal ranks when ``ranks`` is sorted, else None
    (vectorized on a contiguous copy of the column; the loop is per rank)."""
    if len(ranks) == 0:
        return []
    r = np.ascontiguousarray(ranks)
    if not bool((r[1:] >= r[:-1]).all()):
        return None
    lo = np.flatnonzero(np.r_[True, r[1:] != r[:-1]])
    hi = np.append(lo[1:], len(r))
    return [(int(k), int(a), int(b)) for k, a, b in zip(r[lo], lo, hi)]


def map_inplace(table: np.ndarray, cols: tuple[str, ...], models: dict[int, RankClock], on_block: Any = None) -> None:
    """Map the time columns ``cols`` of ``table`` (the event table) in place.

    The same numbers as ``map_by_rank`` (each row by its own rank's model, -1
    stays -1) without a full-size copy of the table or of a column: the table
    goes by blocks of ``_MAP_ROWS`` rows, and each block's rank column (read
    while its rows are in cache) splits it into runs of one rank, each run's
    columns mapped with that rank's model. Rows are mapped one by one, so no
    order of the table is assumed: a block with many runs (a table not
    sorted by rank) is mapped by :func:`map_by_rank`, which sorts it.
    Measured at 1024x10k (20.5 M times, CPU s, alternating runs): 0.53 -> 0.32-0.37
    (most of it :meth:`RankClock.offset_ns` without np.interp's per-element
    search). Then at 64 x 100k (12.8 M times): the rank runs found per block
    instead of by a full-size contiguous copy of the rank column and a pass
    checking its order (0.04-0.08 s), and :meth:`RankClock.offset_ns`'s range
    checks by the block's min and max: 0.26-0.30 -> 0.16-0.24 (4 runs each, loaded
    2-core machine).

    ``on_block(rows, lo)``, if given, is called with each block once its columns
    are mapped (rows ``lo:lo + len(rows)``, in table order): align's collective
    selection (:class:`distdiag.match.KeySelector`) reads the block while it is
    in cache."""
    views = [table[c] for c in cols]
    rank_col = table["rank"]
    for a in range(0, len(table), _MAP_ROWS):  # per block of the table: every column while in cache
        b = min(len(table), a + _MAP_ROWS)
        r = np.ascontiguousarray(rank_col[a:b])
        cut = np.flatnonzero(r[1:] != r[:-1])
        if len(cut) > _MAP_MAX_RUNS:  # not rank-sorted here: each rank's rows gathered
            for col in views:  # a couple of time columns
                col[a:b], _ = map_by_rank(col[a:b], r, models)
        else:
            edges = [0, *(cut + 1).tolist(), b - a]
            for lo, hi in zip(edges[:-1], edges[1:]):  # per run of one rank in the block (1-2 when sorted)
                m = models.get(int(r[lo]))
                if m is None:
                    continue
                for col in views:  # a couple of time columns
                    t = col[a + lo : a + hi].astype(np.int64)
                    invalid = t == -1
                    if not invalid.any():
                        col[a + lo : a + hi] = m.map(t)
                    else:
                        valid = ~invalid
                        t[valid] = m.map(t[valid])
                        col[a + lo : a + hi] = t
        if on_block is not None:
            on_block(table[a:b], a)


#: More runs of one rank than this in a block of :func:`map_inplace`: the block is
#: mapped by :func:`map_by_rank` (a sort, no Python loop per run).
_MAP_MAX_RUNS = 16


#: Rows per block of :func:`map_inplace`: both time columns of a block are mapped
#: while its 73-byte rows are in cache (1.2 MB).
_MAP_ROWS = 1 << 14


def _clc_map(t: np.ndarray, tau: np.ndarray, low: np.ndarray, base: int) -> np.ndarray:
    """Controlled logical clock for one rank: the least monotone map with f(t) >= t,
    f(tau_j) >= low_j, and slope >= GAMMA after each forced jump.

    The CLC recurrence c_i = max(lower_i, c_{i-1} + GAMMA (t_i - t_{i-1})) becomes,
    with u_i = c_i - GAMMA t_i, a running maximum: u_i = max(lower_i - GAMMA t_i, u_{i-1}).
    So f(t) = max(t, GAMMA t + max_{tau_j <= t}(low_j - GAMMA tau_j)). Vectorized.
    """
    order = np.argsort(tau, kind="stable")
    tau_r = (tau[order] - base).astype(np.float64)
    cm = np.maximum.accumulate((low[order] - base).astype(np.float64) - GAMMA * tau_r)
    x = (t - base).astype(np.float64)
    j = np.searchsorted(tau_r, x, side="right") - 1
    f = x.copy()
    has = j >= 0
    f[has] = np.maximum(x[has], GAMMA * x[has] + cm[j[has]])
    return base + np.rint(f).astype(np.int64)


def apply_repairs(t: np.ndarray, ranks: np.ndarray, repairs: list[dict[int, tuple[np.ndarray, np.ndarray]]], base: int) -> np.ndarray:
    """Apply every repair pass's per-rank CLC map to times ``t`` of ranks ``ranks`` (-1 stays -1)."""
    out = t.astype(np.int64).copy()
    if not repairs or len(out) == 0:
        return out
    order = np.argsort(ranks, kind="stable")  # one sort; then each rank is a slice
    rs = ranks[order]
    touched = sorted({r for rep in repairs for r in rep})
    lo = np.searchsorted(rs, touched, side="left")
    hi = np.searchsorted(rs, touched, side="right")
    for r, a, b in zip(touched, lo, hi):  # ranks with violations
        if a == b:
            continue
        idx = order[a:b]
        v = out[idx]
        ok = v != -1
        for rep in repairs:  # a handful of passes, in order
            if r in rep:
                tau, low = rep[r]
                v[ok] = _clc_map(v[ok], tau, low, base)
        out[idx] = v
    return out


def repair_table(tab: np.ndarray, repairs: list[dict[int, tuple[np.ndarray, np.ndarray]]], base: int) -> None:
    """Apply the repairs to the t0/t1 columns of a table of rows with a rank column, in place."""
    if not len(tab):
        return
    spans = _rank_spans(tab["rank"])
    if spans is None:
        er = tab["rank"].astype(np.int64)
        tab["t0_ns"] = apply_repairs(tab["t0_ns"], er, repairs, base)
        tab["t1_ns"] = apply_repairs(tab["t1_ns"], er, repairs, base)
        return
    # rank-sorted (always, from load_run): repair only the touched ranks' slices
    touched = {rk for rep in repairs for rk in rep}
    for rk, lo, hi in spans:  # per rank; numpy inside
        if rk not in touched:
            continue
        sl = tab[lo:hi]
        rr = np.full(hi - lo, rk, np.int64)
        for c in ("t0_ns", "t1_ns"):  # two time columns
            sl[c] = apply_repairs(sl[c], rr, repairs, base)
