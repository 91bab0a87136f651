"""serial_section's per-rank queries (the late rank's recorded activity inside a window, what it
did there) are answered band by band (distdiag.bands): the compute phases among the activity
kinds are streamed, so nothing may read them from run.events, and nothing may depend on where
the bands fall."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from distdiag import bands as bd
from distdiag.clocks import align
from distdiag.detectors import serial_section as ss
from distdiag.pipeline import analyze
from distdiag.run import load_run
from distdiag.schema import Kind
from distdiag.synth import synth
from factories import coll, write_rank

MS = 1_000_000
#: one band for the whole run, then tiny ones: a rank a band, a few ranks, uneven
BAND_SIZES = (1 << 40, 1, 7, 20)


def _act(t0_ms: float, t1_ms: float, kind: int, name: str, s: list[str], site: str = "job.py:9") -> tuple[Any, ...]:
    r = list(coll(t0_ms, t1_ms, -1, s, op=name, comm=""))
    r[2] = int(kind)
    if site not in s:
        s.append(site)
    r[9] = s.index(site)
    return tuple(r)


def _small_run(run_dir: Path, ranks: int = 6) -> Any:
    """Per rank r: phases [10, 14] and [20, 30] ms, a write at [12, 13] ms (rank 1: also a read at
    [40, 45] ms), two all-reduces and a STEP (not activity); rank 4 records no activity at all."""
    for rank in range(ranks):  # a handful of ranks: test data
        s = [""]
        rows = [coll(1, 2, 0, s)]
        if rank != 4:
            rows += [_act(10, 14, Kind.PHASE, "evaluate", s), _act(12, 13, Kind.FILE_WRITE, "/log", s),
                     _act(20, 30, Kind.FORWARD, "Model.forward", s)]  # fmt: skip
        if rank == 1:
            rows += [_act(40, 45, Kind.FILE_READ, "/data", s, site="job.py:12")]
        rows += [coll(50, 51, 1, s), _act(52, 52, Kind.STEP, "optimizer_step", s)]
        write_rank(run_dir, rank, ranks, rows, s, end_mono_ns=60 * MS)
    return align(load_run(run_dir))


def _each_band_size(monkeypatch: pytest.MonkeyPatch, run: Any) -> Any:
    for size in BAND_SIZES:
        monkeypatch.setattr(bd, "BAND_EVENTS", size)
        n = len(list(bd.bands(run)))
        assert (n == 1) if size == BAND_SIZES[0] else (n > 1)
        yield size


def test_activity_in_a_window_counts_the_calls_starting_inside_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = _small_run(tmp_path / "r")
    t = int(run.events["t0_ns"][run.events["kind"] == Kind.PHASE].min()) - 10 * MS  # the aligned 0 ms
    # (rank, a_ms, b_ms) in a shuffled order, answered in that order
    q = np.array([(1, 10, 20), (4, 0, 59), (3, 11, 19), (1, 0, 5), (0, 10, 40), (1, 30, 50), (5, 20, 20),
                  (2, 14, 14), (3, 9, 15)], np.int64)  # fmt: skip
    want_ms = [10.0,  # 4 + 1 + 10 (the phase at 20 starts on the closing edge), capped at 20 - 10
               0.0,  # no activity
               1.0,  # the write only: the phase started before the window
               0.0, 15.0,
               5.0,  # rank 1's read; [40, 45]
               0.0,  # a zero-length window at the forward's start: capped at 0
               0.0, 5.0]  # fmt: skip
    for _ in _each_band_size(monkeypatch, run):
        got = ss._activity_ns(run, q[:, 0], t + q[:, 1] * MS, t + q[:, 2] * MS)
        assert got.dtype == np.float64
        assert got.tolist() == [w * MS for w in want_ms]
    assert ss._activity_ns(run, q[:0, 0], q[:0, 1], q[:0, 2]).shape == (0,)


def test_what_it_did_groups_each_sections_calls_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = _small_run(tmp_path / "r")
    t = int(run.events["t0_ns"][run.events["kind"] == Kind.PHASE].min()) - 10 * MS
    # section 0: ranks 0, 1, 5 over [9, 21] ms; section 1: rank 1 over [35, 50] and rank 3 over [0, 5];
    # section 2: rank 4 only (nothing recorded)
    sec = np.array([1, 0, 0, 2, 1, 0])
    rank = np.array([1, 5, 1, 4, 3, 0])
    a = t + np.array([35, 9, 9, 0, 0, 9]) * MS
    b = t + np.array([50, 21, 21, 59, 5, 21]) * MS
    want = [
        [{"call": "forward Model.forward", "site": "job.py:9", "count": 3, "s": 0.03},
         {"call": "phase evaluate", "site": "job.py:9", "count": 3, "s": 0.012},
         {"call": "file_write /log", "site": "job.py:9", "count": 3, "s": 0.003}],
        [{"call": "file_read /data", "site": "job.py:12", "count": 1, "s": 0.005}],
        [],
    ]  # fmt: skip
    for _ in _each_band_size(monkeypatch, run):
        assert ss._what_it_did(run, sec, rank, a, b, 3, 5) == want
        assert ss._what_it_did(run, sec, rank, a, b, 3, 1)[0] == want[0][:1]
    assert ss._what_it_did(run, sec[:0], rank[:0], a[:0], b[:0], 0, 5) == []


def test_a_serial_section_is_the_same_whatever_the_band_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # rank 2 runs an "evaluate" phase (a streamed kind) before every 4th Bcast
    synth(tmp_path / "r", ranks=12, events=1200, fault="serial", ranks_per_host=4, fault_rank=2)
    seen = []
    for _ in _each_band_size(monkeypatch, align(load_run(tmp_path / "r"))):
        rep = analyze(tmp_path / "r")
        (f,) = [f for f in rep.findings if f.kind == "serial_section"]
        seen.append((f.cost_s, f.ranks, f.summary, f.evidence))
    assert all(x == seen[0] for x in seen[1:])
    ev = seen[0][3]
    assert ev["lead_rank"] == 2
    assert ev["why_serial"]["recorded_activity"] == ev["windows"] > 0  # the phase is found in each window
    assert ev["in_between"][0]["call"] == "phase evaluate" and ev["in_between"][0]["count"] == ev["windows"]
