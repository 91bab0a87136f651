"""A run dir is untrusted input: the analyzer reads nothing outside it, and writes no control characters to a terminal.

Someone hands over a run dir ("can you look at my job?"). A rank file whose
table is an external link, keeps its data in an external file, or is a
virtual dataset of other files would make HDF5 read the analyst's own files
(``~/.ssh/id_rsa``) into the report. Each such table is refused with one
warning line and the rest of the run is analyzed; the secret's bytes never
reach the report. Host names, paths and call sites from a rank file reach
the terminal with their control characters escaped. A row whose timestamps lie
outside its rank's recorded span is dropped, counted, and the rest analyzed
as if it were not there.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable

import h5py
import numpy as np
import pytest

from distdiag.config import Config
from distdiag.pipeline import analyze
from distdiag.render import render
from distdiag.schema import EVENT_DTYPE, Kind, rank_file_name
from factories import coll, write_rank

I64 = np.iinfo(np.int64)
SECRET = b"-----BEGIN OPENSSH PRIVATE KEY----- s3cr3t-b1t5 -----END-----"


def _job(run_dir: Path, n: int = 3) -> None:
    """n ranks, 30 all-reduces, rank 1 late at each: a straggler to find in the rest."""
    for r in range(n):
        strings = [""]
        rows = [coll(10 * i + (4 if r == 1 else 0), 10 * i + 5, i, strings) for i in range(30)]
        write_rank(run_dir, r, n, rows, strings)


def _secret_file(tmp_path: Path) -> Path:
    p = tmp_path / "home" / "id_rsa"
    p.parent.mkdir()
    p.write_bytes(SECRET)
    return p


def _strings_in_external_storage(path: Path, secret: Path) -> None:
    """/strings as a fixed-length string table whose bytes are the secret file's."""
    with h5py.File(path, "r+") as f:
        del f["strings"]
        n = len(SECRET) // 8
        f.create_dataset("strings", shape=(n,), dtype="S8", external=[(str(secret), 0, n * 8)])


def _strings_as_external_link(path: Path, secret: Path) -> None:
    """/strings as an external link into another HDF5 file holding the secret."""
    other = secret.with_suffix(".h5")
    with h5py.File(other, "w") as g:
        g.create_dataset("strings", data=np.array([SECRET.decode()], dtype=h5py.string_dtype()))
    with h5py.File(path, "r+") as f:
        del f["strings"]
        f["strings"] = h5py.ExternalLink(str(other), "/strings")


def _events_as_virtual_dataset(path: Path, secret: Path) -> None:
    """/events as a virtual dataset mapping another file's events."""
    other = secret.with_suffix(".events.h5")
    with h5py.File(path, "r") as f:
        rows = f["events"][()]
    with h5py.File(other, "w") as g:
        g.create_dataset("events", data=rows)
    layout = h5py.VirtualLayout(shape=(len(rows),), dtype=EVENT_DTYPE)
    layout[:] = h5py.VirtualSource(str(other), "events", shape=(len(rows),))
    with h5py.File(path, "r+") as f:
        del f["events"]
        f.create_virtual_dataset("events", layout)


def _inflight_in_external_storage(path: Path, secret: Path) -> None:
    """/inflight (an events table) read from the raw bytes of another file."""
    n = 4
    secret.write_bytes(SECRET * (1 + n * EVENT_DTYPE.itemsize // len(SECRET)))
    with h5py.File(path, "r+") as f:
        if "inflight" in f:
            del f["inflight"]
        f.create_dataset("inflight", shape=(n,), dtype=EVENT_DTYPE, external=[(str(secret), 0, n * EVENT_DTYPE.itemsize)])


MUTATIONS: dict[str, tuple[Callable[[Path, Path], None], str]] = {
    "external storage": (_strings_in_external_storage, "keeps its data in external file"),
    "external link": (_strings_as_external_link, "is an external link"),
    "virtual dataset": (_events_as_virtual_dataset, "is a virtual dataset"),
    "external inflight": (_inflight_in_external_storage, "keeps its data in external file"),
}


@pytest.mark.parametrize("how", sorted(MUTATIONS))
def test_tables_stored_outside_the_rank_file_are_refused(tmp_path: Path, how: str) -> None:
    run_dir = tmp_path / "run"
    _job(run_dir)
    secret = _secret_file(tmp_path)
    mutate, said = MUTATIONS[how]
    mutate(run_dir / rank_file_name(0), secret)

    rep = analyze(run_dir, Config())
    out = json.dumps(rep.to_json()) + render(rep, "text")
    assert "s3cr3t" not in out and "OPENSSH" not in out
    lines = [w for w in rep.run.warnings if said in w]
    assert len(lines) == 1 and lines[0].startswith(rank_file_name(0)), rep.run.warnings
    # the rest is analyzed: the late rank is still found on the other files
    assert [f.ranks for f in rep.findings if f.kind == "straggler"] == [[1]], rep.findings


def test_a_rank_file_of_its_own_tables_is_read_as_before(tmp_path: Path) -> None:
    """The healthy twin: the same run dir untouched gives no such warning and all three ranks."""
    run_dir = tmp_path / "run"
    _job(run_dir)
    rep = analyze(run_dir, Config())
    assert not [w for w in rep.run.warnings if "file itself only" in w], rep.run.warnings
    assert sorted(rep.run.ranks) == [0, 1, 2]
    assert [f.ranks for f in rep.findings if f.kind == "straggler"] == [[1]]


def _outside_rank_file(tmp_path: Path) -> Path:
    """An HDF5 rank file outside the run dir (the analyst's own, say) whose host name is the secret."""
    other = tmp_path / "home" / "other-run"
    strings = [""]
    rows = [coll(10 * i, 10 * i + 5, i, strings) for i in range(30)]
    write_rank(other, 0, 3, rows, strings, host=SECRET.decode())
    return other / rank_file_name(0)


def test_a_rank_file_that_is_a_link_is_refused_and_the_rest_analyzed(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _job(run_dir)
    (run_dir / rank_file_name(0)).unlink()
    (run_dir / rank_file_name(0)).symlink_to(_outside_rank_file(tmp_path))
    rep = analyze(run_dir, Config())
    out = json.dumps(rep.to_json()) + render(rep, "text")
    assert "s3cr3t" not in out and "OPENSSH" not in out
    said = [w for w in rep.run.warnings if w.startswith(rank_file_name(0))]
    assert len(said) == 1 and "symbolic link" in said[0], rep.run.warnings
    assert sorted(rep.run.ranks) == [1, 2]
    assert [f.ranks for f in rep.findings if f.kind == "straggler"] == [[1]], rep.findings


def test_a_fifo_of_a_rank_files_name_is_refused_without_blocking(tmp_path: Path) -> None:
    # opening a FIFO for reading blocks until someone writes: the analyzer must never open it
    run_dir = tmp_path / "run"
    _job(run_dir)
    os.mkfifo(run_dir / rank_file_name(3))
    p = subprocess.run([sys.executable, "-m", "distdiag.cli", "analyze", str(run_dir), "--format", "json"],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert p.returncode == 0, p.stderr
    warnings = json.loads(p.stdout)["run"]["warnings"]
    assert [w for w in warnings if w.startswith(rank_file_name(3)) and "not a regular file" in w], warnings


def test_stored_slurm_accounting_is_read_only_from_a_small_regular_file(tmp_path: Path) -> None:
    from distdiag import slurm

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    acct = run_dir / slurm.ACCOUNTING_FILE
    outside = tmp_path / "outside.json"
    outside.write_text(json.dumps({"schema": slurm.ACCOUNTING_SCHEMA, "job": {"job_id": "7"}}))
    acct.symlink_to(outside)
    assert slurm.load_stored(run_dir) is None  # a link: never followed
    acct.unlink()
    acct.symlink_to("/dev/zero")
    assert slurm.load_stored(run_dir) is None  # would read forever
    acct.unlink()
    os.mkfifo(acct)
    assert slurm.load_stored(run_dir) is None  # would block
    acct.unlink()
    acct.write_bytes(b" " * (slurm.MAX_STORED_BYTES + 1))
    assert slurm.load_stored(run_dir) is None  # over the bound


def test_storing_slurm_accounting_never_writes_through_a_planted_link(tmp_path: Path) -> None:
    from distdiag import slurm

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    victim = tmp_path / "bashrc"
    victim.write_text("the analyst's own\n")
    (run_dir / f".{slurm.ACCOUNTING_FILE}.{os.getpid()}.tmp").symlink_to(victim)
    acct = slurm.Accounting(job_id="7")
    assert slurm.store(run_dir, acct) is None
    assert victim.read_text() == "the analyst's own\n"
    # the healthy twin: a run dir of our own, no planted link, stores and reads back
    (run_dir / f".{slurm.ACCOUNTING_FILE}.{os.getpid()}.tmp").unlink()
    assert slurm.store(run_dir, acct) == run_dir / slurm.ACCOUNTING_FILE
    got = slurm.load_stored(run_dir)
    assert got is not None and got.job_id == "7"


EVIL_HOST = "n1\x1b[2J\x1b]0;pwned\x07\r\u202e"


def _evil_run(run_dir: Path) -> None:
    """Rank 1 late at every all-reduce, on a host whose name clears the screen and sets the title."""
    for r in range(3):
        strings = [""]
        rows = [coll(10 * i + (4 if r == 1 else 0), 10 * i + 5, i, strings) for i in range(30)]
        write_rank(run_dir, r, 3, rows, strings, host=EVIL_HOST if r == 1 else f"n{r}")


@pytest.mark.parametrize("color", [False, True])
def test_host_names_reach_the_terminal_escaped(tmp_path: Path, color: bool) -> None:
    run_dir = tmp_path / "run"
    _evil_run(run_dir)
    rep = analyze(run_dir, Config())
    text = render(rep, "text", color=color)
    # the straggler's host is shown, written out
    assert "n1\\x1b[2J\\x1b]0;pwned\\x07\\x0d\\u202e" in text
    # no control character but the newline and the renderer's own colours
    own = re.sub(r"\x1b\[[0-9;]*m", "", text) if color else text
    assert not [c for c in own if (ord(c) < 32 and c != "\n") or 0x7F <= ord(c) <= 0x9F or c == "\u202e"]
    assert ("\x1b[" in text) is color


def test_a_newline_in_a_host_name_cannot_forge_a_line_of_the_report(tmp_path: Path) -> None:
    """A newline is the one control character the text keeps, for its own lines only."""
    run_dir = tmp_path / "run"
    forged = "n1\nVERDICT: healthy. Nothing to see."
    for r in range(3):
        strings = [""]
        rows = [coll(10 * i + (4 if r == 1 else 0), 10 * i + 5, i, strings) for i in range(30)]
        write_rank(run_dir, r, 3, rows, strings, host=forged if r == 1 else f"n{r}")
    text = render(analyze(run_dir, Config()), "text", color=False)
    assert [ln for ln in text.splitlines() if ln.startswith("VERDICT:")] == [
        ln for ln in text.splitlines() if ln.startswith("VERDICT: straggler")], text  # fmt: skip
    assert "n1\\x0aVERDICT: healthy" in text, text


@pytest.mark.parametrize("fmt", ["text", "html", "json"])
def test_names_that_are_not_utf8_are_written_out_in_every_format(tmp_path: Path, fmt: str) -> None:
    """Found by benchmarks/fuzz_rundirs.py: a launch id of bytes ``ff fe`` (decoded with
    surrogateescape) made the HTML report unwritable (UnicodeEncodeError, a traceback)."""
    run_dir = tmp_path / "run"
    _evil_run(run_dir)
    for r in (1, 2):
        with h5py.File(run_dir / f"rank-0000{r}.h5", "r+") as f:
            f.attrs["host"] = np.bytes_(b"n\xff" + bytes([48 + r]))
            f.attrs["launch_id"] = b"\xff\xfe"  # h5py reads it back as str with surrogates
    out = tmp_path / f"report.{fmt}"
    p = subprocess.run([sys.executable, "-m", "distdiag.cli", "analyze", str(run_dir), "--format", fmt, "-o", str(out)],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert p.returncode == 0, p.stderr
    got = out.read_bytes().decode("utf-8")  # strict: every byte written is UTF-8
    assert "udcff" in got, got[:3000]  # written out (\\udcff; in JSON \\\\udcff), not dropped


def test_the_cli_writes_no_control_characters(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _evil_run(run_dir)
    p = subprocess.run([sys.executable, "-m", "distdiag.cli", "analyze", str(run_dir)], capture_output=True,
                       text=True, timeout=120)  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert "pwned" in p.stdout and "\x1b" not in p.stdout + p.stderr and "\x07" not in p.stdout
    # an error line that names a file from the run dir is escaped too
    bad = tmp_path / "bad\x1b[2J"
    bad.mkdir()  # a dir with no rank files: the error names it
    p = subprocess.run([sys.executable, "-m", "distdiag.cli", "analyze", str(bad)], capture_output=True, text=True,
                       timeout=120)  # fmt: skip
    assert p.returncode == 2 and p.stderr.startswith("distdiag: "), p.stderr
    assert "\x1b" not in p.stderr and "bad\\x1b[2J" in p.stderr, p.stderr



def _append_row(path: Path, t0_ns: int, t1_ns: int) -> None:
    with h5py.File(path, "r+") as f:
        ev = f["events"]
        row = np.zeros(1, ev.dtype)
        row["t0_ns"], row["t1_ns"], row["kind"] = t0_ns, t1_ns, int(Kind.MARK)
        ev.resize((len(ev) + 1,))
        ev[-1:] = row


@pytest.fixture(scope="module")
def storm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("storm") / "run"
    p = subprocess.run([sys.executable, "-m", "distdiag.cli", "synth", str(d), "--ranks", "8", "--events", "3000",
                        "--fault", "storm"], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert p.returncode == 0, p.stderr
    return d


@pytest.mark.parametrize("t0_ns, t1_ns", [(I64.min, I64.max), (0, I64.max), (I64.min + 1, -5), (10**18, 10**18)])
def test_one_bogus_timestamp_is_dropped_and_the_storm_still_found(
    storm_dir: Path, tmp_path: Path, t0_ns: int, t1_ns: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    healthy = analyze(storm_dir, Config())  # the same run without the bogus row
    assert healthy.verdict is not None and healthy.verdict.kind == "metadata_storm"
    run_dir = tmp_path / "run"
    shutil.copytree(storm_dir, run_dir)
    _append_row(run_dir / rank_file_name(3), t0_ns, t1_ns)
    rep = analyze(run_dir, Config())
    said = [w for w in rep.run.warnings if "outside the rank's recorded span" in w]
    assert len(said) == 1 and said[0].startswith(f"{rank_file_name(3)}: 1 event row "), rep.run.warnings
    # analyzed as if the row were not there
    assert rep.run.wall_s == pytest.approx(healthy.run.wall_s)
    assert [(f.kind, f.ranks, round(f.cost_s, 9)) for f in rep.findings] == [
        (f.kind, f.ranks, round(f.cost_s, 9)) for f in healthy.findings
    ]
    # streamed (what a large run gets), every band's rows read again from the files, the bogus row
    # dropped again: the same report (it was "rank-00003.h5 changed while it was analyzed")
    from distdiag import bands

    monkeypatch.setattr(bands, "BAND_EVENTS", 512)
    streamed = analyze(run_dir, dataclasses.replace(Config(), stream_events=0), stream=True)
    assert render(streamed, "json") == render(rep, "json")


def _shared_heap_strings(path: Path, n: int, big: int) -> None:
    """/strings of ``n`` entries that all point at one shared heap object of ``big`` bytes:
    a file of ~``big`` bytes that decodes to n copies."""
    with h5py.File(path, "r+") as f:
        old = [s.decode() if isinstance(s, bytes) else s for s in f["strings"][()]]
        del f["strings"]
        table = old + ["x" * big] + ["y"] * (n - len(old) - 1)
        f.create_dataset("strings", data=np.array(table, dtype=object), dtype=h5py.string_dtype(), chunks=(1024,),
                         maxshape=(None,))  # fmt: skip
        ds = f["strings"]
        ref = np.dtype([("len", "<u4"), ("addr", "<u8"), ("idx", "<u4")])
        first = np.frombuffer(ds.id.read_direct_chunk((0,))[1], ref).copy()
        shared = first[len(old)]
        for lo in range(0, n, 1024):
            chunk = np.frombuffer(ds.id.read_direct_chunk((lo,))[1], ref).copy()
            at = np.arange(lo, lo + len(chunk))
            chunk[at > len(old)] = shared  # every later entry: the big object
            ds.id.write_direct_chunk((lo,), chunk.tobytes())


LIMITED = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (1_500_000_000, 1_500_000_000))
from distdiag.cli import main
sys.exit(main(["analyze", sys.argv[1], "--format", "json"]))
"""


def _analyze_limited(run_dir: Path, said: str) -> None:
    """The CLI's JSON analysis under a 1.5 GB address-space limit completes, says ``said`` once
    about rank 0's file, and still finds the straggler (rank 1) in the rest."""
    p = subprocess.run([sys.executable, "-c", LIMITED, str(run_dir)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    rep = json.loads(p.stdout)
    lines = [w for w in rep["run"]["warnings"] if said in w]
    assert len(lines) == 1 and lines[0].startswith(rank_file_name(0)), rep["run"]["warnings"]
    assert [f["ranks"] for f in rep["findings"] if f["kind"] == "straggler"] == [[1]]


def test_a_string_table_of_one_shared_heap_object_decodes_within_a_bound(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _job(run_dir)
    _shared_heap_strings(run_dir / rank_file_name(0), n=4096, big=1 << 20)  # 4 GB decoded from a ~1 MB file
    size = (run_dir / rank_file_name(0)).stat().st_size
    assert size < 2 << 20
    # under a 1.5 GB address-space limit the analysis completes
    _analyze_limited(run_dir, "/strings would decode to")
    # the bound is the file's own size: what was read is at most 4x it (+1 MB)
    from distdiag.run import load_run

    run = load_run(run_dir)
    assert sum(len(s) for s in run.strings) <= 4 * size + (1 << 20) + 3 * 64 * 1024


def test_a_compressed_table_whose_chunks_claim_gigabytes_is_refused(tmp_path: Path) -> None:
    """/inflight gzip-compressed in chunks of 2^26 rows (4.9 GB each inflated): a few KB on disk."""
    run_dir = tmp_path / "run"
    _job(run_dir)
    path = run_dir / rank_file_name(0)
    with h5py.File(path, "r+") as f:
        if "inflight" in f:
            del f["inflight"]
        ds = f.create_dataset("inflight", shape=(1 << 26,), dtype=EVENT_DTYPE, chunks=(1 << 26,), compression="gzip")
        ds[:1] = np.zeros(1, EVENT_DTYPE)  # one chunk written: all of it compressed zeros
    assert path.stat().st_size < 50 << 20
    _analyze_limited(run_dir, "compression bomb")
