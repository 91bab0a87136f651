"""What the analysis computes once per run and several stages read: :class:`RunCache`, ``Run.cache``.

One declared attribute per result, so that a grep finds every writer and reader of each and
mypy knows what each holds. :meth:`distdiag.run.Run.replace` gives a new run an empty one: a
result made on the raw run (the kind index, a match) never reaches the aligned run. Results
that depend on more than the run hold what they were made from (``(colls, value)``, checked
with ``is``) or are memos by their settings.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import numpy as np
    import pandas as pd

    from distdiag.breakdown import Tallies
    from distdiag.clockmodel import ClockModel
    from distdiag.match import Collectives, KeySelector
    from distdiag.mismatch import Mismatches
    from distdiag.replay import Model
    from distdiag.rows import KindIndex
    from distdiag.slurm import RankFirsts, SlurmView
    from distdiag.startup_floor import Floor

#: the results of the per-rank passes a sweep makes (:func:`distdiag.passes.analysis_passes`),
#: by the attribute that holds each
PassResult = Literal["rank_firsts", "priced_costs", "tallies", "startup_ends"]


@dataclass(slots=True)
class RunCache:
    """The run's shared results (see the module docstring); None: not made yet."""

    #: the clock model (distdiag.clocks.align); the stream re-reader and --parallel's ranks map rows with it
    clock_model: ClockModel | None = None
    #: the match on the raw run (distdiag.clocks: the exit fallback, then the causality check)
    raw_collectives: Collectives | None = None
    #: align's mapping pass's (table, selection of its collective rows), taken once by match_collectives
    selected_keys: tuple[np.ndarray, KeySelector] | None = None
    #: the matched collectives (distdiag.match.collectives_of, or align's; an analysis rank's: its members)
    collectives: Collectives | None = None
    #: the warnings align's match added, taken once by collectives_of
    collectives_warnings: list[str] | None = None
    #: per rank r, the event rows of the ranks below r, streamed kinds included (distdiag.bands)
    rank_rows: np.ndarray | None = None
    #: (min, max) ns of every row, streamed kinds included, aligned (distdiag.bands)
    time_bounds: tuple[int, int] | None = None
    #: the index of the table's rows by kind (distdiag.rows.kind_index)
    kind_index: KindIndex | None = None
    #: each rank's first useful, collective and rendezvous instants (a sweep's, or distdiag.slurm's)
    rank_firsts: RankFirsts | None = None
    #: the run's Slurm accounting view (distdiag.slurm.accounting_of)
    slurm: SlurmView | None = None
    #: critical_path_costs of PRICED_KINDS, by kind (a sweep's, or distdiag.critical_path.priced's)
    priced_costs: dict[int, dict[str, Any]] | None = None
    #: the breakdown's per-rank and per-step tallies (a sweep's BreakdownPass; distdiag.breakdown reads them)
    tallies: Tallies | None = None
    #: per rank, where its startup ends, ns (a sweep's, or distdiag.breakdown.startup_ends')
    startup_ends: np.ndarray | None = None
    #: the per-step table (distdiag.breakdown.breakdown or step_breakdown; the JSON, text and frames read it)
    step_breakdown: pd.DataFrame | None = None
    #: (step table, its per-step aggregate) for the HTML report's figure and table (distdiag.render.plots)
    per_step: tuple[pd.DataFrame, pd.DataFrame] | None = None
    #: ((peaks file, precision), GPU breakdown) (distdiag.gpu_timeline.gpu_breakdown)
    gpu_breakdown: tuple[tuple[str, str], dict[str, Any] | None] | None = None
    #: (colls, each group's root as a world rank) (distdiag.lateness.root_world_ranks)
    root_world_ranks: tuple[Collectives, np.ndarray] | None = None
    #: (colls, distdiag.mismatch.mismatches of them)
    collective_mismatch: tuple[Collectives, Mismatches] | None = None
    #: async_exits -> (colls, distdiag.match.member_gaps_ns of them, read-only)
    member_gaps: dict[bool, tuple[Collectives, np.ndarray]] = field(default_factory=dict)
    #: (healthy_call_ns, import_gap_ns) -> the startup floor (distdiag.startup_floor.floor_of)
    startup_floor: dict[tuple[float, float], Floor | None] = field(default_factory=dict)
    #: the matched point-to-point transfers, by column (distdiag.links.p2p_transfers)
    p2p_transfers: dict[str, np.ndarray] | None = None
    #: per transfer, the WAIT rows holding its receive's and its send's completion (distdiag.links.p2p_waits)
    p2p_waits: tuple[np.ndarray, np.ndarray] | None = None
    #: (colls, the replay model of the run from them) (distdiag.replay.model_of)
    replay_model: tuple[Collectives, Model] | None = None
    #: ``--parallel``: rank 0's seconds in each stage (distdiag.parallel.analyze_parallel)
    parallel: dict[str, Any] | None = None

    def put(self, name: PassResult, value: Any) -> None:
        """A sweep's result where its stage looks for it."""
        setattr(self, name, value)
