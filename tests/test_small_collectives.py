"""small_collectives: small collectives called back to back, each paying its per-call latency.

A real 4-rank MPI job (tests/jobs/small_collectives.py) that all-reduces 2,000 values one
a call each step (blocking, or non-blocking: waited one by one or all at once), run by turns
with its twin that all-reduces the same values in one call:
the price is checked against what the twin saved, measured in the test. Synthetic runs
(tests/factories.make_run) for what stays silent: a step's one small all-reduce after work.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from distdiag.analysis import Analysis
from distdiag.config import Config
from distdiag.detectors import small_collectives
from distdiag.pipeline import Report, analyze
from factories import make_run
from truth import Twins, assert_prices_median, assert_silent_twin, mpi_twins, verdict_prices

JOB = Path(__file__).resolve().parent / "jobs" / "small_collectives.py"


def of_kind(rep: Report, kind: str) -> list:
    return [f for f in rep.findings if f.kind == kind]


def test_a_small_all_reduce_after_each_steps_work_is_no_finding(tmp_path: Path) -> None:
    # 8 KiB all-reduces, 0.9 ms each, after 2 ms of work: small, but not back to back (the next
    # step's call needs this one's result); and back to back with 0.05 ms of work between calls
    # of 0.3 ms, priced at what their transfers took
    make_run(tmp_path / "r", iters=100, compute_ms=2.0, transfer_ms=0.9)
    rep = analyze(tmp_path / "r", Config())
    assert of_kind(rep, "small_collectives") == []
    # nothing to fuse is no finding, whatever the threshold (it was a crash at min_fraction 0)
    zero = Config(sections={"small_collectives": {"min_fraction": 0.0}})
    assert small_collectives.detect(Analysis.of(rep.run, zero)) == []
    make_run(tmp_path / "b", iters=2000, compute_ms=0.05, jitter_ms=0.01, transfer_ms=0.3)
    rep = analyze(tmp_path / "b", Config())
    (f,) = of_kind(rep, "small_collectives")
    assert f.evidence["calls"] == 1999 and f.evidence["median_bytes"] == 8192, f.evidence
    # each call's last arrival to its last exit: 0.3 ms and the members' exits, up to 20 us apart
    assert f.evidence["detector_cost_s"] == pytest.approx(1999 * 0.315e-3, rel=0.03)
    assert rep.verdict is f
    # large calls back to back are not small ones
    make_run(tmp_path / "l", iters=2000, compute_ms=0.05, jitter_ms=0.01, transfer_ms=0.3, nbytes=1 << 20)
    assert of_kind(analyze(tmp_path / "l", Config()), "small_collectives") == []


@pytest.fixture(scope="module", params=["blocking", "each", "all"])
def small(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Twins[Report]:
    """2 pairs by turns: 10 steps of 20 ms of work, then 2,000 values all-reduced one a call
    (faulty) or in one call (the twin): blocking, each call an ``Iallreduce`` waited for at once
    (``each``), or the step's calls posted and then waited for in one ``Waitall`` (``all``)."""
    how = () if request.param == "blocking" else ("--nonblocking", request.param)
    return mpi_twins(tmp_path_factory.mktemp(f"small_{request.param}"), JOB, ("--per-call", "1", *how),
                     ("--per-call", "2000", *how))  # fmt: skip


@pytest.mark.mpi
def test_mpi_small_collectives_are_the_verdict_at_what_fusing_saves(small: Twins[Report]) -> None:
    # Measured here (2 cores), loops against the twin's: blocking 6.3 s against 0.2; each 0.92 s,
    # priced 0.60 s of 0.71 saved (the completions are stamped after the waits that see them);
    # all 3.11 s, priced 2.67 s of 2.90 (before: network_bound, "0.0 MB/s", each a nothing priced)
    costs = verdict_prices(small.faulty, "small_collectives")
    for rep in small.faulty:
        ev = rep.findings[0].evidence
        assert ev["calls"] >= 19_000 and ev["median_bytes"] == 8, ev
        assert of_kind(rep, "network_bound") == []  # small calls cost their latency, not their bytes
    print(f"small_collectives priced {', '.join(f'{c:.3f}' for c in costs)} s: {small.saving}")
    assert_prices_median(small.saving, costs, rel=0.25, what="small_collectives cost")


@pytest.mark.mpi
def test_mpi_fused_twin_has_no_finding_and_no_unexplained_transfer(small: Twins[Report]) -> None:
    assert_silent_twin(small.healthy, "comm_transfer_s")
