"""Clock sync across "nodes": each rank in its own network namespace (its own
loopback), so rank 0's 127.0.0.1 is useless to the others and they must find
it through the other address it publishes. Plain processes (no MPI, no torch)
under distdiag-wrap, clocks skewed with libfaketime, truth from the kernel's
clock (tests/jobs/clock_job.py)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from netns import NetnsCluster, have_netns

from distdiag.run import load_run
from distdiag import clocks

pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(have_netns() is not None, reason=str(have_netns())),
]

REPO = Path(__file__).resolve().parent.parent
LIBFAKETIME = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1"
SPECS = ["+0s x1.0", "-0.4s x1.00015", "+0.3s x0.99985"]


def test_ranks_on_separate_nodes_sync_through_the_published_address(tmp_path: Path) -> None:
    if not os.path.exists(LIBFAKETIME):
        pytest.fail("libfaketime not found: apt-get install faketime (listed in .ci/apt-packages.txt)")
    run_dir, truth_dir = tmp_path / "run", tmp_path / "truth"
    with NetnsCluster(3) as c:

        def env_of(k: int) -> dict[str, str]:
            return dict(os.environ, RANK=str(k), WORLD_SIZE="3", LOCAL_RANK="0", DISTDIAG_HOST=c.node_name(k),
                        DISTDIAG_SYNC_INTERVAL_S="0.3", LD_PRELOAD=LIBFAKETIME, FAKETIME=SPECS[k])  # fmt: skip

        argv = [sys.executable, "-m", "distdiag.wrap", "--dir", str(run_dir), sys.executable,
                str(REPO / "tests" / "jobs" / "clock_job.py"), "--mode", "plain", "--truth-dir", str(truth_dir),
                "--iters", "80", "--work-s", "0.005"]  # fmt: skip
        res = c.run_all(argv, env_of, timeout_s=60)
        assert all(r.returncode == 0 for r in res), [r.stdout[-2000:] for r in res]
        doc = json.loads((run_dir / "clock-ref.json").read_text())
        assert doc["addrs"] == [c.addr(0), "127.0.0.1"]  # node 0's own address, loopback last

    run = load_run(run_dir)
    model = clocks.fit(run)
    fits = {}
    for r in range(3):
        a = np.load(truth_dir / f"truth-{r}.npy")
        k, b = np.polyfit((a[:, 0] - a[0, 0]).astype(float), (a[:, 1] - a[0, 1]).astype(float), 1)
        fits[r] = (int(a[0, 0]), int(a[0, 1]), float(k), float(b))
    T0, P0, K0, B0 = fits[0]
    for r in (1, 2):
        m = model.ranks[r]
        assert m.method.startswith("sync") and m.n_windows >= 3, m.to_json()
        t0, p0, k, b = fits[r]
        x = run.events[run.events["rank"] == r]["t0_ns"]
        truth = P0 + np.rint(B0 + K0 * (((x - p0).astype(float) - b) / k + (t0 - T0))).astype(np.int64)
        err = np.abs(m.map(x) - truth)
        assert (err <= m.bound_at(x) + 1_000).all(), (err.max(), m.to_json())
        assert err.max() <= 100_000, m.to_json()
        assert m.drift_ppm == pytest.approx((k / K0 - 1) * 1e6, abs=m.bound_growth * 1e6 + 2)
