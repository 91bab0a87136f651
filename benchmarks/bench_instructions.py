"""Instructions the shim adds per intercepted call, old tree vs this one: a load-proof count.

    python benchmarks/bench_instructions.py --old /tmp/old-worktree [--n 20000] [--cases barrier,stat]

Why instructions: this 2-core machine is shared, and under a load average of
7 even the CPU time per call (benchmarks/bench_intercept.py) moves by 50%
from run to run. Valgrind's callgrind counts the instructions a process
executes, the same on every run whatever the neighbours do. Each case runs
its loop inside ``eval`` and we read the inclusive count of ``builtin_eval``
(the loop alone: imports and set-up excluded), once with the hook and once
without, in a separate ``valgrind --tool=callgrind`` process per (tree, case,
variant); "added" is the difference per call. Both trees are imported
through PYTHONPATH (a ``git worktree`` of the old commit; nothing installed).

Instructions are not nanoseconds: on this machine's CPU a quiet run of the
Python interpreter retires roughly 8-10 instructions per ns (old mpi4py hook:
~12.9k instructions against ~1.4 us measured by bench_intercept on a quiet
box), so read 1k instructions as ~0.1 us. Needs valgrind (Debian:
``apt-get install valgrind``) and, for the MPI cases, mpi4py + MPICH (an MPI
singleton: no mpiexec). Runtime: valgrind runs ~40x slower; the two
default cases take 2-4 minutes on 2 shared cores (the MPI import is most of it).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import shutil
import subprocess
import sys
import tempfile

#: case -> (set-up with the hook, set-up without it, the loop). The set-ups
#: define ``c`` / ``p``; the loop runs N times inside eval.
_MPI_HOOKED = (
    "from distdiag.shim.hooks import mpi4py as hook\n"
    "hook.install(rec, None)\n"
    "from mpi4py import MPI\n"
)
CASES: dict[str, tuple[str, str, str]] = {
    "barrier": (_MPI_HOOKED + "c = MPI.COMM_SELF\n", _MPI_HOOKED + "c = hook._saved['COMM_SELF']\n", "c.Barrier()"),
    "allreduce": (_MPI_HOOKED + "c = MPI.COMM_SELF\n", _MPI_HOOKED + "c = hook._saved['COMM_SELF']\n", "c.allreduce(1)"),
    "stat": ("from distdiag.shim.hooks import fileio\nfileio.install(rec, None)\n", "", "os.stat(p)"),
    "exists": ("from distdiag.shim.hooks import fileio\nfileio.install(rec, None)\n", "", "os.path.exists(p)"),
    "open_rb": ("from distdiag.shim.hooks import fileio\nfileio.install(rec, None)\n", "", "open(p, 'rb').close()"),
    "open_text": ("from distdiag.shim.hooks import fileio\nfileio.install(rec, None)\n", "", "open(p).close()"),
}
LABELS = {
    "barrier": "mpi COMM_SELF.Barrier()",
    "allreduce": "mpi COMM_SELF.allreduce(1)",
    "stat": "os.stat(path)",
    "exists": "os.path.exists(path)",
    "open_rb": "open(path, 'rb').close()",
    "open_text": "open(path).close()",
}


def child(case: str, variant: str, n: int) -> None:
    import os  # noqa: F401  (the loop's namespace)

    from distdiag.shim.recorder import Recorder

    rec = Recorder()
    d = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    p = os.path.join(d, f"bench_instructions_{os.getpid()}")
    open(p, "wb").close()
    hooked, plain, loop = CASES[case]
    ns = {"rec": rec, "os": os, "p": p, "N": n}
    exec(hooked if variant == "hooked" else plain, ns)
    try:
        eval(compile(f"for _ in range(N):\n    {loop}\n", "loop", "exec"), ns)  # N rows: two chunks at most
    finally:
        os.unlink(p)


def _count(tree: str, case: str, variant: str, n: int, out_dir: str) -> float:
    """Instructions per loop iteration inside eval, for one (tree, case, variant)."""
    out = os.path.join(out_dir, f"cg.{abs(hash(tree))}.{case}.{variant}")
    env = dict(os.environ, PYTHONPATH=tree, PYTHONHASHSEED="0")
    cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, os.path.abspath(__file__),
           "--child", case, variant, str(n)]  # fmt: skip
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=tree)
    if p.returncode != 0:
        raise RuntimeError(f"{case}/{variant} in {tree} failed:\n{p.stderr[-2000:]}")
    ann = subprocess.run(["callgrind_annotate", "--inclusive=yes", out], capture_output=True, text=True, check=True).stdout
    for line in ann.splitlines():
        m = re.match(r"\s*([\d,]+)\s.*bltinmodule\.c:builtin_eval\b", line)
        if m:
            return int(m.group(1).replace(",", "")) / n
    raise RuntimeError(f"no builtin_eval in callgrind's report of {case}/{variant}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", help="the other source tree (a git worktree of the old commit)")
    ap.add_argument("--n", type=int, default=10000, help="calls per loop")
    ap.add_argument("--cases", default="barrier,stat", help=f"comma-separated, of {', '.join(CASES)}")
    ap.add_argument("--jobs", type=int, default=2, help="valgrind processes at once")
    ap.add_argument("--child", nargs=3, metavar=("CASE", "VARIANT", "N"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.child[0], a.child[1], int(a.child[2]))
        return 0
    if shutil.which("valgrind") is None or shutil.which("callgrind_annotate") is None:
        print("bench_instructions: valgrind not found (apt-get install valgrind)", file=sys.stderr)
        return 2
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trees = {"new": here} | ({"old": os.path.abspath(a.old)} if a.old else {})
    cases = [c for c in a.cases.split(",") if c]
    with tempfile.TemporaryDirectory() as tmp, concurrent.futures.ThreadPoolExecutor(a.jobs) as pool:
        futs = {(t, c, v): pool.submit(_count, trees[t], c, v, a.n, tmp) for t in trees for c in cases for v in ("hooked", "plain")}
        got = {k: f.result() for k, f in futs.items()}
    print(f"# instructions per call (callgrind, loop inside eval, {a.n} calls); added = hooked - plain")
    for t, path in trees.items():
        print(f"#   {t}: {path}")
    head = f"{'call':28s} {'plain':>8s}" + "".join(f" {t + ' added':>11s}" for t in trees)
    print(head + (f" {'new/old':>8s}" if "old" in trees else ""))
    for c in cases:
        plain = got[("new", c, "plain")]
        added = {t: got[(t, c, "hooked")] - got[(t, c, "plain")] for t in trees}
        row = f"{LABELS[c]:28s} {plain:8.0f}" + "".join(f" {added[t]:11.0f}" for t in trees)
        print(row + (f" {added['new'] / added['old']:8.2f}" if "old" in trees else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
