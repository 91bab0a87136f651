"""The probe under the real wrapper on an MPI job: `distdiag-wrap --probe-links`, and the
default (on across hosts only, within 1 s; `--no-probe-links` switches it off)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from distdiag.links import probe_matrix
from distdiag.match import collectives_of
from distdiag.run import load_run
from distdiag.schema import P2P_KINDS, Kind

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.skipif(shutil.which("mpiexec") is None, reason="no mpiexec (pip install mpich)"),
    pytest.mark.skipif(shutil.which("distdiag-wrap") is None, reason="distdiag-wrap not installed"),
]

JOB = str(Path(__file__).parent / "jobs" / "net_mpi_allreduce.py")


def _wrap(run_dir: Path, *flags: str) -> None:
    p = subprocess.run(
        ["mpiexec", "-n", "3", shutil.which("distdiag-wrap") or "", "--dir", str(run_dir), *flags, sys.executable, JOB],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]


def test_probe_rows_make_a_full_matrix_and_leave_the_program_untouched(tmp_path: Path) -> None:
    _wrap(tmp_path / "r", "--probe-links")
    run = load_run(tmp_path / "r")
    m = probe_matrix(run)
    assert m is not None and m.units.kind == "rank"  # one host: rank pairs
    i, j, bw = m.pairs()
    assert sorted(zip(i.tolist(), j.tolist())) == [(0, 1), (0, 2), (1, 2)]
    assert np.all(bw > 1e6)
    assert np.all(np.isfinite(m.latency_s[~np.eye(3, dtype=bool)]))
    # the default 3 s budget holds (slack: 3 ranks busy-poll on 2 shared cores)
    assert 0 < m.extra["probe_s"] < 6.0
    # the probe ran on a private communicator: none of its traffic is the program's
    ev = run.events
    assert not np.isin(ev["kind"], np.array(sorted(P2P_KINDS), np.uint8)).any()
    colls = collectives_of(run)
    assert len(colls) == 20 and sorted(colls.g_seq.tolist()) == list(range(20))
    probe_comms = {run.s(int(c)) for c in ev[ev["kind"] == Kind.PROBE]["comm_id"]}
    assert probe_comms == {"probe:mpi"}


def test_by_default_a_job_on_one_host_is_not_probed(tmp_path: Path) -> None:
    _wrap(tmp_path / "r")  # the launcher says one host (MPI_LOCALNRANKS = the world size)
    run = load_run(tmp_path / "r")
    assert not (run.events["kind"] == Kind.PROBE).any()
    assert probe_matrix(run) is None


def _two_nodes(tmp_path: Path, *flags: str) -> Any:
    """4 ranks as 2 nodes of 2 (DISTDIAG_HOST per rank), the wrapper given ``flags``."""
    wrap = shutil.which("distdiag-wrap") or ""
    cmd = (f'DISTDIAG_HOST=node$((PMI_RANK / 2)) exec {wrap} --dir {tmp_path / "r"} {" ".join(flags)} '
           f'{sys.executable} {JOB}')  # fmt: skip
    p = subprocess.run(["mpiexec", "-n", "4", "sh", "-c", cmd], capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    return load_run(tmp_path / "r")


def test_by_default_a_job_across_hosts_is_probed_within_the_small_budget(tmp_path: Path) -> None:
    run = _two_nodes(tmp_path)
    pr = run.events[run.events["kind"] == Kind.PROBE]
    span = pr[pr["name_id"] == run.sid("probe")]
    assert sorted(span["rank"].tolist()) == [0, 2]  # the first rank of each node
    assert (span["value"] == 1.0).all()  # probe_auto_budget_s, not the 3 s of --probe-links
    took = (span["t1_ns"] - span["t0_ns"]) / 1e9
    print(f"the default probe took {', '.join(f'{t:.4f}' for t in took)} s (fast links: the sizes grow to 4 MiB)")
    assert took.max() < 1.0
    m = probe_matrix(run)
    assert m is not None and m.units.kind == "host" and m.bw_bytes_per_s[0, 1] > 1e6
    assert len(collectives_of(run)) == 20


def test_no_probe_links_switches_the_default_off(tmp_path: Path) -> None:
    run = _two_nodes(tmp_path, "--no-probe-links")
    assert run.hosts == ["node0", "node1"]
    assert not (run.events["kind"] == Kind.PROBE).any()


def test_only_the_first_rank_of_each_node_probes(tmp_path: Path) -> None:
    """4 ranks as 2 nodes of 2 (DISTDIAG_HOST per rank): ranks 0 and 2 probe
    each other, ranks 1 and 3 go straight on to the program, nobody waits."""
    wrap = shutil.which("distdiag-wrap") or ""
    cmd = f'DISTDIAG_HOST=node$((PMI_RANK / 2)) exec {wrap} --dir {tmp_path / "r"} --probe-links {sys.executable} {JOB}'
    p = subprocess.run(["mpiexec", "-n", "4", "sh", "-c", cmd], capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    run = load_run(tmp_path / "r")
    assert run.hosts == ["node0", "node1"]
    pr = run.events[(run.events["kind"] == Kind.PROBE) & (run.events["name_id"] == run.sid("probe_bw"))]
    assert sorted(set(pr["rank"].tolist())) == [0, 2]
    assert sorted(set(pr["peer"].tolist())) == [0, 2]
    m = probe_matrix(run)
    assert m is not None and m.units.kind == "host"
    assert np.isfinite(m.bw_bytes_per_s[0, 1]) and m.bw_bytes_per_s[0, 1] > 1e6
    assert len(collectives_of(run)) == 20
