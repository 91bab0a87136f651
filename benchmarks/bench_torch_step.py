"""DDP step time with and without distdiag's torch hooks, side by side in one run.

    python benchmarks/bench_torch_step.py [--nproc 4] [--width 1024] [--blocks 12] [--steps 10]
    python benchmarks/bench_torch_step.py --micro      # ns added per module call / collective, 1 process

The launcher starts itself under ``torchrun --standalone``. Every rank builds
two identical DDP models: one while the hooks are installed (it carries the
bucket-recording comm hook) and one without. It then alternates blocks of
``--steps`` training steps (DataLoader, forward, backward, SGD step): a block
on the plain model with the hooks uninstalled, a block on the hooked model
with the torch_dist and phases hooks installed and a real ``Writer`` flushing
the rows to an HDF5 file in the background, as under ``distdiag-wrap``.
Alternating blocks cancel the drift of a shared machine's load; the figure is
the ratio of the median step times (target <= 1.01).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace


def launch(args: argparse.Namespace) -> int:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
           __file__, "--worker", "--width", str(args.width), "--blocks", str(args.blocks), "--steps", str(args.steps),
           "--hooks", args.hooks] + (["--no-writer"] if args.no_writer else [])  # fmt: skip
    return subprocess.run(cmd, timeout=1800).returncode


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from distdiag.shim.config import ShimConfig
    from distdiag.shim.hooks import phases, torch_dist
    from distdiag.shim.recorder import Recorder
    from distdiag.shim.writer import Writer, base_attrs

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    tmp = Path(tempfile.mkdtemp(prefix="bench-torch-"))
    cfg = ShimConfig()
    rec = Recorder(cfg.chunk_rows, cfg.max_pending_chunks)
    writer = None
    if not args.no_writer:
        writer = Writer(tmp / f"rank-{rank:05d}.h5", rec, cfg, base_attrs(rank=rank, world_size=world))
        writer.start()
    parts = [p for p in args.hooks.split(",") if p]

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(args.width, args.width), torch.nn.ReLU(), torch.nn.Linear(args.width, args.width))

    def on() -> None:
        if "torch_dist" in parts:
            torch_dist.install(rec, cfg)
        if "phases" in parts:
            phases.install(rec, cfg)

    def off() -> None:
        torch_dist.uninstall()
        phases.uninstall()

    plain = DDP(model())
    on()
    hooked = DDP(model())
    off()
    data = torch.utils.data.TensorDataset(torch.randn(args.steps * 16, args.width), torch.randn(args.steps * 16, args.width))
    times: dict[str, list[float]] = {"without": [], "with": []}

    def block(m: torch.nn.Module, key: str, record: bool) -> None:
        opt = torch.optim.SGD(m.parameters(), lr=1e-3)
        loader = torch.utils.data.DataLoader(data, batch_size=16)
        it = iter(loader)
        for _ in range(args.steps):
            t0 = time.perf_counter()
            x, y = next(it)
            opt.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            opt.step()
            if record:
                times[key].append(time.perf_counter() - t0)

    block(plain, "without", False)  # warm-up
    on()
    block(hooked, "with", False)
    off()
    for b in range(args.blocks):
        order = (("without", plain), ("with", hooked)) if b % 2 == 0 else (("with", hooked), ("without", plain))
        for key, m in order:
            if key == "with":
                on()
            block(m, key, True)
            if key == "with":
                off()
    if writer is not None:
        writer.close(0)
    res = {k: statistics.median(v) for k, v in times.items()}
    allres = [None] * world
    dist.all_gather_object(allres, res)
    if rank == 0:
        print(f"DDP on gloo, {world} ranks, Linear {args.width}x{args.width} x2, {args.blocks} alternating blocks of {args.steps} steps;"
              f" hooks: {args.hooks}; writer: {'off' if args.no_writer else 'on'}")
        print(f"{'rank':>4} {'without ms':>11} {'with ms':>9} {'ratio':>7}")
        ratios = []
        for r, d in enumerate(allres):
            ratio = d["with"] / d["without"]
            ratios.append(ratio)
            print(f"{r:>4} {1e3 * d['without']:>11.2f} {1e3 * d['with']:>9.2f} {ratio:>7.3f}")
        print(f"median ratio with/without: {statistics.median(ratios):.3f} (target <= 1.01)")
        print(json.dumps({"median_ratio": statistics.median(ratios), "per_rank": allres}))
    dist.destroy_process_group()


def micro() -> None:
    """Per-call overhead in one process: a tiny module call and a 1-rank all_reduce."""
    import torch
    import torch.distributed as dist

    from distdiag.shim.hooks import phases, torch_dist
    from distdiag.shim.recorder import Recorder

    tmp = tempfile.mkdtemp()
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
    lin = torch.nn.Identity()
    x = torch.ones(1)
    t = torch.ones(1)
    n = 20000

    def per_call(fn, n_calls: int) -> float:  # type: ignore[no-untyped-def]
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter_ns()
            for _ in range(n_calls):
                fn()
            best = min(best, (time.perf_counter_ns() - t0) / n_calls)
        return best

    cases = [("nn.Module call (outermost)", lambda: lin(x), n), ("dist.all_reduce, 1 rank, 4 B", lambda: dist.all_reduce(t), 2000),
             ("Tensor.to(float64) with h2d_copies=on", lambda: x.to(torch.float64), n)]  # fmt: skip
    rec = Recorder()
    print(f"{'call':<40} {'without ns':>11} {'with ns':>9} {'added ns':>9}")
    for name, fn, k in cases:
        base = per_call(fn, k)
        torch_dist.install(rec)
        phases.install(rec, SimpleNamespace(h2d_copies="on"))
        wrapped = per_call(fn, k)
        torch_dist.uninstall()
        phases.uninstall()
        print(f"{name:<40} {base:>11.0f} {wrapped:>9.0f} {wrapped - base:>9.0f}")
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--blocks", type=int, default=12)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--hooks", default="torch_dist,phases", help="which hooks the 'with' blocks install")
    ap.add_argument("--no-writer", action="store_true", help="no background HDF5 writer in the 'with' blocks")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--micro", action="store_true")
    args = ap.parse_args()
    if args.micro:
        micro()
        return 0
    if args.worker or "RANK" in os.environ:
        worker(args)
        return 0
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
