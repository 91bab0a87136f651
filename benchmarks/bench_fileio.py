"""What the file-I/O hook adds per intercepted call: plain vs hooked, side by side.

    python benchmarks/bench_fileio.py [--n 20000] [--repeats 7]

Each operation runs ``n`` times with the hook off and on, alternating, over
``repeats`` rounds, timed with the thread's CPU clock (``time.thread_time_ns``:
what the shim adds is CPU work, and wall-clock on a shared machine mostly
measures the neighbours); the table shows the best (minimum) ns per call of each,
which a busy machine disturbs least, the difference (the shim's cost per
call) and, for comparison, the difference of the medians. The files live on tmpfs (/dev/shm when
present) so the system call itself is as fast and steady as it gets, which
makes the added cost easy to see; on a parallel file system the same ns are
added to calls that take 100 us to 10 ms.

Target: <= 1 us added per open/stat. Reads and writes of binary files are
counted at the raw layer (one booking per buffer fill / large call), so small
buffered reads and writes cost nothing extra.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Callable

from distdiag.shim.hooks import fileio
from distdiag.shim.recorder import Recorder


#: CPU time of this thread, not wall-clock: the shim's cost is CPU work, and on a
#: shared 2-core machine wall-clock mostly measures the other tenants
CLOCK = time.thread_time_ns


def bench(fn: Callable[[int], None], n: int) -> float:
    t0 = CLOCK()
    fn(n)
    return (CLOCK() - t0) / n


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args()
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    d = tempfile.mkdtemp(prefix="bench_fileio_", dir=base)
    small = os.path.join(d, "small.bin")
    with open(small, "wb") as f:
        f.write(b"x" * 256)
    big = os.path.join(d, "big.bin")
    with open(big, "wb") as f:
        f.write(os.urandom(4 << 20))
    missing = os.path.join(d, "missing")
    for i in range(20):
        open(os.path.join(d, f"e{i}"), "wb").close()
    out = os.path.join(d, "out.bin")
    wf_holder: list = []

    def open_close_rb(n: int) -> None:
        for _ in range(n):
            open(small, "rb").close()

    def open_read_rb(n: int) -> None:
        for _ in range(n):
            with open(small, "rb") as f:
                f.read()

    def open_close_text(n: int) -> None:
        for _ in range(n):
            open(small).close()

    def stat(n: int) -> None:
        st = os.stat
        for _ in range(n):
            st(small)

    def stat_missing(n: int) -> None:
        st = os.stat
        for _ in range(n):
            try:
                st(missing)
            except FileNotFoundError:
                pass

    def exists(n: int) -> None:
        ex = os.path.exists
        for _ in range(n):
            ex(small)

    def listdir(n: int) -> None:
        ld = os.listdir
        for _ in range(n):
            ld(d)

    def read_4k(n: int) -> None:  # buffered small reads: served from the buffer
        with open(big, "rb") as f:
            r = f.read
            for _ in range(n):
                if not r(4096):
                    f.seek(0)

    def read_1m(n: int) -> None:  # large reads: one counted raw call each
        with open(big, "rb") as f:
            r = f.read
            for _ in range(n):
                if len(r(1 << 20)) < (1 << 20):
                    f.seek(0)

    def write_4k(n: int) -> None:
        buf = b"y" * 4096
        with open(out, "wb") as f:
            w = f.write
            for _ in range(n):
                w(buf)

    ops: list[tuple[str, Callable[[int], None], int]] = [
        ("open+close 'rb' (counted)", open_close_rb, a.n),
        ("open+read+close 'rb' 256 B", open_read_rb, a.n),
        ("open+close text 'r'", open_close_text, a.n),
        ("os.stat (exists)", stat, a.n),
        ("os.stat (missing, raises)", stat_missing, a.n),
        ("os.path.exists", exists, a.n),
        ("os.listdir (20 entries)", listdir, a.n // 4),
        ("f.read(4 KiB) buffered", read_4k, a.n),
        ("f.read(1 MiB)", read_1m, max(200, a.n // 50)),
        ("f.write(4 KiB) buffered", write_4k, a.n),
    ]
    print(f"python {sys.version.split()[0]}, files on {base or tempfile.gettempdir()}, n={a.n}, repeats={a.repeats}, "
          f"thread CPU ns per call, load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")  # fmt: skip
    print(f"{'operation':32s} {'plain ns':>10s} {'hooked ns':>10s} {'added ns':>10s} {'ratio':>6s} {'added (median)':>15s}")
    for name, fn, n in ops:
        plain, hooked = [], []
        for _ in range(a.repeats):
            plain.append(bench(fn, n))
            rec = Recorder(chunk_rows=1 << 16, max_pending_chunks=1 << 20)
            fileio.install(rec, None)
            try:
                hooked.append(bench(fn, n))
            finally:
                fileio.uninstall()
        p, h = min(plain), min(hooked)
        dm = statistics.median(hooked) - statistics.median(plain)
        print(f"{name:32s} {p:10.0f} {h:10.0f} {h - p:10.0f} {h / p:6.2f} {dm:15.0f}")
    for f in os.listdir(d):
        os.unlink(os.path.join(d, f))
    os.rmdir(d)
    return 0


if __name__ == "__main__":
    sys.exit(main())
