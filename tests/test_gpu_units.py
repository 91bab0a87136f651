"""The CPU-side logic of GPU timing, piece by piece, on the FAKE CUDA (tests/fake_cuda).

* ``cuda_events.Timer``: pairs stay pending until their events are done (asked
  with ``query()``, never waited for), are placed on the host clock through an
  anchor although the fake GPU's clock is 123 s off, are bounded in number
  (dropped and counted past it), and a failing CUDA call stops the timing
  without raising into the program.
* ``gpu_timeline.substitute_collective_times``: the join of GPU spans to their
  collectives (by t0, seq and kind; nothing else moves).
* ``gpu_timeline.gpu_breakdown``: the partition of a step window by priority,
  on a rank file with known spans.
* An old rank file (GPU samples of the old 10-column table, no GPU spans) loads.
* The NVML sampler's new metrics, and each call guarded on its own (tests/fake_pynvml).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "fake_cuda"))

import fake_cuda  # noqa: E402  (a FAKE torch.cuda)

from distdiag.config import Config  # noqa: E402
from distdiag.schema import EVENT_DTYPE, GPU_DTYPE, Kind  # noqa: E402
from distdiag.shim.hooks import cuda_events  # noqa: E402
from distdiag.shim.recorder import Recorder, as_events  # noqa: E402

MS = 1_000_000


def _rows(t: cuda_events.Timer) -> np.ndarray:
    tb = t._tb
    return as_events(tb.buf, 0, tb.n) if tb is not None else np.zeros(0, EVENT_DTYPE)


def _wait_idle() -> None:
    fake_cuda.current_stream().idle.wait(5)


def test_pairs_wait_until_done_and_land_on_the_host_clock() -> None:
    t = cuda_events.Timer(Recorder(), fake_cuda, fake_cuda.device_of)
    fake_cuda.kernel(30)  # the GPU is busy: the pair below starts after it
    tok = t.begin(0)
    k0 = fake_cuda.Event(enable_timing=True)
    k0.record()
    fake_cuda.kernel(20)
    k1 = fake_cuda.Event(enable_timing=True)
    k1.record()
    t.end(tok, Kind.COLL, 7, cpu_t0=12345, comm_id=3, seq=9)
    assert t.resolve() == 0 and len(t.pending) == 1  # not done: pending, nothing waited for
    _wait_idle()
    assert t.resolve() == 1 and not t.pending
    (row,) = _rows(t)
    assert row["kind"] == Kind.GPU_SPAN and row["aux"] == Kind.COLL and row["nbytes"] == 12345
    assert (row["seq"], row["comm_id"], row["name_id"], row["peer"]) == (9, 3, 7, 0)
    # the fake GPU's clock is CLOCK_OFFSET_NS off the host's: the anchor takes it out, to within
    # the bound the row states (``value``: where the anchor ran), plus 2 ms for the fake's stream
    # thread, which stamps k0 and k1 when it wakes. (The anchor itself, recorded on an idle stream,
    # used to be stamped by that thread too: beside a busy core up to 3.8-4.6 ms late; it is now
    # stamped at once, as a real GPU's idle stream completes it.)
    bound = float(row["value"]) + 2 * MS
    assert abs(int(row["t0_ns"]) - k0.host_ns()) < bound  # type: ignore[operator]
    assert abs(int(row["t1_ns"]) - k1.host_ns()) < bound  # type: ignore[operator]
    assert 18 * MS < row["t1_ns"] - row["t0_ns"] < 40 * MS
    assert 0 <= row["value"] < 50 * MS  # the anchor's bound


def test_pending_pairs_are_bounded_and_counted() -> None:
    t = cuda_events.Timer(Recorder(), fake_cuda, fake_cuda.device_of, max_pending=4)
    fake_cuda.kernel(200)
    for i in range(10):
        t.end(t.begin(0), Kind.FORWARD, 1, cpu_t0=i)
    assert len(t.pending) == 4 and t.dropped == 6
    _wait_idle()
    assert t.resolve() == 4 and t.status()["pending"] == 0
    assert sorted(_rows(t)["nbytes"].tolist()) == [0, 1, 2, 3]


def test_a_failing_cuda_call_stops_timing_quietly() -> None:
    class Broken:
        def __init__(self, enable_timing: bool = False) -> None:
            pass

        def record(self, stream: Any = None) -> None:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    class BrokenCuda:
        is_initialized = staticmethod(lambda: True)
        current_device = staticmethod(lambda: 0)
        current_stream = staticmethod(fake_cuda.current_stream)
        Stream = fake_cuda.Stream
        Event = Broken

    t = cuda_events.Timer(Recorder(), BrokenCuda, fake_cuda.device_of)
    assert t.begin(0) is None and t.open is False
    assert t.begin(0) is None  # and stays off
    t.end(None, Kind.COLL, 1, 0)
    assert t.resolve() == 0


def test_without_cuda_initialized_phases_are_not_timed() -> None:
    class Cold:
        is_initialized = staticmethod(lambda: False)

    t = cuda_events.Timer(Recorder(), Cold, fake_cuda.device_of)
    assert t.begin() is None  # the shim never creates a CUDA context


def test_torch_import_asks_no_device_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """At the program's ``import torch`` the shim must not call ``torch.cuda.is_available()``:
    its cudaGetDeviceCount runs cuInit, which poisons fork (a child forked later cannot use
    CUDA). A STAND-IN torch (no CUDA build here) whose availability check records being called."""
    asked: list[str] = []

    class StandInCuda:
        _is_compiled = staticmethod(lambda: True)  # a CUDA build of torch, which this machine lacks
        is_initialized = staticmethod(lambda: False)

        @staticmethod
        def is_available() -> bool:
            asked.append("is_available")
            return True

        @staticmethod
        def device_count() -> int:
            asked.append("device_count")
            return 1

    class StandInTorch:
        cuda = StandInCuda

    monkeypatch.setattr(cuda_events, "_REC", Recorder())
    monkeypatch.setattr(cuda_events, "_TIMER", None)
    cuda_events._on_torch(StandInTorch)
    assert asked == []
    from distdiag.shim.hooks import phases

    assert phases._accelerator_present(StandInTorch) and asked == []  # the H2D wrappers' choice too
    t = cuda_events.timer()
    assert t is not None and t.begin() is None  # on, but nothing timed before the program's CUDA init


def _ev(rows: list[tuple[Any, ...]]) -> np.ndarray:
    out = np.zeros(len(rows), EVENT_DTYPE)
    for i, r in enumerate(rows):  # a handful
        out[i] = r
    return out


def _row(t0: float, t1: float, kind: int, name: int = 0, comm: int = 0, seq: int = -1, nbytes: int = 0, aux: int = 0) -> tuple[Any, ...]:
    return (int(t0 * MS), int(t1 * MS), kind, name, comm, seq, -1, nbytes, aux, 0, 0, 0.0)


def test_collectives_take_their_gpu_span_by_t0_seq_and_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    from distdiag.gpu_timeline import substitute_collective_times

    rows = [
        _row(10, 11, Kind.COLL, 1, 2, seq=0, nbytes=4096),
        _row(20, 21, Kind.COLL, 1, 2, seq=1, nbytes=4096),
        _row(30, 31, Kind.COLL, 1, 2, seq=2, nbytes=4096),  # no span: keeps its CPU times
        _row(40, 41, Kind.H2D, 3, nbytes=1 << 20),
        _row(15, 19, Kind.GPU_SPAN, 1, 2, seq=0, nbytes=10 * MS, aux=Kind.COLL),
        _row(25, 29, Kind.GPU_SPAN, 1, 2, seq=5, nbytes=20 * MS, aux=Kind.COLL),  # wrong seq: no join
        _row(45, 49, Kind.GPU_SPAN, 3, nbytes=40 * MS, aux=Kind.H2D),  # a copy's span: copies keep CPU times
    ]  # fmt: skip
    spans = slice(4, 7)
    for mode, moved in (("cpu", 0), ("gpu", 1)):
        ev = _ev(rows)
        before = ev.copy()
        monkeypatch.setenv("DISTDIAG_COLLECTIVE_TIMES", mode)
        assert substitute_collective_times(ev) == moved
        # the spans' keys become their rows' bytes (0: joined nothing), in either mode
        assert ev["nbytes"][spans].tolist() == [4096, 0, 1 << 20]
        changed = np.flatnonzero(ev[:4] != before[:4]).tolist()
        assert changed == ([0] if moved else [])
    assert (ev["t0_ns"][0], ev["t1_ns"][0]) == (15 * MS, 19 * MS)


def _write(path: Path, events: np.ndarray, strings: list[str], gpu: np.ndarray | None = None, timed: bool = True) -> None:
    from distdiag.shim.writer import write_rank_file

    attrs: dict[str, Any] = {"rank": 0, "world_size": 1}
    if timed:
        attrs["cuda_timing"] = "on: test"
    write_rank_file(path, attrs, events, strings, gpu=gpu)


def test_gpu_breakdown_partitions_each_step_by_priority(tmp_path: Path) -> None:
    """Per step (100 ms): H2D span 0-10, forward 10-40, backward 40-60, an NCCL span 50-80
    (its overlap with backward is kernels), the CPU waiting on the loader 80-100 with no span."""
    from distdiag.gpu_timeline import gpu_breakdown
    from distdiag.run import load_run

    strings = ["", "optimizer_step", "all_reduce", "Model", "DataLoader.__next__", "default", "Tensor.to"]
    rows = [_row(0, 0, Kind.SHIM)]
    for s in range(3):
        b = 100 * s
        rows.append(_row(b, b, Kind.STEP, 1))
        if s == 2:
            break
        rows += [
            _row(b, b + 1, Kind.H2D, 6), _row(b + 0, b + 10, Kind.GPU_SPAN, 6, nbytes=(b) * MS, aux=Kind.H2D),
            _row(b + 1, b + 2, Kind.FORWARD, 3), _row(b + 10, b + 40, Kind.GPU_SPAN, 3, nbytes=(b + 1) * MS, aux=Kind.FORWARD),
            _row(b + 2, b + 3, Kind.BACKWARD, 3), _row(b + 40, b + 60, Kind.GPU_SPAN, 3, nbytes=(b + 2) * MS, aux=Kind.BACKWARD),
            _row(b + 3, b + 4, Kind.COLL, 2, 5, seq=s), _row(b + 50, b + 80, Kind.GPU_SPAN, 2, 5, seq=s, nbytes=(b + 3) * MS, aux=Kind.COLL),
            _row(b + 80, b + 100, Kind.INPUT_WAIT, 4),
        ]  # fmt: skip
    ev = _ev(rows)
    ev = ev[np.argsort(ev["t0_ns"], kind="stable")]
    _write(tmp_path / "rank-00000.h5", ev, strings)
    run = load_run(tmp_path)
    g = gpu_breakdown(run)
    assert g is not None
    (d,) = g["per_rank"]
    assert d["steps"] == 2 and d["window_s"] == pytest.approx(0.2)
    assert d["kernels_s"] == pytest.approx(0.1) and d["h2d_s"] == pytest.approx(0.02)
    assert d["nccl_s"] == pytest.approx(0.04) and d["idle_input_s"] == pytest.approx(0.04)
    assert d["idle_other_s"] == pytest.approx(0.0, abs=1e-9)
    assert [s["kernels_s"] for s in g["per_step"]] == pytest.approx([0.05, 0.05])
    assert g["share"]["kernels"] == pytest.approx(0.5)
    # the collective took its GPU span at load: arrival 50 ms into its step, exit 80
    c = run.events[run.events["kind"] == Kind.COLL]
    assert (c["t0_ns"] % (100 * MS)).tolist() == [50 * MS, 50 * MS]


def test_the_gpu_view_takes_the_peak_at_the_configured_precision(tmp_path: Path) -> None:
    """The report's GPU view (throughput against the device's peak) reads the analysis's own
    ``[analyze.gpu_underutilized]`` settings, as the detector does: it read a config nobody set,
    so ``precision = "fp32"`` (or another ``gpus_file``) changed the finding and not the view
    beside it. A FAKE device name: no GPU here, the view reads the rank file's ``gpu_names``."""
    from distdiag.pipeline import analyze_run
    from distdiag.render import render
    from distdiag.run import load_run
    from distdiag.shim.writer import write_rank_file

    strings = ["", "optimizer_step", "Model"]
    rows = [_row(0, 0, Kind.SHIM)]
    for s in range(4):  # steps of 100 ms: 60 ms of forward kernels, 1e12 FLOP each
        b = 100 * s
        rows.append((int(b * MS), int(b * MS), Kind.STEP, 1, 0, -1, -1, 0, 0, 0, 0, 1e12))
        if s < 3:
            rows += [_row(b + 1, b + 2, Kind.FORWARD, 2), _row(b + 10, b + 70, Kind.GPU_SPAN, 2, nbytes=(b + 1) * MS, aux=Kind.FORWARD)]
    ev = _ev(rows)
    ev = ev[np.argsort(ev["t0_ns"], kind="stable")]
    attrs: dict[str, Any] = {"rank": 0, "world_size": 1, "cuda_timing": "on: test", "gpu_names": '{"0": "FAKE NVIDIA H200"}'}
    write_rank_file(tmp_path / "rank-00000.h5", attrs, ev, strings)
    got = {}
    for precision in ("bf16", "fp32"):
        cfg = Config()
        cfg.sections.setdefault("gpu_underutilized", {})["precision"] = precision
        rep = analyze_run(load_run(tmp_path), cfg)
        (d,) = rep.to_json()["breakdown"]["gpu"]["per_rank"]
        got[precision] = (d["device"], d["peak_tflops"], d["mfu"])
        assert f"of the {d['device']}'s peak" in render(rep, "text")
    # configs/gpus.toml: H200 SXM, 989 TFLOP/s bf16, 67 fp32; 1e12 FLOP a 100 ms step: 10 TFLOP/s
    assert got == {"bf16": ("H200 SXM", 989, pytest.approx(10 / 989, rel=1e-3)),
                   "fp32": ("H200 SXM", 67, pytest.approx(10 / 67, rel=1e-3))}


def test_an_old_rank_file_still_loads(tmp_path: Path) -> None:
    """Written before GPU spans and the NVML columns of issue 22: the old 10-column /gpu table."""
    import h5py

    from distdiag.run import load_run

    ev = _ev([_row(0, 1, Kind.SHIM), _row(1, 5, Kind.FORWARD, 1), _row(5, 9, Kind.COLL, 2, 3, seq=0)])
    _write(tmp_path / "rank-00000.h5", ev, ["", "Model", "all_reduce", "default"], timed=False)
    old = np.dtype([(n, GPU_DTYPE[n]) for n in GPU_DTYPE.names[:10]])  # type: ignore[index]
    rows = np.zeros(2, old)
    rows["t_ns"], rows["sm_util_pct"] = [2 * MS, 4 * MS], [50, 60]
    with h5py.File(tmp_path / "rank-00000.h5", "a") as f:
        del f["gpu"]
        f.create_dataset("gpu", data=rows, maxshape=(None,), chunks=(16,))
    run = load_run(tmp_path)
    assert run.gpu["sm_util_pct"].tolist() == [50, 60] and (run.gpu["throttle_reasons"] == 0).all()
    assert len(run.events) == 3 and not run.warnings
    from distdiag.gpu_timeline import gpu_breakdown

    assert gpu_breakdown(run) is None


_SAMPLE = """
import json, time
from types import SimpleNamespace
from distdiag.shim.hooks import nvml
rows, attrs = [], {}
s = nvml.start_sampler(SimpleNamespace(gpu_interval_s=0.02), rows.append, attrs.__setitem__, 0, 1, {})
time.sleep(0.15)
if s: s.stop()
t0 = time.perf_counter()
for _ in range(200):
    s.sample()
per = (time.perf_counter() - t0) / 200
r = [dict(zip(x.dtype.names, x.tolist())) for b in rows for x in b]
print(json.dumps({"attrs": attrs, "rows": r, "per_sample_s": per}))
"""


def _sampler(env: dict[str, str]) -> dict[str, Any]:
    e = dict(os.environ, FAKE_NVML_GPUS="1", PYTHONPATH=os.pathsep.join([str(REPO / "tests" / "fake_pynvml"), str(REPO)]), **env)
    p = subprocess.run([sys.executable, "-c", _SAMPLE], capture_output=True, text=True, timeout=120, env=e)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout)  # type: ignore[no-any-return]


def test_nvml_throttle_temperature_and_xid() -> None:
    d = _sampler({"FAKE_NVML_THROTTLE": "64", "FAKE_NVML_TEMP": "83", "FAKE_NVML_XID": "79"})
    rows = d["rows"]
    assert all(r["throttle_reasons"] == 64 and r["temp_c"] == 83 for r in rows)
    assert [r["xid"] for r in rows].count(79) == 1 and all(r["xid"] in (0, 79) for r in rows)  # reported once
    assert d["per_sample_s"] < 0.01  # 11 calls of the fake; the real cost is measured by benchmarks/gpu_check.py


def test_nvml_a_missing_or_failing_call_loses_its_metric_only() -> None:
    d = _sampler({"FAKE_NVML_MISSING": "nvmlDeviceGetCurrentClocksEventReasons,nvmlEventSetCreate",
                  "FAKE_NVML_FAIL_CALLS": "nvmlDeviceGetTemperature,nvmlDeviceGetPowerUsage"})  # fmt: skip
    for r in d["rows"]:
        assert r["throttle_reasons"] == -1 and r["xid"] == -1  # neither readable: said so, not 0
        assert np.isnan(r["temp_c"]) and np.isnan(r["power_w"])
        assert r["sm_util_pct"] == 97 and r["sm_clock_mhz"] == 1755 and r["pcie_tx_bytes_per_s"] == 1000 * 1024
    assert d["attrs"]["gpu_sampler"].startswith("on:")


def test_timer_rows_reach_the_rank_file_on_the_flusher(tmp_path: Path) -> None:
    """One process under distdiag.wrap: a forward on the fake GPU; the file's GPU_SPAN row and attrs."""
    job = tmp_path / "job.py"
    job.write_text(
        "import sys, time\n"
        f"sys.path.insert(0, {str(REPO / 'tests' / 'fake_cuda')!r})\n"
        "import torch, fake_cuda\n"
        "from distdiag.shim.hooks import cuda_events\n"
        "cuda_events.use_fake(fake_cuda, fake_cuda.device_of)\n"
        "fake_cuda.current_stream()  # CUDA initialized, as by model.cuda()\n"
        "class M(torch.nn.Module):\n"
        "    def forward(self, x):\n"
        "        fake_cuda.kernel(30)\n"
        "        return x\n"
        "M()(torch.ones(1))\n"
        "fake_cuda.synchronize()\n"
        "time.sleep(0.5)\n"
        "print(sorted(fake_cuda.query_threads))\n"
    )
    env = dict(os.environ, DISTDIAG_DIR=str(tmp_path / "run"), DISTDIAG_HOOKS="fileio=0", DISTDIAG_FLUSH_INTERVAL_S="0.1")
    for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(v, None)
    p = subprocess.run([sys.executable, "-m", "distdiag.wrap", str(job)], capture_output=True, text=True, timeout=120,
                       env=env, cwd=tmp_path)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip() == "['distdiag-flusher']"
    import h5py

    (f,) = (tmp_path / "run").glob("rank-*.h5")
    with h5py.File(f, "r") as h:
        assert h.attrs["cuda_timing"].startswith("on: FAKE CUDA")
        ev = h["events"][:]
    (span,) = ev[ev["kind"] == Kind.GPU_SPAN]
    (fwd,) = ev[ev["kind"] == Kind.FORWARD]
    assert span["aux"] == Kind.FORWARD and span["nbytes"] == fwd["t0_ns"] and span["name_id"] == fwd["name_id"]
    assert 25 * MS < span["t1_ns"] - span["t0_ns"] < 60 * MS
    assert span["t0_ns"] >= fwd["t0_ns"] - 2 * MS  # the GPU starts the phase after its CPU launched it


def test_gpu_breakdown_by_blocks_of_ranks_is_the_whole_sweep(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three ranks with different spans, swept in one block and one rank a block: the same numbers."""
    from distdiag import gpu_timeline
    from distdiag.run import load_run

    strings = ["", "optimizer_step", "Model", "DataLoader.__next__"]
    for r in range(3):
        rows = [_row(0, 0, Kind.SHIM)]
        for s in range(4):
            b = 100 * s
            rows.append(_row(b, b, Kind.STEP, 1))
            if s < 3:
                rows += [_row(b + 1, b + 2, Kind.FORWARD, 2),
                         _row(b + 5 + 10 * r, b + 50 + 5 * r, Kind.GPU_SPAN, 2, nbytes=(b + 1) * MS, aux=Kind.FORWARD),
                         _row(b + 60, b + 60 + 10 * (r + 1), Kind.INPUT_WAIT, 3)]  # fmt: skip
        ev = _ev(rows)
        ev = ev[np.argsort(ev["t0_ns"], kind="stable")]
        from distdiag.shim.writer import write_rank_file

        write_rank_file(tmp_path / f"rank-{r:05d}.h5", {"rank": r, "world_size": 3, "cuda_timing": "on: test"}, ev, strings)
    whole = gpu_timeline._gpu_breakdown(load_run(tmp_path), Config())
    monkeypatch.setattr(gpu_timeline, "BLOCK_BOUNDARIES", 1)
    apart = gpu_timeline._gpu_breakdown(load_run(tmp_path), Config())
    assert whole is not None and whole == apart
    k = [d["kernels_s"] for d in whole["per_rank"]]
    assert k == pytest.approx([0.135, 0.12, 0.105])  # 45, 40, 35 ms a step, 3 steps
    assert [d["idle_input_s"] for d in whole["per_rank"]] == pytest.approx([0.03, 0.06, 0.09])


def test_crafted_gpu_spans_are_untrusted_input(tmp_path: Path) -> None:
    """A run dir is untrusted: GPU_SPAN rows that join nothing, run backwards, name kinds that do
    not exist or claim seqs never seen change nothing and break nothing (text and JSON reports)."""
    from distdiag.pipeline import analyze
    from distdiag.render.text import TextRenderer

    strings = ["", "optimizer_step", "all_reduce", "default", "Model\n\x1b[31mVERDICT: healthy"]
    rows = [_row(0, 0, Kind.SHIM), _row(1, 1, Kind.STEP, 1), _row(2, 3, Kind.COLL, 2, 3, seq=0), _row(4, 5, Kind.FORWARD, 4),
            _row(9, 9, Kind.STEP, 1), _row(10, 11, Kind.COLL, 2, 3, seq=1), _row(20, 20, Kind.STEP, 1),
            _row(3, 2.5, Kind.GPU_SPAN, 2, 3, seq=0, nbytes=2 * MS, aux=Kind.COLL),  # backwards: not joined
            _row(3, 4, Kind.GPU_SPAN, 2, 3, seq=7, nbytes=10 * MS, aux=Kind.COLL),  # seq never seen
            _row(3, 4, Kind.GPU_SPAN, 4, 0, seq=-1, nbytes=4 * MS, aux=250),  # a kind that does not exist
            _row(4, 8, Kind.GPU_SPAN, 4, 0, seq=-1, nbytes=-5, aux=Kind.FORWARD),  # a key of nothing
            _row(12, 19, Kind.GPU_SPAN, 2, 3, seq=1, nbytes=10 * MS, aux=Kind.COLL)]  # fmt: skip
    ev = _ev(rows)
    ev = ev[np.argsort(ev["t0_ns"], kind="stable")]
    _write(tmp_path / "rank-00000.h5", ev, strings)
    rep = analyze(tmp_path)
    c = rep.run.events[rep.run.events["kind"] == Kind.COLL]
    assert (c["t0_ns"] // MS).tolist() == [2, 12]  # only the valid span joined
    assert rep.run.ranks[0].gpu_timed_collectives == 1
    text = TextRenderer(color=False).render(rep)
    assert "\x1b" not in text and "GPU timeline" in text
    js = json.dumps(rep.to_json())
    assert rep.to_json()["breakdown"]["gpu"]["per_rank"][0]["kernels_s"] >= 0 and js


def test_h2d_copy_gives_the_copies_rate_on_the_gpu(tmp_path: Path) -> None:
    """10 steps of 100 ms, each a 100 MB copy the CPU waits 20 ms for, 10 ms of it on the bus
    (the copy's GPU span): the evidence gives the bus's 10 GB/s next to the CPU rows' 5."""
    from distdiag.pipeline import analyze

    strings = ["", "optimizer_step", "Tensor.to"]
    rows = [_row(0, 0, Kind.SHIM)]
    for s in range(11):
        b = 100 * s
        rows.append(_row(b, b, Kind.STEP, 1))
        if s < 10:
            rows += [_row(b + 10, b + 30, Kind.H2D, 2, nbytes=100_000_000),
                     _row(b + 15, b + 25, Kind.GPU_SPAN, 2, nbytes=(b + 10) * MS, aux=Kind.H2D)]  # fmt: skip
    ev = _ev(rows)
    _write(tmp_path / "rank-00000.h5", ev[np.argsort(ev["t0_ns"], kind="stable")], strings)
    rep = analyze(tmp_path)
    (f,) = [f for f in rep.findings if f.kind == "h2d_copy"]
    e = f.evidence
    assert e["achieved_gb_per_s"] == pytest.approx(5.0) and e["gpu_copies"] == 10
    assert e["gpu_copy_s"] == pytest.approx(0.1) and e["gpu_achieved_gb_per_s"] == pytest.approx(10.0)
    assert "pageable" not in f.advice  # the bus's own 10 GB/s, not the CPU rows' 5
