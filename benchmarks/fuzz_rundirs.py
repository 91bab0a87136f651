"""Hostile run dirs at volume: N structurally mutated copies of a real run, each analyzed alone.

    python benchmarks/fuzz_rundirs.py [--cases 10000] [--workers 2] [--seed 0] [--timeout-s 10]
                                      [--json out.json] [--keep-failures DIR] [--flips]

``--flips``: each case flips random bytes of one rank file instead (``mutations.flip_bytes``:
1-24 anywhere or 1-8 in the first 4 KiB); it found libhdf5's endless global heap walk
(``distdiag/gheap.py``).

One real 2-rank ``mpiexec distdiag-wrap`` job is recorded once (``tests/mutations.py``'s
``JOB``). Each case copies its run dir, applies 1 to 4 of the structural mutations of
``tests/mutations.py`` (external storage and links, virtual datasets, soft links out of the
file, dtype swaps, huge declared dims, compression bombs, shared heap ids, out-of-range ids,
INT64 extremes, absurd attributes, replaced tables, rank files that are links out of the dir,
FIFOs, duplicate ranks, hostile Slurm accounting), drawn from the case's own seed, and
analyzes it in a forked child under a ``--timeout-s`` alarm and a 2 GiB address-space bound
(``mutations.analyze_isolated``). What issue 18 requires, each counted and expected 0:

* crashes: anything but a report (text and JSON) or one ``distdiag:`` error line;
* hangs: no answer within ``--timeout-s`` (10 s);
* peak RSS over the bound: the child's growth above its start beyond
  ``mutations.rss_bound`` (128 MiB + 16 bytes per byte of the dir's files);
* quoted: a report or error holding bytes that exist only outside the run dir.

A failing case is replayed by its seed: ``--cases 1 --seed S`` (``--keep-failures`` keeps
its dir and its child's output). The exit status is 1 when any count is not 0.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

import mutations  # noqa: E402

_NAMES = sorted(mutations.MUTATIONS)


def names_of(seed: int) -> list[str]:
    """The mutations of case ``seed`` (1 to 4, repeats allowed: two links, two swaps)."""
    rng = random.Random(seed ^ 0x5EED)
    return [rng.choice(_NAMES) for _ in range(rng.randint(1, 4))]


# the worker's state, set once per worker process by the pool's initializer
_W: dict[str, Any] = {}


def _init(real_run: str, outside: str, scratch: str, timeout_s: float, keep: str | None, flips: bool = False) -> None:
    import distdiag.pipeline  # noqa: F401  (once per worker: each case's child starts warm)
    import distdiag.render  # noqa: F401

    _W.update(real_run=Path(real_run), outside=Path(outside), scratch=Path(scratch), timeout_s=timeout_s,
              keep=Path(keep) if keep else None, flips=flips)  # fmt: skip


def _special(d: str, names: list[str]) -> list[str]:
    """FIFOs and devices a mutation made (copytree cannot copy them; the row says they were there)."""
    import stat

    return [n for n in names if not stat.S_ISREG(m := os.lstat(os.path.join(d, n)).st_mode)
            and not stat.S_ISDIR(m) and not stat.S_ISLNK(m)]  # fmt: skip


def one_case(seed: int) -> dict[str, Any]:
    names = ["flip_bytes"] if _W["flips"] else names_of(seed)
    case = Path(tempfile.mkdtemp(prefix=f"case-{seed}-", dir=_W["scratch"]))
    d = case / "run"
    shutil.copytree(_W["real_run"], d)
    row: dict[str, Any] = {"seed": seed, "names": names}
    try:
        if _W["flips"]:
            row["flipped"] = mutations.flip_bytes(d, seed)
        else:
            mutations.mutate(d, _W["outside"], names, seed)
    except Exception as e:  # a mutation that h5py refused: nothing to analyze, not a finding
        row.update(kind="skipped", detail=f"{type(e).__name__}: {e}")
        shutil.rmtree(case, ignore_errors=True)
        return row
    bound = mutations.rss_bound(d)
    got = mutations.analyze_isolated(d, case / "out", timeout_s=_W["timeout_s"], mem_bytes=2 << 30)
    row.update(kind=got.kind, seconds=got.seconds, rss_growth=got.rss_growth, rss_bound=bound, quoted=got.quoted,
               over=got.rss_growth > bound, detail=got.detail[-400:])  # fmt: skip
    bad = got.kind not in ("report", "error") or got.quoted or row["over"] or got.seconds > _W["timeout_s"]
    if bad and _W["keep"] is not None:
        shutil.copytree(case, _W["keep"] / case.name, symlinks=True, ignore=_special)
    shutil.rmtree(case, ignore_errors=True)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=10_000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0, help="the first case's seed (cases are seed, seed+1, ...)")
    ap.add_argument("--timeout-s", type=float, default=10.0)
    ap.add_argument("--json", type=Path, help="write every case's outcome here")
    ap.add_argument("--keep-failures", type=Path, help="copy failing cases' dirs and outputs here")
    ap.add_argument("--flips", action="store_true",
                    help="random byte flips in one rank file per case (mutations.flip_bytes) instead of structural mutations")
    ns = ap.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="distdiag-fuzz-") as td:
        base = Path(td)
        t0 = time.perf_counter()
        real_run = mutations.make_real_run(base, REPO)
        outside = mutations.make_outside(base / "home")
        scratch = base / "cases"
        scratch.mkdir()
        if ns.keep_failures:
            ns.keep_failures.mkdir(parents=True, exist_ok=True)
        print(f"real run: {len(list(real_run.glob('rank-*.h5')))} ranks, {mutations.dir_bytes(real_run)} bytes, "
              f"recorded in {time.perf_counter() - t0:.1f} s; {ns.cases} cases on {ns.workers} workers", flush=True)  # fmt: skip
        seeds = range(ns.seed, ns.seed + ns.cases)
        rows: list[dict[str, Any]] = []
        t1 = time.perf_counter()
        ctx = mp.get_context("spawn")  # fork from this threaded pool deadlocked a respawned worker
        init = (str(real_run), str(outside), str(scratch), ns.timeout_s,
                str(ns.keep_failures) if ns.keep_failures else None, ns.flips)  # fmt: skip
        lost: list[int] = []
        with ctx.Pool(ns.workers, initializer=_init, initargs=init, maxtasksperchild=500) as pool:
            it = pool.imap_unordered(one_case, seeds)  # chunksize 1: its iterator has next(timeout)
            while True:
                try:
                    # a pool whose worker died (OOM killer, a crash in the worker itself)
                    # never hands back that worker's cases: name them instead of waiting
                    row = it.next(timeout=8 * (ns.timeout_s + 5) + 60)
                except StopIteration:
                    break
                except mp.TimeoutError:
                    seen = {r["seed"] for r in rows}
                    lost = [s for s in seeds if s not in seen]
                    print(f"  no case finished in {8 * (ns.timeout_s + 5) + 60:.0f} s: a worker died "
                          f"(see dmesg); {len(lost)} cases lost, e.g. seeds {lost[:8]}", flush=True)  # fmt: skip
                    pool.terminate()
                    break
                rows.append(row)
                if len(rows) % 500 == 0:
                    print(f"  {len(rows)} cases, {time.perf_counter() - t1:.0f} s", flush=True)
        wall = time.perf_counter() - t1

    done = [r for r in rows if r["kind"] != "skipped"]
    kinds: dict[str, int] = {}
    for r in rows:
        kinds[r["kind"]] = kinds.get(r["kind"], 0) + 1
    crashes = [r for r in done if r["kind"] in ("crash", "memory")]
    hangs = [r for r in done if r["kind"] == "hang" or r["seconds"] > ns.timeout_s]
    over = [r for r in done if r["over"]]
    quoted = [r for r in done if r["quoted"]]
    per_name: dict[str, list[int]] = {n: [0, 0] for n in (["flip_bytes"] if ns.flips else _NAMES)}  # cases, reports
    for r in done:
        for n in set(r["names"]):
            per_name[n][0] += 1
            per_name[n][1] += r["kind"] == "report"
    secs = sorted(r["seconds"] for r in done)
    growth = sorted(r["rss_growth"] for r in done)

    def pct(xs: list[Any], q: float) -> Any:
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0

    print(f"\n{len(rows)} cases in {wall:.0f} s ({len(rows) / max(wall, 1e-9):.1f}/s): "
          + ", ".join(f"{k} {v}" for k, v in sorted(kinds.items())))  # fmt: skip
    print(f"analysis time per case: median {pct(secs, 0.5):.2f} s, p99 {pct(secs, 0.99):.2f} s, "
          f"max {pct(secs, 1.0):.2f} s (bound {ns.timeout_s:.0f} s)")  # fmt: skip
    print(f"RSS growth per case: median {pct(growth, 0.5) / 2**20:.0f} MiB, p99 {pct(growth, 0.99) / 2**20:.0f} MiB, "
          f"max {pct(growth, 1.0) / 2**20:.0f} MiB (bound ~{mutations.RSS_BOUND / 2**20:.0f} MiB + 16 B/B)")  # fmt: skip
    print("per mutation (cases with it: reports / errors):")
    for n, (k, rep) in per_name.items():
        print(f"  {n:22s} {k:6d}: {rep} / {k - rep}")
    print(f"\ncrashes {len(crashes)}  hangs over {ns.timeout_s:.0f} s {len(hangs)}  RSS over the bound {len(over)}  "
          f"reports quoting bytes from outside {len(quoted)}  cases lost with a worker {len(lost)}")  # fmt: skip
    for label, bad in (("crash", crashes), ("hang", hangs), ("rss", over), ("quoted", quoted)):
        for r in bad[:5]:
            print(f"  {label}: seed {r['seed']} {r.get('flipped', r['names'])}: {r['detail'][-300:]!r}")
    if ns.json:
        ns.json.write_text(json.dumps({"cases": rows, "wall_s": wall, "lost": lost}, indent=1))
    return 1 if crashes or hangs or over or quoted or lost else 0


if __name__ == "__main__":
    sys.exit(main())
