"""The reports side by side: Perfetto export (vectorized vs a loop per event), HTML vs the analysis it draws.

    python benchmarks/bench_report.py [--ranks 16] [--events 20000] [--fault slow_link]

The run is a synthetic one (``distdiag.synth``: bulk-synchronous training,
the real rank-file format) with a slow link, so every figure that needs
collectives or a link matrix has one. Timed in one process, on one report, in CPU seconds (the machine is shared):

* ``analyze_run`` (align, match, detectors, ranking): the reference;
* the HTML report (figures drawn with matplotlib Agg, PNG, base64) and the
  figures one by one;
* the Perfetto export as written (one ``DataFrame.to_json`` per kind of
  event) against the obvious implementation (a dict per event through
  ``json.dumps``), on the same events, and the bytes per event;
* the export capped with ``max_events`` (what the CLI does by default).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from distdiag.pipeline import analyze_run
from distdiag.render.html import HtmlRenderer
from distdiag.render.perfetto import _pid, _tid, build_trace
from distdiag.render.plots import PLOTS, NoData, figure_png
from distdiag.run import load_run
from distdiag.synth import synth


def naive_trace(report: Any) -> str:
    """The loop-per-event baseline: the same collective and event slices, one dict each."""
    run, c = report.run, report.collectives
    t0 = run.start_ns
    st = [str(s) for s in run.strings]
    out = []
    for i in range(len(c.m_rank)):  # the thing the real exporter avoids
        g = int(c.m_group[i])
        r = int(c.m_rank[i])
        a, z = int(c.m_t0_ns[i]), int(c.m_t1_ns[i])
        out.append({"name": st[c.m_op[i]], "cat": "collective", "ph": "X", "ts": round((a - t0) / 1e3, 3),
                    "dur": round((z - a) / 1e3, 3), "pid": r + 1, "tid": int(_tid(np.array([r]), np.array([0]), 1)[0]),
                    "args": {"comm": st[c.g_comm[g]], "seq": int(c.g_seq[g]), "nbytes": int(c.m_nbytes[i]),
                             "wait_ms": max(0, int(c.g_last_ns[g]) - a) / 1e6, "site": st[c.m_site[i]]}})  # fmt: skip
    ev = run.events
    for e in ev[ev["kind"] != 1]:  # and one per other event
        r = int(e["rank"])
        out.append({"name": st[e["name_id"]], "cat": "phase", "ph": "X", "ts": round((int(e["t0_ns"]) - t0) / 1e3, 3),
                    "dur": round((int(e["t1_ns"]) - int(e["t0_ns"])) / 1e3, 3), "pid": int(_pid(np.array([r]))[0]),
                    "tid": r, "args": {"nbytes": int(e["nbytes"]), "site": st[e["site_id"]]}})  # fmt: skip
    return json.dumps({"traceEvents": out})


def best(fn: Any, repeat: int) -> tuple[float, Any]:
    """The least CPU seconds of ``repeat`` calls (CPU, not wall: the machine is shared)."""
    times, res = [], None
    for _ in range(repeat):  # a few repeats
        t = time.process_time()
        res = fn()
        times.append(time.process_time() - t)
    return min(times), res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=16)
    ap.add_argument("--events", type=int, default=20000, help="events per rank")
    ap.add_argument("--fault", default="slow_link")
    ap.add_argument("--repeat", type=int, default=2)
    ns = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        synth(run_dir, ranks=ns.ranks, events=ns.events, fault=ns.fault)
        t_an, report = best(lambda: analyze_run(load_run(run_dir)), 1)
        n_ev = len(report.run.events)
        print(f"run: {ns.ranks} ranks, {n_ev:,} events, {len(report.collectives):,} collectives ({ns.fault})")
        print(f"analyze_run (reference)        {t_an:8.2f} s   1.00x")
        t_html, page = best(lambda: HtmlRenderer().render(report), ns.repeat)
        print(f"HTML report                    {t_html:8.2f} s   {t_html / t_an:5.2f}x of the analysis, "
              f"{len(page) / 1e6:.2f} MB")  # fmt: skip
        for p in PLOTS:  # a handful of figures
            try:
                t_fig, png = best(lambda p=p: figure_png(p.fn, report), 1)
            except NoData:
                print(f"  figure {p.name:<16} (no data)")
                continue
            print(f"  figure {p.name:<16} {t_fig:8.2f} s   {len(png) / 1e3:6.0f} kB")
        t_vec, (text, stats) = best(lambda: build_trace(report), ns.repeat)
        t_loop, naive = best(lambda: naive_trace(report), 1)
        n_naive = naive.count('"ph"')
        rate_vec, rate_loop = stats.n_events / t_vec, n_naive / t_loop
        print(f"Perfetto export, vectorized    {t_vec:8.2f} s   {stats.n_events:,} events, "
              f"{len(text) / stats.n_events:.0f} B/event, {rate_vec / 1e6:.3f} M events/s")  # fmt: skip
        print(f"Perfetto export, dict per event {t_loop:7.2f} s   {n_naive:,} events (no wait slices, fewer args), "
              f"{rate_loop / 1e6:.3f} M events/s: the vectorized writer is {rate_vec / rate_loop:.1f}x faster an event")  # fmt: skip
        cap = max(1000, stats.n_events // 10)
        t_cap, (text_c, st_c) = best(lambda: build_trace(report, max_events=cap), ns.repeat)
        print(f"Perfetto export, max_events={cap:,}  {t_cap:6.2f} s   {st_c.n_events:,} written, "
              f"{st_c.n_dropped:,} left out, {len(text_c) / 1e6:.1f} MB")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
