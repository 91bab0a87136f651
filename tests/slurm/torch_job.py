"""A gloo all-reduce loop that sets up torch.distributed from Slurm's variables.

Run as ``srun ... distdiag-wrap python tests/slurm/torch_job.py``. Rank and
world size come from SLURM_PROCID / SLURM_NTASKS (what a user's training
script does without torchrun); MASTER_ADDR defaults to the first node of the
allocation (``scontrol show hostnames``), MASTER_PORT must be set. Rank
``--slow-rank`` sleeps ``--delay-s`` before each all-reduce: a real straggler.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time

ap = argparse.ArgumentParser()
ap.add_argument("--iters", type=int, default=20)
ap.add_argument("--slow-rank", type=int, default=-1)
ap.add_argument("--delay-s", type=float, default=0.05)
a = ap.parse_args()

rank = int(os.environ["SLURM_PROCID"])
world = int(os.environ["SLURM_NTASKS"])
if "MASTER_ADDR" not in os.environ:
    hosts = subprocess.run(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]],
                           capture_output=True, text=True, timeout=30, check=True).stdout.split()  # fmt: skip
    os.environ["MASTER_ADDR"] = hosts[0]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

dist.init_process_group("gloo", rank=rank, world_size=world, init_method="env://")
x = torch.ones(1 << 14)
injected = 0.0
dist.barrier()
for _ in range(a.iters):
    x = torch.tanh(x * 0.5) + 1.0
    if rank == a.slow_rank:
        time.sleep(a.delay_s)
        injected += a.delay_s
    dist.all_reduce(x)
t = torch.tensor([injected])
dist.all_reduce(t)
if rank == 0:
    print(f"torch job: {world} ranks, injected delay {float(t):.3f} s on rank {a.slow_rank}", flush=True)
dist.destroy_process_group()
