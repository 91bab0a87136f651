"""What a forked child's exit costs under the wrapper: fork, a few file calls, exit, waitpid.

A DataLoader whose workers are not persistent forks its workers anew each epoch, and each
worker that recorded a call has a stream of its own, written by the rank's helper
(distdiag.shim.helper) when it ends. This times, in one program, ``--children`` children in a
row (each: 20 ``os.stat`` calls, then ``os._exit(0)`` or ``sys.exit(0)``), from the fork to the
parent's ``waitpid``, plain and wrapped side by side (``--rounds`` of each by turns), and prints
the medians per child and their ratio.

    python benchmarks/bench_fork.py [--children 40] [--rounds 3] [--exit os|sys]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

PROG = """
import json, os, sys, time
how, n, d = sys.argv[1], int(sys.argv[2]), sys.argv[3]
open(os.path.join(d, "x"), "w").close()
import numpy  # a DataLoader's parent has torch: the children's streams open at once
per = []
for i in range(n):
    t = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        for _ in range(20):
            os.stat(os.path.join(d, "x"))
        if how == "os":
            os._exit(0)
        sys.exit(0)
    os.waitpid(pid, 0)
    per.append(time.perf_counter() - t)
print("REC " + json.dumps(per))
"""


def one(wrapped: bool, args: argparse.Namespace, tmp: str) -> list[float]:
    d = tempfile.mkdtemp(dir=tmp)
    cmd = [sys.executable, "-c", PROG, args.exit, str(args.children), d]
    if wrapped:
        cmd = [sys.executable, "-m", "distdiag.wrap", "--dir", os.path.join(d, "run"), *cmd]
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTDIAG_")}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    if p.returncode != 0:
        raise SystemExit(p.stdout + p.stderr)
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("REC "))
    return [float(x) for x in json.loads(line[4:])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--children", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--exit", choices=["os", "sys"], default="os")
    args = ap.parse_args()
    got: dict[bool, list[float]] = {False: [], True: []}
    firsts: dict[bool, list[float]] = {False: [], True: []}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            for wrapped in (False, True):
                per = one(wrapped, args, tmp)
                firsts[wrapped].append(per[0])
                got[wrapped].extend(per[1:])
    plain, wrap = statistics.median(got[False]), statistics.median(got[True])
    print(f"per child (median of {len(got[True])}, the first of each run apart), exit via {args.exit}._exit/exit:")
    print(f"  plain   {plain * 1e3:7.2f} ms   first {statistics.median(firsts[False]) * 1e3:7.2f} ms")
    print(f"  wrapped {wrap * 1e3:7.2f} ms   first {statistics.median(firsts[True]) * 1e3:7.2f} ms")
    print(f"  wrapped/plain {wrap / plain:.2f}, +{(wrap - plain) * 1e3:.2f} ms a child")


if __name__ == "__main__":
    main()
