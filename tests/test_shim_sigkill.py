"""A SIGKILLed rank's file opens with every row of its last completed flush (the README's
crash-safety promise; issue 17). 8 kills at random instants per case of a job flushing
every 10 ms, so that many land near or inside a flush; ``benchmarks/bench_sigkill.py`` runs
hundreds."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from sigkill import kill_once

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("numpy_at", ["first", "late", "never"])
@pytest.mark.parametrize("writer", ["thread", "process", "process+helper"])
def test_a_rank_killed_at_random_instants_keeps_every_row_of_its_last_flush(tmp_path: Path, numpy_at: str,
                                                                           writer: str) -> None:  # fmt: skip
    """``numpy_at``: when the job imports numpy, so when its HDF5 file opens (before it, the
    rows are in the spill log): at once, after a random 0-0.6 s (kills before, during and
    after the opening and the log's hand-over), never (the log only, until the exit).
    ``writer``: the in-process writer; the helper process (which outlives the rank and closes
    the file); the helper SIGKILLed with the rank (Slurm's step kill after ``KillWait``, a
    cgroup's OOM kill), so that nobody closes the file and a kill lands inside the helper's writes."""
    rng = random.Random(17)
    w, helper_too = writer.split("+")[0], writer.endswith("+helper")
    bad = [(k, why) for k in range(8) if (why := kill_once(tmp_path, rng, 0.01, REPO, numpy_at, w, helper_too)) is not None]
    assert bad == [], bad
