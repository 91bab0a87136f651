"""The shim is a guest: the wrapped program behaves exactly as unwrapped, and recording
never breaks it nor grows without bound.

Real processes throughout:

* hypothesis composes programs from intercepted calls (file reads/writes, stat,
  listdir, failed opens, numpy save/load, json, threads, phases) and endings
  (normal, ``sys.exit(n)``, ``sys.exit("msg")``, exceptions, ``os._exit``,
  ``KeyboardInterrupt``): exit code, stdout and stderr of ``python prog.py``
  and ``distdiag-wrap python prog.py`` must be equal byte for byte, and the
  values the intercepted calls returned (printed by the program) with them;
* real signals: SIGINT ends a program with KeyboardInterrupt (or runs its own
  handler) exactly as unwrapped; a SIGTERM handler the program installs runs,
  and the program may go on recording after it;
* a file-size limit (``RLIMIT_FSIZE``) that stops the shim's writes: the job runs
  to its normal end with one stderr line;
* memory: a job recording millions of events as fast as Python can (over
  10^6 events/s) keeps its resident memory within the recorder's bound, and
  what it could not keep is counted (``lost_events``, ``LOST`` rows), never grown.
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
from helpers import single_process_env
from helpers import fill_prog
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from distdiag.schema import Kind

PY = sys.executable
WRAP = [PY, "-m", "distdiag.wrap"]
TIMEOUT_S = 60

def env(**extra: str) -> dict[str, str]:
    return single_process_env(**{"PYTHONHASHSEED": "0", **extra})


def _run(cmd: list[str], cwd: Path, **kw: Any) -> tuple[int, str, str]:
    p = subprocess.run(cmd, cwd=cwd, env=kw.pop("env", env()), capture_output=True, text=True, timeout=TIMEOUT_S, **kw)
    return p.returncode, p.stdout, p.stderr


# -- generated programs ------------------------------------------------------------------

BLOCKS = {
    "write_read_binary": """
        data = bytes(range(256)) * {n}
        with open("blob{i}.bin", "wb") as f:
            print("wrote", f.write(data))
        with open("blob{i}.bin", "rb") as f:
            got = f.read()
        print("read", len(got), got == data, f.closed, type(f).__name__)
    """,
    "write_read_text": """
        with open("notes{i}.txt", "w") as f:
            f.write("line\\n" * {n})
        with open("notes{i}.txt") as f:
            print("lines", len(f.readlines()))
    """,
    "stat_listdir": """
        open("s{i}.txt", "w").close()
        print("size", os.stat("s{i}.txt").st_size, os.path.exists("s{i}.txt"), os.path.exists("nope{i}"))
        print("dir", sorted(os.listdir(".")))
    """,
    "failed_open": """
        try:
            open("missing{i}/x.txt")
        except OSError as e:
            print("oserror", type(e).__name__, e.errno, e.filename)
    """,
    "numpy_save_load": """
        np.save("arr{i}.npy", np.arange({n}))
        print("npy", int(np.load("arr{i}.npy").sum()))
    """,
    "json_roundtrip": """
        with open("cfg{i}.json", "w") as f:
            json.dump({{"n": {n}, "k": [1, 2]}}, f)
        with open("cfg{i}.json") as f:
            print("json", json.load(f))
    """,
    "thread_io": """
        def work(k):
            with open(f"t{i}_{{k}}.bin", "wb") as f:
                f.write(b"x" * (k + 1) * 1000)
        ts = [threading.Thread(target=work, args=(k,)) for k in range(3)]
        [t.start() for t in ts]; [t.join() for t in ts]
        print("threads", sorted(os.path.getsize(f"t{i}_{{k}}.bin") for k in range(3)))
    """,
    "phase_and_stderr": """
        with distdiag.phase("block{i}"):
            print("in phase {i}", file=sys.stderr)
        distdiag.step(samples={n})
        distdiag.mark("m{i}")
    """,
    "caught_exception": """
        try:
            {{}}["k{i}"]
        except KeyError as e:
            print("caught", repr(e))
    """,
}
ENDINGS = {
    "normal": "print('end')",
    "exit_code": "sys.stdout.flush(); sys.exit({code})",
    "exit_message": "sys.exit('fatal: stopping at block {code}')",
    "raise": "def deep():\n    raise ValueError('boom {code}')\ndeep()",
    "os_exit": "sys.stdout.flush(); os._exit({code})",
    "keyboard": "raise KeyboardInterrupt",
}
HEADER = "import os, sys, json, threading\nimport numpy as np\nimport distdiag\n"


def _program(blocks: list[tuple[str, int]], ending: str, code: int) -> str:
    parts = [HEADER]
    for i, (name, n) in enumerate(blocks):
        parts.append(textwrap.dedent(BLOCKS[name]).format(i=i, n=n))
    parts.append(ENDINGS[ending].format(code=code))
    return "\n".join(parts) + "\n"


@settings(max_examples=12, deadline=None, derandomize=True, database=None, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.too_slow])  # fmt: skip
@given(
    blocks=st.lists(st.tuples(st.sampled_from(sorted(BLOCKS)), st.integers(1, 300)), min_size=1, max_size=6),
    ending=st.sampled_from(sorted(ENDINGS)),
    code=st.integers(0, 120),
)
def test_generated_programs_behave_exactly_as_unwrapped(blocks: list[tuple[str, int]], ending: str, code: int) -> None:
    src = _program(blocks, ending, code)
    with tempfile.TemporaryDirectory() as td:
        t = Path(td)
        (t / "prog.py").write_text(src)
        results = []
        for wrapped in (False, True):
            cwd = t / "work"  # the same path for both runs: tracebacks show it
            if cwd.exists():
                shutil.rmtree(cwd)
            cwd.mkdir()
            cmd = [*WRAP, "--dir", str(t / "run"), PY, "../prog.py"] if wrapped else [PY, "../prog.py"]
            results.append(_run(cmd, cwd))
            # the program's own files: same names, same bytes
            results.append(tuple(sorted((p.name, p.read_bytes()) for p in cwd.iterdir())))  # type: ignore[arg-type]
        assert results[2:] == results[:2], src
        assert (t / "run" / "rank-00000.h5").exists()
        with h5py.File(t / "run" / "rank-00000.h5", "r") as f:
            rc = results[0][0]  # type: ignore[index]
            assert bool(f.attrs["closed_cleanly"])
            want_rc = {"keyboard": -signal.SIGINT, "raise": 1, "exit_message": 1}.get(ending, rc)
            assert int(f.attrs["exit_code"]) == want_rc


# -- real signals --------------------------------------------------------------------------

SIG_PROG = """
import signal, sys, time
import distdiag

mode = sys.argv[1]
if mode == "int_handler":
    def on_int(signum, frame):
        print("user SIGINT handler", signum, flush=True)
        raise SystemExit(5)
    signal.signal(signal.SIGINT, on_int)
if mode == "term_continue":
    got = []
    signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
try:
    for i in range(2000):
        distdiag.mark("before")
    print("ready", flush=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (mode == "term_continue" and got):
        time.sleep(0.01)
    if mode == "term_continue":
        print("handler saw", got, "and the program goes on", flush=True)
        for i in range(1000):
            distdiag.mark("after")
        print("finished", flush=True)
except KeyboardInterrupt:
    if mode != "catch_int":
        raise
    print("caught KeyboardInterrupt, cleaning up", flush=True)
    sys.exit(3)
"""


def _signal_run(prog: Path, cwd: Path, mode: str, sig: int, wrapped: bool, run_dir: Path) -> tuple[int, str, str]:
    cmd = [*WRAP, "--dir", str(run_dir), PY, str(prog), mode] if wrapped else [PY, str(prog), mode]
    p = subprocess.Popen(cmd, cwd=cwd, env=env(DISTDIAG_FLUSH_INTERVAL_S="30"), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert p.stdout is not None
        line = p.stdout.readline()
        assert line == "ready\n", line
        p.send_signal(sig)
        out, err = p.communicate(timeout=TIMEOUT_S)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=TIMEOUT_S)
    return p.returncode, line + out, err


@pytest.mark.parametrize(
    "mode, sig, want_rc",
    [("default", signal.SIGINT, -signal.SIGINT), ("catch_int", signal.SIGINT, 3), ("int_handler", signal.SIGINT, 5),
     ("term_continue", signal.SIGTERM, 0)],
)  # fmt: skip
def test_real_signals_act_as_unwrapped(tmp_path: Path, mode: str, sig: int, want_rc: int) -> None:
    prog = tmp_path / "sig.py"
    prog.write_text(SIG_PROG)
    plain = _signal_run(prog, tmp_path, mode, sig, False, tmp_path / "unused")
    wrapped = _signal_run(prog, tmp_path, mode, sig, True, tmp_path / "run")
    # the signal lands at a line that depends on timing (seen: the print() line in one
    # run, the loop in another), so compare exit code and output less traceback frames
    def norm(r: Any) -> Any:
        return (r[0], "\n".join(ln for ln in r[1].splitlines() if not ln.startswith(" ")))
    assert norm(wrapped) == norm(plain)
    assert plain[0] == want_rc
    if mode == "default":
        assert "KeyboardInterrupt" in plain[2] and "Traceback" in plain[2]
    with h5py.File(tmp_path / "run" / "rank-00000.h5", "r") as f:
        ev, s = f["events"][:], f["strings"].asstr()[:]
        assert bool(f.attrs["closed_cleanly"]) and int(f.attrs["exit_code"]) == want_rc
    names = s[ev["name_id"]]
    assert int((names == "before").sum()) == 2000
    if mode == "term_continue":
        # the program's handler ran and it went on: the file holds what it recorded after
        assert int((names == "after").sum()) == 1000 and "sigterm" in set(names[ev["kind"] == Kind.SHIM])


# -- a file-size limit stops the writer ------------------------------------------------------


def test_file_size_limit_leaves_the_job_running_with_one_stderr_line(tmp_path: Path) -> None:
    """RLIMIT_FSIZE of 1 MiB (a quota-like stop): the shim's 5 MB of events cannot be written."""
    prog = tmp_path / "fill.py"
    prog.write_text(fill_prog(4))

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))

    e = env(DISTDIAG_FLUSH_INTERVAL_S="0.05")
    plain = _run([PY, str(prog)], tmp_path, env=e, preexec_fn=limit)
    rc, out, err = _run([*WRAP, "--dir", str(tmp_path / "run"), PY, str(prog)], tmp_path, env=e, preexec_fn=limit)
    assert (rc, out) == plain[:2] == (4, "finished\n")
    assert err.count("\n") == 1 and err.startswith("distdiag: ") and "without recording" in err, err
    assert (tmp_path / "run" / "rank-00000.h5").stat().st_size <= 1 << 20


# -- bounded memory at > 10^6 events/s -----------------------------------------------------

MEM_PROG = """
import json, sys, threading, time
from distdiag.shim import session

n = int(sys.argv[1])
rec = session.SESSION.rec
add = rec.add

def rss_kib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])

peak = [rss_kib()]
stop = threading.Event()

def sample():
    while not stop.wait(0.01):
        peak[0] = max(peak[0], rss_kib())

base = rss_kib()
th = threading.Thread(target=sample, daemon=True)
th.start()
t0 = time.perf_counter()
for i in range(n):
    add(i, i + 1, 60, 1)  # Kind.MARK rows, as fast as Python can append them
dt = time.perf_counter() - t0
stop.set(); th.join()
peak[0] = max(peak[0], rss_kib())
print(json.dumps({"rate_per_s": n / dt, "base_kib": base, "peak_kib": peak[0], "lost": rec.lost_events}))
"""


@pytest.mark.parametrize("flush_interval_s", ["0.2", "1000"])
def test_memory_stays_bounded_at_a_million_events_per_second(tmp_path: Path, flush_interval_s: str) -> None:
    """6 M events appended at full speed. With a flusher (every 0.2 s) or without one (1000 s:
    nothing is written until exit) the resident memory grows by at most the pending-chunk bound
    (``max_pending_chunks`` x ``chunk_rows`` x 69 B = 16 x 16384 x 69 B = 18 MB here) plus the
    writer's own working memory (see the slack below);
    everything beyond it is dropped and counted, and the counts add up."""
    import json

    n = 6_000_000
    prog = tmp_path / "mem.py"
    prog.write_text(MEM_PROG)
    e = env(DISTDIAG_FLUSH_INTERVAL_S=flush_interval_s, DISTDIAG_MAX_PENDING_CHUNKS="16", DISTDIAG_HOOKS="fileio=0")
    rc, out, err = _run([*WRAP, "--dir", str(tmp_path / "run"), PY, str(prog), str(n)], tmp_path, env=e)
    assert rc == 0, err
    m = json.loads(out.strip().splitlines()[-1])
    bound_kib = 16 * 16384 * 69 // 1024
    grew_kib = m["peak_kib"] - m["base_kib"]
    print(f"rate {m['rate_per_s'] / 1e6:.2f} M events/s, RSS +{grew_kib / 1024:.1f} MiB (bound {bound_kib / 1024:.1f} "
          f"MiB), lost {m['lost']}")  # fmt: skip
    # The rate is what one thread of this machine manages (1-2 M/s idle, a third of that while
    # other tests run): not asserted; the 1000 s case overruns the bound at any rate.
    # Slack, measured: with a flusher busy at these rates, HDF5's metadata cache, the flush
    # batch and the allocator's thread arenas add up to ~45-110 MiB, flat from 3 M to 12 M
    # events (+45 to +107 MiB at 3 M, +95 and +99 at 6 M, +99 and +101 at 12 M, idle and with a
    # busy core beside it). The events themselves are 6 M x 69 B = 395 MiB: holding them (a
    # leak, an unbounded queue) fails both checks by far. (At 3 M events half the events' size,
    # 101 MiB, was under that flat slack: the second check failed beside a busy core.)
    assert grew_kib < bound_kib + 128 * 1024, m
    assert grew_kib < n * 69 // 1024 // 2, m
    with h5py.File(tmp_path / "run" / "rank-00000.h5", "r") as f:
        kinds = f["events"]["kind"]
        lost_attr = int(f.attrs["lost_events"])
        lost_rows = f["events"]["aux"][kinds == Kind.LOST]
        marks = int((kinds == Kind.MARK).sum())
    assert lost_attr == m["lost"] == int(lost_rows.sum())
    assert marks + lost_attr == n  # every event is either in the file or counted as lost
    if flush_interval_s == "1000":
        assert lost_attr > 0  # no flusher: it had to drop, and said so
