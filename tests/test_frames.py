"""The pandas API (``distdiag.load``) on a real demo run.

``mpiexec -n 4 distdiag-wrap`` runs distdiag's demo job (20 iterations: a
Barrier, 20 Allreduce, a Barrier every 10th, a final pickled ``allreduce``)
with rank 2 sleeping 20 ms before each Allreduce, after opening a file
whose path holds ``<script>`` and inside one ``distdiag.phase``. The frames
are checked against what the job did and against the rank files read
directly with h5py, not against the analyzer's own numbers.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pandas as pd
import pytest
from helpers import MPIEXEC, demo_args, run_wrapped_mpi

pytestmark = pytest.mark.mpi

REPO = Path(__file__).resolve().parent.parent
ITERS = 20
EXPECTED_COLLECTIVES = {"Barrier": 1 + ITERS // 10, "Allreduce": ITERS, "allreduce": 1}
PHASE = "load & <b>shard</b>"
XSS = "<script>alert(1)</script>"

JOB = f"""
import os, sys
import distdiag
with distdiag.phase({PHASE!r}):
    d = os.path.join(sys.argv[1], "<script>alert(1)<")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "script>"), "w") as f:
        f.write("x")
from distdiag import demo_job
sys.exit(demo_job.main(sys.argv[2:]))
"""


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("frames")
    return run_wrapped_mpi(tmp, JOB, demo_args(tmp, ITERS))


@pytest.fixture(scope="module")
def run(run_dir: Path):  # type: ignore[no-untyped-def]
    import distdiag

    return distdiag.load(run_dir)


def test_events_are_every_row_of_every_rank_file(run, run_dir: Path) -> None:  # type: ignore[no-untyped-def]
    rows = {}
    for f in sorted(run_dir.glob("rank-*.h5")):  # four files
        with h5py.File(f, "r", locking=False) as h:
            rows[int(h.attrs["rank"])] = len(h["events"])
    ev = run.events
    assert isinstance(ev, pd.DataFrame)
    assert ev.groupby("rank").size().to_dict() == rows
    assert {"rank", "host", "kind", "name", "t0_ns", "t1_ns", "t0_s", "dur_s", "comm", "seq", "site"} <= set(ev.columns)
    assert (ev["dur_s"] >= 0).all()
    assert ev["t0_s"].min() >= -1e-3  # seconds since the first shim start


def test_collectives_have_arrival_and_exit_per_rank(run) -> None:  # type: ignore[no-untyped-def]
    c = run.collectives
    for r in range(4):  # four ranks
        assert c[c["rank"] == r]["op"].value_counts().to_dict() == EXPECTED_COLLECTIVES
    assert (c.groupby("group").size() == 4).all()
    assert (c["state"] == "complete").all()
    assert (c["arrival_s"] <= c["exit_s"]).all()
    assert (c["wait_s"] >= 0).all() and (c["transfer_s"] >= 0).all()
    # wait = last arrival - own arrival: zero for the last arriver
    assert np.allclose(c["wait_s"], c["last_arrival_s"] - c["arrival_s"], atol=1e-9)
    assert (c.loc[c["is_last"], "wait_s"] == 0).all()
    ar = c[c["op"] == "Allreduce"]
    last = ar[ar["is_last"]]["rank"].value_counts()
    assert last.idxmax() == 2 and last[2] >= 0.6 * ITERS  # the sleeping rank arrives last
    others = ar[ar["rank"] != 2].groupby("group")["wait_s"].median()
    # ... and the others wait for it: rank 2 sleeps 20 ms before each; a healthy wait is ~0.1 ms
    assert others.median() > 0.01
    g = run.collective_groups
    assert len(g) == sum(EXPECTED_COLLECTIVES.values())
    assert (g["n_members"] == 4).all() and (g["spread_s"] >= 0).all()


def test_phases_files_findings_breakdown(run) -> None:  # type: ignore[no-untyped-def]
    ph = run.phases
    mine = ph[ph["phase"] == PHASE]
    assert sorted(mine["rank"]) == [0, 1, 2, 3]
    assert (mine["dur_s"] >= 0).all() and mine["site"].str.contains("job.py").all()
    fs = run.files
    opened = fs[(fs["op"] == "open") & fs["path"].str.endswith(XSS)]
    assert sorted(opened["rank"]) == [0, 1, 2, 3]
    assert (opened["fs"] != "").all()
    # the open happened inside the phase, on the same rank
    for r in range(4):  # four ranks
        p = mine[mine["rank"] == r].iloc[0]
        o = opened[opened["rank"] == r].iloc[0]
        assert p["t0_s"] <= o["t0_s"] <= o["t1_s"] <= p["t1_s"]
    f = run.findings
    assert list(f.columns[:3]) == ["kind", "cost_s", "fraction"]
    assert f.iloc[0]["kind"] == "straggler" and f.iloc[0]["ranks"] == [2]
    assert f["cost_s"].is_monotonic_decreasing
    assert run.verdict is not None and run.verdict.kind == "straggler"
    b = run.breakdown
    assert sorted(b["rank"]) == [0, 1, 2, 3]
    assert b.loc[b["rank"] == 2, "comm_wait_s"].iloc[0] < b.loc[b["rank"] != 2, "comm_wait_s"].min()
    assert len(run.ranks) == 4 and (run.ranks["exit_code"] == 0).all()
    assert run.gpu.empty  # no GPU, no sampler
    assert run.to_json()["schema"] == "distdiag.report/1"


def test_plots_take_the_frames(run) -> None:  # type: ignore[no-untyped-def]
    from distdiag.render import plots

    from distdiag.breakdown import COLUMNS

    ax = plots.plot_breakdown(run)
    assert len(COLUMNS) == 8  # startup_s is a category of its own
    assert len(ax.patches) == 4 * len(COLUMNS)  # ranks x categories
    with pytest.raises(plots.NoData):
        plots.plot_slurm_timeline(run)


def test_load_of_a_dir_without_rank_files_says_so(tmp_path: Path) -> None:
    import distdiag
    from distdiag.errors import DistdiagError

    with pytest.raises(DistdiagError, match="holds no rank"):
        distdiag.load(tmp_path)


def test_import_distdiag_stays_light() -> None:
    """``import distdiag`` runs inside every wrapped job: load() must not pull pandas in."""
    code = "import sys, distdiag; assert callable(distdiag.load); print('pandas' in sys.modules)"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "False"


def test_the_walkthrough_script_runs_on_a_demo_run(run_dir: Path, tmp_path: Path) -> None:
    """analysis/demo_walkthrough.py uses only the public API; it must keep working on a real run."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, str(REPO / "analysis" / "demo_walkthrough.py"), str(run_dir), "--out",
                        str(tmp_path)], capture_output=True, text=True, timeout=300, env=env)  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert "verdict: straggler" in p.stdout
    assert {"timeline.png", "wait_heatmap.png", "breakdown.png", "report.html", "trace.json"} <= {
        q.name for q in tmp_path.iterdir()}


STEP_JOB = """
import time
import numpy as np
from mpi4py import MPI
import distdiag

comm = MPI.COMM_WORLD
buf, out = np.ones(1024), np.empty(1024)
comm.Barrier()
for it in range(10):
    if comm.Get_rank() == 1 and it == 6:
        time.sleep(0.15)  # one slow step on one rank
    comm.Allreduce(buf, out)
    comm.Barrier()
    distdiag.step(samples=8)
"""


def test_wait_heatmap_by_step_puts_the_slow_step_where_it_happened(tmp_path: Path) -> None:
    """Ranks that mark steps get a rank x step heatmap: the others' waits land in the slow step's column."""
    import distdiag
    from distdiag.render import plots

    run = distdiag.load(run_wrapped_mpi(tmp_path, STEP_JOB))
    ranks, mat, per_col, what = plots.wait_matrix(run)
    assert what == "step" and per_col == 1 and list(ranks) == [0, 1, 2, 3]
    # column k: collectives entered after k steps (the first Barrier and step 0's are in column 0)
    assert mat.shape == (4, 10)
    # column 0 holds the start-up Barrier (launch skew); after it, step 6 is the slow one
    slow = 1 + np.nanargmax(np.nansum(mat[:, 1:], axis=0))
    assert slow == 6, mat
    others = mat[[0, 2, 3], 6]
    assert (others > 0.1).all() and mat[1, 6] < 0.02, mat[:, 6]
    by_coll = plots.wait_matrix(run, by="collective")
    assert by_coll[3] == "collective on communicator 'world'" and by_coll[1].shape == (4, 21)
    assert plots.plot_wait_heatmap(run).get_xlabel().startswith("step index")


def test_a_collective_that_never_completed_is_waiting_until_the_record_ends(tmp_path: Path) -> None:
    """tests/jobs/hang_barrier.py: rank 2 never reaches the Barrier; the ranks are SIGKILLed inside it.
    The frames, the trace and the breakdown agree: the others waited in it until their records end."""
    import json as _json
    import signal
    import time

    import distdiag
    from distdiag.render.perfetto import build_trace

    if MPIEXEC is None:
        pytest.fail("mpiexec not found: install the 'mpi' extra (mpi4py + mpich)")
    run_dir, piddir, data = tmp_path / "run", tmp_path / "pids", tmp_path / "data"
    piddir.mkdir()
    data.write_bytes(b"x" * 4096)
    # `timeout` is the safety net: no rank outlives 60 s whatever happens here
    cmd = [MPIEXEC, "-n", "4", "timeout", "-s", "KILL", "60", sys.executable, "-m", "distdiag.wrap", "--dir",
           str(run_dir), sys.executable, str(REPO / "tests" / "jobs" / "hang_barrier.py"), str(piddir), str(data), "2"]  # fmt: skip
    # flush often: a SIGKILLed rank's record ends at its last flush
    env = dict(os.environ, DISTDIAG_FLUSH_INTERVAL_S="0.2")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while len(list(piddir.glob("*.pid"))) < 4 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        time.sleep(0.2)
        pids = [int(p.read_text()) for p in piddir.glob("*.pid")]  # exactly the ranks this test started
        assert len(pids) == 4
        time.sleep(1.2)  # several flush intervals inside the Barrier
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.kill()
            proc.wait(timeout=10)
    run = distdiag.load(run_dir)
    c = run.collectives
    stuck = c[c["exit_s"].isna()]
    assert sorted(stuck["rank"]) == [0, 1, 3] and (stuck["op"] == "Barrier").all()
    assert (stuck["state"] == "in_flight").all()
    ends = run.ranks.set_index("rank")["end_s"]
    for r in stuck.itertuples():  # three ranks
        assert r.wait_s == pytest.approx(ends[r.rank] - r.arrival_s, abs=1e-6)
        assert r.wait_s > 0.5
    b = run.breakdown.set_index("rank")
    stuck_wait = stuck.set_index("rank")["wait_s"].sort_index()
    assert (b.loc[[0, 1, 3], "comm_wait_s"].to_numpy() >= stuck_wait.to_numpy() - 1e-6).all()
    text, _ = build_trace(run.report)
    waits = [e for e in _json.loads(text)["traceEvents"] if e.get("cat") == "wait" and "never" in e["name"]]
    assert sorted(e["pid"] - 1 for e in waits) == [0, 1, 3]
    assert all(e["dur"] > 0.5e6 for e in waits)
    # rank 2 sat in distdiag.phase("evaluate") when killed: the trace shows it open until its record ends
    evals = [e for e in _json.loads(text)["traceEvents"] if e.get("cat") == "phase" and e["name"] == "evaluate"]
    assert [e["pid"] - 1 for e in evals] == [2] and evals[0]["dur"] > 0.5e6
