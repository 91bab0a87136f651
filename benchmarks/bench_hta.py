"""distdiag vs Holistic Trace Analysis (HTA) on the same synthetic events, same machine, one run.

    python benchmarks/bench_hta.py [--ranks 64] [--events 10000] [--hta-python /tmp/hta-venv/bin/python]

1. ``distdiag.synth`` writes a straggler run (rank files, the shim's format).
2. The same events are converted to the per-rank Kineto / Chrome trace JSON that
   HTA reads (``distributedInfo.rank``, ``ProfilerStep#N`` annotations, CUDA
   runtime launches linked to GPU kernels by ``correlation``): each FORWARD
   becomes a compute kernel ("ampere_sgemm_128x64_nn") on stream 7, each
   Allreduce an NCCL kernel ("ncclKernel_AllReduce_RING_LL_Sum_float") on
   stream 20 spanning the rank's time inside the all-reduce, one ProfilerStep
   per iteration. HTA gets the TRUE timeline (the generator's clock offsets
   removed): it does no clock correction of its own, so this favours HTA.
   The conversion is not timed.
3. Each side runs in a fresh child process that reports wall, CPU and peak RSS:
   distdiag: ``analyze`` + JSON render; HTA: ``TraceAnalysis(trace_dir)``
   (parsing), ``get_potential_stragglers()`` and ``get_temporal_breakdown()``.
   Both name their straggler; the ratios are printed. CPU seconds include
   child processes (HTA parses the rank files in a process pool); peak RSS is
   the main process's, with HTA's largest pool worker printed beside it.

HTA runs from its own environment (``--hta-python``; made with
``python -m venv --system-site-packages /tmp/hta-venv && /tmp/hta-venv/bin/pip
install HolisticTraceAnalysis``) because it pulls in Jupyter and friends that
the project's environment does not need; numpy/pandas are the shared ones.
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

import numpy as np

REPO = Path(__file__).resolve().parent.parent

_HTA_CHILD = r"""
import json, resource, sys, time, logging
logging.disable(logging.WARNING)
t0 = time.perf_counter()
from hta.trace_analysis import TraceAnalysis
ta = TraceAnalysis(trace_dir=sys.argv[1])
t_parse = time.perf_counter()
stragglers = ta.get_potential_stragglers(num_candidates=1)
t_strag = time.perf_counter()
tb = ta.get_temporal_breakdown(visualize=False)
t_end = time.perf_counter()
# the breakdown's straggler: the rank that waits least (least idle + non-compute share)
col = [c for c in tb.columns if c.startswith("compute_time_pctg")]
ru = resource.getrusage(resource.RUSAGE_SELF)
ch = resource.getrusage(resource.RUSAGE_CHILDREN)  # HTA parses rank files in a process pool
print(json.dumps({"wall_s": t_end - t0, "parse_s": t_parse - t0, "straggler_s": t_strag - t_parse,
                  "breakdown_s": t_end - t_strag, "cpu_s": ru.ru_utime + ru.ru_stime + ch.ru_utime + ch.ru_stime,
                  "rss_mb": ru.ru_maxrss / 1024, "child_rss_mb": ch.ru_maxrss / 1024,
                  "stragglers": [int(s) for s in stragglers],
                  "most_compute_rank": int(tb.loc[tb[col[0]].idxmax(), "rank"]) if col else None}))
"""

_DD_CHILD = r"""
import json, resource, sys, time
t0 = time.perf_counter()
from distdiag.pipeline import analyze
from distdiag.render import render
rep = analyze(sys.argv[1])
out = render(rep, "json")
t_end = time.perf_counter()
ru = resource.getrusage(resource.RUSAGE_SELF)
ch = resource.getrusage(resource.RUSAGE_CHILDREN)
s = [f for f in rep.findings if f.kind == "straggler"]
print(json.dumps({"wall_s": t_end - t0, "cpu_s": ru.ru_utime + ru.ru_stime + ch.ru_utime + ch.ru_stime,
                  "rss_mb": ru.ru_maxrss / 1024, "child_rss_mb": ch.ru_maxrss / 1024, "stragglers": s[0].ranks if s else [], "verdict": rep.verdict.kind if rep.verdict else None}))
"""


def to_kineto(run_dir: Path, out_dir: Path) -> int:
    """Write one Kineto JSON per rank of a synthetic run; returns the number of trace events."""
    from distdiag.run import load_run
    from distdiag.schema import Kind
    from distdiag.synth import load_truth

    truth = load_truth(run_dir)
    off = np.asarray(truth["offset_ns"], np.int64)
    run = load_run(run_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    n_written = 0
    ev = run.events
    for r, sl in run.rank_slices().items():  # one file per rank
        e = ev[sl]
        e = e[np.isin(e["kind"], [Kind.FORWARD, Kind.COLL])]
        t0_us = (e["t0_ns"] + off[r]) / 1e3  # true timeline, µs as Kineto writes
        t1_us = (e["t1_ns"] + off[r]) / 1e3
        is_fw = e["kind"] == Kind.FORWARD
        parts = []
        corr = np.arange(1, len(e) + 1)
        # one ProfilerStep per iteration: from its FORWARD's start to its all-reduce's end
        fw_idx = np.flatnonzero(is_fw)
        ar_idx = np.flatnonzero(~is_fw)
        n_it = min(len(fw_idx), len(ar_idx))
        for i in range(n_it):  # per iteration: the converter is not what is measured
            a, b = t0_us[fw_idx[i]], t1_us[ar_idx[i]]
            parts.append(f'{{"ph":"X","cat":"user_annotation","name":"ProfilerStep#{i}","pid":{100 + r},"tid":1,'
                         f'"ts":{a:.3f},"dur":{b - a:.3f}}}')  # fmt: skip
        for j in range(len(e)):  # per event
            c = int(corr[j])
            name, stream = ("ampere_sgemm_128x64_nn", 7) if is_fw[j] else ("ncclKernel_AllReduce_RING_LL_Sum_float", 20)
            launch = "cudaLaunchKernel" if is_fw[j] else "ncclGroupEnd"
            ts, dur = t0_us[j], max(t1_us[j] - t0_us[j], 0.001)
            parts.append(f'{{"ph":"X","cat":"cuda_runtime","name":"{launch}","pid":{100 + r},"tid":1,'
                         f'"ts":{ts:.3f},"dur":0.5,"args":{{"correlation":{c},"cbid":211}}}}')  # fmt: skip
            parts.append(f'{{"ph":"X","cat":"kernel","name":"{name}","pid":0,"tid":{stream},"ts":{ts:.3f},'
                         f'"dur":{dur:.3f},"args":{{"stream":{stream},"device":0,"correlation":{c},'
                         f'"grid":[1,1,1],"block":[256,1,1]}}}}')  # fmt: skip
        n_written += len(parts)
        doc_head = json.dumps({
            "schemaVersion": 1,
            "distributedInfo": {"backend": "nccl", "rank": int(r), "world_size": int(truth["ranks"])},
            "deviceProperties": [{"id": 0, "name": "FAKE GPU (synthetic)", "totalGlobalMem": 85899345920}],
            "displayTimeUnit": "ms",
        })[:-1]  # fmt: skip
        with open(out_dir / f"rank-{r}.json", "w") as fh:
            fh.write(doc_head + ',"traceEvents":[' + ",".join(parts) + "]}")
    return n_written


def _child(argv: list[str], timeout: float) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    got = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
    lines = [ln for ln in got.stdout.splitlines() if ln.startswith("{")]
    if got.returncode != 0 or not lines:
        return {"error": (got.stderr.strip().splitlines() or [f"rc {got.returncode}"])[-3:]}
    return dict(json.loads(lines[-1]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--events", type=int, default=10000)
    ap.add_argument("--base", type=Path, default=Path("/tmp/distdiag-hta"))
    ap.add_argument("--hta-python", default="/tmp/hta-venv/bin/python")
    ap.add_argument("--timeout", type=float, default=3000)
    ns = ap.parse_args(argv)
    from distdiag.synth import synth

    run_dir = ns.base / f"run-{ns.ranks}x{ns.events}"
    trace_dir = ns.base / f"kineto-{ns.ranks}x{ns.events}"
    for d in (run_dir, trace_dir):
        if d.exists():
            shutil.rmtree(d)
    truth = synth(run_dir, ranks=ns.ranks, events=ns.events, fault="straggler", ranks_per_host=8, seed=1)
    t0 = time.perf_counter()
    n_trace = to_kineto(run_dir, trace_dir)
    trace_mb = sum(p.stat().st_size for p in trace_dir.iterdir()) / 1e6
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; {ns.ranks} ranks x {ns.events} events: "
          f"{truth.total_events:,} distdiag events ({truth.bytes_on_disk / 1e6:.0f} MB HDF5) = {n_trace:,} Kineto "
          f"events ({trace_mb:.0f} MB JSON, converted in {time.perf_counter() - t0:.0f} s); true straggler: rank "
          f"{truth.fault_rank}", flush=True)  # fmt: skip
    dd = _child([sys.executable, "-c", _DD_CHILD, str(run_dir)], ns.timeout)
    print(f"distdiag: {dd}", flush=True)
    hta = _child([ns.hta_python, "-c", _HTA_CHILD, str(trace_dir)], ns.timeout)
    print(f"HTA:      {hta}", flush=True)
    if "error" not in dd and "error" not in hta:
        print(f"HTA / distdiag: wall {hta['wall_s'] / dd['wall_s']:.1f}x, CPU {hta['cpu_s'] / dd['cpu_s']:.1f}x, "
              f"peak RSS {hta['rss_mb'] / dd['rss_mb']:.1f}x (HTA's largest pool worker: {hta['child_rss_mb']:.0f} MB); "
              f"straggler: distdiag {dd['stragglers']}, HTA {hta['stragglers']} (most compute in HTA's temporal "
              f"breakdown: rank {hta['most_compute_rank']}), "
              f"truth [{truth.fault_rank}]", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
