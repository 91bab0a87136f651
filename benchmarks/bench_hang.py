"""Cost of the hang and collective_mismatch detectors next to the straggler detector.

    python benchmarks/bench_hang.py [--ranks 256] [--events 4000]

A synthetic run (``distdiag.synth``, the shim's file layout) is loaded and
aligned once; then the last collective of every rank but one is moved into
``/inflight`` (the job hung there, rank ``ranks // 2`` never came) and every
rank's sizes at one early seq are made to differ on one rank (a mismatch).
Each detector runs on the same run, side by side, best of 3.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from distdiag.cache import RunCache  # noqa: E402
from distdiag.clocks import align  # noqa: E402
from distdiag.config import Config  # noqa: E402
from distdiag.detectors import load_all  # noqa: E402
from distdiag.match import collectives_of  # noqa: E402
from distdiag.run import load_run  # noqa: E402
from distdiag.schema import COMM_KINDS  # noqa: E402
from distdiag.synth import synth  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=256)
    ap.add_argument("--events", type=int, default=4000, help="per rank")
    ns = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as td:
        synth(Path(td) / "run", ranks=ns.ranks, events=ns.events)
        run = align(load_run(Path(td) / "run"))
    ev = run.events
    coll = np.isin(ev["kind"], np.array(sorted(int(k) for k in COMM_KINDS), np.uint8)) & (ev["seq"] >= 0)
    world = int(np.bincount(ev["comm_id"][coll]).argmax())
    on_world = coll & (ev["comm_id"] == world)
    last_seq = int(ev["seq"][on_world].max())
    hung = ns.ranks // 2
    stuck = on_world & (ev["seq"] == last_seq)
    inf = ev[stuck & (ev["rank"] != hung)].copy()
    inf["t1_ns"] = -1
    keep = ~stuck
    odd = on_world & (ev["seq"] == 3) & (ev["rank"] == 1)
    ev = ev.copy()
    ev["nbytes"][odd] += 8
    run = run.replace(events=ev[keep], inflight=np.concatenate([run.inflight, inf]))
    print(f"{ns.ranks} ranks, {len(run.events):,} events, hang at world #{last_seq} (rank {hung} missing)")
    from distdiag.analysis import Analysis

    dets = load_all()
    cfg = Config()
    cfg.sections["hang"] = {"min_stuck_s": 0.0}  # the synthetic hang lasts only until the ranks' last event
    for name in ("straggler", "hang", "collective_mismatch"):
        best = float("inf")
        got = []
        for _ in range(3):
            run.cache = RunCache()
            collectives_of(run)  # matching is shared by all three: not timed
            t = time.perf_counter()
            got = dets[name](Analysis(run, collectives_of(run), cfg))
            best = min(best, time.perf_counter() - t)
        summary = got[0].summary[:90] if got else "(nothing)"
        print(f"  {name:20s} {best * 1e3:8.1f} ms   {summary}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
