"""Hooks: one module per intercepted library.

Each hook module defines ``install(rec: Recorder, cfg: ShimConfig) -> None`` and
``uninstall() -> None``. ``install`` must be cheap and must not import the
library it hooks: libraries the program has not imported yet are hooked when
it imports them, through :func:`when_imported`. Every hook keeps the original
callable and restores it exactly in ``uninstall`` (tests rely on that).

The registry below is the one place that lists them, in install order.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import logging
import sys
import time
import types
from typing import Any, Callable

log = logging.getLogger(__name__)

#: module path -> enabled by default. wrap.py installs them in this order.
HOOKS: dict[str, bool] = {
    "distdiag.shim.hooks.mpi4py": True,
    "distdiag.shim.hooks.fileio": True,
    # a no-op unless ShimConfig.probe_links (distdiag-wrap --probe-links)
    "distdiag.shim.probe": True,
    "distdiag.shim.hooks.torch_dist": True,
    "distdiag.shim.hooks.phases": True,
    "distdiag.shim.hooks.cuda_events": True,
    # a GPU sampler thread; off (with a one-line reason in the file) without NVML
    "distdiag.shim.hooks.nvml": True,
}

_waiting: dict[str, list[Callable[[types.ModuleType], None]]] = {}
#: watched module -> perf_counter_ns (the recorder's clock) when its import began
#: (before the loader created the module): a callback that wants the import
#: as a span pops it (the mpi4py hook: ``import mpi4py.MPI`` runs MPI_Init)
import_started_ns: dict[str, int] = {}


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Runs callbacks right after a watched module finishes importing."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _waiting:
            return None
        # Let the other finders locate the module, then wrap its loader.
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PostImportLoader(spec.loader, fullname)
                return spec
        return None


class _PostImportLoader(importlib.abc.Loader):
    def __init__(self, loader: Any, fullname: str) -> None:
        self._loader = loader
        self._fullname = fullname

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        # an extension module's init may run here (single-phase init): start the clock first
        import_started_ns[self._fullname] = time.perf_counter_ns()
        return self._loader.create_module(spec)  # type: ignore[no-any-return]

    def exec_module(self, module: types.ModuleType) -> None:
        self._loader.exec_module(module)
        _fire(self._fullname, module)

    def __getattr__(self, name: str) -> Any:  # get_resource_reader, is_package, ...
        return getattr(self._loader, name)


_finder = _PostImportFinder()


def _fire(name: str, module: types.ModuleType) -> None:
    for cb in _waiting.pop(name, []):
        try:
            cb(module)
        except Exception:  # a hook never breaks the user's import
            log.debug("distdiag: hook for %s failed", name, exc_info=True)


def when_imported(name: str, callback: Callable[[types.ModuleType], None]) -> None:
    """Call ``callback(module)`` once ``name`` is imported (now, if it already is)."""
    mod = sys.modules.get(name)
    if mod is not None:
        try:
            callback(mod)
        except Exception:
            log.debug("distdiag: hook for %s failed", name, exc_info=True)
        return
    _waiting.setdefault(name, []).append(callback)
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)


def cancel_all() -> None:
    """Forget every pending post-import callback and remove the finder."""
    _waiting.clear()
    if _finder in sys.meta_path:
        sys.meta_path.remove(_finder)


def install_all(rec: Any, cfg: Any, enabled: dict[str, bool] | None = None) -> list[str]:
    """Install every enabled hook; a hook that fails is skipped, never fatal."""
    done = []
    for modname, default_on in HOOKS.items():
        short = modname.rsplit(".", 1)[1]
        if not (enabled or {}).get(short, default_on):
            continue
        try:
            importlib.import_module(modname).install(rec, cfg)
            done.append(short)
        except Exception as e:  # never break the job
            log.warning("distdiag: hook %s not installed: %s", short, e)
    return done
