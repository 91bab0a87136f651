"""Exposed versus overlapped non-blocking collectives, and the per-step breakdown, on rank files with a known truth.

The rows are what the torch hooks record for DDP (BACKWARD phases that include
DDP's finalize, COLL_ASYNC bucket rows from launch to completion, OPTIMIZER,
STEP), written through the shim's writer; the real DDP jobs are in
test_torch_ddp.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from distdiag.breakdown import COLUMNS, per_step, per_step_json, step_breakdown
from distdiag.config import Config
from distdiag.pipeline import analyze
from distdiag.render.text import TextRenderer
from distdiag.schema import Kind
from factories import MS, coll, write_rank


def _row(t0_ms: float, t1_ms: float, kind: int, name: str, s: list[str]) -> tuple[Any, ...]:
    r = list(coll(t0_ms, t1_ms, -1, s, op=name, comm=""))
    r[2] = int(kind)
    return tuple(r)


def _bucket(t0_ms: float, t1_ms: float, seq: int, s: list[str]) -> tuple[Any, ...]:
    return coll(t0_ms, t1_ms, seq, s, op="ddp_bucket_allreduce", comm="ddp0:default", kind=Kind.COLL_ASYNC)


def test_worked_example_of_the_docstring(tmp_path: Path) -> None:
    """Backward [0, 100) ms; buckets [40, 70) and [80, 95) on rank 0; rank 1 launched bucket 2 at 85."""
    s = [""]
    for rank, (launch2, done2) in enumerate([(80, 95), (85, 95)]):
        rows = [_row(0, 100, Kind.BACKWARD, "Tensor.backward", s), _bucket(40, 70, 0, s), _bucket(launch2, done2, 1, s),
                _row(100, 105, Kind.OPTIMIZER, "SGD", s), _row(105, 105, Kind.STEP, "optimizer_step", s)]  # fmt: skip
        write_rank(tmp_path / "r", rank, 2, rows, s, end_mono_ns=120 * MS)
    rep = analyze(tmp_path / "r", Config())
    b = rep.breakdown.set_index("rank")
    # rank 0: [80, 85) waiting for rank 1 to launch bucket 2, [85, 95) its transfer; bucket 1 hidden
    assert b.loc[0, "comm_wait_s"] == pytest.approx(0.005)
    assert b.loc[0, "comm_transfer_s"] == pytest.approx(0.010)
    assert b.loc[0, "comm_exposed_s"] == pytest.approx(0.015)
    assert b.loc[0, "comm_overlapped_s"] == pytest.approx(0.030)
    assert b.loc[0, "compute_s"] == pytest.approx(0.120 - 0.015)
    # rank 1 launched last: no wait, 10 ms exposed transfer
    assert b.loc[1, "comm_wait_s"] == pytest.approx(0.0)
    assert b.loc[1, "comm_transfer_s"] == pytest.approx(0.010)
    assert b.loc[1, "comm_overlapped_s"] == pytest.approx(0.030)
    # the seven columns still add up to the wall
    np.testing.assert_allclose(b[list(COLUMNS)].sum(axis=1), b["wall_s"], rtol=1e-12)


def test_a_bucket_still_waiting_for_a_peer_while_another_transfers_counts_once(tmp_path: Path) -> None:
    """Rank 0 launched buckets at 40 and 80; rank 1 only at 85 and 88: rank 0 waits [80, 88), then transfers to 98."""
    s = [""]
    for rank, launches in enumerate([(40, 80), (85, 88)]):
        rows = [_row(0, 100, Kind.BACKWARD, "Tensor.backward", s), _bucket(launches[0], 95, 0, s),
                _bucket(launches[1], 98, 1, s), _row(100, 100, Kind.STEP, "optimizer_step", s)]  # fmt: skip
        write_rank(tmp_path / "r", rank, 2, rows, s, end_mono_ns=100 * MS)
    b = analyze(tmp_path / "r", Config()).breakdown.set_index("rank")
    assert b.loc[0, "comm_wait_s"] == pytest.approx(0.008)
    assert b.loc[0, "comm_transfer_s"] == pytest.approx(0.010)
    assert b.loc[0, "comm_exposed_s"] == pytest.approx(0.018)
    assert b.loc[1, "comm_wait_s"] == 0.0 and b.loc[1, "comm_transfer_s"] == pytest.approx(0.010)
    np.testing.assert_allclose(b[list(COLUMNS)].sum(axis=1), b["wall_s"], rtol=1e-12)


def test_async_collective_outside_backward_stays_compute(tmp_path: Path) -> None:
    """An async_op all_reduce posted in forward and done before backward: hidden, nothing exposed."""
    s = [""]
    rows = [_row(0, 50, Kind.FORWARD, "Net", s),
            coll(10, 40, 0, s, op="all_reduce", comm="default", kind=Kind.COLL_ASYNC),
            _row(50, 90, Kind.BACKWARD, "Tensor.backward", s), _row(90, 90, Kind.STEP, "optimizer_step", s)]  # fmt: skip
    write_rank(tmp_path / "r", 0, 1, rows, s, end_mono_ns=100 * MS)
    b = analyze(tmp_path / "r", Config()).breakdown.iloc[0]
    assert b["comm_exposed_s"] == 0.0 and b["comm_wait_s"] == 0.0 and b["comm_transfer_s"] == 0.0
    assert b["comm_overlapped_s"] == pytest.approx(0.030)
    assert b["compute_s"] == pytest.approx(0.100)


def _three_steps(run_dir: Path) -> None:
    """Two ranks, three DDP-like steps of 100 ms; in step 1 rank 1 computes 50 ms longer and rank 0 waits for it.

    Per step (ms from its start): loader wait 0-20, forward 20-40, backward
    40-90 (+50 on the slow step) with the one bucket launched at 70 (+50 on
    rank 1) and completed 20 after the last launch (DDP's finalize holds
    backward until then), optimizer for 10, STEP. Rank 0 also reads a file
    across its second step mark (255-265).
    """
    s = [""]
    for rank in range(2):
        rows: list[tuple[Any, ...]] = []
        t = 10.0  # start-up before the first loader wait is no step
        for i in range(3):
            slow = 50.0 if i == 1 else 0.0
            launch = t + 70 + (slow if rank == 1 else 0.0)
            rows += [_row(t, t + 20, Kind.INPUT_WAIT, "DataLoader.__next__", s),
                     _row(t + 20, t + 40, Kind.FORWARD, "Net", s),
                     _row(t + 40, t + 90 + slow, Kind.BACKWARD, "Tensor.backward", s),
                     _bucket(launch, t + 90 + slow, i, s),
                     _row(t + 90 + slow, t + 100 + slow, Kind.OPTIMIZER, "SGD", s),
                     _row(t + 100 + slow, t + 100 + slow, Kind.STEP, "optimizer_step", s)]  # fmt: skip
            t += 100 + slow
        if rank == 0:
            rows.append(_row(255, 265, Kind.FILE_READ, "/data/x", s))
        rows.sort(key=lambda r: r[0])
        write_rank(run_dir, rank, 2, rows, s, end_mono_ns=400 * MS)


def test_per_step_rows_match_the_step_marks(tmp_path: Path) -> None:
    _three_steps(tmp_path / "r")
    rep = analyze(tmp_path / "r", Config())
    steps = step_breakdown(rep.run, rep.collectives)
    assert len(steps) == 6 and list(steps["step"]) == [0, 1, 2] * 2
    r0 = steps[steps["rank"] == 0].set_index("step")
    r1 = steps[steps["rank"] == 1].set_index("step")
    for r in (r0, r1):
        np.testing.assert_allclose(r["wall_s"], [0.100, 0.150, 0.100])
        np.testing.assert_allclose(r["t_s"], [0.010, 0.110, 0.260])  # step 0 opens at the first loader wait
        np.testing.assert_allclose(r["input_wait_s"], [0.020] * 3)
        np.testing.assert_allclose(r["comm_transfer_s"], [0.020] * 3)
    # the read crossing rank 0's mark at 260 ms is split: 5 ms in step 1, 5 ms in step 2
    np.testing.assert_allclose(r0["io_s"], [0.0, 0.005, 0.005])
    # the bucket is exposed from the last launch; in step 1 rank 0 waits 50 ms for rank 1 to launch it
    np.testing.assert_allclose(r0["comm_wait_s"], [0.0, 0.050, 0.0])
    np.testing.assert_allclose(r0["comm_exposed_s"], [0.020, 0.070, 0.020])
    np.testing.assert_allclose(r1["comm_wait_s"], [0.0, 0.0, 0.0])
    np.testing.assert_allclose(r1["compute_s"], [0.060, 0.110, 0.060])
    # the columns add up to each step's wall; rank 0's step 2 counts the 5 ms its read overlapped the loader wait twice
    total = steps[list(COLUMNS)].sum(axis=1).to_numpy()
    np.testing.assert_allclose(total - steps["wall_s"].to_numpy(), [0, 0, 0.005, 0, 0, 0], atol=1e-12)
    # per step over ranks
    agg = per_step(steps)
    np.testing.assert_allclose(agg["median_wall_s"], [0.100, 0.150, 0.100])
    np.testing.assert_allclose(agg["max_comm_wait_s"], [0.0, 0.050, 0.0])
    np.testing.assert_allclose(agg["median_comm_wait_s"], [0.0, 0.025, 0.0])
    # the JSON: one row per step, the same numbers
    js = json.loads(json.dumps(rep.to_json()))["breakdown"]["per_step"]
    assert js["bin"] == 1 and [r["step"] for r in js["rows"]] == [0, 1, 2]
    assert js["rows"][1]["max"]["wall_s"] == pytest.approx(0.150)
    assert js["rows"][1]["max"]["comm_wait_s"] == pytest.approx(0.050)
    assert js["summary"]["steps"] == 3 and js["summary"]["step_s"]["median"] == pytest.approx(0.100)
    assert sum(js["summary"]["share"][c] for c in COLUMNS) == pytest.approx(1.0 + 0.005 / 0.7)  # that 5 ms again
    # the text report's one line
    text = TextRenderer(color=False).render(rep)
    assert "steps: 3, median 100.0 ms (slowest rank's 100.0 ms): compute " in text, text
    # the pandas API hands out the same table
    from distdiag.frames import RunFrames

    assert RunFrames(rep).per_step.equals(steps)


def test_long_runs_bin_consecutive_steps(tmp_path: Path) -> None:
    _three_steps(tmp_path / "r")
    rep = analyze(tmp_path / "r", Config())
    js = per_step_json(step_breakdown(rep.run, rep.collectives), max_rows=2)
    assert js["bin"] == 2
    assert [(r["step"], r["steps"]) for r in js["rows"]] == [(0, 2), (2, 1)]
    # a bin holds the mean of its steps: the total still adds up
    assert js["rows"][0]["max"]["wall_s"] == pytest.approx((0.100 + 0.150) / 2)
    assert js["rows"][1]["max"]["wall_s"] == pytest.approx(0.100)
    assert js["summary"]["steps"] == 3


def test_no_step_marks_gives_an_empty_per_step(tmp_path: Path) -> None:
    s = [""]
    write_rank(tmp_path / "r", 0, 1, [coll(1, 2, 0, s)], s, end_mono_ns=5 * MS)
    rep = analyze(tmp_path / "r", Config())
    js = rep.to_json()["breakdown"]["per_step"]
    assert js["rows"] == [] and js["summary"] == {"steps": 0}
    assert "steps:" not in TextRenderer(color=False).render(rep)


@pytest.mark.parametrize("far", [0, np.iinfo(np.int64).max // 4], ids=["banded", "lexsort"])
def test_marks_at_or_before_a_time_are_counted_in_rank_time_order(far: int) -> None:
    """Both paths of the search (rank bands, and the lexsort for time ranges too long for bands) against a count."""
    from distdiag.breakdown import _marks_up_to

    rng = np.random.default_rng(1)
    b_rank, b_t = rng.integers(0, 5, 200), rng.integers(0, 1000, 200)
    b_t = b_t + np.where(b_t > 500, far, 0)
    o = np.lexsort((b_t, b_rank))
    b_rank, b_t = b_rank[o], b_t[o]
    q_rank, q_t = rng.integers(0, 6, 500), rng.integers(-5, 1005, 500)
    q_t = q_t + np.where(q_t > 500, far, 0)
    want = [int(((b_rank < r) | ((b_rank == r) & (b_t <= t))).sum()) for r, t in zip(q_rank, q_t)]
    assert _marks_up_to(b_rank, b_t, q_rank, q_t).tolist() == want
