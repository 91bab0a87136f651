"""MPI_Init as a recorded span, on a real ``mpiexec -n 2`` job under distdiag-wrap.

The mpi4py hook records ``import mpi4py.MPI`` (MPI_Init and the wire-up) as
COMM_WORLD's COMM_CREATE row, t0 before the import and t1 after it. The job
(tests/jobs/late_init.py): rank 1 opens files for 2 s before importing, rank
0 imports at once and waits in MPI_Init while a thread of its own keeps
opening a file. Without the span rank 0 looked busy until MPI_Init returned
and launch_overhead named it; with the span its rendezvous starts when its
import does, and rank 1 is named.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import MPIEXEC, run_in_session

from distdiag.config import Config
from distdiag.pipeline import analyze
from distdiag.run import Run, load_run
from distdiag.schema import Kind
from distdiag.slurm import Accounting, rank_busy_until, rank_milestones, store

pytestmark = pytest.mark.mpi

JOB = Path(__file__).parent / "jobs" / "late_init.py"
BUSY_S = 2.0


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if MPIEXEC is None:
        pytest.fail("mpiexec not found: install the 'mpi' extra (mpi4py + mpich)")
    d = tmp_path_factory.mktemp("late_init") / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["DISTDIAG_SLURM_OFFLINE"] = "1"
    cmd = [MPIEXEC, "-n", "2", sys.executable, "-m", "distdiag.wrap", "--dir", str(d), sys.executable, str(JOB), str(BUSY_S)]
    run_in_session(cmd, 120, env=env, check=True)
    return d


def _init_rows(run: Run, rank: int) -> np.ndarray:
    ev = run.events
    return ev[(ev["rank"] == rank) & (ev["kind"] == int(Kind.COMM_CREATE)) & (ev["name_id"] == run.sid("world"))]


def test_mpi_init_is_a_span_the_waiting_rank_spends_blocked(run_dir: Path) -> None:
    run = load_run(run_dir)
    w0, w1 = _init_rows(run, 0), _init_rows(run, 1)
    assert len(w0) == 1 and len(w1) == 1
    d0 = (int(w0["t1_ns"][0]) - int(w0["t0_ns"][0])) / 1e9
    d1 = (int(w1["t1_ns"][0]) - int(w1["t0_ns"][0])) / 1e9
    # rank 0 waited in MPI_Init for rank 1's 2 s of work; rank 1 went straight through
    assert d0 > BUSY_S - 0.5, (d0, d1)
    assert d1 < d0 - 1.0, (d0, d1)
    # the row still maps the communicator: this rank's rank in COMM_WORLD and its size
    assert [int(w0["peer"][0]), int(w0["aux"][0])] == [0, 2]
    assert [int(w1["peer"][0]), int(w1["aux"][0])] == [1, 2]


def test_rank_busy_before_mpi_init_is_the_one_the_others_waited_for(run_dir: Path) -> None:
    run = load_run(run_dir)
    busy = rank_busy_until(run)
    # rank 0's loader thread opened files all through MPI_Init; those do not count
    assert busy[1] - busy[0] > BUSY_S - 0.5, busy
    starts = {r: i.start_ns for r, i in run.ranks.items()}
    ev = run.events
    # rank 0 was busy only until its import began (the thread's opens before it)
    w0 = _init_rows(run, 0)
    own0 = ev[(ev["rank"] == 0) & (ev["t0_ns"] < w0["t0_ns"][0]) & (ev["kind"] != int(Kind.SHIM))]
    assert len(own0) and starts[0] <= int(w0["t0_ns"][0])


def test_launch_overhead_names_the_rank_busy_before_mpi_init(run_dir: Path) -> None:
    # the job "started" a second before the first shim and ended a second after the last event
    shim_start, _, _, last = rank_milestones(load_run(run_dir))
    start = math.floor(min(shim_start.values())) - 1
    store(run_dir, Accounting(job_id="77", name="late_init", state="COMPLETED", exit_code=0, submit_s=start,
                              eligible_s=start, start_s=start, end_s=math.ceil(max(last.values())) + 1))  # fmt: skip
    rep = analyze(run_dir, Config())
    f = {x.kind: x for x in rep.findings}["launch_overhead"]
    assert f.ranks == [1], f.summary
    assert f.evidence["shim_start_to_rendezvous_s"] > BUSY_S - 0.5


def test_a_rank_whose_first_work_waits_for_nobody_is_busy_until_it(tmp_path: Path) -> None:
    """No rendezvous before the first step marker: the rank that marked it last is the late one,
    even when another rank's imports (file rows) ran longer."""
    from factories import coll, write_rank

    strings: list[str] = [""]
    rank0 = [coll(float(t), t + 50.0, -1, strings, op="/site/mod.py", kind=Kind.FILE_OPEN) for t in range(0, 500, 50)]
    rank0.append(coll(600.0, 600.0, -1, strings, op="step", kind=Kind.STEP))
    rank1 = [coll(10.0, 20.0, -1, strings, op="/site/mod.py", kind=Kind.FILE_OPEN),
             coll(6000.0, 6000.0, -1, strings, op="step", kind=Kind.STEP)]  # slept 6 s: nothing recorded
    write_rank(tmp_path, 0, 2, rank0, strings)
    write_rank(tmp_path, 1, 2, rank1, strings)
    busy = rank_busy_until(load_run(tmp_path))
    wall0 = 1_700_000_000.0
    assert busy[0] - wall0 == pytest.approx(0.6) and busy[1] - wall0 == pytest.approx(6.0), busy
