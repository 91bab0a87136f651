"""A walk through one run with the public API only: ``distdiag.load`` and the plot functions.

    python analysis/demo_walkthrough.py RUN_DIR [--out DIR]
    python analysis/demo_walkthrough.py --demo [--out DIR]   # runs the 4-rank demo job first (needs mpiexec)

What a notebook user would do: load the run, read the verdict, look at who
waited for whom per collective, where each rank's time went, which files it
touched, then save the figures and the HTML report and a Perfetto trace next
to them. Everything printed comes from the DataFrames of ``distdiag.load``.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

import distdiag
from distdiag.render import plots, render
from distdiag.render.perfetto import export_perfetto


def run_demo(out: Path) -> Path:
    """``mpiexec -n 4 distdiag-wrap python -m distdiag.demo_job`` (rank 2 sleeps 20 ms per iteration)."""
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        sys.exit("demo_walkthrough: --demo needs mpiexec (pip install 'distdiag[mpi]')")
    run_dir = out / "demo-run"
    cmd = [mpiexec, "-n", "4", sys.executable, "-m", "distdiag.wrap", "--dir", str(run_dir), sys.executable, "-m",
           "distdiag.demo_job", "--iters", "30", "--slow-rank", "2", "--delay-s", "0.02"]  # fmt: skip
    subprocess.run(cmd, check=True, timeout=300)
    return run_dir


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", nargs="?", help="a run directory written by distdiag-wrap")
    ap.add_argument("--demo", action="store_true", help="run the built-in demo job first and walk through it")
    ap.add_argument("--out", default="walkthrough-out", help="where figures, report.html and trace.json go")
    ns = ap.parse_args(argv)
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    if ns.demo:
        run_dir = run_demo(out)
    elif ns.run_dir:
        run_dir = Path(ns.run_dir)
    else:
        ap.error("give a RUN_DIR or --demo")

    run = distdiag.load(run_dir)
    print(run)

    # 1. The verdict: the top finding, with its cost in seconds and as a share of the wall-clock.
    f = run.findings
    if f.empty:
        print("\nhealthy: no cause costs a noticeable share of the wall-clock")
    else:
        top = f.iloc[0]
        print(f"\nverdict: {top.kind} costs {top.cost_s:.2f} s ({top.fraction:.0%}): {top.summary}")
        print(f"what to do: {top.advice}")
        print("\nall findings:\n" + f[["kind", "cost_s", "fraction", "ranks"]].to_string(index=False))

    # 2. Who arrived last, and how long the others waited, per kind of collective.
    c = run.collectives
    if not c.empty:
        last = c[c["is_last"]].groupby("op")["rank"].agg(lambda s: s.value_counts().idxmax())
        waits = c.groupby(["op", "rank"])["wait_s"].sum().unstack("rank")
        print("\nmost frequent last arriver per op:\n" + last.to_string())
        print("\nseconds each rank waited, per op:\n" + waits.round(3).to_string())

    # 3. Where each rank's wall-clock went.
    b = run.breakdown
    print("\nper-rank breakdown (s):\n" + b.round(3).to_string(index=False))

    # 4. Files: the busiest paths by time in calls.
    fs = run.files
    if not fs.empty:
        busy = fs.groupby("path").agg(calls=("op", "size"), time_s=("dur_s", "sum")).nlargest(5, "time_s")
        print("\nbusiest paths:\n" + busy.to_string())

    # 5. Phases the program marked with distdiag.phase(...) (or torch's forward/backward/optimizer).
    ph = run.phases
    if not ph.empty:
        print("\nphases (s):\n" + ph.groupby(["phase", "rank"])["dur_s"].sum().unstack("rank").round(3).to_string())

    # 6. Figures, one function each; a figure without data raises NoData.
    for p in plots.PLOTS:
        try:
            png = plots.figure_png(p.fn, run)
        except plots.NoData as why:
            print(f"figure {p.name}: not drawn ({why})")
            continue
        (out / f"{p.name}.png").write_bytes(png)
    (out / "report.html").write_text(render(run.report, "html"))
    st = export_perfetto(run, out / "trace.json")
    print(f"\nwrote figures, {out / 'report.html'} and {out / 'trace.json'} ({st.n_events} events: open it in "
          "https://ui.perfetto.dev)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
