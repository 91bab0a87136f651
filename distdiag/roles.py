"""What the ranking, the replay and the clock check need to know of a finding's kind, declared
by its detector (``@register(name, role=Role(...))``), so that none of them keeps a table of
detector names: a new detector states its place in the ranking where it is written.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Role:
    """A finding kind's place in the one ranking (:mod:`distdiag.ranking`)."""

    #: 0: a mechanism (a subsystem that held a rank: its claims explain the symptoms' windows they
    #: cover); 1: a code path (claims its charged windows, and is itself explained by mechanisms);
    #: 2: a symptom (lateness: loses what causes of a lower tier explain); None: neither adjusted
    #: nor explaining
    tier: int | None = None
    #: the event kinds whose rank-time the finding claims when its detector states no claims of its
    #: own (:func:`distdiag.claims.claims_of`), on its ranks; ``claims_hosts``: on its hosts' ranks
    #: when it names hosts and no ranks (a slow node's link)
    claims: tuple[int, ...] = ()
    claims_hosts: bool = False
    #: how the replay prices it when its detector states no counterfactual
    #: (:func:`distdiag.replay.claims_change`): "" not from its claims; "claims": its claimed
    #: rank-time removed; "unhidden": the part of it that compute did not hide removed
    replay_claims: str = ""
    #: the step at which the ranking's cumulative replay removes it: a subsystem that held a rank
    #: (0), a subsystem finding it explains and the start-up (1), the code path (2), the symptom (3),
    #: what is left of the waiting once they are gone (4: a load imbalance that moves between ranks)
    removal: int = 1
    #: a subsystem finding ("never silent"): reported while what it keeps is ``min_share`` of the run
    subsystem: bool = False
    #: the kinds that name its cause, whose seconds are its first (a subsystem finding)
    explained_by: tuple[str, ...] = ()
    #: (the evidence key of the cross-rank time that names its rank, what that time is, what the
    #: clocks then cannot tell) for a finding whose rank is named by comparing arrivals across
    #: ranks' clocks; None for one named from a rank's own clock or from who is where
    attributed_by: tuple[str, str, str] | None = None


#: kind -> its role, filled by ``@register`` (:mod:`distdiag.detectors`)
ROLES: dict[str, Role] = {}
#: the role of a kind no detector declared (a finding made by hand, a test's)
NO_ROLE = Role()


def role_of(kind: str) -> Role:
    """The role the detector of ``kind`` declared (every detector registered first)."""
    if kind not in ROLES:
        from distdiag.detectors import load_all

        load_all()
    return ROLES.get(kind, NO_ROLE)
