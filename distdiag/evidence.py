"""Small helpers the detectors share for their summaries and evidence."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from distdiag.run import Run


def secs(x: float) -> str:
    """12.5 s, 0.98 s, 42.4 ms: three significant digits in a unit people read."""
    return f"{x:.3g} s" if x >= 0.1 else f"{x * 1e3:.3g} ms"


def tally(ids: np.ndarray, weight_ns: np.ndarray, run: Run, limit: int, key: str = "wait_s",
          ndigits: int | None = None) -> dict[str, dict[str, float]]:
    """string id -> {count, <key>: seconds}, heaviest first, at most ``limit`` entries.

    The straggler and serial-section detectors tally ops and call sites alike with it.
    """
    if len(ids) == 0:
        return {}
    uniq, inv = np.unique(ids, return_inverse=True)
    tot = np.bincount(inv, weights=weight_ns)
    cnt = np.bincount(inv)
    order = np.argsort(-tot)[:limit]
    out: dict[str, dict[str, float]] = {}
    for i in order:  # at most ``limit``
        v = float(tot[i]) / 1e9
        out[run.s(int(uniq[i])) or "?"] = {"count": int(cnt[i]), key: v if ndigits is None else round(v, ndigits)}
    return out
