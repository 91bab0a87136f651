"""Per-rank HDF5 writer: the on-disk side of the shim.

Layout (see :mod:`distdiag.schema`)::

    rank-NNNNN.h5
      /            attrs per schema.FILE_ATTRS
      /events      EVENT_DTYPE, chunked, resizable (maxshape=None)
      /strings     variable-length UTF-8 (read with ``ds.asstr()[:]``); row i = string id i
      /clock_sync  SYNC_DTYPE, chunked, resizable
      /inflight    EVENT_DTYPE rows with t1_ns == -1, replaced at every flush
      /gpu         GPU_DTYPE, chunked, resizable (empty when no sampler ran)

Every dataset exists in every file (possibly empty), so a reader never has to
ask whether a path is there. :func:`write_rank_file` (tests, factories, the
synthetic generator) and :class:`Writer` (the shim) produce exactly this layout
through the same :func:`_create_layout`.

Why default HDF5 mode and not SWMR: measured with h5py 3.16 on these machines,
a default-mode file that was ``flush()``-ed after each batch opens normally
after the writer is SIGKILLed, with every flushed row; without flushing it
does not open at all. SWMR adds the ``libver='latest'`` requirement on readers
and buys nothing here (nobody reads a rank file while the job runs). So the
flusher flushes after every batch and a SIGKILL loses at most one interval.

No compression by default: 10^6 rows append in 0.1 s uncompressed against
0.35 s with lzf + shuffle (measured); the flusher must stay cheap.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import sys
import threading
import time
from pathlib import Path
from typing import Any, BinaryIO, Callable

import numpy as np

from distdiag.shim.rankfile import (  # noqa: F401  (re-exported: what the shim needs before numpy)
    DEFAULT_REDACT_ARGS,
    DISK_RESERVE_BYTES,
    FILE_MODE,
    REDACTED,
    _exit_timeout,
    _redacted_argv_attr,
    base_attrs,
    describe_code,
    fork_file_name,
    one_line,
    read_own_file,
    redact_argv,
    say,
    wait_for_writes,
    write_private_file,
)
from distdiag.shim.recorder import ROW_SIZE as _ROW_SIZE
from distdiag.schema import (
    COUNTER_DTYPE,
    EVENT_DTYPE,
    FILE_KINDS,
    GPU_DTYPE,
    SYNC_DTYPE,
    Kind,
)

log = logging.getLogger(__name__)

assert _ROW_SIZE == EVENT_DTYPE.itemsize  # the recorder's struct and the dtype describe one row

#: Chunk shapes (rows). An events chunk of 4096 rows is 282 KB: big enough for
#: fast appends, small enough that a tiny test file stays small.
EVENTS_CHUNK_ROWS = 4096
STRINGS_CHUNK_ROWS = 1024
SYNC_CHUNK_ROWS = 256
GPU_CHUNK_ROWS = 1024

_DATASETS = ("events", "strings", "clock_sync", "inflight", "gpu")

#: HDF5 file locking: used where the file system supports it, ignored where it
#: does not (Lustre mounted without flock, some NFS), instead of failing the
#: open with "unable to lock file" (HDF5_USE_FILE_LOCKING=FALSE still wins).
LOCKING = "best-effort"


#: Columns that hold string ids (``distdiag.run.STRING_COLUMNS``), and the kinds whose
#: ``aux`` is one too (``distdiag.run._AUX_STRING_KINDS``; tests check they agree)
STRING_COLUMNS = ("name_id", "comm_id", "site_id")
AUX_STRING_KINDS = frozenset({*FILE_KINDS, int(Kind.COLL), int(Kind.COLL_ASYNC), int(Kind.WAIT)})
_AUX_KIND_TABLE = np.zeros(256, bool)
_AUX_KIND_TABLE[sorted(AUX_STRING_KINDS)] = True

#: forked children's inherited writers' h5py objects: kept alive, never closed by us (see Writer.detach)
_ABANDONED: list[Any] = []


def _anon_fd() -> int:
    """A descriptor that takes any write, seek or truncate and goes nowhere that matters."""
    try:
        return os.memfd_create("distdiag-inherited-rank-file", os.MFD_CLOEXEC)
    except (AttributeError, OSError):
        import tempfile

        f = tempfile.TemporaryFile()
        try:
            return os.dup(f.fileno())
        finally:
            f.close()


class _LocalIds:
    """The string ids of a file that holds only the strings its rows use, renumbered.

    A forked child's file (``compact_strings``): the child keeps its parent's string
    table (every id the hooks cached stays valid), which may hold 10^5 paths; writing all
    of it into every worker's file would cost each one the parent's table. And a rank
    file past its byte budget (:class:`_Budget`): from then on only the names of the rows
    it keeps, and of its counters, are written. Each flush maps the id columns of its rows
    onto the file's own table through a lookup array (recorder id -> file id, 4 bytes a
    recorder string), appending the strings seen for the first time.

    ``done``: recorder ids ``[0, done)`` are in the file already, under the same ids.
    ``room``: bytes (UTF-8 length + 16 a string) new strings may still take; a string
    that does not fit is refused for good (maps to -1). None: no bound."""

    def __init__(self, strings: list[str], done: int = 0) -> None:
        self.strings = strings  # the recorder's table: append-only
        self.lut = np.full(max(1, len(strings), done), -1, np.int32)
        self.room: int | None = None
        if done > 0:
            self.lut[:done] = np.arange(done, dtype=np.int32)
            self.n = done  # strings of the file so far
            self.new: list[str] = []  # the file's strings not yet written
        else:
            self.lut[0] = 0
            self.n = 1
            self.new = [""]  # id 0 is ""

    def _map(self, col: np.ndarray, bounded: bool = True) -> np.ndarray:
        if len(col) == 0:
            return col
        strings = self.strings
        n = len(strings)  # append-only: read the length once
        if n > len(self.lut):
            self.lut = np.concatenate([self.lut, np.full(max(n, 2 * len(self.lut)) - len(self.lut), -1, np.int32)])
        lut = self.lut
        c = col.astype(np.int64)
        bad = (c < 0) | (c >= n)
        if bad.any():
            c[bad] = 0  # no such string: "", as the reader shows an id out of range
        got = lut[c]
        # -1: not seen yet; -2: refused (no room); an unbounded call takes refused ones too
        miss = got == -1 if bounded else got < 0
        if miss.any():
            room = self.room if bounded else None
            for x in _unique(c[miss])[0].tolist():
                s = strings[x]
                if room is not None:
                    cost = len(s.encode("utf-8", "surrogatepass")) + 16
                    if cost > room:
                        lut[x] = -2
                        continue
                    room -= cost
                lut[x] = self.n
                self.n += 1
                self.new.append(s)
            if room is not None:
                self.room = room
            got = lut[c]
        return np.where(got < 0, -1, got).astype(col.dtype)

    def remap(self, ev: np.ndarray, bounded: bool = True) -> np.ndarray:
        """``ev`` with file-local string ids (a copy when ``ev`` views a recorder chunk);
        -1 for a string refused for want of room."""
        if len(ev) == 0:
            return ev
        if ev.base is not None:
            ev = ev.copy()
        for c in STRING_COLUMNS:
            ev[c] = self._map(ev[c], bounded)
        m = _AUX_KIND_TABLE[ev["kind"]]
        if m.any():
            aux = ev["aux"]
            aux[m] = self._map(aux[m], bounded)
        return ev

    def take_new(self) -> list[str]:
        new, self.new = self.new, []
        return new


def _str_dtype() -> Any:
    import h5py

    return h5py.string_dtype("utf-8")


def _create_layout(f: Any, budget_bytes: int = 0) -> None:
    """Create every dataset of a rank file, empty. Under a byte budget the events' chunks take at
    most a sixteenth of it: HDF5 allocates a whole chunk at a time, and a 282 kB chunk (4096 rows)
    past a budget of that order doubled the file (seen: 698 kB under 300 kB, when the first flush
    came just under the budget and the sampled rows then opened a second chunk)."""
    rows = EVENTS_CHUNK_ROWS
    if budget_bytes > 0:
        rows = min(rows, max(64, budget_bytes // (16 * EVENT_DTYPE.itemsize)))
    f.create_dataset("events", shape=(0,), maxshape=(None,), dtype=EVENT_DTYPE, chunks=(rows,))
    f.create_dataset("strings", shape=(0,), maxshape=(None,), dtype=_str_dtype(), chunks=(STRINGS_CHUNK_ROWS,))
    f.create_dataset("clock_sync", shape=(0,), maxshape=(None,), dtype=SYNC_DTYPE, chunks=(SYNC_CHUNK_ROWS,))
    f.create_dataset("inflight", shape=(0,), maxshape=(None,), dtype=EVENT_DTYPE, chunks=(64,))
    f.create_dataset("gpu", shape=(0,), maxshape=(None,), dtype=GPU_DTYPE, chunks=(GPU_CHUNK_ROWS,))


#: bytes (strings: entries / 64) one h5py write call takes at most. h5py serializes every
#: call of the process on one global lock, held for the whole call, so the program's own
#: h5py calls (an HDF5-backed data loader) wait at most one piece behind a flush, not the
#: whole batch (measured: a 41 MB batch, one call, held a 10-element read 23 ms on tmpfs;
#: on a slow file system the write takes as long as the disk: 0.24 s seen). Between pieces
#: the flusher gives up the GIL once (time.sleep(0)) so a thread waiting on the lock takes it.
WRITE_PIECE_BYTES = 1 << 20


class _PastDeadline(Exception):
    """The exit's time bound (``exit_timeout_s``) passed inside a write: what was written
    stays, the dataset is cut back to it, the rest is not written."""

    def __init__(self, written: int, total: int) -> None:
        super().__init__(f"{total - written} of {total} rows not written")
        self.written, self.total = written, total


def _h5_strings(strings: list[str]) -> list[str]:
    """``strings`` as an HDF5 string dataset can hold them: valid UTF-8 without NUL. A path
    that is not UTF-8 (``os.fsdecode`` gives its bytes as lone surrogates) keeps them as
    ``\\xNN`` escapes, a NUL is ``\\x00``; the ids do not move. One string HDF5 refuses
    would cost the rank its whole file (seen: a program that wrote ``b"/tmp/sur_\\xff.bin"``)."""
    if all(s.isascii() and "\x00" not in s for s in strings):
        return strings
    return [_h5_string(s) for s in strings]


def _h5_string(s: str) -> str:
    if "\x00" in s:
        s = s.replace("\x00", "\\x00")
    try:
        s.encode("utf-8")
        return s
    except UnicodeEncodeError:
        pass
    try:  # a file name's undecodable bytes: as they were
        return s.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # another lone surrogate: its code point
        return s.encode("utf-8", "backslashreplace").decode("utf-8")


def _append(ds: Any, rows: Any, deadline: Callable[[], float | None] | None = None) -> None:
    n = len(rows)
    if n == 0:
        return
    old = ds.shape[0]
    ds.resize((old + n,))
    done = _write_pieces(ds, old, rows, deadline)
    if done < n:
        ds.resize((old + done,))  # no fill-value rows after the last one written
        raise _PastDeadline(done, n)


def _write_pieces(ds: Any, at: int, rows: Any, deadline: Callable[[], float | None] | None = None) -> int:
    """``ds[at : at + len(rows)] = rows`` in calls of whole chunks, about WRITE_PIECE_BYTES
    each. The rank file has no chunk cache (``rdcc_nbytes=0``), so each call writes its
    chunks then and there; with one, the file's flush wrote every cached chunk in one call
    (0.37 s of a 0.93 s flush on a 10 ms/MiB disk). Measured on tmpfs, 600k rows: 55 ms a
    flush against 41 ms in one call (~0.02 us more a row)."""
    import h5py

    n = len(rows)
    itemsize = getattr(getattr(rows, "dtype", None), "itemsize", 64) or 64
    chunk = int((ds.chunks or (n,))[0]) or n
    step = max(1, WRITE_PIECE_BYTES // (chunk * itemsize)) * chunk
    lo = 0
    while lo < n:
        hi = min(n, (at + lo) // step * step + step - at)  # up to a chunk boundary
        if lo:
            d = deadline() if deadline is not None else None  # read at every piece: close() may set it now
            if d is not None and time.monotonic() > d:
                return lo
            time.sleep(0)
        piece = rows[lo:hi]
        if isinstance(piece, np.ndarray) and piece.dtype.names and piece.flags.c_contiguous:
            # h5py's slicing costs ~0.3 ms a call for a compound type: the low-level write
            fspace = ds.id.get_space()
            fspace.select_hyperslab((at + lo,), (hi - lo,))
            ds.id.write(h5py.h5s.create_simple((hi - lo,)), fspace, piece)
        else:
            ds[at + lo : at + hi] = piece
        lo = hi
    return n


def _replace(ds: Any, rows: Any) -> None:
    ds.resize((len(rows),))
    if len(rows):
        _write_pieces(ds, 0, rows)


def _attr_value(v: Any) -> Any:
    """HDF5-storable form of an attribute value (dicts/lists become JSON text)."""
    if isinstance(v, (dict, list, tuple)):
        return json.dumps(v)
    return v


def _set_attrs(f: Any, attrs: dict[str, Any]) -> None:
    for k, v in attrs.items():
        if v is None:  # None means "absent" (e.g. exit_code of a killed rank)
            if k in f.attrs:
                del f.attrs[k]
            continue
        f.attrs[k] = _attr_value(v)


def write_rank_file(
    path: str | os.PathLike[str] | BinaryIO,
    attrs: dict[str, Any],
    events: np.ndarray,
    strings: list[str],
    sync: np.ndarray | None = None,
    inflight: np.ndarray | None = None,
    gpu: np.ndarray | None = None,
) -> None:
    """Write one complete rank file in one go, with the shim's exact layout.

    ``attrs`` override :func:`base_attrs` (rank, world_size, host, job_id, ...).
    Unless given, the file looks like a cleanly closed run: ``closed_cleanly``
    True, ``exit_code`` 0, ``end_mono_ns``/``last_flush_mono_ns`` the last
    event's t1 and ``mono_ns_at_start`` the first event's t0. Pass an attribute
    as ``None`` to leave it out (a killed rank has no ``exit_code`` nor
    ``end_mono_ns``, and ``closed_cleanly`` False). ``strings[0]`` must be "". ``path`` may
    be a binary file object (in memory: the analyzer's reading of a spill log,
    distdiag.run._open_spill)."""
    import h5py

    events = np.asarray(events, dtype=EVENT_DTYPE)
    t_first = int(events["t0_ns"].min()) if len(events) else 0
    t_last = int(max(events["t0_ns"].max(), events["t1_ns"].max())) if len(events) else 0
    full: dict[str, Any] = base_attrs()
    full.update(
        mono_ns_at_start=t_first,
        last_flush_mono_ns=t_last,
        end_mono_ns=t_last,
        exit_code=0,
        closed_cleanly=True,
    )
    full.update(attrs)
    if not strings or strings[0] != "":
        raise ValueError("write_rank_file: strings[0] must be '' (string id 0 is the empty string)")
    with h5py.File(path, "w", locking=LOCKING) as f:
        _create_layout(f)
        _append(f["events"], events)
        _append(f["strings"], _h5_strings(list(strings)))
        if sync is not None:
            _append(f["clock_sync"], np.asarray(sync, dtype=SYNC_DTYPE))
        if inflight is not None:
            _replace(f["inflight"], np.asarray(inflight, dtype=EVENT_DTYPE))
        if gpu is not None:
            _append(f["gpu"], np.asarray(gpu, dtype=GPU_DTYPE))
        _set_attrs(f, full)


def _rows_view(buf: bytearray, start: int, stop: int) -> np.ndarray:
    """Rows ``[start, stop)`` of a chunk, viewed without a copy.

    Safe without copying: the owning thread only ever writes rows at or after
    its published count, so published rows never change, and the view keeps
    the chunk alive after the thread moved on to a new one."""
    return np.frombuffer(buf, EVENT_DTYPE, count=stop - start, offset=start * EVENT_DTYPE.itemsize)




class _DiskFull(OSError):
    pass


#: ``/counters`` rows at most (schema.COUNTER_DTYPE; see :class:`_Budget`): past it the
#: least counted names of each kind fold into its (kind, -1)
COUNTERS_MAX = 1 << 16
#: by kind: rows kept whatever the budget: the shim's milestones and loss counts, and
#: every communication row (collectives, point-to-point, waits, communicators, the probe):
#: the analysis matches them across ranks, and a rank that sampled them alone would make
#: the other ranks' calls look unmatched (false mismatches and hangs)
_ALWAYS_KEPT = np.zeros(256, bool)
_ALWAYS_KEPT[[int(k) for k in (Kind.SHIM, Kind.LOST, Kind.COLL, Kind.COLL_ASYNC, Kind.SEND, Kind.RECV,
                               Kind.SEND_ASYNC, Kind.RECV_ASYNC, Kind.WAIT, Kind.COMM_CREATE, Kind.PROBE)]] = True  # fmt: skip
_FILE_ROW = np.zeros(256, bool)
_FILE_ROW[sorted(FILE_KINDS)] = True
#: the share of a budget kept for what a file takes once the budget is reached: the sampled
#: rows (budget / 8), the string table's growth (budget / 8), the counters and HDF5's chunk slack
#: (the last eighth). Thinning starts where the rest would be passed, so the file ends near its
#: budget, not 1.25x it plus the rest: when a loaded machine's flushes came small, the rows before
#: the budget took it all and the file ended at 1.4-1.6x (455 kB under 300 kB, seen twice)
BUDGET_RESERVE = 3 / 8
#: past this many times its budget a rank file stops recording (communication rows alone
#: can pass the budget): it is closed properly with ``recording_stopped`` saying so
HARD_FACTOR = 4


def _unique(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(a, return_inverse=True)`` without it: in the program's process, since
    numpy 2's ``np.unique`` imports ``numpy.ma`` (an import the program did not make, its
    file system calls recorded as the program's)."""
    order = np.argsort(a, kind="stable")
    srt = a[order]
    first = np.ones(len(srt), bool)
    if len(srt) > 1:
        first[1:] = srt[1:] != srt[:-1]
    inv = np.empty(len(a), np.int64)
    inv[order] = np.cumsum(first) - 1
    return srt[first], inv


def _merge_counters(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a`` and ``b`` (COUNTER_DTYPE) summed per (kind, name_id)."""
    both = np.concatenate([a, b])
    key = both["kind"].astype(np.int64) << 32 | (both["name_id"].astype(np.int64) & 0xFFFFFFFF)
    uniq, inv = _unique(key)
    out = np.zeros(len(uniq), COUNTER_DTYPE)
    out["kind"], out["name_id"] = uniq >> 32, (uniq & 0xFFFFFFFF).astype(np.uint32).view(np.int32)
    for col in ("count", "dur_ns", "nbytes"):
        acc = np.zeros(len(uniq), np.int64)
        np.add.at(acc, inv, both[col])  # exact int64 (a float bincount loses ns past 2^53)
        out[col] = acc
    return out


class _Budget:
    """A rank file's byte budget (``max_file_bytes``; Darshan's "partial" log, done so the
    analysis still sees the whole run).

    Until the file would pass it, less :data:`BUDGET_RESERVE` of it, every row is written.
    From the flush that would pass that on, the file keeps one row in ``sample_every`` by arrival, except the rows it always
    keeps (:data:`_ALWAYS_KEPT`: milestones, loss counts and every communication row, which
    the analysis matches across ranks). Every row not written is added to ``/counters``, its
    (kind, name) count (of calls: a file row the interposer summed counts its ``seq`` calls),
    duration and bytes. The sampled rows may take a further
    ``budget / 8``; past that only counters grow (at most :data:`COUNTERS_MAX` rows).
    Attributes say so: ``budget_bytes``, ``budget_reached_mono_ns``, ``sample_every``,
    ``rows_counted_only``. From then on the string table takes only the names of the
    rows kept and of the counters, at most ``budget / 8`` more bytes of them (a row whose
    name finds no room is counted instead; a counter's name becomes -1, "other names").
    So a file ends near the budget plus the counters past their eighth (29 bytes each), the
    clock and GPU samples (a row per minute and per second) and the communication rows; at
    :data:`HARD_FACTOR` x the budget it stops recording (closed properly, said in
    ``recording_stopped``)."""

    def __init__(self, budget_bytes: int, sample_every: int) -> None:
        self.budget = int(budget_bytes)
        self.every = max(1, int(sample_every))
        self.reached_ns: int | None = None
        self.sampled_bytes = 0
        self.arrived = 0  # rows of other kinds seen since the budget was reached
        self.counted = 0
        self.counters = np.zeros(0, COUNTER_DTYPE)

    def over(self, file_bytes: int, batch_bytes: int) -> bool:
        """The budget is reached: the file would pass what the budget leaves after the room it
        keeps (:data:`BUDGET_RESERVE`) for what is written once it is reached."""
        limit = self.budget - int(self.budget * BUDGET_RESERVE)
        return self.budget > 0 and (self.reached_ns is not None or file_bytes + batch_bytes > limit)

    def thin(self, events: np.ndarray, t_ns: int) -> np.ndarray:
        """The rows of ``events`` to write; the others go into the counters."""
        if self.reached_ns is None:
            self.reached_ns = t_ns
        kind = events["kind"]
        keep = _ALWAYS_KEPT[kind]
        room = (self.budget // 8 - self.sampled_bytes) // EVENT_DTYPE.itemsize
        if room > 0:
            rest = np.flatnonzero(~keep)
            sample = rest[(self.arrived + np.arange(len(rest))) % self.every == 0]
            # within what is left of the allowance: one large flush (a loaded machine flushes
            # less often) took 1.6x it at once before
            keep[sample[: max(0, room - int(keep.sum()))]] = True
            self.arrived += len(rest)
            self.sampled_bytes += int(keep.sum()) * EVENT_DTYPE.itemsize
        drop = events[~keep]
        if len(drop):
            self.count(drop)
        return events[keep]

    def count(self, rows: np.ndarray) -> None:
        """Add ``rows`` (recorder ids) to the counters."""
        self.counted += len(rows)
        new = np.zeros(len(rows), COUNTER_DTYPE)
        # a file row the libc interposer summed stands for ``seq`` calls (distdiag.rows.calls_of)
        summed = _FILE_ROW[rows["kind"]] & (rows["seq"] > 1)
        new["kind"], new["name_id"] = rows["kind"], rows["name_id"]
        new["count"] = np.where(summed, rows["seq"], 1)
        new["dur_ns"] = np.maximum(rows["t1_ns"] - rows["t0_ns"], 0)
        new["nbytes"] = np.maximum(rows["nbytes"], 0)
        self.counters = _merge_counters(self.counters, new)
        if len(self.counters) > COUNTERS_MAX:  # the smallest fold into one (kind, -1) per kind
            order = np.argsort(self.counters["count"])[::-1]
            fold = self.counters[order[COUNTERS_MAX // 2 :]].copy()
            fold["name_id"] = -1
            self.counters = _merge_counters(self.counters[order[: COUNTERS_MAX // 2]], fold)

    def file_counters(self, ids: _LocalIds) -> np.ndarray:
        """The counters in the file's string ids (-1: a name that found no room)."""
        out = self.counters.copy()
        folded = out["name_id"] < 0  # already "other names" (past COUNTERS_MAX)
        out["name_id"] = ids._map(out["name_id"], bounded=True)
        out["name_id"][folded] = -1
        return _merge_counters(out, np.zeros(0, COUNTER_DTYPE)) if (out["name_id"] < 0).sum() > 1 else out

    def attrs(self) -> dict[str, Any]:
        return {"budget_bytes": self.budget, "budget_reached_mono_ns": self.reached_ns,
                "sample_every": self.every, "rows_counted_only": self.counted}  # fmt: skip


class Writer:
    """The shim's incremental writer for one rank.

    ``Writer(path, rec, cfg, attrs)`` creates the file (layout + attributes),
    exclusively: ``FileExistsError`` when a file (or a link) is there (it is
    never overwritten, a link never followed), another ``OSError`` when it
    cannot be made (the wrapper then runs the job without recording). The
    file is mode 0600 (:data:`FILE_MODE`) and its ``argv`` attribute is
    redacted (:func:`redact_argv`, ``cfg.redact_args`` / ``cfg.keep_code_text``).
    ``start()`` launches the background flusher; ``flush()`` and ``close()``
    may be called from any thread. After a write error (full disk, vanished
    directory) the writer prints one line on stderr, stops writing and tells
    the recorder to drop its chunks, so memory stays bounded; the job goes on.

    What a flush writes (in this order, then ``file.flush()``):

    1. the recorder's full chunks (``rec.full``), from the offset already
       flushed while each was still a thread's current chunk;
    2. for every thread buffer, the rows published since the last flush. The
       buffer is read before its count (``buf = tb.buf; n = tb.n``): if the
       thread rotates in between, ``n`` belongs to the new chunk, is at most
       ``cap``, and every row of the old chunk below ``cap`` is complete, so
       rows ``[offset, n)`` of ``buf`` are always whole rows;
    3. new strings, clock-sync and GPU rows handed over since the last flush;
    4. ``/inflight`` replaced by ``rec.inflight_rows()``;
    5. attrs ``last_flush_mono_ns`` and ``lost_events`` (and a ``Kind.LOST``
       row with ``aux`` = newly lost events when that count grew).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        rec: Any,
        cfg: Any,
        attrs: dict[str, Any],
        compact_strings: bool = False,
        claim_fd: int | None = None,
    ) -> None:
        import h5py

        self.path = Path(path)
        self.rec = rec
        self.interval_s = float(getattr(cfg, "flush_interval_s", 1.0))
        #: close() ends within this many seconds whatever the file system does (see close)
        self.exit_timeout_s = _exit_timeout(getattr(cfg, "exit_timeout_s", 10.0))
        self._deadline: float | None = None  # time.monotonic() bound, set by close()
        self.rows_cut = 0  # rows not written because the exit's bound passed
        self._budget = _Budget(int(getattr(cfg, "max_file_bytes", 0) or 0), int(getattr(cfg, "sample_every", 64)))
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.failed = False
        # id(buf) -> (buf, rows already written). The buffer object is kept in
        # the value so its id cannot be reused while the entry exists.
        self._offsets: dict[int, tuple[bytearray, int]] = {}
        self._strings_done = 0
        self._lost_done = 0
        self._sync: list[np.ndarray] = []
        self._gpu: list[np.ndarray] = []
        self._held: list[np.ndarray] = []
        self.rows_written = 0
        self.flushes = 0
        #: the time the next flush is stamped with (``last_flush_mono_ns``) instead of now: a helper
        #: process writes the rank's flush after it was made (distdiag.shim.helper)
        self.flush_mono_ns: int | None = None
        self._detached = False
        #: a forked child's file: only the strings its rows use (see _LocalIds)
        self._ids = _LocalIds(rec.strings.strings) if compact_strings else None
        # "x": created exclusively, never over another file (FileExistsError if one is
        # there: another launch's rank file, the wrapper then records elsewhere)
        # "x" is O_CREAT | O_EXCL underneath (HDF5's sec2 driver): it never opens what is
        # there, a link included, so a link planted at the name is never written through.
        # rdcc_nbytes=0: no chunk cache, see _write_pieces
        if claim_fd is None:
            self._f = h5py.File(self.path, "x", locking=LOCKING, rdcc_nbytes=0)
        else:
            # The path was claimed empty by distdiag.shim.rankfile.RankFile (O_EXCL, no link
            # followed); this open ("w" follows a link) goes over that very file only. (Made
            # under a temporary name and renamed over the claim instead, the file lost its
            # descriptor on a FUSE passthrough mount: EBADF at the next write, seen.)
            claimed = os.fstat(claim_fd)
            there = os.lstat(self.path)
            if not (stat.S_ISREG(there.st_mode) and os.path.samestat(claimed, there) and there.st_size == 0):
                raise FileExistsError(f"{self.path} is no longer the empty file claimed at start")
            self._f = h5py.File(self.path, "w", locking=LOCKING, rdcc_nbytes=0)
            if not os.path.samestat(os.fstat(self._f.id.get_vfd_handle()), claimed):
                self._f.close()
                raise FileExistsError(f"{self.path} is no longer the file claimed at start")
        try:
            fd = self._f.id.get_vfd_handle()
            try:  # a program this one execs does not inherit the descriptor
                os.set_inheritable(fd, False)
            except Exception:
                pass
            # Only the job's user reads what follows (argv, env, paths): 0600 before the
            # first attribute is written (HDF5 creates files 0666 & ~umask, and changing
            # the umask would change it for the program's own threads too).
            try:
                os.fchmod(fd, FILE_MODE)
            except OSError:  # a file system without modes (vfat, some FUSE): the 0700 dir still guards it
                log.debug("distdiag: mode of %s not set", self.path, exc_info=True)
            if "argv" in attrs:
                attrs = {**attrs, "argv": _redacted_argv_attr(attrs["argv"], cfg)}
            _create_layout(self._f, self._budget.budget)
            # Keep the dataset objects open for the file's life: a dataset
            # closed after each append flushes its chunk cache on close, and a
            # failure there is only printed by h5py ("Exception ignored"), never
            # raised; with them open, write errors surface in file.flush().
            self._ds = {name: self._f[name] for name in _DATASETS}
            _set_attrs(self._f, {**attrs, "closed_cleanly": False})
            self._f.flush()
        except Exception:
            self._f.close()
            raise

    # -- handing rows over (any thread) -----------------------------------------
    def add_rows(self, raw: bytes) -> None:
        """Queue whole EVENT_DTYPE rows given as bytes (rows of threads that ended before the
        file opened, see distdiag.shim.rankfile.RankFile); written at the next flush."""
        with self._lock:
            self._held.append(np.frombuffer(raw, EVENT_DTYPE))

    def add_sync(self, rows: np.ndarray) -> None:
        """Queue SYNC_DTYPE rows; written at the next flush."""
        with self._lock:
            self._sync.append(np.asarray(rows, dtype=SYNC_DTYPE).copy())

    def add_gpu(self, rows: np.ndarray) -> None:
        """Queue GPU_DTYPE rows; written at the next flush."""
        with self._lock:
            self._gpu.append(np.asarray(rows, dtype=GPU_DTYPE).copy())

    def set_attr(self, name: str, value: Any) -> None:
        """Set a root attribute now (dicts/lists are stored as JSON text)."""
        with self._lock:
            if self._closed or self.failed:
                return
            try:
                _set_attrs(self._f, {name: value})
            except Exception as e:
                self._fail(e)

    # -- the background flusher ---------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="distdiag-flusher", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.flush()

    # -- flushing ---------------------------------------------------------------
    def _collect_events(self) -> np.ndarray:
        rec = self.rec
        parts: list[np.ndarray] = self._held
        self._held = []
        parts += [_rows_view(buf, start, stop) for buf, start, stop in rec.drain(self._offsets)]
        lost = int(rec.lost_events)
        if lost > self._lost_done:
            from distdiag.shim.recorder import now_ns

            t = now_ns()
            row = np.zeros(1, EVENT_DTYPE)
            row["t0_ns"] = row["t1_ns"] = t
            row["kind"] = Kind.LOST
            row["name_id"] = rec.intern("lost_events")
            row["aux"] = lost - self._lost_done
            row["seq"] = row["peer"] = -1
            parts.append(row)
            self._lost_done = lost
        if not parts:
            return np.zeros(0, EVENT_DTYPE)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def flush(self) -> None:
        """Write everything recorded so far and flush the file. Never raises."""
        with self._lock:
            if self._closed or self.failed:
                return
            try:
                self._flush_locked()
            except Exception as e:
                self._fail(e)

    def _flush_locked(self) -> None:
        from distdiag.shim.recorder import now_ns

        f = self._f
        ds = self._ds
        events = self._collect_events()
        inflight = self.rec.inflight_rows()
        budget = self._budget
        size = self._file_bytes() if budget.budget > 0 else 0
        if budget.reached_ns is not None and size > HARD_FACTOR * budget.budget:
            raise _DiskFull(f"it passed {HARD_FACTOR}x its recording budget (max_file_bytes={budget.budget}) with "
                            "rows never sampled (communication)")  # fmt: skip
        if len(events) and budget.over(size, len(events) * EVENT_DTYPE.itemsize + self._pending_strings()):
            if budget.reached_ns is None:
                # from now on the file takes only the names its kept rows and counters use
                if self._ids is None:
                    self._ids = _LocalIds(self.rec.strings.strings, done=self._strings_done)
                self._ids.room = budget.budget // 8
            events = budget.thin(events, now_ns())  # recorder ids: the counters keep those
        ids = self._ids
        if ids is not None:
            if budget.reached_ns is not None:
                events = self._map_kept(ids, events)
            else:
                events = ids.remap(events)
            inflight = ids.remap(inflight, bounded=False)
        self._check_space(len(events) * EVENT_DTYPE.itemsize)
        counters = None
        if budget.reached_ns is not None:
            assert ids is not None
            counters = budget.file_counters(ids)
        if ids is not None:
            new = ids.take_new()
        else:
            strings = self.rec.strings.strings
            n_str = len(strings)  # append-only list: read the length once
            new = strings[self._strings_done : n_str]
        if new:
            _append(ds["strings"], _h5_strings(new))
            self._strings_done += len(new)
        try:
            _append(ds["events"], events, self._get_deadline)
            self.rows_written += len(events)
        except _PastDeadline as e:
            self.rows_written += e.written
            self.rows_cut += e.total - e.written
            _set_attrs(f, {"recording_stopped": f"the exit's bound (exit_timeout_s={self.exit_timeout_s:g}) passed "
                                                f"while writing: {self.rows_cut} rows not written",
                           "rows_not_written_at_exit": self.rows_cut})  # fmt: skip
        if self._sync:
            sync, self._sync = self._sync, []
            _append(ds["clock_sync"], np.concatenate(sync))
        if self._gpu:
            gpu, self._gpu = self._gpu, []
            _append(ds["gpu"], np.concatenate(gpu))
        _replace(ds["inflight"], inflight)
        if budget.reached_ns is not None:
            if "counters" not in f:
                f.create_dataset("counters", shape=(0,), maxshape=(None,), dtype=COUNTER_DTYPE, chunks=(1024,))
            _replace(f["counters"], counters)
            _set_attrs(f, budget.attrs())
        f.attrs["last_flush_mono_ns"] = now_ns() if self.flush_mono_ns is None else int(self.flush_mono_ns)
        f.attrs["lost_events"] = int(self.rec.lost_events)
        f.flush()
        self.flushes += 1

    def _get_deadline(self) -> float | None:
        return self._deadline

    def _pending_strings(self) -> int:
        """About what the strings not yet written take in the file (none known for a child's)."""
        if self._ids is not None:
            return 0
        new = self.rec.strings.strings[self._strings_done :]
        return sum(map(len, new)) + 16 * len(new)

    def _map_kept(self, ids: _LocalIds, events: np.ndarray) -> np.ndarray:
        """``events`` (kept past the budget) in file ids: milestones whatever their names
        take; a row whose name finds no room goes into the counters instead."""
        if len(events) == 0:
            return events
        always = _ALWAYS_KEPT[events["kind"]]
        out = events.copy()
        if always.any():
            out[always] = ids.remap(events[always], bounded=False)
        rest = ~always
        if rest.any():
            mapped = ids.remap(events[rest], bounded=True)
            refused = np.zeros(len(mapped), bool)
            for c in STRING_COLUMNS:
                refused |= mapped[c] < 0
            refused |= _AUX_KIND_TABLE[mapped["kind"]] & (mapped["aux"] < 0)
            out[rest] = mapped
            if refused.any():
                where = np.flatnonzero(rest)[refused]
                self._budget.count(events[where])
                keep = np.ones(len(out), bool)
                keep[where] = False
                out = out[keep]
        return out

    def _file_bytes(self) -> int:
        """The rank file's size on disk as of the last flush (what the budget counts)."""
        try:
            return os.fstat(self._f.id.get_vfd_handle()).st_size
        except Exception:
            return 0

    def _check_space(self, batch_nbytes: int) -> None:
        """Stop cleanly before the disk is full rather than after.

        Measured with h5py 3.16: once a write inside HDF5 fails with ENOSPC the
        file cannot be closed and the library's shutdown at process exit
        segfaults. So every flush first checks that the batch plus a reserve
        fits; if not, the file is closed properly (everything so far stays
        readable) and recording stops.
        """
        try:
            st = os.statvfs(self.path.parent)
        except OSError:
            return
        free = st.f_bavail * st.f_frsize
        need = 2 * batch_nbytes + DISK_RESERVE_BYTES
        if free < need:
            raise _DiskFull(f"only {free} bytes free on its file system (need {need})")

    def _fail(self, e: BaseException) -> None:
        """Stop writing after an error; keep the job running with bounded memory."""
        if self.failed:
            return
        self.failed = True
        self._stop.set()
        msg = one_line(e)
        say(f"distdiag: cannot write {self.path}: {msg}; the job runs without recording")
        # From now on every full chunk is dropped (counted as lost) instead of queued.
        self.rec.max_pending_chunks = 0
        self.rec.full.clear()
        self._offsets.clear()
        if isinstance(e, _DiskFull):
            try:  # nothing failed inside HDF5: close properly, the rows so far stay readable
                _set_attrs(self._f, {"recording_stopped": msg, "lost_events": int(self.rec.lost_events)})
                self._ds = {}
                self._f.close()
                return
            except Exception:
                pass
        # A write failed inside HDF5. Its later writes (object deallocation, the
        # close, the library's shutdown at exit) would fail again, print
        # errors and, measured, segfault at exit. Point the file descriptor at
        # /dev/null so they succeed harmlessly, then close.
        try:
            fd = self._f.id.get_vfd_handle()
            nul = os.open(os.devnull, os.O_RDWR)
            try:
                os.dup2(nul, fd)
            finally:
                os.close(nul)
        except Exception:
            log.debug("distdiag: could not detach the failed file", exc_info=True)
        self._ds = {}
        try:
            self._f.close()
        except Exception:
            pass

    def close(self, exit_code: int | None, deadline: float | None = None, end_mono_ns: int | None = None,
              clean: bool = True) -> None:
        """Final flush; write end_mono_ns, exit_code, closed_cleanly=True. Idempotent, never raises.

        Bounded by ``exit_timeout_s`` (10 s) whatever the file system does: the flusher's
        and this final flush stop writing at the bound (between ~1 MiB pieces, see
        _write_pieces; the rows not written are counted in ``rows_not_written_at_exit``),
        and a flush stuck inside one call (a hung file system) is not waited for past
        it: the file then stays as of its last flush. ``deadline``: a time.monotonic() bound
        set by the caller instead. ``end_mono_ns``: the process's end as it said it (a helper
        process writes the file after the rank's end, distdiag.shim.helper); ``clean`` False:
        the process did not close the file (it died), so ``closed_cleanly`` stays false and no
        exit is written. What the kernel does with the
        descriptor at process exit is the kernel's (a hung FUSE or NFS server can hold
        the exit itself; see the README)."""
        from distdiag.shim.recorder import now_ns

        if deadline is None:  # else the caller's (RankFile.close): one bound for the whole exit
            deadline = time.monotonic() + self.exit_timeout_s
        self._deadline = deadline
        self._stop.set()
        if not wait_for_writes(self._thread, self._lock, deadline, self.interval_s):
            self._closed = True
            say(f"distdiag: {self.path}: a write did not return within exit_timeout_s={self.exit_timeout_s:g} s "
                "(hung file system?); the job exits with the file as of its last flush")
            return
        try:
            if self._closed or self.failed:
                self._closed = True
                return
            try:
                self._flush_locked()
                if clean:
                    end = now_ns() if end_mono_ns is None else int(end_mono_ns)
                    _set_attrs(self._f, {"end_mono_ns": end, "exit_code": exit_code, "closed_cleanly": True})
                self._ds = {}
                self._f.close()
            except Exception as e:
                self._fail(e)
            self._closed = True
        finally:
            self._lock.release()

    def close_unclean(self) -> None:
        """The process that recorded died: write what was handed over and close the file, leaving
        ``closed_cleanly`` false (the analyzer reads the rank as killed, as after a SIGKILL)."""
        self.close(None, clean=False)

    def detach(self) -> None:
        """In a forked child: the inherited file is the parent's; never write, flush or close it.

        Setting flags is not enough: the child's HDF5 library still has the
        file open (h5py's objects, and the library's own list of open files),
        and whatever closes it there (an h5py object's deallocation, h5py's and
        HDF5's shutdown when the child's interpreter exits) flushes the
        child's stale metadata cache and truncates the file to the child's
        stale end of allocation, through the descriptor it shares with the
        parent: measured, a child that ends by ``sys.exit`` while the parent
        appends leaves a rank file whose string heap or /events cannot be read.
        h5py's docs advise opening files after a fork, never before; this file
        was opened before. So the child's copy of the descriptor is pointed at
        an anonymous memory file (``memfd``, this process's own fd table only):
        HDF5 may write, truncate and close there as it likes, the parent's file
        never sees a byte. The h5py objects are kept referenced so that no
        close happens before the child's exit. Idempotent; never raises.
        """
        self._stop.set()
        self._thread = None
        self._closed = True
        self._lock = threading.RLock()  # the parent's lock may have been held at fork time
        if self._detached:
            return
        self._detached = True
        try:
            f = self._f
            _ABANDONED.append((f, self._ds))
            self._ds = {}
            # h5py takes its lock around fork, so the file is either open or closed
            # here, not half-way; a closed one's descriptor number may be another file's now
            if f.id.valid:
                fd = f.id.get_vfd_handle()
                anon = _anon_fd()
                try:
                    os.dup2(anon, fd, inheritable=False)
                finally:
                    os.close(anon)
        except Exception:
            log.debug("distdiag: inherited rank file not detached", exc_info=True)

    @property
    def closed(self) -> bool:
        return self._closed
