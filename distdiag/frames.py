"""The pandas API: ``run = distdiag.load("run_dir/")`` for notebooks and scripts.

``load`` reads a run directory, aligns the clocks, matches the collectives and
runs every detector (the same pipeline as ``distdiag analyze``), then hands the
result out as pandas DataFrames, each built on first access and kept::

    run = distdiag.load("distdiag-1234/")
    run.findings        # one row per finding, ranked (the verdict first)
    run.breakdown       # one row per rank: where its wall-clock went (seconds)
    run.per_step        # one row per (rank, step): the same columns within each iteration
    run.collectives     # one row per (collective, member rank): arrival, exit, wait
    run.collective_groups  # one row per matched collective
    run.phases          # compute phases: distdiag.phase(...), forward/backward/optimizer, input wait, H2D
    run.files           # file-system calls: open, stat, listdir, read, write, close
    run.events          # every event, string columns decoded
    run.gpu             # NVML samples (empty without a GPU)
    run.ranks           # one row per rank: host, pid, start/end, exit code, lost events
    run.report          # the distdiag.pipeline.Report (what the renderers draw)

Times: ``*_ns`` columns are integers on the aligned timeline (rank 0's
monotonic clock); ``*_s`` columns are seconds since the run's first shim start
on that timeline (``t0_s``, ``t1_s``), or durations (``dur_s``, ``wait_s``).
String columns (``name``, ``comm``, ``site``, ``path``) are decoded from the
run's one string table. Strings come from the job: treat them as untrusted
text when you put them into HTML.

Nothing here computes a finding: the frames are views of the Report.
"""

from __future__ import annotations

import logging
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from distdiag.match import Collectives, MatchState
from distdiag.rows import events_of
from distdiag.run import Run
from distdiag.schema import FILE_KINDS, PHASE_KINDS, Kind

log = logging.getLogger(__name__)

__all__ = ["RunFrames", "load", "kind_names"]

#: kind value -> short lower-case name ("coll", "open", "phase", ...), for any u1 value
_KIND_NAME = np.array([str(i) for i in range(256)], dtype=object)
for _k in Kind:
    _KIND_NAME[int(_k)] = _k.name.lower().removeprefix("file_")
_STATE_NAME = np.array([s.name.lower() for s in MatchState], dtype=object)


def kind_names(kinds: np.ndarray) -> np.ndarray:
    """Vectorized ``Kind`` value -> short name (FILE_OPEN -> "open", COLL -> "coll")."""
    names: np.ndarray = _KIND_NAME[np.asarray(kinds, dtype=np.int64) & 0xFF]
    return names


def _decode(strings: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """One gather: string ids -> object array of str (ids out of range -> "")."""
    st = np.asarray(strings, dtype=object)
    ids = np.asarray(ids, dtype=np.int64)
    ok = (ids >= 0) & (ids < len(st))
    return np.where(ok, st[np.where(ok, ids, 0)], "")


class RunFrames:
    """A loaded, analyzed run, as DataFrames (see the module docstring).

    Build it with :func:`load`, or ``RunFrames(report)`` around a
    :class:`distdiag.pipeline.Report` you already have.
    """

    def __init__(self, report: Any) -> None:
        self.report = report

    def __repr__(self) -> str:
        r = self.run
        return (f"<distdiag run {str(r.path)!r}: {len(r.ranks)} ranks on {len(r.hosts)} hosts, "
                f"{r.wall_s:.3g} s, {len(self.report.findings)} findings>")  # fmt: skip

    # -- the objects underneath -------------------------------------------------------
    @property
    def run(self) -> Run:
        """The aligned :class:`distdiag.run.Run` (columnar numpy arrays)."""
        return self.report.run  # type: ignore[no-any-return]

    @property
    def colls(self) -> Collectives:
        """The matched collectives (columnar, :class:`distdiag.match.Collectives`)."""
        return self.report.collectives  # type: ignore[no-any-return]

    @property
    def t0_ns(self) -> int:
        """The instant the ``*_s`` columns count from: the first shim start (aligned timeline)."""
        return int(self.run.start_ns)

    @property
    def wall_s(self) -> float:
        return float(self.run.wall_s)

    @property
    def verdict(self) -> Any:
        """The top :class:`distdiag.findings.Finding`, or None for a healthy job."""
        return self.report.verdict

    def _secs(self, t_ns: np.ndarray) -> np.ndarray:
        return (np.asarray(t_ns, np.int64) - self.t0_ns) / 1e9

    def _hosts(self, ranks: np.ndarray) -> np.ndarray:
        r = self.run
        n = max(r.world_size, max(r.ranks, default=-1) + 1)
        table = np.full(n + 1, "", dtype=object)
        for rank, info in r.ranks.items():  # one per rank
            table[rank] = info.host
        ranks = np.asarray(ranks, np.int64)
        got: np.ndarray = table[np.clip(ranks, 0, n)]
        return got

    # -- frames -----------------------------------------------------------------------
    @cached_property
    def ranks(self) -> pd.DataFrame:
        """One row per rank with a readable file."""
        rows = []
        for r, i in sorted(self.run.ranks.items()):  # one per rank
            rows.append({"rank": r, "host": i.host, "local_rank": i.local_rank, "pid": i.pid,
                         "start_s": (i.start_ns - self.t0_ns) / 1e9, "end_s": (i.end_ns - self.t0_ns) / 1e9,
                         "dur_s": i.dur_s, "closed_cleanly": i.closed_cleanly, "exit_code": i.exit_code,
                         "n_events": i.n_events, "lost_events": i.lost_events})  # fmt: skip
        return pd.DataFrame(rows, columns=["rank", "host", "local_rank", "pid", "start_s", "end_s", "dur_s",
                                           "closed_cleanly", "exit_code", "n_events", "lost_events"])  # fmt: skip

    def _event_frame(self, ev: np.ndarray) -> pd.DataFrame:
        st = self.run.strings
        t1 = ev["t1_ns"]
        return pd.DataFrame(
            {
                "rank": ev["rank"].astype(np.int64),
                "host": self._hosts(ev["rank"]),
                "kind": kind_names(ev["kind"]),
                "name": _decode(st, ev["name_id"]),
                "t0_ns": ev["t0_ns"],
                "t1_ns": t1,
                "t0_s": self._secs(ev["t0_ns"]),
                "t1_s": np.where(t1 >= 0, self._secs(t1), np.nan),
                "dur_s": np.where(t1 >= 0, (t1 - ev["t0_ns"]) / 1e9, np.nan),
                "comm": _decode(st, ev["comm_id"]),
                "seq": ev["seq"],
                "peer": ev["peer"],
                "nbytes": ev["nbytes"],
                "aux": ev["aux"],
                "site": _decode(st, ev["site_id"]),
                "tid": ev["tid"],
                "value": ev["value"],
            }
        )

    @cached_property
    def events(self) -> pd.DataFrame:
        """Every recorded event (not the in-flight ones), sorted by (rank, t0_ns)."""
        return self._event_frame(self.run.events)

    @cached_property
    def inflight(self) -> pd.DataFrame:
        """Calls a rank was inside of when its record ends (t1 is NaN)."""
        return self._event_frame(self.run.inflight)

    @cached_property
    def phases(self) -> pd.DataFrame:
        """Compute phases; ``phase`` is the user's name for ``distdiag.phase``, else the kind
        (forward, backward, optimizer, input_wait, h2d)."""
        sel = events_of(self.run, PHASE_KINDS)  # the run's kind index (distdiag.rows)
        df = self._event_frame(sel)
        named = (sel["kind"] == Kind.PHASE) & (sel["name_id"] > 0)
        df.insert(2, "phase", np.where(named, df["name"].to_numpy(), df["kind"].to_numpy()))
        return df.drop(columns=["comm", "seq", "peer", "aux"])

    @cached_property
    def files(self) -> pd.DataFrame:
        """File-system calls: ``op`` (open, close, stat, listdir, read, write), ``path``, ``fs``
        ("fstype:mountpoint"), bytes moved, call site."""
        sel = events_of(self.run, FILE_KINDS)
        df = self._event_frame(sel)
        df = df.rename(columns={"kind": "op", "name": "path"})
        # File events keep their file system's string id in aux (see run._remap).
        df["fs"] = _decode(self.run.strings, sel["aux"])
        return df.drop(columns=["comm", "seq", "peer", "aux", "value"])

    @cached_property
    def collectives(self) -> pd.DataFrame:
        """One row per (matched collective, member rank), sorted by (collective, arrival).

        ``arrival_s``/``exit_s``: when this rank entered/left it; ``last_arrival_s``:
        when the last member arrived; ``wait_s``: this rank's time waiting for the
        others (last arrival - its arrival, 0 for the last one; for a collective
        that never completed, all its time inside until its record ends);
        ``transfer_s``: after the last arrival until it left. NaN exit: still
        inside at the end (``state`` says whether a member never came).
        """
        c = self.colls
        st = self.run.strings
        g = c.m_group
        t1 = c.m_t1_ns
        in_flight = t1 < 0
        last = c.g_last_ns[g]
        exit_s = np.where(in_flight, np.nan, self._secs(t1))
        # A collective that never completed (a member never came, or never left):
        # everyone inside waited until its record ends, as distdiag.breakdown counts it.
        end_ns = np.asarray(self.run.rank_bounds()[1], np.int64)
        never = (c.g_state[g] == MatchState.IN_FLIGHT) | (c.g_exit_ns[g] < 0)
        inside_to = np.where(in_flight, end_ns[np.clip(c.m_rank, 0, len(end_ns) - 1)] if len(end_ns) else t1, t1)
        wait_ns = np.where(never, np.maximum(0, inside_to - c.m_t0_ns),
                           np.maximum(0, np.minimum(last, inside_to) - c.m_t0_ns))  # fmt: skip
        return pd.DataFrame(
            {
                "group": g.astype(np.int64),  # m_group is int32 (the match kept compact); the frame keeps int64
                "comm": _decode(st, c.g_comm[g]),
                "seq": c.g_seq[g],
                "op": _decode(st, np.asarray(c.m_op)),
                "state": _STATE_NAME[c.g_state[g].astype(np.int64)] if len(g) else np.zeros(0, object),
                "rank": c.m_rank.astype(np.int64),
                "host": self._hosts(c.m_rank),
                "kind": kind_names(c.m_kind),
                "arrival_ns": c.m_t0_ns,
                "exit_ns": t1,
                "arrival_s": self._secs(c.m_t0_ns),
                "exit_s": exit_s,
                "last_arrival_s": self._secs(last),
                "wait_s": wait_ns / 1e9,
                "transfer_s": np.where(in_flight, np.nan, np.maximum(0, t1 - np.maximum(last, c.m_t0_ns)) / 1e9),
                "dur_s": np.where(in_flight, np.nan, (t1 - c.m_t0_ns) / 1e9),
                "last_rank": c.g_last_rank[g].astype(np.int64),
                "is_last": c.m_rank == c.g_last_rank[g],
                "nbytes": np.asarray(c.m_nbytes),  # the per-group columns, materialized: a frame holds them anyway
                "root": np.asarray(c.m_peer),
                "site": _decode(st, np.asarray(c.m_site)),
            }
        )

    @cached_property
    def collective_groups(self) -> pd.DataFrame:
        """One row per matched collective (communicator, seq): state, members, first/last arrival, exit."""
        c = self.colls
        st = self.run.strings
        ex = c.g_exit_ns
        return pd.DataFrame(
            {
                "comm": _decode(st, c.g_comm),
                "seq": c.g_seq,
                "op": _decode(st, c.g_op),
                "state": _STATE_NAME[c.g_state.astype(np.int64)] if len(c) else np.zeros(0, object),
                "n_members": c.g_n_members,
                "n_expected": c.g_n_expected,
                "first_arrival_s": self._secs(c.g_first_ns),
                "last_arrival_s": self._secs(c.g_last_ns),
                "exit_s": np.where(ex >= 0, self._secs(ex), np.nan),
                "spread_s": (c.g_last_ns - c.g_first_ns) / 1e9,
                "last_rank": c.g_last_rank.astype(np.int64),
            }
        )

    @cached_property
    def findings(self) -> pd.DataFrame:
        """The ranked findings, the verdict first; ``evidence`` holds each finding's dict."""
        cols = ["kind", "cost_s", "fraction", "ranks", "hosts", "links", "paths", "summary", "advice", "evidence"]
        return pd.DataFrame([{c: getattr(f, c) for c in cols} for f in self.report.findings], columns=cols)

    @property
    def breakdown(self) -> pd.DataFrame:
        """Per rank: wall_s and where it went (compute_s, comm_wait_s, ... see distdiag.breakdown)."""
        return self.report.breakdown

    @property
    def per_step(self) -> pd.DataFrame:
        """Per (rank, step): t_s, wall_s and the breakdown columns of that step (see distdiag.breakdown).

        ``distdiag.breakdown.per_step(frame)`` aggregates it per step (median and max over ranks).
        """
        from distdiag.breakdown import step_breakdown

        return step_breakdown(self.run, self.colls)

    @cached_property
    def gpu(self) -> pd.DataFrame:
        """NVML samples with ``t_s`` on the aligned timeline; empty when no sampler ran."""
        g = self.run.gpu
        df = pd.DataFrame(g)
        if "rank" in df:
            df.insert(0, "host", self._hosts(g["rank"]))
        df["t_s"] = self._secs(g["t_ns"])
        return df

    @property
    def warnings(self) -> list[str]:
        return list(self.run.warnings)

    def to_json(self) -> dict[str, Any]:
        """The stable JSON report (the same object as ``distdiag analyze --format json``)."""
        return self.report.to_json()  # type: ignore[no-any-return]


def load(run_dir: str | Path, config: str | Path | Any | None = None) -> RunFrames:
    """Load and analyze a run directory; see :class:`RunFrames` for the frames.

    ``config``: a TOML path (like ``--config``), a :class:`distdiag.config.Config`,
    or None for the defaults. Raises :class:`distdiag.errors.DistdiagError` when
    the directory holds nothing to analyze.
    """
    from distdiag.config import Config, load_config
    from distdiag.pipeline import analyze_run
    from distdiag.run import load_run

    cfg = config if isinstance(config, Config) else load_config(config)
    return RunFrames(analyze_run(load_run(run_dir), cfg))
