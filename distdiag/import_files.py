"""Which file calls are an import's (module files, the directories searched for them), and which
file systems are the node's own: the rules the ``startup`` and ``io_bound`` detectors share.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from distdiag.run import Run


#: file systems on the node itself: their calls' latency is the machine's, not a slow server's
LOCAL_FSTYPES = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "zfs", "tmpfs", "ramfs", "overlay", "f2fs",
                           "squashfs", "vfat", "devtmpfs"})  # fmt: skip

#: a file call on a path like these is part of an import
MODULE_SUFFIXES = (".py", ".pyc", ".so", ".pth", ".pyd")


def is_module_path(path: str) -> bool:
    """A module file's path: Python source, bytecode, an extension, a ``.pth`` or anything in a
    ``__pycache__``."""
    return path.endswith(MODULE_SUFFIXES) or "__pycache__" in path


def shared_fs_rows(run: Run, rows: np.ndarray) -> np.ndarray:
    """Which of these file rows are on a file system that is not the node's own (``aux``:
    ``"fstype:mountpoint"``; NFS, Lustre, GPFS, FUSE...): one test a distinct mount."""
    aux = run.events["aux"][rows].astype(np.int64)
    uniq, inv = np.unique(aux, return_inverse=True)
    shared = np.fromiter((u > 0 and run.s(int(u)).split(":", 1)[0] not in LOCAL_FSTYPES for u in uniq), bool, len(uniq))
    return shared[inv]


def import_paths(run: Run, nid: np.ndarray) -> np.ndarray:
    """Which of these path ids (``name_id`` of file rows) an import touches: a module path, or a
    directory holding one of the run's module paths at any depth (the import system stats and
    lists each ``sys.path`` entry and package directory it searches). One test a distinct path:
    ``["/a/pkg/__init__.py", "/a/pkg", "/a", "/a/data.bin"]`` -> True, True, True, False."""
    uniq, inv = np.unique(nid, return_inverse=True)
    paths = [run.s(int(u)) for u in uniq]  # distinct paths
    is_mod = np.fromiter((is_module_path(p) for p in paths), bool, len(paths))
    dirs: set[str] = set()
    for p in (p for p, m in zip(paths, is_mod) if m):  # distinct module paths
        d = os.path.dirname(p)
        while d and d not in dirs:
            dirs.add(d)
            d = os.path.dirname(d) if d != os.path.dirname(d) else ""
    is_imp = is_mod | np.fromiter((p.rstrip("/") in dirs for p in paths), bool, len(paths))
    return is_imp[inv]  # type: ignore[no-any-return]
