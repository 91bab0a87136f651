"""Per-rank passes over bands of ranks, and the sweep that runs several of them at once (issue 19).

A *pass* computes numbers that are each rank's own (the breakdown's unions, the input
waits' critical path, each rank's first rendezvous) from the rows of its ranks, one
:class:`distdiag.bands.Band` at a time. It has four steps, the shape of a map and a reduce:

* ``begin(run, part)``: its accumulator for the bands of block ``part`` (``(j, n)``: block
  j of n, :func:`distdiag.bands.part_edges`; None: every band), arrays sized by the run;
* ``add(acc, band)``: one band's ranks into it (a few numpy calls, never a loop per row);
* ``part(acc)``: what the block gives (only its own ranks' numbers, so blocks that cover
  every band once put together are the one pass exactly);
* ``reduce(run, parts)``: the result, from the parts of blocks that cover every band once.

:func:`sweep` walks the bands of one block once and feeds each band to every pass it is
given: a streamed run (:mod:`distdiag.run`) reads each band's rows from the rank files once
for all of them, where each pass used to read them again. :func:`run_local` is the local
executor (one block: every band, then each pass's reduce of its one part); ``distdiag
analyze --parallel`` (:mod:`distdiag.parallel`) runs the same passes with :func:`sweep` on
block k of K on analysis rank k and reduces the K parts on rank 0. Nothing a pass computes
may depend on where the bands fall or on how the blocks are cut: the tests run each pass
with one band and many, one block and several, and compare.

The passes: :class:`distdiag.breakdown.BreakdownPass` and ``StartupEndsPass``,
:class:`distdiag.critical_path.CostsPass`, :class:`distdiag.slurm.FirstsPass`, and
:class:`RowsPass` (a few columns of some kinds' rows, gathered: the collective rows' ``aux``
that :mod:`distdiag.mismatch` reads, the stalls ``io_bandwidth`` overlaps).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Generic, Sequence, TypeVar

import numpy as np

from distdiag.bands import Band, bands
from distdiag.cache import PassResult

if TYPE_CHECKING:
    from distdiag.match import Collectives
    from distdiag.run import Run

A = TypeVar("A")
P = TypeVar("P")
R = TypeVar("R")


class Pass(Generic[A, P, R]):
    """A per-rank pass (see the module docstring); subclasses define the four steps."""

    def begin(self, run: Run, part: tuple[int, int] | None) -> A:
        raise NotImplementedError

    def add(self, acc: A, band: Band) -> None:
        raise NotImplementedError

    def part(self, acc: A) -> P:
        raise NotImplementedError

    def reduce(self, run: Run, parts: list[P]) -> R:
        raise NotImplementedError


def sweep(run: Run, passes: Sequence[Pass[Any, Any, Any]], part: tuple[int, int] | None = None,
          band_events: int | None = None) -> list[Any]:  # fmt: skip
    """Each pass's part of block ``part`` (None: every band), the bands walked once for all."""
    accs = [p.begin(run, part) for p in passes]
    for band in bands(run, band_events, part=part):  # a few bands, each vectorized
        for p, acc in zip(passes, accs):  # a handful of passes
            p.add(acc, band)
        del band
    return [p.part(acc) for p, acc in zip(passes, accs)]


def analysis_passes(colls: Collectives, firsts: bool, costs: bool) -> dict[PassResult, Pass[Any, Any, Any]]:
    """The per-rank passes an analysis sweeps, keyed by the ``run.cache`` attribute where the stage
    that reads each looks for its result: the Slurm view's per-rank firsts (``firsts``), the
    critical path of input waits and copies (``costs``), the breakdown and each rank's end of
    start-up. Without a match (``colls`` None: an analysis rank whose job could not be made)
    only the passes that need none. The one list the pipeline (:func:`run_local`) and
    ``--parallel``'s blocks (:func:`sweep`) both run."""
    from distdiag.breakdown import BreakdownPass, StartupEndsPass
    from distdiag.critical_path import PRICED_KINDS, CostsPass
    from distdiag.slurm import FirstsPass

    todo: dict[PassResult, Pass[Any, Any, Any]] = {}
    if firsts:
        todo["rank_firsts"] = FirstsPass()
    if costs and colls is not None:
        todo["priced_costs"] = CostsPass(PRICED_KINDS)
    if colls is not None:
        todo["tallies"] = BreakdownPass(colls)
    todo["startup_ends"] = StartupEndsPass()
    return todo


def run_local(run: Run, passes: Sequence[Pass[Any, Any, Any]], band_events: int | None = None) -> list[Any]:
    """Each pass's result over every band, in one sweep: the local executor."""
    parts = sweep(run, passes, None, band_events)
    return [p.reduce(run, [got]) for p, got in zip(passes, parts)]


class _Gathered:
    """:class:`RowsPass`'s accumulator: the columns taken from each band so far."""

    def __init__(self, dtype: np.dtype, fields: tuple[str, ...]) -> None:
        self.empty = [np.zeros(0, dtype[f]) for f in fields]
        self.pieces: list[list[np.ndarray]] = []


class RowsPass(Pass[_Gathered, list[np.ndarray], list[np.ndarray]]):
    """The columns ``fields`` of the rows of ``kinds`` that ``keep(events, rows)`` (a bool per
    row; None: all) selects, in table order: a gather, for the stages that need a few columns
    of some kinds whatever the mode (a streamed run holds its collective rows on disk once
    matched). Only those columns outlive a band. Its part and its result: one array a field."""

    def __init__(self, kinds: Any, fields: tuple[str, ...],
                 keep: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None) -> None:  # fmt: skip
        self.kinds, self.fields, self.keep = kinds, fields, keep

    def begin(self, run: Run, part: tuple[int, int] | None) -> _Gathered:
        return _Gathered(run.events.dtype, self.fields)

    def add(self, acc: _Gathered, band: Band) -> None:
        sel = band.rows(self.kinds)
        if self.keep is not None:
            sel = sel[self.keep(band.events, sel)]
        acc.pieces.append([band.events[f][sel] for f in self.fields])

    def part(self, acc: _Gathered) -> list[np.ndarray]:
        return self.reduce(None, acc.pieces) if acc.pieces else acc.empty

    def reduce(self, run: Run | None, parts: list[list[np.ndarray]]) -> list[np.ndarray]:
        if len(parts) == 1:
            return parts[0]
        return [np.concatenate([p[i] for p in parts]) for i in range(len(self.fields))]
