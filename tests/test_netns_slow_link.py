"""End to end on a real network: a 4-node DDP (gloo) job in network namespaces,
one node's link throttled to 50 Mbit/s with tbf, recorded by ``distdiag-wrap
--probe-links`` and analyzed by ``distdiag analyze --format json``.

Measured here: the throttled node stretches every rank's bucket all-reduce of
a 512x512 layer from ~10 ms to ~0.3 s, and the probe sees ~6 MB/s for every
pair with that node against hundreds of MB/s for the others.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from distdiag.links import probe_matrix
from distdiag.run import load_run
from distdiag.schema import Kind
from netns import NetnsCluster, free_port_hint, have_netns

pytestmark = [
    pytest.mark.netns,
    pytest.mark.torch,
    pytest.mark.skipif(have_netns() is not None, reason=str(have_netns())),
    pytest.mark.skipif(shutil.which("distdiag-wrap") is None, reason="distdiag-wrap not installed (pip install -e .)"),
]

JOB = str(Path(__file__).parent / "jobs" / "net_ddp.py")
SLOW = 2
STEPS = "10"
WIDTH = "512"
JOB_TIMEOUT_S = 300  # 4 torch imports on 2 shared cores: slow, but bounded


def _run_job(tmp_path: Path, shape: bool) -> tuple[Path, dict[str, Any]]:
    run_dir = tmp_path / "run"
    with NetnsCluster(4) as c:
        if shape:
            c.shape(SLOW, "50mbit")
        port = free_port_hint()

        def env(k: int) -> dict[str, str]:
            e = c.torch_env(k, port)
            # File-I/O capture is not under test here and makes `import torch`
            # several times slower; the network path is the same without it.
            e["DISTDIAG_HOOKS"] = "fileio=0"
            return e

        argv = [shutil.which("distdiag-wrap") or "distdiag-wrap", "--dir", str(run_dir), "--probe-links", sys.executable, JOB, STEPS, WIDTH]
        runs = c.run_all(argv, env, timeout_s=JOB_TIMEOUT_S, log_dir=tmp_path)
    for k, r in enumerate(runs):
        assert r.returncode == 0, f"rank {k}:\n{r.stdout[-3000:]}"
    p = subprocess.run(
        [sys.executable, "-m", "distdiag.cli", "analyze", str(run_dir), "--format", "json"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    return run_dir, json.loads(p.stdout)


def test_throttled_node_is_the_verdict_and_no_rank_is_blamed(tmp_path: Path) -> None:
    run_dir, rep = _run_job(tmp_path, shape=True)
    slow_host = f"node{SLOW}"
    findings = rep["findings"]
    assert findings, rep
    top = findings[0]
    assert top["kind"] == "slow_link", [(f["kind"], f["cost_s"], f["summary"]) for f in findings]
    assert top["hosts"] == [slow_host]
    assert all(slow_host in link for link in top["links"]) and len(top["links"]) == 3
    # ~0.3 s of each of the 10 bucket all-reduces is the link; at least half of it must be found
    assert top["cost_s"] > 1.0, top
    assert top["fraction"] > 0.02
    # the slow link slows every rank alike: no straggler finding blames a rank for it
    assert not [f for f in findings if f["kind"] == "straggler" and SLOW in f["ranks"]], findings
    assert not [f for f in findings if f["kind"] == "straggler" and f["fraction"] >= 0.02], findings

    # the probe's node x node matrix shows every pair with the throttled node as slow
    mat = top["evidence"]["matrix"]
    assert mat["source"] == "probe" and mat["units"] == ["node0", "node1", "node2", "node3"]
    bw = np.array([[np.nan if v is None else v for v in row] for row in mat["bw_MB_per_s"]])
    slow_pairs = [bw[SLOW, j] for j in range(4) if j != SLOW]
    fast_pairs = [bw[i, j] for i in range(4) for j in range(i + 1, 4) if SLOW not in (i, j)]
    assert max(slow_pairs) < 8.0, bw  # 50 Mbit/s = 6.25 MB/s
    assert min(fast_pairs) > 10 * max(slow_pairs), bw

    # the probe itself: every rank met all three others, within its 3 s budget
    # (also on the throttled node, where the sizes stopped growing early)
    run = load_run(run_dir)
    pr = run.events[run.events["kind"] == Kind.PROBE]
    for r in range(4):
        mine = pr[pr["rank"] == r]
        assert {run.s(int(i)) for i in mine["name_id"]} == {"probe", "probe_bw", "probe_lat"}
        assert set(mine["peer"][mine["peer"] >= 0].tolist()) == set(range(4)) - {r}
        span = mine[mine["name_id"] == run.sid("probe")]
        assert len(span) == 1 and (span["t1_ns"] - span["t0_ns"])[0] / 1e9 < 4.5
    biggest = pr[(pr["rank"] == SLOW) & (pr["name_id"] == run.sid("probe_bw"))]["nbytes"].max()
    assert biggest < 4 << 20  # the slow node's steps stopped growing before 4 MiB


def test_unthrottled_network_has_no_slow_link(tmp_path: Path) -> None:
    run_dir, rep = _run_job(tmp_path, shape=False)
    costly = [f for f in rep["findings"] if f["kind"] == "slow_link" and f["fraction"] > 0.02]
    assert not costly, costly
    m = probe_matrix(load_run(run_dir))
    assert m is not None
    i, j, bw = m.pairs()
    assert len(bw) == 6  # every node pair was probed
    assert bw.min() > 20e6, m.to_json()  # veths on one bridge: far above the throttled 6 MB/s
