"""A small FSDP2 (``fully_shard``) training job on gloo/CPU for the FSDP capture test.

`python torch_fsdp.py --out DIR [--steps N] [--width W] [--big-rank R --big-batch B]`:
two WxW linear layers, each its own FSDP unit, then the root. Every rank
trains on batches of 64 rows, rank R on B (an uneven data split: a real
straggler, slower at the work every rank does, so the others wait for it at
the all-gathers and reduce-scatters inside forward and backward). Writes
DIR/rank<R>.json with the final loss and the rank's seconds per step.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--big-rank", type=int, default=-1)
    ap.add_argument("--big-batch", type=int, default=64)
    a = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    w = a.width
    model = torch.nn.Sequential(torch.nn.Linear(w, w), torch.nn.ReLU(), torch.nn.Linear(w, w))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(a.big_batch if rank == a.big_rank else 64, w)
    loss = torch.zeros(())
    t0 = time.perf_counter()
    for _ in range(a.steps):
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
    step_s = (time.perf_counter() - t0) / a.steps
    dist.barrier()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps({"loss": float(loss.detach()), "step_s": step_s}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
