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
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
static long long clk(clockid_t c) { struct timespec t; clock_gettime(c, &t); return t.tv_sec * 1000000000LL + t.tv_nsec; }
static long (*drain)(void *, long);
static void (*waitfn)(long);
static atomic_int stop;
/* the drainer, as the shim runs it: its own thread, woken every half ring */
static void *drainer(void *arg) {
    static char buf[4096 * 320];
    (void)arg;
    while (!atomic_load(&stop)) {
        while (drain(buf, 4096) > 0) {}
        waitfn(10);
    }
    while (drain(buf, 4096) > 0) {}
    return NULL;
}
int main(int argc, char **argv) {
    long n = atol(argv[2]);
    int oc = strcmp(argv[3], "open+close") == 0; /* else: stat */
    int (*start)(long, const char *) = dlsym(RTLD_DEFAULT, "dd_start");
    *(void **)&drain = dlsym(RTLD_DEFAULT, "dd_drain");
    *(void **)&waitfn = dlsym(RTLD_DEFAULT, "dd_wait");
    pthread_t th;
    if (start && drain && waitfn) {
        start(16384, NULL);
        pthread_create(&th, NULL, drainer, NULL);
    }
    struct stat st;
    for (long i = 0; i < n / 10; i++) {
        if (oc) close(open(argv[1], O_RDONLY)); else stat(argv[1], &st);
    }
    long long t0 = clk(CLOCK_THREAD_CPUTIME_ID), p0 = clk(CLOCK_PROCESS_CPUTIME_ID);
    for (long i = 0; i < n; i++) {
        if (oc) close(open(argv[1], O_RDONLY)); else stat(argv[1], &st);
    }
    long long t1 = clk(CLOCK_THREAD_CPUTIME_ID);
    if (start && drain && waitfn) {
        atomic_store(&stop, 1);
        pthread_join(th, NULL);
    }
    long long p1 = clk(CLOCK_PROCESS_CPUTIME_ID);
    printf("%.1f %.1f\n", (double)(t1 - t0) / n, (double)(p1 - p0) / n);
    return 0;
}
"""


def c_bench(d: str, lib: str, n: int, repeats: int, op: str = "stat") -> dict[str, tuple[float, float]] | None:
    """ns per call of a C loop of ``op``, plain and interposed: (thread CPU, process CPU), best
    of ``repeats``; the interposed process's drainer is a thread of its own, as in the shim."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        return None
    src = os.path.join(d, "cb.c")
    exe = os.path.join(d, "cb")
    with open(src, "w") as f:
        f.write(C_BENCH)
    subprocess.run([cc, "-O2", "-pthread", "-o", exe, src, "-ldl"], check=True)
    small = os.path.join(d, "small.bin")
    best = {"plain": (float("inf"), float("inf")), "preload": (float("inf"), float("inf"))}
    for _ in range(repeats):
        for mode in best:
            env = dict(os.environ)
            env.pop("LD_PRELOAD", None)
            if mode == "preload":
                env["LD_PRELOAD"] = lib
            out = subprocess.run([exe, small, str(n), op], capture_output=True, text=True, env=env, check=True).stdout
            t, p = (float(x) for x in out.split())
            best[mode] = (min(best[mode][0], t), min(best[mode][1], p))
    return best


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
            for op in ("stat", "open+close"):
                c = c_bench(d, lib, max(a.n * 10, 100000), a.repeats, op)
                if c is not None:
                    (pt, pp), (it, ip) = c["plain"], c["preload"]
                    print(f"C loop, libc {op}: plain {pt:.0f} ns, interposed: thread +{it - pt:.0f} ns, process "
                          f"+{ip - pp:.0f} ns (with the drainer thread's copy of the slots; no Python)")  # fmt: skip
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
