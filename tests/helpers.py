"""Helpers several test modules share (import as ``from helpers import ...``).

Real jobs only: ``mpiexec`` from the mpich wheel, ``python -m distdiag.wrap``,
a timeout on every subprocess.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator, Sequence

import pytest

MPIEXEC = shutil.which("mpiexec")
REPO = Path(__file__).resolve().parent.parent

#: A launcher's rank variables: a program run outside any launcher must not inherit them.
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "PMI_RANK", "PMI_SIZE", "PMI_FD", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")  # fmt: skip


def holders(path: Path) -> list[int]:
    """PIDs of the processes that have ``path`` open (read from /proc: ours, as root, all)."""
    want = os.path.realpath(path)
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == want:
                    out.append(int(pid))
                    break
            except OSError:
                continue
    return out


def wait_until_closed(path: Path, timeout_s: float = 30.0) -> None:
    """Wait until no process has ``path`` open: a rank file written by a helper process
    (``writer = "process"``) is complete once its helper closed it, which may be after the
    rank's death."""
    import time

    end = time.monotonic() + timeout_s
    while holders(path):
        if time.monotonic() > end:
            raise TimeoutError(f"{path} still open by {holders(path)} after {timeout_s} s")
        time.sleep(0.01)


def single_process_env(**extra: str) -> dict[str, str]:
    """os.environ without a launcher's rank variables or distdiag's/Slurm's settings, with this
    checkout on PYTHONPATH, plus ``extra``: one process, as a user starts it by hand."""
    e = {k: v for k, v in os.environ.items()
         if k not in LAUNCH_VARS and not k.startswith(("DISTDIAG_", "SLURM_"))}  # fmt: skip
    e["PYTHONPATH"] = str(REPO)
    e.update(extra)
    return e


def demo_args(tmp: Path, iters: int, slow_rank: int = 2, delay_s: float = 0.02) -> list[str]:
    """Arguments of a job script that takes a scratch dir then ``distdiag.demo_job``'s options."""
    return [str(tmp), "--iters", str(iters), "--slow-rank", str(slow_rank), "--delay-s", str(delay_s)]


def run_wrapped_mpi(tmp: Path, job_src: str, args: list[str] | None = None, n: int = 4,
                    env: dict[str, str] | None = None, timeout_s: float = 180) -> Path:
    """Write ``job_src`` to tmp/job.py, run it on ``n`` ranks under ``distdiag.wrap`` and return tmp/run.

    Fails the test (with the job's output) when mpiexec is missing or the job exits non-zero.
    """
    if MPIEXEC is None:
        pytest.fail("mpiexec not found: install the 'mpi' extra (mpi4py + mpich)")
    job = tmp / "job.py"
    job.write_text(job_src)
    run_dir = tmp / "run"
    cmd = [MPIEXEC, "-n", str(n), sys.executable, "-m", "distdiag.wrap", "--dir", str(run_dir), sys.executable,
           str(job), *(args or [])]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    return run_dir


def fill_prog(exit_code: int) -> str:
    """A job that records ~5.5 MB of MARK rows in 0.4 s, prints 'finished' and exits ``exit_code``
    (for the tests where the writer's disk fills or a size limit stops it)."""
    return (
        "import time, distdiag\n"
        "for i in range(40):\n"
        "    for j in range(2000):\n"
        "        distdiag.mark('tick')\n"
        "    time.sleep(0.01)\n"
        "print('finished')\n"
        f"raise SystemExit({int(exit_code)})\n"
    )


def run_in_session(cmd: list[str], timeout_s: float, *, cwd: Path | None = None, env: dict[str, str] | None = None,
                   check: bool = False, merged: bool = False) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` in its own session; on timeout kill that session (mpiexec or torchrun and its ranks:
    ours only) and fail the test. With ``check`` a non-zero exit fails it too, with the output. With
    ``merged`` its stderr goes into its stdout (a launcher's and its ranks' lines in the order they
    came; ``stderr`` is then empty)."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT if merged else subprocess.PIPE,
                         text=True, cwd=cwd, env=env, start_new_session=True)  # fmt: skip
    try:
        out, err = p.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)  # the group we created, by its leader's PID
        out, err = p.communicate(timeout=30)
        pytest.fail(f"{cmd[:6]} timed out after {timeout_s} s\nstdout:\n{out[-3000:]}\nstderr:\n{(err or '')[-3000:]}")
    err = err or ""  # None when merged
    if check and p.returncode != 0:
        pytest.fail(f"{cmd} exited {p.returncode}\nstdout:\n{out}\nstderr:\n{err}")
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


@contextlib.contextmanager
def small_tmpfs(tmp_path: Path, size: str) -> Iterator[Path]:
    """A real tmpfs of ``size`` (``mount -o size=3m``) at tmp_path/small, unmounted afterwards:
    a disk that fills. Skips the test where it cannot exist (not root, no mount)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root to mount a small tmpfs")
    mnt = tmp_path / "small"
    mnt.mkdir()
    m = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True, timeout=30)
    if m.returncode != 0:
        pytest.skip(f"cannot mount tmpfs: {m.stderr!r}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True, timeout=30)


def wait_for_writers(run_dir: Path, timeout_s: float = 60.0) -> None:
    """Wait until every rank file of ``run_dir`` is closed by its writer: after a rank's death its
    helper process finishes the file (within seconds: it may first import numpy and h5py and take
    over the rank's spill log; distdiag.shim.helper), and a test reading the files by hand reads
    them finished."""
    for f in sorted(run_dir.glob("rank-*.h5")):
        wait_until_closed(f, timeout_s)


def stat_calls(ev: Any, strings: Sequence[str], path: str) -> int:
    """How many stat calls on ``path`` the rank file's rows stand for: its own rows, and the
    sums the libc interposer's rate rule made of a hot loop's calls (named ``<dir>/*``, ``seq``
    the calls they stand for: ``distdiag.rows.calls_of``)."""
    import numpy as np

    from distdiag.rows import calls_of
    from distdiag.schema import Kind

    names = {path, os.path.dirname(path) + "/*"}
    ok = np.array([strings[i] in names for i in ev["name_id"]], bool) if len(ev) else np.zeros(0, bool)
    return int(calls_of(ev[(ev["kind"] == Kind.FILE_STAT) & ok]).sum())
