"""3 torch.distributed (gloo) ranks; rank HANG_RANK never reaches the all_reduce the
others enter: it sits in ``distdiag.phase("load_checkpoint")`` forever. Each rank writes
its pid to PIDDIR/<rank>.pid once past its first all-reduces.

usage (under torchrun): hang_gloo.py PIDDIR HANG_RANK
"""

from __future__ import annotations

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

import distdiag

piddir, hang_rank = sys.argv[1], int(sys.argv[2])
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
rank = dist.get_rank()
t = torch.ones(1024)
for _ in range(5):
    dist.all_reduce(t)
with open(os.path.join(piddir, f"{rank}.pid"), "w") as f:
    f.write(str(os.getpid()))
if rank == hang_rank:
    with distdiag.phase("load_checkpoint"):
        while True:  # stuck in its own code
            time.sleep(0.05)
dist.all_reduce(t)  # GLOO-HANG-SITE: the others wait here
