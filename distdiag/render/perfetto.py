"""Perfetto / Chrome trace export: ``distdiag analyze RUN --perfetto trace.json``.

The Chrome JSON trace-event format (what ui.perfetto.dev, ``trace_processor``
and chrome://tracing read). One process per rank, named ``rank N (host)``
and sorted by rank, on the aligned timeline (microseconds since the first
rank started); inside it one thread track per kind of activity so that
slices on a track nest properly:

============  =====================================================================
track         slices
============  =====================================================================
collectives   every matched collective (name = op; args: comm, seq, nbytes, root,
              state, wait_ms, site), with a nested ``wait`` slice from the rank's
              arrival to the last member's arrival (time lost waiting for others)
async comm    non-blocking collectives: post -> completion seen
p2p           sends and receives (args: peer, nbytes)
phases        distdiag.phase(...), forward/backward/optimizer, input wait, H2D;
              steps and marks as instants
file I/O      open, stat, listdir, read, write, close (args: path, fs, nbytes)
other         Wait loops, communicator creation, link probes, the shim's milestones
============  =====================================================================

GPU samples (NVML) are counters on the rank's process (``gpu N`` with SM and
memory utilization, power). A thread of the program other than the main one
gets its own set of tracks.

Big runs stay loadable: ``window_s=(t0, t1)`` keeps what overlaps that
window (seconds on the same timeline), and ``max_events`` caps the events
written: counters are thinned evenly to at most a tenth of the budget, and
of the slices and instants the longest are kept (what one looks for in a
timeline; short ones are invisible at that zoom anyway). What was dropped is
written under ``otherData`` and returned in :class:`ExportStats`.

Serialization is vectorized: each kind of event is one pandas frame written
by ``DataFrame.to_json`` (C); the ``args`` object is nested by one string
replace on a sentinel key, never by a Python loop per event.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np
import pandas as pd

from distdiag.match import MatchState
from distdiag.schema import FILE_KINDS, P2P_KINDS, PHASE_KINDS, Kind

log = logging.getLogger(__name__)

#: the CLI's default cap: ~200 bytes an event makes this ~100 MB of JSON, which
#: the Perfetto UI and chrome://tracing still open
DEFAULT_MAX_EVENTS = 500_000

# Thread tracks inside each rank's process.
LANE_COLL, LANE_ASYNC, LANE_P2P, LANE_PHASE, LANE_FILE, LANE_OTHER = range(1, 7)
LANE_NAMES = {LANE_COLL: "collectives", LANE_ASYNC: "async comm", LANE_P2P: "p2p", LANE_PHASE: "phases",
              LANE_FILE: "file I/O", LANE_OTHER: "other"}  # fmt: skip
_N_LANES = 8
#: program threads per rank that get their own tracks (more share the last set)
_MAX_THREADS = 16

#: sentinel prefix that marks the first args column; see _frame_json
_ARG0 = "\x01"


@dataclass
class ExportStats:
    """What the export wrote (and left out)."""

    path: str = ""
    n_events: int = 0
    n_slices: int = 0
    n_instants: int = 0
    n_counters: int = 0
    n_dropped: int = 0
    window_s: tuple[float, float] | None = None
    #: per rank: collectives written (top-level collective slices)
    collectives_per_rank: dict[int, int] = field(default_factory=dict)


def _pid(rank: np.ndarray) -> np.ndarray:
    # pid 0 is the idle process to trace_processor: rank r is process r + 1
    return np.asarray(rank, np.int64) + 1


def _tid(rank: np.ndarray, thread: np.ndarray, lane: np.ndarray | int) -> np.ndarray:
    """Globally unique thread ids (trace_processor keys threads by tid across processes)."""
    th = np.clip(np.asarray(thread, np.int64), 0, _MAX_THREADS - 1)
    return ((np.asarray(rank, np.int64) + 1) * _MAX_THREADS + th) * _N_LANES + lane


def _json_strings(strings: np.ndarray) -> np.ndarray:
    """The run's string table as Python str (object array), for to_json to escape."""
    return np.asarray([str(s) for s in strings], dtype=object)  # one per distinct string, not per event


def _frame_json(df: pd.DataFrame, n_args: int) -> str:
    """The rows as JSON objects, one a line, each ending in ",\\n"; the last ``n_args`` columns nested under "args".

    ``to_json(orient="records")`` writes ``[{"name":...},{"name":...}]``. Two
    patterns in it can only be structure, never part of a string value,
    because a value's quotes are written as ``\\"``: ``},{"name":`` (the
    boundary between two events; "name" is every frame's first column) and
    ``,"\\u0001key":`` (the first args column, named with the _ARG0 sentinel).
    So three C-level replaces nest the args and split the lines.
    """
    if len(df) == 0:
        return ""
    if df.columns[0] != "name":
        raise ValueError("every trace frame starts with the name column")
    s = df.to_json(orient="records", double_precision=3)[1:-1]
    close = "}}" if n_args else "}"
    if n_args:
        first = df.columns[len(df.columns) - n_args]
        key = json.dumps(first)[1:-1]  # to_json's escape of the sentinel name
        plain = first.removeprefix(_ARG0)
        s = s.replace(f',"{key}":', f',"args":{{"{plain}":')
    s = s.replace('},{"name":', close + ',\n{"name":')
    return str(s[:-1]) + close + ",\n"


class _Builder:
    """Columns of one kind of event, gathered per category, then written at once."""

    def __init__(self) -> None:
        self.frames: list[tuple[str, pd.DataFrame, int]] = []  # (what, frame, n_args)

    def add(self, what: str, base: dict[str, Any], args: dict[str, Any]) -> None:
        cols = dict(base)
        for i, (k, v) in enumerate(args.items()):
            cols[(_ARG0 + k) if i == 0 else k] = v
        self.frames.append((what, pd.DataFrame(cols), len(args)))


def _slice_base(name: np.ndarray, cat: str, ts_us: np.ndarray, dur_us: np.ndarray, pid: np.ndarray,
                tid: np.ndarray) -> dict[str, Any]:  # fmt: skip
    return {"name": name, "cat": cat, "ph": "X", "ts": ts_us, "dur": dur_us, "pid": pid, "tid": tid}


def build_trace(report: Any, window_s: tuple[float, float] | None = None,
                max_events: int | None = None) -> tuple[str, ExportStats]:  # fmt: skip
    """The whole trace as one JSON string, and what went into it."""
    run = report.run
    colls = report.collectives
    t0 = int(run.start_ns)
    st = _json_strings(run.strings)
    end_ns = np.asarray(run.rank_bounds()[1], np.int64)
    # Calls a rank was still inside of (a phase, a read) run until its record ends;
    # in-flight collectives come with the matched ones below.
    ev = run.events
    if len(run.inflight):
        inf = run.inflight.copy()
        inf["t1_ns"] = np.maximum(inf["t0_ns"], end_ns[np.clip(inf["rank"], 0, len(end_ns) - 1)])
        ev = np.concatenate([ev, inf[~np.isin(inf["kind"], np.array([Kind.COLL, Kind.COLL_ASYNC], np.uint8))]])
    stats = ExportStats(window_s=window_s)

    def us(t_ns: np.ndarray) -> np.ndarray:
        return (np.asarray(t_ns, np.int64) - t0) / 1e3

    # -- choose what to write: window, then budget ----------------------------------
    ev_t1 = np.where(ev["t1_ns"] >= 0, ev["t1_ns"], ev["t0_ns"])
    m_t1 = np.where(colls.m_t1_ns >= 0, colls.m_t1_ns,
                    end_ns[np.clip(colls.m_rank, 0, len(end_ns) - 1)] if len(end_ns) else colls.m_t0_ns)  # fmt: skip
    keep_ev = (ev["kind"] != Kind.COLL) | (ev["seq"] < 0)  # matched collectives come from colls
    keep_ev &= ~((ev["kind"] == Kind.COLL_ASYNC) & (ev["seq"] >= 0))
    keep_m = np.ones(len(colls.m_rank), bool)
    gpu = run.gpu
    keep_g = np.ones(len(gpu), bool)
    if window_s is not None:
        big = np.iinfo(np.int64).max // 4  # an open end: beyond any timestamp
        w0 = t0 + int(window_s[0] * 1e9) if np.isfinite(window_s[0]) else -big
        w1 = t0 + int(window_s[1] * 1e9) if np.isfinite(window_s[1]) else big
        keep_ev &= (ev_t1 >= w0) & (ev["t0_ns"] <= w1)
        keep_m &= (m_t1 >= w0) & (colls.m_t0_ns <= w1)
        keep_g &= (gpu["t_ns"] >= w0) & (gpu["t_ns"] <= w1)
    n_before = int(keep_ev.sum() + keep_m.sum() + keep_g.sum())
    if max_events is not None and n_before > max_events:
        # Counters: thinned evenly to at most a tenth of the budget.
        gi = np.flatnonzero(keep_g)
        cap_g = max_events // 10
        if len(gi) > cap_g:
            keep_g[:] = False
            keep_g[gi[np.linspace(0, len(gi) - 1, cap_g).astype(np.int64)]] = True
        budget = max(0, max_events - int(keep_g.sum()))
        # Slices: the longest win; a collective counts its wait slice too.
        ei, mi = np.flatnonzero(keep_ev), np.flatnonzero(keep_m)
        dur = np.concatenate([(ev_t1 - ev["t0_ns"])[ei], (m_t1 - colls.m_t0_ns)[mi]]).astype(np.float64)
        cost = np.concatenate([np.ones(len(ei)), np.full(len(mi), 2.0)])
        order = np.argsort(-dur, kind="stable")
        fits = np.cumsum(cost[order]) <= budget
        chosen = order[fits]
        keep_ev[:] = False
        keep_m[:] = False
        keep_ev[ei[chosen[chosen < len(ei)]]] = True
        keep_m[mi[chosen[chosen >= len(ei)] - len(ei)]] = True

    b = _Builder()

    # -- collectives (matched) -------------------------------------------------------
    sel = np.flatnonzero(keep_m)
    if len(sel):
        g = colls.m_group[sel]
        rank = colls.m_rank[sel].astype(np.int64)
        a_ns = colls.m_t0_ns[sel]
        z_ns = m_t1[sel]
        is_async = colls.m_kind[sel] == Kind.COLL_ASYNC
        lane = np.where(is_async, LANE_ASYNC, LANE_COLL)
        pid = _pid(rank)
        tid = _tid(rank, np.zeros(len(sel), np.int64), lane)
        last = colls.g_last_ns[g]
        # Never completed (a member never came or never left): waiting until the record ends.
        never = (colls.g_state[g] == MatchState.IN_FLIGHT) | (colls.g_exit_ns[g] < 0)
        wait_ns = np.where(is_async, 0, np.where(never, z_ns - a_ns, np.maximum(0, np.minimum(last, z_ns) - a_ns)))
        state = np.asarray([s.name.lower() for s in MatchState], dtype=object)[colls.g_state[g].astype(np.int64)]
        in_flight = colls.m_t1_ns[sel] < 0
        args = {
            "comm": st[colls.g_comm[g]],
            "seq": colls.g_seq[g],
            "nbytes": colls.m_nbytes[sel],
            "root": colls.m_peer[sel],
            "state": np.where(in_flight, "in_flight", state),
            "wait_ms": wait_ns / 1e6,
            "last_rank": colls.g_last_rank[g],
            "site": st[colls.m_site[sel]],
        }
        base = _slice_base(st[colls.m_op[sel]], "collective", us(a_ns), (z_ns - a_ns) / 1e3, pid, tid)
        w = wait_ns > 0
        # The wait slice sits inside its collective on the same track: same start, shorter.
        wname = np.where(never[w], "wait (never completed)",
                         np.char.add("wait for rank ", colls.g_last_rank[g][w].astype(str))).astype(object)
        wbase = _slice_base(wname, "wait", us(a_ns[w]), wait_ns[w] / 1e3, pid[w], tid[w])
        frame = pd.concat([pd.DataFrame({**base, **{(_ARG0 + k if i == 0 else k): v for i, (k, v) in enumerate(args.items())}}),
                           pd.DataFrame({**wbase, **{(_ARG0 + k if i == 0 else k): np.asarray(v)[w]
                                                     for i, (k, v) in enumerate(args.items())}})],
                          ignore_index=True)  # fmt: skip
        b.frames.append(("collectives", frame, len(args)))
        stats.n_slices += len(frame)
        top = ~is_async
        r_u, r_n = np.unique(rank[top], return_counts=True)
        stats.collectives_per_rank = {int(r): int(n) for r, n in zip(r_u, r_n)}

    # -- every other event --------------------------------------------------------------
    e = ev[keep_ev]
    kind = e["kind"]
    rank = e["rank"].astype(np.int64)
    e_t1 = np.where(e["t1_ns"] >= 0, e["t1_ns"], e["t0_ns"])
    thread = e["tid"].astype(np.int64)
    kind_label = np.array([str(i) for i in range(256)], dtype=object)
    for k in Kind:  # the enum, not the events
        kind_label[int(k)] = k.name.lower().removeprefix("file_")

    def slices(mask: np.ndarray, lane: int, cat: str, name: np.ndarray, args: dict[str, np.ndarray]) -> None:
        if not mask.any():
            return
        base = _slice_base(name[mask], cat, us(e["t0_ns"][mask]), (e_t1[mask] - e["t0_ns"][mask]) / 1e3,
                           _pid(rank[mask]), _tid(rank[mask], thread[mask], lane))  # fmt: skip
        b.add(cat, base, {k: v[mask] for k, v in args.items()})
        stats.n_slices += int(mask.sum())

    names = st[e["name_id"]]
    labels = kind_label[kind.astype(np.int64)]
    sites = st[e["site_id"]]
    m_file = np.isin(kind, np.array(sorted(FILE_KINDS), np.uint8))
    slices(m_file, LANE_FILE, "file", labels,
           {"path": names, "fs": st[np.clip(e["aux"], 0, len(st) - 1)], "nbytes": e["nbytes"], "site": sites})
    m_phase = np.isin(kind, np.array(sorted(int(k) for k in PHASE_KINDS), np.uint8))
    phase_name = np.where((kind == Kind.PHASE) & (e["name_id"] > 0), names, labels)
    slices(m_phase, LANE_PHASE, "phase", phase_name, {"kind": labels, "nbytes": e["nbytes"], "site": sites})
    m_p2p = np.isin(kind, np.array(sorted(int(k) for k in P2P_KINDS), np.uint8))
    slices(m_p2p, LANE_P2P, "p2p", np.where(e["name_id"] > 0, names, labels),
           {"peer": e["peer"], "nbytes": e["nbytes"], "site": sites})  # fmt: skip
    m_coll_unmatched = np.isin(kind, np.array([Kind.COLL, Kind.COLL_ASYNC], np.uint8))
    slices(m_coll_unmatched, LANE_OTHER, "collective_unmatched", names, {"comm": st[e["comm_id"]], "site": sites})
    m_other = np.isin(kind, np.array([Kind.WAIT, Kind.COMM_CREATE, Kind.PROBE], np.uint8))
    slices(m_other, LANE_OTHER, "other", np.where(e["name_id"] > 0, names, labels),
           {"kind": labels, "peer": e["peer"], "nbytes": e["nbytes"], "site": sites})  # fmt: skip
    # Instants: steps and marks on the phases track, the shim's milestones on "other".
    for kinds, i_lane, cat in (((Kind.STEP, Kind.MARK), LANE_PHASE, "step"), ((Kind.SHIM, Kind.LOST), LANE_OTHER, "shim")):
        m = np.isin(kind, np.array(kinds, np.uint8))
        if not m.any():
            continue
        base = {"name": np.where(e["name_id"][m] > 0, names[m], labels[m]), "cat": cat, "ph": "i", "s": "t",
                "ts": us(e["t0_ns"][m]), "pid": _pid(rank[m]), "tid": _tid(rank[m], thread[m], i_lane)}  # fmt: skip
        b.add(cat, base, {"kind": labels[m], "samples": e["nbytes"][m], "aux": e["aux"][m], "value": e["value"][m]})
        stats.n_instants += int(m.sum())

    # -- GPU counters -------------------------------------------------------------------
    gs = gpu[keep_g]
    if len(gs):
        base = {"name": np.char.add("gpu ", gs["gpu"].astype(str)).astype(object), "ph": "C", "ts": us(gs["t_ns"]),
                "pid": _pid(gs["rank"])}  # fmt: skip
        b.add("gpu", base, {"sm_util_pct": gs["sm_util_pct"].astype(np.float64),
                            "mem_util_pct": gs["mem_util_pct"].astype(np.float64),
                            "power_w": gs["power_w"].astype(np.float64)})  # fmt: skip
        stats.n_counters = len(gs)

    stats.n_events = stats.n_slices + stats.n_instants + stats.n_counters
    stats.n_dropped = max(0, n_before - int(keep_ev.sum() + keep_m.sum() + keep_g.sum()))

    # -- metadata: names and order of the tracks ---------------------------------------------
    used_tids: set[int] = set()
    for _, df, _ in b.frames:  # a dozen frames
        if "tid" in df:
            used_tids.update(np.unique(df["tid"].to_numpy(np.int64)).tolist())
    meta: list[dict[str, Any]] = []
    for r in sorted(run.ranks):  # one per rank
        host = run.host_of(r)
        meta.append({"name": "process_name", "ph": "M", "pid": r + 1, "tid": 0,
                     "args": {"name": f"rank {r} ({host})" if host else f"rank {r}"}})  # fmt: skip
        meta.append({"name": "process_sort_index", "ph": "M", "pid": r + 1, "tid": 0, "args": {"sort_index": r}})
    for t in sorted(used_tids):  # per rank x lane x thread actually used
        t_lane = t % _N_LANES
        th = (t // _N_LANES) % _MAX_THREADS
        rank_ = t // (_N_LANES * _MAX_THREADS) - 1
        label = LANE_NAMES.get(t_lane, "track") + (f" (thread {th})" if th else "")
        meta.append({"name": "thread_name", "ph": "M", "pid": rank_ + 1, "tid": t, "args": {"name": label}})
        meta.append({"name": "thread_sort_index", "ph": "M", "pid": rank_ + 1, "tid": t,
                     "args": {"sort_index": th * _N_LANES + t_lane}})  # fmt: skip

    other = {
        "producer": "distdiag",
        "run_dir": str(run.path),
        "job_id": run.job_id,
        "ranks": int(run.world_size),
        "aligned_clocks": bool(run.aligned),
        "time_zero": "first shim start across ranks (aligned timeline)",
        "events": stats.n_events,
        "dropped_events": stats.n_dropped,
        # JSON has no Infinity: an open end is null
        "window_s": [float(w) if np.isfinite(w) else None for w in window_s] if window_s is not None else None,
        "max_events": max_events,
    }
    parts = ['{"displayTimeUnit":"ms","otherData":', json.dumps(other), ',"traceEvents":[\n']
    parts += [json.dumps(m) + ",\n" for m in meta]
    for _, df, n_args in b.frames:  # a dozen frames, each serialized in C
        if len(df):
            # Nesting on a track needs parents first: by (tid, ts, longest first).
            if "dur" in df:
                o = np.lexsort((-df["dur"].to_numpy(), df["ts"].to_numpy(), df["tid"].to_numpy()))
                df = df.iloc[o]
            parts.append(_frame_json(df, n_args))
    text = "".join(parts)
    text = text.rstrip().removesuffix(",") + "\n]}\n"
    return text, stats


def export_perfetto(report_or_run: Any, path: str | Path | IO[str], window_s: tuple[float, float] | None = None,
                    max_events: int | None = DEFAULT_MAX_EVENTS) -> ExportStats:  # fmt: skip
    """Write the trace of a Report (or ``distdiag.load`` frames, a Run, a run dir) to ``path``."""
    from distdiag.render.plots import as_report

    report = as_report(report_or_run)
    text, stats = build_trace(report, window_s=window_s, max_events=max_events)
    if hasattr(path, "write"):
        path.write(text)
        stats.path = getattr(path, "name", "")
    else:
        Path(path).write_text(text)
        stats.path = str(path)
    if stats.n_dropped:
        log.info("perfetto: %d events left out (max_events=%s, window=%s); %d written",
                    stats.n_dropped, max_events, window_s, stats.n_events)  # fmt: skip
    return stats


def parse_window(text: str) -> tuple[float, float]:
    """``"T0:T1"`` (seconds since the first rank started; either side may be empty) -> (t0, t1)."""
    a, sep, z = text.partition(":")
    if not sep:
        raise ValueError(f"--window wants T0:T1 in seconds, got {text!r}")
    try:
        lo = float(a) if a.strip() else 0.0
        hi = float(z) if z.strip() else float("inf")
    except ValueError:
        raise ValueError(f"--window wants T0:T1 in seconds, got {text!r}") from None
    if hi < lo:
        raise ValueError(f"--window {text!r}: the end is before the start")
    return lo, hi
