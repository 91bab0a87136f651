"""Finding: the one type every detector returns (see the JSON contract in README)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

#: a symptom's windows: per collective (or stretch) it charges, ``(rank, stretch_t0_ns, stretch_t1_ns,
#: charge_ns)``, int64 arrays: a cause's claims inside a stretch explain up to its charge
Windows = tuple[Any, Any, Any, Any]


@dataclass
class Finding:
    """One cause of lost wall-clock.

    ``cost_s`` is the wall-clock the job would save if this cause were removed;
    ``fraction`` is ``cost_s`` over the run's wall-clock. Detectors fill
    ``fraction`` with 0.0; the pipeline sets it once the wall-clock is known.
    """

    kind: str
    cost_s: float
    summary: str
    ranks: list[int] = field(default_factory=list)
    hosts: list[str] = field(default_factory=list)
    links: list[list[str]] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    evidence: dict[str, Any] = field(default_factory=dict)
    #: what to do about it, one sentence
    advice: str = ""
    fraction: float = 0.0
    #: the counterfactual that removes this cause (a :class:`distdiag.replay.Change`), for the
    #: replay to price (``evidence.replay``); None where the detector cannot state one. Not in the JSON.
    change: Any = field(default=None, repr=False, compare=False)
    #: the rank-time this cause holds, ``(rank, t0_ns, t1_ns)`` int64 intervals: what the ranking
    #: takes out of the findings it explains and what the replay removes when ``change`` is None.
    #: None: the rows of the kinds its role claims on its ranks (``distdiag.roles.Role.claims``). Not in the JSON.
    claims: tuple[Any, Any, Any] | None = field(default=None, repr=False, compare=False)
    #: as a symptom (a late rank, a serial stretch, a start-up), what it charges: ``windows(run,
    #: colls)`` gives its :data:`Windows` (or None), asked only when some cause may explain it (the
    #: detector made it; the ranking needs no detector's rules). None: it explains nothing away.
    windows: Callable[[Any, Any], Windows | None] | None = field(default=None, repr=False, compare=False)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "cost_s": float(self.cost_s),
            "fraction": float(self.fraction),
            "ranks": [int(r) for r in self.ranks],
            "hosts": list(self.hosts),
            "links": [list(link) for link in self.links],
            "paths": list(self.paths),
            "summary": self.summary,
            "advice": self.advice,
            "evidence": self.evidence,
        }
