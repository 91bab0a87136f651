"""Cost of the shim's hot path, side by side in one run.

    python benchmarks/bench_recorder.py [--n 1000000] [--repeat 5]

Prints ns per call for: an empty loop (the floor), ``Recorder.add``,
``enter``/``leave`` (a blocking-call pair), the user API with and without a
session (``distdiag.step``, ``mark``, ``with phase``), and the writer's flush
throughput (rows/s into HDF5). Each figure is the best of ``--repeat`` runs;
the "added" column subtracts the empty loop.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np


def best_ns_per_call(fn: Callable[[int], None], n: int, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter_ns()
        fn(n)
        best = min(best, (time.perf_counter_ns() - t0) / n)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--launch-repeat", type=int, default=5, help="plain vs wrapped empty-script runs (0: skip)")
    args = ap.parse_args()
    n, repeat = args.n, args.repeat

    import distdiag
    from distdiag.schema import Kind
    from distdiag.shim import session
    from distdiag.shim.config import ShimConfig
    from distdiag.shim.recorder import Recorder, now_ns
    from distdiag.shim.writer import Writer, base_attrs

    # max_pending_chunks large: nobody drains here, and dropping would be cheaper than recording
    rec = Recorder(chunk_rows=16384, max_pending_chunks=1 << 30)
    name = rec.intern("Allreduce")
    COLL = int(Kind.COLL)

    def empty(n: int) -> None:
        for _ in range(n):
            pass

    def clock_only(n: int) -> None:
        for _ in range(n):
            now_ns()

    def add(n: int) -> None:
        a = rec.add
        for i in range(n):
            a(i, i, COLL, name, 0, i, -1, 8)

    def enter_leave(n: int) -> None:
        e, lv = rec.enter, rec.leave
        for i in range(n):
            e(COLL, name, 0, i, -1, 8)
            lv()

    def step(n: int) -> None:
        s = distdiag.step
        for _ in range(n):
            s(samples=32)

    def mark(n: int) -> None:
        m = distdiag.mark
        for _ in range(n):
            m("x")

    def phase(n: int) -> None:
        p = distdiag.phase
        for _ in range(n):
            with p("x"):
                pass

    rows: list[tuple[str, float]] = []
    floor = best_ns_per_call(empty, n, repeat)
    rows.append(("empty loop (floor)", floor))
    rows.append(("perf_counter_ns()", best_ns_per_call(clock_only, n, repeat)))
    rows.append(("Recorder.add", best_ns_per_call(add, n, repeat)))
    rec.full.clear()
    rows.append(("Recorder.enter+leave", best_ns_per_call(enter_leave, n, repeat)))
    rec.full.clear()
    assert session.SESSION is None
    rows.append(("distdiag.step, unwrapped", best_ns_per_call(step, n, repeat)))
    rows.append(("distdiag.mark, unwrapped", best_ns_per_call(mark, n, repeat)))
    rows.append(("with distdiag.phase, unwrapped", best_ns_per_call(phase, n, repeat)))

    class _S:
        pass

    s = _S()
    s.rec = rec  # type: ignore[attr-defined]
    session.SESSION = s  # type: ignore[assignment]
    try:
        rows.append(("distdiag.step, recording", best_ns_per_call(step, n, repeat)))
        rec.full.clear()
        rows.append(("distdiag.mark, recording", best_ns_per_call(mark, n, repeat)))
        rec.full.clear()
        rows.append(("with distdiag.phase, recording", best_ns_per_call(phase, n, repeat)))
        rec.full.clear()
    finally:
        session.SESSION = None

    # the same add loop while a real Writer flushes to disk every 0.2 s: what the
    # application thread pays per event, the flusher's GIL share included
    with tempfile.TemporaryDirectory() as d:
        rec_f = Recorder(chunk_rows=16384, max_pending_chunks=1 << 30)
        w_f = Writer(Path(d) / "bg.h5", rec_f, ShimConfig(flush_interval_s=0.2), base_attrs())
        w_f.start()

        def add_flushing(n: int) -> None:
            a = rec_f.add
            for i in range(n):
                a(i, i, COLL, name, 0, i, -1, 8)

        rows.append(("Recorder.add, flusher every 0.2 s", best_ns_per_call(add_flushing, n, repeat)))
        w_f.close(0)

    print(f"{'operation':34s} {'ns/call':>9s} {'added ns':>9s}   (n={n}, best of {repeat})")
    for label, ns in rows:
        print(f"{label:34s} {ns:9.1f} {ns - floor:9.1f}")

    # writer throughput: the flusher's cost per row into HDF5 (uncompressed)
    with tempfile.TemporaryDirectory() as d:
        rec2 = Recorder(chunk_rows=16384, max_pending_chunks=1 << 30)
        w = Writer(Path(d) / "bench.h5", rec2, ShimConfig(), base_attrs())
        m = 1_000_000
        for i in range(m):
            rec2.add(i, i, COLL, 1)
        t0 = time.perf_counter()
        w.flush()
        dt = time.perf_counter() - t0
        w.close(0)
        size = (Path(d) / "bench.h5").stat().st_size
    print(f"\nwriter flush: {m} rows in {dt * 1e3:.0f} ms = {m / dt / 1e6:.1f} M rows/s, file {size / 1e6:.1f} MB")
    launch_overhead(args.launch_repeat)
    _ = np  # numpy is imported by the shim anyway


def launch_overhead(repeat: int) -> None:
    """Start-to-exit of an empty script, plain and wrapped, alternating (best of ``repeat``)."""
    import os
    import subprocess
    import sys

    if repeat <= 0:
        return
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTDIAG_")}
    repo = str(Path(__file__).resolve().parent.parent)  # measure this checkout
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo, env.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory() as d:
        script = Path(d) / "empty.py"
        script.write_text("")
        cmds = {
            "python empty.py": [sys.executable, str(script)],
            "distdiag-wrap python empty.py": [sys.executable, "-m", "distdiag.wrap", "--dir", str(Path(d) / "run"),
                                              sys.executable, str(script)],
        }
        best = {k: float("inf") for k in cmds}
        for _ in range(repeat):
            for k, cmd in cmds.items():
                t0 = time.perf_counter()
                subprocess.run(cmd, env=env, check=True, timeout=120, capture_output=True)
                best[k] = min(best[k], time.perf_counter() - t0)
    base = best["python empty.py"]
    print("\nlaunch, start to exit (best of %d):" % repeat)
    for k, v in best.items():
        print(f"  {k:32s} {v * 1e3:7.0f} ms  (+{(v - base) * 1e3:.0f} ms)")


if __name__ == "__main__":
    main()
