"""A 2-rank gloo job profiled by torch.profiler (no distdiag-wrap): each rank writes its Kineto trace.

Runs under ``torchrun --nproc-per-node 2``. Per step: ``--work-ms`` of matmuls, then (on
``--slow-rank`` only) ``--slow-ms`` more of matmuls, then an all-reduce; one
``prof.step()`` a step, so the trace holds ``ProfilerStep#N`` annotations. No
DataLoader: its collate (~0.3 ms a step here) would be a real input wait of a few
percent in a job this small (the loader mapping is tested on generated traces).
Rank 0 prints ``loop <s> s``: barrier to barrier, the job's own wall-clock. Every rank prints
``rank <r> sched_delay <s> s``: the time its threads waited for a core in that span (the kernel's
``run_delay``, ``/proc/self/task/*/schedstat``), which the healthy twin's check allows as noise.
"""

from __future__ import annotations

import argparse
import os
import time
import warnings

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, schedule

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--iters", type=int, default=30)
ap.add_argument("--slow-rank", type=int, default=-1)
ap.add_argument("--slow-ms", type=float, default=0.0)
ap.add_argument("--work-ms", type=float, default=10.0, help="every rank's compute a step")
ap.add_argument("--gz", action="store_true")
ns = ap.parse_args()

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
a = torch.randn(128, 128)
x = torch.ones(4096)


def run_delay_s() -> float:
    """Seconds the calling thread has waited on a run queue (0 where the kernel does not say)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


def busy(ms: float) -> None:
    """Compute (matmuls) for ``ms`` milliseconds: work that takes a core, not a sleep."""
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        a @ a


warnings.filterwarnings("ignore", message="Profiler won't be using warmup")
with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=0, warmup=0, active=ns.iters + 1)) as prof:
    dist.barrier()
    d0 = run_delay_s()
    t0 = time.perf_counter()
    for _ in range(ns.iters):
        busy(ns.work_ms)
        if rank == ns.slow_rank:
            busy(ns.slow_ms)
        dist.all_reduce(x)
        prof.step()
    dist.barrier()
    t_loop = time.perf_counter() - t0
    delay = run_delay_s() - d0
path = f"{ns.out}/rank{rank}.pt.trace.json"
prof.export_chrome_trace(path)
if ns.gz:
    import gzip
    import os

    with open(path, "rb") as f, gzip.open(path + ".gz", "wb") as g:
        g.write(f.read())
    os.unlink(path)
print(f"rank {rank} sched_delay {delay:.4f} s", flush=True)
if rank == 0:
    print(f"loop {t_loop:.4f} s", flush=True)
dist.barrier()
dist.destroy_process_group()
