"""What a cause finding claims: the rank-time its subsystem held (the ranking takes it out of the
symptoms' windows it covers, :mod:`distdiag.ranking`; the replay removes it to price the finding,
:func:`distdiag.replay.claims_change`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from distdiag.findings import Finding
from distdiag.rows import rows_of
from distdiag.schema import Kind

if TYPE_CHECKING:
    from distdiag.run import Run

#: finding kind -> the event kinds whose rank-time the finding claims, for the mechanisms whose
#: detectors state no claims of their own (``io_bandwidth``'s episodes and ``io_bound``'s bursts
#: are :attr:`Finding.claims`)
CLAIMED_KINDS: dict[str, tuple[int, ...]] = {
    "input_bound": (Kind.INPUT_WAIT,),
    "h2d_copy": (Kind.H2D,),
    "metadata_storm": (Kind.FILE_OPEN, Kind.FILE_CLOSE, Kind.FILE_STAT, Kind.FILE_LISTDIR),
    "slow_link": (Kind.SEND, Kind.RECV, Kind.WAIT),
}
#: the findings that name a subsystem that held a rank (the causes the ranking and the replay remove first)
MECHANISMS = ("input_bound", "h2d_copy", "metadata_storm", "io_bandwidth", "slow_link", "io_bound")


def claims_of(c: Finding, run: Run) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The rank-time a cause finding claims: (rank, t0_ns, t1_ns) intervals (its own, when the
    detector stated them: :attr:`Finding.claims`)."""
    if c.claims is not None:
        return c.claims if len(c.claims[0]) else None
    kinds = CLAIMED_KINDS.get(c.kind)
    if kinds is None:
        return None
    ev = run.events
    sel = rows_of(run, kinds)  # the run's kind index (distdiag.rows): ascending rows, no scan
    ranks = list(c.ranks)
    if c.kind == "slow_link" and c.hosts and not ranks:
        ranks = [r for r, i in run.ranks.items() if i.host in set(c.hosts)]
    if ranks:
        sel = sel[np.isin(ev["rank"][sel], np.asarray(ranks))]
    if len(sel) == 0:
        return None
    t0 = ev["t0_ns"][sel]
    return (ev["rank"][sel].astype(np.int64), t0.astype(np.int64),
            np.maximum(ev["t1_ns"][sel], t0).astype(np.int64))  # fmt: skip
