"""distdiag reading Kineto traces (the files Holistic Trace Analysis reads), and HTA on the same files.

    python benchmarks/bench_kineto.py [--ranks 64] [--events 10000] [--hta-python /tmp/hta-venv/bin/python]

1. ``distdiag.kineto_synth.write_traces`` writes one GPU-shaped trace per rank
   (NCCL all-reduce kernels, compute kernels with their runtime launches,
   ``record_param_comms``, ProfilerStep; ~``--events`` trace events a rank),
   a straggler on rank 3 and clocks seconds apart (untimed).
2. A fresh child runs ``distdiag.pipeline.analyze(trace_dir)`` + the JSON render
   and reports wall, CPU, peak RSS, the part spent in ``json.loads`` (parsing
   the traces once more, alone) and the straggler it names.
3. With ``--hta-python`` (HTA in its own venv, see benchmarks/bench_hta.py), a
   fresh child runs HTA's ``TraceAnalysis`` + ``get_potential_stragglers`` +
   ``get_temporal_breakdown`` on the same dir. HTA does no clock correction: the
   traces' offsets are the generator's, so HTA reads them as written.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_hta import _HTA_CHILD  # noqa: E402

_DD_CHILD = r"""
import gzip, json, resource, sys, time
from pathlib import Path
t0 = time.perf_counter()
from distdiag.pipeline import analyze
from distdiag.render import render
rep = analyze(sys.argv[1])
out = render(rep, "json")
t_end = time.perf_counter()
ru = resource.getrusage(resource.RUSAGE_SELF)
t1 = time.perf_counter()
for p in sorted(Path(sys.argv[1]).iterdir()):
    json.loads(p.read_bytes())
t_parse = time.perf_counter() - t1
s = [f for f in rep.findings if f.kind == "straggler"]
inp = json.loads(out)["run"]["input"]
print(json.dumps({"wall_s": t_end - t0, "cpu_s": ru.ru_utime + ru.ru_stime, "rss_mb": ru.ru_maxrss / 1024,
                  "json_loads_s": t_parse, "stragglers": s[0].ranks if s else [],
                  "straggler_cost_s": s[0].cost_s if s else None, "clock_bound_ms": inp["clock_bound_ms"],
                  "verdict": rep.verdict.kind if rep.verdict else None}))
"""


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
    ap.add_argument("--base", type=Path, default=Path("/tmp/distdiag-kineto"))
    ap.add_argument("--hta-python", default="")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=3000)
    ns = ap.parse_args(argv)
    from distdiag.kineto_synth import write_traces

    trace_dir = ns.base / f"kineto-{ns.ranks}x{ns.events}"
    if trace_dir.exists():
        shutil.rmtree(trace_dir)
    kernels = 4
    steps = max(2, ns.events // (2 * kernels + 3))  # trace events a step: ProfilerStep, 2 a kernel, rpc, NCCL
    t0 = time.perf_counter()
    truth = write_traces(trace_dir, ranks=ns.ranks, steps=steps, compute_ms=20, kernels=kernels, straggler_rank=3,
                         straggler_ms=2, offsets_s=5.0)  # fmt: skip
    mb = sum(p.stat().st_size for p in trace_dir.iterdir()) / 1e6
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; {ns.ranks} ranks x {steps} steps: "
          f"{truth['events']:,} trace events ({mb:.0f} MB JSON, written in {time.perf_counter() - t0:.0f} s); "
          f"true straggler rank 3, cost {truth['straggler_cost_s']:.3f} s", flush=True)  # fmt: skip
    for _ in range(ns.repeat):
        dd = _child([sys.executable, "-c", _DD_CHILD, str(trace_dir)], ns.timeout)
        print(f"distdiag: {dd}", flush=True)
        if ns.hta_python:
            hta = _child([ns.hta_python, "-c", _HTA_CHILD, str(trace_dir)], ns.timeout)
            print(f"HTA:      {hta}", flush=True)
            if "error" not in dd and "error" not in hta:
                print(f"HTA / distdiag: wall {hta['wall_s'] / dd['wall_s']:.1f}x, CPU {hta['cpu_s'] / dd['cpu_s']:.1f}x, "
                      f"peak RSS {hta['rss_mb'] / dd['rss_mb']:.1f}x; straggler: distdiag {dd['stragglers']}, "
                      f"HTA {hta['stragglers']}, truth [3]", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
