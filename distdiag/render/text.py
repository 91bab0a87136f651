"""The terminal report: the verdict first, then the ranked findings, the per-rank breakdown, warnings.

The first lines answer the user's question on their own: which cause binds,
what it costs (seconds and share of wall-clock), the evidence, what to do, and
what binds next once it is fixed (``distdiag.ranking.outlook``). A healthy job
says so plainly and shows where the time went instead.

Colour only when writing to a terminal: ``TextRenderer(color=None)`` asks
``sys.stdout.isatty()``, and ``NO_COLOR`` (https://no-color.org, any
non-empty value) or ``TERM=dumb`` turn it off; the CLI passes
``color=False`` when the report goes to a file. The progress bar while many
rank files load is :class:`distdiag.render.progress.ProgressBar` (stderr, a
terminal only).

Everything from the run dir is untrusted: the finished text has every
control character escaped (:func:`distdiag.render.fmt.escape_controls`), and
only then are the renderer's own colours put in, from markers that carry a
fresh random token each render, so text in a rank file cannot forge them.
"""

from __future__ import annotations

import collections
import os
import re
import secrets
import sys
from typing import TYPE_CHECKING, Any, TextIO

import numpy as np

from distdiag.breakdown import COLUMNS, LABELS, step_breakdown, step_summary
from distdiag.ranking import outlook, unpriced_binding
from distdiag.render.fmt import escape_controls, fmt_s, short_list

if TYPE_CHECKING:
    from distdiag.run import Run

#: a per-rank table longer than this shows the ranks the findings name plus min/median/max
MAX_RANK_ROWS = 16


def _fmt_val(v: Any) -> str:
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict):
        items = []
        for k, sub in list(v.items())[:3]:
            if isinstance(sub, dict):
                items.append(f"{k} (" + ", ".join(f"{a} {_fmt_val(b)}" for a, b in sub.items()) + ")")
            else:
                items.append(f"{k} {_fmt_val(sub)}")
        more = f", +{len(v) - 3} more" if len(v) > 3 else ""
        return "; ".join(items) + more
    if isinstance(v, (list, tuple)):
        more = f", +{len(v) - 3} more" if len(v) > 3 else ""
        if v and all(isinstance(x, dict) for x in v):  # records: one (k v, ...) each
            return "; ".join("(" + ", ".join(f"{a} {_fmt_val(b)}" for a, b in x.items()) + ")" for x in v[:3]) + more
        return ", ".join(_fmt_val(x) for x in v[:3]) + more
    return str(v)


def _evidence_lines(ev: dict[str, Any], indent: str) -> list[str]:
    scalars = [f"{k} {_fmt_val(v)}" for k, v in ev.items() if not isinstance(v, (dict, list, tuple))]
    out = []
    if scalars:
        out.append(indent + "evidence: " + ", ".join(scalars))
    for k, v in ev.items():
        if isinstance(v, (dict, list, tuple)) and len(v):
            out.append(indent + f"  {k}: {_fmt_val(v)}")
    return out


def use_color(stream: TextIO | None = None) -> bool:
    """Colour on ``stream`` (stdout): a TTY, NO_COLOR unset or empty, TERM not "dumb"."""
    stream = stream or sys.stdout
    if os.environ.get("NO_COLOR") or os.environ.get("TERM") == "dumb":
        return False
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # closed or replaced streams
        return False


#: ANSI styles by role; only used when colour is on
_STYLE = {"verdict": "1;31", "healthy": "1;32", "head": "1", "dim": "2", "cost": "1;33", "warn": "33"}


class TextRenderer:
    def __init__(self, max_findings: int | None = None, color: bool | None = None) -> None:
        self.max_findings = max_findings
        self._mark = ""
        #: None: decide from stdout (see use_color)
        self.color = use_color() if color is None else bool(color)

    def _c(self, role: str, text: str) -> str:
        if not self.color:
            return text
        return f"{self._mark}{_STYLE[role]}\ue001{text}{self._mark}0\ue001"

    def render(self, report: Any) -> str:
        # U+E000 is no control character: it survives the escaping, and the token makes
        # the marker one no rank file can hold.
        self._mark = "\ue000" + secrets.token_hex(8)
        text = escape_controls(self._render(report))
        if self.color:
            text = re.sub(re.escape(self._mark) + "([0-9;]*)\ue001", "\x1b[\\1m", text)
        return text

    def _render(self, report: Any) -> str:
        run = report.run
        lines: list[str] = []
        hosts = run.hosts
        host_txt = f"{len(hosts)} host{'s' if len(hosts) != 1 else ''}" + (
            f" ({', '.join(hosts[:4])}{', ...' if len(hosts) > 4 else ''})" if hosts else ""
        )
        job = f"job {run.job_id}, " if run.job_id else ""
        present = len(run.ranks)
        ranks_txt = f"{run.world_size} ranks" if present == run.world_size else f"{present} of {run.world_size} ranks"
        lines.append(f"distdiag: {job}{ranks_txt} on {host_txt}, wall-clock {fmt_s(run.wall_s)}  [{run.path}]")
        if getattr(run, "source", "distdiag") == "kineto":
            lines.append(_kineto_line(run))
        cap = _capture_line(run)
        if cap:
            lines.append(cap)
        lines.append("")
        lines += self._verdict(report)
        lines += _coverage_lines(report)
        lines.append("")
        if report.findings:
            lines += self._findings(report)
            lines.append("")
        slurm = _slurm_lines(getattr(report, "slurm", None))
        if slurm:
            lines += slurm + [""]
        lines += self._breakdown(report)
        from distdiag.gpu_timeline import gpu_text  # GPU-timed runs only (CUDA events)

        gpu = gpu_text(run, getattr(report, "config", None))
        if gpu:
            lines += [""] + gpu
        kids = _children_lines(getattr(report, "children", None) or {})
        if kids:
            lines += [""] + [self._c("head", kids[0])] + kids[1:]
        if run.warnings:
            lines.append("")
            lines.append(self._c("warn", f"WARNINGS ({len(run.warnings)})"))
            lines += [f"  - {w}" for w in run.warnings]
        # every entry is one line of ours: a newline inside one came from the run dir (a
        # name in a string table, a host) and would let it forge a line ("VERDICT: healthy")
        return "\n".join(ln.replace("\n", "\\x0a") for ln in lines) + "\n"

    # -- sections -------------------------------------------------------------------
    def _verdict(self, report: Any) -> list[str]:
        f = report.verdict
        run = report.run
        if f is None:
            thr = report.config.min_fraction
            c = unpriced_binding(getattr(report, "coverage", None) or [])
            if c is None:
                out = [
                    self._c("healthy", "VERDICT: healthy.")
                    + f" No cause costs more than {thr:.0%} of the {fmt_s(run.wall_s)} wall-clock "
                    "(no straggler, no serial section, no I/O, input or link bottleneck found)."
                ]
            else:  # nothing priced, yet something other than compute holds the run: not "healthy"
                out = [
                    self._c("verdict", "VERDICT: no cause priced")
                    + f" -- yet {LABELS.get(c['category'], c['category'])} holds {c['share']:.0%} of rank "
                    f"{c['rank']}'s wall-clock ({fmt_s(c['seconds'])}), which no finding explains (see binds below)"
                ]
            out.append("  time went to: " + self._shares(report))
            return out
        out = [self._c("verdict", f"VERDICT: {f.kind}") + f" -- {f.summary}"]
        base = "turnaround, submit to end" if f.evidence.get("fraction_of") == "turnaround" else "wall-clock"
        out.append(
            "  cost: " + self._c("cost", f"{fmt_s(f.cost_s)} = {f.fraction:.0%} of the {base}")
            + " (what the job would save without it)"
        )
        rp = f.evidence.get("replay")
        if isinstance(rp, dict):
            out.append("  " + _replay_line(rp))
        tog = [g.evidence["replay"] for g in report.findings
               if isinstance(g.evidence.get("replay"), dict) and g.evidence["replay"].get("together_s") is not None]  # fmt: skip
        if len(tog) > 1:
            out.append(f"  replayed together: the {len(tog)} causes replayed, removed at once, end the run "
                       f"{fmt_s(max(float(t['together_s']) for t in tog))} sooner (each second counted once)")  # fmt: skip
        if f.kind == "serial_section" and f.evidence.get("serial_fraction"):
            s = float(f.evidence["serial_fraction"])
            out.append(
                f"  Amdahl: {s:.1%} of the run is serial, which caps any speed-up from more ranks at {1 / s:.3g}x "
                "(5% serial caps you at 20x)"
            )
        where = []
        if f.ranks:
            where.append(f"ranks {short_list(f.ranks, 6, ',')}")
        if f.hosts:
            where.append(f"hosts {short_list(f.hosts, 6, ',')}")
        if f.links:
            where.append("links " + short_list(["-".join(map(str, link)) for link in f.links], 6, ","))
        if f.paths:
            where.append(f"paths {short_list(f.paths, 6, ',')}")
        if where:
            out.append("  where: " + "; ".join(where))
        ev = {k: v for k, v in f.evidence.items() if k not in _EVIDENCE_SHOWN_ELSEWHERE}
        # the scalars and the first few tables: the verdict stays one screen (JSON has it all)
        ev_lines = _evidence_lines(ev, "  ")
        nested = [line for line in ev_lines if line.startswith("    ")]
        out += [line for line in ev_lines if not line.startswith("    ")]
        inc = f.evidence.get("includes")
        if inc:
            out.append("  also seen as: " + "; ".join(f"{k} ({fmt_s(float(v))})" for k, v in inc.items())
                       + " -- the same seconds, counted here")  # fmt: skip
        dd = f.evidence.get("deduplicated")
        if dd:
            out.append(
                f"  counted once: {fmt_s(float(dd['cost_before_s']) - float(f.cost_s))} of its "
                f"{fmt_s(float(dd['cost_before_s']))} belong to " + ", ".join(dd["explained_by"])
            )
        if f.advice:
            out.append(f"  what to do: {f.advice}")
        out.append("  " + _then_line(report))
        if nested:
            out.append(self._c("dim", "  details:"))
            out += [self._c("dim", line) for line in nested[:MAX_EVIDENCE_TABLES]]
        return out

    def _shares(self, report: Any) -> str:
        df = report.breakdown
        if len(df) == 0:
            return "no rank recorded any time"
        tot = {c: float(df[c].sum()) for c in COLUMNS}
        wall = float(df["wall_s"].sum()) or 1.0
        parts = [f"{LABELS[c]} {v / wall:.0%}" for c, v in sorted(tot.items(), key=lambda kv: -kv[1]) if v / wall >= 0.005]
        return ", ".join(parts) + " (of all ranks' time)"

    def _findings(self, report: Any) -> list[str]:
        limit = self.max_findings or report.config.max_findings
        fs = report.findings[:limit]
        out = [self._c("head", "FINDINGS (ranked by the wall-clock each would save; each second counted once)")]
        # "then": the finding's share of the shorter run left once the ones above it are fixed
        out.append(f"  {'#':>2}  {'kind':<20} {'cost':>9} {'share':>6} {'then':>6}  {'ranks':<10} summary")
        then = outlook(fs, float(report.run.wall_s), limit=len(fs))
        for i, (f, o) in enumerate(zip(fs, then), 1):
            out.append(
                f"  {i:>2}  {f.kind:<20} {fmt_s(f.cost_s):>9} {f.fraction:>6.1%} {o['share']:>6.1%}  "
                f"{short_list(f.ranks, 6, ','):<10} {f.summary}"
            )
        if len(report.findings) > limit:
            out.append(f"  ... {len(report.findings) - limit} more (see --format json)")
        return out

    def _breakdown(self, report: Any) -> list[str]:
        df = report.breakdown
        out = [self._c("head", "PER-RANK BREAKDOWN (seconds)")]
        cols = ["wall_s", *COLUMNS]
        heads = ["wall", "compute", "startup", "comm_wait", "comm_xfer", "io", "input_wait", "h2d", "other"]
        out.append(f"  {'rank':>6} {'host':<12} " + " ".join(f"{h:>10}" for h in heads))
        if len(df) == 0:
            out.append("  (no rank)")
            return out

        def row(label: str, host: str, vals: Any) -> str:
            return f"  {label:>6} {host[:12]:<12} " + " ".join(f"{float(v):>10.3f}" for v in vals)

        if len(df) <= MAX_RANK_ROWS:
            for r in df.itertuples(index=False):
                out.append(row(str(r.rank), str(r.host), [getattr(r, c) for c in cols]))
            return out + self._steps(report)
        named = sorted({int(x) for f in report.findings for x in f.ranks})
        sub = df[df["rank"].isin(named)].head(MAX_RANK_ROWS)
        for r in sub.itertuples(index=False):
            out.append(row(str(r.rank), str(r.host), [getattr(r, c) for c in cols]))
        arr = df[cols].to_numpy()
        for label, vals in (("min", arr.min(axis=0)), ("median", np.median(arr, axis=0)), ("max", arr.max(axis=0))):
            out.append(row(label, f"({len(df)} ranks)", vals))
        return out + self._steps(report)

    def _steps(self, report: Any) -> list[str]:
        """One line: the median step and where step time went (breakdown.per_step in the JSON has each step)."""
        colls = getattr(report, "collectives", None)
        s = step_summary(step_breakdown(report.run, colls))
        if not s["steps"]:
            return []
        t = s["step_s"]
        share = s["share"]
        parts = [f"{LABELS[c]} {share[c]:.0%}" for c in sorted(COLUMNS, key=lambda c: -share[c]) if share[c] >= 0.005]
        hidden = share["comm_overlapped_s"]
        tail = f"; async collectives hidden behind compute {hidden:.0%}" if hidden >= 0.005 else ""
        return [f"  steps: {s['steps']}, median {fmt_s(t['median'])} (slowest rank's {fmt_s(t['max_rank_median'])}): "
                + ", ".join(parts) + tail]


#: evidence keys the verdict shows in their own words
_EVIDENCE_SHOWN_ELSEWHERE = frozenset({"deduplicated", "serial_fraction", "amdahl_speedup_cap", "fraction_of",
                                       "includes", "first_windows", "next_once_fixed", "lead_rank", "replay"})
#: evidence tables (dicts, lists) the verdict shows under its scalars
MAX_EVIDENCE_TABLES = 3


def _replay_line(rp: dict[str, Any]) -> str:
    """The replay's check of the cost: the run replayed with the cause removed (distdiag.replay)."""
    what = str(rp.get("counterfactual", ""))
    if rp.get("saving_s") is None:
        return f"replayed: not priced ({rp.get('why_not', '')}); counterfactual: {what}"
    return f"replayed: the run ends {fmt_s(float(rp['saving_s']))} sooner with {what}"


def _coverage_lines(report: Any) -> list[str]:
    """Never silent: each category above 10% of a rank's wall-clock that no finding explains, and what binds."""
    out = []
    for c in getattr(report, "coverage", None) or []:  # at most eight
        if c.get("binds"):
            out.append(f"  binds: {c['binds']} ({LABELS.get(c['category'], c['category'])}: {c['share']:.0%} of rank "
                       f"{c['rank']}'s wall-clock, {fmt_s(c['seconds'])}; no finding explains it)")  # fmt: skip
    return out


def _then_line(report: Any) -> str:
    """What binds once the verdict is fixed, or that nothing else is worth fixing."""
    fs = report.findings
    wall = float(report.run.wall_s)
    if len(fs) < 2:
        thr = report.config.min_fraction
        return f"then: nothing else costs more than {thr:.0%} of the wall-clock; fixing this is the whole win"
    nxt = outlook(fs, wall, limit=2)[1]
    return (
        f"then: {nxt['kind']} ({fmt_s(nxt['cost_s'])}, {nxt['share']:.0%} of the {fmt_s(nxt['wall_s'])} "
        f"left once this is fixed) -- {fs[1].summary}"
    )


def _children_lines(children: dict[int, Any], top: int = 8) -> list[str]:
    """The ranks' forked children's file I/O (distdiag.children): one line per rank (the
    busiest first), then each one's most costly file system and file."""
    if not children:
        return []
    out = ["CHILD PROCESSES (forked from the ranks: DataLoader workers, ...; their time is not the ranks')"]
    ranked = sorted(children.values(), key=lambda c: -c.io_s)
    for c in ranked[:top]:  # a handful of lines
        roles = ", ".join(f"{n} {r}" for r, n in sorted(c.roles.items()))
        out.append(f"  rank {c.rank}: {roles}: {c.calls} file calls in {fmt_s(c.io_s)} ({c.metadata_calls} metadata "
                   f"in {fmt_s(c.metadata_s)}), {c.bytes_read / 1e6:.1f} MB read")  # fmt: skip
        if c.by_fs:
            fs, (n, secs, _b) = max(c.by_fs.items(), key=lambda kv: kv[1][1])
            avg_ms = 1e3 * secs / max(n, 1)
            out.append(f"      mostly on {fs}: {int(n)} calls, {avg_ms:.3g} ms each")
        if c.top_files:
            p, n, secs, _b = c.top_files[0]
            out.append(f"      costliest file: {p} ({n} calls, {fmt_s(secs)})")
    if len(ranked) > top:
        out.append(f"  ... and {len(ranked) - top} more ranks with children")
    return out


def _slurm_lines(view: Any) -> list[str]:
    """The Slurm line under the header: the job's timeline, or why there is none."""
    if view is None:
        return []
    if view.acct is None or not view.timeline:
        return [f"slurm: {view.why}"]
    a = view.acct
    steps = "  ".join(f"{t['what']} +{t['t_s']:.1f}s" for t in view.timeline if not t["what"].startswith("step "))
    turn = f", turnaround {fmt_s(view.turnaround_s)}" if view.turnaround_s else ""
    return [f"slurm: job {a.job_id} {a.state or '?'} on {a.nodes or '?'}{turn} ({view.origin} accounting)",
            f"  timeline: {steps}"]  # fmt: skip


#: the rank files' ``fileio_capture`` values, as the header says them
_CAPTURES = {"preload": "libc interposer", "python": "Python-level hooks (no calls made from C)", "off": "off"}


def _capture_line(run: Run) -> str:
    """Which capture recorded the file calls (the ``fileio_capture`` attribute), or "" for
    files that do not say (older ones, Kineto traces)."""
    caps = collections.Counter(getattr(r, "fileio_capture", "") for r in run.ranks.values())
    caps.pop("", None)
    if not caps:
        return ""
    parts = [f"{_CAPTURES.get(c, c)}" + (f" ({n} ranks)" if len(caps) > 1 else "") for c, n in sorted(caps.items())]
    return "file I/O capture: " + ", ".join(parts)


def _kineto_line(run: Run) -> str:
    """The header line of a run read from PyTorch profiler traces: what was read, how the clocks were aligned."""
    from distdiag.pipeline import input_json

    inp = input_json(run)
    b = inp["clock_bound_ms"]
    bound = "some ranks could not be aligned" if b is None else f"good to +-{b:.3g} ms"
    return (f"input: {inp['files']} PyTorch profiler (Kineto) traces, no clock-sync samples: clocks aligned from "
            f"the matched collectives ({bound})")  # fmt: skip
