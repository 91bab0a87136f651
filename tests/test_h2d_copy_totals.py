"""h2d_copy totals its copy rows by blocks of rows (distdiag.detectors.h2d_copy._BLOCK):
the evidence must not depend on the block size, and must be the simulation's truth."""

from __future__ import annotations

from pathlib import Path

import pytest

from distdiag.analysis import Analysis
from distdiag.clocks import align
from distdiag.config import Config
from distdiag.detectors import h2d_copy
from distdiag.run import load_run
from test_torch_detectors import make_torch_run


def test_copy_totals_by_blocks_are_the_truth(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_torch_run(tmp_path, world=3, iters=11, h2d_ms=25.0, h2d_bytes=50_000_000, compute_ms=30.0)
    run = align(load_run(tmp_path))
    (one,) = h2d_copy.detect(Analysis.of(run, Config()))
    assert h2d_copy._copy_totals(run) == (3 * 11, 3 * 11 * 25_000_000, 3 * 11 * 50_000_000)
    assert one.evidence["copies"] == 33 and one.evidence["bytes"] == 33 * 50_000_000
    assert one.evidence["copy_s"] == pytest.approx(33 * 0.025)
    for block in (1, 4):  # one row a block; blocks that do not divide the rows
        monkeypatch.setattr(h2d_copy, "_BLOCK", block)
        (got,) = h2d_copy.detect(Analysis.of(run, Config()))
        assert (got.summary, got.evidence, got.cost_s) == (one.summary, one.evidence, one.cost_s)
