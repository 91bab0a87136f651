"""``distdiag``: argument parsing only; the work is in the library.

    distdiag analyze RUN_DIR [--format text|json|html] [-o FILE] [--config FILE] [-v]
                     [--perfetto TRACE_JSON [--window T0:T1] [--max-events N]]
    distdiag analyze --parallel RUN_DIR ...   (under mpiexec/srun -n K: distdiag.parallel)
    distdiag synth OUT_DIR --ranks N --events M --fault straggler|slow_link|storm|serial|skew|none
    distdiag demo [ARGS...]

Expected mistakes (a wrong path, a file that is not a rank file, a bad config)
print one line, ``distdiag: <message>``, and exit with code 2; no traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from distdiag.errors import EXIT_USAGE, DistdiagError
from distdiag.output import emit
from distdiag.render import RENDERERS
from distdiag.render.fmt import escape_controls


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="distdiag", description="Why is my distributed job slow?")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    a = sub.add_parser("analyze", help="analyze a run directory written by distdiag-wrap")
    a.add_argument("run_dir", metavar="RUN_DIR",
                   help="the directory holding rank-*.h5 (or per-rank PyTorch profiler trace JSONs)")
    a.add_argument("--format", "-f", choices=sorted(RENDERERS), default="text", help="output format (default: text)")
    a.add_argument("-o", "--output", metavar="FILE", help="write the report to FILE instead of stdout")
    a.add_argument("--config", metavar="FILE", help="TOML file whose [analyze] table overrides the defaults")
    a.add_argument("-v", "--verbose", action="count", default=0, help="log progress (-vv: debug)")
    a.add_argument("--parallel", action="store_true",
                   help="run as one of K analysis ranks under mpiexec/srun -n K (distdiag.parallel); rank 0 writes")
    a.add_argument("--perfetto", metavar="TRACE_JSON", help="also write a Perfetto/Chrome trace (tracks per rank)")
    a.add_argument("--window", metavar="T0:T1", type=_window, default=None,
                   help="--perfetto: only what overlaps T0..T1 (seconds since the first rank started; either may be empty)")
    a.add_argument("--max-events", metavar="N", type=int, default=None,
                   help="--perfetto: write at most N events, the longest first (default 500000, ~100 MB; 0: no cap)")
    from distdiag.synth import add_parser as _synth_parser

    _synth_parser(sub)
    d = sub.add_parser("demo", help="run a built-in 4-rank MPI job with one slow rank, then analyze it", add_help=False)
    d.add_argument("args", nargs=argparse.REMAINDER)
    return p


def _window(text: str) -> tuple[float, float]:
    from distdiag.render.perfetto import parse_window

    try:
        return parse_window(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _analyze(ns: argparse.Namespace) -> int:
    from distdiag.config import load_config
    from distdiag.run import load_run, streamed_kinds_for

    from distdiag.render.progress import ProgressBar

    cfg = load_config(ns.config)
    # Load before importing the pipeline (pandas, every detector): a wrong
    # path is answered in a fraction of the time. The bar shows on a terminal only.
    # text and JSON need no row drawn: a large run streams its compute phases (distdiag.bands)
    stream = ns.format in ("text", "json") and not getattr(ns, "perfetto", None)
    kinds = streamed_kinds_for(ns.run_dir, cfg.stream_events) if stream else ()
    run = load_run(ns.run_dir, progress=ProgressBar(), streamed_kinds=kinds, max_trace_bytes=cfg.kineto_max_trace_bytes)
    from distdiag.pipeline import analyze_run

    return emit(analyze_run(run, cfg, inplace=True), ns)


def _no_huge_page_advice() -> None:
    """Turn off numpy's ``madvise(MADV_HUGEPAGE)`` on its large arrays for this process (the
    analysis's own), unless ``NUMPY_MADVISE_HUGEPAGE`` says otherwise (numpy's documented knob).

    Why: the analysis allocates many fresh arrays of millions of rows as its memory grows, and
    a fresh 2 MB page is zeroed whole at its first touch (on a virtual machine, where the host
    backs the guest's memory lazily, far dearer still). Measured on the 2-core VM the
    benchmarks run on (``benchmarks/NOTES.md``, "Huge pages"): a fresh 16 MB result 33 ms with
    the advice, 7.4 ms without; the replay of a 1024-rank DDP-shaped run 2.3-2.6 s with it,
    1.3 s without; the loader's own table already went without it (``run.new_table``).
    Only the CLI does this: the library API leaves the caller's numpy as it is."""
    if "NUMPY_MADVISE_HUGEPAGE" in os.environ:
        return
    try:
        from numpy._core import multiarray
    except ImportError:  # numpy 1.x
        from numpy.core import multiarray  # type: ignore[no-redef]
    setter = getattr(multiarray, "_set_madvise_hugepage", None)
    if setter is not None:
        setter(False)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["demo"]:
        # The demo owns its arguments (and its --help).
        from distdiag.demo import main as demo_main

        return int(demo_main(argv[1:]) or 0)
    p = _parser()
    ns = p.parse_args(argv)
    if ns.command is None:
        p.print_help(sys.stderr)
        return EXIT_USAGE
    logging.basicConfig(
        level=logging.WARNING - 10 * min(2, getattr(ns, "verbose", 0)),
        format="distdiag: %(message)s",
        stream=sys.stderr,
    )
    if ns.command == "analyze":
        _no_huge_page_advice()
    try:
        if ns.command == "synth":
            from distdiag.synth import main_from_args

            return main_from_args(ns)
        if getattr(ns, "parallel", False):
            from distdiag.parallel import main_from_args as parallel_main

            return parallel_main(ns)
        return _analyze(ns)
    except DistdiagError as e:
        print(f"distdiag: {escape_controls(str(e))}", file=sys.stderr)  # names from the run dir: untrusted
        return EXIT_USAGE
    except BrokenPipeError:  # `distdiag analyze ... | head`
        return 0


if __name__ == "__main__":
    sys.exit(main())
