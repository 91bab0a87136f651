"""match.member_gaps_ns: the member-order fast path equals the global (rank, arrival) order.

``_member_gaps_ns`` first tries blocks of whole groups in member order (each
rank's rows already by arrival: one communicator, or several used in step) and
falls back to the run-wide (rank, arrival) order at the first row out of order.
Both paths must give the same gaps; these runs are built so that each path is
really taken (asserted), on real rank files through load_run and align.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from distdiag import clocks, match
from distdiag.match import collectives_of
from distdiag.run import load_run
from distdiag.schema import Kind
from factories import coll, write_rank


def _run(tmp_path: Path, comms_of_step: list[list[str]], steps: int, seed: int) -> tuple:
    """6 ranks; at step i every rank calls the collective on comms_of_step[i % len][rank % 2]
    ('world' is shared, 'even'/'odd' split the ranks); every 5th is non-blocking; some in flight."""
    rng = random.Random(seed)
    for r in range(6):
        s = [""]
        rows = []
        seqs: dict[str, int] = {}
        t = 1.0 + rng.uniform(0, 3)
        for i in range(steps):
            pair = comms_of_step[i % len(comms_of_step)]
            c = pair[r % 2]
            k = Kind.COLL if i % 5 else Kind.COLL_ASYNC
            dt = rng.uniform(0.1, 2.0)
            end = -1 if (i == steps - 1 and r == 3) else t + dt  # rank 3 still inside its last one
            rows.append(coll(t, end, seqs.get(c, 0), s, comm=c, kind=k))
            seqs[c] = seqs.get(c, 0) + 1
            t += dt + rng.uniform(0.0, 1.0)
        write_rank(tmp_path / "run", r, 6, rows, s)
    run = clocks.align(load_run(tmp_path / "run"))
    return run, collectives_of(run)


def _global(run, colls, async_exits, monkeypatch):  # type: ignore[no-untyped-def]
    with monkeypatch.context() as m:
        m.setattr(match, "_member_gaps_in_member_order", lambda *a, **k: None)
        return match._member_gaps_ns(run, colls, async_exits)


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):  # type: ignore[no-untyped-def]
    """Blocks of a few groups, so each rank's carry from block to block is exercised."""
    monkeypatch.setattr(match, "_GAP_ROWS", 40)


@pytest.mark.parametrize("gap_rows", [40, 2])
@pytest.mark.parametrize("async_exits", [False, True])
def test_one_communicator_takes_the_fast_path_and_equals_the_global_order(tmp_path, monkeypatch, async_exits, gap_rows):
    monkeypatch.setattr(match, "_GAP_ROWS", gap_rows)  # 2: one group a block, every row's predecessor carried
    run, colls = _run(tmp_path, [["world", "world"]], steps=400, seed=1)
    fast = match._member_gaps_in_member_order(run, colls, async_exits)
    assert fast is not None  # the path under test was really taken
    ref = _global(run, colls, async_exits, monkeypatch)
    assert np.array_equal(fast, ref)
    assert np.array_equal(match._member_gaps_ns(run, colls, async_exits), ref)
    assert ref.max() > 0  # gaps are not trivially zero


@pytest.mark.parametrize("gap_rows", [40, 2])
@pytest.mark.parametrize("async_exits", [False, True])
def test_communicators_out_of_step_fall_back_to_the_same_gaps(tmp_path, monkeypatch, async_exits, gap_rows):
    # 'world' every third call, 'even'/'odd' in between: in (comm, seq) order a rank's
    # rows jump back in time, so the member-order pass must give up (gap_rows 2: one
    # group a block, so only the arrival carried from the previous block sees the jump)
    monkeypatch.setattr(match, "_GAP_ROWS", gap_rows)
    run, colls = _run(tmp_path, [["world", "world"], ["even", "odd"], ["even", "odd"]], steps=300, seed=3)
    assert match._member_gaps_in_member_order(run, colls, async_exits) is None
    ref = _global(run, colls, async_exits, monkeypatch)
    assert np.array_equal(match._member_gaps_ns(run, colls, async_exits), ref)
    assert ref.max() > 0
