"""A real slow file system for tests: a FUSE pass-through with an overloaded metadata server.

Every request is served one at a time (one lock), and ``getattr``, ``open``,
``opendir`` and ``readdir`` each hold that lock for ``latency_ms`` before
answering, as a saturated Lustre MDS or NFS server does: one client's stat
takes ``latency_ms``; N clients' stats at once take ~N times as long each.
Data reads and writes pass through with no added delay (the data path is
fine; only metadata is slow), unless ``--write-ms-per-mb`` makes writes slow too. The kernel's attribute, entry and negative
caches are switched off (``attr_timeout=0`` ...), so every stat and every
lookup really reaches the server, as on a cluster where the files are
shared between nodes.

Run as a program (what the fixture does, in a subprocess)::

    python tests/slowfs.py BACKING_DIR MOUNT_POINT --latency-ms 0.5

For tests: ``mount_slowfs(backing, mnt, latency_ms)`` is a context manager
that mounts, waits until the mount is in ``/proc/self/mounts``, and always
unmounts (``fusermount -u``, lazily if still busy, then the server process
by its PID) even when the test fails. ``slow_mount_over(tmp, latency_ms, fill)``
is the module fixtures' form: a backing dir that ``fill`` writes, mounted, and
the test skipped only when ``/dev/fuse`` is absent.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

log = logging.getLogger(__name__)

FSNAME = "slowfs"


def _mount_types() -> dict[str, str]:
    out = {}
    with open("/proc/self/mounts", encoding="utf-8", errors="replace") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 3:
                out[parts[1].replace("\\040", " ")] = parts[2]
    return out


def fuse_available() -> str | None:
    """None when FUSE can be used here, else the reason it cannot."""
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse is absent"
    if shutil.which("fusermount") is None and shutil.which("fusermount3") is None:
        return "fusermount is not installed (Debian: fuse3)"
    try:
        import fuse  # noqa: F401  (fusepy; needs libfuse.so.2)
    except (ImportError, OSError, EnvironmentError) as e:
        return f"fusepy unusable: {e}"
    return None


def make_ops(backing: str, latency_s: float, write_s_per_mb: float = 0.0) -> Any:
    from fuse import FuseOSError, Operations

    root = os.path.realpath(backing)
    lock = threading.Lock()

    def slow() -> None:
        # held under the lock: the server is busy for the whole delay
        if latency_s > 0:
            time.sleep(latency_s)

    class SlowFS(Operations):  # type: ignore[misc]
        """Pass-through to ``root``; metadata calls are serialized and slow."""

        def _full(self, path: str) -> str:
            return os.path.join(root, path.lstrip("/"))

        def __call__(self, op: str, *args: Any) -> Any:
            with lock:  # one request at a time, like a saturated server
                try:
                    return super().__call__(op, *args)
                except OSError as e:
                    if isinstance(e, FuseOSError):
                        raise
                    raise FuseOSError(e.errno or errno.EIO) from None

        # -- metadata (slow) ------------------------------------------------
        def getattr(self, path: str, fh: Any = None) -> dict[str, Any]:
            slow()
            st = os.lstat(self._full(path))
            keys = ("st_atime", "st_ctime", "st_gid", "st_mode", "st_mtime", "st_nlink", "st_size", "st_uid", "st_blocks")
            return {k: getattr(st, k) for k in keys}

        def open(self, path: str, flags: int) -> int:
            slow()
            return os.open(self._full(path), flags)

        def opendir(self, path: str) -> int:
            slow()
            return 0

        def readdir(self, path: str, fh: Any) -> list[str]:
            slow()
            return [".", ".."] + os.listdir(self._full(path))

        def create(self, path: str, mode: int, fi: Any = None) -> int:
            slow()
            return os.open(self._full(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)

        # -- data and the rest (pass-through, no delay) ---------------------
        def access(self, path: str, mode: int) -> None:
            if not os.access(self._full(path), mode):
                raise FuseOSError(errno.EACCES)

        def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
            return os.pread(fh, size, offset)

        def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
            if write_s_per_mb > 0:  # a slow disk (--write-ms-per-mb): the data path too
                time.sleep(write_s_per_mb * len(data) / 2**20)
            return os.pwrite(fh, data, offset)

        def truncate(self, path: str, length: int, fh: Any = None) -> None:
            with open(self._full(path), "r+b") as f:
                f.truncate(length)

        def flush(self, path: str, fh: int) -> None:
            return None

        def release(self, path: str, fh: int) -> None:
            os.close(fh)

        def fsync(self, path: str, datasync: bool, fh: int) -> None:
            os.fsync(fh)

        def mkdir(self, path: str, mode: int) -> None:
            os.mkdir(self._full(path), mode)

        def rmdir(self, path: str) -> None:
            os.rmdir(self._full(path))

        def unlink(self, path: str) -> None:
            os.unlink(self._full(path))

        def rename(self, old: str, new: str) -> None:
            os.rename(self._full(old), self._full(new))

        def chmod(self, path: str, mode: int) -> None:
            os.chmod(self._full(path), mode)

        def chown(self, path: str, uid: int, gid: int) -> None:
            os.chown(self._full(path), uid, gid)

        def utimens(self, path: str, times: Any = None) -> None:
            os.utime(self._full(path), times)

        def statfs(self, path: str) -> dict[str, Any]:
            stv = os.statvfs(self._full(path))
            keys = ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree", "f_files", "f_flag", "f_frsize", "f_namemax")
            return {k: getattr(stv, k) for k in keys}

    return SlowFS()


def serve(backing: str, mountpoint: str, latency_ms: float, write_ms_per_mb: float = 0.0) -> None:
    """Mount and serve in the foreground until unmounted."""
    from fuse import FUSE

    FUSE(
        make_ops(backing, latency_ms / 1000.0, write_ms_per_mb / 1000.0),
        mountpoint,
        foreground=True,
        nothreads=True,  # libfuse's single-threaded loop; the lock makes it explicit
        fsname=FSNAME,
        subtype=FSNAME,
        # no kernel caching of attributes, names or misses: every call reaches us
        attr_timeout=0,
        entry_timeout=0,
        negative_timeout=0,
    )


def _unmount(mnt: str, timeout_s: float = 10.0) -> None:
    for prog in ("fusermount", "fusermount3"):
        if shutil.which(prog):
            subprocess.run([prog, "-u", mnt], capture_output=True, timeout=timeout_s, check=False)
            break
    if mnt in _mount_types():  # busy: detach lazily so the test run never leaves it behind
        for prog in ("fusermount", "fusermount3"):
            if shutil.which(prog):
                subprocess.run([prog, "-uz", mnt], capture_output=True, timeout=timeout_s, check=False)
                break


#: mount point -> the PID of the server process serving it (a test may SIGSTOP it: a hung server)
SERVERS: dict[str, int] = {}


@contextlib.contextmanager
def mount_slowfs(backing: str | os.PathLike[str], mnt: str | os.PathLike[str], latency_ms: float, timeout_s: float = 15.0,
                 write_ms_per_mb: float = 0.0) -> Iterator[Path]:  # fmt: skip
    """Mount ``backing`` at ``mnt`` through the slow server; always unmounts. ``write_ms_per_mb``:
    data writes take that long per MiB too (a slow disk; 0: pass-through)."""
    mnt_s = os.path.abspath(os.fspath(mnt))
    os.makedirs(mnt_s, exist_ok=True)
    logf = open(mnt_s + ".log", "wb")
    proc = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), os.fspath(backing), mnt_s, "--latency-ms", str(latency_ms),
         "--write-ms-per-mb", str(write_ms_per_mb)],  # fmt: skip
        stdout=logf,
        stderr=subprocess.STDOUT,
        env={k: v for k, v in os.environ.items() if not k.startswith("DISTDIAG")},
    )
    try:
        deadline = time.monotonic() + timeout_s
        while mnt_s not in _mount_types():
            if proc.poll() is not None:
                logf.flush()
                raise RuntimeError(f"slowfs exited with {proc.returncode}: {Path(mnt_s + '.log').read_text(errors='replace')}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"slowfs did not mount {mnt_s} within {timeout_s} s")
            time.sleep(0.02)
        SERVERS[mnt_s] = proc.pid
        yield Path(mnt_s)
    finally:
        SERVERS.pop(mnt_s, None)
        try:
            os.kill(proc.pid, signal.SIGCONT)  # a test that stopped it (a hung server) must not hang the unmount
        except OSError:
            pass
        try:
            _unmount(mnt_s)
        finally:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()  # our own server process, by its PID
                proc.wait(timeout=10)
            logf.close()


@contextlib.contextmanager
def slow_mount_over(tmp: Path, latency_ms: float, fill: Callable[[Path], None]) -> Iterator[Path]:
    """For a module fixture: ``tmp/backing``, written by ``fill``, mounted at ``tmp/mnt`` through
    the slow server. Skips the test only where this machine has no ``/dev/fuse``; FUSE there but
    unusable (no fusermount, no fusepy) is a failure, not a skip."""
    import pytest

    if not os.path.exists("/dev/fuse"):
        pytest.skip("/dev/fuse is absent: no FUSE on this machine")
    why = fuse_available()
    assert why is None, why
    backing = tmp / "backing"
    backing.mkdir()
    fill(backing)
    with mount_slowfs(backing, tmp / "mnt", latency_ms) as mnt:
        yield mnt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("backing")
    ap.add_argument("mountpoint")
    ap.add_argument("--latency-ms", type=float, default=1.0)
    ap.add_argument("--write-ms-per-mb", type=float, default=0.0)
    a = ap.parse_args(argv)
    serve(a.backing, a.mountpoint, a.latency_ms, a.write_ms_per_mb)
    return 0


if __name__ == "__main__":
    sys.exit(main())
