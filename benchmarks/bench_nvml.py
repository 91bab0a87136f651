"""Cost of one NVML sample (all metrics of one GPU) in distdiag's sampler.

    python benchmarks/bench_nvml.py [--gpus 1,8] [--n 2000]

Runs against the real nvidia-ml-py when a GPU answers; otherwise against the
FAKE module in tests/fake_pynvml (this prints which). With the fake, the figure
is the sampler's own Python cost per sample (building the row, the calls'
overhead), not the driver's: real NVML queries add their own time (typically
tens of µs each). Side by side: a bare loop of the same length.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

FAKE_DIR = Path(__file__).resolve().parent.parent / "tests" / "fake_pynvml"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpus", default="1,8")
    ap.add_argument("--n", type=int, default=2000)
    args = ap.parse_args()
    real = False
    try:
        import pynvml

        pynvml.nvmlInit()
        real = True
    except Exception:
        for m in [m for m in sys.modules if m == "pynvml"]:
            del sys.modules[m]
        sys.path.insert(0, str(FAKE_DIR))
        import pynvml  # noqa: F811  (the FAKE module)

    from distdiag.shim.hooks.nvml import Sampler

    print(f"NVML: {'real nvidia-ml-py' if real else 'FAKE module (tests/fake_pynvml): sampler overhead only'}")
    print(f"{'gpus':>5} {'bare loop ns':>13} {'per sample µs':>14} {'per GPU µs':>11}")
    for g in (int(x) for x in args.gpus.split(",")):
        if not real:
            os.environ["FAKE_NVML_GPUS"] = str(g)
            pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
        if g > count:
            print(f"{g:>5} (only {count} GPUs)")
            continue
        s = Sampler(pynvml, list(range(g)), 1.0, lambda rows: None)
        s.sample()
        t0 = time.perf_counter_ns()
        for _ in range(args.n):
            pass
        bare = (time.perf_counter_ns() - t0) / args.n
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter_ns()
            for _ in range(args.n):
                s.sample()
            best = min(best, (time.perf_counter_ns() - t0) / args.n)
        print(f"{g:>5} {bare:>13.0f} {best / 1e3:>14.1f} {best / 1e3 / g:>11.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
