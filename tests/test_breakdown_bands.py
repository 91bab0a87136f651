"""The breakdown is tallied band of ranks by band of ranks (distdiag.breakdown.BAND_EVENTS):
the tables must not depend on where the bands fall."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from distdiag import breakdown as bd
from distdiag.clocks import align
from distdiag.match import collectives_of
from distdiag.run import load_run
from distdiag.schema import Kind
from factories import coll, make_run, write_rank


def _row(t0_ms: float, t1_ms: float, kind: int, name: str, s: list[str]) -> tuple[Any, ...]:
    r = list(coll(t0_ms, t1_ms, -1, s, op=name, comm=""))
    r[2] = int(kind)
    return tuple(r)


def _ddp_run(run_dir: Path, ranks: int = 5, steps: int = 6) -> None:
    """DDP-like rows: backward with two buckets (the last rank launches late), optimizer, STEP;
    a read in flight on rank 2."""
    for rank in range(ranks):  # a handful of ranks and steps: test data
        s = [""]
        rows = []
        for k in range(steps):
            t = 10 + 120 * k
            late = 7 * (rank == ranks - 1) + k
            rows += [_row(t, t + 3, Kind.INPUT_WAIT, "DataLoader.__next__", s),
                     _row(t + 5, t + 100, Kind.BACKWARD, "Tensor.backward", s),
                     coll(t + 40 + rank, t + 70, 2 * k, s, op="ddp_bucket_allreduce", comm="ddp0:default",
                          kind=Kind.COLL_ASYNC),
                     coll(t + 80 + late, t + 96 + k, 2 * k + 1, s, op="ddp_bucket_allreduce", comm="ddp0:default",
                          kind=Kind.COLL_ASYNC),
                     _row(t + 100, t + 110, Kind.OPTIMIZER, "SGD", s),
                     _row(t + 110, t + 110, Kind.STEP, "optimizer_step", s)]  # fmt: skip
        inflight = [_row(10 + 120 * steps, -1, Kind.FILE_READ, "read", s)] if rank == 2 else None
        write_rank(run_dir, rank, ranks, rows, s, inflight=inflight, end_mono_ns=(30 + 120 * steps) * 1_000_000)


@pytest.mark.parametrize("kind", ["mpi", "ddp"])
def test_band_size_changes_no_number(tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if kind == "mpi":
        make_run(tmp_path / "r", world_size=6, iters=40, io_ms=0.5, slow_rank=3, slow_ms=2.0, killed_ranks=(4,))
    else:
        _ddp_run(tmp_path / "r")
    run = align(load_run(tmp_path / "r"))
    colls = collectives_of(run)
    monkeypatch.setattr(bd, "BAND_EVENTS", 1 << 40)
    one = bd.breakdown(run, colls)
    one_steps = run.cache.pop("step_breakdown")
    n = len(run.rank_bounds()[0])
    assert len(bd._bands(run, n, bd.BAND_EVENTS)) == 1
    for band in (1, 17, 100):  # one rank a band, a few, uneven
        monkeypatch.setattr(bd, "BAND_EVENTS", band)
        assert len(bd._bands(run, n, band)) > 1
        got = bd.breakdown(run, colls)
        pd.testing.assert_frame_equal(got, one, check_exact=True)
        pd.testing.assert_frame_equal(run.cache.pop("step_breakdown"), one_steps, check_exact=True)
        pd.testing.assert_frame_equal(bd.step_breakdown(run, colls), one_steps, check_exact=True)
        run.cache.pop("step_breakdown")
    assert one["wall_s"].gt(0).all()
    if kind == "ddp":
        assert len(one_steps) == 5 * 6
        assert one["comm_exposed_s"].gt(0).all() and one["comm_overlapped_s"].gt(0).all()
        assert one.set_index("rank").loc[2, "io_s"] == pytest.approx(0.020)  # the read in flight until the end
    else:
        assert one["io_s"].gt(0).all() and one["comm_wait_s"].gt(0).any()
    np.testing.assert_allclose(one[list(bd.COLUMNS)].sum(axis=1), one["wall_s"], rtol=1e-9)
