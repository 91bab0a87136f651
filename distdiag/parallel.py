"""``distdiag analyze --parallel RUN_DIR`` under ``mpiexec -n K`` / ``srun -n K``.

The analysis itself runs on MPI, the engine every cluster whose jobs we
diagnose already has. What is split today, and why the result is the serial
result exactly:

1. **Per-rank work** (reading and decoding the rank files: HDF5 reads, schema
   and damage checks, the columnar tables, per-file warnings) is split by
   blocks of rank files: analysis rank k reads files ``[k*F/K, (k+1)*F/K)``.
   This is the one stage whose cost grows with the file count and the I/O,
   and it needs nothing from other files.
2. **Reduce**: each analysis rank ships its decoded tables to analysis rank 0
   (metadata pickled; the event rows, packed with their rank column while
   reading, as one raw byte buffer, no pickling); rank 0 takes every block's
   metadata first, allocates the run's table once at its exact size and
   receives each block's rows straight into its slice of it, then assembles them with the same function :func:`distdiag.run.load_run`
   uses (``run._assemble``), in file order, and runs the same
   ``analyze_run``. Same inputs to the same functions: the JSON report is
   byte-for-byte the serial one (tests/test_parallel.py checks that under
   ``mpiexec -n 3``).

Not split yet (measured, see benchmarks/bench_scale.py and the closing
note of issue 10): clock alignment, collective matching by sequence ranges,
and the detectors still run on analysis rank 0 over the whole run, so the
speed-up is bounded by the share of the reading in the total (Amdahl), and
rank 0 still needs the memory of the whole run.

What comes next (design, not built; see also distdiag/run.py):

* Clock model: each analysis rank fits its ranks' sync rows (independent per
  rank; the exit fallback needs the matched collectives, so it stays on the
  owners below), maps its own rows in place, and ships aligned rows.
* Matching by sequence ranges: the collective rows are the only cross-rank
  input. Each analysis rank sends each (comm, seq) row to the owner of that
  seq range (``block_of`` over seq, one ``Alltoallv`` of the collective
  columns, ~45 B a row); owners run ``match_collectives`` on their ranges
  (groups never straddle owners: a group is one (comm, seq)).
* Per-rank stages (breakdown unions, input/h2d/io/metadata detectors) run
  where the rank's rows were read; their per-rank partials are gathered (a
  few numbers per rank). Group stages (straggler, serial section, mismatch,
  hang) run on each owner's groups plus the last group of the previous range
  (straggler's inherited lateness looks one seq back); findings are reduced
  on rank 0 and ranked there, as now.
* Byte-identical output is kept by reducing in (comm, seq) / rank order and
  rendering only on rank 0, as the serial path orders them.

Streaming (``distdiag.bands``, a run over ``Config.stream_events`` rows) works
as in the serial analysis: each analysis rank leaves the compute phases out of
what it ships (they are read again from the files, band by band, by the stages
that need them), and ships its kept collective rows apart (``COLL_ROW_DTYPE``)
with each file's small sig table; rank 0 re-points them into one buffer and
assembles the same streamed Run, so it holds what a streamed serial analysis
holds, not the whole table.

Errors: a problem that leaves nothing to analyze is raised on rank 0 as
:class:`DistdiagError` (the CLI prints one line); the other ranks return
quietly. Every rank returns from :func:`analyze_parallel`, nobody hangs.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np

from distdiag.run import (
    COLL_ROW_DTYPE,
    RUN_EVENT_DTYPE,
    DistdiagError,
    _anon,
    _assemble,
    _capacity_rows,
    _Packer,
    _populate,
    _RankData,
    _read_rank,
    new_table,
    rank_files_of,
    streamed_kinds_for,
)

log = logging.getLogger(__name__)

#: tags of the byte buffers holding event rows and kept collective rows
_TAG_EVENTS = 17
_TAG_COLL = 18
_TAG_PART = 19


def block_of(k: int, n_workers: int, n_items: int) -> tuple[int, int]:
    """Analysis rank k's contiguous block [lo, hi) of n_items (sizes differ by at most one)."""
    return (k * n_items) // n_workers, ((k + 1) * n_items) // n_workers


def _read_block(
    files: list[Path], streamed: tuple[int, ...] = ()
) -> tuple[list[tuple[_RankData | str, list[str]]], _Packer]:
    """This analysis rank's files, their event rows packed into one buffer (see ``run._Packer``);
    rows of the ``streamed`` kinds left out as :func:`distdiag.run.load_run` leaves them."""
    out = []
    packer = _Packer(_capacity_rows(files), drop=streamed)
    for fp in files:  # one per rank file of this block
        w: list[str] = []
        d = _read_rank(fp, w, packer)
        if isinstance(d, _RankData):
            packer.take(d)
        out.append((d, w))
    return out, packer


def _stream_limit(cfg: Any) -> int:
    from distdiag.config import Config

    return int((cfg or Config()).stream_events)


def _gather_collectives(comm: Any, packer: _Packer, parts: list[dict[Path, tuple[int, int, np.ndarray]]],
                        used: list[int]) -> None:
    """Rank 0: every analysis rank's kept collective rows (a streamed run) into one buffer, in
    file order, with each file's (offset, rows, sig table) re-pointed into it."""
    from mpi4py import MPI

    assert packer.coll is not None
    total = int(sum(used))
    if len(packer.coll) < total:
        buf = _anon(total, COLL_ROW_DTYPE)
        buf[: used[0]] = packer.coll[: used[0]]
    else:
        buf = packer.coll
    merged: dict[Path, tuple[int, int, np.ndarray]] = {}
    off = 0
    for src, (pp, n) in enumerate(zip(parts, used)):  # per analysis rank, in file order
        if src and n:
            comm.Recv([buf[off : off + n].view(np.uint8), MPI.BYTE], source=src, tag=_TAG_COLL)
        for path, (o, c, table) in pp.items():  # per rank file of that block
            merged[path] = (off + o, c, table)
        off += n
    packer.coll, packer.coll_used, packer.coll_parts = buf, total, merged


class _BreakdownSplit:
    """Rank 0's side of the breakdown's band passes run on the other analysis ranks.

    A streamed run's breakdown reads every rank's rows again from the files (the
    longest stage at 1,024 x 100k: ~15 s of the streamed analysis). Once the
    collectives are matched, rank 0 broadcasts the run (its resident rows, the
    clock model, what the stream needs) and the match; analysis ranks 1..K-1
    each take a block of the bands (:func:`distdiag.breakdown.breakdown_part`)
    while rank 0 runs the detectors, and send their parts back before the
    breakdown, which puts them in place. A run in memory (not streamed) or K = 1
    keeps the breakdown on rank 0: the bands are views of the table there, and
    shipping the table would cost what the pass costs.
    """

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        self.sent = False
        self.workers = 0
        self.collected = False

    def matched(self, run: Any, colls: Any) -> None:
        n = self.comm.Get_size()
        job = None
        if n > 1 and run.streamed_kinds:
            cache = {k: run.cache[k] for k in ("clock_model",) if k in run.cache}
            job = (dataclasses.replace(run, cache=cache, warnings=[]), colls)
            self.workers = n - 1
        self.comm.bcast(job, root=0)
        self.sent = True

    def done(self, run: Any) -> None:
        from distdiag.breakdown import PARTS

        if not self.workers or self.collected:
            return
        parts = [self.comm.recv(source=src, tag=_TAG_PART) for src in range(1, self.workers + 1)]
        self.collected = True
        if not any(isinstance(p, str) for p in parts):  # one failed: rank 0 computes every band itself
            run.cache[PARTS] = [p for p in parts if p is not None]

    def abort(self) -> None:
        """Rank 0 failed: the others stop waiting for the run, or their parts are taken and dropped."""
        if not self.sent:
            self.comm.bcast(None, root=0)
            self.sent = True
        elif self.workers and not self.collected:
            for src in range(1, self.workers + 1):  # per analysis rank
                self.comm.recv(source=src, tag=_TAG_PART)
            self.collected = True


def _breakdown_worker(comm: Any) -> None:
    """Analysis rank k > 0: wait for rank 0's matched run; compute block k - 1 of its bands."""
    from distdiag.breakdown import breakdown_part

    job = comm.bcast(None, root=0)
    if job is None:
        return
    run, colls = job
    k, n = comm.Get_rank(), comm.Get_size()
    part: Any
    try:
        part = breakdown_part(run, colls, (k - 1, n - 1))
    except Exception as e:  # rank 0 computes the breakdown itself when a part is missing
        log.warning("analysis rank %d: breakdown part failed (%s: %s)", k, type(e).__name__, e)
        part = _FAILED
    comm.send(part, dest=0, tag=_TAG_PART)


#: a part an analysis rank could not compute (rank 0 then computes the whole breakdown itself)
_FAILED = "failed"


def analyze_parallel(run_dir: str | Path, cfg: Any = None, comm: Any = None, stream: bool = True) -> Any:
    """Analyze ``run_dir`` on every rank of ``comm`` (default COMM_WORLD).

    ``stream``: stream a run larger than ``cfg.stream_events`` rows as the serial CLI does
    (:func:`distdiag.run.streamed_kinds_for`): the analysis ranks leave the compute phases
    out while reading and ship only the kept rows, so rank 0 holds what a streamed serial
    analysis holds; the report is the same either way.

    Returns the :class:`distdiag.pipeline.Report` on rank 0 and None elsewhere.
    ``report.run.cache["parallel"]`` holds the seconds of each stage on rank 0.
    """
    from mpi4py import MPI

    comm = comm if comm is not None else MPI.COMM_WORLD
    k, n_workers = comm.Get_rank(), comm.Get_size()
    t_start = time.perf_counter()
    files: list[Path] | None = None
    p: Path | None = None
    err: str | None = None
    streamed: tuple[int, ...] = ()
    if k == 0:
        try:
            p, files = rank_files_of(run_dir)
            streamed = streamed_kinds_for(run_dir, _stream_limit(cfg)) if stream else ()
        except DistdiagError as e:
            err = str(e)
    files, streamed, err = comm.bcast((files, streamed, err), root=0)
    if err is not None:
        if k == 0:
            raise DistdiagError(err)
        return None
    assert files is not None  # for mypy: bcast gave the list when err is None
    lo, hi = block_of(k, n_workers, len(files))
    mine, packer = _read_block(files[lo:hi], streamed)
    t_read = time.perf_counter()

    if k != 0:
        # Metadata pickled (small); the event rows (rank column attached) as the
        # packed buffer's raw bytes: already one contiguous block, no copy.
        meta = []
        counts = []
        for d, w in mine:  # per rank file
            counts.append(len(d.events) if isinstance(d, _RankData) else 0)
            if isinstance(d, _RankData):
                d = dataclasses.replace(d, events=np.zeros(0, RUN_EVENT_DTYPE))  # the rows go by buffer below
            meta.append((d, w))
        # streaming: what the left-out rows need (per file), the kept collective rows' parts
        comm.send((meta, counts, packer.stats, packer.coll_parts, packer.coll_used), dest=0)
        if packer.used:
            comm.Send([packer.buf[: packer.used].view(np.uint8), MPI.BYTE], dest=0, tag=_TAG_EVENTS)
        if packer.coll is not None and packer.coll_used:
            comm.Send([packer.coll[: packer.coll_used].view(np.uint8), MPI.BYTE], dest=0, tag=_TAG_COLL)
        del mine, packer, meta
        _breakdown_worker(comm)
        return None

    # Rank 0: every block's metadata first, so the run's table is allocated once,
    # at its exact size, and each block's rows are received straight into it.
    blocks: list[list[tuple[_RankData | str, list[str]]]] = [mine]
    block_counts: list[list[int]] = [[len(d.events) if isinstance(d, _RankData) else 0 for d, _ in mine]]
    coll_used = [packer.coll_used]
    coll_parts = [packer.coll_parts]
    for src in range(1, n_workers):  # per analysis rank, in file order
        meta, counts, stats, parts, used = comm.recv(source=src)
        blocks.append(meta)
        block_counts.append(counts)
        packer.stats.update(stats)
        coll_parts.append(parts)
        coll_used.append(used)
    total = sum(sum(c) for c in block_counts)
    if len(packer.buf) >= total:  # rank 0's own buffer has room (K = 1, or a generous bound): no copy
        table = packer.buf[:total]
    else:
        table = new_table(total)
        _populate(table)  # every row is written below: fault the pages in at once (see run.new_table)
        table[: packer.used] = packer.buf[: packer.used]
    packer.buf = table  # rank 0's own views are re-pointed below, with everyone's
    off = 0
    got_all: list[_RankData | str] = []
    warnings: list[str] = []
    views: list[_RankData] = []
    for src, (blk, counts) in enumerate(zip(blocks, block_counts)):  # per analysis rank, in file order
        n_blk = int(sum(counts))
        if src and n_blk:
            comm.Recv([table[off : off + n_blk].view(np.uint8), MPI.BYTE], source=src, tag=_TAG_EVENTS)
        for (d, w), c in zip(blk, counts):  # per rank file of that block
            if isinstance(d, _RankData):
                d.events = table[off : off + c]
                views.append(d)
            off += c
            got_all.append(d)
            warnings.extend(w)
    packer.used, packer.views = total, views
    # then their collective rows (each analysis rank sends its events first, then these:
    # large sends complete only when received, so rank 0 takes them in that order)
    if packer.coll is not None:
        _gather_collectives(comm, packer, coll_parts, coll_used)
    t_gather = time.perf_counter()
    assert p is not None
    split = _BreakdownSplit(comm)
    try:
        run = _assemble(run_dir, p, files, got_all, warnings, packer)
    except BaseException:
        split.abort()
        raise
    del got_all, blocks, mine, packer
    t_assemble = time.perf_counter()

    from distdiag.config import Config
    from distdiag.pipeline import analyze_run

    try:
        report = analyze_run(run, cfg or Config(), inplace=True, split=split)  # the assembled run is ours alone
    except BaseException:
        split.abort()
        raise
    t_end = time.perf_counter()
    report.run.cache["parallel"] = {
        "workers": n_workers,
        "read_s": t_read - t_start,
        "gather_s": t_gather - t_read,
        "assemble_s": t_assemble - t_gather,
        "analyze_s": t_end - t_assemble,
        "total_s": t_end - t_start,
    }
    log.info("parallel analysis on %d ranks: %s", n_workers, report.run.cache["parallel"])
    return report


def main_from_args(ns: Any) -> int:
    """``distdiag analyze --parallel``: every analysis rank runs this; rank 0 renders."""
    from mpi4py import MPI

    from distdiag.config import load_config

    comm = MPI.COMM_WORLD
    try:
        cfg = load_config(ns.config)
        ok = True
    except DistdiagError:
        ok = False
    if not comm.allreduce(ok, op=MPI.LAND):  # a bad config: every rank stops, rank 0 says why
        if comm.Get_rank() == 0:
            cfg = load_config(ns.config)  # raises the one-line error for the CLI
        return 2
    # as the serial CLI: text and JSON draw no row, so a large run streams
    stream = ns.format in ("text", "json") and not getattr(ns, "perfetto", None)
    report = analyze_parallel(ns.run_dir, cfg, comm, stream=stream)
    if report is None:
        return 0
    from distdiag.cli import emit

    return emit(report, ns)
