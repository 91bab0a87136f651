"""CPU and transient memory of the per-rank facts the Slurm view and hang read, side by side.

    python benchmarks/bench_rank_facts.py RUN_DIR [--baseline /tmp/wt] [--repeat 2] [--stream]

What is timed, in a fresh child per measurement (the run loaded and aligned
first, not timed): the Slurm view's milestones and busy-until
(``distdiag.slurm.rank_milestones`` + ``rank_busy_until``: each rank's first
useful work, first collective, first rendezvous, and its activity before it)
and hang's description of 8 ranks' last rows (``hang._describe``; an older
tree: its own slicing of ``run.events`` then ``_doing``). Both run only on a
Slurm job or a hung one, so ``bench_scale --stages`` on a synthetic run does
not reach them. CPU is ``time.process_time`` (the machine is shared); the
transient is the peak RSS over the RSS before the stage (the high-water mark
reset through ``/proc/self/clear_refs``), per event. With ``--baseline`` the
children alternate (A B, B A, ...) and the best of each tree is printed.
``--stream`` loads the run with the compute phases streamed (this tree only:
the stages then read them band by band from the rank files).

Measured (issue 10, 2-core machine at load ~4, ``--baseline <worktree of
485fb9d>``, best of 2-3 alternating children per tree, before -> after; the
run's kind index is first built inside the Slurm facts in both trees, ~4
B/event of it held after)::

    run (synthetic)          Slurm facts CPU s, transient     hang (8 ranks) CPU s, transient
    256 x 10k   (2.6 M ev)   0.313 -> 0.107,  +31.1 -> +3.2 B/ev   0.028 -> 0.002,  +12.0 -> +0.05 B/ev
    1024 x 10k (10.3 M ev)   1.234 -> 0.443,  +34.4 -> +5.0 B/ev   0.157 -> 0.002,  +12.0 -> +0.01 B/ev
    64 x 100k   (6.4 M ev)   0.657 -> 0.250,  +35.0 -> +5.0 B/ev   0.111 -> 0.013,   +8.0 -> +0.02 B/ev

Before: rows of every useful kind gathered by rank (three passes), a
``np.minimum.at`` over them, and a compare of every row's t0 with its rank's
rendezvous; hang copied the whole rank column to find 8 ranks. After: one
pass over the bands, minima by ``reduceat`` over each rank's segment, the
rows before the rendezvous from the few kinds that can be there; hang reads
only its ranks' bands. Streamed (``--stream``, 1024 x 10k): Slurm facts
1.44 s (a pass reads every rank file again), +2.1 B/event; the baseline
raises there (its rows_of asks for streamed kinds).
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

REPO = Path(__file__).resolve().parent.parent


def _timed(fn: Any) -> tuple[float, float]:
    """(CPU s, transient MB) of ``fn()`` (bench_scale's measure)."""
    from bench_scale import measured

    _, c, r0, _, hwm = measured(fn)
    return c, max(0.0, hwm - r0)


def _child(run_dir: str, stream: bool) -> int:
    import numpy as np

    from distdiag import clocks, run as runmod, slurm
    from distdiag.detectors import hang

    # the plain call when not streaming: an older tree's load_run has no streamed_kinds
    loaded = runmod.load_run(run_dir, streamed_kinds=runmod.STREAMED_KINDS) if stream else runmod.load_run(run_dir)
    run = clocks.align(loaded)
    n_events = int(sum(i.n_events for i in run.ranks.values())) or 1
    out: dict[str, Any] = {"events": n_events}
    out["slurm"] = _timed(lambda: (slurm.rank_milestones(run), slurm.rank_busy_until(run)))
    ranks = np.linspace(0, max(run.ranks), 8).astype(np.int64)
    _, end = run.rank_bounds()
    if hasattr(hang, "_describe"):
        out["hang"] = _timed(lambda: hang._describe(run, ranks, {int(r): int(end[r]) for r in ranks}))
    else:  # an older tree: what its detect did for the ranks it describes

        def old() -> None:
            col = np.ascontiguousarray(run.events["rank"])
            sl = {int(r): slice(*(int(x) for x in np.searchsorted(col, [int(r), int(r) + 1]))) for r in ranks}
            for r in ranks:  # 8
                hang._doing(run, int(r), int(end[r]), sl)  # type: ignore[arg-type]  # an older tree's signature

        out["hang"] = _timed(old)
    print(json.dumps(out))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir")
    ap.add_argument("--baseline", type=Path, help="another checkout, put first on PYTHONPATH")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--stream", action="store_true", help="stream the compute phases (this tree only)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns.child:
        return _child(ns.run_dir, ns.stream)
    trees = [("this", REPO)] + ([("baseline", ns.baseline.resolve())] if ns.baseline else [])
    best: dict[str, dict[str, tuple[float, float]]] = {}
    for i in range(ns.repeat):  # alternating blocks: A B, B A, ...
        for label, tree in trees if i % 2 == 0 else trees[::-1]:  # 1-2 trees
            env = dict(os.environ, PYTHONPATH=str(tree) + os.pathsep + os.environ.get("PYTHONPATH", ""))
            cmd = [sys.executable, __file__, ns.run_dir, "--child"]
            cmd += ["--stream"] if ns.stream and label == "this" else []
            got = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd="/tmp")
            if got.returncode:
                print(f"{label}: FAILED\n{got.stderr[-2000:]}", flush=True)
                continue
            res = json.loads(got.stdout.splitlines()[-1])
            ev = res.pop("events")
            print(f"{label:8s} load {os.getloadavg()[0]:.1f}: " + "  ".join(
                f"{k} {c:.3f} s +{mb * 2**20 / ev:.2f} B/ev" for k, (c, mb) in res.items()), flush=True)  # fmt: skip
            b = best.setdefault(label, {})
            for k, (c, mb) in res.items():  # two stages
                old = b.get(k, (float("inf"), float("inf")))
                b[k] = (min(old[0], c), min(old[1], mb * 2**20 / ev))
    for label, b in best.items():  # 1-2 trees
        print(f"best {label:8s}: " + "  ".join(f"{k} {c:.3f} s +{t:.2f} B/ev" for k, (c, t) in b.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
