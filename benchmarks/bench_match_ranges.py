"""The collective match split by (comm, seq) key ranges: what K analysis ranks would pay.

    python benchmarks/bench_match_ranges.py [RUN_DIR] [--ks 1,2,4] [--repeat 3]

RUN_DIR (default /tmp/distdiag-scale/1024x10000) is loaded streamed (the
collective rows kept apart, compact: what a large run's analysis matches) and
aligned, untimed. Then, ``--repeat`` times, the CPU seconds
(``time.process_time``: the machine is shared and noisy) of the whole match
(``match_collectives``) and, for each K, of the split (``split_match``: the
selection pass, the key ranges, each part's rows taken), each part's match
(``match_part``) and the merge (``merge_collectives``); the order of the whole
match and the K splits alternates between repeats, and the best of each is
printed. The merge is checked equal to the whole match (groups, members,
membership) each time.

What it predicts: on K analysis ranks the match stage costs about the
largest part's match plus the merge on the root (the split's selection is
done by each analysis rank over its own rows, so ~split/K each; the rows'
exchange is not measured here). The bytes: a part's input as shipped
(its rows, in-flight rows and the run's sig table; the scope's membership
pairs besides) and its output (every array of its match).

Measured (issue 10 part 4, 2-core machine at load ~4.3, best of 3 / 5
alternating repeats, CPU s)::

    1024 x 10k (5.12 M collective rows, 5,000 groups): whole match 0.838
      K  split  sum parts  max part  merge  max+merge  speed-up  in/part MB  out/part MB
      1  0.435     0.804     0.804   0.025    0.829     1.01x      189.4       128.5
      2  0.381     0.799     0.404   0.033    0.437     1.92x       94.7        64.2
      4  0.477     0.746     0.191   0.031    0.222     3.77x       47.4        32.1
    64 x 100k (3.2 M collective rows, 50,000 groups): whole match 0.506
      1  0.225     0.506     0.506   0.010    0.516     0.98x      118.4        84.9
      2  0.149     0.498     0.251   0.016    0.267     1.90x       59.2        42.4
      4  0.197     0.499     0.129   0.012    0.142     3.58x       29.6        21.2

The parts' matches add up to the whole one (the match is near linear in
rows; no part pays for the others'), so the match stage scales with K up to
the merge (~0.01-0.03 s: a copy of the result, 128 MB at 1024 x 10k) and
the exchange of the rows (37 B a row, shipped once). The scope's
membership pairs are 0.5-8 kB. The serial split (0.15-0.48 s, one process
selecting, cutting and copying every row) is what each analysis rank does
over its own rows in a parallel run.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from distdiag.cache import RunCache  # noqa: E402
from distdiag.clocks import align  # noqa: E402
from distdiag.match import (  # noqa: E402
    Collectives,
    GroupColumn,
    match_collectives,
    match_part,
    merge_collectives,
    split_match,
)
from distdiag.run import STREAMED_KINDS, load_run  # noqa: E402


def out_bytes(c: Collectives) -> int:
    """Bytes of every array a match holds (the shared ``m_group`` once)."""
    n = 0
    for f in c.__dataclass_fields__:  # per field
        v = getattr(c, f)
        if isinstance(v, np.ndarray) and f != "strings":
            n += v.nbytes
        elif isinstance(v, GroupColumn):
            n += v.group_values.nbytes + v.exc_rows.nbytes + v.exc_values.nbytes
    return n + sum(m.nbytes for m in c.comm_members.values())


def cpu(f: Any) -> tuple[float, Any]:
    t = time.process_time()
    r = f()
    return time.process_time() - t, r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", nargs="?", default="/tmp/distdiag-scale/1024x10000")
    ap.add_argument("--ks", default="1,2,4")
    ap.add_argument("--repeat", type=int, default=3)
    ns = ap.parse_args()
    ks = [int(k) for k in ns.ks.split(",")]
    run = align(load_run(ns.run_dir, streamed_kinds=STREAMED_KINDS), inplace=True)
    run.cache = RunCache()  # align's match: not needed here
    assert run.coll_rows is not None
    print(f"{ns.run_dir}: {len(run.coll_rows):,} collective rows ({run.coll_rows.nbytes / 1e6:.0f} MB kept), "
          f"{len(run.inflight)} in flight")  # fmt: skip
    best: dict[str, float] = {}
    facts: dict[int, dict[str, float]] = {}
    whole_bytes = 0

    def keep(name: str, s: float) -> None:
        best[name] = min(best.get(name, np.inf), s)

    for rep in range(ns.repeat):  # per repeat: the whole match first or last, alternately
        jobs: list[Any] = ["whole", *ks]
        if rep % 2:
            jobs.reverse()
        for job in jobs:  # the whole match, then each K (or the reverse)
            gc.collect()
            if job == "whole":
                s, whole = cpu(lambda: match_collectives(run.replace()))
                keep("whole", s)
                whole_bytes = out_bytes(whole)
                n_groups, n_members = len(whole), len(whole.m_rank)
                del whole
                continue
            k = int(job)
            s, (scope, parts) = cpu(lambda: split_match(run, k))
            keep(f"split{k}", s)
            times, outs = [], []
            for p in parts:  # per part
                s, c = cpu(lambda: match_part(p, scope, run.strings))
                times.append(s)
                outs.append(c)
            keep(f"sum{k}", sum(times))
            keep(f"max{k}", max(times))
            s, merged = cpu(lambda: merge_collectives(outs))
            keep(f"merge{k}", s)
            facts[k] = {
                "in_max": max(p.nbytes for p in parts), "in_sum": sum(p.nbytes for p in parts),
                "pairs": scope.pairs.nbytes, "out_max": max(out_bytes(c) for c in outs),
                "out_sum": sum(out_bytes(c) for c in outs), "merged": out_bytes(merged),
            }  # fmt: skip
            del parts, outs, merged, scope
    # checked once, outside the timing: the merge is the whole match
    whole = match_collectives(run.replace())
    scope, parts = split_match(run, max(ks))
    merged = merge_collectives([match_part(p, scope, run.strings) for p in parts])
    for col in ("g_comm", "g_seq", "g_state", "g_start", "m_group", "m_rank", "m_t0_ns", "m_t1_ns"):  # spot columns
        assert np.array_equal(getattr(whole, col), getattr(merged, col)), col
    del whole, merged, parts

    print(f"whole match: {best['whole']:.3f} s CPU, {n_groups:,} groups, {n_members:,} members, "
          f"result {whole_bytes / 1e6:.1f} MB")  # fmt: skip
    print(f"{'K':>3} {'split':>7} {'sum parts':>10} {'max part':>9} {'merge':>7} {'max+merge':>10} {'speed-up':>9}"
          f" {'in/part MB':>11} {'out/part MB':>12} {'merged MB':>10} {'pairs kB':>9}")  # fmt: skip
    for k in ks:  # per K
        crit = best[f"max{k}"] + best[f"merge{k}"]
        fk = facts[k]
        print(f"{k:>3} {best[f'split{k}']:>7.3f} {best[f'sum{k}']:>10.3f} {best[f'max{k}']:>9.3f} "
              f"{best[f'merge{k}']:>7.3f} {crit:>10.3f} {best['whole'] / crit:>8.2f}x "
              f"{fk['in_max'] / 1e6:>11.1f} {fk['out_max'] / 1e6:>12.1f} {fk['merged'] / 1e6:>10.1f} "
              f"{fk['pairs'] / 1e3:>9.1f}")  # fmt: skip
    print("speed-up: whole / (max part + merge); split: one process over every row (K ranks: ~split/K each)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
