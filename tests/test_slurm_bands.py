"""The Slurm view's per-rank facts (first useful work, first collective, busy until the
rendezvous) come band by band from distdiag.bands: equal to their definitions whatever
the band size, and with the compute phases streamed (absent from run.events).

The run: ranks with random rows of every kind that matters here (collectives,
point-to-point, communicator creation, steps, compute phases, file calls, the
shim's marks, waits), on a coarse time grid so that rows of different kinds
start at the same instant (the first-row ties rank_busy_until breaks by table
order); plus a rank with only file calls (no rendezvous), a rank whose first
rendezvous row is a streamed phase, a rank with no rows at all and a rank with
no file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import distdiag.bands as bands_mod
from distdiag.run import STREAMED_KINDS, Run, load_run
from distdiag.schema import COMM_KINDS, P2P_KINDS, PHASE_KINDS, Kind
from distdiag.slurm import _wall_map_ns, rank_busy_until, rank_milestones
from factories import coll, write_rank

WORLD = 12
#: ranks 0-7 random; 8 file calls only; 9 a phase first; 10 no rows; 11 no file
POOL = [Kind.COLL, Kind.COLL_ASYNC, Kind.SEND, Kind.RECV_ASYNC, Kind.COMM_CREATE, Kind.STEP, Kind.PHASE,
        Kind.FORWARD, Kind.BACKWARD, Kind.OPTIMIZER, Kind.INPUT_WAIT, Kind.FILE_OPEN, Kind.FILE_READ,
        Kind.SHIM, Kind.MARK, Kind.WAIT]  # fmt: skip
USEFUL = {int(k) for k in COMM_KINDS | P2P_KINDS | PHASE_KINDS | {Kind.STEP}}
RENDEZVOUS = USEFUL | {int(Kind.COMM_CREATE)}
SYNC = {int(k) for k in COMM_KINDS | P2P_KINDS | {Kind.COMM_CREATE}}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("slurm_bands")
    rng = np.random.default_rng(7)
    for r in range(WORLD - 1):  # rank 11 leaves no file
        s = [""]
        n = 0 if r == 10 else int(rng.integers(5, 60))
        kinds = [Kind.FILE_OPEN, Kind.FILE_READ, Kind.SHIM] if r == 8 else POOL
        rows = []
        for _ in range(n):  # test data
            k = kinds[int(rng.integers(len(kinds)))]
            t0 = float(rng.integers(0, 40)) * 10  # a coarse grid: ties across kinds
            t1 = t0 + float(rng.integers(0, 3)) * 10
            rows.append(coll(t0, t1, -1, s, op="x", kind=k))
        if r == 9:
            rows.append(coll(0.0, 5.0, -1, s, op="fwd", kind=Kind.FORWARD))
        rows.sort(key=lambda row: row[0])
        write_rank(d, r, WORLD, rows, s, env='{"SLURM_JOB_ID": "77"}')
    return d


def _definitions(run: Run) -> tuple[dict[int, float], dict[int, float], dict[int, float]]:
    """First useful work, first collective and busy-until per rank, straight from their
    definitions, rank by rank over its rows (the table holds every kind)."""
    wm = _wall_map_ns(run)
    assert wm is not None
    ev = run.events
    first: dict[int, float] = {}
    first_coll: dict[int, float] = {}
    busy: dict[int, float] = {}
    for r in sorted(run.ranks):  # test reference: a few ranks
        e = ev[ev["rank"] == r]
        kind, t0, t1 = e["kind"].astype(int), e["t0_ns"].astype(int), e["t1_ns"].astype(int)
        use = np.isin(kind, list(USEFUL))
        if use.any():
            first[r] = (int(t0[use].min()) + wm) / 1e9
        co = np.isin(kind, [int(k) for k in COMM_KINDS])
        if co.any():
            first_coll[r] = (int(t0[co].min()) + wm) / 1e9
        rdv = np.isin(kind, list(RENDEZVOUS))
        if not rdv.any():
            continue
        at = int(t0[rdv].min())
        head = int(kind[np.flatnonzero(rdv & (t0 == at))[0]])
        if head not in SYNC:
            b = at
        else:
            pre = (t0 < at) & (kind != int(Kind.SHIM))
            t_end = np.where(t1 >= t0, t1, t0)
            b = max([run.ranks[r].start_ns] + [min(int(x), at) for x in t_end[pre]])
        busy[r] = (b + wm) / 1e9
    return first, first_coll, busy


def _facts(run: Run) -> tuple[Any, ...]:
    start, first, first_coll, last = rank_milestones(run)
    return start, first, first_coll, last, rank_busy_until(run)


def test_rank_facts_equal_their_definitions(run_dir: Path) -> None:
    run = load_run(run_dir)
    first, first_coll, busy = _definitions(run)
    _, got_first, got_coll, _, got_busy = _facts(run)
    assert got_first == first and got_coll == first_coll and got_busy == busy
    # the cases the run is built for are there
    assert 8 not in got_first and 8 not in got_busy and 10 not in got_first and 11 not in got_first
    assert got_busy[9] == got_first[9]  # a lone first row (a phase): busy until it
    assert len(got_busy) == 9 and any(busy[r] > first[r] - 1 for r in range(8))


@pytest.mark.parametrize("band_events", [1, 7, 50])
def test_rank_facts_do_not_depend_on_the_band_size(run_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                    band_events: int) -> None:  # fmt: skip
    want = _facts(load_run(run_dir))
    assert len(list(bands_mod.bands(load_run(run_dir)))) == 1
    monkeypatch.setattr(bands_mod, "BAND_EVENTS", band_events)
    run = load_run(run_dir)
    assert len(list(bands_mod.bands(run))) > 1
    got = _facts(run)
    assert got == want
    assert [list(d) for d in got] == [list(d) for d in want]  # the same rank order too


def test_rank_facts_with_the_phases_streamed(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    want = _facts(load_run(run_dir))
    monkeypatch.setattr(bands_mod, "BAND_EVENTS", 20)
    run = load_run(run_dir, streamed_kinds=STREAMED_KINDS)
    assert not np.isin(run.events["kind"], STREAMED_KINDS).any()
    assert _facts(run) == want


@pytest.mark.parametrize("streamed", [False, True])
def test_rank_firsts_of_blocks_of_bands_put_together_are_the_whole_pass(run_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                                         streamed: bool) -> None:  # fmt: skip
    # --parallel: each analysis rank computes the firsts of its block of bands
    # (rank_firsts_part), rank 0 puts them together (FirstsPass.reduce)
    from distdiag.slurm import FirstsPass, _rank_firsts, needs_rank_firsts, rank_firsts_part

    kinds = STREAMED_KINDS if streamed else ()
    whole = _rank_firsts(load_run(run_dir, streamed_kinds=kinds))
    monkeypatch.setattr(bands_mod, "BAND_EVENTS", 20)
    run = load_run(run_dir, streamed_kinds=kinds)
    assert needs_rank_firsts(run)  # a Slurm job (SLURM_JOB_ID in the ranks' env) with start times
    for n in (1, 2, 3, 5, 40):  # 40: more blocks than bands (empty blocks)
        run.cache.rank_firsts = FirstsPass().reduce(run, [rank_firsts_part(run, (j, n)) for j in range(n)])
        got = run.cache.rank_firsts
        for f in ("useful_ns", "coll_ns", "rendezvous_ns", "lone"):
            a, b = getattr(whole, f), getattr(got, f)
            assert a.dtype == b.dtype and np.array_equal(a, b), (n, f)
