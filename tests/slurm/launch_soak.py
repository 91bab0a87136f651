"""Launch soak: N consecutive 4-rank MPI jobs on the test Slurm, each with a timeout.

    python3 tests/slurm/launch_soak.py --mode srun-mpi --jobs 50 --busy 1
    python3 tests/slurm/launch_soak.py --mode sbatch --jobs 50 --busy 1
    python3 tests/slurm/launch_soak.py --mode srun-pmi2 --jobs 50 --busy 1   # the old path

Modes (2 nodes x 2 tasks, ``python -m distdiag.wrap`` around ``distdiag.demo_job``):

  srun-mpi   ``SlurmCluster.srun_mpi`` of tests/conftest.py, exactly as the tests
             launch their MPI jobs (no retry is hidden from the count: a second
             launch would show as a failure of the first, see ``--no-retry``)
  sbatch     ``launchers/distdiag.sbatch`` submitted as
             test_slurm_launchers.py does (the job records and analyzes itself;
             DISTDIAG_LAUNCH="mpiexec -launcher slurm", the template's plain
             srun with ``--env DISTDIAG_LAUNCH=srun``)
  srun-pmi2  plain ``srun --mpi=pmi2`` of the wheel's ranks: slurmd's pmi2
             plugin serves PMI (the path that hung in MPI_Init)

Every job must finish within ``--timeout`` seconds with exit code 0, and its run
dir must hold 4 rank files, closed cleanly, of ranks 0-3 on hosts n1 n1 n2 n2
with the job's id. A job past its timeout is a hang: it is cancelled and the
soak goes on, so the count is a rate. ``--busy N`` runs N busy-looping
processes beside the jobs (killed by PID at the end). New "mpi/pmi2" error
lines in the slurmd logs during the soak are counted. Needs tests/slurm/up.sh.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))

from conftest import SlurmCluster, _slurm_dir, _slurm_problem  # noqa: E402

DEMO = ["-m", "distdiag.demo_job", "--iters", "5", "--slow-rank", "-1", "--delay-s", "0"]
WANT_HOSTS = ["n1", "n1", "n2", "n2"]


def _check_run(run_dir: Path, job_id: str) -> str | None:
    """Why the run dir is not a clean 4-rank run of this job on n1 n1 n2 n2, or None."""
    import h5py

    files = sorted(run_dir.glob("rank-*.h5"))
    if len(files) != 4:
        return f"{len(files)} rank files"
    got = []
    for f in files:
        with h5py.File(f, "r") as h:
            a = h.attrs
            got.append((int(a["rank"]), str(a["host"]), str(a["job_id"]), bool(a["closed_cleanly"]), int(a["exit_code"])))
    if [g[0] for g in got] != [0, 1, 2, 3] or [g[1] for g in got] != WANT_HOSTS:
        return f"ranks/hosts {[(g[0], g[1]) for g in got]}"
    if job_id and any(g[2] != job_id for g in got):
        return f"job ids {[g[2] for g in got]} (want {job_id})"
    if not all(g[3] and g[4] == 0 for g in got):
        return f"closed_cleanly/exit_code {[(g[3], g[4]) for g in got]}"
    return None


def _job_id_of(name: str, slurm: SlurmCluster, stderr: str = "") -> str:
    """The job's id: from salloc's "Granted job allocation N", else sacct (which lags the job's end a little)."""
    m = re.search(r"Granted job allocation (\d+)", stderr)
    if m:
        return m.group(1)
    for _ in range(20):
        p = slurm.run(["sacct", "-n", "-X", "-P", "--name", name, "-o", "jobid"], check=False, timeout_s=20)
        ids = [x for x in p.stdout.split() if x.strip()]
        if ids:
            return ids[-1]
        time.sleep(0.5)
    return ""


def _one(mode: str, i: int, slurm: SlurmCluster, base: Path, timeout_s: float, env: dict[str, str]) -> dict[str, Any]:
    name = f"soak{os.getpid()}-{i}"
    work = base / name
    work.mkdir()
    run_dir = work / "run"
    py = sys.executable
    t0 = t_done = time.monotonic()
    job_id, why = "", None
    try:
        if mode == "srun-mpi":
            try:
                p = slurm.srun_mpi(["-N2", "--ntasks-per-node=2", "--time=5", py, "-m", "distdiag.wrap", "--dir",
                                    str(run_dir), py, *DEMO], name, timeout_s=timeout_s, cwd=work,
                                   env=slurm.env(**env))  # fmt: skip
                t_done = time.monotonic()
                if "demo: 4 ranks" not in p.stdout:
                    why = f"no demo line in stdout: {p.stdout[-300:]!r} {p.stderr[-300:]!r}"
                job_id = _job_id_of(name, slurm, p.stderr)
            except AssertionError as e:
                t_done = time.monotonic()
                why = "hang" if "did not finish" in str(e) else f"failed: {str(e)[-400:]}"
                job_id = _job_id_of(name, slurm, str(e))
        elif mode == "srun-pmi2":
            cmd = ["srun", "--job-name", name, "--mpi=pmi2", "-N2", "--ntasks-per-node=2", "--time=5", py, "-m",
                   "distdiag.wrap", "--dir", str(run_dir), py, *DEMO]  # fmt: skip
            try:
                p = slurm.run(cmd, timeout_s=timeout_s, check=False, cwd=work, env=slurm.env(**env))
                t_done = time.monotonic()
                if p.returncode != 0:
                    why = f"exit {p.returncode}: {p.stderr[-400:]}"
            except subprocess.TimeoutExpired:
                t_done = time.monotonic()
                why = "hang"
                slurm.run(["scancel", "--name", name], check=False, timeout_s=20)
            job_id = _job_id_of(name, slurm)
        else:  # sbatch, as test_slurm_launchers.py submits the template
            out = work / "out.txt"
            senv = slurm.env(**{"DISTDIAG_WRAP": f"{py} -m distdiag.wrap", "DISTDIAG_CMD": f"{py} -m distdiag.cli",
                                "DISTDIAG_DIR": str(run_dir), "DISTDIAG_LAUNCH": "mpiexec -launcher slurm", **env})  # fmt: skip
            job_id = slurm.sbatch(["--time=5", "-J", name, "-o", str(out), str(REPO / "launchers" / "distdiag.sbatch"),
                                   py, *DEMO], cwd=work, env=senv)  # fmt: skip
            try:
                slurm.wait_gone(job_id, timeout_s=timeout_s)
                t_done = time.monotonic()
                text = out.read_text() if out.exists() else ""
                if "program exit code 0" not in text:
                    why = f"job output: {text[-400:]!r}"
                elif not (run_dir / "report.json").is_file():
                    why = "no report.json"
            except AssertionError:
                t_done = time.monotonic()
                why = "hang"
    except subprocess.TimeoutExpired as e:  # a Slurm client command itself
        t_done, why = time.monotonic(), f"client timeout: {e}"
    dt = t_done - t0  # the launch to its end; the job-id look-up after it is not counted
    if why is None:
        why = _check_run(run_dir, job_id)
    return {"i": i, "name": name, "job": job_id, "s": round(dt, 2), "ok": why is None, "why": why}


def _pmi_errors(logs: dict[Path, int], jobs: set[str]) -> int:
    """slurmd's "mpi/pmi2: ... error" lines since the soak began, of the soak's own jobs' steps."""
    n = 0
    for f, size in logs.items():
        if f.exists():
            for line in f.read_bytes()[size:].decode(errors="replace").splitlines():
                m = re.search(r"\] \[(\d+)\.", line)
                n += bool(m and m.group(1) in jobs and "mpi/pmi2:" in line and "error" in line)
    return n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["srun-mpi", "sbatch", "srun-pmi2"], required=True)
    ap.add_argument("--jobs", type=int, default=50)
    ap.add_argument("--timeout", type=float, default=90, help="seconds a job may take before it counts as a hang")
    ap.add_argument("--busy", type=int, default=1, help="busy-looping processes beside the jobs")
    ap.add_argument("--env", action="append", default=[], metavar="K=V", help="extra environment of every job")
    ap.add_argument("--stop-on-fail", action="store_true")
    ap.add_argument("--json", type=Path, help="write every job's record here")
    ns = ap.parse_args(argv)
    env = dict(kv.split("=", 1) for kv in ns.env)

    d = _slurm_dir()
    why = _slurm_problem(d)
    if why:
        print(f"soak: no test Slurm: {why}", file=sys.stderr)
        return 2
    slurm = SlurmCluster(dir=d, conf=d / "etc" / "slurm.conf")
    logs = {f: f.stat().st_size for f in sorted((d / "log").glob("slurmd-*.log"))}
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(ns.busy)]
    base = Path(tempfile.mkdtemp(prefix="distdiag-soak-"))
    rows: list[dict[str, Any]] = []
    t0 = time.monotonic()
    try:
        for i in range(ns.jobs):
            r = _one(ns.mode, i, slurm, base, ns.timeout, env)
            rows.append(r)
            print(f"soak {ns.mode} {i + 1}/{ns.jobs} job {r['job'] or '?'} {r['s']:.1f}s "
                  f"{'ok' if r['ok'] else 'FAIL: ' + str(r['why'])}", flush=True)  # fmt: skip
            if r["ok"]:
                shutil.rmtree(base / r["name"], ignore_errors=True)
            elif ns.stop_on_fail:
                break
    finally:
        for b in busy:  # ours, by PID
            b.kill()
            b.wait()
    wall = time.monotonic() - t0
    ok = [r["s"] for r in rows if r["ok"]]
    hangs = sum(1 for r in rows if r["why"] == "hang")
    summary = {
        "mode": ns.mode, "env": env, "busy": ns.busy, "jobs": len(rows), "ok": len(ok),
        "hangs": hangs, "other_failures": len(rows) - len(ok) - hangs, "timeout_s": ns.timeout,
        "s_min": min(ok, default=None), "s_median": round(statistics.median(ok), 2) if ok else None,
        "s_max": max(ok, default=None), "wall_s": round(wall, 1), "slurmd_pmi2_errors": _pmi_errors(logs, {r["job"] for r in rows if r["job"]}),
        "failed_dirs": [str(base / r["name"]) for r in rows if not r["ok"]],
    }  # fmt: skip
    print("soak summary: " + json.dumps(summary), flush=True)
    if ns.json:
        ns.json.write_text(json.dumps({"summary": summary, "jobs": rows}, indent=1))
    if not summary["failed_dirs"]:
        shutil.rmtree(base, ignore_errors=True)
    return 0 if len(ok) == len(rows) == ns.jobs else 1


if __name__ == "__main__":
    raise SystemExit(main())
