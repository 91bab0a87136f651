"""hang describes what the missing ranks did from their rows in distdiag.bands (the same
finding with any band size and with the compute phases streamed, absent from run.events and
read again from the rank files: the ``hang_in_phases`` case of tests/test_equivalence.py).

The run: 10 ranks; every rank but 3 and 7 is killed inside Barrier #4 on world.
Rank 3's last program rows are compute phases (a FORWARD then a BACKWARD that ends
last; a shim mark after them says nothing) and a file read before them; rank 7 is
inside an open phase. Their rows are the streamed kinds a whole-table read would
have to see.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from distdiag.config import Config
from distdiag.pipeline import analyze
from factories import hang_in_phases

WORLD = 10
MISSING = (3, 7)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("hang_bands")
    hang_in_phases(d, WORLD)
    return d


def _hang(run_dir: Path) -> dict[str, Any]:
    got = [f for f in analyze(run_dir, Config()).findings if f.kind == "hang"]
    assert len(got) == 1
    return dataclasses.asdict(got[0])


def test_the_missing_ranks_last_rows_are_their_compute_phases(run_dir: Path) -> None:
    f = _hang(run_dir)
    assert f["ranks"] == list(MISSING)
    doing = {d["rank"]: d for d in f["evidence"]["doing"]}
    last3 = doing[3]["last_event"]
    assert last3["kind"] == "BACKWARD" and last3["name"] == "bwd"  # not the shim's later mark
    assert doing[3]["last_file"]["path"] == "/data/shard-3"
    assert doing[3]["what"].startswith("outside any recorded call") and "BACKWARD bwd" in doing[3]["what"]
    assert doing[7]["what"].startswith("inside phase 'evaluate'")
    assert doing[7]["last_file"]["path"] == "/data/shard-7"
