"""The Perfetto/Chrome trace export of a real demo run, checked by a strict trace-format validator.

Perfetto's ``trace_processor`` could not be run here: the ``perfetto`` PyPI
package (0.59.1) ships only the Python client, and its TraceProcessor
downloads ``trace_processor_shell`` from commondatastorage.googleapis.com
on first use, which this machine cannot reach; no wheel or Debian package
carries the binary. So the trace is checked against the Chrome trace-event
format as Perfetto's JSON importer reads it (``validate`` below: types,
phases, required fields, named processes and threads, thread ids unique
across processes, properly nested slices per track, strict JSON with no
NaN/Infinity), and the collectives are counted per rank track from the
file. ``test_trace_processor_counts_collectives`` runs the real query when
``DISTDIAG_TRACE_PROCESSOR_BIN`` names a ``trace_processor_shell`` binary.

The job: ``mpiexec -n 4 distdiag-wrap`` on distdiag's demo job (20
iterations: a Barrier, 20 Allreduce, a Barrier every 10th, a final pickled
``allreduce``), rank 2 sleeping before its Allreduce; GPU samples come from
the FAKE NVML module in tests/fake_pynvml (no GPU here), one fake device per
rank, sampled every 0.1 s.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from helpers import demo_args, run_wrapped_mpi

pytestmark = pytest.mark.mpi

REPO = Path(__file__).resolve().parent.parent
FAKE_NVML = REPO / "tests" / "fake_pynvml"
XSS = "<script>alert(1)</script>"
ITERS = 20
#: per rank, from the demo job's code (not from the analyzer)
EXPECTED_COLLECTIVES = {"Barrier": 1 + ITERS // 10, "Allreduce": ITERS, "allreduce": 1}

JOB = """
import os, sys
d = os.path.join(sys.argv[1], "<script>alert(1)<")
os.makedirs(d, exist_ok=True)
with open(os.path.join(d, "script>"), "w") as f:
    f.write("x")
from distdiag import demo_job
sys.exit(demo_job.main(sys.argv[2:]))
"""


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("perfetto")
    env = dict(os.environ, FAKE_NVML_GPUS="1", DISTDIAG_GPU_INTERVAL_S="0.1",
               PYTHONPATH=os.pathsep.join([str(FAKE_NVML), str(REPO), os.environ.get("PYTHONPATH", "")]))  # fmt: skip
    return run_wrapped_mpi(tmp, JOB, demo_args(tmp, ITERS), env=env)


def export(run_dir: Path, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "distdiag.cli", "analyze", str(run_dir), "--format", "json",
                           "--perfetto", str(out), *extra], capture_output=True, text=True, timeout=180)  # fmt: skip


# ----------------------------------------------------------------------------------
# the validator


class TraceError(ValueError):
    pass


def _num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def load_strict(path: Path) -> dict[str, Any]:
    def no_constants(c: str) -> Any:
        raise TraceError(f"JSON constant {c} is not JSON")

    doc = json.loads(path.read_text(), parse_constant=no_constants)
    if not isinstance(doc, dict):
        raise TraceError("the trace is not a JSON object")
    return doc  # type: ignore[no-any-return]


def validate(doc: dict[str, Any]) -> dict[str, Any]:
    """Check a Chrome JSON trace the way Perfetto's importer needs it; return what it holds.

    Returns {"processes": {pid: name}, "threads": {tid: (pid, name)},
    "slices": {process name: Counter((cat, name))}, "events": [non-metadata events]}.
    """
    evs = doc.get("traceEvents")
    if not isinstance(evs, list):
        raise TraceError("no traceEvents list")
    if doc.get("displayTimeUnit", "ms") not in ("ms", "ns"):
        raise TraceError("displayTimeUnit must be ms or ns")
    procs: dict[int, str] = {}
    threads: dict[int, tuple[int, str]] = {}
    tid_pid: dict[int, int] = {}
    body = []
    for i, e in enumerate(evs):  # a test: a loop is fine
        if not isinstance(e, dict):
            raise TraceError(f"event {i} is not an object")
        ph = e.get("ph")
        if ph not in ("X", "i", "C", "M"):
            raise TraceError(f"event {i}: phase {ph!r} is not one this exporter writes")
        if not isinstance(e.get("name"), str) or not e["name"]:
            raise TraceError(f"event {i}: no name")
        if not _int(e.get("pid")):
            raise TraceError(f"event {i}: pid must be an integer")
        if "args" in e and not isinstance(e["args"], dict):
            raise TraceError(f"event {i}: args must be an object")
        if "cat" in e and not isinstance(e["cat"], str):
            raise TraceError(f"event {i}: cat must be a string")
        if ph == "M":
            args = e.get("args", {})
            if e["name"] in ("process_name", "thread_name"):
                if not isinstance(args.get("name"), str):
                    raise TraceError(f"event {i}: {e['name']} without args.name")
                if e["name"] == "process_name":
                    procs[e["pid"]] = args["name"]
                else:
                    if not _int(e.get("tid")):
                        raise TraceError(f"event {i}: thread_name without tid")
                    threads[e["tid"]] = (e["pid"], args["name"])
            elif e["name"] in ("process_sort_index", "thread_sort_index"):
                if not _int(args.get("sort_index")):
                    raise TraceError(f"event {i}: sort index must be an integer")
            else:
                raise TraceError(f"event {i}: unknown metadata {e['name']!r}")
            continue
        if not _num(e.get("ts")) or e["ts"] < 0:
            raise TraceError(f"event {i}: ts must be a finite number >= 0")
        if ph == "X" and (not _num(e.get("dur")) or e["dur"] < 0):
            raise TraceError(f"event {i}: a complete event needs a finite dur >= 0")
        if ph == "i" and e.get("s", "t") not in ("g", "p", "t"):
            raise TraceError(f"event {i}: instant scope must be g, p or t")
        if ph == "C":
            if not e.get("args") or not all(_num(v) for v in e["args"].values()):
                raise TraceError(f"event {i}: counter values must be finite numbers")
        else:
            if not _int(e.get("tid")):
                raise TraceError(f"event {i}: tid must be an integer")
            if tid_pid.setdefault(e["tid"], e["pid"]) != e["pid"]:
                raise TraceError(f"event {i}: tid {e['tid']} used in two processes")
        body.append(e)
    for e in body:
        if e["pid"] not in procs:
            raise TraceError(f"pid {e['pid']} has no process_name")
        if e["ph"] != "C" and (e["tid"] not in threads or threads[e["tid"]][0] != e["pid"]):
            raise TraceError(f"tid {e['tid']} has no thread_name in process {e['pid']}")
    # Slices on one track must nest: sorted by (ts, longest first), each one ends
    # before whichever enclosing slice is still open.
    by_track: dict[int, list[tuple[float, float, str]]] = {}
    for e in body:
        if e["ph"] == "X":
            by_track.setdefault(e["tid"], []).append((e["ts"], -e["dur"], e["name"]))
    eps = 1e-3  # µs: the file's precision
    for tid, sl in by_track.items():
        stack: list[float] = []
        for ts, neg, name in sorted(sl):
            end = ts - neg
            while stack and stack[-1] <= ts + eps:
                stack.pop()
            if stack and end > stack[-1] + eps:
                raise TraceError(f"track {threads[tid][1]!r} of {procs[threads[tid][0]]!r}: slice {name!r} at "
                                 f"{ts} overlaps its parent without nesting")  # fmt: skip
            stack.append(end)
    slices: dict[str, Counter[tuple[str, str]]] = {name: Counter() for name in procs.values()}
    for e in body:
        if e["ph"] == "X":
            slices[procs[e["pid"]]][(e.get("cat", ""), e["name"])] += 1
    return {"processes": procs, "threads": threads, "slices": slices, "events": body}


# ----------------------------------------------------------------------------------


def test_demo_trace_loads_and_counts_the_collectives_per_rank(run_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "trace.json"
    p = export(run_dir, out)
    assert p.returncode == 0, p.stderr
    assert "left out" not in p.stderr
    t = validate(load_strict(out))
    assert sorted(t["processes"].values()) == [f"rank {r} ({h})" for r, h in
                                               sorted((r, json.loads(p.stdout)["run"]["hosts"][0]) for r in range(4))]  # fmt: skip
    for r in range(4):  # four ranks
        name = next(n for n in t["processes"].values() if n.startswith(f"rank {r} "))
        got = {op: n for (cat, op), n in t["slices"][name].items() if cat == "collective"}
        assert got == EXPECTED_COLLECTIVES, (name, got)
        waits = sum(n for (cat, _), n in t["slices"][name].items() if cat == "wait")
        assert 0 < waits <= sum(EXPECTED_COLLECTIVES.values())
    # the XSS path is data in args, on each rank's file track
    opens = [e for e in t["events"] if e.get("cat") == "file" and e["name"] == "open" and e["args"]["path"].endswith(XSS)]
    assert sorted(e["pid"] for e in opens) == [1, 2, 3, 4]
    # rank 2 slept before its Allreduce: it waits least, the others wait for it
    wait_ms = Counter()
    for e in t["events"]:
        if e.get("cat") == "collective" and e["name"] == "Allreduce":
            wait_ms[e["pid"]] += e["args"]["wait_ms"]
    assert wait_ms[3] < min(wait_ms[1], wait_ms[2], wait_ms[4]) / 2, wait_ms
    lasts = Counter(e["args"]["last_rank"] for e in t["events"] if e.get("cat") == "collective" and e["name"] == "Allreduce")
    assert lasts.most_common(1)[0][0] == 2
    # GPU samples (FAKE NVML) are counters on each rank's process
    gpu = [e for e in t["events"] if e["ph"] == "C"]
    assert {e["pid"] for e in gpu} == {1, 2, 3, 4}
    assert all(e["name"] == "gpu 0" and e["args"]["sm_util_pct"] == 97.0 for e in gpu)


def test_window_keeps_only_what_overlaps_it(run_dir: Path, tmp_path: Path) -> None:
    full = validate(load_strict(_full(run_dir, tmp_path)))
    colls = sorted(e["ts"] for e in full["events"] if e.get("cat") == "collective")
    lo_us, hi_us = colls[len(colls) // 3], colls[2 * len(colls) // 3]
    out = tmp_path / "win.json"
    p = export(run_dir, out, "--window", f"{lo_us / 1e6}:{hi_us / 1e6}")
    assert p.returncode == 0, p.stderr
    doc = load_strict(out)
    t = validate(doc)
    assert 0 < len(t["events"]) < len(full["events"])
    own = [e for e in t["events"] if e.get("cat") != "wait"]
    for e in own:  # every event overlaps the window
        assert e["ts"] + e.get("dur", 0) >= lo_us - 1 and e["ts"] <= hi_us + 1, e
    # a wait slice comes with its collective (same track, same start), which overlaps
    starts = {(e["tid"], e["ts"]) for e in own if e.get("cat") == "collective"}
    assert all((e["tid"], e["ts"]) in starts for e in t["events"] if e.get("cat") == "wait")
    n_in = sum(1 for e in full["events"] if e.get("cat") != "wait"
               and e["ts"] + e.get("dur", 0) >= lo_us - 1 and e["ts"] <= hi_us + 1)  # fmt: skip
    assert abs(len(own) - n_in) <= 2  # the same selection (µs rounding at the edges aside)
    assert doc["otherData"]["window_s"] == pytest.approx([lo_us / 1e6, hi_us / 1e6])


def test_max_events_keeps_the_longest_slices(run_dir: Path, tmp_path: Path) -> None:
    full = validate(load_strict(_full(run_dir, tmp_path)))
    cap = 60
    out = tmp_path / "cap.json"
    p = export(run_dir, out, "--max-events", str(cap))
    assert p.returncode == 0, p.stderr
    assert "left out" in p.stderr
    doc = load_strict(out)
    t = validate(doc)
    assert len(t["events"]) <= cap
    assert doc["otherData"]["dropped_events"] > 0
    assert sum(1 for e in t["events"] if e["ph"] == "C") <= cap // 10
    kept = sorted(e["dur"] for e in t["events"] if e["ph"] == "X" and e.get("cat") != "wait")
    key = {(e["pid"], e.get("tid"), e["ts"], e["name"]) for e in t["events"]}
    dropped = [e["dur"] for e in full["events"] if e["ph"] == "X" and e.get("cat") != "wait"
               and (e["pid"], e["tid"], e["ts"], e["name"]) not in key]  # fmt: skip
    assert kept and dropped and min(kept) >= max(dropped) - 1e-3


def _full(run_dir: Path, tmp_path: Path) -> Path:
    out = tmp_path / "full.json"
    p = export(run_dir, out, "--max-events", "0")
    assert p.returncode == 0, p.stderr
    return out


def test_a_bad_window_is_a_usage_error(run_dir: Path, tmp_path: Path) -> None:
    p = export(run_dir, tmp_path / "x.json", "--window", "5:1")
    assert p.returncode == 2
    assert "end is before the start" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.parametrize(
    "bad, why",
    [
        ({"name": "a", "ph": "X", "ts": 0, "pid": 1, "tid": 9}, "dur"),
        ({"name": "a", "ph": "X", "ts": "0", "dur": 1, "pid": 1, "tid": 9}, "ts"),
        ({"name": "a", "ph": "X", "ts": 0, "dur": 1, "pid": 1, "tid": 10}, "thread_name"),
        ({"name": "a", "ph": "C", "ts": 0, "pid": 1, "args": {"x": "high"}}, "counter"),
        ({"name": "a", "ph": "B", "ts": 0, "pid": 1, "tid": 9}, "phase"),
        ({"name": "b", "ph": "X", "ts": 5, "dur": 10, "pid": 1, "tid": 9}, "nest"),
    ],
)
def test_the_validator_rejects_broken_traces(bad: dict[str, Any], why: str) -> None:
    meta = [{"name": "process_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": "rank 0"}},
            {"name": "thread_name", "ph": "M", "pid": 1, "tid": 9, "args": {"name": "collectives"}},
            {"name": "a", "ph": "X", "ts": 0, "dur": 10, "pid": 1, "tid": 9}]  # fmt: skip
    validate({"traceEvents": meta})  # the good part passes
    with pytest.raises(TraceError):
        validate({"traceEvents": [*meta, bad]})


def test_trace_processor_counts_collectives(run_dir: Path, tmp_path: Path) -> None:
    """The real Perfetto query, where a trace_processor_shell binary is at hand (see the module docstring)."""
    bin_path = os.environ.get("DISTDIAG_TRACE_PROCESSOR_BIN")
    if not bin_path:
        pytest.skip("no trace_processor_shell offline (the perfetto package downloads it); "
                    "set DISTDIAG_TRACE_PROCESSOR_BIN to run this query")  # fmt: skip
    from perfetto.trace_processor import TraceProcessor, TraceProcessorConfig

    out = _full(run_dir, tmp_path)
    tp = TraceProcessor(trace=str(out), config=TraceProcessorConfig(bin_path=bin_path))
    try:
        rows = tp.query(
            "select p.name as proc, count(*) as n from slice s join thread_track tt on s.track_id = tt.id "
            "join thread using(utid) join process p using(upid) where s.category = 'collective' group by p.name"
        ).as_pandas_dataframe()
    finally:
        tp.close()
    assert len(rows) == 4
    assert (rows["n"] == sum(EXPECTED_COLLECTIVES.values())).all(), rows


def test_args_nest_whatever_the_strings_hold() -> None:
    """Job strings that look like the exporter's own structure stay data."""
    import pandas as pd

    from distdiag.render.perfetto import _ARG0, _frame_json

    nasty = ['},{"name":"x"', '","\x01path":1,"', "a\nb}\n{", "</script>\"'&", "é\\u0001"]
    df = pd.DataFrame({"name": nasty, "ph": "X", "ts": [1.5] * 5, "dur": [2.0] * 5, "pid": [1] * 5,
                       "tid": [9] * 5, _ARG0 + "path": nasty[::-1], "nbytes": [1, 2, 3, 4, 5]})  # fmt: skip
    text = _frame_json(df, 2)
    got = json.loads("[" + text.rstrip().removesuffix(",") + "]")
    assert [e["name"] for e in got] == nasty
    assert [e["args"] for e in got] == [{"path": p, "nbytes": n} for p, n in zip(nasty[::-1], [1, 2, 3, 4, 5])]
    plain = _frame_json(df[["name", "ph", "ts", "pid"]], 0)
    assert [e["name"] for e in json.loads("[" + plain.rstrip().removesuffix(",") + "]")] == nasty


def test_gpu_figure_draws_one_line_per_device(run_dir: Path) -> None:
    """The FAKE NVML samples of the same run, through the pandas API and the plot function."""
    import distdiag
    from distdiag.render import plots

    run = distdiag.load(run_dir)
    assert sorted(run.gpu["rank"].unique()) == [0, 1, 2, 3]
    ax = plots.plot_gpu(run)
    assert len(ax.lines) == 4


@pytest.mark.parametrize("fault", ["straggler", "slow_link", "storm", "serial", "skew", "none"])
def test_every_synthetic_fault_exports_a_valid_trace(fault: str, tmp_path: Path) -> None:
    """distdiag.synth writes real rank files for each fault; every one exports a trace the validator accepts."""
    from distdiag.pipeline import analyze
    from distdiag.render.perfetto import export_perfetto
    from distdiag.synth import synth

    synth(tmp_path / "run", ranks=16, events=800, fault=fault, ranks_per_host=4)
    report = analyze(tmp_path / "run")
    st = export_perfetto(report, tmp_path / "t.json", max_events=None)
    t = validate(load_strict(tmp_path / "t.json"))
    assert len(t["processes"]) == 16
    assert st.n_dropped == 0 and len(t["events"]) == st.n_events
    n_coll = {n: sum(v for (cat, _), v in c.items() if cat == "collective") for n, c in t["slices"].items()}
    assert sorted(n_coll.values()) == sorted(st.collectives_per_rank.values())
    assert len(set(n_coll.values())) == 1  # every rank joined every collective
