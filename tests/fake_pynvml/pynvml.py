"""A FAKE ``pynvml`` for machines without a GPU. NOT NVIDIA's library.

Tests put ``tests/fake_pynvml`` first on ``PYTHONPATH`` so that ``import
pynvml`` finds this module instead of nvidia-ml-py. It implements only the
calls distdiag's sampler makes, with the same names, units and error
behaviour (``NVMLError_LibraryNotFound`` from ``nvmlInit``), and returns
scripted values set through environment variables:

``FAKE_NVML_FAIL``      ``library_not_found`` -> nvmlInit raises NVMLError_LibraryNotFound
``FAKE_NVML_GPUS``      device count (default 2)
``FAKE_NVML_NAME``      device name (default "FAKE NVIDIA H100 80GB HBM3")
``FAKE_NVML_SM_UTIL``   / ``FAKE_NVML_MEM_UTIL``: utilization percentages (default 97 / 35)
``FAKE_NVML_NO_NVLINK`` set -> NVLink fields answer NVML_ERROR_NOT_SUPPORTED
``FAKE_NVML_THROTTLE``  clock-event (throttle) reason bits (default 0: none)
``FAKE_NVML_TEMP``      GPU temperature, C (default 45)
``FAKE_NVML_XID``       an XID error number: the event set reports it once (default: none)
``FAKE_NVML_MISSING``   comma-separated function names this "library" lacks (AttributeError, as an
                        old nvidia-ml-py without them)
``FAKE_NVML_FAIL_CALLS`` comma-separated function names that raise NVMLError_NotSupported

Every answer is what the fake was told to say: it measures nothing.
"""

from __future__ import annotations

import os
import time
from types import SimpleNamespace
from typing import Any

FAKE = True

NVML_SUCCESS = 0
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_CLOCK_SM = 1
NVML_PCIE_UTIL_TX_BYTES = 0
NVML_PCIE_UTIL_RX_BYTES = 1
NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX = 138
NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX = 139
NVML_ERROR_TIMEOUT = 10
NVML_TEMPERATURE_GPU = 0
nvmlEventTypeXidCriticalError = 8


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        self.value = value

    def __str__(self) -> str:
        return {12: "NVML Shared Library Not Found", 3: "Not Supported"}.get(self.value, f"NVML error {self.value}")


class NVMLError_LibraryNotFound(NVMLError):
    def __init__(self) -> None:
        super().__init__(NVML_ERROR_LIBRARY_NOT_FOUND)


class NVMLError_Timeout(NVMLError):
    def __init__(self) -> None:
        super().__init__(NVML_ERROR_TIMEOUT)


class NVMLError_NotSupported(NVMLError):
    def __init__(self) -> None:
        super().__init__(NVML_ERROR_NOT_SUPPORTED)


_init = False
calls = 0


_ENV = {k: v for k, v in os.environ.items() if k.startswith("FAKE_NVML_")}  # read once: the fake stays cheap


def _env(name: str, default: str) -> str:
    return _ENV.get(name, default)


def nvmlInit() -> None:
    global _init
    if _env("FAKE_NVML_FAIL", "") == "library_not_found":
        raise NVMLError_LibraryNotFound()
    _init = True


def nvmlShutdown() -> None:
    global _init
    _init = False


def _check() -> None:
    if not _init:
        raise NVMLError(1)  # NVML_ERROR_UNINITIALIZED


def nvmlDeviceGetCount() -> int:
    _check()
    return int(_env("FAKE_NVML_GPUS", "2"))


def nvmlDeviceGetHandleByIndex(i: int) -> Any:
    _check()
    if not 0 <= i < nvmlDeviceGetCount():
        raise NVMLError(2)  # NVML_ERROR_INVALID_ARGUMENT
    return SimpleNamespace(index=i, uuid=f"GPU-fake-{i:04d}")


def nvmlDeviceGetHandleByUUID(uuid: str) -> Any:
    _check()
    for i in range(nvmlDeviceGetCount()):
        if uuid == f"GPU-fake-{i:04d}":
            return nvmlDeviceGetHandleByIndex(i)
    raise NVMLError(13)  # NVML_ERROR_NOT_FOUND


def nvmlDeviceGetIndex(h: Any) -> int:
    return int(h.index)


def nvmlDeviceGetName(h: Any) -> str:
    return _env("FAKE_NVML_NAME", "FAKE NVIDIA H100 80GB HBM3")


def nvmlDeviceGetUtilizationRates(h: Any) -> Any:
    global calls
    calls += 1
    return SimpleNamespace(gpu=int(_env("FAKE_NVML_SM_UTIL", "97")), memory=int(_env("FAKE_NVML_MEM_UTIL", "35")))


def nvmlDeviceGetClockInfo(h: Any, clock: int) -> int:
    return 1755


def nvmlDeviceGetMemoryInfo(h: Any) -> Any:
    return SimpleNamespace(total=80 << 30, used=(20 << 30) + h.index, free=(60 << 30) - h.index)


def nvmlDeviceGetPowerUsage(h: Any) -> int:
    return 350_000  # mW


def nvmlDeviceGetPcieThroughput(h: Any, counter: int) -> int:
    return 1000 if counter == NVML_PCIE_UTIL_TX_BYTES else 2000  # KB/s


def nvmlDeviceGetFieldValues(h: Any, field_ids: list[int]) -> list[Any]:
    # cumulative KiB counters growing at 1 GiB/s in each direction
    kib = int(time.perf_counter_ns() / 1e9 * (1 << 20))
    ret = NVML_ERROR_NOT_SUPPORTED if os.environ.get("FAKE_NVML_NO_NVLINK") else NVML_SUCCESS
    return [SimpleNamespace(fieldId=f, nvmlReturn=ret, value=SimpleNamespace(ullVal=kib)) for f in field_ids]


def nvmlDeviceGetCurrentClocksEventReasons(h: Any) -> int:
    return int(_env("FAKE_NVML_THROTTLE", "0"))


def nvmlDeviceGetTemperature(h: Any, sensor: int) -> int:
    return int(_env("FAKE_NVML_TEMP", "45"))


_xid_sent: set[int] = set()


def nvmlEventSetCreate() -> Any:
    return SimpleNamespace(devices=[])


def nvmlDeviceRegisterEvents(h: Any, types: int, es: Any) -> None:
    es.devices.append(h)


def nvmlEventSetWait_v2(es: Any, timeout_ms: int) -> Any:
    xid = _env("FAKE_NVML_XID", "")
    if xid:
        for h in es.devices:
            if h.index not in _xid_sent:
                _xid_sent.add(h.index)
                return SimpleNamespace(device=h, eventType=nvmlEventTypeXidCriticalError, eventData=int(xid))
    raise NVMLError_Timeout()


def nvmlEventSetFree(es: Any) -> None:
    pass


def _wrap_failing() -> None:
    for name in [n.strip() for n in _env("FAKE_NVML_FAIL_CALLS", "").split(",") if n.strip()]:
        if name in globals():
            def fail(*a: Any, **k: Any) -> Any:
                raise NVMLError_NotSupported()

            globals()[name] = fail
    for name in [n.strip() for n in _env("FAKE_NVML_MISSING", "").split(",") if n.strip()]:
        globals().pop(name, None)


_wrap_failing()
