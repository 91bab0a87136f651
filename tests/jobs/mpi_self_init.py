"""An mpi4py program that initializes MPI itself (tests/test_shim_mpi_init.py).

``mpi_self_init.py OUT MODE``: MODE ``init`` / ``thread`` (``rc.initialize =
False`` then ``MPI.Init()`` / ``MPI.Init_thread(MPI.THREAD_MULTIPLE)``),
``auto`` (mpi4py initializes at import, the usual way), ``never``
(``rc.initialize = False`` and no MPI at all), ``finalize`` (auto, then the
program's own ``MPI.Finalize()``). Rank 1 works 1 s before MPI_Init, so rank 0
waits inside it. Each rank writes what it saw to OUT/result-<rank>.json and
prints one line (one write).
"""

from __future__ import annotations

import json
import os
import sys
import time

out_dir, mode = sys.argv[1], sys.argv[2]
rank = int(os.environ.get("PMI_RANK", "0"))
import distdiag  # noqa: E402  (marks: no-ops outside distdiag-wrap)

if rank == 1:
    time.sleep(1.0)
from mpi4py import rc  # noqa: E402

if mode in ("init", "thread", "never"):
    rc.initialize = False
distdiag.mark("before_init")
from mpi4py import MPI  # noqa: E402

res: dict[str, object] = {"mode": mode, "initialized_at_import": MPI.Is_initialized()}
if mode == "init":
    res["provided"] = MPI.Init()
elif mode == "thread":
    res["provided"] = MPI.Init_thread(MPI.THREAD_MULTIPLE)
distdiag.mark("after_init")
if mode == "never":
    res["version"] = list(MPI.Get_version())  # allowed before MPI_Init
    res["initialized"] = MPI.Is_initialized()
else:
    import numpy as np

    comm = MPI.COMM_WORLD
    res["query_thread"] = MPI.Query_thread()
    res["rank"], res["size"] = comm.Get_rank(), comm.Get_size()
    comm.Barrier()
    res["sum"] = comm.allreduce(comm.Get_rank() + 1)
    a = np.full(4, comm.Get_rank() + 1.0)
    b = np.zeros(4)
    comm.Allreduce(a, b)
    res["Allreduce"] = b.tolist()
    dup = comm.Dup()
    res["bcast"] = dup.bcast("hello" if dup.Get_rank() == 0 else None, root=0)
    dup.Free()
    res["type"] = type(comm).__name__
    if mode in ("init", "thread", "finalize"):
        MPI.Finalize()
        res["finalized"] = MPI.Is_finalized()
with open(os.path.join(out_dir, f"result-{rank}.json"), "w") as f:
    json.dump(res, f, sort_keys=True)
os.write(1, f"rank {rank} {mode} done\n".encode())
