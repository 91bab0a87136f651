"""The spill log: a rank's rows before its HDF5 file opens, on disk, read by the analyzer.

With ``open_file_at = "numpy"`` (the default) the rank file opens at the first flush after
the program's own numpy import (distdiag.shim.rankfile); until then every flush appends to
``rank-NNNNN.h5.log`` with the standard library only (distdiag.shim.spill), and the log
goes once the HDF5 file holds its rows. Real wrapped processes throughout; the kills at
random instants are in ``tests/test_shim_sigkill.py``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import single_process_env

from distdiag.run import load_run, open_rank_file
from distdiag.schema import Kind
from distdiag.shim.recorder import ROW_SIZE
from distdiag.shim.spill import MAGIC, read_log

PY = sys.executable
WRAP = [PY, "-m", "distdiag.wrap"]
TIMEOUT_S = 60

#: marks, then (with argv[1] = "numpy") numpy imported and more marks; reports its modules
PROG = """
import json, sys, time
import distdiag
for i in range(3000):
    distdiag.mark("before")
print("before done", flush=True)
time.sleep(0.6)                                  # flushes every 0.05 s: into the log
seen = {m: m in sys.modules for m in ("numpy", "h5py", "ctypes")}
if sys.argv[1] == "numpy":
    import numpy
    time.sleep(0.6)                              # the file opens at the next flush
for i in range(2000):
    distdiag.mark("after")
print(json.dumps(seen), flush=True)
if sys.argv[2] == "hang":
    time.sleep(60)
"""


def _start(tmp: Path, *args: str, **env: str) -> subprocess.Popen[str]:
    prog = tmp / "prog.py"
    prog.write_text(PROG)
    e = single_process_env(DISTDIAG_FLUSH_INTERVAL_S="0.05", **env, DISTDIAG_WRITER="thread")
    return subprocess.Popen([*WRAP, "--dir", str(tmp / "run"), PY, str(prog), *args], cwd=tmp, env=e,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip


def _marks(path: Path) -> dict[str, int]:
    with open_rank_file(path) as f:
        ev, s = f["events"][:], f["strings"].asstr()[:]
    names = s[ev["name_id"][ev["kind"] == Kind.MARK]]
    return {n: int((names == n).sum()) for n in ("before", "after")}


def test_a_numpy_free_program_never_loads_numpy_and_ends_with_one_complete_rank_file(tmp_path: Path) -> None:
    p = _start(tmp_path, "none", "end")
    out, err = p.communicate(timeout=TIMEOUT_S)
    assert p.returncode == 0, err
    assert json.loads(out.splitlines()[-1]) == {"numpy": False, "h5py": False, "ctypes": False}
    run = tmp_path / "run"
    assert sorted(q.name for q in run.iterdir() if q.name.startswith("rank-")) == ["rank-00000.h5"]  # no log left
    with open_rank_file(run / "rank-00000.h5") as f:
        assert f.attrs["file_opened_on"] == "exit" and bool(f.attrs["closed_cleanly"])
    assert _marks(run / "rank-00000.h5") == {"before": 3000, "after": 2000}


def test_the_log_hands_its_rows_to_the_file_at_the_programs_numpy_import(tmp_path: Path) -> None:
    p = _start(tmp_path, "numpy", "hang")
    try:
        assert p.stdout is not None
        assert "before done" in p.stdout.readline()
        run = tmp_path / "run"
        log = run / "rank-00000.h5.log"
        t_end = time.monotonic() + 30
        while not (log.exists() and log.stat().st_size > 3000 * 69) and time.monotonic() < t_end:
            time.sleep(0.02)
        assert (run / "rank-00000.h5").stat().st_size == 0 and log.stat().st_size > 3000 * 69
        seen = json.loads(p.stdout.readline())
        assert seen["numpy"] is False  # nothing before the program's own import
        t_end = time.monotonic() + 30
        while log.exists() and time.monotonic() < t_end:
            time.sleep(0.02)
        assert not log.exists()  # the HDF5 file holds the log's rows now
        with open_rank_file(run / "rank-00000.h5") as f:
            assert f.attrs["file_opened_on"] == "numpy"
        t_end = time.monotonic() + 30
        while _marks(run / "rank-00000.h5")["after"] < 2000 and time.monotonic() < t_end:
            time.sleep(0.05)  # the next flush (a busy machine may delay it)
        assert _marks(run / "rank-00000.h5") == {"before": 3000, "after": 2000}  # flushed while it runs
    finally:
        p.kill()
        p.wait(timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def killed_log(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """The spill log of a numpy-free rank SIGKILLed after its marks were flushed."""
    tmp = tmp_path_factory.mktemp("killed")
    p = _start(tmp, "none", "hang")
    try:
        assert p.stdout is not None
        p.stdout.readline()
        p.stdout.readline()  # every mark recorded; 0.05 s flushes
        log = tmp / "run" / "rank-00000.h5.log"
        t_end = time.monotonic() + 30
        while time.monotonic() < t_end:  # until a flush took them all (a busy machine delays it)
            if len(read_log(log.read_bytes())["rows"]) // ROW_SIZE >= 5000:
                break
            time.sleep(0.05)
        time.sleep(0.2)  # the rows of a flush or two after (the rank's own, not the marks)
    finally:
        os.kill(p.pid, signal.SIGKILL)  # ours, by its PID
        p.wait(timeout=TIMEOUT_S)
    return (tmp / "run" / "rank-00000.h5.log").read_bytes()


def _run_dir_with(tmp: Path, log: bytes, name: str = "run") -> Path:
    d = tmp / name
    d.mkdir()
    (d / "rank-00000.h5").write_bytes(b"")  # the claim, as a killed rank leaves it
    (d / "rank-00000.h5.log").write_bytes(log)
    return d


def test_a_killed_ranks_log_is_read_in_its_files_place(tmp_path: Path, killed_log: bytes) -> None:
    d = _run_dir_with(tmp_path, killed_log)
    run = load_run(d)
    assert len(run.ranks) == 1 and not run.ranks[0].closed_cleanly
    names = np.array([run.s(int(i)) for i in run.events["name_id"][run.events["kind"] == Kind.MARK]])
    assert int((names == "before").sum()) == 3000 and int((names == "after").sum()) == 2000
    assert any("read from its spill log" in w for w in run.warnings)


def test_a_torn_log_keeps_every_record_before_the_tear(tmp_path: Path, killed_log: bytes) -> None:
    """A kill inside a write leaves a torn last record: cut the log at many points, and at
    every one the analyzer reads each whole record before it and says the end was cut."""
    whole = read_log(killed_log)
    n_whole = len(whole["rows"]) // 69
    cuts = sorted({len(MAGIC) + 1, *range(len(killed_log) - 1, len(MAGIC), -max(1, len(killed_log) // 23))})
    prev = -1
    for k, cut in enumerate(cuts):
        d = _run_dir_with(tmp_path, killed_log[:cut], f"cut{k}")
        got = read_log(killed_log[:cut])
        rows = len(got["rows"]) // 69
        assert rows <= n_whole and rows >= prev  # a longer prefix never holds fewer rows
        prev = rows
        assert got["damaged"] is not None or cut in (len(killed_log),)
        run = load_run(d) if rows else None
        if run is not None:
            assert len(run.events) >= rows - 64  # the rows the prefix holds (a handful of shim rows aside)
            assert any("cut short" in w for w in run.warnings)


def test_a_damaged_record_ends_the_read_there(tmp_path: Path, killed_log: bytes) -> None:
    bad = bytearray(killed_log)
    bad[len(bad) // 2] ^= 0xFF
    got = read_log(bytes(bad))
    assert got["damaged"] and "damaged record" in got["damaged"]
    assert len(got["rows"]) < len(read_log(killed_log)["rows"])


def test_a_log_is_untrusted_input(tmp_path: Path, killed_log: bytes) -> None:
    # a link: never followed (the target is a valid log outside the run dir)
    outside = tmp_path / "elsewhere.log"
    outside.write_bytes(killed_log)
    d = tmp_path / "link"
    d.mkdir()
    (d / "rank-00000.h5").write_bytes(b"")
    (d / "rank-00000.h5.log").symlink_to(outside)
    with pytest.raises(Exception, match="symbolic link"):
        load_run(d)
    # garbage: one clear line
    d = _run_dir_with(tmp_path, b"not a log at all", "garbage")
    with pytest.raises(Exception, match="not a distdiag spill log"):
        load_run(d)
    # far larger than a shim writes (sparse: nothing is allocated for it)
    d = _run_dir_with(tmp_path, MAGIC, "huge")
    with open(d / "rank-00000.h5.log", "r+b") as f:
        f.truncate(1 << 30)
    with pytest.raises(Exception, match="more than the 256 MiB"):
        load_run(d)


def test_the_log_keeps_no_secret_of_the_command_line(tmp_path: Path) -> None:
    prog = tmp_path / "prog.py"
    prog.write_text("import time, distdiag\ndistdiag.mark('x')\ntime.sleep(0.5)\nprint('up', flush=True)\ntime.sleep(60)\n")
    e = single_process_env(DISTDIAG_FLUSH_INTERVAL_S="0.05", DISTDIAG_WRITER="thread")
    p = subprocess.Popen([*WRAP, "--dir", str(tmp_path / "run"), PY, str(prog), "--api-token", "hunter2-secret"],
                         cwd=tmp_path, env=e, stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert p.stdout is not None and "up" in p.stdout.readline()
        time.sleep(0.2)
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=TIMEOUT_S)
    log = (tmp_path / "run" / "rank-00000.h5.log").read_bytes()
    assert b"--api-token" in log and b"hunter2" not in log


def test_a_budget_thinned_file_still_replaces_its_log(tmp_path: Path) -> None:
    """A recording budget under the log's size thins the handed-over rows into the file's
    counters (by design): the log must go all the same, or the analyzer reads it in the
    file's place and loses the run after the program's numpy import, exit status included."""
    p = _start(tmp_path, "numpy", "end", DISTDIAG_MAX_FILE_BYTES="100000")  # the log holds ~210 kB
    _out, err = p.communicate(timeout=TIMEOUT_S)
    assert p.returncode == 0, err
    run_dir = tmp_path / "run"
    assert sorted(q.name for q in run_dir.iterdir() if q.name.startswith("rank-")) == ["rank-00000.h5"]
    run = load_run(run_dir)
    assert run.ranks[0].closed_cleanly and not any("spill log" in w for w in run.warnings), run.warnings
    assert any("recording budget" in w for w in run.warnings), run.warnings


def test_a_cleanly_closed_file_is_read_over_a_log_left_beside_it(tmp_path: Path, killed_log: bytes) -> None:
    """A log stays only where the file failed or was cut before holding it; a file closed
    cleanly with every row it was given is the rank's record, whatever lies beside it."""
    from distdiag.schema import EVENT_DTYPE
    from distdiag.shim.writer import write_rank_file

    d = tmp_path / "both"
    d.mkdir()
    ev = np.zeros(10, EVENT_DTYPE)
    ev["t0_ns"] = ev["t1_ns"] = np.arange(10) * 1000 + 10**9
    ev["kind"], ev["name_id"] = int(Kind.MARK), 1
    write_rank_file(d / "rank-00000.h5", {}, ev, ["", "from_the_file"])
    (d / "rank-00000.h5.log").write_bytes(killed_log)
    run = load_run(d)
    assert len(run.events) == 10 and run.s(int(run.events["name_id"][0])) == "from_the_file"
    assert not any("spill log" in w for w in run.warnings)


def test_a_log_removed_while_the_file_is_read_leaves_the_file(tmp_path: Path, killed_log: bytes,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """A killed rank's helper makes its file from the log, then removes the log: an analysis
    that saw the log, and the file not yet whole (a killed rank's is never "closed cleanly"),
    reads the file once the log is gone (before: the log's read failed, the rank unreadable)."""
    from distdiag import run as run_mod
    from distdiag.schema import EVENT_DTYPE
    from distdiag.shim.writer import write_rank_file

    d = tmp_path / "finishing"
    d.mkdir()
    ev = np.zeros(10, EVENT_DTYPE)
    ev["t0_ns"] = ev["t1_ns"] = np.arange(10) * 1000 + 10**9
    ev["kind"], ev["name_id"] = int(Kind.MARK), 1
    write_rank_file(d / "rank-00000.h5", {"closed_cleanly": False}, ev, ["", "from_the_file"])
    log = d / "rank-00000.h5.log"
    log.write_bytes(killed_log)
    real = run_mod._open_h5_file

    def helper_done_meanwhile(path: Path) -> object:  # the helper removes the log while we read the file
        f = real(path)
        log.unlink(missing_ok=True)
        return f

    monkeypatch.setattr(run_mod, "_open_h5_file", helper_done_meanwhile)
    run = load_run(d)
    assert len(run.events) == 10 and run.s(int(run.events["name_id"][0])) == "from_the_file"
    assert not any("spill log" in w for w in run.warnings)


def test_a_rows_record_of_no_whole_rows_is_malformed(killed_log: bytes) -> None:
    """A crafted ROWS record whose length is no multiple of a row would misalign every row
    after it: it ends the read as malformed, the records before it kept."""
    import struct
    import zlib

    body = b"x" * 70
    bad = killed_log + struct.pack("<4sII", b"ROWS", len(body), zlib.crc32(body)) + body
    got = read_log(bad)
    assert got["damaged"] and "malformed ROWS" in got["damaged"]
    assert got["rows"] == read_log(killed_log)["rows"]


def test_an_empty_claim_without_a_log_says_so(tmp_path: Path, killed_log: bytes) -> None:
    """Killed before its first flush: the claim is empty and no log was written; the rank is
    skipped with that reason (next to a readable rank, so the run still loads)."""
    d = _run_dir_with(tmp_path, killed_log, "two")
    (d / "rank-00001.h5").write_bytes(b"")
    run = load_run(d)
    assert list(run.ranks) == [0]
    assert any("rank-00001.h5" in w and "no spill log beside it" in w for w in run.warnings), run.warnings
