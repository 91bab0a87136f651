"""Runs the link probe on its own (no wrapper): installs distdiag.shim.probe
with a fresh Recorder, calls init_process_group("gloo") (torch) or imports
mpi4py (`mpi` argument), and prints one JSON line with what the probe measured
and the PROBE rows it recorded.
"""

from __future__ import annotations

import json
import os
import sys
import time
import types

import numpy as np

from distdiag.schema import Kind
from distdiag.shim import probe
from distdiag.shim.recorder import Recorder, as_events


def main() -> None:
    transport = sys.argv[1] if len(sys.argv) > 1 else "torch"
    budget_s = float(sys.argv[2]) if len(sys.argv) > 2 else 3.0
    rec = Recorder()
    cfg = types.SimpleNamespace(probe_links=True, probe_budget_s=budget_s, probe_max_rounds=15, probe_timeout_s=30.0)
    probe.install(rec, cfg)
    t0 = time.perf_counter()
    if transport == "torch":
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank = dist.get_rank()
    else:
        from mpi4py import MPI

        rank = MPI.COMM_WORLD.Get_rank()
    init_s = time.perf_counter() - t0
    res = probe.LAST
    tb = rec.buffers[0]
    ev = as_events(tb.buf, 0, tb.n)
    rows = ev[ev["kind"] == Kind.PROBE]
    names = [rec.strings.strings[i] for i in rows["name_id"]]
    bw: dict[int, float] = {}
    for (rnd, peer, nbytes, a, b) in (res.bw_steps if res else []):
        bw[peer] = max(bw.get(peer, 0.0), nbytes / ((b - a) / 1e9))
    line = (
        json.dumps(
            {
                "rank": rank,
                "elapsed_s": res.elapsed_s if res else None,
                "init_s": init_s,
                "rounds": res.rounds if res else 0,
                "participants": res.participants if res else [],
                "bw": {str(k): v for k, v in bw.items()},
                "row_names": sorted(set(names)),
                "rows": int(len(rows)),
                "peers": sorted(set(int(p) for p in rows["peer"] if p >= 0)),
                "monotone": bool(np.all(rows["t1_ns"] >= rows["t0_ns"])),
            }
        )
    )
    # mpiexec's proxy may splice the ranks' stdout lines together: tests that
    # need every rank's line whole set NET_PROBE_OUT and read one file per rank
    out_dir = os.environ.get("NET_PROBE_OUT")
    if out_dir:
        with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
            f.write(line)
    print(line, flush=True)
    if transport == "torch":
        dist.destroy_process_group()
    probe.uninstall()


if __name__ == "__main__":
    main()
