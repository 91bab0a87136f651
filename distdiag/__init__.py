"""distdiag: tells you why your multi-node job is slow.

The user-facing annotations (``distdiag.phase``, ``distdiag.step``) live in
``distdiag.api`` and are re-exported here; they cost nothing when the program
runs without ``distdiag-wrap``.
"""

from __future__ import annotations

__version__ = "0.1.0"

from distdiag.api import mark, phase, step  # noqa: E402  (after __version__: the writer reads it)

__all__ = ["__version__", "mark", "phase", "step"]
