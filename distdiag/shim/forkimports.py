"""A fork never leaves the child an import that one of the shim's threads had under way.

CPython keeps one lock per module being imported (``importlib._bootstrap``'s
``_module_locks``) and does not reset them at ``fork()``. When a thread of the
shim is importing at the instant the program forks (the NVML sampler's starter
imports pynvml, ctypes.util and subprocess in the background, ~170 ms; a fork
child's flusher imports h5py), the child inherits those locks held by a thread
it does not have, and the module half executed in ``sys.modules``. The child's
own ``import subprocess`` then waits forever. Seen: 1-2 of 30 children forked in
the 0.3 s after the program's ``import numpy`` hung, with either writer; never
without the wrapper.

In the child, :func:`after_in_child` forgets what the shim's threads held: their
module locks, what they were blocked on, and the modules they had not finished
(the child imports those afresh, as it would have without the shim). A lock
held by a thread of the program is left as it is: that is the program's own
fork, and it behaves exactly as without the wrapper.

Reads CPython's ``_frozen_importlib`` (``_module_locks``, a lock's ``owner``,
``_blocking_on``; the same in 3.9-3.13); where they are not there it does nothing.
"""

from __future__ import annotations

import sys
import threading

_PREFIX = "distdiag-"
_shim_idents: frozenset[int] = frozenset()


def before() -> None:
    """In the forking thread, just before ``fork()``: which threads are the shim's."""
    global _shim_idents
    try:
        _shim_idents = frozenset(t.ident for t in threading.enumerate() if t.name.startswith(_PREFIX) and t.ident)
    except Exception:
        _shim_idents = frozenset()


def after_in_parent() -> None:
    global _shim_idents
    _shim_idents = frozenset()


def after_in_child() -> None:
    """In the child: release what the shim's threads (gone in the child) held in the import system."""
    global _shim_idents
    gone, _shim_idents = _shim_idents, frozenset()
    if gone:
        try:
            forget_imports_of(gone)
        except Exception:
            pass


def forget_imports_of(idents: frozenset[int]) -> list[str]:
    """Drop the module locks held by the threads ``idents`` and the modules they left half
    imported; returns those modules' names. Never touches a lock another thread holds."""
    bootstrap = sys.modules.get("_frozen_importlib")
    locks = getattr(bootstrap, "_module_locks", None)
    if not isinstance(locks, dict):
        return []
    dropped = []
    for name, ref in list(locks.items()):
        try:
            lock = ref()
        except Exception:
            continue
        if lock is None or getattr(lock, "owner", None) not in idents:
            continue
        locks.pop(name, None)
        mod = sys.modules.get(name)
        if mod is not None and getattr(getattr(mod, "__spec__", None), "_initializing", False):
            del sys.modules[name]  # half executed: the child's import runs it again
            dropped.append(name)
    blocking = getattr(bootstrap, "_blocking_on", None)
    if blocking is not None:
        for ident in idents:  # a new thread may get the same ident: no stale edge for it
            try:
                blocking.pop(ident, None)
            except Exception:
                pass
    return dropped


def install() -> None:
    """Once, at the shim's start, before its first thread."""
    import os

    os.register_at_fork(before=before, after_in_parent=after_in_parent, after_in_child=after_in_child)
