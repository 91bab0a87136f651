"""How distdiag attaches to DDPs on CPU, in one real process (gloo, world size 1).

``python torch_ddp_modes.py`` prints one JSON line: per DDP its rows (comm key,
seq, nbytes, dtype) and whether the AutogradCPU allreduce kernel is registered
while the hooks are installed and after ``uninstall``. Cases: a CPU DDP alone
(recorded by the kernel, no comm hook: its gradients must equal an unhooked
twin's bit for bit), a second DDP on the same group (our comm hook), a
Python-level all_reduce and a direct ``ProcessGroup.allreduce`` outside backward
(not buckets), a user comm hook registered after some steps (it runs; the rows
go on), torch's FP16 builtin hook on a DDP of another group (its half-precision
all-reduce is the bucket).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import types

from distdiag.shim.hooks import torch_dist
from distdiag.shim.recorder import Recorder, as_events

rec = Recorder()
# DDP_KERNEL_IMPL: the shim's ddp_kernel_impl ("auto": the C++ kernel where it is built)
cfg = types.SimpleNamespace(ddp_kernel_impl=os.environ.get("DDP_KERNEL_IMPL", "auto"))
if os.environ.get("DDP_KERNEL_BUILT_FOR"):  # as if the C++ kernel had been built against another torch
    from distdiag.shim.hooks import _ddpk  # type: ignore[attr-defined]

    _ddpk.TORCH_VERSION = os.environ["DDP_KERNEL_BUILT_FOR"]
torch_dist.install(rec, cfg)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

tmp = tempfile.mkdtemp()
dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)


def kernel_registered() -> bool:
    return "AutogradCPU" in torch._C._dispatch_dump("c10d::allreduce_")


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32))


def step(m: torch.nn.Module, i: int) -> None:
    g = torch.Generator().manual_seed(i)
    m.zero_grad()
    m(torch.randn(4, 32, generator=g)).pow(2).sum().backward()


a = DDP(model())
b = DDP(model())  # same group
out: dict[str, object] = {"kernel_installed": kernel_registered(), "impl": "c++" if torch_dist._ck else "python"}
same: list[bool] = []
torch_dist.uninstall()
twin = DDP(model())  # built and stepped without distdiag: the reference gradients
torch_dist.install(rec, cfg)
for i in range(3):
    step(a, i)
    step(b, i)
    torch_dist.uninstall()
    step(twin, i)
    torch_dist.install(rec, cfg)
    same.append(all(torch.equal(p.grad, q.grad) for p, q in zip(a.parameters(), twin.parameters())))  # type: ignore[arg-type]
out["same_grads"] = same
t = torch.ones(4)
dist.all_reduce(t)
dist.distributed_c10d._get_default_group().allreduce([t]).wait()  # the C++ path, outside backward
calls = [0]


def user_hook(state, bucket):  # type: ignore[no-untyped-def]
    calls[0] += 1
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0])


a.register_comm_hook(None, user_hook)
for i in range(3, 5):
    step(a, i)
g = dist.new_group([0])
c = DDP(model(), process_group=g)
c._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
for i in range(2):
    step(c, i)
time.sleep(0.2)  # callbacks on gloo's threads
out["user_hook_calls"] = calls[0]
parts = [as_events(buf, a, z) for buf, a, z in rec.drain({})]  # the writer's drain: also the C++ kernel's rows
ev = np.concatenate(parts)
ev = ev[np.argsort(ev["t0_ns"], kind="stable")]
s = rec.strings.strings
out["rows"] = [[s[r["name_id"]], s[r["comm_id"]], int(r["seq"]), int(r["nbytes"]), s[r["aux"]], bool(r["t1_ns"] >= r["t0_ns"]),
                s[r["site_id"]].rsplit(":", 1)[0]]
               for r in ev if s[r["name_id"]] in ("ddp_bucket_allreduce", "all_reduce")]  # fmt: skip
torch_dist.uninstall()
out["kernel_after_uninstall"] = kernel_registered()
step(a, 9)  # still trains after uninstall
dist.destroy_process_group()
print(json.dumps(out))
sys.stdout.flush()
os._exit(0)
