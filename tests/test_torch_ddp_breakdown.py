"""A real 2-rank DDP job on gloo whose gradient buckets take measurable time: exposed comm and the per-step table.

One torchrun launch (torch's import dominates it on 2 cores). Two 1536x1536
linear layers (9.4 MB of gradient each) with 4 MB buckets: several bucket
all-reduces per step, the later ones launched near the end of backward, so
DDP's finalize really waits for them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from distdiag.breakdown import COLUMNS, step_breakdown
from distdiag.pipeline import Report, analyze
from distdiag.render.text import TextRenderer
from distdiag.schema import Kind

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.torch

STEPS = 8


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> Report:
    from test_torch_ddp import torchrun

    tmp = tmp_path_factory.mktemp("ddp_big")
    torchrun(tmp, ["--steps", str(STEPS), "--batch", "16", "--width", "1536", "--bucket-mb", "4"], nproc=2)
    return analyze(tmp / "run")


def _rows(rep: Report, rank: int, kind: int) -> Any:
    ev = rep.run.events
    return ev[(ev["rank"] == rank) & (ev["kind"] == kind)]


def test_exposed_bucket_time_leaves_compute_and_the_columns_still_sum_to_the_wall(big: Report) -> None:
    b = big.breakdown.set_index("rank")
    for r in (0, 1):
        buckets = _rows(big, r, Kind.COLL_ASYNC)
        assert len(buckets) > STEPS, len(buckets)  # several buckets per step (DDP rebuilds them after step 0)
        # The rule, one backward at a time in plain Python (8 rows): from the last
        # launch inside the backward to the latest completion, up to its end.
        want = 0
        for b0, b1 in _rows(big, r, Kind.BACKWARD)[["t0_ns", "t1_ns"]]:
            mine = buckets[(buckets["t0_ns"] >= b0) & (buckets["t0_ns"] < b1)]
            assert len(mine), "every backward launched its buckets"
            c = int(mine["t0_ns"].max())
            want += max(0, min(int(mine["t1_ns"].max()), int(b1)) - c)
        exposed = float(b.loc[r, "comm_exposed_s"])
        assert exposed > 0.0
        assert exposed == pytest.approx(want / 1e9, rel=1e-9, abs=1e-9)
        # exposed time moved from compute into the two comm columns, the rest is hidden behind backward
        assert float(b.loc[r, "comm_wait_s"] + b.loc[r, "comm_transfer_s"]) >= exposed - 1e-9
        assert float(b.loc[r, "comm_overlapped_s"]) > 0.0
        spans = float((buckets["t1_ns"] - buckets["t0_ns"]).sum()) / 1e9
        assert exposed + float(b.loc[r, "comm_overlapped_s"]) <= spans + 1e-9
    # the seven columns still add up to each rank's wall
    np.testing.assert_allclose(b[list(COLUMNS)].sum(axis=1), b["wall_s"], rtol=1e-9)


def test_per_step_table_has_one_row_per_step_with_the_step_rows_durations(big: Report) -> None:
    steps = step_breakdown(big.run, big.collectives)
    js = json.loads(json.dumps(big.to_json()))["breakdown"]["per_step"]
    assert js["bin"] == 1 and [row["step"] for row in js["rows"]] == list(range(STEPS))
    assert all(row["ranks"] == 2 for row in js["rows"])
    dur = []
    for r in (0, 1):
        marks = _rows(big, r, Kind.STEP)["t0_ns"]
        assert len(marks) == STEPS
        mine = steps[steps["rank"] == r].sort_values("step")
        assert list(mine["step"]) == list(range(STEPS))
        # step k > 0 runs from STEP row k-1 to STEP row k
        np.testing.assert_allclose(mine["wall_s"].to_numpy()[1:], np.diff(marks) / 1e9, rtol=1e-12)
        np.testing.assert_allclose(mine[list(COLUMNS)].sum(axis=1), mine["wall_s"], rtol=1e-9)
        assert (mine["comm_exposed_s"] > 0).all()  # every step waited for its last buckets
        dur.append(mine["wall_s"].to_numpy())
    np.testing.assert_allclose([row["max"]["wall_s"] for row in js["rows"]], np.max(dur, axis=0), rtol=1e-12)
    np.testing.assert_allclose(js["summary"]["step_s"]["median"], np.median(np.median(dur, axis=0)), rtol=1e-12)
    assert f"steps: {STEPS}, median " in TextRenderer(color=False).render(big)
