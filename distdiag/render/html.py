"""The HTML report: ONE self-contained file (``distdiag analyze RUN --format html -o report.html``).

Nothing is fetched to view it: the style is inline, every figure is a PNG
in a ``data:`` URI (drawn by :mod:`distdiag.render.plots` with matplotlib's
Agg backend), and there is no script at all. A Content-Security-Policy
meta tag says so to the browser (``default-src 'none'``), so even a
string that slipped past escaping could neither run nor load anything.

Every string that came from the job (paths, op names, phase names, host
names, communicator keys, summaries built from them, warnings) goes
through :func:`html.escape`; plots are rasters, so no job string reaches
the markup through a figure.

Layout: the verdict (what binds, what it costs, what to do, what binds
next), the ranked findings with their evidence, the figures (timeline,
wait heatmap, breakdown bars, link matrix, metadata ops/s, Slurm
timeline, GPU), the per-rank breakdown table, the per-step section
(stacked bars of each step's median over ranks, binned like the JSON's
``breakdown.per_step`` past 200 steps, and the slowest steps with the
rank that was slowest in each; one line when the run has no STEP rows),
the busiest paths, the Slurm record, warnings. A figure the run has no data for is listed as
not shown, with the reason.
"""

from __future__ import annotations

import base64
import html
import json
import logging
from typing import Any

import numpy as np

from distdiag.breakdown import COLUMNS, LABELS
from distdiag.ranking import unpriced_binding
from distdiag.render.fmt import fmt_s, short_list
from distdiag.schema import FILE_KINDS, Kind

log = logging.getLogger(__name__)

#: busiest paths listed in the report
MAX_PATHS = 25

_CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'"

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:0 auto;max-width:1180px;padding:16px 24px;color:#222}
h1{font-size:20px;margin:8px 0}h3{font-size:14px;margin:14px 0 4px}h2{font-size:16px;margin:28px 0 8px;border-bottom:1px solid #ddd;padding-bottom:4px}
.meta{color:#555}.verdict{border-left:6px solid #d1495b;background:#fdf1f2;padding:10px 14px;margin:12px 0}
.verdict.healthy{border-color:#4c9f70;background:#eff8f2}.verdict b.k{font-size:16px}
table{border-collapse:collapse;margin:6px 0;font-size:13px}td,th{border-bottom:1px solid #e5e5e5;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f6f6f6}td.n{text-align:right;font-variant-numeric:tabular-nums}
pre{background:#f7f7f7;padding:8px;overflow:auto;max-height:320px;font-size:12px;white-space:pre-wrap;word-break:break-all}
figure{margin:10px 0 22px}figure img{max-width:100%;height:auto;border:1px solid #eee}figcaption{color:#555;font-size:13px}
code,.path{font-family:ui-monospace,monospace;font-size:12px;word-break:break-all}.warn{color:#8a5a00}
"""


def e(x: Any) -> str:
    """Escape for HTML text and attribute values (quotes too)."""
    return html.escape(str(x), quote=True)


class HtmlRenderer:
    """``render(report) -> str``: the whole page, self-contained."""

    def __init__(self, dpi: int = 90, figures: bool = True, max_findings: int | None = None) -> None:
        self.dpi = dpi
        self.figures = figures
        self.max_findings = max_findings

    def render(self, report: Any) -> str:
        run = report.run
        title = f"distdiag report: job {run.job_id}" if run.job_id else "distdiag report"
        parts = [
            "<!DOCTYPE html>",
            '<html lang="en"><head><meta charset="utf-8">',
            f'<meta http-equiv="Content-Security-Policy" content="{_CSP}">',
            '<meta name="viewport" content="width=device-width, initial-scale=1">',
            f"<title>{e(title)}</title><style>{_CSS}</style></head><body>",
            f"<h1>{e(title)}</h1>",
            self._header(report),
            self._verdict(report),
            self._findings(report),
            self._figures(report),
            self._breakdown(report),
            self._steps(report),
            self._paths(report),
            self._slurm(report),
            self._warnings(report),
            "</body></html>",
        ]
        out = "\n".join(p for p in parts if p) + "\n"
        # a name that was not UTF-8 (decoded with surrogateescape) cannot be written as
        # UTF-8: its bytes are shown written out ("\udcff"), as the text report does
        return out.encode("utf-8", "backslashreplace").decode("utf-8")

    # -- sections -------------------------------------------------------------------
    def _header(self, report: Any) -> str:
        run = report.run
        present = len(run.ranks)
        ranks = f"{run.world_size} ranks" if present == run.world_size else f"{present} of {run.world_size} ranks"
        hosts = run.hosts
        return (
            f'<p class="meta">{e(ranks)} on {len(hosts)} host{"s" if len(hosts) != 1 else ""} '
            f"({e(short_list(hosts, 8))}), wall-clock {e(fmt_s(run.wall_s))}; run dir <span class=\"path\">{e(run.path)}</span></p>"
        )

    def _verdict(self, report: Any) -> str:
        f = report.verdict
        run = report.run
        if f is None:
            thr = report.config.min_fraction
            c = unpriced_binding(getattr(report, "coverage", None) or [])
            if c is not None:  # nothing priced, yet something other than compute holds the run
                share = f"{float(c['share']):.0%}"
                return (
                    f'<div class="verdict"><b class="k">No cause priced</b> &mdash; yet '
                    f"{e(LABELS.get(c['category'], c['category']))} holds {e(share)} of rank "
                    f"{e(c['rank'])}'s wall-clock ({e(fmt_s(c['seconds']))}), which no finding explains: "
                    f"{e(c['binds'])}.</div>"
                )
            return (
                '<div class="verdict healthy"><b class="k">Healthy.</b> No cause costs more than '
                f"{e(f'{thr:.0%}')} of the {e(fmt_s(run.wall_s))} wall-clock.</div>"
            )
        base = "turnaround, submit to end" if f.evidence.get("fraction_of") == "turnaround" else "wall-clock"
        out = [
            '<div class="verdict">',
            f'<b class="k">Verdict: {e(f.kind)}</b> &mdash; {e(f.summary)}<br>',
            f"<b>cost:</b> {e(fmt_s(f.cost_s))} = {e(f'{f.fraction:.0%}')} of the {e(base)} "
            "(what the job would save without it)<br>",
        ]
        s = f.evidence.get("serial_fraction")
        if f.kind == "serial_section" and s:
            s = float(s)
            out.append(f"<b>Amdahl:</b> {e(f'{s:.1%}')} of the run is serial: more ranks speed it up at most "
                       f"{e(f'{1 / s:.3g}')}&times;<br>")  # fmt: skip
        where = self._where(f)
        if where:
            out.append(f"<b>where:</b> {where}<br>")
        if f.advice:
            out.append(f"<b>what to do:</b> {e(f.advice)}<br>")
        nxt = self._then(report)
        if nxt:
            out.append(f"<b>then:</b> {nxt}")
        out.append("</div>")
        return "\n".join(out)

    @staticmethod
    def _where(f: Any) -> str:
        where = []
        if f.ranks:
            where.append("ranks " + e(short_list(f.ranks, 8)))
        if f.hosts:
            where.append("hosts " + e(short_list(f.hosts, 8)))
        if f.links:
            where.append("links " + e(short_list(["-".join(map(str, link)) for link in f.links], 8)))
        if f.paths:
            where.append("paths " + ", ".join(f'<span class="path">{e(p)}</span>' for p in f.paths[:5])
                         + (f", +{len(f.paths) - 5}" if len(f.paths) > 5 else ""))  # fmt: skip
        return "; ".join(where)

    @staticmethod
    def _then(report: Any) -> str:
        fs = report.findings
        if len(fs) < 2:
            return "nothing else is worth fixing: this is the whole win"
        try:
            from distdiag.ranking import outlook

            nxt = outlook(fs, float(report.run.wall_s), limit=2)[1]
            return (f"{e(nxt['kind'])} ({e(fmt_s(nxt['cost_s']))}, {e(format(nxt['share'], '.0%'))} of the "
                    f"{e(fmt_s(nxt['wall_s']))} left once this is fixed) &mdash; {e(fs[1].summary)}")  # fmt: skip
        except Exception:  # the outlook is a nicety; the findings table has it all
            log.debug("no outlook", exc_info=True)
            return f"{e(fs[1].kind)} &mdash; {e(fs[1].summary)}"

    def _findings(self, report: Any) -> str:
        fs = report.findings
        if not fs:
            return ""
        limit = self.max_findings or getattr(report.config, "max_findings", 20) or 20
        rows = []
        for i, f in enumerate(fs[:limit], 1):
            ev = json.dumps(_plain(f.evidence), indent=1, default=str, allow_nan=True)
            rows.append(
                f"<tr><td class=\"n\">{i}</td><td>{e(f.kind)}</td><td class=\"n\">{e(fmt_s(f.cost_s))}</td>"
                f"<td class=\"n\">{e(f'{f.fraction:.1%}')}</td><td>{self._where(f) or '-'}</td>"
                f"<td>{e(f.summary)}"
                + (f"<br><i>{e(f.advice)}</i>" if f.advice else "")
                + f"<details><summary>evidence</summary><pre>{e(ev)}</pre></details></td></tr>"
            )
        more = f"<p>&hellip; {len(fs) - limit} more (see --format json)</p>" if len(fs) > limit else ""
        return (
            "<h2>Findings</h2><p class=\"meta\">Ranked by the wall-clock each would save; each second counted once.</p>"
            "<table><tr><th>#</th><th>kind</th><th>cost</th><th>share</th><th>where</th><th>summary</th></tr>"
            + "".join(rows) + "</table>" + more
        )

    def _figures(self, report: Any) -> str:
        if not self.figures:
            return ""
        missing = _plots_missing()
        if missing:
            return f'<h2>Figures</h2><p class="warn">no figures: {missing}</p>'
        from distdiag.render.plots import PLOTS, NoData, figure_png
        out = ["<h2>Figures</h2>"]
        skipped = []
        for p in PLOTS:  # a handful of figures
            try:
                png = figure_png(p.fn, report, dpi=self.dpi)
            except NoData as why:
                skipped.append(f"{p.title} ({why})")
                continue
            except Exception as exc:  # one broken figure must not cost the report
                log.warning("figure %s failed: %s", p.name, exc, exc_info=log.isEnabledFor(logging.DEBUG))
                skipped.append(f"{p.title} (failed: {type(exc).__name__}: {exc})")
                continue
            b64 = base64.b64encode(png).decode("ascii")
            out.append(
                f'<figure id="fig-{e(p.name)}"><img alt="{e(p.title)}" src="data:image/png;base64,{b64}">'
                f"<figcaption><b>{e(p.title)}.</b> {e(p.caption)}</figcaption></figure>"
            )
        if skipped:
            out.append('<p class="meta">Not shown: ' + "; ".join(e(s) for s in skipped) + "</p>")
        return "\n".join(out)

    def _breakdown(self, report: Any) -> str:
        df = report.breakdown
        if len(df) == 0:
            return ""
        heads = ["rank", "host", "wall", "compute", "startup", "comm wait", "comm transfer", "I/O", "input wait", "H2D", "other"]
        cols = ["wall_s", *COLUMNS]
        arr = df[cols].to_numpy(dtype=float)
        rows = []
        for r, h, vals in zip(df["rank"].tolist(), df["host"].tolist(), arr):  # one per rank
            rows.append(f"<tr><td class=\"n\">{int(r)}</td><td>{e(h)}</td>"
                        + "".join(f'<td class="n">{v:.3f}</td>' for v in vals) + "</tr>")  # fmt: skip
        binds = "".join(f"<p>binds: {e(c['binds'])} ({e(LABELS.get(c['category'], c['category']))}: {c['share']:.0%} "
                        f"of rank {int(c['rank'])}'s wall-clock; no finding explains it)</p>"
                        for c in (getattr(report, "coverage", None) or []) if c.get("binds"))  # fmt: skip
        return ("<h2>Per-rank breakdown (seconds)</h2><table><tr>" + "".join(f"<th>{h}</th>" for h in heads)
                + "</tr>" + "".join(rows) + "</table>" + binds)  # fmt: skip

    def _steps(self, report: Any) -> str:
        """Per step: the stacked bars (binned like breakdown.per_step past 200 steps) and the slowest steps.

        Reads step_breakdown's table that the breakdown stage left in
        ``run.cache``; a run without STEP rows gets one line saying so.
        """
        from distdiag.render.plots import MAX_SLOW_STEPS, NO_STEPS, per_step_of, slowest_steps

        head = '<h2 id="per-step">Per step</h2>'
        agg = per_step_of(report)
        if len(agg) == 0:
            return f'{head}<p class="meta" id="no-steps">No per-step time: {e(NO_STEPS)}.</p>'
        med = agg["median_wall_s"].to_numpy(dtype=float)
        out = [head, f'<p class="meta">{len(agg)} steps; step time (median over ranks) median '
                     f"{e(fmt_s(np.median(med)))}, slowest {e(fmt_s(med.max()))}. Each step runs from one "
                     "optimizer step (or <code>distdiag.step()</code>) to the next; the JSON report has every "
                     "step.</p>"]  # fmt: skip
        out.append(self._steps_figure(report))
        slow = slowest_steps(report, MAX_SLOW_STEPS)
        rows = []
        for r in slow.itertuples(index=False):  # at most MAX_SLOW_STEPS
            rank = int(r.max_rank)
            rows.append(
                f'<tr><td class="n">{int(r.step)}</td><td class="n">+{float(r.t_s):.3f} s</td>'
                f'<td class="n">{int(r.ranks)}</td><td class="n">{e(fmt_s(r.median_wall_s))}</td>'
                f'<td class="n">{e(fmt_s(r.max_wall_s))}</td><td class="n">{rank}</td>'
                f"<td>{e(report.run.host_of(rank))}</td>"
                f"<td>{e(LABELS[str(r.top_col)])} {e(fmt_s(r.top_s))}</td></tr>"
            )
        out.append(
            f'<h3>Slowest {len(slow)} of {len(agg)} steps</h3><table id="slowest-steps"><tr><th>step</th>'
            "<th>start</th><th>ranks</th><th>median over ranks</th><th>max over ranks</th><th>slowest rank</th>"
            "<th>host</th><th>its largest part</th></tr>" + "".join(rows) + "</table>"
        )
        return "\n".join(p for p in out if p)

    def _steps_figure(self, report: Any) -> str:
        if not self.figures:
            return ""
        missing = _plots_missing()
        if missing:
            return f'<p class="warn">no figure: {missing}</p>'
        from distdiag.render.plots import NoData, figure_png, plot_steps, step_bars
        try:
            bars = step_bars(report)
            png = figure_png(plot_steps, report, dpi=self.dpi)
        except NoData:
            return ""
        except Exception as exc:  # a broken figure must not cost the report
            log.warning("figure steps failed: %s", exc, exc_info=log.isEnabledFor(logging.DEBUG))
            return f'<p class="meta">Per-step figure not shown (failed: {e(type(exc).__name__)}: {e(exc)})</p>'
        b64 = base64.b64encode(png).decode("ascii")
        per = (f"Each bar holds {bars.bin} consecutive steps ({len(bars.first)} bars): the means of their medians"
               if bars.bin > 1 else "Each bar is one step")  # fmt: skip
        return (
            f'<figure id="fig-steps"><img alt="Per-step breakdown" src="data:image/png;base64,{b64}">'
            f"<figcaption><b>Per-step breakdown.</b> {e(per)}; a part's height is its median over ranks, in the "
            "per-rank bars' colors. The dash is the slowest rank's step time.</figcaption></figure>"
        )

    def _paths(self, report: Any) -> str:
        run = report.run
        ev = run.events
        m = np.isin(ev["kind"], np.array(sorted(FILE_KINDS), np.uint8))
        if not m.any():
            return ""
        ids = ev["name_id"][m].astype(np.int64)
        dur = np.maximum(0, ev["t1_ns"][m] - ev["t0_ns"][m]) / 1e9
        opens = (ev["kind"][m] == Kind.FILE_OPEN).astype(np.int64)
        uniq, inv, counts = np.unique(ids, return_inverse=True, return_counts=True)
        tot_s = np.bincount(inv, weights=dur)
        n_open = np.bincount(inv, weights=opens)
        top = np.lexsort((-counts, -tot_s))[:MAX_PATHS]
        rows = [
            f'<tr><td class="path">{e(run.s(int(uniq[i])))}</td><td class="n">{int(counts[i])}</td>'
            f'<td class="n">{int(n_open[i])}</td><td class="n">{e(fmt_s(tot_s[i]))}</td></tr>'
            for i in top
        ]
        return (f"<h2>Busiest paths</h2><p class=\"meta\">{len(uniq)} paths, {int(m.sum())} file-system calls; "
                f"the {len(top)} with the most time in calls.</p>"
                "<table><tr><th>path</th><th>calls</th><th>opens</th><th>time in calls</th></tr>"
                + "".join(rows) + "</table>")  # fmt: skip

    def _slurm(self, report: Any) -> str:
        view = getattr(report, "slurm", None)
        if view is None:
            return ""
        if view.acct is None or not view.timeline:
            return f"<h2>Slurm</h2><p class=\"meta\">{e(view.why)}</p>"
        a = view.acct
        rows = "".join(
            f"<tr><td>{e(t['what'])}</td><td class=\"n\">+{float(t['t_s']):.1f} s</td>"
            f"<td>{e(short_list(t.get('ranks') or [], 8))}</td></tr>"
            for t in view.timeline
        )
        turn = f", turnaround {e(fmt_s(view.turnaround_s))}" if view.turnaround_s else ""
        return (f"<h2>Slurm</h2><p>job {e(a.job_id)} {e(a.state or '?')} on {e(a.nodes or '?')}{turn} "
                f"({e(view.origin)} accounting)</p><table><tr><th>instant</th><th>since submit</th><th>ranks</th></tr>"
                + rows + "</table>")  # fmt: skip

    def _warnings(self, report: Any) -> str:
        ws = report.run.warnings
        if not ws:
            return ""
        return f"<h2>Warnings ({len(ws)})</h2><ul>" + "".join(f'<li class="warn">{e(w)}</li>' for w in ws) + "</ul>"


def _plots_missing() -> str:
    """'' when the figures can be drawn, else why not (escaped HTML): matplotlib missing, the tables still tell the story.

    It imports matplotlib itself: distdiag.render.plots imports it only inside
    the functions that draw, so importing that module proves nothing (every
    figure then failed on its own, without the install hint).
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        return f"{e(exc)} (pip install 'distdiag[report]')"
    return ""


def _plain(x: Any) -> Any:
    """Evidence as plain JSON types (numpy scalars and arrays included)."""
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, np.ndarray):
        return _plain(x.tolist())
    if isinstance(x, np.generic):
        return x.item()
    return x
