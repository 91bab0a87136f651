"""Cost of the per-rank breakdown with exposed DDP bucket time, and of the per-step breakdown, side by side.

    python benchmarks/bench_breakdown.py [--ranks 16] [--steps 20000] [--reps 3] [--baseline REV] [--mpi]

A synthetic DDP run (vectorized, written through the shim's writer): per rank
and step a loader wait, forward, backward with 3 gradient buckets (COLL_ASYNC,
completing after the last rank launched them), optimizer, STEP: 8 rows a
step. Timed on the same aligned run, in alternating blocks, CPU time
(``time.process_time``; this machine is shared): the breakdown of ``--baseline``
(default: the commit before exposed/per-step, loaded with ``git show``), the
breakdown now (per rank and, from the same intervals, per step), ``step_breakdown``
alone (its cache cleared: what a run without ``breakdown()`` pays) and ``per_step_json``;
each with its extra peak RSS per event over what was resident before it (the
high-water mark reset through ``/proc/self/clear_refs``; the smallest of the reps).
``--mpi``: instead, the MPI run of ``tests/factories.make_run`` (an all-reduce and
a file read per iteration, no async collective, no STEP row): what the new
rules cost a job that has nothing for them.

Measured (2-core machine at load 4-6, ``--baseline 8f3430c``, best of 3, CPU
s and extra peak per event): bands of ranks, rows ordered by rank once
(radix), in-place clipping: DDP 16 x 20k (2.56 M events) breakdown 1.42-2.00
-> 0.88-0.94 s, +143-179 -> +44 B/event (the per-step table and its tallies,
~20 B/event, are part of that); ``step_breakdown`` alone 0.72 s. ``--mpi``
(0.64 M events, one band): 0.31 -> 0.22 s, peak unchanged (one band is the
whole run below ``distdiag.bands.BAND_EVENTS``).

Then (issue 10, ``--baseline 1f4f854``, best of 3, load 4-7): members read
from each band's own event rows, unions that skip sorted sorts, rows of a kind
from the run's kind index, per_step computed once per per_step_json. DDP
16 x 20k: breakdown 0.70-1.07 -> 0.48-0.82 s (0.69-0.77x; the per-step cut of
each part is now its largest cost), peak unchanged (+42 B/event), per_step_json
0.16 -> 0.08-0.12 s; ``--mpi``: 0.36x. Same tables (tests/test_breakdown_members.py,
tests/test_breakdown_bands.py) and a byte-identical JSON report.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np

from distdiag.breakdown import breakdown, per_step_json, step_breakdown
from distdiag.clocks import align
from distdiag.match import collectives_of
from distdiag.run import load_run
from distdiag.schema import EVENT_DTYPE, Kind
from distdiag.shim.writer import write_rank_file

MS = 1_000_000
REPO = Path(__file__).resolve().parent.parent


def write_ddp_run(run_dir: Path, ranks: int, steps: int, seed: int = 0) -> int:
    """Write the run; return its event count."""
    rng = np.random.default_rng(seed)
    strings = ["", "DataLoader.__next__", "Net", "Tensor.backward", "SGD", "optimizer_step", "ddp_bucket_allreduce",
               "ddp0:default"]  # fmt: skip
    comp = rng.uniform(8, 12, (ranks, steps)) * MS  # backward compute per rank and step
    launch = np.stack([0.4, 0.7, 1.0])[None, None, :] * comp[:, :, None]  # 3 buckets, the last at the end
    done = launch.max(axis=0) + 1.5 * MS  # completes once the last rank launched it: (steps, 3)
    bwd_len = np.maximum(comp, done[None, :, 2] - 0)  # finalize waits for the last bucket
    step_len = (1 + 3) * MS + bwd_len.max(axis=0) + 1 * MS  # every rank leaves the step together
    t_step = (200 * MS + np.concatenate([[0], np.cumsum(step_len)[:-1]])).astype(np.int64)  # (steps,)
    n = 0
    run_dir.mkdir(parents=True, exist_ok=True)
    for r in range(ranks):  # one file per rank
        t = t_step
        b0 = t + 4 * MS
        b1 = (b0 + np.maximum(comp[r], done[:, 2])).astype(np.int64)
        rows = np.zeros((steps, 8), EVENT_DTYPE)
        spec = [(t, t + 1 * MS, Kind.INPUT_WAIT, 1), (t + 1 * MS, b0, Kind.FORWARD, 2), (b0, b1, Kind.BACKWARD, 3)]
        for k in range(3):  # three buckets
            spec.append((b0 + launch[r, :, k].astype(np.int64), b0 + done[:, k].astype(np.int64), Kind.COLL_ASYNC, 6))
        spec += [(b1, b1 + 1 * MS, Kind.OPTIMIZER, 4), (b1 + 1 * MS, b1 + 1 * MS, Kind.STEP, 5)]
        for j, (a, z, kind, name) in enumerate(spec):  # 8 columns of rows
            rows[:, j]["t0_ns"] = a
            rows[:, j]["t1_ns"] = z
            rows[:, j]["kind"] = int(kind)
            rows[:, j]["name_id"] = name
            rows[:, j]["seq"] = -1
        for k in range(3):
            rows[:, 3 + k]["comm_id"] = 7
            rows[:, 3 + k]["seq"] = np.arange(steps) * 3 + k
        ev = rows.reshape(-1)
        ev = ev[np.argsort(ev["t0_ns"], kind="stable")]
        n += len(ev)
        end = int(ev["t1_ns"].max()) + 10 * MS
        attrs = {"rank": r, "world_size": ranks, "host": f"n{r // 8}", "job_id": "bench", "launch_id": "bench",
                 "wall_ns_at_start": 1_700_000_000 * 10**9, "mono_ns_at_start": 0, "end_mono_ns": end}  # fmt: skip
        write_rank_file(run_dir / f"rank-{r:05d}.h5", attrs, ev, strings)
    return n


def _vm(key: str) -> int:
    """A ``/proc/self/status`` figure in bytes (-1 where there is none)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith(key + ":"))
    except (OSError, StopIteration):
        return -1


def _reset_peak() -> int:
    """Reset the peak RSS to the current RSS (``/proc/self/clear_refs``); return the current RSS.

    Freed memory the allocator still holds is handed back first (``malloc_trim``),
    else a stage's temporaries can fit in what the stage before it freed and read as 0.
    """
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return 1 << 62  # no figure: the peak prints as nothing (peak - this is hugely negative)
    return _vm("VmRSS")


def _peak() -> int:
    return _vm("VmHWM")


def _baseline(rev: str) -> types.ModuleType | None:
    try:
        src = subprocess.run(["git", "show", f"{rev}:distdiag/breakdown.py"], cwd=REPO, capture_output=True,
                             text=True, check=True).stdout  # fmt: skip
    except (OSError, subprocess.CalledProcessError) as e:
        print(f"no baseline ({e}); timing the current code only")
        return None
    mod = types.ModuleType("breakdown_baseline")
    exec(compile(src, f"{rev}:distdiag/breakdown.py", "exec"), mod.__dict__)
    return mod


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=16)
    ap.add_argument("--steps", type=int, default=20000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--baseline", default="14c896f~1")
    ap.add_argument("--mpi", action="store_true", help="time on make_run's MPI run instead of the DDP one")
    ns = ap.parse_args(argv)
    base = _baseline(ns.baseline)
    with tempfile.TemporaryDirectory() as tmp:
        if ns.mpi:
            sys.path.insert(0, str(REPO / "tests"))
            from factories import make_run

            make_run(Path(tmp) / "run", world_size=ns.ranks, iters=ns.steps, io_ms=0.1, slow_rank=1, slow_ms=1.0)
            n = ns.ranks * ns.steps * 2
        else:
            n = write_ddp_run(Path(tmp) / "run", ns.ranks, ns.steps)
        run = align(load_run(Path(tmp) / "run"))
        colls = collectives_of(run)
        print(f"run: {ns.ranks} ranks x {ns.steps} steps = {n:,} events")

        def step_once() -> None:
            run.cache.step_breakdown = None
            step_breakdown(run, colls)

        steps = step_breakdown(run, colls)
        stages = [("breakdown now (+steps)", lambda: breakdown(run, colls)), ("step_breakdown", step_once),
                  ("per_step_json", lambda: per_step_json(steps))]  # fmt: skip
        if base is not None:
            stages.insert(0, (f"breakdown {ns.baseline}", lambda: base.breakdown(run, colls)))
        cpu: dict[str, list[float]] = {name: [] for name, _ in stages}
        peak: dict[str, list[float]] = {name: [] for name, _ in stages}
        for _ in range(ns.reps):  # alternating blocks
            for name, fn in stages:
                r0 = _reset_peak()
                t = time.process_time()
                out = fn()
                cpu[name].append(time.process_time() - t)
                peak[name].append(_peak() - r0)
                del out
        for name, ts in cpu.items():
            best = min(ts)
            extra = f"  {min(peak[name]) / n:+6.1f} B/event peak" if min(peak[name]) > -(1 << 61) else ""
            print(f"  {name:<24} {best:7.3f} s CPU (best of {len(ts)})  {n / best / 1e6:6.2f} M events/s{extra}")
        if base is not None:
            ratio = min(cpu["breakdown now (+steps)"]) / min(cpu[f"breakdown {ns.baseline}"])
            print(f"  breakdown now / baseline: {ratio:.2f}x")
        b = breakdown(run, colls)
        print(f"  median per rank: exposed {b['comm_exposed_s'].median():.2f} s, "
              f"overlapped {b['comm_overlapped_s'].median():.2f} s of {b['wall_s'].median():.1f} s")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
