"""The file-I/O hook keeps every behaviour of what it wraps, and records what it saw.

Each behaviour is checked against the same call with the hook off, so a test
fails as soon as a wrapper changes a result, a type, an exception or a side
effect.
"""

from __future__ import annotations

import _io
import builtins
import errno
import gc
import io
import os
import posix
import sys
import textwrap
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pytest

from distdiag.schema import Kind
from distdiag.shim import mounts
from distdiag.shim.hooks import fileio
from distdiag.shim.recorder import Recorder, as_events

PATCHED = [
    (builtins, "open"),
    (io, "open"),
    (io, "open_code"),
    (_io, "open_code"),
    (os, "open"),
    (os, "close"),
    (os, "stat"),
    (os, "lstat"),
    (os, "listdir"),
    (os, "scandir"),
    (os, "chdir"),
    (os, "fsync"),
    (os, "fdatasync"),
    (posix, "stat"),
    (posix, "lstat"),
    (posix, "listdir"),
]


def events(rec: Recorder) -> np.ndarray:
    parts = [np.frombuffer(buf, dtype=as_events(buf, 0, 0).dtype, count=n).copy() for buf, n in rec.full]
    parts += [as_events(tb.buf, 0, tb.n) for tb in rec.buffers]
    return np.concatenate(parts) if parts else np.zeros(0, as_events(bytearray(69), 0, 0).dtype)


class Hooked:
    def __init__(self, rec: Recorder) -> None:
        self.rec = rec

    def rows(self, kind: Kind | None = None, path: str | os.PathLike[str] | None = None) -> np.ndarray:
        ev = events(self.rec)
        if kind is not None:
            ev = ev[ev["kind"] == int(kind)]
        if path is not None:
            pid = self.rec.strings.ids.get(os.path.abspath(os.fspath(path)), -1)
            ev = ev[ev["name_id"] == pid]
        return ev

    def s(self, i: int) -> str:
        return self.rec.strings.strings[int(i)]


@pytest.fixture
def hooked() -> Iterator[Hooked]:
    originals = {(o, n): getattr(o, n) for o, n in PATCHED}
    rec = Recorder(chunk_rows=4096)
    fileio.install(rec, None)
    try:
        yield Hooked(rec)
    finally:
        fileio.uninstall()
        for (o, n), f in originals.items():
            assert getattr(o, n) is f, f"{o.__name__}.{n} not restored"


def both(fn: Callable[[], Any], hooked_rec: Hooked | None = None) -> tuple[Any, Any]:
    """``fn()`` with the hook off, then on (the caller's fixture installed it)."""
    fileio.uninstall()
    try:
        plain = _outcome(fn)
    finally:
        fileio.install(hooked_rec.rec if hooked_rec else Recorder(), None)
    return plain, _outcome(fn)


def _outcome(fn: Callable[[], Any]) -> Any:
    try:
        return ("ok", fn())
    except Exception as e:  # compare type, args, errno, filename: everything the user sees
        return ("raised", type(e), e.args, getattr(e, "errno", None), getattr(e, "filename", None), str(e))


# -- uninstall ------------------------------------------------------------------------
def test_uninstall_restores_every_original_exactly() -> None:
    originals = {(o, n): getattr(o, n) for o, n in PATCHED}
    fileio.install(Recorder(), None)
    assert all(getattr(o, n) is not originals[(o, n)] for o, n in PATCHED)
    assert builtins.open.__wrapped__ is originals[(builtins, "open")]  # functools.wraps keeps the link
    fileio.uninstall()
    for (o, n), f in originals.items():
        assert getattr(o, n) is f, f"{o.__name__}.{n}"


def test_install_twice_wraps_once(hooked: Hooked) -> None:
    first = builtins.open
    fileio.install(Recorder(), None)
    assert builtins.open is first


# -- open -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "mode,kwargs,payload",
    [
        ("w", {}, "plain text\nsecond line\n"),
        ("w", {"encoding": "utf-16"}, "ünïcödé\n"),
        ("w", {"encoding": "latin-1", "newline": "\r\n"}, "a\nb\n"),
        ("wb", {}, b"\x00\x01binary"),
        ("wb", {"buffering": 0}, b"unbuffered"),
        ("x", {}, "exclusive"),
        ("a", {}, "appended"),
        ("w+", {}, "read back"),
        ("wb+", {}, b"random access"),
    ],
)
def test_open_modes_types_and_contents_unchanged(hooked: Hooked, tmp_path: Path, mode: str, kwargs: dict[str, Any], payload: Any) -> None:
    def run(tag: str) -> Any:
        p = tmp_path / f"{tag}.dat"
        if "a" in mode:
            p.write_text("prefix ")
        with open(p, mode, **kwargs) as f:
            info = (type(f), f.mode, type(f.name), f.name.replace(tag, "X"), getattr(f, "encoding", None), f.writable(), f.readable())
            n = f.write(payload)
            if "+" in mode:
                f.seek(0)
                back = f.read()
            else:
                back = None
            fd_ok = isinstance(f.fileno(), int)
        return info, n, back, fd_ok, f.closed, p.read_bytes(), repr(f).replace(tag, "X")

    fileio.uninstall()
    plain = run("plain")
    fileio.install(hooked.rec, None)
    assert run("hooked") == plain
    # and the open was recorded, with the write counted for binary files
    p = tmp_path / "hooked.dat"
    # the test's open, p.read_bytes() and, for append, p.write_text()
    assert len(hooked.rows(Kind.FILE_OPEN, p)) == (3 if "a" in mode else 2)
    gc.collect()  # small counted calls are summed until the file object is freed
    if "b" in mode and "buffering" not in kwargs:
        assert hooked.rows(Kind.FILE_WRITE, p)["nbytes"].sum() == len(payload)
    else:
        assert len(hooked.rows(Kind.FILE_WRITE, p)) == 0  # text files are not counted


def test_open_read_modes_and_iteration(hooked: Hooked, tmp_path: Path) -> None:
    p = tmp_path / "r.txt"
    p.write_bytes(b"line1\r\nline2\nline3")

    def run() -> Any:
        out = []
        for kw in ({}, {"newline": ""}, {"encoding": "ascii", "errors": "strict"}):
            with open(p, "r", **kw) as f:
                out.append((list(f), type(f)))
        with open(p, "rb") as f:
            out.append((f.readline(), f.read(3), f.read(), f.tell(), type(f)))
        with open(p, "rb", buffering=0) as f:
            b = bytearray(4)
            out.append((f.readinto(b), bytes(b), type(f)))
        with p.open("rb") as f:
            out.append((f.read(), type(f)))
        with open(p, mode="rb") as f:
            out.append((f.read(), type(f), f.mode))
        return out

    plain, with_hook = both(run, hooked)
    assert plain == with_hook


def test_open_of_fd_closefd_and_opener_behave(hooked: Hooked, tmp_path: Path) -> None:
    p = tmp_path / "fd.bin"
    p.write_bytes(b"abcdef")

    def run() -> Any:
        fd = os.open(p, os.O_RDONLY)
        with open(fd, "rb", closefd=False) as f:
            first = f.read(2)
        os.lseek(fd, 0, os.SEEK_SET)
        still_open = os.read(fd, 1)
        os.close(fd)
        with open(p, "rb", opener=lambda path, flags: os.open(path, flags)) as g:
            viaopener = g.read()
        return first, still_open, viaopener

    plain, with_hook = both(run, hooked)
    assert plain == with_hook
    assert len(hooked.rows(Kind.FILE_CLOSE, p)) >= 1  # os.open'd fd closed through os.close


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda d: open(d / "missing.txt"), id="missing"),
        pytest.param(lambda d: open(d / "missing.txt", "rb"), id="missing-binary"),
        pytest.param(lambda d: open(d), id="is-a-directory"),
        pytest.param(lambda d: open(d / "no" / "dir" / "f", "w"), id="missing-dir"),
        pytest.param(lambda d: open(d / "exists.txt", "x"), id="exists"),
        pytest.param(lambda d: open(d / "exists.txt", "rw"), id="bad-mode"),
        pytest.param(lambda d: open(d / "exists.txt", "r", buffering=0), id="unbuffered-text"),
        pytest.param(lambda d: open(d / "exists.txt", encoding="no-such-codec"), id="bad-encoding"),
        pytest.param(lambda d: open(3.5), id="bad-type"),
        pytest.param(lambda d: open(d / "exists.txt", ["rb"]), id="mode-not-str"),
        pytest.param(lambda d: open(d / "exists.txt", mode=["rb"]), id="mode-kw-not-str"),
        pytest.param(lambda d: open(d / "exists.txt", mode="rb", bogus=1), id="unknown-kwarg"),
        pytest.param(lambda d: open(d / "exists.txt", "rbb"), id="mode-twice"),
        pytest.param(lambda d: os.open(d / "missing.txt", os.O_RDONLY), id="os.open-missing"),
        pytest.param(lambda d: io.open_code(str(d / "missing.py")), id="open_code-missing"),
    ],
)
def test_open_exceptions_are_the_same(hooked: Hooked, tmp_path: Path, call: Callable[[Path], Any]) -> None:
    (tmp_path / "exists.txt").write_text("x")
    plain, with_hook = both(lambda: call(tmp_path), hooked)
    assert plain[0] == "raised"
    assert with_hook == plain


def test_failed_open_is_recorded_with_errno(hooked: Hooked, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        open(tmp_path / "nope")
    rows = hooked.rows(Kind.FILE_OPEN, tmp_path / "nope")
    assert len(rows) == 1 and rows["value"][0] == errno.ENOENT
    assert hooked.s(rows["site_id"][0]).startswith(__file__ + ":")


# -- stat / exists / listdir / scandir -----------------------------------------------
def test_stat_family_unchanged(hooked: Hooked, tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_text("1234")
    link = tmp_path / "link"
    link.symlink_to(f)
    broken = tmp_path / "broken"
    broken.symlink_to(tmp_path / "gone")

    def run() -> Any:
        dfd = os.open(tmp_path, os.O_RDONLY)
        try:
            return (
                type(os.stat(f)),
                os.stat(f)[:7],
                os.lstat(link).st_mode,
                os.stat(link, follow_symlinks=False).st_mode,
                os.stat("f", dir_fd=dfd).st_size,
                os.stat(dfd).st_mode,
                os.stat(str(f).encode()).st_size,
                os.path.exists(f), os.path.exists(tmp_path / "nope"), os.path.lexists(broken), os.path.exists(broken),
                os.path.isfile(f), os.path.isdir(tmp_path), os.path.islink(link), os.path.getsize(f),
                f.exists(), f.is_file(), (tmp_path / "nope").exists(),
                _outcome(lambda: os.stat(tmp_path / "nope")),
                _outcome(lambda: os.lstat(tmp_path / "nope")),
                _outcome(lambda: os.stat(None)),  # type: ignore[arg-type]
            )
        finally:
            os.close(dfd)

    plain, with_hook = both(run, hooked)
    assert plain == with_hook
    # os.path.exists/isfile/getsize and pathlib go through os.stat: all recorded, misses too
    st = hooked.rows(Kind.FILE_STAT, f)
    assert len(st) == 8  # stat x2, bytes path, exists, isfile, getsize, Path.exists, Path.is_file
    miss = hooked.rows(Kind.FILE_STAT, tmp_path / "nope")
    assert len(miss) >= 3 and set(miss["value"]) == {float(errno.ENOENT)}
    assert {hooked.s(i).rsplit(":", 1)[0] for i in st["site_id"]} == {__file__}


def test_listdir_scandir_unchanged(hooked: Hooked, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for n in "abc":
        (tmp_path / n).write_text(n)
    monkeypatch.chdir(tmp_path)

    def run() -> Any:
        with os.scandir(tmp_path) as it:
            kind = type(it)
            names = sorted(e.name for e in it)
        it2 = os.scandir()
        n2 = sorted(e.name for e in it2)
        it2.close()
        return (
            sorted(os.listdir(tmp_path)), sorted(os.listdir()), sorted(os.listdir(None)), sorted(os.listdir(os.fsencode(tmp_path))),
            kind, names, n2, sorted(os.listdir(path=str(tmp_path))),
            _outcome(lambda: os.listdir(tmp_path / "nope")), _outcome(lambda: os.scandir(tmp_path / "a")),
            sorted(p.name for p in tmp_path.iterdir()),
        )

    plain, with_hook = both(run, hooked)
    assert plain == with_hook
    assert len(hooked.rows(Kind.FILE_LISTDIR, tmp_path)) >= 7  # "." and None resolve to the cwd
    assert len(hooked.rows(Kind.FILE_LISTDIR, tmp_path / "nope")) == 1


def test_chdir_invalidates_relative_paths(hooked: Hooked, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    os.path.exists("x")
    os.chdir(tmp_path / "b")
    os.path.exists("x")
    assert len(hooked.rows(Kind.FILE_STAT, tmp_path / "a" / "x")) == 1
    assert len(hooked.rows(Kind.FILE_STAT, tmp_path / "b" / "x")) == 1


# -- bytes ----------------------------------------------------------------------------
def test_binary_bytes_counted_big_calls_are_rows(hooked: Hooked, tmp_path: Path) -> None:
    p = tmp_path / "ckpt.bin"
    big = os.urandom(3 << 20)
    with open(p, "wb") as f:
        f.write(big)  # one big call: its own row with its exact duration
        for _ in range(100):
            f.write(b"0123456789")  # small calls: summed
    del f
    gc.collect()
    w = hooked.rows(Kind.FILE_WRITE, p)
    assert w["nbytes"].sum() == len(big) + 1000
    assert (w["nbytes"] == len(big)).sum() == 1
    assert w["value"].sum() == 2  # raw calls: the big one, then one buffer flush at close
    with open(p, "rb") as f:
        head = f.read(100)
        buf = bytearray(1000)
        f.readinto(buf)
        rest = f.read()
    del f
    gc.collect()
    assert head + bytes(buf) + rest == big + b"0123456789" * 100
    r = hooked.rows(Kind.FILE_READ, p)
    assert r["nbytes"].sum() == p.stat().st_size
    assert (r["t1_ns"] >= r["t0_ns"]).all()


def test_close_recorded_when_it_takes_time(hooked: Hooked, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = tmp_path / "c.bin"
    with open(p, "wb") as f:
        f.write(b"fast")
    assert len(hooked.rows(Kind.FILE_CLOSE, p)) == 0  # a 2 us local close is not worth a row
    monkeypatch.setattr(fileio, "CLOSE_MIN_NS", 0)
    with open(p, "rb") as f:
        f.read()
    g = open(p, "ab")
    g.write(b"x")
    del g  # closed by refcount, through the same close
    rows = hooked.rows(Kind.FILE_CLOSE, p)
    assert len(rows) == 2 and (rows["t1_ns"] >= rows["t0_ns"]).all()
    assert p.read_bytes() == b"fastx"


def test_counting_file_objects_close_at_once_without_cycles(hooked: Hooked, tmp_path: Path) -> None:
    """The idiom open(p, 'wb').write(b) must close (and flush) the file right away."""
    p = tmp_path / "idiom.bin"
    gc.disable()
    try:
        open(p, "wb").write(b"now")
        assert p.read_bytes() == b"now"
    finally:
        gc.enable()


def test_run_dir_and_pseudo_files_not_recorded(hooked: Hooked, tmp_path: Path) -> None:
    run_dir = tmp_path / "distdiag-run"
    run_dir.mkdir()
    fileio.skip_dir(run_dir)
    (run_dir / "rank-00000.h5").write_bytes(b"x")
    os.stat(run_dir / "rank-00000.h5")
    open("/proc/self/status").read()
    os.stat("/dev/null")
    ev = hooked.rows()
    names = {hooked.s(i) for i in ev["name_id"]}
    assert not any(n.startswith(str(run_dir)) for n in names)
    assert "/proc/self/status" not in names and "/dev/null" not in names
    if os.path.isdir("/dev/shm"):  # tmpfs: real files, recorded
        os.path.exists("/dev/shm/distdiag-test-nothing")
        assert len(hooked.rows(Kind.FILE_STAT, "/dev/shm/distdiag-test-nothing")) == 1


def test_import_storm_is_seen(hooked: Hooked, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / "stormpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from . import m0, m1, m2\n")
    for i in range(3):
        (pkg / f"m{i}.py").write_text(f"X = {i}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "stormpkg", raising=False)
    import stormpkg  # noqa: F401

    for i in range(3):
        assert len(hooked.rows(Kind.FILE_STAT, pkg / f"m{i}.py")) >= 1
        assert len(hooked.rows(Kind.FILE_OPEN, pkg / f"m{i}.py")) >= 1  # open_code reads the source
    assert len(hooked.rows(Kind.FILE_LISTDIR, pkg)) >= 1
    for m in ("stormpkg", "stormpkg.m0", "stormpkg.m1", "stormpkg.m2"):
        sys.modules.pop(m, None)


def test_mount_tag_is_recorded(hooked: Hooked, tmp_path: Path) -> None:
    p = tmp_path / "t"
    p.write_text("x")
    os.stat(p)
    row = hooked.rows(Kind.FILE_STAT, p)[0]
    fstype, mnt = mounts.lookup(str(p))
    assert hooked.s(row["aux"]) == f"{fstype}:{mnt}"


def test_h5py_and_numpy_paths(hooked: Hooked, tmp_path: Path) -> None:
    import h5py

    p = tmp_path / "d.h5"
    with h5py.File(p, "w") as f:
        f["x"] = np.arange(10)
        assert isinstance(f, h5py.File) and isinstance(f["x"].file, h5py.File)
    with pytest.raises(FileNotFoundError):
        h5py.File(tmp_path / "missing.h5", "r")
    assert len(hooked.rows(Kind.FILE_OPEN, p)) == 1
    assert len(hooked.rows(Kind.FILE_CLOSE, p)) == 1
    assert hooked.rows(Kind.FILE_OPEN, tmp_path / "missing.h5")["value"][0] == errno.ENOENT

    a = np.arange(1000, dtype=np.float64)
    np.save(tmp_path / "a", a)
    assert np.array_equal(np.load(tmp_path / "a.npy"), a)
    m = np.load(tmp_path / "a.npy", mmap_mode="r")
    assert isinstance(m, np.memmap)
    assert hooked.rows(Kind.FILE_WRITE, tmp_path / "a.npy")["nbytes"].max() == a.nbytes
    assert hooked.rows(Kind.FILE_READ, tmp_path / "a.npy")["nbytes"].max() == a.nbytes
    assert len(hooked.rows(Kind.FILE_OPEN, tmp_path / "a.npy")) >= 3  # save, load, load(mmap_mode) (+ memmap's own)


def test_threads_record_into_their_own_buffers(hooked: Hooked, tmp_path: Path) -> None:
    import threading

    def work() -> None:
        for i in range(50):
            os.path.exists(tmp_path / f"t{i}")

    ts = [threading.Thread(target=work) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=30)
    ev = hooked.rows(Kind.FILE_STAT)
    ev = ev[np.isin(ev["name_id"], [hooked.rec.strings.ids.get(str(tmp_path / f"t{i}"), -1) for i in range(50)])]
    assert len(ev) == 200 and len(set(ev["tid"])) == 4


def test_shim_never_raises_when_recorder_breaks(tmp_path: Path) -> None:
    class Broken(Recorder):
        def add(self, *a: Any, **k: Any) -> None:
            raise RuntimeError("recorder broken")

    fileio.install(Broken(), None)
    try:
        (tmp_path / "f").write_text("ok")
        assert open(tmp_path / "f").read() == "ok"
        assert os.path.exists(tmp_path / "f")
        with open(tmp_path / "g", "wb") as f:
            f.write(b"x" * (2 << 20))
        assert (tmp_path / "g").stat().st_size == 2 << 20
    finally:
        fileio.uninstall()


def test_program_source_sees_wrapped_open_as_function(hooked: Hooked, tmp_path: Path) -> None:
    """Code that introspects open (help(), inspect) still sees its name and docs."""
    assert builtins.open.__name__ == "open" and builtins.open.__doc__ == io.open.__wrapped__.__doc__  # type: ignore[attr-defined]
    src = tmp_path / "prog.py"
    src.write_text(textwrap.dedent("""
        with open(__file__) as f:
            first = f.readline()
    """))
    ns: dict[str, Any] = {"__file__": str(src)}
    exec(compile(src.read_text(), str(src), "exec"), ns)
    assert ns["first"] == "\n"
    assert hooked.s(hooked.rows(Kind.FILE_OPEN, src)["site_id"][-1]) == f"{src}:2"  # [0] is src.read_text()


def test_any_mode_and_buffering_behaves_as_io_open(tmp_path: Path) -> None:
    """Property: for every mode string and buffering, the hooked open does what io.open does."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    plain_open = io.open
    rec = Recorder()

    @settings(max_examples=80, deadline=None)
    @given(mode=st.text(alphabet="rwxab+t", min_size=1, max_size=4), buffering=st.sampled_from([None, None, -1, 0, 1, 4096]),
           kw=st.booleans())  # fmt: skip
    def check(mode: str, buffering: int | None, kw: bool) -> None:
        def attempt(opener: Callable[..., Any], name: str) -> Any:
            p = tmp_path / name
            p.write_bytes(b"seed")
            args: tuple[Any, ...] = (mode,) if buffering is None else (mode, buffering)
            kwargs: dict[str, Any] = {"mode": mode} if buffering is None else {"mode": mode, "buffering": buffering}
            try:
                f = opener(p, **kwargs) if kw else opener(p, *args)
            except Exception as e:
                return ("raised", type(e), str(e).replace(name, "X"))
            with f:
                return ("ok", type(f), f.mode, f.readable(), f.writable(), f.seekable())

        want = attempt(plain_open, "plain")
        fileio.install(rec, None)
        try:
            got = attempt(builtins.open, "hooked")
        finally:
            fileio.uninstall()
        assert got == want, (mode, buffering, kw)

    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # buffering=1 in binary mode warns, both ways
        check()


def test_byte_counting_can_be_switched_off(tmp_path: Path) -> None:
    from distdiag.shim.config import load_config

    cfg = load_config(environ={"DISTDIAG_FILEIO_COUNT_BYTES": "0"})
    rec = Recorder()
    p = tmp_path / "b.bin"
    fileio.install(rec, cfg)
    try:
        with open(p, "wb") as f:
            f.write(b"x" * 10)
        assert type(f.raw) is io.FileIO  # io.open's own object
    finally:
        fileio.uninstall()
    h = Hooked(rec)
    assert len(h.rows(Kind.FILE_OPEN, p)) == 1 and len(h.rows(Kind.FILE_WRITE, p)) == 0
    fileio.install(rec, load_config(environ={}))
    try:
        with open(p, "rb") as f:
            assert type(f.raw) is fileio.FileIO
    finally:
        fileio.uninstall()
