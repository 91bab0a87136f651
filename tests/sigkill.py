"""SIGKILL a wrapped rank at random instants and check what its file kept.

The README promises that a SIGKILLed rank loses at most one flush interval and that its
file still opens. ``kill_once`` runs a real wrapped job that records marks without pause
(2,000 between 1 ms sleeps), flushing every ``flush_interval_s``, kills it with SIGKILL
(by its PID) a random 0.05-0.8 s after its rank file was first written, and says what is wrong with
the file, or None:

* it must open (h5py), with its events and strings;
* the marks must have no hole (consecutive marks never more than ``SLACK_S`` apart: a
  table cut back to an older flush, or flushes lost in the middle, would leave one);
* the last mark must be at most ``flush_interval_s`` + ``SLACK_S`` before the file's
  ``last_flush_mono_ns``: the rows of the last completed flush are there.

Used by ``tests/test_shim_sigkill.py`` (a few kills) and ``benchmarks/bench_sigkill.py``
(hundreds).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

#: how long the job may be descheduled (a busy core beside it) before a gap reads as lost rows
SLACK_S = 0.5

#: the jobs, by when they import numpy: the rank file opens (HDF5) at the first flush after
#: the program's numpy import; until then the rows go to the spill log (rank-00000.h5.log),
#: which the analyzer reads in the file's place. "late": after a random 0-0.6 s of marks, so
#: that kills land before, during and after the file's opening and the log's hand-over.
JOBS = {
    "first": "import numpy\nimport distdiag\n",
    "late": "import distdiag, random, time\nT_NUMPY = time.monotonic() + random.uniform(0, 0.6)\n",
    "never": "import distdiag\n",
}
LOOP = """\
import time
while True:
    for _ in range(2000):
        distdiag.mark("tick")
    time.sleep(0.001)
    if "T_NUMPY" in globals() and time.monotonic() > T_NUMPY:
        import numpy
"""


def _has_bytes(path: Path) -> bool:
    try:
        return path.stat().st_size > 0
    except OSError:
        return False


def kill_once(work: Path, rng: random.Random, flush_interval_s: float, repo: Path, numpy_at: str = "first",
              writer: str = "thread", helper_too: bool = False) -> str | None:  # fmt: skip
    """``writer``: the shim's ``writer`` setting ("process": the file is written by a helper
    process, which goes on after the kill; the file is read once the helper closed it).
    ``helper_too`` (with "process"): the helper is SIGKILLed too, just before the rank, as
    Slurm's step kill after ``KillWait`` or the OOM killer of a cgroup ends every process of
    the step: nobody closes the file, and it must open with the helper's last completed flush."""
    import numpy as np

    from helpers import holders, wait_until_closed

    from distdiag.run import open_rank_file
    from distdiag.schema import Kind

    job = work / f"job-{numpy_at}.py"
    if not job.exists():
        job.write_text(JOBS[numpy_at] + LOOP)
    d = work / "run"
    shutil.rmtree(d, ignore_errors=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTDIAG_")}
    env.update(PYTHONPATH=str(repo), DISTDIAG_FLUSH_INTERVAL_S=str(flush_interval_s), DISTDIAG_WRITER=writer)
    p = subprocess.Popen([sys.executable, "-m", "distdiag.wrap", "--dir", str(d), sys.executable, str(job)], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    helper: list[int] = []
    try:
        # from the rank's first flush on: the first bytes of its file or its spill log (the
        # interpreter's start takes ~0.3 s here and longer beside a busy core: a kill before
        # tests nothing)
        t_end = time.monotonic() + 60
        while not (_has_bytes(d / "rank-00000.h5") or _has_bytes(d / "rank-00000.h5.log")) and p.poll() is None \
                and time.monotonic() < t_end:  # fmt: skip
            time.sleep(0.005)
        t_first = time.monotonic()
        time.sleep(rng.uniform(0.05, 0.8))
        helper = [q for q in holders(d / "rank-00000.h5") if q != p.pid] if helper_too else []
        if helper_too and len(helper) != 1:
            return None if p.poll() is not None else f"no one helper holds the file: {helper}"
    finally:
        t_kill = time.monotonic()
        gone = []
        for q in helper:
            try:
                os.kill(q, signal.SIGKILL)  # the job's helper: started by the job we started, found by its PID
            except ProcessLookupError:  # it ended on its own: said below, once its rank is ended too
                gone.append(q)
        os.kill(p.pid, signal.SIGKILL)  # ours, by its PID (always: a rank left running would load the rest)
        _, err = p.communicate(timeout=30)
    if gone:
        return f"the helper {gone} ended on its own while its rank ran (stderr {err[-300:]!r})"
    if writer == "process" and (d / "rank-00000.h5").exists():
        wait_until_closed(d / "rank-00000.h5")
    try:
        with open_rank_file(d / "rank-00000.h5") as f:  # or its spill log, as the analyzer reads it
            ev = f["events"][:]
            strings = list(f["strings"].asstr()[:])
            last_flush = int(f.attrs["last_flush_mono_ns"])
            clean = bool(f.attrs.get("closed_cleanly", False))
    except Exception as e:
        return f"the file does not open: {type(e).__name__}: {e}"[:300] + f" (stderr {err[-300:]!r})"
    if helper and clean:  # the helper closes cleanly only once the rank said it exits: it never did
        return "closed cleanly, though neither the rank nor its helper lived to close it"
    marks = np.sort(ev["t0_ns"][ev["kind"] == Kind.MARK])
    if len(marks) == 0:
        # killed before its program's first marks reached a flush: nothing flushed is lost,
        # provided the program had not been running for more than the slack at that flush
        shim = ev[ev["kind"] == Kind.SHIM]
        started = [int(r["t0_ns"]) for r in shim if strings[int(r["name_id"])] == "target_start"]
        if not started:  # not one flush in the file: only when the kill came before the first could land
            if t_kill - t_first > flush_interval_s + SLACK_S:
                return f"no rows {t_kill - t_first:.3f} s after the file was first written (stderr {err[-300:]!r})"
            return None
        if last_flush - started[0] < SLACK_S * 1e9:
            return None
        return f"no marks, {(last_flush - started[0]) / 1e9:.3f} s into the program (stderr {err[-300:]!r})"
    if len(marks) > 1 and np.diff(marks).max() > SLACK_S * 1e9:
        return f"a hole of {np.diff(marks).max() / 1e9:.3f} s between marks"
    if marks[-1] < last_flush - (flush_interval_s + SLACK_S) * 1e9:
        return f"the last mark is {(last_flush - marks[-1]) / 1e9:.3f} s before the last flush"
    return None
