"""tests/corpus.py, the analysis's safety net (issue 19): a recorded corpus checks clean, and a
report that changed in any mode is named."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from helpers import MPIEXEC, REPO

from distdiag.synth import synth

CORPUS = [sys.executable, str(REPO / "tests" / "corpus.py")]


def _corpus(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CORPUS, *args], capture_output=True, text=True, timeout=300, cwd=REPO)


def test_a_recorded_corpus_checks_clean_and_a_changed_report_is_named(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    synth(runs / "a" / "run", ranks=6, events=300, fault="straggler", ranks_per_host=2, seed=2)
    synth(runs / "b", ranks=4, events=200, fault="none", ranks_per_host=2, seed=2)
    (runs / "b" / "rank-00003.h5").write_bytes(b"not hdf5")  # a damaged rank: reported, not fatal
    corpus = tmp_path / "corpus"
    k = "1" if MPIEXEC else ""
    rec = _corpus("record", str(corpus), "--from", str(runs), "--parallel", k)
    assert rec.returncode == 0, rec.stderr
    assert sorted(p.name for p in corpus.iterdir()) == ["a__run", "b"]
    assert '"kind": "straggler"' in (corpus / "a__run" / "report.json").read_text()
    assert "rank-00003.h5" in (corpus / "b" / "report.json").read_text()
    ok = _corpus("check", str(corpus), "--parallel", k)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    n_modes = 2 + bool(MPIEXEC)
    assert f"2 entries: {2 * n_modes} reports the same, 0 differ" in ok.stdout
    # what a change that moved a verdict looks like: the recorded report no longer matches
    rep = corpus / "a__run" / "report.json"
    rep.write_text(rep.read_text().replace('"kind": "straggler"', '"kind": "serial_section"', 1))
    bad = _corpus("check", str(corpus), "--parallel", k)
    assert bad.returncode == 1
    assert bad.stdout.count("a__run [") == n_modes and "DIFFERS" in bad.stdout and "serial_section" in bad.stdout
