"""The libc interposer's Python side: find and arm the library, drain its ring into rows.

``interpose.c`` beside this file is built by ``pip install`` into ``_interpose*.so``
(an optional setuptools extension: without a compiler the package installs without it
and the file hook records at the Python level, as before). How it comes into a rank:

* **Re-exec.** ``LD_PRELOAD`` must be set before the interpreter starts, so
  ``distdiag-wrap`` re-executes itself once, in the same process (``exec``: same pid,
  descriptors, signal dispositions), with the library appended to ``LD_PRELOAD``
  (:func:`reexec`; a named interpreter's own re-exec carries it too, :func:`arm_env`).
  Launchers need not do anything. ``DISTDIAG_PRELOAD_TRIED`` marks the second start, so a
  library the loader refuses costs one exec, never a loop.
* **Environment.** The process environment (what exec'd children inherit) keeps the
  library, so the rank's children load it too (inert unless they are wrapped ranks, or
  forked: a forked worker's calls are its own stream); ``os.environ`` is what it would be
  without the shim (:func:`clean_environ`): ``LD_PRELOAD`` as the user set it (absent if
  unset), no marker. A program's own ``LD_PRELOAD`` stays, ahead of ours (its interposers
  keep precedence). A child started with an explicit ``env=`` built from ``os.environ``
  does not load it.
* **Which capture.** When the library is loaded and ``DISTDIAG_HOOKS`` says
  ``preload=1`` (the default: :data:`PRELOAD_DEFAULT`), the file hook installs *none* of its recording wrappers (os.stat,
  open, listdir, h5py, ...) and this drainer is the only source of file rows: each call
  is recorded once, by libc, whatever called it (Python, numpy, HDF5, torch's C++).
  Call sites: libc does not know the Python line. The file hook's thin wrappers of the
  calls that name a path (open, the imports' open_code, os.open, os.listdir, os.scandir,
  os.mkdir, os.remove/unlink, os.rmdir, os.rename/replace) name it (``_binding.site``) just
  before the call, and the descriptor an open makes carries its site to its reads, writes
  and close. Other rows (``os.stat``, calls made from C) carry none (``site_id`` 0); those
  hot calls get no Python wrapper. ``comm_id`` holds the libc
  call (``"libc:lstat"``, ``"libc:open"``...). The rank file's ``fileio_capture``
  attribute says which capture was in force: ``preload``, ``python`` or ``off``.

Rows, as the Python hook makes them: FILE_OPEN (open/openat/creat/fopen), FILE_STAT
(stat/lstat/fstatat/statx/access/faccessat, mkdir,
rmdir, unlink, rename, and an fstat or lseek of a tracked descriptor that took >=
CLOSE_MIN_NS: one answered from the client's cached attributes, ~1 us, is no server
call, as the Python hook skips fstat; on a file system that asks its server, it is a
row), FILE_LISTDIR
(opendir/fdopendir, getdents64, a readdir that went to the kernel), FILE_CLOSE (close,
fclose, closedir, when they took >= CLOSE_MIN_NS), FILE_READ/FILE_WRITE (read, pread,
readv, fread / write, pwrite, writev, fwrite: calls under BIG_CALL_BYTES and
BIG_CALL_NS summed per file and thread into one row, ``value`` = the calls summed;
fsync/fdatasync as a FILE_WRITE row with no bytes; an mmap of a file as a FILE_READ row
with no bytes). An open's row also spans the fstat/lseek calls the same thread makes
next on the new descriptor (Python's ``open()`` is open + fstat + fstat + lseek): one row, as
the Python hook's. The interposer folds those itself (no slot; the thread's next slot carries
their end, ``fold_t1``, and the converter moves the thread's pending open's end there); one on
another descriptor, even of the same file, is a call of its own (the converter folded those too,
by path: an fstat of an older descriptor 0.2 s after an open made that open last 0.2 s). ``value`` of the other rows is the call's errno (0: it succeeded).
``tid`` is a recorder thread id given to each OS thread the calls came from.
"""

from __future__ import annotations

import logging
import os
import struct
import sys
import threading
import time
from typing import Any

log = logging.getLogger(__name__)

HERE = os.path.dirname(os.path.abspath(__file__))
#: the marker of the re-executed start (removed from the environment at once)
TRIED_VAR = "DISTDIAG_PRELOAD_TRIED"
#: the ring's slots, for the library to start recording as it is loaded (interpose.c's
#: ``dd_early``, which removes the variable from the process's environment at once)
EARLY_VAR = "DISTDIAG_PRELOAD_EARLY"

#: the slot header of interpose.c's struct slot (64 bytes), then PATH_CAP path bytes
_HDR = struct.Struct("<Qqqqiiii HHiq")
PATH_CAP = 256
SLOT_SIZE = _HDR.size + PATH_CAP
#: slots copied out of the ring per dd_drain call
DRAIN_BATCH = 1024
#: interpose.c's struct ovf_rec (op, OS tid, calls, summed ns, bytes, first t0, dir length,
#: pad), then PATH_CAP directory bytes; at most OVF_MAX of them (its table and one per call)
_OVF = struct.Struct("<iiqqqqII")
OVF_SIZE = _OVF.size + PATH_CAP
OVF_MAX = 1024 + 32
#: OS threads given a recorder tid; past it the map starts over (new ids for old threads)
MAX_THREADS = 4096
#: A thread's metadata calls (FILE_STAT: stat, lstat, statx, access, mkdir, unlink...) above
#: ``preload_rows_per_s`` (ShimConfig, 10^5) in a window of HOT_WINDOW_NS, each under
#: ``big_ns``, are summed per (call, directory, thread) instead of a row each (issue 21 item 3):
#: a storm of millions of fast stats keeps its first rows of each window (1,000 of 10 ms) and
#: one sum per directory and batch. A slow call is always a row.
HOT_WINDOW_NS = 10_000_000

OP_NAMES = (
    "", "open", "close", "read", "write", "lseek", "fsync", "stat", "fstat", "access",
    "opendir", "readdir", "mkdir", "unlink", "rename", "mmap", "fopen", "fread",
    "fwrite", "lstat", "statx", "getdents64", "rmdir", "fclose", "closedir",
)  # fmt: skip
OP = {name: i for i, name in enumerate(OP_NAMES) if name}


def library_path() -> str | None:
    """The built interposer beside this file, or None (not built here)."""
    try:
        found = sorted(n for n in os.listdir(HERE) if n.startswith("_interpose") and n.endswith(".so"))
    except OSError:
        return None
    return os.path.join(HERE, found[0]) if found else None


_lib: Any = None


def loaded() -> Any:
    """The interposer as this process loaded it (LD_PRELOAD), through its binding
    (``_binding``: no ctypes in the program's process), or None."""
    global _lib
    if _lib is not None:
        return _lib
    try:
        from distdiag.shim.preload import _binding  # type: ignore[attr-defined]
    except ImportError:
        return None
    try:
        if not _binding.available() or _binding.version() != (2, SLOT_SIZE):
            return None
    except Exception:
        return None
    _lib = _binding
    return _lib


#: whether ``DISTDIAG_HOOKS`` without a ``preload`` entry uses the interposer (README, "From
#: libc: the interposer"); ``preload=0`` chooses the Python-level capture.
PRELOAD_DEFAULT = True


def wanted(hooks: dict[str, bool]) -> bool:
    """The interposer is to be used: the file hook on and ``preload`` switched on
    (``DISTDIAG_HOOKS="preload=1"``, and :data:`PRELOAD_DEFAULT` without the entry)."""
    return bool(hooks.get("fileio", True)) and bool(hooks.get("preload", PRELOAD_DEFAULT))


def arm_env(hooks: dict[str, bool], slots: int = 16384) -> bool:
    """Put the library in LD_PRELOAD (and the marker) for the exec that follows; False when
    it is not wanted, not built, already tried, or already loaded. ``slots``: the ring the
    library starts with as it is loaded (:data:`EARLY_VAR`), so the interpreter's own start
    and imports are recorded from its first instruction."""
    if TRIED_VAR in os.environ or not wanted(hooks) or loaded() is not None:
        return False
    path = library_path()
    if path is None:
        return False
    own = os.environ.get("LD_PRELOAD", "")
    os.environ["LD_PRELOAD"] = f"{own}:{path}" if own else path
    os.environ[TRIED_VAR] = "1"
    os.environ[EARLY_VAR] = str(max(1024, int(slots)))
    return True


def disarm_env() -> None:
    """Undo :func:`arm_env` (the exec failed)."""
    os.environ.pop(TRIED_VAR, None)
    os.environ.pop(EARLY_VAR, None)
    clean_environ()
    own = os.environ.get("LD_PRELOAD")
    if own is None:
        os.unsetenv("LD_PRELOAD")
    else:
        os.putenv("LD_PRELOAD", own)


def reexec(hooks: dict[str, bool], slots: int = 16384) -> None:
    """Re-execute this interpreter, as it was started, with the interposer preloaded.
    Returns only when that is not wanted or not possible (then nothing changed)."""
    if not arm_env(hooks, slots):
        return
    argv = list(getattr(sys, "orig_argv", []) or [])
    if not argv or not sys.executable:
        disarm_env()
        return
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execv(sys.executable, argv)
    except OSError:
        disarm_env()


def clean_environ() -> None:
    """``os.environ`` as the program would see it unwrapped: no marker, and LD_PRELOAD
    without our library (absent when that leaves it empty). The process environment keeps
    LD_PRELOAD (exec'd children load the library), so ``os.environ``'s own mapping is
    edited, not the process's (that would be putenv/unsetenv)."""
    if TRIED_VAR in os.environ:
        del os.environ[TRIED_VAR]  # from both: a child must not take it as its own retry
    if EARLY_VAR in os.environ:
        del os.environ[EARLY_VAR]  # the library took it (and removed it) as it was loaded
    try:
        data = os.environ._data  # type: ignore[attr-defined]
        key = os.environ.encodekey("LD_PRELOAD")  # type: ignore[attr-defined]
        raw = data.get(key)
        if raw is None:
            return
        val = os.environ.decodevalue(raw)  # type: ignore[attr-defined]
        ours = library_path()
        keep = [p for p in val.replace(" ", ":").split(":") if p and not _is_ours(p, ours)]
        if len(keep) == len([p for p in val.replace(" ", ":").split(":") if p]):
            return
        if keep:
            data[key] = os.environ.encodevalue(":".join(keep))  # type: ignore[attr-defined]
        else:
            del data[key]
    except Exception:
        log.debug("distdiag: LD_PRELOAD not cleaned from os.environ", exc_info=True)


def _is_ours(p: str, ours: str | None) -> bool:
    if ours is not None and os.path.abspath(p) == ours:
        return True
    return os.path.basename(p).startswith("_interpose") and os.path.dirname(os.path.abspath(p)) == HERE


# -- the drainer ------------------------------------------------------------------------------
class Drainer:
    """Moves the ring's slots into the recorder's rows, from a thread of its own.

    The thread sleeps in ``dd_wait`` (GIL released) until the ring is half full or a
    flush interval passed. Rows go into a recorder buffer no thread owns
    (``Recorder.shared_buffer``), written under this object's lock. In a forked child
    the thread is started again and a new buffer made (the recorder forgot the parent's).
    """

    def __init__(self, lib: Any, rec: Any, cfg: Any, tag: Any, interval_s: float) -> None:
        from distdiag.schema import Kind
        from distdiag.shim.hooks import fileio

        self.lib = lib
        self.rec = rec
        self.tag = tag  # str path -> (name_id, aux) or ()
        self.interval_ms = max(1, int(interval_s * 1000 / 2))
        self.pid = os.getpid()
        self.lock = threading.Lock()
        self.stop_ev = threading.Event()
        self.thread: threading.Thread | None = None
        self.tb: Any = None
        self.out = bytearray(SLOT_SIZE * DRAIN_BATCH)
        self.paths: dict[bytes, tuple[int, ...]] = {}
        self.tids: dict[int, int] = {}
        self.ovf_out = bytearray(OVF_SIZE * OVF_MAX)
        self.acc: dict[tuple[int, int, int], list[int]] = {}
        #: per recorder tid, its window (start ns, metadata calls in it): see HOT_WINDOW_NS
        self.rate: dict[int, list[int]] = {}
        #: the hot calls of the batch being converted: (kind, dir name_id, tid, op) ->
        #: [first start, summed ns, calls, dir aux]; made rows after each batch (_put_sums)
        self.msum: dict[tuple[int, int, int, int], list[int]] = {}
        self.hot_window_ns = HOT_WINDOW_NS
        self.hot_calls = max(1, int(getattr(cfg, "preload_rows_per_s", 100_000)) * HOT_WINDOW_NS // 1_000_000_000)
        self.big_bytes = fileio.BIG_CALL_BYTES
        self.big_ns = fileio.BIG_CALL_NS
        self.close_min_ns = fileio.CLOSE_MIN_NS
        self.max_paths = fileio.MAX_CACHED_PATHS
        k_open, k_close, k_stat, k_list = int(Kind.FILE_OPEN), int(Kind.FILE_CLOSE), int(Kind.FILE_STAT), int(Kind.FILE_LISTDIR)
        k_read, k_write = int(Kind.FILE_READ), int(Kind.FILE_WRITE)
        #: op -> (kind, mode): mode 0 a row, 1 summed bytes, 2 a row when slow, 3 a row when slow + flush the file's sums
        self.ops: dict[int, tuple[int, int]] = {
            OP["open"]: (k_open, 0), OP["fopen"]: (k_open, 0),
            OP["close"]: (k_close, 3), OP["fclose"]: (k_close, 3), OP["closedir"]: (k_close, 3),
            OP["read"]: (k_read, 1), OP["fread"]: (k_read, 1), OP["mmap"]: (k_read, 0),
            OP["write"]: (k_write, 1), OP["fwrite"]: (k_write, 1), OP["fsync"]: (k_write, 0),
            OP["stat"]: (k_stat, 0), OP["lstat"]: (k_stat, 0), OP["statx"]: (k_stat, 0), OP["fstat"]: (k_stat, 2),
            OP["access"]: (k_stat, 0), OP["mkdir"]: (k_stat, 0), OP["rmdir"]: (k_stat, 0),
            OP["unlink"]: (k_stat, 0), OP["rename"]: (k_stat, 0), OP["lseek"]: (k_stat, 2),
            OP["opendir"]: (k_list, 0), OP["readdir"]: (k_list, 0), OP["getdents64"]: (k_list, 0),
        }  # fmt: skip
        self.op_ids = [rec.intern(f"libc:{n}") if n else 0 for n in OP_NAMES]
        self.open_ops = frozenset({OP["open"], OP["fopen"]})
        #: ``self.ops`` and ``open_ops`` as ``_binding.convert`` reads them: per op its kind, its
        #: mode (255: not recorded) and flags (1: an open, 4: summed when hot, see HOT_WINDOW_NS)
        table = bytearray(3 * len(OP_NAMES))
        for i in range(len(OP_NAMES)):
            kind, mode = self.ops.get(i, (0, 255))
            hot = 4 if kind == k_stat and mode == 0 else 0  # summed above the rate (HOT_WINDOW_NS)
            table[3 * i : 3 * i + 3] = bytes((kind, mode, (1 if i in self.open_ops else 0) | hot))
        self.ops_table = bytes(table)
        #: the rows ``convert`` writes (grown to what a batch can make)
        self.rows = bytearray()
        #: False: the Python loop even where the binding converts (the tests' reference)
        self.use_c = True
        #: (lo, hi): rows that start in [lo, hi) are dropped (the shim's own setup: see start())
        self.drop_ns: tuple[int, int] | None = None

    # -- thread ---------------------------------------------------------------------------
    def start(self) -> None:
        t = threading.Thread(target=self._loop, name="distdiag-preload-drainer", daemon=True)
        self.thread = t
        t.start()

    def _loop(self) -> None:
        try:
            self.rec.mute_thread()
            self.lib.mute(True)
        except Exception:
            pass
        while not self.stop_ev.is_set():
            try:
                self.lib.wait(self.interval_ms)
            except Exception:
                return
            if self.stop_ev.is_set():
                break
            self.drain()

    def after_fork_in_child(self) -> None:
        self.pid = os.getpid()
        self.lock = threading.Lock()
        self.tb = None
        self.tids = {}
        self.acc = {}
        self.rate = {}
        self.msum = {}
        self.stop_ev = threading.Event()
        try:
            self.start()
        except Exception:
            self.thread = None

    def stop(self) -> None:
        self.stop_ev.set()
        try:
            self.lib.kick()
        except Exception:
            pass

    # -- rows -----------------------------------------------------------------------------
    def _buffer(self) -> Any:
        rec = self.rec
        tb = self.tb
        if tb is None or not any(b is tb for b in list(rec.buffers)):
            # first rows here, or the recorder was reset by a fork: a fresh buffer, and the
            # forked child's stream is woken as a thread's first row wakes it
            tb = self.tb = rec.shared_buffer()
            rec.new_buffer_made()
        return tb

    def drain(self, final: bool = False, timeout_s: float = 2.0) -> None:
        """Move every published slot into rows; ``final``: also the partial sums. Never raises."""
        if os.getpid() != self.pid:
            return
        if not self.lock.acquire(timeout=timeout_s):
            return
        try:
            self._drain_locked(final)
        except Exception:
            log.debug("distdiag: preload drain failed", exc_info=True)
        finally:
            self.lock.release()

    def _drain_locked(self, final: bool) -> None:
        from distdiag.shim.hooks.fileio import sum_seq
        from distdiag.shim.recorder import ROW_SIZE, pack_row

        lib, rec, out = self.lib, self.rec, self.out
        tb: Any = None
        #: per thread, its last open, held until its next call (see ``fold``)
        pend: dict[int, list[Any]] = {}

        drop = self.drop_ns

        def put(row: Any, seq: int = -1) -> None:
            nonlocal tb
            if drop is not None and drop[0] <= row[0] < drop[1]:
                return
            if tb is None:
                tb = self._buffer()
            m = tb.n
            if m >= tb.cap:
                m = rec._rotate(tb)
            t0_, t1_, k_, nid, cid, nbytes, aux_, site, tid_, val = row
            pack_row(tb.buf, m * ROW_SIZE, t0_, t1_, k_, nid, cid, seq, -1, nbytes, aux_, site, tid_, val)
            tb.n = m + 1

        # the shim's own threads (flusher, clock, sampler: "distdiag-*", muted in the recorder
        # too, some before the interposer started) are not the program's I/O
        shim = tuple(t.native_id for t in threading.enumerate() if t.name.startswith("distdiag-") and t.native_id is not None)
        convert = getattr(lib, "convert", None) if self.use_c else None
        while True:
            n = lib.drain(out, DRAIN_BATCH)
            if n <= 0:
                break
            if convert is not None:
                # the slots made into rows in C (~0.1 us a slot, against ~1.5 us in the loop below)
                need = (2 * n + len(self.acc) + 1) * ROW_SIZE
                if len(self.rows) < need:
                    self.rows = bytearray(need)
                r = convert(out, n, self.rows, self, pend, shim)
                if r and drop is not None:
                    r = _drop_rows(self.rows, r, drop)
                if r:
                    if tb is None:
                        tb = self._buffer()
                    self._put_bytes(memoryview(self.rows)[: r * ROW_SIZE], r, ROW_SIZE)
            else:
                self._convert_py(out, n, pend, set(shim), put)
            if self.msum:  # the batch's hot metadata calls, one row per (call, directory, thread)
                self._put_sums([(k[2], a[0], a[1], k[0], k[1], a[3], self.op_ids[k[3]], 0, a[2], 0.0)
                                for k, a in self.msum.items()], put)  # fmt: skip
                self.msum.clear()
            if n < DRAIN_BATCH:
                break
        if len(self.rate) > MAX_THREADS:
            self.rate.clear()
        for po in pend.values():  # an open whose fstat comes after this drain: a row of its own
            put(po)
        acc = self.acc
        if final and acc:
            for (kind, name_id, tid), a in list(acc.items()):
                put((a[0], a[0] + a[1], kind, name_id, a[5], a[2], a[4], a[6], tid, float(a[3])), sum_seq(a[3]))
            acc.clear()
        self._take_overflow(set(shim), put)

    def _take_overflow(self, shim: set[int], put: Any) -> None:
        """The calls the full ring summed (interpose.c's ``overflow``) as one row per (call,
        directory, thread) since the last drain: ``name`` the directory + ``"/*"``, ``seq``
        the calls it stands for (:func:`distdiag.rows.calls_of`), ``t1 - t0`` their summed
        duration (as the small reads' sums), placed as below, ``nbytes`` their bytes,
        ``value`` the calls for reads and writes (as their sums), 0 for the others (their
        errno is not kept). Calls of a kind that makes a row only when slow (fstat, lseek,
        close) make one when they took ``close_min_ns`` each on average. A loop over at most
        OVF_MAX records a drain, never over calls."""
        buf = self.ovf_out
        n = int(self.lib.overflow(buf, OVF_MAX))
        if n <= 0:
            return
        now = time.perf_counter_ns()
        recs = []
        for i in range(n):
            at = i * OVF_SIZE
            op, ostid, calls, ns, nbytes, first, dlen, _ = _OVF.unpack_from(buf, at)
            kind, mode = self.ops.get(op, (0, 255))
            if ostid in shim or mode == 255 or calls <= 0 or (mode >= 2 and ns < self.close_min_ns * calls):
                continue
            d = bytes(buf[at + _OVF.size : at + _OVF.size + min(dlen, PATH_CAP - 1)])
            if d:
                tag = self._tag_of(d.rstrip(b"/") + b"/*")
                if not tag:
                    continue  # a path the file hook does not record
            else:  # the overflow table was full: the call's own entry, no directory kept
                tag = (self.rec.intern("*"), 0)
            recs.append((self._tid_of(ostid), first or now - ns, ns, kind, tag[0], tag[1], self.op_ids[op], nbytes,
                         calls, float(calls) if mode == 1 else 0.0))  # fmt: skip
        self._put_sums(recs, put)

    @staticmethod
    def _put_sums(recs: list[tuple[Any, ...]], put: Any) -> None:
        """Rows of summed calls, each ``(tid, first start, summed ns, kind, name_id, aux, comm_id,
        nbytes, calls, value)``, with ``seq`` = calls. One thread's calls ran one after another,
        interleaved over its directories: its sums are laid end to end from the first one's start
        (in the order of their first calls), so the thread's time in them is counted once and
        whole, where each at its own first call would overlap the others."""
        recs.sort()
        cursor: dict[int, int] = {}
        for tid, first, ns, kind, name_id, aux, cid, nbytes, calls, value in recs:
            t0 = max(first, cursor.get(tid, first))
            cursor[tid] = t0 + ns
            put((t0, t0 + ns, kind, name_id, cid, nbytes, aux, 0, tid, value), calls)

    def _tag_of(self, p: bytes) -> tuple[int, ...]:
        """``(name_id, aux)`` of the path bytes ``p`` (``()``: not recorded), cached in ``paths``."""
        tag = self.paths.get(p)
        if tag is None:
            tag = self.tag(os.fsdecode(p))
            if len(self.paths) < self.max_paths:
                self.paths[p] = tag
        return tag  # type: ignore[no-any-return]

    def _tid_of(self, ostid: int) -> int:
        """The recorder thread id given to OS thread ``ostid``."""
        tids = self.tids
        tid = tids.get(ostid)
        if tid is None:
            if len(tids) >= MAX_THREADS:  # a program of many short threads: bounded
                tids.clear()
            tid = tids[ostid] = next(self.rec._tids)
        return tid

    def _convert_py(self, out: Any, n: int, pend: dict[int, list[Any]], shim: set[int], put: Any) -> None:
        """The ``n`` slots in ``out`` made into rows through ``put``: what ``_binding.convert`` does
        in C, kept for a build without it and as the reference the tests compare it with."""
        from distdiag.shim.hooks.fileio import sum_seq

        unpack = _HDR.unpack_from
        paths, ops, acc, op_ids = self.paths, self.ops, self.acc, self.op_ids
        opens = self.open_ops
        big_b, big_ns, close_min = self.big_bytes, self.big_ns, self.close_min_ns
        rate, msum, hot_calls, hot_win = self.rate, self.msum, self.hot_calls, self.hot_window_ns
        hot_ops = frozenset(i for i in range(len(OP_NAMES)) if self.ops_table[3 * i + 2] & 4)
        for i in range(n):
            o = i * SLOT_SIZE
            _, t0, t1, nb, op, err, _fd, ostid, plen, _fl, site, folded = unpack(out, o)
            how = ops.get(op)
            if how is None or ostid in shim:
                continue
            if folded > 0:  # fstat/lseek calls the interposer folded into the thread's open (fold_fd)
                po = pend.get(self._tid_of(ostid))
                if po is not None and folded > po[1]:
                    po[1] = folded
            p = bytes(out[o + 64 : o + 64 + plen])
            tag = paths.get(p)
            if tag is None:
                tag = self._tag_of(p)
            if not tag:
                continue
            tid = self._tid_of(ostid)
            kind, mode = how
            name_id, aux = tag[0], tag[1]
            po = pend.get(tid)
            if po is not None:  # (its fstat/lseek calls: folded by the interposer, fold_t1 above)
                del pend[tid]
                put(po)
            if op in opens:
                pend[tid] = [t0, t1, kind, name_id, op_ids[op], 0, aux, site, tid, float(err)]
                continue
            if mode == 1:
                d = t1 - t0
                if nb >= big_b or d >= big_ns:
                    put((t0, t1, kind, name_id, op_ids[op], nb, aux, site, tid, 1.0))
                    continue
                key = (kind, name_id, tid)
                a = acc.get(key)
                if a is None:
                    acc[key] = [t0, d, nb, 1, aux, op_ids[op], site]
                    continue
                a[1] += d
                a[2] += nb
                a[3] += 1
                if a[2] < big_b and a[1] < big_ns:
                    continue
                del acc[key]
                put((a[0], a[0] + a[1], kind, name_id, a[5], a[2], aux, a[6], tid, float(a[3])), sum_seq(a[3]))
            elif mode == 0:
                if op in hot_ops and t1 - t0 < big_ns:
                    w = rate.get(tid)
                    if w is None:
                        w = rate[tid] = [t0, 0]
                    elif t0 - w[0] >= hot_win:
                        w[0], w[1] = t0, 0
                    w[1] += 1
                    if w[1] > hot_calls:  # above the rate: summed per (call, directory, thread)
                        dtag = self._tag_of(p.rpartition(b"/")[0] + b"/*")
                        if dtag:
                            k = (kind, dtag[0], tid, op)
                            a = msum.get(k)
                            if a is None:
                                msum[k] = [t0, t1 - t0, 1, dtag[1]]
                            else:
                                a[1] += t1 - t0
                                a[2] += 1
                            continue
                put((t0, t1, kind, name_id, op_ids[op], 0, aux, site, tid, float(err)))
            else:
                if mode == 3 and acc:
                    for row in self._take_sums(name_id):
                        put(row, sum_seq(int(row[9])))
                if t1 - t0 >= close_min:
                    put((t0, t1, kind, name_id, op_ids[op], 0, aux, site, tid, float(err)))

    def _put_bytes(self, data: bytes | memoryview, rows: int, row_size: int) -> None:
        """Whole rows, packed as the recorder packs them, into the shared buffer."""
        rec = self.rec
        tb = self._buffer()
        at = 0
        while at < rows:
            m = tb.n
            if m >= tb.cap:
                m = rec._rotate(tb)
            take = min(tb.cap - m, rows - at)
            tb.buf[m * row_size : (m + take) * row_size] = data[at * row_size : (at + take) * row_size]
            tb.n = m + take  # the publish, after the bytes (the flusher reads buf, then n)
            at += take

    def _take_sums(self, name_id: int) -> tuple[tuple[Any, ...], ...]:
        rows = []
        for key in [k for k in self.acc if k[1] == name_id]:
            a = self.acc.pop(key)
            kind, _, tid = key
            rows.append((a[0], a[0] + a[1], kind, name_id, a[5], a[2], a[4], a[6], tid, float(a[3])))
        return tuple(rows)


def _drop_rows(rows: bytearray, n: int, drop: tuple[int, int]) -> int:
    """The first ``n`` event rows of ``rows`` without those whose t0 lies in ``drop``, compacted
    in place; returns how many are left. A loop: only the first drain of an early start."""
    from distdiag.shim.recorder import ROW_SIZE

    t0_of = struct.Struct("<q").unpack_from
    k = 0
    for i in range(n):
        if not drop[0] <= t0_of(rows, i * ROW_SIZE)[0] < drop[1]:
            if k != i:
                rows[k * ROW_SIZE : (k + 1) * ROW_SIZE] = rows[i * ROW_SIZE : (i + 1) * ROW_SIZE]
            k += 1
    return k


DRAINER: Drainer | None = None
_forks_registered = False
#: the shim's start (perf_counter_ns), set by distdiag.shim.wrap before it installs the hooks
SHIM_START_NS: int | None = None



def start(rec: Any, cfg: Any, skip_prefix: str | None, tag: Any) -> Drainer | None:
    """Start the interposer's recording in this process and its drainer; None when the
    interposer is not loaded (or not wanted, or cannot start): the caller falls back."""
    global DRAINER, _forks_registered
    if DRAINER is not None:
        return DRAINER
    lib = loaded()
    if lib is None:
        return None
    slots = int(getattr(cfg, "preload_ring_slots", 16384))
    skip = os.fsencode(os.path.abspath(skip_prefix)) if skip_prefix else None
    try:
        if lib.start(slots, skip) < 0:
            return None
    except Exception:
        return None
    d = Drainer(lib, rec, cfg, tag, float(getattr(cfg, "flush_interval_s", 1.0)))
    rec.on_libc_mute = mute  # the recorder's muted threads and spans (h5py's imports) are libc-muted too
    if SHIM_START_NS is not None:
        # started as the library was loaded (EARLY_VAR): what it recorded before the shim's start is
        # the interpreter's start and imports, kept; from the shim's start to now it is the shim's
        # own setup (its config, run dir, imports), which the Python-level capture does not see
        # either: dropped, in this first drain
        d.drop_ns = (SHIM_START_NS, time.perf_counter_ns())
        d.drain()
        d.drop_ns = None
    d.start()
    DRAINER = d
    if not _forks_registered:
        os.register_at_fork(after_in_child=_after_fork_in_child)
        _forks_registered = True
    return d


def _after_fork_in_child() -> None:
    d = DRAINER
    if d is not None:
        d.after_fork_in_child()


def loaded_ns() -> int | None:
    """``perf_counter_ns`` when the interposer was loaded into this process (its start: before
    the interpreter's first instruction), or None without it."""
    lib = loaded()
    try:
        t = lib.loaded_ns() if lib is not None else None
    except Exception:
        return None
    return int(t) if t else None


def drain_now(final: bool = True) -> None:
    """Everything the interposer recorded so far into rows (the shim calls this before it
    writes its last rows). A no-op without the interposer. Never raises."""
    d = DRAINER
    if d is not None:
        d.drain(final=final)


def mute(on: bool) -> None:
    """The calling thread's libc calls are (not) recorded: the shim's own threads."""
    lib = _lib
    if lib is not None:
        try:
            lib.mute(bool(on))
        except Exception:
            pass


def stop() -> None:
    """Stop recording (the file hook's uninstall); the ring's last slots are drained."""
    global DRAINER
    d = DRAINER
    if d is None:
        return
    try:
        d.lib.stop()
    except Exception:
        pass
    d.stop()
    d.drain(final=True)
    if getattr(d.rec, "on_libc_mute", None) is mute:
        d.rec.on_libc_mute = None
    DRAINER = None
