"""A gloo training loop on a FAKE GPU (tests/fake_cuda): kernels are sleeps on a device thread.

Runs under ``torchrun`` (through ``distdiag.wrap`` or not). Per step: a DataLoader
batch (``--loader-ms`` of sleep in ``__getitem__``: a slow loader), a forward
that queues ``--fwd-ms`` of fake kernels, a backward that queues ``--bwd-ms``,
a blocking ``all_reduce`` (gloo on the CPU; on the fake GPU a rendezvous of
every rank's device thread, as NCCL's kernel), the optimizer step, then
``fake_cuda.synchronize()`` (as ``loss.item()`` would). On ``--slow-rank`` the
kernels take ``--slow-factor`` times longer: a slow GPU, which the CPU does not
see, since launches return at once.

Each rank writes ``--out/rank<r>.json``: the loop's wall-clock (barrier to
barrier) and the fake device's true busy intervals by kind (the truth the
GPU breakdown is compared with).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fake_cuda"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import fake_cuda  # noqa: E402  (a FAKE torch.cuda: see its docstring)

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--iters", type=int, default=20)
ap.add_argument("--loader-ms", type=float, default=0.0)
ap.add_argument("--fwd-ms", type=float, default=10.0)
ap.add_argument("--bwd-ms", type=float, default=10.0)
ap.add_argument("--slow-rank", type=int, default=-1)
ap.add_argument("--slow-factor", type=float, default=1.0)
ap.add_argument("--ddp", action="store_true", help="wrap the model in DDP (buckets through the comm hook: DISTDIAG_DDP_KERNEL=0)")
ap.add_argument("--async-op", action="store_true", help="all_reduce(async_op=True) and wait()")
ap.add_argument("--flops", type=float, default=0.0, help="distdiag.step(flops=...) each step")
ap.add_argument("--no-sync", action="store_true", help="no synchronize() a step: the GPU runs on while the CPU loads")
ns = ap.parse_args()

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
fake_cuda.install()
factor = ns.slow_factor if rank == ns.slow_rank else 1.0
truth: dict[str, list[tuple[int, int]]] = {"kernels": [], "nccl": []}


def timed_kernel(ms: float, what: str) -> None:
    """A fake kernel whose true device interval is kept for the truth."""
    s = ms / 1000.0

    def run() -> None:
        a = time.perf_counter_ns()
        time.sleep(s)
        truth[what].append((a, time.perf_counter_ns()))

    fake_cuda.current_stream().put(run)


class Kern(torch.autograd.Function):
    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        timed_kernel(ns.fwd_ms * factor, "kernels")
        return x * 1.0

    @staticmethod
    def backward(ctx: object, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        timed_kernel(ns.bwd_ms * factor, "kernels")
        return g


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Kern.apply(x * self.w)


class Slow(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return ns.iters

    def __getitem__(self, i: int) -> torch.Tensor:
        if ns.loader_ms:
            time.sleep(ns.loader_ms / 1000.0)
        return torch.ones(8)


model: torch.nn.Module = Model()
if ns.ddp:
    model = torch.nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(model.parameters(), lr=0.0)
loader = torch.utils.data.DataLoader(Slow(), batch_size=None, num_workers=0)
grad = torch.ones(1024)
dist.barrier()
t0 = time.perf_counter()
for x in loader:
    loss = model(x).sum()
    loss.backward()
    if ns.async_op:
        dist.all_reduce(grad, async_op=True).wait()
    else:
        dist.all_reduce(grad)
    opt.step()
    opt.zero_grad()
    if not ns.no_sync:
        fake_cuda.synchronize()
    if ns.flops:
        import distdiag

        distdiag.step(flops=ns.flops)
fake_cuda.synchronize()
dist.barrier()
loop_s = time.perf_counter() - t0
os.makedirs(ns.out, exist_ok=True)
with open(os.path.join(ns.out, f"rank{rank}.json"), "w") as f:
    json.dump({"loop_s": loop_s, "truth": truth, "query_threads": sorted(fake_cuda.query_threads),
               "foreign_syncs": fake_cuda.foreign_syncs}, f)
dist.destroy_process_group()
