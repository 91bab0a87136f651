"""Writing a finished report where the command line asks (``--format``, ``-o``, ``--perfetto``):
the one output step of the serial CLI (:mod:`distdiag.cli`) and of ``--parallel``'s rank 0
(:mod:`distdiag.parallel`), kept apart from both so that neither imports the other."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from distdiag.errors import EXIT_USAGE


def _perfetto(report: object, ns: argparse.Namespace) -> int:
    from distdiag.render.perfetto import DEFAULT_MAX_EVENTS, export_perfetto

    cap = DEFAULT_MAX_EVENTS if ns.max_events is None else (ns.max_events or None)
    try:
        st = export_perfetto(report, ns.perfetto, window_s=ns.window, max_events=cap)
    except OSError as e:
        print(f"distdiag: cannot write '{ns.perfetto}': {e.strerror or e}", file=sys.stderr)
        return EXIT_USAGE
    left = f", {st.n_dropped} left out (--max-events/--window)" if st.n_dropped else ""
    print(f"distdiag: wrote {st.n_events} trace events to {ns.perfetto}{left} (open it in https://ui.perfetto.dev)",
          file=sys.stderr)
    return 0


def emit(report: object, ns: argparse.Namespace) -> int:
    """Write the report as ``ns`` asks (--perfetto, --format, -o): the serial and the
    --parallel paths share it. Returns the exit code."""
    from distdiag.render import render

    if getattr(ns, "perfetto", None):
        rc = _perfetto(report, ns)
        if rc:
            return rc
    # colour only on a terminal: never into a file (-o)
    options = {"color": False} if ns.output and ns.format == "text" else {}
    out = render(report, ns.format, **options)
    if ns.output:
        try:
            Path(ns.output).write_text(out)
        except OSError as e:
            print(f"distdiag: cannot write '{ns.output}': {e.strerror or e}", file=sys.stderr)
            return EXIT_USAGE
    else:
        sys.stdout.write(out)
        sys.stdout.flush()
    return 0
