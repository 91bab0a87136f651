"""The HTML report's "Per step" section: stacked bars per step and the slowest steps.

The main case is a real 2-rank DDP job on gloo (``tests/jobs/torch_ddp.py``
under ``torchrun -m distdiag.wrap``) in which rank 1 really sleeps
``SLEEP_S`` inside its optimizer step of step ``SLOW_STEP``: a global
optimizer step pre-hook, registered by a few lines that then run the job
script unchanged (``runpy``). That step is rank 1's slowest, and rank 0 pays
the same time in the next step, waiting in its bucket all-reduces for rank 1.

Many steps (binning) and a run without steps use rank files written through
the shim's writer (``factories.write_rank``) and ``distdiag.synth``.
"""

from __future__ import annotations

import base64
import html
import io
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from distdiag.breakdown import COLUMNS, LABELS, per_step_json, step_breakdown
from distdiag.pipeline import Report, analyze
from distdiag.render import plots
from distdiag.render.html import HtmlRenderer
from distdiag.schema import EVENT_DTYPE, Kind
from factories import MS, write_rank

STEPS = 10
SLOW_RANK, SLOW_STEP, SLEEP_S = 1, 4, 0.5

INJECT = """
import os, runpy, sys, time
import torch  # the shim's optimizer hooks register on this import, before the one below
from torch.optim.optimizer import register_optimizer_step_pre_hook

calls = [0]

def slow_step(opt, args, kwargs):
    if int(os.environ["RANK"]) == {rank} and calls[0] == {step}:
        time.sleep({sleep_s})
    calls[0] += 1

register_optimizer_step_pre_hook(slow_step)
sys.argv[0] = {job!r}
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.fixture(scope="module")
def ddp(tmp_path_factory: pytest.TempPathFactory) -> Report:
    pytest.importorskip("torch")
    import test_torch_ddp

    tmp = tmp_path_factory.mktemp("html_steps")
    script = tmp / "slow_step.py"
    script.write_text(INJECT.format(rank=SLOW_RANK, step=SLOW_STEP, sleep_s=SLEEP_S, job=str(test_torch_ddp.JOB)))
    with pytest.MonkeyPatch.context() as mp:  # the same launcher, our script in front of the same job
        mp.setattr(test_torch_ddp, "JOB", script)
        out = test_torch_ddp.torchrun(tmp, ["--steps", str(STEPS), "--batch", "8"], nproc=2)
    assert sorted(out) == [0, 1] and all(len(o["losses"]) == STEPS for o in out.values())
    return analyze(tmp / "run")


def _slowest_rows(page: str) -> list[list[str]]:
    """The cells of the slowest-steps table, as text, row by row."""
    m = re.search(r'<table id="slowest-steps">(.*?)</table>', page, re.S)
    assert m, "no slowest-steps table"
    rows = re.findall(r"<tr>(.*?)</tr>", m.group(1), re.S)[1:]
    return [re.findall(r"<td[^>]*>(.*?)</td>", r, re.S) for r in rows]


def _parts(ax: Any) -> list[Any]:
    """The stacked parts of plot_steps: one collection of bars per breakdown column."""
    return [c for c in ax.collections if str(c.get_gid()).startswith("steps-")]


def _bars(ax: Any) -> list[int]:
    return [len(c.get_paths()) for c in _parts(ax)]


@pytest.mark.torch
def test_ddp_section_has_one_bar_per_step_and_names_the_rank_that_slept(ddp: Report) -> None:
    page = HtmlRenderer().render(ddp)
    assert '<h2 id="per-step">Per step</h2>' in page and 'id="no-steps"' not in page
    assert f"{STEPS} steps; step time" in page
    m = re.search(r'<figure id="fig-steps"><img alt="[^"]*" src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert m and "Each bar is one step" in page
    from matplotlib.image import imread
    from test_html import drawn  # the browser test's pixel check

    assert drawn(np.asarray(imread(io.BytesIO(base64.b64decode(m.group(1))), format="png")))
    # one stacked bar per step: seven parts, in the per-rank figure's labels and colors
    ax = plots.plot_steps(ddp)
    assert _bars(ax) == [STEPS] * len(COLUMNS)
    ref = plots.plot_breakdown(ddp)
    labels = [LABELS[c] for c in COLUMNS]
    assert [c.get_label() for c in _parts(ax)] == [c.get_label() for c in ref.containers] == labels
    assert [tuple(c.get_facecolor()[0]) for c in _parts(ax)] == [c[0].get_facecolor() for c in ref.containers]

    rows = _slowest_rows(page)
    assert len(rows) == STEPS
    by_step = {int(r[0]): r for r in rows}
    # the two slowest: the step rank 1 slept in, and the next one, where rank 0 waited for it.
    # Step 0 may rank above them: DDP's first step builds its buckets and warms up (0.6 s of
    # it seen beside a busy core, against ~0.25 s a step after); every other step ranks below.
    order = [int(r[0]) for r in rows if int(r[0]) != 0]
    assert set(order[:2]) == {SLOW_STEP, SLOW_STEP + 1}, rows[:3]
    slept = by_step[SLOW_STEP]
    assert int(slept[5]) == SLOW_RANK and slept[7].startswith("compute "), slept
    waited = by_step[SLOW_STEP + 1]
    assert int(waited[5]) == 1 - SLOW_RANK and waited[7].startswith("waiting in collectives "), waited
    # the numbers are the step table's: the max is rank 1's step, at least the sleep
    steps = step_breakdown(ddp.run, ddp.collectives)
    one = steps[(steps["step"] == SLOW_STEP)].set_index("rank")["wall_s"]
    slow = plots.slowest_steps(ddp).set_index("step")
    assert slow.loc[SLOW_STEP, "max_wall_s"] == one[SLOW_RANK] >= SLEEP_S
    assert slow.loc[SLOW_STEP, "median_wall_s"] == pytest.approx(one.median(), rel=1e-12)
    assert slow.loc[SLOW_STEP, "top_s"] >= SLEEP_S
    # every other step is far shorter than the sleep (but step 0, DDP's warm-up: 0.77 s seen beside a busy core)
    assert (slow.drop([0, SLOW_STEP, SLOW_STEP + 1])["max_wall_s"] < SLEEP_S / 2).all(), slow


@pytest.mark.torch
def test_ddp_bars_bin_like_the_json_per_step(ddp: Report) -> None:
    """With fewer bars than steps, a bar holds consecutive steps: the JSON's rows, value for value."""
    steps = step_breakdown(ddp.run, ddp.collectives)
    for max_bars in (4, 3, 1):
        js = per_step_json(steps, max_rows=max_bars)
        bars = plots.step_bars(ddp, max_bars)
        assert bars.bin == js["bin"] > 1
        assert _bars(plots.plot_steps(ddp, max_bars=max_bars)) == [len(js["rows"])] * len(COLUMNS)
        assert bars.first.tolist() == [r["step"] for r in js["rows"]]
        assert bars.count.tolist() == [r["steps"] for r in js["rows"]]
        for c in COLUMNS:
            np.testing.assert_allclose(bars.median_s[c], [r["median"][c] for r in js["rows"]], rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(bars.max_wall_s, [r["max"]["wall_s"] for r in js["rows"]], rtol=1e-12)


@pytest.mark.torch
def test_rendering_reads_the_cached_step_table(ddp: Report, monkeypatch: pytest.MonkeyPatch) -> None:
    """The breakdown stage left the step table in run.cache.step_breakdown; the section must not compute it again."""
    import distdiag.breakdown

    cached = ddp.run.cache.step_breakdown

    def boom(*a: Any, **k: Any) -> None:
        raise AssertionError("the step table was recomputed")

    monkeypatch.setattr(distdiag.breakdown, "_compute", boom)
    page = HtmlRenderer().render(ddp)
    assert 'id="fig-steps"' in page
    assert ddp.run.cache.step_breakdown is cached


def _many_steps(run_dir: Path, n_steps: int, ranks: int = 2) -> None:
    """``n_steps`` steps of 10 ms per rank: 2 ms of loader wait, then compute, then the optimizer's STEP row."""
    for r in range(ranks):
        ev = np.zeros(2 * n_steps, EVENT_DTYPE)
        t = np.arange(n_steps, dtype=np.int64) * 10 * MS
        ev["t0_ns"][0::2], ev["t1_ns"][0::2], ev["kind"][0::2] = t, t + 2 * MS, int(Kind.INPUT_WAIT)
        ev["t0_ns"][1::2] = ev["t1_ns"][1::2] = t + 10 * MS
        ev["kind"][1::2] = int(Kind.STEP)
        ev["name_id"][1::2] = 1
        ev["seq"] = ev["peer"] = -1
        write_rank(run_dir, r, ranks, ev.tolist(), ["", "optimizer_step"], end_mono_ns=(n_steps * 10 + 5) * MS)


def test_a_long_run_draws_at_most_max_bars_and_stays_small(tmp_path: Path) -> None:
    n = 4_000  # 20 steps a bar
    _many_steps(tmp_path / "r", n)
    rep = analyze(tmp_path / "r")
    page = HtmlRenderer().render(rep)
    per = n // plots.MAX_STEP_BARS
    assert f"Each bar holds {per} consecutive steps ({plots.MAX_STEP_BARS} bars)" in page
    assert _bars(plots.plot_steps(rep)) == [plots.MAX_STEP_BARS] * len(COLUMNS)
    bars = plots.step_bars(rep)
    np.testing.assert_allclose(bars.median_s["input_wait_s"], 0.002, rtol=1e-9)
    np.testing.assert_allclose(bars.median_s["compute_s"], 0.008, rtol=1e-9)
    assert len(_slowest_rows(page)) == plots.MAX_SLOW_STEPS
    m = re.search(r'<h2 id="per-step">.*?(?=<h2)', page, re.S)
    assert m and len(m.group(0)) < 200_000, "the section must stay small"


@pytest.mark.parametrize("figures", [True, False])
def test_a_run_without_steps_says_so_in_one_line(tmp_path: Path, figures: bool) -> None:
    from distdiag.synth import synth

    synth(tmp_path / "run", ranks=4, events=200, fault="none", ranks_per_host=2)
    rep = analyze(tmp_path / "run")
    page = HtmlRenderer(figures=figures).render(rep)
    m = re.search(r'<h2 id="per-step">Per step</h2>(.*?)(?=<h2|</body>)', page, re.S)
    assert m, "the section is there"
    assert m.group(1).strip() == f'<p class="meta" id="no-steps">No per-step time: {html.escape(plots.NO_STEPS)}.</p>'
    assert 'id="fig-steps"' not in page and "slowest-steps" not in page
    with pytest.raises(plots.NoData):
        plots.plot_steps(rep)


def test_without_matplotlib_both_figure_sections_say_how_to_get_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # distdiag.render.plots imports matplotlib only inside its drawing functions,
    # so the guard must try matplotlib itself (a None entry makes its import fail)
    _many_steps(tmp_path / "r", 3)
    rep = analyze(tmp_path / "r")
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)
    page = HtmlRenderer().render(rep)
    hint = "(pip install 'distdiag[report]')"
    assert '<h2>Figures</h2><p class="warn">no figures: ' in page and page.count(hint) == 2
    assert "<img" not in page and 'id="slowest-steps"' in page
