"""hang describes what the missing ranks did from their rows in distdiag.bands: the same
finding with one band, with tiny bands, and with the compute phases streamed (absent
from run.events, read again from the rank files).

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

import distdiag.bands as bands_mod
from distdiag.config import Config
from distdiag.pipeline import analyze
from distdiag.schema import Kind
from factories import MS, coll, write_rank

WORLD = 10
MISSING = (3, 7)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("hang_bands")
    for r in range(WORLD):
        s = [""]
        rows = []
        for i in range(4):  # healthy collectives, with compute phases between them
            rows.append(coll(10.0 * i + 3, 10.0 * i + 6, -1, s, op="fwd", kind=Kind.FORWARD))
            rows.append(coll(10.0 * i + 6.5, 10.0 * i + 8, -1, s, op="bwd", kind=Kind.BACKWARD))
            rows.append(coll(10.0 * i + 0.1 * r, 10.0 * i + 2, i, s))
        inf = None
        if r == 3:
            rows += [coll(45.0, 46.0, -1, s, op="/data/shard-3", kind=Kind.FILE_READ),
                     coll(47.0, 60.0, -1, s, op="fwd", kind=Kind.FORWARD),
                     coll(48.0, 70.0, -1, s, op="bwd", kind=Kind.BACKWARD),
                     coll(65.0, 65.0, -1, s, op="clock", kind=Kind.SHIM)]  # fmt: skip
        elif r == 7:
            rows.append(coll(44.0, 45.0, -1, s, op="/data/shard-7", kind=Kind.FILE_READ))
            inf = [coll(46.0, -1, -1, s, op="evaluate", kind=Kind.PHASE)]
        else:
            inf = [coll(50.0 + r, -1, 4, s, op="Barrier")]
        rows.sort(key=lambda row: row[0])
        write_rank(d, r, WORLD, rows, s, inflight=inf, closed_cleanly=False, exit_code=None,
                   end_mono_ns=None, last_flush_mono_ns=int(2000 * MS))  # fmt: skip
    return d


def _hang(run_dir: Path, stream: bool = False) -> dict[str, Any]:
    cfg = Config()
    if stream:
        cfg = dataclasses.replace(cfg, stream_events=0)  # stream whatever the run's size
    rep = analyze(run_dir, cfg, stream=stream)
    if stream:
        assert rep.run.streamed_kinds and not (rep.run.events["kind"] == int(Kind.FORWARD)).any()
    got = [f for f in rep.findings if f.kind == "hang"]
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


@pytest.mark.parametrize("band_events", [1, 30])
def test_the_finding_does_not_depend_on_the_band_size(run_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                      band_events: int) -> None:  # fmt: skip
    want = _hang(run_dir)
    monkeypatch.setattr(bands_mod, "BAND_EVENTS", band_events)
    assert _hang(run_dir) == want


def test_the_finding_is_the_same_with_the_phases_streamed(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    want = _hang(run_dir)
    monkeypatch.setattr(bands_mod, "BAND_EVENTS", 30)
    assert _hang(run_dir, stream=True) == want
