"""Link analysis and the slow_link detector on simulated runs with a known truth.

The simulated job is bulk-synchronous: compute, then one ring all-reduce of
``nbytes`` per iteration across one rank per node. Its transfer phase is
latency + bus bytes / (the slowest link among the members), so a slow node
stretches every all-reduce for every rank while arrivals stay on time. Rank
files go through the shim's own ``write_rank_file``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import pytest

from distdiag.config import Config
from distdiag.analysis import Analysis
from distdiag.detectors import load_all
from distdiag.detectors.slow_link import detect as slow_link
from distdiag.detectors.straggler import detect as straggler
from distdiag.links import (
    bus_factor,
    collective_transfers,
    p2p_matrix,
    probe_matrix,
    union_s,
    units_of,
)
from distdiag.pipeline import analyze
from distdiag.run import load_run
from distdiag.schema import EVENT_DTYPE, SYNC_DTYPE, Kind, SyncTag, rank_file_name
from distdiag.shim.writer import write_rank_file

MS = 1_000_000
MB = 1e6


def make_link_run(
    run_dir: Path,
    *,
    n: int = 4,
    iters: int = 40,
    nbytes: int = 4 << 20,
    fast_bw: float = 1000 * MB,
    pair_bw: dict[tuple[int, int], float] | None = None,
    compute_ms: float = 20.0,
    latency_ms: float = 0.2,
    probe: bool = True,
    p2p: bool = False,
    noise: float = 0.0,
    hosts: Sequence[str] | None = None,
    seed: int = 0,
) -> float:
    """Write the run; returns the true saving (s) had every link run at ``fast_bw``."""
    rng = np.random.default_rng(seed)
    hosts = list(hosts) if hosts is not None else [f"node{r}" for r in range(n)]
    pair_bw = dict(pair_bw or {})

    def bw(a: int, b: int) -> float:
        return pair_bw.get((min(a, b), max(a, b)), fast_bw)

    ring_min = min(bw(r, (r + 1) % n) for r in range(n))
    bus = nbytes * 2 * (n - 1) / n
    xfer_ns = int(latency_ms * MS + bus / ring_min * 1e9)
    xfer_fast_ns = int(latency_ms * MS + bus / fast_bw * 1e9)
    t = 1_000 * MS
    strings = ["", "all_reduce", "default", "probe_bw", "probe_lat", "probe", "probe:torch", "send", "recv", "x.py:1"]
    sid = {s: i for i, s in enumerate(strings)}
    rows: list[list[tuple]] = [[] for _ in range(n)]

    # -- the probe: every pair once, symmetric rows on both ranks --------------------
    if probe:
        t_probe0 = t
        for a in range(n):
            for b in range(a + 1, n):
                lat = int(0.1 * MS)
                size = 1 << 20
                dur = int(size / (bw(a, b) * (1 + noise * rng.uniform(-1, 1))) * 1e9)
                for me, peer in ((a, b), (b, a)):
                    rows[me].append((t, t + lat, Kind.PROBE, sid["probe_lat"], sid["probe:torch"], -1, peer, 8, 0, 0, 0, 0.0))
                    rows[me].append((t + lat, t + lat + dur, Kind.PROBE, sid["probe_bw"], sid["probe:torch"], -1, peer, size, 0, 0, 0, 0.0))
                t += lat + dur + MS
        for r in range(n):
            rows[r].append((t_probe0, t, Kind.PROBE, sid["probe"], sid["probe:torch"], -1, -1, n, 3, 0, 0, 3.0))
        t += 10 * MS

    # -- the iterations ----------------------------------------------------------------
    saving_ns = 0
    for it in range(iters):  # the simulation's time step
        comp = (compute_ms * (1 + 0.02 * rng.uniform(-1, 1, n)) * MS).astype(np.int64)
        arrive = t + comp
        last = int(arrive.max())
        exit_ = last + xfer_ns + rng.integers(0, 20_000, n)
        for r in range(n):
            rows[r].append((int(arrive[r]), int(exit_[r]), Kind.COLL, sid["all_reduce"], sid["default"], it, -1, nbytes, 0, sid["x.py:1"], 0, 0.0))
        saving_ns += xfer_ns - xfer_fast_ns
        t = int(exit_.max())
        if p2p:
            # ring exchange of nbytes: r sends to r+1 while r-1 sends to r
            durs = [int(nbytes / bw(r, (r + 1) % n) * 1e9) for r in range(n)]
            for r in range(n):
                d = (r + 1) % n
                rows[r].append((t, t + durs[r], Kind.SEND, sid["send"], sid["default"], -1, d, nbytes, 0, 0, 0, 0.0))
                rows[d].append((t, t + durs[r], Kind.RECV, sid["recv"], sid["default"], -1, r, nbytes, 0, 0, 0, 0.0))
                saving_ns += 0  # counted below as one window
            t += max(durs) + MS
    if p2p:
        slow_p2p = [int(nbytes / bw(r, (r + 1) % n) * 1e9) for r in range(n)]
        saving_ns += iters * (max(slow_p2p) - int(nbytes / fast_bw * 1e9))
    t_end = t + 5 * MS

    for r in range(n):  # one file per rank
        ev = np.array(rows[r], dtype=EVENT_DTYPE)
        ev = ev[np.argsort(ev["t0_ns"], kind="stable")]
        sync = None
        if r:
            sync = np.zeros(3, SYNC_DTYPE)
            sync["t_send_ns"] = 900 * MS + np.arange(3) * MS
            sync["t_recv_ns"] = sync["t_send_ns"] + 50_000
            sync["t_ref_ns"] = sync["t_send_ns"] + 25_000
            sync["tag"] = SyncTag.START
        write_rank_file(
            run_dir / rank_file_name(r),
            dict(rank=r, world_size=n, local_rank=0, host=hosts[r], job_id="77", launch_id="l77",
                 mono_ns_at_start=900 * MS, end_mono_ns=t_end, last_flush_mono_ns=t_end),
            ev, strings, sync=sync,
        )  # fmt: skip
    return saving_ns / 1e9


def _slow_node(k: int, n: int, bw: float) -> dict[tuple[int, int], float]:
    return {(min(k, j), max(k, j)): bw for j in range(n) if j != k}


def test_bus_factors_follow_the_ring_convention() -> None:
    assert bus_factor("all_reduce", 4) == pytest.approx(1.5)
    assert bus_factor("Allreduce", 8) == pytest.approx(1.75)
    assert bus_factor("ddp_bucket_allreduce", 2) == pytest.approx(1.0)
    assert bus_factor("all_gather_into_tensor", 4) == pytest.approx(3.0)  # nbytes = each rank's piece
    assert bus_factor("reduce_scatter_tensor", 4) == pytest.approx(0.75)
    assert bus_factor("broadcast", 4) == 1.0
    assert bus_factor("barrier", 4) == 0.0
    assert bus_factor("all_reduce", 1) == 0.0


def test_union_counts_overlapping_windows_once() -> None:
    t0 = np.array([0, 5, 20, 21]) * MS
    t1 = np.array([10, 12, 22, 30]) * MS
    assert union_s(t0, t1) == pytest.approx(0.022)
    assert union_s(np.zeros(0, np.int64), np.zeros(0, np.int64)) == 0.0


def test_probe_matrix_is_symmetric_and_shows_the_slow_node(tmp_path: Path) -> None:
    make_link_run(tmp_path, pair_bw=_slow_node(2, 4, 6 * MB), iters=5)
    run = load_run(tmp_path)
    m = probe_matrix(run)
    assert m is not None and m.source == "probe"
    assert m.units.names == ["node0", "node1", "node2", "node3"]
    bw = m.bw_bytes_per_s
    assert np.allclose(bw, bw.T, equal_nan=True)
    assert np.all(np.isnan(np.diag(bw)))
    assert bw[2, 0] == pytest.approx(6 * MB, rel=0.01) and bw[1, 3] == pytest.approx(1000 * MB, rel=0.01)
    assert np.nanmax(m.latency_s) == pytest.approx(1e-4, rel=0.01)
    js = m.to_json()
    assert js["bw_MB_per_s"][2][0] == pytest.approx(6.0, rel=0.01) and js["bw_MB_per_s"][0][0] is None


def test_collective_transfer_phase_and_bus_bandwidth(tmp_path: Path) -> None:
    make_link_run(tmp_path, pair_bw=_slow_node(1, 4, 10 * MB), iters=10, latency_ms=0.0)
    run = load_run(tmp_path)
    ct = collective_transfers(run)
    assert len(ct) == 10
    # all-reduce of 4 MiB on 4 ranks: bus bytes 1.5 x 4 MiB at the 10 MB/s slowest hop
    assert np.allclose(ct.bus_bytes, 1.5 * (4 << 20))
    assert np.median(ct.bus_bw_bytes_per_s) == pytest.approx(10 * MB, rel=0.02)
    assert np.all(ct.arrival_spread_s < 0.002)  # everyone arrived on time: the network, not a rank


def test_slow_node_is_named_with_cost_near_truth(tmp_path: Path) -> None:
    truth_s = make_link_run(tmp_path, pair_bw=_slow_node(2, 4, 6 * MB), noise=0.1)
    run = load_run(tmp_path)
    fs = slow_link(Analysis.of(run, Config()))
    assert len(fs) == 1
    f = fs[0]
    assert f.kind == "slow_link" and f.hosts == ["node2"] and f.ranks == [2]
    assert sorted(tuple(sorted(x)) for x in f.links) == [("node0", "node2"), ("node1", "node2"), ("node2", "node3")]
    assert f.cost_s == pytest.approx(truth_s, rel=0.25)
    assert f.evidence["matrix"]["units"] == ["node0", "node1", "node2", "node3"]
    assert f.evidence["ratio"] < 0.02
    assert f.evidence["network_bound_share"] == 1.0
    assert "node node2" in f.summary


def test_pipeline_ranks_slow_link_first_and_no_straggler_is_blamed(tmp_path: Path) -> None:
    make_link_run(tmp_path, pair_bw=_slow_node(2, 4, 6 * MB))
    assert "slow_link" in load_all()
    rep = analyze(tmp_path, Config())
    assert rep.findings and rep.findings[0].kind == "slow_link"
    assert not [f for f in rep.findings if f.kind == "straggler"]
    assert rep.findings[0].fraction > 0.5


def test_healthy_network_with_noise_stays_silent(tmp_path: Path) -> None:
    make_link_run(tmp_path, noise=0.3)
    run = load_run(tmp_path)
    assert slow_link(Analysis.of(run, Config())) == []


@pytest.mark.parametrize("ratio,expect", [(0.55, False), (0.45, True)])
def test_threshold_at_half_the_median_pair(tmp_path: Path, ratio: float, expect: bool) -> None:
    make_link_run(tmp_path, pair_bw=_slow_node(3, 4, ratio * 1000 * MB), nbytes=64 << 20, iters=20, compute_ms=5)
    fs = slow_link(Analysis.of(load_run(tmp_path), Config()))
    assert bool(fs) == expect
    if expect:
        assert fs[0].hosts == ["node3"]


def test_slow_pair_between_healthy_nodes(tmp_path: Path) -> None:
    make_link_run(tmp_path, n=5, pair_bw={(1, 2): 20 * MB}, noise=0.05)
    fs = slow_link(Analysis.of(load_run(tmp_path), Config()))
    assert len(fs) == 1
    assert fs[0].links == [["node1", "node2"]] and fs[0].hosts == ["node1", "node2"]
    assert fs[0].ranks == [1, 2]


def test_cost_below_min_fraction_is_not_reported(tmp_path: Path) -> None:
    # a slow node, but the job barely communicates: 64 KiB per 200 ms step
    make_link_run(tmp_path, pair_bw=_slow_node(2, 4, 100 * MB), nbytes=64 << 10, compute_ms=200, iters=10)
    assert slow_link(Analysis.of(load_run(tmp_path), Config())) == []


def test_passive_p2p_matrix_localizes_without_the_probe(tmp_path: Path) -> None:
    truth_s = make_link_run(tmp_path, probe=False, p2p=True, pair_bw=_slow_node(1, 4, 8 * MB), iters=10)
    run = load_run(tmp_path)
    assert probe_matrix(run) is None
    m = p2p_matrix(run)
    assert m is not None and m.source == "p2p"
    assert m.bw_bytes_per_s[0, 1] == pytest.approx(8 * MB, rel=0.02)
    assert m.bw_bytes_per_s[2, 3] == pytest.approx(1000 * MB, rel=0.02)
    assert np.isnan(m.bw_bytes_per_s[0, 2])  # the ring never sends 0 -> 2
    fs = slow_link(Analysis.of(run, Config()))
    assert len(fs) == 1 and fs[0].hosts == ["node1"]
    assert fs[0].evidence["source"] == "p2p"
    assert fs[0].cost_s == pytest.approx(truth_s, rel=0.25)


def test_one_host_uses_rank_pairs(tmp_path: Path) -> None:
    make_link_run(tmp_path, hosts=["h"] * 4, pair_bw=_slow_node(0, 4, 5 * MB))
    run = load_run(tmp_path)
    assert units_of(run).kind == "rank"
    fs = slow_link(Analysis.of(run, Config()))
    assert len(fs) == 1 and fs[0].ranks == [0] and fs[0].hosts == []
    assert ["rank 0", "rank 1"] in fs[0].links


def test_no_probe_no_p2p_no_finding(tmp_path: Path) -> None:
    make_link_run(tmp_path, probe=False, pair_bw=_slow_node(2, 4, 6 * MB))
    run = load_run(tmp_path)
    assert slow_link(Analysis.of(run, Config())) == []
    # the straggler detector does not blame anyone for the slow collectives either
    assert straggler(Analysis.of(run, Config())) == []


def test_p2p_matching_by_communicator_pair_and_order(tmp_path: Path) -> None:
    """n-th send from a to b on a communicator meets the n-th receive there,
    whatever the other pairs and communicators do; a send never received is dropped."""
    strings = ["", "send", "recv", "world", "sub"]
    S, R, W, B = Kind.SEND, Kind.RECV, 3, 4
    ev0 = [  # rank 0 sends to 1 on world twice, on sub once, and once more never received
        (10 * MS, 11 * MS, S, 1, W, -1, 1, 1 << 20, 0, 0, 0, 0.0),
        (12 * MS, 13 * MS, S, 1, B, -1, 1, 2 << 20, 0, 0, 0, 0.0),
        (20 * MS, 22 * MS, S, 1, W, -1, 1, 3 << 20, 0, 0, 0, 0.0),
        (30 * MS, 31 * MS, S, 1, W, -1, 1, 4 << 20, 0, 0, 0, 0.0),
    ]
    ev1 = [  # rank 1 receives: sub first, then world twice (posted late: transfer starts at its t0)
        (12 * MS, 14 * MS, R, 2, B, -1, 0, 2 << 20, 0, 0, 0, 0.0),
        (15 * MS, 16 * MS, R, 2, W, -1, 0, 1 << 20, 0, 0, 0, 0.0),
        (17 * MS, 25 * MS, R, 2, W, -1, 0, 3 << 20, 0, 0, 0, 0.0),
    ]
    for r, rows in ((0, ev0), (1, ev1)):
        write_rank_file(tmp_path / rank_file_name(r), dict(rank=r, world_size=2, host=f"h{r}", job_id="1", launch_id="l"),
                        np.array(rows, EVENT_DTYPE), strings)  # fmt: skip
    from distdiag.links import p2p_transfers

    tr = p2p_transfers(load_run(tmp_path))
    order = np.argsort(tr["nbytes"])
    assert tr["nbytes"][order].tolist() == [1 << 20, 2 << 20, 3 << 20]
    assert tr["src"].tolist() == [0, 0, 0] and tr["dst"].tolist() == [1, 1, 1]
    # 1 MiB: both in the call from 15 ms (the receive) to 16 ms; 3 MiB: 20 -> 25 ms
    assert (tr["xfer_s"][order] * 1e3).round(3).tolist() == [1.0, 2.0, 5.0]


def test_transfer_summary_marks_slow_link_collectives_network_bound(tmp_path: Path) -> None:
    from distdiag.links import transfer_summary

    make_link_run(tmp_path, pair_bw=_slow_node(2, 4, 6 * MB), iters=10)
    df = transfer_summary(load_run(tmp_path))
    assert df[["comm", "op", "count", "n_ranks"]].values.tolist() == [["default", "all_reduce", 10, 4]]
    assert df["network_bound_share"].iloc[0] == 1.0
    assert df["bus_bw_MB_per_s"].iloc[0] == pytest.approx(6.0, rel=0.05)


def test_compute_bound_collectives_are_not_network_bound(tmp_path: Path) -> None:
    from distdiag.links import transfer_summary

    # fast links, tiny payload: the transfer phase is a fraction of a millisecond
    make_link_run(tmp_path, nbytes=8 << 10, latency_ms=0.05, iters=10)
    df = transfer_summary(load_run(tmp_path))
    assert df["network_bound_share"].iloc[0] == 0.0
