"""GPU samples from NVML (nvidia-ml-py, ``import pynvml``) on a background thread.

Every ``ShimConfig.gpu_interval_s`` one ``GPU_DTYPE`` row per sampled GPU goes
to ``SESSION.writer.add_gpu``: SM utilization, memory-controller utilization,
SM clock, memory used, power, PCIe tx/rx (NVML reports KB/s; stored as
bytes/s) and NVLink throughput (the sum over links of the data tx+rx counters,
as a rate between two samples), the clock-event ("throttle") reasons as NVML's
bit mask (``nvmlDeviceGetCurrentClocksEventReasons``, or the older
``...ThrottleReasons``; -1 when neither answers), the GPU temperature, and the
last XID error NVML reported since the previous sample (an event set
registered for ``nvmlEventTypeXidCriticalError``, polled with a 0 ms timeout;
0 none, -1 when XID events cannot be read here). Every call is guarded on its
own: a function this nvidia-ml-py lacks, or an NVMLError from one call, loses
that metric only (NaN, or -1 for the integer ones), and it is not asked again.

Cost per sample, per GPU: 11 NVML calls (utilization, SM clock, memory, power,
PCIe tx, PCIe rx, NVLink field values, clock-event reasons, temperature, one
XID poll; the handle is kept). On the fake here ~20 us a sample; on a real
device the two PCIe calls dominate (NVML measures PCIe throughput over a
window, tens of ms on some drivers), all on this background thread, never the
program's. ``benchmarks/gpu_check.py`` measures a sample on a real GPU and
puts the readings next to ``nvidia-smi``'s (not yet run: no GPU where this
was written; tested against ``tests/fake_pynvml``).

Which GPUs: the ones this process can see (``CUDA_VISIBLE_DEVICES``, indices or
UUIDs, else all). When several ranks share a node and each sees every GPU (the
torchrun default), each rank samples only GPU ``local_rank % n``, so a node's
GPUs are sampled once each, not once per rank. The sampled GPUs' names go in the
``gpu_names`` attribute (JSON {index: name}) for the peak-rate table.

No GPU: ``nvmlInit()`` raises (``NVMLError_LibraryNotFound`` without a driver)
or there is no pynvml; the sampler stays off and the rank file's
``gpu_sampler`` attribute says why in one line, e.g.
``off: NVML library not found``. It never raises into the job.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
from typing import Any, Callable

from distdiag.shim.recorder import now_ns

log = logging.getLogger(__name__)

_sampler: Sampler | None = None


def _err_text(e: BaseException) -> str:
    """One line for the report: 'NVML library not found', 'Driver Not Loaded', ..."""
    try:
        s = str(e)
    except Exception:
        s = ""
    return s.strip().splitlines()[0] if s.strip() else type(e).__name__


def _visible(nv: Any, count: int, environ: dict[str, str]) -> list[int]:
    cvd = environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is None:
        return list(range(count))
    out = []
    for tok in (t.strip() for t in cvd.split(",")):
        if not tok:
            continue
        if tok.isdigit():
            i = int(tok)
            if 0 <= i < count:
                out.append(i)
            continue
        try:  # a UUID (GPU-..., MIG-...)
            h = nv.nvmlDeviceGetHandleByUUID(tok)
            out.append(int(nv.nvmlDeviceGetIndex(h)))
        except Exception:
            continue
    return out


def choose_devices(nv: Any, count: int, local_rank: int, local_world: int, environ: dict[str, str]) -> list[int]:
    """NVML indices this rank samples (see the module docstring)."""
    vis = _visible(nv, count, environ)
    if len(vis) > 1 and local_world > 1:
        return [vis[local_rank % len(vis)]]
    return vis


class Sampler:
    """The sampling thread. ``sink`` receives GPU_DTYPE arrays (``Writer.add_gpu``)."""

    def __init__(self, nv: Any, devices: list[int], interval_s: float, sink: Callable[[Any], None]) -> None:
        self.nv = nv
        self.devices = devices
        self.handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in devices]
        self.interval_s = max(0.01, float(interval_s))
        self.sink = sink
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._unsupported: set[str] = set()
        self._nvlink_prev: dict[int, tuple[int, float]] = {}  # gpu -> (t_ns, cumulative bytes)
        self.samples = 0
        self._xid_set: Any = None  # NVML event set for XID errors; None: not readable
        self._xid_last: dict[int, int] = {}  # gpu -> last XID seen since the previous sample
        self._xid_ok = False
        try:
            es = nv.nvmlEventSetCreate()
            for h in self.handles:
                nv.nvmlDeviceRegisterEvents(h, nv.nvmlEventTypeXidCriticalError, es)
            self._xid_set, self._xid_ok = es, True
        except Exception as e:
            log.debug("distdiag: NVML XID events not readable: %s", e)

    def _throttle(self, h: Any) -> float:
        nv = self.nv
        fn = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or nv.nvmlDeviceGetCurrentClocksThrottleReasons
        return float(fn(h))

    def _poll_xid(self) -> None:
        """Drain the XID event set (0 ms timeout each, at most 16 events a sample)."""
        nv = self.nv
        if self._xid_set is None:
            return
        for _ in range(16):
            try:
                d = nv.nvmlEventSetWait_v2(self._xid_set, 0)
            except Exception as e:
                if getattr(e, "value", None) != getattr(nv, "NVML_ERROR_TIMEOUT", 10):
                    log.debug("distdiag: NVML XID poll failed: %s", e)
                    self._xid_set, self._xid_ok = None, False
                return
            try:
                idx = int(nv.nvmlDeviceGetIndex(d.device))
                self._xid_last[idx] = int(d.eventData)
            except Exception:
                continue

    # one metric, NaN when unsupported (and never asked again)
    def _get(self, name: str, fn: Callable[[], float]) -> float:
        if name in self._unsupported:
            return math.nan
        try:
            return float(fn())
        except Exception as e:
            self._unsupported.add(name)
            log.debug("distdiag: NVML %s unsupported: %s", name, e)
            return math.nan

    def _nvlink_bytes(self, h: Any) -> float:
        nv = self.nv
        fields = [nv.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, nv.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX]
        vals = nv.nvmlDeviceGetFieldValues(h, fields)
        total = 0.0
        for v in vals:
            if getattr(v, "nvmlReturn", 0) != 0:
                raise RuntimeError("NVLink field not supported")
            total += float(v.value.ullVal) * 1024.0  # KiB counters
        return total

    def sample(self) -> Any:
        """One row per device, now (a GPU_DTYPE array: the sampler starts after the program's
        own numpy import, see :func:`install`)."""
        import numpy as np

        from distdiag.schema import GPU_DTYPE

        nv = self.nv
        rows = np.zeros(len(self.handles), GPU_DTYPE)
        self._poll_xid()
        for k, (idx, h) in enumerate(zip(self.devices, self.handles)):
            t = now_ns()
            util = None
            if "util" not in self._unsupported:
                try:
                    util = nv.nvmlDeviceGetUtilizationRates(h)
                except Exception:
                    self._unsupported.add("util")
            r = rows[k]
            r["t_ns"] = t
            r["gpu"] = idx
            r["sm_util_pct"] = util.gpu if util is not None else math.nan
            r["mem_util_pct"] = util.memory if util is not None else math.nan
            # (util: one call for both; the other metrics one call each through _get)
            r["sm_clock_mhz"] = self._get("sm_clock", lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM))
            mem = self._get("mem", lambda: nv.nvmlDeviceGetMemoryInfo(h).used)
            r["mem_used_bytes"] = -1 if math.isnan(mem) else int(mem)
            r["power_w"] = self._get("power", lambda: nv.nvmlDeviceGetPowerUsage(h) / 1000.0)
            r["pcie_tx_bytes_per_s"] = self._get("pcie_tx", lambda: nv.nvmlDeviceGetPcieThroughput(h, nv.NVML_PCIE_UTIL_TX_BYTES) * 1024.0)
            r["pcie_rx_bytes_per_s"] = self._get("pcie_rx", lambda: nv.nvmlDeviceGetPcieThroughput(h, nv.NVML_PCIE_UTIL_RX_BYTES) * 1024.0)
            cum = self._get("nvlink", lambda: self._nvlink_bytes(h))
            rate = math.nan
            if not math.isnan(cum):
                prev = self._nvlink_prev.get(idx)
                if prev is not None and t > prev[0]:
                    rate = max(0.0, (cum - prev[1]) * 1e9 / (t - prev[0]))
                self._nvlink_prev[idx] = (t, cum)
            r["nvlink_bytes_per_s"] = rate
            thr = self._get("throttle", lambda: self._throttle(h))
            r["throttle_reasons"] = -1 if math.isnan(thr) else int(thr)
            r["temp_c"] = self._get("temp", lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU))
            r["xid"] = self._xid_last.pop(idx, 0) if self._xid_ok else -1
        self.samples += 1
        return rows

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.sink(self.sample())
            except Exception:
                log.debug("distdiag: GPU sample failed", exc_info=True)
            self._stop.wait(self.interval_s)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="distdiag-nvml", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=max(1.0, 2 * self.interval_s))
        try:  # one last sample so a short job has a row near its end
            self.sink(self.sample())
        except Exception:
            pass


def start_sampler(
    cfg: Any,
    sink: Callable[[Any], None],
    set_attr: Callable[[str, Any], None],
    local_rank: int = 0,
    local_world: int = 1,
    environ: dict[str, str] | None = None,
) -> Sampler | None:
    """Start sampling, or say in ``set_attr('gpu_sampler', ...)`` why not. Never raises."""
    env = dict(os.environ if environ is None else environ)
    try:
        import pynvml as nv
    except Exception as e:
        set_attr("gpu_sampler", f"off: pynvml not importable ({_err_text(e)})")
        return None
    try:
        nv.nvmlInit()
    except Exception as e:
        if getattr(e, "value", None) == 12:  # NVML_ERROR_LIBRARY_NOT_FOUND: no NVIDIA driver here
            set_attr("gpu_sampler", "off: NVML library not found")
        else:
            set_attr("gpu_sampler", f"off: {_err_text(e)}")
        return None
    try:
        count = int(nv.nvmlDeviceGetCount())
        devices = choose_devices(nv, count, local_rank, local_world, env)
        if not devices:
            set_attr("gpu_sampler", f"off: no visible GPU ({count} on the node)")
            return None
        names = {}
        for i in devices:
            n = nv.nvmlDeviceGetName(nv.nvmlDeviceGetHandleByIndex(i))
            names[str(i)] = n.decode() if isinstance(n, bytes) else str(n)
        s = Sampler(nv, devices, getattr(cfg, "gpu_interval_s", 1.0), sink)
        set_attr("gpu_names", json.dumps(names))
        set_attr("gpu_sampler", f"on: {len(devices)} GPU(s) every {s.interval_s:g} s")
        s.start()
        return s
    except Exception as e:
        set_attr("gpu_sampler", f"off: {_err_text(e)}")
        return None


_starter: threading.Thread | None = None
#: install() ran and uninstall() not since: the numpy callback may start the sampler
_active = False


def _driver_library_loadable() -> bool:
    """Whether libnvidia-ml loads (a failed dlopen takes ~1 ms; importing pynvml ~150 ms)."""
    try:
        import ctypes

        ctypes.CDLL("libnvidia-ml.so.1")
        return True
    except OSError:
        return False
    except Exception:
        return True  # unsure: let pynvml decide


def install(rec: Any, cfg: Any = None) -> None:
    """Start the sampler for the running session once the program has imported numpy.

    Not before: pynvml imports ctypes and loads libnvidia-ml, and a guest loads
    nothing into the program's process before the program's own imports (the
    sampler's rows are numpy arrays too). Every GPU program imports numpy
    (torch, cupy and jax do) within its first seconds; one that never does is
    not sampled, and its file says so (``gpu_sampler``). Then in a background
    thread: importing pynvml and probing for the driver took ~170 ms here
    (ctypes, then a failed dlopen), which the program's import of numpy would
    otherwise pay.
    """
    global _starter, _active
    if _sampler is not None or _starter is not None:
        return
    from distdiag.shim import hooks as _hooks
    from distdiag.shim import session

    sess = session.SESSION
    if sess is None:
        return
    local_world = 1
    for var in ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE"):
        try:  # SLURM_NTASKS_PER_NODE may read "4(x2)"
            local_world = int(os.environ[var].split("(")[0])
            break
        except (KeyError, ValueError):
            continue
    sess.writer.set_attr("gpu_sampler", "off: not started (the program did not import numpy)")

    def start() -> None:
        global _sampler
        try:  # pynvml's and ctypes' imports are the shim's, not the program's file I/O
            rec.mute_thread()
        except Exception:
            pass
        if not _driver_library_loadable():
            # Said now, so that even a job shorter than the import below has the line;
            # the sampler still tries pynvml (which may bring its own library path).
            sess.writer.set_attr("gpu_sampler", "off: NVML library not found")
        _sampler = start_sampler(cfg, sess.writer.add_gpu, sess.writer.set_attr, sess.local_rank, local_world)

    def on_numpy(_np: Any) -> None:
        global _starter
        if _starter is not None or not _active:
            return
        _starter = threading.Thread(target=start, name="distdiag-nvml-start", daemon=True)
        _starter.start()

    _active = True
    _hooks.when_imported("numpy", on_numpy)


def uninstall() -> None:
    global _sampler, _starter, _active
    _active = False
    if _starter is not None:
        _starter.join(timeout=5.0)
        _starter = None
    s, _sampler = _sampler, None
    if s is not None:
        s.stop()
        try:
            s.nv.nvmlShutdown()
        except Exception:
            pass
