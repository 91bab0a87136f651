"""The per-rank breakdown against the simulation's truth."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from distdiag.breakdown import breakdown
from distdiag.intervals import union_length_by_key
from distdiag.clocks import align
from distdiag.config import Config
from distdiag.pipeline import analyze
from distdiag.run import load_run
from distdiag.schema import Kind
from factories import MS, coll, make_run, write_rank


def test_breakdown_matches_the_simulated_truth(tmp_path: Path) -> None:
    t = make_run(tmp_path / "r", iters=80, slow_rank=3, slow_ms=2.0, io_ms=0.5, clock_offsets_ms=[0, 700, -90, 3])
    df = breakdown(align(load_run(tmp_path / "r")))
    assert list(df["rank"]) == [0, 1, 2, 3]
    tol = 1e-6
    np.testing.assert_allclose(df["comm_wait_s"], t.comm_wait_ns / 1e9, atol=tol)
    np.testing.assert_allclose(df["comm_transfer_s"], t.comm_transfer_ns / 1e9, atol=tol)
    np.testing.assert_allclose(df["io_s"], t.io_ns / 1e9, atol=tol)
    # the simulation's compute before each rank's first all-reduce is its startup (no step, no
    # rendezvous yet): taken out of compute, the two add up to the simulated compute
    np.testing.assert_allclose(df["compute_s"] + df["startup_s"], t.compute_ns / 1e9, atol=tol)
    assert (df["startup_s"] > 0).all() and (df["startup_s"] < 2 * t.compute_ns / 1e9 / 80).all()
    assert df["comm_wait_s"][3] == 0.0  # the straggler never waits
    assert (df[["input_wait_s", "h2d_s", "other_s"]].to_numpy() == 0).all()
    np.testing.assert_allclose(df["wall_s"], t.wall_ns / 1e9, atol=tol)


def test_overlapping_calls_on_two_threads_count_once() -> None:
    key = np.array([0, 0, 0, 1])
    t0 = np.array([0, 2, 8, 5])
    t1 = np.array([10, 5, 12, 6])
    np.testing.assert_array_equal(union_length_by_key(key, t0, t1, 3), [12, 1, 0])


def test_phases_and_point_to_point_land_in_their_columns(tmp_path: Path) -> None:
    s = [""]

    def row(t0: float, t1: float, kind: int, name: str) -> tuple:
        r = list(coll(t0, t1, -1, s, op=name, comm=""))
        r[2] = int(kind)
        return tuple(r)

    rows = [row(0, 100, Kind.FORWARD, "forward"), row(10, 20, Kind.INPUT_WAIT, "next"), row(20, 25, Kind.H2D, "copy"),
            row(30, 40, Kind.RECV, "Recv"), row(50, 60, Kind.FILE_STAT, "/etc"), row(55, 65, Kind.FILE_READ, "/etc")]  # fmt: skip
    write_rank(tmp_path / "r", 0, 1, rows, s, mono_ns_at_start=0, end_mono_ns=200 * MS)
    rep = analyze(tmp_path / "r", Config())
    r = rep.breakdown.iloc[0]
    assert r["wall_s"] == pytest.approx(0.2)
    assert r["input_wait_s"] == pytest.approx(0.010)
    assert r["h2d_s"] == pytest.approx(0.005)
    assert r["other_s"] == pytest.approx(0.010)
    assert r["io_s"] == pytest.approx(0.015)  # stat and read overlap by 5 ms: counted once
    # compute: the 200 ms minus every call above (the forward phase is compute)
    assert r["compute_s"] == pytest.approx(0.2 - 0.010 - 0.005 - 0.010 - 0.015)


def test_a_collective_that_never_completed_is_all_waiting(tmp_path: Path) -> None:
    s = [""]
    write_rank(tmp_path / "r", 0, 2, [coll(1, 2, 0, s)], s, inflight=[coll(3, -1, 1, s)], closed_cleanly=False,
               end_mono_ns=None, exit_code=None, last_flush_mono_ns=13 * MS)  # fmt: skip
    write_rank(tmp_path / "r", 1, 2, [coll(1.5, 2, 0, s)], s, end_mono_ns=5 * MS)
    df = breakdown(align(load_run(tmp_path / "r")))
    # rank 0: seq 0 waited 0.5 ms for rank 1, then 0.5 ms transfer; seq 1 in flight from 3 ms to its end at 13 ms
    assert df["comm_wait_s"][0] == pytest.approx(0.0005 + 0.010)
    assert df["comm_transfer_s"][0] == pytest.approx(0.0005)
