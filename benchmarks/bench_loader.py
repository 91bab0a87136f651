"""A DataLoader job's step time wrapped against plain (issue 21's cost), side by side in one run.

    python benchmarks/bench_loader.py [--workers 4] [--steps 2000] [--rounds 7] [--stats 1000000]
                                      [--batch 4] [--decode 0]

A single-process training loop fed by a torch DataLoader whose ``--workers`` worker
processes each read one small file per sample (``os.stat``, open, read, close: what a
dataset of images or shards does), from a directory on the local disk; the step is a small
matmul. Three variants, run by turns round after round (the order rotates, so machine load
drifting hits all alike): ``plain`` (no distdiag), ``python`` (``distdiag-wrap``, the
Python-level file hooks, the default) and ``preload`` (``distdiag-wrap`` with
``DISTDIAG_HOOKS=preload=1``: the libc interposer, in the main process and in every
worker). Each run prints its own loop time (first batch to last, so the interpreter's
start stays out of it) and its step time after the first fifth of the steps (the steady
state: the workers' start, which the wrapper makes longer by a fixed amount per worker, and
their first batches stay out of it); the figures are each variant's medians over the
rounds, as ratios to plain's. Issue 21's target (step time): <= 1.02. ``--batch`` samples a
step; ``--decode N``: each sample also does N 64x64 matmuls (~25 us each on one core), a
fixed amount of work standing for its decoding (0, the default: the file calls are the whole
sample, the worst case for the capture's share).

Also per-rank bytes per million calls: a wrapped loop of ``--stats`` ``os.stat`` calls on
one file with each capture, the rank file's size over the calls.

And ``--samples N``: what one worker's sample costs, without the DataLoader's processes (whose
scheduling on a small machine is noisier than the difference): one process runs the Dataset's
``__getitem__`` N times (stat, open, read, close, a tensor), and prints the process's CPU per
sample (the drainer's work on the rows included), best of 5; plain and each capture by turns.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

JOB = r"""
import os, sys, time
import torch
from torch.utils.data import DataLoader, Dataset


class Files(Dataset):
    def __init__(self, root):
        self.paths = sorted(os.path.join(root, n) for n in os.listdir(root))

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        p = self.paths[i]
        os.stat(p)
        with open(p, "rb") as f:
            x = torch.tensor(len(f.read()), dtype=torch.float32)
        for _ in range(decode):  # the sample's decoding: a fixed amount of work, not of time
            x = (m @ m).sum() * 0 + x
        return x


root, workers, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
batch, decode = int(sys.argv[4]), int(sys.argv[5])
torch.set_num_threads(1)
m = torch.randn(64, 64)
loader = DataLoader(Files(root), batch_size=batch, num_workers=workers, shuffle=False)
w = torch.randn(128, 128)
n = 0
t0 = tw = None
warm = steps // 5  # the steady state: after the workers' start and their first batches
while n < steps:
    for batch in loader:
        if t0 is None:
            t0 = time.perf_counter()
        if n == warm:
            tw = time.perf_counter()
        (w @ w).sum().item()
        n += 1
        if n == steps:
            break
t1 = time.perf_counter()
print(f"loop {t1 - t0:.4f} s steady {(t1 - tw) / (steps - warm) * 1e6:.1f} us", flush=True)
"""

SAMPLES = r"""
import os, sys, time
import torch
root, n = sys.argv[1], int(sys.argv[2])
paths = sorted(os.path.join(root, p) for p in os.listdir(root))
def item(p):
    os.stat(p)
    with open(p, "rb") as f:
        return torch.tensor(len(f.read()), dtype=torch.float32)
for p in paths[:200]:
    item(p)
best = best_thread = float("inf")
for _ in range(5):
    t, tt = time.process_time_ns(), time.thread_time_ns()
    for i in range(n):
        item(paths[i % len(paths)])
    best_thread = min(best_thread, (time.thread_time_ns() - tt) / n)  # the program's thread alone
    try:
        from distdiag.shim import preload
        preload.drain_now(final=False)  # the rows of these calls, made now if not yet
    except ImportError:
        pass
    best = min(best, (time.process_time_ns() - t) / n)
print(f"sample {best:.0f} thread {best_thread:.0f}")
"""

STATS = r"""
import os, sys
p, n = sys.argv[1], int(sys.argv[2])
for _ in range(n):
    os.stat(p)
"""

VARIANTS = ("plain", "python", "preload")


def _env(variant: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTDIAG_") and k != "LD_PRELOAD"}
    env["OMP_NUM_THREADS"] = "1"
    env["DISTDIAG_HOOKS"] = f"preload={int(variant == 'preload')}"
    return env


def _cmd(variant: str, script: Path, run_dir: Path, *args: str) -> list[str]:
    if variant == "plain":
        return [sys.executable, str(script), *args]
    return [sys.executable, "-m", "distdiag.wrap", "--dir", str(run_dir), sys.executable, str(script), *args]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--files", type=int, default=0, help="default: 4 x steps (one epoch: the workers start once)")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--batch", type=int, default=4, help="samples a step")
    ap.add_argument("--decode", type=int, default=0,
                    help="64x64 matmuls a sample, its decoding (0: none, the worst case for the capture's share)")
    ap.add_argument("--stats", type=int, default=1_000_000, help="calls of the bytes-per-call loop (0: skip it)")
    ap.add_argument("--samples", type=int, default=0, help="only the per-sample CPU of one process's loop")
    a = ap.parse_args()
    if a.samples:
        return _per_sample(a)
    a.files = a.files or a.batch * a.steps
    tmp = Path(tempfile.mkdtemp(prefix="bench_loader_"))
    try:
        data = tmp / "data"
        data.mkdir()
        for i in range(a.files):
            (data / f"s{i:05d}.bin").write_bytes(os.urandom(4096))
        job = tmp / "job.py"
        job.write_text(JOB)
        by_key = _by_turns(tmp, job, a.rounds, ("loop ", "steady "), str(data), str(a.workers), str(a.steps),
                           str(a.batch), str(a.decode))  # fmt: skip
        if by_key is None:
            return 1
        print(f"DataLoader job, {a.workers} workers, {a.steps} steps of {a.batch} samples (one 4 KiB file each, "
              f"{a.decode} 64x64 matmuls of decoding), "
              f"{a.rounds} rounds by turns; load average at the end {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")  # fmt: skip
        for key, label, unit in (("loop ", "whole loop (first batch to last)", "s"),
                                 ("steady ", f"step time after the first {a.steps // 5} steps", "us")):  # fmt: skip
            figs = by_key[key]
            base = statistics.median(figs["plain"])
            print(f"{label}: median {unit}, ratio to plain, each round's")
            for v in VARIANTS:
                m = statistics.median(figs[v])
                print(f"  {v:<8} {m:10.3f} {m / base:7.3f}  {' '.join(f'{x:.3f}' for x in figs[v])}")
        if a.stats:
            stats = tmp / "stats.py"
            stats.write_text(STATS)
            target = data / "s00000.bin"
            print(f"rank file bytes per million calls ({a.stats} os.stat calls, one file):")
            for v in ("python", "preload"):
                run_dir = tmp / f"stats-{v}"
                p = subprocess.run(_cmd(v, stats, run_dir, str(target), str(a.stats)), env=_env(v), capture_output=True,
                                   text=True, timeout=600)  # fmt: skip
                if p.returncode != 0:
                    print(p.stderr[-3000:], file=sys.stderr)
                    return 1
                size = sum(f.stat().st_size for f in run_dir.glob("rank-*.h5"))
                print(f"  {v:<8} {size * 1e6 / a.stats / 1e6:8.1f} MB")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


def _by_turns(tmp: Path, job: Path, rounds: int, keys: tuple[str, ...], *args: str) -> dict[str, dict[str, list[float]]] | None:
    """Per key, each variant's figure (the number after the key in its output) per round, the
    variants by turns (the order rotates and reverses round by round); None when a run failed."""
    got: dict[str, dict[str, list[float]]] = {k: {v: [] for v in VARIANTS} for k in keys}
    for r in range(rounds):
        order = VARIANTS[r % 3 :] + VARIANTS[: r % 3]
        for v in order if r % 2 == 0 else tuple(reversed(order)):
            run_dir = tmp / f"run-{v}-{r}"
            p = subprocess.run(_cmd(v, job, run_dir, *args), env=_env(v), capture_output=True, text=True, timeout=600)
            if p.returncode != 0:
                print(p.stderr[-3000:], file=sys.stderr)
                return None
            for k in keys:
                got[k][v].append(float(p.stdout.split(k)[1].split()[0]))
            shutil.rmtree(run_dir, ignore_errors=True)
    return got


def _per_sample(a: argparse.Namespace) -> int:
    tmp = Path(tempfile.mkdtemp(prefix="bench_loader_"))
    try:
        data = tmp / "data"
        data.mkdir()
        for i in range(2000):
            (data / f"s{i:05d}.bin").write_bytes(os.urandom(4096))
        job = tmp / "samples.py"
        job.write_text(SAMPLES)
        got = _by_turns(tmp, job, a.rounds, ("sample ", "thread "), str(data), str(a.samples))
        if got is None:
            return 1
        print(f"one process's Dataset loop, {a.samples} samples (stat, open, read 4 KiB, close, a tensor), "
              f"CPU per sample, best of 5, {a.rounds} rounds by turns; process (with the drainer's work) "
              "and the program's thread alone")  # fmt: skip
        for label, figs in (("process", got["sample "]), ("thread", got["thread "])):
            base = statistics.median(figs["plain"])
            for v in VARIANTS:
                m = statistics.median(figs[v])
                print(f"{label:<8} {v:<8} {m:8.0f} ns  +{m - base:6.0f} ns  {m / base:6.3f}  "
                      f"{' '.join(f'{x:.0f}' for x in figs[v])}")  # fmt: skip
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
