"""Analysis at scale: ranks x events -> seconds and peak RSS, and the --parallel speed-up.

    python benchmarks/bench_scale.py [--grid 64x10000,1024x1000] [--base /tmp/distdiag-scale]
                                     [--parallel 64x10000 --ks 1,2,4] [--max-events 2e7] [--shim]
                                     [--baseline /tmp/wt --repeat 2] [--stages 1024x10000]

Each run dir is written once by ``distdiag.synth`` (straggler fault, 8 ranks
per host; reused when its synth.json matches), then analyzed in a fresh child
process (``analyze`` + the JSON renderer, what ``distdiag analyze --format
json`` does), which reports its own wall seconds, CPU seconds (user + sys)
and peak RSS (``ru_maxrss``): one child per measurement, so the peaks do not
mix. On a shared machine wall time depends on the load; CPU seconds do not
(much), so both are printed, with the load average at the start.

``--parallel RxM`` runs ``mpiexec -n K distdiag analyze --parallel`` for each
K in ``--ks`` on that run and prints the speed-up over K=1 and the stage
times of analysis rank 0 (read / gather / assemble / analyze).

``--shim`` measures the shim's writer at scale first: file bytes per million
events and the flush's CPU per event, as a share of a busy rank's time.

``--baseline DIR --repeat N`` measures each size with another checkout too
(e.g. ``git worktree add /tmp/wt <old commit>``; it is put first on
PYTHONPATH, never installed), alternating A B / B A blocks in this one run,
and prints the ratios of the best CPU runs.

Sizes whose events exceed ``--max-events`` are skipped with a note: the
analyzer holds the whole run in memory (~110-120 bytes of peak RSS per event,
measured at 10^7-10^8 events), and a run that would not fit must not take the shared machine down.

Measured (issue 10, 2-core machine at load 4-12, ``--grid 256x10000,1024x10000
--baseline <worktree of 53bae35> --repeat 2``, best CPU run of each; two runs)::

    size          events      CPU s  before -> after             peak RSS  before -> after
    256 x 10k     2.56 M       7.4 -> 5.4 (1.37x); 8.9 -> 7.2 (1.23x)     ~730 -> ~720 MB
    1024 x 10k   10.27 M      37.9 -> 26.4 (1.44x); 40.9 -> 30.9 (1.32x)  2837-2974 -> 2546-2567 MB (1.17-1.20x)
                                                                          ~285 -> 248 B/event

``--stages RxM`` prints each analysis stage's CPU seconds and peak RSS
(the high-water mark reset through ``/proc/self/clear_refs`` before each
stage) in a fresh child, for this tree and the ``--baseline`` one; with
``--repeat N`` the children alternate (A B, B A, ...) and the best CPU and
transient of each stage per tree are printed side by side.

Per stage at 1024 x 10k (``--stages 1024x10000 --baseline``, one run, CPU s,
before -> after): whole analysis 40.4 -> 31.7, peak 2896 -> 2547 MB; read 7.1
-> 6.7 (~5 ms a rank file, then the rows); assemble 2.1 -> 1.3 and its +73
B/event copy gone; align 9.1 -> 4.7 with a 137 -> 58 B/event transient (in
place, one blocked gather); match 3.5 -> 0 (align's match is reused);
collective_mismatch 2.2 -> 0.05; live RSS after matching 1801 -> 1120 MB.
The peak was then distdiag.breakdown's transient (+141 B/event over the live
set, 8-9 s of CPU; not this benchmark's code); serial_section +64 B/event,
4 s; straggler 3.5-4 s. Extrapolated: 1,024 x 100,000 events would take
~250-300 s of CPU and ~25 GB (target 60 s, 4 GB): see distdiag/run.py for
what comes next.

Then breakdown by bands of ranks and serial_section's temporaries (``--stages
1024x10000 --baseline <worktree of 8f3430c>``, two runs, CPU s, before ->
after): breakdown 5.9-6.4 -> 2.0-3.2 with a +148 -> +13-16 B/event
transient; serial_section 2.6-3.1 -> 1.3-1.7, +64 -> +24-28 B/event; whole
analysis 20.4-24.2 -> 15.6-19.2 s; peak 2546 -> 1395 MB, now set by align's
+58 B/event and straggler's +28 B/event over the live set (1.1 GB after
matching, ~108 B/event).

Then cheaper per event, same JSON (issue 10, the in-memory pipeline made
cheaper; the streaming design in distdiag/run.py is still to come). Per
stage, CPU s best of 4 alternating children per tree (``--stages 1024x10000
--baseline <worktree of 58e2557> --repeat 4``), three such runs at load 1-2::

    stage            CPU s before -> after           transient over the live set, B/event
    read + pack      4.5-5.7 -> 2.9-3.6              75.5 -> 75.0 (the table itself)
    assemble         0.79-1.00 -> 0.63-0.64          0.4 -> 0.4
    align            3.0-3.4 -> 2.3-2.7              58.3 -> 33.4 (28.5 of it: the match, kept)
    straggler        2.0-2.4 -> 1.05-1.15            25.9 -> 13.0
    serial_section   0.25-0.34 -> 0.18               15.9 -> 5.2
    whole analysis   13.4-16.3 -> 11.0-12.2          peak 1388 -> 1271 MB (135 -> 124 B/event)

(read: attributes and dtypes through h5py's low-level API with a type cache,
~5 -> ~3.3 ms a rank file; align's transient was the collective match and
the causality check, not the time mapping: match gathers its sort keys, then
the other fields in matched order with ``take``, and the causality check
counts by blocks of groups; straggler and serial_section: member-size
temporaries by blocks of groups, radix-pass sorts.) Whole analysis (``--grid
256x10000,1024x10000 --baseline --repeat 2``, best CPU of 2, load 1.1, before
the serial_section step): 1024 x 10k 16.4 -> 12.2 s (1.35x), peak 1388 ->
1296 MB; 256 x 10k 3.8 -> 3.0 s (1.26x), 420 -> 397 MB. The peak is now
breakdown's +12 B/event over the live set (1.10-1.15 GB, ~108 B/event: the
73-byte table, 28.5 B/event of matched collectives, 4 of member gaps), then
straggler's +13 over a smaller one. Tried and left out: allocating the packed
table without numpy's huge-page advice (first touch 1.1 -> 0.7 s, but the
whole analysis only 1.02-1.03x, within the noise, through a private numpy
switch).

Then distdiag.breakdown's CPU and transient, same JSON (``--grid 1024x10000
--stages 1024x10000 --baseline <worktree of c2dfff9> --repeat 2``, two runs at
load 1.0; and the breakdown alone on the aligned run, first call in a fresh
process, 2 alternating runs per tree): breakdown 1.87-2.19 -> 1.12-1.28 s of CPU, its
transient over the live set +12.0 -> +0.4-0.5 B/event (alone: 1.89-1.96 ->
1.13-1.22 s, +13.0 -> +2.0 B/event, 2.0 of it the int32 order of the member
rows by rank). The transient was two run-wide copies (the band bounds'
``searchsorted`` copied the strided rank column and cast it to int64: 12
B/event; the rank order's int64 argsort: 6), now a binary search over the
view and a chunked sort into int32; CPU: bands of 2^16 rows (temporaries in
cache), one category lookup per event row, unions in band coordinates, the
step search within a band's marks. Whole analysis, best CPU of 2: 10.5 ->
9.3 s and 8.7 -> 8.9 s (the ~0.8 s saved is within the other stages' noise,
read + pack alone 2.5-3.0 s; the stages' sums 8.7-9.5 -> 7.8-9.3 s); peak
1269-1270 -> 1226-1231 MB (124 -> 119-120 B/event), now set by straggler's
+13 B/event. Breakdown alone at
64 x 100k 1.10 -> 0.67 s, +10.5 -> +0.2 B/event; 1024 x 1k 0.20 -> 0.11 s,
+18.5 -> +1.2.

Then the whole pipeline cheaper per event at 100k events a rank, same JSON
(byte for byte on every synth fault, 256x10k, 1024x10k and 1024x100k against
1f4f854): one kind index for the detectors (distdiag/rows.py), breakdown
members from the band's own rows, the match's arrival order by packed int64
sorts and its member gaps in member order, the clock mapping by cache
blocks, the collective rows selected in the mapping pass, rank files read
whole into a reused scratch with the table's pages faulted in by
``MADV_POPULATE_WRITE``, detectors' member-size passes cut (figures in each
module's docstring). ``--grid 1024x100000 --baseline <worktree of 1f4f854>
--repeat 2`` at load 1.0, then ``--grid 256x10000,1024x10000,64x100000``::

    size           events     CPU s before -> after (best of 2)   wall s after    peak RSS before -> after
    1024 x 100k    102.4 M    105.3 -> 45.4 (2.32x)                45.3-64.5       11,296 -> 11,244 MB
    64 x 100k        6.4 M      5.8 -> 3.2 (1.81x)                   3.0-4.0          805 -> 797 MB
    1024 x 10k      10.3 M     14.2 -> 7.8 (1.83x)                   7.6-11.0       1,226 -> 1,208 MB
    256 x 10k        2.6 M      3.8 -> 2.7 (1.38x)                   2.6-3.2          380 -> 369 MB

The slower first run of each pair read rank files the previous size had
pushed out of the page cache. Per stage at 1024 x 100k (``--stages``, one
child, CPU s, session start -> end): read + pack 18.6 -> 12.5, assemble 6.8
-> 0.3, align 25.4 -> 11.3, straggler 13.0 -> 3.4, input_bound + h2d_copy +
metadata_storm + io_bandwidth 10.4 -> 1.4 (the kind index), serial_section
2.6 -> 0.7, breakdown 16.1 -> 2.7; sum 94.4 -> 32.4. 16,384 x 10,000 (164 M events, 14.5 GB of rank
files; ``--child`` run alone under ``oom_score_adj`` 1000): completes, 176-201
s wall, 160-178 s CPU, peak RSS 18.0-18.1 GB (110 B/event); the previous stop
ran out of memory. The 4 GB target at 1024 x 100k was not met then: the live set
was the 73-byte table plus ~28.5 B/event of matched collectives.

Then streaming (issue 10, distdiag/bands.py, the "Then streaming" part of
distdiag/run.py's docstring): ``--grid 1024x100000 --max-events 2e8 --baseline
<worktree of 7e740fe> --repeat 2``, alternating, load 1: peak RSS 11,244 ->
3,575 MB, wall 31.3-32.4 -> 40.4-41.9 s, the verdict and the JSON the same;
16,384 x 10,000: 5.8 GB, 145 s. Smaller runs (under ``stream_events``, 20 M
rows) stay in memory: 1024 x 10k 1209 -> 1053 MB, 64 x 100k 797 -> 696 MB
(the compact match), CPU within the noise.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def _child(run_dir: str, parallel: bool) -> int:
    """Runs in the measured process: analyze, render, print one JSON line of figures."""
    t0 = time.perf_counter()
    if parallel:
        from mpi4py import MPI

        from distdiag.parallel import analyze_parallel

        cfg = None
        if os.environ.get("DISTDIAG_BENCH_STREAM_EVENTS"):  # --stream-events: the streamed analysis at any size
            from distdiag.config import Config

            cfg = Config(stream_events=int(os.environ["DISTDIAG_BENCH_STREAM_EVENTS"]))
        rep = analyze_parallel(run_dir, cfg)
        stages = rep.run.cache.parallel if rep is not None else None
        rank = MPI.COMM_WORLD.Get_rank()
        # every analysis rank's peak (the machine holds them all): rank 0 reports the list
        all_rss = MPI.COMM_WORLD.gather(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, root=0)
    else:
        import inspect

        from distdiag.pipeline import analyze

        # as `distdiag analyze --format json` does: a large run streams (an older tree cannot)
        kw: dict[str, Any] = {"stream": True} if "stream" in inspect.signature(analyze).parameters else {}
        rep = analyze(run_dir, **kw)
        stages, rank, all_rss = None, 0, None
    if rep is not None:
        from distdiag.render import render

        out = render(rep, "json")
        top = rep.verdict
    wall = time.perf_counter() - t0
    ru = resource.getrusage(resource.RUSAGE_SELF)
    if rank == 0:
        print(json.dumps({
            "wall_s": wall, "cpu_s": ru.ru_utime + ru.ru_stime, "rss_mb": ru.ru_maxrss / 1024,
            "verdict": None if top is None else [top.kind, top.ranks[:3], round(top.cost_s, 2)],
            "json_bytes": len(out), "stages": stages, "rss_all_mb": all_rss,
        }))  # fmt: skip
    return 0


def vm() -> tuple[float, float]:
    """(RSS, peak RSS) of this process, MB."""
    with open("/proc/self/status") as f:
        d = {ln.split(":")[0]: ln.split()[1] for ln in f if ln.startswith("Vm")}
    return int(d["VmRSS"]) / 1024, int(d["VmHWM"]) / 1024


def measured(fn: Any, *a: Any, **k: Any) -> tuple[Any, float, float, float, float]:
    """``fn(*a, **k)`` with its CPU seconds and the RSS before, after and at its own peak (MB):
    the high-water mark is reset first through ``/proc/self/clear_refs``."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak RSS to the current RSS
    except OSError:
        pass
    r0, _ = vm()
    c0 = time.process_time()
    out = fn(*a, **k)
    c = time.process_time() - c0
    r1, hwm = vm()
    return out, c, r0, r1, hwm


def _stages_child(run_dir: str) -> int:
    """Runs in the measured process: each stage of ``analyze`` + the JSON render with its
    CPU seconds and its own peak RSS (the high-water mark is reset before each stage
    through ``/proc/self/clear_refs``), printed as a table."""
    import inspect

    import numpy as np

    from distdiag import clocks, pipeline
    from distdiag import run as runmod
    from distdiag.breakdown import breakdown
    from distdiag.config import load_config
    from distdiag.detectors import load_all
    from distdiag.match import collectives_of
    from distdiag.ranking import rank_findings
    from distdiag.render import render
    from distdiag.slurm import accounting_of

    rows: list[tuple[str, float, float, float, float]] = []

    def stage(name: str, fn: Any, *a: Any, **k: Any) -> Any:
        out, c, r0, r1, hwm = measured(fn, *a, **k)
        rows.append((name, c, r0, r1, hwm))
        return out

    cfg = load_config()
    p, files = runmod.rank_files_of(run_dir)
    warnings: list[str] = []
    # an older tree (--baseline) has no packer: it read every file, then assembled a copy
    # a tree that streams (distdiag.bands) keeps the compute phases out of the table on a large run
    drop = runmod.streamed_kinds_for(run_dir, cfg.stream_events) if hasattr(runmod, "streamed_kinds_for") else ()

    def part(name: str) -> Any:  # a loader part; a tree before 2026-12 named it with a leading underscore
        return getattr(runmod, name, None) or getattr(runmod, "_" + name, None)

    Packer, capacity_rows, read_rank, RankData, assemble = (part(x) for x in ("Packer", "capacity_rows", "read_rank",
                                                                              "RankData", "assemble"))  # fmt: skip
    if Packer is None:
        packer = None
    else:
        packer = Packer(capacity_rows(files), drop=drop) if drop else Packer(capacity_rows(files))

    # a packer-aware reader reads the events straight into the packer (load_run's way)
    into = (packer,) if packer is not None and "packer" in inspect.signature(read_rank).parameters else ()

    def read() -> list:
        got = []
        for fp in files:  # one per rank file
            d = read_rank(fp, warnings, *into)
            if packer is not None and isinstance(d, RankData):
                packer.take(d)
            got.append(d)
        return got

    got = stage("read + pack", read)
    extra = (packer,) if packer is not None else ()
    run = stage("assemble", assemble, run_dir, p, files, got, warnings, *extra)
    del got, packer, extra, into  # the packer holds the buffer: a streamed run frees its collective rows later
    kw = {"inplace": True} if "inplace" in inspect.signature(clocks.align).parameters else {}
    run = stage("align", clocks.align, run, **kw)
    colls = stage("match", collectives_of, run)
    run.warnings.extend(pipeline._incomplete_warnings(run, colls))
    if hasattr(runmod, "stream_out"):  # a streamed run lets its collective rows go once matched
        run = stage("stream out", runmod.stream_out, run)
    sv = stage("slurm", accounting_of, run)
    dets = load_all()
    findings: list[Any] = []
    for name in cfg.detectors or list(dets):  # one per detector
        # what a detector is given: one Analysis (a tree before 2026-12: the run and the config)
        if len(inspect.signature(dets[name]).parameters) == 1:
            from distdiag.analysis import Analysis

            inputs: tuple[Any, ...] = (Analysis(run, colls, cfg),)
        else:
            inputs = (run, cfg)
        findings.extend(f for f in stage("det " + name, dets[name], *inputs) if np.isfinite(float(f.cost_s)))
    findings = stage("rank findings", rank_findings, findings, run, colls, cfg)
    bd = stage("breakdown", breakdown, run, colls)
    rep = pipeline.Report(run=run, findings=findings, breakdown=bd, collectives=colls, config=cfg, slurm=sv)
    stage("render json", render, rep, "json")
    n = max(1, sum(i.n_events for i in run.ranks.values()))
    print(f"{run_dir}: {n:,} events ({len(run.events):,} in the table), {sum(r[1] for r in rows):.1f} s of CPU, peak RSS {max(r[4] for r in rows):.0f} MB")
    print(f"{'stage':28s} {'cpu s':>7s} {'ns/event':>8s} {'RSS before':>10s} {'after':>7s} {'peak':>7s} {'peak-before':>11s}")
    for name, c, r0, r1, hwm in rows:  # a few dozen stages
        print(f"{name:28s} {c:7.2f} {c / n * 1e9:8.0f} {r0:10.0f} {r1:7.0f} {hwm:7.0f} {(hwm - r0) * 1048576 / n:8.1f} B/ev")
    return 0


def shim_at_scale(m: int = 1_000_000, batches: tuple[int, ...] = (16384, 100_000, 1_000_000)) -> None:
    """The shim's writer at scale: file bytes per million events and the flush cost per event.

    Rows go into a real Recorder (not timed), then a real Writer flushes them
    in batches of ``batch`` rows, as its background flusher does once per
    interval (a rank recording 100k events/s flushes 100k rows a second).
    The flush's CPU seconds per row times a rank's event rate is the share of
    that rank's time the writer takes (the flusher holds the GIL while h5py
    writes, so this share comes out of the application's time)."""
    import tempfile

    from distdiag.shim.config import ShimConfig
    from distdiag.shim.recorder import Recorder
    from distdiag.shim.writer import Writer, base_attrs

    coll = 1
    for batch in batches:  # a few batch sizes
        with tempfile.TemporaryDirectory(dir="/tmp") as d:
            rec = Recorder(chunk_rows=16384, max_pending_chunks=1 << 30)
            w = Writer(Path(d) / "rank-00000.h5", rec, ShimConfig(), base_attrs())
            cpu = wall = 0.0
            done = 0
            while done < m:  # one flush per batch, as the flusher does per interval
                k = min(batch, m - done)
                add = rec.add
                for i in range(done, done + k):  # filling the recorder is not timed
                    add(i, i + 5, coll, 1, 2, i, -1, 8)
                done += k
                c0, t0 = time.process_time(), time.perf_counter()
                w.flush()
                cpu += time.process_time() - c0
                wall += time.perf_counter() - t0
            w.close(0)
            size = (Path(d) / "rank-00000.h5").stat().st_size
        per_row_us = cpu / m * 1e6
        print(f"shim writer, flushes of {batch:>9,} rows: {size / m:.1f} B/event = {size / 1e6 * 1e6 / m:.0f} MB per "
              f"million events; flush CPU {per_row_us:.3f} µs/event (wall {wall / m * 1e6:.3f}); share of a rank "
              f"recording 10k / 100k / 1M events/s: {per_row_us * 1e4 / 1e6:.2%} / {per_row_us * 1e5 / 1e6:.2%} / "
              f"{per_row_us:.1%}", flush=True)  # fmt: skip


def _ensure_run(base: Path, ranks: int, events: int) -> tuple[Path, dict]:
    from distdiag.synth import synth

    d = base / f"{ranks}x{events}"
    meta = d / "synth.json"
    if meta.exists():
        t = json.loads(meta.read_text())
        if t["ranks"] == ranks and t["events_per_rank"] == events and t["fault"] == "straggler":
            return d, t
    if d.exists():
        shutil.rmtree(d)
    t0 = time.perf_counter()
    truth = synth(d, ranks=ranks, events=events, fault="straggler", ranks_per_host=8, seed=1)
    print(f"  wrote {ranks}x{events} ({truth.total_events:,} events, {truth.bytes_on_disk / 1e9:.2f} GB) "
          f"in {time.perf_counter() - t0:.1f} s", flush=True)  # fmt: skip
    return d, json.loads(meta.read_text())


def _measure(argv: list[str], timeout: float, tree: Path = REPO) -> dict:
    """Run ``argv`` with ``tree``'s distdiag first on the path; its last JSON line."""
    env = dict(os.environ, PYTHONPATH=str(tree) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.perf_counter()
    got = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
    outer = time.perf_counter() - t0
    if got.returncode != 0:
        return {"error": got.stderr.strip().splitlines()[-1:] or [f"rc {got.returncode}"]}
    line = [ln for ln in got.stdout.splitlines() if ln.startswith("{")][-1]
    res = dict(json.loads(line))
    res["outer_wall_s"] = outer  # with interpreter start and imports
    return res


def _size(s: str) -> tuple[int, int]:
    r, m = s.lower().split("x")
    return int(r), int(float(m))


def _print_row(label: str, res: dict) -> None:
    print(f"{label:9}{res['ranks']:>6} x {res['events']:>7,} = {res['total']:>12,} events: wall {res['wall_s']:7.1f} s, "
          f"cpu {res['cpu_s']:7.1f} s ({res['cpu_s'] / res['total'] * 1e6:.2f} µs/event), peak RSS "
          f"{res['rss_mb']:7.0f} MB ({res['rss_mb'] * 1e6 / res['total']:.0f} B/event), "
          f"verdict {res['verdict']} (load {res['load']:.1f})", flush=True)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--grid", default="16x10000,64x10000,256x10000,1024x1000,1024x10000,16x100000,64x100000")
    ap.add_argument("--base", type=Path, default=Path("/tmp/distdiag-scale"))
    ap.add_argument("--parallel", default="", help="RxM run for the --parallel speed-up")
    ap.add_argument("--stream-events", type=int, default=None,
                    help="the --parallel runs' Config.stream_events (0: stream at any size)")
    ap.add_argument("--ks", default="1,2,4")
    ap.add_argument("--max-events", type=float, default=2e7)
    ap.add_argument("--timeout", type=float, default=3000)
    ap.add_argument("--shim", action="store_true", help="also measure the shim writer at scale")
    ap.add_argument("--baseline", type=Path, help="another checkout (e.g. a git worktree of an older commit): "
                    "each size is measured with both trees, alternating, in this one run")
    ap.add_argument("--repeat", type=int, default=1, help="measurements per tree and size (alternating blocks)")
    ap.add_argument("--stages", default="", help="RxM run: CPU and peak RSS of each analysis stage (a fresh child, "
                    "also with --baseline)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--child-stages", help=argparse.SUPPRESS)
    ap.add_argument("--child-parallel", action="store_true", help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    if ns.child:
        return _child(ns.child, ns.child_parallel)
    if ns.child_stages:
        return _stages_child(ns.child_stages)

    ns.base.mkdir(parents=True, exist_ok=True)
    print(f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", flush=True)
    if ns.shim:
        shim_at_scale()
    rows = []
    for spec in [s for s in ns.grid.split(",") if s]:  # a handful of sizes
        ranks, events = _size(spec)
        if ranks * events > ns.max_events:
            print(f"{spec}: skipped ({ranks * events:.2e} events > --max-events {ns.max_events:.0e}: "
                  f"~{ranks * events * 280 / 1e9:.0f} GB of RSS)", flush=True)  # fmt: skip
            continue
        d, truth = _ensure_run(ns.base, ranks, events)
        trees = [("", REPO)] + ([("baseline ", ns.baseline.resolve())] if ns.baseline else [])
        best: dict[str, dict] = {}
        for i in range(ns.repeat):  # alternating blocks: A B, B A, ...
            for label, tree in trees if i % 2 == 0 else trees[::-1]:  # one or two trees
                res = _measure([sys.executable, __file__, "--child", str(d)], ns.timeout, tree)
                res.update(ranks=ranks, events=events, total=truth["total_events"],
                           disk_gb=truth["bytes_on_disk"] / 1e9, load=os.getloadavg()[0], tree=label)  # fmt: skip
                rows.append(res)
                if "error" in res:
                    print(f"{label}{spec}: FAILED {res['error']}", flush=True)
                    continue
                _print_row(label, res)
                if label not in best or res["cpu_s"] < best[label]["cpu_s"]:
                    best[label] = res
        if len(best) == 2:
            new, old = best[""], best["baseline "]
            print(f"{'':8}{ranks}x{events}: baseline / this tree: cpu {old['cpu_s'] / new['cpu_s']:.2f}x, "
                  f"peak RSS {old['rss_mb'] / new['rss_mb']:.2f}x (best of {ns.repeat} each)", flush=True)  # fmt: skip

    if ns.stages:
        d, _ = _ensure_run(ns.base, *_size(ns.stages))
        trees = [("", REPO)] + ([("baseline ", ns.baseline.resolve())] if ns.baseline else [])
        per: dict[str, dict[str, list[tuple[float, float]]]] = {}
        for i in range(ns.repeat):  # alternating blocks: A B, B A, ...
            for label, tree in trees if i % 2 == 0 else trees[::-1]:  # 1-2 trees
                env = dict(os.environ, PYTHONPATH=str(tree) + os.pathsep + os.environ.get("PYTHONPATH", ""))
                got = subprocess.run([sys.executable, __file__, "--child-stages", str(d)], capture_output=True,
                                     text=True, timeout=ns.timeout, env=env)  # fmt: skip
                print(f"{label or 'this tree'} ({tree}):\n{got.stdout}{got.stderr[-2000:] if got.returncode else ''}",
                      flush=True)  # fmt: skip
                for ln in got.stdout.splitlines():  # the child's table: one line per stage
                    cells = ln.split()
                    if len(cells) >= 8 and cells[-1] == "B/ev":
                        per.setdefault(label, {}).setdefault(" ".join(cells[:-7]), []).append(
                            (float(cells[-7]), float(cells[-2]))
                        )
        if len(per) == 2 and ns.repeat > 1:
            print(f"best of {ns.repeat} per tree: {'stage':26s} {'cpu s base -> this':>20s} {'+B/ev base -> this':>20s}")
            for stage_name, base_rows in per["baseline "].items():  # a few dozen stages
                new_rows = per[""].get(stage_name, [(0.0, 0.0)])
                cb, cn = min(r[0] for r in base_rows), min(r[0] for r in new_rows)
                if max(cb, cn) >= 0.05:
                    print(f"{'':21s}{stage_name:26s} {cb:9.2f} -> {cn:6.2f} {min(r[1] for r in base_rows):11.1f} -> "
                          f"{min(r[1] for r in new_rows):5.1f}", flush=True)  # fmt: skip

    if ns.parallel:
        if ns.stream_events is not None:
            os.environ["DISTDIAG_BENCH_STREAM_EVENTS"] = str(ns.stream_events)
        ranks, events = _size(ns.parallel)
        d, truth = _ensure_run(ns.base, ranks, events)
        mpiexec = shutil.which("mpiexec") or "mpiexec"
        base_wall = None
        for k in [int(x) for x in ns.ks.split(",")]:  # K = 1, 2, 4
            res = _measure([mpiexec, "-n", str(k), sys.executable, __file__, "--child", str(d), "--child-parallel"],
                           ns.timeout)  # fmt: skip
            if "error" in res:
                print(f"--parallel K={k}: FAILED {res['error']}", flush=True)
                continue
            base_wall = base_wall or res["wall_s"]
            st = res["stages"] or {}
            every = res.get("rss_all_mb") or [res["rss_mb"]]
            print(f"--parallel {ranks}x{events} K={k}: wall {res['wall_s']:.1f} s (speed-up {base_wall / res['wall_s']:.2f}), "
                  f"cpu (rank 0) {res['cpu_s']:.1f} s, rank 0: read {st.get('read_s', 0):.1f} s, "
                  f"gather {st.get('gather_s', 0):.1f} s, assemble {st.get('assemble_s', 0):.1f} s, "
                  f"analyze {st.get('analyze_s', 0):.1f} s (align+match {st.get('align_match_s', 0):.1f}, "
                  f"send jobs {st.get('send_jobs_s', 0):.1f}, slurm firsts {st.get('slurm_firsts_s', 0):.1f}, "
                  f"input costs {st.get('input_costs_s', 0):.1f}, detectors {st.get('detectors_s', 0):.1f}, "
                  f"own part {st.get('own_part_s', 0):.1f}, wait for parts {st.get('wait_parts_s', 0):.1f}, "
                  f"breakdown+report {st.get('breakdown_s', 0):.1f}), collectives held {st.get('collectives_held')} "
                  f"(match steps {st.get('match_steps')}); "
                  f"peak RSS rank 0 {res['rss_mb']:.0f} MB, all ranks {sum(every):.0f} MB "
                  f"({', '.join(f'{x:.0f}' for x in every)}), verdict {res['verdict']} "
                  f"(load {os.getloadavg()[0]:.1f})", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
