"""What the ranks' forked children did: DataLoader workers' file I/O, attributed to their rank.

A process forked from a rank (a DataLoader worker, a ``multiprocessing`` child, a
daemon) records into ``rank-NNNNN.fork-PID.h5`` beside the rank's file
(:class:`distdiag.shim.wrap._ForkStream`), with the rank's attributes plus ``pid``,
``forked_from_pid`` and ``role`` (``dataloader_worker``, ``multiprocessing`` or
``fork``). The rank's own breakdown never counts a child's time (the child runs
beside it, on other cores); what the children read is where an input-bound rank's
data comes from. So the report gets, per rank, its children's file I/O: how many
processes, calls, metadata calls and their time, bytes, per file system, and the
files they spent most time on (``Report.children``, ``children`` in the JSON,
"CHILD PROCESSES" in the text report), and an ``input_bound`` finding for that rank
carries it in its evidence (``children_io``).

Read like the rank files (the same reader, :func:`distdiag.run.read_rank`: a run dir
is untrusted), at most ``[analyze.children] max_files`` of them (4,096 by default;
the rest are counted in a warning). Vectorized per file: one ``np.unique`` over
each child's rows, nothing per event.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from distdiag.rows import calls_of
from distdiag.schema import FILE_KINDS, Kind

if TYPE_CHECKING:
    from distdiag.run import Run

#: a forked process's file (distdiag.shim.rankfile.fork_file_name)
FORK_FILE_RE = re.compile(r"^rank-(\d{5,})\.fork-(\d+)\.h5$")
#: the metadata calls (as distdiag.detectors.metadata_storm counts them)
META_KINDS = np.array([Kind.FILE_OPEN, Kind.FILE_CLOSE, Kind.FILE_STAT, Kind.FILE_LISTDIR], np.uint8)
MAX_CHILD_FILES = 4096
TOP_FILES = 5


@dataclass
class ChildIO:
    """One rank's children, summed."""

    rank: int
    processes: int = 0
    #: the children's recorded lifetimes, summed (their first to last recorded instant)
    alive_s: float = 0.0
    roles: dict[str, int] = field(default_factory=dict)
    calls: int = 0
    metadata_calls: int = 0
    io_s: float = 0.0
    metadata_s: float = 0.0
    bytes_read: int = 0
    bytes_written: int = 0
    #: file system ("type:mount") -> [calls, seconds, bytes]
    by_fs: dict[str, list[float]] = field(default_factory=dict)
    #: (path, calls, seconds, bytes), most time first
    top_files: list[tuple[str, int, float, int]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "processes": self.processes,
            "alive_s": round(self.alive_s, 6),
            "roles": dict(self.roles),
            "calls": self.calls,
            "metadata_calls": self.metadata_calls,
            "io_s": round(self.io_s, 6),
            "metadata_s": round(self.metadata_s, 6),
            "bytes_read": self.bytes_read,
            "bytes_written": self.bytes_written,
            "by_fs": [{"fs": k, "calls": int(v[0]), "seconds": round(v[1], 6), "bytes": int(v[2])}
                      for k, v in sorted(self.by_fs.items(), key=lambda kv: -kv[1][1])],  # fmt: skip
            "top_files": [{"path": p, "calls": c, "seconds": round(s, 6), "bytes": b} for p, c, s, b in self.top_files],
        }


def child_files(run_dir: Path) -> list[tuple[int, int, Path]]:
    """``(rank, pid, path)`` of the forked processes' files in ``run_dir``, sorted."""
    out = []
    try:
        names = [q.name for q in run_dir.iterdir()]
    except OSError:
        return []
    for n in names:
        m = FORK_FILE_RE.match(n)
        if m:
            out.append((int(m.group(1)), int(m.group(2)), run_dir / n))
    return sorted(out)


def _add(acc: ChildIO, ev: np.ndarray, strings: np.ndarray, files: list[tuple[np.ndarray, ...]]) -> None:
    """Sum one child's file rows into its rank's ``acc`` (one pass of numpy over the rows)."""
    f = ev[np.isin(ev["kind"], np.array(sorted(FILE_KINDS), np.uint8)) & (ev["t1_ns"] >= ev["t0_ns"])]
    if not len(f):
        return
    dur = (f["t1_ns"] - f["t0_ns"]).astype(np.float64) / 1e9
    nb = np.maximum(f["nbytes"], 0).astype(np.int64)
    meta = np.isin(f["kind"], META_KINDS)
    n_of = calls_of(f)  # 1, or the calls a sum stands for
    acc.calls += int(n_of.sum())
    acc.metadata_calls += int(n_of[meta].sum())
    acc.io_s += float(dur.sum())
    acc.metadata_s += float(dur[meta].sum())
    acc.bytes_read += int(nb[f["kind"] == Kind.FILE_READ].sum())
    acc.bytes_written += int(nb[f["kind"] == Kind.FILE_WRITE].sum())
    n_str = len(strings)

    def name(i: int) -> str:
        return str(strings[i]) if 0 <= i < n_str else ""

    for col in ("aux", "name_id"):
        ids, inv = np.unique(f[col].astype(np.int64), return_inverse=True)
        calls = np.bincount(inv, weights=n_of, minlength=len(ids))
        secs = np.bincount(inv, weights=dur, minlength=len(ids))
        byts = np.bincount(inv, weights=nb.astype(np.float64), minlength=len(ids))
        if col == "name_id":  # one a distinct path (a worker reads each sample once): kept as arrays
            ok = (ids > 0) & (ids < n_str)
            paths = np.full(len(ids), "", object)
            paths[ok] = np.asarray(strings, object)[ids[ok]]
            files.append((paths, calls.astype(np.float64), secs, byts))
            continue
        for k, i in enumerate(ids.tolist()):  # distinct file systems of one child: a few
            cur = acc.by_fs.setdefault(name(int(i)) or "?", [0.0, 0.0, 0.0])
            cur[0] += float(calls[k])
            cur[1] += float(secs[k])
            cur[2] += float(byts[k])


def _top_files(parts: list[tuple[np.ndarray, ...]], top: int) -> list[tuple[str, int, float, int]]:
    """The ``top`` paths by seconds over one rank's children (each child's per-path sums in
    ``parts``), summed by path across children: one np.unique, no loop over paths."""
    if not parts:
        return []
    paths = np.concatenate([p[0] for p in parts])  # objects: a fixed-width copy would be the longest path's width each
    u, inv = np.unique(paths, return_inverse=True)
    calls, secs, byts = (np.bincount(inv, weights=np.concatenate([p[k] for p in parts]), minlength=len(u))
                         for k in (1, 2, 3))  # fmt: skip
    order = [j for j in np.argsort(-secs, kind="stable").tolist()[: top + 1] if u[j]][:top]  # "" (no name) left out
    return [(str(u[j]), int(calls[j]), float(secs[j]), int(byts[j])) for j in order]


def children_io(run: Run, max_files: int = MAX_CHILD_FILES) -> dict[int, ChildIO]:
    """Per rank with children, their file I/O (see the module docstring); warnings go to
    ``run.warnings``. Empty for a run without forked processes' files."""
    from distdiag.run import read_rank

    run_dir = Path(getattr(run, "path", "") or "")
    if not run_dir.is_dir() or getattr(run, "source", "distdiag") != "distdiag":
        return {}
    found = child_files(run_dir)
    if len(found) > max_files:
        run.warnings.append(f"{len(found)} forked processes' files; the first {max_files} are read "
                            "([analyze.children] max_files)")  # fmt: skip
        found = found[:max_files]
    out: dict[int, ChildIO] = {}
    files: dict[int, list[tuple[np.ndarray, ...]]] = {}
    bad = 0
    for rank, _pid, path in found:  # one per forked process
        warnings: list[str] = []
        got = read_rank(path, warnings)
        if isinstance(got, str):
            bad += 1
            continue
        acc = out.setdefault(rank, ChildIO(rank))
        acc.processes += 1
        acc.alive_s += max(0, int(got.info.end_ns) - int(got.info.start_ns)) / 1e9
        role = str(getattr(got.info, "role", "") or "fork")
        acc.roles[role] = acc.roles.get(role, 0) + 1
        _add(acc, got.events, got.strings, files.setdefault(rank, []))
    if bad:
        run.warnings.append(f"{bad} forked processes' files could not be read (damaged or not distdiag's); skipped")
    for rank, acc in out.items():  # one per rank with children
        acc.top_files = _top_files(files.get(rank, []), TOP_FILES)
    return out
