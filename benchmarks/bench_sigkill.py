"""SIGKILL a wrapped rank at N random instants and count the files that lost more than the
promise allows (see ``tests/sigkill.py`` for what each kill checks).

    python benchmarks/bench_sigkill.py [--kills 200] [--flush-interval-s 0.01] [--seed 0] [--writer process]
                                       [--helper-too]

``--helper-too`` (with ``--writer process``): the helper process is SIGKILLed with the rank, as
Slurm's step kill after ``KillWait`` ends both, so that kills land inside the helper's writes.

The kills take the three jobs of ``tests/sigkill.py`` in turn: numpy imported first (the
HDF5 file opens at the first flush), late (kills before, during and after the file's
opening and the spill log's hand-over) and never (the spill log only).

Exit status 1 when any file is bad.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from sigkill import JOBS, kill_once  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=200)
    ap.add_argument("--flush-interval-s", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--writer", choices=("thread", "process"), default="process", help="the shim's writer setting")
    ap.add_argument("--helper-too", action="store_true", help="SIGKILL the rank's helper process too")
    ns = ap.parse_args(argv)
    if ns.helper_too and ns.writer != "process":
        ap.error("--helper-too needs --writer process")
    rng = random.Random(ns.seed)
    bad = 0
    by_job = dict.fromkeys(JOBS, 0)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="distdiag-sigkill-") as td:
        for k in range(ns.kills):
            job = list(JOBS)[k % len(JOBS)]
            why = kill_once(Path(td), rng, ns.flush_interval_s, REPO, job, ns.writer, ns.helper_too)
            if why is not None:
                bad += 1
                by_job[job] += 1
                print(f"  kill {k} (numpy {job}): {why}", flush=True)
    print(f"{ns.kills} SIGKILLs (writer={ns.writer}{', helper too' if ns.helper_too else ''}, flush every {ns.flush_interval_s:g} s) in {time.perf_counter() - t0:.0f} s: "
          f"{bad} files lost rows of a completed flush or did not open; by job (numpy first/late/never): "
          f"{'/'.join(str(v) for v in by_job.values())}")  # fmt: skip
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
