"""The test Slurm itself: two nodes, MPI under srun, accounting through sacct."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, SlurmCluster

pytestmark = pytest.mark.slurm


def test_srun_spreads_tasks_over_two_named_nodes(slurm: SlurmCluster, tmp_path: Path) -> None:
    p = slurm.run(
        ["srun", "-N2", "--ntasks-per-node=2", "bash", "-c", 'echo "$SLURMD_NODENAME $SLURM_PROCID $SLURM_NODEID"'],
        cwd=tmp_path,
    )
    rows = sorted(tuple(line.split()) for line in p.stdout.splitlines())
    assert [r[1] for r in rows] == ["0", "1", "2", "3"]
    nodes = {r[0] for r in rows}
    assert nodes == {"n1", "n2"}
    # SLURM_NODEID follows the node name: ranks on one node share it.
    assert len({(r[0], r[2]) for r in rows}) == 2


def test_mpi_world_of_four_under_srun_pmi2(slurm: SlurmCluster, tmp_path: Path) -> None:
    code = "from mpi4py import MPI; c = MPI.COMM_WORLD; print(c.Get_rank(), c.Get_size(), c.allreduce(1))"
    p = slurm.run(["srun", "-N2", "-n4", sys.executable, "-c", code], cwd=tmp_path, timeout_s=90)
    rows = sorted(line.split() for line in p.stdout.splitlines())
    assert rows == [[str(r), "4", "4"] for r in range(4)], p.stdout + p.stderr


def test_sacct_json_gives_submit_eligible_start_end(slurm: SlurmCluster, tmp_path: Path) -> None:
    job = slurm.sbatch(["-N1", "-n1", "-o", str(tmp_path / "out"), "--wrap", "sleep 2"], cwd=tmp_path)
    slurm.wait_gone(job, timeout_s=60)
    rec = slurm.sacct(job)
    t = rec["time"]
    assert rec["state"]["current"] == "COMPLETED"
    assert 0 < t["submission"] <= t["eligible"] <= t["start"] < t["end"]
    # Seconds resolution: a 2 s sleep shows as 2-4 s of run time.
    assert 2 <= t["end"] - t["start"] <= 4, t


def test_up_sh_again_starts_nothing_and_keeps_the_daemons(slurm: SlurmCluster) -> None:
    run = slurm.dir / "run"
    names = ["munged", "mariadbd", "slurmdbd", "slurmctld", "slurmd-n1", "slurmd-n2"]
    before = {n: (run / f"{n}.pid").read_text().strip() for n in names if (run / f"{n}.pid").exists()}
    p = subprocess.run([str(REPO / "tests" / "slurm" / "up.sh")], capture_output=True, text=True, timeout=60,
                       env=slurm.env(DISTDIAG_SLURM_DIR=str(slurm.dir)))  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.count("already running") >= 5, p.stdout
    assert (run / "started.pids").read_text().split() == []
    after = {n: (run / f"{n}.pid").read_text().strip() for n in before}
    assert after == before
