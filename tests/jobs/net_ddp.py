"""A small DDP (gloo) training job for the network tests: one rank per node.

`python net_ddp.py STEPS WIDTH`: a WIDTH x WIDTH linear layer, so every step's
gradient all-reduce moves ~4*WIDTH^2 bytes; compute is tiny, so on a slow link
the all-reduce dominates. Prints `rank=R step_s=<mean>` at the end, and rank 0
the loop's wall-clock, `loop <s> s` (a barrier before the loop to the one after
it): a test compares a cost with what the same job saves on an unthrottled
network (tests/truth.py).
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    width = int(sys.argv[2]) if len(sys.argv) > 2 else 512
    torch.manual_seed(0)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = DDP(torch.nn.Linear(width, width))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(32, width)
    times = []
    dist.barrier()
    t_loop = time.perf_counter()
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    dist.barrier()
    loop_s = time.perf_counter() - t_loop
    dist.destroy_process_group()
    print(f"rank={rank} host={os.environ.get('DISTDIAG_HOST', '')} step_s={sum(times) / len(times):.4f}", flush=True)
    if rank == 0:
        print(f"net_ddp: {steps} steps, loop {loop_s:.4f} s", flush=True)


if __name__ == "__main__":
    main()
