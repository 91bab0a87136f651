"""Shared test fixtures. Keep each one small; add yours below the last.

Markers (declared in pyproject.toml) say what a test needs; fixtures skip a test
only when that need is truly absent on this machine, and never where CI
promises it: ``.ci/run`` sets ``DISTDIAG_SLURM_REQUIRED=1`` after bringing up
Slurm, so there a missing Slurm FAILS the Slurm tests instead of skipping them.
"""

from __future__ import annotations

import faulthandler
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent

# One BLAS/OpenMP thread per process, for every job the tests start (they
# inherit this environment). The tests run 3-4 ranks on 2 cores; each rank's
# numpy would otherwise start one OpenBLAS thread per core, and those threads
# spin while they wait: 8+ busy threads on 2 cores. Measured (issue 16): the
# demo job's healthy loop took 3.6-4.6 s with them and 0.17-0.41 s without
# (40 iterations, 4 ranks), and the noise they made was larger than the
# faults the tests inject. A cluster job runs one rank per core with one
# thread (torchrun sets OMP_NUM_THREADS=1 for the same reason); that is what
# the tests emulate. A test that wants more threads sets them itself.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"
# And MPICH's waiting ranks sleep between polls instead of spinning: on a
# cluster a rank that waits in a collective spins on its own core, here it
# takes the core of a rank that works. Measured (4 A/B pairs of the demo job,
# load 6-8): spinning, the healthy loop took 0.17-0.53 s and the ranks' work
# overlapped the slow rank's sleep, so a 2.0 s sleep cost the job 1.7-2.1 s;
# sleeping, 0.07-0.24 s and 1.97-2.10 s, priced 1.94-2.02 s.
os.environ["MPIR_CVAR_ENABLE_HEAVY_YIELD"] = "1"


# --- slurm -----------------------------------------------------------------------


def _slurm_dir() -> Path:
    return Path(os.environ.get("DISTDIAG_SLURM_DIR", "/tmp/distdiag-slurm"))


@dataclass
class SlurmCluster:
    """The single-host, two-node Slurm stood up by ``tests/slurm/up.sh``."""

    dir: Path
    conf: Path
    nodes: list[str] = field(default_factory=lambda: ["n1", "n2"])

    def env(self, **extra: str) -> dict[str, str]:
        """os.environ plus what srun/sbatch/sacct need to reach this cluster."""
        env = dict(os.environ)
        env["SLURM_CONF"] = str(self.conf)
        # A test runs inside no allocation: drop any a developer's shell holds.
        for k in [k for k in env if k.startswith("SLURM_") and k != "SLURM_CONF"]:
            del env[k]
        # MPI jobs that tests start with a plain `srun` still get PMI from
        # slurmd's pmi2 plugin, which misreads PMI-1 lines over 1024 bytes
        # (see srun_mpi). With OFI the wheel's only PMI value of any size is
        # each node root's 16-byte TCP address (a ~90-byte line at 2, 4 or 8
        # ranks a node); UCX's card is ~4 kB, put in segments whose lines
        # reach ~1080 bytes. Plain srun --mpi=pmi2, 2 nodes x 2 ranks, one
        # busy core beside: 7 hangs in 60 jobs with UCX, none in 60 with OFI
        # (README, "MPI under srun").
        env.setdefault("MPIR_CVAR_CH4_NETMOD", "ofi")
        env.update(extra)
        return env

    def run(self, args: list[str], timeout_s: float = 60, check: bool = True, **kw: Any) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client command (srun, sbatch, scontrol ...) with a timeout."""
        kw.setdefault("env", self.env())
        p = subprocess.run(args, capture_output=True, text=True, timeout=timeout_s, **kw)
        if check and p.returncode != 0:
            raise AssertionError(f"{' '.join(args)} exited {p.returncode}\nstdout: {p.stdout}\nstderr: {p.stderr}")
        return p

    def srun_mpi(
        self, args: list[str], name: str, timeout_s: float = 150, **kw: Any
    ) -> subprocess.CompletedProcess[str]:
        """An MPI job of the mpich wheel on this cluster, launched so that it cannot hang in MPI_Init.

        ``args`` as for srun: allocation options, one token each (``-N2``,
        ``--ntasks-per-node=2``, ``--time=5``), then the program. It runs as
        ``salloc --job-name NAME OPTIONS mpiexec -launcher slurm PROGRAM``:
        Slurm allocates the nodes and starts one Hydra proxy per node (a job
        step with ``--mpi=none``, through ``HYDRA_LAUNCHER_EXTRA_ARGS``); the
        proxies serve PMI to the ranks. The ranks still see the job's Slurm
        variables (SLURM_JOB_ID, SLURMD_NODENAME n1/n2: distdiag's hosts) and
        Hydra's PMI_RANK, block-distributed like srun's tasks.

        Why not ``srun --mpi=pmi2``: the wheel speaks PMI-1 only, and Slurm
        22.05's pmi2 plugin reads each PMI-1 request with a single read() of
        at most 1024 bytes (pmi1.c, "TODO: read until newline"). The wheel's
        UCX business card is put in segments whose lines are longer than that
        now and then (zero runs are compressed, so their length varies), and
        slurmd misparses the rest ("value not properly terminated", "invalid
        client request") and the ranks can wait in MPI_Init forever: 7 hangs
        in 60 such jobs, one busy core beside (tests/slurm/launch_soak.py
        --mode srun-pmi2). This way, 60 of 60 with UCX and 60 of 60 with OFI
        (--mode srun-mpi), none hung and slurmd logged no PMI error: there is
        no relaunch.
        """
        n_opts = next((i for i, a in enumerate(args) if not a.startswith("-")), len(args))
        opts, prog = args[:n_opts], args[n_opts:]
        if not prog:
            raise ValueError(f"srun_mpi: no program in {args}")
        env = dict(kw.pop("env", None) or self.env())
        env.setdefault("HYDRA_LAUNCHER_EXTRA_ARGS", "--mpi=none")
        kw.setdefault("stdin", subprocess.DEVNULL)  # mpiexec forwards its stdin to rank 0: never the terminal's
        cmd = ["salloc", "--job-name", name, *opts, "mpiexec", "-launcher", "slurm", *prog]
        try:
            p = self.run(cmd, timeout_s=timeout_s, check=False, env=env, **kw)
        except subprocess.TimeoutExpired:
            self.run(["scancel", "--name", name], check=False, timeout_s=20)
            raise AssertionError(f"{' '.join(cmd)} did not finish in {timeout_s} s (cancelled)") from None
        if p.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} exited {p.returncode}\nstdout: {p.stdout}\nstderr: {p.stderr}")
        return p

    def sbatch(self, args: list[str], timeout_s: float = 30, **kw: Any) -> str:
        """Submit with ``sbatch --parsable``; returns the job id."""
        p = self.run(["sbatch", "--parsable", *args], timeout_s=timeout_s, **kw)
        return p.stdout.strip().split(";")[0]

    def wait_gone(self, job_id: str, timeout_s: float = 60) -> None:
        """Block until the job left the queue (finished, failed or cancelled)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                p = self.run(["squeue", "-h", "-j", job_id, "-o", "%T"], check=False, timeout_s=20)
            except subprocess.TimeoutExpired:
                # slurmctld busy (a full suite on 2 loaded cores kept it >10 s once): ask again
                continue
            if p.returncode != 0 or not p.stdout.strip():
                return
            time.sleep(0.3)
        self.run(["scancel", job_id], check=False, timeout_s=10)
        raise AssertionError(f"Slurm job {job_id} still queued/running after {timeout_s} s (cancelled)")

    def sacct(self, job_id: str, timeout_s: float = 30) -> dict[str, Any]:
        """The job's final ``sacct --json`` record.

        Right after a job ends, slurmdbd first holds a placeholder row (name
        "allocation", no eligible time) for a few seconds: poll until the row
        is the finished job's.
        """
        deadline = time.monotonic() + timeout_s
        last: Any = None
        while time.monotonic() < deadline:
            p = self.run(["sacct", "-j", job_id, "--json"], check=False, timeout_s=15)
            if p.returncode == 0:
                jobs = [j for j in json.loads(p.stdout).get("jobs", []) if str(j.get("job_id")) == job_id]
                if jobs:
                    last = jobs[0]
                    t = last.get("time", {})
                    state = last.get("state", {}).get("current", "")
                    if t.get("eligible") and t.get("end") and state not in ("PENDING", "RUNNING"):
                        return dict(last)
            time.sleep(0.5)
        raise AssertionError(f"sacct has no final record of job {job_id} after {timeout_s} s; last: {last}")


def _slurm_problem(d: Path, resume: bool = True) -> str | None:
    """Why the test Slurm cannot be used, or None when it answers."""
    conf = d / "etc" / "slurm.conf"
    if shutil.which("srun") is None:
        return "srun not on PATH (Slurm client not installed; .ci/run installs it)"
    if not conf.exists():
        return f"{conf} missing (run tests/slurm/up.sh)"
    env = dict(os.environ, SLURM_CONF=str(conf))
    try:
        p = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, timeout=10, env=env)
    except subprocess.TimeoutExpired:
        return "sinfo timed out: slurmctld not answering (run tests/slurm/up.sh)"
    if p.returncode != 0:
        return f"sinfo failed: {p.stderr.strip()} (run tests/slurm/up.sh)"
    states = dict(line.split() for line in p.stdout.splitlines() if line.strip())
    bad = {n: s for n, s in states.items() if not s.rstrip("*").startswith(("idle", "mix", "alloc", "comp"))}
    if bad and resume:
        # A step that would not die in time (a loaded machine) drains its node:
        # the test cluster is ours, so put the nodes back to work once.
        subprocess.run(["scontrol", "update", f"NodeName={','.join(bad)}", "State=RESUME"], capture_output=True,
                       timeout=10, env=env)  # fmt: skip
        return _slurm_problem(d, resume=False)
    if len(states) < 2 or bad:
        return f"test Slurm nodes not usable: {states}"
    return None


@pytest.fixture(scope="session")
def slurm() -> SlurmCluster:
    """The test Slurm; skips when it is not running, FAILS when CI requires it."""
    d = _slurm_dir()
    why = _slurm_problem(d)
    if why is not None:
        if os.environ.get("DISTDIAG_SLURM_REQUIRED") == "1":
            pytest.fail(f"Slurm required (DISTDIAG_SLURM_REQUIRED=1) but {why}", pytrace=False)
        pytest.skip(f"no test Slurm: {why}")
    return SlurmCluster(dir=d, conf=d / "etc" / "slurm.conf")


# -- a hard bound on each test -------------------------------------------------------------------------
#: No test runs longer (setup, call and teardown); a hung one ends the whole run with every
#: thread's stack on stderr, where CI shows it. An in-process bound (SIGALRM, a timer thread)
#: cannot end a loop inside a C library that holds the GIL (libhdf5's, see distdiag.gheap);
#: faulthandler's own thread can. Before this bound a hang ran CI into its 80-minute limit
#: with no word of where.
_TEST_LIMIT_S = float(os.environ.get("DISTDIAG_TEST_LIMIT_S", "900"))
_STDERR_FD: list[int] = []


def pytest_configure(config: pytest.Config) -> None:
    _STDERR_FD.append(os.dup(sys.__stderr__.fileno() if sys.__stderr__ is not None else 2))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    if _STDERR_FD and _TEST_LIMIT_S > 0:
        faulthandler.dump_traceback_later(_TEST_LIMIT_S, exit=True, file=_STDERR_FD[0])
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


# -- the corpus of real runs (tests/corpus.py): DISTDIAG_CORPUS_DIR=DIR copies each test's run dirs --------
_CORPUS_MAX_BYTES = 64 << 20  # a run dir larger than this is left out (a scale test's)


@pytest.fixture(autouse=True)
def _corpus_copy(request: pytest.FixtureRequest) -> Any:
    """With ``DISTDIAG_CORPUS_DIR`` set: after each test, every directory under its ``tmp_path``
    that holds rank files is copied to ``$DISTDIAG_CORPUS_DIR/<test>/<dir>`` (for
    ``tests/corpus.py record --from``). Off (and free) otherwise."""
    dest_root = os.environ.get("DISTDIAG_CORPUS_DIR")
    if not dest_root or "tmp_path" not in request.fixturenames:
        yield
        return
    tmp: Path = request.getfixturevalue("tmp_path")  # now: torn down after this fixture
    yield
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in request.node.nodeid)[-150:]
    for d in sorted({p.parent for p in tmp.rglob("rank-*.h5")}):
        try:
            if sum(f.stat().st_size for f in d.rglob("*") if f.is_file()) > _CORPUS_MAX_BYTES:
                continue
            shutil.copytree(d, Path(dest_root) / name / d.relative_to(tmp), symlinks=True, dirs_exist_ok=True)
        except OSError:
            pass  # a run dir the test left half-made or unreadable: not corpus material
