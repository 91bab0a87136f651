"""launchers/: the sbatch template runs the program under distdiag-wrap and analyzes it in the job."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, SlurmCluster

LAUNCHERS = REPO / "launchers"


SCRIPTS = sorted(p.name for p in LAUNCHERS.iterdir() if p.is_file() and p.suffix in (".sh", ".sbatch"))


@pytest.mark.parametrize("name", SCRIPTS)
def test_launcher_scripts_parse(name: str) -> None:
    p = subprocess.run(["bash", "-n", str(LAUNCHERS / name)], capture_output=True, text=True, timeout=10)
    assert p.returncode == 0, p.stderr


@pytest.mark.slurm
def test_sbatch_template_records_and_analyzes_in_the_job(slurm: SlurmCluster, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    # The wheel's ranks through its Hydra, not slurmd's pmi2 plugin (SlurmCluster.srun_mpi says why).
    env = slurm.env(DISTDIAG_WRAP=f"{sys.executable} -m distdiag.wrap", DISTDIAG_CMD=f"{sys.executable} -m distdiag.cli",
                    DISTDIAG_DIR=str(run_dir), DISTDIAG_LAUNCH="mpiexec -launcher slurm")  # fmt: skip
    job = slurm.sbatch(["--time=5", "-o", str(tmp_path / "out.txt"), str(LAUNCHERS / "distdiag.sbatch"),
                        sys.executable, "-m", "distdiag.demo_job", "--slow-rank", "1", "--delay-s", "0.05",
                        "--iters", "30"], cwd=tmp_path, env=env)  # fmt: skip
    slurm.wait_gone(job, timeout_s=240)
    out = (tmp_path / "out.txt").read_text()
    assert "injected delay 1.500 s on rank 1" in out, out
    assert "program exit code 0" in out, out
    rep = json.loads((run_dir / "report.json").read_text())
    assert (run_dir / "report.txt").read_text().startswith("distdiag: job " + job)
    strag = [f for f in rep["findings"] if f["kind"] == "straggler" and f["fraction"] >= 0.02]
    # The template's job is the plumbing: the sleeping rank is named. What the sleep cost
    # the job and the straggler's price are compared in test_slurm_wrap and test_e2e_mpi.
    assert strag and strag[0]["ranks"] == [1], rep["findings"]
    assert rep["run"]["hosts"] == ["n1", "n2"]
    # Analyzed inside the job: Slurm's record of a job still running.
    s = rep["run"]["slurm"]
    assert s["available"] and s["job"]["state"] == "RUNNING" and not s["job"]["final"], s
    # After the job, the analysis refreshes the record to the final one.
    slurm.sacct(job)
    p = subprocess.run([sys.executable, "-m", "distdiag.cli", "analyze", str(run_dir), "--format", "json"],
                       capture_output=True, text=True, timeout=120, env=slurm.env())  # fmt: skip
    assert p.returncode == 0, p.stderr
    after = json.loads(p.stdout)
    s = after["run"]["slurm"]
    assert s["origin"] == "live" and s["job"]["final"] and s["job"]["state"] == "COMPLETED", s
    # The same rank files give the same straggler, analyzed in the job or after it.
    again = [f for f in after["findings"] if f["kind"] == "straggler" and f["fraction"] >= 0.02]
    assert [(f["ranks"], f["cost_s"]) for f in again] == [(f["ranks"], f["cost_s"]) for f in strag]
