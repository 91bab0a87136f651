"""Structural mutations of real run dirs: what a hostile or careless run dir can hold.

Byte flips (``tests/test_fuzz_reader.py``) rarely make a well-formed HDF5 file that
lies. These do: each mutation rewrites one rank file (or the dir) with h5py into
something valid as HDF5 that claims what it does not hold, or whose bytes live
outside the run dir. Shared by the suite's hypothesis test
(``test_fuzz_reader.py::test_structural_mutations_*``) and the benchmark
``benchmarks/fuzz_rundirs.py`` (10^4 mutated dirs, each analyzed in its own process
under a time and memory bound).

Every mutation takes ``(run_dir, rng, outside)``: ``rng`` a ``random.Random``,
``outside`` a directory outside the run dir holding the "analyst's secrets"
(:func:`make_outside`): a raw file and an HDF5 file whose bytes hold :data:`MARK`.
A report that contains :data:`MARK` quoted bytes from outside the run dir; a string table
or rank metadata holding it after the load read them (whether a finding shows them or not).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import h5py
import numpy as np

from distdiag.schema import EVENT_DTYPE, RANK_FILE_RE, rank_file_name

#: what no report may contain: it only exists outside the run dir
MARK = "s3cr3t-0f-the-analyst"
SECRET_BYTES = (f"-----BEGIN OPENSSH PRIVATE KEY----- {MARK} -----END-----\n").encode() * 64
I64 = np.iinfo(np.int64)
U32 = np.iinfo(np.uint32)

#: a 2-rank job with collectives, file I/O, phases and steps (what a real rank file holds),
#: and rank 1 late at every bcast: the report names a call site (a string of the file),
#: so a string table read from outside the run dir would show in it
JOB = (
    "import numpy as np, distdiag, tempfile, os, time\n"
    "from mpi4py import MPI\n"
    "c = MPI.COMM_WORLD\n"
    "b = np.ones(64); o = np.empty_like(b)\n"
    "p = os.path.join(tempfile.gettempdir(), f'fz-{os.getpid()}.bin')\n"
    "for i in range(40):\n"
    "    with distdiag.phase('step'):\n"
    "        c.Allreduce(b, o)\n"
    "        if c.rank == 1: time.sleep(0.01)\n"
    "        c.bcast(i, root=0)\n"
    "        with open(p, 'wb') as f: f.write(b.tobytes())\n"
    "    distdiag.step(samples=8)\n"
    "os.unlink(p)\n"
)


def make_real_run(d: Path, repo: Path) -> Path:
    """``d/run``: the run dir of a real 2-rank ``mpiexec distdiag-wrap`` job of :data:`JOB`."""
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        raise RuntimeError("mpiexec not found: install the 'mpi' extra (mpi4py + mpich)")
    prog = d / "job.py"
    prog.write_text(JOB)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DISTDIAG_", "SLURM_"))}
    env["PYTHONPATH"] = str(repo)
    run_dir = d / "run"
    p = subprocess.run([mpiexec, "-n", "2", sys.executable, "-m", "distdiag.wrap", "--dir", str(run_dir),
                        sys.executable, str(prog)], capture_output=True, text=True, timeout=120, env=env)  # fmt: skip
    if p.returncode != 0 or len(list(run_dir.glob("rank-*.h5"))) != 2:
        raise RuntimeError(f"the real job failed: {p.stdout}{p.stderr}")
    return run_dir


def make_outside(d: Path) -> Path:
    """``d``: the analyst's files, outside any run dir: ``secret.bin`` (raw) and ``secret.h5``
    (an HDF5 file shaped like a rank file: events, strings and attributes holding :data:`MARK`)."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "secret.bin").write_bytes(SECRET_BYTES)
    with h5py.File(d / "secret.h5", "w") as f:
        f.create_dataset("strings", data=np.array(["", MARK, MARK * 4], dtype=h5py.string_dtype()))
        ev = np.zeros(8, EVENT_DTYPE)
        ev["name_id"] = 1
        ev["t0_ns"], ev["t1_ns"] = np.arange(8) * 10, np.arange(8) * 10 + 5
        f.create_dataset("events", data=ev)
        f.create_dataset("inflight", data=ev[:2])
        f.create_dataset("clock_sync", data=np.zeros(0, np.float64))
        f.attrs["host"] = MARK
        f.attrs["distdiag_schema"] = 1
        f.attrs["rank"] = 0
    return d


# -- helpers ---------------------------------------------------------------------------------------

_TABLES = ("events", "strings", "clock_sync", "inflight", "gpu")


def _rank_files(run_dir: Path) -> list[Path]:
    return sorted(p for p in run_dir.iterdir() if RANK_FILE_RE.match(p.name) and p.is_file() and not p.is_symlink())


def _pick(run_dir: Path, rng: random.Random) -> Path | None:
    files = _rank_files(run_dir)
    return rng.choice(files) if files else None


def _edit(run_dir: Path, rng: random.Random, fn: Callable[[h5py.File, random.Random], None]) -> None:
    path = _pick(run_dir, rng)
    if path is None:
        return
    with h5py.File(path, "r+") as f:
        fn(f, rng)


def _table(f: h5py.File, rng: random.Random, names: tuple[str, ...] = _TABLES) -> str | None:
    have = [n for n in names if n in f]
    return rng.choice(have) if have else None


def _own(f: h5py.File, name: str) -> h5py.Dataset | None:
    """``f[name]`` when it is a dataset whose bytes are the file's own (a hard link, no
    external storage, not virtual): only those are read to build a mutation from, so an
    earlier mutation's link out of the file never copies the secret into it (the analyzer
    reading such a copy reads the run dir, not outside it)."""
    try:
        if f.id.links.get_info(name.encode()).type != h5py.h5l.TYPE_HARD:
            return None
    except KeyError:
        return None
    ds = f.get(name)
    if not isinstance(ds, h5py.Dataset):
        return None
    dcpl = ds.id.get_create_plist()
    if dcpl.get_external_count() or dcpl.get_layout() == h5py.h5d.VIRTUAL:
        return None
    # nor one an earlier mutation declared huge (huge_dims): reading it whole to build from
    # took this process to 23 GB (10^9 variable-length strings) and the OOM killer
    if ds.size * max(16, ds.dtype.itemsize) > 4 * f.id.get_filesize() + (1 << 20):
        return None
    return ds


def _drop(f: h5py.File, name: str) -> tuple[np.dtype, tuple[int, ...]]:
    """Delete ``name`` (a link, a group or a dataset); its dtype and shape when it was a dataset."""
    obj = f.get(name, getlink=True)
    dtype: Any = EVENT_DTYPE
    shape: tuple[int, ...] = (4,)
    if isinstance(obj, h5py.HardLink) and isinstance(f[name], h5py.Dataset):
        dtype, shape = f[name].dtype, f[name].shape
    del f[name]
    return np.dtype(dtype), shape


# -- the mutations ---------------------------------------------------------------------------------


def external_storage(run_dir: Path, rng: random.Random, outside: Path) -> None:
    """A table whose bytes are the secret file's (HDF5 external storage)."""

    def fn(f: h5py.File, rng: random.Random) -> None:
        name = _table(f, rng) or "strings"
        dtype, _ = _drop(f, name) if name in f else (EVENT_DTYPE, (0,))
        offset = 0
        if dtype.kind == "O" or name == "strings":
            # mostly one secret line per string, each starting at MARK: whatever string the
            # report shows quotes the secret
            line = SECRET_BYTES.index(b"\n") + 1
            dtype = np.dtype(rng.choice([f"S{line}"] * 3 + ["S8", "S64", "S1"]))
            offset = SECRET_BYTES.index(MARK.encode()) if dtype.itemsize == line else 0
        n = max(1, (len(SECRET_BYTES) - offset) // max(1, dtype.itemsize))
        f.create_dataset(name, shape=(n,), dtype=dtype,
                         external=[(str(outside / "secret.bin"), offset, n * dtype.itemsize)])  # fmt: skip

    _edit(run_dir, rng, fn)


def external_strings(run_dir: Path, rng: random.Random, outside: Path) -> None:
    """The review's case: every rank's /strings as fixed-length strings stored in the secret
    file, one secret line per string (each starting at MARK): the ranks still agree on every
    name, so the findings name them, and every string the report names quotes the secret."""

    def fn(f: h5py.File, rng: random.Random) -> None:
        if "strings" in f:
            _drop(f, "strings")
        line = SECRET_BYTES.index(b"\n") + 1
        offset = SECRET_BYTES.index(MARK.encode())
        n = (len(SECRET_BYTES) - offset) // line
        f.create_dataset("strings", shape=(n,), dtype=f"S{line}",
                         external=[(str(outside / "secret.bin"), offset, n * line)])  # fmt: skip

    for path in _rank_files(run_dir):
        with h5py.File(path, "r+") as f:
            fn(f, rng)


def external_link(run_dir: Path, rng: random.Random, outside: Path) -> None:
    """A table that is an external link into the secret HDF5 file (absolute or relative path)."""

    def fn(f: h5py.File, rng: random.Random) -> None:
        name = _table(f, rng, ("events", "strings", "inflight")) or "strings"
        if name in f:
            _drop(f, name)
        target = str(outside / "secret.h5")
        if rng.random() < 0.5:
            target = os.path.relpath(target, Path(f.filename).parent)
        f[name] = h5py.ExternalLink(target, "/" + name)

    _edit(run_dir, rng, fn)


def virtual_dataset(run_dir: Path, rng: random.Random, outside: Path) -> None:
    """/events (or /strings) as a virtual dataset of the secret HDF5 file's table."""

    def fn(f: h5py.File, rng: random.Random) -> None:
        name = rng.choice(["events", "strings"])
        with h5py.File(outside / "secret.h5", "r") as g:
            shape, dtype = g[name].shape, g[name].dtype
        if name in f:
            _drop(f, name)
        layout = h5py.VirtualLayout(shape=shape, dtype=dtype)
        layout[:] = h5py.VirtualSource(str(outside / "secret.h5"), name, shape=shape)
        f.create_virtual_dataset(name, layout)

    _edit(run_dir, rng, fn)


def soft_link(run_dir: Path, rng: random.Random, outside: Path) -> None:
    """A table that is a soft link to another table of the same file (or to nothing)."""

    def fn(f: h5py.File, rng: random.Random) -> None:
        name = _table(f, rng)
        if name is None:
            return
        _drop(f, name)
        f[name] = h5py.SoftLink("/" + rng.choice([*_TABLES, "nowhere"]))

    _edit(run_dir, rng, fn)


def dtype_swap(run_dir: Path, rng: random.Random, outside: Path) -> None:
    """A table rewritten with another dtype: fields renamed, dropped, narrowed, float, big-endian."""

    def fn(f: h5py.File, rng: random.Random) -> None:
        name = _table(f, rng)
        if name is None:
            return
        own = _own(f, name)
        data = own[()] if own is not None else np.zeros(4, EVENT_DTYPE)
        _drop(f, name)
        how = rng.choice(["float", "renamed", "dropped", "narrow", "bigendian", "plain", "2d", "strings-as-int"])
        n = len(data) if np.ndim(data) else 1
        if data.dtype.names and how in ("float", "renamed", "dropped", "narrow", "bigendian"):
            names = list(data.dtype.names)
            if how == "dropped":
                names.remove(rng.choice(names))
            fields = []
            for nm in names:
                t = data.dtype[nm]
                t = {"float": np.dtype("<f8"), "narrow": np.dtype("i1"), "bigendian": t.newbyteorder(">")}.get(how, t)
                fields.append((nm + "_x" if how == "renamed" and rng.random() < 0.5 else nm, t))
            out = np.zeros(n, fields)
            for (nm, _), src in zip(fields, names):
                out[nm] = data[src].astype(out.dtype[nm], copy=False) if how != "narrow" else 7
            f.create_dataset(name, data=out)
        elif how == "2d":
            f.create_dataset(name, data=np.zeros((n, 3), np.int64))
        elif how == "strings-as-int":
            f.create_dataset(name, data=np.arange(n, dtype=np.int64))
        else:
            f.create_dataset(name, data=np.zeros(n, np.float64))

    _edit(run_dir, rng, fn)


def huge_dims(run_dir: Path, rng: random.Random, outside: Path) -> None:
    """A table that declares far more rows (or dimensions) than the file holds: chunked,
    never written, so HDF5 would hand back fill values for all of them."""

    def fn(f: h5py.File, rng: random.Random) -> None:
        name = _table(f, rng) or "events"
        dtype, _ = _drop(f, name) if name in f else (EVENT_DTYPE, (0,))
        if dtype.kind == "O":
            dtype = h5py.string_dtype()
        rows = rng.choice([1 << 31, 1 << 40, (1 << 62) // max(1, np.dtype(dtype).itemsize), 10**9])
        shape: tuple[int, ...] = (rows,) if rng.random() < 0.7 else (1 << 20, 1 << 20)
        chunks = tuple(min(s, rng.choice([1, 64, 4096, 1 << 20])) for s in shape)
        f.create_dataset(name, shape=shape, dtype=dtype, chunks=chunks, maxshape=(None,) * len(shape))

    _edit(run_dir, rng, fn)


def compression_bomb(run_dir: Path, rng: random.Random, outside: Path) -> None:
    """/events rewritten gzip- or lzf-compressed with far more rows than the file's bytes."""

    def fn(f: h5py.File, rng: random.Random) -> None:
        name = rng.choice(["events", "inflight", "clock_sync"])
        dtype, _ = _drop(f, name) if name in f else (EVENT_DTYPE, (0,))
        if dtype.kind == "O" or not dtype.names:
            dtype = EVENT_DTYPE
        rows = rng.choice([1 << 20, 1 << 22])
        chunk = rng.choice([1 << 16, 1 << 20, rows])
        ds = f.create_dataset(name, shape=(rows,), dtype=dtype, chunks=(chunk,), maxshape=(None,),
                              compression=rng.choice(["gzip", "lzf"]), shuffle=rng.random() < 0.5)  # fmt: skip
        ds[: min(rows, chunk)] = np.zeros(min(rows, chunk), dtype)  # one real (compressible) chunk

    _edit(run_dir, rng, fn)


def shared_heap_strings(run_dir: Path, rng: random.Random, outside: Path) -> None:
    """/strings of many entries that all point at one big shared heap object."""
    path = _pick(run_dir, rng)
    if path is None:
        return
    n, big = rng.choice([2048, 4096]), rng.choice([1 << 16, 1 << 20])
    with h5py.File(path, "r+") as f:
        own = _own(f, "strings")
        if own is None or own.dtype.kind != "O":
            return
        old = [s.decode() if isinstance(s, bytes) else str(s) for s in own[()]][: n // 2]
        del f["strings"]
        table = old + ["x" * big] + ["y"] * (n - len(old) - 1)
        f.create_dataset("strings", data=np.array(table, dtype=object), dtype=h5py.string_dtype(), chunks=(1024,),
                         maxshape=(None,))  # fmt: skip
        ds = f["strings"]
        ref = np.dtype([("len", "<u4"), ("addr", "<u8"), ("idx", "<u4")])
        shared = np.frombuffer(ds.id.read_direct_chunk((0,))[1], ref)[len(old)].copy()
        for lo in range(0, n, 1024):
            chunk = np.frombuffer(ds.id.read_direct_chunk((lo,))[1], ref).copy()
            at = np.arange(lo, lo + len(chunk))
            chunk[at > len(old)] = shared
            ds.id.write_direct_chunk((lo,), chunk.tobytes())


def out_of_range_ids(run_dir: Path, rng: random.Random, outside: Path) -> None:
    """String-id columns (name, communicator, site, aux) beyond the table, or negative."""

    def fn(f: h5py.File, rng: random.Random) -> None:
        own = _own(f, "events")
        if own is None or own.dtype != EVENT_DTYPE:
            return
        ev = own[()]
        if not len(ev):
            return
        col = rng.choice(["name_id", "comm_id", "site_id", "aux", "kind"])
        at = np.array(sorted({rng.randrange(len(ev)) for _ in range(rng.randint(1, 16))}))
        info = np.iinfo(ev.dtype[col])
        picks = [v for v in (info.max, info.min, -1, 1 << 20, info.max - 1) if info.min <= v <= info.max]
        ev[col][at] = [rng.choice(picks) for _ in at]
        f["events"][...] = ev

    _edit(run_dir, rng, fn)


def int_extremes(run_dir: Path, rng: random.Random, outside: Path) -> None:
    """INT64 / float extremes in times, sizes, sequence numbers and values (also NaN, inf)."""

    def fn(f: h5py.File, rng: random.Random) -> None:
        name = rng.choice(["events", "inflight", "clock_sync", "gpu"])
        own = _own(f, name)
        if own is None or not own.dtype.names or not len(own):
            return
        ev = own[()]
        for _ in range(rng.randint(1, 6)):
            col = rng.choice(ev.dtype.names)
            i = rng.randrange(len(ev))
            if ev.dtype[col].kind == "f":
                ev[col][i] = rng.choice([np.nan, np.inf, -np.inf, 1e308, -0.0])
            elif ev.dtype[col].kind in "iu":
                info = np.iinfo(ev.dtype[col])
                ev[col][i] = rng.choice([info.max, info.min, info.max - 1, 0])
        f[name][...] = ev

    _edit(run_dir, rng, fn)


def attr_chaos(run_dir: Path, rng: random.Random, outside: Path) -> None:
    """File attributes of the wrong type, absurd, huge, or full of control characters."""

    def fn(f: h5py.File, rng: random.Random) -> None:
        key = rng.choice(["rank", "world_size", "host", "local_rank", "argv", "env", "clock", "launch_id",
                          "job_id", "closed_cleanly", "distdiag_version", "gpu_names", "pid"])  # fmt: skip
        value = rng.choice([
            -1, 2**31 - 1, 2**62, "\x1b]0;pwned\x07\x1b[2J", "x" * (1 << 20), np.nan, b"\xff\xfe", "[" * 5000,
            json.dumps({"0": "\x1b[31mGPU"}), np.arange(3), "", "null",
        ])  # fmt: skip
        try:
            f.attrs[key] = value
        except (TypeError, ValueError):
            f.attrs[key] = str(value)

    _edit(run_dir, rng, fn)


def table_replaced(run_dir: Path, rng: random.Random, outside: Path) -> None:
    """A table deleted, or a group (or an empty or scalar dataset) in its place."""

    def fn(f: h5py.File, rng: random.Random) -> None:
        name = _table(f, rng)
        if name is None:
            return
        _drop(f, name)
        how = rng.choice(["gone", "group", "scalar", "empty"])
        if how == "group":
            f.create_group(name).create_dataset("events", data=np.zeros(3, EVENT_DTYPE))
        elif how == "scalar":
            f.create_dataset(name, data=np.int64(7))
        elif how == "empty":
            f.create_dataset(name, shape=None, dtype="f8")

    _edit(run_dir, rng, fn)


def link_to_outside(run_dir: Path, rng: random.Random, outside: Path) -> None:
    """A rank file replaced by a symbolic link to a file outside the run dir (or a device)."""
    path = _pick(run_dir, rng)
    if path is None:
        return
    path.unlink()
    path.symlink_to(rng.choice([outside / "secret.h5", outside / "secret.bin", Path("/dev/zero")]))


def special_file(run_dir: Path, rng: random.Random, outside: Path) -> None:
    """A FIFO (opening it would block) or a directory under a rank file's name."""
    name = run_dir / rank_file_name(rng.randrange(2, 9))
    if name.exists() or name.is_symlink():
        return
    if rng.random() < 0.5:
        os.mkfifo(name)
    else:
        name.mkdir()


def duplicate_rank(run_dir: Path, rng: random.Random, outside: Path) -> None:
    """A rank file copied under another rank's name (or a far one)."""
    path = _pick(run_dir, rng)
    dst = run_dir / rank_file_name(rng.choice([0, 1, 5, 99999]))
    if path is not None and dst != path:
        shutil.copyfile(path, dst)


def hostile_accounting(run_dir: Path, rng: random.Random, outside: Path) -> None:
    """``slurm-accounting.json``: a link outside, deep nesting, absurd numbers, the wrong types."""
    p = run_dir / "slurm-accounting.json"
    if p.exists() or p.is_symlink():
        p.unlink()
    how = rng.choice(["link", "deep", "absurd", "types"])
    if how == "link":
        p.symlink_to(outside / "secret.bin")
        return
    job: Any = {"job_id": "7", "submit_s": 1, "start_s": 2, "end_s": 3, "state": "COMPLETED"}
    if how == "deep":
        job = {"job_id": "[" * 100000}
        p.write_text('{"schema": 1, "job": ' + "[" * 100000 + "]" * 100000 + "}")
        return
    if how == "absurd":
        job.update(submit_s=-(2**62), start_s=2**62, end_s=1e308, nodes="\x1b[2J" * 1000)
    else:
        job.update(submit_s="soon", start_s=[1], end_s={"x": 1}, exit_code="0:9")
    p.write_text(json.dumps({"schema": 1, "job": job}))


MUTATIONS: dict[str, Callable[[Path, random.Random, Path], None]] = {
    f.__name__: f
    for f in (external_storage, external_strings, external_link, virtual_dataset, soft_link, dtype_swap, huge_dims,
              compression_bomb, shared_heap_strings, out_of_range_ids, int_extremes, attr_chaos,
              table_replaced, link_to_outside, special_file, duplicate_rank, hostile_accounting)  # fmt: skip
}


def mutate(run_dir: Path, outside: Path, names: list[str], seed: int) -> None:
    """Apply the mutations ``names`` in order, drawing their choices from ``seed``."""
    rng = random.Random(seed)
    for name in names:
        MUTATIONS[name](run_dir, rng, outside)


# -- analyzing a mutated dir in its own process ----------------------------------------------------

#: what analyzing one mutated dir may grow the process by beyond its start (a healthy analysis
#: of the real run grows it ~15 MB) ...
RSS_BOUND = 128 << 20
#: ... plus this many bytes per byte of the run dir's files (the reader's bound is a small
#: constant factor of a file's own size)
RSS_PER_BYTE = 16


def dir_bytes(d: Path) -> int:
    """The bytes of the regular files in ``d`` (links and special files are not its bytes)."""
    return sum(p.lstat().st_size for p in d.iterdir() if p.is_file() and not p.is_symlink())


def rss_bound(run_dir: Path) -> int:
    return RSS_BOUND + RSS_PER_BYTE * dir_bytes(run_dir)



class Outcome:
    """What analyzing one run dir in a forked child gave (see :func:`analyze_isolated`)."""

    __slots__ = ("kind", "seconds", "rss_growth", "quoted", "detail")

    def __init__(self, kind: str, seconds: float, rss_growth: int, quoted: bool, detail: str) -> None:
        #: "report", "error" (one DistdiagError line), "crash", "hang" (over the time bound),
        #: "memory" (MemoryError under the address-space bound)
        self.kind = kind
        self.seconds = seconds
        #: the child's peak RSS less the parent's at the fork (bytes)
        self.rss_growth = rss_growth
        #: the report or the error quoted MARK, or the analysis read it (the loaded string
        #: table and rank metadata, ``read.txt``): bytes from outside the run dir
        self.quoted = quoted
        self.detail = detail

    def __repr__(self) -> str:
        return (f"Outcome({self.kind}, {self.seconds:.2f} s, +{self.rss_growth >> 20} MB, quoted={self.quoted}, "
                f"{self.detail[-600:]!r})")  # fmt: skip


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _vm_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def _child(run_dir: Path, out: Path, timeout_s: float, mem_bytes: int) -> int:
    import resource
    import signal
    import traceback

    signal.alarm(max(1, int(timeout_s)))  # default action: the child ends (a hang)
    (out / "rss0").write_text(str(_rss_bytes()))  # the child's own start: its peak is read against it
    lim = _vm_bytes() + mem_bytes
    resource.setrlimit(resource.RLIMIT_AS, (lim, lim))
    fd = os.open(out / "stderr", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 2)
    try:
        from distdiag.config import load_config
        from distdiag.pipeline import analyze
        from distdiag.render import render
        from distdiag.errors import DistdiagError

        try:
            rep = analyze(run_dir, load_config())
            (out / "report.json").write_text(render(rep, "json"))
            (out / "report.txt").write_text(render(rep, "text", color=False))
            # what the load read, shown by a finding or not (a healthy job's report names
            # few strings): the string table and every rank's metadata
            read = [str(x) for x in rep.run.strings] + [repr(i) for i in rep.run.ranks.values()]
            (out / "read.txt").write_text("\n".join(read))
            return 0
        except DistdiagError as e:
            (out / "error").write_text(str(e))
            return 2
    except MemoryError:
        return 4
    except BaseException:
        try:
            (out / "crash").write_text(traceback.format_exc())
        except BaseException:
            pass
        return 3


def _forked(fn: Callable[[], int], timeout_s: float) -> tuple[int, Any, bool]:
    """``fn()`` in a forked child whose exit code it gives (3 if it raised); (the child's wait
    status, its rusage, whether it was still running after ``timeout_s`` and ended by PID)."""
    import signal
    import time

    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the caller
        code = 3
        try:
            code = fn()
        finally:
            os._exit(code)
    deadline = time.monotonic() + timeout_s
    while True:
        got, status, ru = os.wait4(pid, os.WNOHANG)
        if got:
            return status, ru, False
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            _, status, ru = os.wait4(pid, 0)
            return status, ru, True
        time.sleep(0.005)


def analyze_isolated(run_dir: Path, out: Path, timeout_s: float = 10.0, mem_bytes: int = 2 << 30) -> Outcome:
    """Analyze ``run_dir`` in a forked child under ``timeout_s`` and an address-space bound of
    ``mem_bytes`` over the parent's; ``out`` (an empty dir) gets its report or error."""
    import signal
    import time

    import distdiag.pipeline  # noqa: F401  (imported once in the parent: each child starts warm)
    import distdiag.render  # noqa: F401

    out.mkdir(parents=True, exist_ok=True)
    base = _rss_bytes()
    t0 = time.perf_counter()
    # past the child's own alarm: it ignored it
    status, ru, _ = _forked(lambda: _child(run_dir, out, timeout_s, mem_bytes), timeout_s + 5)
    seconds = time.perf_counter() - t0
    try:
        base = int((out / "rss0").read_text())
    except (OSError, ValueError):
        pass  # the parent's, a bound from above
    growth = max(0, ru.ru_maxrss * 1024 - base)
    texts = [p.read_text(errors="replace") for p in (out / n for n in ("report.json", "report.txt", "error", "read.txt"))
             if p.exists()]  # fmt: skip
    quoted = any(MARK in t for t in texts)
    err = (out / "stderr").read_text(errors="replace") if (out / "stderr").exists() else ""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        kind = "hang" if sig in (signal.SIGALRM, signal.SIGKILL) else "crash"
        return Outcome(kind, seconds, growth, quoted, f"signal {sig}: {err}")
    code = os.WEXITSTATUS(status)
    if code == 0:
        return Outcome("report", seconds, growth, quoted, err)
    if code == 2:
        msg = (out / "error").read_text(errors="replace")
        one_line = bool(msg) and "\n" not in msg and "Traceback" not in msg
        return Outcome("error" if one_line else "crash", seconds, growth, quoted, msg)
    if code == 4:
        return Outcome("memory", seconds, growth, quoted, err)
    crash = (out / "crash").read_text(errors="replace") if (out / "crash").exists() else err
    return Outcome("crash", seconds, growth, quoted, crash)


def flip_bytes(run_dir: Path, seed: int) -> str:
    """Random byte flips in one rank file of ``run_dir`` (as ``test_byte_flips_*`` makes them):
    1 to 24 anywhere, or 1 to 8 in the first 4 KiB (the superblock and root headers). Says what."""
    rng = random.Random(seed)
    f = _rank_files(run_dir)[rng.randrange(len(_rank_files(run_dir)))]
    a = bytearray(f.read_bytes())
    front = rng.random() < 0.5
    at = []
    for _ in range(rng.randint(1, 8 if front else 24)):
        pos = rng.randrange(min(4096, len(a))) if front else rng.randrange(len(a))
        a[pos] ^= rng.randint(1, 255)
        at.append(pos)
    f.write_bytes(bytes(a))
    return f"{f.name}: bytes {sorted(at)} flipped"


def in_child(fn: Callable[[], Any], timeout_s: float = 60.0) -> Any:
    """``fn()`` run in a forked child: its result (pickled back), or its exception raised here as
    an AssertionError with the child's traceback, or an AssertionError when it has not finished
    in ``timeout_s`` (a hang; the child is ended by PID). A libhdf5 loop on a damaged file holds
    the GIL and cannot be interrupted in the process: only a child can be bounded."""
    import pickle
    import tempfile
    import traceback

    with tempfile.TemporaryDirectory() as td:
        box = Path(td) / "result"

        def child() -> int:
            try:
                got = ("ok", fn())
            except BaseException:
                got = ("fail", traceback.format_exc())
            box.write_bytes(pickle.dumps(got))
            return 0

        status, _, ended = _forked(child, timeout_s)
        if ended:
            raise AssertionError(f"did not finish in {timeout_s:.0f} s (a hang)")
        if not box.exists():
            raise AssertionError(f"the child ended without a result (status {status})")
        kind, value = pickle.loads(box.read_bytes())
        if kind == "fail":
            raise AssertionError(value)
        return value
