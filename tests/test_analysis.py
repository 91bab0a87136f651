"""What a detector is given (distdiag.analysis): the detectors' declared ``requires`` decide
which per-rank passes the pipeline sweeps, and a detector reads its inputs from the Analysis."""

from __future__ import annotations

from pathlib import Path

import pytest

from distdiag.analysis import PRODUCTS, Analysis
from distdiag.clocks import align
from distdiag.config import Config
from distdiag.critical_path import PRICED_KINDS, needs_costs
from distdiag.detectors import DETECTORS, REQUIRES, load_all, register, required
from distdiag.findings import Finding
from distdiag.passes import analysis_passes
from distdiag.pipeline import analyze
from distdiag.run import load_run
from test_torch_detectors import make_torch_run


def test_every_detector_declares_known_products() -> None:
    dets = load_all()
    assert set(REQUIRES) >= set(dets)
    for name in dets:
        assert set(REQUIRES[name]) <= set(PRODUCTS), name
    # the detectors that price input waits and copies are the ones that require their pass
    assert {n for n in dets if "costs" in REQUIRES[n]} == {"input_bound", "h2d_copy"}
    with pytest.raises(ValueError, match="unknown products"):
        register("bad_test_only", requires=("breakdwon",))


def test_the_costs_pass_is_swept_only_for_a_detector_that_requires_it(tmp_path: Path) -> None:
    make_torch_run(tmp_path, world=3, iters=11, input_ms=20.0, compute_ms=30.0)
    run = align(load_run(tmp_path))
    load_all()
    assert needs_costs(run, Config())  # every detector: input_bound among them
    assert needs_costs(run, Config(detectors=["input_bound"]))
    assert not needs_costs(run, Config(detectors=["straggler", "startup"]))
    assert "costs" not in required(["straggler", "startup"])

    seen: list[Analysis] = []

    def reader(an: Analysis) -> list[Finding]:  # a detector that prices input waits
        seen.append(an)
        p = an.priced(PRICED_KINDS[0], 0.0)
        return [Finding(kind="input_bound", cost_s=p.cost_s, summary="test")] if p is not None else []

    register("costs_test_only", requires=("costs",))(reader)
    try:
        assert needs_costs(run, Config(detectors=["costs_test_only"]))
        todo = analysis_passes(object(), False, needs_costs(run, Config(detectors=["costs_test_only"])))
        assert any(type(p).__name__ == "CostsPass" for p in todo.values())
        rep = analyze(tmp_path, Config(detectors=["costs_test_only"]))
    finally:
        del DETECTORS["costs_test_only"], REQUIRES["costs_test_only"]
    (an,) = seen
    assert an.run is rep.run and an.colls is rep.collectives  # the pipeline's own, not a copy
    (f,) = rep.findings
    # the same price input_bound gives from the same pass
    (ib,) = [g for g in analyze(tmp_path, Config(detectors=["input_bound"])).findings]
    assert f.cost_s == pytest.approx(ib.cost_s)


def test_every_analyzer_module_is_checked_as_under_mypy_strict() -> None:
    # issue 19: the analyzer (all of distdiag but the shim) is typed strictly; a new module that
    # is not in pyproject.toml's strict list would silently escape the check
    import tomllib

    root = Path(__file__).resolve().parent.parent
    conf = tomllib.loads((root / "pyproject.toml").read_text())
    strict = next(o for o in conf["tool"]["mypy"]["overrides"] if o.get("disallow_untyped_defs"))
    listed = set(strict["module"])
    for p in sorted((root / "distdiag").rglob("*.py")):  # a few dozen modules
        rel = p.relative_to(root).with_suffix("")
        if len(rel.parts) > 2 and rel.parts[1] == "shim":
            continue
        mod = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        parent = ".".join(rel.parts[:-1]) + ".*"
        assert mod in listed or parent in listed, f"{mod} is not in pyproject.toml's mypy strict list"


def test_a_new_kind_takes_its_place_in_the_ranking_from_the_role_it_declares(tmp_path: Path) -> None:
    # the ranking keeps no table of detector names: a cause of a kind it has never seen explains a
    # straggler's window when its detector declares it a mechanism, and nothing when it declares none
    import numpy as np

    from distdiag.ranking import rank_findings
    from distdiag.roles import ROLES, Role

    make_torch_run(tmp_path, world=3, iters=11, compute_ms=30.0)
    run = align(load_run(tmp_path))
    an = Analysis.of(run, Config())
    one = np.array([1], np.int64)
    win = (one, np.array([0], np.int64), np.array([10**9], np.int64), np.array([4 * 10**8], np.int64))
    claim = (one, np.array([0], np.int64), np.array([10**9], np.int64))

    def ranked(role: Role | None) -> list[Finding]:
        if role is not None:
            ROLES["cause_test_only"] = role
        try:
            late = Finding(kind="straggler", cost_s=0.4, summary="late", ranks=[1], windows=lambda r, c: win)
            cause = Finding(kind="cause_test_only", cost_s=1.0, summary="held", ranks=[1], claims=claim)
            return rank_findings([late, cause], an.run, an.colls, an.cfg)
        finally:
            ROLES.pop("cause_test_only", None)

    assert [f.kind for f in ranked(None)] == ["cause_test_only", "straggler"]  # no role: explains nothing
    got = ranked(Role(tier=0))
    assert [f.kind for f in got] == ["cause_test_only"]  # a mechanism: the straggler's 0.4 s are its own
    assert got[0].evidence["includes"] == {"straggler ranks 1": 0.4}
