"""Pickles mpi4py communicators, classes and requests (tests/test_shim_mpi_init.py).

``mpi_pickle_comm.py OUT``: each rank writes OUT/pickle-<rank>.json with the
outcome of each case: ``["ok", what came back]`` or ``["raise", type, message]``,
and whether a pickle of COMM_WORLD/COMM_SELF made here loads in a process that
runs no distdiag.
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import subprocess
import sys
from typing import Any, Callable

from mpi4py import MPI


def describe(v: Any) -> Any:
    if isinstance(v, type):
        return ["class", v.__name__, v is MPI.Intracomm, v is MPI.Request]
    if isinstance(v, MPI.Comm):
        return ["comm", type(v).__name__, v is MPI.COMM_WORLD, v is MPI.COMM_SELF, v is MPI.COMM_NULL,
                v == MPI.COMM_WORLD, v == MPI.COMM_SELF, bool(v)]  # fmt: skip
    if isinstance(v, MPI.Request):
        return ["request", type(v).__name__, bool(v)]
    return repr(v)


def outcome(fn: Callable[[], Any]) -> Any:
    try:
        v = fn()
    except Exception as e:
        return ["raise", type(e).__name__, str(e)]
    return ["ok", describe(v)]


def rt(o: Any) -> Callable[[], Any]:
    return lambda: pickle.loads(pickle.dumps(o))


world = MPI.COMM_WORLD
me = world.Get_rank()
dup = world.Dup()
second = MPI.Intracomm(MPI.COMM_WORLD)  # a second handle to mpi4py's constant
done = world.Isend(b"x", me, 5)
world.Recv(bytearray(1), me, 5)
done.Wait()
pending = world.Irecv(bytearray(1), me, 6)
out = {
    "world": outcome(rt(MPI.COMM_WORLD)),
    "self": outcome(rt(MPI.COMM_SELF)),
    "null": outcome(rt(MPI.COMM_NULL)),
    "dup": outcome(rt(dup)),
    "second": outcome(rt(second)),
    "comm_of_world": outcome(rt(MPI.Comm(MPI.COMM_WORLD))),
    "type_world": outcome(rt(type(MPI.COMM_WORLD))),
    "type_dup": outcome(rt(type(dup))),
    "Request": outcome(rt(MPI.Request)),
    "done_request": outcome(rt(done)),
    "pending_request": outcome(rt(pending)),
    "copy_world": outcome(lambda: copy.copy(MPI.COMM_WORLD)),
    "deepcopy_world": outcome(lambda: copy.deepcopy(MPI.COMM_WORLD)),
    "copy_second": outcome(lambda: copy.copy(second)),
    "checks": [isinstance(world, MPI.Intracomm), isinstance(world, MPI.Comm), isinstance(dup, MPI.Intracomm),
               issubclass(type(world), MPI.Intracomm), type(world).__name__, type(dup).__name__],  # fmt: skip
}
blob = pickle.dumps([MPI.COMM_WORLD, MPI.COMM_SELF, second])
code = (
    "import pickle, sys; from mpi4py import MPI; w, s, c = pickle.load(sys.stdin.buffer); "
    "print(w is MPI.COMM_WORLD, s is MPI.COMM_SELF, type(c).__name__, c == MPI.COMM_WORLD)"
)
env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI", "HYDRA", "MPI", "DISTDIAG"))}
p = subprocess.run([sys.executable, "-c", code], input=blob, capture_output=True, env=env, timeout=120)
out["elsewhere"] = [p.returncode, p.stdout.decode().strip(), "distdiag" in blob.decode("latin-1")]
pending.Cancel()
pending.Wait()
dup.Free()
with open(os.path.join(sys.argv[1], f"pickle-{me}.json"), "w") as f:
    json.dump(out, f, sort_keys=True)
