"""``distdiag analyze --parallel`` under a real ``mpiexec -n 3`` equals the serial analysis.

The run dirs come from the synthetic generator (real rank files); one test
adds a damaged file and a foreign file, so the warnings the readers on
different analysis ranks produce must come back in the serial order too.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import run_in_session

from distdiag.parallel import block_of
from distdiag.synth import synth

sys.path.insert(0, str(Path(__file__).resolve().parent))
from factories import truncate_copy  # noqa: E402

MPIEXEC = shutil.which("mpiexec")
pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="needs mpiexec (pip install mpich)")
REPO = Path(__file__).resolve().parent.parent


def _run(argv: list[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run argv in its own session with this checkout importable; a timeout kills that session and fails."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return run_in_session(argv, timeout, env=env)


def _serial(run_dir: Path, fmt: str, *extra: str) -> str:
    got = _run([sys.executable, "-m", "distdiag.cli", "analyze", str(run_dir), "--format", fmt, *extra])
    assert got.returncode == 0, got.stderr
    return got.stdout


def _parallel(run_dir: Path, fmt: str, n: int = 3, *extra: str) -> str:
    got = _run([MPIEXEC or "mpiexec", "-n", str(n), sys.executable, "-m", "distdiag.cli", "analyze", "--parallel",
                str(run_dir), "--format", fmt, *extra])  # fmt: skip
    assert got.returncode == 0, got.stderr
    return got.stdout


def test_blocks_cover_every_file_once() -> None:
    for n_items in (0, 1, 2, 7, 100):
        for k in (1, 2, 3, 4, 8):
            spans = [block_of(i, k, n_items) for i in range(k)]
            assert spans[0][0] == 0 and spans[-1][1] == n_items
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))


def _stream_config(tmp: Path, limit: int) -> str:
    cfg = tmp / f"stream{limit}.toml"
    cfg.write_text(f"[analyze]\nstream_events = {limit}\n")
    return str(cfg)


# (the straggler and serial runs of this test are cases of tests/test_equivalence.py now)
@pytest.mark.parametrize("fault,ranks,events", [("storm", 48, 4000)])
def test_parallel_streamed_equals_serial_in_memory(tmp_path: Path, fault: str, ranks: int, events: int) -> None:
    # stream_events = 0: every analysis rank leaves the phases out; K = 1 keeps every
    # collective row on rank 0, K = 3 keeps them where they were read (matched by key
    # ranges). The serial analysis holds every row (-1). A truncated file exercises the
    # per-file facts shipped to rank 0. The storm run's messages are past MPICH's eager
    # limit (MBs of file rows per analysis rank): a send then completes only when rank 0
    # receives it (the order of rank 0's receives once hung on that).
    d = tmp_path / "run"
    synth(d, ranks=ranks, events=events, fault=fault, ranks_per_host=2, seed=3)
    truncate_copy(d / "rank-00002.h5", d / "cut.h5", (d / "rank-00002.h5").stat().st_size * 2 // 3)
    (d / "cut.h5").replace(d / "rank-00002.h5")
    streamed = _stream_config(tmp_path, 0)
    ser = _serial(d, "json", "--config", _stream_config(tmp_path, -1))
    assert f'"kind": "{fault}' in ser or f'"kind": "metadata_{fault}' in ser
    for n in (1, 3):
        assert _parallel(d, "json", n, "--config", streamed) == ser, n


def test_parallel_streams_what_the_serial_analysis_streams(tmp_path: Path) -> None:
    # rank 0's Run after a parallel read has the phases out of its table, as load_run has
    d = tmp_path / "run"
    synth(d, ranks=6, events=400, fault="straggler", ranks_per_host=2, seed=1)
    out = tmp_path / "facts.json"
    code = (
        "import json, sys\n"
        "from distdiag.config import Config\n"
        "from distdiag.parallel import analyze_parallel\n"
        "from distdiag.schema import Kind\n"
        "rep = analyze_parallel(sys.argv[1], Config(stream_events=0))\n"
        "if rep is not None:\n"
        "    ev = rep.run.events\n"
        "    json.dump({'streamed': sorted(rep.run.streamed_kinds),\n"
        "               'forward_rows': int((ev['kind'] == int(Kind.FORWARD)).sum()),\n"
        "               'coll_rows_after': rep.run.coll_rows is not None,\n"
        "               'held': rep.run.cache.parallel['collectives_held']}, open(sys.argv[2], 'w'))\n"
    )
    got = _run([MPIEXEC or "mpiexec", "-n", "3", sys.executable, "-c", code, str(d), str(out)])
    assert got.returncode == 0, got.stderr
    import json

    from distdiag.run import STREAMED_KINDS

    facts = json.loads(out.read_text())
    # and the collective rows stayed on the analysis ranks that read them (matched there)
    assert facts == {"streamed": sorted(STREAMED_KINDS), "forward_rows": 0, "coll_rows_after": False, "held": True}


_PARTS_CHILD = """
import json, sys
import distdiag.bands
distdiag.bands.BAND_EVENTS = int(sys.argv[3])  # many bands: each analysis rank gets some
from distdiag.config import Config
from distdiag.parallel import analyze_parallel
from distdiag.render import render
rep = analyze_parallel(sys.argv[1], Config(stream_events=0))
if rep is not None:
    facts = {"parts": rep.run.cache.parallel["breakdown_blocks"],
             "input_costs_split": "input_costs_s" in rep.run.cache.parallel}
    open(sys.argv[2], "w").write(json.dumps(facts) + "\\n" + render(rep, "json"))
"""


def test_the_breakdown_bands_are_split_over_the_analysis_ranks(tmp_path: Path) -> None:
    # A real DDP job (steps, forward/backward/optimizer phases, async all-reduces, a slow data
    # loader), streamed: the analysis ranks each price a block of the bands' input waits
    # (input_bound's pass) and compute a block of the breakdown's bands while rank 0 runs
    # the detectors; the report equals the serial in-memory one, steps and findings included.
    pytest.importorskip("torch")
    import json

    from test_torch_ddp import torchrun

    from distdiag.config import Config
    from distdiag.pipeline import analyze
    from distdiag.render import render

    # the Dataset sleeps 6 ms a sample: input waits, priced by input_bound band by band too
    torchrun(tmp_path, ["--steps", "12", "--batch", "8", "--sleep-ms", "6"], nproc=2)
    d = tmp_path / "run"
    out = tmp_path / "par.txt"
    got = _run([MPIEXEC or "mpiexec", "-n", "3", sys.executable, "-c", _PARTS_CHILD, str(d), str(out), "64"])
    assert got.returncode == 0, got.stderr
    head, par = out.read_text().split("\n", 1)
    facts = json.loads(head)
    parts = facts["parts"]
    assert facts["input_costs_split"]
    # two blocks, disjoint and in rank order, each with its ranks' steps
    assert len(parts) == 2 and parts[0][1] == parts[1][0] and parts[0][0] == 0 and parts[1][1] == 2, parts
    assert parts[0][3] == parts[1][2] and parts[1][3] > parts[1][2] > 0, parts
    ser = render(analyze(d, Config(stream_events=-1)), "json")
    assert '"steps": 12' in ser or '"steps": 13' in ser, ser[-600:]
    assert '"kind": "input_bound"' in ser
    assert par == ser


def test_more_analysis_ranks_than_files(tmp_path: Path) -> None:
    d = tmp_path / "run"
    synth(d, ranks=2, events=300, fault="none", ranks_per_host=1)
    assert _parallel(d, "json", n=3) == _serial(d, "json")


def test_a_wrong_path_is_one_line_and_exit_2_on_every_rank(tmp_path: Path) -> None:
    got = _run([MPIEXEC or "mpiexec", "-n", "3", sys.executable, "-m", "distdiag.cli", "analyze", "--parallel",
                str(tmp_path / "nope")])  # fmt: skip
    assert got.returncode == 2
    assert got.stderr.strip().splitlines() == [f"distdiag: run dir '{tmp_path / 'nope'}' does not exist"]


def test_parallel_writes_the_same_perfetto_trace_and_output_file(tmp_path: Path) -> None:
    # --parallel goes through the same output step as the serial path (distdiag.output.emit)
    d = tmp_path / "run"
    synth(d, ranks=6, events=300, fault="straggler", ranks_per_host=2, seed=7)
    outs = {}
    for mode in ("serial", "parallel"):
        trace, report = tmp_path / f"{mode}.trace.json", tmp_path / f"{mode}.json"
        pre = [MPIEXEC or "mpiexec", "-n", "3"] if mode == "parallel" else []
        flag = ["--parallel"] if mode == "parallel" else []
        got = _run([*pre, sys.executable, "-m", "distdiag.cli", "analyze", *flag, str(d), "--format", "json",
                    "-o", str(report), "--perfetto", str(trace)])  # fmt: skip
        assert got.returncode == 0, got.stderr
        outs[mode] = (report.read_text(), trace.read_text())
    assert '"kind": "straggler"' in outs["parallel"][0]
    assert outs["parallel"] == outs["serial"]
