"""The shim's hot path: fixed-width event rows packed into preallocated chunks.

Why ``struct.pack_into`` into a ``bytearray``: measured on a 2-core machine
(``benchmarks/bench_recorder.py``), one row costs ~550 ns this way against
~850 ns for a write into a numpy structured row and ~820 ns for
``list.append(tuple)`` plus the later conversion. The bytearray *is* a
preallocated chunk: ``numpy.frombuffer(chunk, EVENT_DTYPE)`` views it with no
copy when the writer flushes.

Threads: every thread records into its own ``ThreadBuffer`` (no lock on the hot
path). A thread's first chunk is small (``FIRST_CHUNK_ROWS``, 4.4 KB) and each
rotation makes the next one ``CHUNK_GROWTH`` times larger, up to
``chunk_rows``: a short-lived thread that records a few calls costs 4.4 KB, not
a 1.1 MB chunk. A buffer knows when its thread ended (``ThreadBuffer.dead``:
a marker kept only in the thread's ``threading.local`` slot is freed with the
thread state); the writer drops such a buffer once its rows are written
(:meth:`Recorder.prune`), so neither memory nor the flush's walk over the
buffers grows with the number of threads that ever recorded. Only the owning thread writes a buffer; it publishes a row by bumping
``n`` *after* packing it, so the flusher, which reads ``buf`` and then ``n``,
only ever sees complete rows. A full chunk is handed to the flusher through a
deque (atomic append) and the thread continues in a fresh chunk. If the
flusher falls behind by more than ``max_pending_chunks`` the newest full chunk
is dropped and counted in ``lost_events`` (memory stays bounded; the analyzer
sees a LOST row).

A hook never raises into user code: every hook wraps its bookkeeping in
``try/except`` itself; this module's methods do not raise on valid input.

Writing a row inline (the protocol the mpi4py hook's generated wrappers use
to skip two method calls a call, ~0.5 us on this machine,
``benchmarks/bench_intercept.py``): take the thread's buffer (``tb =
rec._local.tb``, else ``rec._tb()``), and for a blocking call set ``tb.cur``
to the full row with ``t1 = -1`` before it (what ``/inflight`` shows if the
rank dies inside the call); after it set ``tb.cur = None``, then ``n =
tb.n``, ``if n >= tb.cap: n = rec._rotate(tb)``, ``pack_row(tb.buf, n *
ROW_SIZE, t0, t1, ...)`` and last ``tb.n = n + 1`` (the publish).
:meth:`enter`/:meth:`leave` do the same in two calls and stay for the
other hooks. The C wrappers (``distdiag/shim/_hot.c``) follow the same
protocol on the same buffer, but mark their open call in C fields
(``ccur``) instead of ``cur``: no tuple per call.
"""

from __future__ import annotations

import collections
import itertools
import os
import struct
import sys
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Callable

from distdiag.schema import EVENT_SPEC, Kind

# No numpy here: this module runs in the program's process from its first line, and
# importing numpy there would fix BLAS thread counts (OPENBLAS_NUM_THREADS, ...) before
# the program sets them. The writer views these bytes as schema.EVENT_DTYPE rows.
_STRUCT_CODES = {"<i8": "q", "u1": "B", "<i4": "i", "<f8": "d"}
_ROW = struct.Struct("<" + "".join(_STRUCT_CODES[code] for _, code in EVENT_SPEC))
ROW_SIZE = _ROW.size
#: byte offset of ``kind`` in a row; a zero there marks a row not yet written
KIND_OFFSET = struct.calcsize("<" + "".join(_STRUCT_CODES[code] for name, code in EVENT_SPEC[: [n for n, _ in EVENT_SPEC].index("kind")]))
#: ``pack_row(buf, offset, t0, t1, kind, name_id, comm_id, seq, peer, nbytes, aux, site_id, tid, value)``
pack_row = _ROW.pack_into

#: The event clock. One monotonic clock per rank; the analyzer aligns ranks.
now_ns = time.perf_counter_ns
CLOCK_NAME = "perf_counter_ns"


#: rows of a thread's first chunk (4.4 KB); every rotation grows the next chunk by
#: CHUNK_GROWTH, up to the recorder's chunk_rows
FIRST_CHUNK_ROWS = 64
CHUNK_GROWTH = 4


#: ``tid`` of a muted thread's buffer (Recorder.mute_thread): never registered, never written
MUTED_TID = -1


class _Muted:
    __slots__ = ("rec", "saved", "muted")

    def __init__(self, rec: Recorder) -> None:
        self.rec = rec
        self.saved: Any = None
        self.muted = False

    def __enter__(self) -> None:
        loc = self.rec._local
        self.saved = getattr(loc, "tb", None)
        if self.saved is None or self.saved.tid != MUTED_TID:
            self.rec.mute_thread()
            self.muted = True

    def __exit__(self, *exc: Any) -> None:
        loc = self.rec._local
        if self.muted:
            self.rec.libc_mute(False)
        if self.saved is not None:
            loc.tb = self.saved
        else:
            try:
                del loc.tb
            except AttributeError:
                pass


class _Alive:
    """Held only by a thread's ``threading.local`` slot: freed when the thread state goes."""

    __slots__ = ("__weakref__",)


class _PyThreadBufferBase:
    """ThreadBuffer's state where the C module (distdiag.shim._hot.TBBase) is not built."""

    __slots__ = ("buf", "n", "cap", "tid", "cur", "spans", "alive")

    def __init__(self, cap: int, tid: int, alive: Any = None) -> None:
        self.buf = bytearray(cap * ROW_SIZE)
        self.n = 0
        self.cap = cap
        self.tid = tid
        #: the blocking call this thread is inside of: a full row tuple with t1 = -1
        self.cur: tuple[Any, ...] | None = None
        #: open spans (``distdiag.phase``) on this thread, outermost first: rows with t1 = -1
        self.spans: list[tuple[Any, ...]] = []
        #: weak reference to the owning thread's _Alive marker; None: no thread owns
        #: the buffer (see Recorder.shared_buffer), it is never pruned
        self.alive = alive

    #: the call a C wrapper is inside of: never, without the C module
    ccur: tuple[Any, ...] | None = None


def _load_hot() -> Any:
    """distdiag.shim._hot (the C hot path), or None where it is not built, writes other rows,
    or ``DISTDIAG_HOT=0`` asks for the pure-Python twins (what a machine without a compiler runs)."""
    if os.environ.get("DISTDIAG_HOT", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    try:
        from distdiag.shim import _hot  # type: ignore[attr-defined]
    except ImportError:
        return None
    probe = (-2, 2**62, 255, -(2**31), 2**31 - 1, -1, 7, 2**40, 3, 12, 5, 0.0)
    if _hot.ROW_SIZE != ROW_SIZE or _hot.pack(*probe) != _ROW.pack(*probe):
        return None
    return _hot


#: the C hot path (distdiag/shim/_hot.c), or None: the same objects in pure Python
HOT: Any = _load_hot()


if TYPE_CHECKING:  # the checker sees the Python base's fields (the C base has the same)
    _ThreadBufferBase = _PyThreadBufferBase
else:
    _ThreadBufferBase = HOT.TBBase if HOT is not None else _PyThreadBufferBase


class ThreadBuffer(_ThreadBufferBase):
    """One thread's current chunk and the call it is inside of (if any).

    Fields (C or Python, the same): ``buf`` the chunk, ``n`` its rows written, ``cap``
    its rows, ``tid``, ``cur`` the blocking call a Python hook is inside of (a row tuple
    with t1 = -1, or None), ``ccur`` the one a C wrapper (distdiag/shim/_hot.c) is inside
    of (read-only: built from its fields when asked), ``spans`` the open spans (``distdiag.phase``) outermost
    first, ``alive`` a weak reference to the owning thread's _Alive marker (None: no
    thread owns the buffer, see Recorder.shared_buffer; it is never pruned)."""

    __slots__ = ()

    @property
    def dead(self) -> bool:
        """The owning thread has ended: nothing writes this buffer any more."""
        a = self.alive
        return a is not None and a() is None


class StringTable:
    """Interned strings; id 0 is the empty string. Append-only."""

    def __init__(self) -> None:
        self.ids: dict[str, int] = {"": 0}
        self.strings: list[str] = [""]
        self._lock = threading.Lock()

    def intern(self, s: str) -> int:
        i = self.ids.get(s)
        if i is not None:
            return i
        with self._lock:
            i = self.ids.get(s)
            if i is None:
                i = len(self.strings)
                self.strings.append(s)
                self.ids[s] = i
            return i


class Recorder:
    """Per-process event sink. One instance per rank (``distdiag.shim.recorder.RECORDER``)."""

    def __init__(self, chunk_rows: int = 16384, max_pending_chunks: int = 64) -> None:
        self.chunk_rows = chunk_rows
        self.max_pending_chunks = max_pending_chunks
        self.strings = StringTable()
        self.enabled = True
        self.lost_events = 0
        #: full chunks waiting for the flusher: (bytearray, rows)
        self.full: collections.deque[tuple[bytearray, int]] = collections.deque()
        self.buffers: list[ThreadBuffer] = []
        #: called (no arguments) after a thread got its first buffer; None normally.
        #: A forked child's shim starts its own file from here (distdiag.shim.wrap)
        self.on_new_buffer: Callable[[], None] | None = None
        #: called with True / False as a thread is muted / unmuted (mute_thread, muted): the libc
        #: interposer's per-thread switch while it records (distdiag.shim.preload), else None
        self.on_libc_mute: Callable[[bool], None] | None = None
        #: called with the recorder at the start of every drain: sources that hold rows outside
        #: the thread buffers (the C++ DDP kernel's completed buckets, distdiag.shim.hooks.torch_dist)
        #: put them into a buffer of theirs here
        self.feeders: list[Callable[[Recorder], None]] = []
        self._local = threading.local()
        self._tids = itertools.count()
        self._buf_lock = threading.Lock()
        #: (id(code), f_lasti) -> string id of "file:line"; _site_codes keeps
        #: each code object alive so that its id is never reused. Keyed by id:
        #: hashing a code object hashes its bytecode and constants (~150 ns).
        self._sites: dict[tuple[int, int], int] = {}
        self._site_codes: dict[int, Any] = {}
        self.intern = self.strings.intern

    # -- per-thread buffer ----------------------------------------------------
    def _tb(self) -> ThreadBuffer:
        try:
            return self._local.tb  # type: ignore[no-any-return]
        except AttributeError:
            mark = _Alive()
            tb = ThreadBuffer(min(FIRST_CHUNK_ROWS, self.chunk_rows), next(self._tids), weakref.ref(mark))
            with self._buf_lock:
                self.buffers.append(tb)
            loc = self._local
            loc.tb = tb
            loc.alive = mark  # only this slot holds it: it dies with the thread's locals
            self.new_buffer_made()
            return tb

    def new_buffer_made(self) -> None:
        """Call :attr:`on_new_buffer` (a buffer's first rows wake a forked child's stream); what it
        raises is distdiag's failure, never the program's: ignored."""
        cb = self.on_new_buffer
        if cb is not None:
            try:
                cb()
            except Exception:
                pass

    def shared_buffer(self) -> ThreadBuffer:
        """A registered buffer that no thread owns and that is never pruned, for a caller
        that serializes its writers itself (torch_dist's future callbacks)."""
        tb = ThreadBuffer(min(FIRST_CHUNK_ROWS, self.chunk_rows), next(self._tids))
        with self._buf_lock:
            self.buffers.append(tb)
        return tb

    def prune(self, dead: list[ThreadBuffer]) -> None:
        """Forget buffers whose threads ended and whose rows were written (the writer calls this)."""
        if not dead:
            return
        gone = {id(tb) for tb in dead}
        with self._buf_lock:
            self.buffers = [tb for tb in self.buffers if id(tb) not in gone]

    def reset_after_fork(self) -> None:
        """In a forked child: forget the parent's rows (the parent writes them) and its threads.

        The string table stays: ids the hooks cached stay valid in the child.
        The calling thread gets a fresh buffer at its next row (and with it
        :attr:`on_new_buffer`)."""
        self._buf_lock = threading.Lock()
        self.strings._lock = threading.Lock()
        self.buffers = []
        self.full = collections.deque()
        self.lost_events = 0
        loc = self._local
        for name in ("tb", "alive"):
            try:
                delattr(loc, name)
            except AttributeError:
                pass

    def mute_thread(self) -> None:
        """From now on the calling thread's rows go nowhere: for the shim's own threads
        (the flusher, the GPU sampler's start), whose imports and file calls the hooks
        would otherwise record as the program's. The thread's rows so far stay."""
        tb = ThreadBuffer(FIRST_CHUNK_ROWS, MUTED_TID)  # registered nowhere: never written
        self._local.tb = tb
        self.libc_mute(True)

    def libc_mute(self, on: bool) -> None:
        """The calling thread's libc calls (un)muted in the interposer too, when it records
        (:attr:`on_libc_mute`, set by distdiag.shim.preload); never raises."""
        cb = self.on_libc_mute
        if cb is not None:
            try:
                cb(on)
            except Exception:
                pass

    def muted(self) -> Any:
        """A context in which the calling thread's rows go nowhere (see :meth:`mute_thread`);
        its own buffer, and the rows in it, are back afterwards."""
        return _Muted(self)

    def _rotate(self, tb: ThreadBuffer) -> int:
        # Order matters: the flusher reads ``tb.buf`` then ``tb.n``. Resetting
        # ``n`` before swapping ``buf`` means it can never pair the fresh
        # (empty) chunk with the old chunk's row count; the old chunk is
        # queued only after it is no longer the thread's current one. The
        # fresh chunk may be larger than the old one (a young thread's chunks
        # grow): the flusher clamps a count to its chunk's size.
        if tb.tid == MUTED_TID:  # a muted thread's rows: overwritten, never queued
            tb.n = 0
            return 0
        old, rows = tb.buf, tb.n
        cap = tb.cap
        if cap < self.chunk_rows:
            cap = min(cap * CHUNK_GROWTH, self.chunk_rows)
        tb.n = 0
        tb.buf = bytearray(cap * ROW_SIZE)
        tb.cap = cap
        if len(self.full) >= self.max_pending_chunks:
            self.lost_events += rows  # may include rows already flushed: an upper bound
        else:
            self.full.append((old, rows))
        return 0  # the row index to write next

    # -- the hot path -----------------------------------------------------------
    def add(
        self,
        t0: int,
        t1: int,
        kind: int,
        name_id: int,
        comm_id: int = 0,
        seq: int = -1,
        peer: int = -1,
        nbytes: int = 0,
        aux: int = 0,
        site_id: int = 0,
        value: float = 0.0,
    ) -> None:
        """Append one finished event."""
        try:
            tb = self._local.tb
        except AttributeError:
            tb = self._tb()
        n = tb.n
        if n >= tb.cap:
            n = self._rotate(tb)
        pack_row(tb.buf, n * ROW_SIZE, t0, t1, kind, name_id, comm_id, seq, peer, nbytes, aux, site_id, tb.tid, value)
        tb.n = n + 1

    def enter(
        self,
        kind: int,
        name_id: int,
        comm_id: int = 0,
        seq: int = -1,
        peer: int = -1,
        nbytes: int = 0,
        aux: int = 0,
        site_id: int = 0,
    ) -> int:
        """Mark the calling thread as inside a blocking call; returns t0.

        Pair with :meth:`leave`. Until then the flusher writes the call to
        ``/inflight``, so a rank killed inside it shows what it was doing.
        """
        try:
            tb = self._local.tb
        except AttributeError:
            tb = self._tb()
        t0 = now_ns()
        tb.cur = (t0, -1, kind, name_id, comm_id, seq, peer, nbytes, aux, site_id, tb.tid, 0.0)
        return t0

    def leave(self, t1: int | None = None) -> None:
        """Finish the call :meth:`enter` opened on this thread and record it."""
        try:
            tb = self._local.tb
        except AttributeError:  # entered in the parent before a fork: the parent records it
            return
        cur = tb.cur
        if cur is None:
            return
        tb.cur = None
        n = tb.n
        if n >= tb.cap:
            n = self._rotate(tb)
        # unpacking beats list(cur) + *row by ~190 ns a call (measured)
        t0, _, kind, name_id, comm_id, seq, peer, nbytes, aux, site_id, tid, value = cur
        pack_row(
            tb.buf, n * ROW_SIZE, t0, now_ns() if t1 is None else t1,
            kind, name_id, comm_id, seq, peer, nbytes, aux, site_id, tid, value,
        )
        tb.n = n + 1

    def site(self, depth: int = 2) -> int:
        """String id of the caller's ``file:line``, ``depth`` frames up from here."""
        try:
            f = sys._getframe(depth)
        except ValueError:
            return 0
        i = self._sites.get((id(f.f_code), f.f_lasti))
        return i if i is not None else self.site_of(f)

    def site_of(self, f: Any) -> int:
        """String id of frame ``f``'s current ``file:line``."""
        # keyed by the bytecode offset: f_lineno is computed from the line
        # table on every access, f_lasti is a plain field (~150 ns less a call)
        c = f.f_code
        key = (id(c), f.f_lasti)
        i = self._sites.get(key)
        if i is None:
            self._site_codes[id(c)] = c
            i = self.intern(f"{c.co_filename}:{f.f_lineno}")
            self._sites[key] = i
        return i

    # -- for the writer ---------------------------------------------------------
    def open_span(self, kind: int, name_id: int, site_id: int = 0, t0: int | None = None) -> tuple[Any, ...]:
        """Mark the calling thread as inside a span (a phase) until :meth:`close_span`.

        Unlike :meth:`enter` spans nest and enclose calls; they are not rows
        (the caller adds the finished span itself). Open spans go to
        ``/inflight`` at every flush, so a rank killed inside ``phase("eval")``
        shows it was there (see distdiag.detectors.hang)."""
        try:
            tb = self._local.tb
        except AttributeError:
            tb = self._tb()
        row = (now_ns() if t0 is None else t0, -1, kind, name_id, 0, -1, -1, 0, 0, site_id, tb.tid, 0.0)
        tb.spans.append(row)
        return row

    def close_span(self, row: tuple[Any, ...]) -> None:
        """Forget the span :meth:`open_span` returned (normally the calling thread's innermost)."""
        try:
            tb = self._local.tb
            if tb.spans and tb.spans[-1] is row:
                tb.spans.pop()
                return
        except AttributeError:
            pass
        for b in list(self.buffers):  # closed out of order or on another thread: rare
            for i, r in enumerate(b.spans):
                if r is row:
                    del b.spans[i]
                    return

    def drain(self, offsets: dict[int, tuple[bytearray, int]]) -> list[tuple[bytearray, int, int]]:
        """The rows published since the last drain, as ``(chunk, first row, end row)`` ranges,
        and the buffers of threads that ended pruned (their rows are in the ranges).

        ``offsets`` is the caller's record of what it took before (``id(chunk) ->
        (chunk, rows taken)``; the chunk is kept in the value so its id cannot be
        reused while the entry exists), updated here. One protocol for every
        consumer (the HDF5 writer, the spill log before it opens): what one took
        the other never takes again when it hands over its ``offsets``.

        1. the full chunks (``self.full``), from the offset already taken while each
           was still a thread's current chunk;
        2. for every thread buffer, the rows published since. The buffer is read
           before its count (``buf = tb.buf; n = tb.n``): if the thread rotates in
           between, ``n`` belongs to the new chunk, is at most ``cap``, and every row
           of the old chunk below ``cap`` is complete, so rows ``[offset, n)`` of
           ``buf`` are always whole rows.

        The :attr:`feeders` run first, so what they hold is in this drain."""
        for feed in self.feeders:
            feed(self)
        out: list[tuple[bytearray, int, int]] = []
        while True:
            try:
                buf, n = self.full.popleft()
            except IndexError:
                break
            entry = offsets.get(id(buf))
            start = entry[1] if entry is not None and entry[0] is buf else 0
            if n > start:
                out.append((buf, start, n))
            # Keep the entry (pruned below once the chunk is neither queued nor
            # current): _rotate queues the full chunk *before* it swaps in a fresh
            # one, so a drain can take a chunk that is still the thread's current
            # buffer; without this entry the loop below would take that chunk again
            # from row 0 (seen as duplicated rows 16384 apart in files of SIGKILLed ranks).
            offsets[id(buf)] = (buf, max(start, n))
        dead = []
        for tb in list(self.buffers):
            # Whether the thread ended, before its buffer and count are read: a
            # dead thread writes nothing more, so what is read now is all of it.
            gone = tb.dead
            buf = tb.buf  # buffer first, then count: see above
            n = tb.n
            # A young thread's next chunk is larger than its current one: if it
            # rotated between the two reads, n counts rows of the new chunk and
            # may pass the old one's size. The old chunk is full (every row
            # complete) and queued: the rows up to its end are the ones to take.
            rows = len(buf) // ROW_SIZE
            if n > rows:
                n = rows
            entry = offsets.get(id(buf))
            start = entry[1] if entry is not None and entry[0] is buf else 0
            if n > start and buf[(n - 1) * ROW_SIZE + KIND_OFFSET] == 0:
                # _rotate swaps in the fresh (zeroed) chunk before it resets the
                # count, so for a moment (fresh chunk, old count) is visible. Every
                # real row has kind >= 1: skip this round.
                if gone:
                    dead.append(tb)
                continue
            if n > start:
                out.append((buf, start, n))
                offsets[id(buf)] = (buf, n)
            if gone:
                dead.append(tb)
        # Threads that ended: their rows are in this batch (their queued chunks were
        # drained above, or stay queued until the next drain); drop the buffers.
        self.prune(dead)
        # Forget chunks that are neither current nor queued (dropped as lost):
        # holding them would leak a chunk each time the consumer falls behind.
        live = {id(tb.buf) for tb in list(self.buffers)} | {id(b) for b, _ in list(self.full)}
        for k in [k for k in offsets if k not in live]:
            del offsets[k]
        return out

    def inflight_tuples(self) -> list[tuple[Any, ...]]:
        """The calls and spans threads are inside of now, as row tuples (t1 = -1)."""
        rows = [c for tb in list(self.buffers) for c in (tb.cur, tb.ccur) if c is not None]
        return rows + [r for tb in list(self.buffers) for r in list(tb.spans)]

    def inflight_rows(self) -> Any:
        """The calls and spans threads are inside of now, as EVENT_DTYPE rows (the writer's)."""
        import numpy as np

        from distdiag.schema import EVENT_DTYPE

        rows = self.inflight_tuples()
        out = np.zeros(len(rows), EVENT_DTYPE)
        for i, r in enumerate(rows):  # one row per thread inside a call: a handful
            out[i] = r
        return out


def as_events(buf: bytearray, start: int, stop: int) -> Any:
    """Rows ``[start, stop)`` of a chunk as an EVENT_DTYPE array (a copy)."""
    import numpy as np

    from distdiag.schema import EVENT_DTYPE

    return np.frombuffer(buf, EVENT_DTYPE, count=stop - start, offset=start * ROW_SIZE).copy()


#: The process-wide recorder, created by the wrapper; None when not wrapped.
RECORDER: Recorder | None = None
SHIM_KIND = Kind  # re-export for hooks
