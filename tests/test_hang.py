"""hang: the job ended inside a collective that not every rank entered.

Real jobs: 4 MPI ranks under ``distdiag-wrap`` where rank 2 never reaches the
Barrier the others enter; the ranks are killed the ways a job dies on a
cluster (SIGKILL; SIGTERM then SIGKILL as Slurm does at the time limit; Slurm
``--time`` itself when the test Slurm is up). Unit cases (rank files written
through the shim's writer) cover the silent cases, a rank without a file, a
deadlock and the ranking.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import wait_for_writers

from distdiag.pipeline import analyze
from conftest import SlurmCluster
from factories import MS, coll, write_rank

JOB = Path(__file__).parent / "jobs" / "hang_barrier.py"
REPO = Path(__file__).resolve().parent.parent
WRAP = [sys.executable, "-m", "distdiag.wrap"]
#: the Barrier rank 2 never reaches, and the read it does instead
BARRIER_LINE = next(i for i, s in enumerate(JOB.read_text().splitlines(), 1) if "HANG-SITE" in s)
PHASE_LINE = next(i for i, s in enumerate(JOB.read_text().splitlines(), 1) if 'with distdiag.phase("evaluate")' in s)
READ_LINE = next(i for i, s in enumerate(JOB.read_text().splitlines(), 1) if "open(data" in s)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DISTDIAG_", "SLURM_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["DISTDIAG_FLUSH_INTERVAL_S"] = "0.2"
    env.update(extra)
    return env


def _analyze_json(run_dir: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    p = subprocess.run([sys.executable, "-m", "distdiag.cli", "analyze", str(run_dir), "--format", "json"],
                       capture_output=True, text=True, timeout=120, env=env)  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stderr, p.stderr
    return dict(json.loads(p.stdout))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie of mpiexec's proxy counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _run_and_kill(tmp_path: Path, how: str) -> Path:
    """Start the job, wait until every rank is past its Allreduces, kill the rank processes."""
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        pytest.fail("mpiexec not found: install the 'mpi' extra (mpi4py + mpich)")
    run_dir, piddir, data = tmp_path / "run", tmp_path / "pids", tmp_path / "shard.bin"
    piddir.mkdir()
    data.write_bytes(os.urandom(1 << 20))
    # `timeout` is the safety net: no rank outlives 60 s whatever happens to this test.
    cmd = [mpiexec, "-n", "4", "timeout", "-s", "KILL", "60", *WRAP, "--dir", str(run_dir),
           sys.executable, str(JOB), str(piddir), str(data), "2"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(), cwd=tmp_path)
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while len(list(piddir.glob("*.pid"))) < 4:
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate(timeout=10)
            time.sleep(0.05)
        time.sleep(0.2)
        pids = [int(p.read_text()) for p in piddir.glob("*.pid")]  # exactly the ranks this test started
        time.sleep(1.2)  # several flush intervals with ranks 0, 1, 3 inside the Barrier
        if how == "kill":
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
        else:  # Slurm at the time limit: SIGTERM, KillWait, SIGKILL
            for pid in pids:
                os.kill(pid, signal.SIGTERM)
            t_end = time.monotonic() + 2.0
            while any(_alive(p) for p in pids) and time.monotonic() < t_end:
                time.sleep(0.05)
            for pid in pids:
                if _alive(pid):
                    os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            for pid in pids:
                if _alive(pid):
                    os.kill(pid, signal.SIGKILL)
            proc.kill()
            proc.wait(timeout=10)
    assert len(list(run_dir.glob("rank-*.h5"))) == 4
    wait_for_writers(run_dir)  # the killed ranks' helpers finish their files (the analyses compared read them whole)
    return run_dir


def _check_hang(rep: dict[str, Any], data_name: str, max_s: float = 30) -> dict[str, Any]:
    top = rep["findings"][0]
    assert top["kind"] == "hang", [(f["kind"], f["summary"]) for f in rep["findings"]]
    assert top["ranks"] == [2]
    ev = top["evidence"]
    assert (ev["op"], ev["comm"], ev["seq"]) == ("Barrier", "world", 5)
    assert ev["site"].endswith(f"hang_barrier.py:{BARRIER_LINE}"), ev["site"]
    assert sorted(ev["inside"]) == [0, 1, 3] and ev["never_entered"] == [2]
    assert not ev["deadlock"]
    # per communicator: the last collective of each rank and whether it left
    assert ev["last_collective"]["world"] == {"Barrier #5 (inside)": [0, 1, 3], "Allreduce #4 (left)": [2]}
    doing = ev["doing"][0]
    assert doing["rank"] == 2
    # what rank 2 did instead: the read of the shard at its line, then nothing recorded
    assert doing["last_file"]["path"].endswith(data_name)
    assert doing["last_file"]["site"].endswith(f"hang_barrier.py:{READ_LINE}")
    assert doing["what"] == f"inside phase 'evaluate' at {JOB}:{PHASE_LINE}"  # its open phase, from /inflight
    assert [c["kind"] for c in doing["inflight"]] == ["PHASE"]
    assert 0.8 < doing["for_s"] < max_s
    # the others were stuck from their arrival to their end: >= ~1.2 s of waiting each
    assert all(0.8 < s < max_s for s in ev["stuck_s"].values()), ev["stuck_s"]
    # the job never finished: it lost its whole run (its turnaround under Slurm, queue included)
    lost_s = top["evidence"].get("turnaround_s") or rep["run"]["wall_s"]
    assert top["cost_s"] == pytest.approx(lost_s) and top["cost_s"] >= rep["run"]["wall_s"] - 1e-6
    assert 0.8 < top["evidence"]["stuck_wait_s"] <= rep["run"]["wall_s"]
    assert f"hang_barrier.py:{BARRIER_LINE}" in top["summary"] and "rank(s) 2 never entered Barrier" in top["summary"]
    assert "rank 2 was inside phase 'evaluate'" in top["summary"]
    return dict(top)


@pytest.mark.mpi
def test_sigkilled_hang_names_the_missing_rank_the_barrier_site_and_what_it_did(tmp_path: Path) -> None:
    rep = _analyze_json(_run_and_kill(tmp_path, "kill"))
    _check_hang(rep, "shard.bin")


@pytest.mark.mpi
def test_sigterm_then_sigkill_hang_is_found_the_same_way(tmp_path: Path) -> None:
    run_dir = _run_and_kill(tmp_path, "term")
    rep = _analyze_json(run_dir)
    _check_hang(rep, "shard.bin")


@pytest.mark.slurm
def test_slurm_time_limit_hang_names_rank_2(slurm: SlurmCluster, tmp_path: Path) -> None:
    """srun --time=1: Slurm's smallest limit is a minute, and it checks limits every ~30 s, so
    this job runs 60-100 s; Slurm then sends SIGTERM, waits KillWait (5 s here), SIGKILLs."""
    run_dir, piddir, data = tmp_path / "run", tmp_path / "pids", tmp_path / "shard.bin"
    piddir.mkdir()
    data.write_bytes(os.urandom(1 << 20))
    env = slurm.env(DISTDIAG_FLUSH_INTERVAL_S="0.5", PYTHONPATH=str(REPO))
    p = slurm.run(["srun", "-N1", "-n4", "--time=1", "--job-name", "hang9", *WRAP, "--dir", str(run_dir),
                   sys.executable, str(JOB), str(piddir), str(data), "2"],
                  timeout_s=240, check=False, cwd=tmp_path, env=env)  # fmt: skip
    assert p.returncode != 0 and "TIME LIMIT" in p.stderr, p.stderr
    rep = _analyze_json(run_dir, env=slurm.env())
    top = _check_hang(rep, "shard.bin", max_s=200)
    assert top["evidence"]["stuck_wait_s"] > 50  # stuck from the barrier to the time limit
    assert rep["run"]["slurm"]["job"]["state"] == "TIMEOUT"


GLOO_JOB = Path(__file__).parent / "jobs" / "hang_gloo.py"


@pytest.mark.torch
def test_gloo_hang_names_the_rank_in_its_phase_and_the_all_reduce(tmp_path: Path) -> None:
    """The same post-mortem for torch.distributed on gloo (what the NCCL flight recorder answers
    only from dumps each rank must write itself): 3 ranks under torchrun, SIGKILLed."""
    pytest.importorskip("torch")
    piddir = tmp_path / "pids"
    piddir.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
           "-m", "distdiag.wrap", str(GLOO_JOB), str(piddir), "1"]  # fmt: skip
    env = _env(DISTDIAG_DIR=str(tmp_path / "run"), DISTDIAG_HOOKS="fileio=0", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while len(list(piddir.glob("*.pid"))) < 3:
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate(timeout=10)[0][-3000:]
            time.sleep(0.05)
        time.sleep(1.5)  # several flushes with ranks 0 and 2 inside the all_reduce
        for p in piddir.glob("*.pid"):  # exactly the ranks this test started
            os.kill(int(p.read_text()), signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # our own torchrun session only
            proc.wait(timeout=10)
    rep = _analyze_json(tmp_path / "run")
    top = rep["findings"][0]
    assert top["kind"] == "hang" and top["ranks"] == [1], [(f["kind"], f["summary"]) for f in rep["findings"]]
    ev = top["evidence"]
    line = next(i for i, s in enumerate(GLOO_JOB.read_text().splitlines(), 1) if "GLOO-HANG-SITE" in s)
    assert ev["op"] == "all_reduce" and ev["seq"] == 5 and sorted(ev["inside"]) == [0, 2]
    assert ev["site"].endswith(f"hang_gloo.py:{line}"), ev["site"]
    assert ev["doing"][0]["what"].startswith("inside phase 'load_checkpoint'")
    assert top["cost_s"] > 0.8


# -- unit cases: rank files written through the shim's writer ---------------------------


def _healthy_rows(strings: list[str], rank: int, n: int = 4) -> list[tuple[Any, ...]]:
    return [coll(10.0 * i + 0.1 * rank, 10.0 * i + 2, i, strings) for i in range(n)]


def _kinds(run_dir: Path) -> list[str]:
    return [f.kind for f in analyze(run_dir).findings]


def test_healthy_and_fully_entered_in_flight_collectives_are_no_hang(tmp_path: Path) -> None:
    ok = tmp_path / "ok"
    for r in range(4):
        s = [""]
        write_rank(ok, r, 4, _healthy_rows(s, r), s)
    assert "hang" not in _kinds(ok)
    # every rank entered the last collective and was killed inside it: stuck, but nobody is missing
    inside = tmp_path / "inside"
    for r in range(4):
        s = [""]
        write_rank(inside, r, 4, _healthy_rows(s, r), s, inflight=[coll(40.0 + r, -1, 4, s)],
                   closed_cleanly=False, exit_code=None, end_mono_ns=None, last_flush_mono_ns=int(900 * MS))
    assert "hang" not in _kinds(inside)


def test_a_rank_without_a_file_is_named_as_the_missing_one(tmp_path: Path) -> None:
    for r in range(3):  # rank 3 never started: no file
        s = [""]
        write_rank(tmp_path, r, 4, _healthy_rows(s, r), s, inflight=[coll(40.0 + r, -1, 4, s, op="Barrier")],
                   closed_cleanly=False, exit_code=None, end_mono_ns=None, last_flush_mono_ns=int(3000 * MS))
    rep = analyze(tmp_path)
    top = rep.findings[0]
    assert top.kind == "hang" and top.ranks == [3]
    assert "no usable file" in top.evidence["doing"][0]["what"]
    assert top.evidence["stuck_wait_s"] == pytest.approx(3.0 - 0.042, abs=0.01)
    assert top.cost_s == pytest.approx(rep.run.wall_s)  # the whole run was lost: it never finished


def test_ranks_waiting_on_each_other_are_a_deadlock(tmp_path: Path) -> None:
    # ranks 0, 1 wait in Barrier #4 on world; ranks 2, 3 wait in Bcast #0 on "sub" for ranks 0, 1
    for r in range(4):
        s = [""]
        rows = _healthy_rows(s, r)
        if r < 2:
            rows.append(coll(45.0, 46.0, 0, s, op="Allreduce", comm="sub"))
            inf = [coll(50.0 + r, -1, 4, s, op="Barrier")]
        else:
            inf = [coll(50.0 + r, -1, 0, s, op="Bcast", comm="sub2", root=2)]
        write_rank(tmp_path, r, 4, rows, s, inflight=inf, closed_cleanly=False, exit_code=None,
                   end_mono_ns=None, last_flush_mono_ns=int(2000 * MS))  # fmt: skip
    rep = analyze(tmp_path)
    hang = [f for f in rep.findings if f.kind == "hang"]
    assert len(hang) == 1 and rep.findings[0] is hang[0]
    assert hang[0].evidence["deadlock"] is True
    assert hang[0].ranks == [2, 3]
    assert "wait on each other" in hang[0].summary
    doing = {d["rank"]: d for d in hang[0].evidence["doing"]}
    assert "Bcast #0 on communicator 'sub2'" in doing[2]["what"]


def test_hang_ranks_first_even_when_a_straggler_costs_more(tmp_path: Path) -> None:
    # rank 1 is 300 ms late at each of 20 all-reduces (6 s), then rank 2 never reaches the
    # last collective and the job is killed 1 s later: the hang is the verdict.
    for r in range(4):
        s = [""]
        rows = [coll(400.0 * i + (300.0 if r == 1 else 0.0), 400.0 * i + 301, i, s) for i in range(20)]
        inf = [coll(8000.0 + r, -1, 20, s, op="Barrier")] if r != 2 else None
        write_rank(tmp_path, r, 4, rows, s, inflight=inf, closed_cleanly=False, exit_code=None,
                   end_mono_ns=None, last_flush_mono_ns=int(9000 * MS))  # fmt: skip
    rep = analyze(tmp_path)
    kinds = [f.kind for f in rep.findings]
    assert kinds[0] == "hang" and "straggler" in kinds, kinds
    strag = next(f for f in rep.findings if f.kind == "straggler")
    hang = rep.findings[0]
    # the others sat stuck for less than the straggler cost, but the job never finished:
    # the hang costs the whole run, and the contract's order by cost_s holds
    assert strag.cost_s > hang.evidence["stuck_wait_s"]
    assert hang.cost_s == pytest.approx(rep.run.wall_s) and hang.cost_s >= strag.cost_s
    assert [f.cost_s for f in rep.findings] == sorted((f.cost_s for f in rep.findings), reverse=True)


def test_open_phases_are_in_flight_until_they_close_in_any_order() -> None:
    import threading

    from distdiag.schema import Kind
    from distdiag.shim.recorder import Recorder

    rec = Recorder(chunk_rows=16)
    outer = rec.open_span(Kind.PHASE, rec.intern("train"), rec.intern("job.py:3"))
    inner = rec.open_span(Kind.PHASE, rec.intern("eval"), rec.intern("job.py:9"))
    rec.enter(Kind.COLL, rec.intern("Barrier"), rec.intern("world"), 4)

    def names() -> list[str]:
        rows = rec.inflight_rows()
        return sorted(rec.strings.strings[int(i)] for i in rows["name_id"])

    assert names() == ["Barrier", "eval", "train"]
    assert set(rec.inflight_rows()["t1_ns"]) == {-1}
    rec.leave()
    rec.close_span(outer)  # out of order: the outer one first
    assert names() == ["eval"]
    t = threading.Thread(target=rec.close_span, args=(inner,))  # and from another thread
    t.start()
    t.join()
    assert names() == []
