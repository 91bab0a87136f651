"""DDP with uneven inputs under ``Join``: rank 0 trains STEPS0 batches, the others STEPS1.

`python torch_join.py STEPS0 STEPS1`. Once a rank runs out of data, Join makes
it shadow the others' collectives (DDP's join hook) so nobody hangs.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    steps0, steps1 = int(sys.argv[1]), int(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = DDP(torch.nn.Linear(256, 256))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with Join([model]):
        for _ in range(steps0 if rank == 0 else steps1):
            opt.zero_grad()
            model(torch.randn(8, 256)).sum().backward()
            opt.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
