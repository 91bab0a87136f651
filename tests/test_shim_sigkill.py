"""A SIGKILLed rank's file opens with every row of its last completed flush (the README's
crash-safety promise; issue 17). 12 kills at random instants of a job flushing every
10 ms, so that many land near or inside a flush; ``benchmarks/bench_sigkill.py`` runs
hundreds."""

from __future__ import annotations

import random
from pathlib import Path

from sigkill import kill_once

REPO = Path(__file__).resolve().parent.parent


def test_a_rank_killed_at_random_instants_keeps_every_row_of_its_last_flush(tmp_path: Path) -> None:
    rng = random.Random(17)
    bad = [(k, why) for k in range(12) if (why := kill_once(tmp_path, rng, 0.01, REPO)) is not None]
    assert bad == [], bad
