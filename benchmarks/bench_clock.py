"""Clock alignment: residual against injected skew and drift, and the cost of sync.

    python benchmarks/bench_clock.py [--ranks 4 16 64] [--run-s 3]

For each world size N, starts N plain processes on this host (no MPI: the
sync side channel is UDP and needs none), rank 0 with its true clock, the
others under libfaketime with a random offset (+-0.5 s) and drift (+-200 ppm).
Each runs ``ClockSync`` with a sync round every 0.5 s while it alternates
Python compute and sleeps, and records ground truth (its faked clock next to
the kernel's CLOCK_MONOTONIC via a raw system call, which libfaketime does not
intercept; see tests/jobs/clock_job.py). The analyzer's model
(``distdiag.clocks``) is fitted from the rows and compared with the truth at
200 instants over each rank's run. Oversubscribed on purpose: 64 ranks on 2
cores is the worst case for the exchanges' round trips.

Prints, per N: residual (median / p95 / max over ranks of each rank's max
error), the stated bound, drift error, and the sync cost: wall-clock per round
(sync_exchanges=10 exchanges) as the client's thread sees it, in ms per rank
per sample (one sample = one round). ``--overhead`` adds the program's side:
a pure-Python compute loop timed with and without a sync round every 50 ms
(1200 times the default rate: the default interval is 60 s), alternated in
one run.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "jobs"))
LIBFAKETIME = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1"


def worker(rank: int, world: int, run_dir: Path, run_s: float) -> None:
    from clock_job import Truth  # type: ignore[import-not-found]

    from distdiag.shim.clock import ClockSync
    from distdiag.shim.config import ShimConfig

    cfg = ShimConfig()
    cfg.sync_interval_s = 0.5
    cfg.exit_sync_wait_s = 60.0  # rank 0 waits for every rank's exit round
    rows: list[np.ndarray] = []
    costs: list[int] = []
    c = ClockSync(rank, world, run_dir, cfg, rows.append)
    orig = c._round

    def timed(tag):  # type: ignore[no-untyped-def]
        t = time.perf_counter_ns()
        orig(tag)
        costs.append(time.perf_counter_ns() - t)

    c._round = timed  # type: ignore[method-assign]
    truth = Truth()
    truth.sample()
    c.start()
    end = time.monotonic() + run_s
    while time.monotonic() < end:
        t_end = time.perf_counter() + 0.005
        x = 0
        while time.perf_counter() < t_end:  # holds the GIL, like Python-level compute
            x += 1
        time.sleep(0.01)
        truth.sample()
    c.stop()
    truth.sample()
    sync = np.concatenate(rows) if rows else np.zeros(0)
    np.savez(run_dir / f"w{rank}.npz", sync=sync, truth=np.array(truth.rows, np.int64), cost_ns=np.array(costs, np.int64),
             exchanges=c.exchanges, lost=c.lost)  # fmt: skip


def one(n: int, run_s: float, rng: np.random.Generator) -> dict[str, float]:
    from distdiag import clocks
    from distdiag.run import RUN_SYNC_DTYPE

    off_s = np.r_[0.0, rng.uniform(-0.5, 0.5, n - 1)]
    drift = np.r_[0.0, rng.uniform(-200, 200, n - 1)]
    with tempfile.TemporaryDirectory() as d:
        run_dir = Path(d)
        procs = []
        for r in range(n):  # start every rank
            env = dict(os.environ)
            if r > 0:
                env["LD_PRELOAD"] = LIBFAKETIME
                env["FAKETIME"] = f"{off_s[r]:+.6f}s x{1 + drift[r] * 1e-6:.7f}"
            cmd = [sys.executable, __file__, "--worker", str(r), str(n), str(run_dir), str(run_s)]
            procs.append(subprocess.Popen(cmd, env=env))
        for p in procs:
            p.wait(timeout=120 + 2 * n)
        data = [np.load(run_dir / f"w{r}.npz") for r in range(n)]
    # truth: perf_r = p0 + c + k (true - t0)
    fits = []
    for dd in data:
        a = dd["truth"]
        k, c = np.polyfit((a[:, 0] - a[0, 0]).astype(float), (a[:, 1] - a[0, 1]).astype(float), 1)
        fits.append((int(a[0, 0]), int(a[0, 1]), float(k), float(c)))
    T0, P0, K0, C0 = fits[0]
    parts = []
    for r in range(1, n):
        s = data[r]["sync"]
        if len(s) == 0:
            continue
        out = np.zeros(len(s), RUN_SYNC_DTYPE)
        for col in s.dtype.names:
            out[col] = s[col]
        out["rank"] = r
        parts.append(out)
    k = clocks._knots(np.concatenate(parts))
    errs, bounds, derr, unsynced = [], [], [], 0
    for r in range(1, n):
        kr = k[k["rank"] == r]
        if len(kr) == 0:
            unsynced += 1
            continue
        m = clocks._fit_rank(r, kr)
        t0, p0, kk, cc = fits[r]
        a = data[r]["truth"]
        x = np.linspace(a[0, 1], a[-1, 1], 200).astype(np.int64)
        true_rel = ((x - p0).astype(float) - cc) / kk + (t0 - T0)
        truth = P0 + np.rint(C0 + K0 * true_rel).astype(np.int64)
        errs.append(float(np.abs(m.map(x) - truth).max()))
        bounds.append(float(m.bound_at(x).max()))
        derr.append(abs(m.drift_ppm - (kk / K0 - 1) * 1e6))
    cost = np.concatenate([dd["cost_ns"] for dd in data[1:]]) / 1e6
    ex = sum(int(dd["exchanges"]) for dd in data[1:])
    lost = sum(int(dd["lost"]) for dd in data[1:])
    e = np.array(errs) / 1e3
    return {
        "n": n, "res_med_us": float(np.median(e)), "res_p95_us": float(np.percentile(e, 95)), "res_max_us": float(e.max()),
        "bound_med_us": float(np.median(bounds)) / 1e3, "drift_err_med_ppm": float(np.median(derr)),
        "cost_med_ms": float(np.median(cost)), "cost_p95_ms": float(np.percentile(cost, 95)),
        "rounds": len(cost), "exch": ex, "lost": lost, "unsynced": unsynced,
    }  # fmt: skip


def _reference(run_dir: Path, run_s: float) -> None:
    from distdiag.shim.clock import ClockSync
    from distdiag.shim.config import ShimConfig

    c = ClockSync(0, 2, run_dir, ShimConfig(), lambda rows: None)
    c.start()
    time.sleep(run_s)


def _workload() -> float:
    """~0.3 s of pure-Python compute (holds the GIL: the worst case for a sync thread)."""
    t = time.perf_counter()
    x = 0
    for i in range(3_000_000):
        x += i % 7
    return time.perf_counter() - t


def overhead(reps: int = 5, interval_s: float = 0.05) -> None:
    """Side by side in one run: the program's compute with and without a sync round every interval_s."""
    from distdiag.shim.clock import ClockSync
    from distdiag.shim.config import ShimConfig

    with tempfile.TemporaryDirectory() as d:
        ref = subprocess.Popen([sys.executable, __file__, "--reference", d, str(10 + reps * 3)])
        try:
            deadline = time.monotonic() + 20
            while not (Path(d) / "clock-ref.json").exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            cfg = ShimConfig()
            cfg.sync_interval_s = interval_s
            plain, synced, rounds = [], [], 0
            for _ in range(reps):  # alternate, so drifting machine load hits both alike
                plain.append(_workload())
                c = ClockSync(1, 2, d, cfg, lambda rows: None)
                c.start()
                time.sleep(0.2)  # the start round is done
                r0 = sum(c.rounds.values())
                synced.append(_workload())
                rounds += sum(c.rounds.values()) - r0
                c.stop()
        finally:
            ref.kill()
            ref.wait(timeout=10)
    p, s_ = float(np.median(plain)), float(np.median(synced))
    print(f"program overhead: compute {p * 1e3:.0f} ms plain vs {s_ * 1e3:.0f} ms with a sync round every "
          f"{interval_s * 1e3:.0f} ms ({rounds} rounds during the synced runs): ratio {s_ / p:.3f}")  # fmt: skip


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]), float(sys.argv[5]))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--reference":
        _reference(Path(sys.argv[2]), float(sys.argv[3]))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, nargs="+", default=[4, 16, 64])
    ap.add_argument("--run-s", type=float, default=3.0, help="plus 0.3 s per rank")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--overhead", action="store_true", help="also: the program's slowdown from sync rounds")
    a = ap.parse_args()
    rng = np.random.default_rng(a.seed)
    print(f"{'ranks':>5} {'resid med/p95/max us':>22} {'bound med us':>12} {'drift err ppm':>13} "
          f"{'ms/rank/sample med/p95':>23} {'rounds':>6} {'lost/exch':>10} {'unsynced':>8}")  # fmt: skip
    if a.overhead:
        overhead()
    for n in a.ranks:  # each world size
        # 64 Python processes take ~20 s to start on 2 cores: every rank must overlap rank 0
        r = one(n, a.run_s + 0.3 * n, rng)
        print(f"{r['n']:>5} {r['res_med_us']:>7.1f}/{r['res_p95_us']:>6.1f}/{r['res_max_us']:>7.1f} "
              f"{r['bound_med_us']:>12.1f} {r['drift_err_med_ppm']:>13.1f} "
              f"{r['cost_med_ms']:>11.2f}/{r['cost_p95_ms']:>8.2f} {r['rounds']:>6} {r['lost']:>4}/{r['exch']:<5} "
              f"{r['unsynced']:>8}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
