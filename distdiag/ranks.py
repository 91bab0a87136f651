"""How a set of ranks is written in a message: one implementation for every warning and finding.

Two forms, both sorted by rank:

* :func:`rank_ranges` folds consecutive ranks into ranges, ``0-2, 5, 7-8``,
  so a list stays one line at 1,024 ranks (the loader's missing ranks, the
  clock fallbacks, a host's ranks in a straggler finding);
* :func:`rank_list` names each rank up to a limit, then counts the rest,
  ``0, 2, 3 and 5 more``: for the few ranks a hang or a mismatched collective
  singles out, where each one matters and a range would hide the gaps.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np


def rank_ranges(ranks: Iterable[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``'0-2, 5, 7-8'``; ``''`` for no ranks.

    A repeated rank breaks a range and is written twice (``[1, 1, 2]`` ->
    ``'1, 1-2'``): callers pass distinct ranks, and a duplicate shows rather than hides.
    """
    a = np.sort(np.fromiter(ranks, np.int64))
    if not len(a):
        return ""
    # a range ends where the next rank is not this one + 1
    runs = np.split(a, np.flatnonzero(np.diff(a) != 1) + 1)
    return ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def rank_list(ranks: Iterable[int], limit: int = 16) -> str:
    """The first ``limit`` ranks in order, then how many more: ``'0, 2, 3 and 5 more'``."""
    a = np.sort(np.fromiter(ranks, np.int64))
    txt = ", ".join(str(int(r)) for r in a[:limit])
    return txt + (f" and {len(a) - limit} more" if len(a) > limit else "")
