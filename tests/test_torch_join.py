"""DDP with uneven inputs under ``torch.distributed.algorithms.join.Join``, wrapped and analyzed.

A rank that ran out of data shadows the others' bucket all-reduces through
DDP's join hook; distdiag must record those shadow all-reduces too (they go
through the Reducer's comm hook), so every collective matches and nothing
looks hung or mismatched.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

from distdiag.match import MatchState, collectives_of
from distdiag.pipeline import analyze
from distdiag.schema import Kind
from helpers import run_in_session

pytest.importorskip("torch")

pytestmark = pytest.mark.torch

JOB = Path(__file__).resolve().parent / "jobs" / "torch_join.py"


def test_shadow_all_reduces_of_a_joined_rank_are_recorded_and_match(tmp_path: Path) -> None:
    steps0, steps1 = 6, 3
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "distdiag.wrap", str(JOB), str(steps0), str(steps1)]  # fmt: skip
    env = dict(os.environ, DISTDIAG_DIR=str(tmp_path / "run"), DISTDIAG_HOOKS="fileio=0")
    run_in_session(cmd, 300, cwd=tmp_path, env=env, check=True)
    rep = analyze(tmp_path / "run")
    run = rep.run
    ev = run.events
    bucket_id = run.sid("ddp_bucket_allreduce")
    for r in (0, 1):
        mine = ev["rank"] == r
        n_steps = int((mine & (ev["kind"] == int(Kind.STEP))).sum())
        n_buckets = int((mine & (ev["kind"] == int(Kind.COLL_ASYNC)) & (ev["name_id"] == bucket_id)).sum())
        assert n_steps == (steps0 if r == 0 else steps1), (r, n_steps)
        # one bucket (a 256x256 layer) per backward; rank 1's last 3 are its join hook's shadows
        assert n_buckets == steps0, (r, n_buckets)
    c = collectives_of(run)
    assert len(c) > 0 and (c.g_state == MatchState.COMPLETE).all(), np.unique(c.g_state, return_counts=True)
    bad = [f.kind for f in rep.findings if f.kind in ("hang", "collective_mismatch")]
    assert bad == [] and not [w for w in run.warnings if "incomplete" in w or "missing" in w], (bad, run.warnings)
