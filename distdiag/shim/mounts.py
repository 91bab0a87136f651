"""Which file system a path lives on: the mount table of ``/proc/self/mounts``.

The file-I/O hook tags every path with ``"fstype:mountpoint"`` (``"lustre:/scratch"``,
``"fuse.slowfs:/tmp/x/mnt"``, ``"ext4:/"``) so the analyzer can tell a
metadata storm on the parallel file system from one on node-local disk.

Lookups are a longest-prefix match over mount points, done on the
*lexically* absolute path: no ``realpath`` (that would be one extra metadata
call per component, on the very file system we are trying not to load). A
symlink that crosses file systems is therefore attributed to the file system
its name lives on. Results are cached per directory; ``refresh()`` re-reads the
table (tests mount file systems at run time).

Stdlib only: this module runs inside the user's job.
"""

from __future__ import annotations

import io
import logging
import os
import threading

log = logging.getLogger(__name__)

MOUNTS_PATH = "/proc/self/mounts"

# io.open as it was when this module was imported: the file-I/O hook replaces
# io.open later, and reading the mount table must not record itself.
_open = io.open


def _unescape(field: str) -> str:
    r"""Mount table fields escape space, tab, newline and backslash as ``\040`` etc."""
    if "\\" not in field:
        return field
    out = []
    i = 0
    while i < len(field):
        c = field[i]
        if c == "\\" and i + 4 <= len(field) and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(c)
            i += 1
    return "".join(out)


def parse_mounts(text: str) -> list[tuple[str, str]]:
    """``[(mount_point, fstype), ...]`` in table order (later mounts shadow earlier ones)."""
    rows = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        rows.append((_unescape(parts[1]), parts[2]))
    return rows


class MountTable:
    """Longest-prefix match of absolute paths onto mount points, cached per directory."""

    def __init__(self, rows: list[tuple[str, str]] | None = None) -> None:
        self._lock = threading.Lock()
        self._by_dir: dict[str, tuple[str, str]] = {}
        self._rows: list[tuple[str, str]] = []
        self._points: frozenset[str] = frozenset()
        if rows is None:
            self.refresh()
        else:
            self._set(rows)

    def _set(self, rows: list[tuple[str, str]]) -> None:
        # The last mount on a mount point wins (it shadows the ones below it),
        # so keep the last row per mount point, then order longest first.
        last: dict[str, str] = {}
        for mnt, fstype in rows:
            last[mnt.rstrip("/") or "/"] = fstype
        ordered = sorted(last.items(), key=lambda kv: len(kv[0]), reverse=True)
        with self._lock:
            self._rows = ordered
            self._points = frozenset(last)
            self._by_dir = {}

    def refresh(self) -> None:
        """Re-read ``/proc/self/mounts`` (cheap: one small procfs read)."""
        try:
            with _open(MOUNTS_PATH, "r", encoding="utf-8", errors="replace") as f:
                text = f.read()
        except OSError as e:  # not Linux, or no procfs: every path is "unknown"
            log.debug("distdiag: cannot read %s: %s", MOUNTS_PATH, e)
            text = ""
        self._set(parse_mounts(text))

    def lookup_dir(self, d: str) -> tuple[str, str]:
        """``(fstype, mount_point)`` of an absolute, normalized directory path."""
        hit = self._by_dir.get(d)
        if hit is not None:
            return hit
        res = ("unknown", "/")
        for mnt, fstype in self._rows:
            if mnt == "/" or d == mnt or d.startswith(mnt + "/"):
                res = (fstype, mnt)
                break
        self._by_dir[d] = res
        return res

    def lookup(self, path: str) -> tuple[str, str]:
        """``(fstype, mount_point)`` of ``path`` (made absolute against the cwd, not resolved)."""
        p = os.path.abspath(path)
        # A mount point itself belongs to the mounted file system, so look it up
        # as a directory first; otherwise its parent directory decides.
        if p in self._points:
            return self.lookup_dir(p)
        return self.lookup_dir(os.path.dirname(p) or "/")


_TABLE: MountTable | None = None


def table() -> MountTable:
    """The process-wide table, read on first use."""
    global _TABLE
    if _TABLE is None:
        _TABLE = MountTable()
    return _TABLE


def lookup(path: str) -> tuple[str, str]:
    """``(fstype, mount_point)`` for ``path``; ``("unknown", "/")`` when no table."""
    return table().lookup(path)


def fs_tag(path: str) -> str:
    """``"fstype:mountpoint"``: the string the file-I/O hook stores in ``aux``."""
    fstype, mnt = lookup(path)
    return f"{fstype}:{mnt}"


def refresh() -> None:
    table().refresh()
