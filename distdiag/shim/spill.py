"""The rank's spill log: what the shim recorded before its HDF5 file opened, on disk.

With ``open_file_at = "numpy"`` (the default) the HDF5 file opens only once the
program has imported numpy itself (:mod:`distdiag.shim.rankfile` says why). Until
then the flusher appends every interval's rows here instead of holding them in
memory, with the standard library only: ``os.write`` of framed records to
``rank-NNNNN.h5.log`` (:func:`log_name`), claimed exclusively, mode 0600, never
through a link. A write that returned is in the kernel's page cache, so a rank
SIGKILLed before its program imported numpy (or while its HDF5 file was being
made) keeps every row of its last completed flush, as the HDF5 file does after.

When the HDF5 file opens, its writer takes the log's rows over, writes them with
its first flush, and only then is the log removed. So while a log is there it holds
everything the HDF5 file may lack, and the analyzer reads the log in the file's
place (:func:`read_log`; ``distdiag.run``): one rank file per rank after a normal
exit, in the documented layout; a log only where a process died early.

Format: ``MAGIC`` then records, each ``tag (4 bytes) | length (u32) | crc32 (u32)
| payload``. A record is written with one ``os.write`` after the previous one
returned; a torn last record (the kill came inside the write) fails its length or
checksum and ends the read: what came before it is whole.

========  ===========================================================================
tag       payload
========  ===========================================================================
``ROWS``  whole EVENT_DTYPE rows (the recorder's packed bytes)
``STRS``  JSON ``[first id, [strings ...]]``: the string table from that id on
``SYNC``  JSON list of SYNC_DTYPE rows as lists (schema.SYNC_SPEC's order)
``ATTR``  JSON object of root attributes (later records override earlier ones)
``INFL``  EVENT_DTYPE rows: the calls in flight at that flush (the last one counts)
``MARK``  JSON ``{"last_flush_mono_ns": t, "lost_events": n}``: a completed flush
========  ===========================================================================
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from pathlib import Path
from typing import Any

MAGIC = b"DDSPILL1"
#: bytes of one EVENT_DTYPE row (distdiag.shim.recorder.ROW_SIZE)
ROW_BYTES = 69
_HEAD = struct.Struct("<4sII")
TAGS = (b"ROWS", b"STRS", b"SYNC", b"ATTR", b"INFL", b"MARK")
#: the most one record may hold (a chunk of rows is at most a few MiB)
MAX_RECORD_BYTES = 64 << 20
#: mode of the log (as every file the shim writes: distdiag.shim.rankfile.FILE_MODE)
_MODE = 0o600


def log_name(rank_file_name: str) -> str:
    """``rank-00003.h5`` -> ``rank-00003.h5.log`` (also for ``rank-00003.fork-PID.h5``)."""
    return rank_file_name + ".log"


class SpillLog:
    """An append-only log of framed records (see the module docstring). ``SpillLog(path)``
    creates ``path`` exclusively (``FileExistsError`` if anything is there, a link
    included); :meth:`add` appends one record and raises ``OSError`` on a write error
    (the caller gives up on the log); :meth:`remove` deletes it once the HDF5 file
    holds its rows."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        self.fd: int | None = os.open(self.path, flags, _MODE)
        try:
            os.fchmod(self.fd, _MODE)
        except OSError:
            pass
        self.size = 0
        self._write(MAGIC)

    def _write(self, data: bytes) -> None:
        fd = self.fd
        if fd is None:
            raise OSError("the spill log is closed")
        view = memoryview(data)
        while view:
            n = os.pwrite(fd, view, self.size)
            if n <= 0:
                raise OSError("the spill log took no bytes")
            view = view[n:]
            self.size += n

    def add(self, tag: bytes, payload: bytes) -> None:
        self._write(_HEAD.pack(tag, len(payload), zlib.crc32(payload)) + payload)

    def add_json(self, tag: bytes, obj: Any) -> None:
        self.add(tag, json.dumps(obj, separators=(",", ":")).encode())

    def records(self, tags: tuple[bytes, ...]) -> Any:
        """Yield ``(tag, payload)`` of this log's own records with a tag in ``tags`` (the
        writer's hand-over). Read through a descriptor of its own, opened read-only and
        checked to be the same file: a descriptor opened for writing may not read (a FUSE
        file system that creates files write-only, seen: EBADF)."""
        if self.fd is None:
            return
        want = os.fstat(self.fd)
        fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
        try:
            if not os.path.samestat(os.fstat(fd), want):
                raise OSError(f"{self.path} is no longer the spill log written")
            at = len(MAGIC)
            while at + _HEAD.size <= self.size:
                tag, n, _crc = _HEAD.unpack(os.pread(fd, _HEAD.size, at))
                if tag in tags:
                    yield tag, os.pread(fd, n, at + _HEAD.size)
                at += _HEAD.size + n
        finally:
            os.close(fd)

    def close(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass

    def remove(self) -> None:
        """Delete the log (its rows are in the HDF5 file now) and close it."""
        try:
            os.unlink(self.path)
        except OSError:
            pass
        self.close()


class LogError(ValueError):
    """A spill log that cannot be read at all (its reason in one line)."""


def read_log(data: bytes) -> dict[str, Any]:
    """The contents of a spill log's bytes, for the analyzer (untrusted input: every
    length and checksum is checked; a torn or damaged record ends the read).

    Returns ``rows`` (bytes of whole rows), ``strings`` (list, ``strings[0] == ""``),
    ``sync`` (list of row lists), ``attrs`` (dict), ``inflight`` (bytes), ``marks``
    (completed flushes), ``damaged`` (a reason, or None: the log's end was torn)."""
    if not data.startswith(MAGIC):
        raise LogError("not a distdiag spill log (no signature)")
    rows: list[bytes] = []
    strings: list[str] = []
    sync: list[Any] = []
    attrs: dict[str, Any] = {}
    inflight = b""
    marks = 0
    damaged: str | None = None
    at = len(MAGIC)
    while at < len(data):
        if at + _HEAD.size > len(data):
            damaged = "its last record is cut short"
            break
        tag, n, crc = _HEAD.unpack_from(data, at)
        body = data[at + _HEAD.size : at + _HEAD.size + n]
        if tag not in TAGS or n > MAX_RECORD_BYTES or len(body) != n or zlib.crc32(body) != crc:
            damaged = "its last record is cut short" if len(body) != n else f"a damaged record at byte {at}"
            break
        at += _HEAD.size + n
        try:
            if tag in (b"ROWS", b"INFL") and n % ROW_BYTES:
                raise ValueError("not whole rows")  # every later row would be misaligned
            if tag == b"ROWS":
                rows.append(body)
            elif tag == b"INFL":
                inflight = body
            elif tag == b"MARK":
                m = json.loads(body)
                if isinstance(m, dict):
                    attrs.update({k: int(v) for k, v in m.items() if k in ("last_flush_mono_ns", "lost_events")})
                marks += 1
            else:
                obj = json.loads(body)
                if tag == b"STRS":
                    first, new = obj
                    if int(first) != len(strings) or not all(isinstance(x, str) for x in new):
                        raise ValueError("strings out of order")
                    strings.extend(new)
                elif tag == b"SYNC":
                    sync.extend(list(r) for r in obj)
                elif isinstance(obj, dict):
                    attrs.update(obj)
        except (ValueError, TypeError, KeyError):
            damaged = f"a malformed {tag.decode()} record at byte {at - _HEAD.size - n}"
            break
    if not strings:
        strings = [""]
    return {"rows": b"".join(rows), "strings": strings, "sync": sync, "attrs": attrs, "inflight": inflight,
            "marks": marks, "damaged": damaged}  # fmt: skip
