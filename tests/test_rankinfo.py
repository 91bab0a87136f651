"""Rank, world size, local rank, node and job come from each launcher's environment."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import h5py
import pytest

from distdiag.shim.rankinfo import detect, launch_hash

from test_wrap import WRAP_CONSOLE, clean_env

LAUNCHERS = {
    # name: (env, expected (rank, world_size, local_rank, host, job_id, launch_id or None = the hash))
    "slurm": (
        {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_JOB_ID": "4711",
         "SLURM_STEP_ID": "0", "SLURMD_NODENAME": "node07"},
        (5, 8, 1, "node07", "4711", "4711"),
    ),
    "slurm_step2": (
        {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_JOB_ID": "4711",
         "SLURM_STEP_ID": "2", "SLURMD_NODENAME": "node01"},
        (0, 2, 0, "node01", "4711", "4711.2"),
    ),
    "openmpi": (
        {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
         "PMIX_RANK": "3", "PMIX_NAMESPACE": "prterun-vm-123@1"},
        (3, 4, 1, None, "", None),
    ),
    "pmix": ({"PMIX_RANK": "2", "PMIX_NAMESPACE": "ns9", "SLURM_NTASKS": "6", "SLURM_LOCALID": "0"}, (2, 6, 0, None, "", None)),
    "mpich": ({"PMI_RANK": "1", "PMI_SIZE": "3", "MPI_LOCALRANKID": "1", "PMI_FD": "9"}, (1, 3, 1, None, "", None)),
    "torchrun": (
        {"RANK": "6", "WORLD_SIZE": "8", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4",
         "TORCHELASTIC_RUN_ID": "abc", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},
        (6, 8, 2, None, "", None),
    ),
    # mpiexec inside an sbatch script: the batch step's SLURM_PROCID=0 must not win over PMI_RANK
    "mpich_in_sbatch": (
        {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "3", "SLURM_PROCID": "0", "SLURM_NTASKS": "1",
         "SLURM_JOB_ID": "99", "SLURMD_NODENAME": "n3"},
        (3, 4, 3, "n3", "99", "99"),
    ),
    "single": ({}, (0, 1, 0, None, "", None)),
}


@pytest.mark.parametrize("name", sorted(LAUNCHERS))
def test_detect_from_launcher_env(name: str) -> None:
    env, (rank, size, local, host, job, launch) = LAUNCHERS[name]
    info = detect(env, ppid=100)
    assert (info.rank, info.world_size, info.local_rank, info.job_id) == (rank, size, local, job)
    if host is not None:
        assert info.host == host
    assert info.launch_id == (launch if launch is not None else info.launch_hash)
    assert len(info.launch_hash) == 10


def test_distdiag_host_overrides_node_name() -> None:
    env = {**LAUNCHERS["slurm"][0], "DISTDIAG_HOST": "fake-node-b"}
    assert detect(env).host == "fake-node-b"


def test_launch_hash_same_within_a_launch_and_different_across() -> None:
    a0 = {"PMI_RANK": "0", "PMI_SIZE": "2", "PMI_KVSNAME": "kvs_1_0"}
    a1 = {**a0, "PMI_RANK": "1"}
    b0 = {**a0, "PMI_KVSNAME": "kvs_2_0"}
    # PMI_KVSNAME decides, not the parent pid (ranks on other nodes have other parents)
    assert detect(a0, ppid=1).launch_hash == detect(a1, ppid=2).launch_hash
    assert detect(a0, ppid=1).launch_hash != detect(b0, ppid=1).launch_hash
    # with nothing launch-specific in the env (the mpich wheel's Hydra uses PMI_FD) the parent decides
    fd0 = {"PMI_RANK": "0", "PMI_SIZE": "2", "PMI_FD": "9"}
    fd1 = {"PMI_RANK": "1", "PMI_SIZE": "2", "PMI_FD": "11"}
    assert detect(fd0, ppid=7).launch_hash == detect(fd1, ppid=7).launch_hash
    assert detect(fd0, ppid=7).launch_hash != detect(fd0, ppid=8).launch_hash
    t = {"RANK": "0", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "r1", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    assert launch_hash(t, "torchrun", 2, ppid=1) == launch_hash({**t, "RANK": "1"}, "torchrun", 2, ppid=2)
    assert launch_hash(t, "torchrun", 2, ppid=1) != launch_hash({**t, "MASTER_PORT": "2"}, "torchrun", 2, ppid=1)


def test_garbage_values_fall_back_instead_of_raising() -> None:
    info = detect({"PMI_RANK": "x", "SLURM_PROCID": "-3", "SLURM_NTASKS": "zz"})
    assert (info.rank, info.world_size) == (0, 1)
    info = detect({"OMPI_COMM_WORLD_RANK": "4", "OMPI_COMM_WORLD_SIZE": "2"})  # size must exceed rank
    assert (info.rank, info.world_size) == (4, 5)


@pytest.mark.parametrize("name", ["slurm", "openmpi", "mpich", "torchrun"])
def test_wrapped_process_records_its_launcher_identity(tmp_path: Path, name: str) -> None:
    """A real distdiag-wrap process with the launcher's variables set writes rank-NNNNN.h5 with them."""
    env_vars, (rank, size, local, host, job, launch) = LAUNCHERS[name]
    prog = tmp_path / "p.py"
    prog.write_text("print('ok')\n")
    run_dir = tmp_path / "run"
    # a lone process posing as rank k of n: there is no rank 0 to sync clocks with, don't wait for one
    env = clean_env(**env_vars, DISTDIAG_HOST="emulated-node-3", DISTDIAG_HOOKS="mpi4py=0",
                    DISTDIAG_SYNC_START_WAIT_S="0.05", DISTDIAG_EXIT_SYNC_WAIT_S="0.05")
    p = subprocess.run([*WRAP_CONSOLE, "--dir", str(run_dir), sys.executable, str(prog)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout == "ok\n", p.stderr
    assert [x.name for x in run_dir.glob("rank-*")] == [f"rank-{rank:05d}.h5"]
    with h5py.File(run_dir / f"rank-{rank:05d}.h5", "r") as f:
        a = dict(f.attrs)
    assert (int(a["rank"]), int(a["world_size"]), int(a["local_rank"]), a["host"]) == (rank, size, local, "emulated-node-3")
    if job:
        assert a["job_id"] == job
    assert a["launch_id"] == (launch if launch is not None else a["launch_id"])
    env_kept = json.loads(a["env"])
    rank_var = {"slurm": "SLURM_PROCID", "openmpi": "OMPI_COMM_WORLD_RANK", "mpich": "PMI_RANK", "torchrun": "RANK"}[name]
    assert env_kept[rank_var] == str(rank)
    assert "PATH" not in env_kept and "HOME" not in env_kept
