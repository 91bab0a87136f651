"""The JSON report is a stable contract (DESIGN.md): keys, types, ordering, and that it round-trips."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from distdiag.config import Config
from distdiag.pipeline import REPORT_SCHEMA, analyze
from distdiag.render import RENDERERS, render
from factories import make_run

RUN_KEYS = {"ranks": int, "hosts": list, "job_id": str, "wall_s": float, "missing_ranks": list, "warnings": list}
FINDING_KEYS = {"kind": str, "cost_s": float, "fraction": float, "ranks": list, "hosts": list, "links": list,
                "paths": list, "summary": str, "evidence": dict}  # fmt: skip
PER_RANK_KEYS = {"rank": int, "compute_s": float, "comm_wait_s": float, "comm_transfer_s": float, "io_s": float,
                 "input_wait_s": float, "h2d_s": float, "other_s": float}  # fmt: skip


def _json(run_dir: Path) -> dict:
    return json.loads(render(analyze(run_dir, Config()), "json"))


def _check_types(obj: dict, spec: dict[str, type]) -> None:
    for k, typ in spec.items():
        assert k in obj, k
        assert isinstance(obj[k], typ) and not (typ is int and isinstance(obj[k], bool)), (k, obj[k])


@pytest.mark.parametrize("case", ["straggler", "healthy", "missing_and_killed"])
def test_report_keys_and_types(tmp_path: Path, case: str) -> None:
    kw = {"straggler": dict(slow_rank=1, slow_ms=2.0), "healthy": {},
          "missing_and_killed": dict(skip_ranks=[3], killed_ranks=[2], slow_rank=0, slow_ms=2.0)}[case]  # fmt: skip
    make_run(tmp_path / "r", iters=60, io_ms=0.2, **kw)
    rep = _json(tmp_path / "r")
    assert set(rep) == {"schema", "run", "findings", "breakdown", "children"}
    assert rep["children"] == []  # no forked processes' files (distdiag/children.py)
    assert rep["schema"] == REPORT_SCHEMA == "distdiag.report/1"
    _check_types(rep["run"], RUN_KEYS)
    assert rep["run"]["ranks"] == 4 and rep["run"]["job_id"] == "4242"
    assert rep["run"]["hosts"] == ["node0", "node1"]
    assert all(isinstance(w, str) for w in rep["run"]["warnings"])
    assert rep["run"]["wall_s"] > 0
    for f in rep["findings"]:
        _check_types(f, FINDING_KEYS)
        assert all(isinstance(r, int) for r in f["ranks"])
        assert f["fraction"] == pytest.approx(f["cost_s"] / rep["run"]["wall_s"])
    costs = [f["cost_s"] for f in rep["findings"]]
    assert costs == sorted(costs, reverse=True)
    # coverage: the categories above 10% of a rank's wall and what explains them (distdiag.ranking.coverage)
    assert set(rep["breakdown"]) == {"per_rank", "per_step", "coverage"}
    for c in rep["breakdown"]["coverage"]:
        assert isinstance(c["explained_by"], list) and (c["binds"] is None) == bool(c["explained_by"])
    for row in rep["breakdown"]["per_rank"]:
        _check_types(row, PER_RANK_KEYS)
        assert all(row[k] >= 0 for k in PER_RANK_KEYS if k != "rank")
        # information columns, not part of the sum (distdiag/breakdown.py)
        assert row["comm_exposed_s"] == 0.0 and row["comm_overlapped_s"] == 0.0  # no non-blocking collective here
    # no STEP rows in these runs: the per-step table is there, empty
    assert rep["breakdown"]["per_step"] == {"summary": {"steps": 0}, "bin": 1, "rows": []}
    present = 3 if case == "missing_and_killed" else 4
    assert [r["rank"] for r in rep["breakdown"]["per_rank"]] == list(range(present))
    if case == "healthy":
        assert rep["findings"] == [] and rep["run"]["warnings"] == [] and rep["run"]["missing_ranks"] == []
    else:
        assert rep["findings"][0]["kind"] == "straggler"
    if case == "missing_and_killed":
        assert rep["run"]["missing_ranks"] == [3]
        assert rep["findings"][0]["ranks"] == [0]


def test_text_report_leads_with_the_verdict(tmp_path: Path) -> None:
    make_run(tmp_path / "s", iters=60, slow_rank=1, slow_ms=2.0)
    text = render(analyze(tmp_path / "s", Config()), "text")
    lines = text.splitlines()
    assert lines[2].startswith("VERDICT: straggler -- rank 1 arrived last at 100% of 59 Allreduce calls")
    assert lines[3].startswith("  cost: ") and "% of the wall-clock" in lines[3]
    assert any(line.startswith("  what to do: ") for line in lines[:12])
    assert "FINDINGS" in text and "PER-RANK BREAKDOWN" in text
    make_run(tmp_path / "h", iters=60)
    healthy = render(analyze(tmp_path / "h", Config()), "text").splitlines()
    assert healthy[2].startswith("VERDICT: healthy.") and healthy[3].startswith("  time went to: compute")


def test_every_registered_format_renders(tmp_path: Path) -> None:
    make_run(tmp_path / "r", iters=10)
    rep = analyze(tmp_path / "r", Config())
    for fmt in RENDERERS:
        assert render(rep, fmt)


def test_a_failing_detector_costs_its_findings_not_the_report(tmp_path: Path) -> None:
    from distdiag.detectors import DETECTORS, load_all
    from distdiag.findings import Finding

    load_all()

    def broken(a: object) -> list[Finding]:
        raise ZeroDivisionError("boom")

    def nan_cost(a: object) -> list[Finding]:
        return [Finding(kind="straggler", cost_s=float("nan"), summary="?")]

    make_run(tmp_path / "r", iters=30, slow_rank=1, slow_ms=2.0)
    DETECTORS["broken_test_only"] = broken
    DETECTORS["nan_test_only"] = nan_cost
    try:
        rep = json.loads(render(analyze(tmp_path / "r", Config()), "json"))
    finally:
        del DETECTORS["broken_test_only"], DETECTORS["nan_test_only"]
    assert rep["findings"][0]["ranks"] == [1]
    w = rep["run"]["warnings"]
    assert "detector 'broken_test_only' failed (ZeroDivisionError: boom); its findings are missing" in w
    assert any("nan_test_only" in x and "finite" in x for x in w)
