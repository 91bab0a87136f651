"""The synthetic run generator: its fault runs are diagnosed by the real analyzer.

Each fault is injected by ``distdiag.synth`` into real rank files (the shim's
writer), then the whole pipeline runs on them: the fault must be the verdict,
on the right rank or host, at a cost near the simulation's truth; the healthy
run and the clock-skewed run must stay silent. These double as fast
end-to-end tests of the straggler, slow_link, metadata_storm and
serial_section detectors and of clock alignment.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from distdiag.pipeline import analyze
from distdiag.render import render
from distdiag.run import load_run
from distdiag.synth import FAULTS, load_truth, synth

RANKS = 16
EVENTS = 1000
RPH = 4  # ranks per host: 4 hosts

#: fault -> the finding kind that must be the verdict
VERDICT = {"straggler": "straggler", "slow_link": "slow_link", "storm": "metadata_storm", "serial": "serial_section"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("synth")
    out = {}
    for fault in FAULTS:  # six small runs, ~0.2 s each
        d = base / fault
        synth(d, ranks=RANKS, events=EVENTS, fault=fault, ranks_per_host=RPH, seed=3)
        out[fault] = d
    return out


@pytest.mark.parametrize("fault", sorted(VERDICT))
def test_fault_is_the_verdict_on_the_right_rank_or_host(runs: dict[str, Path], fault: str) -> None:
    truth = load_truth(runs[fault])
    rep = analyze(runs[fault])
    assert rep.verdict is not None, f"{fault}: no finding"
    v = rep.verdict
    assert v.kind == VERDICT[fault], [(f.kind, f.cost_s) for f in rep.findings]
    if truth["fault_rank"] >= 0:
        assert v.ranks == [truth["fault_rank"]]
    if truth["fault_host"]:
        assert truth["fault_host"] in v.hosts and len(v.hosts) == 1
    # the cost is the simulation's saving, within the jitter (straggler: the
    # second-to-last arrival is up to 2 * jitter * compute behind the mean)
    assert v.cost_s == pytest.approx(truth["expected_cost_s"], rel=0.12)
    assert not rep.run.warnings


@pytest.mark.parametrize("fault", ["none", "skew"])
def test_healthy_and_skewed_runs_are_silent(runs: dict[str, Path], fault: str) -> None:
    rep = analyze(runs[fault])
    assert rep.findings == [], [(f.kind, f.cost_s, f.summary) for f in rep.findings]
    assert not rep.run.warnings


def test_skewed_clocks_are_aligned_to_the_truth(runs: dict[str, Path]) -> None:
    truth = load_truth(runs["skew"])
    assert max(abs(d) for d in truth["drift_ppm"]) > 5  # the run really drifts
    assert max(abs(o) for o in truth["offset_ns"]) > 1e9  # and its clocks are seconds apart
    rep = analyze(runs["skew"])
    assert rep.run.offset_ns is not None
    err_ns = np.abs(np.asarray(rep.run.offset_ns[:RANKS]) - np.asarray(truth["offset_ns"]))
    assert err_ns.max() < 50_000  # within the sync exchanges' error bars (RTT/2 <= 100 µs)


def test_files_have_the_shim_layout_and_the_asked_size(runs: dict[str, Path]) -> None:
    run = load_run(runs["none"])
    assert sorted(run.ranks) == list(range(RANKS))
    counts = np.bincount(run.events["rank"], minlength=RANKS)
    # whole iterations of 2 events; host leaders carry the probe rows on top
    assert np.all(counts >= EVENTS - 2) and np.all(counts <= EVENTS + 2 * (RANKS // RPH) + 1)
    with h5py.File(runs["none"] / "rank-00000.h5") as f:
        assert set(f) == {"events", "strings", "clock_sync", "inflight", "gpu"}
        assert f.attrs["closed_cleanly"]
    assert run.hosts == [f"node{h:04d}" for h in range(RANKS // RPH)]


def test_same_seed_same_files_other_seed_other_files(tmp_path: Path) -> None:
    a = synth(tmp_path / "a", ranks=4, events=200, fault="straggler", seed=1)
    b = synth(tmp_path / "b", ranks=4, events=200, fault="straggler", seed=1)
    c = synth(tmp_path / "c", ranks=4, events=200, fault="straggler", seed=2)
    assert a.fault_rank == b.fault_rank
    with h5py.File(tmp_path / "a/rank-00002.h5") as fa, h5py.File(tmp_path / "b/rank-00002.h5") as fb, \
            h5py.File(tmp_path / "c/rank-00002.h5") as fc:  # fmt: skip
        assert np.array_equal(fa["events"][:], fb["events"][:])
        assert not np.array_equal(fa["events"][:], fc["events"][:])
    assert c.total_events == a.total_events


def test_unknown_fault_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown fault"):
        synth(tmp_path, ranks=2, events=100, fault="meteor")


def test_cli_writes_a_run_the_cli_analyzes(tmp_path: Path) -> None:
    d = tmp_path / "run"
    got = subprocess.run([sys.executable, "-m", "distdiag.cli", "synth", str(d), "--ranks", "8", "--events", "400",
                          "--fault", "straggler", "--ranks-per-host", "2"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert got.returncode == 0, got.stderr
    assert "fault straggler on rank 5" in got.stdout
    rep = subprocess.run([sys.executable, "-m", "distdiag.cli", "analyze", str(d), "--format", "json"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert rep.returncode == 0, rep.stderr
    js = json.loads(rep.stdout)
    assert js["findings"][0]["kind"] == "straggler" and js["findings"][0]["ranks"] == [5]
    assert render(analyze(d), "json")  # the library path renders the same run
