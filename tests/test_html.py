"""The HTML report in a real browser: headless Chromium (Debian's ``chromium``) over the DevTools protocol.

A real ``mpiexec -n 4 distdiag-wrap`` demo job (rank 2 sleeps before its
Allreduce) that also opens a file whose path holds ``<script>alert(1)</script>``
is analyzed with ``distdiag analyze --format html -o report.html``; Chromium
loads the file offline and we check, through the DevTools protocol on a pipe
(``--remote-debugging-pipe``: no port, no network):

* no console message, no uncaught exception, no log entry at warning/error
  level, no JavaScript dialog (an ``alert`` that ran would open one);
* the page is self-contained: no script element, nothing loaded from
  anywhere but ``data:`` URIs;
* every figure decoded (naturalWidth > 0) and the screenshot shows drawn
  pixels where each figure sits (not blank);
* the ``<script>`` path is on the page as text.

Two controls show that the checks can fail: a page that inserts the same
path unescaped opens the alert dialog in the same harness, and the pixel
check rejects a blank figure.
"""

from __future__ import annotations

import base64
import io
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import demo_args, run_wrapped_mpi

pytestmark = pytest.mark.mpi

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
XSS = "<script>alert(1)</script>"
ITERS = 20

# A path can hold "</script>" only across a directory: "<script>alert(1)<" / "script>".
JOB = f"""
import os, sys
d = os.path.join(sys.argv[1], "<script>alert(1)<")
os.makedirs(d, exist_ok=True)
for _ in range(40):  # busy enough to be among the busiest paths the report lists
    with open(os.path.join(d, "script>"), "w") as f:
        f.write("x" * 4096)
    os.stat(os.path.join(d, "script>"))
from distdiag import demo_job
sys.exit(demo_job.main(sys.argv[2:]))
"""


def run_job(tmp: Path) -> Path:
    return run_wrapped_mpi(tmp, JOB, demo_args(tmp, ITERS))


@pytest.fixture(scope="module")
def report_html(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("html")
    run_dir = run_job(tmp)
    out = tmp / "report.html"
    p = subprocess.run([sys.executable, "-m", "distdiag.cli", "analyze", str(run_dir), "--format", "html", "-o", str(out)],
                       capture_output=True, text=True, timeout=180)  # fmt: skip
    assert p.returncode == 0, p.stderr
    return out


# ----------------------------------------------------------------------------------
# a minimal DevTools-protocol client over --remote-debugging-pipe (fd 3: to Chromium, fd 4: from it)


class Browser:
    def __init__(self, profile: Path, timeout_s: float = 60.0) -> None:
        if CHROMIUM is None:
            pytest.fail("chromium not found: apt-get install chromium (listed in .ci/apt-packages.txt)")
        to_r, self._to_w = os.pipe()
        self._from_r, from_w = os.pipe()

        def fds() -> None:  # in the child: its fd 3 reads our commands, fd 4 carries its replies
            a, b = os.dup(to_r), os.dup(from_w)  # above 4 now: neither dup2 below clobbers the other
            os.dup2(a, 3)
            os.dup2(b, 4)

        args = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-extensions", "--hide-scrollbars", f"--user-data-dir={profile}",
                "--remote-debugging-pipe", "about:blank"]  # fmt: skip
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, preexec_fn=fds, pass_fds=(3, 4),
                                     start_new_session=True)  # fmt: skip
        os.close(to_r)
        os.close(from_w)
        self.deadline = time.monotonic() + timeout_s
        self._buf = b""
        self._id = 0
        self.events: list[dict[str, Any]] = []
        self.session: str | None = None

    def close(self) -> None:
        try:
            self.send("Browser.close", session=False, wait=False)
        except OSError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)  # our own Chromium and its children only
            self.proc.wait(timeout=10)
        os.close(self._to_w)
        os.close(self._from_r)

    def _read(self) -> dict[str, Any]:
        while b"\0" not in self._buf:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("chromium did not answer in time")
            r, _, _ = select.select([self._from_r], [], [], left)
            if r:
                chunk = os.read(self._from_r, 1 << 20)
                if not chunk:
                    raise EOFError("chromium closed the pipe")
                self._buf += chunk
        msg, _, self._buf = self._buf.partition(b"\0")
        return json.loads(msg)  # type: ignore[no-any-return]

    def send(self, method: str, params: dict[str, Any] | None = None, session: bool = True, wait: bool = True) -> Any:
        self._id += 1
        msg: dict[str, Any] = {"id": self._id, "method": method, "params": params or {}}
        if session and self.session:
            msg["sessionId"] = self.session
        os.write(self._to_w, json.dumps(msg).encode() + b"\0")
        if not wait:
            return None
        while True:
            m = self._read()
            if m.get("id") == self._id:
                if "error" in m:
                    raise RuntimeError(f"{method}: {m['error']}")
                return m.get("result", {})
            self._event(m)

    def _event(self, m: dict[str, Any]) -> None:
        if "method" not in m:
            return
        self.events.append(m)
        if m["method"] == "Page.javascriptDialogOpening":  # dismiss it, or the page blocks
            self.send("Page.handleJavaScriptDialog", {"accept": True}, wait=False)

    def open(self, url: str, width: int = 1280, height: int = 1000) -> None:
        target = self.send("Target.createTarget", {"url": "about:blank"}, session=False)["targetId"]
        self.session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True}, session=False)["sessionId"]
        for m in ("Page.enable", "Runtime.enable", "Log.enable"):
            self.send(m)
        self.send("Emulation.setDeviceMetricsOverride", {"width": width, "height": height, "deviceScaleFactor": 1,
                                                         "mobile": False})  # fmt: skip
        self.send("Page.navigate", {"url": url})
        while not any(e["method"] == "Page.loadEventFired" for e in self.events):
            self._event(self._read())

    def evaluate(self, expr: str) -> Any:
        r = self.send("Runtime.evaluate", {"expression": expr, "returnByValue": True})
        return r["result"].get("value")

    def screenshot(self) -> np.ndarray:
        """The whole page as an (h, w, channels) float array in [0, 1]."""
        from matplotlib.image import imread

        r = self.send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True})
        return np.asarray(imread(io.BytesIO(base64.b64decode(r["data"])), format="png"))

    def complaints(self) -> list[str]:
        """Console messages, uncaught exceptions, warning/error log entries, dialogs."""
        out = []
        for e in self.events:
            m, p = e["method"], e.get("params", {})
            if m == "Runtime.consoleAPICalled":
                out.append(f"console.{p.get('type')}: " + " ".join(str(a.get("value", a.get("description")))
                                                                   for a in p.get("args", [])))  # fmt: skip
            elif m == "Runtime.exceptionThrown":
                out.append("exception: " + json.dumps(p.get("exceptionDetails", {}))[:300])
            elif m == "Log.entryAdded" and p.get("entry", {}).get("level") in ("warning", "error"):
                out.append(f"log {p['entry']['level']}: {p['entry'].get('text')}")
            elif m == "Page.javascriptDialogOpening":
                out.append(f"dialog {p.get('type')}: {p.get('message')}")
        return out


PAGE_STATE = """JSON.stringify({
  scripts: document.querySelectorAll('script').length,
  text: document.body.innerText,
  external: [...document.querySelectorAll('[src],[href]')].map(e => e.getAttribute('src') || e.getAttribute('href'))
            .filter(u => !u.startsWith('data:') && !u.startsWith('#')),
  figures: [...document.querySelectorAll('figure img')].map(i => {
    const r = i.getBoundingClientRect();
    return {id: i.closest('figure').id, ok: i.complete && i.naturalWidth > 0,
            x: r.left + window.scrollX, y: r.top + window.scrollY, w: r.width, h: r.height};
  }),
  height: document.documentElement.scrollHeight,
})"""


def drawn(pixels: np.ndarray) -> bool:
    """A region shows a plot: a real share of non-white pixels and many distinct colours."""
    rgb = pixels[..., :3]
    if rgb.size == 0:
        return False
    ink = np.mean(np.any(rgb < 0.9, axis=-1))
    colours = len(np.unique((rgb * 255).astype(np.uint8).reshape(-1, 3), axis=0))
    return bool(ink > 0.03 and colours > 16)


def inspect(url: str, profile: Path) -> tuple[dict[str, Any], np.ndarray | None, list[str]]:
    b = Browser(profile)
    try:
        b.open(url)
        state = json.loads(b.evaluate(PAGE_STATE))
        # the whole page in one shot: make the viewport as tall as the document
        b.send("Emulation.setDeviceMetricsOverride", {"width": 1280, "height": int(state["height"]),
                                                      "deviceScaleFactor": 1, "mobile": False})  # fmt: skip
        shot = b.screenshot() if state["figures"] else None
        time.sleep(0.2)  # let late console messages arrive
        b.send("Runtime.evaluate", {"expression": "1"})
        return state, shot, b.complaints()
    finally:
        b.close()


# ----------------------------------------------------------------------------------


def test_report_opens_without_errors_and_shows_the_plots(report_html: Path, tmp_path: Path) -> None:
    html = report_html.read_text()
    assert "<script" not in html.lower()
    state, shot, complaints = inspect(report_html.as_uri(), tmp_path / "profile")
    assert complaints == []
    assert state["scripts"] == 0
    assert state["external"] == [], "the report must load nothing from outside the file"
    ids = {f["id"] for f in state["figures"]}
    # the demo has collectives and file events; it ran on one host outside Slurm
    assert {"fig-timeline", "fig-wait_heatmap", "fig-breakdown", "fig-metadata_rate"} <= ids
    assert "fig-link_matrix" not in ids and "fig-slurm_timeline" not in ids
    assert "Link matrix (no link measurements)" in state["text"]
    assert all(f["ok"] for f in state["figures"]), state["figures"]
    assert shot is not None
    for f in state["figures"]:  # a handful
        x, y, w, h = (int(round(f[k])) for k in ("x", "y", "w", "h"))
        assert w > 200 and h > 100, f
        assert drawn(shot[y : y + h, x : x + w]), f"figure {f['id']} is blank in the screenshot"
    # the verdict names the injected straggler
    assert "Verdict: straggler" in state["text"] and "rank 2" in state["text"]


def test_job_paths_are_text_not_markup(report_html: Path, tmp_path: Path) -> None:
    state, _, complaints = inspect(report_html.as_uri(), tmp_path / "profile")
    assert XSS in state["text"], "the <script> path must be shown, as text"
    assert state["scripts"] == 0
    assert not any(c.startswith("dialog") for c in complaints)
    html = report_html.read_text()
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html


def test_controls_the_harness_catches_an_unescaped_path_and_a_blank_figure(tmp_path: Path) -> None:
    bad = tmp_path / "bad.html"
    bad.write_text(f"<!DOCTYPE html><html><body><p>path: /tmp/{XSS}</p></body></html>")
    state, _, complaints = inspect(bad.as_uri(), tmp_path / "profile")
    assert state["scripts"] == 1
    assert any(c.startswith("dialog alert: 1") for c in complaints), complaints
    assert not drawn(np.ones((200, 300, 4)))
    noisy = np.random.default_rng(0).random((200, 300, 3))
    assert drawn(noisy)


def _png_drawn(png: bytes) -> bool:
    from matplotlib.image import imread

    return drawn(np.asarray(imread(io.BytesIO(png), format="png")))


def test_link_matrix_and_slurm_timeline_figures_when_the_run_has_them(tmp_path: Path) -> None:
    """A synthetic run (distdiag.synth: the real rank-file format) with a slow link between 4 hosts,
    plus a Slurm record whose strings are hostile: both figures are drawn, the strings escaped."""
    import re

    from distdiag.pipeline import analyze
    from distdiag.render.html import HtmlRenderer
    from distdiag.slurm import Accounting, SlurmView, timeline
    from distdiag.synth import synth

    synth(tmp_path / "run", ranks=16, events=1000, fault="slow_link", ranks_per_host=4)
    report = analyze(tmp_path / "run")
    assert report.verdict is not None and report.verdict.kind == "slow_link"
    evil = '<img src=x onerror="alert(2)">'
    acct = Accounting(job_id="77", name=evil, state="COMPLETED", submit_s=1000, eligible_s=1000, start_s=1030,
                      end_s=1100, nodes=evil)  # fmt: skip
    tl = timeline(acct, {0: 1031.0, 1: 1032.0}, {0: 1035.0, 1: 1036.0}, {0: 1099.0, 1: 1098.0}, 1100.0)
    report.slurm = SlurmView(acct=acct, why="", origin="stored", timeline=tl)
    page = HtmlRenderer().render(report)
    figs = dict(re.findall(r'<figure id="fig-([a-z_]+)"><img alt="[^"]*" src="data:image/png;base64,([A-Za-z0-9+/=]+)"',
                           page))  # fmt: skip
    assert {"timeline", "wait_heatmap", "breakdown", "link_matrix", "slurm_timeline"} <= set(figs)
    for name in ("link_matrix", "slurm_timeline"):
        assert _png_drawn(base64.b64decode(figs[name])), name
    assert evil not in page and html_escape(evil) in page
    assert "<img src=x" not in page


def html_escape(s: str) -> str:
    import html

    return html.escape(s, quote=True)


@pytest.mark.parametrize("fault, figure", [("straggler", "wait_heatmap"), ("slow_link", "link_matrix"),
                                           ("storm", "metadata_rate"), ("serial", "timeline"), ("skew", "breakdown"),
                                           ("none", "breakdown")])  # fmt: skip
def test_every_synthetic_fault_renders_a_self_contained_report(fault: str, figure: str, tmp_path: Path) -> None:
    """distdiag.synth writes real rank files for each fault: each report renders, names its verdict,
    draws the figure that shows it, and holds no script and no outside URL."""
    import re

    from distdiag.pipeline import analyze
    from distdiag.render.html import HtmlRenderer
    from distdiag.synth import synth

    synth(tmp_path / "run", ranks=16, events=800, fault=fault, ranks_per_host=4)
    report = analyze(tmp_path / "run")
    page = HtmlRenderer().render(report)
    assert "<script" not in page.lower()
    assert not re.search(r'(src|href)="(?!data:|#)', page)
    assert f'id="fig-{figure}"' in page
    if fault in ("none", "skew"):
        assert "Healthy." in page
    else:
        assert f"Verdict: {report.verdict.kind}" in page
