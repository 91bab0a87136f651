"""What each writer costs a short job: the helper process against the in-process thread.

    python benchmarks/bench_writer_cost.py [--module numpy] [--rounds 7]

Each round runs, in alternating order, a fresh ``python -c "import MOD; <N stats>"``:

* ``plain``    unwrapped;
* ``thread``   ``distdiag-wrap`` with ``DISTDIAG_WRITER=thread`` (the rank file written by a
  flusher thread of the program's process);
* ``process``  ``distdiag-wrap`` with ``DISTDIAG_WRITER=process`` (written by a helper process).

and reads two things per run: the job's wall-clock (start to the wrapped process's exit,
what the user waits for) and the CPU of every process it left behind (user + system),
the helper included: this driver makes itself the child subreaper (``prctl``), so the
helper, which ``/bin/sh`` starts in the background and which outlives ``sh``, is
reparented to it and its CPU lands in ``RUSAGE_CHILDREN`` once reaped. Medians over the
rounds, and the ratios against plain, side by side in one run.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import resource
import statistics
import subprocess
import sys
import time

PR_SET_CHILD_SUBREAPER = 36


def _reap_all() -> None:
    """Wait for every descendant reparented to this process (the helper ends after the rank)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, 0)
        except ChildProcessError:
            return
        except InterruptedError:
            continue


def _one(variant: str, module: str, stats: int) -> tuple[float, float]:
    code = f"import os, {module}\nfor i in range({stats}): os.stat('.')"
    cmd = [sys.executable, "-c", code]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if variant != "plain":
        cmd = [sys.executable, "-m", "distdiag.wrap", "--dir", f"/tmp/bench-writer-cost-{os.getpid()}-{variant}",
               *cmd]  # fmt: skip
        env["DISTDIAG_WRITER"] = variant
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL)
    p.wait()
    wall = time.perf_counter() - t0
    _reap_all()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if p.returncode != 0:
        raise SystemExit(f"{variant}: exit {p.returncode}")
    subprocess.run(["rm", "-rf", f"/tmp/bench-writer-cost-{os.getpid()}-{variant}"], check=False)
    return wall, cpu


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--module", default="numpy")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--stats", type=int, default=20000, help="os.stat calls the job makes (rows to write)")
    a = ap.parse_args()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        print("bench_writer_cost: prctl(PR_SET_CHILD_SUBREAPER) failed: the helper's CPU is not counted",
              file=sys.stderr)  # fmt: skip
    variants = ["plain", "thread", "process"]
    got: dict[str, list[tuple[float, float]]] = {v: [] for v in variants}
    for r in range(a.rounds):
        order = variants if r % 2 == 0 else variants[::-1]
        for v in order:
            got[v].append(_one(v, a.module, a.stats))
    wall0 = statistics.median(w for w, _ in got["plain"])
    cpu0 = statistics.median(c for _, c in got["plain"])
    print(f"import {a.module} + {a.stats} stats, {a.rounds} rounds, medians")
    print(f"{'variant':8} {'wall s':>8} {'x plain':>8} {'CPU s':>8} {'x plain':>8}")
    for v in variants:
        w = statistics.median(x for x, _ in got[v])
        c = statistics.median(y for _, y in got[v])
        print(f"{v:8} {w:8.3f} {w / wall0:8.2f} {c:8.3f} {c / cpu0:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
