"""A small DDP training job on gloo, for distdiag's PyTorch tests.

Runs under ``torchrun --nproc-per-node N`` (optionally through distdiag-wrap).
Faults are injected for real: ``--sleep-ms`` sleeps in the Dataset's
``__getitem__`` (per sample, in the training process: ``num_workers=0``, so
nothing hides it), ``--slow-rank R --slow-iters K`` makes rank R do K extra
matrix products per step before its backward. Each rank writes
``<out>/rank<r>.json`` with its losses and what it checked.

``--slow-ms X``: rank R sleeps X ms more every step, before its forward (a straggler beside the
imbalance below). ``--rotate-ms X``: rank ``step % world`` sleeps X ms more before its forward (a load imbalance
that moves between ranks); ``--spread-ms X``: every rank sleeps X / world ms more (the same
work, balanced: its twin).

``--timed``: a barrier before the loop and one after it, so each rank's
``loop_s`` is the job's loop wall-clock between two synchronizations: what a
test compares with the same job run without its fault (tests/truth.py).

``--files DIR --workers K``: each sample is also read from a file of DIR (``os.stat``, then
open and read ``sample-NNNNN.bin``: rank r reads samples ``r * steps * batch`` on), in K
DataLoader worker processes (persistent; 0: in the training process), as a dataset of
images or shards does.

``--direct DIR`` (no wrapper): the job installs distdiag's torch hooks itself
into a Recorder and writes ``DIR/rank-NNNNN.h5`` at the end with
``write_rank_file``: the hooks tested on their own, before the wrapper exists.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=10)
ap.add_argument("--batch", type=int, default=8)
ap.add_argument("--width", type=int, default=256)
ap.add_argument("--sleep-ms", type=float, default=0.0)
ap.add_argument("--slow-rank", type=int, default=-1)
ap.add_argument("--slow-iters", type=int, default=0)
ap.add_argument("--slow-ms", type=float, default=0.0, help="rank --slow-rank sleeps this much more every step")
ap.add_argument("--rotate-ms", type=float, default=0.0)
ap.add_argument("--spread-ms", type=float, default=0.0)
ap.add_argument("--user-hook", action="store_true")
ap.add_argument("--bucket-mb", type=float, default=0.0, help="DDP bucket_cap_mb (0: torch's default)")
ap.add_argument("--timed", action="store_true", help="barriers around the loop: loop_s is the job's wall-clock")
ap.add_argument("--extras", action="store_true", help="also run async collectives, p2p, object collectives, a new group")
ap.add_argument("--files", default="", help="read each sample's file from this dir (see above)")
ap.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
ap.add_argument("--out", default="")
ap.add_argument("--direct", default="")
args = ap.parse_args()

rec = None
if args.direct:
    from distdiag.shim.hooks import phases, torch_dist
    from distdiag.shim.recorder import Recorder

    rec = Recorder()
    torch_dist.install(rec)
    phases.install(rec)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)


class SleepyData(torch.utils.data.Dataset):
    def __init__(self, n: int, width: int, sleep_s: float) -> None:
        g = torch.Generator().manual_seed(1000 + rank)
        self.x = torch.randn(n, width, generator=g)
        self.y = torch.randn(n, width, generator=g)
        self.sleep_s = sleep_s
        self.slept_s = 0.0  # what the sleeps really took (the injected fault, measured)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):  # type: ignore[no-untyped-def]
        if args.files:
            p = os.path.join(args.files, f"sample-{rank * len(self.x) + i:05d}.bin")
            os.stat(p)
            with open(p, "rb") as f:
                f.read()
        if self.sleep_s:
            t = time.perf_counter()
            time.sleep(self.sleep_s)
            self.slept_s += time.perf_counter() - t
        return self.x[i], self.y[i]


model = torch.nn.Sequential(torch.nn.Linear(args.width, args.width), torch.nn.ReLU(), torch.nn.Linear(args.width, args.width))
ddp = DDP(model, bucket_cap_mb=args.bucket_mb) if args.bucket_mb else DDP(model)
hook_calls = [0]
if args.user_hook:

    # no annotations: under `from __future__ import annotations` they are strings,
    # which DDP's _check_comm_hook rejects
    def counting_allreduce(state, bucket):  # type: ignore[no-untyped-def]
        hook_calls[0] += 1
        t = bucket.buffer().div_(world)
        return dist.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0])

    ddp.register_comm_hook(None, counting_allreduce)

opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
data = SleepyData(args.steps * args.batch, args.width, args.sleep_ms / 1000.0)
loader = torch.utils.data.DataLoader(data, batch_size=args.batch, shuffle=False, num_workers=args.workers,
                                     persistent_workers=args.workers > 0)
extra = torch.randn(args.width, args.width)
losses = []
if args.timed:
    dist.barrier()
t_start = time.perf_counter()
for step, (x, y) in enumerate(loader):
    if args.rotate_ms and step % world == rank:
        time.sleep(args.rotate_ms / 1000.0)
    if args.spread_ms:
        time.sleep(args.spread_ms / 1000.0 / world)
    if rank == args.slow_rank and args.slow_ms:
        time.sleep(args.slow_ms / 1000.0)
    opt.zero_grad()
    out = ddp(x)
    if rank == args.slow_rank:
        z = extra
        for _ in range(args.slow_iters):
            z = torch.tanh(z @ extra)
        out = out + 0.0 * z.sum()
    loss = torch.nn.functional.mse_loss(out, y)
    loss.backward()
    opt.step()
    losses.append(float(loss.detach()))
if args.timed:
    dist.barrier()
t_loop = time.perf_counter() - t_start

checks: dict[str, object] = {}
if args.extras:
    t = torch.full((4,), float(rank))
    w = dist.all_reduce(t, async_op=True)
    w.wait()
    checks["async_all_reduce"] = t.tolist()
    peer = rank ^ 1
    buf = torch.full((3,), float(rank))
    if rank % 2 == 0:
        w = dist.isend(buf, peer)
    else:
        w = dist.irecv(buf, peer)
    w.wait()
    checks["p2p"] = buf.tolist()
    ops = [dist.P2POp(dist.isend, torch.full((2,), float(rank)), (rank + 1) % world),
           dist.P2POp(dist.irecv, rb := torch.zeros(2), (rank - 1) % world)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    checks["batch"] = rb.tolist()
    objs = [None] * world
    dist.all_gather_object(objs, {"rank": rank})
    checks["objects"] = objs
    g = dist.new_group([0, 1])
    if rank in (0, 1):
        t2 = torch.ones(2)
        dist.all_reduce(t2, group=g)
        checks["subgroup"] = t2.tolist()
    dist.barrier()

if rec is not None:
    import numpy as np

    from distdiag.shim import hooks as _h
    from distdiag.shim.hooks import phases, torch_dist
    from distdiag.shim.recorder import as_events
    from distdiag.shim.writer import write_rank_file

    dist.barrier()
    time.sleep(0.1)  # let future callbacks on backend threads finish
    torch_dist.uninstall()
    phases.uninstall()
    parts = [as_events(b, 0, n) for b, n in list(rec.full)] + [as_events(tb.buf, 0, tb.n) for tb in rec.buffers]
    ev = np.concatenate(parts) if parts else np.zeros(0)
    ev = ev[np.argsort(ev["t0_ns"], kind="stable")]
    os.makedirs(args.direct, exist_ok=True)
    write_rank_file(
        os.path.join(args.direct, f"rank-{rank:05d}.h5"),
        {"rank": rank, "world_size": world, "local_rank": int(os.environ.get("LOCAL_RANK", 0)), "host": "localhost",
         "job_id": "direct", "launch_id": "direct"},
        ev,
        list(rec.strings.strings),
    )

if args.out:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "losses": losses, "hook_calls": hook_calls[0], "loop_s": t_loop, "slept_s": data.slept_s,
                   "checks": checks}, f)
# every rank reaches the teardown together, and then leaves without it: twice in about nine
# full-suite runs on 2 loaded cores the *unwrapped* job's rank died in the teardown with
# SIGABRT ("terminate called without an active exception": gloo's threads), once even after
# this barrier. Its outputs are written; os._exit skips destroy_process_group and the
# interpreter's teardown (wrapped, the shim's os._exit closes the rank file as at any exit).
dist.barrier()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
