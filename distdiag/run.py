"""The analyzer's core data model: :class:`Run` and :func:`load_run`.

A run directory holds one ``rank-NNNNN.h5`` per rank (see :mod:`distdiag.schema`).
:func:`load_run` reads them all into one :class:`Run`:

* ``run.events``: the events of every rank as ONE columnar structured array
  (``RUN_EVENT_DTYPE`` = the on-disk ``EVENT_DTYPE`` plus a ``rank`` column),
  sorted by (rank, t0_ns). String ids (``name_id``, ``comm_id``, ``site_id``)
  are remapped from each rank's own table onto one global table
  (``run.strings``, ``run.s(id)``), so the same communicator key or op name has
  the same id on every rank and can be compared with ``==`` on integer columns.
* ``run.sync``, ``run.inflight``, ``run.gpu``: the other tables, with a rank column.
* ``run.ranks``: per-rank metadata (:class:`RankInfo`), ``run.warnings`` and
  ``run.missing_ranks`` for everything that was wrong but not fatal.

Bad input never raises a traceback at the user: a problem that leaves nothing
to analyze raises :class:`DistdiagError` (the CLI prints its message and exits
2); anything else becomes one line in ``run.warnings`` and the analysis goes on
with what is there.

Timestamps stay in each rank's own clock until :func:`distdiag.clocks.align`
maps them onto rank 0's timeline (``run.aligned`` says which).

Loading packs each rank's rows into one table as its file is read (:class:`Packer`,
by cache-sized blocks, each scanned for the rank's time bounds, order and string ids:
:class:`_Scan`); the table is its own anonymous mapping, populated rank by rank.
Streaming (``load_run(..., streamed_kinds=STREAMED_KINDS)``) keeps the compute phases and
the collective rows out of the table: every row is still read and scanned, the collective
rows are kept apart for the match (``COLL_ROW_DTYPE``, dropped by :func:`stream_out` once
matched), and the stages that need the phases read them band of ranks by band of ranks
from the files (:func:`distdiag.bands.bands`, :class:`_Stream`: the same remap, sort,
clock map and repairs, so a band's rows are byte for byte the table's).

How the loader's memory and time were measured and cut, step by step (issue 10): ``benchmarks/NOTES.md``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import mmap
import os
import re
import stat
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np

from distdiag import gheap
from distdiag.cache import RunCache

# DistdiagError is re-exported: modules and tests import it from here too
from distdiag.errors import DistdiagError as DistdiagError
from distdiag.errors import SpillLogError, TraceError
from distdiag.gheap import VLEN_REF
from distdiag.h5attrs import RootAttributes, root_attributes
from distdiag.ranks import rank_ranges
from distdiag.schema import (
    COMM_KINDS,
    COUNTER_DTYPE,
    EVENT_DTYPE,
    FILE_KINDS,
    GPU_DTYPE,
    RANK_FILE_RE,
    SCHEMA_ATTR,
    SCHEMA_VERSION,
    SYNC_DTYPE,
    Kind,
)

log = logging.getLogger(__name__)

_KIND_VALUES = frozenset(int(k) for k in Kind)


def _with_rank(dt: np.dtype) -> np.dtype:
    return np.dtype(list(dt.descr) + [("rank", "<i4")])


RUN_EVENT_DTYPE = _with_rank(EVENT_DTYPE)
RUN_SYNC_DTYPE = _with_rank(SYNC_DTYPE)
RUN_GPU_DTYPE = _with_rank(GPU_DTYPE)
#: An event row of the file as one void field, and a run row as that plus the rank
#: (both packed, the rank after the file's last byte): one memcpy copies a row.
_FILE_ROW = np.dtype(f"V{EVENT_DTYPE.itemsize}")
_RUN_ROW = np.dtype(f"V{RUN_EVENT_DTYPE.itemsize}")
_PACKED_ROW = np.dtype({"names": ["v", "rank"], "formats": [_FILE_ROW, "<i4"], "offsets": [0, EVENT_DTYPE.itemsize],
                        "itemsize": RUN_EVENT_DTYPE.itemsize})  # fmt: skip

#: A collective row as a streamed run keeps it for the match (:class:`Packer`, ``coll_rows``):
#: the match's keys and times, and ``sig``, an id into the run's table of the row's other
#: fields (``coll_sigs``, :data:`_SIG_DTYPE`): SPMD ranks repeat a few (op, bytes, root,
#: site, datatype), so 37 bytes a row instead of 73.
COLL_ROW_DTYPE = np.dtype([("t0_ns", "<i8"), ("t1_ns", "<i8"), ("kind", "u1"), ("comm_id", "<i4"), ("seq", "<i8"),
                           ("rank", "<i4"), ("sig", "<i4")])  # fmt: skip
#: the byte runs a collective row shares with an event row: t0_ns..kind, comm_id..seq, rank
_EV_AT: dict[str, int] = {f: int(v[1]) for f, v in (EVENT_DTYPE.fields or {}).items()}
_RUN_SPANS = np.dtype({"names": ["a", "b", "c"], "formats": ["V17", "V12", "V4"],
                       "offsets": [0, _EV_AT["comm_id"], EVENT_DTYPE.itemsize],
                       "itemsize": EVENT_DTYPE.itemsize + 4})  # fmt: skip
_COLL_SPANS = np.dtype({"names": ["a", "b", "c"], "formats": ["V17", "V12", "V4"], "offsets": [0, 17, 29],
                        "itemsize": COLL_ROW_DTYPE.itemsize})  # fmt: skip
assert _EV_AT["kind"] == 16 and _EV_AT["seq"] == _EV_AT["comm_id"] + 4
assert [COLL_ROW_DTYPE.fields[f][1] for f in ("kind", "comm_id", "seq", "rank", "sig")] == [16, 17, 21, 29, 33]  # type: ignore[index]
_SIG_FIELDS = ("name_id", "nbytes", "peer", "site_id", "aux")
_SIG_DTYPE = np.dtype([(f, EVENT_DTYPE[f]) for f in _SIG_FIELDS])
_SIG_VOID = np.dtype(f"V{_SIG_DTYPE.itemsize}")

#: Columns that hold string ids and are remapped onto the global table.
STRING_COLUMNS = ("name_id", "comm_id", "site_id")
#: Kinds whose ``aux`` is a string id as well: the file system of a file event,
#: the datatype of a collective ("MPI_DOUBLE", "float32"), the op a WAIT waits on.
_AUX_STRING_KINDS = np.array(sorted({*FILE_KINDS, int(Kind.COLL), int(Kind.COLL_ASYNC), int(Kind.WAIT)}), np.uint8)
#: kind -> whether its aux is a string id (np.isin by one gather)
_AUX_KIND_TABLE = np.zeros(256, bool)
_AUX_KIND_TABLE[_AUX_STRING_KINDS] = True

#: Events are read in blocks of this many rows so that a file truncated in the
#: middle of its events still yields every row before the damage.
_READ_BLOCK_ROWS = 1 << 20
#: Rows per block of the packed read's copy and scan (:meth:`Packer.read_events`):
#: ~1.1 MB of file rows that stay in cache between the two (8,192 rows: same per row,
#: a second block's overhead at 10k rows a rank; measured).
_PACK_ROWS = 1 << 14

#: What h5py raises on damaged files: OSError mostly, RuntimeError for a
#: mangled superblock, KeyError/ValueError/TypeError for broken objects,
#: AttributeError for a group where a table should be, MemoryError/OverflowError
#: for a flipped dimension that claims billions of rows (found by tests/test_fuzz_reader.py).
_H5_ERRORS = (OSError, RuntimeError, KeyError, ValueError, TypeError, AttributeError, MemoryError, OverflowError)

#: No launch has more ranks: a larger rank number or world size is a corrupt attribute.
MAX_RANKS = 1 << 22


@dataclass(frozen=True)
class RankInfo:
    """What one rank file says about its rank. Times are in ns of ``run``'s timeline
    (the rank's own clock before alignment, rank 0's after)."""

    rank: int
    path: Path
    host: str
    local_rank: int
    world_size: int
    job_id: str
    launch_id: str
    pid: int
    #: first instant the rank was observed: the shim's start (or its first event)
    start_ns: int
    #: last instant: the shim's close, else the last flush, else the last event
    end_ns: int
    closed_cleanly: bool
    exit_code: int | None
    lost_events: int
    n_events: int
    wall_ns_at_start: int | None
    mono_ns_at_start: int | None
    distdiag_version: str = ""
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    #: the rank's recording budget (``max_file_bytes``), when it reached it: seconds after
    #: its start, 1 row in ``sample_every`` kept after it, and the rows only counted
    #: (``/counters``) by kind name
    budget_bytes: int = 0
    budget_reached_s: float | None = None
    sample_every: int = 0
    counted_only: dict[str, tuple[int, float]] = field(default_factory=dict)
    #: why the rank's writer stopped before its end (a full disk, the exit's time bound), or ""
    recording_stopped: str = ""
    #: from the process's start to the shim's (the interpreter's start and imports, recorded by the
    #: libc interposer from its load: ``process_start_mono_ns``), 0 when not known; the program's
    #: first line comes after it, so its startup lasts at least that long
    lead_in_ns: int = 0
    #: what the rank's rows were read from: "distdiag" (a rank file) or "kineto" (a PyTorch
    #: profiler trace, :mod:`distdiag.kineto`), and the byte bound that read was held to
    source: str = "distdiag"
    read_limit_bytes: int = 0
    #: a forked process's file only: what the process was (``dataloader_worker``,
    #: ``multiprocessing``, ``fork``; :mod:`distdiag.children`)
    role: str = ""
    #: the rank file's ``cuda_timing`` attribute ("on: ..." when its calls were timed on the GPU
    #: too, :mod:`distdiag.shim.hooks.cuda_events`), and how many of its collectives took their
    #: GPU times (:func:`distdiag.gpu_timeline.substitute_collective_times`)
    cuda_timing: str = ""
    gpu_timed_collectives: int = 0
    #: the rank file's ``fileio_capture`` attribute: what recorded its file calls ("preload":
    #: the libc interposer, "python": the Python-level wrappers, "off"; "" in older files)
    fileio_capture: str = ""
    #: the span its event rows were held to when read (:func:`_recorded_span`), where that dropped
    #: some (else None, None): a band pass reading them again drops the same rows
    row_span: tuple[int | None, int | None] = (None, None)

    @property
    def dur_s(self) -> float:
        return max(0, self.end_ns - self.start_ns) / 1e9


@dataclass
class Run:
    """Every rank of one launch, as columnar arrays (see the module docstring)."""

    path: Path
    #: rank -> metadata, for the ranks whose file could be read
    ranks: dict[int, RankInfo]
    events: np.ndarray  # RUN_EVENT_DTYPE, sorted by (rank, t0_ns)
    strings: np.ndarray  # object array of str; id 0 is ""
    sync: np.ndarray  # RUN_SYNC_DTYPE, raw (each rank's own clock, never aligned)
    inflight: np.ndarray  # RUN_EVENT_DTYPE, t1_ns == -1
    gpu: np.ndarray  # RUN_GPU_DTYPE
    world_size: int
    job_id: str
    warnings: list[str] = field(default_factory=list)
    missing_ranks: list[int] = field(default_factory=list)
    #: True once distdiag.clocks.align mapped every timestamp onto rank 0's clock
    aligned: bool = False
    #: per-rank offset (ns) that align() added, indexed by rank; None before
    offset_ns: np.ndarray | None = None
    #: results the stages make once and share (the clock model, the match, ...)
    cache: RunCache = field(default_factory=RunCache, repr=False)
    #: kinds whose rows are NOT in ``events`` (streamed: read band by band from the rank
    #: files through :func:`distdiag.bands.bands`); empty when the table holds every row
    streamed_kinds: tuple[int, ...] = ()
    #: the :class:`_Stream` that reads them (None when nothing is streamed)
    stream: Any = field(default=None, repr=False)
    #: a streamed run's collective rows with a seq, kept for the match until it is made
    #: (``COLL_ROW_DTYPE``, sorted by (rank, t0) like the table; see :func:`stream_out`)
    coll_rows: np.ndarray | None = field(default=None, repr=False)
    #: their other fields, one row per ``sig`` (``_SIG_DTYPE``, global string ids)
    coll_sigs: np.ndarray | None = field(default=None, repr=False)
    #: ``--parallel``: the collective rows stay on the analysis ranks that read them
    #: (``distdiag.parallel._Remote``: map, repair, match, fetch them there); None otherwise.
    #: Right after :func:`assemble`: per kept rank file, (rank, string lookup, sig map, unsorted).
    coll_remote: Any = field(default=None, repr=False)
    _string_ids: dict[str, int] | None = field(default=None, repr=False)

    # -- strings ----------------------------------------------------------------
    def s(self, sid: int) -> str:
        """The string with global id ``sid`` ("" for 0 or an id out of range)."""
        if 0 <= sid < len(self.strings):
            return str(self.strings[sid])
        return ""

    def sid(self, text: str) -> int:
        """The global id of ``text``, or -1 when no rank used it."""
        if self._string_ids is None:
            self._string_ids = {str(v): i for i, v in enumerate(self.strings)}
        return self._string_ids.get(text, -1)

    # -- ranks --------------------------------------------------------------------
    @property
    def rank_ids(self) -> np.ndarray:
        """The ranks present, ascending."""
        return np.array(sorted(self.ranks), dtype=np.int64)

    @property
    def hosts(self) -> list[str]:
        return sorted({r.host for r in self.ranks.values()})

    def host_of(self, rank: int) -> str:
        info = self.ranks.get(int(rank))
        return info.host if info is not None else ""

    def hosts_of(self, ranks: Iterable[int]) -> list[str]:
        return sorted({self.host_of(r) for r in ranks} - {""})

    @property
    def source(self) -> str:
        """"kineto" when the ranks were read from PyTorch profiler traces, else "distdiag"."""
        return "kineto" if any(i.source == "kineto" for i in self.ranks.values()) else "distdiag"

    @property
    def start_ns(self) -> int:
        """First shim start across ranks (meaningful on the aligned timeline)."""
        return min((r.start_ns for r in self.ranks.values()), default=0)

    @property
    def end_ns(self) -> int:
        return max((r.end_ns for r in self.ranks.values()), default=0)

    @property
    def wall_s(self) -> float:
        """First shim start to last shim end across ranks, in seconds."""
        return max(0, self.end_ns - self.start_ns) / 1e9

    def rank_bounds(self) -> tuple[np.ndarray, np.ndarray]:
        """(start_ns, end_ns) arrays indexed by rank (size world_size; 0 for absent ranks)."""
        n = max(self.world_size, max(self.ranks, default=-1) + 1)
        start = np.zeros(n, np.int64)
        end = np.zeros(n, np.int64)
        for r, info in self.ranks.items():  # one per rank
            start[r] = info.start_ns
            end[r] = info.end_ns
        return start, end

    def lead_ins(self) -> np.ndarray:
        """Per rank (indexed as :meth:`rank_bounds`), ns from its process's start to its shim's
        (:attr:`RankInfo.lead_in_ns`; 0 where not known)."""
        n = max(self.world_size, max(self.ranks, default=-1) + 1)
        out = np.zeros(n, np.int64)
        for r, info in self.ranks.items():  # one per rank
            out[r] = info.lead_in_ns
        return out

    # -- events -------------------------------------------------------------------
    def events_of(self, kinds: Iterable[int]) -> np.ndarray:
        """The events whose kind is in ``kinds`` (a copy, same order)."""
        ks = np.fromiter((int(k) for k in kinds), dtype=np.uint8)
        return self.events[np.isin(self.events["kind"], ks)]

    def rank_slices(self) -> dict[int, slice]:
        """rank -> slice of ``events`` holding that rank's rows."""
        # One contiguous copy of the column and two vectorized searches: searching the
        # strided field view once per rank cost 2.2 s at 256 ranks x 4,000 events (measured).
        r = np.ascontiguousarray(self.events["rank"])
        ranks = np.array(sorted(self.ranks), np.int64)
        lo = np.searchsorted(r, ranks)
        hi = np.searchsorted(r, ranks + 1)
        return {int(k): slice(int(a), int(b)) for k, a, b in zip(ranks, lo, hi)}

    def replace(self, **changes: Any) -> Run:
        """A shallow copy with ``changes`` (stages return new runs, never mutate)."""
        new = dataclasses.replace(self, **changes)
        new.warnings = list(new.warnings)
        new.cache = RunCache()
        return new

    def to_frame(self) -> Any:
        """The events as a pandas DataFrame with string columns decoded (for notebooks)."""
        import pandas as pd

        df = pd.DataFrame(self.events)
        strings = np.asarray(self.strings, dtype=object)
        for col in STRING_COLUMNS:
            df[col.removesuffix("_id")] = strings[np.clip(self.events[col], 0, len(strings) - 1)]
        names = {int(k): k.name for k in Kind}
        df["kind_name"] = df["kind"].map(lambda k: names.get(int(k), str(k)))
        return df


# ----------------------------------------------------------------------------------
# loading


@dataclass
class _Scan:
    """What one pass over a rank's event rows, made while they are in cache, tells
    :func:`read_rank` (the rank's first and last instants) and :func:`assemble`
    (whether the rank's rows need sorting by t0, whether its string ids need a
    range check or a remap). Before, each was a strided pass over the whole
    73-byte-a-row table after loading (the sort check, the remap's range
    checks: ~60-70 ns an event) or over each rank's rows (three reductions),
    against ~10 ns a row over a block still in cache, plus ~25 us a block
    (measured, issue 10)."""

    rows: int = 0
    t0_min: int = 0
    t0_max: int = 0
    t1_max: int = 0
    t1_min: int = 0
    #: some row's t0 is below the row before it (threads flush chunks out of time order)
    unsorted: bool = False
    #: largest string id in name_id, comm_id, site_id and in the aux of the kinds
    #: whose aux is a string id (see _AUX_STRING_KINDS), each read as unsigned: a
    #: negative id counts as huge, so ``id_umax < len(strings)`` says every id is
    #: in range in one reduction a column. 0 without rows.
    id_umax: int = 0
    _last_t0: int = field(default=0, repr=False)

    def add(self, rows: np.ndarray) -> None:
        """Take the next block of the rank's rows (any dtype with the event fields), in file order.

        Each step is one strided pass over the block (~1-4 ns a row in cache): the
        t0 order first, then the t0 bounds are its ends unless it is out of order."""
        n = len(rows)
        if n == 0:
            return
        t0 = np.ascontiguousarray(rows["t0_ns"])  # then the order check is one vector compare
        back = n > 1 and bool(np.any(t0[1:] < t0[:-1]))
        lo0, hi0 = (int(t0.min()), int(t0.max())) if back else (int(t0[0]), int(t0[-1]))
        t1 = rows["t1_ns"]
        hi1, lo1 = int(t1.max()), int(t1.min())
        u = max(int(rows[col].view(np.uint32).max()) for col in STRING_COLUMNS)
        # aux of the kinds whose aux is a string id, 0 elsewhere (take + where: ~3 ns a
        # row; a fancy-index gather and a boolean compress cost ~7, max(where=) ~17)
        fk = _AUX_KIND_TABLE.take(rows["kind"])
        u = max(u, int(np.where(fk, rows["aux"].view(np.uint64), np.uint64(0)).max()))
        if self.rows == 0:
            self.t0_min, self.t0_max, self.t1_max, self.t1_min, self.id_umax = lo0, hi0, hi1, lo1, u
        else:
            back = back or int(t0[0]) < self._last_t0
            self.t0_min, self.t0_max, self.t1_max = min(self.t0_min, lo0), max(self.t0_max, hi0), max(self.t1_max, hi1)
            self.t1_min = min(self.t1_min, lo1)
            self.id_umax = max(self.id_umax, u)
        self.unsorted = self.unsorted or back
        self._last_t0 = int(t0[-1])
        self.rows += n

    @classmethod
    def of(cls, events: np.ndarray) -> _Scan:
        """The scan of a whole array of rows, by blocks (a table read by the damaged-file path)."""
        sc = cls()
        for a in range(0, len(events), _PACK_ROWS):  # per block of rows
            sc.add(events[a : a + _PACK_ROWS])
        return sc


@dataclass
class RankData:
    info: RankInfo
    events: np.ndarray
    strings: np.ndarray
    sync: np.ndarray
    inflight: np.ndarray
    gpu: np.ndarray
    #: the scan of ``events``, made while reading (:func:`read_rank`)
    scan: _Scan


class NotOwnFile(Exception):
    """A run dir entry that is not a regular file of its own (a symbolic link, a FIFO, a
    device), or that was swapped while it was opened: never read (a run dir is untrusted,
    and ``rank-00000.h5 -> ~/.ssh/...`` would read the analyst's files)."""


def open_rank_file(path: Path) -> Any:
    """:func:`_open_h5`, for callers outside this module (e.g. a detector reading one attribute)."""
    return _open_h5(path)


#: the largest spill log read (distdiag.shim.spill): the shim opens the HDF5 file once its log
#: holds 8 MiB, so a real one is smaller; a larger one is refused, never read whole
MAX_SPILL_LOG_BYTES = 256 << 20


def _open_spill(log_path: Path, st: os.stat_result) -> Any:
    """The rank file as its spill log holds it: an HDF5 file in memory, in the shim's layout.

    A log next to a rank file means the process ended before its HDF5 file held the
    log's rows (killed before its program imported numpy, or while the file was being
    made: distdiag.shim.spill); the log then has every row of its last completed flush.
    The log is untrusted like the rest of the run dir: a regular file of its own, at
    most :data:`MAX_SPILL_LOG_BYTES`, every record's length and checksum checked."""
    import io

    import h5py

    from distdiag.shim.spill import LogError, read_log
    from distdiag.shim.writer import write_rank_file

    if stat.S_ISLNK(st.st_mode):
        raise NotOwnFile(f"has a spill log {log_path.name} that is a symbolic link (never read)")
    if not stat.S_ISREG(st.st_mode):
        raise NotOwnFile(f"has a spill log {log_path.name} that is not a regular file")
    if st.st_size > MAX_SPILL_LOG_BYTES:
        raise SpillLogError(f"its spill log {log_path.name} holds {st.st_size} bytes, more than the "
                            f"{MAX_SPILL_LOG_BYTES >> 20} MiB a shim writes (not a distdiag spill log?)")  # fmt: skip
    fd = os.open(log_path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    try:
        got = os.fstat(fd)
        if (got.st_dev, got.st_ino) != (st.st_dev, st.st_ino):
            raise NotOwnFile(f"has a spill log {log_path.name} that changed while it was opened; not read")
        chunks = []
        left = min(got.st_size, MAX_SPILL_LOG_BYTES)
        while left > 0:
            b = os.read(fd, min(left, 1 << 24))
            if not b:
                break
            chunks.append(b)
            left -= len(b)
        data = b"".join(chunks)
    finally:
        os.close(fd)
    try:
        got_log = read_log(data)
    except LogError as e:
        raise SpillLogError(f"its spill log {log_path.name} cannot be read: {e}") from None
    attrs = dict(got_log["attrs"])
    rows = np.frombuffer(got_log["rows"], EVENT_DTYPE, count=len(got_log["rows"]) // EVENT_DTYPE.itemsize)
    sync = np.array([tuple(r) for r in got_log["sync"]], dtype=SYNC_DTYPE) if got_log["sync"] else None
    inflight_raw = got_log["inflight"]
    inflight = np.frombuffer(inflight_raw, EVENT_DTYPE, count=len(inflight_raw) // EVENT_DTYPE.itemsize)
    why = f"the process ended before its HDF5 file held them; {got_log['marks']} flushes"
    if got_log["damaged"]:
        why += f", then {got_log['damaged']}"
    attrs.update(closed_cleanly=False, read_from_spill_log=why, file_opened_on=None)
    for name in ("end_mono_ns", "exit_code"):
        attrs.setdefault(name, None)
    bio = io.BytesIO()
    try:
        write_rank_file(bio, attrs, rows, list(got_log["strings"]), sync=sync, inflight=inflight)
    except (TypeError, ValueError, OverflowError) as e:
        raise SpillLogError(f"its spill log {log_path.name} holds malformed values ({_short(e)})") from None
    return h5py.File(bio, "r", locking=False)


def _closed_whole(f: Any) -> bool:
    """The open rank file ``f`` was closed cleanly with every row it was given (no rows cut
    by the exit's bound): then it, not a spill log left beside it, is the rank's record (a
    log stays where the file failed, was cut before it held the log's rows, or never opened)."""
    try:
        return bool(f.attrs.get("closed_cleanly", False)) and int(f.attrs.get("rows_not_written_at_exit", 0)) == 0
    except Exception:
        return False


def _open_h5(path: Path) -> Any:
    """Open a rank file read-only, also while its writer still has it open (SWMR).

    With a spill log next to it (``rank-NNNNN.h5.log``), the log is read in the
    file's place (:func:`_open_spill`).

    Only a regular file is opened, never through a symbolic link: ``lstat`` first, and
    after the open the descriptor HDF5 holds must be that same file (device, inode), so a
    link swapped in between is caught too (:class:`NotOwnFile`).

    Without a chunk cache (``rdcc_nbytes=0``): every table is read once, whole,
    so a cache only costs. With HDF5's default 1 MB cache each 282 kB chunk of
    events (4,096 rows) went through a cache buffer, a malloc above glibc's
    mmap threshold, so fresh pages every chunk, then a second copy; without
    it HDF5 reads the chunks straight into the destination. The events read
    alone (64 x 100k, four alternating passes): user 5-14 -> 1.3-3.6 ns an
    event, sys 19-57 -> 12-16 (issue 10). Same rows either way."""
    import h5py

    from distdiag.shim.spill import log_name

    log_path = path.with_name(log_name(path.name))
    try:
        log_st: os.stat_result | None = os.lstat(log_path)
    except FileNotFoundError:
        log_st = None
    if log_st is not None:
        try:
            f = _open_h5_file(path)  # (waits a moment for a writer finishing it)
        except (NotOwnFile, OSError, *_H5_ERRORS):
            f = None  # the empty claim, a half-made file: the log
        if f is not None and _closed_whole(f):
            return f
        try:  # a helper making the file from the log removes the log once the file holds its rows
            log_st = os.lstat(log_path)
        except FileNotFoundError:
            log_st = None
        if log_st is None:
            return f if f is not None else _open_h5_file(path)
        if f is not None:
            f.close()
        try:
            return _open_spill(log_path, log_st)
        except FileNotFoundError:  # removed just now: the file holds its rows
            return _open_h5_file(path)
    return _open_h5_file(path)


#: how long a rank file whose writer still holds it (its HDF5 lock) is waited for: a rank's helper
#: process (distdiag.shim.helper) writes the last flush of a rank that died just now
WRITER_WAIT_S = 3.0
#: run dirs whose files were still held after WRITER_WAIT_S (a live job), -> when: not waited for again
_HELD_DIRS: dict[str, float] = {}


def _wait_for_writer(path: Path) -> None:
    """Wait (at most :data:`WRITER_WAIT_S`, once per run dir a minute) while a process holds
    ``path``'s HDF5 lock for writing (``flock``, same host; a file system without flocks holds
    none): the file is then being finished, e.g. by the helper of a rank killed a moment ago.
    A file still held after the wait (a job still running) is read as it is."""
    import fcntl

    key = str(path.parent)
    seen = _HELD_DIRS.get(key)
    if seen is not None and time.monotonic() - seen < 60.0:
        return
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return
    try:
        end = time.monotonic() + WRITER_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() > end:
                    _HELD_DIRS[key] = time.monotonic()
                    return
                time.sleep(0.01)
            except OSError:  # no flocks here
                return
    finally:
        os.close(fd)


def _open_h5_file(path: Path) -> Any:
    """:func:`_open_h5` of the HDF5 file itself (never through a link, the same file after the open)."""
    import h5py

    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise NotOwnFile("is a symbolic link (a run dir's files are read only as regular files of their own)")
    if not stat.S_ISREG(st.st_mode):
        raise NotOwnFile("is not a regular file")
    _wait_for_writer(path)
    _check_headers(path)
    try:
        f = h5py.File(path, "r", libver="latest", swmr=True, locking=False, rdcc_nbytes=0)
    except _H5_ERRORS:
        # Files not written in SWMR mode open in the default mode.
        f = h5py.File(path, "r", locking=False, rdcc_nbytes=0)
    try:
        got = os.fstat(int(f.id.get_vfd_handle()))
        same = (got.st_dev, got.st_ino) == (st.st_dev, st.st_ino)
    except (OSError, TypeError, ValueError, *_H5_ERRORS):
        same = False
    if not same:
        f.close()
        raise NotOwnFile("changed while it was opened (replaced by another file or a link); not read")
    return f


def _check_headers(path: Path) -> None:
    """:func:`distdiag.h5guard.check` of the file at ``path`` (a regular file, not followed
    through a link): raises :class:`distdiag.h5guard.UnsafeHeader` (a ValueError: the file is
    skipped as a corrupt one) where a header declares a size libhdf5 would allocate unchecked."""
    from distdiag import h5guard

    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        h5guard.check(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


#: (HDF5 class, size) -> [(datatype, numpy dtype, memory type)] of datatypes met before.
#: Building a numpy dtype from an HDF5 compound costs 80-300 us in h5py (a call
#: per member), and every rank file holds the same few types: one ``H5Tequal``
#: (~3 us) against a type seen before gives the same dtype (measured at 1,024
#: rank files: ~0.6 ms a file of the ~5 ms it took to read one).
_TYPE_CACHE: dict[tuple[int, int], list[tuple[Any, np.dtype, Any]]] = {}


def _dtype_of(tid: Any) -> tuple[np.dtype, Any]:
    """(numpy dtype, memory type to read it with) of the HDF5 datatype ``tid``:
    what h5py's ``tid.dtype`` and ``h5t.py_create(dtype)`` give, cached by equality."""
    import h5py

    key = (int(tid.get_class()), int(tid.get_size()))
    seen = _TYPE_CACHE.setdefault(key, [])
    for t, dt, mt in seen:  # a handful of types per (class, size)
        if tid.equal(t):
            return dt, mt
    dt = tid.dtype
    mt = h5py.h5t.py_create(dt)
    # Only transient types are kept: a committed (named) type belongs to its file,
    # and its id dies when the file closes.
    if len(seen) < 8 and not tid.committed():
        seen.append((tid, dt, mt))
    return dt, mt


#: what :meth:`_Attrs._fast` gives for an attribute it must not read
_REFUSED = object()
#: the HDF5 type classes of the attributes a rank file holds (H5T_INTEGER, H5T_FLOAT, H5T_STRING, H5T_ENUM)
_ATTR_CLASSES = frozenset((0, 1, 3, 8))


class _Attrs:
    """A rank file's attributes with the values ``f.attrs.get`` gives. With ``heap``, those the
    shim writes are decoded from the root group's header (:mod:`distdiag.h5attrs`: ~40 us a
    rank file for all of them); the others are read with the low-level API on first use
    (``f.attrs[name]`` costs ~100 us in h5py; this 25-40). An attribute neither can read
    (absent, not a scalar, damaged) is asked of ``f.attrs.get``, so a damaged one raises
    where it did before."""

    def __init__(self, f: Any, heap: _Heap | None = None) -> None:
        self._f = f  # its h5py attribute manager (~40 us to make) only where h5py must read one
        self._fid = f.id
        self._heap = heap
        #: the file's global heap is damaged: its text attributes (there) read as absent
        self._no_text = heap is not None and bool(heap.damaged)
        #: attributes of a type class the shim never writes (damage), read as absent
        self.refused: list[str] = []
        self._vals: dict[str, Any] = {}
        #: the file's attribute names, listed on first use; None when they could not be listed
        self._names: frozenset[bytes] | None = None
        self._listed = False
        self._native: RootAttributes | None = None
        self._strings_checked = False
        if heap is not None:
            try:
                self._native = root_attributes(heap.pread, heap.size())
            except Exception:  # whatever the bytes hold, libhdf5 reads them as before
                self._native = None
            if self._native is not None:
                self._names, self._listed = self._native.names, True

    def _from_header(self, name: str) -> Any:
        """``name``'s value as the root group's header holds it (:mod:`distdiag.h5attrs`), ``_REFUSED``
        for text whose heap is damaged, or ``self`` where the header's bytes do not say (libhdf5's
        to read)."""
        nat = self._native
        if nat is None:
            return self
        if name in nat.values:
            return nat.values[name]
        ref = nat.strings.get(name)
        if ref is None:
            return self
        heap = self._heap
        assert heap is not None
        if not self._strings_checked:  # the collections the text attributes point at: walked once, all
            self._strings_checked = True
            refs = np.array(list(nat.strings.values()), VLEN_REF)
            heap.check(refs)
            self._no_text = self._no_text or bool(heap.damaged)
        if self._no_text:
            return _REFUSED  # as libhdf5 must not walk a damaged heap, its text reads as absent
        length, addr, idx = ref
        col = heap.good.get(addr)
        if col is None or not 0 < idx < len(col.begin) or col.begin[idx] < 0 or col.size[idx] != length:
            return self
        lo = int(col.begin[idx])
        raw = col.data[lo : lo + length].split(b"\0", 1)[0]  # a C string, as h5py reads it
        return raw.decode("utf-8", "surrogateescape")

    def _has(self, name: str) -> bool:
        """Whether the file has attribute ``name`` (its names listed once: ~7 us, where asking
        for an absent one costs ~40); True when they cannot be listed."""
        if not self._listed:
            import h5py

            self._listed = True
            got: list[bytes] = []
            try:
                h5py.h5a.iterate(self._fid, lambda n, *_: got.append(bytes(n)))
                self._names = frozenset(got)
            except _H5_ERRORS:
                self._names = None  # unknown: every name is asked of HDF5
        return self._names is None or name.encode() in self._names

    def get(self, name: str, default: Any = None) -> Any:
        if name in self._vals:
            return self._vals[name]
        if not self._has(name):
            return default
        try:
            v = self._from_header(name)
            if v is self:
                v = self._fast(name)
        except _H5_ERRORS:
            if self._no_text:
                return default  # h5py's way could reach the damaged heap
            v = self  # sentinel: not read
        if v is _REFUSED:
            return default
        if v is self:
            return self._f.attrs.get(name, default)
        self._vals[name] = v
        return v

    def _fast(self, name: str) -> Any:
        import h5py

        aid = h5py.h5a.open(self._fid, name.encode())
        tid = aid.get_type()
        if tid.get_class() not in _ATTR_CLASSES:
            # the shim writes numbers, booleans and strings: another class is damage (a flipped
            # byte made one a variable-length sequence, whose read segfaulted libhdf5:
            # benchmarks/fuzz_rundirs.py --flips, seed 7601), never handed to libhdf5 to convert
            self.refused.append(name)
            return _REFUSED
        dt, mt = _dtype_of(tid)
        if self._no_text and (dt.kind == "O" or dt.hasobject):
            return _REFUSED  # variable-length: in the global heap that libhdf5 must not walk
        if aid.shape != () or dt.subdtype is not None:
            return self  # arrays, empty dataspaces: h5py's way
        arr = np.zeros((), dtype=dt)
        aid.read(arr, mtype=mt)
        v = arr[()]
        if isinstance(v, bytes) and (info := h5py.check_string_dtype(dt)) is not None and info.length is None:
            v = v.decode("utf-8", "surrogateescape")  # as h5py decodes variable-length strings
        return v


def _attr(attrs: Any, name: str, default: Any = None) -> Any:
    v = attrs.get(name, default)
    if isinstance(v, bytes):
        v = v.decode("utf-8", "replace")
    if isinstance(v, np.generic):
        v = v.item()
    return v


def _json_attr(attrs: Any, name: str, default: list[Any] | dict[str, Any]) -> Any:
    """A JSON attribute of the shape of ``default`` (a list or a dict), else ``default``: a
    rank file is untrusted, and ``null`` or a number where the env dict belongs must not
    reach the detectors (``i.env.get`` on None). Lists and dicts of strings stay strings."""
    v = _attr(attrs, name)
    if v is None:
        return default
    try:
        got = json.loads(v)
    except (TypeError, ValueError, RecursionError):
        return default
    if isinstance(default, dict):
        if not isinstance(got, dict):
            return default
        return {str(k): (x if isinstance(x, (str, int, float, bool, list, dict)) or x is None else str(x))
                for k, x in got.items()}  # fmt: skip
    return [str(x) for x in got] if isinstance(got, list) else default


def _file_size(f: Any) -> int | None:
    try:
        return os.path.getsize(f.filename)
    except (OSError, TypeError, ValueError):
        return None


def _max_rows(f: Any, itemsize: int, size: int | None = -1) -> int:
    """The most rows of ``itemsize`` bytes the file can hold (uncompressed, as the shim writes).
    ``size``: the file's size when known (None: unknown), else it is asked for."""
    if size == -1:
        size = _file_size(f)
    if size is None:
        return 1 << 62
    return size // max(1, int(itemsize)) + 1024


class RefusedTable(Exception):
    """A table of a rank file whose bytes live outside it (an external link, external
    storage, a virtual dataset), or that would inflate past any bound the file sets
    (a compression bomb); the message says which and where."""


def _inspect(f: Any, name: str) -> tuple[Any, str | None]:
    """The top-level object ``name`` of ``f``: ``(its id, or None where there is no such link;
    why it is not wholly inside the file (or would inflate to far more than it), or None)``.

    A run dir is untrusted input: HDF5 follows an external link to any file
    the analyst can open, reads a dataset's external storage (raw bytes of any
    file, e.g. ``~/.ssh/id_rsa``, which would then show up in the report as
    strings) and assembles virtual datasets from other files. Only a hard link
    to a dataset with its own storage is read. The link is looked at before
    it is followed: resolving an external link already opens the target. The id
    is the one the caller reads through (one lookup and one open a table)."""
    import h5py

    try:
        link = f.id.links.get_info(name.encode())
    except _H5_ERRORS:
        return None, None  # absent: the caller's business
    if link.type != h5py.h5l.TYPE_HARD:
        kind = "an external link" if link.type == h5py.h5l.TYPE_EXTERNAL else "a soft or user-defined link"
        return None, f"/{name} is {kind}, not a table of its own"
    oid = h5py.h5o.open(f.id, name.encode())
    if isinstance(oid, h5py.h5d.DatasetID):
        dcpl = oid.get_create_plist()
        if dcpl.get_external_count() > 0:
            return oid, f"/{name} keeps its data in external file(s) ({os.fsdecode(dcpl.get_external(0)[0])[:80]}...)"
        layout = dcpl.get_layout()
        if layout == h5py.h5d.VIRTUAL:
            return oid, f"/{name} is a virtual dataset (its data lives in other files)"
        if layout == h5py.h5d.CHUNKED and dcpl.get_nfilters():
            # HDF5 inflates a filtered chunk whole to read any row of it: a chunk that
            # claims more than the file could hold uncompressed is a compression bomb
            chunk_bytes = int(np.prod(dcpl.get_chunk(), dtype=np.float64)) * max(1, oid.get_type().get_size())
            size = _file_size(f)
            if size is not None and chunk_bytes > _CHUNK_BYTES_PER_FILE_BYTE * size + (1 << 20):
                return oid, (f"/{name} has compressed chunks of {chunk_bytes / 1e6:.0f} MB each, more than "
                             f"{_CHUNK_BYTES_PER_FILE_BYTE}x the file's size (a compression bomb?)")  # fmt: skip
    return oid, None


#: The largest chunk a filtered table may declare, in bytes per byte of file (plus 1 MB).
_CHUNK_BYTES_PER_FILE_BYTE = 16


def _open_obj(f: Any, name: str, oid: Any = None) -> Any:
    """``f[name]`` for a dataset, without h5py's path handling (~40 us of the ~100 a lookup costs);
    ``oid``: its id as :func:`_inspect` gave it, already checked.

    Raises :class:`RefusedTable` for a table whose bytes live outside the file (:func:`_inspect`)."""
    import h5py

    if oid is None:
        oid, why = _inspect(f, name)
        if why is not None:
            raise RefusedTable(why)
        if oid is None:
            oid = h5py.h5o.open(f.id, name.encode())  # absent: h5py's error, as f[name] raises it
    if isinstance(oid, h5py.h5d.DatasetID):
        return h5py.Dataset(oid)
    return f[name]  # a group or a named type where a table should be: as h5py gives it


#: What decoding a rank file's string table may allocate, in bytes of string per byte of
#: file (plus 1 MB). The shim's strings take a few bytes of file each beyond their own.
_STRING_BYTES_PER_FILE_BYTE = 4

def _vlen_refs(ds: Any, n: int, heap: _Heap) -> np.ndarray | None:
    """The first ``n`` variable-length references of ``ds`` (:data:`distdiag.gheap.VLEN_REF`:
    length, collection address, object index), read from its storage without decoding
    (~4 us a chunk of 1,024), chunked or contiguous; None for a layout whose bytes cannot be
    read so (filtered chunks, compact). Rows never written are null (0, 0, 0).

    Each chunk's place comes from the chunk index and its bytes from ``heap``'s ``pread``,
    at most a healthy chunk's size and never past the file's end. h5py's
    ``read_direct_chunk`` sizes its buffer by one lookup and libhdf5 reads by another: a
    damaged index made it write past the buffer (a segfault; benchmarks/fuzz_rundirs.py
    --flips, seed 2920)."""
    import h5py

    try:
        dcpl = ds.id.get_create_plist()
        size = heap.size()
        out = np.zeros(n, VLEN_REF)
        if dcpl.get_layout() == h5py.h5d.CONTIGUOUS and not dcpl.get_nfilters():
            at = ds.id.get_offset()  # None: never written (every string null)
            if at is not None and 0 <= int(at) < size:
                raw = heap.pread(int(at), min(n * VLEN_REF.itemsize, size - int(at)))
                k = len(raw) // VLEN_REF.itemsize
                out[:k] = np.frombuffer(raw, VLEN_REF, count=k)
            return out
        if dcpl.get_layout() != h5py.h5d.CHUNKED or dcpl.get_nfilters():
            return None
        rows = max(1, int(dcpl.get_chunk()[0]))
        full = rows * VLEN_REF.itemsize
        for lo in range(0, n, rows):  # one read a chunk
            try:
                info = ds.id.get_chunk_info_by_coord((lo,))
            except _H5_ERRORS:
                continue  # a damaged index entry: those rows read as null
            if info.byte_offset is None or int(info.byte_offset) >= size:
                continue  # a chunk never written (or placed past the end): empty strings
            at = int(info.byte_offset)
            raw = heap.pread(at, min(int(info.size), full, size - at))
            k = min(rows, n - lo, len(raw) // VLEN_REF.itemsize)
            out[lo : lo + k] = np.frombuffer(raw, VLEN_REF, count=k)
        return out
    except _H5_ERRORS:
        return None


class _Heap:
    """The global heap collections a rank file's strings point at, each read and walked by
    :mod:`distdiag.gheap` before anything of the file is decoded by libhdf5 (whose walk of a
    damaged one never ends). ``damaged``: why some cannot be used ("" when all can)."""

    def __init__(self, f: Any) -> None:
        self._f = f
        self.good: dict[int, Any] = {}
        self.damaged = ""
        self._seen: set[int] = set()
        #: the string table and its references as :meth:`of` read them (None: not read)
        self.ds: Any = None
        self.shape: Any = None
        self.dtype: tuple[np.dtype, Any] | None = None
        self.refs: np.ndarray | None = None
        #: how the file's bytes are read, chosen on the first read: its descriptor, or its image
        #: (a file in memory: a spill log's)
        self._fd: int | None = None
        self._image: bytes | None = None

    def check(self, refs: np.ndarray) -> None:
        """Walk the collections of ``refs`` not walked yet."""
        new = [a for a in np.unique(refs["addr"]).tolist() if a and a not in self._seen]
        if not new:
            return
        self._seen.update(new)
        good, bad = gheap.collections(new, self.pread, self.size())
        self.good.update(good)
        if bad and not self.damaged:
            self.damaged = bad[0] + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else "")

    def size(self) -> int:
        """The file's size (0: unknown), of a file in memory too."""
        try:
            return int(self._f.id.get_filesize())
        except _H5_ERRORS:
            return _file_size(self._f) or 0

    def pread(self, offset: int, n: int) -> bytes:
        if self._fd is None and self._image is None:
            if self._f.driver == "sec2":  # a rank file on disk (_open_h5_file)
                self._fd = int(self._f.id.get_vfd_handle())
            else:
                self._image = bytes(self._f.id.get_file_image())
        if self._fd is not None:
            return os.pread(self._fd, n, offset)
        assert self._image is not None
        return self._image[offset : offset + n]

    @classmethod
    def of(cls, f: Any) -> _Heap:
        """The heap of ``f``'s string table as it is now (no table, or not the shim's layout:
        nothing walked)."""
        import h5py

        heap = cls(f)
        try:
            heap.ds = ds = _open_obj(f, "strings")
            heap.shape = shape = getattr(ds, "shape", None)
            if shape is not None and len(shape) == 1:
                heap.dtype = _dtype_of(ds.id.get_type())
                info = h5py.check_string_dtype(heap.dtype[0])
                if info is not None and info.length is None:
                    heap.refs = _vlen_refs(ds, min(int(shape[0]), _max_rows(f, 16, heap.size() or None)), heap)
                    if heap.refs is not None:
                        heap.check(heap.refs)
        except (RefusedTable, *_H5_ERRORS):
            pass  # said when the table is read
        return heap


def _strings_in_budget(lengths: np.ndarray, budget: int) -> tuple[int, int]:
    """How many of the strings of ``lengths`` fit ``budget`` bytes decoded, and their declared total."""
    total = np.cumsum(lengths)
    fit = int(np.searchsorted(total, budget, side="right"))
    return fit, int(total[-1]) if len(lengths) else 0


def _written_rows(ds: Any, n: int, itemsize: int) -> int:
    """Of the first ``n`` rows of ``ds``, how many lie before the end of its last written
    chunk: the rows after it were never written (HDF5 hands back fill values), and asking
    HDF5 for them costs ~6 KB of its own memory per empty chunk (measured: a /strings of
    2^31 declared rows in 1-row chunks took 540 MB to read its first 86,129). A table whose
    storage holds all ``n`` rows (every healthy one: chunks are allocated whole) costs one
    call (~1 us)."""
    import h5py

    try:
        if n == 0 or ds.id.get_storage_size() >= n * max(1, itemsize):
            return n
        dcpl = ds.id.get_create_plist()
        if dcpl.get_layout() != h5py.h5d.CHUNKED:
            return n
        rows = max(1, int(dcpl.get_chunk()[0]))
        if ds.id.get_num_chunks() == 0:
            return 0
        end = [0]

        def last(info: Any) -> None:
            end[0] = max(end[0], int(info.chunk_offset[0]) + rows)

        ds.id.chunk_iter(last)
        return min(n, end[0])
    except _H5_ERRORS:  # an old HDF5 without chunk_iter: as declared
        return n


def _read_strings(f: Any, fname: str, warnings: list[str], size: int | None, heap: _Heap) -> np.ndarray | str:
    """The rank's string table, or a one-line reason why it cannot be used.

    Decoding is bounded by the file's size (:data:`_STRING_BYTES_PER_FILE_BYTE`): a
    hostile file whose entries all point at one shared 1 MB heap object would otherwise
    decode to a copy per entry (2.9 GB from a 1.5 MB file). The strings beyond the
    bound are read as "" and said in one warning line.

    Variable-length strings in chunks (the shim's table) are decoded from their global
    heap by :mod:`distdiag.gheap`, never by libhdf5 (``heap``: the collections already
    walked, and the table as it read it before the attributes); a string in a damaged
    collection reads as "" and is said."""
    import h5py

    if heap.ds is not None:
        ds, shape = heap.ds, heap.shape
    else:  # it could not be opened then: opened again, for the reason
        try:
            ds = _open_obj(f, "strings")
        except RefusedTable as e:
            return f"{fname}: {e}; skipped (a rank file's tables are read from the file itself only)"
        shape = getattr(ds, "shape", None)
    if shape is None or len(shape) != 1:
        return f"{fname}: /strings is not a table of strings (corrupt); skipped"
    n = int(shape[0])
    cap = _max_rows(f, 16, size)  # a variable-length string is a 16-byte heap reference in its chunk
    if n > cap:
        warnings.append(f"{fname}: /strings claims {n} strings, more than the file can hold (corrupt header); reading {cap}")
        n = cap
    written = _written_rows(ds, n, 16) if isinstance(ds, h5py.Dataset) else n
    if written < n:  # the rest were never written: they read as "", as ids past the table do
        warnings.append(f"{fname}: /strings declares {int(shape[0])} strings but only its first {written} were "
                        "written (corrupt header); reading those")  # fmt: skip
        n = written
    budget = _STRING_BYTES_PER_FILE_BYTE * (size if size is not None else 1 << 40) + (1 << 20)
    try:
        dt, _ = heap.dtype if heap.dtype is not None else _dtype_of(ds.id.get_type())
        info = h5py.check_string_dtype(dt)
        vlen = info is not None and info.length is None
        if not vlen:
            refs = None
        elif heap.refs is not None and len(heap.refs) >= n:
            refs = heap.refs[:n]  # read before the attributes
        else:
            refs = _vlen_refs(ds, n, heap)
        total: int | None
        if refs is not None:
            fit, total = _strings_in_budget(refs["len"].astype(np.int64), budget)
        elif vlen:  # filtered or compact: the shim never writes it, and libhdf5 would walk its heap unchecked
            return (f"{fname}: /strings holds variable-length strings in a layout the shim never writes "
                    "(compressed or compact), which only libhdf5 could decode, from a heap distdiag cannot "
                    "check first (see distdiag.gheap); skipped")  # fmt: skip
        else:  # fixed-length: the size is the type's
            fit, total = min(n, budget // max(1, dt.itemsize)), n * dt.itemsize
        if fit < n:
            warnings.append(
                f"{fname}: /strings would decode to {(total or 0) / 1e6:.0f} MB, more than {_STRING_BYTES_PER_FILE_BYTE}x "
                f"the file's size (corrupt or hostile); reading the first {fit} of {n} strings, the rest as \"\""
            )
        out = np.empty(n, dtype=object)
        out[fit:] = ""
        if refs is not None:
            heap.check(refs[:fit])
            got, damaged = gheap.decode(refs[:fit], heap.good, "ascii" if info is not None and info.encoding == "ascii" else "utf-8")
            out[:fit] = got
            if damaged:
                why = heap.damaged or "they name no object of their heap collection, or one of another length"
                warnings.append(f"{fname}: {damaged} of its {n} strings cannot be read ({why}; corrupt); "
                                "they read as \"\"")  # fmt: skip
            return out
        out[:fit] = list(ds.asstr()[:fit])
        return out
    except _H5_ERRORS as e:
        return f"{fname}: its string table cannot be read ({_short(e)}); skipped"


def _int_attr(attrs: Any, name: str, default: Any = None) -> Any:
    """An integer attribute, or ``default`` when it is absent or not an integer (corrupt)."""
    v = _attr(attrs, name)
    if v is None:
        return default
    try:
        return int(v)
    except (TypeError, ValueError, OverflowError):
        return default


def _read_table(
    f: Any, name: str, dtype: np.dtype, fname: str, warnings: list[str], refresh: bool = True, size: int | None = -1,
    packer: Packer | None = None, rank: int = -1, scan: list[_Scan] | None = None,
) -> np.ndarray:
    """A dataset as ``dtype``; rows up to the first unreadable block if damaged.

    ``refresh``: see rows a still-running writer appended since the open (SWMR);
    not needed for a file its writer closed. Cost per call matters at 16k rank
    files: h5py's ``shape``/``dtype`` properties and slicing each cost tens of
    microseconds, so each is asked once, the dtype comes from the type cache
    (:func:`_dtype_of`), and a healthy table of up to ``_READ_BLOCK_ROWS`` rows
    is read with one low-level read. ``size``: the file's size, if known.

    ``packer``: the events table, when healthy and in the shim's layout, goes
    straight into the packer's buffer with rank ``rank`` (:meth:`Packer.read_events`),
    its scan appended to ``scan``; the rows returned are then that view
    (``RUN_EVENT_DTYPE``), to be taken by the packer before its next read."""
    import h5py

    oid, why = _inspect(f, name)
    if why is not None:
        warnings.append(f"{fname}: {why}; ignored (a rank file's tables are read from the file itself only)")
        return np.zeros(0, dtype)
    if oid is None:  # no such table
        return np.zeros(0, dtype)
    ds = _open_obj(f, name, oid)
    shape = getattr(ds, "shape", None)
    mtype: Any = None
    ds_dtype: np.dtype | None
    if isinstance(ds, h5py.Dataset):
        ds_dtype, mtype = _dtype_of(ds.id.get_type())
    else:
        ds_dtype = getattr(ds, "dtype", None)
    names = getattr(ds_dtype, "names", None) or ()
    if ds_dtype is None or shape is None or len(shape) != 1 or not set(names) & set(dtype.names or ()):
        warnings.append(f"{fname}: /{name} is not a table of {name} rows (corrupt, or written by another tool); ignored")
        return np.zeros(0, dtype)
    lacks = [c for c in _REQUIRED_COLUMNS.get(dtype, ()) if c not in names]
    if lacks:  # zeros in their place would be rows at time 0, or of kind 0: not the rows the file meant
        warnings.append(f"{fname}: /{name} lacks the column(s) {', '.join(lacks)} (corrupt, or written by another "
                        "tool); ignored")  # fmt: skip
        return np.zeros(0, dtype)
    if refresh:
        try:
            ds.refresh()  # SWMR: see rows appended since open
            shape = ds.shape
        except Exception:
            pass
    n = int(shape[0]) if shape else 0
    cap = _max_rows(f, ds_dtype.itemsize, size)
    if n > cap:
        warnings.append(f"{fname}: /{name} claims {n} rows, more than the file can hold (corrupt header); reading {cap}")
        n = cap
    written = _written_rows(ds, n, ds_dtype.itemsize) if isinstance(ds, h5py.Dataset) else n
    if written < n:  # never written: fill values, not rows the rank recorded
        warnings.append(f"{fname}: /{name} declares {int(shape[0])} rows but only its first {written} were written "
                        "(corrupt header); reading those")  # fmt: skip
        n = written
    if packer is not None and scan is not None and mtype is not None and n == int(shape[0]) and ds_dtype == dtype == EVENT_DTYPE:
        try:
            rows, sc = packer.read_events(ds.id, n, mtype, rank)
            scan.append(sc)
            return rows
        except _H5_ERRORS:
            pass  # damaged: read as below, which keeps what it can
    if n <= _READ_BLOCK_ROWS and n == int(shape[0]):
        whole = np.empty(n, ds_dtype)
        try:
            if n:
                ds.id.read(h5py.h5s.ALL, h5py.h5s.ALL, whole, mtype=mtype)
            return _as_dtype(whole, dtype)
        except _H5_ERRORS:
            pass  # damaged: the block-wise read below keeps what it can
    parts = []
    got = 0
    for lo in range(0, n, _READ_BLOCK_ROWS):  # one iteration per million rows
        hi = min(n, lo + _READ_BLOCK_ROWS)
        try:
            block = ds[lo:hi]
        except _H5_ERRORS as e:
            # Try smaller pieces so we keep every row before the damage.
            block = _salvage(ds, lo, hi)
            warnings.append(
                f"{fname}: /{name} is damaged after row {lo + len(block)} of {n} ({_short(e)}); "
                f"analyzing the {lo + len(block)} rows before it"
            )
            parts.append(block)
            got += len(block)
            break
        parts.append(block)
        got += len(block)
    if not parts:
        return np.zeros(0, dtype)
    return _as_dtype(parts[0] if len(parts) == 1 else np.concatenate(parts), dtype)


#: the columns without which a table's rows mean nothing (any other missing column reads as zero)
_REQUIRED_COLUMNS: dict[np.dtype, tuple[str, ...]] = {EVENT_DTYPE: ("t0_ns", "t1_ns", "kind")}


def _as_dtype(raw: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``raw`` with the fields of ``dtype`` (missing ones zero)."""
    if raw.dtype == dtype:
        return raw
    out = np.zeros(len(raw), dtype)
    for col in dtype.names or ():
        if raw.dtype.names and col in raw.dtype.names:
            out[col] = raw[col]
    return out


def _salvage(ds: Any, lo: int, hi: int) -> np.ndarray:
    """Rows [lo, k) for the largest k that reads, by bisection (log2 reads)."""
    good = lo
    bad = hi
    while bad - good > 1:
        mid = (good + bad) // 2
        try:
            ds[good:mid]
            good = mid
        except _H5_ERRORS:
            bad = mid
    try:
        return np.asarray(ds[lo:good])
    except _H5_ERRORS:
        return np.zeros(0, ds.dtype)


def _short(e: BaseException) -> str:
    """h5py's message, cut to what helps a user."""
    s = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    m = re.search(r"truncated file: eof = (\d+).*stored_eof = (\d+)", s)
    if m:
        return f"{m.group(1)} of {m.group(2)} bytes present"
    s = s.removeprefix("Unable to synchronously open file ").removeprefix("Unable to open file ")
    return s[:160]


#: How far a row may lie outside its rank's recorded span (shim start to its last flush or
#: exit) and still be believed: the shim stamps both ends itself, from the rows' own clock.
_SPAN_SLACK_NS = 10 * 10**9


#: how long before the shim's start a process may have started (its interpreter, its imports)
MAX_LEAD_IN_NS = 24 * 3600 * 10**9


def _process_start(proc0: int | None, mono0: int | None) -> int | None:
    """The process's start (``process_start_mono_ns``: the libc interposer's load, before the
    interpreter's first instruction; rows from then on are the interpreter's own start and
    imports), when it lies before the shim's start and less than a day before it; else None."""
    if proc0 is None or mono0 is None or not 0 <= mono0 - proc0 <= MAX_LEAD_IN_NS:
        return None
    return proc0


def _recorded_span(mono0: int | None, end: int | None, last_flush: int | None) -> tuple[int | None, int | None]:
    """[first, last] instant a rank's rows may hold, from its attributes (None: that end unknown)."""
    lo = None if mono0 is None else mono0 - _SPAN_SLACK_NS
    ends = [x for x in (end, last_flush) if x is not None and x > 0]
    hi = max(ends) + _SPAN_SLACK_NS if ends else None
    return lo, hi


def _in_span(
    rows: np.ndarray, scan: _Scan, span: tuple[int | None, int | None], fname: str, warnings: list[str],
    packer: Packer | None, what: str = "event",
) -> tuple[np.ndarray, _Scan]:
    """``rows`` without those outside the rank's recorded ``span``, and their scan; one warning
    line counts what was dropped.

    A run dir is untrusted, and one row with t0 = INT64_MIN and t1 = INT64_MAX
    made the wall-clock 18,446,744,074 s, which hid a real metadata storm below
    every threshold. t1 = -1 is an open call (in flight), not an instant. The
    scan's bounds decide first, so a healthy table costs nothing more."""
    lo, hi = span
    if not scan.rows:
        return rows, scan
    below = lo is not None and min(scan.t0_min, scan.t1_min) < lo  # an open call's -1 too: then look closer
    above = hi is not None and max(scan.t0_max, scan.t1_max) > hi
    if not (below or above):
        return rows, scan
    t0, t1 = rows["t0_ns"], rows["t1_ns"]
    keep = np.ones(len(rows), bool)
    if lo is not None:
        keep &= (t0 >= lo) & ((t1 >= lo) | (t1 == -1))
    if hi is not None:
        keep &= (t0 <= hi) & (t1 <= hi)
    n_bad = len(rows) - int(np.count_nonzero(keep))
    if n_bad == 0:
        return rows, scan
    warnings.append(
        f"{fname}: {n_bad} {what} row{'s' if n_bad != 1 else ''} outside the rank's recorded span "
        f"(implausible timestamps: a damaged or forged file); dropped, the rest analyzed"
    )
    kept = packer.compact(rows, keep) if packer is not None else rows[keep]
    return kept, _Scan.of(kept)


def read_rank(path: Path, warnings: list[str], packer: Packer | None = None) -> RankData | str:
    """One rank file, or a one-line reason why it cannot be used.

    ``packer``: its events may be read straight into the packer's buffer (see
    :func:`_read_table`); the caller must then ``packer.take`` the result before
    the next read, as :func:`load_run` does."""
    fname = path.name
    try:
        f = _open_h5(path)
    except NotOwnFile as e:
        return f"{fname} {e}; skipped"
    except FileNotFoundError:
        return f"{fname} disappeared while the run dir was read; skipped"
    except SpillLogError as e:
        return f"{fname}: {e}; skipped"
    except _H5_ERRORS as e:
        if "signature not found" in str(e):
            try:
                empty = path.stat().st_size == 0
            except OSError:
                empty = False
            if empty:  # claimed at start, written from the first flush after the program's numpy import
                return (f"{fname} is not an HDF5 file: it is empty and has no spill log beside it (the process was "
                        "killed before its first flush, or its log could not be made); skipped")  # fmt: skip
            return f"{fname} is not an HDF5 file (no HDF5 signature: empty, overwritten or not a rank file); skipped"
        return f"{fname} cannot be opened as HDF5 (truncated or corrupt: {_short(e).strip('()')}); skipped"
    try:
        with f:
            heap = _Heap.of(f)  # before any attribute: see distdiag.gheap
            attrs = _Attrs(f, heap)
            try:
                version = _attr(attrs, SCHEMA_ATTR)
            except _H5_ERRORS as e:
                return f"{fname} has unreadable attributes (corrupt: {_short(e)}); skipped"
            if version is None:
                return f"{fname} is an HDF5 file but not a distdiag rank file (no '{SCHEMA_ATTR}' attribute); skipped"
            try:
                version = int(version)
            except (TypeError, ValueError):
                return f"{fname} has a malformed schema version {version!r}; skipped"
            if version != SCHEMA_VERSION:
                writer = _attr(attrs, "distdiag_version", "?")
                return (
                    f"{fname} was written with rank-file schema {version} (distdiag {writer}); this distdiag reads "
                    f"schema {SCHEMA_VERSION}: analyze it with distdiag {writer} (pip install 'distdiag=={writer}')"
                )
            m = RANK_FILE_RE.match(fname)
            name_rank = int(m.group(1)) if m else -1
            rank = _attr(attrs, "rank", name_rank)
            try:
                rank = int(rank)
            except (TypeError, ValueError):
                rank = name_rank
            if rank < 0:
                return f"{fname} names no rank; skipped"
            if rank >= MAX_RANKS:
                return f"{fname} names rank {rank}, beyond any launch (corrupt attribute); skipped"
            # links.exists, not `in`: `in` resolves an external link, which opens its target
            if not (f.id.links.exists(b"events") and f.id.links.exists(b"strings")):
                return f"{fname} lacks the /events or /strings table (corrupt, or killed before its first flush); skipped"

            # A file its writer closed gets no more rows: no SWMR refresh (4 per file otherwise).
            live = not bool(_attr(attrs, "closed_cleanly", False))
            spilled = _attr(attrs, "read_from_spill_log")
            if spilled is not None:  # built in memory from the log (_open_spill): nothing to refresh
                live = False
                warnings.append(f"{fname}: read from its spill log {fname}.log ({spilled})")
            size = _file_size(f)
            scans: list[_Scan] = []
            events = _read_table(
                f, "events", EVENT_DTYPE, fname, warnings, refresh=live, size=size, packer=packer, rank=rank, scan=scans
            )
            scan = scans[0] if scans else _Scan.of(events)
            mono0 = _int_attr(attrs, "mono_ns_at_start")
            wall0 = _int_attr(attrs, "wall_ns_at_start")
            end = _int_attr(attrs, "end_mono_ns")
            last_flush = _int_attr(attrs, "last_flush_mono_ns")
            proc0 = _process_start(_int_attr(attrs, "process_start_mono_ns"), mono0)
            span = _recorded_span(mono0 if proc0 is None else proc0, end, last_flush)
            n_read = len(events)
            events, scan = _in_span(events, scan, span, fname, warnings, packer)
            dropped_span = span if len(events) < n_read else (None, None)  # for a band's re-read
            cuda_timing = str(_attr(attrs, "cuda_timing", "") or "")[:300]
            n_gpu = 0
            if cuda_timing.startswith("on"):  # GPU-timed: collectives on the GPU's timeline
                n_gpu = _gpu_times(events)
                if n_gpu:
                    scan = _Scan.of(events)
            strings = _read_strings(f, fname, warnings, size, heap)
            if isinstance(strings, str):
                return strings
            if heap.damaged:
                warnings.append(f"{fname}: its text attributes (host, launch id, command line) are not read: "
                                f"{heap.damaged} (corrupt)")  # fmt: skip
            if len(strings) == 0:
                strings = np.array([""], dtype=object)
            sync = _read_table(f, "clock_sync", SYNC_DTYPE, fname, warnings, refresh=live, size=size)
            inflight = _read_table(f, "inflight", EVENT_DTYPE, fname, warnings, refresh=live, size=size)
            if len(inflight):
                inflight, _ = _in_span(inflight, _Scan.of(inflight), span, fname, warnings, None, "in-flight")
            gpu = _read_table(f, "gpu", GPU_DTYPE, fname, warnings, refresh=live, size=size)

            closed = not live and spilled is None
            has_ev = len(events) > 0
            ev_t0 = scan.t0_min if has_ev else None
            ev_t1 = max(scan.t1_max, scan.t0_max) if has_ev else None
            starts = [int(x) for x in (mono0, ev_t0, proc0) if x is not None]
            start_ns = min(starts) if starts else 0
            ends = [int(x) for x in (end, last_flush, ev_t1) if x is not None]
            if len(inflight):
                ends.append(int(inflight["t0_ns"].max()))
            end_ns = max(ends) if ends else start_ns
            if end is not None and closed:
                end_ns = max(int(end), ev_t1 or 0)
            exit_code = _int_attr(attrs, "exit_code")
            reached = _int_attr(attrs, "budget_reached_mono_ns")
            counted: dict[str, tuple[int, float]] = {}
            if reached is not None:
                counters = _read_table(f, "counters", COUNTER_DTYPE, fname, warnings, refresh=live, size=size)
                if len(counters):
                    kinds = counters["kind"]
                    n_of = np.bincount(kinds, weights=np.maximum(counters["count"], 0), minlength=256)
                    s_of = np.bincount(kinds, weights=np.maximum(counters["dur_ns"], 0) / 1e9, minlength=256)
                    for k in np.flatnonzero(n_of).tolist():
                        name = Kind(k).name.lower() if k in _KIND_VALUES else f"kind {k}"
                        counted[name] = (int(n_of[k]), float(s_of[k]))
            info = RankInfo(
                rank=rank,
                path=path,
                host=str(_attr(attrs, "host", "") or ""),
                local_rank=_int_attr(attrs, "local_rank", -1),
                world_size=_int_attr(attrs, "world_size", 0),
                job_id=str(_attr(attrs, "job_id", "") or ""),
                launch_id=str(_attr(attrs, "launch_id", "") or ""),
                pid=_int_attr(attrs, "pid", -1),
                start_ns=start_ns,
                end_ns=end_ns,
                closed_cleanly=closed,
                exit_code=None if exit_code is None else int(exit_code),
                lost_events=max(0, _int_attr(attrs, "lost_events", 0)),
                n_events=len(events),
                wall_ns_at_start=None if wall0 is None else int(wall0),
                mono_ns_at_start=None if mono0 is None else int(mono0),
                distdiag_version=str(_attr(attrs, "distdiag_version", "") or ""),
                argv=_json_attr(attrs, "argv", []),
                env={k: v for k, v in _json_attr(attrs, "env", {}).items() if isinstance(v, str)},
                config=_json_attr(attrs, "config", {}),
                budget_bytes=max(0, _int_attr(attrs, "budget_bytes", 0)),
                budget_reached_s=None if reached is None else max(0, reached - start_ns) / 1e9,
                sample_every=max(0, _int_attr(attrs, "sample_every", 0)),
                counted_only=counted,
                recording_stopped=str(_attr(attrs, "recording_stopped", "") or "")[:300],
                lead_in_ns=0 if proc0 is None or mono0 is None else int(mono0) - proc0,
                cuda_timing=cuda_timing,
                role=str(_attr(attrs, "role", "") or "")[:40],
                gpu_timed_collectives=n_gpu,
                row_span=dropped_span,
                fileio_capture=str(_attr(attrs, "fileio_capture", "") or "")[:20],
            )
            if attrs.refused:
                warnings.append(f"{fname}: attributes {', '.join(sorted(set(attrs.refused)))} have a type the shim "
                                "never writes (corrupt); read as absent")  # fmt: skip
            return RankData(info, events, strings, sync, inflight, gpu, scan)
    except _H5_ERRORS as e:
        return f"{fname} cannot be read (truncated or corrupt: {_short(e)}); skipped"


def _global_strings(tables: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
    """One global string table and, per rank, a lookup array local id -> global id.

    One dict pass over the strings (not the events: a rank has thousands of
    strings against millions of events); the lookup arrays then remap every
    event column with a single gather. Deliberately not ``np.unique`` on a
    fixed-width unicode copy: 10^6 paths of 200 characters would take 800 MB.
    "" is inserted first, so it keeps id 0.
    """
    ids: dict[str, int] = {"": 0}
    lookups = []
    for t in tables:  # per rank
        lookups.append(np.fromiter((ids.setdefault(str(x), len(ids)) for x in t), dtype=np.int32, count=len(t)))
    table = np.empty(len(ids), dtype=object)
    table[:] = list(ids)
    return table, lookups


def _map_ids(ids: np.ndarray, lookup: np.ndarray) -> tuple[np.ndarray, int]:
    """``lookup[ids]``, with ids out of range mapped to 0 ("") and counted."""
    if len(ids) == 0:
        return ids, 0
    if int(ids.min()) >= 0 and int(ids.max()) < len(lookup):  # the normal case: one gather
        return lookup[ids], 0
    oob = (ids < 0) | (ids >= len(lookup))
    return np.where(oob, 0, lookup[np.clip(ids, 0, len(lookup) - 1)]), int(oob.sum())


def _remap(arr: np.ndarray, lookup: np.ndarray) -> int:
    """Remap the string-id columns of ``arr`` in place; returns how many ids were out of range."""
    bad = 0
    for col in STRING_COLUMNS:
        arr[col], b = _map_ids(arr[col], lookup)
        bad += b
    # File events keep a string id in ``aux`` too: "fstype:mountpoint" (shim/hooks/fileio.py);
    # so do collectives (datatype name) and waits (the awaited op), so that equal
    # datatypes compare equal across ranks (distdiag.detectors.collective_mismatch).
    fk = _AUX_KIND_TABLE.take(arr["kind"])  # np.isin, by one gather (isin: ~0.1 ms a call)
    if fk.any():
        mapped, b = _map_ids(arr["aux"][fk], lookup)
        arr["aux"][fk] = mapped
        bad += b
    return bad


#: Rows per block of the table-wide passes of assemble (a few MB of temporaries).
_ASSEMBLE_ROWS = 1 << 18


def _sort_late_ranks(events: np.ndarray, spans: dict[int, tuple[int, int]], late: list[int]) -> None:
    """Sort by t0 the rows of the ranks in ``late`` (their scan found rows out of
    time order: threads flush chunks out of order), so the table is sorted by
    (rank, t0). Finding them is :class:`_Scan`'s work, done while reading; here
    it was a pass over the whole table (~25 ns an event)."""
    for rk in late:  # ranks out of time order: usually none
        lo, hi = spans[rk]
        ev = events[lo:hi]
        rows = ev.view(_RUN_ROW)  # whole rows as one void field: one memcpy a row (field by field: ~10x)
        rows[:] = rows.take(np.argsort(ev["t0_ns"], kind="stable"))


def _remap_table(
    events: np.ndarray, ranks: list[int], lookups: list[np.ndarray], in_range: list[bool]
) -> int:
    """:func:`_remap` of every rank's rows (``lookups[i]`` is rank ``ranks[i]``'s), done
    over the whole table (sorted by rank) by blocks of rows. Returns how many ids
    were out of range. ``in_range[i]``: rank ``ranks[i]``'s scan found every id in
    range; such a rank with an identity lookup needs nothing, and blocks of those
    ranks only are not looked at: the usual run costs nothing here.

    The usual case is cheap: the ranks of an SPMD job meet their strings in the
    same order, so most lookups are the identity, and a block whose ranks all
    have one only needs its ids range-checked (two reductions a column), no
    gather and no write-back. Other blocks gather from the concatenated lookups
    through each row's rank. (Rank by rank this cost ~0.9 ms per 10k-event rank,
    measured at 1,024 ranks.)"""
    if len(events) == 0:
        return 0
    n_r = max(ranks) + 1
    base = np.zeros(n_r, np.int64)
    size = np.full(n_r, np.iinfo(np.int64).max, np.int64)  # absent ranks own no rows
    ident = np.ones(n_r, bool)
    lens = np.array([len(lk) for lk in lookups], np.int64)
    base[ranks] = np.concatenate([[0], np.cumsum(lens)[:-1]])
    size[ranks] = lens
    ident[ranks] = [bool(np.array_equal(lk, np.arange(len(lk)))) for lk in lookups]
    n_ident = np.concatenate([[0], np.cumsum(ident)])
    dirty = np.zeros(n_r, bool)
    dirty[ranks] = ~(ident[ranks] & np.array(in_range, bool))
    n_dirty = np.concatenate([[0], np.cumsum(dirty)])
    cat = np.concatenate(lookups)

    def mapped(ids: np.ndarray, r: np.ndarray, ln_min: int, identity: bool) -> tuple[np.ndarray | None, int]:
        """lookup[ids] of each row's rank (None: unchanged); ids out of its range -> 0 (""), counted."""
        if len(ids) == 0 or (int(ids.min()) >= 0 and int(ids.max()) < ln_min):
            if identity:
                return None, 0
            at = ids.astype(np.int64)
            at += base[r]
            return cat[at], 0
        at = ids.astype(np.int64)
        oob = (at < 0) | (at >= size[r])
        n_bad = int(np.count_nonzero(oob))
        at += base[r]
        at[oob] = 0
        out = cat[at]
        out[oob] = 0
        return out, n_bad

    bad = 0
    for a in range(0, len(events), _ASSEMBLE_ROWS):  # per block of rows
        blk = events[a : a + _ASSEMBLE_ROWS]
        r_lo, r_hi = int(blk["rank"][0]), int(blk["rank"][-1])  # rows come by rank: the block holds ranks r_lo..r_hi
        if n_dirty[r_hi + 1] == n_dirty[r_lo]:
            continue  # clean ranks only
        r = blk["rank"]
        identity = int(n_ident[r_hi + 1] - n_ident[r_lo]) == r_hi + 1 - r_lo
        ln_min = int(size[r_lo : r_hi + 1].min())
        for col in STRING_COLUMNS:  # three id columns
            out, b = mapped(blk[col], r, ln_min, identity)
            if out is not None:
                blk[col] = out
            bad += b
        # aux holds a string id too for file events, collectives and waits (see _remap)
        fk = _AUX_KIND_TABLE[blk["kind"]]  # np.isin by a 256-entry table: one gather
        if fk.any():
            aux = blk["aux"]
            out, b = mapped(aux[fk], r[fk], ln_min, identity)
            if out is not None:
                aux[fk] = out
            bad += b
    return bad


def _assemble_collectives(
    packer: Packer, paths: list[Path], lookups: list[np.ndarray]
) -> tuple[np.ndarray, np.ndarray, int]:
    """The kept collective rows of the ranks whose files are ``paths`` (ascending ranks), as one
    ``COLL_ROW_DTYPE`` table sorted by (rank, t0) with global string ids, the run's sig table,
    and how many string ids were out of range (counted per row, as the table's remap counts).
    The buffer is used in place when the ranks filled it in order (the usual case)."""
    assert packer.coll is not None
    parts = [packer.coll_parts[p] for p in paths]
    in_order = all(a == b for a, b in zip((o for o, _, _ in parts), np.cumsum([0] + [n for _, n, _ in parts])))
    total = sum(n for _, n, _ in parts)
    rows = packer.coll[:total] if in_order else np.empty(total, COLL_ROW_DTYPE)
    sigs, maps = _coll_sig_maps([t for _, _, t in parts], lookups)
    off = 0
    for (o, n, _), lookup, m, path in zip(parts, lookups, maps, paths):  # per rank: its slice
        sl = rows[off : off + n]
        if not in_order:
            sl[:] = packer.coll[o : o + n]
        finish_coll_rows(sl, lookup, m, packer.stats[path].unsorted)
        off += n
    return rows, sigs, sum(packer.coll_bad[p] for p in paths)


def _coll_sig_maps(tables: list[np.ndarray], lookups: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
    """The run's sig table (``_SIG_DTYPE``, global string ids, sorted) from each rank's own small
    one (local string ids), and per rank its local sig -> global sig map. No rows needed:
    ``--parallel`` makes it on rank 0 while the rows stay where they were read."""
    remapped = []
    for table, lookup in zip(tables, lookups):  # per rank: its small sig table
        t = table.copy()
        for f in ("name_id", "site_id", "aux"):  # the string-id fields (aux: the datatype of a collective)
            t[f], _ = _map_ids(t[f], lookup)
        remapped.append(t)
    cat = np.concatenate(remapped) if remapped else np.zeros(0, _SIG_DTYPE)
    u, inv = np.unique(cat.view(_SIG_VOID), return_inverse=True)
    inv = inv.reshape(-1).astype(np.int32)
    cuts = np.cumsum([len(t) for t in tables])[:-1]
    return u.view(_SIG_DTYPE), np.split(inv, cuts) if tables else []


def finish_coll_rows(sl: np.ndarray, lookup: np.ndarray, sig_map: np.ndarray, unsorted: bool) -> None:
    """One rank's kept collective rows as the run holds them, in place: sorted by t0 (stable)
    when the rank's rows came out of order, global communicator ids, global sigs."""
    if unsorted and len(sl) > 1:
        sl[:] = sl.take(np.argsort(sl["t0_ns"], kind="stable"))
    sl["comm_id"], _ = _map_ids(sl["comm_id"], lookup)
    sl["sig"] = sig_map[sl["sig"]]


def _coll_bad(c: np.ndarray, table: np.ndarray, sig: np.ndarray, n_strings: int) -> int:
    """Out-of-range string ids of one rank's kept collective rows (local ids, its string table
    ``n_strings`` long), counted per row as the table's remap counts them: the comm id of each
    row, and the op, site and datatype of each row through its sig."""
    at = c["comm_id"].astype(np.int64)
    bad = int(np.count_nonzero((at < 0) | (at >= n_strings)))
    uses = np.bincount(sig, minlength=len(table)) if len(c) else np.zeros(len(table), np.int64)
    for f in ("name_id", "site_id", "aux"):  # the string-id fields of the sig table
        v = table[f].astype(np.int64)
        bad += int(uses[(v < 0) | (v >= n_strings)].sum())
    return bad


def _attach_rank(arr: np.ndarray, dtype: np.dtype, rank: int, out: np.ndarray | None = None) -> np.ndarray:
    """``arr`` with a rank column appended (into ``out`` when given).

    The run dtypes are the file dtype with ``rank`` appended after its last
    byte, both packed, so the rows copy as raw bytes: one strided memcpy
    instead of one pass per field (measured 10x faster at 10^6 rows).
    """
    if out is None:
        out = np.empty(len(arr), dtype)
    n = len(arr)
    if arr.dtype == dtype:  # already carries the rank column (a packed view)
        out[:] = arr
        out["rank"] = rank
        return out
    src = np.ascontiguousarray(arr)
    k = src.dtype.itemsize
    if k + 4 == dtype.itemsize and dtype.fields is not None and dtype.fields["rank"][1] == k:
        if n:
            # each row's bytes as one void field (one memcpy a row: ~7 ns, the uint8
            # 2-D copy ~9-17, measured), the rank after them
            rows = np.dtype({"names": ["v", "rank"], "formats": [f"V{k}", dtype.fields["rank"][0]],
                             "offsets": [0, k], "itemsize": k + 4})  # fmt: skip
            ov = out.view(rows)
            ov["v"] = src.view(f"V{k}")
            ov["rank"] = rank
        return out
    for col in src.dtype.names or ():
        out[col] = src[col]
    out["rank"] = rank
    return out


#: a flag per kind byte: True for the collective kinds (the loader's and the match's selection)
COMM_TABLE = np.zeros(256, bool)
COMM_TABLE[[int(k) for k in COMM_KINDS]] = True
#: odd 64-bit multipliers that mix each field of a sig into one hash (a collision is checked, not assumed away)
_SIG_MIX = np.array([0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93,
                     0xFF51AFD7ED558CCD], np.uint64)  # fmt: skip


def _anon(rows: int, dtype: np.dtype) -> np.ndarray:
    """An uninitialized array in its own anonymous mapping (pages never written are never resident;
    the mapping is unmapped when its last view dies)."""
    try:
        m = mmap.mmap(-1, max(1, rows) * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as e:  # ENOMEM: as np.empty's MemoryError, so that callers fall back alike
        raise MemoryError(str(e)) from e
    return np.frombuffer(m, dtype)[:rows]


def _sig_table(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the distinct (op, bytes, root, site, datatype) of ``rows`` as a ``_SIG_DTYPE`` table, each
    row's index into it as int32). By a hash of the five fields, checked: rows that share a
    hash must share the fields, else the exact (slower) unique of the raw records decides."""
    n = len(rows)
    if n == 0:
        return np.zeros(0, _SIG_DTYPE), np.zeros(0, np.int32)
    one = np.empty(1, _SIG_DTYPE)
    for f in _SIG_FIELDS:  # five fields
        one[f] = rows[f][0]
    if all(bool((rows[f] == one[f][0]).all()) for f in _SIG_FIELDS):  # one for all: the usual SPMD rank
        return one, np.zeros(n, np.int32)
    with np.errstate(over="ignore"):
        h = np.zeros(n, np.uint64)
        for f, k in zip(_SIG_FIELDS, _SIG_MIX):  # five fields
            v = rows[f].astype(np.int64).view(np.uint64)
            h ^= v * k + (h << np.uint64(6)) + (h >> np.uint64(2))
    _, first, inv = np.unique(h, return_index=True, return_inverse=True)
    inv = inv.reshape(-1)
    table = np.empty(len(first), _SIG_DTYPE)
    for f in _SIG_FIELDS:  # five fields
        table[f] = rows[f][first]
    if all(np.array_equal(table[f][inv], rows[f]) for f in _SIG_FIELDS):
        return table, inv.astype(np.int32)
    raw = np.empty(n, _SIG_DTYPE)  # a hash collision: the exact way
    for f in _SIG_FIELDS:  # five fields
        raw[f] = rows[f]
    u, inv_raw = np.unique(raw.view(_SIG_VOID), return_inverse=True)
    return u.view(_SIG_DTYPE), inv_raw.reshape(-1).astype(np.int32)


class Packer:
    """Every rank's event rows, copied as they are read into ONE ``RUN_EVENT_DTYPE`` buffer.

    The run's event table is this buffer (``assemble`` takes it as is when the
    ranks come in file order, the normal case), so loading never holds the
    per-rank arrays and the table at once (it did: 148 bytes an event at the
    peak, now 73 plus one rank's file rows, up to ``_READ_BLOCK_ROWS``, in a
    reused scratch: see :meth:`read_events`). The first capacity is an upper bound
    from the file sizes (a shim-written file holds at most size / 69 rows):
    ``np.empty`` only reserves address space, and pages never written are
    never resident. A file that holds more rows (compressed by another tool)
    grows the buffer by doubling and re-points the views handed out before.

    A healthy events table in the shim's layout is read by
    :meth:`read_events` straight into the buffer: blocks of ``_PACK_ROWS`` rows
    through one reused scratch (HDF5 copies the file's bytes, the types being
    equal), each block copied into place with its rank and scanned
    (:class:`_Scan`) while it is in cache. Anything else (another layout, a
    damaged table) is read as before and copied in by :meth:`take`.
    """

    def __init__(self, rows: int, drop: Iterable[int] = ()) -> None:
        #: kind -> not kept in the table (streamed); None: every row is kept
        self.drop: np.ndarray | None = None
        drop = sorted({int(k) for k in drop})
        if drop:
            self.drop = np.zeros(256, bool)
            self.drop[drop] = True
        #: rank file -> what the streamed rows of its rank need (:class:`_RankStream`)
        self.stats: dict[Path, _RankStream] = {}
        #: collective rows dropped from the table but kept for the match (when the collective
        #: kinds are dropped): one COLL_ROW_DTYPE buffer filled rank by rank, its used rows,
        #: and per rank file (offset, rows, its own sig table of local string ids)
        self.coll: np.ndarray | None = None
        self.coll_used = 0
        self.coll_parts: dict[Path, tuple[int, int, np.ndarray]] = {}
        #: per rank file: out-of-range string ids of its kept collective rows (:func:`_coll_bad`)
        self.coll_bad: dict[Path, int] = {}
        #: ``--parallel``: the rows stay on the analysis rank that read them (``Run.coll_remote``):
        #: :func:`assemble` makes the sig table and each file's maps, and leaves the rows alone
        self.coll_remote = False
        if self.drop is not None and self.drop[[int(k) for k in COMM_KINDS]].all():
            self.coll = _anon(max(1, rows), COLL_ROW_DTYPE)
        try:
            self.buf = new_table(max(0, rows))
        except MemoryError:  # the kernel refuses the reservation (a run larger than RAM + swap): grow instead
            self.buf = new_table(min(max(0, rows), _READ_BLOCK_ROWS))
        self.used = 0
        self.views: list[RankData] = []
        self._scratch: np.ndarray | None = None
        self._written: np.ndarray | None = None  # what read_events wrote at ``used``, not taken yet

    def _reserve(self, n: int) -> None:
        """Room for ``n`` more rows after ``used``."""
        if self.used + n > len(self.buf):
            new = new_table(max(2 * len(self.buf), self.used + n))
            populate(new[: self.used])
            new[: self.used] = self.buf[: self.used]
            for v in self.views:  # per rank taken so far: re-point its view
                lo = self._offset(v.events)
                v.events = new[lo : lo + len(v.events)]
            self.buf = new

    def read_events(self, dsid: Any, n: int, mtype: Any, rank: int) -> tuple[np.ndarray, _Scan]:
        """The ``n`` rows of the events dataset ``dsid`` (file type = ``EVENT_DTYPE``,
        read with memory type ``mtype``) written at ``used`` with rank ``rank``:
        (the view of them, their scan). ``used`` does not move until :meth:`take`,
        so a rank file that fails after this leaves nothing behind. Raises what
        h5py raises on a damaged table (the caller falls back to the salvaging
        read).

        The rows are read by reads of up to ``_READ_BLOCK_ROWS`` into a scratch
        that is reused from rank to rank (one read a rank file, mostly: a read
        of a row range costs twice one of the whole table, measured), then
        copied into place and scanned by blocks of ``_PACK_ROWS`` that stay in
        cache between the two."""
        import h5py

        self._written = None
        self._reserve(n)
        out = self.buf[self.used : self.used + n]
        scan = _Scan()
        if n == 0:
            return out, scan
        populate(out)
        step = min(n, _READ_BLOCK_ROWS)
        if self._scratch is None or len(self._scratch) < step:
            self._scratch = np.empty(step, EVENT_DTYPE)
        ov = out.view(_PACKED_ROW)
        fspace = dsid.get_space() if n > step else None
        for lo in range(0, n, step):  # one read a rank file of up to 2^20 events
            c = min(step, n - lo)
            got = self._scratch[:c]
            if fspace is None:
                dsid.read(h5py.h5s.ALL, h5py.h5s.ALL, got, mtype=mtype)
            else:
                fspace.select_hyperslab((lo,), (c,))
                dsid.read(h5py.h5s.create_simple((c,)), fspace, got, mtype=mtype)
            for a in range(0, c, _PACK_ROWS):  # per block of rows
                blk = got[a : a + _PACK_ROWS]
                o = ov[lo + a : lo + a + len(blk)]
                o["v"] = blk.view(_FILE_ROW)  # one memcpy a row
                o["rank"] = rank
                scan.add(blk)  # while the block is in cache
        self._written = out
        return out, scan

    def compact(self, rows: np.ndarray, keep: np.ndarray) -> np.ndarray:
        """``rows[keep]``, in order; rows :meth:`read_events` just wrote are compacted in place
        (still to be taken, as before)."""
        if rows is not self._written:
            kept: np.ndarray = rows[keep]
            return kept
        k = int(np.count_nonzero(keep))
        rows[:k] = rows[keep]
        self._written = rows[:k]
        return self._written

    def take(self, d: RankData) -> None:
        """Make ``d.events`` part of the buffer: the rows :meth:`read_events` wrote at
        ``used`` stay where they are; others (file rows) are copied in with the rank
        column, and ``d.events`` becomes the view."""
        n = len(d.events)
        if d.events is not self._written:
            self._reserve(n)
            out = self.buf[self.used : self.used + n]
            d.events = _attach_rank(d.events, RUN_EVENT_DTYPE, d.info.rank, out=out)
        if self.drop is not None:
            d.events = self._keep(d)
            n = len(d.events)
        self.used += n
        self.views.append(d)
        self._written = None

    def _keep(self, d: RankData) -> np.ndarray:
        """Compact ``d``'s rows (at ``used``) to those of kinds not dropped, in order, and note
        what the dropped ones need later (:class:`_RankStream`). One rank's rows: the
        transient is that rank's kept rows."""
        ev = d.events
        assert self.drop is not None
        kind = ev["kind"]
        dropped = self.drop.take(kind)
        st = _RankStream(n_all=len(ev))
        if len(ev):
            t0, t1 = ev["t0_ns"], ev["t1_ns"]
            st.t_min = int(min(t0.min(), t1.min()))
            st.t_max = int(max(t0.max(), t1.max()))
            st.t0_min = int(t0.min())
        st.unsorted = d.scan.unsorted
        self.stats[d.info.path] = st
        # the scan saw every string id in range (id_umax: negative ids count as huge): none to count
        ids_ok = not d.scan.rows or d.scan.id_umax < len(d.strings)
        coll = None
        if self.coll is not None:
            coll = self._keep_collectives(d.info.path, ev, None if ids_ok else len(d.strings))
        if dropped.any() and not ids_ok:
            # out-of-range string ids of the rows that leave (the table's remap counts its own; the
            # kept collective rows are counted when assembled): the warning counts every row's
            drop_rows = ev[dropped if coll is None else dropped & ~coll]
            n_str = len(d.strings)
            for col in STRING_COLUMNS:  # three id columns
                v = drop_rows[col].astype(np.int64)
                st.bad_ids += int(np.count_nonzero((v < 0) | (v >= n_str)))
            fk = _AUX_KIND_TABLE.take(drop_rows["kind"])
            v = drop_rows["aux"][fk]
            st.bad_ids += int(np.count_nonzero((v < 0) | (v >= n_str)))
        if not dropped.any():
            return ev
        kept = ev.take(np.flatnonzero(~dropped))  # a copy (the target range overlaps the source), whole rows
        out = ev[: len(kept)]
        out[:] = kept
        return out

    def _keep_collectives(self, path: Path, ev: np.ndarray, n_strings: int | None) -> np.ndarray:
        """Append the collective rows with a seq of one rank's ``ev`` to :attr:`coll`, their other
        fields as ids into the rank's own small table of distinct ones (:func:`_sig_table`).
        ``n_strings``: the rank's string table length, to count out-of-range ids (:func:`_coll_bad`);
        None when the rank's scan saw every id in range (the usual file: ~15 ns a row saved).
        Returns which rows of ``ev`` it kept."""
        assert self.coll is not None
        keep = COMM_TABLE.take(ev["kind"]) & (ev["seq"] >= 0)
        c = ev.take(np.flatnonzero(keep))  # whole rows (~20 ns a row; a boolean index copies field by field)
        n = len(c)
        if self.coll_used + n > len(self.coll):
            new = _anon(max(2 * len(self.coll), self.coll_used + n), COLL_ROW_DTYPE)
            new[: self.coll_used] = self.coll[: self.coll_used]
            self.coll = new
        out = self.coll[self.coll_used : self.coll_used + n]
        # three runs of bytes per row (t0..kind, comm_id..seq, rank): laid out to be copied as such
        cv, ov = c.view(_RUN_SPANS), out.view(_COLL_SPANS)
        for f in ("a", "b", "c"):  # three byte runs
            ov[f] = cv[f]
        table, sig = _sig_table(c)
        out["sig"] = sig
        self.coll_parts[path] = (self.coll_used, n, table)
        self.coll_bad[path] = 0 if n_strings is None else _coll_bad(c, table, sig, n_strings)
        self.coll_used += n
        return keep

    def _offset(self, view: np.ndarray) -> int:
        if len(view) == 0:
            return 0
        # ``.ctypes.data``: ~3 us; ``__array_interface__`` spells out this dtype's 13 fields (~40 us)
        return (view.ctypes.data - self.buf.ctypes.data) // RUN_EVENT_DTYPE.itemsize

    def table_of(self, parts: list[RankData]) -> np.ndarray | None:
        """The buffer as the run's table when ``parts`` (kept ranks, ascending) fill it in order, else None."""
        off = 0
        for d in parts:  # per rank: two integers
            if len(d.events) and (_owner(d.events) is not _owner(self.buf) or self._offset(d.events) != off):
                return None
            off += len(d.events)
        return self.buf[:off]


def _owner(a: np.ndarray) -> Any:
    """The array that ``a`` is a slice of: the one whose ``base`` is not an array (numpy
    points every slice's ``base`` at it; a table of :func:`new_table` has its mapping as base)."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


#: ``madvise`` advice that faults a range in at once (Linux >= 5.14); None once refused.
_POPULATE_WRITE: int | None = getattr(mmap, "MADV_POPULATE_WRITE", 23) if sys.platform.startswith("linux") else None


def new_table(rows: int) -> np.ndarray:
    """An uninitialized ``RUN_EVENT_DTYPE`` array of ``rows`` rows (what ``np.empty`` gives)
    in its own anonymous mapping, so that :func:`populate` can fault its pages in by
    ranges, and without numpy's huge-page advice.

    Why (issue 10, measured with ``resource.getrusage`` filling 6.4 M rows by
    blocks of 16,384, as the packer does): the first touch of the table's pages
    cost 9-110 ns a row of system time with numpy's allocation (it advises
    huge pages above 4 MB; a 2 MB fault is cheap when free huge pages exist,
    dear when memory must be compacted first, and the page cache fills this
    machine) and 32-119 ns with 4 kB faults, but 19-26 ns, steadily, when
    ``madvise(MADV_POPULATE_WRITE)`` faults each rank's range in before its
    rows are copied (one call a rank file; huge pages + populate: 11-74).
    A bounded cost instead of a best case: see the module docstring for what
    it gives the read. Pages never written are never resident, as with
    ``np.empty``. The mapping is unmapped when the last view of the table dies."""
    if rows <= 0 or _POPULATE_WRITE is None:
        return np.empty(max(0, rows), RUN_EVENT_DTYPE)
    return _anon(rows, RUN_EVENT_DTYPE)


def populate(view: np.ndarray) -> None:
    """Fault in the pages of ``view`` (a slice of a :func:`new_table` table) in one call;
    nothing for other arrays, or where the kernel does not know the advice."""
    global _POPULATE_WRITE
    table = _owner(view)
    m = table.base
    if _POPULATE_WRITE is None or len(view) == 0 or not isinstance(m, memoryview) or not isinstance(m.obj, mmap.mmap):
        return
    lo = view.ctypes.data - table.ctypes.data  # the table starts at the mapping's start
    a = lo - lo % mmap.PAGESIZE
    try:
        m.obj.madvise(_POPULATE_WRITE, a, lo + view.nbytes - a)
    except (OSError, ValueError):  # an older kernel (EINVAL): the copy faults the pages in instead
        _POPULATE_WRITE = None


def capacity_rows(files: list[Path]) -> int:
    """Upper bound on the event rows in ``files``: a shim-written file stores its rows uncompressed."""
    total = 0
    for fp in files:  # one stat per rank file
        try:
            total += fp.stat().st_size // EVENT_DTYPE.itemsize + 1
        except OSError:
            continue
    return total


def load_run(
    path: str | Path, progress: Callable[[int, int], None] | None = None, streamed_kinds: Iterable[int] = (),
    max_trace_bytes: int | None = None,
) -> Run:
    """Read every rank file of a run directory into one :class:`Run`.

    ``streamed_kinds``: rows of these kinds are read and checked like every row
    but not kept in ``run.events``: the stages read them band by band through
    :func:`distdiag.bands.bands`, which reads them again from the files
    (:class:`_Stream`). See :data:`STREAMED_KINDS` and ``pipeline.analyze``.

    Raises :class:`DistdiagError` only when nothing can be analyzed; every other
    problem is one line in ``run.warnings``. ``progress(done, total)`` is called
    after each rank file (the CLI's progress bar).

    Each rank's rows are copied into one packed table as soon as its file is
    read (:class:`Packer`), so the peak is the table plus one rank's rows.

    A dir with no ``rank-*.h5`` but with trace JSONs is read as PyTorch profiler
    (Kineto) traces, one per rank (:mod:`distdiag.kineto`), each at most
    ``max_trace_bytes`` (``Config.kineto_max_trace_bytes``).
    """
    from distdiag import kineto

    if Path(path).is_dir() and kineto.is_kineto_dir(Path(path)):
        return _load_kineto(path, progress, streamed_kinds, max_trace_bytes or kineto.DEFAULT_MAX_TRACE_BYTES)
    p, files = rank_files_of(path)
    warnings: list[str] = []
    packer = Packer(capacity_rows(files), drop=streamed_kinds)
    got_all = _read_each(files, lambda fp: read_rank(fp, warnings, packer), packer, progress)
    return assemble(path, p, files, got_all, warnings, packer)


def _read_each(
    files: list[Path],
    read: Callable[[Path], RankData | str],
    packer: Packer,
    progress: Callable[[int, int], None] | None,
) -> list[RankData | str]:
    """``read`` each file (a rank file or a trace) in turn, its rows packed at once."""
    got_all: list[RankData | str] = []
    for i_file, fp in enumerate(files):
        if progress is not None:
            progress(i_file, len(files))
        got = read(fp)
        if isinstance(got, RankData):
            packer.take(got)
        got_all.append(got)
    if progress is not None:
        progress(len(files), len(files))
    return got_all


def _load_kineto(
    path: str | Path, progress: Callable[[int, int], None] | None, streamed_kinds: Iterable[int], limit: int
) -> Run:
    """:func:`load_run` for a dir of Kineto traces: each trace gives what a rank file gives
    (:func:`_read_trace_rank`), packed and assembled the same way."""
    from distdiag import kineto

    p = Path(path)
    files = kineto.trace_files(p)
    warnings: list[str] = []
    packer = Packer(_trace_rows(files), drop=streamed_kinds)
    got_all = _read_each(files, lambda fp: _read_trace_rank(fp, warnings, limit), packer, progress)
    return assemble(path, p, files, got_all, warnings, packer, what="trace files")


def _trace_rows(files: list[Path]) -> int:
    """A first capacity for the rows of ``files`` (traces): ~100 bytes of JSON an event, a gz ~10x
    smaller (the packer grows past it)."""
    total = 0
    for fp in files:  # one stat per trace
        try:
            total += fp.lstat().st_size * (10 if fp.name.endswith(".gz") else 1) // 100 + 1
        except OSError:
            continue
    return total


def _read_trace_rank(path: Path, warnings: list[str], limit: int) -> RankData | str:
    """One Kineto trace as :func:`read_rank` gives a rank file, or a one-line reason why not."""
    from distdiag import kineto

    try:
        t = kineto.read_trace(path, limit)
    except TraceError as e:
        return f"{path.name} {e}; skipped"
    except MemoryError:
        return f"{path.name} does not fit in memory when parsed (lower kineto_max_trace_bytes); skipped"
    if t.rank >= MAX_RANKS:
        return f"{path.name} names rank {t.rank}, beyond any launch; skipped"
    if t.n_bad:
        warnings.append(f"{path.name}: {t.n_bad} trace events without a usable ts/dur were ignored")
    info = RankInfo(
        rank=t.rank, path=path, host=t.host, local_rank=-1, world_size=t.world_size, job_id="", launch_id="",
        pid=t.pid, start_ns=t.start_ns, end_ns=t.end_ns, closed_cleanly=True, exit_code=None, lost_events=0,
        n_events=len(t.events), wall_ns_at_start=None, mono_ns_at_start=None, source="kineto", read_limit_bytes=limit,
    )  # fmt: skip
    return RankData(info, t.events, t.strings, np.zeros(0, SYNC_DTYPE), np.zeros(0, EVENT_DTYPE),
                     np.zeros(0, GPU_DTYPE), _Scan.of(t.events))  # fmt: skip


def rank_files_of(path: str | Path) -> tuple[Path, list[Path]]:
    """The run dir and its rank files, sorted by name; DistdiagError when there are none."""
    p = Path(path)
    if not p.exists():
        raise DistdiagError(f"run dir '{path}' does not exist")
    if not p.is_dir():
        raise DistdiagError(f"'{path}' is not a directory (pass the run dir that holds the rank-*.h5 files)")
    # a link or a special file of a rank file's name is listed, and refused with a warning when read
    files = sorted(q for q in p.iterdir() if RANK_FILE_RE.match(q.name) and (q.is_symlink() or not q.is_dir()))
    if not files:
        from distdiag.kineto import is_kineto_dir

        if is_kineto_dir(p):
            raise DistdiagError(f"run dir '{path}' holds PyTorch profiler traces, not rank files: analyze it without "
                                "--parallel (only the serial analysis reads traces)")  # fmt: skip
        raise DistdiagError(f"run dir '{path}' holds no rank-*.h5 files (did the job run under distdiag-wrap?)")
    return p, files


def assemble(
    path: str | Path, p: Path, files: list[Path], got_all: list[RankData | str], warnings: list[str],
    packer: Packer | None = None, what: str = "rank files",
) -> Run:
    """One Run from what ``read_rank`` gave for each of ``files`` (in order); see :func:`load_run`.

    Split from the reading so that distdiag.parallel can read the files on many
    analysis ranks and assemble the very same Run on one. ``packer``: the
    events of ``got_all`` are already views of one packed ``RUN_EVENT_DTYPE``
    buffer; when the kept ranks fill it in rank order (file names in rank
    order, no duplicate), it becomes the table without a copy and every step
    below works in place on each rank's slice."""
    problems: list[str] = []
    loaded: dict[int, RankData] = {}
    for fp, got in zip(files, got_all):  # one per rank file
        if isinstance(got, str):
            problems.append(got)
            continue
        r = got.info.rank
        if r in loaded:
            prev = loaded[r]
            # Keep the file whose name matches the rank it claims.
            keep, drop = (got, prev) if _name_rank(fp) == r and _name_rank(prev.info.path) != r else (prev, got)
            loaded[r] = keep
            problems.append(
                f"rank {r} appears in both {prev.info.path.name} and {fp.name} (two launches in one dir?); "
                f"using {keep.info.path.name}, skipping {drop.info.path.name}"
            )
            continue
        loaded[r] = got
    if not loaded:
        if len(problems) == 1:
            raise DistdiagError(problems[0].removesuffix("; skipped"))
        raise DistdiagError(
            f"none of the {len(files)} {what} in '{path}' can be analyzed: " + problems[0].removesuffix("; skipped")
            + f" (and {len(problems) - 1} more)"
        )
    warnings = problems + warnings

    ranks = sorted(loaded)
    infos = {r: loaded[r].info for r in ranks}
    sizes = {i.world_size for i in infos.values() if i.world_size > 0}
    absurd = sorted(s for s in sizes if s > MAX_RANKS)
    if absurd:
        warnings.append(f"rank files claim a world size of {absurd[0]}, beyond any launch (corrupt); ignored")
        sizes -= set(absurd)
    world_size = max(sizes | {ranks[-1] + 1})
    if len(sizes) > 1:
        warnings.append(f"rank files disagree on the world size ({sorted(sizes)}); assuming {world_size}")
    launches = {i.launch_id for i in infos.values() if i.launch_id}
    if len(launches) > 1:
        warnings.append(f"rank files come from {len(launches)} different launches ({', '.join(sorted(launches))})")
    missing = np.setdiff1d(np.arange(world_size), np.asarray(ranks)).tolist()
    if missing:
        warnings.append(
            f"{len(missing)} of {world_size} ranks have no usable file: {rank_ranges(missing)} "
            "(analyzing the others; collectives they joined count as incomplete)"
        )
    for r in ranks:  # per rank: a handful of checks
        i = infos[r]
        if not i.closed_cleanly:
            what = ""
            inf = loaded[r].inflight
            if len(inf):
                names = sorted({str(loaded[r].strings[n]) if 0 <= n < len(loaded[r].strings) else "?" for n in inf["name_id"]})
                what = f"; it was inside {', '.join(names)} (in flight) at its last flush"
            warnings.append(
                f"rank {r} did not close its file (killed?): its record ends at its last flush{what}"
            )
        if i.recording_stopped:
            warnings.append(f"rank {r} stopped recording before its end ({i.recording_stopped}); "
                            "what it did after that is missing")  # fmt: skip
        if i.budget_reached_s is not None:
            top = sorted(i.counted_only.items(), key=lambda kv: -kv[1][1])[:4]
            what = ", ".join(f"{n} {k} taking {sec:.3g} s" for k, (n, sec) in top)
            warnings.append(
                f"rank {r} reached its recording budget of {i.budget_bytes} bytes {i.budget_reached_s:.1f} s "
                f"after its start: from then on 1 row in {i.sample_every} was kept and the rest only counted"
                f" ({what or 'none yet'}); what it did after that is priced low"
            )
        if i.lost_events:
            warnings.append(f"rank {r} dropped {i.lost_events} events (the shim could not keep up); its totals are low")
        if i.exit_code not in (None, 0):
            warnings.append(f"rank {r} exited with code {i.exit_code}")

    gstrings, lookups = _global_strings([loaded[r].strings for r in ranks])
    # the small tables are filled rank by rank into arrays of their final size
    # (np.concatenate of 1,024 structured parts spent ~0.1 s promoting their dtypes)
    side = {
        name: np.empty(sum(len(getattr(loaded[r], name)) for r in ranks), dt)
        for name, dt in (("sync", RUN_SYNC_DTYPE), ("inflight", RUN_EVENT_DTYPE), ("gpu", RUN_GPU_DTYPE))
    }
    side_off = dict.fromkeys(side, 0)
    n_total = sum(len(loaded[r].events) for r in ranks)
    packed = packer.table_of([loaded[r] for r in ranks]) if packer is not None else None
    events = packed if packed is not None else np.empty(n_total, RUN_EVENT_DTYPE)
    if packer is not None:
        packer.views = []  # the table (or the copy below) is the only owner from here on
        packer._scratch = None  # one rank's file rows: free before the sort's temporaries
    bad_ids = 0
    off = 0
    spans: dict[int, tuple[int, int]] = {}
    scans = [loaded[r].scan for r in ranks]
    for r, lookup in zip(ranks, lookups):  # per rank: small tables; the events are done table-wide below
        d = loaded[r]
        if packed is None:
            _attach_rank(d.events, RUN_EVENT_DTYPE, r, out=events[off : off + len(d.events)])
        spans[r] = (off, off + len(d.events))
        off += len(d.events)
        for name, out in side.items():  # three small tables
            rows = getattr(d, name)
            a = side_off[name]
            part = _attach_rank(rows, out.dtype, r, out=out[a : a + len(rows)])
            side_off[name] = a + len(rows)
            if name == "inflight":
                bad_ids += _remap(part, lookup)
        loaded[r].events = np.zeros(0, d.events.dtype)  # the table holds the rows now
    if packer is not None and packed is None:
        packer.buf = packer.buf[:0]  # copied out (ranks out of file order): let the packed rows go
    _sort_late_ranks(events, spans, [r for r, sc in zip(ranks, scans) if sc.unsorted])
    in_range = [sc.rows == 0 or sc.id_umax < len(lk) for sc, lk in zip(scans, lookups)]  # per rank: two integers
    bad_ids += _remap_table(events, ranks, lookups, in_range)
    job_ids = sorted({i.job_id for i in infos.values() if i.job_id})
    if packer is not None and packer.drop is not None:
        bad_ids += sum(packer.stats[infos[r].path].bad_ids for r in ranks)
    coll_rows, coll_sigs = None, None
    coll_remote: Any = None
    if packer is not None and packer.coll_remote:  # --parallel: the rows stay where they were read
        paths = [infos[r].path for r in ranks]
        coll_sigs, maps = _coll_sig_maps([packer.coll_parts[q][2] for q in paths], lookups)
        bad_ids += sum(packer.coll_bad[q] for q in paths)
        coll_remote = {q: (r, lk, m, packer.stats[q].unsorted) for q, r, lk, m in zip(paths, ranks, lookups, maps)}
    elif packer is not None and packer.coll is not None:
        coll_rows, coll_sigs, bad = _assemble_collectives(packer, [infos[r].path for r in ranks], lookups)
        bad_ids += bad
        packer.coll = None
    if bad_ids:
        warnings.append(f"{bad_ids} string ids point outside their file's string table (corrupt rows); shown as ''")
    stream = None
    if packer is not None and packer.drop is not None:
        stream = _Stream(
            kinds=tuple(int(k) for k in np.flatnonzero(packer.drop)),
            ranks={r: packer.stats[infos[r].path] for r in ranks},
            lookups=dict(zip(ranks, lookups)),
            in_range=dict(zip(ranks, in_range)),
        )
    return Run(
        path=p,
        ranks=infos,
        events=events,
        strings=gstrings,
        sync=side["sync"],
        inflight=side["inflight"],
        gpu=side["gpu"],
        world_size=world_size,
        job_id=job_ids[0] if job_ids else "",
        warnings=warnings,
        missing_ranks=missing,
        streamed_kinds=stream.kinds if stream is not None else (),
        stream=stream,
        coll_rows=coll_rows,
        coll_sigs=coll_sigs,
        coll_remote=coll_remote,
    )


def _read_events(info: RankInfo) -> np.ndarray | None:
    """The events table of ``info``'s file again, read as :func:`read_rank` read it (the same
    damage handling), without its attributes and other tables: a band pass reads only
    this (measured at 1,024 x 10k: a whole rank file costs ~2.5 ms, mostly h5py's per-attribute
    calls). None when the file cannot be opened any more. A Kineto trace is parsed again."""
    if info.source == "kineto":
        from distdiag import kineto

        try:
            return kineto.read_trace(info.path, info.read_limit_bytes or kineto.DEFAULT_MAX_TRACE_BYTES).events
        except (TraceError, MemoryError):
            return None
    try:
        f = _open_h5(info.path)
    except (NotOwnFile, OSError, *_H5_ERRORS):
        return None
    try:
        with f:
            ev = _read_table(
                f, "events", EVENT_DTYPE, info.path.name, [], refresh=not info.closed_cleanly, size=_file_size(f)
            )
    except _H5_ERRORS:
        return None
    # without the rows read_rank dropped as outside the rank's recorded span (a file with one
    # implausible timestamp was "changed while analyzed" on every streamed run)
    if info.row_span != (None, None):
        ev, _ = _in_span(ev, _Scan.of(ev), info.row_span, info.path.name, [], None)
    if info.gpu_timed_collectives:  # as read_rank gave them: the GPU's times
        _gpu_times(ev)
    return ev


def _gpu_times(events: np.ndarray) -> int:
    """The one place collectives take their GPU-side times (one rank's rows, in place; see
    :func:`distdiag.gpu_timeline.substitute_collective_times`): how many did."""
    from distdiag.gpu_timeline import substitute_collective_times

    return substitute_collective_times(events)


#: The kinds ``pipeline.analyze`` streams on a large run: the compute phases and the
#: collectives, the bulk of a training run's rows. Only per-rank stages read their rows
#: (the breakdown, input_bound's critical path, serial_section's activity, hang, the Slurm
#: view), all through :func:`distdiag.bands.bands`; the collective rows are kept apart
#: for the match until it is made (``Run.coll_rows``, :func:`stream_out`). Everything
#: else (sync rows, step marks, file and p2p calls, probes) stays in ``run.events``.
STREAMED_KINDS = tuple(sorted({int(Kind.PHASE), int(Kind.FORWARD), int(Kind.BACKWARD), int(Kind.OPTIMIZER),
                               *(int(k) for k in COMM_KINDS)}))  # fmt: skip


def streamed_kinds_for(path: str | Path, limit: int) -> tuple[int, ...]:
    """The kinds to stream for the run dir ``path``: :data:`STREAMED_KINDS` when its files hold
    more than ``limit`` event rows (0: always, -1: never; ``Config.stream_events``), else none.
    The estimate is the files' bytes over a row's 69 (an upper bound: no file is opened)."""
    if limit < 0:
        return ()
    if limit == 0:
        return STREAMED_KINDS
    from distdiag import kineto

    if Path(path).is_dir() and kineto.is_kineto_dir(Path(path)):
        return STREAMED_KINDS if _trace_rows(kineto.trace_files(Path(path))) > limit else ()
    _, files = rank_files_of(path)
    rows = sum(f.stat().st_size for f in files) // EVENT_DTYPE.itemsize
    return STREAMED_KINDS if rows > limit else ()


@dataclass
class _RankStream:
    """What one rank's streamed rows need after loading: its row count (every row, kept or
    not), raw time bounds over every row, whether its rows needed sorting."""

    n_all: int
    t_min: int = 0
    t_max: int = 0
    t0_min: int = 0
    unsorted: bool = False
    #: out-of-range string ids in the rows left out of the table (damaged files only)
    bad_ids: int = 0


@dataclass
class _Stream:
    """Reads a band of ranks' rows again from their files, exactly as :func:`load_run`
    and :func:`distdiag.clocks.align` made the table's (string ids remapped, sorted
    by t0, clocks mapped, causality repairs applied): see :func:`distdiag.bands.bands`."""

    kinds: tuple[int, ...]
    ranks: dict[int, _RankStream]
    lookups: dict[int, np.ndarray]
    in_range: dict[int, bool]

    def rank_rows(self, n: int) -> np.ndarray:
        """Per r in 0..n: rows (every kind) of the ranks below r."""
        cnt = np.zeros(n, np.int64)
        for r, st in self.ranks.items():  # per rank: one integer
            if r < n:
                cnt[r] = st.n_all
        out = np.zeros(n + 1, np.int64)
        np.cumsum(cnt, out=out[1:])
        return out

    def _times(self, run: Run, raw: dict[int, int]) -> dict[int, int]:
        """Raw per-rank instants mapped as align mapped the table's (clock model, then repairs)."""
        from distdiag.clockmodel import apply_repairs, map_by_rank

        model = run.cache.clock_model if run.aligned else None
        if model is None or not raw:
            return dict(raw)
        rk = np.array(sorted(raw), np.int64)
        t = np.array([raw[r] for r in rk], np.int64)
        t, _ = map_by_rank(t, rk, model.ranks)
        if model.repairs:
            t = apply_repairs(t, rk, model.repairs, model.repair_base)
        return dict(zip(rk.tolist(), t.tolist()))

    def time_bounds(self, run: Run) -> tuple[int, int]:
        """(min, max) over t0_ns and t1_ns of every row, mapped (see :func:`distdiag.bands.time_bounds`):
        each rank's map is monotone, so its mapped extremes are its raw extremes mapped."""
        have = {r: st for r, st in self.ranks.items() if st.n_all}
        if not have:
            return (0, 0)
        lo = self._times(run, {r: st.t_min for r, st in have.items()})
        hi = self._times(run, {r: st.t_max for r, st in have.items()})
        return (min(lo.values()), max(hi.values()))

    def t0_min(self, models: dict[int, Any]) -> int | None:
        """The smallest t0_ns of every row, mapped with the per-rank clocks ``models`` (before
        any repair), or None without rows: what ``run.events["t0_ns"].min()`` gives in memory."""
        from distdiag.clockmodel import map_by_rank

        have = sorted(r for r, st in self.ranks.items() if st.n_all)
        if not have:
            return None
        rk = np.array(have, np.int64)
        t, _ = map_by_rank(np.array([self.ranks[r].t0_min for r in have], np.int64), rk, models)
        return int(t.min())

    def read_band(self, run: Run, r_lo: int, r_hi: int) -> np.ndarray:
        """Every row (every kind) of the ranks in ``[r_lo, r_hi)``, as the in-memory table holds them."""
        from distdiag.clockmodel import apply_repairs, map_inplace

        ranks = [r for r in range(r_lo, r_hi) if r in self.ranks and self.ranks[r].n_all]
        total = sum(self.ranks[r].n_all for r in ranks)
        ev = np.empty(total, RUN_EVENT_DTYPE)
        spans: dict[int, tuple[int, int]] = {}
        off = 0
        for r in ranks:  # per rank of the band: one file read
            rows = _read_events(run.ranks[r])
            if rows is None or len(rows) != self.ranks[r].n_all:
                raise DistdiagError(
                    f"{run.ranks[r].path.name} changed while it was analyzed (its rows are read twice on a large "
                    "run); analyze a finished run dir"
                )
            n = len(rows)
            _attach_rank(rows, RUN_EVENT_DTYPE, r, out=ev[off : off + n])
            spans[r] = (off, off + n)
            off += n
        if not total:
            return ev
        _sort_late_ranks(ev, spans, [r for r in ranks if self.ranks[r].unsorted])
        _remap_table(ev, ranks, [self.lookups[r] for r in ranks], [self.in_range[r] for r in ranks])
        model = run.cache.clock_model if run.aligned else None
        if model is not None:
            map_inplace(ev, ("t0_ns", "t1_ns"), model.ranks)
            if model.repairs:
                touched = {rk for rep in model.repairs for rk in rep}
                for r in ranks:  # per rank of the band
                    if r not in touched:
                        continue
                    lo, hi = spans[r]
                    sl = ev[lo:hi]
                    rr = np.full(hi - lo, r, np.int64)
                    for c in ("t0_ns", "t1_ns"):  # two time columns
                        sl[c] = apply_repairs(sl[c], rr, model.repairs, model.repair_base)
        return ev


def stream_out(run: Run) -> Run:
    """``run`` without the collective rows it kept apart for the match (``Run.coll_rows``):
    ``pipeline.analyze_run`` calls it once the collectives are matched. The match keeps
    what the cross-rank stages read; the per-rank stages read the rows from the files with
    the phases (:mod:`distdiag.bands`). The cache (clock model, the match, ...) carries over."""
    if run.coll_rows is None and run.coll_remote is None:
        return run
    out = run.replace(coll_rows=None, coll_sigs=None, coll_remote=None)
    out.cache = run.cache
    return out


def _name_rank(path: Path) -> int:
    m = RANK_FILE_RE.match(path.name)
    return int(m.group(1)) if m else -1
