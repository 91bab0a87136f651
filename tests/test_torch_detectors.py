"""input_bound, h2d_copy and gpu_underutilized against simulated PyTorch runs with a known truth.

The simulation writes real rank files through the shim's writer: per
iteration each rank waits ``input_ms`` on the loader, copies for ``h2d_ms``,
runs forward and backward (posting the DDP bucket all-reduce half-way through
backward, which completes ``xfer_ms`` after the last rank posted it), steps the
optimizer and marks the step (``value`` = the step's FLOPs). Every rank leaves
the iteration when the bucket completes, as DDP does. The truth is exact:
removing a cause that every rank pays equally saves ``iters * its ms``.

(Real-process tests of the same detectors are in test_torch_ddp.py; H2D and
NVML cannot happen for real on a CPU-only machine, so these simulated runs are
where their detectors meet a positive case.)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import numpy as np
import pytest

from distdiag.config import load_config
from distdiag.pipeline import analyze
from distdiag.schema import EVENT_DTYPE, GPU_DTYPE, Kind
from distdiag.shim.writer import write_rank_file

MS = 1_000_000


def make_torch_run(
    run_dir: Path,
    world: int = 4,
    iters: int = 20,
    input_ms: Sequence[float] | float = 0.0,
    h2d_ms: float = 0.0,
    h2d_bytes: int = 0,
    compute_ms: Sequence[float] | float = 30.0,
    xfer_ms: float = 2.0,
    startup_ms: float = 200.0,
    flops_per_step: float = 0.0,
    gpu: dict[str, float] | None = None,
    gpu_name: str = "NVIDIA H100 80GB HBM3",
) -> float:
    """Write the run; return its wall-clock in seconds."""
    run_dir.mkdir(parents=True, exist_ok=True)
    inp = np.broadcast_to(np.asarray(input_ms, float), (world,))
    comp = np.broadcast_to(np.asarray(compute_ms, float), (world,))
    strings = ["", "DataLoader.__next__", "Tensor.to", "DistributedDataParallel", "Tensor.backward", "SGD",
               "optimizer_step", "ddp_bucket_allreduce", "ddp0:default", "step", "torch.float32"]  # fmt: skip
    sid = {s: i for i, s in enumerate(strings)}
    rows: list[list[tuple]] = [[] for _ in range(world)]
    T = np.full(world, int(startup_ms * MS), np.int64)  # each rank's own position in time
    for r in range(world):
        rows[r].append((0, int(T[r]), Kind.SHIM, 0, 0, -1, -1, 0, 0, 0, 0, 0.0))
    for i in range(iters):
        t = T.copy()
        t_in = t + (inp * MS).astype(np.int64)
        t_h2d = t_in + int(h2d_ms * MS)
        c = comp * MS
        t_fwd = t_h2d + (c / 3).astype(np.int64)
        comp_end = t_fwd + (2 * c / 3).astype(np.int64)
        arrive = t_fwd + (c / 3).astype(np.int64)  # the bucket is ready half-way through backward
        done = int(arrive.max() + xfer_ms * MS)  # ... and completes once the last rank posted it
        for r in range(world):
            bwd_end = max(int(comp_end[r]), done)  # DDP's backward waits for its buckets
            opt_end = bwd_end + 1 * MS
            ev = rows[r]
            if inp[r] > 0:
                ev.append((int(t[r]), int(t_in[r]), Kind.INPUT_WAIT, sid["DataLoader.__next__"], 0, -1, -1, 0, 0, 0, 0, 0.0))
            if h2d_ms > 0:
                ev.append((int(t_in[r]), int(t_h2d[r]), Kind.H2D, sid["Tensor.to"], 0, -1, -1, h2d_bytes, 0, 0, 0, 0.0))
            ev.append((int(t_h2d[r]), int(t_fwd[r]), Kind.FORWARD, sid["DistributedDataParallel"], 0, -1, -1, 0, 0, 0, 0, 0.0))
            ev.append((int(t_fwd[r]), bwd_end, Kind.BACKWARD, sid["Tensor.backward"], 0, -1, -1, 0, 0, 0, 0, 0.0))
            ev.append((int(arrive[r]), done, Kind.COLL_ASYNC, sid["ddp_bucket_allreduce"], sid["ddp0:default"], i, -1,
                       1 << 20, sid["torch.float32"], 0, 1, 0.0))  # fmt: skip
            ev.append((bwd_end, opt_end, Kind.OPTIMIZER, sid["SGD"], 0, -1, -1, 0, 0, 0, 0, 0.0))
            ev.append((opt_end, opt_end, Kind.STEP, sid["optimizer_step"], 0, -1, -1, 0, 0, 0, 0, 0.0))
            if flops_per_step:
                ev.append((opt_end, opt_end, Kind.STEP, sid["step"], 0, -1, -1, 8, 0, 0, 0, flops_per_step))
            T[r] = opt_end
    end = int(T.max()) + 50 * MS
    for r in range(world):
        ev = np.array(sorted(rows[r]), dtype=EVENT_DTYPE)
        g = None
        attrs: dict[str, object] = {"rank": r, "world_size": world, "host": "node0", "job_id": "sim", "launch_id": "sim",
                                    "mono_ns_at_start": 0, "end_mono_ns": end, "last_flush_mono_ns": end}  # fmt: skip
        if gpu is not None:
            ts = np.arange(int(startup_ms * MS), end, 100 * MS)
            g = np.zeros(len(ts), GPU_DTYPE)
            g["t_ns"] = ts
            g["gpu"] = r
            g["sm_util_pct"] = gpu["sm"]
            g["mem_util_pct"] = gpu["mem"]
            attrs["gpu_names"] = json.dumps({str(r): gpu_name})
            attrs["gpu_sampler"] = "on: 1 GPU(s) every 0.1 s"
        write_rank_file(run_dir / f"rank-{r:05d}.h5", attrs, ev, strings, gpu=g)
    return end / 1e9


def _find(report, kind: str):  # type: ignore[no-untyped-def]
    return [f for f in report.findings if f.kind == kind]


# -- input_bound ------------------------------------------------------------------------------------
def test_input_bound_every_rank_waits_cost_is_the_wait(tmp_path: Path) -> None:
    make_torch_run(tmp_path, iters=20, input_ms=40.0, compute_ms=30.0)
    rep = analyze(tmp_path)
    f = _find(rep, "input_bound")
    assert f, [x.kind for x in rep.findings]
    assert rep.findings[0].kind == "input_bound"
    assert f[0].cost_s == pytest.approx(20 * 0.040, rel=0.05)
    assert f[0].ranks == [0, 1, 2, 3]


def test_input_bound_one_rank_waits_others_wait_for_it_at_the_bucket(tmp_path: Path) -> None:
    # rank 1's loader is slow; the others wait for it in the all-reduce: on the critical path
    make_torch_run(tmp_path, iters=20, input_ms=[0, 40, 0, 0], compute_ms=30.0)
    f = _find(analyze(tmp_path), "input_bound")
    assert f and f[0].cost_s == pytest.approx(20 * 0.040, rel=0.1)
    assert f[0].ranks == [1]


def test_input_wait_hidden_behind_a_slower_rank_costs_nothing(tmp_path: Path) -> None:
    # rank 0 waits 20 ms on input, but rank 3 computes 40 ms longer: removing the wait saves nothing
    make_torch_run(tmp_path, iters=20, input_ms=[20, 0, 0, 0], compute_ms=[30, 30, 30, 70])
    assert not _find(analyze(tmp_path), "input_bound")


def test_input_bound_silent_on_a_fast_loader(tmp_path: Path) -> None:
    make_torch_run(tmp_path, iters=20, input_ms=0.3, compute_ms=30.0)
    assert not _find(analyze(tmp_path), "input_bound")


@pytest.mark.parametrize("share, expected", [(0.03, True), (0.012, False)])
def test_input_bound_threshold(tmp_path: Path, share: float, expected: bool) -> None:
    # wall ~= startup + iters * (input + compute + ~4 ms): choose input to be `share` of it
    iters, comp, start = 20, 30.0, 200.0
    per_iter = comp + 2 + 1 + 1
    inp = share * (start + 50 + iters * per_iter) / (iters * (1 - share))
    wall = make_torch_run(tmp_path, iters=iters, input_ms=inp, compute_ms=comp, startup_ms=start)
    f = _find(analyze(tmp_path), "input_bound")
    assert bool(f) is expected, (inp, wall, f)
    if f:
        assert f[0].cost_s / wall == pytest.approx(share, rel=0.1)


# -- h2d_copy --------------------------------------------------------------------------------------
def test_h2d_copy_positive_and_pageable_hint(tmp_path: Path) -> None:
    make_torch_run(tmp_path, iters=20, h2d_ms=25.0, h2d_bytes=50_000_000, compute_ms=30.0)
    rep = analyze(tmp_path)
    f = _find(rep, "h2d_copy")
    assert f and rep.findings[0].kind == "h2d_copy"
    assert f[0].cost_s == pytest.approx(20 * 0.025, rel=0.05)
    assert f[0].evidence["achieved_gb_per_s"] == pytest.approx(2.0, rel=0.01)  # 50 MB in 25 ms
    assert "pageable" in f[0].advice


def test_h2d_copy_silent_when_small(tmp_path: Path) -> None:
    make_torch_run(tmp_path, iters=20, h2d_ms=0.2, h2d_bytes=5_000_000, compute_ms=30.0)
    assert not _find(analyze(tmp_path), "h2d_copy")


@pytest.mark.parametrize("share, expected", [(0.03, True), (0.012, False)])
def test_h2d_copy_threshold(tmp_path: Path, share: float, expected: bool) -> None:
    iters, comp, start = 20, 30.0, 200.0
    ms = share * (start + 50 + iters * (comp + 4)) / (iters * (1 - share))
    wall = make_torch_run(tmp_path, iters=iters, h2d_ms=ms, h2d_bytes=1 << 20, compute_ms=comp, startup_ms=start)
    f = _find(analyze(tmp_path), "h2d_copy")
    assert bool(f) is expected
    if f:
        assert f[0].cost_s / wall == pytest.approx(share, rel=0.1)


# -- gpu_underutilized -------------------------------------------------------------------------------
# H100 SXM bf16 peak (configs/gpus.toml): 989 TFLOP/s. A step lasts ~34 ms here.
STEP_S = 0.034


def _flops_for(mfu: float) -> float:
    return mfu * 989e12 * STEP_S


def test_gpu_busy_but_slow_is_flagged_with_memory_bound_advice(tmp_path: Path) -> None:
    make_torch_run(tmp_path, iters=30, compute_ms=30.0, flops_per_step=_flops_for(0.05), gpu={"sm": 98, "mem": 80})
    f = _find(analyze(tmp_path), "gpu_underutilized")
    assert f, "busy GPUs at 5% of peak must be flagged"
    ev = f[0].evidence
    assert ev["memory_bound"] is True
    mfu = ev["per_rank"][0]["mfu"]
    assert mfu == pytest.approx(0.05, rel=0.1)
    assert "batch size" in f[0].advice
    # cost: the step time at a 40% target would shrink by 1 - 0.05/0.4
    assert f[0].cost_s == pytest.approx(29 * STEP_S * (1 - mfu / 0.4), rel=0.1)


def test_gpu_underutilized_not_memory_bound_gets_kernel_advice(tmp_path: Path) -> None:
    make_torch_run(tmp_path, iters=30, compute_ms=30.0, flops_per_step=_flops_for(0.05), gpu={"sm": 98, "mem": 10})
    f = _find(analyze(tmp_path), "gpu_underutilized")
    assert f and f[0].evidence["memory_bound"] is False and "batch size" not in f[0].advice


def test_gpu_efficient_or_idle_is_not_flagged(tmp_path: Path) -> None:
    make_torch_run(tmp_path / "a", iters=30, flops_per_step=_flops_for(0.45), gpu={"sm": 98, "mem": 60})
    assert not _find(analyze(tmp_path / "a"), "gpu_underutilized")
    # NVML says idle: this is not the "utilization lies" case (input_bound & co. explain idle GPUs)
    make_torch_run(tmp_path / "b", iters=30, flops_per_step=_flops_for(0.05), gpu={"sm": 30, "mem": 10})
    assert not _find(analyze(tmp_path / "b"), "gpu_underutilized")


@pytest.mark.parametrize("mfu, expected", [(0.22, True), (0.28, False)])
def test_gpu_underutilized_threshold(tmp_path: Path, mfu: float, expected: bool) -> None:
    # default max_mfu = 0.25
    make_torch_run(tmp_path, iters=30, flops_per_step=_flops_for(mfu), gpu={"sm": 95, "mem": 30})
    assert bool(_find(analyze(tmp_path), "gpu_underutilized")) is expected


def test_gpu_peak_override_from_config(tmp_path: Path) -> None:
    make_torch_run(tmp_path, iters=30, flops_per_step=_flops_for(0.45), gpu={"sm": 98, "mem": 60}, gpu_name="Mystery GPU")
    assert not _find(analyze(tmp_path), "gpu_underutilized")  # unknown device: no peak, no claim
    cfgf = tmp_path / "site.toml"
    cfgf.write_text("[analyze.gpu_underutilized]\npeak_tflops = 5000.0\n")
    f = _find(analyze(tmp_path, load_config(cfgf)), "gpu_underutilized")
    assert f and f[0].evidence["per_rank"][0]["peak_tflops"] == 5000.0
