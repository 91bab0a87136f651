"""input_bound + h2d_copy (the critical path of input waits and copies) at scale, this tree against another.

    python benchmarks/bench_input_bound.py [--size 64x100000] [--baseline /tmp/wt] [--repeat 2]
                                           [--base /tmp/distdiag-scale-input] [--stream]

The synthetic runs of ``distdiag synth`` have no input wait, copy or step mark,
so these detectors never price anything there. This writes (once; reused when
its meta.json matches) a DDP-like run of R ranks x M events through the shim's
writer: per iteration each rank waits on the loader, copies to the device,
runs a forward phase with a user phase inside it, a backward that posts the
bucket all-reduce half-way and waits for it, the optimizer, and marks the
step (8 rows an iteration, ns-irregular lengths). Some iterations' input wait
is partly hidden under the previous step (a prefetch).

Each measurement is a fresh child per detector: load + align (not measured),
then the ``input_bound`` or the ``h2d_copy`` detector, or both one after the
other as the pipeline runs them, with the CPU seconds and the peak RSS over
the RSS before (the high-water mark reset through
``/proc/self/clear_refs``), in bytes per event. With ``--baseline`` the
children alternate A B / B A ``--repeat`` times and the best CPU and least
transient of each tree are printed side by side. ``--stream`` also measures
this tree with the compute phases streamed (read band by band from the rank
files: the CPU then includes that read).

The match and the kind index are built before the measured detector (the
pipeline's match stage, or the first detector that asks, builds them).

Measured (issue 10, 2-core machine at load 2-5, ``--size 64x100000 --baseline
<worktree of daba0eb> --repeat 2 --stream``; baseline = the whole-table
computation, one pass per detector; this = band by band, both kinds priced in
the first detector's pass; best CPU s of 2 children per tree, range over three
runs)::

    detector            CPU s baseline -> this (streamed)     peak RSS over the live set, B/event
    input_bound         1.27-1.51 -> 0.83-0.94 (1.25-1.32)   68.3 -> 1.7-3.1 (6.2)
    h2d_copy            1.42-1.47 -> 0.90-1.04 (1.22-1.64)   68.3 -> 1.7-3.1 (3.4-6.2)
    both, in turn       2.69-2.82 -> 0.91-1.05 (1.36-1.57)   68.4 -> 1.8-3.1 (3.4-6.2)

(each child computes the run's time bounds once: ~0.1 s of the above).
At 256 x 10k and 1024 x 1k (``--repeat 2``), both in turn: 0.95 -> 0.35 s and
0.36 -> 0.14 s, +61-63 -> +3-5 B/event.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
MS = 1_000_000
#: each alone, then both in one process one after the other (as the pipeline runs them)
DETECTORS = ("input_bound", "h2d_copy", "both")


def write_run(d: Path, ranks: int, events: int, seed: int = 1) -> None:
    """The DDP-like run (see the module docstring), vectorized over ranks x iterations."""
    from distdiag.schema import EVENT_DTYPE, Kind
    from distdiag.shim.writer import write_rank_file

    d.mkdir(parents=True, exist_ok=True)
    it = max(1, events // 8)
    rng = np.random.default_rng(seed)
    strings = ["", "DataLoader.__next__", "Tensor.to", "DistributedDataParallel", "Tensor.backward", "SGD",
               "optimizer_step", "ddp_bucket_allreduce", "ddp0:default", "user", "torch.float32"]  # fmt: skip
    shape = (it, ranks)
    jit = rng.integers(0, MS // 2, shape)
    d_in = rng.integers(1, 8 * MS, shape) * (rng.random(shape) < 0.7)
    pre = np.where(rng.random(shape) < 0.2, rng.integers(0, 2 * MS, shape), 0)  # prefetch under the last step
    d_h2d = rng.integers(MS // 10, 2 * MS, shape)
    d_fwd = rng.integers(8 * MS, 12 * MS, shape) + np.arange(ranks) * (MS // 20)
    d_bwd = 2 * d_fwd
    start = jit  # relative to the iteration's start S_i
    t_in = start + d_in
    t_h2d = t_in + d_h2d
    t_fwd = t_h2d + d_fwd
    arrive = t_fwd + d_bwd // 2
    done = arrive.max(axis=1, keepdims=True) + rng.integers(MS // 2, 2 * MS, (it, 1))
    bwd_end = np.maximum(t_fwd + d_bwd, done)
    opt_end = bwd_end + rng.integers(MS // 2, MS, shape)
    S = np.concatenate([[200 * MS], 200 * MS + np.cumsum(opt_end.max(axis=1) + MS)[:-1]])[:, None]
    end = int(S[-1, 0] + opt_end.max()) + 50 * MS
    user0 = t_h2d + d_fwd // 4
    for r in range(ranks):  # one file per rank
        ev = np.zeros((it, 8), EVENT_DTYPE)
        s = S[:, 0]
        cols = [(start[:, r] - pre[:, r], t_in[:, r], Kind.INPUT_WAIT, 1), (t_in[:, r], t_h2d[:, r], Kind.H2D, 2),
                (t_h2d[:, r], t_fwd[:, r], Kind.FORWARD, 3), (user0[:, r], user0[:, r] + d_fwd[:, r] // 2, Kind.PHASE, 9),
                (t_fwd[:, r], bwd_end[:, r], Kind.BACKWARD, 4), (arrive[:, r], done[:, 0], Kind.COLL_ASYNC, 7),
                (bwd_end[:, r], opt_end[:, r], Kind.OPTIMIZER, 5), (opt_end[:, r], opt_end[:, r], Kind.STEP, 6)]  # fmt: skip
        for j, (a, b, k, name) in enumerate(cols):  # 8 kinds of row
            ev["t0_ns"][:, j] = s + a
            ev["t1_ns"][:, j] = s + b
            ev["kind"][:, j] = int(k)
            ev["name_id"][:, j] = name
        ev["seq"] = -1
        ev["peer"] = -1
        ev["comm_id"][:, 5] = 8
        ev["seq"][:, 5] = np.arange(it)
        ev["nbytes"][:, 5] = 1 << 20
        ev["aux"][:, 5] = 10
        ev["nbytes"][:, 1] = 1 << 22
        flat = ev.reshape(-1)
        flat = flat[np.lexsort((flat["t0_ns"],))]
        attrs: dict[str, object] = {"rank": r, "world_size": ranks, "host": f"node{r // 8}", "job_id": "bench",
                                    "launch_id": "bench", "mono_ns_at_start": 0, "end_mono_ns": end,
                                    "last_flush_mono_ns": end}  # fmt: skip
        write_rank_file(d / f"rank-{r:05d}.h5", attrs, flat, strings)


def ensure_run(base: Path, ranks: int, events: int) -> Path:
    d = base / f"{ranks}x{events}"
    meta = d / "meta.json"
    want = {"ranks": ranks, "events_per_rank": events, "version": 1}
    if meta.exists() and json.loads(meta.read_text()) == want:
        return d
    t0 = time.perf_counter()
    write_run(d, ranks, events)
    meta.write_text(json.dumps(want))
    print(f"  wrote {d} in {time.perf_counter() - t0:.1f} s", flush=True)
    return d


def _child(run_dir: str, stream: bool, det: str) -> int:
    """In the measured process: load + align, then the detector ``det`` (or "both")'s CPU s and
    transient RSS."""
    from distdiag.clocks import align
    from distdiag.analysis import Analysis
    from distdiag.config import load_config
    from distdiag.detectors import load_all
    from distdiag.run import load_run

    kw: dict[str, Any] = {}
    if stream:
        from distdiag.run import STREAMED_KINDS

        kw["streamed_kinds"] = STREAMED_KINDS
    run = align(load_run(run_dir, **kw))
    cfg = load_config()
    dets = load_all()
    n = sum(i.n_events for i in run.ranks.values())
    out: dict[str, Any] = {"events": n}

    from distdiag.match import collectives_of
    from distdiag.rows import kind_index

    # what the pipeline has built before the detectors run (the match stage), or the
    # first detector that asks (the kind index): not these detectors' own cost
    collectives_of(run)
    kind_index(run)
    from bench_scale import measured  # RSS in MB

    got, c, r0, _, hwm = measured(
        lambda: [f.cost_s for name in DETECTORS[:2] if det in (name, "both") for f in dets[name](Analysis.of(run, cfg))]
    )
    out[det] = {"cpu_s": c, "transient_b_per_event": (hwm - r0) * 2**20 / n, "cost_s": got}
    print(json.dumps(out))
    return 0


def _measure(tree: Path, run_dir: Path, stream: bool = False) -> dict[str, Any]:
    """One child per detector (the second would reuse the pages the first freed: its peak would hide)."""
    env = dict(os.environ, PYTHONPATH=str(tree) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out: dict[str, Any] = {}
    for det in DETECTORS:
        argv = [sys.executable, str(Path(__file__).resolve()), "--child", str(run_dir), "--det", det]
        got = subprocess.run(argv + (["--stream"] if stream else []), capture_output=True, text=True, env=env,
                             cwd="/tmp", timeout=1200)  # fmt: skip
        if got.returncode != 0:
            return {"error": got.stderr.strip().splitlines()[-1:]}
        out.update(json.loads(got.stdout.strip().splitlines()[-1]))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="64x100000")
    ap.add_argument("--base", type=Path, default=Path("/tmp/distdiag-scale-input"))
    ap.add_argument("--baseline", type=Path)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--stream", action="store_true")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--det", default="input_bound", help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    if ns.child:
        return _child(ns.child, ns.stream, ns.det)
    r, m = ns.size.lower().split("x")
    d = ensure_run(ns.base, int(r), int(float(m)))
    trees = [("this", REPO)] + ([("baseline", ns.baseline)] if ns.baseline else [])
    res: dict[str, list[dict[str, Any]]] = {t: [] for t, _ in trees}
    print(f"{d}, load {os.getloadavg()[0]:.1f}", flush=True)
    for i in range(ns.repeat):  # alternating blocks: A B, B A, ...
        for label, tree in trees if i % 2 == 0 else trees[::-1]:
            got = _measure(tree, d)
            res[label].append(got)
            print(f"  {label:8s} {json.dumps(got)}", flush=True)
    if ns.stream:
        got = _measure(REPO, d, stream=True)
        res["this streamed"] = [got]
        print(f"  streamed {json.dumps(got)}", flush=True)
    print(f"{'detector':12s} {'tree':14s} {'best CPU s':>10s} {'least B/event':>13s}")
    for det in DETECTORS:
        best = {}
        for label, runs in res.items():
            ok = [x[det] for x in runs if det in x]
            if ok:
                best[label] = min(x["cpu_s"] for x in ok)
                tr = min(x["transient_b_per_event"] for x in ok)
                print(f"{det:12s} {label:14s} {best[label]:10.3f} {tr:13.1f}")
        if "baseline" in best and best["this"] > 0:
            print(f"{det:12s} baseline / this CPU: {best['baseline'] / best['this']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
