"""File I/O hook: every open, stat, listdir of the program, with its duration.

What is wrapped (each original kept and restored exactly by ``uninstall``):

* ``builtins.open`` / ``io.open`` (also ``pathlib.Path.open``, ``numpy.load``,
  ``np.memmap``, which call them)                             -> FILE_OPEN
* ``io.open_code`` (``_io.open_code``: what the import system reads ``.py`` /
  ``.pyc`` with)                                               -> FILE_OPEN
* ``os.open``, and ``os.close`` of the descriptors ``os.open`` returned -> FILE_OPEN / FILE_CLOSE
* ``os.fsync`` / ``os.fdatasync`` of a recorded file (a FILE_WRITE row with
  no bytes: the time to make the writes durable)               -> FILE_WRITE
* ``os.stat`` / ``os.lstat`` (``os.path.exists/isfile/isdir/getsize/...`` and
  ``pathlib.Path.stat/exists`` call these at call time)        -> FILE_STAT
* ``posix.stat`` / ``posix.lstat`` / ``posix.listdir``: the import system's
  private bindings (``importlib._bootstrap_external._os`` is ``posix``), so an
  import storm shows up as the metadata storm it is              -> FILE_STAT / FILE_LISTDIR
* ``os.listdir`` / ``os.scandir`` (scandir: the opendir call only; the reads
  happen while the caller iterates and stay unwrapped, so the iterator
  keeps its exact type)                                          -> FILE_LISTDIR
* ``h5py.File`` open and close, ``numpy.load`` / ``numpy.save`` of a path
  (their data moves through C, not through Python file objects)   -> FILE_OPEN / FILE_CLOSE / FILE_READ / FILE_WRITE

Rows: ``name_id`` = the absolute path (lexical, not resolved: resolving would
add metadata calls), ``aux`` = string id of ``"fstype:mountpoint"``
(``distdiag.shim.mounts``), ``site_id`` = the first call site outside the
standard library and distdiag (for ``os.path.exists`` the user's line, for an
import the ``import`` statement), ``value`` = errno of a call that failed (a
failed stat is a metadata operation too: most of an import storm is misses),
0 otherwise. ``seq`` is -1, or on a row that sums several reads or writes the calls it
stands for (:func:`distdiag.rows.calls_of`); ``peer``/``comm_id`` are unused.

Bytes and close. A pure-Python proxy around the file object would change its
type and cost on every call; attributes set on the C file object cannot be
made safe either (a bound ``write`` holding the file makes a reference cycle
that delays the close of ``open(p, "wb").write(b)`` to the next GC; a weakly
bound one lets ``open(p, "rb").read()`` free the file before the call). So
for binary files with default buffering (``open(p, "rb")``, ``"wb"``, ``"ab"``,
``"r+b"``, ...: checkpoints, shards, pickles) the wrapper builds what io.open
builds, the same C ``BufferedReader/Writer/Random`` with the same buffer size,
over :class:`FileIO`, a subclass of ``io.FileIO`` that books bytes at the raw
layer: one booking per buffer fill or large call (a real system call, and
every call of at least the buffer size goes there), never per small
``f.read(4)``. Its ``close`` records FILE_CLOSE when the close took
at least ``CLOSE_MIN_NS`` (a flush to a remote server, a busy server). The
object the program holds has the exact type, mode, name, fd and behaviour; only
``type(f.raw)`` differs. A raw call that moves >= ``BIG_CALL_BYTES`` or blocks
>= ``BIG_CALL_NS`` is its own FILE_READ/FILE_WRITE row (exact start and
duration); smaller calls are summed per file into one row (``t0`` = first
call, duration = time inside the calls) emitted when the sum passes those
limits or at close. ``value`` of a FILE_READ/FILE_WRITE row is the number of
calls it sums. Text files, unbuffered or custom-buffered binary files and
``open_code`` keep the original object (their opens are recorded, not their
bytes): config and log files are small, and text writes are hot loops.

Skipped: paths under the run directory (the shim's own files), pseudo file
systems (``PSEUDO_FSTYPES``: /proc, /sys, /dev/null...; no storage behind
them), and ``stat`` of a file descriptor (``fstat`` is answered by the
client, not the metadata server).

Not seen (by these Python-level wrappers; the libc interposer, ``distdiag.shim.preload``,
sees them, and when it is loaded these wrappers stay out): C code that opens files
itself (``torch.save`` to a path, HDF5's data reads, ``np.fromfile``, ``DirEntry.is_dir()``
of ``os.walk``); file calls made before the hook is installed;
and a rank hung *inside* an open or stat leaves no in-flight row (the
recorder's enter/leave does not nest, and an enclosing data-loader wait
already holds that slot).
"""

from __future__ import annotations

import builtins
import errno as _errno
import functools
import io
import logging
import os
import posix
import sys
import sysconfig
import threading
import time
from types import FunctionType
from typing import Any, Callable

import _io

from distdiag.schema import Kind
from distdiag.shim import mounts
from distdiag.shim.recorder import HOT as _HOT
from distdiag.shim.recorder import ROW_SIZE as _ROW_SIZE
from distdiag.shim.recorder import pack_row as _pack
from distdiag.shim.warnsite import call_as_caller as _as_caller

log = logging.getLogger(__name__)

#: a read/write call at least this large or slow is a row of its own
BIG_CALL_BYTES = 1 << 20
BIG_CALL_NS = 1_000_000
#: a close of a counted file is a row only when it took this long (a close that
#: flushes to a remote server, or waits on a busy one); a 2 us local close is not
#: worth its 0.5 us row
CLOSE_MIN_NS = 20_000
#: path-cache bound: past it, paths are tagged on every call (correct, slower)
MAX_CACHED_PATHS = 1 << 17
#: file systems with no storage behind them: never recorded (/dev/null, /proc/self/...,
#: /sys/...); /dev/shm is tmpfs, real memory-backed files, and is recorded
PSEUDO_FSTYPES = frozenset(
    {
        "proc", "sysfs", "devtmpfs", "devpts", "cgroup", "cgroup2", "securityfs", "debugfs", "tracefs",
        "pstore", "bpf", "mqueue", "configfs", "fusectl", "binfmt_misc", "autofs", "efivarfs", "nsfs",
    }
)  # fmt: skip

_FILE_OPEN = int(Kind.FILE_OPEN)
_FILE_CLOSE = int(Kind.FILE_CLOSE)
_FILE_STAT = int(Kind.FILE_STAT)
_FILE_LISTDIR = int(Kind.FILE_LISTDIR)
_FILE_READ = int(Kind.FILE_READ)
_FILE_WRITE = int(Kind.FILE_WRITE)

# -- state (module globals: the hot path reads them without attribute lookups) --
_rec: Any = None
_add: Callable[..., None] | None = None
#: the recorder's per-thread buffers (``rec._local``): the inline row writes read ``_tls.tb``
_tls: Any = None
_intern: Callable[[str], int] | None = None
_now: Callable[[], int] = time.perf_counter_ns  # the recorder's event clock
_count_bytes = True
#: path as the program passed it (str) -> (name_id, aux) or () when skipped
_paths: dict[str, tuple[int, ...]] = {}
#: absolute-path prefixes never recorded (the run dir; see skip_dir)
_skip: tuple[str, ...] = ()
#: fds from os.open -> (name_id, aux, site_id)
_fds: dict[int, tuple[int, int, int]] = {}
#: fds of counted binary files (FileIO below) -> (name_id, aux, site_id), for fsync
_data_fds: dict[int, tuple[int, int, int]] = {}
#: (owner object, attribute name) -> original, for uninstall
_orig: dict[tuple[Any, str], Any] = {}
_h5_cb: Callable[[Any], None] | None = None
_np_cb: Callable[[Any], None] | None = None
_lock = threading.Lock()

# call sites: the first frame outside these is the program's
_LIB_PREFIXES = tuple(
    sorted(
        {
            sysconfig.get_paths()["stdlib"] + os.sep,
            sysconfig.get_paths()["platstdlib"] + os.sep,
            os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep,
            "<frozen ",
        }
    )
)
#: id(code) -> 0: the program's / 1: a library's / 2: a library module's body
_libkind: dict[int, int] = {}
#: the code objects _libkind has seen, kept alive so that their ids are never reused
_libcode: list[Any] = []
_sites: dict[tuple[int, int], int] = {}  # (id(code), f_lasti) -> string id of "file:line"
#: id(frame of a library module body still running) -> (its code, site id): see _site
_modsites: dict[int, tuple[Any, int]] = {}
MAX_MODSITES = 1 << 16
_getframe = sys._getframe
#: ``-X warn_default_encoding``: ``open(p)`` without an encoding warns (fixed at startup)
_warn_encoding = bool(getattr(sys.flags, "warn_default_encoding", 0))


# -- helpers -----------------------------------------------------------------------
def _classify(c: Any) -> int:
    lib = (2 if c.co_name == "<module>" else 1) if c.co_filename.startswith(_LIB_PREFIXES) else 0
    # no lock (a hook must never wait on one): two threads racing here append
    # the same code twice, which only keeps it alive twice
    _libcode.append(c)
    _libkind[id(c)] = lib
    return lib


def _site() -> int:
    """String id of the first ``file:line`` outside the stdlib and distdiag."""
    return _site_from(_getframe(2), None)


def _site_from(f: Any, sites: dict[int, tuple[Any, int, Any, int]] | None) -> int:
    """:func:`_site`, starting the walk at frame ``f``.

    ``sites``: a wrapper's own cache, by its caller's ``f_lasti``: ``(code,
    site id, None, 0)`` when the caller is the program's own frame, ``(code,
    site id, caller's caller's code, its f_lasti)`` when the caller is one
    library function called by the program (``os.path.exists``). The wrapper
    checks the code objects (and that f_lasti) before it trusts an entry, so
    a program that stats in a loop finds its line with one int-keyed lookup
    and no walk.
    """
    # Keyed by id(code): hashing a code object hashes its bytecode and
    # constants; _libcode holds each code object, so its id is never reused.
    # (The walk's loop is the hot part: ~12 frames an event in torch's lazy
    # imports; the plain library frame goes first with one int per code.)
    #
    # Why _modsites: during ``import torch`` every stat/open is ~60 frames
    # below the program's ``import`` line (six importlib frames per nesting
    # level, torch's own modules counting as library), and walking them all
    # cost ~9 us an event, 17k events. A module body runs once, and while its
    # frame lives every frame below it is blocked at the same instruction, so
    # the answer for anything called from inside it is fixed: cache it by the
    # frame's id (unique among live objects), checked against its code. The
    # walk then stops at the innermost module being imported (~6 frames).
    # (A code object exec'd twice, its second frame at the first one's
    # freed address, could reuse a stale answer: a rare mislabel, never an error.)
    try:
        first = f
        mods: list[Any] | None = None
        while True:
            c = f.f_code
            lib = _libkind.get(id(c))
            if lib is None:
                lib = _classify(c)
            if lib == 1:  # the common case first: a library function's frame
                b = f.f_back
                if b is None:
                    break
                f = b
                continue
            if not lib:
                break
            hit = _modsites.get(id(f))  # a library module's body
            if hit is not None and hit[0] is c:
                if mods is not None:
                    for m in mods:
                        _modsites[id(m)] = (m.f_code, hit[1])
                return hit[1]
            if mods is None:
                mods = [f]
            else:
                mods.append(f)
            b = f.f_back
            if b is None:
                break
            f = b
        # f_lasti (the bytecode offset) is a plain int; f_lineno is computed by
        # scanning the line table: look the line up once per call instruction
        key = (id(c), f.f_lasti)
        i = _sites.get(key)
        if i is None:
            i = _sites[key] = _intern(f"{c.co_filename}:{f.f_lineno}")  # type: ignore[misc]
        if mods is not None:
            if len(_modsites) > MAX_MODSITES:
                _modsites.clear()
            for m in mods:
                _modsites[id(m)] = (m.f_code, i)
        elif sites is not None:
            if f is first:  # the program called the wrapper itself
                sites[f.f_lasti] = (c, i, None, 0)
            elif first.f_back is f:  # through one library function: os.path.exists, Path.stat
                sites[first.f_lasti] = (first.f_code, i, c, f.f_lasti)
        return i
    except Exception:
        return 0


def _cached_site(f: Any, sites: dict[int, tuple[Any, int, Any, int]]) -> int:
    """:func:`_site_from` for a wrapper called from frame ``f``, through the wrapper's own cache
    ``sites`` (see there): one int-keyed lookup when the caller is the program's frame, or one
    library function called from the same program line as before."""
    s = sites.get(f.f_lasti)
    if s is not None and s[0] is f.f_code:
        if s[2] is None:
            return s[1]  # type: ignore[no-any-return]
        b = f.f_back
        if b is not None and b.f_code is s[2] and b.f_lasti == s[3]:
            return s[1]  # type: ignore[no-any-return]
    return _site_from(f, sites)


#: directory (absolute, lexical) -> aux string id of its "fstype:mountpoint", -1 for a
#: pseudo file system; valid for the mount table whose per-directory cache is _dirs_of
_dirs: dict[str, int] = {}
_dirs_of: Any = None


def _dir_aux(ap: str) -> int:
    """``aux`` of absolute path ``ap`` (-1: never recorded); one mount lookup per directory."""
    global _dirs_of
    t = mounts.table()
    if t._by_dir is not _dirs_of:  # the table was re-read (refresh): start over
        _dirs.clear()
        _dirs_of = t._by_dir
    if ap in t._points:  # a mount point belongs to the file system mounted there
        fstype, mnt = t.lookup_dir(ap)
        return -1 if fstype in PSEUDO_FSTYPES else _intern(f"{fstype}:{mnt}")  # type: ignore[misc]
    d = ap.rpartition("/")[0] or "/"
    aux = _dirs.get(d)
    if aux is None:
        fstype, mnt = t.lookup_dir(d)
        aux = _dirs[d] = -1 if fstype in PSEUDO_FSTYPES else _intern(f"{fstype}:{mnt}")  # type: ignore[misc]
    return aux


def _tag(path: Any) -> tuple[int, ...]:
    """``(name_id, aux)`` of a path argument, or ``()`` when it is not recorded."""
    try:
        if isinstance(path, int) or path is None:
            return ()
        p = os.fspath(path)
        if isinstance(p, bytes):
            p = os.fsdecode(p)
        hit = _paths.get(p)
        if hit is not None:
            return hit
        # lexical abspath (getcwd only, no metadata call); most paths the import
        # system and programs pass are already absolute and normal: skip the
        # normpath (~0.9 us) for those
        if p[:1] == "/" and p[-1:] != "/" and "/." not in p and "//" not in p:
            ap = p
        else:
            ap = os.path.abspath(p)
        aux = _dir_aux(ap)
        if aux < 0 or (_skip and ap.startswith(_skip)):
            res: tuple[int, ...] = ()
        else:
            res = (_intern(ap), aux)  # type: ignore[misc]
        if len(_paths) < MAX_CACHED_PATHS:
            _paths[p] = res
        return res
    except Exception:
        return ()


def _errno_of(e: BaseException) -> float:
    return float(getattr(e, "errno", None) or _errno.EIO) if isinstance(e, OSError) else float(_errno.EINVAL)


def _record(kind: int, path: Any, t0: int, t1: int, err: float = 0.0) -> None:
    try:
        tag = _paths.get(path) if path.__class__ is str else None
        if tag is None:
            tag = _tag(path)
        if tag:
            _add(t0, t1, kind, tag[0], 0, -1, -1, 0, tag[1], _site(), err)  # type: ignore[misc]
    except Exception:
        pass


# -- byte counting on binary file objects ------------------------------------------
def sum_seq(calls: int) -> int:
    """``seq`` of a row that sums ``calls`` reads or writes (``value`` holds them too): the calls
    it stands for (:func:`distdiag.rows.calls_of`), -1 for one call, as every single call's row.
    The libc interposer's drainer (distdiag.shim.preload, and ``_binding.c``) writes its sums so."""
    return calls if calls > 1 else -1


class _Acc:
    """Sums of the small read/write calls on one binary file object.

    No __slots__ on purpose: the counters start as class attributes (0) and
    become instance attributes on first use, so opening a file costs three
    attribute stores, not eleven.
    """

    r_n = r_ns = r_t0 = r_calls = 0
    w_n = w_ns = w_t0 = w_calls = 0

    def __init__(self, name_id: int, aux: int, site: int) -> None:
        self.name_id = name_id
        self.aux = aux
        self.site = site

    def emit(self) -> None:
        add = _add
        if add is None:
            return
        try:
            if self.r_calls:
                rc = self.r_calls
                add(self.r_t0, self.r_t0 + self.r_ns, _FILE_READ, self.name_id, 0, sum_seq(rc), -1, self.r_n, self.aux, self.site, float(rc))
                self.r_n = self.r_ns = self.r_calls = 0
            if self.w_calls:
                wc = self.w_calls
                add(self.w_t0, self.w_t0 + self.w_ns, _FILE_WRITE, self.name_id, 0, sum_seq(wc), -1, self.w_n, self.aux, self.site, float(wc))
                self.w_n = self.w_ns = self.w_calls = 0
        except Exception:
            pass


def _count(acc: _Acc, write: bool, n: int, t0: int, t1: int) -> None:
    """Book one read/write call: big ones are rows, small ones are summed."""
    try:
        dt = t1 - t0
        if n >= BIG_CALL_BYTES or dt >= BIG_CALL_NS:
            _add(t0, t1, _FILE_WRITE if write else _FILE_READ, acc.name_id, 0, -1, -1, n, acc.aux, acc.site, 1.0)  # type: ignore[misc]
            return
        if write:
            if not acc.w_calls:
                acc.w_t0 = t0
            acc.w_n += n
            acc.w_ns += dt
            acc.w_calls += 1
            if acc.w_n >= BIG_CALL_BYTES or acc.w_ns >= BIG_CALL_NS:
                acc.emit()
        else:
            if not acc.r_calls:
                acc.r_t0 = t0
            acc.r_n += n
            acc.r_ns += dt
            acc.r_calls += 1
            if acc.r_n >= BIG_CALL_BYTES or acc.r_ns >= BIG_CALL_NS:
                acc.emit()
    except Exception:
        pass


class FileIO(io.FileIO):
    """The raw layer of a counted binary file: ``io.FileIO`` that books its bytes.

    The buffered object the program holds (``BufferedReader`` / ``BufferedWriter``
    / ``BufferedRandom``) is the real C type; only its ``.raw`` is this
    subclass. The buffered layer calls ``raw.readinto`` / ``raw.readall`` /
    ``raw.write`` once per buffer fill or large call (>= 8 KiB each, real
    system calls), so booking there costs a few hundred ns per syscall, never
    per small ``f.read(4)``. Closing goes through ``close`` here whether the
    program closes, leaves a ``with`` block, or drops the object.
    """

    # the accumulator, set right after construction: no __init__ override, so
    # the C constructor runs exactly as io.open runs it
    _dd: _Acc

    def readinto(self, buffer: Any) -> Any:
        t0 = _now()
        n = _FIO_readinto(self, buffer)
        if n:
            _count(self._dd, False, n, t0, _now())
        return n

    def readall(self) -> Any:
        t0 = _now()
        b = _FIO_readall(self)
        if b:
            _count(self._dd, False, len(b), t0, _now())
        return b

    def read(self, size: int | None = -1) -> Any:
        t0 = _now()
        b = _FIO_read(self, size)
        if b:
            _count(self._dd, False, len(b), t0, _now())
        return b

    def write(self, b: Any) -> Any:
        t0 = _now()
        n = _FIO_write(self, b)
        if n:
            _count(self._dd, True, n, t0, _now())
        return n

    def close(self) -> None:
        if self.closed:
            return _FIO_close(self)  # type: ignore[no-any-return]
        t0 = _now()
        try:
            _data_fds.pop(_FIO_fileno(self), None)
        except Exception:
            pass
        try:
            _FIO_close(self)
        finally:
            try:
                t1 = _now()
                acc = self._dd
                if acc.r_calls or acc.w_calls:
                    acc.emit()
                if t1 - t0 >= CLOSE_MIN_NS:
                    _add(t0, t1, _FILE_CLOSE, acc.name_id, 0, -1, -1, 0, acc.aux, acc.site, 0.0)  # type: ignore[misc]
            except Exception:
                pass


FileIO.__module__ = "_io"  # repr(f.raw) reads like the original's
_FIO_readinto = io.FileIO.readinto
_FIO_readall = io.FileIO.readall
_FIO_read = io.FileIO.read
_FIO_write = io.FileIO.write
_FIO_close = io.FileIO.close
_FIO_fileno = io.FileIO.fileno

#: binary modes whose io.open we rebuild with the counting raw layer; any other
#: mode (and every invalid one) goes to the original io.open, errors included
_BIN_MODES: dict[str, tuple[str, type]] = {}
for _m, _raw, _cls in (
    ("rb", "r", io.BufferedReader),
    ("br", "r", io.BufferedReader),
    ("wb", "w", io.BufferedWriter),
    ("bw", "w", io.BufferedWriter),
    ("ab", "a", io.BufferedWriter),
    ("xb", "x", io.BufferedWriter),
    ("rb+", "r+", io.BufferedRandom),
    ("r+b", "r+", io.BufferedRandom),
    ("wb+", "w+", io.BufferedRandom),
    ("w+b", "w+", io.BufferedRandom),
    ("ab+", "a+", io.BufferedRandom),
    ("a+b", "a+", io.BufferedRandom),
    ("xb+", "x+", io.BufferedRandom),
    ("x+b", "x+", io.BufferedRandom),
):
    _BIN_MODES[_m] = (_raw, _cls)


def _open_counted(file: Any, rawmode: str, cls: type, tag: tuple[int, ...], site: int) -> Any:
    """What ``io.open(file, binary_mode)`` does (Modules/_io/_iomodule.c), with our raw layer.

    Default buffering only: the buffer size is the raw file's ``_blksize``,
    as io.open picks it for binary files (the tty check there only matters
    for text files' line buffering).
    """
    raw = FileIO(os.fspath(file), rawmode)  # io.open hands FileIO the fspath, so f.name is a str
    raw._dd = _Acc(tag[0], tag[1], site)
    _data_fds[_FIO_fileno(raw)] = (tag[0], tag[1], site)
    try:
        size = int(getattr(raw, "_blksize", io.DEFAULT_BUFFER_SIZE))
        if size <= 1:
            size = io.DEFAULT_BUFFER_SIZE
        return cls(raw, size)
    except BaseException:
        raw.close()
        raise


# -- warnings of the wrapped calls ---------------------------------------------------
# A warning raised inside the original is attributed to the frame that called it: were
# that the wrapper's, ``-W ...:__main__`` filters and "once per location" would see this
# file. Where one is possible the original is called as from the program's frame
# (distdiag.shim.warnsite); the tests compare each case with the unwrapped run.
def _open_may_warn(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """io.open warns from C: ``buffering=1`` with a binary mode (RuntimeWarning); no
    encoding for a text mode under ``-X warn_default_encoding`` (EncodingWarning)."""
    n = len(args)
    mode = args[0] if n else kwargs.get("mode", "r")
    binary = mode.__class__ is not str or "b" in mode
    if n > 1 or "buffering" in kwargs:
        b = args[1] if n > 1 else kwargs["buffering"]
        if b.__class__ is not int or (b == 1 and binary):  # an __index__ object may be 1
            return True
    if _warn_encoding and not binary and (args[2] if n > 2 else kwargs.get("encoding")) is None:
        return True
    return False


def _path_may_warn(path: Any) -> bool:
    """The os functions warn (DeprecationWarning, from C) of a path that is a bytes-like
    object other than bytes (``bytearray``, ``memoryview``)."""
    c = path.__class__
    return not (c is str or c is bytes or c is int or path is None or hasattr(c, "__fspath__"))


# -- the wrappers --------------------------------------------------------------------
def _wrap_open(orig: Callable[..., Any], count: bool) -> Callable[..., Any]:
    @functools.wraps(orig)
    def open(file: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: A001 - it is open
        t0 = _now()
        # binary files with default buffering: counted (see FileIO above)
        if count and _count_bytes and ((len(args) == 1 and not kwargs) or (not args and len(kwargs) == 1 and "mode" in kwargs)):
            m = args[0] if args else kwargs["mode"]
            rm = _BIN_MODES.get(m) if m.__class__ is str else None
            if rm is not None and (file.__class__ is str or isinstance(file, os.PathLike)):
                tag = _paths.get(file) if file.__class__ is str else None
                if tag is None:
                    tag = _tag(file)
                if tag:
                    site = _site()
                    try:
                        f = _open_counted(file, rm[0], rm[1], tag, site)
                    except BaseException as e:
                        _add_safe(t0, _now(), _FILE_OPEN, (tag[0], tag[1], site), _errno_of(e))
                        raise
                    _add_safe(t0, _now(), _FILE_OPEN, (tag[0], tag[1], site), 0.0)
                    return f
        try:
            if count and (kwargs or len(args) > 1 or _warn_encoding) and _open_may_warn(args, kwargs):
                f = _as_caller(_getframe(1), orig, (file, *args), kwargs)
            else:
                f = orig(file, *args, **kwargs)
        except BaseException as e:
            _record(_FILE_OPEN, file, t0, _now(), _errno_of(e))
            raise
        _record(_FILE_OPEN, file, t0, _now())
        return f

    return open


def _wrap_path_call(orig: Callable[..., Any], kind: int) -> Callable[..., Any]:
    """stat / lstat: ``orig(path, *, dir_fd=None, follow_symlinks=True)``."""
    sites: dict[int, tuple[Any, int, Any, int]] = {}  # the caller's f_lasti -> see _site_from

    @functools.wraps(orig)
    def wrapper(path: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = _now()
        try:
            # a plain call when it can be: orig(path, *args, **kwargs) builds a list, a tuple and a dict
            if args or kwargs or path.__class__ is not str:
                if _path_may_warn(path):
                    res = _as_caller(_getframe(1), orig, (path, *args), kwargs)
                else:
                    res = orig(path, *args, **kwargs)
            else:
                res = orig(path)
        except BaseException as e:
            if path.__class__ is not int and kwargs.get("dir_fd") is None:
                _record(kind, path, t0, _now(), _errno_of(e))
            raise
        t1 = _now()
        # The common case inline (a str path seen before): import storms are
        # millions of these. The row is written with the Recorder's inline
        # protocol (distdiag.shim.recorder), not through rec.add: a method
        # call with 11 arguments was ~1/4 of the hook's cost.
        if path.__class__ is str and not kwargs:
            tag = _paths.get(path)
            if tag is not None:
                if tag:
                    try:
                        site = _cached_site(_getframe(1), sites)
                        try:
                            tb = _tls.tb
                        except AttributeError:
                            tb = _rec._tb()
                        n = tb.n
                        if n >= tb.cap:
                            n = _rec._rotate(tb)
                        _pack(tb.buf, n * _ROW_SIZE, t0, t1, kind, tag[0], 0, -1, -1, 0, tag[1], site, tb.tid, 0.0)
                        tb.n = n + 1
                    except Exception:
                        pass
                return res
        if path.__class__ is not int and kwargs.get("dir_fd") is None:
            _record(kind, path, t0, t1)
        return res

    return wrapper


def _wrap_dir_call(orig: Callable[..., Any]) -> Callable[..., Any]:
    """listdir / scandir: ``orig(path='.')``; a path of None also means '.'."""

    @functools.wraps(orig)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = _now()
        try:
            if args and args[0].__class__ is not str and _path_may_warn(args[0]):
                res = _as_caller(_getframe(1), orig, args, kwargs)
            else:
                res = orig(*args, **kwargs)
        except BaseException as e:
            path = args[0] if args else kwargs.get("path")
            _record(_FILE_LISTDIR, "." if path is None else path, t0, _now(), _errno_of(e))
            raise
        t1 = _now()
        path = args[0] if args else kwargs.get("path")
        _record(_FILE_LISTDIR, "." if path is None else path, t0, t1)
        return res

    return wrapper


def _wrap_os_open(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def wrapper(path: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = _now()
        try:
            if path.__class__ is not str and _path_may_warn(path):
                fd = _as_caller(_getframe(1), orig, (path, *args), kwargs)
            else:
                fd = orig(path, *args, **kwargs)
        except BaseException as e:
            _record(_FILE_OPEN, path, t0, _now(), _errno_of(e))
            raise
        t1 = _now()
        try:
            if kwargs.get("dir_fd") is None and not (len(args) >= 3 and args[2] is not None):
                tag = _paths.get(path) if path.__class__ is str else None
                if tag is None:
                    tag = _tag(path)
                if tag:
                    site = _site()
                    _add(t0, t1, _FILE_OPEN, tag[0], 0, -1, -1, 0, tag[1], site, 0.0)  # type: ignore[misc]
                    _fds[fd] = (tag[0], tag[1], site)
        except Exception:
            pass
        return fd

    return wrapper


def _wrap_os_close(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def wrapper(fd: Any, *args: Any, **kwargs: Any) -> Any:
        info = _fds.pop(fd, None) if fd.__class__ is int else None
        if info is None:
            return orig(fd, *args, **kwargs)
        t0 = _now()
        try:
            res = orig(fd, *args, **kwargs)
        except BaseException as e:
            _add_safe(t0, _now(), _FILE_CLOSE, info, _errno_of(e))
            raise
        _add_safe(t0, _now(), _FILE_CLOSE, info, 0.0)
        return res

    return wrapper


def _wrap_sync(orig: Callable[..., Any]) -> Callable[..., Any]:
    """fsync / fdatasync of a recorded file: the time to make its writes durable
    (a FILE_WRITE row with no bytes; part of a checkpoint's cost)."""

    @functools.wraps(orig)
    def wrapper(fd: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = _now()
        res = orig(fd, *args, **kwargs)
        try:
            k = fd if fd.__class__ is int else fd.fileno()
            info = _data_fds.get(k) or _fds.get(k)
            if info is not None:
                _add(t0, _now(), _FILE_WRITE, info[0], 0, -1, -1, 0, info[1], info[2], 1.0)  # type: ignore[misc]
        except Exception:
            pass
        return res

    return wrapper


def _wrap_site(orig: Callable[..., Any], is_open: bool) -> Callable[..., Any]:
    """With the libc interposer recording: ``orig`` as it is, after naming its call site to the
    interposer (``_binding.site``): the libc call on that path made next by this thread, and the
    calls on the descriptor it opens, carry it. The first argument is the path (open's file);
    a path given by keyword, a descriptor or another object's ``__fspath__`` gets no site (it is
    not called twice). The caller's site cached as :func:`_wrap_path_call` caches it.

    Where distdiag/shim/_hot.c is built, the common calls (a str or bytes path; for open no
    keyword and no buffering argument) take its ``SiteCall`` instead, which does the same in C
    with the same cache and hands every other call to this Python wrapper (~0.5 us less an open)."""
    sites: dict[int, tuple[Any, int, Any, int]] = {}  # the caller's f_lasti -> see _site_from

    @functools.wraps(orig)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if args and _rec is not None:
            path = args[0]
            c = path.__class__
            if c is not str and c is not bytes:
                pl = sys.modules.get("pathlib")
                path = str(path) if pl is not None and isinstance(path, pl.PurePath) else None
            if path is not None:
                try:
                    _site_put(_cached_site(_getframe(1), sites), path)  # type: ignore[misc]
                except Exception:
                    pass
        if is_open:
            if (kwargs or len(args) > 2 or _warn_encoding) and _open_may_warn(args[1:], kwargs):
                return _as_caller(_getframe(1), orig, args, kwargs)
        elif args and args[0].__class__ is not str and _path_may_warn(args[0]):
            return _as_caller(_getframe(1), orig, args, kwargs)
        return orig(*args, **kwargs)

    if _HOT is None or _site_put is None:
        return wrapper
    fast = _HOT.SiteCall(orig, wrapper, sites, _site_from, _site_put, is_open, _warn_encoding)
    return functools.update_wrapper(fast, orig)  # type: ignore[no-any-return]


_site_put: Callable[[int, Any], None] | None = None


def _install_site_wrappers() -> None:
    """The libc interposer records the file calls; these wrappers only name their call sites
    (:func:`_wrap_site`): the calls that name a path, not the hot ones (stat, reads)."""
    global _site_put
    try:
        from distdiag.shim.preload import _binding  # type: ignore[attr-defined]

        _site_put = _binding.site
    except (ImportError, AttributeError):
        return
    if _HOT is not None:
        _HOT.file_sites(True)
    opened = _wrap_site(io.open, True)
    _patch(builtins, "open", opened)
    _patch(io, "open", opened)
    open_code = _wrap_site(_io.open_code, False)
    _patch(_io, "open_code", open_code)
    _patch(io, "open_code", open_code)
    for name in ("open", "listdir", "scandir", "mkdir", "remove", "unlink", "rmdir", "rename", "replace"):
        if hasattr(os, name):
            _patch(os, name, _wrap_site(getattr(os, name), False))
    _patch(posix, "listdir", _wrap_site(posix.listdir, False))  # the import system's own


def _add_safe(t0: int, t1: int, kind: int, info: tuple[int, int, int], err: float, nbytes: int = 0) -> None:
    try:
        _add(t0, t1, kind, info[0], 0, -1, -1, nbytes, info[1], info[2], err)  # type: ignore[misc]
    except Exception:
        pass


def _wrap_chdir(orig: Callable[..., Any]) -> Callable[..., Any]:
    """Relative paths are cached as given; a new cwd gives them new meanings."""

    @functools.wraps(orig)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return orig(*args, **kwargs)
        finally:
            _paths.clear()

    return wrapper


# -- h5py and numpy (hooked when the program imports them) ----------------------------
def _hook_h5py(h5py: Any) -> None:
    if _add is None:
        return
    File = h5py.File
    orig_init = File.__init__
    orig_close = File.close

    @functools.wraps(orig_init)
    def __init__(self: Any, name: Any, *args: Any, **kwargs: Any) -> None:
        # h5py warns with stacklevel=2 (swmr=True with a write mode): as from the caller's
        # frame (an h5py open costs far more than the trampoline)
        caller = _getframe(1)
        if not isinstance(name, (str, bytes, os.PathLike)):  # FileID or a Python file object
            _as_caller(caller, orig_init, (self, name, *args), kwargs)
            return
        t0 = _now()
        try:
            _as_caller(caller, orig_init, (self, name, *args), kwargs)
        except BaseException as e:
            _record(_FILE_OPEN, name, t0, _now(), _errno_of(e))
            raise
        _record(_FILE_OPEN, name, t0, _now())

    @functools.wraps(orig_close)
    def close(self: Any) -> None:
        try:
            name = self.filename if self.id.valid else None
        except Exception:
            name = None
        if name is None:
            orig_close(self)
            return
        t0 = _now()
        orig_close(self)
        _record(_FILE_CLOSE, name, t0, _now())

    _patch(File, "__init__", __init__)
    _patch(File, "close", close)


def _hook_numpy(np: Any) -> None:
    if _add is None:
        return
    orig_load = np.load
    orig_save = np.save

    @functools.wraps(orig_load)
    def load(file: Any, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(file, (str, bytes, os.PathLike)):
            return orig_load(file, *args, **kwargs)
        t0 = _now()
        res = orig_load(file, *args, **kwargs)  # the open inside is recorded by open()
        t1 = _now()
        try:
            # an eager array was read in full; a memmap or an .npz reads lazily
            if type(res) is np.ndarray:
                tag = _tag(file)
                if tag:
                    _add(t0, t1, _FILE_READ, tag[0], 0, -1, -1, int(res.nbytes), tag[1], _site(), 1.0)  # type: ignore[misc]
        except Exception:
            pass
        return res

    @functools.wraps(orig_save)
    def save(file: Any, arr: Any, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(file, (str, bytes, os.PathLike)):
            return orig_save(file, arr, *args, **kwargs)
        t0 = _now()
        res = orig_save(file, arr, *args, **kwargs)
        t1 = _now()
        try:
            p = os.fspath(file)
            if isinstance(p, bytes):
                p = os.fsdecode(p)
            if not p.endswith(".npy"):  # np.save appends the suffix
                p += ".npy"
            tag = _tag(p)
            if tag:
                _add(t0, t1, _FILE_WRITE, tag[0], 0, -1, -1, int(getattr(arr, "nbytes", 0)), tag[1], _site(), 1.0)  # type: ignore[misc]
        except Exception:
            pass
        return res

    _patch(np, "load", load)
    _patch(np, "save", save)


# -- install / uninstall ---------------------------------------------------------------
def _patch(owner: Any, name: str, new: Any) -> None:
    """Install ``new`` as ``owner.name``; where the original is a builtin (``os.stat``, ``open``)
    and ``new`` a Python function, as :func:`_as_builtin` of it."""
    key = (owner, name)
    if key not in _orig:
        _orig[key] = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    if new.__class__ is FunctionType and not hasattr(type(_orig[key]), "__get__"):
        new = _as_builtin(new)
    setattr(owner, name, new)


_builtin_like: dict[int, tuple[Any, Any]] = {}  # id(function) -> (function, what stands for the builtin)


def _as_builtin(fn: Any) -> Any:
    """``fn``, a Python function standing for a builtin, as an object that behaves as a builtin
    where a function would not. Held in a class, a builtin is no method: ``class A: stat = os.stat``
    then ``A().stat(p)`` passes no ``self`` (a function there would get the instance as its path:
    "stat() takes exactly 1 positional argument (2 given)"). It pickles and copies by name, and its
    repr is the builtin's. One object per function (``builtins.open is io.open`` stays true).

    Its class's ``__call__`` is ``fn`` itself as a staticmethod: no frame of ours comes between the
    caller and ``fn`` (whose ``_getframe(1)`` must be the caller's); ~30 ns a call over the function."""
    got = _builtin_like.get(id(fn))
    if got is not None and got[0] is fn:
        return got[1]
    base = fn
    while getattr(base, "__wrapped__", None) is not None:
        base = base.__wrapped__
    cls = type("AsBuiltin", (), {
        "__slots__": ("__dict__", "__weakref__"),
        "__call__": staticmethod(fn),
        "__reduce__": lambda self: self.__qualname__,  # by name, as pickle saves a builtin
        "__repr__": lambda self: repr(base),
        "__module__": __name__,
    })  # fmt: skip
    obj = functools.update_wrapper(cls(), fn)
    obj.__wrapped__ = base  # the builtin, as a wrapper made by functools.wraps links it
    _builtin_like[id(fn)] = (fn, obj)
    return obj


def _pickle_names() -> None:
    """After the patches: pickle saves a function by name, and ``__module__.__qualname__``
    must lead back to it. A wrapper copied its original's (``os.open``'s is ``posix``, which
    we leave alone): name the module it was installed in instead, so ``pickle.dumps(os.open)``
    works as without us (and loads as ``os.open`` anywhere). ``open`` keeps ``io``."""
    for (owner, name) in list(_orig):
        new = getattr(owner, name, None)
        if not isinstance(owner, type(sys)) or new is None:
            continue
        mod = sys.modules.get(getattr(new, "__module__", None) or "")
        if getattr(mod, getattr(new, "__qualname__", ""), None) is not new:
            try:
                new.__module__ = owner.__name__
            except (AttributeError, TypeError):
                pass


def _run_dir_of(cfg: Any) -> str | None:
    try:
        from distdiag.shim import session

        if session.SESSION is not None:
            return str(session.SESSION.run_dir)
    except Exception:
        pass
    d = getattr(cfg, "run_dir", None) or os.environ.get("DISTDIAG_DIR")
    return str(d) if d else None


def skip_dir(path: str | os.PathLike[str]) -> None:
    """Never record paths under ``path`` (the wrapper calls this with the run dir)."""
    global _skip
    p = os.path.abspath(os.fspath(path)).rstrip("/") + "/"
    if p not in _skip:
        _skip = (*_skip, p)
    _paths.clear()
    _dirs.clear()


#: which capture records the file calls: "preload" (the libc interposer, distdiag.shim.preload),
#: "python" (the wrappers below) or "off" (not installed); the rank file's ``fileio_capture``
CAPTURE = "off"


def _start_preload(rec: Any, cfg: Any, run_dir: str | None) -> bool:
    """Record through the libc interposer when it is loaded and wanted: then none of the
    Python-level wrappers is installed (a call both would see is recorded once, by libc)."""
    global CAPTURE
    hooks_cfg = dict(getattr(cfg, "hooks", None) or {})
    try:
        from distdiag.shim import preload

        if not preload.wanted(hooks_cfg) or preload.start(rec, cfg, run_dir, _tag) is None:
            return False
    except Exception:
        log.debug("distdiag: the libc interposer did not start", exc_info=True)
        return False
    CAPTURE = "preload"
    _set_capture_attr()
    return True


def _set_capture_attr() -> None:
    try:
        from distdiag.shim import session

        s = session.SESSION
        if s is not None:
            s.writer.set_attr("fileio_capture", CAPTURE)
    except Exception:
        log.debug("distdiag: fileio_capture not set", exc_info=True)


def install(rec: Any, cfg: Any = None) -> None:
    """Start recording file I/O into ``rec``. Idempotent; never imports h5py/numpy itself.

    With the libc interposer loaded (distdiag-wrap preloads it unless ``DISTDIAG_HOOKS``
    says ``preload=0``) the calls are recorded by libc and none of the recording wrappers
    below is installed; this module then tags paths (mount, run dir) for the interposer's rows
    and names the call sites of the few path calls (:func:`_install_site_wrappers`)."""
    global _rec, _tls, _add, _intern, _count_bytes, _h5_cb, _np_cb, CAPTURE
    from distdiag.shim import hooks

    with _lock:
        if _rec is not None:
            return
        _rec = rec
        _tls = rec._local
        _add = rec.add
        _intern = rec.intern
        _count_bytes = bool(getattr(cfg, "fileio_count_bytes", True))
        _paths.clear()
        _sites.clear()
        _modsites.clear()
        _dirs.clear()
        mounts.refresh()
        rd = _run_dir_of(cfg)
        if rd:
            skip_dir(rd)
        if _start_preload(rec, cfg, rd):
            _install_site_wrappers()
            _pickle_names()
            return

        opened = _wrap_open(io.open, count=True)
        _patch(builtins, "open", opened)
        _patch(io, "open", opened)
        open_code = _wrap_open(_io.open_code, count=False)  # imports: the opens, not the bytes
        _patch(_io, "open_code", open_code)
        _patch(io, "open_code", open_code)
        _patch(os, "open", _wrap_os_open(os.open))
        _patch(os, "close", _wrap_os_close(os.close))
        _patch(os, "stat", _wrap_path_call(os.stat, _FILE_STAT))
        _patch(os, "lstat", _wrap_path_call(os.lstat, _FILE_STAT))
        _patch(os, "listdir", _wrap_dir_call(os.listdir))
        _patch(os, "scandir", _wrap_dir_call(os.scandir))
        _patch(os, "chdir", _wrap_chdir(os.chdir))
        _patch(os, "fsync", _wrap_sync(os.fsync))
        if hasattr(os, "fdatasync"):
            _patch(os, "fdatasync", _wrap_sync(os.fdatasync))
        # the import system's own bindings (importlib._bootstrap_external._os is posix)
        _patch(posix, "stat", _wrap_path_call(posix.stat, _FILE_STAT))
        _patch(posix, "lstat", _wrap_path_call(posix.lstat, _FILE_STAT))
        _patch(posix, "listdir", _wrap_dir_call(posix.listdir))

        _pickle_names()
        _h5_cb = _hook_h5py
        _np_cb = _hook_numpy
        CAPTURE = "python"
    _set_capture_attr()
    hooks.when_imported("h5py", _h5_cb)
    hooks.when_imported("numpy", _np_cb)


def uninstall() -> None:
    """Put every original back; files opened meanwhile keep counting into nothing."""
    global _rec, _tls, _add, _intern, _h5_cb, _np_cb, CAPTURE
    from distdiag.shim import hooks

    with _lock:
        if CAPTURE == "preload":
            try:
                from distdiag.shim import preload

                preload.stop()
            except Exception:
                log.debug("distdiag: the libc interposer did not stop", exc_info=True)
        CAPTURE = "off"
        if _HOT is not None:
            _HOT.file_sites(False)  # a SiteCall the program still holds only calls through
        for (owner, name), orig in reversed(list(_orig.items())):
            try:
                setattr(owner, name, orig)
            except Exception:
                log.debug("distdiag: cannot restore %r.%s", owner, name, exc_info=True)
        _orig.clear()
        _builtin_like.clear()
        for modname, cb in (("h5py", _h5_cb), ("numpy", _np_cb)):
            waiting = hooks._waiting.get(modname)
            if waiting and cb in waiting:
                waiting.remove(cb)
        _h5_cb = _np_cb = None
        _rec = None
        _tls = None
        _add = None
        _intern = None
        _paths.clear()
        _fds.clear()
        _data_fds.clear()
        _modsites.clear()
