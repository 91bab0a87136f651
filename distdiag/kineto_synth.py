"""GPU-shaped PyTorch profiler (Kineto) traces of a synthetic data-parallel job, with their truth.

Used by tests/test_kineto.py and benchmarks/bench_kineto.py (and, for the same events
as a distdiag run, benchmarks/bench_hta.py's converter). One trace JSON per rank, as
``torch.profiler`` writes it on a CUDA/NCCL job: ``distributedInfo``, per step a
``ProfilerStep#i`` annotation, a DataLoader ``__next__`` annotation (the input wait),
an HtoD ``gpu_memcpy`` and compute kernels on stream 7 (each launched by a
``cudaLaunchKernel`` runtime event, linked by ``correlation``), then the gradient
all-reduce as an NCCL kernel on stream 20 with the args recent torch gives it
(``Collective name``, ``Process Group Name``, ``In msg nelems``, ``dtype``,
``Group size``) and its ``record_param_comms`` CPU op.

The model, per step i (true timeline, ns): every rank starts at ``S_i``, waits
``input_ms`` for its batch, copies for ``h2d_ms``, computes ``compute_ms`` (plus
``straggler_ms`` on ``straggler_rank``) in ``kernels`` kernels, and enters the
all-reduce at that end, ``A_ri``; the all-reduce ends at ``max_r A_ri +
transfer_ms`` (+ up to ``exit_jitter_us`` per rank), and the next step starts
``gap_ms`` later. Each rank's trace is written on its own clock: true time +
``offset_ns[r]`` (seconds apart, as unsynchronized nodes are).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import numpy as np


def write_traces(
    out_dir: str | Path, ranks: int = 4, steps: int = 20, compute_ms: float = 40.0, kernels: int = 4,
    transfer_ms: float = 1.0, input_ms: float = 0.0, h2d_ms: float = 0.0, straggler_rank: int = -1,
    straggler_ms: float = 0.0, gap_ms: float = 0.2, exit_jitter_us: float = 20.0, offsets_s: float = 2.0,
    gz: bool = False, seed: int = 0, name: str = "rank{r}.pt.trace.json",
) -> dict[str, Any]:
    """Write one trace per rank into ``out_dir``; returns the truth (offsets, per-step arrivals, costs)."""
    rng = np.random.default_rng(seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ms = 1_000_000
    off = np.zeros(ranks, np.int64)
    off[1:] = (rng.uniform(-offsets_s, offsets_s, ranks - 1) * 1e9).astype(np.int64)
    base = 5_000_000_000_000  # ns: a monotonic clock some days after boot
    work = np.full(ranks, compute_ms * ms, np.float64)
    if 0 <= straggler_rank < ranks:
        work[straggler_rank] += straggler_ms * ms
    jitter = rng.uniform(0, exit_jitter_us * 1e3, (steps, ranks))
    comp_jit = rng.uniform(0, 0.02 * compute_ms * ms, (steps, ranks))  # 2% noise in the work
    s = float(base)
    rows: list[list[dict[str, Any]]] = [[] for _ in range(ranks)]
    corr = [1] * ranks
    arrivals = np.zeros((steps, ranks))
    step_s = np.zeros(steps)
    for i in range(steps):  # per step: the generator is not what is measured
        a0 = s + input_ms * ms + h2d_ms * ms
        arr = a0 + work + comp_jit[i]
        arrivals[i] = arr
        end = arr.max() + transfer_ms * ms
        for r in range(ranks):  # per rank
            o = float(off[r])
            ev = rows[r]
            def us(t: float, o: float = o) -> float:  # the trace's unit, on rank r's clock
                return round((t + o) / 1e3, 3)

            exit_r = end + jitter[i, r]
            ev.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{i}", "pid": 100 + r, "tid": 100 + r,
                       "ts": us(s), "dur": round((exit_r - s) / 1e3, 3), "args": {"External id": i}})  # fmt: skip
            if input_ms > 0:
                ev.append({"ph": "X", "cat": "user_annotation", "pid": 100 + r, "tid": 100 + r,
                           "name": "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__",
                           "ts": us(s), "dur": round(input_ms * 1e3, 3)})  # fmt: skip
            t = s + input_ms * ms
            if h2d_ms > 0:
                ev.append({"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pageable -> Device)", "pid": 0,
                           "tid": 7, "ts": us(t), "dur": round(h2d_ms * 1e3, 3),
                           "args": {"device": 0, "stream": 7, "correlation": corr[r], "bytes": 64 << 20}})  # fmt: skip
                corr[r] += 1
                t += h2d_ms * ms
            k_dur = (arr[r] - t) / kernels
            for k in range(kernels):  # compute kernels
                c = corr[r]
                corr[r] += 1
                ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 100 + r,
                           "tid": 100 + r, "ts": us(s + k * 1000), "dur": 4.0, "args": {"correlation": c}})  # fmt: skip
                ev.append({"ph": "X", "cat": "kernel", "name": "ampere_sgemm_128x64_nn", "pid": 0, "tid": 7,
                           "ts": us(t + k * k_dur), "dur": round(k_dur / 1e3, 3),
                           "args": {"device": 0, "stream": 7, "correlation": c, "grid": [1, 1, 1]}})  # fmt: skip
            c = corr[r]
            corr[r] += 1
            comm_args = {"Collective name": "allreduce", "Process Group Name": "0", "Process Group Description":
                         "default_pg", "In msg nelems": 1 << 20, "Out msg nelems": 1 << 20, "Group size": ranks,
                         "dtype": "Float"}  # fmt: skip
            ev.append({"ph": "X", "cat": "cpu_op", "name": "record_param_comms", "pid": 100 + r, "tid": 100 + r,
                       "ts": us(s + kernels * 1000), "dur": 20.0, "args": dict(comm_args, Seq=i)})  # fmt: skip
            ev.append({"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL", "pid": 0,
                       "tid": 20, "ts": us(arr[r]), "dur": round((exit_r - arr[r]) / 1e3, 3),
                       "args": dict(comm_args, device=0, stream=20, correlation=c)})  # fmt: skip
        step_s[i] = (end - s) / 1e9
        s = end + exit_jitter_us * 1e3 + gap_ms * ms
    n_events = 0
    for r in range(ranks):  # one file per rank
        doc = {"schemaVersion": 1,
               "distributedInfo": {"backend": "nccl", "rank": r, "world_size": ranks},
               "deviceProperties": [{"id": 0, "name": "FAKE GPU (synthetic)", "totalGlobalMem": 85899345920}],
               "host_name": f"node{r // 8}", "displayTimeUnit": "ms", "traceEvents": rows[r]}  # fmt: skip
        n_events += len(rows[r])
        text = json.dumps(doc)
        fname = name.format(r=r) + (".gz" if gz else "")
        if gz:
            (out / fname).write_bytes(gzip.compress(text.encode()))
        else:
            (out / fname).write_text(text)
    late = arrivals.max(axis=1) - np.sort(arrivals, axis=1)[:, -2] if ranks > 1 else np.zeros(steps)
    return {
        "ranks": ranks, "steps": steps, "offset_ns": off.tolist(), "events": n_events,
        "straggler_rank": straggler_rank,
        # what the straggler detector charges: last - second-to-last arrival, first collective left out
        "straggler_cost_s": float(late[1:].sum()) / 1e9 if straggler_rank >= 0 else 0.0,
        "input_cost_s": input_ms * steps / 1e3, "h2d_cost_s": h2d_ms * steps / 1e3,
        "wall_s": float(step_s.sum() + steps * (gap_ms * ms + exit_jitter_us * 1e3) / 1e9),
    }  # fmt: skip
