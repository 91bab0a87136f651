"""The verdict stages side by side: serial_section and the one ranking against the straggler detector.

    python benchmarks/bench_verdict.py [--ranks 32] [--iters 20000]

The run is ``tests/factories.make_run`` (one all-reduce and one file read per
iteration and rank, a slow rank) written through the shim's writer. Timed on
the aligned, matched run: the straggler detector (the reference: one pass over
the collectives), serial_section (member gaps, per-group medians, activity
lookups), and ``rank_findings`` with a straggler and a cause whose claims it
must intersect (input_bound-like claims: every file read of the slow rank).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from factories import make_run  # noqa: E402

from distdiag.clocks import align  # noqa: E402
from distdiag.config import Config  # noqa: E402
from distdiag.detectors import load_all  # noqa: E402
from distdiag.findings import Finding  # noqa: E402
from distdiag.match import collectives_of  # noqa: E402
from distdiag.roles import ROLES, Role  # noqa: E402
from distdiag.ranking import rank_findings  # noqa: E402
from distdiag.run import load_run  # noqa: E402
from distdiag.schema import Kind  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=32)
    ap.add_argument("--iters", type=int, default=20000)
    ap.add_argument("--repeat", type=int, default=3)
    ns = ap.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        make_run(run_dir, world_size=ns.ranks, iters=ns.iters, io_ms=0.1, slow_rank=1, slow_ms=1.0,
                 hosts=[f"n{r // 8}" for r in range(ns.ranks)])  # fmt: skip
        run = align(load_run(run_dir))
        colls = collectives_of(run)
        n_member = len(colls.m_rank)
        print(f"run: {ns.ranks} ranks x {ns.iters} iterations: {len(run.events):,} events, "
              f"{len(colls):,} collectives, {n_member:,} member rows")  # fmt: skip
        from distdiag.analysis import Analysis

        dets = load_all()
        cfg = Config()

        def best(fn: object) -> float:
            ts = []
            for _ in range(ns.repeat):  # a few repeats: take the best
                t = time.perf_counter()
                fn()  # type: ignore[operator]
                ts.append(time.perf_counter() - t)
            return min(ts)

        strag = dets["straggler"](Analysis(run, colls, cfg))
        # a cause claiming the slow rank's file reads (the claims rank_findings intersects)
        ROLES.setdefault("bench_cause", Role(tier=0, claims=(Kind.FILE_READ,)))

        def ranked() -> None:
            fs = [Finding(f.kind, f.cost_s, f.summary, ranks=list(f.ranks), evidence={}) for f in strag]
            fs.append(Finding("bench_cause", 1e9, "", ranks=[1]))
            rank_findings(fs, run, colls, cfg)

        rows = [
            ("straggler", best(lambda: dets["straggler"](Analysis(run, colls, cfg)))),
            ("serial_section", best(lambda: dets["serial_section"](Analysis(run, colls, cfg)))),
            ("rank_findings", best(ranked)),
        ]
        ref = rows[0][1]
        print(f"{'stage':<16} {'s':>8} {'member rows/s':>14} {'x straggler':>12}")
        for name, s in rows:  # three stages
            print(f"{name:<16} {s:>8.3f} {n_member / s:>14,.0f} {s / ref:>12.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
