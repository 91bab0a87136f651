"""The rank file written by a helper process (``writer = "process"``, the default; ``DISTDIAG_WRITER``).

Why (issue 17): while the rank's own process holds a descriptor of its file, the
file system can hold the process. A hung FUSE or NFS server makes the kernel's own
close of that descriptor at the process's exit wait uninterruptibly (FUSE sends a
FLUSH on every close), so the job hung at exit whatever bound the writer kept; and
a SIGKILL that lands while HDF5 writes its metadata leaves a file that may not open
(safe by luck, not by construction). With the helper:

* the rank's process never opens anything in the run dir after its start: its
  flusher frames each interval's rows, strings, clock samples, GPU samples,
  attributes and in-flight calls exactly as the spill log does
  (:mod:`distdiag.shim.spill`: tag, length, crc32, payload; a ``MARK`` ends a
  completed flush) and sends them down a Unix socket pair (``MSG_NOSIGNAL``: a helper that
  died never raises SIGPIPE in the job); no numpy, h5py or libhdf5 is ever
  loaded into the program's process by the shim;
* the helper applies a flush's records to the HDF5 file (the same
  :class:`distdiag.shim.writer.Writer`: layout, budget, disk checks) only once its
  ``MARK`` has arrived whole, so a rank killed at any instant, inside a flush
  included, leaves the helper a stream that ends after its last completed flush or
  inside the next one: the helper writes every row of the last completed flush,
  drops the torn one, and closes the file properly (``closed_cleanly`` false: the
  rank did not close it). Crash safety by construction for a SIGKILL of the rank
  (the OOM killer, ``kill -9``, a launcher's kill of the rank's process group: the
  helper is in a session of its own and ignores SIGINT, SIGTERM and SIGHUP, and
  ends when the stream does);
* at the rank's exit (normal, ``sys.exit``, ``os._exit``, SIGTERM) the rank sends
  its last flush and an ``EXIT`` record, ends the stream, and waits for the
  helper's "done" at most until the exit's bound (``exit_timeout_s``). A hung file
  system then holds the helper, never the job: the rank's exit takes at most the
  bound.

* a process forked from the rank (a DataLoader worker) that records gets a stream of
  its own: it hands the far end of a new socket pair to the helper on the connector
  (a ``SOCK_SEQPACKET`` pair made at the spawn, inherited by every fork, close-on-exec;
  one message is one hand-over, whole, from any process), and the same helper writes
  the child's ``rank-NNNNN.fork-PID.h5`` (made by the helper: the child opens nothing in
  the run dir). So the child imports no h5py on a thread of its own beside its own
  imports, and a hung file system holds neither its recording nor its exit. The
  helper reads every stream it holds (``poll``) and ends once the rank's stream and
  every child's have ended. A child whose helper has gone writes its file itself,
  as with ``writer = "thread"``.

Not covered: a SIGKILL of the helper itself (Slurm's SIGKILL of every process of a
step after ``KillWait``, when the rank did not end at its SIGTERM) while it writes:
the file is then as the in-process writer leaves it when the rank is killed (it
opens unless the kill lands inside HDF5's metadata write).

The helper is not the program's child: it is started by ``/bin/sh`` in the
background (``sh`` ends at once and is reaped before the program runs), so the
program's ``os.wait()`` never sees it. Its standard streams are ``/dev/null`` (a
helper that outlives the rank on a hung file system never holds the job's output
pipes open, which launchers and ``subprocess`` wait on); what it has to say (a full
disk, a write error) comes back to the rank on the same socket and is printed on
the rank's stderr as one line, as the in-process writer does. It costs a Python
interpreter with numpy and h5py per rank (~50 MB of memory, ~0.3 s of CPU when it opens the
file), which the program's own process no longer pays; it opens the file only after the job's
start-up (:meth:`_Helper._defer`), the flushes going to the spill log until then.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import struct
import sys
import time
import zlib
from pathlib import Path
from typing import Any

from distdiag.shim.ownfd import dup_above, ident, still_ours
from distdiag.shim.spill import MAX_RECORD_BYTES, SpillLog

_HEAD = struct.Struct("<4sII")
#: the helper's descriptors: the stream from the rank, the channel back, the claimed rank file,
#: and the connector on which the rank's forked children hand it streams of their own
DATA_FD, BACK_FD, CLAIM_FD, CONN_FD = 3, 4, 5, 6
#: the helper's niceness added to the rank's: its CPU (numpy's and h5py's imports at its start, then the
#: writes) yields to the job's ranks on a busy node (CFS: ~10% of a core's share at +10 against 0)
NICE = 10
#: what the rank sends at most at once before it polls (a flush's batch can be MiBs)
_SEND_BYTES = 1 << 20
#: how long a forked child waits for the helper's connector to take its stream
_HAND_OVER_S = 2.0


# -- the rank's side -------------------------------------------------------------------------
class HelperGone(OSError):
    """The helper cannot take more (it ended, or the exit's bound passed inside a write)."""


class PipeLog(SpillLog):
    """The spill log (:class:`distdiag.shim.spill.SpillLog`: ``add``, ``add_json``, ``size``,
    ``close``, ``remove``) sent down a socket to a helper process, which answers on the same
    socket (``SAY ...``, ``FAIL ...``, ``DONE`` lines). Made by :func:`spawn`.

    Before each use the descriptor is checked to be still the socket made at start (device and
    inode): a program that closed every descriptor (a daemonizer's ``closerange``) and opened
    files of its own may have the same number now, and the shim must never read or write its
    data; the helper is then given up without closing what is now the program's."""

    def __init__(self, path: Path, sock: socket.socket) -> None:  # no file: the socket
        self.path = path
        self._sock: socket.socket | None = sock
        self.fd = sock.fileno()
        self._id = ident(self.fd)
        #: where a process forked from this one hands the helper a stream of its own (:func:`connect`)
        self.connector: Connector | None = None
        self._shut = False
        self.size = 0
        #: a time.monotonic() bound for writes (the exit's); None: wait as long as the helper takes
        self.deadline: float | None = None
        self._back = b""
        self.done = False
        self.failed_line: str | None = None

    def _ours(self) -> socket.socket | None:
        """The socket while its descriptor is still ours; else None (and it is forgotten, not closed)."""
        sock = self._sock
        if sock is None:
            return None
        if not still_ours(sock, self._id):
            sock.detach()  # the number is the program's now: never closed by us
            self._sock, self.fd = None, None
            self.done = True
        return self._sock

    def _write(self, data: bytes) -> None:
        sock = self._ours()
        if sock is None or self._shut:
            raise HelperGone("the helper's stream is closed")
        view = memoryview(data)
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLOUT)
        while view:
            try:  # MSG_NOSIGNAL: a helper that died is EPIPE here, never a SIGPIPE in a program that
                # restored SIGPIPE's default (a pipe's write would have killed the job)
                n = sock.send(view[:_SEND_BYTES], socket.MSG_NOSIGNAL)
            except BlockingIOError:
                n = 0
            except OSError as e:  # EPIPE: the helper ended
                raise HelperGone(f"the helper ended ({e.strerror})") from e
            view = view[n:]
            self.size += n
            if view:
                left = None if self.deadline is None else self.deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise HelperGone("the exit's bound passed while the helper was still taking the last flush")
                ev = poller.poll(None if left is None else max(1, int(left * 1000)))
                if any(e & (select.POLLERR | select.POLLHUP) for _, e in ev):
                    raise HelperGone("the helper ended")

    def read_back(self, wait_until: float | None = None) -> list[str]:
        """Lines the helper sent back (``SAY ...``, ``FAIL ...``, ``DONE``), without waiting, or
        until ``DONE`` (or the helper's end) but not past ``wait_until`` (time.monotonic())."""
        out: list[str] = []
        sock = self._ours()
        if sock is None:
            return out
        while True:
            timeout = 0 if wait_until is None else max(0.0, wait_until - time.monotonic())
            try:
                ready = select.select([sock], [], [], timeout)[0]
            except (OSError, ValueError):
                ready = []
            if not ready:
                break
            try:
                chunk = sock.recv(65536)
            except BlockingIOError:
                continue
            except OSError:
                chunk = b""
            if not chunk:  # the helper closed its end: it has ended
                self.done = True
                break
            self._back += chunk
            *lines, self._back = self._back.split(b"\n")
            for raw in lines:
                line = raw.decode("utf-8", "replace")
                if line == "DONE":
                    self.done = True
                elif line.startswith("FAIL "):
                    self.failed_line = line[5:]
                    out.append(line[5:])
                elif line.startswith("SAY "):
                    out.append(line[4:])
            if self.done or wait_until is None:
                break
        return out

    def finish(self) -> None:
        """End the stream (the helper writes what it has and says ``DONE``); the answer can still be read."""
        sock = self._ours()
        self._shut = True
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def close(self) -> None:
        """Close the socket (the helper then ends what it has)."""
        sock = self._ours()
        self._sock, self.fd = None, None
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass

    remove = close  # the spill log's "its rows are in the file now": nothing to delete here


class Connector:
    """The rank's end of the helper's connector (a ``SOCK_SEQPACKET`` pair: one message is one
    hand-over, whole, whichever process sends it). A process forked from the rank inherits it and
    hands the helper, in one message, the far end of a new stream (:func:`connect`), so the rank's
    helper also writes the child's file: the child loads nothing (no h5py import on a thread of
    the child beside the child's own imports) and never touches the run dir (a hung file system
    holds neither its recording nor its exit)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock: socket.socket | None = sock
        self._id = ident(sock.fileno())

    def hand_over(self, fd: int) -> None:
        """Give the helper ``fd`` (a stream socket's far end). Raises ``OSError`` (``HelperGone``)."""
        sock = self._sock
        if sock is None or not still_ours(sock, self._id):
            self._sock = None  # the number is the program's now (closerange): left alone
            raise HelperGone("the helper's connector is no longer open")
        deadline = time.monotonic() + _HAND_OVER_S
        while True:  # the helper's queue may be full for a moment (many workers start at once)
            try:
                sock.sendmsg([b"S"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", fd))],
                             socket.MSG_NOSIGNAL | socket.MSG_DONTWAIT)  # fmt: skip
                return
            except BlockingIOError:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise HelperGone(f"the helper took no stream within {_HAND_OVER_S:g} s") from None
                poller = select.poll()  # not select(): the number may be above FD_SETSIZE
                poller.register(sock.fileno(), select.POLLOUT)
                poller.poll(max(1, int(left * 1000)))
            except OSError as e:
                raise HelperGone(f"the helper took no stream ({e.strerror})") from e


def _high_dup(fd: int) -> int:
    """``fd`` moved above the helper's 3-6 (close-on-exec): posix_spawn's dup2 onto the same
    number would keep close-on-exec set."""
    return dup_above(fd, 10)


def _helper_env() -> dict[str, str]:
    """The helper's environment: the rank's, without our libc interposer (the helper's own
    file calls are not the program's) and with one BLAS/OpenMP thread (it only copies)."""
    env = dict(os.environ)
    pre = env.get("LD_PRELOAD")
    if pre:
        keep = [p for p in pre.replace(":", " ").split() if "distdiag" not in p]
        if keep:
            env["LD_PRELOAD"] = " ".join(keep)
        else:
            env.pop("LD_PRELOAD")
    for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env[k] = "1"
    root = str(Path(__file__).resolve().parent.parent.parent)  # where the distdiag package is
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


_BOOT = "from distdiag.shim.helper import main; main()"


def spawn(path: Path, claim_fd: int, cfg: Any, attrs_pid: int) -> PipeLog:
    """Start the helper for the rank file ``path`` (claimed empty at ``claim_fd``, which the
    helper takes: the caller closes its own). Returns the stream to it. Raises ``OSError``."""
    # one socket pair, both ways: send(MSG_NOSIGNAL) never raises SIGPIPE in the job (a pipe's
    # write does, where the program restored SIGPIPE's default)
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    conn_mine, conn_theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    fds = [theirs.detach()]
    try:
        fds[0] = _high_dup(fds[0])
        fds.append(_high_dup(os.dup(claim_fd)))
        fds.append(_high_dup(conn_theirs.detach()))
        there, claim, conn = fds
        actions = [(os.POSIX_SPAWN_DUP2, there, DATA_FD), (os.POSIX_SPAWN_DUP2, there, BACK_FD),
                   (os.POSIX_SPAWN_DUP2, claim, CLAIM_FD), (os.POSIX_SPAWN_DUP2, conn, CONN_FD)]  # fmt: skip
        argv = ["/bin/sh", "-c", '"$@" </dev/null >/dev/null 2>&1 &', "sh", sys.executable, "-c", _BOOT]
        pid = os.posix_spawn("/bin/sh", argv, _helper_env(), file_actions=actions)
        while True:  # sh ends as soon as the helper is started in the background
            try:
                os.waitpid(pid, 0)
                break
            except ChildProcessError:
                break
            except InterruptedError:
                continue
    except BaseException:
        mine.close()
        conn_mine.close()
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass
        raise
    for fd in fds:
        os.close(fd)
    lg = _stream(path, mine, cfg, attrs_pid, forked=False)
    hi = _high_dup(conn_mine.detach())  # close-on-exec: a forked child inherits it, an exec'd program not
    lg.connector = Connector(socket.socket(fileno=hi))
    return lg


def connect(path: Path, connector: Connector, cfg: Any, pid: int, inherited: int = 0) -> PipeLog:
    """In a process forked from the rank: a stream of its own to the rank's helper, which
    writes ``path`` (made by the helper: this process opens nothing in the run dir). Raises
    ``OSError`` when the helper takes none (it ended, or the connector is gone). ``inherited``: the
    rank's strings this process's table starts with (a child of the rank itself; the helper has
    them from the rank's stream), 0 to send the whole table."""
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connector.hand_over(theirs.fileno())
    except BaseException:
        mine.close()
        raise
    finally:
        theirs.close()
    lg = _stream(path, mine, cfg, pid, forked=True, inherited=inherited)
    lg.connector = connector
    return lg


def _stream(path: Path, sock: socket.socket, cfg: Any, pid: int, forked: bool, inherited: int = 0) -> PipeLog:
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SEND_BYTES)
    except OSError:
        pass  # the default: more polls, same bytes
    sock.setblocking(False)
    lg = PipeLog(path, sock)
    keys = ("flush_interval_s", "exit_timeout_s", "max_file_bytes", "sample_every", "helper_open_after_s")
    lg.add_json(b"INIT", {"path": str(Path(path).absolute()), "rank_pid": pid, "forked": forked, "inherited": inherited,
                          "cfg": {k: getattr(cfg, k) for k in keys if hasattr(cfg, k)}})  # fmt: skip
    return lg


# -- the helper's side -------------------------------------------------------------------------
class _Replica:
    """What :class:`distdiag.shim.writer.Writer` reads of a Recorder, filled from the stream."""

    def __init__(self) -> None:
        from types import SimpleNamespace

        self.strings = SimpleNamespace(strings=[])  # the rank's table from id 0 (""), as it sends it
        self._ids: dict[str, int] = {}
        self.lost_events = 0
        self.max_pending_chunks = 0
        self.full: list[Any] = []
        self.inflight = b""
        #: a forked child's: (the rank's replica's ids, how many of them the child inherited)
        self.base_ids: tuple[dict[str, int], int] | None = None

    def add_strings(self, first: int, new: list[str]) -> None:
        if first != len(self.strings.strings) or not all(isinstance(s, str) for s in new):
            raise ValueError("strings out of order")
        for s in new:
            self._ids.setdefault(s, len(self.strings.strings))
            self.strings.strings.append(s)

    def intern(self, s: str) -> int:
        i = self._ids.get(s)  # the rank interns every name the writer uses (wrap._Shim)
        if i is None and self.base_ids is not None:
            j = self.base_ids[0].get(s)
            i = j if j is not None and j < self.base_ids[1] else None
        return 0 if i is None else i

    def drain(self, offsets: Any) -> list[Any]:
        return []

    def inflight_rows(self) -> Any:
        import numpy as np

        from distdiag.schema import EVENT_DTYPE

        return np.frombuffer(self.inflight, EVENT_DTYPE).copy()


class _Back:
    """The channel back to the rank: one line per message, never raises (the rank may be gone)."""

    def __init__(self, fd: int) -> None:
        self.fd: int | None = fd

    def send(self, line: str) -> None:
        fd = self.fd
        if fd is None:
            return
        try:
            os.write(fd, (" ".join(line.split()) + "\n").encode("utf-8", "replace"))
        except OSError:
            self.fd = None


class _Helper:
    """One stream's file: the rank's (its claimed file at ``claim_fd``), or a forked child's
    (made by the helper: ``claim_fd`` None)."""

    def __init__(self, back: _Back, claim_fd: int | None = CLAIM_FD, base: _Replica | None = None) -> None:
        self.back = back
        self.claim_fd = claim_fd
        self.compact = False
        #: a forked child's stream: the rank's replica, whose first ``inherited`` strings the
        #: child's table starts with (the child sends only those it made after the fork)
        self.base = base
        self.inherited = 0
        self.held_mark: dict[str, Any] | None = None
        self.rec = _Replica()
        self.path: Path | None = None
        self.cfg: Any = None
        self.w: Any = None
        self.attrs: dict[str, Any] = {}
        # one flush's records, applied at its MARK
        self.rows: list[bytes] = []
        self.sync: list[Any] = []
        self.gpu: list[bytes] = []
        self.new_attrs: dict[str, Any] = {}
        self.strings: list[tuple[int, list[str]]] = []
        self.inflight: bytes | None = None
        self.end: dict[str, Any] | None = None
        self.failed = False
        #: until the file opens: the spill log the rank's flushes go to (see :meth:`_defer`), how many
        #: of the replica's strings it holds, its clock samples (kept for the Writer too), and its
        #: bytes up to the end of its last completed flush
        self.log: Any = None
        self.log_strings = 0
        self.log_sync: list[Any] = []
        self.log_marked = 0
        #: the last completed flush's MARK in the log (its time is the rank's last flush, not the file's)
        self.log_mark: dict[str, Any] = {}
        self.started = time.monotonic()

    def take(self, tag: bytes, body: bytes) -> None:
        if tag == b"INIT":
            init = json.loads(body)
            from types import SimpleNamespace

            self.path = Path(init["path"])
            self.compact = bool(init.get("forked", False))  # a child's file: only the strings its rows use
            self.inherited = max(0, int(init.get("inherited", 0)))
            # the rank redacted argv already: the Writer must not redact it twice
            self.cfg = SimpleNamespace(**init.get("cfg", {}), redact_args="", keep_code_text=True)
        elif tag == b"ROWS":
            self.rows.append(body)
        elif tag == b"STRS":
            first, new = json.loads(body)
            self.strings.append((int(first), list(new)))
        elif tag == b"SYNC":
            self.sync.extend(json.loads(body))
        elif tag == b"GPUS":
            self.gpu.append(body)
        elif tag == b"ATTR":
            self.new_attrs.update(json.loads(body))
        elif tag == b"INFL":
            self.inflight = body
        elif tag == b"MARK":
            mark = json.loads(body)
            if self.inherited and len(self.rec.strings.strings) < self.inherited:
                if self.base_pending():
                    # the rank has not sent the strings it made just before the fork yet (it
                    # does at its next flush): this flush waits, its records kept, for at most that
                    self.held_mark = mark
                    return
                self.take_base()
            self.held_mark = None
            self.apply(mark)
        elif tag == b"EXIT":
            self.end = json.loads(body)

    def apply(self, mark: dict[str, Any]) -> None:
        """A completed flush: its records into the file, then the file's flush."""
        rows, sync, gpu, attrs = self.rows, self.sync, self.gpu, self.new_attrs
        self.rows, self.sync, self.gpu, self.new_attrs = [], [], [], {}
        for first, new in self.strings:
            self.rec.add_strings(first, new)
        self.strings = []
        if self.inflight is not None:
            self.rec.inflight, self.inflight = self.inflight, None
        self.rec.lost_events = int(mark.get("lost_events", 0))
        if self.failed or self.path is None:
            return
        if self.w is None:
            went = self._defer(rows, sync, gpu, attrs, mark)
            if went == "held":
                return
            if went == "logged":  # the file opens now and takes this flush from the log
                rows, sync, attrs = [], [], {}
        self.open_and_flush(rows, sync, gpu, attrs, mark)

    def _defer(self, rows: list[bytes], sync: list[Any], gpu: list[bytes], attrs: dict[str, Any],
               mark: dict[str, Any]) -> str:  # fmt: skip
        """Before the file opens: append this flush to the spill log instead. Returns ``"held"``
        (it went there, the file stays unopened), ``"logged"`` (it went there, and the file opens
        now) or ``""`` (it is not in the log: the file opens now and takes it).

        Why: opening the HDF5 file imports h5py and loads libhdf5 (CPU, and metadata calls to where
        Python's packages live; numpy loads at the helper's start, see _say_through). At the
        helper's first flush, one second into the rank's run, that landed inside the job's own
        start-up (its imports, its dataset
        build, an import storm on a parallel file system) and, on a node with fewer free cores
        than helpers, slowed it (measured: 4 ranks on 2 cores, a 0.2 s start of a job ran 0.04-0.1 s
        longer wrapped, none with the file opened later). So the rank's stream goes to the spill
        log (:mod:`distdiag.shim.spill`, the standard library only; the analyzer reads it in the
        file's place if the helper dies too) until ``helper_open_after_s`` of the rank's run have
        passed, the log holds :data:`distdiag.shim.rankfile.OPEN_AFTER_BYTES` (or half the
        recording budget: the rows handed over at once are then written under the budget's
        reserve, :data:`distdiag.shim.writer.BUDGET_RESERVE`), GPU samples come, or the stream
        ends: then the file opens and takes the log's rows first. A short job opens its file at
        its exit."""
        path = self.path
        if path is None or self.base is not None or self.claim_fd is None or gpu:
            return ""  # a forked child's file (a compact table of its own) opens at once
        from distdiag.shim.rankfile import DISK_RESERVE_BYTES, OPEN_AFTER_BYTES

        after_s = float(getattr(self.cfg, "helper_open_after_s", 30.0))
        budget = int(getattr(self.cfg, "max_file_bytes", 0) or 0)
        limit = min(OPEN_AFTER_BYTES, budget // 2) if budget > 0 else OPEN_AFTER_BYTES
        if self.log is None:
            if after_s <= 0 or time.monotonic() - self.started >= after_s:
                return ""
            from distdiag.shim.spill import SpillLog, log_name

            try:
                self.log = SpillLog(path.with_name(log_name(path.name)))
            except OSError:
                return ""  # a stale log of that name, a read-only dir: the file opens now
        lg = self.log
        batch = sum(len(r) for r in rows) + 64 * len(sync) + len(self.rec.inflight) + 4096
        try:
            st = os.statvfs(path.parent)
            free, need = st.f_bavail * st.f_frsize, batch + DISK_RESERVE_BYTES
        except OSError:
            free = need = 0
        if free < need:  # as the file's writer would (Writer._check_space): stop before the disk is full
            why = f"only {free} bytes free on its file system (need {need})"
            try:
                lg.add_json(b"ATTR", {"recording_stopped": why, "lost_events": int(self.rec.lost_events)})
            except OSError:
                pass
            lg.close()
            self.log = None
            self.fail(f"distdiag: cannot write {self.path}: {why}; the job runs without recording")
            return "held"  # the rows so far stay readable in the log, which the analyzer reads
        try:
            strings = self.rec.strings.strings
            if len(strings) > self.log_strings:  # strings first: the rows name them
                lg.add_json(b"STRS", [self.log_strings, strings[self.log_strings :]])
                self.log_strings = len(strings)
            for raw in rows:
                lg.add(b"ROWS", raw)
            if sync:
                lg.add_json(b"SYNC", sync)
            if attrs:
                lg.add_json(b"ATTR", attrs)
            if self.rec.inflight:
                lg.add(b"INFL", bytes(self.rec.inflight))
            lg.add_json(b"MARK", mark)
        except OSError:  # a full disk: the file opens now and takes this flush from memory
            lg.size = self.log_marked  # what the log holds whole; a torn record is never handed over
            return ""
        self.log_marked = lg.size
        self.log_mark = mark
        self.log_sync.extend(sync)
        self.attrs.update(attrs)
        return "held" if lg.size < limit and time.monotonic() - self.started < after_s else "logged"

    def open_and_flush(self, rows: list[bytes], sync: list[Any], gpu: list[bytes], attrs: dict[str, Any],
                       mark: dict[str, Any]) -> None:  # fmt: skip
        """Write a completed flush's records into the file (opened first if it is not; it then
        takes what the spill log holds before them), then flush the file."""
        if self.path is None:
            return
        import numpy as np

        from distdiag.schema import GPU_DTYPE, SYNC_DTYPE
        from distdiag.shim.writer import Writer

        w = self.w
        if w is None:
            self.attrs.update(attrs)
            attrs = {}
            try:
                w = self.w = Writer(self.path, self.rec, self.cfg, {**self.attrs, "file_opened_on": "helper"},
                                    compact_strings=self.compact, claim_fd=self.claim_fd)  # fmt: skip
            except Exception as e:
                self.fail(f"distdiag: cannot write {self.path}: {' '.join(str(e).split())[:300]}; "
                          "the job runs without recording")  # fmt: skip
                return
        handed = self._hand_over(w)
        for raw in rows:
            w.add_rows(raw)
        if sync:
            w.add_sync(np.array([tuple(r) for r in sync], SYNC_DTYPE))
        for raw in gpu:
            w.add_gpu(np.frombuffer(raw, GPU_DTYPE))
        for k, v in attrs.items():
            w.set_attr(k, v)
        if "last_flush_mono_ns" in mark:  # the rank's flush, not the time the helper wrote it
            w.flush_mono_ns = int(mark["last_flush_mono_ns"])
        w.flush()
        if handed is not None:
            self._settle_log(w, handed)
        if w.failed:
            self.fail("")

    def _hand_over(self, w: Any) -> int | None:
        """The log's rows and clock samples to the new file, first (None: there was no log)."""
        lg = self.log
        if lg is None:
            return None
        import numpy as np

        from distdiag.schema import EVENT_DTYPE, SYNC_DTYPE

        handed = 0
        try:
            for _tag, raw in lg.records((b"ROWS",)):
                w.add_rows(raw)
                handed += len(raw) // EVENT_DTYPE.itemsize
        except OSError as e:  # the log keeps what the file may lack: it stays (never removed below)
            self.back.send(f"SAY distdiag: {self.path}: its spill log could not be read back ({e}); it stays beside the file")
            handed = -1
        if self.log_sync:
            w.add_sync(np.array([tuple(r) for r in self.log_sync], SYNC_DTYPE))
            self.log_sync = []
        return handed

    def _settle_log(self, w: Any, handed: int) -> None:
        """The log goes once the file holds its rows (else it stays, and the analyzer reads it)."""
        lg, self.log = self.log, None
        if lg is None:
            return
        from distdiag.shim.rankfile import holds_the_log

        if holds_the_log(w, handed):
            lg.remove()
        else:
            lg.close()

    def base_pending(self) -> bool:
        """The rank has not yet sent all the strings this child's table starts with."""
        return self.base is not None and len(self.base.strings.strings) < self.inherited

    def take_base(self) -> None:
        """The child's table starts as the rank's first ``inherited`` strings (the same objects,
        no copy of the text); any the rank never sent (it died first) are ""."""
        have = self.base.strings.strings[: self.inherited] if self.base is not None else []
        self.rec.strings.strings.extend(have)
        self.rec.strings.strings.extend([""] * (self.inherited - len(have)))
        if self.base is not None:
            self.rec.base_ids = (self.base._ids, len(have))
        self.attrs["strings_inherited"] = self.inherited

    def fail(self, line: str) -> None:
        self.failed = True
        self.back.send("FAIL " + line)

    def close(self) -> None:
        """The stream ended: the last completed flush is in; close the file, cleanly only when the
        rank said so (``EXIT``); a rank that died leaves ``closed_cleanly`` false, as a killed one does."""
        if self.held_mark is not None:  # the rank's strings never came: what the child has still goes
            self.take_base()
            mark, self.held_mark = self.held_mark, None
            self.apply(mark)
        if self.w is None and self.log is not None and not self.failed:  # the file opens now, from the log
            self.open_and_flush([], [], [], {}, self.log_mark)
        w = self.w
        if w is None or self.failed:
            return
        end = self.end
        if end is None:
            w.close_unclean()
        else:
            w.close(end.get("exit_code"), end_mono_ns=end.get("end_mono_ns"))


#: the stream being read: where the Writer's one-line messages go
_SAY_TO: list[_Back] = []


def _say_through() -> None:
    """The Writer's one-line messages (``rankfile.say``) go back to the stderr of the process
    whose stream is being read. The writer's module (numpy) is not imported here: it takes
    ``rankfile.say`` when it is, at the file's opening (:meth:`_Helper._defer` says why)."""
    from distdiag.shim import rankfile

    def say(line: str) -> None:
        if _SAY_TO:
            _SAY_TO[0].send("SAY " + line)

    rankfile.say = say
    # the writer's module (numpy) loads here, at the helper's start, as it always did: without it
    # tests/test_startup.py's healthy twin got a startup finding in 2 of 4 runs beside a busy core
    # (not understood yet; h5py and the file still wait, see _Helper._defer)
    from distdiag.shim import writer

    writer.say = say


class _Stream:
    """One stream being read: the rank's (``DATA_FD``, answered on ``BACK_FD``) or a forked
    child's (one socket both ways), and the file it writes."""

    def __init__(self, fd: int, back_fd: int, claim_fd: int | None, base: _Replica | None = None) -> None:
        self.fd = fd
        self.back = _Back(back_fd)
        self.h = _Helper(self.back, claim_fd, base)
        self.buf = bytearray()

    def feed(self, chunk: bytes) -> bool:
        """Take what arrived; True once the stream's ``EXIT`` is in. Raises ``ValueError`` on a
        damaged stream."""
        buf, h = self.buf, self.h
        buf += chunk
        at = 0
        while len(buf) - at >= _HEAD.size:
            tag, n, crc = _HEAD.unpack_from(buf, at)
            if n > MAX_RECORD_BYTES:
                raise ValueError(f"a record of {n} bytes")
            if len(buf) - at - _HEAD.size < n:
                break
            body = bytes(buf[at + _HEAD.size : at + _HEAD.size + n])
            if zlib.crc32(body) != crc:
                raise ValueError("a damaged record")
            at += _HEAD.size + n
            h.take(tag, body)
            if h.end is not None:
                break
        del buf[:at]
        return h.end is not None

    def waits_for_rank(self) -> bool:
        """A child's flush held until the rank's stream brings the strings it inherited."""
        return self.h.held_mark is not None and self.h.base_pending()

    def finish(self, broken: BaseException | None = None, write: bool = True) -> None:
        """The stream ended (or broke): close its file with what it holds (``write``; else
        :meth:`write_file` later), say ``DONE``."""
        if broken is not None:  # what the file holds stays, the file is closed
            self.back.send(f"SAY distdiag: the rank file's helper stopped reading: {' '.join(str(broken).split())[:200]}")
        try:
            if write:
                self.write_file()
        finally:
            self.back.send("DONE")
            for fd in {self.fd, self.back.fd}:
                if fd is not None and fd != DATA_FD and fd != BACK_FD:
                    try:
                        os.close(fd)
                    except OSError:
                        pass

    def write_file(self) -> None:
        try:
            self.h.close()
        except Exception as e:
            self.back.send(f"SAY distdiag: {self.h.path}: its helper could not close it: {' '.join(str(e).split())[:200]}")


def _take_streams(conn: socket.socket) -> tuple[list[int], bool]:
    """The streams forked children handed over on the connector, without waiting; and
    whether it is still open (every process holding its other end has ended: closed)."""
    got: list[int] = []
    while True:
        try:
            msg, anc, _flags, _addr = conn.recvmsg(1, socket.CMSG_SPACE(4 * struct.calcsize("i")), socket.MSG_DONTWAIT)
        except BlockingIOError:
            return got, True
        except InterruptedError:
            continue
        except OSError:
            return got, False
        fds: list[int] = []
        for level, kind, data in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                usable = len(data) - len(data) % struct.calcsize("i")
                fds.extend(struct.unpack(f"{usable // struct.calcsize('i')}i", data[:usable]))
        if not msg and not fds:
            return got, False
        for extra in fds[1:]:  # one per message; anything else is not ours to keep
            try:
                os.close(extra)
            except OSError:
                pass
        if fds:
            got.append(fds[0])


def main() -> None:
    """The helper process: read the rank's stream from fd 3 (and those its forked children hand
    over on fd 6) until each ends, write their files, say ``DONE`` on each."""
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, signal.SIG_IGN)
    try:  # a guest: on a busy node the job's ranks come first (its imports at start, then its writes)
        os.nice(NICE)
    except OSError:
        pass
    try:
        os.setsid()
    except OSError:
        pass
    try:  # everything else the rank's process had open stays the rank's
        os.closerange(CONN_FD + 1, os.sysconf("SC_OPEN_MAX"))
    except (OSError, ValueError):
        pass
    try:
        conn: socket.socket | None = socket.socket(fileno=CONN_FD)
    except OSError:
        conn = None
    _say_through()  # the Writer's one-line messages: to the process whose stream is being read
    streams = {DATA_FD: _Stream(DATA_FD, BACK_FD, CLAIM_FD)}
    rank = streams[DATA_FD].h.rec  # the table forked children's start with
    waiting: list[_Stream] = []  # children ended, their file waiting for the rank's next flush
    while True:
        if conn is not None and DATA_FD not in streams:  # the rank is done: a child's last word still counts
            new, open_ = _take_streams(conn)
            streams.update((fd, _Stream(fd, fd, None, rank)) for fd in new)
            if not open_:
                conn.close()
                conn = None
        if not streams:
            break
        poller = select.poll()
        for fd in streams:
            poller.register(fd, select.POLLIN)
        if conn is not None:
            poller.register(conn.fileno(), select.POLLIN)
        try:
            ready = poller.poll()
        except InterruptedError:
            continue
        for fd, _ev in ready:
            if conn is not None and fd == conn.fileno():
                new, open_ = _take_streams(conn)
                streams.update((fd2, _Stream(fd2, fd2, None, rank)) for fd2 in new)
                if not open_:
                    conn.close()
                    conn = None
                continue
            st = streams.get(fd)
            if st is None:
                continue
            _SAY_TO[:] = [st.back]
            broken: BaseException | None = None
            try:
                chunk = os.read(fd, _SEND_BYTES)
            except BlockingIOError:
                continue
            except OSError as e:
                chunk, broken = b"", e
            try:
                ended = not chunk or st.feed(chunk)
            except Exception as e:
                ended, broken = True, e
            if ended:
                del streams[fd]
                if fd != DATA_FD and DATA_FD in streams and st.waits_for_rank():
                    st.finish(broken, write=False)  # the child's exit waits for nothing more
                    waiting.append(st)
                    continue
                if fd == DATA_FD:  # all the rank will ever send: the children's files go first
                    for w in waiting:
                        w.write_file()
                    waiting.clear()
                st.finish(broken)
        for w in [w for w in waiting if not w.waits_for_rank()]:
            w.write_file()
            waiting.remove(w)
    os._exit(0)
