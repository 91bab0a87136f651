"""The analysis's safety net: a corpus of run dirs and the JSON report each must keep, byte for byte.

    python tests/corpus.py record CORPUS [--synth] [--from DIR ...] [--parallel 1,2,3]
    python tests/corpus.py check CORPUS [--parallel 1,2,3] [--only NAME ...]

For a change to the analyzer that must not change what it says (the engine redesign of
issue 19 is the one it was made for), record first, change, then check:

* ``record`` fills ``CORPUS``: with ``--synth``, every synth fault (distdiag.synth.FAULTS)
  at two sizes; with ``--from DIR``, every run dir (a directory holding ``rank-*.h5``)
  under DIR, copied as it is. The real runs the test suite makes are gathered that way:
  ``DISTDIAG_CORPUS_DIR=/tmp/runs python -m pytest -q`` copies each test's run dirs there
  (tests/conftest.py), then ``record CORPUS --from /tmp/runs``. Each entry is
  ``CORPUS/NAME/run/`` and ``CORPUS/NAME/report.json``: the in-memory analysis's report.
  A run dir the analyzer refuses keeps its error line instead (``error.txt``): that is a
  verdict too.
* ``check`` analyzes every entry again in every mode and compares with ``report.json``:
  in memory; streamed (``stream_events = 0``) with small bands (``BAND_EVENTS`` = 512
  rows, so every run has several); and ``distdiag analyze --parallel`` under
  ``mpiexec -n K`` for each K of ``--parallel`` (skipped without mpiexec). One line per
  entry and mode that differs (with the first differing line), a summary, exit status 1
  if any differs.

``record`` runs the same modes and notes, per entry, those that already differ from the
in-memory report (``known.json``), so ``check`` reports them apart: a difference that was
there before the change is not the change's.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

SYNTH_SIZES = ((16, 2000, 4), (64, 600, 8))  # (ranks, events per rank, ranks per host)
SMALL_BAND = 512
TIMEOUT_S = 600


def _report(run_dir: Path, stream: bool) -> str:
    """The JSON report of ``run_dir``, in memory or streamed in small bands; an error's line."""
    from distdiag import bands
    from distdiag.config import Config
    from distdiag.errors import DistdiagError
    from distdiag.pipeline import analyze
    from distdiag.render import render

    saved = bands.BAND_EVENTS
    cfg = dataclasses.replace(Config(), stream_events=0 if stream else -1)
    try:
        if stream:
            bands.BAND_EVENTS = SMALL_BAND
        return render(analyze(run_dir, cfg, stream=True), "json")  # type: ignore[no-any-return]
    except DistdiagError as e:
        return f"error: {e}\n"
    finally:
        bands.BAND_EVENTS = saved


def _parallel_report(run_dir: Path, k: int, mpiexec: str) -> str:
    cmd = [mpiexec, "-n", str(k), sys.executable, "-m", "distdiag.cli", "analyze", "--parallel", str(run_dir),
           "--format", "json"]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    if p.returncode != 0:
        line = (p.stderr.strip().splitlines() or ["(no message)"])[-1]
        return f"error: {line.removeprefix('distdiag: ')}\n"
    return p.stdout


def _modes(parallel: list[int]) -> list[str]:
    return ["memory", "streamed"] + [f"parallel{k}" for k in parallel]


def _run_mode(run_dir: Path, mode: str, mpiexec: str | None) -> str | None:
    """The report in ``mode``, or None where the mode cannot run here (no mpiexec)."""
    if mode == "memory":
        return _report(run_dir, False)
    if mode == "streamed":
        return _report(run_dir, True)
    if mpiexec is None:
        return None
    return _parallel_report(run_dir, int(mode.removeprefix("parallel")), mpiexec)


def _first_diff(want: str, got: str) -> str:
    for ln in difflib.unified_diff(want.splitlines(), got.splitlines(), lineterm="", n=0):
        if ln.startswith(("+", "-")) and not ln.startswith(("+++", "---")):
            return ln[:200]
    return "(whitespace)"


def _run_dirs(root: Path) -> list[Path]:
    """Directories under ``root`` (itself included) that hold rank files, sorted."""
    found = {p.parent for p in root.rglob("rank-*.h5")}
    return sorted(found)


def _name(root: Path, d: Path, taken: set[str]) -> str:
    base = "__".join(d.relative_to(root).parts) or d.name
    name, i = base, 1
    while name in taken:
        i += 1
        name = f"{base}.{i}"
    taken.add(name)
    return name


def record(corpus: Path, do_synth: bool, sources: list[Path], parallel: list[int]) -> int:
    from distdiag.synth import FAULTS, synth

    corpus.mkdir(parents=True, exist_ok=True)
    taken = {p.name for p in corpus.iterdir()}
    entries: list[Path] = []
    if do_synth:
        for fault in FAULTS:
            for ranks, events, per_host in SYNTH_SIZES:
                e = corpus / f"synth-{fault}-{ranks}x{events}"
                if e.name in taken:
                    continue
                taken.add(e.name)
                synth(e / "run", ranks=ranks, events=events, fault=fault, ranks_per_host=per_host, seed=1)
                entries.append(e)
    for src in sources:
        for d in _run_dirs(src):
            e = corpus / _name(src, d, taken)
            shutil.copytree(d, e / "run", symlinks=True)
            entries.append(e)
    mpiexec = shutil.which("mpiexec")
    for e in entries:
        want = _report(e / "run", False)
        (e / "report.json").write_text(want)
        known = {}
        for mode in _modes(parallel)[1:]:
            got = _run_mode(e / "run", mode, mpiexec)
            if got is not None and got != want:
                known[mode] = _first_diff(want, got)
        (e / "known.json").write_text(json.dumps(known, indent=1, sort_keys=True) + "\n")
        state = "error" if want.startswith("error:") else "report"
        print(f"{e.name}: {state}" + (f", differs already in {', '.join(known)}" if known else ""), flush=True)
    print(f"recorded {len(entries)} entries in {corpus}")
    return 0


def check(corpus: Path, parallel: list[int], only: list[str]) -> int:
    mpiexec = shutil.which("mpiexec")
    modes = _modes(parallel)
    if mpiexec is None:
        print("check: no mpiexec here, the parallel modes are skipped", file=sys.stderr)
    entries = sorted(p for p in corpus.iterdir() if (p / "report.json").is_file() and (not only or p.name in only))
    if not entries:
        print(f"check: no entries in {corpus}", file=sys.stderr)
        return 2
    new = old = same = 0
    for e in entries:
        want = (e / "report.json").read_text()
        known = json.loads((e / "known.json").read_text()) if (e / "known.json").is_file() else {}
        for mode in modes:
            got = _run_mode(e / "run", mode, mpiexec)
            if got is None:
                continue
            if got == want:
                same += 1
            elif mode in known:
                old += 1
                print(f"{e.name} [{mode}]: differs, as it did when recorded")
            else:
                new += 1
                print(f"{e.name} [{mode}]: DIFFERS: {_first_diff(want, got)}", flush=True)
    print(f"{len(entries)} entries: {same} reports the same, {new} differ, {old} differed already when recorded")
    return 1 if new else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("corpus", type=Path)
    r.add_argument("--synth", action="store_true", help="every synth fault at two sizes")
    r.add_argument("--from", dest="sources", type=Path, action="append", default=[], help="run dirs under DIR")
    c = sub.add_parser("check")
    c.add_argument("corpus", type=Path)
    c.add_argument("--only", action="append", default=[], help="only the entry NAME (repeatable)")
    for p in (r, c):
        p.add_argument("--parallel", default="1,2,3", help="analysis ranks K for --parallel (empty: none)")
    a = ap.parse_args(argv)
    ks = [int(k) for k in a.parallel.split(",") if k.strip()]
    if a.cmd == "record":
        if not a.synth and not a.sources:
            ap.error("record: nothing to record (--synth and/or --from DIR)")
        return record(a.corpus, a.synth, a.sources, ks)
    return check(a.corpus, ks, a.only)


if __name__ == "__main__":
    raise SystemExit(main())
