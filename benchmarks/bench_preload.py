"""What file-call capture costs per call: plain vs the Python hooks vs the libc interposer.

    python benchmarks/bench_preload.py [--n 20000] [--repeats 5]

Side by side in one run: each round starts three fresh processes, one per capture
(``plain``: nothing; ``python``: distdiag.shim.hooks.fileio's wrappers; ``preload``: the
interposer, ``LD_PRELOAD``ed, recording into its ring, its drainer thread turning slots into
recorder rows in C, ``_binding.convert``; ``preload_py``: the same with the drainer's Python
loop, as before that existed and where the binding is older than the library), and each times the same operations ``n`` times on tmpfs (/dev/shm), where
the call itself is as fast as it gets, so what capture adds is plain to see:

* ``stat``: ``os.stat(path)`` (one libc stat)
* ``open+close``: ``os.close(os.open(path))`` (one libc open and close)
* ``open(rb)``: ``open(path, "rb").close()`` (Python's open: open, two fstat, close)
* ``read 256B``: ``os.pread(fd, 256, 0)`` on a descriptor opened after the start (one pread)

Two clocks per op: the calling thread's CPU time (what the program's thread pays) and the
whole process's (which includes the drainer thread's work on the interposer's rows: that
is the full price of a row). Best of ``repeats`` (a busy machine disturbs the minimum
least). Then the libc hook alone, from C (``--c``, needs gcc): a compiled loop of
``stat`` calls, plain vs preloaded and started (``dd_start``), draining the ring every
4096 calls as the drainer would: ns added per libc call, with no Python in the loop.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

MODES = ("plain", "python", "preload", "preload_py")
OPS = ("stat", "open+close", "open(rb)", "read 256B")


def child(mode: str, n: int, d: str) -> None:
    from distdiag.shim import preload
    from distdiag.shim.config import ShimConfig
    from distdiag.shim.hooks import fileio
    from distdiag.shim.recorder import Recorder

    small = os.path.join(d, "small.bin")
    rec = Recorder()
    if mode != "plain":
        cfg = ShimConfig()
        cfg.hooks = {"preload": mode.startswith("preload")}
        cfg.run_dir = os.path.join(d, "run")  # type: ignore[attr-defined]
        fileio.install(rec, cfg)
        assert fileio.CAPTURE == mode.partition("_")[0], (fileio.CAPTURE, mode)
        if mode == "preload_py":
            assert preload.DRAINER is not None
            preload.DRAINER.use_c = False
    fd = os.open(small, os.O_RDONLY)
    st, op, cl, pr = os.stat, os.open, os.close, os.pread
    rd = os.O_RDONLY

    def f_stat() -> None:
        for _ in range(n):
            st(small)

    def f_openclose() -> None:
        for _ in range(n):
            cl(op(small, rd))

    def f_open_rb() -> None:
        for _ in range(n):
            open(small, "rb").close()

    def f_read() -> None:
        for _ in range(n):
            pr(fd, 256, 0)

    out = {}
    for name, fn in zip(OPS, (f_stat, f_openclose, f_open_rb, f_read)):
        fn()  # warm: caches, the first chunks
        preload.drain_now(final=True)
        t0, p0 = time.thread_time_ns(), time.process_time_ns()
        fn()
        t1 = time.thread_time_ns()
        preload.drain_now(final=True)  # the rows of these calls, made now if not yet
        p1 = time.process_time_ns()
        out[name] = ((t1 - t0) / n, (p1 - p0) / n)
    print(json.dumps(out))


C_BENCH = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <time.h>
static long long cpu(void) { struct timespec t; clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t); return t.tv_sec * 1000000000LL + t.tv_nsec; }
int main(int argc, char **argv) {
    long n = atol(argv[2]);
    int (*start)(long, const char *) = dlsym(RTLD_DEFAULT, "dd_start");
    long (*drain)(void *, long) = dlsym(RTLD_DEFAULT, "dd_drain");
    static char buf[4096 * 320];
    if (start) start(16384, NULL);
    struct stat st;
    for (long i = 0; i < n / 10; i++) stat(argv[1], &st);
    long long t0 = cpu();
    for (long i = 0; i < n; i++) {
        stat(argv[1], &st);
        if (drain && (i & 4095) == 4095) drain(buf, 4096);
    }
    long long t1 = cpu();
    printf("%.1f\n", (double)(t1 - t0) / n);
    return 0;
}
"""


def c_bench(d: str, lib: str, n: int, repeats: int) -> tuple[float, float] | None:
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        return None
    src = os.path.join(d, "cb.c")
    exe = os.path.join(d, "cb")
    with open(src, "w") as f:
        f.write(C_BENCH)
    subprocess.run([cc, "-O2", "-o", exe, src, "-ldl"], check=True)
    small = os.path.join(d, "small.bin")
    best = {"plain": float("inf"), "preload": float("inf")}
    for _ in range(repeats):
        for mode in best:
            env = dict(os.environ)
            env.pop("LD_PRELOAD", None)
            if mode == "preload":
                env["LD_PRELOAD"] = lib
            out = subprocess.run([exe, small, str(n)], capture_output=True, text=True, env=env, check=True).stdout
            best[mode] = min(best[mode], float(out))
    return best["plain"], best["preload"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--child", choices=MODES)
    ap.add_argument("--dir")
    ap.add_argument("--no-c", action="store_true", help="skip the C loop")
    a = ap.parse_args()
    if a.child:
        child(a.child, a.n, a.dir)
        return 0
    from distdiag.shim import preload

    lib = preload.library_path()
    if lib is None:
        print("the interposer is not built (pip install -e . with a C compiler)", file=sys.stderr)
        return 2
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    d = tempfile.mkdtemp(prefix="bench_preload_", dir=base)
    try:
        with open(os.path.join(d, "small.bin"), "wb") as f:
            f.write(b"x" * 256)
        best: dict[str, dict[str, tuple[float, float]]] = {m: {} for m in MODES}
        for _ in range(a.repeats):
            for mode in MODES:
                env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD" and not k.startswith("DISTDIAG_")}
                if mode.startswith("preload"):
                    env["LD_PRELOAD"] = lib
                p = subprocess.run([sys.executable, __file__, "--child", mode, "--n", str(a.n), "--dir", d],
                                   capture_output=True, text=True, env=env)  # fmt: skip
                if p.returncode != 0:
                    print(p.stderr, file=sys.stderr)
                    return 1
                for op, (t, pc) in json.loads(p.stdout).items():
                    old = best[mode].get(op, (float("inf"), float("inf")))
                    best[mode][op] = (min(old[0], t), min(old[1], pc))
        print(f"ns per call, best of {a.repeats} x {a.n} (tmpfs); thread CPU / process CPU (process: + the drainer)")
        print(f"{'op':<12} {'plain':>13} {'python hooks':>20} {'interposer':>20} {'interposer, py drain':>22}")
        for op in OPS:
            pt, pp = best["plain"][op]
            cells = [f"{pt:6.0f} /{pp:6.0f}"]
            for m in ("python", "preload", "preload_py"):
                t, pc = best[m][op]
                cells.append(f"+{t - pt:6.0f} /+{pc - pp:6.0f}")
            print(f"{op:<12} {cells[0]:>13} {cells[1]:>20} {cells[2]:>20} {cells[3]:>22}")
        if not a.no_c:
            c = c_bench(d, lib, max(a.n * 10, 100000), a.repeats)
            if c is not None:
                print(f"C loop, libc stat: plain {c[0]:.0f} ns, interposed {c[1]:.0f} ns: +{c[1] - c[0]:.0f} ns a call "
                      "(ring slot + drain, no Python)")  # fmt: skip
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
