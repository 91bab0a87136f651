"""A SIGKILLed rank's file opens with every row of its last completed flush (the README's
crash-safety promise; issue 17). 12 kills at random instants of a job flushing every
10 ms, so that many land near or inside a flush; ``benchmarks/bench_sigkill.py`` runs
hundreds."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from sigkill import kill_once

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("numpy_at", ["first", "late", "never"])
def test_a_rank_killed_at_random_instants_keeps_every_row_of_its_last_flush(tmp_path: Path, numpy_at: str) -> None:
    """``numpy_at``: when the job imports numpy, so when its HDF5 file opens (before it, the
    rows are in the spill log): at once, after a random 0-0.6 s (kills before, during and
    after the opening and the log's hand-over), never (the log only, until the exit)."""
    rng = random.Random(17)
    bad = [(k, why) for k in range(8) if (why := kill_once(tmp_path, rng, 0.01, REPO, numpy_at)) is not None]
    assert bad == [], bad
