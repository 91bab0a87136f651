"""The detector registry: one grep for ``@register`` finds every detector.

A detector is ``detect(run: Run, cfg: Config) -> list[Finding]``: it reads the
aligned run (and the matched collectives on it), returns data, never prints.
"""

from __future__ import annotations

from typing import Any, Callable

from distdiag.findings import Finding

Detector = Callable[[Any, Any], "list[Finding]"]

#: name -> detector, in the order they run. Filled by @register at import of
#: the modules listed in _MODULES.
DETECTORS: dict[str, Detector] = {}


def register(name: str) -> Callable[[Detector], Detector]:
    def deco(fn: Detector) -> Detector:
        DETECTORS[name] = fn
        return fn

    return deco


_MODULES = ("straggler", "input_bound", "h2d_copy", "gpu_underutilized", "metadata_storm", "io_bandwidth", "io_bound", "slow_link",
            "network_bound",
            "queue_wait", "launch_overhead", "serial_section", "hang", "startup", "compute_bound",
            "collective_mismatch")


def load_all() -> dict[str, Detector]:
    import importlib

    for m in _MODULES:
        importlib.import_module(f"distdiag.detectors.{m}")
    return DETECTORS
