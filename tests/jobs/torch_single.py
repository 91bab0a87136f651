"""One process, a 1-rank gloo group: drives distdiag's torch hooks directly on a Recorder.

Prints one JSON object with what the hooks recorded and whether uninstall
restored every patched attribute. ``sys.argv[1]`` is a scratch directory.
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.utils.data.dataloader as dl
from torch.nn.parallel import DistributedDataParallel as DDP

from distdiag.schema import Kind
from distdiag.shim.hooks import phases, torch_dist
from distdiag.shim.recorder import Recorder, as_events

scratch = sys.argv[1]
PATCHED = [
    (dist, "all_reduce"), (c10d, "all_reduce"), (dist, "isend"), (dist, "batch_isend_irecv"), (c10d.Work, "wait"),
    (DDP, "__init__"), (DDP, "register_comm_hook"), (DDP, "_register_builtin_comm_hook"), (torch.nn.Module, "__call__"),
    (torch.Tensor, "backward"), (torch.autograd, "backward"), (torch.Tensor, "to"), (torch.Tensor, "cuda"),
    (torch.Tensor, "copy_"), (dl._BaseDataLoaderIter, "__next__"),
]  # fmt: skip
before = [getattr(o, a) for o, a in PATCHED]

rec = Recorder()
torch_dist.install(rec)
phases.install(rec, SimpleNamespace(h2d_copies="on"))  # even on CPU: the code path runs, nothing qualifies
wrapped = [getattr(o, a) is not b for (o, a), b in zip(PATCHED, before)]

from torch.distributed import all_reduce  # bound after install: the wrapper  # noqa: E402

dist.init_process_group("gloo", init_method=f"file://{scratch}/store", rank=0, world_size=1)
out: dict[str, object] = {"wrapped": wrapped}
t = torch.arange(4.0)
all_reduce(t)
objs = [None]
dist.all_gather_object(objs, {"a": 1})
w = dist.all_reduce(torch.ones(2), async_op=True)
w.wait()

# host-to-device: none of these moves host memory onto an accelerator
x = torch.arange(6.0)
m = x.to("meta")
d = x.to(torch.float64)
c = x.to("cpu")
e = torch.empty(6, device="meta").copy_(x)
out["h2d_results"] = [str(m.device), d.dtype == torch.float64 and bool((d == x.double()).all()), c is x, str(e.device)]

# DDP with a user hook, and one with a built-in hook; two optimizers (only the first marks steps)
calls = [0]


def hook(state, bucket):  # type: ignore[no-untyped-def]
    calls[0] += 1
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


m1 = DDP(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)))
m1.register_comm_hook(None, hook)
m2 = DDP(torch.nn.Linear(8, 2))
m2._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
o1 = torch.optim.SGD(m1.parameters(), lr=0.1)
o2 = torch.optim.SGD(m2.parameters(), lr=0.1)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(12, 8)), batch_size=4)
for (xb,) in loader:
    (m1(xb).sum() + m2(xb).sum()).backward()
    o1.step()
    o2.step()
out["user_hook_calls"] = calls[0]
dist.barrier()

torch_dist.uninstall()
phases.uninstall()
out["restored"] = [getattr(o, a) is b for (o, a), b in zip(PATCHED, before)]
t2 = torch.ones(1)
dist.all_reduce(t2)  # after uninstall: not recorded
dist.destroy_process_group()

ev = as_events(rec.buffers[0].buf, 0, rec.buffers[0].n)
for tb in rec.buffers[1:]:
    ev = np.concatenate([ev, as_events(tb.buf, 0, tb.n)])
ev = ev[np.argsort(ev["t0_ns"], kind="stable")]
s = rec.strings.strings
out["rows"] = [[int(r["kind"]), s[r["name_id"]], s[r["comm_id"]], int(r["seq"]), int(r["nbytes"]), s[r["site_id"]]] for r in ev]
out["kinds"] = {k.name: int((ev["kind"] == k).sum()) for k in Kind}
print(json.dumps(out))
