"""The detector registry: one grep for ``@register`` finds every detector.

A detector is ``detect(a: Analysis) -> list[Finding]`` (:class:`distdiag.analysis.Analysis`):
it reads the aligned run, the matched collectives and the passes' results it declares in
``requires`` (names of :data:`distdiag.analysis.PRODUCTS`), returns data, never prints, and
never imports another detector. Its ``role`` (:class:`distdiag.roles.Role`) says where its
findings stand in the ranking: the ranking keeps no table of detector names.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from distdiag.analysis import PRODUCTS
from distdiag.findings import Finding
from distdiag.roles import NO_ROLE, ROLES, Role

if TYPE_CHECKING:
    from distdiag.analysis import Analysis

Detector = Callable[["Analysis"], "list[Finding]"]

#: name -> detector, in the order they run. Filled by @register at import of
#: the modules listed in _MODULES.
DETECTORS: dict[str, Detector] = {}
#: name -> the products (:data:`distdiag.analysis.PRODUCTS`) its detector reads
REQUIRES: dict[str, tuple[str, ...]] = {}


def register(
    name: str, requires: tuple[str, ...] = (), role: Role | None = None
) -> Callable[[Detector], Detector]:
    """Register ``detect`` under ``name`` (the kind of its findings); ``requires``: the products it
    reads besides the run; ``role``: its findings' place in the ranking (:class:`distdiag.roles.Role`)."""
    unknown = [r for r in requires if r not in PRODUCTS]
    if unknown:
        raise ValueError(f"detector {name!r} requires unknown products {unknown} (known: {sorted(PRODUCTS)})")

    def deco(fn: Detector) -> Detector:
        DETECTORS[name] = fn
        REQUIRES[name] = tuple(requires)
        ROLES[name] = role if role is not None else NO_ROLE
        return fn

    return deco


_MODULES = ("straggler", "input_bound", "h2d_copy", "gpu_underutilized", "metadata_storm", "io_bandwidth", "io_bound", "slow_link",
            "network_bound",
            "queue_wait", "launch_overhead", "serial_section", "hang", "startup", "compute_bound",
            "collective_mismatch", "load_imbalance", "small_collectives")


def load_all() -> dict[str, Detector]:
    import importlib

    for m in _MODULES:
        importlib.import_module(f"distdiag.detectors.{m}")
    return DETECTORS


def required(names: list[str] | tuple[str, ...] | None = None) -> set[str]:
    """The products the detectors ``names`` (None or empty: every registered one) read."""
    dets = load_all()
    return {p for n in (names or dets) for p in REQUIRES.get(n, ())}
