"""The analyzer reads any run dir a real job can leave, and never shows a traceback.

Hypothesis mutates REAL rank files (a 2-rank ``mpiexec distdiag-wrap`` job)
by truncation at any byte, byte flips anywhere or in the metadata at the
front, and zeroed blocks; every mutated run dir must give a report (text and
JSON) or one :class:`DistdiagError` line, nothing else. Structural damage a
real job or a careless user leaves (wrong dtypes, missing tables, absurd
attributes, huge string tables, duplicate ranks, a file of another schema,
foreign HDF5 next to rank files, ranks that never started) is covered case by
case with what the report must say about it.

Structural mutations (external storage and links, VDS, dtype swaps, huge
declared dims, compression bombs, shared heap ids, out-of-range ids, INT64
extremes, links and FIFOs of rank-file names: ``tests/mutations.py``) each run
in a forked child under a time and memory bound, and no report may quote a
byte from outside the run dir; ``benchmarks/fuzz_rundirs.py`` runs 10^4 of them.

Example counts are bounded (``FUZZ_EXAMPLES`` per strategy) so the module
runs in well under a minute on 2 loaded cores.
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import h5py
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from distdiag import gheap
from distdiag.config import Config
from distdiag.pipeline import analyze_run
from distdiag.render import render
from distdiag.errors import DistdiagError
from distdiag.run import load_run, read_rank
from distdiag.schema import EVENT_DTYPE, SCHEMA_ATTR, Kind, rank_file_name
import mutations
from factories import coll, write_rank

REPO = Path(__file__).resolve().parent.parent
FUZZ_EXAMPLES = 40
# No shrinking (a failing example is printed as found; shrinking HDF5 damage took
# minutes) and no example database (reruns are derandomized anyway).
_SETTINGS = settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True, database=None,
                     phases=[Phase.explicit, Phase.generate], print_blob=True,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])  # fmt: skip


@pytest.fixture(scope="module")
def real_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real 2-rank job's run dir (collectives, clock samples, file events, phases)."""
    if shutil.which("mpiexec") is None:
        pytest.fail("mpiexec not found: install the 'mpi' extra (mpi4py + mpich)")
    return mutations.make_real_run(tmp_path_factory.mktemp("real"), REPO)


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DISTDIAG_SLURM_OFFLINE", "1")


def report_or_error(run_dir: Path) -> tuple[Any, str | None]:
    """(report, None) or (None, the one-line error). Anything else propagates: a failure."""
    try:
        run = load_run(run_dir)
        rep = analyze_run(run, Config())
    except DistdiagError as e:
        msg = str(e)
        assert msg and "\n" not in msg and "Traceback" not in msg, msg
        return None, msg
    json.dumps(rep.to_json(), allow_nan=False)  # the contract: plain JSON
    render(rep, "text")
    for w in rep.run.warnings:
        assert isinstance(w, str) and "\n" not in w, w
    return rep, None


def _mutated(real_run: Path, mutate: Callable[[bytes], bytes], which: int) -> tuple[bool, str | None, list[str]]:
    """(whether there is a report, the one-line error, the report's warnings) of ``real_run``
    with rank file ``which`` mutated, analyzed in a forked child under a time bound: a damaged
    file that made libhdf5 loop would otherwise hang the suite (see distdiag.gheap)."""
    with tempfile.TemporaryDirectory() as td:
        d = Path(td) / "run"
        shutil.copytree(real_run, d)
        f = sorted(d.glob("rank-*.h5"))[which]
        f.write_bytes(mutate(f.read_bytes()))
        got: tuple[bool, str | None, list[str]] = mutations.in_child(lambda: _summary(d), timeout_s=60)
        return got


def _summary(d: Path) -> tuple[bool, str | None, list[str]]:
    """(whether there is a report, the one-line error, the report's warnings) of run dir ``d``."""
    rep, err = report_or_error(d)
    return rep is not None, err, [] if rep is None else list(rep.run.warnings)


def test_the_unmutated_real_run_is_clean(real_run: Path) -> None:
    rep, err = report_or_error(real_run)
    assert err is None and rep.run.world_size == 2 and len(rep.run.ranks) == 2
    assert not [w for w in rep.run.warnings if "corrupt" in w or "damaged" in w or "skipped" in w]
    # the string table holds the job's call sites: one read from outside the run dir would
    # hold MARK instead (the "quoted" checks below look at it; see mutations.analyze_isolated)
    assert any("job.py:" in str(s) for s in rep.run.strings), rep.run.strings[:20]


@_SETTINGS
@given(frac=st.floats(0.0, 1.0), which=st.integers(0, 1))
def test_truncation_at_any_byte_is_a_report_or_one_error(real_run: Path, frac: float, which: int) -> None:
    size = (sorted(real_run.glob("rank-*.h5"))[which]).stat().st_size
    cut = int(frac * size)
    rep, err, warnings = _mutated(real_run, lambda b: b[:cut], which)
    if cut < size:
        # the other rank is intact: always a report, and the damage is said
        assert rep, err
        name = rank_file_name(which)
        assert any(name in w for w in warnings), warnings


@_SETTINGS
@given(flips=st.lists(st.tuples(st.floats(0.0, 1.0), st.integers(1, 255)), min_size=1, max_size=24),
       which=st.integers(0, 1))  # fmt: skip
def test_byte_flips_anywhere_are_a_report_or_one_error(real_run: Path, flips: list[tuple[float, int]], which: int) -> None:
    def mutate(b: bytes) -> bytes:
        a = bytearray(b)
        for pos, x in flips:
            a[min(len(a) - 1, int(pos * len(a)))] ^= x
        return bytes(a)

    rep, err, _ = _mutated(real_run, mutate, which)
    assert rep or err is not None


@_SETTINGS
@given(flips=st.lists(st.tuples(st.integers(0, 4095), st.integers(1, 255)), min_size=1, max_size=8),
       which=st.integers(0, 1))  # fmt: skip
def test_byte_flips_in_the_metadata_are_a_report_or_one_error(real_run: Path, flips: list[tuple[int, int]], which: int) -> None:
    """The superblock and root object headers sit in the first 4 KiB: flips there hit HDF5's parser."""

    def mutate(b: bytes) -> bytes:
        a = bytearray(b)
        for pos, x in flips:
            a[pos % len(a)] ^= x
        return bytes(a)

    rep, err, _ = _mutated(real_run, mutate, which)
    assert rep or err is not None


@_SETTINGS
@given(block=st.floats(0.0, 1.0), nblocks=st.integers(1, 8), fill=st.sampled_from([b"\0", b"\xff", b"random"]))
def test_zeroed_or_overwritten_blocks_are_a_report_or_one_error(real_run: Path, block: float, nblocks: int, fill: bytes) -> None:
    def mutate(b: bytes) -> bytes:
        a = bytearray(b)
        start = (int(block * len(a)) // 512) * 512
        n = min(len(a) - start, 512 * nblocks)
        a[start : start + n] = os.urandom(n) if fill == b"random" else fill * n
        return bytes(a)

    rep, err, _ = _mutated(real_run, mutate, 0)
    assert rep, err  # rank 1 is intact


def test_every_fuzzed_dir_through_the_cli_is_exit_0_or_one_line_exit_2(real_run: Path, tmp_path: Path) -> None:
    """The CLI boundary itself, on a handful of damaged dirs (subprocesses are slow)."""
    rng = np.random.default_rng(9)
    cases = []
    for i in range(3):  # a handful: each CLI run pays the imports (~2 s)
        d = tmp_path / f"d{i}"
        shutil.copytree(real_run, d)
        for f in sorted(d.glob("rank-*.h5")):
            b = bytearray(f.read_bytes())
            if i % 2 == 0:
                b = b[: int(rng.integers(0, len(b)))]
            else:
                for pos in rng.integers(0, len(b), 16):
                    b[int(pos)] ^= int(rng.integers(1, 256))
            f.write_bytes(bytes(b))
        cases.append(d)
    for i, d in enumerate(cases):
        for fmt in ("json", "text") if i == 0 else ("json",):
            p = subprocess.run([sys.executable, "-m", "distdiag.cli", "analyze", str(d), "--format", fmt],
                               capture_output=True, text=True, timeout=120,
                               env=dict(os.environ, DISTDIAG_SLURM_OFFLINE="1", PYTHONPATH=str(REPO)))  # fmt: skip
            assert "Traceback" not in p.stderr, p.stderr
            if p.returncode == 0:
                if fmt == "json":
                    json.loads(p.stdout)
            else:
                assert p.returncode == 2, (p.returncode, p.stderr)
                lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
                assert len(lines) == 1 and lines[0].startswith("distdiag: "), p.stderr


# -- the global heap: libhdf5's walk of a damaged collection never ends (distdiag.gheap) ------------


def _refs(path: Path) -> np.ndarray:
    """The string table's references as its storage holds them (chunked or contiguous)."""
    with h5py.File(path, "r") as f:
        ds = f["strings"]
        if ds.chunks is None:
            at = ds.id.get_offset()
            return np.frombuffer(path.read_bytes()[at : at + 16 * ds.shape[0]], gheap.VLEN_REF)
        raw = b"".join(ds.id.read_direct_chunk((lo,))[1] for lo in range(0, ds.shape[0], ds.chunks[0]))
        return np.frombuffer(raw, gheap.VLEN_REF, count=ds.shape[0])


def _rewrite_strings(path: Path, **layout: Any) -> None:
    """The rank file's string table written again, the same strings, in another layout."""
    with h5py.File(path, "r+") as f:
        table = list(f["strings"].asstr()[:])
        del f["strings"]
        f.create_dataset("strings", data=np.array(table, dtype=object), dtype=h5py.string_dtype(), **layout)


def _objects(data: bytes) -> list[tuple[int, int, int]]:
    """(index, offset of its header, size) of each object of a healthy collection."""
    out, p = [], 16
    while p + 16 <= len(data):
        idx, size = int.from_bytes(data[p : p + 2], "little"), int.from_bytes(data[p + 8 : p + 16], "little")
        out.append((idx, p, size))
        p += size if idx == 0 else 16 + (size + 7) // 8 * 8
    return out


@pytest.mark.parametrize("layout", ["chunked", "contiguous"])
def test_a_collection_libhdf5_would_walk_forever_reads_as_damage_not_a_hang(real_run: Path, tmp_path: Path,
                                                                           layout: str) -> None:  # fmt: skip
    """The free-space object of the string table's last collection says 0 bytes: libhdf5's
    walk stops moving (checked here: reading the table with h5py does not finish). The
    analyzer reads the rank with those strings as "" and says so; its healthy twin reads
    every string as h5py does, every text attribute, and warns of nothing. ``contiguous``:
    the table rewritten unchunked (the shim writes chunks; another writer need not)."""
    if layout == "contiguous":
        healthy = tmp_path / "healthy"
        shutil.copytree(real_run, healthy)
        _rewrite_strings(healthy / rank_file_name(1))
        real_run = healthy
    d = tmp_path / "run"
    shutil.copytree(real_run, d)
    path = d / rank_file_name(1)
    refs = _refs(path)
    last = int(refs["addr"].max())
    blob = bytearray(path.read_bytes())
    size = int.from_bytes(blob[last + 8 : last + 16], "little")
    free = [p for idx, p, _ in _objects(bytes(blob[last : last + size])) if idx == 0]
    assert free, "the last collection has free space (the shim's tables leave some)"
    blob[last + free[0] + 8 : last + free[0] + 16] = bytes(8)
    path.write_bytes(bytes(blob))

    def with_h5py() -> int:
        with h5py.File(path, "r") as f:
            return len(f["strings"].asstr()[:])

    with pytest.raises(AssertionError, match="a hang"):  # the fault is real
        mutations.in_child(with_h5py, timeout_s=5)

    def read(p: Path) -> tuple[list[str], str, list[str]]:
        warnings: list[str] = []
        got = read_rank(p, warnings)
        assert not isinstance(got, str), got
        return [str(x) for x in got.strings], got.info.host, warnings

    strings, host, warnings = mutations.in_child(lambda: read(path), timeout_s=60)
    hit = refs["addr"] == last
    assert any(f"collection at byte {last} has a free-space object of 0 bytes" in w and
               f"{np.count_nonzero(hit)} of its {len(refs)} strings cannot be read" in w for w in warnings), warnings
    assert any("text attributes" in w for w in warnings) and host == "", warnings  # the host is in the heap too
    twin, twin_host, twin_warnings = mutations.in_child(lambda: read(real_run / rank_file_name(1)), timeout_s=60)
    with h5py.File(real_run / rank_file_name(1), "r") as f:
        assert twin == list(f["strings"].asstr()[:]) and twin_host == f.attrs["host"]  # as libhdf5 decodes them
    assert not twin_warnings, twin_warnings
    assert [x for x, h in zip(strings, hit) if h] == [""] * int(np.count_nonzero(hit))
    assert [x for x, h in zip(strings, hit) if not h] == [x for x, h in zip(twin, hit) if not h]
    # the whole run: a report (the other rank is intact), the damage said
    rep, err, run_warnings = mutations.in_child(lambda: _summary(d), timeout_s=60)
    assert rep and [w for w in run_warnings if w.startswith(rank_file_name(1))], (err, run_warnings)


@pytest.mark.parametrize("layout", [{"chunks": (64,), "compression": "gzip"}, {"chunks": (64,), "shuffle": True}],
                         ids=["gzip", "shuffle"])  # fmt: skip
def test_a_string_table_only_libhdf5_could_decode_skips_its_rank_with_why(real_run: Path, tmp_path: Path,
                                                                          layout: dict[str, Any]) -> None:  # fmt: skip
    """Filtered chunks hold their references compressed: only libhdf5 could read them, and it
    would walk their heap unchecked. The shim never writes them: that rank is skipped, said,
    and the rest analyzed."""
    d = tmp_path / "run"
    shutil.copytree(real_run, d)
    _rewrite_strings(d / rank_file_name(0), **layout)
    warnings: list[str] = []
    got = read_rank(d / rank_file_name(0), warnings)
    assert isinstance(got, str) and "a layout the shim never writes" in got and "skipped" in got, got
    rep, err, run_warnings = mutations.in_child(lambda: _summary(d), timeout_s=60)
    assert rep and any(w.startswith(rank_file_name(0)) and "never writes" in w for w in run_warnings), run_warnings


def test_an_attribute_of_a_type_the_shim_never_writes_reads_as_absent_and_is_said(real_run: Path,
                                                                                   tmp_path: Path) -> None:  # fmt: skip
    """A flipped byte made ``host`` a variable-length sequence, and libhdf5 segfaulted converting
    it (benchmarks/fuzz_rundirs.py --flips, seed 7601). Here a well-formed one stands in for it:
    the reader hands no attribute of another class than numbers, booleans and strings to libhdf5."""
    d = tmp_path / "run"
    shutil.copytree(real_run, d)
    with h5py.File(d / rank_file_name(1), "r+") as f:
        del f.attrs["host"]
        seq = np.empty(1, h5py.vlen_dtype(np.int32))
        seq[0] = np.arange(3, dtype=np.int32)
        f.attrs.create("host", seq, dtype=h5py.vlen_dtype(np.int32))
    warnings: list[str] = []
    got = read_rank(d / rank_file_name(1), warnings)
    assert not isinstance(got, str), got
    assert got.info.host == "" and warnings == [f"{rank_file_name(1)}: attributes host have a type the shim never "
                                                "writes (corrupt); read as absent"], (got.info.host, warnings)  # fmt: skip
    twin: list[str] = []
    assert read_rank(real_run / rank_file_name(1), twin).info.host and not twin  # type: ignore[union-attr]


def test_a_heap_walk_refuses_what_would_send_libhdf5_astray(real_run: Path) -> None:
    """Each rule of :func:`distdiag.gheap.walk` on a real collection, broken one at a time."""
    path = real_run / rank_file_name(0)
    refs = _refs(path)
    blob = path.read_bytes()
    addr = int(refs["addr"].max())
    data = blob[addr : addr + int.from_bytes(blob[addr + 8 : addr + 16], "little")]
    col = gheap.walk(addr, data)
    assert isinstance(col, gheap.Collection)
    objs = _objects(data)
    idx, hdr, size = next(o for o in objs if o[0] > 0 and o[2] > 0)

    def broken(at: int, value: bytes) -> str:
        b = bytearray(data)
        b[at : at + len(value)] = value
        got = gheap.walk(addr, bytes(b))
        assert isinstance(got, str), got
        return got

    assert "version 2" in broken(4, b"\x02")
    assert "no global heap collection" in broken(0, b"XCOL")
    assert "cut short" in broken(8, (len(data) + 8).to_bytes(8, "little"))
    assert "runs past its end" in broken(hdr + 8, (len(data)).to_bytes(8, "little"))
    free = next(p for i, p, _ in objs if i == 0)
    assert "free-space object of 0 bytes" in broken(free + 8, bytes(8))
    other = next(p for i, p, _ in objs if i > 0 and i != idx)
    assert "holds an object twice" in broken(other, idx.to_bytes(2, "little"))
    # collections that overlap, or past the file's end, are not read
    good, bad = gheap.collections([addr, addr + 16], lambda o, n: blob[o : o + n], len(blob))
    assert list(good) == [addr] and "overlaps" in bad[0]
    good, bad = gheap.collections([len(blob) - 8], lambda o, n: blob[o : o + n], len(blob))
    assert not good and "past the file's end" in bad[0]
    # a reference to no object, or of another length, reads as "" and is counted
    rows = refs[refs["addr"] == addr][:3].copy()
    want, n_bad = gheap.decode(rows, {addr: col}, "utf-8")
    assert n_bad == 0 and want == [data[col.begin[i] : col.begin[i] + n].decode() for i, n in zip(rows["idx"], rows["len"])]
    rows["idx"][0] = 60000
    rows["len"][1] += 1
    got, n_bad = gheap.decode(rows, {addr: col}, "utf-8")
    assert n_bad == 2 and got[:2] == ["", ""] and got[2] == want[2]


# -- structural mutations: well-formed HDF5 that lies (tests/mutations.py) --------------------------

@pytest.fixture(scope="module")
def outside(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return mutations.make_outside(tmp_path_factory.mktemp("home"))


def _mutated_outcome(real_run: Path, outside: Path, tmp: Path, names: list[str], seed: int) -> mutations.Outcome:
    d = tmp / "run"
    shutil.copytree(real_run, d)
    mutations.mutate(d, outside, names, seed)
    got = mutations.analyze_isolated(d, tmp / "out", timeout_s=60, mem_bytes=2 << 30)
    what = f"{names} seed {seed}: {got!r}"
    assert got.kind in ("report", "error"), what  # no crash, no hang, no MemoryError under the bound
    assert not got.quoted, what  # not one byte from outside the run dir
    assert got.rss_growth <= mutations.rss_bound(d), what
    return got


@pytest.mark.parametrize("name", sorted(mutations.MUTATIONS))
def test_each_structural_mutation_is_a_report_or_one_error_within_bounds(
    real_run: Path, outside: Path, tmp_path: Path, name: str
) -> None:
    _mutated_outcome(real_run, outside, tmp_path, [name], seed=1)


@pytest.mark.parametrize("name", ["external_storage", "external_link", "virtual_dataset", "link_to_outside",
                                  "compression_bomb", "shared_heap_strings"])  # fmt: skip
def test_a_mutation_that_reaches_outside_or_bombs_is_said_in_the_warnings(
    real_run: Path, outside: Path, tmp_path: Path, name: str
) -> None:
    """Not silently absorbed: the report says which file was refused or cut."""
    got = _mutated_outcome(real_run, outside, tmp_path, [name], seed=1)
    assert got.kind == "report", got
    warnings = json.loads((tmp_path / "out" / "report.json").read_text())["run"]["warnings"]
    assert [w for w in warnings if w.startswith("rank-0000")], warnings


@pytest.mark.parametrize("attr, value", [("env", "null"), ("env", "[1, 2]"), ("env", '{"SLURM_JOB_ID": 7}'),
                                         ("argv", "null"), ("argv", '{"a": 1}'), ("config", "3")])  # fmt: skip
def test_json_attributes_of_the_wrong_shape_read_as_absent(real_run: Path, tmp_path: Path, attr: str,
                                                          value: str) -> None:  # fmt: skip
    """Found by benchmarks/fuzz_rundirs.py (seed 577): ``env`` = null crashed the Slurm lookup
    (``i.env.get`` on None) once the dir held stored accounting."""
    d = tmp_path / "run"
    shutil.copytree(real_run, d)
    for p in sorted(d.glob("rank-*.h5")):
        with h5py.File(p, "r+") as f:
            f.attrs[attr] = value
    (d / "slurm-accounting.json").write_text(json.dumps({"schema": 1, "job": {"job_id": "7", "state": "COMPLETED"}}))
    rep, err = report_or_error(d)
    assert err is None, err
    i = rep.run.ranks[0]
    assert isinstance(i.env, dict) and isinstance(i.argv, list) and isinstance(i.config, dict)
    assert all(isinstance(v, str) for v in i.env.values()) and all(isinstance(a, str) for a in i.argv)


def test_a_collective_seq_of_int64_max_is_analyzed(real_run: Path, tmp_path: Path) -> None:
    """Found by benchmarks/fuzz_rundirs.py: the match's key radix seq.max() + 1 passed int64
    (OverflowError in match_collectives)."""
    d = tmp_path / "run"
    shutil.copytree(real_run, d)
    with h5py.File(d / rank_file_name(1), "r+") as f:
        ev = f["events"][()]
        at = np.flatnonzero(ev["seq"] >= 0)[:1]
        ev["seq"][at] = np.iinfo(np.int64).max
        f["events"][...] = ev
    rep, err = report_or_error(d)
    assert err is None, err


@pytest.mark.parametrize("table", ["strings", "events"])
def test_a_table_declaring_2_31_rows_in_1_row_chunks_never_written_reads_within_the_bound(
    real_run: Path, tmp_path: Path, table: str
) -> None:
    """Found by benchmarks/fuzz_rundirs.py (seed 7063, huge_dims): HDF5 spends ~6 KB of its
    own memory per empty chunk it is asked for, so reading the rows the file's size allows
    (86,129 one-row chunks) grew the analysis by 540 MB from a 1.4 MB file."""
    d = tmp_path / "run"
    shutil.copytree(real_run, d)
    with h5py.File(d / rank_file_name(0), "r+") as f:
        dtype = f[table].dtype
        del f[table]
        f.create_dataset(table, shape=(1 << 31,), dtype=dtype, chunks=(1,), maxshape=(None,))
    got = mutations.analyze_isolated(d, tmp_path / "out", timeout_s=60, mem_bytes=2 << 30)
    assert got.kind in ("report", "error"), got
    assert got.rss_growth <= mutations.rss_bound(d) and got.rss_growth < 64 << 20, got
    if got.kind == "report":
        warnings = json.loads((tmp_path / "out" / "report.json").read_text())["run"]["warnings"]
        assert [w for w in warnings if f"/{table} declares 2147483648" in w and "first 0 were written" in w], warnings


def test_every_rank_s_strings_stored_outside_is_one_error_that_says_why(real_run: Path, outside: Path,
                                                                          tmp_path: Path) -> None:  # fmt: skip
    """The review's case on every rank: no rank file has a table of its own left to read."""
    got = _mutated_outcome(real_run, outside, tmp_path, ["external_strings"], seed=1)
    assert got.kind == "error" and "external file" in got.detail, got


@settings(max_examples=24, deadline=None, derandomize=True, database=None, phases=[Phase.explicit, Phase.generate],
          print_blob=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])  # fmt: skip
@given(names=st.lists(st.sampled_from(sorted(mutations.MUTATIONS)), min_size=1, max_size=4),
       seed=st.integers(0, 2**32 - 1))  # fmt: skip
def test_structural_mutations_combined_are_a_report_or_one_error(real_run: Path, outside: Path, names: list[str],
                                                                seed: int) -> None:  # fmt: skip
    with tempfile.TemporaryDirectory() as td:
        _mutated_outcome(real_run, outside, Path(td), names, seed)


# -- structural damage, case by case --------------------------------------------------------


def _four(tmp_path: Path, n: int = 4) -> Path:
    for r in range(n):
        s = [""]
        write_rank(tmp_path, r, n, [coll(10.0 * i + 0.1 * r, 10.0 * i + 2, i, s) for i in range(6)], s)
    return tmp_path


def _edit(path: Path, fn: Callable[[h5py.File], None]) -> None:
    with h5py.File(path, "r+") as f:
        fn(f)


def _replace(name: str, data: Any) -> Callable[[h5py.File], None]:
    def fn(f: h5py.File) -> None:
        del f[name]
        f.create_dataset(name, data=data)

    return fn


def _set(name: str, value: Any) -> Callable[[h5py.File], None]:
    def fn(f: h5py.File) -> None:
        f.attrs[name] = value

    return fn


def _delete(name: str) -> Callable[[h5py.File], None]:
    def fn(f: h5py.File) -> None:
        del f[name]

    return fn


def _group(name: str) -> Callable[[h5py.File], None]:
    def fn(f: h5py.File) -> None:
        del f[name]
        f.create_group(name)

    return fn


STRUCTURAL: dict[str, tuple[Callable[[h5py.File], None], str]] = {
    # name: (damage to rank 1's file, a word the warnings must hold)
    "events_of_ints": (_replace("events", np.arange(10)), "rank-00001.h5"),
    "events_2d": (_replace("events", np.zeros((3, 4), EVENT_DTYPE)), "rank-00001.h5"),
    "events_scalar": (_replace("events", np.zeros((), EVENT_DTYPE)), "rank-00001.h5"),
    "events_fewer_fields": (_replace("events", np.zeros(5, [("t0_ns", "<i8"), ("kind", "u1")])), ""),
    "strings_of_ints": (_replace("strings", np.arange(5)), "rank-00001.h5"),
    "strings_a_group": (_group("strings"), "rank-00001.h5"),
    "no_strings": (_delete("strings"), "rank-00001.h5"),
    "no_events": (_delete("events"), "rank-00001.h5"),
    "inflight_of_floats": (_replace("inflight", np.ones(3)), ""),
    "sync_of_strings": (_replace("clock_sync", np.array([b"x", b"y"])), ""),
    "rank_text": (_set("rank", "one"), ""),
    "rank_negative": (_set("rank", -7), ""),
    "rank_huge": (_set("rank", 2**62), "rank-00001.h5"),
    "world_size_huge": (_set("world_size", 2**40), "world size"),
    "world_size_negative": (_set("world_size", -3), ""),
    "schema_text": (_set(SCHEMA_ATTR, "one"), "schema"),
    "schema_array": (_set(SCHEMA_ATTR, np.array([1, 2])), "rank-00001.h5"),
    "times_as_text": (_set("mono_ns_at_start", "yesterday"), ""),
    "exit_code_text": (_set("exit_code", "bad"), ""),
    "pid_float": (_set("pid", 1.5), ""),
    "argv_not_json": (_set("argv", "[unclosed"), ""),
    "lost_events_negative": (_set("lost_events", -5), ""),
    "host_bytes": (_set("host", np.bytes_(b"\xff\xfe")), ""),
    "string_ids_out_of_range": (
        lambda f: f["events"].__setitem__("name_id", np.full(len(f["events"]), 10**6, np.int32)), "string ids"),
    "kind_unknown": (lambda f: f["events"].__setitem__("kind", np.full(len(f["events"]), 250, np.uint8)), ""),
    "times_reversed": (lambda f: f["events"].__setitem__("t1_ns", np.zeros(len(f["events"]), np.int64)), ""),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(STRUCTURAL))
def test_structural_damage_is_warned_and_the_rest_analyzed(tmp_path: Path, case: str) -> None:
    d = _four(tmp_path)
    damage, word = STRUCTURAL[case]
    _edit(d / rank_file_name(1), damage)
    t = time.monotonic()
    rep, err = report_or_error(d)
    assert time.monotonic() - t < 20  # no blow-up (a world size of 2^40 must not become a list)
    assert rep is not None, err
    assert {0, 2, 3} <= set(rep.run.ranks)
    assert rep.run.world_size <= 4 or rep.run.world_size == len(rep.run.ranks)
    if word:
        assert any(word in w for w in rep.run.warnings), rep.run.warnings


def test_huge_string_table_loads_in_bounded_time(tmp_path: Path) -> None:
    """200,000 distinct 120-character paths in one rank's table (an import storm): it loads."""
    d = _four(tmp_path)
    big = [""] + [f"/lustre/project/site-packages/pkg{i:06d}/" + "x" * 80 + ".py" for i in range(200_000)]

    def fn(f: h5py.File) -> None:
        old = list(f["strings"].asstr()[:])
        del f["strings"]
        f.create_dataset("strings", data=old + big[1:], dtype=h5py.string_dtype("utf-8"))

    _edit(d / rank_file_name(1), fn)
    t = time.monotonic()
    rep, err = report_or_error(d)
    assert rep is not None, err
    assert len(rep.run.strings) >= 200_000
    assert time.monotonic() - t < 30


def test_zero_event_ranks_never_started_ranks_and_duplicates_together(tmp_path: Path) -> None:
    d = tmp_path
    for r in (0, 1):
        s = [""]
        write_rank(d, r, 6, [coll(10.0 * i, 10.0 * i + 2, i, s) for i in range(4)], s)
    write_rank(d, 2, 6, [], [""])  # started, recorded nothing
    # rank 3 and 4 never started (no file); rank 5's file is empty (killed at create)
    (d / rank_file_name(5)).write_bytes(b"")
    # a second launch left a rank 1 file under another name
    shutil.copy(d / rank_file_name(1), d / "rank-00011.h5")
    rep, err = report_or_error(d)
    assert rep is not None, err
    w = " | ".join(rep.run.warnings)
    assert rep.run.missing_ranks == [3, 4, 5]
    assert "rank 1 appears in both" in w and "rank-00005.h5" in w
    assert 2 in rep.run.ranks and rep.run.ranks[2].n_events == 0


def test_a_dir_of_only_damaged_files_is_one_clear_error(tmp_path: Path) -> None:
    (tmp_path / rank_file_name(0)).write_bytes(b"\x89HDF\r\n\x1a\n" + b"\0" * 100)
    (tmp_path / rank_file_name(1)).write_bytes(b"")
    rep, err = report_or_error(tmp_path)
    assert rep is None and err is not None
    assert "rank-00000.h5" in err or "rank files" in err


def test_other_schema_version_says_what_to_do(tmp_path: Path) -> None:
    d = _four(tmp_path)
    _edit(d / rank_file_name(2), _set(SCHEMA_ATTR, 99))
    rep, err = report_or_error(d)
    assert rep is not None, err
    line = next(w for w in rep.run.warnings if "rank-00002.h5" in w)
    assert "schema 99" in line and "pip install" in line


# -- sizes libhdf5 allocates unchecked (distdiag.h5guard) ----------------------------------------
def _messages(blob: bytes, header: int) -> list[tuple[int, int, int]]:
    """(type, offset of its data in the file, size) of each message of the version-1 object header
    at ``header``, in its first chunk and each continuation chunk (the tests' own reading of the
    format, HDF5 spec IV.A.1.a and IV.A.2.q)."""
    first = int.from_bytes(blob[header + 8 : header + 12], "little")
    chunks, out = [(header + 16, first)], []
    while chunks:
        start, n = chunks.pop()
        p = start
        while p + 8 <= start + n:
            mtype, size = int.from_bytes(blob[p : p + 2], "little"), int.from_bytes(blob[p + 2 : p + 4], "little")
            out.append((mtype, p + 8, size))
            if mtype == 0x10:
                chunks.append((int.from_bytes(blob[p + 8 : p + 16], "little"), int.from_bytes(blob[p + 16 : p + 24],
                                                                                             "little")))  # fmt: skip
            p += 8 + size
    return out


def _root_header(blob: bytes) -> int:
    assert blob[8] == 0, "the shim writes a version-0 superblock"
    return int.from_bytes(blob[64:72], "little")  # the root entry's object header address


def _damage(blob: bytearray, where: str) -> str:
    """Make one header of a real rank file declare what libhdf5 would allocate unchecked; the
    line the reader must then give."""
    root = _root_header(bytes(blob))
    msgs = _messages(bytes(blob), root)
    if where == "continuation":
        at = [p for t, p, _ in msgs if t == 0x10][0]
        blob[at + 8 : at + 16] = (1 << 30).to_bytes(8, "little")
        return "the root group's object header continues at byte"
    if where == "free list":
        at = [p for t, p, _ in msgs if t == 0x11][0]
        heap = int.from_bytes(blob[at + 8 : at + 16], "little")
        assert blob[heap : heap + 4] == b"HEAP"
        head = int.from_bytes(blob[heap + 16 : heap + 24], "little")
        data = int.from_bytes(blob[heap + 24 : heap + 32], "little")
        assert head != 1, "the shim's name heap has free space"
        blob[data + head : data + head + 8] = head.to_bytes(8, "little")  # the free block is its own successor
        return "name heap at byte"
    assert where == "table header"
    with tempfile.NamedTemporaryFile(suffix=".h5") as tf:  # libhdf5 says where /events's header is
        tf.write(bytes(blob))
        tf.flush()
        with h5py.File(tf.name, "r") as f:
            table = int(h5py.h5g.get_objinfo(f.id, b"events").objno[0])
    assert blob[table] == 1, "a version-1 object header"
    blob[table + 8 : table + 12] = (1 << 30).to_bytes(4, "little")
    return f"of the root group's object header at byte {table} declares"


def _vm_limited(fn: Callable[[], Any], extra: int = 512 << 20) -> Callable[[], Any]:
    """``fn`` run under an address-space bound of the process's size now plus ``extra`` (in the
    forked child that runs it: the bound is the child's)."""
    import resource

    def bounded() -> Any:
        with open("/proc/self/status") as st:
            vm = next(int(x.split()[1]) * 1024 for x in st if x.startswith("VmSize:"))
        resource.setrlimit(resource.RLIMIT_AS, (vm + extra, resource.RLIM_INFINITY))
        return fn()

    return bounded


@pytest.mark.parametrize("where", ["continuation", "free list", "table header"])
def test_a_header_that_declares_more_than_the_file_is_refused_before_libhdf5_allocates_it(
        real_run: Path, tmp_path: Path, where: str) -> None:  # fmt: skip
    """Version-1 headers carry no checksum: one flipped byte in a size made libhdf5 allocate and
    fill 721 MB opening the file, or allocate free-list nodes until memory ran out (fuzzing,
    seeds 8273, 12019, 13576, 15919). Each such size in a real rank file: under a memory bound
    libhdf5 fails on it (the fault is real), the reader skips the rank with why, and the healthy
    twin reads under the same bound."""
    d = tmp_path / "run"
    shutil.copytree(real_run, d)
    path = d / rank_file_name(1)
    blob = bytearray(path.read_bytes())
    said = _damage(blob, where)
    path.write_bytes(bytes(blob))

    def with_h5py(p: Path) -> Callable[[], Any]:
        def fn() -> Any:
            with h5py.File(p, "r") as f:
                return [int(f[k].id.get_type().get_size()) for k in f]

        return fn

    with pytest.raises(AssertionError):  # the fault is real: libhdf5 fails (or crashes) under the bound
        mutations.in_child(_vm_limited(with_h5py(path)), timeout_s=60)
    assert mutations.in_child(_vm_limited(with_h5py(real_run / rank_file_name(1))), timeout_s=60)  # the control

    def read(p: Path) -> Any:
        got = read_rank(p, [])
        return got if isinstance(got, str) else sorted(got.info.__dict__)

    line = mutations.in_child(_vm_limited(lambda: read(path)), timeout_s=60)
    assert isinstance(line, str) and line.startswith(f"{path.name} cannot be opened as HDF5 (truncated or corrupt: "), line
    assert said in line and ("past the end of the file" in line or "loops" in line), line
    assert not isinstance(mutations.in_child(_vm_limited(lambda: read(real_run / rank_file_name(1))), timeout_s=60),
                          str)  # fmt: skip
