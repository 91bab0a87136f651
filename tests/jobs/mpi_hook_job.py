"""A small MPI job that drives the mpi4py hook directly (no distdiag-wrap).

Usage: mpiexec -n 4 python mpi_hook_job.py OUT_DIR [--plain] [--slow-rank R --sleep-s S]

Creates a Recorder, installs the hook *before* importing mpi4py (as
distdiag-wrap does), runs a fixed mix of collectives, point-to-point calls,
communicator creations and non-blocking calls, then saves per rank:

* ``events-<rank>.npy``: the recorded EVENT_DTYPE rows (finished chunks + current)
* ``strings-<rank>.json``: the string table
* ``results-<rank>.json``: the values the MPI calls returned (to compare a
  wrapped run with a ``--plain`` one)
* ``meta-<rank>.json``: facts the test checks (types, identities after uninstall)

With ``--plain`` the hook is not installed (the reference run).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import numpy as np

from distdiag.shim.recorder import Recorder, as_events


def collect_rows(rec: Recorder) -> np.ndarray:
    parts = [as_events(buf, 0, n) for buf, n in list(rec.full)]
    parts += [as_events(tb.buf, 0, tb.n) for tb in rec.buffers]
    from distdiag.schema import EVENT_DTYPE

    return np.concatenate(parts) if parts else np.zeros(0, EVENT_DTYPE)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--plain", action="store_true")
    ap.add_argument("--generic", action="store_true", help="use the hook's generic wrappers only")
    ap.add_argument("--slow-rank", type=int, default=-1)
    ap.add_argument("--sleep-s", type=float, default=0.0)
    a = ap.parse_args()

    rec = Recorder()
    hook: Any = None
    if not a.plain:
        import distdiag.shim.hooks.mpi4py

        hook = distdiag.shim.hooks.mpi4py
        if a.generic:
            # the fallback wrappers (*args, **kw) that serve when a signature is unexpected
            hook._params = lambda orig: None
        hook.install(rec, None)

    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    size = comm.Get_size()
    res: dict[str, object] = {}
    def tname(o: object) -> str:
        return f"{type(o).__module__}.{type(o).__name__}"

    meta: dict[str, object] = {"world_type": tname(comm), "barrier_wrapper": type(type(comm).__dict__.get("Barrier")).__name__}

    # a rank that is late to a collective; an aligning barrier first, so the
    # ranks' uneven start-up on a loaded machine does not blur the lateness
    if a.slow_rank >= 0:
        comm.Barrier()  # world seq 0 in this mode; everything below shifts by one
        if rank == a.slow_rank:
            time.sleep(a.sleep_s)
    comm.Barrier()  # world seq 0 (seq 1 with --slow-rank)

    res["allreduce_obj"] = comm.allreduce(rank + 1)  # seq 1
    x = np.arange(4, dtype=np.float64) + rank
    y = np.empty_like(x)
    comm.Allreduce(x, y, op=MPI.SUM)  # seq 2
    res["Allreduce"] = y.tolist()
    b = np.zeros(3, dtype=np.int32)
    if rank == 1:
        b[:] = [7, 8, 9]
    comm.Bcast([b, MPI.INT], root=1)  # seq 3, root 1
    res["Bcast"] = b.tolist()
    g = np.zeros(size, dtype=np.int64) if rank == 0 else None
    comm.Gather(np.array([rank * 10], dtype=np.int64), g, root=0)  # seq 4
    res["Gather"] = None if g is None else g.tolist()
    res["gather_obj"] = comm.gather({"r": rank}, root=2)  # seq 5
    res["bcast_obj"] = comm.bcast("hello" if rank == 0 else None, root=0)  # seq 6
    z = np.empty(4)
    comm.Allreduce(MPI.IN_PLACE, y)  # seq 7, in place
    res["Allreduce_inplace"] = y.tolist()
    del z

    # non-blocking collective, completed by Wait after some work
    ib = np.full(2, rank, dtype=np.float64)
    ob = np.empty(2)
    req = comm.Iallreduce(ib, ob)  # seq 8
    t_post = time.perf_counter_ns()
    time.sleep(0.01)
    req.Wait()
    res["Iallreduce"] = ob.tolist()
    meta["t_post_ns"] = t_post
    reqs = [comm.Ibarrier(), comm.Ibcast(ib, root=0)]  # seq 9, 10
    MPI.Request.Waitall(reqs)
    res["Ibcast"] = ib.tolist()

    # point-to-point in a ring: buffer and object, blocking and non-blocking
    right, left = (rank + 1) % size, (rank - 1) % size
    sbuf = np.full(1000, rank, dtype=np.float32)
    rbuf = np.empty(1000, dtype=np.float32)
    if rank % 2 == 0:
        comm.Send(sbuf, dest=right, tag=1)
        comm.Recv(rbuf, source=MPI.ANY_SOURCE, tag=1)
    else:
        comm.Recv(rbuf, source=left, tag=1)
        comm.Send(sbuf, dest=right, tag=1)
    res["Recv"] = float(rbuf[0])
    rq = [comm.Isend(sbuf, dest=left, tag=2), comm.Irecv(rbuf, source=right, tag=2)]
    MPI.Request.Waitall(rq)
    res["Irecv"] = float(rbuf[0])
    sr = comm.sendrecv(b"x" * (rank + 5), dest=right, sendtag=3, source=left, recvtag=3)
    res["sendrecv"] = len(sr)
    srb = np.empty(1000, dtype=np.float32)
    comm.Sendrecv(sbuf, dest=right, sendtag=5, recvbuf=srb, source=MPI.ANY_SOURCE, recvtag=5)
    res["Sendrecv"] = float(srb[0])
    rep = np.full(3, rank, dtype=np.int64)
    comm.Sendrecv_replace(rep, dest=left, sendtag=6, source=right, recvtag=6)
    res["Sendrecv_replace"] = rep.tolist()
    r2 = comm.irecv(source=left, tag=4)
    comm.send(b"y" * 100, dest=right, tag=4)
    res["irecv_obj"] = len(r2.wait())

    # communicator creation: Dup, Split (2 colors), Create_cart + Sub, Split_type
    dup = comm.Dup()
    res["dup_allreduce"] = dup.allreduce(1)  # dup seq 0
    sub = comm.Split(color=rank % 2, key=rank)
    res["split_allreduce"] = sub.allreduce(rank)  # split seq 0
    res["split_allreduce2"] = sub.allreduce(rank * 2)  # split seq 1
    sub2 = sub.Dup()
    sub2.Barrier()
    cart = comm.Create_cart([2, size // 2], periods=[True, True])
    cart_sub = cart.Sub([True, False])
    res["cart_sub_allreduce"] = cart_sub.allreduce(rank)
    res["cart_neighbor"] = cart.neighbor_allgather(rank)
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    node.Barrier()
    meta["types"] = {"dup": tname(dup), "sub": tname(sub), "sub2": tname(sub2), "cart": tname(cart), "cart_sub": tname(cart_sub), "node": tname(node)}
    meta["isinstance_plain_request"] = isinstance(MPI.REQUEST_NULL, MPI.Request)
    for c in (node, cart_sub, cart, sub2, sub, dup):
        c.Free()

    # more constructors: Idup, Clone, Create(group), Create_group, an intercomm and its Merge
    idup, ireq = comm.Idup()
    ireq.Wait()
    res["idup_allreduce"] = idup.allreduce(rank)
    clone = comm.Clone()
    clone.Barrier()
    wg = comm.Get_group()
    evens = wg.Incl([r for r in range(size) if r % 2 == 0])
    created = comm.Create(evens)  # COMM_NULL on odd ranks
    if created != MPI.COMM_NULL:
        res["create_allreduce"] = created.allreduce(rank)
        created.Free()
    mine = wg.Incl([r for r in range(size) if r % 2 == rank % 2])
    grp = comm.Create_group(mine, tag=7)  # collective over the group only
    res["group_allreduce"] = grp.allreduce(rank)
    half: Any = comm.Split(rank % 2, rank)
    inter = half.Create_intercomm(0, comm, 1 - rank % 2, tag=11)
    res["inter_remote_size"] = inter.Get_remote_size()
    merged = inter.Merge(high=rank % 2 == 1)
    res["merged_allreduce"] = merged.allreduce(rank)
    dg = comm.Create_dist_graph_adjacent([left], [right])  # a ring: hear from the left
    res["distgraph_neighbor"] = dg.neighbor_allgather(rank)
    nb_out = np.empty(1, dtype=np.int64)
    dg.Neighbor_alltoall(np.array([rank], dtype=np.int64), nb_out)
    res["distgraph_Neighbor_alltoall"] = nb_out.tolist()
    meta["more_types"] = {"idup": tname(idup), "clone": tname(clone), "grp": tname(grp), "inter": tname(inter), "merged": tname(merged), "distgraph": tname(dg)}
    for c in (dg, merged, inter, half, grp, clone, idup):
        c.Free()
    for g_ in (mine, evens, wg):
        g_.Free()

    # v-variants and the other completion calls
    counts = [i + 1 for i in range(size)]
    displs = [sum(counts[:i]) for i in range(size)]
    sendv = np.arange(sum(counts), dtype=np.float64) if rank == 0 else None
    recvv = np.empty(rank + 1)
    comm.Scatterv([sendv, counts, displs, MPI.DOUBLE] if rank == 0 else None, recvv, root=0)
    res["Scatterv"] = recvv.tolist()
    allv = np.empty(sum(counts))
    comm.Allgatherv(recvv, [allv, counts, displs, MPI.DOUBLE])
    res["Allgatherv"] = allv.tolist()
    ra = [comm.Iallreduce(np.array([float(rank)]), np.empty(1)) for _ in range(2)]
    done: list[int] = []
    while len(done) < 2:
        i = MPI.Request.Waitany(ra)
        done.append(i)
    rs = [comm.Ibarrier() for _ in range(2)]
    while not MPI.Request.Testall(rs):
        pass
    ro = [comm.isend(b"w" * (rank + 1), dest=(rank + 1) % size, tag=20), comm.irecv(source=(rank - 1) % size, tag=20)]
    res["waitall_obj"] = [None if o is None else len(o) for o in MPI.Request.waitall(ro)]
    meta["completion_ok"] = True

    # an MPI error passes through unchanged (mpi4py sets ERRORS_RETURN): same
    # exception type and error class as without the hook
    try:
        comm.Send(sbuf, dest=size + 7, tag=9)
        res["bad_send"] = "no error"
    except MPI.Exception as e:
        res["bad_send"] = [type(e).__name__, e.Get_error_class()]

    # a bad argument raises mpi4py's own error, unchanged
    try:
        comm.Allreduce(object(), y)
        res["bad_buffer"] = "no error"
    except Exception as e:
        res["bad_buffer"] = [type(e).__name__, str(e)]
    # a wrapped-class communicator we never saw created (no state): calls still work
    stray = type(comm)(comm)
    res["stray_allreduce"] = stray.allreduce(rank)

    # in flight: rank 1 is late to a barrier; a helper thread on rank 0 looks
    # at what the recorder would write to /inflight while rank 0 waits
    probe: list[object] = []
    if rank == 0 and hook is not None:
        import threading

        def look() -> None:
            time.sleep(0.15)
            rows = rec.inflight_rows()
            probe.extend([rec.strings.strings[int(r["name_id"])], rec.strings.strings[int(r["comm_id"])], int(r["seq"]), int(r["t1_ns"])] for r in rows)

        th = threading.Thread(target=look)
        th.start()
    if rank == 1:
        time.sleep(0.4)
    comm.Barrier()
    if rank == 0 and hook is not None:
        th.join()
    meta["inflight_probe"] = probe

    comm.Barrier()
    if hook is not None:
        import mpi4py.MPI as M

        originals = dict(hook._saved)  # what install replaced
        hook.uninstall()
        meta["after_uninstall_world_type"] = tname(M.COMM_WORLD)
        meta["after_uninstall_restored"] = {k: getattr(M, k) is v for k, v in originals.items()}
        meta["after_uninstall_request_type_is_builtin"] = type(M.Request) is type
        n_before = sum(tb.n for tb in rec.buffers)
        M.COMM_WORLD.Barrier()
        comm.Barrier()  # the wrapped object we still hold passes through
        meta["rows_added_after_uninstall"] = sum(tb.n for tb in rec.buffers) - n_before

    os.makedirs(a.out, exist_ok=True)
    np.save(os.path.join(a.out, f"events-{rank}.npy"), collect_rows(rec))
    with open(os.path.join(a.out, f"strings-{rank}.json"), "w") as f:
        json.dump(rec.strings.strings, f)
    with open(os.path.join(a.out, f"results-{rank}.json"), "w") as f:
        json.dump(res, f)
    with open(os.path.join(a.out, f"meta-{rank}.json"), "w") as f:
        json.dump(meta, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
