"""A FAKE ``torch.cuda`` for machines without a GPU. NOT NVIDIA's CUDA, NOT torch's.

It stands in for the few parts of ``torch.cuda`` that distdiag's shim uses to
time GPU spans (``distdiag.shim.hooks.cuda_events``): ``is_available``,
``is_initialized``, ``current_device``, ``current_stream``, ``Stream`` and
``Event(enable_timing=True)`` with ``record``/``query``/``elapsed_time``.
Nothing here measures a GPU: a fake device is a thread per stream that runs
what is queued on the stream in order, in real time:

* ``kernel(ms)``: a "kernel" of ``ms`` milliseconds (a sleep on the stream's
  thread); the CPU returns at once, as from a real launch;
* ``Event.record(stream)``: the event completes when the stream's thread
  reaches it (on an idle stream: at once, in the recording thread), stamped
  with ``time.perf_counter_ns() + CLOCK_OFFSET_NS`` (the
  fake GPU's clock is offset from the host's, as a real one is: the shim's
  anchoring must recover host times);
* a collective: :func:`install` makes ``ProcessGroup.allreduce`` queue a
  device-side rendezvous on the current stream before the real (gloo, CPU)
  call, so a rank's "GPU" finishes an all-reduce only once every rank's
  "GPU" reached it (files in ``FAKE_CUDA_DIR``, one per rank and call), as
  NCCL's kernel does; then ``FAKE_CUDA_COLL_MS`` of "transfer";
* ``synchronize()``: the CPU waits for the current stream (``loss.item()``).

Only tests use it: a test job imports it and calls :func:`install`, which
hands it to the shim through ``cuda_events.use_fake``. The shim never looks
for it (no environment variable, no import path of its own).
Every tensor counts as living on fake device 0 (:func:`device_of`).
"""

from __future__ import annotations

import os
import queue
import threading
import time
from typing import Any

FAKE = True
#: the fake GPU clock minus the host clock (ns); the shim never sees it directly
CLOCK_OFFSET_NS = 123_456_789_000

_initialized = False
_lock = threading.Lock()
#: names of the threads that called Event.query() (tests check the shim asks on its flusher)
query_threads: set[str] = set()
#: calls of a synchronize (Event's or a stream's) from a thread other than the program's main one
foreign_syncs: list[str] = []


class _Stream:
    """A fake stream: a daemon thread running its queue in order."""

    def __init__(self, device: int = 0) -> None:
        self.device = device
        self.q: queue.Queue[Any] = queue.Queue()
        self.idle = threading.Event()
        self.idle.set()
        self.queued = 0
        self._t = threading.Thread(target=self._run, name="fake-cuda-stream", daemon=True)
        self._t.start()

    def put(self, op: Any) -> None:
        with _lock:
            self.queued += 1
            self.idle.clear()
        self.q.put(op)

    def _run(self) -> None:
        while True:
            op = self.q.get()
            try:
                op()
            except Exception:
                pass
            with _lock:
                self.queued -= 1
                if self.queued == 0:
                    self.idle.set()

    def synchronize(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            foreign_syncs.append(threading.current_thread().name)
        self.idle.wait()


Stream = _Stream
_default: _Stream | None = None


def is_available() -> bool:
    return True


def is_initialized() -> bool:
    return _initialized


def current_device() -> int:
    return 0


def current_stream(device: Any = None) -> _Stream:
    global _default, _initialized
    with _lock:
        if _default is None:
            _default = _Stream(0)
        _initialized = True
        return _default


def device_of(x: Any) -> int | None:
    """The shim's question "is this a CUDA tensor, on which device?": here always 0."""
    return 0


def synchronize() -> None:
    current_stream().synchronize()


class Event:
    """``torch.cuda.Event(enable_timing=True)``: done when its stream reaches it."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.enable_timing = enable_timing
        self._t: int | None = None
        self._recorded = False

    def record(self, stream: Any = None) -> None:
        s = stream if stream is not None else current_stream()
        self._recorded = True
        with _lock:
            if s.queued == 0:  # an idle stream reaches it at once, as a real GPU's does: stamped
                # now, not whenever the stream's thread next runs (beside a busy core that was up
                # to ~4.6 ms later, an error of the fake's that the shim's anchors then carried)
                self._t = time.perf_counter_ns() + CLOCK_OFFSET_NS
                return
            self._t = None
        s.put(self._stamp)

    def _stamp(self) -> None:
        self._t = time.perf_counter_ns() + CLOCK_OFFSET_NS

    def query(self) -> bool:
        query_threads.add(threading.current_thread().name)
        return self._t is not None or not self._recorded

    def synchronize(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            foreign_syncs.append(threading.current_thread().name)
        while not self.query():
            time.sleep(0.0005)

    def elapsed_time(self, end: Event) -> float:
        if self._t is None or end._t is None:
            raise RuntimeError("fake_cuda: elapsed_time on an event not yet completed")
        if not (self.enable_timing and end.enable_timing):
            raise RuntimeError("fake_cuda: both events must be created with enable_timing=True")
        return (end._t - self._t) / 1e6

    def host_ns(self) -> int | None:
        """The host time the event completed at (tests compare the shim's placement with it)."""
        return None if self._t is None else self._t - CLOCK_OFFSET_NS


def kernel(ms: float) -> None:
    """Queue a "kernel" of ``ms`` milliseconds on the current stream; returns at once."""
    s = ms / 1000.0
    current_stream().put(lambda: time.sleep(s))


#: every stamped "kernel": what a test can compare the shim's spans with
_coll_seq: dict[int, int] = {}


def _rendezvous(path: str, rank: int, size: int, seq: int, transfer_s: float) -> None:
    mine = os.path.join(path, f"c{seq}.r{rank}")
    with open(mine, "w"):
        pass
    others = [os.path.join(path, f"c{seq}.r{r}") for r in range(size)]
    deadline = time.monotonic() + 60
    while not all(os.path.exists(p) for p in others) and time.monotonic() < deadline:
        time.sleep(0.0002)
    if transfer_s > 0:
        time.sleep(transfer_s)


def install(world_dir: str | None = None) -> None:
    """Hand this fake to distdiag's shim (when it runs) and make ``ProcessGroup.allreduce``
    queue its device-side rendezvous. ``world_dir``: where ranks meet (default
    ``FAKE_CUDA_DIR``); without one, all-reduces cost only their transfer on the fake GPU."""
    global _initialized
    import torch.distributed as dist

    path = world_dir or os.environ.get("FAKE_CUDA_DIR", "")
    transfer_s = float(os.environ.get("FAKE_CUDA_COLL_MS", "1")) / 1000.0
    pg = dist.ProcessGroup
    orig = pg.allreduce
    if not getattr(orig, "__fake_cuda__", False):

        def allreduce(self: Any, *args: Any, **kwargs: Any) -> Any:
            key = id(self)
            seq = _coll_seq.get(key, 0)
            _coll_seq[key] = seq + 1
            rank, size = int(self.rank()), int(self.size())
            if path and size > 1:
                d = os.path.join(path, f"pg{self.group_name}")
                os.makedirs(d, exist_ok=True)
                current_stream().put(lambda: _rendezvous(d, rank, size, seq, transfer_s))
            else:
                current_stream().put(lambda: time.sleep(transfer_s))
            return orig(self, *args, **kwargs)

        allreduce.__fake_cuda__ = True  # type: ignore[attr-defined]
        pg.allreduce = allreduce
    current_stream()
    _initialized = True
    try:
        import sys

        from distdiag.shim.hooks import cuda_events

        cuda_events.use_fake(sys.modules[__name__], device_of)
    except Exception:
        pass  # not under distdiag-wrap: the fake still runs the job the same way
