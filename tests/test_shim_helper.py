"""The rank file written by a helper process (``writer = "process"``, distdiag.shim.helper;
issue 17: a hung file system never holds the job's exit, a SIGKILLed rank's file is complete
by construction, nothing of numpy or h5py in the program's process).

Real parts: the slow FUSE server of tests/slowfs.py, stopped with SIGSTOP to make a *hung*
server (every call on the mount then waits for an answer that never comes), real wrapped
processes, SIGKILLs by PID, a real 8 MiB tmpfs for the full disk.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
from helpers import holders, small_tmpfs, single_process_env, stat_calls, wait_until_closed
from sigkill import kill_once
from slowfs import SERVERS, fuse_available, mount_slowfs

from distdiag.run import open_rank_file
from distdiag.schema import Kind

PY = sys.executable
REPO = Path(__file__).resolve().parent.parent
BOUND_S = 2.0

#: marks, one flush, then the program's end once the test says so (the go file)
HUNG_JOB = """\
import os, sys, time
import distdiag
for i in range(20_000):
    distdiag.mark("tick")
print("ready", flush=True)
go = sys.argv[1]
while not os.path.exists(go):
    time.sleep(0.01)
print("end", time.monotonic(), flush=True)  # the program's end: the exit starts here
"""


def _start(tmp: Path, run_dir: Path, writer: str) -> tuple[subprocess.Popen[str], Path]:
    job = tmp / "job.py"
    job.write_text(HUNG_JOB)
    go = tmp / f"go-{writer}"
    env = single_process_env(DISTDIAG_WRITER=writer, DISTDIAG_EXIT_TIMEOUT_S=str(BOUND_S),
                             DISTDIAG_FLUSH_INTERVAL_S="0.1")  # fmt: skip
    p = subprocess.Popen([PY, "-m", "distdiag.wrap", "--dir", str(run_dir), PY, str(job), str(go)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert p.stdout is not None
    assert p.stdout.readline().split() == ["ready"]
    files = (run_dir / "rank-00000.h5", run_dir / "rank-00000.h5.log")  # the thread's spill log until numpy
    end = time.monotonic() + 30
    while not any(f.exists() and f.stat().st_size > 0 for f in files):  # the first flush reached the disk
        assert time.monotonic() < end and p.poll() is None
        time.sleep(0.02)
    return p, go


def _end_s(p: subprocess.Popen[str], wait_s: float) -> float | None:
    """Seconds from the program's end to the process's end, None if it is still there after ``wait_s``."""
    assert p.stdout is not None
    words = p.stdout.readline().split()
    assert words[:1] == ["end"], words
    try:
        p.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        return None
    return time.monotonic() - float(words[1])  # CLOCK_MONOTONIC: one clock for both processes


def test_a_hung_file_system_never_holds_the_exit_and_the_file_completes_once_it_answers(tmp_path: Path) -> None:
    why = fuse_available()
    if why:
        pytest.skip(why)
    backing = tmp_path / "backing"
    backing.mkdir()
    with mount_slowfs(backing, tmp_path / "mnt", latency_ms=0.0) as mnt:
        server = SERVERS[str(mnt)]
        # the fault is real: a rank whose own process holds the file (writer = "thread") hangs at exit
        p, go = _start(tmp_path, mnt / "run-thread", "thread")
        os.kill(server, signal.SIGSTOP)  # the test's own server process, by its PID
        try:
            go.touch()
            assert _end_s(p, BOUND_S + 3.0) is None, "a hung server did not hold the in-process writer's exit"
        finally:
            os.kill(server, signal.SIGCONT)
        p.communicate(timeout=60)
        assert p.returncode == 0

        p, go = _start(tmp_path, mnt / "run", "process")
        os.kill(server, signal.SIGSTOP)
        try:
            go.touch()
            exit_s = _end_s(p, 30.0)
            _, err = p.communicate(timeout=10)
        finally:
            os.kill(server, signal.SIGCONT)
        print(f"exit took {exit_s} s with the server hung, exit_timeout_s={BOUND_S:g}")
        assert exit_s is not None and exit_s < BOUND_S + 1.5, (exit_s, err)
        assert p.returncode == 0, err
        assert "helper did not finish within exit_timeout_s=2" in err, err
        # the server answers again: the helper writes the last flush and closes the file
        f = mnt / "run" / "rank-00000.h5"
        wait_until_closed(f)
        with h5py.File(f, "r") as h:
            ev = h["events"][:]
            assert bool(h.attrs["closed_cleanly"]) and int(h.attrs["exit_code"]) == 0
            assert int((ev["kind"] == Kind.MARK).sum()) == 20_000
            assert h.attrs["file_opened_on"] == "helper"


def _loaded(pid: int) -> set[str]:
    """Which of numpy and libhdf5 process ``pid`` has loaded (its memory maps)."""
    maps = Path(f"/proc/{pid}/maps").read_text()
    return {name for name, mark in (("numpy", "_multiarray_umath"), ("hdf5", "libhdf5")) if mark in maps}


@pytest.mark.parametrize("open_after_s,budget", [("30", "0"), ("0.3", "0"), ("30", str(5 << 19))])
def test_the_helper_loads_nothing_while_the_job_starts(tmp_path: Path, open_after_s: str, budget: str) -> None:
    """Opening the HDF5 file imports numpy and h5py into the helper (~0.3 s of CPU a rank): at its
    first flush, one second in, that competed with the job's own start-up (measured: 4 ranks on 2
    cores ran a 0.2 s start 0.04-0.1 s slower wrapped). The helper now appends the flushes to the
    spill log, readable as the rank's file meanwhile, until ``helper_open_after_s`` of the rank's
    run (the 0.3 s twin: opened by then), until the log holds half the recording budget (the
    2.5 MiB twin: 20,000 rows, 1.4 MB, open it at once, and all of them fit under the budget's
    reserve) or its end; the file then holds every row, the log gone."""
    job = tmp_path / "job.py"
    job.write_text(HUNG_JOB)
    go, run_dir = tmp_path / "go", tmp_path / "run"
    env = single_process_env(DISTDIAG_WRITER="process", DISTDIAG_FLUSH_INTERVAL_S="0.1",
                             DISTDIAG_HELPER_OPEN_AFTER_S=open_after_s, DISTDIAG_MAX_FILE_BYTES=budget)  # fmt: skip
    p = subprocess.Popen([PY, "-m", "distdiag.wrap", "--dir", str(run_dir), PY, str(job), str(go)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert p.stdout is not None and p.stdout.readline().split() == ["ready"]
        f, lg = run_dir / "rank-00000.h5", run_dir / "rank-00000.h5.log"
        helper = holders(f)
        assert len(helper) == 1 and helper[0] != p.pid, helper  # the claim is the helper's
        time.sleep(1.0)  # ten flushes
        with open_rank_file(f) as h:  # what the rank recorded is readable meanwhile
            assert int((h["events"][:]["kind"] == Kind.MARK).sum()) == 20_000
        loaded = _loaded(helper[0])
        if open_after_s == "30" and budget == "0":  # (numpy loads at the helper's start: see _say_through)
            assert "hdf5" not in loaded and lg.exists() and f.stat().st_size == 0, loaded
        else:
            assert "hdf5" in loaded and not lg.exists(), loaded
        go.touch()
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, err
    assert not [ln for ln in err.splitlines() if ln.startswith("distdiag:")], err  # the shim said nothing
    wait_until_closed(f)
    assert not lg.exists()
    with h5py.File(f, "r") as h:
        assert bool(h.attrs["closed_cleanly"]) and h.attrs["file_opened_on"] == "helper"
        assert int((h["events"][:]["kind"] == Kind.MARK).sum()) == 20_000


def test_a_rank_killed_before_its_file_opened_is_finished_from_its_log(tmp_path: Path) -> None:
    """The rank dies while its helper still appends to the spill log: the helper makes the file
    from the log, and it ends where the rank's records end, at its last completed flush (before,
    the file's end was stamped when the helper wrote it, seconds after the death: the analyzer
    then read the rank as alive until then); the log is gone once the file holds its rows."""
    job = tmp_path / "job.py"
    job.write_text(HUNG_JOB)
    run_dir = tmp_path / "run"
    env = single_process_env(DISTDIAG_WRITER="process", DISTDIAG_FLUSH_INTERVAL_S="0.1")
    p = subprocess.Popen([PY, "-m", "distdiag.wrap", "--dir", str(run_dir), PY, str(job), str(tmp_path / "go")],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert p.stdout is not None and p.stdout.readline().split() == ["ready"]
        f, lg = run_dir / "rank-00000.h5", run_dir / "rank-00000.h5.log"
        time.sleep(0.5)
        assert lg.exists() and f.stat().st_size == 0  # the file is not open yet
        p.kill()  # the test's own child, by its PID
        killed_ns = time.monotonic_ns()  # CLOCK_MONOTONIC: the shim's clock
        p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    time.sleep(0.5)  # the helper, a moment later, makes the file (holders: it still has the claim)
    wait_until_closed(f)
    assert not lg.exists()
    with h5py.File(f, "r") as h:
        assert not bool(h.attrs["closed_cleanly"]) and h.attrs["file_opened_on"] == "helper"
        assert int((h["events"][:]["kind"] == Kind.MARK).sum()) == 20_000
        assert int(h.attrs["last_flush_mono_ns"]) <= killed_ns, (int(h.attrs["last_flush_mono_ns"]) - killed_ns) / 1e9


#: a forked child that records, then ends once the test says so (the go file); the rank waits for it
HUNG_CHILD_JOB = """\
import os, sys, time
import numpy  # the child is a DataLoader worker's like: forked from a program that has numpy
go = sys.argv[1]
pid = os.fork()
if pid == 0:
    for i in range(5000):
        os.stat(sys.argv[0])
    print("ready", flush=True)
    while not os.path.exists(go):
        time.sleep(0.01)
    print("end", time.monotonic(), flush=True)  # the child's end: its exit starts here
    sys.exit(0)
os.waitpid(pid, 0)
"""


def _parent_of(pid: int) -> int | None:
    """The parent PID of ``pid`` (/proc/PID/stat's 4th field, after the command in parentheses), or
    None when no such process is left."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])


def test_a_hung_file_system_never_holds_a_forked_childs_exit(tmp_path: Path) -> None:
    """The child's file is written by the rank's helper too (handed a stream of the child's own
    on the helper's connector): the child never holds a descriptor in the run dir, so a hung
    server holds neither its exit nor the rank's wait for it."""
    why = fuse_available()
    if why:
        pytest.skip(why)
    backing = tmp_path / "backing"
    backing.mkdir()
    job = tmp_path / "child-job.py"
    job.write_text(HUNG_CHILD_JOB)
    with mount_slowfs(backing, tmp_path / "mnt", latency_ms=0.0) as mnt:
        server = SERVERS[str(mnt)]
        for writer in ("thread", "process"):
            # the go file in a directory of its own: the interposer sums a hot loop's stats per
            # directory, and the child's first polls of it come within the loop's window
            run_dir, go = mnt / f"run-{writer}", tmp_path / "go" / f"go-child-{writer}"
            go.parent.mkdir(exist_ok=True)
            env = single_process_env(DISTDIAG_WRITER=writer, DISTDIAG_EXIT_TIMEOUT_S=str(BOUND_S),
                                     DISTDIAG_FLUSH_INTERVAL_S="0.1")  # fmt: skip
            p = subprocess.Popen([PY, "-m", "distdiag.wrap", "--dir", str(run_dir), PY, str(job), str(go)], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
            assert p.stdout is not None and p.stdout.readline().split() == ["ready"]
            end = time.monotonic() + 30
            while not [f for f in run_dir.glob("rank-00000.fork-*.h5") if f.stat().st_size > 0]:
                assert time.monotonic() < end and p.poll() is None  # the child's first flush is on the disk
                time.sleep(0.02)
            os.kill(server, signal.SIGSTOP)  # the test's own server process, by its PID
            try:
                go.touch()
                exit_s = _end_s(p, 2 * BOUND_S + 3.0)
            finally:
                os.kill(server, signal.SIGCONT)
            if writer == "thread":  # the fault is real: a child that holds its own file hangs at exit
                assert exit_s is None, "a hung server did not hold the in-process writer's child"
                # and it may never end: its exit froze the flusher thread that held h5py's lock
                # inside the hung write (or it ends once the server answers again, as it now
                # does). Ended here, the child while it is still the rank's and the rank, by PID.
                (f,) = run_dir.glob("rank-00000.fork-*.h5")
                child = int(f.name.split("fork-")[1].split(".")[0])
                if _parent_of(child) == p.pid:  # not ended and reaped, its PID not reused
                    os.kill(child, signal.SIGKILL)
                p.kill()
                p.communicate(timeout=60)
                continue
            _, err = p.communicate(timeout=60)
            assert p.returncode == 0, err
            print(f"child and rank done {exit_s} s after the child's end with the server hung")
            assert exit_s is not None and exit_s < 2 * BOUND_S + 1.5, (exit_s, err)
            (child,) = run_dir.glob("rank-00000.fork-*.h5")
            wait_until_closed(child)  # the server answers again: the helper completes the child's file
            with h5py.File(child, "r") as h:
                ev, strings = h["events"][:], h["strings"].asstr()[:]
                assert bool(h.attrs["closed_cleanly"]) and h.attrs["file_opened_on"] == "helper"
                assert stat_calls(ev, strings, str(job)) == 5000


CHILD_JOB = """\
import os, sys, time
import numpy
pid = os.fork()
if pid == 0:
    for i in range(300):
        os.stat(sys.argv[0])
    time.sleep(0.6)  # several of the child's flushes
    run_dir = os.path.realpath(sys.argv[1])
    held = [fd for fd in os.listdir("/proc/self/fd")
            if os.path.realpath(f"/proc/self/fd/{fd}").startswith(run_dir + os.sep)]
    print("h5py" in sys.modules, held, flush=True)
    sys.exit(4)
print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), "h5py" in sys.modules)
"""


def _one_child(tmp: Path, source: str, arg: str) -> tuple[str, Path]:
    """Run ``source`` wrapped (the helper, flushing every 0.1 s) into ``tmp/run``; its stdout and
    its one forked child's file, once closed."""
    job = tmp / "job.py"
    job.write_text(source)
    run_dir = tmp / "run"
    env = single_process_env(DISTDIAG_WRITER="process", DISTDIAG_FLUSH_INTERVAL_S="0.1")
    p = subprocess.run([PY, "-m", "distdiag.wrap", "--dir", str(run_dir), PY, str(job), arg], env=env,
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert p.returncode == 0 and p.stderr == "", p.stderr
    (child,) = run_dir.glob("rank-00000.fork-*.h5")
    wait_until_closed(child)
    return p.stdout, child


def test_a_forked_childs_file_is_written_by_the_ranks_helper(tmp_path: Path) -> None:
    """The child loads no h5py (its own thread importing h5py beside the child's imports was the
    risk) and holds nothing in the run dir; its file has every row, closed cleanly."""
    run_dir = tmp_path / "run"
    out, child = _one_child(tmp_path, CHILD_JOB, str(run_dir))
    assert out.splitlines() == ["False []", "4 False"]
    with h5py.File(child, "r") as h:
        ev, strings = h["events"][:], list(h["strings"].asstr()[:])
        assert bool(h.attrs["closed_cleanly"]) and int(h.attrs["exit_code"]) == 4
        assert h.attrs["file_opened_on"] == "helper" and h.attrs["role"] == "fork"
        assert stat_calls(ev, strings, str(tmp_path / "job.py")) == 300
        assert len(strings) < 100  # only the strings its rows use, as the in-process writer keeps them


TABLE_JOB = """\
import os, sys, time
d = sys.argv[1]
def stat(name):
    try:
        os.stat(os.path.join(d, name))
    except OSError:
        pass
for i in range(20000):  # the rank's table: 20k paths before the fork (a dataset scan)
    stat(f"before-fork-{i}")
time.sleep(0.25)  # flushed: the helper has them
stat("just-before-fork")  # made after the rank's last flush: sent at its next one
pid = os.fork()
if pid == 0:
    stat("before-fork-7")  # inherited names, and one of the child's own
    stat("just-before-fork")
    stat("childs-own")
    os._exit(0)
os.waitpid(pid, 0)
time.sleep(0.25)
"""


def test_a_forked_child_sends_only_the_strings_it_made_after_the_fork(tmp_path: Path) -> None:
    """A DataLoader worker inherits the rank's string table (10^5 paths after a dataset scan):
    its stream starts from the rank's strings, which the helper already has (the same objects,
    not a copy per worker); its file still names every row right, one the rank had not
    flushed before the fork included."""
    _, child = _one_child(tmp_path, TABLE_JOB, str(tmp_path))
    wait_until_closed(tmp_path / "run" / "rank-00000.h5")
    with h5py.File(child, "r") as h:
        ev, strings = h["events"][:], list(h["strings"].asstr()[:])
        stats = [strings[i] for i in ev["name_id"][ev["kind"] == Kind.FILE_STAT]]
        assert stats == [str(tmp_path / n) for n in ("before-fork-7", "just-before-fork", "childs-own")]
        assert len(strings) < 100  # only the strings its rows use
        assert int(h.attrs["strings_inherited"]) > 20000  # the stream did not carry the rank's table


COMPARE_JOB = """\
import os, sys, threading
import distdiag
def work(k):
    for i in range(200):
        distdiag.mark(f"t{k}")
        os.stat(sys.argv[1])
ts = [threading.Thread(target=work, args=(k,)) for k in range(4)]
[t.start() for t in ts]
[t.join() for t in ts]
pid = os.fork()
if pid == 0:
    for i in range(50):
        os.stat(sys.argv[1])
    os._exit(3)
print("child", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), "numpy" in sys.modules, "h5py" in sys.modules)
sys.exit(5)
"""


def test_the_helper_writes_what_the_in_process_writer_writes_and_the_program_behaves_the_same(tmp_path: Path) -> None:
    job = tmp_path / "job.py"
    job.write_text(COMPARE_JOB)
    got = {}
    for writer in ("thread", "process"):
        d = tmp_path / writer
        env = single_process_env(DISTDIAG_WRITER=writer)
        p = subprocess.run([PY, "-m", "distdiag.wrap", "--dir", str(d), PY, str(job), str(job)], env=env,
                           capture_output=True, text=True, timeout=120)  # fmt: skip
        assert p.returncode == 5, p.stderr
        with h5py.File(d / "rank-00000.h5", "r") as h:
            ev = h["events"][:]
            strings = list(h["strings"].asstr()[:])
            # the program's own rows (an in-process writer opening its file at exit records numpy's
            # and h5py's imports too: there only)
            kinds = {Kind(k).name: int((ev["kind"] == k).sum()) for k in (Kind.MARK, Kind.SHIM)}
            kinds["stats of the job"] = sum(strings[i] == str(job) for i in ev["name_id"][ev["kind"] == Kind.FILE_STAT])
            marks = sorted(strings[i] for i in ev["name_id"][ev["kind"] == Kind.MARK])
            got[writer] = (p.stdout, kinds, marks, int(h.attrs["exit_code"]), bool(h.attrs["closed_cleanly"]))
        children = list(d.glob("rank-00000.fork-*.h5"))
        assert len(children) == 1, children  # the forked child's file, as with the in-process writer
        with h5py.File(children[0], "r") as h:
            ev, strings = h["events"][:], h["strings"].asstr()[:]
            mine = [strings[i] == str(job) for i in ev["name_id"][ev["kind"] == Kind.FILE_STAT]]
            assert sum(mine) == 50
    assert got["process"] == got["thread"]
    # the program never had numpy or h5py loaded by the helper's way (it imports neither)
    assert got["process"][0].split() == ["child", "3", "False", "False"]


def test_a_rank_killed_at_random_instants_leaves_the_helper_every_row_of_its_last_flush(tmp_path: Path) -> None:
    """The in-process writer's kill test (tests/sigkill.py) with the helper: the file is written
    after the kill, from the stream the rank sent (``benchmarks/bench_sigkill.py --writer
    process`` runs hundreds)."""
    rng = random.Random(21)
    jobs = ("first", "late", "never")
    bad = [(k, why) for k in range(6) if (why := kill_once(tmp_path, rng, 0.01, REPO, jobs[k % 3], "process"))]
    assert bad == [], bad
    with h5py.File(tmp_path / "run" / "rank-00000.h5", "r") as h:
        assert not bool(h.attrs["closed_cleanly"])  # the rank died: the helper does not say it closed


FULL_JOB = """\
import sys, time
import distdiag
for i in range(100):
    for k in range(2000):
        distdiag.mark("tick")
    time.sleep(0.01)
print("done", flush=True)
sys.exit(7)
"""


def test_a_full_disk_costs_the_job_nothing_and_is_said_once(tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text(FULL_JOB)
    with small_tmpfs(tmp_path, "8m") as mnt:
        env = single_process_env(DISTDIAG_WRITER="process", DISTDIAG_FLUSH_INTERVAL_S="0.05")
        p = subprocess.run([PY, "-m", "distdiag.wrap", "--dir", str(mnt / "run"), PY, str(tmp_path / "job.py")],
                           env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
        assert p.returncode == 7 and p.stdout == "done\n", p.stderr
        said = [ln for ln in p.stderr.splitlines() if ln.startswith("distdiag:")]
        assert len(said) == 1 and "the job runs without recording" in said[0], p.stderr
        f = mnt / "run" / "rank-00000.h5"
        wait_until_closed(f)
        # what was written before the disk filled stays readable (the helper's spill log, where the
        # disk filled before the file opened: read in the file's place, as the analyzer does)
        with open_rank_file(f) as h:
            assert "free on its file system" in str(h.attrs["recording_stopped"])
            assert len(h["events"]) > 0


HOLDER = """\
import sys, time
import h5py
f = h5py.File(sys.argv[1], "w", locking=True)  # as the writer holds a rank file: HDF5's lock
f["first"] = [1]
f.flush()
print("open", flush=True)
time.sleep(float(sys.argv[2]))
f["last"] = [2]  # the last flush, written after the rank's death
f.close()
"""


def _hold(tmp: Path, name: str, hold_s: float) -> tuple[subprocess.Popen[str], Path]:
    (tmp / "holder.py").write_text(HOLDER)
    path = tmp / name / "rank-00000.h5"
    path.parent.mkdir()
    p = subprocess.Popen([PY, str(tmp / "holder.py"), str(path), str(hold_s)], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline() == "open\n"
    return p, path


def test_the_analyzer_waits_for_a_writer_finishing_a_file_but_not_for_a_running_job(tmp_path: Path) -> None:
    from distdiag import run as run_mod

    # a writer that finishes 0.5 s from now (a killed rank's helper): waited for, its last flush read
    p, path = _hold(tmp_path, "finishing", 0.5)
    t0 = time.monotonic()
    run_mod._wait_for_writer(path)
    waited = time.monotonic() - t0
    with h5py.File(path, "r", locking=False) as f:
        assert "last" in f, waited
    p.wait(timeout=30)
    # the healthy twin: nobody holds it, no wait
    t0 = time.monotonic()
    run_mod._wait_for_writer(path)
    assert time.monotonic() - t0 < 0.2
    # a job still running: waited for WRITER_WAIT_S once, then read as it is (its dir not waited for again)
    p, path = _hold(tmp_path, "running", 60)
    try:
        t0 = time.monotonic()
        run_mod._wait_for_writer(path)
        first = time.monotonic() - t0
        t0 = time.monotonic()
        run_mod._wait_for_writer(path)
        second = time.monotonic() - t0
    finally:
        p.kill()  # ours, by its PID
        p.wait(timeout=30)
    assert run_mod.WRITER_WAIT_S <= first < run_mod.WRITER_WAIT_S + 2 and second < 0.2, (first, second)


SIGPIPE_JOB = """\
import signal, sys, time
import distdiag
signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # as CLI tools do, to end quietly in a closed pipeline
for i in range(2000):
    distdiag.mark("tick")
print("ready", flush=True)
sys.stdin.readline()  # the test has killed the helper
t_end = time.monotonic() + 1.0
while time.monotonic() < t_end:  # flushes every 0.05 s go to a helper that is gone
    for i in range(2000):
        distdiag.mark("tick")
    time.sleep(0.01)
print("done", flush=True)
"""


def test_a_helper_that_died_costs_the_job_nothing_even_where_sigpipe_kills(tmp_path: Path) -> None:
    """The program restores SIGPIPE's default (death) before the shim's flusher writes to a helper
    that is gone: the flusher must never raise SIGPIPE in the job, and says once that recording stopped."""
    from helpers import holders

    (tmp_path / "job.py").write_text(SIGPIPE_JOB)
    env = single_process_env(DISTDIAG_FLUSH_INTERVAL_S="0.05", DISTDIAG_WRITER="process")
    run_dir = tmp_path / "run"
    p = subprocess.Popen([PY, "-m", "distdiag.wrap", "--dir", str(run_dir), PY, str(tmp_path / "job.py")], env=env,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert p.stdin is not None and p.stdout is not None
    try:
        assert p.stdout.readline() == "ready\n"
        f = run_dir / "rank-00000.h5"
        end = time.monotonic() + 30
        helper = []
        while not helper:  # the helper holds the file once its first flush opened it
            assert time.monotonic() < end and p.poll() is None
            helper = [q for q in holders(f) if q != p.pid]
            time.sleep(0.02)
        assert len(helper) == 1
        cmd = Path(f"/proc/{helper[0]}/cmdline").read_bytes()
        assert b"distdiag.shim.helper" in cmd, cmd  # ours: the helper this test's job started
        os.kill(helper[0], signal.SIGKILL)
        p.stdin.write("go\n")
        p.stdin.flush()
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0 and out == "done\n", (p.returncode, err)
    said = [ln for ln in err.splitlines() if ln.startswith("distdiag:")]
    assert len(said) == 1 and "the job runs without recording" in said[0], err


CLOSERANGE_JOB = """\
import os, sys, time
import distdiag
for i in range(2000):
    distdiag.mark("tick")
time.sleep(0.3)  # flushed
os.closerange(3, 4096)  # as a daemonizer does: the shim's descriptors are gone
fds = []
for k in range(4):  # the lowest numbers again, the shim's among them: the program's own pipes now
    fds.append(os.pipe())
t_end = time.monotonic() + 1.0
n = 0
while time.monotonic() < t_end:  # flushes every 0.05 s meanwhile
    for r, w in fds:
        msg = b"%08d" % n
        os.write(w, msg)
        got = os.read(r, 8)
        assert got == msg, (got, msg)  # nobody else read or wrote the program's pipes
        n += 1
    distdiag.mark("tick")
    time.sleep(0.005)
print("ok", n > 0, flush=True)
"""


def test_a_program_that_closes_every_descriptor_keeps_its_own(tmp_path: Path) -> None:
    """The program closes all descriptors and opens pipes that take the shim's old numbers: the
    shim must never read or write them (it checks its socket is still its own before each use)."""
    (tmp_path / "job.py").write_text(CLOSERANGE_JOB)
    env = single_process_env(DISTDIAG_FLUSH_INTERVAL_S="0.05", DISTDIAG_WRITER="process")
    p = subprocess.run([PY, "-m", "distdiag.wrap", "--dir", str(tmp_path / "run"), PY, str(tmp_path / "job.py")],
                       env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert p.returncode == 0 and p.stdout == "ok True\n", (p.returncode, p.stdout, p.stderr)
    f = tmp_path / "run" / "rank-00000.h5"
    wait_until_closed(f)
    with h5py.File(f, "r") as h:  # the rows of the flushes before the program closed our socket
        assert int((h["events"]["kind"] == Kind.MARK).sum()) >= 2000
