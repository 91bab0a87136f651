"""PyTorch profiler (Kineto) traces as an input (issue 22 part 4; distdiag/kineto.py).

Three parts: real ``torch.profiler`` traces of a 2-rank gloo job with a
straggler against its healthy twin (the price against the measured saving);
generated GPU-shaped traces (distdiag/kineto_synth.py: NCCL kernels, compute
kernels, HtoD copies, loader waits, ProfilerStep) whose mapping, clock offsets
and prices are known; and bad input, each one clear line and no traceback.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from distdiag.kineto_synth import write_traces
from distdiag.match import MatchState, collectives_of
from distdiag.pipeline import analyze
from distdiag.run import load_run
from distdiag.schema import Kind
from truth import Saving, assert_prices_median, loop_s, measure_saving, sched_imbalance_s

REPO = Path(__file__).resolve().parent.parent
JOB = REPO / "tests" / "jobs" / "kineto_gloo.py"


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "distdiag.cli", *args], capture_output=True, text=True, timeout=300,
                          cwd=REPO)  # fmt: skip


def _findings(report: object, kind: str) -> list:
    return [f for f in report.findings if f.kind == kind]  # type: ignore[attr-defined]


# ----------------------------------------------------------------------------------
# real torch.profiler traces of a gloo job


#: rank 1's extra compute a step. The replay keeps each all-reduce's time after the last arrival as
#: recorded; in the faulty run the early rank has done its part of the collective (gloo's and the
#: profiler's own per-step work) while it waited, so that part is ~2 ms a step there and 5-9 ms in
#: the healthy twin, where both ranks arrive together: 0.15-0.2 s of 30 steps the twin pays back,
#: which the price cannot know (seen: priced 0.557 s against 0.384 s saved with 20 ms a step,
#: once in four runs). 40 ms keeps that known error well inside the test's 25%.
SLOW_MS = "40"

#: run dir -> how much longer one rank waited for a core than the other in its loop (truth.sched_imbalance_s)
_IMBALANCE: dict[Path, float] = {}


@pytest.fixture(scope="module")
def gloo_ab(tmp_path_factory: pytest.TempPathFactory) -> tuple[Saving, list[Path], list[Path]]:
    """The 2-rank job (10 ms of compute a step) with rank 1 computing 40 ms more before each of 30
    all-reduces, and its healthy twin, 3 pairs by turns (2 ranks on the 2 cores: the saving is still measured, not assumed;
    three healthy runs measure their spread, the noise the healthy-twin check allows, better than two: beside a busy
    core two runs 11.5 ms apart held a 25 ms straggler, a descheduled rank)."""
    pytest.importorskip("torch")
    faulty: list[Path] = []
    healthy: list[Path] = []

    def run(is_faulty: bool, i: int) -> float:
        d = tmp_path_factory.mktemp(f"kineto_{'faulty' if is_faulty else 'healthy'}{i}")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(JOB),
               "--out", str(d), "--iters", "30", "--slow-rank", "1" if is_faulty else "-1", "--slow-ms", SLOW_MS]
        if is_faulty and i == 0:
            cmd.append("--gz")  # one run's traces as .json.gz
        env = dict(os.environ, OMP_NUM_THREADS="1")
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env, cwd=d)
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
        (faulty if is_faulty else healthy).append(d)
        _IMBALANCE[d] = sched_imbalance_s(p.stdout)
        return loop_s(p.stdout)

    saving = measure_saving(run, pairs=3)
    return saving, faulty, healthy


@pytest.mark.torch
def test_real_gloo_straggler_priced_at_the_measured_saving(gloo_ab: tuple[Saving, list[Path], list[Path]]) -> None:
    saving, faulty, healthy = gloo_ab
    assert list(faulty[0].glob("*.json.gz")), "the first faulty run's traces are gzipped"
    costs = []
    for d in faulty:
        rep = analyze(d)
        assert rep.run.source == "kineto"
        s = _findings(rep, "straggler")
        assert s and s[0].ranks == [1], [(f.kind, f.ranks, f.cost_s) for f in rep.findings]
        assert rep.verdict is not None and rep.verdict.kind == "straggler"
        costs.append(float(s[0].cost_s))
    print(f"straggler costs {costs} s; {saving}")
    assert_prices_median(saving, costs, rel=0.25, what="straggler cost")


@pytest.mark.torch
def test_real_gloo_healthy_twin_silent(gloo_ab: tuple[Saving, list[Path], list[Path]]) -> None:
    """No finding above 2% of the wall-clock plus the noise measured in the same test: the healthy
    runs' spread, and how much longer one rank of that run waited for a core than the other
    (the kernel's run_delay, printed by the job). Beside a busy core a healthy rank is really
    descheduled, and the detector rightly sees it late: seen in CI, a 35 ms straggler in a 0.57 s
    healthy run, its rank 0 waking 10 ms late at 7 all-reduces; on a more loaded machine 92 and
    177 ms, with rank 1 waiting for a core 92 and 188 ms longer than rank 0. That is the
    machine's fault, not the job's; the allowance is measured in the run, never assumed."""
    saving, _, healthy = gloo_ab
    for d in healthy:
        rep = analyze(d)
        wall = rep.run.wall_s
        allowed = 0.02 * wall + saving.noise_s + _IMBALANCE[d]
        loud = [(f.kind, f.cost_s) for f in rep.findings if f.cost_s > allowed]
        assert not loud, (loud, wall, saving.noise_s, _IMBALANCE[d])


@pytest.mark.torch
def test_real_gloo_mapping(gloo_ab: tuple[Saving, list[Path], list[Path]]) -> None:
    """gloo's worker annotations are the collectives (every one matched on both ranks), ProfilerStep the steps,
    and the CLI says the input was Kineto traces (text and JSON) with the stated clock bound."""
    _, faulty, healthy = gloo_ab
    run = load_run(healthy[0])
    colls = collectives_of(__import__("distdiag.clocks", fromlist=["align"]).align(run))
    ops = {colls.op_name(g) for g in range(len(colls))}
    assert ops == {"all_reduce", "barrier"}, ops
    assert len(colls) == 32 and (colls.g_state == MatchState.COMPLETE).all()  # 30 all-reduces + 2 barriers
    steps = run.events[run.events["kind"] == Kind.STEP]
    assert len(steps) == 2 * 31, len(steps)  # 30 steps and the window's last (the final barrier)
    txt = _cli("analyze", str(faulty[1]))
    assert txt.returncode == 0, txt.stderr
    assert "input: 2 PyTorch profiler (Kineto) traces" in txt.stdout
    js = json.loads(_cli("analyze", str(faulty[1]), "--format", "json").stdout)
    inp = js["run"]["input"]
    assert inp["format"] == "kineto" and inp["files"] == 2 and "collective-exits" in inp["clock_methods"]
    # the bound stated is the clock model's own (its largest over the ranks), and small against the run. It
    # is measured, not a constant: the spread of the exits it is fitted to grows with the machine's load
    # (0.04-0.14 ms on an idle machine here, 11 ms once in CI beside other work), so no fixed ms limit holds
    model = analyze(faulty[1]).run.cache.clock_model
    assert inp["clock_bound_ms"] == pytest.approx(max(m.bound_ns for m in model.ranks.values()) / 1e6, abs=1e-4)
    assert 0 < inp["clock_bound_ms"] < 0.05 * js["run"]["wall_s"] * 1e3, (inp, js["run"]["wall_s"])


# ----------------------------------------------------------------------------------
# generated GPU-shaped traces


def test_gpu_shaped_straggler_clocks_and_mapping(tmp_path: Path) -> None:
    """NCCL kernels are the collectives at their GPU times; the offsets (up to seconds) are recovered from
    them within the stated bound; the straggler is priced at the generator's lateness."""
    truth = write_traces(tmp_path, ranks=4, steps=20, straggler_rank=2, straggler_ms=10, exit_jitter_us=50)
    rep = analyze(tmp_path)
    run = rep.run
    colls = rep.collectives
    assert len(colls) == 20 and (colls.g_state == MatchState.COMPLETE).all()
    assert {colls.op_name(g) for g in range(len(colls))} == {"all_reduce"}
    assert {colls.comm_name(g) for g in range(len(colls))} == {"default"}
    # GPU times: a member's arrival is its NCCL kernel's start, not the record_param_comms CPU op
    model = run.cache.clock_model
    for r in range(1, 4):
        m = model.ranks[r]
        assert m.method == "collective-exits"
        got = int(m.offset_ns(np.array([m.x0_ns]))[0])
        want = -truth["offset_ns"][r]  # local + offset = rank 0's clock
        assert abs(got - want) <= m.bound_ns, (r, got, want, m.bound_ns)
        assert m.bound_ns < 1e6
    s = _findings(rep, "straggler")
    assert s and s[0].ranks == [2]
    assert s[0].cost_s == pytest.approx(truth["straggler_cost_s"], rel=0.03)
    assert s[0].evidence["clock_bound_ms"] < 1
    ev = run.events
    assert int((ev["kind"] == Kind.PHASE).sum()) == 4 * 20 * 4  # the compute kernels
    assert int((ev["kind"] == Kind.STEP).sum()) == 4 * 20


def test_gpu_shaped_copies_and_input_waits(tmp_path: Path) -> None:
    """HtoD memcpys are H2D rows (bytes from the args), DataLoader __next__ the input waits: input_bound and
    h2d_copy price them at what the generator put on every step's critical path."""
    truth = write_traces(tmp_path, ranks=4, steps=20, input_ms=8, h2d_ms=5, gz=True)
    rep = analyze(tmp_path)
    ev = rep.run.events
    h2d = ev[ev["kind"] == Kind.H2D]
    assert len(h2d) == 80 and (h2d["nbytes"] == 64 << 20).all()
    assert int((ev["kind"] == Kind.INPUT_WAIT).sum()) == 80
    ib, hc = _findings(rep, "input_bound"), _findings(rep, "h2d_copy")
    assert ib and ib[0].cost_s == pytest.approx(truth["input_cost_s"], rel=0.05)
    assert hc and hc[0].cost_s == pytest.approx(truth["h2d_cost_s"], rel=0.05)
    assert not _findings(rep, "straggler")


def test_gpu_shaped_healthy_twin_silent(tmp_path: Path) -> None:
    write_traces(tmp_path, ranks=4, steps=20)
    rep = analyze(tmp_path)
    assert not [f for f in rep.findings if f.cost_s > 0.02 * rep.run.wall_s], [(f.kind, f.cost_s) for f in rep.findings]
    assert rep.to_json()["run"]["input"]["format"] == "kineto"


def test_streamed_report_equals_in_memory(tmp_path: Path) -> None:
    """``stream_events = 0`` (stream always): the trace rows are read again band by band, same report."""
    write_traces(tmp_path, ranks=4, steps=10, straggler_rank=1, straggler_ms=5, input_ms=2)
    cfg_file = tmp_path.parent / f"{tmp_path.name}-stream.toml"
    cfg_file.write_text("[analyze]\nstream_events = 0\n")
    a = _cli("analyze", str(tmp_path), "--format", "json")
    b = _cli("analyze", str(tmp_path), "--format", "json", "--config", str(cfg_file))
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert a.stdout == b.stdout


def test_rank_from_file_name(tmp_path: Path) -> None:
    """Without distributedInfo the rank is the file name's rank<N>."""
    write_traces(tmp_path, ranks=2, steps=5, name="worker.rank_{r}.json")
    for fp in tmp_path.iterdir():
        doc = json.loads(fp.read_text())
        del doc["distributedInfo"]
        fp.write_text(json.dumps(doc))
    run = load_run(tmp_path)
    assert sorted(run.ranks) == [0, 1]
    assert {run.ranks[r].path.name for r in run.ranks} == {"worker.rank_0.json", "worker.rank_1.json"}


# ----------------------------------------------------------------------------------
# bad input: one clear line each, no traceback, nothing read outside the dir


def _one_line_error(d: Path, *extra: str) -> str:
    p = _cli("analyze", str(d), *extra)
    assert p.returncode == 2, (p.returncode, p.stdout[-500:], p.stderr[-2000:])
    assert "Traceback" not in p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("distdiag: "), p.stderr
    return lines[0]


def test_malformed_json(tmp_path: Path) -> None:
    (tmp_path / "rank0.json").write_text('{"traceEvents": [{"ph": "X", "name": "a",')
    line = _one_line_error(tmp_path)
    assert "rank0.json is not valid JSON (line 1" in line


def test_not_a_trace_and_bad_events(tmp_path: Path) -> None:
    (tmp_path / "rank0.json").write_text('{"hello": 1}')
    assert "not a Kineto/Chrome trace (no 'traceEvents' list)" in _one_line_error(tmp_path)
    (tmp_path / "rank0.json").write_text('{"traceEvents": [1, 2, 3]}')
    assert "trace events that are not JSON objects" in _one_line_error(tmp_path)


def test_trace_over_the_size_bound(tmp_path: Path) -> None:
    write_traces(tmp_path, ranks=1, steps=5)
    size = next(tmp_path.iterdir()).stat().st_size
    cfg = tmp_path.parent / f"{tmp_path.name}-small.toml"
    cfg.write_text(f"[analyze]\nkineto_max_trace_bytes = {size - 1}\n")
    line = _one_line_error(tmp_path, "--config", str(cfg))
    assert f"is {size} bytes, over the {size - 1} a trace may have (kineto_max_trace_bytes)" in line
    cfg.write_text(f"[analyze]\nkineto_max_trace_bytes = {size}\n")
    assert _cli("analyze", str(tmp_path), "--config", str(cfg)).returncode == 0


def test_gz_bomb(tmp_path: Path) -> None:
    """A small .gz that decompresses to 64 MiB is refused at the bound (1 MiB here), not decompressed whole."""
    big = b'{"traceEvents": [' + b" " * (64 << 20) + b"]}"
    (tmp_path / "rank0.json.gz").write_bytes(gzip.compress(big, compresslevel=9))
    assert (tmp_path / "rank0.json.gz").stat().st_size < 1 << 20
    cfg = tmp_path.parent / f"{tmp_path.name}-bomb.toml"
    cfg.write_text(f"[analyze]\nkineto_max_trace_bytes = {1 << 20}\n")
    line = _one_line_error(tmp_path, "--config", str(cfg))
    assert "decompresses to more than the 1048576 bytes a trace may have" in line


def test_symlink_out_of_the_dir_is_not_read(tmp_path: Path) -> None:
    """A trace name linking to a file outside the dir is refused; the other ranks are analyzed and the
    report quotes nothing from the target."""
    outside = tmp_path / "secret"
    outside.mkdir()
    write_traces(outside, ranks=2, steps=5)
    secret = outside / "rank1.pt.trace.json"
    doc = json.loads(secret.read_text())
    doc["host_name"] = "SECRET-NAME-FROM-OUTSIDE"  # a read trace's host is in every report
    secret.write_text(json.dumps(doc))
    run_dir = tmp_path / "run"
    write_traces(run_dir, ranks=2, steps=5)
    (run_dir / "rank1.pt.trace.json").unlink()
    (run_dir / "rank1.pt.trace.json").symlink_to(secret)
    p = _cli("analyze", str(run_dir), "--format", "json")
    assert p.returncode == 0, p.stderr
    assert "SECRET-NAME" not in p.stdout
    warnings = json.loads(p.stdout)["run"]["warnings"]
    assert any("rank1.pt.trace.json is a symbolic link" in w for w in warnings), warnings
    assert json.loads(p.stdout)["run"]["missing_ranks"] == [1]
    # alone, the link is the one error
    (run_dir / "rank0.pt.trace.json").unlink()
    assert "rank1.pt.trace.json is a symbolic link" in _one_line_error(run_dir)


def test_missing_rank(tmp_path: Path) -> None:
    (tmp_path / "trace.json").write_text('{"traceEvents": []}')
    line = _one_line_error(tmp_path)
    assert "trace.json names no rank (no distributedInfo.rank in the trace, no rank<N> in its file name)" in line


def test_control_characters_from_a_trace_are_escaped(tmp_path: Path) -> None:
    """Names from a trace reach the terminal escaped (an ESC in a kernel name, a newline in the host)."""
    write_traces(tmp_path, ranks=2, steps=5, straggler_rank=1, straggler_ms=20)
    fp = tmp_path / "rank1.pt.trace.json"
    doc = json.loads(fp.read_text())
    doc["host_name"] = "evil\nVERDICT: healthy\x1b[2J"
    fp.write_text(json.dumps(doc))
    p = _cli("analyze", str(tmp_path))
    assert p.returncode == 0, p.stderr
    assert "\x1b" not in p.stdout and "\nVERDICT: healthy" not in p.stdout
