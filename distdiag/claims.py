"""What a cause finding claims: the rank-time its subsystem held, its detector's own claims or the
rows of the kinds its :class:`distdiag.roles.Role` names. The ranking takes it out of the symptoms'
windows it covers (:mod:`distdiag.ranking`); the replay removes it to price the finding
(:func:`distdiag.replay.claims_change`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from distdiag.findings import Finding
from distdiag.roles import role_of
from distdiag.rows import rows_of

if TYPE_CHECKING:
    from distdiag.run import Run


def claims_of(c: Finding, run: Run) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The rank-time a cause finding claims: (rank, t0_ns, t1_ns) intervals (its own, when the
    detector stated them: :attr:`Finding.claims`)."""
    if c.claims is not None:
        return c.claims if len(c.claims[0]) else None
    role = role_of(c.kind)
    kinds = role.claims
    if not kinds:
        return None
    ev = run.events
    sel = rows_of(run, kinds)  # the run's kind index (distdiag.rows): ascending rows, no scan
    ranks = list(c.ranks)
    if role.claims_hosts and c.hosts and not ranks:
        ranks = [r for r, i in run.ranks.items() if i.host in set(c.hosts)]
    if ranks:
        sel = sel[np.isin(ev["rank"][sel], np.asarray(ranks))]
    if len(sel) == 0:
        return None
    t0 = ev["t0_ns"][sel]
    return (ev["rank"][sel].astype(np.int64), t0.astype(np.int64),
            np.maximum(ev["t1_ns"][sel], t0).astype(np.int64))  # fmt: skip
