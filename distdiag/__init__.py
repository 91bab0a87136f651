"""distdiag: tells you why your multi-node job is slow.

The user-facing annotations (``distdiag.phase``, ``distdiag.step``) live in
``distdiag.api`` and are re-exported here; they cost nothing when the program
runs without ``distdiag-wrap``.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

from distdiag.api import mark, phase, step  # noqa: E402  (after __version__: the writer reads it)

__all__ = ["__version__", "load", "mark", "phase", "step"]


def load(run_dir: Any, config: Any = None) -> Any:
    """Load and analyze a run directory as pandas DataFrames (:class:`distdiag.frames.RunFrames`).

    Imported on first call: ``import distdiag`` inside a wrapped job must not
    pull in pandas or the analyzer.
    """
    from distdiag.frames import load as _load

    return _load(run_dir, config)
