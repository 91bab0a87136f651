"""Link analysis throughput, and the link probe's own cost, side by side.

    python benchmarks/bench_links.py [--ranks 64] [--iters 5000] [--probe]

Analysis: a synthetic run (one rank per node, node 3's links 100x slower) with,
per rank and iteration, one all-reduce and one ring send + receive (3 events),
written through the shim's writer. Timed on their own: load_run, the passive
point-to-point matrix (send/receive matching), the collective transfer phases,
the probe matrix, and the whole slow_link detector, in events/s.

``--probe`` also runs the probe in a 4-rank MPI job on this host at several
budgets and reports the wall time the probe took against its budget and the
job's start-up without it (``mpiexec -n 4``; skipped without mpiexec).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from distdiag.analysis import Analysis
from distdiag.cache import RunCache
from distdiag.config import Config
from distdiag.detectors.slow_link import detect as slow_link
from distdiag.links import collective_transfers, p2p_matrix, p2p_transfers, probe_matrix
from distdiag.match import match_collectives
from distdiag.run import Run
from distdiag.run import load_run
from distdiag.schema import EVENT_DTYPE, Kind, rank_file_name
from distdiag.shim.writer import write_rank_file

MS = 1_000_000


def write_run(d: Path, n: int, iters: int, slow: int = 3) -> int:
    """Vectorized synthetic run; returns the number of events."""
    rng = np.random.default_rng(0)
    strings = ["", "Allreduce", "world", "Send", "Recv", "probe_bw", "probe_lat", "probe", "probe:mpi"]
    bw = np.full((n, n), 1e9)
    bw[slow, :] = bw[:, slow] = 1e7
    nbytes = 1 << 20
    ring = np.minimum(bw[np.arange(n), (np.arange(n) + 1) % n], 1e12)
    x_coll = int(nbytes * 2 * (n - 1) / n / ring.min() * 1e9)
    x_p2p = (nbytes / ring * 1e9).astype(np.int64)  # rank r -> r+1
    step = 5 * MS + x_coll + int(x_p2p.max()) + MS
    t_it = 100 * MS + np.arange(iters, dtype=np.int64) * step
    total = 0
    for r in range(n):  # one file per rank
        comp = (5 * MS + rng.integers(0, 100_000, iters)).astype(np.int64)
        coll = np.zeros(iters, EVENT_DTYPE)
        coll["t0_ns"] = t_it + comp
        coll["t1_ns"] = t_it + 5 * MS + 100_000 + x_coll
        coll["kind"], coll["name_id"], coll["comm_id"] = Kind.COLL, 1, 2
        coll["seq"], coll["peer"], coll["nbytes"] = np.arange(iters), -1, nbytes
        t_p = t_it + 5 * MS + 100_000 + x_coll + 10_000
        snd = np.zeros(iters, EVENT_DTYPE)
        snd["t0_ns"], snd["t1_ns"] = t_p, t_p + x_p2p[r]
        snd["kind"], snd["name_id"], snd["comm_id"], snd["seq"] = Kind.SEND, 3, 2, -1
        snd["peer"], snd["nbytes"] = (r + 1) % n, nbytes
        src = (r - 1) % n
        rcv = np.zeros(iters, EVENT_DTYPE)
        rcv["t0_ns"], rcv["t1_ns"] = t_p, t_p + x_p2p[src]
        rcv["kind"], rcv["name_id"], rcv["comm_id"], rcv["seq"] = Kind.RECV, 4, 2, -1
        rcv["peer"], rcv["nbytes"] = src, nbytes
        peers = np.array([p for p in range(n) if p != r])
        pr = np.zeros(len(peers), EVENT_DTYPE)
        pr["t0_ns"] = 10 * MS + peers * MS
        pr["t1_ns"] = pr["t0_ns"] + (nbytes / bw[r, peers] * 1e9).astype(np.int64)
        pr["kind"], pr["name_id"], pr["comm_id"], pr["seq"] = Kind.PROBE, 5, 8, -1
        pr["peer"], pr["nbytes"] = peers, nbytes
        ev = np.concatenate([pr, coll, snd, rcv])
        ev = ev[np.argsort(ev["t0_ns"], kind="stable")]
        total += len(ev)
        write_rank_file(
            d / rank_file_name(r),
            dict(rank=r, world_size=n, local_rank=0, host=f"n{r:04d}", job_id="1", launch_id="l1", mono_ns_at_start=0),
            ev, strings,
        )  # fmt: skip
    return total


_RUN: Run | None = None


def _timed(label: str, fn, n_events: int, reps: int = 3) -> object:  # type: ignore[no-untyped-def]
    best = float("inf")
    out = None
    for _ in range(reps):
        if _RUN is not None:
            _RUN.cache = RunCache()  # time the work, not the cache
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    print(f"  {label:<34} {best * 1e3:9.1f} ms  {n_events / best / 1e6:8.2f} M events/s")
    return out


def bench_analysis(n: int, iters: int) -> None:
    with tempfile.TemporaryDirectory() as td:
        d = Path(td)
        t = time.perf_counter()
        n_ev = write_run(d, n, iters)
        print(f"synthetic run: {n} ranks x {iters} iterations = {n_ev} events (written in {time.perf_counter() - t:.1f} s)")
        global _RUN
        run = _timed("load_run", lambda: load_run(d), n_ev, reps=1)
        _RUN = run
        _timed("p2p_transfers (send/recv matching)", lambda: p2p_transfers(run), n_ev)  # type: ignore[arg-type]
        _timed("p2p_matrix", lambda: p2p_matrix(run), n_ev)  # type: ignore[arg-type]
        _timed("match_collectives", lambda: match_collectives(run), n_ev)  # type: ignore[arg-type]
        _timed("collective_transfers (incl. match)", lambda: collective_transfers(run), n_ev)  # type: ignore[arg-type]
        _timed("probe_matrix", lambda: probe_matrix(run), n_ev)  # type: ignore[arg-type]
        fs = _timed("slow_link detector (whole)", lambda: slow_link(Analysis.of(run, Config())), n_ev)
        for f in fs:  # type: ignore[attr-defined]
            print(f"  -> {f.kind}: {f.summary}")


def bench_probe() -> None:
    if shutil.which("mpiexec") is None:
        print("probe: no mpiexec, skipped")
        return
    job = Path(__file__).resolve().parent.parent / "tests" / "jobs" / "net_probe.py"
    print("probe over MPI, 4 ranks on this host (every rank pair; 3 XOR rounds):")
    for budget in (0.25, 1.0, 3.0):
        p = subprocess.run(["mpiexec", "-n", "4", sys.executable, str(job), "mpi", str(budget)],
                           capture_output=True, text=True, timeout=120)  # fmt: skip
        res = [json.loads(ln) for ln in p.stdout.splitlines() if ln.startswith("{")]
        if p.returncode != 0 or not res:
            print(f"  budget {budget}: failed: {p.stderr[-300:]}")
            continue
        el = max(d["elapsed_s"] for d in res)
        bw = np.median([v for d in res for v in d["bw"].values()])
        print(f"  budget {budget:5.2f} s: probe took {el:6.3f} s ({el / budget:5.1%} of budget), median pair {bw / 1e9:.2f} GB/s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--iters", type=int, default=5000)
    ap.add_argument("--probe", action="store_true")
    ns = ap.parse_args(argv)
    bench_analysis(ns.ranks, ns.iters)
    if ns.probe:
        bench_probe()
    return 0


if __name__ == "__main__":
    sys.exit(main())
