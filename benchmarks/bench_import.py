"""What the shim adds to a program's start-up imports: plain vs wrapped, side by side.

    python benchmarks/bench_import.py [--module torch] [--rounds 5]

An import storm (``import torch``: ~17k stats/opens, ~2000 modules) is the
heaviest file-I/O load most jobs put on the fileio hook, and every rank pays
it. Each round runs three fresh interpreters, in alternating order:

* ``plain``    ``python -c "import MOD"``
* ``fileio=0`` ``distdiag-wrap python -c "import MOD"`` with ``DISTDIAG_HOOKS=fileio=0``
* ``fileio=1`` ``distdiag-wrap python -c "import MOD"`` (every hook on)

and reads each child's user+system CPU time from ``resource.getrusage``
(``RUSAGE_CHILDREN`` deltas): on a shared 2-core machine wall-clock measures
the neighbours. The table shows the best (minimum) of the rounds and the
medians; ``fileio=1 - fileio=0`` is what the file-I/O hook costs, divided by
the rows it recorded for a per-event figure.

``--inproc`` times only the import itself, on the importing thread's CPU clock
(``time.thread_time_ns``), in fresh interpreters alternating between no hook
and the file-I/O hook installed into a bare Recorder (no writer thread, no
other hook): interpreter start-up and the wrapper's own set-up drop out, which
makes the hook's share far steadier than whole-process figures.

``--synthetic`` builds the same shape without torch: a package tree whose
imports nest ``--depth`` levels deep (each module imports ``--fanout``
children), compiled to .pyc first, imported ``--reps`` times under fresh
names in each child; the best repetition per child, alternating hook off /
on (/ on from ``--compare``): per-row figures that a loaded machine moves far
less than a 2-second import.
"""

from __future__ import annotations

import argparse
import glob
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable


def cpu_s_of(cmd: list[str], env: dict[str, str], timeout_s: float) -> float:
    """User + system CPU seconds of one child process (waited for)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(cmd, env=env, check=True, timeout=timeout_s, stdout=subprocess.DEVNULL)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def file_rows(run_dir: str) -> int:
    import h5py
    import numpy as np

    from distdiag.schema import FILE_KINDS

    n = 0
    for p in glob.glob(os.path.join(run_dir, "rank-*.h5")):
        with h5py.File(p, "r") as f:
            k = f["events"]["kind"]
            n += int(np.isin(k, sorted(FILE_KINDS)).sum())
    return n


def child(module: str, hooked: bool) -> None:
    """Import ``module`` (with the file-I/O hook or not); print CPU ns and rows."""
    import importlib
    import time

    rec = None
    if hooked:
        from distdiag.shim.hooks import fileio
        from distdiag.shim.recorder import Recorder

        rec = Recorder()
        fileio.install(rec)
    t0 = time.thread_time_ns()
    importlib.import_module(module)
    dt = time.thread_time_ns() - t0
    rows = 0 if rec is None else sum(tb.n for tb in rec.buffers) + sum(n for _, n in rec.full)
    print(dt, rows)


def make_tree(root: str, name: str, depth: int, fanout: int) -> int:
    """Package ``name`` under ``root``: modules nest ``depth`` imports deep; returns the module count."""
    pkg = os.path.join(root, name)
    os.makedirs(pkg, exist_ok=True)
    count = 0

    def mod(path: str, level: int) -> None:
        nonlocal count
        count += 1
        kids = [f"{path}_{i}" for i in range(fanout)] if level < depth else []
        body = "".join(f"from . import {k}\n" for k in kids) + "X = 1\n"
        with open(os.path.join(pkg, path + ".py"), "w") as f:
            f.write(body)
        for k in kids:
            mod(k, level + 1)

    with open(os.path.join(pkg, "__init__.py"), "w") as f:
        f.write("from . import m\n")
    mod("m", 1)
    import compileall

    compileall.compile_dir(pkg, quiet=1)
    return count


def synthetic_child(a: argparse.Namespace, hooked: bool) -> None:
    import importlib
    import time

    rec = None
    if hooked:
        from distdiag.shim.hooks import fileio
        from distdiag.shim.recorder import Recorder

        rec = Recorder(max_pending_chunks=1 << 20)
        fileio.install(rec)
    root = a.root
    sys.path.insert(0, root)
    best = float("inf")
    rows = 0
    for r in range(a.reps):
        before = 0 if rec is None else sum(tb.n for tb in rec.buffers) + sum(n for _, n in rec.full)
        t0 = time.thread_time_ns()
        importlib.import_module(f"p{r}")
        dt = time.thread_time_ns() - t0
        after = 0 if rec is None else sum(tb.n for tb in rec.buffers) + sum(n for _, n in rec.full)
        best = min(best, dt)
        rows = after - before
    print(best, rows)


def synthetic(a: argparse.Namespace) -> int:
    tmp = tempfile.mkdtemp(prefix="bench_import_tree_")
    try:
        mods = 0
        for r in range(a.reps):
            mods = make_tree(tmp, f"p{r}", a.depth, a.fanout)
        res, rows = alternate(a, lambda hook: ["--synthetic-child", hook, "--root", tmp, "--reps", str(a.reps)])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"synthetic import tree: {mods} modules, imports nested {a.depth} deep, {rows} rows per import; "
          f"best of {a.reps} imports per child, {a.rounds} children each, load {os.getloadavg()[0]:.1f}")
    print(f"{'hook':10} {'best ms':>8} {'median':>8} {'us/row':>8}")
    off = min(res["off"])
    for k, v in res.items():
        extra = "" if k == "off" else f" {(min(v) - off) / max(rows, 1) * 1e6:8.2f}"
        print(f"{k:10} {min(v) * 1e3:8.2f} {statistics.median(v) * 1e3:8.2f}{extra}")
    return 0


def alternate(a: argparse.Namespace, child_args: Callable[[str], list[str]]) -> tuple[dict[str, list[float]], int]:
    """Run this script's child (``child_args(hook)``) hook off / on / on with ``--compare``'s tree,
    alternating the order every round; per variant the child's CPU seconds, and the most rows seen."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTDIAG_")}
    names = ["off", "on"] + (["on@compare"] if a.compare else [])
    res: dict[str, list[float]] = {k: [] for k in names}
    rows = 0
    for r in range(a.rounds):
        for name in names if r % 2 == 0 else reversed(names):
            e = dict(env, PYTHONPATH=a.compare) if name == "on@compare" else env
            out = subprocess.run([sys.executable, __file__, *child_args(name.split("@")[0])],
                                 env=e, check=True, timeout=a.timeout_s, capture_output=True, text=True).stdout.split()  # fmt: skip
            res[name].append(int(out[0]) / 1e9)
            rows = max(rows, int(out[1]))
    return res, rows


def inproc(a: argparse.Namespace) -> int:
    res, rows = alternate(a, lambda hook: ["--child", hook, "--module", a.module])
    print(f"import {a.module} in-process: importing thread's CPU s, {a.rounds} rounds, load {os.getloadavg()[0]:.1f}")
    print(f"{'hook':10} {'best':>8} {'median':>8}")
    for k, v in res.items():
        print(f"{k:10} {min(v):8.3f} {statistics.median(v):8.3f}")
    best = min(res["on"]) - min(res["off"])
    med = statistics.median(res["on"]) - statistics.median(res["off"])
    print(f"fileio hook: +{best:.3f} s best, +{med:.3f} s median; {rows} rows -> "
          f"{best / max(rows, 1) * 1e6:.2f} us/row (best), {med / max(rows, 1) * 1e6:.2f} (median)")
    if a.compare:
        best = min(res["on@compare"]) - min(res["off"])
        med = statistics.median(res["on@compare"]) - statistics.median(res["off"])
        print(f"  compare: +{best:.3f} s best, +{med:.3f} s median (distdiag from {a.compare})")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--module", default="torch")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--timeout-s", type=float, default=120.0)
    ap.add_argument("--inproc", action="store_true", help="time the import alone, in-process (see above)")
    ap.add_argument("--compare", help="--inproc: also run the hook from this PYTHONPATH (another checkout)")
    ap.add_argument("--synthetic", action="store_true", help="a generated package tree instead of MODULE")
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--fanout", type=int, default=2)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--child", choices=("off", "on"), help=argparse.SUPPRESS)
    ap.add_argument("--synthetic-child", choices=("off", "on"), help=argparse.SUPPRESS)
    ap.add_argument("--root", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.module, a.child == "on")
        return 0
    if a.synthetic_child:
        synthetic_child(a, a.synthetic_child == "on")
        return 0
    if a.synthetic:
        return synthetic(a)
    if a.inproc:
        return inproc(a)
    wrap = shutil.which("distdiag-wrap") or ""
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("DISTDIAG_")}
    tmp = tempfile.mkdtemp(prefix="bench_import_")
    code = f"import {a.module}"
    variants = {
        "plain": ([sys.executable, "-c", code], {}),
        "fileio=0": ([sys.executable, wrap, "--dir", "{d}", sys.executable, "-c", code], {"DISTDIAG_HOOKS": "fileio=0"}),
        "fileio=1": ([sys.executable, wrap, "--dir", "{d}", sys.executable, "-c", code], {}),
    }
    res: dict[str, list[float]] = {k: [] for k in variants}
    rows = 0
    try:
        for r in range(a.rounds):
            order = list(variants) if r % 2 == 0 else list(reversed(variants))
            for name in order:
                cmd, extra = variants[name]
                d = os.path.join(tmp, f"{name}-{r}")
                res[name].append(cpu_s_of([c.replace("{d}", d) for c in cmd], {**base_env, **extra}, a.timeout_s))
                if name == "fileio=1" and r == 0:
                    rows = file_rows(d)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"import {a.module}: CPU s (user+sys) per interpreter, {a.rounds} rounds, load {os.getloadavg()[0]:.1f}")
    print(f"{'variant':10} {'best':>8} {'median':>8}")
    for k, v in res.items():
        print(f"{k:10} {min(v):8.3f} {statistics.median(v):8.3f}")
    hook_best = min(res["fileio=1"]) - min(res["fileio=0"])
    hook_med = statistics.median(res["fileio=1"]) - statistics.median(res["fileio=0"])
    print(f"fileio hook: +{hook_best:.3f} s best, +{hook_med:.3f} s median; {rows} file rows"
          + (f" -> {hook_best / rows * 1e6:.1f} us/row (best)" if rows else ""))
    print(f"whole shim:  +{min(res['fileio=1']) - min(res['plain']):.3f} s best over plain")
    return 0


if __name__ == "__main__":
    sys.exit(main())
