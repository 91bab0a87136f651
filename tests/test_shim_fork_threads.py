"""Forks and threads under the shim, with real processes (issue 17, its High findings 1-3).

* a forked child never writes the parent's rank file: the child ends by
  ``sys.exit``, by the end of the program, under ``pty.fork``, or after
  writing an HDF5 file of its own, while the parent appends 40k rows, then the
  parent is SIGKILLed: the rank file still reads, with every row the parent
  flushed; and a program the rank execs (``subprocess``, with and without
  ``preexec_fn``) never holds the rank file's descriptor;
* what a forked child records goes to a file of its own,
  ``rank-NNNNN.fork-PID.h5``, with bounded memory: a child's 1M ``stat``
  calls, and the reads of a real torch DataLoader's two workers (which end by
  ``os._exit``);
* 1,500 short-lived threads that each record a few calls: every thread's
  rows are in the file, and the resident memory stays near the plain run's
  (each thread used to keep a 1.1 MB chunk for good).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
from helpers import single_process_env, stat_calls, wait_until_closed

from distdiag.schema import Kind

PY = sys.executable
WRAP = [PY, "-m", "distdiag.wrap"]
TIMEOUT_S = 120

def env(**extra: str) -> dict[str, str]:
    return single_process_env(**{"OMP_NUM_THREADS": "1", **extra})


def run(cmd: list[str], cwd: Path, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, env=env(**extra), capture_output=True, text=True, timeout=TIMEOUT_S)


def read(path: Path) -> tuple[np.ndarray, list[str], dict[str, Any]]:
    with h5py.File(path, "r") as f:
        return f["events"][:], list(f["strings"].asstr()[:]), dict(f.attrs)


def named(ev: np.ndarray, strings: list[str], kind: int, prefix: str) -> np.ndarray:
    """Rows of ``kind`` whose name starts with ``prefix``."""
    ok = np.array([strings[i].startswith(prefix) for i in ev["name_id"]], bool) if len(ev) else np.zeros(0, bool)
    return ev[(ev["kind"] == kind) & ok]


# -- 1: a forked child never writes the parent's rank file ----------------------------------

FORK_THEN_KILL = """
import os, signal, sys, time
import numpy  # the rank file is open (HDF5) from the first flush after this: the child inherits it
tmp, how = sys.argv[1], sys.argv[2]
target = os.path.join(tmp, "target")
open(target, "w").close()
if how == "pty":
    import pty
    pid, _fd = pty.fork()
else:
    pid = os.fork()
if pid == 0:
    time.sleep(1.6)  # the parent appends and flushes meanwhile
    if how == "h5py_then_exit":
        import h5py  # the child's own HDF5 files still work
        with h5py.File(os.path.join(tmp, "child.h5"), "w") as f:
            f["x"] = [1, 2, 3]
        sys.exit(0)
    if how == "sys_exit":
        sys.exit(0)
    # "end", "pty": the child runs off the end of the program
else:
    for i in range(40000):
        os.stat(target)
    os.waitpid(pid, 0)
    time.sleep(0.3)  # one more flush after the child is gone
    os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("how", ["sys_exit", "end", "pty", "h5py_then_exit"])
@pytest.mark.parametrize("writer", ["process", "thread"])
def test_a_forked_child_ending_normally_leaves_the_parents_file_readable(tmp_path: Path, how: str, writer: str) -> None:
    """Seen before: the child's exit closed its inherited HDF5 handle and wrote its stale
    metadata into the parent's file (``bad heap index`` or ``addr overflow`` on reading).
    ``writer``: the file written by a helper process (the default: the child inherits no HDF5
    handle, only the pipe, which it closes) or by the process's own thread."""
    prog = tmp_path / "prog.py"
    prog.write_text(FORK_THEN_KILL)
    run_dir = tmp_path / "run"
    p = run([*WRAP, "--dir", str(run_dir), PY, str(prog), str(tmp_path), how], tmp_path,
            DISTDIAG_FLUSH_INTERVAL_S="0.2", DISTDIAG_WRITER=writer)  # fmt: skip
    assert p.returncode == -signal.SIGKILL, p.stderr
    assert p.stderr == ""  # the child's HDF5 said nothing either
    wait_until_closed(run_dir / "rank-00000.h5")  # the helper writes the killed rank's last flush
    ev, strings, attrs = read(run_dir / "rank-00000.h5")
    assert stat_calls(ev, strings, str(tmp_path / "target")) == 40000
    assert not bool(attrs["closed_cleanly"])  # SIGKILLed: the file is as the last flush left it
    from distdiag.run import load_run

    run_ = load_run(run_dir)
    assert list(run_.rank_ids) == [0] and not [w for w in run_.warnings if "rank-00000" in w], run_.warnings
    forks = list(run_dir.glob("rank-00000.fork-*"))
    if how == "h5py_then_exit":
        with h5py.File(tmp_path / "child.h5", "r") as f:
            assert list(f["x"][:]) == [1, 2, 3]
        # what the child did is its own file's: the h5py open and close of child.h5
        assert len(forks) == 1
        cev, cstrings, _ = read(forks[0])
        opens = named(cev, cstrings, Kind.FILE_OPEN, str(tmp_path / "child.h5"))
        # one that succeeded (the libc interposer also sees HDF5's first try, failed: ENOENT)
        assert int((opens["value"] == 0).sum()) == 1, opens
    else:
        assert not forks, "a child that recorded nothing leaves no file"


EXEC_FDS = """
import os, subprocess, sys
show = '''
import os
out = []
for f in os.listdir("/proc/self/fd"):
    try:
        out.append(os.readlink("/proc/self/fd/" + f))
    except OSError:  # the listing's own descriptor, closed by now
        pass
print(sorted(q for q in out if not q.startswith(("pipe:", "/dev/"))))
'''
for pre in (None, lambda: None):  # without / with preexec_fn (the at-fork handlers run only with it)
    p = subprocess.run([sys.executable, "-c", show], close_fds=False, preexec_fn=pre, capture_output=True, text=True)
    print(p.stdout.strip())
"""


def test_a_program_the_rank_starts_never_holds_its_rank_file(tmp_path: Path) -> None:
    """The rank file's descriptor is close-on-exec (it was inheritable: HDF5 opens without
    O_CLOEXEC), and a preexec_fn child's redirected copy is too."""
    prog = tmp_path / "prog.py"
    prog.write_text(EXEC_FDS)
    run_dir = tmp_path / "run"
    p = run([*WRAP, "--dir", str(run_dir), PY, str(prog)], tmp_path)
    assert p.returncode == 0 and p.stderr == "", p.stderr
    lines = p.stdout.splitlines()
    assert len(lines) == 2 and all(line.startswith("[") for line in lines), p.stdout
    for line in lines:
        assert str(run_dir) not in line and "memfd:" not in line, line
    assert p.stdout == run([PY, str(prog)], tmp_path).stdout  # the same descriptors as unwrapped


FORK_DURING_SHIM_IMPORT = """
import os, signal, sys, time
import numpy  # the shim's NVML starter begins its imports (pynvml, ctypes.util, subprocess) in the background
pids = []
for i in range(40):  # forks spread over the ~0.4 s those imports take
    pid = os.fork()
    if pid == 0:
        signal.alarm(5)  # a child whose import waits forever dies of SIGALRM
        try:
            import pynvml  # nvidia-ml-py ('.[all]'); without it the starter's import fails at once
        except ImportError:
            pass
        import ctypes.util, subprocess, platform
        os._exit(0)
    pids.append(pid)
    time.sleep(0.01)
hung = [pid for pid in pids if os.waitpid(pid, 0)[1] != 0]
print(len(hung), "of", len(pids), "children hung")
"""


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_a_child_forked_while_a_shim_thread_imports_imports_normally(tmp_path: Path, writer: str) -> None:
    """Seen before: 1-2 of 30 children forked in the 0.3 s after ``import numpy`` inherited the
    module locks of the NVML starter's import under way, held by a thread the child does not
    have, and their own ``import subprocess`` waited forever (distdiag.shim.forkimports)."""
    prog = tmp_path / "prog.py"
    prog.write_text(FORK_DURING_SHIM_IMPORT)
    p = run([*WRAP, "--dir", str(tmp_path / "run"), PY, str(prog)], tmp_path, DISTDIAG_WRITER=writer)
    assert p.returncode == 0, p.stderr
    assert p.stdout == "0 of 40 children hung\n", p.stderr
    plain = run([PY, str(prog)], tmp_path)
    assert plain.stdout == "0 of 40 children hung\n", plain.stderr


# -- 2: a forked child's I/O goes to a file of its own, bounded -------------------------------

CHILD_STATS = """
import os, sys, time
import numpy  # as a DataLoader worker's parent has (torch): the child's file opens at once
tmp, n1, n2, end, run_dir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
cdir, pdir = os.path.join(tmp, "c"), os.path.join(tmp, "p")
os.makedirs(cdir); os.makedirs(pdir)
paths = [os.path.join(cdir, f"f{i}") for i in range(1000)]
for q in paths:
    open(q, "w").close()
open(os.path.join(pdir, "mine"), "w").close()

def rss_kib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024

r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(r)
    for i in range(n1):
        os.stat(paths[i % 1000])
    mine = os.path.join(run_dir, f"rank-00000.fork-{os.getpid()}.h5")
    for _ in range(100):  # wrapped: once the child's file exists, its writer's memory is in
        if run_dir == "-" or os.path.exists(mine):
            break
        time.sleep(0.1)
    time.sleep(0.3 if run_dir != "-" else 0)
    at_n1 = rss_kib()
    for i in range(n1, n2):
        os.stat(paths[i % 1000])
    grew = rss_kib() - at_n1
    os.write(w, f"{os.getpid()} {grew}\\n".encode())
    os.close(w)
    if end == "os_exit":
        os._exit(3)  # as multiprocessing's workers end
    sys.exit(3)
os.close(w)
for i in range(100):
    os.stat(os.path.join(pdir, "mine"))
with os.fdopen(r) as f:
    cpid, grew = f.read().split()
_, status = os.waitpid(pid, 0)
print(cpid, grew, os.waitstatus_to_exitcode(status))
"""


@pytest.mark.parametrize("end,capture", [("sys_exit", "python"), ("os_exit", "python"), ("os_exit", "preload")])
def test_a_forked_childs_file_io_goes_to_its_own_file_with_bounded_memory(tmp_path: Path, end: str, capture: str) -> None:
    """Seen before: a child's 300k stat calls stayed in its memory (18 chunks, 114 MB RSS) and
    were never written. Now they are in rank-00000.fork-PID.h5, and the child's memory does not
    grow with its rows: over its last 750k calls (52 MB of rows) it grows by about what the
    plain child's does (measured here: the same program unwrapped). With the libc interposer
    every call is counted too: those its ring had no slot for while the drainer waited for a
    core are summed (rows of ``seq`` calls, named ``<dir>/*``; 1,049 were lost before, beside
    the suite and a busy core)."""
    n1, n2 = 250_000, 1_000_000
    prog = tmp_path / "prog.py"
    prog.write_text(CHILD_STATS)
    (tmp_path / "w").mkdir()
    (tmp_path / "u").mkdir()
    run_dir = tmp_path / "run"
    p = run([*WRAP, "--dir", str(run_dir), PY, str(prog), str(tmp_path / "w"), str(n1), str(n2), end, str(run_dir)],
            tmp_path, DISTDIAG_FLUSH_INTERVAL_S="0.2", DISTDIAG_HOOKS=f"preload={int(capture == 'preload')}")  # fmt: skip
    assert p.returncode == 0 and p.stderr == "", p.stderr
    cpid, grew_kib, child_rc = (int(x) for x in p.stdout.split())
    assert child_rc == 3
    plain = run([PY, str(prog), str(tmp_path / "u"), str(n1), str(n2), end, "-"], tmp_path)
    plain_grew_kib = int(plain.stdout.split()[1])
    rows_kib = (n2 - n1) * 69 // 1024
    print(f"child RSS over {n2 - n1} calls ({rows_kib / 1024:.0f} MiB of rows): +{grew_kib / 1024:.1f} MiB "
          f"wrapped, +{plain_grew_kib / 1024:.1f} MiB plain")  # fmt: skip
    assert grew_kib < plain_grew_kib + rows_kib // 3

    fork_file = run_dir / f"rank-00000.fork-{cpid}.h5"
    assert sorted(q.name for q in run_dir.glob("rank-*")) == sorted(["rank-00000.h5", fork_file.name])
    ev, strings, attrs = read(fork_file)
    cstats = named(ev, strings, Kind.FILE_STAT, str(tmp_path / "w" / "c") + "/")
    calls = np.maximum(cstats["seq"], 1)
    summed = str(tmp_path / "w" / "c" / "*")
    print(f"{len(cstats)} rows, {int(calls[calls > 1].sum())} calls summed in {int((calls > 1).sum())} of them")
    assert int(calls.sum()) == n2
    assert len({strings[i] for i in cstats["name_id"]} - {summed}) == 1000
    assert (int(attrs["rank"]), int(attrs["pid"]), int(attrs["exit_code"])) == (0, cpid, 3)
    assert bool(attrs["closed_cleanly"]) and int(attrs["lost_events"]) == 0
    assert int(attrs["forked_from_pid"]) != cpid
    assert len(strings) < 1100  # the child's own strings, not the parent's whole table
    assert not len(named(ev, strings, Kind.FILE_STAT, str(tmp_path / "w" / "p")))

    pev, pstrings, pattrs = read(run_dir / "rank-00000.h5")
    assert pattrs["fileio_capture"] == capture
    assert int(pattrs["pid"]) == int(attrs["forked_from_pid"])
    assert len(named(pev, pstrings, Kind.FILE_STAT, str(tmp_path / "w" / "p" / "mine"))) == 100
    assert not len(named(pev, pstrings, Kind.FILE_STAT, str(tmp_path / "w" / "c") + "/"))
    from distdiag.run import load_run

    r = load_run(run_dir)  # the child's file is no second rank 0
    assert list(r.rank_ids) == [0] and not r.warnings, r.warnings


DATALOADER_JOB = """
import os, sys
import torch
from torch.utils.data import DataLoader, Dataset

d = sys.argv[1]
names = [os.path.join(d, f"s{i}.bin") for i in range(64)]
for i, q in enumerate(names):
    with open(q, "wb") as f:
        f.write(bytes([i]) * 1000)

class Files(Dataset):
    def __len__(self):
        return len(names)
    def __getitem__(self, i):
        with open(names[i], "rb") as f:
            return torch.tensor(len(f.read()))

total = sum(int(b.sum()) for b in DataLoader(Files(), batch_size=8, num_workers=2,
                                             multiprocessing_context="fork"))
print(total)
"""


def test_dataloader_workers_reads_are_in_their_own_files(tmp_path: Path) -> None:
    """Every torch DataLoader worker is a forked child: its dataset reads used to be lost."""
    pytest.importorskip("torch")
    prog = tmp_path / "dl.py"
    prog.write_text(DATALOADER_JOB)
    data = tmp_path / "data"
    data.mkdir()
    run_dir = tmp_path / "run"
    p = run([*WRAP, "--dir", str(run_dir), PY, str(prog), str(data)], tmp_path, DISTDIAG_FLUSH_INTERVAL_S="0.2")
    assert p.returncode == 0 and p.stdout == "64000\n", p.stderr
    workers = sorted(run_dir.glob("rank-00000.fork-*.h5"))
    assert len(workers) == 2, sorted(q.name for q in run_dir.iterdir())
    opened: list[str] = []
    for w in workers:
        ev, strings, attrs = read(w)
        assert bool(attrs["closed_cleanly"]) and int(attrs["exit_code"]) == 0
        opened += [strings[i] for i in named(ev, strings, Kind.FILE_OPEN, str(data) + "/")["name_id"]]
    assert sorted(opened) == sorted(str(data / f"s{i}.bin") for i in range(64))  # each sample's read, once


# -- 3: short-lived threads ----------------------------------------------------------------------

THREADS = """
import os, sys, threading, time
tmp, n = sys.argv[1], int(sys.argv[2])
paths = [os.path.join(tmp, f"t{i}") for i in range(n)]

def work(i):
    for _ in range(3):
        os.path.exists(paths[i])  # a stat each: no such file, still a metadata call

for wave in range(0, n, 50):
    ts = [threading.Thread(target=work, args=(i,)) for i in range(wave, min(n, wave + 50))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
from distdiag.shim import recorder
rec = recorder.RECORDER
for _ in range(100):  # a flush or two after the last thread ended
    if rec is None or len(rec.buffers) < 10:
        break
    time.sleep(0.1)
with open("/proc/self/status") as f:  # this process's peak (ru_maxrss would hold the parent's before exec)
    peak_kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
print(peak_kib, -1 if rec is None else len(rec.buffers))
"""


def test_short_lived_threads_keep_memory_bounded_and_every_row(tmp_path: Path) -> None:
    """Seen before: 1,500 threads -> 1,678 MB RSS wrapped against 28 MB plain."""
    n = 1500
    prog = tmp_path / "threads.py"
    prog.write_text(THREADS)
    run_dir = tmp_path / "run"
    rss: dict[tuple[bool, int], int] = {}
    for wrapped in (False, True):
        for k in (0, n):
            d = tmp_path / f"{'w' if wrapped else 'p'}{k}"
            d.mkdir()
            cmd = [*WRAP, "--dir", str(run_dir if k else tmp_path / "run0"), PY] if wrapped else [PY]
            p = run([*cmd, str(prog), str(d), str(k)], tmp_path, DISTDIAG_FLUSH_INTERVAL_S="0.2")
            assert p.returncode == 0 and p.stderr == "", p.stderr
            peak, buffers = (int(x) for x in p.stdout.split())
            rss[(wrapped, k)] = peak
            if wrapped and k:
                assert buffers < 10, buffers  # the ended threads' buffers are gone
    plain_kib = rss[(False, n)] - rss[(False, 0)]
    wrapped_kib = rss[(True, n)] - rss[(True, 0)]
    print(f"{n} threads: peak RSS +{wrapped_kib / 1024:.1f} MiB wrapped, +{plain_kib / 1024:.1f} MiB plain "
          f"(wrapped {rss[(True, n)] / 1024:.0f} MiB, plain {rss[(False, n)] / 1024:.0f} MiB)")  # fmt: skip
    assert wrapped_kib < plain_kib + 48 * 1024, rss
    ev, strings, _ = read(run_dir / "rank-00000.h5")
    rows = named(ev, strings, Kind.FILE_STAT, str(tmp_path / f"w{n}") + "/")
    by_path: dict[str, set[int]] = {}
    counts: dict[str, int] = {}
    for nid, tid in zip(rows["name_id"].tolist(), rows["tid"].tolist()):
        by_path.setdefault(strings[nid], set()).add(tid)
        counts[strings[nid]] = counts.get(strings[nid], 0) + 1
    assert len(by_path) == n and set(counts.values()) == {3}  # every thread's three calls
    assert all(len(t) == 1 for t in by_path.values())  # each from its one thread
    assert len({next(iter(t)) for t in by_path.values()}) == n


def test_the_writers_string_columns_agree_with_the_loaders() -> None:
    """A forked child's file renumbers its string ids with the loader's list of id columns."""
    from distdiag import run as run_mod
    from distdiag.shim import writer

    assert writer.STRING_COLUMNS == run_mod.STRING_COLUMNS
    assert writer.AUX_STRING_KINDS == {int(k) for k in run_mod._AUX_STRING_KINDS}


def test_a_forked_childs_strings_are_renumbered_on_write(tmp_path: Path) -> None:
    """The compact string table of a child's file: every row's names read back as recorded."""
    from distdiag.shim.config import ShimConfig
    from distdiag.shim.recorder import Recorder
    from distdiag.shim.writer import Writer, base_attrs

    rec = Recorder(chunk_rows=64)
    for i in range(500):
        rec.intern(f"parent{i}")  # what the parent interned before the fork
    w = Writer(tmp_path / "c.h5", rec, ShimConfig(), base_attrs(), compact_strings=True)
    rec.add(1, 2, Kind.FILE_STAT, rec.intern("/a"), aux=rec.intern("ext4:/"), site_id=rec.intern("x.py:3"))
    rec.add(3, 4, Kind.MARK, rec.intern("parent7"), aux=12345)  # a MARK's aux is no string id
    w.flush()
    rec.add(5, 6, Kind.FILE_OPEN, rec.intern("/b"), aux=rec.intern("ext4:/"), site_id=rec.intern("x.py:3"))
    w.close(0)
    ev, strings, _ = read(tmp_path / "c.h5")
    assert strings[0] == "" and len(strings) == 6
    assert [strings[i] for i in ev["name_id"]] == ["/a", "parent7", "/b"]
    assert [strings[i] for i in ev["site_id"]] == ["x.py:3", "", "x.py:3"]
    assert strings[ev["aux"][0]] == strings[ev["aux"][2]] == "ext4:/" and ev["aux"][1] == 12345


def test_prune_keeps_a_young_threads_rows_across_growing_chunks(tmp_path: Path) -> None:
    """A thread's chunks grow (64, 256, ... rows); a flusher racing it writes every row once,
    and the buffers of the threads that ended are gone after a flush."""
    import threading

    from distdiag.shim.config import ShimConfig
    from distdiag.shim.recorder import Recorder
    from distdiag.shim.writer import Writer, base_attrs

    rec = Recorder(chunk_rows=16384, max_pending_chunks=100000)
    w = Writer(tmp_path / "g.h5", rec, ShimConfig(flush_interval_s=0.0005), base_attrs())
    w.start()
    n = 40000

    def work(k: int) -> None:
        for i in range(n):
            rec.add(i, i + 1, Kind.MARK, 0, seq=i, aux=k)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    w.flush()
    assert len(rec.buffers) == 0  # all four threads ended
    w.close(0)
    with h5py.File(tmp_path / "g.h5", "r") as f:
        ev = f["events"][:]
    assert len(ev) == 4 * n
    for k in range(4):
        np.testing.assert_array_equal(np.sort(ev["seq"][ev["aux"] == k]), np.arange(n))
