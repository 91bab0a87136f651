"""The link probe's plan (rounds, participants) and the probe over MPI on one host.

The probe over gloo on a real throttled network is checked end to end, through
the wrapper, in tests/test_netns_slow_link.py (one 4-rank torch job each costs
four torch imports on 2 cores, so the tests share them).
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from distdiag.shim.probe import participants_of, plan_masks

JOB = str(Path(__file__).parent / "jobs" / "net_probe.py")


@pytest.mark.parametrize("m", [2, 3, 4, 5, 7, 8, 13, 16])
def test_all_masks_cover_every_pair_once(m: int) -> None:
    seen: list[tuple[int, int]] = []
    for mask in plan_masks(m, max_rounds=1000):
        pairs = [(i, i ^ mask) for i in range(m) if (i ^ mask) < m]
        assert all(b != a for a, b in pairs)
        # a round is a matching: nobody talks to two partners at once
        assert len({a for a, _ in pairs}) == len(pairs)
        seen += [(min(a, b), max(a, b)) for a, b in pairs if a < b]
    assert sorted(seen) == list(itertools.combinations(range(m), 2))


def test_capped_rounds_start_with_the_hypercube() -> None:
    masks = plan_masks(64, max_rounds=6)
    assert masks == [1, 2, 4, 8, 16, 32]  # every node meets log2(64) partners
    assert plan_masks(1, 15) == []


def test_only_one_rank_per_host_probes_across_hosts() -> None:
    assert participants_of(["a", "a", "b", "b", "c"]) == [0, 2, 4]
    assert participants_of(["a", "a", "a"]) == [0, 1, 2]  # one host: rank pairs


@pytest.mark.mpi
def test_probe_over_mpi_measures_every_rank_pair_on_one_host(tmp_path: Path) -> None:
    env = dict(os.environ, DISTDIAG_HOST="onehost", NET_PROBE_OUT=str(tmp_path))
    p = subprocess.run(
        ["mpiexec", "-n", "3", sys.executable, JOB, "mpi", "1.0"],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    # one file per rank: mpiexec may splice the ranks' stdout lines together
    res = sorted((json.loads(f.read_text()) for f in tmp_path.glob("*.json")), key=lambda d: d["rank"])
    assert [d["rank"] for d in res] == [0, 1, 2]
    for d in res:
        assert d["participants"] == [0, 1, 2]  # one host: every rank probes
        assert sorted(int(k) for k in d["bw"]) == sorted({0, 1, 2} - {d["rank"]})
        assert all(v > 1e6 for v in d["bw"].values())  # shared memory moves far more than 1 MB/s
        assert d["elapsed_s"] < 3.0


@pytest.mark.parametrize(("env", "one"), [
    ({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"}, True),              # torchrun, one node
    ({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}, False),             # torchrun, two nodes
    ({"PMI_SIZE": "3", "MPI_LOCALNRANKS": "3"}, True),                 # MPICH's hydra, one host
    ({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, False),
    ({"SLURM_PROCID": "0", "SLURM_NNODES": "1", "WORLD_SIZE": "4"}, True),
    ({"SLURM_PROCID": "0", "SLURM_STEP_NUM_NODES": "2", "SLURM_NNODES": "1"}, False),
    ({"WORLD_SIZE": "4"}, False),                                      # not said: the all-gather decides
    ({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4", "DISTDIAG_HOST": "n1"}, False),  # hosts named by hand
])  # fmt: skip
def test_the_default_probe_knows_a_single_host_from_the_launcher(env: dict[str, str], one: bool) -> None:
    from distdiag.shim.probe import one_host_said

    assert one_host_said(env) is one


def test_the_default_mode_installs_only_where_the_job_may_span_hosts() -> None:
    import types

    dist = pytest.importorskip("torch.distributed")
    from distdiag.shim import probe
    from distdiag.shim.recorder import Recorder

    orig = dist.init_process_group
    for mode, env, patched in [("auto", {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}, False),
                               ("auto", {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1"}, True),
                               ("off", {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1"}, False),
                               ("on", {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}, True)]:  # fmt: skip
        probe.install(Recorder(), types.SimpleNamespace(probe_links=mode), environ=env)
        try:
            assert (dist.init_process_group is not orig) is patched, (mode, env)
        finally:
            probe.uninstall()
        assert dist.init_process_group is orig


def test_install_is_a_no_op_without_the_flag_and_uninstall_restores_exactly() -> None:
    import types

    dist = pytest.importorskip("torch.distributed")
    from distdiag.shim import probe
    from distdiag.shim.recorder import Recorder

    orig = dist.init_process_group
    probe.install(Recorder(), types.SimpleNamespace(probe_links=False))
    assert dist.init_process_group is orig
    probe.install(Recorder(), types.SimpleNamespace(probe_links=True))
    try:
        assert dist.init_process_group is not orig
        assert dist.init_process_group.__wrapped__ is orig  # type: ignore[attr-defined]
        assert dist.distributed_c10d.init_process_group is dist.init_process_group
    finally:
        probe.uninstall()
    assert dist.init_process_group is orig and dist.distributed_c10d.init_process_group is orig
