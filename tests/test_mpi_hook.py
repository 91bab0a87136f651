"""The mpi4py hook, on real ``mpiexec -n 4`` jobs.

The job (tests/jobs/mpi_hook_job.py) installs the hook into its own Recorder
before importing mpi4py, runs a fixed mix of MPI calls and saves each rank's
rows, string table, call results and a few facts; the tests read those. One
wrapped run and one plain run are shared by most tests (module fixtures);
the straggler case is its own run.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import run_in_session

from distdiag.schema import Kind

pytestmark = pytest.mark.mpi

JOBS = Path(__file__).parent / "jobs"
NP = 4
HOOK = "distdiag.shim.hooks.mpi4py"
TIMEOUT_S = 120  # 4 busy-polling ranks on 2 shared cores: slow, but never hang


def _run(cmd: list[str], cwd: Path | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run a job in its own session; fail on a timeout (killing that session) or a non-zero exit."""
    return run_in_session(cmd, TIMEOUT_S, cwd=cwd, env=env, check=True)


def _mpiexec() -> str:
    exe = Path(sys.executable).with_name("mpiexec")
    return str(exe) if exe.exists() else "mpiexec"


class RankOut:
    def __init__(self, d: Path, rank: int) -> None:
        self.rank = rank
        self.strings: list[str] = json.loads((d / f"strings-{rank}.json").read_text())
        ev = d / f"events-{rank}.npy"
        self.ev = np.load(ev) if ev.exists() else None
        self.results: dict[str, Any] = json.loads((d / f"results-{rank}.json").read_text())
        self.meta: dict[str, Any] = json.loads((d / f"meta-{rank}.json").read_text())

    def s(self, i: int) -> str:
        return self.strings[int(i)]

    def rows(self, *kinds: Kind) -> np.ndarray:
        assert self.ev is not None
        return self.ev[np.isin(self.ev["kind"], [int(k) for k in kinds])]

    def named(self, name: str, kind: Kind | None = None) -> np.ndarray:
        assert self.ev is not None
        names = np.array([self.s(i) for i in self.ev["name_id"]])
        m = names == name
        if kind is not None:
            m &= self.ev["kind"] == int(kind)
        return self.ev[m]

    def colls(self) -> dict[tuple[str, int], str]:
        """(comm key, seq) -> op name of every collective row."""
        r = self.rows(Kind.COLL, Kind.COLL_ASYNC)
        return {(self.s(c), int(q)): self.s(n) for c, q, n in zip(r["comm_id"], r["seq"], r["name_id"])}


def _job(tmp: Path, *args: str, env: dict[str, str] | None = None) -> list[RankOut]:
    _run([_mpiexec(), "-n", str(NP), sys.executable, str(JOBS / "mpi_hook_job.py"), str(tmp), *args], env=env)
    return [RankOut(tmp, r) for r in range(NP)]


@pytest.fixture(scope="module")
def wrapped(tmp_path_factory: pytest.TempPathFactory) -> list[RankOut]:
    return _job(tmp_path_factory.mktemp("wrapped"))


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> list[RankOut]:
    return _job(tmp_path_factory.mktemp("plain"), "--plain")


@pytest.fixture(scope="module")
def generic(tmp_path_factory: pytest.TempPathFactory) -> list[RankOut]:
    return _job(tmp_path_factory.mktemp("generic"), "--generic")


@pytest.fixture(scope="module")
def pywrapped(tmp_path_factory: pytest.TempPathFactory) -> list[RankOut]:
    """The hook without distdiag/shim/_hot.c: what a machine without a compiler runs."""
    return _job(tmp_path_factory.mktemp("pywrapped"), env=dict(os.environ, DISTDIAG_HOT="0"))


# -- matching keys ------------------------------------------------------------------------
def test_sequence_numbers_and_comm_keys_agree_across_ranks(wrapped: list[RankOut]) -> None:
    per_rank = [r.colls() for r in wrapped]
    # every rank's world collectives: the same ops at the same seq, 0..n-1 without gaps
    worlds = [{q: op for (c, q), op in pr.items() if c == "world"} for pr in per_rank]
    assert all(w == worlds[0] for w in worlds), worlds
    assert sorted(worlds[0]) == list(range(len(worlds[0])))
    assert worlds[0][0] == "Barrier" and worlds[0][1] == "allreduce" and worlds[0][2] == "Allreduce"
    assert worlds[0][8] == "Iallreduce" and {worlds[0][9], worlds[0][10]} == {"Ibarrier", "Ibcast"}
    # every communicator key: members agree on the whole (seq -> op) sequence
    by_key: dict[str, list[dict[int, str]]] = {}
    for pr in per_rank:
        keys = {c for c, _ in pr}
        for k in keys:
            by_key.setdefault(k, []).append({q: op for (c, q), op in pr.items() if c == k})
    for k, seqs in by_key.items():
        assert all(s == seqs[0] for s in seqs), (k, seqs)
        assert sorted(seqs[0]) == list(range(len(seqs[0]))), (k, seqs[0])


def test_dup_split_cart_comms_are_wrapped_and_keyed_consistently(wrapped: list[RankOut]) -> None:
    for r in wrapped:
        t = r.meta["types"]
        assert r.meta["world_type"] == f"{HOOK}.Intracomm"
        intra, cart = f"{HOOK}.Intracomm", f"{HOOK}.Cartcomm"
        assert t == {"dup": intra, "sub": intra, "sub2": intra, "cart": cart, "cart_sub": cart, "node": intra}
        keys = {(r.s(c), q) for c, q in zip(r.rows(Kind.COLL)["comm_id"], r.rows(Kind.COLL)["seq"])}
        assert ("world.dup0", 0) in keys
        color = r.rank % 2
        assert (f"world.split1.c{color}", 0) in keys and (f"world.split1.c{color}", 1) in keys
        assert (f"world.split1.c{color}.dup0", 0) in keys
        # all ranks share one host: Split_type(SHARED) gives one node comm led by world rank 0
        assert ("world.splittype3.r0", 0) in keys
        # COMM_CREATE rows: parent key, this rank's rank in the new comm, its size
        cc = r.rows(Kind.COMM_CREATE)
        made = {r.s(n): (r.s(p), int(pe), int(sz)) for n, p, pe, sz in zip(cc["name_id"], cc["comm_id"], cc["peer"], cc["aux"])}
        assert made["world"] == ("", r.rank, NP)
        assert made["world.dup0"] == ("world", r.rank, NP)
        assert made[f"world.split1.c{color}"] == ("world", r.rank // 2, 2)
        assert made["world.cart2"][0] == "world"
    # the two split halves are different communicators with different keys
    k0 = {c for c, _ in wrapped[0].colls()}
    k1 = {c for c, _ in wrapped[1].colls()}
    assert "world.split1.c0" in k0 and "world.split1.c0" not in k1
    # Cartcomm.Sub([True, False]) on a 2x2 grid: two disjoint comms, told apart by their leaders
    subs = {next(c for c, _ in r.colls() if ".sub0." in c) for r in wrapped}
    assert len(subs) == 2


def test_other_constructors_and_intercomms_are_keyed_alike_on_all_members(wrapped: list[RankOut]) -> None:
    intra = f"{HOOK}.Intracomm"
    made = []
    for r in wrapped:
        assert r.meta["more_types"] == {
            "idup": intra,
            "clone": intra,
            "grp": intra,
            "inter": f"{HOOK}.Intercomm",
            "merged": intra,
            "distgraph": f"{HOOK}.Distgraphcomm",
        }
        dg = {(c, op) for (c, q), op in r.colls().items() if ".distgraph" in c}
        assert {op for _, op in dg} == {"neighbor_allgather", "Neighbor_alltoall"} and len({c for c, _ in dg}) == 1
        na = r.named("Neighbor_alltoall", Kind.COLL)
        assert (int(na["nbytes"][0]), r.s(na["aux"][0])) == (8, "MPI_LONG")
        cc = r.rows(Kind.COMM_CREATE)
        made.append({r.s(n) for n in cc["name_id"]})
    # the intercomm joins both halves, so do its key and its Merge's: one key on all 4 ranks
    inter = [{k for k in m if k.startswith("inter.") and "merge" not in k} for m in made]
    merged = [{k for k in m if k.startswith("inter.") and k.endswith(".merge0")} for m in made]
    assert all(len(i) == 1 and i == inter[0] for i in inter), inter
    for r in wrapped:  # an intercomm's COMM_CREATE: rank in the local half, members of both halves
        cc = r.rows(Kind.COMM_CREATE)
        row = cc[[r.s(n) in inter[0] for n in cc["name_id"]]]
        assert (int(row["peer"][0]), int(row["aux"][0])) == (r.rank // 2, NP)
    assert all(len(m) == 1 and m == merged[0] for m in merged), merged
    # Create_group: one key per group, the same on its members, different between groups
    groups = [{k for k in m if ".group.t7." in k} for m in made]
    assert all(len(g) == 1 for g in groups)
    assert groups[0] == groups[2] and groups[1] == groups[3] and groups[0] != groups[1]
    # Create(evens): only even ranks get a communicator, with one key
    created = [{k for k in m if ".create" in k} for m in made]
    assert created[0] == created[2] and len(created[0]) == 1 and created[1] == created[3] == set()


def test_completion_calls_finish_every_tracked_request(wrapped: list[RankOut]) -> None:
    for r in wrapped:
        world = {q: op for (c, q), op in r.colls().items() if c == "world"}
        # Iallreduce x2 (Waitany), Ibarrier x2 (Testall loop): all four completed and recorded
        assert sorted(op for op in world.values() if op in ("Iallreduce", "Ibarrier")).count("Iallreduce") == 3
        assert list(world.values()).count("Ibarrier") == 3
        assert len(r.named("Waitany", Kind.WAIT)) == 2
        assert (r.named("Waitany", Kind.WAIT)["comm_id"] != 0).all()
        assert len(r.named("isend", Kind.SEND_ASYNC)) == 1 and len(r.named("irecv", Kind.RECV_ASYNC)) == 2
        sv = r.named("Scatterv", Kind.COLL)
        assert sv["nbytes"].tolist() == [8 * (r.rank + 1)]  # this rank's share
        agv = r.named("Allgatherv", Kind.COLL)
        assert agv["nbytes"].tolist() == [8 * (r.rank + 1)]


def test_results_and_errors_equal_the_unwrapped_run(wrapped: list[RankOut], plain: list[RankOut]) -> None:
    for w, p in zip(wrapped, plain):
        assert w.results == p.results
        assert p.results["bad_send"][0] == "Exception"  # the error case really errs
    assert plain[0].meta["world_type"] == "mpi4py.MPI.Intracomm"


# -- timing ----------------------------------------------------------------------------------
def test_nonblocking_completion_is_seen_after_the_post(wrapped: list[RankOut]) -> None:
    for r in wrapped:
        ia = r.named("Iallreduce", Kind.COLL_ASYNC)
        ia = ia[ia["seq"] == 8]  # the one posted before the 10 ms sleep
        assert len(ia) == 1
        # posted, then 10 ms of sleep, then Wait: completion seen at least 10 ms after the post
        assert ia["t0_ns"][0] <= r.meta["t_post_ns"]
        assert ia["t1_ns"][0] - ia["t0_ns"][0] >= 10_000_000
        a = r.rows(Kind.COLL_ASYNC, Kind.SEND_ASYNC, Kind.RECV_ASYNC)
        assert len(a) >= 6 and (a["t1_ns"] >= a["t0_ns"]).all()
        # the Wait itself is a WAIT row inside the async span
        wt = r.named("Wait", Kind.WAIT)
        assert len(wt) == 1 and wt["t0_ns"][0] >= ia["t0_ns"][0] and wt["t1_ns"][0] <= ia["t1_ns"][0]
        # ... and names what it waits for: world's Iallreduce, seq 8
        assert (r.s(wt["comm_id"][0]), int(wt["seq"][0]), r.s(wt["aux"][0])) == ("world", 8, "Iallreduce")


def test_late_rank_shows_a_later_arrival(tmp_path: Path) -> None:
    slow, sleep_s = 2, 0.3
    ranks = _job(tmp_path, "--slow-rank", str(slow), "--sleep-s", str(sleep_s))
    late = {r.rank: r.named("Barrier", Kind.COLL) for r in ranks}
    t0 = {k: int(v[v["seq"] == 1]["t0_ns"][0]) for k, v in late.items()}  # seq 0 aligned the ranks
    t1 = {k: int(v[v["seq"] == 1]["t1_ns"][0]) for k, v in late.items()}
    others = [k for k in t0 if k != slow]
    # one host: perf_counter_ns is CLOCK_MONOTONIC, comparable across these processes.
    # Thresholds at half the sleep: 4 busy-polling ranks on 2 shared cores skew by tens of ms.
    assert t0[slow] - max(t0[k] for k in others) >= 0.5 * sleep_s * 1e9
    for k in others:  # the punctual ranks waited in the barrier for the late one
        assert t1[k] - t0[k] >= 0.5 * sleep_s * 1e9
        assert t1[slow] - t0[slow] < t1[k] - t0[k]


def test_a_rank_waiting_in_a_collective_shows_it_in_flight(wrapped: list[RankOut]) -> None:
    probe = wrapped[0].meta["inflight_probe"]
    assert len(probe) == 1
    name, comm, seq, t1 = probe[0]
    assert (name, comm, t1) == ("Barrier", "world", -1)
    assert wrapped[0].colls()[("world", seq)] == "Barrier"


# -- point-to-point --------------------------------------------------------------------------
def test_p2p_peers_and_bytes(wrapped: list[RankOut]) -> None:
    for r in wrapped:
        right, left = (r.rank + 1) % NP, (r.rank - 1) % NP
        send = r.named("Send", Kind.SEND)
        ok = send[send["peer"] == right]
        assert len(ok) == 1 and ok["nbytes"][0] == 4000 and r.s(ok["aux"][0]) == "MPI_FLOAT"
        recv = r.named("Recv", Kind.RECV)
        # even ranks received from ANY_SOURCE: the row holds the actual source
        assert len(recv) == 1 and recv["peer"][0] == left and recv["nbytes"][0] == 4000
        isend, irecv = r.named("Isend", Kind.SEND_ASYNC), r.named("Irecv", Kind.RECV_ASYNC)
        assert isend["peer"].tolist() == [left] and irecv["peer"].tolist() == [right]
        sr_s, sr_r = r.named("sendrecv", Kind.SEND), r.named("sendrecv", Kind.RECV)
        assert sr_s["peer"].tolist() == [right] and sr_s["nbytes"].tolist() == [r.rank + 5]
        assert sr_r["peer"].tolist() == [left] and sr_r["nbytes"].tolist() == [left + 5]
        assert (sr_s["t0_ns"] == sr_r["t0_ns"]).all()
        # Sendrecv from ANY_SOURCE: the RECV row holds the actual source
        assert r.named("Sendrecv", Kind.SEND)["peer"].tolist() == [right]
        assert r.named("Sendrecv", Kind.RECV)["peer"].tolist() == [left]
        assert r.named("Sendrecv", Kind.SEND)["nbytes"].tolist() == [4000]
        assert r.named("Sendrecv_replace", Kind.SEND)["peer"].tolist() == [left]
        assert r.named("Sendrecv_replace", Kind.RECV)["peer"].tolist() == [right]
        assert r.named("send", Kind.SEND)["nbytes"].tolist() == [100]
        # irecv of b"y" * 100 (wait), then of b"w" * (left + 1) (waitall): sizes from the objects
        assert r.named("irecv", Kind.RECV_ASYNC)["nbytes"].tolist() == [100, left + 1]
        # p2p rows are not collectives
        assert (r.rows(Kind.SEND, Kind.RECV, Kind.SEND_ASYNC, Kind.RECV_ASYNC)["seq"] == -1).all()


def test_collective_roots_bytes_datatypes_and_call_sites(wrapped: list[RankOut]) -> None:
    for r in wrapped:
        c = {(r.s(cm), int(q)): row for cm, q, row in zip(r.rows(Kind.COLL)["comm_id"], r.rows(Kind.COLL)["seq"], r.rows(Kind.COLL))}
        bc = c[("world", 3)]  # Bcast([b, MPI.INT], root=1) of 3 int32
        assert (bc["peer"], bc["nbytes"], r.s(bc["aux"])) == (1, 12, "MPI_INT")
        ar = c[("world", 2)]  # Allreduce of 4 float64
        assert (ar["peer"], ar["nbytes"], r.s(ar["aux"])) == (-1, 32, "MPI_DOUBLE")
        assert c[("world", 7)]["nbytes"] == 32  # IN_PLACE: the receive buffer
        assert c[("world", 5)]["peer"] == 2  # gather(obj, root=2)
        assert r.s(c[("world", 1)]["aux"]) == "object"
        site = r.s(ar["site_id"])
        assert site.startswith(str(JOBS / "mpi_hook_job.py") + ":") and int(site.rsplit(":", 1)[1]) > 0


# -- uninstall ---------------------------------------------------------------------------------
def test_uninstall_restores_mpi4py_exactly(wrapped: list[RankOut]) -> None:
    for r in wrapped:
        m = r.meta
        assert m["after_uninstall_world_type"] == "mpi4py.MPI.Intracomm"
        assert m["after_uninstall_restored"] == {"COMM_WORLD": True, "COMM_SELF": True, "Request": True}
        assert m["after_uninstall_request_type_is_builtin"]
        assert m["rows_added_after_uninstall"] == 0
        assert m["isinstance_plain_request"]  # while installed, plain requests still are MPI.Request


# -- end to end under distdiag-wrap --------------------------------------------------------------
def _read_rank_file(path: Path) -> tuple[np.ndarray, list[str]]:
    import h5py

    with h5py.File(path, "r") as f:
        return f["events"][:], list(f["strings"].asstr()[:])


def test_wrapped_program_records_into_rank_files(tmp_path: Path) -> None:
    """``mpiexec -n 4 distdiag-wrap python job.py``: a plain mpi4py program, unchanged output."""
    job = str(JOBS / "mpi_wrap_job.py")
    run_dir = tmp_path / "run"
    wrapped_out = _run([_mpiexec(), "-n", str(NP), sys.executable, "-m", "distdiag.wrap", "--dir", str(run_dir), sys.executable, job]).stdout
    plain_out = _run([_mpiexec(), "-n", str(NP), sys.executable, job]).stdout
    # mpiexec interleaves the ranks' stdout (lines are not atomic): compare the records
    line = re.compile(r"rank \d+ total [0-9.]+ type \w+;")
    assert sorted(line.findall(wrapped_out)) == sorted(line.findall(plain_out))
    assert len(line.findall(plain_out)) == NP

    seqs = []
    for rank in range(NP):
        ev, strings = _read_rank_file(run_dir / f"rank-{rank:05d}.h5")
        coll = ev[ev["kind"] == int(Kind.COLL)]
        # the program bound COMM_WORLD by name at import: still the wrapped one
        seq_ops = [(strings[c], int(q), strings[n]) for c, q, n in zip(coll["comm_id"], coll["seq"], coll["name_id"])]
        assert [q for c, q, _ in seq_ops if c == "world"] == list(range(10))
        assert ("world.dup0", 0, "bcast") in seq_ops
        assert (f"world.split1.c{rank % 2}", 0, "allreduce") in seq_ops
        seqs.append([(c, q, n) for c, q, n in seq_ops if not c.startswith("world.split")])
        recv = ev[ev["kind"] == int(Kind.RECV)]
        assert recv["peer"].tolist() == [(rank - 1) % NP] and recv["nbytes"].tolist() == [80]
        assert (ev[ev["kind"] == int(Kind.SEND_ASYNC)]["peer"] == (rank + 1) % NP).all()
    assert all(s == seqs[0] for s in seqs)


# -- install / uninstall in one process (MPICH singleton, no mpiexec) -----------------------------
_SINGLETON = """
import json, sys
from distdiag.shim.recorder import Recorder
from distdiag.shim.hooks import mpi4py as hook
import distdiag.shim.hooks as hooks
rec = Recorder()
out = {}
if sys.argv[1] == "before":
    hook.install(rec, None)
    hook.uninstall()
    out["pending"] = list(hooks._waiting)
    from mpi4py import MPI
    out["world"] = type(MPI.COMM_WORLD).__module__
    out["request"] = type(MPI.Request).__name__
else:
    from mpi4py import MPI
    world, request = MPI.COMM_WORLD, MPI.Request
    hook.install(rec, None)  # mpi4py already imported: the hook applies at once
    out["swapped"] = MPI.COMM_WORLD is not world and type(MPI.COMM_WORLD).__module__ == hook.__name__
    n0 = sum(tb.n for tb in rec.buffers)
    MPI.COMM_WORLD.Barrier()
    n1 = sum(tb.n for tb in rec.buffers)
    world.Barrier()  # the name bound before install stays the plain object
    out["rows"] = [n0, n1, sum(tb.n for tb in rec.buffers)]
    hook.uninstall()
    out["restored"] = MPI.COMM_WORLD is world and MPI.Request is request
print(json.dumps(out))
"""


def _singleton(mode: str) -> dict[str, Any]:
    p = _run([sys.executable, "-c", _SINGLETON, mode])
    return json.loads(p.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_uninstall_before_import_leaves_mpi4py_untouched() -> None:
    out = _singleton("before")
    assert out == {"pending": [], "world": "mpi4py.MPI", "request": "type"}


def test_install_after_import_swaps_the_module_attributes_and_uninstall_puts_them_back() -> None:
    out = _singleton("after")
    assert out["swapped"] and out["restored"]
    n0, n1, n2 = out["rows"]
    assert n1 == n0 + 1 and n2 == n1


_GUEST = """
import json, logging, time, threading
from distdiag.shim.recorder import Recorder, HOT
from distdiag.shim.hooks import mpi4py as hook
logging.basicConfig(level=logging.DEBUG, format="LOG %(message)s")
rec = Recorder()
hook.install(rec, None)
from mpi4py import MPI
c = MPI.COMM_SELF
out = {"wrapper": type(type(c).__dict__["Barrier"]).__name__}
rows = lambda: sum(tb.n for tb in rec.buffers)
a = time.perf_counter_ns(); b = HOT.now_ns(); d = time.perf_counter_ns()
out["clock"] = a <= b <= d  # the rows' clock is the other hooks' (time.perf_counter_ns)
# the call's own error passes through as it is, and its row is still written
n0 = rows()
try:
    c.Bcast(bytearray(4), root=5)
except MPI.Exception as e:
    out["error"] = [type(e).__module__, e.Get_error_class()]
for comm, key in ((c, "type_error"), (hook._saved["COMM_SELF"], "plain_type_error")):
    try:
        comm.Barrier(1)
    except TypeError as e:
        out[key] = str(e)
out["rows_after_errors"] = rows() - n0
# distdiag's own failure (a communicator state it cannot read) costs the call nothing, records nothing
saved, c._dd = c._dd, object()
n0 = rows()
c.Barrier(); c.Barrier()
out["broken_state"] = rows() - n0
c._dd = saved
# a thread's rows: its own buffer, its own tid
t = threading.Thread(target=lambda: [c.Barrier() for _ in range(3)]); t.start(); t.join()
out["threads"] = sorted({tb.tid for tb in rec.buffers if tb.n})
print(json.dumps(out))
"""


def test_c_wrapper_passes_errors_through_and_survives_its_own_failures() -> None:
    from distdiag.shim.recorder import HOT

    if HOT is None:
        pytest.skip("distdiag.shim._hot is not built here")
    p = _run([sys.executable, "-c", _GUEST])
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["wrapper"] == "Call" and out["clock"]
    assert out["error"] == ["mpi4py.MPI", 7]  # MPI_ERR_ROOT, mpi4py's own class, as without us
    assert out["type_error"] == out["plain_type_error"]  # mpi4py's own message: the C wrapper has no signature
    assert out["rows_after_errors"] == 2  # both calls recorded, as the generic Python wrappers do
    assert out["broken_state"] == 0
    assert "bookkeeping failed in Barrier" in p.stderr and p.stderr.count("bookkeeping failed in Barrier") == 1
    assert len(out["threads"]) == 2


def _row_facts(r: RankOut) -> list[tuple[Any, ...]]:
    """A rank's rows without their times, strings resolved, sorted."""
    assert r.ev is not None
    return sorted(
        (int(e["kind"]), r.s(e["name_id"]), r.s(e["comm_id"]), int(e["seq"]), int(e["peer"]), int(e["nbytes"]), r.s(e["aux"]) if e["kind"] != Kind.COMM_CREATE else int(e["aux"]), r.s(e["site_id"]), int(e["tid"]))
        for e in r.ev
    )


def test_generic_fallback_wrappers_record_the_same_rows(wrapped: list[RankOut], generic: list[RankOut]) -> None:
    """The (*args, **kw) wrappers used when mpi4py's signatures differ: same rows as the generated ones."""
    for w, g in zip(wrapped, generic):
        assert w.results == g.results
        assert _row_facts(w) == _row_facts(g)


def test_c_wrappers_record_the_rows_the_python_wrappers_record(wrapped: list[RankOut], pywrapped: list[RankOut]) -> None:
    """Blocking collectives and sends go through distdiag/shim/_hot.c where it is built: the
    same rows, results and call sites as without it (DISTDIAG_HOT=0: the template's Python
    wrappers and a pure-Python thread buffer), and times in order."""
    from distdiag.shim.recorder import HOT

    if HOT is None:
        pytest.skip("distdiag.shim._hot is not built here: every wrapper is the Python one")
    assert [w.meta["barrier_wrapper"] for w in wrapped] == ["Call"] * NP  # the C path really ran
    assert [p.meta["barrier_wrapper"] for p in pywrapped] == ["function"] * NP
    for w, p in zip(wrapped, pywrapped):
        assert w.results == p.results
        assert _row_facts(w) == _row_facts(p)
        assert w.ev is not None
        assert (w.ev["t1_ns"] >= w.ev["t0_ns"]).all() and (w.ev["t0_ns"] > 0).all()
