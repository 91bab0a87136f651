"""Who am I in this launch: rank, world size, local rank, node, job and launch id.

Read from the launcher's environment, first match wins, most specific launcher
first (an ``mpiexec`` or ``torchrun`` inside an ``sbatch`` script inherits the
batch step's ``SLURM_PROCID=0``, so Slurm's task variables only count when no
MPI/torch launcher set its own):

=========  =============================================================
torchrun   RANK, WORLD_SIZE, LOCAL_RANK (LOCAL_WORLD_SIZE)
Open MPI   OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_RANK
PMIx       PMIX_RANK (size from OMPI_COMM_WORLD_SIZE / PMI_SIZE / SLURM_NTASKS)
MPICH      PMI_RANK, PMI_SIZE, MPI_LOCALRANKID (Hydra; also srun --mpi=pmi2)
Slurm      SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID
(none)     a single rank: 0 of 1
=========  =============================================================

The node name is ``DISTDIAG_HOST`` when set (tests that emulate several nodes
on one machine use it), else ``SLURMD_NODENAME``, else the host name. The job
id is ``SLURM_JOB_ID`` under Slurm; outside a scheduler it is the launch id.

The launch id is the same on every rank of one launch and differs between
launches: ``<jobid>`` or ``<jobid>.<stepid>`` under Slurm, else a short hash of
what all ranks of one launch share (``launch_hash``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import socket
from typing import Mapping


@dataclasses.dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    local_rank: int
    host: str
    job_id: str  # scheduler job id; "" outside a scheduler
    step_id: str  # Slurm step id; "" when none
    launcher: str  # "torchrun" | "openmpi" | "pmix" | "mpich" | "slurm" | "single"
    launch_hash: str  # 10 hex digits shared by every rank of the launch

    @property
    def launch_id(self) -> str:
        if self.job_id:
            return self.job_id if self.step_id in ("", "0") else f"{self.job_id}.{self.step_id}"
        return self.launch_hash


def _int(env: Mapping[str, str], name: str) -> int | None:
    v = env.get(name)
    if v is None:
        return None
    try:
        return int(v.strip())
    except ValueError:
        return None


def _first_int(env: Mapping[str, str], *names: str) -> int | None:
    for n in names:
        v = _int(env, n)
        if v is not None:
            return v
    return None


def _ancestor_pid(names: tuple[str, ...], start_pid: int | None = None, max_depth: int = 8) -> int | None:
    """The nearest ancestor process whose command name is one of ``names`` (Linux /proc)."""
    pid = os.getppid() if start_pid is None else start_pid
    for _ in range(max_depth):
        if pid <= 1:
            return None
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:
            return None
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses
        comm = stat[stat.find("(") + 1 : stat.rfind(")")]
        if comm in names:
            return pid
        try:
            pid = int(stat[stat.rfind(")") + 2 :].split()[1])
        except (IndexError, ValueError):
            return None
    return None


def launch_hash(env: Mapping[str, str], launcher: str, world_size: int, ppid: int | None = None) -> str:
    """A short hash of the environment values every rank of one launch shares.

    - Slurm: job id + step id.
    - Hydra (MPICH): PMI_PORT / PMI_KVSNAME when set; the PyPI ``mpich`` wheel's
      Hydra uses PMI_FD and sets neither, so then the parent pid (the node's
      ``hydra_pmi_proxy``, found up the process tree), which only ranks on
      one node share.
    - Open MPI / PMIx: PMIX_NAMESPACE / OMPI_MCA_ess_base_jobid.
    - torchrun: TORCHELASTIC_RUN_ID + MASTER_ADDR + MASTER_PORT.
    - a single rank: the parent pid.
    """
    if ppid is None:
        # Hydra's per-node proxy, even when the rank runs under `bash -c ...`
        ppid = (_ancestor_pid(("hydra_pmi_proxy",)) if launcher == "mpich" else None) or os.getppid()
    keys: list[str]
    if launcher == "torchrun":
        keys = ["TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT"]
    elif launcher in ("openmpi", "pmix"):
        keys = ["PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid", "PMIX_SERVER_URI41", "PMIX_SERVER_URI4"]
    elif launcher == "mpich":
        keys = ["PMI_PORT", "PMI_KVSNAME"]
    else:
        keys = []
    parts = [launcher, str(world_size)] + [f"{k}={env[k]}" for k in keys if env.get(k)]
    if env.get("SLURM_JOB_ID"):
        parts += [f"job={env['SLURM_JOB_ID']}", f"step={env.get('SLURM_STEP_ID', '')}"]
    if len(parts) == 2 + (2 if env.get("SLURM_JOB_ID") else 0):
        # nothing launch-specific from the launcher itself: the parent process
        parts.append(f"ppid={ppid}")
    return hashlib.sha1("\0".join(parts).encode()).hexdigest()[:10]


def detect(environ: Mapping[str, str] | None = None, ppid: int | None = None) -> RankInfo:
    """Rank info from the environment; never raises."""
    env = os.environ if environ is None else environ
    rank: int | None
    size: int | None
    local: int | None
    if _int(env, "RANK") is not None and _int(env, "WORLD_SIZE") is not None:
        launcher = "torchrun"
        rank, size, local = _int(env, "RANK"), _int(env, "WORLD_SIZE"), _int(env, "LOCAL_RANK")
    elif _int(env, "OMPI_COMM_WORLD_RANK") is not None:
        launcher = "openmpi"
        rank = _int(env, "OMPI_COMM_WORLD_RANK")
        size = _int(env, "OMPI_COMM_WORLD_SIZE")
        local = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK")
    elif _int(env, "PMIX_RANK") is not None:
        launcher = "pmix"
        rank = _int(env, "PMIX_RANK")
        size = _first_int(env, "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "PMI_SIZE", "SLURM_NTASKS", "SLURM_NPROCS")
        local = _first_int(env, "OMPI_COMM_WORLD_LOCAL_RANK", "PMIX_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID")
    elif _int(env, "PMI_RANK") is not None:
        launcher = "mpich"
        rank = _int(env, "PMI_RANK")
        size = _first_int(env, "PMI_SIZE", "SLURM_NTASKS", "SLURM_NPROCS")
        local = _first_int(env, "MPI_LOCALRANKID", "SLURM_LOCALID")
    elif _int(env, "SLURM_PROCID") is not None:
        launcher = "slurm"
        rank = _int(env, "SLURM_PROCID")
        size = _first_int(env, "SLURM_NTASKS", "SLURM_NPROCS")
        local = _int(env, "SLURM_LOCALID")
    else:
        launcher, rank, size, local = "single", 0, 1, 0
    rank = rank if rank is not None and rank >= 0 else 0
    size = size if size is not None and size > rank else rank + 1
    local = local if local is not None and local >= 0 else 0
    host = env.get("DISTDIAG_HOST") or env.get("SLURMD_NODENAME") or _hostname()
    job_id = env.get("SLURM_JOB_ID", "") or ""
    step_id = env.get("SLURM_STEP_ID", "") if job_id else ""
    return RankInfo(
        rank=rank,
        world_size=size,
        local_rank=local,
        host=host,
        job_id=job_id,
        step_id=step_id or "",
        launcher=launcher,
        launch_hash=launch_hash(env, launcher, size, ppid),
    )


def _hostname() -> str:
    try:
        return socket.gethostname().split(".")[0] or "localhost"
    except Exception:
        return "localhost"
