"""Never silent on the network (issue 20 item 2): the 4-node DDP job of
``tests/test_netns_slow_link.py``, one node's link throttled to 50 Mbit/s with tbf, run
with ``--no-probe-links`` (the probe is on by default across hosts): no bandwidth per pair exists, so no link can be named, and
the report had no finding at all while most of the job was collective transfer. Now it
says the network binds (``network_bound``), priced at the union of the transfer windows
in which every rank waited, against what the throttle cost the job (the same job on the
unthrottled network, by turns); the unthrottled twins stay silent.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_netns_slow_link import _run_job, pytestmark  # noqa: F401  (the same job and marks)

from distdiag.config import Config
from distdiag.links import collective_transfers
from distdiag.pipeline import analyze
from truth import assert_prices_median, measure_saving


def test_a_throttled_network_without_the_probe_is_network_bound_not_healthy(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    reps: dict[bool, list[dict[str, Any]]] = {True: [], False: []}
    dirs: dict[bool, list[Path]] = {True: [], False: []}

    def run(shape: bool, i: int) -> float:
        run_dir, rep, loop = _run_job(tmp_path_factory.mktemp(f"{'throttled' if shape else 'unthrottled'}{i}"), shape,
                                      probe=False)  # fmt: skip
        reps[shape].append(rep)
        dirs[shape].append(run_dir)
        return loop

    saving = measure_saving(run, pairs=2)
    costs = []
    for rep in reps[True]:
        top = rep["findings"][0] if rep["findings"] else None
        assert top is not None and top["kind"] == "network_bound", rep["findings"]
        assert top["ranks"] == [] and "--probe-links" in top["advice"]
        assert top["evidence"]["share_of_wall"] > 0.1
        by = top["evidence"]["by_op_and_size"]
        assert by and by[0]["bus_bw_MB_per_s"] < 20.0  # 50 Mbit/s is 6.25 MB/s on the slow hop
        assert not [f for f in rep["findings"] if f["kind"] == "straggler" and f["fraction"] >= 0.02]
        costs.append(top["cost_s"])
    for rep in reps[False]:  # the twins: the network does not bind
        assert not [f for f in rep["findings"] if f["kind"] == "network_bound"], rep["findings"]
    print(f"network_bound priced {', '.join(f'{c:.3f}' for c in costs)} s: {saving}")
    # an upper bound (the network taking no time): within 25% of what the throttle cost
    assert_prices_median(saving, costs, rel=0.25, what="network_bound cost")
    # Told what the fabric delivers (here: the bus bandwidth the unthrottled twins achieved, measured
    # in this test), the price is the transfers' excess over it, no longer the upper bound.
    fabric = _achieved_bus_MB_per_s(dirs[False])
    at_fabric = []
    for d in dirs[True]:
        cfg = Config()
        cfg.sections["network_bound"] = {"fabric_MB_per_s": fabric}
        (f,) = [f for f in analyze(d, cfg).findings if f.kind == "network_bound"]
        assert f.evidence["fabric_MB_per_s"] == pytest.approx(fabric, rel=1e-3)
        at_fabric.append(f.cost_s)
    for d in dirs[False]:  # the twins run at the fabric's bandwidth: nothing to save on the network
        cfg = Config()
        cfg.sections["network_bound"] = {"fabric_MB_per_s": fabric}
        assert not [f for f in analyze(d, cfg).findings if f.kind == "network_bound"]
    print(f"network_bound at the fabric's {fabric:.1f} MB/s priced {', '.join(f'{c:.3f}' for c in at_fabric)} s: {saving}")
    assert_prices_median(saving, at_fabric, rel=0.25, what="network_bound cost at the fabric's bandwidth")


def _achieved_bus_MB_per_s(run_dirs: list[Path]) -> float:
    """The median bus bandwidth of the largest collectives (DDP's buckets) in these runs."""
    bws = []
    for d in run_dirs:
        rep = analyze(d, Config())
        ct = collective_transfers(rep.run, rep.collectives)
        big = ct.bus_bytes >= 0.5 * ct.bus_bytes.max()
        bws.append(ct.bus_bw_bytes_per_s[big & np.isfinite(ct.bus_bw_bytes_per_s)])
    return float(np.median(np.concatenate(bws))) / 1e6
