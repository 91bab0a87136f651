"""A wait on a non-blocking collective is communication time, not "other calls".

Real jobs (torch gloo ``all_reduce(async_op=True).wait()`` under torchrun, and
mpi4py ``Iallreduce(...).Wait()`` under mpiexec), 3 ranks, rank 1 posting each
of N all-reduces SLEEP seconds late. The others block in their wait for rank 1:
the breakdown must put that time in ``comm_wait_s`` (and ``comm_exposed_s``),
not ``other_s``; rank 1 itself waits for nobody.

How long a rank waits is not only the injected sleep: under an oversubscribed
``mpiexec`` rank 1 can also start its first all-reduce later than the others
(CI saw 0.23 s of start skew on top of the 0.2 s sleep). So the test derives
each rank's expected wait from the recorded rows themselves (per collective,
from its own post to the last rank's post, cut at its own exit) and checks the
breakdown against that, and the injected sleep as a lower bound.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import MPIEXEC, run_in_session

from distdiag.pipeline import analyze
from distdiag.schema import Kind

JOB = Path(__file__).parent / "jobs" / "async_wait.py"
N, SLEEP = 5, 0.2
INJECTED = N * SLEEP


def _run(tmp: Path, backend: str) -> Path:
    d = tmp / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(DISTDIAG_DIR=str(d), DISTDIAG_HOOKS="fileio=0", DISTDIAG_SLURM_OFFLINE="1")
    if backend == "torch":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
               "-m", "distdiag.wrap", str(JOB), "torch", str(N), str(SLEEP)]  # fmt: skip
    else:
        if MPIEXEC is None:
            pytest.fail("mpiexec not found: install the 'mpi' extra (mpi4py + mpich)")
        cmd = [MPIEXEC, "-n", "3", sys.executable, "-m", "distdiag.wrap", sys.executable, str(JOB), "mpi", str(N),
               str(SLEEP)]  # fmt: skip
    run_in_session(cmd, 240, cwd=tmp, env=env, check=True)
    return d


def _expected_wait_s(ev: np.ndarray) -> dict[int, float]:
    """Per rank: the sum over its collectives of [own post, last rank's post), cut at its own exit."""
    kinds = [int(Kind.COLL), int(Kind.COLL_ASYNC), int(Kind.WAIT)]
    rows = ev[np.isin(ev["kind"], kinds) & (ev["seq"] >= 0)]
    posts = rows[rows["kind"] != int(Kind.WAIT)]
    out: dict[int, float] = {}
    for r in np.unique(rows["rank"]):
        total = 0
        for p in posts[posts["rank"] == r]:
            same = (rows["comm_id"] == p["comm_id"]) & (rows["seq"] == p["seq"])
            last_post = posts["t0_ns"][(posts["comm_id"] == p["comm_id"]) & (posts["seq"] == p["seq"])].max()
            own_exit = rows["t1_ns"][same & (rows["rank"] == r)].max()
            total += max(0, min(last_post, own_exit) - p["t0_ns"])
        out[int(r)] = total / 1e9
    return out


@pytest.mark.parametrize(
    "backend", [pytest.param("torch", marks=pytest.mark.torch), pytest.param("mpi", marks=pytest.mark.mpi)]
)
def test_waiting_on_a_late_async_all_reduce_is_comm_wait(tmp_path: Path, backend: str) -> None:
    if backend == "torch":
        pytest.importorskip("torch")
    rep = analyze(_run(tmp_path, backend))
    run, bd = rep.run, rep.breakdown.set_index("rank")
    ev = run.events
    waits = ev[ev["kind"] == int(Kind.WAIT)]
    # every wait names the collective it waits on (comm, seq), as the analysis needs
    assert len(waits) >= 3 * N and np.all(waits["seq"] >= 0), waits[["rank", "comm_id", "seq"]]
    expected = _expected_wait_s(ev)
    for r in (0, 2):
        row = bd.loc[r]
        assert expected[r] > 0.75 * INJECTED, (r, expected)  # the fault really happened
        assert abs(row.comm_wait_s - expected[r]) < 0.05 * INJECTED, (r, expected[r], row.to_dict())
        assert row.comm_exposed_s > 0.75 * INJECTED, (r, row.to_dict())
        # what is left in other_s is not the waits (MPI_Init's span is there for MPI)
        assert row.other_s < bd.loc[1].other_s + 0.25 * INJECTED, (r, row.to_dict())
    assert bd.loc[1].comm_wait_s < 0.25 * INJECTED, bd.loc[1].to_dict()
    cols = ["compute_s", "comm_wait_s", "comm_transfer_s", "io_s", "input_wait_s", "h2d_s", "other_s"]
    assert np.allclose(bd[cols].sum(axis=1), bd["wall_s"], rtol=0.01), bd
