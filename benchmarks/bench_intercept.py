"""Interception cost of the mpi4py hook: ns added per call, side by side in one run.

    mpiexec -n 2 python benchmarks/bench_intercept.py [--rounds 15] [--scale 1.0] [--python-wrappers]
    python benchmarks/bench_intercept.py --compare /tmp/old-worktree [--blocks 4] [--rounds 5] [--scale 0.5]

(Without mpiexec it re-launches itself under ``mpiexec -n 2``.)

The hook is installed before mpi4py is imported, exactly as distdiag-wrap
does; the plain communicator is the one the hook replaced. Both ranks run the
same loops, alternating plain and wrapped blocks round by round so drift in
machine load (other jobs, MPICH's busy-polling on a 2-core box) hits both
alike. For each (call, variant) we keep the per-call time of every round and
report the median and the minimum over rounds; "added" is wrapped minus plain.

Two communicators:
* ``world`` (2 ranks): the real calls; the difference includes network noise.
* ``self`` (1 rank, a ~100 ns Barrier): the shim's bookkeeping alone, precise.

``--compare TREE``: the same measurement of two source trees (this one and
TREE, e.g. a ``git worktree`` of an older commit; each imported through
PYTHONPATH, never installed) in alternating blocks of ``mpiexec -n 2`` runs
(this, TREE, TREE, this, ...), reporting rank 0's CPU ns added per call of
each: min and median over all rounds of all blocks.

The recorder's full chunks are dropped between blocks (the writer would take
them), so memory stays flat.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from typing import Any, Callable


def _relaunch() -> int:
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        print("bench_intercept: mpiexec not found (pip install mpich)", file=sys.stderr)
        return 2
    env = dict(os.environ, DISTDIAG_BENCH_CHILD="1")
    return subprocess.call([mpiexec, "-n", "2", sys.executable, *sys.argv], env=env, timeout=900)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--scale", type=float, default=1.0, help="multiply the calls per block")
    ap.add_argument("--compare", metavar="TREE", help="also measure the source tree TREE, in alternating blocks")
    ap.add_argument("--blocks", type=int, default=4, help="with --compare: mpiexec runs per tree")
    ap.add_argument("--python-wrappers", action="store_true",
                    help="the hook's Python wrappers for every call, not the C ones (distdiag/shim/_hot.c)")
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # rank 0 prints one JSON line (--compare's child)
    a = ap.parse_args()
    if a.compare:
        return _compare(a)
    if "PMI_RANK" not in os.environ and "OMPI_COMM_WORLD_RANK" not in os.environ and not os.environ.get("DISTDIAG_BENCH_CHILD"):
        return _relaunch()

    import numpy as np

    from distdiag.shim.hooks import mpi4py as hook
    from distdiag.shim.recorder import Recorder

    if a.python_wrappers:
        hook._USE_C = False
    rec = Recorder()
    hook.install(rec, None)
    from mpi4py import MPI

    wrapped_world = MPI.COMM_WORLD
    plain_world = hook._saved["COMM_WORLD"]
    wrapped_self = MPI.COMM_SELF
    plain_self = hook._saved["COMM_SELF"]
    assert type(wrapped_world) is not type(plain_world)
    rank = plain_world.Get_rank()

    mib = 1 << 20
    sbuf = np.ones(mib // 8)
    rbuf = np.empty_like(sbuf)

    def k(n: int) -> int:
        return max(1, int(n * a.scale))

    cases: list[tuple[str, Any, Any, Callable[[Any], Any], int]] = [
        ("self  Barrier()", plain_self, wrapped_self, lambda c: c.Barrier(), k(20000)),
        ("self  allreduce(1)", plain_self, wrapped_self, lambda c: c.allreduce(1), k(20000)),
        ("world Barrier()", plain_world, wrapped_world, lambda c: c.Barrier(), k(2000)),
        ("world allreduce(1)", plain_world, wrapped_world, lambda c: c.allreduce(1), k(2000)),
        ("world Allreduce 1 MiB", plain_world, wrapped_world, lambda c: c.Allreduce(sbuf, rbuf), k(100)),
    ]

    results: dict[str, dict[str, list[float]]] = {name: {"plain": [], "wrapped": []} for name, *_ in cases}
    cpu: dict[str, dict[str, list[float]]] = {name: {"plain": [], "wrapped": []} for name, *_ in cases}
    for r in range(a.rounds):
        for name, plain, wrapped, fn, n in cases:
            order = (("plain", plain), ("wrapped", wrapped)) if r % 2 == 0 else (("wrapped", wrapped), ("plain", plain))
            for variant, comm in order:
                plain_world.Barrier()  # start each block together
                # the loop calls a method on a local name, as a program would
                c0 = time.thread_time_ns()
                t0 = time.perf_counter_ns()
                for _ in range(n):
                    fn(comm)
                dt = time.perf_counter_ns() - t0
                results[name][variant].append(dt / n)
                cpu[name][variant].append((time.thread_time_ns() - c0) / n)
                rec.full.clear()  # what the writer's flusher would take

    # both ranks measure the breakdown at once (same load as the loops above); rank 0 prints it
    breakdown = _breakdown(hook, rec, plain_self, wrapped_self, max(1, int(20000 * a.scale)), a.rounds)
    # rank 0 reports; take the worse of both ranks' medians (they wait on each other)
    allres = plain_world.gather(results, root=0)
    allcpu = plain_world.gather(cpu, root=0)
    if rank != 0:
        return 0
    if a.json:
        print("BENCH_JSON " + json.dumps({"cpu": allcpu[0], "breakdown": breakdown}), flush=True)
        hook.uninstall()
        return 0
    print(f"# mpi4py hook interception cost: mpiexec -n 2, {a.rounds} rounds, per-call ns")
    print(f"# blocking calls' wrappers: {type(type(wrapped_self).Barrier).__name__} ({'C, distdiag/shim/_hot.c' if getattr(hook, '_HOT', None) is not None and hook._USE_C else 'Python'})")
    print(f"# rows recorded on rank 0: {sum(tb.n for tb in rec.buffers)} in the open chunk, lost_events={rec.lost_events}")
    print(f"# load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (other jobs inflate every figure)")
    print("# wall: perf_counter per call; cpu: this thread's CPU time per call (less sensitive to being descheduled)")
    print(f"{'call':24s} {'plain med':>10s} {'wrapped med':>12s} {'added med':>10s} {'added min':>10s} {'cpu added med':>14s} {'cpu added min':>14s}")
    for name, *_ in cases:
        pm = max(statistics.median(res[name]["plain"]) for res in allres)
        wm = max(statistics.median(res[name]["wrapped"]) for res in allres)
        pmin = min(min(res[name]["plain"]) for res in allres)
        wmin = min(min(res[name]["wrapped"]) for res in allres)
        cpm = statistics.median(allcpu[0][name]["plain"])
        cwm = statistics.median(allcpu[0][name]["wrapped"])
        cpmin, cwmin = min(allcpu[0][name]["plain"]), min(allcpu[0][name]["wrapped"])
        print(f"{name:24s} {pm:10.0f} {wm:12.0f} {wm - pm:10.0f} {wmin - pmin:10.0f} {cwm - cpm:14.0f} {cwmin - cpmin:14.0f}")
    print(_breakdown_text(breakdown, a.rounds))
    hook.uninstall()
    return 0


def _breakdown(hook: Any, rec: Any, plain: Any, wrapped: Any, n: int, rounds: int) -> dict[str, float]:
    """Where the added time of a wrapped COMM_SELF.Barrier() goes (CPU ns per call, min of rounds)."""

    def cpu_per_call(fn: Callable[[], Any]) -> float:
        best = float("inf")
        for _ in range(rounds):
            c0 = time.thread_time_ns()
            for _ in range(n):
                fn()
            best = min(best, (time.thread_time_ns() - c0) / n)
            rec.full.clear()
        return best

    empty = cpu_per_call(lambda: None)
    base = cpu_per_call(plain.Barrier)
    full = cpu_per_call(wrapped.Barrier)
    hot = getattr(hook, "_HOT", None)  # None: no C wrappers (or a tree from before them)
    hook._rec = None  # the wrapper passes straight through: what its call and check alone cost
    if hot is not None:
        hot.uninstall()  # the C wrappers' recorder
    try:
        through = cpu_per_call(wrapped.Barrier)
    finally:
        hook._rec = rec
        if hot is not None:
            hot.install(rec, hook._oops)
    enter_leave = cpu_per_call(lambda: (rec.enter(1, 2, 3, 4, -1, 0, 0, 0), rec.leave())) - empty
    site = cpu_per_call(lambda: rec.site(1)) - empty
    return {"empty": empty, "added": full - base, "pass_through": through - base, "enter_leave": enter_leave, "site": site}


def _breakdown_text(b: dict[str, float], rounds: int) -> str:
    return "\n".join(
        [
            f"# breakdown of self Barrier() (CPU ns/call, min of {rounds} rounds; an empty Python call costs {b['empty']:.0f} here):",
            f"#   added in total   {b['added']:6.0f}",
            f"#   pass-through     {b['pass_through']:6.0f}   (recorder None: the wrapper's call and check alone)",
            f"#   rec.enter+leave  {b['enter_leave']:6.0f}   (the Recorder's two-call API, as torch_dist uses it)",
            f"#   rec.site         {b['site']:6.0f}   (the caller's file:line, Recorder API)",
        ]
    )


def _compare(a: argparse.Namespace) -> int:
    """This tree and ``a.compare`` in alternating blocks of mpiexec runs; CPU ns added per call, rank 0."""
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        print("bench_intercept: mpiexec not found (pip install mpich)", file=sys.stderr)
        return 2
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trees = {"new": here, "old": os.path.abspath(a.compare)}
    cpu: dict[str, dict[str, dict[str, list[float]]]] = {t: {} for t in trees}
    brk: dict[str, list[dict[str, float]]] = {t: [] for t in trees}
    for blk in range(a.blocks):
        for label in (("new", "old") if blk % 2 == 0 else ("old", "new")):
            env = dict(os.environ, PYTHONPATH=trees[label], DISTDIAG_BENCH_CHILD="1")
            cmd = [mpiexec, "-n", "2", sys.executable, os.path.abspath(__file__), "--json",
                   "--rounds", str(a.rounds), "--scale", str(a.scale)] + (["--python-wrappers"] if a.python_wrappers else [])  # fmt: skip
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=trees[label])
            line = next((ln for ln in p.stdout.splitlines() if ln.startswith("BENCH_JSON ")), None)
            if p.returncode != 0 or line is None:
                print(f"bench_intercept: the {label} run failed:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}", file=sys.stderr)
                return 1
            got = json.loads(line.split(" ", 1)[1])
            for case, d in got["cpu"].items():
                for variant, xs in d.items():
                    cpu[label].setdefault(case, {}).setdefault(variant, []).extend(xs)
            brk[label].append(got["breakdown"])
    n_rounds = a.blocks * a.rounds
    print(f"# mpi4py hook, CPU ns added per call on rank 0 (wrapped - plain): old = {trees['old']}, new = {trees['new']}")
    print(f"# {a.blocks} mpiexec -n 2 runs per tree, alternating; {n_rounds} rounds each; "
          f"load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")  # fmt: skip
    print(f"{'call':24s} {'old min':>9s} {'new min':>9s} {'old med':>9s} {'new med':>9s}")
    for case in cpu["new"]:
        row = []
        for stat in (min, statistics.median):
            for label in ("old", "new"):
                d = cpu[label][case]
                row.append(stat(d["wrapped"]) - stat(d["plain"]))
        print(f"{case:24s} {row[0]:9.0f} {row[1]:9.0f} {row[2]:9.0f} {row[3]:9.0f}")
    print("# breakdown of self Barrier() (CPU ns/call, best block of each tree):")
    for key in ("added", "pass_through", "enter_leave", "site"):
        o = min(b[key] for b in brk["old"])
        n = min(b[key] for b in brk["new"])
        print(f"#   {key:14s} old {o:6.0f}   new {n:6.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
