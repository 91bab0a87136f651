"""``distdiag analyze --parallel RUN_DIR`` under ``mpiexec -n K`` / ``srun -n K``.

The analysis itself runs on MPI, the engine every cluster whose jobs we
diagnose already has. What is split, and why the result is the serial result
exactly (the same functions on the same inputs, reduced in the serial order):

1. **Reading** (HDF5 reads, schema and damage checks, the columnar tables,
   per-file warnings) is split by blocks of rank files: analysis rank k reads
   files ``[k*F/K, (k+1)*F/K)``. Each ships its decoded tables to rank 0
   (metadata pickled; the kept event rows as one raw byte buffer), which
   allocates the run's table once and receives each block straight into its
   slice, then assembles the Run with :func:`distdiag.run.load_run`'s own
   ``assemble``.
2. **Streaming.** A run over ``Config.stream_events`` rows (text and JSON
   output, as the serial CLI) is read with the compute phases left out on
   every analysis rank: rank 0 holds what a streamed serial analysis holds.
3. **The collective rows stay where they were read** (a streamed run, K > 1:
   :class:`_Held`, :class:`_Remote`). Rank 0 makes the run-wide tables from the
   files' small ones (string lookups, the sig table: ``run._coll_sig_maps``)
   and broadcasts them; each analysis rank makes its rows the serial
   ``coll_rows`` of its ranks in place. The serial stages' calls on those
   rows come to ``Run.coll_remote`` and are run by every analysis rank on its
   own rows: the clock map (:func:`distdiag.clocks.align`), the causality
   repairs (:func:`distdiag.clocks.check_causality`), and the **match, by
   (communicator, sequence) key ranges** (:func:`_match_share`): each row goes
   to the owner of its key range in one ``Alltoallv`` (37 bytes a row), each
   owner matches its range (:func:`distdiag.match.match_part`) and rank 0
   merges the parts (:func:`distdiag.match.merge_collectives`): the serial
   match, field by field. The raw match the clock fit needs for ranks without
   samples goes the same way.
4. **The per-rank band passes** (a streamed run, K > 1): once the match is
   made, rank 0 sends each analysis rank the run and its ranks' members of the
   match (:func:`_members_of`); the bands are cut in K blocks
   (:func:`distdiag.bands.part_edges`) and every analysis rank reads its
   block's files again, once, for every per-rank pass (:mod:`distdiag.passes`,
   one sweep: :func:`_sweep_block`): the Slurm view's per-rank firsts (a Slurm
   job: :class:`distdiag.slurm.FirstsPass`) and input_bound's / h2d_copy's
   critical path (rows of those kinds: :class:`distdiag.critical_path.CostsPass`),
   each rank's end of start-up (:class:`distdiag.breakdown.StartupEndsPass`) and
   the breakdown (:class:`distdiag.breakdown.BreakdownPass`), sent to rank 0 in
   one message. Rank 0 sweeps its own block the same way, takes the others'
   parts and puts each pass together (its ``reduce``) before its detectors; the
   breakdown's parts wait in place until after them. Each block writes only its
   own ranks' numbers, so the blocks put together are the one pass exactly.
   (Before the sweep, each of these was a pass of its own over the block's
   files, and rank 0 read every rank's files again for the start-up ends.)

Not split (measured in the closing notes of issue 10): the clock fit, the
causality check, the detectors and the ranking run on rank 0 over the matched
collectives (a few numbers per group) and the resident rows; the band passes
that ask about a few ranks (serial sections, hangs) read them on rank 0. A
run in memory (``--format html``, ``--perfetto``, or under ``stream_events``)
gathers everything on rank 0 after the split read.

Tests: tests/test_parallel.py, tests/test_parallel_match.py (every path of the
exchange, under ``mpiexec -n 2/3/4``, against the serial in-memory JSON and
match).

Errors: a problem that leaves nothing to analyze is raised on rank 0 as
:class:`DistdiagError` (the CLI prints one line); the other ranks return
quietly. A :class:`DistdiagError` rank 0 raises later ends the others' command
loop (:meth:`_Remote.abort`), and a part an analysis rank could not compute is
said in the log and made on rank 0. Anything else that escapes on any rank (a
bug, a ``MemoryError``, an error while the ranks are inside an exchange) cannot
be answered by the others, who wait in a receive that would never come: that
rank says so in one line (``distdiag: analysis rank 1 of 3 failed (IndexError:
...); ending all 3 analysis ranks``; the traceback with ``-v``) and calls
``MPI.COMM_WORLD.Abort``, which ends every analysis rank (:func:`_end_all`).
Rank 0's orderly :meth:`_Remote.abort` is bounded the same way
(:data:`ABORT_WAIT_S`): if the others do not answer in time, it ends them all.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from distdiag.cache import PassResult, RunCache
from distdiag.run import (
    COLL_ROW_DTYPE,
    RUN_EVENT_DTYPE,
    DistdiagError,
    assemble,
    capacity_rows,
    Packer,
    populate,
    RankData,
    read_rank,
    new_table,
    rank_files_of,
    streamed_kinds_for,
)

if TYPE_CHECKING:
    from distdiag.run import Run
    from distdiag.config import Config

log = logging.getLogger(__name__)

#: message tags: the event rows' byte buffers, the others' blocks and parts, their jobs
_TAG_EVENTS = 17
_TAG_PART = 19
_TAG_JOB = 20
_TAG_MATCH = 21


def block_of(k: int, n_workers: int, n_items: int) -> tuple[int, int]:
    """Analysis rank k's contiguous block [lo, hi) of n_items (sizes differ by at most one)."""
    return (k * n_items) // n_workers, ((k + 1) * n_items) // n_workers


def _read_block(
    files: list[Path], streamed: tuple[int, ...] = ()
) -> tuple[list[tuple[RankData | str, list[str]]], Packer]:
    """This analysis rank's files, their event rows packed into one buffer (see ``run.Packer``);
    rows of the ``streamed`` kinds left out as :func:`distdiag.run.load_run` leaves them."""
    out = []
    packer = Packer(capacity_rows(files), drop=streamed)
    for fp in files:  # one per rank file of this block
        w: list[str] = []
        d = read_rank(fp, w, packer)
        if isinstance(d, RankData):
            packer.take(d)
        out.append((d, w))
    return out, packer


def _stream_limit(cfg: Config | None) -> int:
    from distdiag.config import Config

    return int((cfg or Config()).stream_events)


class _Held:
    """One analysis rank's own kept collective rows of a streamed run (``COLL_ROW_DTYPE``):
    they stay where they were read. ``setup`` makes them what the serial run's
    ``coll_rows`` holds for those ranks (:func:`distdiag.run.finish_coll_rows`: sorted,
    global communicator ids and sigs), in rank order; the clock map and the causality
    repairs are applied to them in place as rank 0's align applies them to its table."""

    def __init__(self, packer: Packer) -> None:
        self.buf = packer.coll
        self.parts = dict(packer.coll_parts)  # this rank's files only: (offset, rows, sig table)
        self.rows = np.zeros(0, COLL_ROW_DTYPE)

    def setup(self, info: dict[Path, tuple[int, np.ndarray, np.ndarray, bool]]) -> None:
        from distdiag.run import finish_coll_rows

        mine = sorted((info[q][0], q) for q in self.parts if q in info)  # kept files, by rank
        spans = [self.parts[q][:2] for _, q in mine]
        in_order = all(o == a for (o, _), a in zip(spans, np.cumsum([0] + [n for _, n in spans])))
        total = sum(n for _, n in spans)
        assert self.buf is not None or total == 0
        rows = self.buf[:total] if (in_order and self.buf is not None) else np.empty(total, COLL_ROW_DTYPE)
        off = 0
        for (_, q), (o, n) in zip(mine, spans):  # per rank file of this block
            sl = rows[off : off + n]
            if not in_order:
                sl[:] = self.buf[o : o + n]  # type: ignore[index]
            _, lookup, sig_map, unsorted = info[q]
            finish_coll_rows(sl, lookup, sig_map, unsorted)
            off += n
        self.rows, self.buf, self.parts = rows, None, {}


def _take_rows(rows: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """``rows.take(idx)`` of a structured array, as whole records (a void view: 2-3x faster
    than the field-wise take of a 37-byte record, measured)."""
    void = np.dtype(f"V{rows.dtype.itemsize}")
    return rows.view(void).take(idx).view(rows.dtype)


def _send_big(comm: Any, obj: Any, dest: int, tag: int) -> None:
    """``comm.send(obj)``, but its numpy arrays go as raw buffers (pickle protocol 5, out of
    band): no copy into a pickle stream on this side, none out of it on the other. A
    match part is ~25 bytes a member (~600 MB per analysis rank at 1,024 x 100k at K = 2)."""
    from mpi4py import MPI

    bufs: list[pickle.PickleBuffer] = []
    head = pickle.dumps(obj, protocol=5, buffer_callback=bufs.append)
    raws = [b.raw() for b in bufs]
    comm.send((head, [r.nbytes for r in raws]), dest=dest, tag=tag)
    for r in raws:  # a few dozen arrays
        comm.Send([r, MPI.BYTE], dest=dest, tag=tag)


def _recv_big(comm: Any, source: int, tag: int) -> Any:
    """What :func:`_send_big` sent: each buffer received straight into its own array."""
    from mpi4py import MPI

    head, sizes = comm.recv(source=source, tag=tag)
    bufs = [np.empty(n, np.uint8) for n in sizes]
    for b in bufs:  # a few dozen arrays
        comm.Recv([b, MPI.BYTE], source=source, tag=tag)
    return pickle.loads(head, buffers=bufs)


def _row_type(MPI: Any) -> Any:
    """One ``COLL_ROW_DTYPE`` row as an MPI datatype: counts in rows, not bytes (37x smaller)."""
    t = MPI.BYTE.Create_contiguous(COLL_ROW_DTYPE.itemsize)
    t.Commit()
    return t


def _match_share(comm: Any, held: _Held, sigs: np.ndarray, strings: np.ndarray, run: Run | None = None,
                 steps: dict[str, float] | None = None) -> Any:
    """Every analysis rank's share of the collective match (rank 0 passes the ``run`` being
    matched: its in-flight rows). Returns the merged :class:`Collectives` on rank 0.

    1. The scope (communicator membership pairs, the key radix) of every rank's rows and of
       the in-flight rows, united (a few kB each).
    2. Each rank's (key, rows) histogram to rank 0, which cuts the keys into K ranges of
       about equal rows (:func:`distdiag.match.key_ranges`) and broadcasts the cuts.
    3. One ``Alltoallv`` sends each row to the owner of its range; rows come from the
       analysis ranks in file order, each in rank order, so an owner's rows are in the
       serial table order (re-sorted by rank, stably, only when file and rank order differ).
    4. Each owner matches its range (:func:`distdiag.match.match_part`, with its in-flight
       rows from rank 0); rank 0 gathers the parts and merges them
       (:func:`distdiag.match.merge_collectives`): the serial match, exactly.
    A failure anywhere is said on rank 0 after every rank has left the exchange."""
    from mpi4py import MPI

    from distdiag.match import (
        MatchPart,
        MatchScope,
        select_keys,
        group_keys,
        key_ranges,
        match_part,
        merge_collectives,
    )

    k, n = comm.Get_rank(), comm.Get_size()
    rows = held.rows
    inf_rows: Any = None
    inf_keys_at: Any = None
    scopes = [MatchScope.of_rows(rows["comm_id"], rows["seq"], rows["rank"])]
    if k == 0:
        assert run is not None, "rank 0 passes the run"
        isel, igot = select_keys(run.inflight)
        inf_rows, inf_keys_at = run.inflight.take(isel), igot
        scopes.append(MatchScope.of_rows(igot["comm_id"], igot["seq"], igot["rank"]))
    scope = MatchScope.union([s for got in comm.allgather(scopes) for s in got])
    t = [time.perf_counter()]
    keys = group_keys(rows["comm_id"], rows["seq"], scope.n_seq)
    # The cuts only balance the work (any cuts give the serial match): a histogram of every
    # _HIST_STRIDE-th row's key is enough, and costs a sort of 1/64 of the rows.
    hist = comm.gather(np.unique(keys[::_HIST_STRIDE], return_counts=True), root=0)
    cuts = None
    if k == 0:
        assert hist is not None
        ks = [h[0] for h in hist] + [group_keys(inf_keys_at["comm_id"], inf_keys_at["seq"], scope.n_seq)]
        cs = [h[1] for h in hist] + [np.ones(len(ks[-1]), np.int64)]
        cuts = key_ranges(np.concatenate(ks), n, scope.n_seq, counts=np.concatenate(cs)).cuts
    cuts = comm.bcast(cuts, root=0)
    part = np.searchsorted(cuts, keys, side="right").astype(np.int16 if n < 1 << 15 else np.int32)
    del keys
    order = np.argsort(part, kind="stable")  # small ints: numpy's radix sort, linear
    send = _take_rows(rows, order)
    del order
    s_cnt = np.bincount(part, minlength=n).astype(np.int64)
    del part
    t.append(time.perf_counter())
    r_cnt = np.array(comm.alltoall(s_cnt.tolist()), np.int64)
    recv = np.empty(int(r_cnt.sum()), COLL_ROW_DTYPE)
    row_t = _row_type(MPI)
    try:
        s_dis, r_dis = np.cumsum(s_cnt) - s_cnt, np.cumsum(r_cnt) - r_cnt
        comm.Alltoallv([send, (s_cnt, s_dis), row_t], [recv, (r_cnt, r_dis), row_t])
    finally:
        row_t.Free()
    del send
    t.append(time.perf_counter())
    if len(recv) > 1 and not bool(np.all(recv["rank"][1:] >= recv["rank"][:-1])):
        recv = _take_rows(recv, np.argsort(recv["rank"], kind="stable"))  # file order is not rank order here
    inf_parts = None
    if k == 0:
        assert inf_rows is not None
        ip = np.searchsorted(cuts, group_keys(inf_keys_at["comm_id"], inf_keys_at["seq"], scope.n_seq), side="right")
        inf_parts = [inf_rows[ip == j] for j in range(n)]  # a handful of rows per rank
    mine_inf = comm.scatter(inf_parts, root=0)
    got: Any
    try:
        got = match_part(MatchPart(recv, sigs, mine_inf), scope, strings)
    except Exception as e:  # said on rank 0, once every rank is out of the exchange
        got = f"analysis rank {k}: collective match failed ({type(e).__name__}: {e})"
    del recv
    t.append(time.perf_counter())
    if k != 0:
        _send_big(comm, got, 0, _TAG_MATCH)
        return None
    parts = [got] + [_recv_big(comm, src, _TAG_MATCH) for src in range(1, n)]  # in range order
    t.append(time.perf_counter())
    bad = [p for p in parts if isinstance(p, str)]
    if bad:
        raise DistdiagError(bad[0])
    merged = merge_collectives(parts)
    merged.strings = strings
    t.append(time.perf_counter())
    if steps is not None:  # rank 0's seconds in each step (cache.parallel["match_steps"])
        steps.update(zip(("ranges_s", "alltoallv_s", "match_s", "gather_s", "merge_s"), np.diff(t).round(3).tolist()))
    return merged


#: every _HIST_STRIDE-th held row's key goes into the histogram the key ranges are cut from
_HIST_STRIDE = 64



class _Remote:
    """Rank 0's handle on the analysis ranks of a streamed ``--parallel`` run: ``Run.coll_remote``.

    The collective rows stay on the analysis ranks that read them (:class:`_Held`); the
    serial stages' calls come here and are broadcast as commands, which every analysis
    rank runs on its own rows (rank 0 too, on its block): ``map`` (the clock models,
    from :func:`distdiag.clocks.align`), ``repair`` (the causality repairs, from
    :func:`distdiag.clocks.check_causality`), ``match`` (:func:`distdiag.match.match_collectives`:
    by key ranges, :func:`_match_share`). The pipeline's ``split`` hooks follow: once the
    match is made, ``matched`` sends each other rank its block of the bands, takes the
    blocks of the passes rank 0 needs before its detectors (the Slurm view's firsts,
    the input costs), and the others go on with their breakdown blocks while rank 0
    runs the detectors; ``done`` computes rank 0's block and collects theirs. Without
    held rows (a run in memory, or K = 1) only the band passes apply, and only for a
    streamed run.
    """

    def __init__(self, comm: Any, held: _Held | None, sigs: np.ndarray | None, strings: np.ndarray,
                 cfg: Config | None = None) -> None:  # fmt: skip
        self.comm, self.held, self.sigs, self.strings, self.cfg = comm, held, sigs, strings, cfg
        self.workers = 0
        self.ended = False  # the others left the command loop ("end", or "breakdown" and its jobs)
        self.collected = False  # their parts are taken
        self.colls: Any = None
        #: the blocks of the breakdown's bands the analysis ranks swept: [r_lo, r_hi, k_lo, k_hi] each
        self.blocks: list[list[int]] = []
        #: when rank 0 passed each step (time.perf_counter): the stage figures of cache.parallel
        self.t: dict[str, float] = {}
        #: rank 0's seconds in each step of the last match (:func:`_match_share`)
        self.match_steps: dict[str, float] = {}

    def _cmd(self, name: str, arg: Any = None) -> None:
        self.comm.bcast((name, arg), root=0)

    def _status(self, err: str | None) -> None:
        errs = [e for e in self.comm.gather(err, root=0) or [] if e]
        if errs:
            raise DistdiagError(errs[0])

    def setup(self, info: dict[Path, tuple[int, np.ndarray, np.ndarray, bool]]) -> None:
        """Every analysis rank makes its held rows the run's (see :class:`_Held`)."""
        self._cmd("setup", (info, self.sigs, self.strings))
        self._status(_run_op(self.comm, self.held, "setup", info))

    def map(self, models: Any) -> None:
        self._cmd("map", models)
        self._status(_run_op(self.comm, self.held, "map", models))

    def repair(self, repairs: Any, base: int) -> None:
        self._cmd("repair", (repairs, base))
        self._status(_run_op(self.comm, self.held, "repair", (repairs, base)))

    def match(self, run: Run) -> Any:
        from distdiag.match import warn_repeats

        self._cmd("match")
        assert self.held is not None and self.sigs is not None
        merged = _match_share(self.comm, self.held, self.sigs, self.strings, run, self.match_steps)
        warn_repeats(run, merged)
        return merged

    # the pipeline's split hooks (distdiag.pipeline.analyze_run) -------------------------
    def matched(self, run: Run, colls: Any) -> None:
        """The match is made: each of ranks 1..K-1 gets its block of the breakdown's bands, with the
        run and only its ranks' members of the match (:func:`_members_of`); rank 0 keeps block 0."""
        from distdiag.bands import part_edges
        from distdiag.breakdown import BreakdownPart
        from distdiag.critical_path import needs_costs
        from distdiag.passes import analysis_passes
        from distdiag.slurm import needs_rank_firsts

        self.t["matched"] = time.perf_counter()
        self.colls = colls
        n = self.comm.Get_size()
        if n > 1 and run.streamed_kinds:
            cache = RunCache(clock_model=run.cache.clock_model)  # their bands' rows are mapped with it
            lite = dataclasses.replace(run, cache=cache, warnings=[], coll_remote=None)
            self.workers = n - 1
            firsts = needs_rank_firsts(run)  # the Slurm view's per-rank pass, before the detectors
            costs = needs_costs(run, self.cfg)  # input_bound's and h2d_copy's pass, before the detectors
            self._cmd("breakdown")
            jobs = []
            try:
                for dst in range(1, n):  # per analysis rank: its bands' ranks
                    edges = part_edges(run, (dst, n))
                    sub = _members_of(colls, edges[0][0], edges[-1][1]) if edges else None
                    jobs.append((lite, sub, firsts, costs))
            except Exception:  # the others wait for a job: an empty one lets them through
                log.debug("making the analysis ranks' jobs failed", exc_info=True)
                jobs = [(lite, None, False, False)] * (n - 1)
                firsts = costs = False
            for dst, job in enumerate(jobs, start=1):  # per analysis rank
                _send_big(self.comm, job, dst, _TAG_JOB)
            self.ended = True
            self.t["sent"] = time.perf_counter()
            # rank 0's block of every pass in one sweep, then the others' (one message each)
            own = _sweep_block(run, colls, firsts, costs, (0, n))
            self.t["own_part"] = time.perf_counter()
            got = [own] + [self.comm.recv(source=src, tag=_TAG_PART) for src in range(1, n)]
            self.collected = True
            self.t["parts"] = time.perf_counter()
            self.blocks = [[b.r_lo, b.r_hi, b.k_lo, b.k_hi] for b in (g.get("tallies") for g in got)
                           if isinstance(b, BreakdownPart)]  # fmt: skip
            # each pass reduced where every block made its part (else its stage makes it on rank 0)
            for key, ps in analysis_passes(colls, firsts, costs).items():  # a handful
                parts = [g.get(key, _FAILED) for g in got]
                if not any(isinstance(x, str) for x in parts):
                    run.cache.put(key, ps.reduce(run, parts))
            if firsts:
                self.t["firsts"] = time.perf_counter()
            if costs:
                self.t["costs"] = time.perf_counter()
        else:
            self._cmd("end")
        self.ended = True

    def done(self, run: Run) -> None:
        """The detectors are done (a step of the stage timings)."""
        self.t["detected"] = time.perf_counter()

    def abort(self) -> None:
        """Rank 0 failed: the others stop waiting for commands, or their parts are taken and dropped."""
        if not self.ended:
            self._cmd("end")
            self.ended = True
        elif self.workers and not self.collected:
            for src in range(1, self.workers + 1):  # per analysis rank: its parts, dropped
                self.comm.recv(source=src, tag=_TAG_PART)
            self.collected = True


def _members_of(colls: Any, r_lo: int, r_hi: int) -> Any:
    """``colls`` with only the members of ranks ``[r_lo, r_hi)`` (every group kept, in member
    order): what the breakdown's bands of those ranks read (:class:`distdiag.breakdown._Band`
    takes its members by rank; group columns whole). ``g_start`` still counts every member:
    the breakdown does not read it, and nothing else gets this."""
    from distdiag.match import GroupColumn

    keep = np.flatnonzero((colls.m_rank >= r_lo) & (colls.m_rank < r_hi))
    m_group = colls.m_group[keep]

    def column(c: GroupColumn | None) -> GroupColumn | None:
        if c is None:
            return None
        at = np.searchsorted(keep, c.exc_rows)
        hit = (at < len(keep)) & (keep[np.minimum(at, len(keep) - 1)] == c.exc_rows) if len(keep) else at < 0
        return GroupColumn(c.group_values, m_group, at[hit], c.exc_values[hit])

    return dataclasses.replace(
        colls, m_group=m_group, m_rank=colls.m_rank[keep], m_t0_ns=colls.m_t0_ns[keep],
        m_t1_ns=colls.m_t1_ns[keep], m_kind=colls.m_kind[keep], m_op=column(colls.m_op),
        m_nbytes=column(colls.m_nbytes), m_peer=column(colls.m_peer), m_site=column(colls.m_site),
        m_aux=column(colls.m_aux),
    )  # fmt: skip


def _spans(t0: float, t: dict[str, float], t_end: float) -> dict[str, float]:
    """Seconds between rank 0's steps (:attr:`_Remote.t`), named by the step they end."""
    out, prev = {}, t0
    steps = (("align_match_s", "matched"), ("send_jobs_s", "sent"), ("own_part_s", "own_part"),
             ("wait_parts_s", "parts"), ("slurm_firsts_s", "firsts"), ("input_costs_s", "costs"),
             ("detectors_s", "detected"))  # fmt: skip
    for name, key in steps:
        if key in t:
            out[name], prev = t[key] - prev, t[key]
    out["breakdown_s"] = t_end - prev
    return out


def _run_op(comm: Any, held: _Held | None, name: str, arg: Any) -> str | None:
    """One command on this analysis rank's held rows; an error as one line (None: done)."""
    from distdiag.clockmodel import map_inplace, repair_table

    try:
        if held is not None and name == "setup":
            held.setup(arg)
        elif held is not None and len(held.rows):
            if name == "map":
                map_inplace(held.rows, ("t0_ns", "t1_ns"), arg)
            elif name == "repair":
                repair_table(held.rows, *arg)
        return None
    except Exception as e:
        return f"analysis rank {comm.Get_rank()}: {name} of its collective rows failed ({type(e).__name__}: {e})"


def _sweep_block(run: Run, colls: Any, firsts: bool, costs: bool, part: tuple[int, int]) -> dict[PassResult, Any]:
    """Block ``part`` of the bands' part of each pass of :func:`distdiag.passes.analysis_passes`,
    in one sweep (:func:`distdiag.passes.sweep`), by its ``run.cache`` attribute. A sweep that fails
    makes each :data:`_FAILED` (said in the log): rank 0 then leaves those to its stages."""
    from distdiag import passes

    todo = passes.analysis_passes(colls, firsts, costs)
    try:
        return dict(zip(todo, passes.sweep(run, list(todo.values()), part)))
    except Exception as e:
        log.warning("analysis rank sweep of %s failed (%s: %s)", ", ".join(todo), type(e).__name__, e)
        return dict.fromkeys(todo, _FAILED)


def _serve(comm: Any, held: _Held | None) -> None:
    """Analysis rank k > 0 after reading: run rank 0's commands until the breakdown or the end."""
    sigs = strings = None
    while True:
        name, arg = comm.bcast(None, root=0)
        if name == "setup":
            info, sigs, strings = arg
            comm.gather(_run_op(comm, held, name, info), root=0)
        elif name in ("map", "repair"):
            comm.gather(_run_op(comm, held, name, arg), root=0)
        elif name == "match":
            assert held is not None and sigs is not None and strings is not None
            _match_share(comm, held, sigs, strings)
        elif name == "breakdown":
            held = None  # matched: the rows are done with
            run, colls, firsts, costs = _recv_big(comm, 0, _TAG_JOB)
            k, n = comm.Get_rank(), comm.Get_size()
            run.cache.collectives = colls  # this rank's members: what its bands read
            # every per-rank pass of this rank's bands, in one sweep: rank 0 waits for them before its detectors
            comm.send(_sweep_block(run, colls, firsts, costs, (k, n)), dest=0, tag=_TAG_PART)
            return
        else:  # "end"
            return


#: a block an analysis rank could not compute (rank 0 then makes that pass over every band itself)
_FAILED = "failed"

#: exit code of an analysis that ended every rank (MPI_Abort's errorcode): not the usage code 2
EXIT_FAILED = 1
#: seconds rank 0's orderly end (:meth:`_Remote.abort`) may take before it ends every rank
ABORT_WAIT_S = 30.0


#: seconds the failing rank waits for the launcher to take its line before ``Abort``
LINE_GRACE_S = 2.0


def _let_the_launcher_read(fd: int, bound_s: float) -> None:
    """Wait, at most ``bound_s``, until the launcher has read what we wrote to ``fd``.

    Hydra (MPICH's mpiexec) forwards a rank's stderr from a pipe, and its abort
    over another socket; when the abort wins the race the line on the pipe is
    dropped with the job (seen 1 run in 40 on a loaded 2-core machine: an empty
    stderr, MPICH's own ``Abort(1) on node ...`` line gone too). So with a pipe we
    wait until it is empty (``FIONREAD`` counts the bytes not yet read, from either
    end), then a moment for the launcher to pass them on; anything else (a
    terminal, a file, a socket) gets that moment only."""
    import fcntl
    import stat
    import struct
    import termios

    try:
        pipe = stat.S_ISFIFO(os.fstat(fd).st_mode)
        deadline = time.monotonic() + bound_s
        while pipe and time.monotonic() < deadline:
            left = struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]
            if left <= 0:
                break
            time.sleep(0.01)
        time.sleep(min(0.1, bound_s))
    except (OSError, ValueError):  # no fd 2, or no FIONREAD here: the moment only
        time.sleep(min(0.1, bound_s))


def _end_all(comm: Any, e: BaseException) -> None:
    """An unexpected failure on this analysis rank: say it in one line, then end every rank.

    The others may be waiting in a receive or a collective that this rank will never
    enter; only ``Abort`` gets them out (mpiexec and srun end the whole job on it)."""
    import sys

    from distdiag.render.fmt import escape_controls

    k, n = comm.Get_rank(), comm.Get_size()
    what = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    line = f"distdiag: analysis rank {k} of {n} failed ({what}); ending all {n} analysis ranks"
    try:
        if log.isEnabledFor(logging.INFO):  # the traceback, with -v; names from the run dir: untrusted
            import traceback

            log.info("%s", escape_controls("".join(traceback.format_exception(e)).rstrip()))
        sys.stderr.write(escape_controls(line)[:2000] + "\n")
        sys.stderr.flush()
        _let_the_launcher_read(2, LINE_GRACE_S)
    finally:
        try:
            comm.Abort(EXIT_FAILED)
        finally:  # MPICH's Abort can return before the launcher ends us: no traceback after the line
            os._exit(EXIT_FAILED)


def _bounded(comm: Any, fn: Any, seconds: float, what: str) -> None:
    """``fn()``, but if it has not returned within ``seconds`` every rank is ended (:func:`_end_all`)."""
    import threading

    done = threading.Event()

    def watch() -> None:
        if not done.wait(seconds):
            _end_all(comm, TimeoutError(f"{what} took over {seconds:g} s"))

    threading.Thread(target=watch, name="distdiag-abort-watch", daemon=True).start()
    try:
        fn()
    finally:
        done.set()


def analyze_parallel(run_dir: str | Path, cfg: Config | None = None, comm: Any = None, stream: bool = True) -> Any:
    """Analyze ``run_dir`` on every rank of ``comm`` (default COMM_WORLD).

    ``stream``: stream a run larger than ``cfg.stream_events`` rows as the serial CLI does
    (:func:`distdiag.run.streamed_kinds_for`): the analysis ranks leave the compute phases
    out while reading and ship only the kept rows, so rank 0 holds what a streamed serial
    analysis holds; the report is the same either way.

    Returns the :class:`distdiag.pipeline.Report` on rank 0 and None elsewhere.
    ``report.run.cache.parallel`` holds the seconds of each stage on rank 0.
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
    # A streamed run on K > 1: the collective rows stay where they were read (_Held, _Remote)
    remote = bool(streamed) and n_workers > 1 and packer.coll is not None

    if k != 0:
        # Metadata pickled (small); the event rows (rank column attached) as the
        # packed buffer's raw bytes: already one contiguous block, no copy.
        meta = []
        counts = []
        for d, w in mine:  # per rank file
            counts.append(len(d.events) if isinstance(d, RankData) else 0)
            if isinstance(d, RankData):
                d = dataclasses.replace(d, events=np.zeros(0, RUN_EVENT_DTYPE))  # the rows go by buffer below
            meta.append((d, w))
        # streaming: what the left-out rows need (per file); the kept collective rows stay
        # here (remote), rank 0 gets each file's small sig table and damaged-id count
        comm.send((meta, counts, packer.stats, packer.coll_parts, packer.coll_bad), dest=0)
        if packer.used:
            comm.Send([packer.buf[: packer.used].view(np.uint8), MPI.BYTE], dest=0, tag=_TAG_EVENTS)
        held = _Held(packer) if remote else None
        del mine, packer, meta
        _serve(comm, held)
        return None

    # Rank 0: every block's metadata first, so the run's table is allocated once,
    # at its exact size, and each block's rows are received straight into it.
    blocks: list[list[tuple[RankData | str, list[str]]]] = [mine]
    block_counts: list[list[int]] = [[len(d.events) if isinstance(d, RankData) else 0 for d, _ in mine]]
    held = _Held(packer) if remote else None  # rank 0's own rows, before the others' parts join
    for src in range(1, n_workers):  # per analysis rank, in file order
        meta, counts, stats, parts, bad = comm.recv(source=src)
        blocks.append(meta)
        block_counts.append(counts)
        packer.stats.update(stats)
        packer.coll_bad.update(bad)
        packer.coll_parts.update(parts)  # their sig tables (offsets into their own buffers: unused here)
    total = sum(sum(c) for c in block_counts)
    if len(packer.buf) >= total:  # rank 0's own buffer has room (K = 1, or a generous bound): no copy
        table = packer.buf[:total]
    else:
        table = new_table(total)
        populate(table)  # every row is written below: fault the pages in at once (see run.new_table)
        table[: packer.used] = packer.buf[: packer.used]
    packer.buf = table  # rank 0's own views are re-pointed below, with everyone's
    off = 0
    got_all: list[RankData | str] = []
    warnings: list[str] = []
    views: list[RankData] = []
    for src, (blk, counts) in enumerate(zip(blocks, block_counts)):  # per analysis rank, in file order
        n_blk = int(sum(counts))
        if src and n_blk:
            comm.Recv([table[off : off + n_blk].view(np.uint8), MPI.BYTE], source=src, tag=_TAG_EVENTS)
        for (d, w), c in zip(blk, counts):  # per rank file of that block
            if isinstance(d, RankData):
                d.events = table[off : off + c]
                views.append(d)
            off += c
            got_all.append(d)
            warnings.extend(w)
    packer.used, packer.views = total, views
    # K > 1 and streamed: assemble makes the sig table and each file's maps, the rows stay where
    # they are; K = 1 (or in memory): rank 0's packer holds every kept row, as load_run's does
    packer.coll_remote = remote
    t_gather = time.perf_counter()
    assert p is not None
    split = _Remote(comm, held, None, np.zeros(0, object), cfg)
    try:
        run = assemble(run_dir, p, files, got_all, warnings, packer)
        if remote:
            split.sigs, split.strings = run.coll_sigs, run.strings
            split.setup(run.coll_remote)
            run.coll_remote = split
    except DistdiagError:
        _bounded(comm, split.abort, ABORT_WAIT_S, "ending the other analysis ranks")
        raise
    del got_all, blocks, mine, packer, held
    t_assemble = time.perf_counter()

    from distdiag.config import Config
    from distdiag.pipeline import analyze_run

    try:
        report = analyze_run(run, cfg or Config(), inplace=True, split=split)  # the assembled run is ours alone
    except DistdiagError:  # said by the protocol (an analysis rank's status, or nothing to analyze)
        _bounded(comm, split.abort, ABORT_WAIT_S, "ending the other analysis ranks")
        raise
    t_end = time.perf_counter()
    report.run.cache.parallel = {
        "workers": n_workers,
        "collectives_held": remote,  # matched by key ranges where they were read
        "read_s": t_read - t_start,
        "gather_s": t_gather - t_read,
        "assemble_s": t_assemble - t_gather,
        "analyze_s": t_end - t_assemble,
        # within analyze: align + match, the jobs sent, rank 0's block of the passes, the wait
        # for the others', the detectors, the breakdown and report
        **_spans(t_assemble, split.t, t_end),
        "breakdown_blocks": split.blocks,
        "match_steps": dict(split.match_steps) if remote else None,
        "total_s": t_end - t_start,
    }
    log.info("parallel analysis on %d ranks: %s", n_workers, report.run.cache.parallel)
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
    try:
        report = analyze_parallel(ns.run_dir, cfg, comm, stream=stream)
    except DistdiagError as e:
        if comm.Get_rank() == 0:  # raised where the others were let go: the CLI's one line, exit 2
            raise
        _end_all(comm, e)  # an analysis rank has no orderly way to tell rank 0
        raise  # not reached: Abort ends this process
    except BaseException as e:  # a bug, MemoryError, KeyboardInterrupt: nobody else can answer it
        _end_all(comm, e)
        raise
    if report is None:
        return 0
    from distdiag.output import emit

    return emit(report, ns)
