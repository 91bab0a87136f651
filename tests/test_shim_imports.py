"""The shim loads nothing into the program's process before the program's own imports.

Seen before: a script that sets ``OPENBLAS_NUM_THREADS=1`` before its own ``import
numpy`` got a 1-thread BLAS plain and a 2-thread one wrapped, because the shim had
imported numpy (and h5py, ctypes, pynvml) first. Now the rank file is claimed empty at
start and opened (numpy, h5py) at the first flush after the program's numpy import, or
when rows waiting pass a bound, or at exit (distdiag.shim.rankfile); until then the rows
go to a spill log, standard library only (distdiag.shim.spill). Real
wrapped processes throughout, each compared with the same program unwrapped.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
from helpers import single_process_env

from distdiag.rows import calls_of
from distdiag.schema import Kind

PY = sys.executable
WRAP = [PY, "-m", "distdiag.wrap"]
TIMEOUT_S = 60
#: third-party (and ctypes) modules a guest must not load before the program does
WATCHED = ("numpy", "h5py", "ctypes", "pynvml", "threadpoolctl", "mpi4py", "torch")


def _run(cmd: list[str], cwd: Path, **extra: str) -> subprocess.CompletedProcess[str]:
    # the in-process writer's opening (writer = "thread"): a helper process loads nothing here at all
    env = single_process_env(**{"DISTDIAG_OPEN_FILE_AT": "numpy", "DISTDIAG_WRITER": "thread", **extra})
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


def _rank_file(run_dir: Path) -> tuple[np.ndarray, list[str], dict[str, Any]]:
    with h5py.File(run_dir / "rank-00000.h5", "r") as f:
        return f["events"][:], list(f["strings"].asstr()[:]), dict(f.attrs)


BLAS = f"""
import json, os, sys
first = sorted(m for m in {WATCHED!r} if m in sys.modules)
os.environ["OPENBLAS_NUM_THREADS"] = "1"  # what the program chooses before its import
os.environ["OMP_NUM_THREADS"] = "1"
import numpy
from threadpoolctl import threadpool_info
blas = sorted((i["internal_api"], i["num_threads"]) for i in threadpool_info())
print(json.dumps({{"first": first, "blas": blas}}))
"""


@pytest.mark.parametrize("writer,capture", [("thread", "python"), ("process", "python"), ("thread", "preload")])
def test_what_the_program_sets_before_its_numpy_import_holds(tmp_path: Path, writer: str, capture: str) -> None:
    """With the libc interposer too (``preload``): the shim's own import of h5py, made in the
    program's thread while the recorder is muted, was recorded from libc as the program's I/O."""
    prog = tmp_path / "blas.py"
    prog.write_text(BLAS)
    # the environment the job was launched with says 3: only the program's own setting may win
    outer = {"OPENBLAS_NUM_THREADS": "3", "OMP_NUM_THREADS": "3", "DISTDIAG_FLUSH_INTERVAL_S": "0.2",
             "DISTDIAG_WRITER": writer, "DISTDIAG_HOOKS": f"preload={int(capture == 'preload')}"}  # fmt: skip
    plain = _run([PY, str(prog)], tmp_path, **outer)
    wrapped = _run([*WRAP, "--dir", str(tmp_path / "run"), PY, str(prog)], tmp_path, **outer)
    assert plain.returncode == 0 and wrapped.returncode == 0, (plain.stderr, wrapped.stderr)
    p, w = json.loads(plain.stdout), json.loads(wrapped.stdout)
    assert w == p
    assert w["first"] == []
    assert w["blas"] and all(n == 1 for _, n in w["blas"]), w["blas"]
    ev, strings, attrs = _rank_file(tmp_path / "run")
    assert bool(attrs["closed_cleanly"]) and attrs["file_opened_on"] in {"thread": ("numpy", "exit"), "process": ("helper",)}[writer]
    assert attrs["fileio_capture"] == capture
    opened = [strings[i] for i in ev["name_id"][ev["kind"] == Kind.FILE_OPEN]]
    # the program's own import of numpy is its I/O; h5py's (the shim's file) is not
    assert any("/numpy/" in s for s in opened)
    assert not any("/h5py/" in s for s in opened), [s for s in opened if "/h5py/" in s][:3]


NO_NUMPY = """
import os, sys
for i in range(500):
    os.path.exists(f"/nonexistent-distdiag-{i}")
print(sorted(m for m in ("numpy", "h5py") if m in sys.modules), flush=True)
end = sys.argv[1]
if end == "exit3":
    sys.exit(3)
if end == "interrupt":
    raise KeyboardInterrupt
if end == "h5py":  # the program's own h5py, imported after the wrapper's exit handler
    import h5py
    with h5py.File(sys.argv[2], "w") as f:
        f["names"] = ["a", "bc"]  # variable-length strings: h5py's converters
"""


def test_a_program_that_never_imports_numpy_ends_as_unwrapped_and_its_file_is_written_at_exit(tmp_path: Path) -> None:
    """Seen on the way: importing numpy inside the exit handler turned a Ctrl-C's -2 into 1,
    and h5py imported there left HDF5's C exit handler calling into the finalized interpreter
    (a segfault, 139, at every such exit); a program's own h5py import made the final flush
    fail ("Operation not defined for data type class")."""
    prog = tmp_path / "prog.py"
    prog.write_text(NO_NUMPY)
    for end, want in (("end", 0), ("exit3", 3), ("interrupt", -signal.SIGINT), ("h5py", 0)):
        mine = tmp_path / f"mine-{end}.h5"
        run_dir = tmp_path / f"run-{end}"
        slow = {"DISTDIAG_FLUSH_INTERVAL_S": "30"}  # no flush before the end: the file opens at exit
        plain = _run([PY, str(prog), end, str(mine)], tmp_path, **slow)
        mine.unlink(missing_ok=True)
        wrapped = _run([*WRAP, "--dir", str(run_dir), PY, str(prog), end, str(mine)], tmp_path, **slow)
        assert (wrapped.returncode, wrapped.stdout, wrapped.stderr) == (plain.returncode, plain.stdout, plain.stderr)
        assert plain.returncode == want
        assert wrapped.stdout.startswith("[]")  # neither numpy nor h5py before the program's end
        ev, strings, attrs = _rank_file(run_dir)
        assert bool(attrs["closed_cleanly"]), (end, attrs)
        assert int(attrs["exit_code"]) == want and attrs["file_opened_on"] == "exit"
        stats = [strings[i] for i in ev["name_id"][ev["kind"] == Kind.FILE_STAT]]
        assert sum(s.startswith("/nonexistent-distdiag-") for s in stats) == 500
        if end == "h5py":
            with h5py.File(mine, "r") as f:
                assert list(f["names"].asstr()[:]) == ["a", "bc"]


MANY_ROWS = """
import os, sys, time
path = sys.argv[1]
for i in range(300_000):  # a row each with either capture (the interposer sums fast stats, not opens)
    os.close(os.open("/", os.O_RDONLY))
deadline = time.monotonic() + 20
while os.stat(path).st_size == 0 and time.monotonic() < deadline:  # the flusher opens it meanwhile
    time.sleep(0.05)
print(os.stat(path).st_size > 0, "numpy" in sys.modules, flush=True)
"""


def test_rows_waiting_for_the_numpy_import_are_bounded(tmp_path: Path) -> None:
    """A program that records many rows and never imports numpy: the file opens once 8 MiB of
    rows wait (not at exit, with every row kept in memory until then) and loses none."""
    prog = tmp_path / "many.py"
    prog.write_text(MANY_ROWS)
    run_dir = tmp_path / "run"
    p = _run([*WRAP, "--dir", str(run_dir), PY, str(prog), str(run_dir / "rank-00000.h5")], tmp_path,
             DISTDIAG_FLUSH_INTERVAL_S="0.2")  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["True", "True"]  # written while the program ran; numpy came with it
    ev, strings, attrs = _rank_file(run_dir)
    assert attrs["file_opened_on"] == "memory" and int(attrs["lost_events"]) == 0
    names = [strings.index(n) for n in ("/", "/*") if n in strings]  # "/*": calls a full ring summed
    opens = ev[(ev["kind"] == Kind.FILE_OPEN) & np.isin(ev["name_id"], names)]
    assert int(calls_of(opens).sum()) >= 300_000


FORK_AFTER_NUMPY = """
import os, signal, sys, time
import numpy  # the rank file opens at the next flush (every 5 ms here)
pids = []
for k in range(60):  # forks every ~1 ms, all through the file's opening
    pid = os.fork()
    if pid == 0:
        import h5py  # a DataLoader worker that reads HDF5
        os._exit(0)
    pids.append(pid)
    time.sleep(0.001)
deadline = time.monotonic() + 20
while pids and time.monotonic() < deadline:
    pids = [p for p in pids if os.waitpid(p, os.WNOHANG)[0] == 0]
    time.sleep(0.01)
for p in pids:  # hung: our own children, by their PIDs
    os.kill(p, signal.SIGKILL)
    os.waitpid(p, 0)
print("hung", len(pids))
"""


def test_a_child_forked_while_the_file_opens_can_import_h5py(tmp_path: Path) -> None:
    """The file opens (h5py) right after the program's numpy import; a child forked while an
    import of h5py was under way on the flusher thread inherited its module locks, held by
    a thread the child does not have, and its own ``import h5py`` waited forever (seen: 2
    hangs in 10 runs of a fork test). The writer's modules are imported in the thread that
    imported numpy, so no import of ours is ever under way at a fork."""
    prog = tmp_path / "fork.py"
    prog.write_text(FORK_AFTER_NUMPY)
    p = _run([*WRAP, "--dir", str(tmp_path / "run"), PY, str(prog)], tmp_path, DISTDIAG_FLUSH_INTERVAL_S="0.005")
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split() == ["hung", "0"], p.stdout
