"""What a detector is given: the analysis's inputs as one typed value (issue 19).

A detector is ``detect(a: Analysis) -> list[Finding]``. It reads the aligned run, the
matched collectives and the results of the analysis's passes through ``a``; it never
computes a match, never asks how the run is held (in memory, streamed in bands, split
over ``--parallel``'s analysis ranks) and never imports another detector. What it reads
beyond the run and the config it declares in ``@register(name, requires=...)``, by
the names of :data:`PRODUCTS`: the pipeline sweeps the bands once for the products
the enabled detectors require (``costs``: the critical path of input waits and copies
is swept only when a detector that prices it runs).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import pandas as pd

    from distdiag.critical_path import Priced
    from distdiag.match import Collectives
    from distdiag.run import Run
    from distdiag.slurm import SlurmView

from distdiag.config import Config

#: what a detector may require, and what it is
PRODUCTS: dict[str, str] = {
    "collectives": "the matched collectives (distdiag.match.Collectives), on the aligned clocks",
    "breakdown": "each rank's time by category (distdiag.breakdown), and its per-step table",
    "startup_ends": "each rank's end of start-up: its first step or first rendezvous (distdiag.breakdown)",
    "costs": "the critical-path price of input waits and host-to-device copies (distdiag.critical_path)",
    "slurm": "Slurm's accounting and the ranks' launch view (distdiag.slurm)",
    "gpu": "the GPU's own timeline where the run was timed on the GPU (distdiag.gpu_timeline)",
}


@dataclass(frozen=True)
class Analysis:
    """The inputs of one analysis, as the detectors read them. Each product is computed once
    (by the pipeline's sweep, or on first use) and cached on the run."""

    #: the aligned run: its ranks, metadata, kind index and the rows held in memory
    run: Run
    #: the matched collectives (``PRODUCTS["collectives"]``)
    colls: Collectives
    #: the analysis's settings
    cfg: Config = field(default_factory=Config)

    @classmethod
    def of(cls, run: Run, cfg: Config | None = None) -> Analysis:
        """The analysis of ``run`` (aligned or not: the match aligns it first)."""
        from distdiag.match import collectives_of

        return cls(run, collectives_of(run), cfg if cfg is not None else Config())

    def priced(self, kind: int, min_fraction: float) -> Priced | None:
        """``PRODUCTS["costs"]`` of event kind ``kind``, None under ``min_fraction`` of the wall-clock."""
        from distdiag.critical_path import priced

        return priced(self.run, kind, min_fraction)

    def startup_ends(self) -> np.ndarray:
        """``PRODUCTS["startup_ends"]``: per rank, where its start-up ends (ns)."""
        from distdiag.breakdown import startup_ends

        return startup_ends(self.run)

    def step_breakdown(self) -> pd.DataFrame:
        """The per-step table of ``PRODUCTS["breakdown"]``."""
        from distdiag.breakdown import step_breakdown

        return step_breakdown(self.run, self.colls)

    def slurm(self) -> SlurmView:
        """``PRODUCTS["slurm"]``."""
        from distdiag.slurm import accounting_of

        return accounting_of(self.run)

    def gpu_breakdown(self) -> dict[str, Any] | None:
        """``PRODUCTS["gpu"]``, None when the run was not timed on the GPU."""
        from distdiag.gpu_timeline import gpu_breakdown

        return gpu_breakdown(self.run, self.cfg)
