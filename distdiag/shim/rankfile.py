"""The rank's file as the program's process sees it: claimed at start, then either handed
to a helper process that writes it from a socket (``writer = "process"``, the default:
:mod:`distdiag.shim.helper`; the spill log's records go down a socket), or opened as
HDF5 in this process (``writer = "thread"``) from the first flush after the program's
own ``import numpy`` (``open_file_at = "numpy"``) or at start (``"start"``), as follows.

Why: numpy, h5py (and with it libhdf5) are loaded into the program's process the
moment the shim imports them, and what a library reads at load time is then fixed
before the program could set it: a script that sets ``OPENBLAS_NUM_THREADS=1``
(or ``OMP_NUM_THREADS``) before its own ``import numpy`` got a 1-thread BLAS
plain and a 2-thread one wrapped. So the shim's side that runs in the program's
process before the program's imports is the standard library only: the recorder
packs rows with ``struct`` into bytearrays (:mod:`distdiag.shim.recorder`), the
clock sync hands over tuples, and this module holds everything the file needs
until it may be written:

* :class:`RankFile` claims ``rank-NNNNN.h5`` at start, exclusively
  (``O_CREAT | O_EXCL | O_NOFOLLOW``, mode 0600: never over another launch's
  file, never through a link), and keeps the attributes, clock samples and GPU
  rows handed to it.
* Until the HDF5 file opens, its flusher appends each interval's rows, strings,
  clock samples, attributes and in-flight calls to the spill log
  (:mod:`distdiag.shim.spill`, ``rank-NNNNN.h5.log``): on disk, not in memory,
  and a SIGKILL loses at most one interval, as after the opening.
* The HDF5 file (:class:`distdiag.shim.writer.Writer`, which imports numpy and
  h5py) opens at the first interval after the program's own import of numpy has
  finished, takes the log's rows (and the recorder's drain offsets: nothing is
  written twice), writes them with its first flush, and only then is the log
  removed. Every ML and HPC program imports numpy (torch does) in its first
  seconds.
* Two other events open it: the log (or, without one, the rows waiting in
  memory) reaching :data:`OPEN_AFTER_BYTES` (8 MiB, ~120k rows), or half the
  recorder's bound (``max_pending_chunks``), and the program's exit (after the
  last rows and the exit status went to the log). Either imports numpy and
  h5py into a program that had not: said in the file's ``file_opened_on``
  attribute (``numpy``, ``memory``, ``exit``, ``start``).
* Without a log (``"start"``; a forked process's file, whose parent had numpy;
  a log that could not be made) the rows of threads that ended are copied out
  and their buffers freed until the file opens, as a flush would.

The imports the file's opening makes (h5py's files) are never recorded as the
program's I/O (:meth:`distdiag.shim.recorder.Recorder.muted`).

Also here, because they run before the program too: the private-file helpers
(mode 0600, never following a link), ``argv`` redaction and the base attributes.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import re
import secrets
import stat
import sys
import threading
import time
from pathlib import Path
from typing import Any

from distdiag import __version__
from distdiag.schema import SCHEMA_ATTR, SCHEMA_VERSION
from distdiag.shim import config as _config
from distdiag.shim.recorder import ROW_SIZE

log = logging.getLogger(__name__)


def fork_file_name(rank: int, pid: int) -> str:
    """The file of a process forked from rank ``rank`` (a DataLoader worker, a daemon):
    ``rank-NNNNN.fork-PID.h5``. Not a rank file (``schema.RANK_FILE_RE`` does not match
    it): the analyzer never takes it for a second copy of the rank."""
    return f"rank-{rank:05d}.fork-{pid}.h5"



#: Mode of every file the shim writes (rank files, forked processes' files, clock-ref.json,
#: launch.json): the files hold the command line, the recorded environment and the
#: program's paths, and clock-ref.json the clock channel's secret; only the job's user reads them.
FILE_MODE = 0o600


def write_private_file(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``path`` atomically (a reader never sees half of it), mode :data:`FILE_MODE`,
    without following any link.

    The temporary file has an unpredictable name and is created exclusively
    (``O_CREAT | O_EXCL`` never opens what is there, a link included:
    ``EEXIST``), and ``os.replace`` replaces a link at ``path`` rather than
    writing through it. A link planted at the old ``.NAME.<pid>.tmp`` name
    (pids are guessable) once made the shim overwrite its target."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(tmp, flags, FILE_MODE)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def read_own_file(path: str | os.PathLike[str], max_bytes: int = 1 << 16) -> bytes | None:
    """The bytes of ``path`` if it is a regular file (not a link, FIFO or device) of this
    user (the effective uid) that nobody else can write, at most ``max_bytes``; else None.

    For the files the ranks pass each other through the run dir (launch.json,
    clock-ref.json): one that another user could have written or swapped is
    not taken for rank 0's."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
            return None
        return os.read(fd, max_bytes)
    except OSError:
        return None
    finally:
        os.close(fd)


# -- what the files say about the command line ------------------------------------------
#: argument names (substrings, case-insensitive) whose values are never written
#: (``ShimConfig.redact_args``; the environment is filtered by schema.ENV_DENY_SUBSTRINGS)
DEFAULT_REDACT_ARGS = _config.DEFAULT_REDACT_ARGS
REDACTED = "<redacted>"
#: ``scheme://user:password@host``: the password part
_URL_PASSWORD_RE = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^/:@\s]*:)(?P<pw>[^/@\s]+)(?P<tail>@)")
#: ``--name=value``, ``-name=value``, ``name=value`` (the name part)
_ASSIGN_RE = re.compile(r"^(?P<name>-{0,2}[A-Za-z_][A-Za-z0-9_.\-]*)=(?P<value>.*)$", re.S)


def _redact_names(spec: str | None) -> tuple[str, ...]:
    return tuple(n.strip().lower() for n in str(spec if spec is not None else DEFAULT_REDACT_ARGS).split(",") if n.strip())


def describe_code(code: str) -> str:
    """What the files keep of ``python -c CODE``: its length and a hash (to tell runs apart), not its text."""
    h = hashlib.sha256(code.encode("utf-8", "surrogateescape")).hexdigest()[:16]
    return f"<code: {len(code)} chars, sha256 {h}>"


def redact_argv(argv: list[str], names: str | None = None, keep_code: bool = False) -> list[str]:
    """``argv`` as the rank files keep it: values of arguments whose names hold one of
    ``names`` (comma-separated substrings, case-insensitive; default
    :data:`DEFAULT_REDACT_ARGS`, "" for none) replaced by ``<redacted>``, in
    each form: ``--token X``, ``--token=X``, ``api_key=X``; the password of a
    ``scheme://user:pw@host`` URL; and the text of ``-c CODE`` (the first
    argument, as ``Target.command`` has it) replaced by its length and hash
    unless ``keep_code``: code given inline is where a secret typed on the
    command line most often sits, and the files go to support staff."""
    keys = _redact_names(names)

    def secret(name: str) -> bool:
        n = name.lstrip("-").lower()
        return bool(n) and any(k in n for k in keys)

    out: list[str] = []
    args = [str(a) for a in argv]
    i = 0
    if len(args) >= 2 and args[0] == "-c" and not keep_code:
        out += ["-c", describe_code(args[1])]
        i = 2
    while i < len(args):
        a = args[i]
        m = _ASSIGN_RE.match(a)
        if m is not None and secret(m.group("name")):
            out.append(f"{m.group('name')}={REDACTED}")
        elif a.startswith("-") and m is None and secret(a) and i + 1 < len(args) and not args[i + 1].startswith("-"):
            out += [a, REDACTED]  # --token VALUE
            i += 1
        else:
            out.append(_URL_PASSWORD_RE.sub(lambda u: u.group("head") + REDACTED + u.group("tail"), a))
        i += 1
    return out


def _redacted_argv_attr(value: Any, cfg: Any) -> Any:
    """The ``argv`` attribute (JSON text of a list) with :func:`redact_argv` applied."""
    try:
        argv = json.loads(value) if isinstance(value, str) else value
        if not isinstance(argv, list):
            return value
        red = redact_argv(argv, getattr(cfg, "redact_args", None), bool(getattr(cfg, "keep_code_text", False)))
        return json.dumps(red)
    except Exception:
        return json.dumps([REDACTED])  # never the raw text when it cannot be read



def _exit_timeout(v: Any) -> float:
    """``exit_timeout_s`` as a usable bound: not a number, NaN or < 0 -> 10 s; inf or huge ->
    the most a lock wait takes (threading.TIMEOUT_MAX)."""
    try:
        x = float(v)
    except (TypeError, ValueError):
        return 10.0
    if x != x or x < 0:
        return 10.0
    return min(x, threading.TIMEOUT_MAX / 2)



def base_attrs(
    rank: int = 0,
    world_size: int = 1,
    local_rank: int = 0,
    host: str = "localhost",
    job_id: str = "",
    launch_id: str = "",
) -> dict[str, Any]:
    """The root attributes every rank file starts with (see schema.FILE_ATTRS)."""
    from distdiag.shim.recorder import CLOCK_NAME

    return {
        SCHEMA_ATTR: SCHEMA_VERSION,
        "distdiag_version": __version__,
        "rank": int(rank),
        "world_size": int(world_size),
        "local_rank": int(local_rank),
        "host": str(host),
        "job_id": str(job_id),
        "launch_id": str(launch_id),
        "pid": os.getpid(),
        "argv": "[]",
        "env": "{}",
        "clock": CLOCK_NAME,
        "wall_ns_at_start": 0,
        "mono_ns_at_start": 0,
        "last_flush_mono_ns": 0,
        "lost_events": 0,
        "config": "{}",
    }




#: rows (in bytes) waiting in memory past which the file opens before the program imports numpy
OPEN_AFTER_BYTES = 8 << 20


def holds_the_log(w: Any, handed: int) -> bool:
    """The Writer ``w``, after its first flush, holds the ``handed`` rows it took from a spill
    log (``handed`` < 0: the log could not be read back), so the log may go. Rows under the
    recording budget (``max_file_bytes``) are thinned into the file's counters by design: the
    file holds the log's rows then too, and a log kept would be read in its place, the whole run
    after it lost (seen with max_file_bytes under the log's size)."""
    budget = getattr(w, "_budget", None)
    thinned = getattr(budget, "reached_ns", None) is not None and not getattr(w, "rows_cut", 0)
    return handed >= 0 and not w.failed and (w.rows_written >= handed or thinned)

#: set by the wrapper's atexit handler before it closes the file (distdiag.shim.wrap)
EXITING = False
#: called (no arguments, on the flusher thread; at exit on the closing one) before every
#: flush: hooks that make rows off the hot path (distdiag.shim.hooks.cuda_events resolves
#: its CUDA events there). Each must not block and never raise.
BEFORE_FLUSH: list[Any] = []


def _before_flush() -> None:
    for cb in list(BEFORE_FLUSH):
        try:
            cb()
        except Exception:
            pass
#: h5py's own exit handler (``h5py._unregister_converters``), taken off atexit while a
#: rank file is open and run after the file's close (see _take_h5py_exit)
_h5py_exit: Any = None


def _take_h5py_exit() -> None:
    """Run h5py's exit handler after the rank file's close, not before it.

    h5py registers ``atexit.register(_unregister_converters)`` when it is imported; atexit
    runs handlers last-registered first, and the wrapper's (which closes the file) was
    registered before the program ran. Once h5py is imported after it (the file opens
    late, or the program imports h5py), h5py's handler would run first, and the final
    flush's strings then fail ("Operation not defined for data type class"). And an
    import made inside an atexit handler registers a handler that never runs: HDF5's
    own C exit handler then calls into the finalized interpreter (a segfault at every
    exit, seen). So the handler is taken off atexit here and run by
    :func:`_release_h5py_exit` when the file is closed."""
    global _h5py_exit
    if _h5py_exit is not None:
        return
    fn = getattr(sys.modules.get("h5py"), "_unregister_converters", None)
    if fn is None:
        return
    atexit.unregister(fn)
    _h5py_exit = fn


def watch_h5py() -> None:
    """Take h5py's exit handler (:func:`_take_h5py_exit`) as soon as anyone imports h5py:
    the program's own import registers it after the wrapper's, so it would run first."""
    from distdiag.shim import hooks

    hooks.when_imported("h5py", lambda _m: _take_h5py_exit())


def _release_h5py_exit() -> None:
    """After the file's close: h5py's exit handler now (at exit), or back on atexit."""
    global _h5py_exit
    fn, _h5py_exit = _h5py_exit, None
    if fn is None:
        return
    try:
        if EXITING:
            fn()
        else:  # closed early (SIGTERM): the program may go on with h5py until its exit
            atexit.register(fn)
    except Exception:
        pass


class _KeepInterruptFlag:
    """Around the file's opening at exit: CPython ends a program that a Ctrl-C ended by
    SIGINT (exit status -2, what a shell and a launcher read) through a flag,
    ``_Py_UnhandledKeyboardInterrupt``, which running other code resets; importing
    numpy inside an atexit handler does (measured: the status became 1). The flag is
    read before and put back after (ctypes, imported there only: the program is over)."""

    def __enter__(self) -> None:
        self.flag: Any = None
        self.saved = 0
        try:
            import ctypes

            self.flag = ctypes.c_int.in_dll(ctypes.pythonapi, "_Py_UnhandledKeyboardInterrupt")
            self.saved = self.flag.value
        except Exception:  # another interpreter, a static build without the symbol
            self.flag = None

    def __exit__(self, *exc: Any) -> None:
        if self.flag is not None:
            try:
                self.flag.value = self.saved
            except Exception:
                pass


def wait_for_writes(thread: threading.Thread | None, lock: Any, deadline: float, interval_s: float) -> bool:
    """At exit: join the flusher ``thread`` (not past ``deadline``, time.monotonic()), then take
    ``lock`` with 2 s of grace past it (a flush under way stops at its next piece past the
    deadline). Whether the lock was taken; False: a write is stuck (hung file system?)."""
    if thread is not None and thread is not threading.current_thread():
        thread.join(timeout=max(0.0, min(deadline - time.monotonic(), max(5.0, 2 * interval_s))))
    try:
        return bool(lock.acquire(timeout=min(threading.TIMEOUT_MAX, max(0.0, deadline - time.monotonic()) + 2.0)))
    except (OverflowError, ValueError):
        return False


def say(line: str) -> None:
    """One line on the program's stderr; never raises."""
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except Exception:
        pass


def _writer_mode(cfg: Any) -> str:
    """``writer``: "process" (a helper process writes the file, distdiag.shim.helper) or "thread"."""
    return str(getattr(cfg, "writer", "thread")).strip().lower()


def numpy_imported() -> bool:
    """The program's own ``import numpy`` has finished (not merely begun) in this process."""
    m = sys.modules.get("numpy")
    return m is not None and not getattr(getattr(m, "__spec__", None), "_initializing", False)


class _LogFull(OSError):
    pass


#: Free space a flush leaves untouched (HDF5 metadata, the close, the user's own files).
DISK_RESERVE_BYTES = 1 << 20


def _json_safe(v: Any) -> bool:
    try:
        json.dumps(v)
        return True
    except (TypeError, ValueError):
        return False


def one_line(e: BaseException) -> str:
    msg = " ".join(str(e).split())  # HDF5 messages carry newlines: keep to one line
    return msg[:300] + "..." if len(msg) > 300 else msg


class RankFile:
    """One rank's (or forked process's) file, from the wrapper's start to the process's exit.

    ``RankFile(path, rec, cfg, attrs)`` claims ``path`` (``FileExistsError`` when
    anything is there, another ``OSError`` when it cannot be made); ``start()``
    runs the flusher; ``add_sync``, ``add_gpu``, ``set_attr``, ``flush``,
    ``close``, ``detach`` are :class:`distdiag.shim.writer.Writer`'s, from any
    thread, and never raise. Until the HDF5 file opens (see the module
    docstring) they keep what they are given; then they pass it on."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        rec: Any,
        cfg: Any,
        attrs: dict[str, Any],
        compact_strings: bool = False,
        connector: Any = None,
        inherited: int = 0,
    ) -> None:
        self.path = Path(path)
        self.rec = rec
        self.cfg = cfg
        self.interval_s = float(getattr(cfg, "flush_interval_s", 1.0))
        self.exit_timeout_s = _exit_timeout(getattr(cfg, "exit_timeout_s", 10.0))
        self._at_start = str(getattr(cfg, "open_file_at", "numpy")).strip().lower() == "start"
        self._compact = compact_strings
        self._fd: int | None = None
        if connector is None:  # else the rank's helper makes the file: this process opens nothing there
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
            self._fd = os.open(self.path, flags, FILE_MODE)
            try:  # HDF5 and os.open honour the umask; 0600 whatever it is
                os.fchmod(self._fd, FILE_MODE)
            except OSError:
                pass
        self._attrs = dict(attrs)
        #: before the HDF5 file opens, the rows go here (distdiag.shim.spill); None: held in
        #: memory instead (open_file_at = "start", a forked process's file, or no log could be made)
        self._log: Any = None
        self._offsets: dict[int, tuple[bytearray, int]] = {}  # what the log took (Recorder.drain)
        self._strings_logged = 0
        self._handed = 0  # rows the Writer took from the log
        self._sync_logged = 0
        self._attrs_logged: dict[str, Any] = dict(self._attrs)  # to log at the next flush
        #: the file is written by a helper process (distdiag.shim.helper), the rows sent to it
        self._piped = False
        self._gpu_logged = 0
        #: where processes forked from this one hand the helper streams of their own
        #: (distdiag.shim.helper.Connector); None without a helper
        self.connector: Any = None
        if connector is not None:  # a forked child's stream to the rank's helper (OSError: it takes none)
            from distdiag.shim.helper import connect

            self._log = connect(self.path, connector, cfg, os.getpid(), inherited)
            self._strings_logged = inherited  # the helper has those from the rank's stream
            self._piped = True
            self.connector = connector
        elif not self._at_start and not compact_strings and _writer_mode(cfg) == "process":
            self._log = self._spawn_helper()
            self._piped = self._log is not None
            if self._log is not None:
                self.connector = self._log.connector
        if not self._at_start and not compact_strings and self._log is None:
            self._log = self._make_log()
        if not self._at_start and not self._piped:
            from distdiag.shim import hooks

            hooks.when_imported("numpy", self._load_writer)
        #: rows of threads that ended before the file opened (their buffers are freed), without a log
        self._held: list[bytes] = []
        self._held_bytes = 0
        self._sync: list[Any] = []
        self._gpu: list[Any] = []
        self._w: Any = None  # the HDF5 Writer, once open
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.failed = False

    # -- what the Writer would be asked -------------------------------------------------
    def add_sync(self, rows: Any) -> None:
        with self._lock:
            w = self._w
            if w is None:
                self._sync.append(list(rows))
                return
        w.add_sync(rows)

    def add_gpu(self, rows: Any) -> None:
        with self._lock:
            w = self._w
            if w is None:
                self._gpu.append(rows)
                return
        w.add_gpu(rows)

    def set_attr(self, name: str, value: Any) -> None:
        with self._lock:
            w = self._w
            if w is None:
                self._attrs[name] = value
                self._attrs_logged[name] = value
                return
        w.set_attr(name, value)

    @property
    def closed(self) -> bool:
        return self._closed

    # -- opening --------------------------------------------------------------------
    def _due(self) -> str | None:
        """Why the HDF5 file may open now, or None."""
        if self._piped:  # the helper's
            return None
        if self._at_start:
            return "start"
        if numpy_imported():
            return "numpy"
        rec = self.rec
        if len(rec.full) >= max(1, int(rec.max_pending_chunks) // 2) or self._bytes_waiting() >= OPEN_AFTER_BYTES:
            return "memory"
        return None

    def _bytes_waiting(self) -> int:
        if self._log is not None:
            return int(self._log.size)
        rec = self.rec
        rows = sum(n for _, n in list(rec.full)) + sum(tb.n for tb in list(rec.buffers))
        return self._held_bytes + rows * ROW_SIZE

    def _load_writer(self, _numpy: Any) -> None:
        """Right after the program's own ``import numpy``, in the thread that imported it:
        import the writer's modules (h5py, libhdf5) there, so that the flusher's opening
        imports nothing. An import made on the flusher thread could be under way when the
        program forks (DataLoader workers start right after the imports): the child then
        inherits that import's module locks held by a thread it does not have, and its own
        ``import h5py`` waits forever (seen: 2 hangs in 10 runs of a child that imports
        h5py). Costs the program's ``import numpy`` h5py's import (~0.1-0.3 s), what
        ``open_file_at = "start"`` costs at start."""
        if self._closed or self.failed:
            return
        try:
            with self.rec.muted():  # h5py's files are not the program's I/O
                import h5py  # noqa: F401

                import distdiag.shim.writer  # noqa: F401
            _take_h5py_exit()
        except Exception:  # the flusher's opening says why, in one line
            log.debug("distdiag: the writer's modules did not import", exc_info=True)

    # -- the spill log, until the HDF5 file opens ------------------------------------------
    def _spawn_helper(self) -> Any:
        """The stream to a helper process that writes the file (the claim goes to it); None when it
        cannot start (the file is then written in this process, as with ``writer = "thread"``)."""
        from distdiag.shim.helper import spawn

        if self._fd is None:
            return None
        try:
            lg = spawn(self.path, self._fd, self.cfg, os.getpid())
        except Exception as e:
            log.debug("distdiag: no helper process for %s: %s", self.path, e)
            return None
        self._close_claim()  # the helper holds the file: this process keeps nothing of the run dir open
        return lg

    def _make_log(self) -> Any:
        from distdiag.shim.spill import SpillLog, log_name

        try:
            return SpillLog(self.path.with_name(log_name(self.path.name)))
        except OSError as e:  # a stale log of the same name, a read-only dir: rows wait in memory
            log.debug("distdiag: no spill log for %s: %s", self.path, e)
            return None

    def _spill(self) -> None:
        """Append what was recorded since the last flush to the log (under ``self._lock``):
        new strings, rows, clock samples, attributes, the calls in flight, then a mark.

        As the HDF5 writer does (``Writer._check_space``, which also allows for HDF5's own
        overhead), the batch goes only when it fits with 1 MiB to spare: else the log says why recording stopped (a small record) and
        the job runs on without recording, its rows so far readable."""
        lg = self._log
        if lg is None:
            return
        from distdiag.shim.recorder import now_ns, pack_row

        rec = self.rec
        try:
            ranges = rec.drain(self._offsets)
            out: list[tuple[bytes, Any]] = []
            strings = rec.strings.strings
            n_str = len(strings)  # append-only list: read the length once
            if n_str > self._strings_logged:  # strings first: the rows name them
                out.append((b"STRS", [self._strings_logged, strings[self._strings_logged : n_str]]))
            if ranges:
                out.append((b"ROWS", b"".join(bytes(memoryview(buf)[a * ROW_SIZE : b * ROW_SIZE]) for buf, a, b in ranges)))
            n_sync = len(self._sync)
            if n_sync > self._sync_logged:
                out.append((b"SYNC", [list(r) for rows in self._sync[self._sync_logged : n_sync] for r in rows]))
            n_gpu = len(self._gpu)
            if self._piped and n_gpu > self._gpu_logged:  # a log keeps them for the file's opening instead
                out.append((b"GPUS", b"".join(bytes(memoryview(g).cast("B")) for g in self._gpu[self._gpu_logged : n_gpu])))
            if self._attrs_logged:
                attrs, self._attrs_logged = self._attrs_logged, {}
                if "argv" in attrs:
                    attrs["argv"] = _redacted_argv_attr(attrs["argv"], self.cfg)
                out.append((b"ATTR", {k: v for k, v in attrs.items() if _json_safe(v)}))
            inflight = rec.inflight_tuples()
            buf = bytearray(len(inflight) * ROW_SIZE)
            for i, row in enumerate(inflight):  # one per thread inside a call: a handful
                pack_row(buf, i * ROW_SIZE, *row)
            out.append((b"INFL", bytes(buf)))
            batch = sum(len(p) if isinstance(p, bytes) else 64 * len(p) for _, p in out)
            try:  # the helper's Writer checks its own disk: this process never touches the run dir
                st = None if self._piped else os.statvfs(self.path.parent)
                free, need = (st.f_bavail * st.f_frsize, batch + DISK_RESERVE_BYTES) if st else (0, 0)
            except OSError:
                free = need = 0
            if free < need:
                raise _LogFull(f"only {free} bytes free on its file system (need {need})")
            for tag, payload in out:
                if isinstance(payload, bytes):
                    lg.add(tag, payload)
                else:
                    lg.add_json(tag, payload)
            self._strings_logged, self._sync_logged = n_str, n_sync
            lg.add_json(b"MARK", {"last_flush_mono_ns": now_ns(), "lost_events": int(rec.lost_events)})
            if self._piped:  # sent: nothing is handed over later, so nothing is kept
                del self._sync[:n_sync], self._gpu[:n_gpu]
                self._sync_logged = self._gpu_logged = 0
        except Exception as e:  # full disk, quota, a vanished dir: the log stops, its rows so far stay
            try:
                if not self._piped:  # a pipe that failed may hold half a record: nothing more after it
                    lg.add_json(b"ATTR", {"recording_stopped": one_line(e), "lost_events": int(rec.lost_events)})
            except Exception:
                pass
            self._log = None
            lg.close()
            self._give_up(e)

    def _hand_over(self, w: Any) -> None:
        """The new Writer takes the log's rows and the drain's place (nothing twice)."""
        lg = self._log
        if lg is None:
            return
        w._offsets = self._offsets
        for _tag, raw in lg.records((b"ROWS",)):
            w.add_rows(raw)
            self._handed += len(raw) // ROW_SIZE

    def _settle_log(self, w: Any) -> None:
        """After the Writer's flush: the log goes once the HDF5 file holds its rows (the
        handed-over rows are the first a flush writes). A kill before leaves both, and the
        analyzer reads the log (distdiag.shim.spill); so does a file that failed, or that
        the exit's bound cut before it held them."""
        lg, self._log = self._log, None
        if lg is None:
            return
        if holds_the_log(w, self._handed):
            lg.remove()
        else:
            lg.close()

    def _hold_dead_threads(self) -> None:
        """Before the file opens: copy out the rows of threads that ended and free their
        buffers, as the writer's flush does (a thread-per-task program would otherwise keep a
        buffer per thread it ever ran until the file opens). A dead thread writes nothing
        more and its current chunk was never queued, so its rows are read whole, once."""
        rec = self.rec
        dead = []
        for tb in list(rec.buffers):
            if tb.dead:
                buf = tb.buf
                n = min(tb.n, len(buf) // ROW_SIZE)
                if n:
                    self._held.append(bytes(buf[: n * ROW_SIZE]))
                    self._held_bytes += n * ROW_SIZE
                dead.append(tb)
        rec.prune(dead)

    def _open(self, why: str) -> Any:
        """Open the HDF5 file over the claimed one (under ``self._lock``); None on failure."""
        if self._w is not None or self.failed:
            return self._w
        from distdiag.shim.writer import Writer

        try:
            with self.rec.muted():  # h5py's imports are not the program's file I/O
                w = Writer(self.path, self.rec, self.cfg, {**self._attrs, "file_opened_on": why},
                           compact_strings=self._compact, claim_fd=self._fd)  # fmt: skip
                self._hand_over(w)
                for raw in self._held:
                    w.add_rows(raw)
                for rows in self._sync:
                    w.add_sync(rows)
                for rows in self._gpu:
                    w.add_gpu(rows)
        except Exception as e:
            _take_h5py_exit()  # imported, if only to fail: still to run after the close
            self._give_up(e)
            return None
        _take_h5py_exit()
        self._sync, self._gpu, self._held, self._held_bytes = [], [], [], 0
        self._close_claim()
        self._w = w
        if self._log is not None and why != "exit":  # at exit Writer.close flushes, within the bound
            w.flush()
            self._settle_log(w)
        return w

    def _close_claim(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass

    def _give_up(self, e: BaseException) -> None:
        """The file cannot be made: one stderr line; the job runs on, memory bounded."""
        self.failed = True
        self._stop.set()
        self._close_claim()
        lg, self._log = self._log, None
        if lg is not None:
            lg.close()
        self.rec.max_pending_chunks = 0  # from now on full chunks are dropped and counted
        self.rec.full.clear()
        say(f"distdiag: cannot write {self.path}: {one_line(e)}; the job runs without recording")

    # -- the flusher -------------------------------------------------------------------
    def start(self) -> None:
        if self._at_start:  # the old way: the file (numpy, h5py) before the program runs
            with self._lock:
                self._open("start")
        self._thread = threading.Thread(target=self._loop, name="distdiag-flusher", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        # this thread's own file calls (h5py's imports, the writes) are never the program's
        self.rec.mute_thread()
        while not self._stop.wait(self.interval_s):
            self.flush()

    def flush(self) -> None:
        """Write what was recorded, once the file may open (else nothing). Never raises."""
        if self._closed or self.failed:
            return
        if BEFORE_FLUSH:
            _before_flush()
        w = self._w
        if w is None:
            with self._lock:
                if self._w is None and not self._closed:
                    if self._piped:
                        self._hear_helper()
                        if self._log is not None:  # a helper that takes nothing for this long is stuck
                            self._log.deadline = time.monotonic() + max(30.0, 4 * self.interval_s)
                    if self._log is not None:
                        self._spill()
                    else:
                        self._hold_dead_threads()
            why = self._due()
            if why is None:
                return
            with self._lock:
                if self._closed:
                    return
                w = self._open(why)
            if w is None:
                return
        w.flush()
        if w.failed:
            self.failed = True

    def _hear_helper(self, wait_until: float | None = None) -> None:
        """Print what the helper said (a write error, a full disk); after its failure stop
        recording, as an in-process writer's failure does (under ``self._lock``)."""
        lg = self._log
        if lg is None:
            return
        for line in lg.read_back(wait_until):
            if line:
                say(line)
        if lg.failed_line is not None and not self.failed:
            self.failed = True
            self._stop.set()
            self._log = None
            lg.close()
            self.rec.max_pending_chunks = 0  # from now on full chunks are dropped and counted
            self.rec.full.clear()

    def _close_piped(self, exit_code: int | None, deadline: float) -> None:
        """The last flush and the exit to the helper, then its "done", not past ``deadline``."""
        from distdiag.shim.recorder import now_ns

        lg = self._log
        if lg is None:
            return
        lg.deadline = deadline
        self._hear_helper()
        if BEFORE_FLUSH:  # rows made off the hot path (CUDA events resolved) before the last flush
            _before_flush()
        self._spill()
        lg = self._log
        if lg is None:
            return
        try:
            lg.add_json(b"EXIT", {"exit_code": exit_code, "end_mono_ns": now_ns()})
            lg.finish()
            self._hear_helper(wait_until=deadline)
            if not lg.done:
                say(f"distdiag: {self.path}: its helper did not finish within exit_timeout_s="
                    f"{self.exit_timeout_s:g} s (hung file system?); the job exits without waiting")
        except Exception as e:
            say(f"distdiag: {self.path}: the exit did not reach its helper: {one_line(e)}")
        finally:
            self._log = None
            lg.close()

    def close(self, exit_code: int | None) -> None:
        """Open the file now if it never was, then Writer.close. Bounded by ``exit_timeout_s``
        as Writer.close is (the flusher and a flush under way are waited for up to the
        bound). Idempotent, never raises."""
        deadline = time.monotonic() + self.exit_timeout_s
        w = self._w
        if w is not None:
            w._deadline = deadline  # a flush under way stops at its next piece
        self._stop.set()
        if not wait_for_writes(self._thread, self._lock, deadline, self.interval_s):
            self._closed = True
            say(f"distdiag: {self.path}: the file's opening did not return within exit_timeout_s="
                f"{self.exit_timeout_s:g} s (hung file system?); the job exits without it")
            return
        try:
            if self._closed:
                return
            self._closed = True
            if self._piped:
                if not self.failed:
                    self._close_piped(exit_code, deadline)
                return
            w = self._w
            if w is None and not self.failed:
                lg = self._log
                if lg is not None:  # the exit in the log (a few bytes): the rows go to the file
                    from distdiag.shim.recorder import now_ns

                    try:
                        lg.add_json(b"ATTR", {"exit_code": exit_code, "end_mono_ns": now_ns()})
                    except Exception:
                        pass
                with _KeepInterruptFlag():
                    w = self._open("exit")
            if w is not None:
                if BEFORE_FLUSH:
                    _before_flush()
                w.close(exit_code, deadline=deadline)
                self._settle_log(w)
        except Exception:
            log.debug("distdiag: close of %s failed", self.path, exc_info=True)
        finally:
            self._lock.release()
            _release_h5py_exit()

    def detach(self) -> None:
        """In a forked child: the file is the parent's; never write, flush or close it."""
        self._stop.set()
        self._thread = None
        self._closed = True
        self._lock = threading.RLock()  # the parent's lock may have been held at fork time
        w = self._w
        if w is not None:
            w.detach()
        else:
            self._close_claim()  # the child's copy of the descriptor; the parent's stays
        lg, self._log = self._log, None
        if lg is not None:
            lg.close()  # the child's copy; the log is the parent's
