"""The device check of issue 22: distdiag's GPU timing on a real GPU, against references, in one run.

    python benchmarks/gpu_check.py [--quick] [--out DIR]

Needs one CUDA GPU (an H200 was drawn for it) and torch with CUDA; exits 77
(skipped) without one. Written where no GPU was available: every part of it
was run only as far as its CPU side goes (``tests/fake_cuda``); this script is
what verifies the real path. It prints the numbers and one PASS/FAIL line per
check, and exits 1 if a check fails. Well under 10 minutes on an H200 (most
of it torch's and CUDA's start-up, ~10-20 s a process).

1. **Breakdown vs CUPTI.** A single-GPU training step (bf16 matmuls of
   ``--dim``, a DataLoader whose ``__getitem__`` sleeps ``--loader-ms``, a
   pageable fp32 batch copied host->device each step) run twice: under
   ``distdiag.wrap`` (its ``breakdown.gpu``) and under ``torch.profiler`` with
   CUDA activity (CUPTI: kernels and memcpys, the reference). Both windows run
   from the first to the last ``optimizer.step`` end; in both, a moment is
   kernels if any kernel (distdiag: a forward/backward/optimizer span) covers
   it, else a copy, else idle on input if the CPU is in the loader's
   ``__next__``, else other idle. PASS: kernels, idle-on-input and copies
   shares each within 5 points.
2. **A slow GPU.** Two processes on the one GPU (torchrun, gloo on CUDA
   tensors), rank 1's kernels 3x longer; ``distdiag analyze`` with the GPU
   times (default) and with ``DISTDIAG_COLLECTIVE_TIMES=cpu``. PASS: the
   straggler finding names rank 1 from the GPU times and not from the CPU
   enqueue times.
3. **NVML next to nvidia-smi.** During the wrapped overhead run (4), the
   sampler (every 0.2 s) and ``nvidia-smi --query-gpu`` (every 0.5 s) read the
   GPU; medians side by side, and the sampler's cost per sample (real NVML
   calls, 50 samples in this process). PASS: SM utilization within 15
   points, SM clock within 10%, power within 15%, when both read them.
4. **Overhead.** The same step without loader sleep or copies (data made on
   the GPU, ``loss.item()`` each step), plain and wrapped, by turns
   (``--pairs``). PASS: the wrapped median step time within 2% of plain.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

# -- the jobs (written to files and run as programs) ------------------------------------------
STEP_JOB = r'''
import argparse, json, os, sys, time
import torch
ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--steps", type=int, default=40)
ap.add_argument("--dim", type=int, default=8192)
ap.add_argument("--layers", type=int, default=6)
ap.add_argument("--loader-ms", type=float, default=0.0)
ap.add_argument("--h2d", action="store_true", help="a pageable fp32 batch copied to the GPU each step")
ap.add_argument("--profile", default="", help="write a torch.profiler (CUPTI) trace here")
ap.add_argument("--device", default="cuda")
ns = ap.parse_args()
dev = torch.device(ns.device, 0) if ns.device == "cuda" else torch.device(ns.device)
if ns.device == "cuda":
    torch.cuda.init()
D, L = ns.dim, ns.layers
model = torch.nn.Sequential(*[torch.nn.Linear(D, D, bias=False) for _ in range(L)]).to(dev, torch.bfloat16)
opt = torch.optim.SGD(model.parameters(), lr=1e-6)
batch = torch.randn(D, D) if ns.h2d else torch.zeros(1)  # pageable host memory, made once
class DS(torch.utils.data.Dataset):
    def __len__(self): return ns.steps + 5
    def __getitem__(self, i):
        if ns.loader_ms: time.sleep(ns.loader_ms / 1e3)
        return batch
loader = torch.utils.data.DataLoader(DS(), batch_size=None, num_workers=0)
gpu_x = torch.randn(D, D, device=dev, dtype=torch.bfloat16)
flops = 3 * 2 * D * D * D * L
try:
    import distdiag
except Exception:
    distdiag = None
def run():
    times = []
    for i, x in enumerate(loader):
        t = time.perf_counter()
        xb = x.to(dev).to(torch.bfloat16) if ns.h2d else gpu_x
        loss = model(xb).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        if distdiag is not None: distdiag.step(samples=D, flops=flops)
        times.append(time.perf_counter() - t)
        if prof is not None: prof.step()
    return times
prof = None
if ns.profile:
    from torch.profiler import profile, ProfilerActivity
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ns.device == "cuda" else [])
    with profile(activities=acts) as p:
        prof = p
        times = run()
    p.export_chrome_trace(ns.profile)
else:
    times = run()
json.dump({"step_s": times}, open(ns.out, "w"))
'''

SLOW_JOB = r'''
import argparse, json, os, time
import torch, torch.distributed as dist
ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--steps", type=int, default=30)
ap.add_argument("--dim", type=int, default=4096)
ns = ap.parse_args()
dist.init_process_group("gloo")
r = dist.get_rank()
ap2 = os.environ.get("GPU_CHECK_DEVICE", "cuda")
dev = torch.device(ap2, 0) if ap2 == "cuda" else torch.device(ap2)
a = torch.randn(ns.dim, ns.dim, device=dev, dtype=torch.bfloat16)
g = torch.ones(1 << 20, device=dev)
reps = 30 if r == 1 else 10
dist.barrier()
t0 = time.perf_counter()
for i in range(ns.steps):
    for _ in range(reps):
        a = (a @ a) * 1e-3
    dist.all_reduce(g)
    g.sum().item()
dist.barrier()
json.dump({"loop_s": time.perf_counter() - t0}, open(f"{ns.out}.{r}", "w"))
'''


def _run(cmd: list[str], env: dict[str, str] | None = None, timeout: float = 300, cwd: Path | None = None) -> str:
    e = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), **(env or {}))
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=e, cwd=cwd)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:6])}... exited {p.returncode}:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    return p.stdout


def _analyze(run_dir: Path, times: str = "gpu") -> dict[str, Any]:
    return json.loads(_run([sys.executable, "-m", "distdiag.cli", "analyze", str(run_dir), "--format", "json"],
                           env={"DISTDIAG_COLLECTIVE_TIMES": times}))  # fmt: skip


# -- 1. the breakdown against CUPTI --------------------------------------------------------------
def _union(iv: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(iv):  # one trace: thousands of intervals
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _clip(iv: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    return [(max(a, lo), min(b, hi)) for a, b in iv if b > lo and a < hi]


def _minus(iv: list[tuple[float, float]], cut: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """iv minus cut (both unions)."""
    out = []
    for a, b in iv:
        pieces = [(a, b)]
        for c, d in cut:
            nxt = []
            for x, y in pieces:
                if d <= x or c >= y:
                    nxt.append((x, y))
                    continue
                if c > x:
                    nxt.append((x, c))
                if d < y:
                    nxt.append((d, y))
            pieces = nxt
        out += pieces
    return out


def _total(iv: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in iv)


def cupti_shares(trace: Path) -> dict[str, float]:
    """Kernels / copies / idle-on-input / other-idle shares of the window between the first and
    last optimizer.step ends, from a torch.profiler trace (GPU events on the CPU's timeline)."""
    ev = json.loads(trace.read_text())["traceEvents"]
    x = [e for e in ev if e.get("ph") == "X" and "dur" in e]
    steps = sorted(e["ts"] + e["dur"] for e in x if str(e.get("name", "")).startswith("Optimizer.step#"))
    lo, hi = steps[0], steps[-1]
    kern = _union(_clip([(e["ts"], e["ts"] + e["dur"]) for e in x if e.get("cat") == "kernel"], lo, hi))
    h2d = _union(_clip([(e["ts"], e["ts"] + e["dur"]) for e in x if e.get("cat") == "gpu_memcpy" and "HtoD" in e["name"]],
                       lo, hi))  # fmt: skip
    inp = _union(_clip([(e["ts"], e["ts"] + e["dur"]) for e in x
                        if str(e.get("name", "")).startswith("enumerate(DataLoader)")], lo, hi))  # fmt: skip
    h2d_only = _minus(h2d, kern)
    busy = _union(kern + h2d)
    idle_in = _minus(inp, busy)
    w = hi - lo
    k, c, i = _total(kern) / w, _total(h2d_only) / w, _total(idle_in) / w
    return {"kernels": k, "h2d": c, "idle_input": i, "idle_other": max(0.0, 1 - k - c - i)}


def check_breakdown(tmp: Path, args: argparse.Namespace) -> bool:
    job = tmp / "step_job.py"
    job.write_text(STEP_JOB)
    common = ["--steps", str(args.steps), "--dim", str(args.dim), "--loader-ms", str(args.loader_ms), "--h2d",
              "--device", args.device]  # fmt: skip
    run_dir = tmp / "run_breakdown"
    t = time.perf_counter()
    _run([sys.executable, "-m", "distdiag.wrap", str(job), "--out", str(tmp / "bd_wrapped.json"), *common],
         env={"DISTDIAG_DIR": str(run_dir), "DISTDIAG_HOOKS": "fileio=0"})  # fmt: skip
    rep = _analyze(run_dir)
    trace = tmp / "bd_trace.json"
    _run([sys.executable, str(job), "--out", str(tmp / "bd_prof.json"), "--profile", str(trace), *common])
    ref = cupti_shares(trace)
    g = rep["breakdown"].get("gpu")
    print(f"\n[1] GPU breakdown vs torch.profiler/CUPTI ({time.perf_counter() - t:.0f} s)")
    if g is None:
        print("    FAIL: the wrapped run has no breakdown.gpu (no GPU spans recorded)")
        return False
    d = g["per_rank"][0]
    ok = True
    for c in ("kernels", "idle_input", "h2d", "idle_other"):
        mine = d[f"{c}_share"]
        diff = 100 * (mine - ref[c])
        judged = c != "idle_other"
        ok &= (abs(diff) <= 5.0) if judged else True
        print(f"    {c:<11} distdiag {100 * mine:5.1f}%   CUPTI {100 * ref[c]:5.1f}%   diff {diff:+5.1f} pts"
              + ("" if judged else "   (not judged)"))  # fmt: skip
    for k in ("achieved_tflops", "mfu", "device", "peak_tflops"):
        if k in d:
            print(f"    {k}: {d[k]}")
    print("    " + ("PASS" if ok else "FAIL") + ": kernels, idle-on-input and copies within 5 points of CUPTI")
    return ok


# -- 2. a slow GPU -----------------------------------------------------------------------------
def check_slow_gpu(tmp: Path, args: argparse.Namespace) -> bool:
    job = tmp / "slow_job.py"
    job.write_text(SLOW_JOB)
    run_dir = tmp / "run_slow"
    t = time.perf_counter()
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "distdiag.wrap",
          str(job), "--out", str(tmp / "slow"), "--dim", str(min(args.dim, 4096))], env={"DISTDIAG_DIR": str(run_dir), "DISTDIAG_HOOKS": "fileio=0"})  # fmt: skip
    gpu = _analyze(run_dir, "gpu")
    cpu = _analyze(run_dir, "cpu")

    def straggler(rep: dict[str, Any]) -> tuple[list[int], float]:
        f = [x for x in rep["findings"] if x["kind"] == "straggler"]
        return (f[0]["ranks"], f[0]["cost_s"]) if f else ([], 0.0)

    g_r, g_c = straggler(gpu)
    c_r, c_c = straggler(cpu)
    timed = gpu["breakdown"].get("gpu", {}).get("collectives_gpu_timed", 0)
    print(f"\n[2] two processes on one GPU, rank 1's kernels 3x ({time.perf_counter() - t:.0f} s)")
    print(f"    GPU-side arrivals: straggler ranks {g_r} cost {g_c:.3f} s   ({timed} collective rows GPU-timed)")
    print(f"    CPU enqueue times: straggler ranks {c_r} cost {c_c:.3f} s")
    ok = g_r == [1] and 1 not in c_r
    print("    " + ("PASS" if ok else "FAIL") + ": the GPU timeline names rank 1, the CPU's does not")
    return ok


# -- 3 + 4. overhead, with NVML and nvidia-smi side by side -----------------------------------------
def _smi_poll(stop: threading.Event, out: list[dict[str, float]]) -> None:
    q = "utilization.gpu,utilization.memory,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active"
    while not stop.is_set():
        try:
            p = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader,nounits", "-i", "0"],
                               capture_output=True, text=True, timeout=10)  # fmt: skip
            v = [s.strip() for s in p.stdout.strip().split(",")]
            out.append({"t": time.monotonic(), "sm": float(v[0]), "mem": float(v[1]), "clk": float(v[2]),
                        "pw": float(v[3]), "temp": float(v[4]), "thr": int(v[5], 16) if v[5].startswith("0x") else -1})  # fmt: skip
        except Exception:
            pass
        stop.wait(0.5)


def _median(xs: list[float]) -> float:
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else float("nan")


def check_overhead_and_nvml(tmp: Path, args: argparse.Namespace) -> tuple[bool, bool]:
    job = tmp / "step_job.py"
    job.write_text(STEP_JOB)
    common = ["--steps", str(args.steps + 20), "--dim", str(args.dim), "--device", args.device]
    plain: list[float] = []
    wrapped: list[float] = []
    smi: list[dict[str, float]] = []
    run_dirs = []
    t = time.perf_counter()
    for i in range(args.pairs):  # by turns: plain, wrapped
        o = tmp / f"oh_plain{i}.json"
        _run([sys.executable, str(job), "--out", str(o), *common])
        plain.append(statistics.median(json.loads(o.read_text())["step_s"][10:]))
        o = tmp / f"oh_wrapped{i}.json"
        rd = tmp / f"run_oh{i}"
        run_dirs.append(rd)
        stop = threading.Event()
        th = threading.Thread(target=_smi_poll, args=(stop, smi), daemon=True) if shutil.which("nvidia-smi") else None
        if th is not None:
            th.start()
        _run([sys.executable, "-m", "distdiag.wrap", str(job), "--out", str(o), *common],
             env={"DISTDIAG_DIR": str(rd), "DISTDIAG_HOOKS": "fileio=0", "DISTDIAG_GPU_INTERVAL_S": "0.2"})  # fmt: skip
        if th is not None:
            stop.set()
            th.join(5)
        wrapped.append(statistics.median(json.loads(o.read_text())["step_s"][10:]))
    p, w = statistics.median(plain), statistics.median(wrapped)
    ratio = w / p
    print(f"\n[4] overhead: step time plain vs wrapped, {args.pairs} pairs by turns ({time.perf_counter() - t:.0f} s)")
    print(f"    plain   {', '.join(f'{1e3 * x:.2f}' for x in plain)} ms   median {1e3 * p:.2f} ms")
    print(f"    wrapped {', '.join(f'{1e3 * x:.2f}' for x in wrapped)} ms   median {1e3 * w:.2f} ms   ratio {ratio:.4f}")
    oh_ok = ratio <= 1.02
    print("    " + ("PASS" if oh_ok else "FAIL") + ": wrapped within 2% of plain")

    # 3. NVML: the wrapped runs' samples next to nvidia-smi's readings
    from distdiag.run import load_run

    print("\n[3] NVML sampler next to nvidia-smi (medians over the wrapped runs)")
    rows: dict[str, list[float]] = {k: [] for k in ("sm", "mem", "clk", "pw", "temp", "thr", "xid", "tx", "rx")}
    attr = ""
    for rd in run_dirs:
        r = load_run(rd)
        import h5py

        for info in r.ranks.values():
            with h5py.File(info.path, "r") as f:
                attr = str(f.attrs.get("gpu_sampler", ""))
        gg = r.gpu
        gg = gg[gg["sm_util_pct"] > 0] if len(gg) else gg  # while the steps ran
        for k, c in (("sm", "sm_util_pct"), ("mem", "mem_util_pct"), ("clk", "sm_clock_mhz"), ("pw", "power_w"),
                     ("temp", "temp_c"), ("thr", "throttle_reasons"), ("xid", "xid"), ("tx", "pcie_tx_bytes_per_s"),
                     ("rx", "pcie_rx_bytes_per_s")):  # fmt: skip
            rows[k] += [float(v) for v in gg[c]]
    busy_smi = [s for s in smi if s["sm"] > 0]
    print(f"    sampler: {attr}; {len(rows['sm'])} busy samples; nvidia-smi: {len(busy_smi)} busy readings")
    nv_ok = True
    for k, label, tol in (("sm", "SM util %", ("abs", 15.0)), ("mem", "mem-controller util %", None),
                          ("clk", "SM clock MHz", ("rel", 0.10)), ("pw", "power W", ("rel", 0.15)),
                          ("temp", "temperature C", None)):  # fmt: skip
        a, b = _median(rows[k]), _median([s[k] for s in busy_smi])
        judged = ""
        if tol is not None and a == a and b == b:
            good = abs(a - b) <= tol[1] if tol[0] == "abs" else abs(a - b) <= tol[1] * max(abs(b), 1e-9)
            nv_ok &= good
            judged = "  ok" if good else "  OFF"
        print(f"    {label:<22} sampler {a:9.1f}   nvidia-smi {b:9.1f}{judged}")
    thr = sorted({int(x) for x in rows["thr"]})
    print(f"    throttle reason masks seen: sampler {[hex(x) if x >= 0 else x for x in thr]}, "
          f"nvidia-smi {sorted({hex(int(s['thr'])) for s in busy_smi if s['thr'] >= 0})}")  # fmt: skip
    print(f"    XID values seen: {sorted({int(x) for x in rows['xid']})} (0 none, -1 not readable)")
    print(f"    PCIe tx/rx median: {_median(rows['tx']) / 1e6:.1f} / {_median(rows['rx']) / 1e6:.1f} MB/s")
    try:
        import pynvml

        from distdiag.shim.hooks import nvml

        pynvml.nvmlInit()
        s = nvml.Sampler(pynvml, [0], 1.0, lambda r: None)
        s.sample()
        t0 = time.perf_counter()
        for _ in range(50):
            s.sample()
        which = "the FAKE tests/fake_pynvml" if getattr(pynvml, "FAKE", False) else "real NVML"
        print(f"    cost of one sample ({which}, this process): {1e3 * (time.perf_counter() - t0) / 50:.2f} ms")
    except Exception as e:
        print(f"    cost of one sample: not measured ({type(e).__name__}: {e})")
    if not busy_smi:
        nv_ok = False
        print("    FAIL: nvidia-smi gave no readings while the job ran: nothing to compare with")
    if not rows["sm"]:
        nv_ok = False
        print("    FAIL: no NVML samples (is nvidia-ml-py installed? the sampler said: " + attr + ")")
    print("    " + ("PASS" if nv_ok else "FAIL") + ": SM util within 15 points, clock within 10%, power within 15%")
    return oh_ok, nv_ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="", help="keep the run dirs and traces here (default: a temp dir, removed)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--dim", type=int, default=8192)
    ap.add_argument("--loader-ms", type=float, default=30.0)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="fewer steps, one overhead pair")
    ap.add_argument("--only", default="", help="comma list of checks to run: breakdown,slow,overhead")
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # "cpu": the script's plumbing, no check can pass
    args = ap.parse_args()
    if args.quick:
        args.steps, args.pairs = 20, 1
    try:
        import torch

        os.environ["GPU_CHECK_DEVICE"] = args.device
        if args.device != "cuda":
            print(f"gpu_check: PLUMBING RUN on {args.device}: nothing is timed on a GPU, the checks cannot pass")
        elif not torch.cuda.is_available():
            print("gpu_check: skipped: torch.cuda.is_available() is False (no GPU, or a CPU build of torch)")
            return 77
        else:
            print(f"gpu_check: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    except ImportError:
        print("gpu_check: skipped: no torch")
        return 77
    tmp = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="distdiag-gpu-check-"))
    tmp.mkdir(parents=True, exist_ok=True)
    only = set(filter(None, args.only.split(","))) or {"breakdown", "slow", "overhead"}
    results: dict[str, bool] = {}
    t0 = time.perf_counter()
    for name, fn in (("breakdown", lambda: check_breakdown(tmp, args)), ("slow", lambda: check_slow_gpu(tmp, args))):
        if name in only:
            try:
                results[name] = fn()
            except Exception as e:
                print(f"\n[{name}] FAIL: {type(e).__name__}: {str(e)[-3000:]}")
                results[name] = False
    if "overhead" in only:
        try:
            results["overhead"], results["nvml"] = check_overhead_and_nvml(tmp, args)
        except Exception as e:
            print(f"\n[overhead] FAIL: {type(e).__name__}: {str(e)[-3000:]}")
            results["overhead"] = results["nvml"] = False
    print(f"\ngpu_check: {time.perf_counter() - t0:.0f} s; " + ", ".join(f"{k} {'PASS' if v else 'FAIL'}" for k, v in results.items()))
    if not args.out:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
