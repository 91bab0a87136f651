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

The passes: :class:`distdiag.breakdown.BreakdownPass`, :class:`distdiag.critical_path.CostsPass`
and :class:`distdiag.slurm.FirstsPass`.
"""

from __future__ import annotations

from typing import Any, Generic, Sequence, TypeVar

from distdiag.bands import Band, bands

A = TypeVar("A")
P = TypeVar("P")
R = TypeVar("R")

class Pass(Generic[A, P, R]):
    """A per-rank pass (see the module docstring); subclasses define the four steps."""

    #: what it computes, for logs and errors
    name = "pass"

    def begin(self, run: Any, part: tuple[int, int] | None) -> A:
        raise NotImplementedError

    def add(self, acc: A, band: Band) -> None:
        raise NotImplementedError

    def part(self, acc: A) -> P:
        raise NotImplementedError

    def reduce(self, run: Any, parts: list[P]) -> R:
        raise NotImplementedError


def sweep(run: Any, passes: Sequence[Pass[Any, Any, Any]], part: tuple[int, int] | None = None,
          band_events: int | None = None) -> list[Any]:  # fmt: skip
    """Each pass's part of block ``part`` (None: every band), the bands walked once for all."""
    accs = [p.begin(run, part) for p in passes]
    for band in bands(run, band_events, part=part):  # a few bands, each vectorized
        for p, acc in zip(passes, accs):  # a handful of passes
            p.add(acc, band)
        del band
    return [p.part(acc) for p, acc in zip(passes, accs)]


def run_local(run: Any, passes: Sequence[Pass[Any, Any, Any]], band_events: int | None = None) -> list[Any]:
    """Each pass's result over every band, in one sweep: the local executor."""
    parts = sweep(run, passes, None, band_events)
    return [p.reduce(run, [got]) for p, got in zip(passes, parts)]
