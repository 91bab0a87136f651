"""Analyzer throughput: events/s of each stage on a synthetic run written by the shim's writer.

    python benchmarks/bench_analyzer.py [--ranks 32] [--iters 20000] [--keep DIR]

Each rank records, per iteration, one all-reduce and one file read (2 events),
so a run holds ranks * iters * 2 events. The files are written once through
``tests/factories.make_run`` (the shim's own HDF5 layout), then each stage is
timed on its own: load_run, align, match_collectives, the straggler detector,
the per-rank breakdown, and the whole ``analyze`` with rendering, side by side.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from factories import make_run  # noqa: E402

from distdiag.analysis import Analysis  # noqa: E402
from distdiag.breakdown import breakdown  # noqa: E402
from distdiag.clocks import align  # noqa: E402
from distdiag.config import Config  # noqa: E402
from distdiag.detectors import load_all  # noqa: E402
from distdiag.match import match_collectives  # noqa: E402
from distdiag.pipeline import analyze  # noqa: E402
from distdiag.render import render  # noqa: E402
from distdiag.run import load_run  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=32)
    ap.add_argument("--iters", type=int, default=20000)
    ap.add_argument("--keep", type=Path, help="write the run here and keep it")
    ns = ap.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        run_dir = ns.keep or Path(tmp) / "run"
        t = time.perf_counter()
        make_run(run_dir, world_size=ns.ranks, iters=ns.iters, io_ms=0.1, slow_rank=1, slow_ms=1.0,
                 hosts=[f"n{r // 8}" for r in range(ns.ranks)])  # fmt: skip
        gen_s = time.perf_counter() - t
        n_ev = ns.ranks * ns.iters * 2
        mb = sum(f.stat().st_size for f in run_dir.glob("rank-*.h5")) / 1e6
        print(f"run: {ns.ranks} ranks x {ns.iters} iterations = {n_ev:,} events, {mb:.0f} MB on disk "
              f"(written in {gen_s:.1f} s)")  # fmt: skip

        cfg = Config()
        rows = []
        t = time.perf_counter()
        run = load_run(run_dir)
        rows.append(("load_run", time.perf_counter() - t))
        t = time.perf_counter()
        run = align(run)
        rows.append(("align", time.perf_counter() - t))
        t = time.perf_counter()
        colls = match_collectives(run)
        rows.append(("match_collectives", time.perf_counter() - t))
        run.cache.collectives = colls
        t = time.perf_counter()
        found = load_all()["straggler"](Analysis(run, colls, cfg))
        rows.append(("straggler detector", time.perf_counter() - t))
        t = time.perf_counter()
        breakdown(run, colls)
        rows.append(("breakdown", time.perf_counter() - t))
        t = time.perf_counter()
        rep = analyze(run_dir, cfg)
        render(rep, "text")
        render(rep, "json")
        rows.append(("analyze + render (all)", time.perf_counter() - t))

        print(f"{'stage':<24} {'seconds':>9} {'events/s':>14}")
        for name, sec in rows:
            print(f"{name:<24} {sec:>9.3f} {n_ev / sec:>14,.0f}")
        print(f"verdict: {found[0].summary if found else 'no straggler (unexpected)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
