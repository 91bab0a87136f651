"""queue_wait and launch_overhead on recorded runs with a stored accounting record.

No Slurm needed: the rank files are written by the factories with known
timestamps (wall clock 1_700_000_000 s at each rank's shim start) and the
accounting is the run dir's ``slurm-accounting.json``, read offline. Each
detector: the fault (positive), a healthy job (negative), the threshold.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from distdiag.config import Config
from distdiag.pipeline import analyze
from distdiag.slurm import ACCOUNTING_FILE, Accounting, accounting_of, load_stored, parse_sacct_job, store
from factories import coll, write_rank

W0 = 1_700_000_000  # factories: wall_ns_at_start = W0 s at mono 0


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    # Never ask a live sacct here: job 77 may exist in the test Slurm's database.
    monkeypatch.setenv("DISTDIAG_SLURM_OFFLINE", "1")


def make(tmp: Path, first_work_ms: tuple[float, float] = (500.0, 2000.0), end_ms: float = 10_000.0,
         slurm_env: bool = True, acct: Accounting | None = None) -> Path:  # fmt: skip
    """Two ranks whose first collective starts at ``first_work_ms`` after their shim start."""
    run_dir = tmp / "run"
    env = {"SLURM_JOB_ID": "77", "SLURM_PROCID": "0"} if slurm_env else {}
    arrive_all = max(first_work_ms)
    for r in range(2):
        strings = [""]
        rows = [coll(first_work_ms[r], arrive_all + 1, 0, strings), coll(end_ms - 50, end_ms - 40, 1, strings)]
        write_rank(run_dir, r, 2, rows, strings, env=json.dumps(env), end_mono_ns=int(end_ms * 1e6),
                   closed_cleanly=True, exit_code=0)  # fmt: skip
    if acct is not None:
        store(run_dir, acct)
    return run_dir


def acct(submit: int, eligible: int, start: int, end: int | None, state: str = "COMPLETED") -> Accounting:
    return Accounting(job_id="77", name="train", state=state, exit_code=0, submit_s=submit, eligible_s=eligible,
                      start_s=start, end_s=end, nodes="n[1-2]")  # fmt: skip


def findings(run_dir: Path, cfg: Config | None = None) -> dict[str, Any]:
    rep = analyze(run_dir, cfg or Config())
    return {"by_kind": {f.kind: f for f in rep.findings}, "report": rep}


# -- queue_wait ---------------------------------------------------------------------


def test_queue_wait_is_start_minus_submit_as_share_of_turnaround(tmp_path: Path) -> None:
    run = make(tmp_path, acct=acct(W0 - 30, W0 - 30, W0 - 1, W0 + 10))
    got = findings(run)
    f = got["by_kind"]["queue_wait"]
    assert f.cost_s == 29
    assert f.evidence["eligible_to_start_s"] == 29 and f.evidence["submit_to_eligible_s"] == 0
    assert f.evidence["turnaround_s"] == 40
    assert f.fraction == pytest.approx(29 / 40)
    assert got["report"].findings[0].kind == "queue_wait"
    assert "waiting for nodes" in f.summary


def test_queue_wait_splits_held_from_waiting(tmp_path: Path) -> None:
    run = make(tmp_path, acct=acct(W0 - 30, W0 - 20, W0 - 1, W0 + 10))
    f = findings(run)["by_kind"]["queue_wait"]
    assert f.cost_s == 29
    assert f.evidence["submit_to_eligible_s"] == 10 and f.evidence["eligible_to_start_s"] == 19
    assert "held" in f.summary


@pytest.mark.parametrize("wait_s", [0, 1])
def test_no_queue_wait_within_sacct_resolution(tmp_path: Path, wait_s: int) -> None:
    run = make(tmp_path, acct=acct(W0 - 1 - wait_s, W0 - 1 - wait_s, W0 - 1, W0 + 10))
    assert "queue_wait" not in findings(run)["by_kind"]


def test_queue_wait_threshold(tmp_path: Path) -> None:
    # 29 s of a 40 s turnaround = 72.5%: reported at 0.72, not at 0.73.
    run = make(tmp_path, acct=acct(W0 - 30, W0 - 30, W0 - 1, W0 + 10))
    at = findings(run, Config(sections={"queue_wait": {"min_fraction": 0.72}}))["by_kind"]
    above = findings(run, Config(sections={"queue_wait": {"min_fraction": 0.73}}))["by_kind"]
    assert "queue_wait" in at and "queue_wait" not in above


# -- launch_overhead ------------------------------------------------------------------


def test_launch_overhead_to_the_slowest_ranks_first_work(tmp_path: Path) -> None:
    # Job start 1 s before the shims started; rank 1 reached its first collective 2 s later.
    run = make(tmp_path, first_work_ms=(500.0, 2000.0), acct=acct(W0 - 1, W0 - 1, W0 - 1, W0 + 10))
    f = findings(run)["by_kind"]["launch_overhead"]
    assert f.ranks == [1]
    assert f.cost_s == pytest.approx(3.0, abs=1e-3)
    assert f.evidence["job_start_to_shim_start_s"] == pytest.approx(1.0, abs=1e-3)
    assert f.evidence["shim_start_to_first_work_s"] == pytest.approx(2.0, abs=1e-3)
    assert f.fraction == pytest.approx(3.0 / 11)
    per_rank = findings(run)["report"].to_json()["run"]["slurm"]["per_rank"]
    assert [(p["rank"], p["shim_start_s"], p["first_work_s"], p["first_collective_s"], p["last_event_s"])
            for p in per_rank] == [(0, 1.0, 1.5, 1.5, 11.0), (1, 1.0, 3.0, 3.0, 11.0)]  # fmt: skip


def test_quick_launch_is_silent(tmp_path: Path) -> None:
    run = make(tmp_path, first_work_ms=(100.0, 300.0), acct=acct(W0, W0, W0, W0 + 10))
    assert "launch_overhead" not in findings(run)["by_kind"]


def test_launch_overhead_threshold(tmp_path: Path) -> None:
    run = make(tmp_path, first_work_ms=(500.0, 2000.0), acct=acct(W0 - 1, W0 - 1, W0 - 1, W0 + 10))
    frac = 3.0 / 11
    at = findings(run, Config(sections={"launch_overhead": {"min_fraction": frac - 0.001}}))["by_kind"]
    above = findings(run, Config(sections={"launch_overhead": {"min_fraction": frac + 0.001}}))["by_kind"]
    assert "launch_overhead" in at and "launch_overhead" not in above


def test_rank_stuck_in_init_is_all_launch(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    for r in range(2):  # no collective at all: both ranks hung in rendezvous
        write_rank(run_dir, r, 2, [], [""], env=json.dumps({"SLURM_JOB_ID": "77"}), end_mono_ns=int(8e9),
                   closed_cleanly=False)  # fmt: skip
    store(run_dir, acct(W0 - 1, W0 - 1, W0 - 1, W0 + 9))
    f = findings(run_dir)["by_kind"]["launch_overhead"]
    assert f.ranks == [0, 1] and f.cost_s == pytest.approx(9.0, abs=1e-3)
    assert "never reached useful work" in f.summary


# -- where the record comes from ---------------------------------------------------------


def test_no_slurm_no_findings_one_line_why(tmp_path: Path) -> None:
    run = make(tmp_path, slurm_env=False)
    got = findings(run)
    assert not set(got["by_kind"]) & {"queue_wait", "launch_overhead"}
    view = got["report"].slurm
    assert view.acct is None and "did not run under Slurm" in view.why
    assert got["report"].to_json()["run"]["slurm"] == {"available": False, "why": view.why}


def test_slurm_job_offline_without_stored_copy_says_so(tmp_path: Path) -> None:
    run = make(tmp_path)
    view = findings(run)["report"].slurm
    assert view.acct is None and "job 77" in view.why and ACCOUNTING_FILE in view.why


def test_stored_record_of_another_job_is_ignored(tmp_path: Path) -> None:
    other = acct(W0 - 30, W0 - 30, W0 - 1, W0 + 10)
    other.job_id = "78"
    run = make(tmp_path, acct=other)
    view = findings(run)["report"].slurm
    assert view.acct is None


def test_record_read_while_running_uses_the_last_event_as_end(tmp_path: Path) -> None:
    run = make(tmp_path, acct=acct(W0 - 30, W0 - 30, W0 - 1, None, state="RUNNING"))
    rep = findings(run)["report"]
    view = rep.slurm
    assert view.acct is not None and not view.acct.final
    assert view.turnaround_s == pytest.approx(40.0, abs=0.01)  # submit to the last event (W0 + 10 s)
    assert view.timeline[-1]["what"].startswith("end (still running")
    assert rep.findings[0].kind == "queue_wait"


def test_store_and_load_round_trip(tmp_path: Path) -> None:
    a = acct(W0 - 30, W0 - 20, W0 - 1, W0 + 10)
    a.steps = [{"step": "0", "name": "python3", "start_s": W0 - 1, "end_s": W0 + 10}]
    store(tmp_path, a)
    b = load_stored(tmp_path)
    assert b == a and b.final
    (tmp_path / ACCOUNTING_FILE).write_text("{not json")
    assert load_stored(tmp_path) is None


# -- sacct --json formats -----------------------------------------------------------------

SACCT_22_05 = {
    "job_id": 8, "name": "python3", "cluster": "distdiag", "nodes": "n[1-2]",
    "state": {"current": "COMPLETED", "reason": "None"},
    "exit_code": {"status": "SUCCESS", "return_code": 0},
    "time": {"elapsed": 11, "eligible": 1796037733, "end": 1796037744, "start": 1796037733,
             "submission": 1796037730, "suspended": 0},
    "steps": [{"step": {"job_id": 8, "het": {"component": None}, "id": 0, "name": "python3"},
               "time": {"start": 1796037733, "end": 1796037744}}],
}  # fmt: skip
SACCT_24 = {
    "job_id": 9, "name": "train", "cluster": "c", "nodes": "a01",
    "state": {"current": ["FAILED"], "reason": "None"},
    "exit_code": {"status": ["FAILED"], "return_code": {"set": True, "infinite": False, "number": 3}},
    "time": {"eligible": 100, "end": 0, "start": 120, "submission": 90},
    "steps": [{"step": {"id": {"job_id": 9, "step_id": "batch"}, "name": "batch"},
               "time": {"start": {"set": True, "number": 120}, "end": {"set": False, "number": 0}}}],
}  # fmt: skip


def test_parse_sacct_22_05() -> None:
    a = parse_sacct_job(SACCT_22_05)
    assert (a.job_id, a.state, a.exit_code, a.submit_s, a.eligible_s, a.start_s, a.end_s) == (
        "8", "COMPLETED", 0, 1796037730, 1796037733, 1796037733, 1796037744)  # fmt: skip
    assert a.steps == [{"step": "8.0", "name": "python3", "start_s": 1796037733, "end_s": 1796037744}]
    assert a.final


def test_parse_sacct_newer_format() -> None:
    a = parse_sacct_job(SACCT_24)
    assert (a.state, a.exit_code, a.submit_s, a.start_s, a.end_s) == ("FAILED", 3, 90, 120, None)
    assert a.steps[0]["step"] == "9.batch" and a.steps[0]["end_s"] is None
    assert not a.final  # no end yet


def test_accounting_view_is_cached_on_the_run(tmp_path: Path) -> None:
    from distdiag.run import load_run

    run = load_run(make(tmp_path, acct=acct(W0 - 30, W0 - 30, W0 - 1, W0 + 10)))
    assert accounting_of(run) is accounting_of(run)


@pytest.mark.slurm
def test_pyslurm_backend_agrees_with_sacct(slurm: Any, tmp_path: Path) -> None:
    # PyPI has no pyslurm for Slurm 22.05, so this runs only where a site built one.
    pytest.importorskip("pyslurm")
    from distdiag.slurm import read_pyslurm, read_sacct

    job = slurm.sbatch(["-N1", "-n1", "-o", "/dev/null", "--wrap", "sleep 1"], cwd=tmp_path)
    slurm.wait_gone(job)
    slurm.sacct(job)
    a, b = read_pyslurm(job), read_sacct(job)
    assert (a.submit_s, a.eligible_s, a.start_s, a.end_s) == (b.submit_s, b.eligible_s, b.start_s, b.end_s)
