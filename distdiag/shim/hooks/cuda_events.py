"""GPU-side timing of recorded calls: a pair of CUDA events around each, resolved off the hot path.

On a GPU, what the CPU sees of a call is its enqueue: an NCCL ``all_reduce``
returns once its kernel is queued, a ``forward`` once its kernels are
launched. Where the GPU's own timeline matters (a slow GPU looks like a fast
one from the CPU), the hooks ask this module for a :class:`Timer` token around
the call:

* **around** the call, one ``torch.cuda.Event(enable_timing=True)`` recorded
  on the current stream before it and one after (:meth:`Timer.begin`,
  :meth:`Timer.end`; events come from a free list, so steady state allocates
  none). For a blocking NCCL collective the current stream is where its kernel
  is ordered: ProcessGroupNCCL makes its NCCL stream wait for the current
  stream before the kernel and the current stream wait for the NCCL stream
  after it (``work.wait()`` in the blocking path), so the first event completes
  when the rank's GPU reaches the collective (its GPU-side arrival) and the
  second when the collective's kernel ended (its exit).
* **resolved later, never synchronizing**: the pairs wait in a FIFO
  (:attr:`Timer.pending`); the shim's flusher thread, before each flush
  (:data:`distdiag.shim.rankfile.BEFORE_FLUSH`), asks ``event.query()`` of the
  oldest ones and writes a ``Kind.GPU_SPAN`` row for each pair done. It never
  calls ``synchronize()`` or ``wait`` on the program's streams or events. At
  most :data:`MAX_PENDING` pairs wait; past that a call is not timed (counted in
  the rank file's ``cuda_spans_dropped``; its row keeps its CPU times).
* **on the host clock**: an anchor per device, one event recorded on a side
  stream of the shim's own (idle, so it runs at once) between two host
  timestamps, at the first timed call and at every flush. A pair is placed by
  ``anchor.elapsed_time(event)`` from the last anchor recorded before the pair
  (positive, and fresh: CUDA's elapsed times are float milliseconds), so a GPU
  time is ``anchor_host_ns + elapsed``. The anchor's two host timestamps bound
  where it ran (plus the side stream's launch latency, a few microseconds on
  current GPUs), and that bound goes in the row's ``value``; it is the same for
  every span of one anchor, so durations and shares do not carry it.

The row: ``t0``/``t1`` the GPU start/end on the host clock, ``aux`` the timed
row's kind, ``nbytes`` its t0 (the key the analyzer joins on: ``distdiag.run``
replaces a collective's CPU times by its GPU ones, see ``_gpu_times`` there),
``name_id``/``comm_id``/``seq`` the timed row's, ``peer`` the device.

When it is on: a CUDA context exists (``torch.cuda.is_initialized()``: the
shim never creates one) and, for a collective, its tensor is a CUDA tensor.
Nothing here imports torch; the hooks call :func:`timer` (a global read) and
get None on a machine without CUDA, where a call costs one check.

VERIFIED ONLY AGAINST A FAKE. No GPU was available where this was written:
the code path (pending pairs, resolution on the flusher thread, anchoring,
the rows, the analyzer's use of them) is tested with ``tests/fake_cuda``, a
fake ``torch.cuda`` whose "kernels" are sleeps on a device thread, and the
real path only through ``benchmarks/gpu_check.py``, the device check that
runs it on a real GPU (issue 22). What the fake cannot show: the real cost of
an event record (~2-5 us expected), how NCCL's streams order the events, and
the anchor's real launch latency.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, Callable

from distdiag.schema import Kind
from distdiag.shim.recorder import ROW_SIZE, Recorder, now_ns
from distdiag.shim.recorder import pack_row as _pack

log = logging.getLogger(__name__)

#: timed pairs waiting for their events at most (~2 events of ~100 bytes of Python each,
#: plus the driver's event); past it a call is not timed and counted
MAX_PENDING = 4096
#: pairs resolved per flush at most (each: two query() calls and two elapsed_time())
MAX_RESOLVE = 1 << 16

_TIMER: Timer | None = None
_REC: Recorder | None = None
_installed = False
#: set only by a test's fake (:func:`use_fake`); never from the environment or a file
_FAKE: tuple[Any, Callable[[Any], int | None]] | None = None


def _real_device_of(x: Any) -> int | None:
    """CUDA device index of a tensor (or of a list's first), None for anything else."""
    if isinstance(x, (list, tuple)):
        x = x[0] if x else None
    try:
        if x is None or not x.is_cuda:
            return None
        i = x.device.index
        return int(i) if i is not None else 0
    except Exception:
        return None


class Timer:
    """CUDA event pairs around calls, resolved by :meth:`resolve` (see the module docstring).

    ``cuda``: ``torch.cuda`` (or a fake with its names: ``is_initialized``,
    ``current_device``, ``current_stream``, ``Stream``, ``Event``). Only
    :meth:`begin`/:meth:`end` run on the program's threads; :meth:`resolve`
    runs on the flusher (or the closing thread at exit), one at a time."""

    def __init__(self, rec: Recorder, cuda: Any, device_of: Callable[[Any], int | None], max_pending: int = MAX_PENDING) -> None:
        self.rec = rec
        self.cuda = cuda
        self.device_of = device_of
        self.max_pending = max_pending
        #: (kind, name_id, comm_id, seq, cpu_t0, device, anchor id, start event, end event)
        self.pending: collections.deque[tuple[Any, ...]] = collections.deque()
        self._free: list[Any] = []
        self.dropped = 0
        self.resolved = 0
        self.failed = 0  # pairs whose events could not be read (a CUDA error): dropped
        #: anchor id -> (device, host ns before the record, host ns after, event); ids grow
        self._anchors: dict[int, tuple[int, int, int, Any]] = {}
        self._anchor_of: dict[int, int] = {}  # device -> id of its latest anchor
        self._side: dict[int, Any] = {}  # device -> the shim's own stream for anchors
        self._next_anchor = 0
        self._anchor_lock = threading.Lock()
        self._tb: Any = None  # the recorder buffer GPU_SPAN rows go to (owned by no thread)
        self.open = True  # False once the CUDA calls failed: nothing more is timed

    # -- the program's threads ------------------------------------------------------
    def _event(self) -> Any:
        try:
            return self._free.pop()
        except IndexError:
            return self.cuda.Event(enable_timing=True)

    def begin(self, device: int | None = None) -> tuple[Any, int, int] | None:
        """Record the start event on the current stream of ``device`` (None: the current
        device, once CUDA is initialized). A token for :meth:`end`, or None (not timed)."""
        if not self.open:
            return None
        try:
            cuda = self.cuda
            if device is None:
                if not cuda.is_initialized():
                    return None
                device = int(cuda.current_device())
            if len(self.pending) >= self.max_pending:
                self.dropped += 1
                return None
            a = self._anchor_of.get(device)
            if a is None:
                a = self._new_anchor(device)
                if a is None:
                    return None
            ev = self._event()
            ev.record(cuda.current_stream(device))
            return ev, device, a
        except Exception:
            self._give_up()
            return None

    def end(self, token: tuple[Any, int, int] | None, kind: int, name_id: int, cpu_t0: int, comm_id: int = 0, seq: int = -1) -> None:
        """Record the end event after the call; the pair waits for :meth:`resolve`."""
        if token is None:
            return
        try:
            ev0, device, a = token
            ev1 = self._event()
            ev1.record(self.cuda.current_stream(device))
            self.pending.append((int(kind), name_id, comm_id, seq, cpu_t0, device, a, ev0, ev1))
        except Exception:
            self._give_up()

    def cancel(self, token: tuple[Any, int, int] | None) -> None:
        """The call turned out not to be one to time (a ``Tensor.to`` that copied nothing
        onto a device): its start event goes back to the free list."""
        if token is not None:
            self._free.append(token[0])

    def _give_up(self) -> None:
        self.open = False
        log.debug("distdiag: CUDA event timing stopped", exc_info=True)

    # -- anchors -----------------------------------------------------------------------
    def _new_anchor(self, device: int) -> int | None:
        """Record an anchor event on ``device``'s side stream between two host timestamps."""
        with self._anchor_lock:
            try:
                s = self._side.get(device)
                if s is None:
                    s = self._side[device] = self.cuda.Stream(device=device)
                ev = self.cuda.Event(enable_timing=True)
                h0 = now_ns()
                ev.record(s)
                h1 = now_ns()
            except Exception:
                self._give_up()
                return None
            a = self._next_anchor
            self._next_anchor = a + 1
            self._anchors[a] = (device, h0, h1, ev)
            self._anchor_of[device] = a
            return a

    # -- the flusher -------------------------------------------------------------------
    def resolve(self) -> int:
        """Write a GPU_SPAN row for every pending pair whose events are done, oldest first,
        stopping at the first not done; then a fresh anchor per device in use. Never raises,
        never waits on the GPU. Returns the rows written."""
        done = 0
        pending = self.pending
        try:
            while pending and done < MAX_RESOLVE:
                item = pending[0]
                ev1 = item[8]
                if not ev1.query():
                    break  # later pairs of the same stream are not done either
                pending.popleft()
                if self._write(item):
                    done += 1
                self._free.extend((item[7], ev1))
        except Exception:
            self._give_up()
        self.resolved += done
        try:
            for device in list(self._anchor_of):
                self._new_anchor(device)
            self._prune_anchors()
        except Exception:
            self._give_up()
        return done

    def _write(self, item: tuple[Any, ...]) -> bool:
        kind, name_id, comm_id, seq, cpu_t0, device, a, ev0, ev1 = item
        anc = self._anchors.get(a)
        try:
            if anc is None or not anc[3].query():
                raise RuntimeError("anchor not done")
            _, h0, h1, aev = anc
            base = (h0 + h1) // 2
            t0 = base + int(round(aev.elapsed_time(ev0) * 1e6))
            t1 = base + int(round(aev.elapsed_time(ev1) * 1e6))
        except Exception:
            self.failed += 1
            return False
        self._add(t0, max(t0, t1), name_id, comm_id, seq, device, cpu_t0, kind, float(h1 - h0))
        return True

    def _prune_anchors(self) -> None:
        """Drop anchors no pending pair refers to (but each device's latest)."""
        keep = {it[6] for it in list(self.pending)} | set(self._anchor_of.values())
        for a in [a for a in self._anchors if a not in keep]:
            del self._anchors[a]

    def _add(self, t0: int, t1: int, name_id: int, comm_id: int, seq: int, device: int, cpu_t0: int, kind: int,
             bound_ns: float) -> None:  # fmt: skip
        rec = self.rec
        tb = self._tb
        if tb is None:
            tb = self._tb = rec.shared_buffer()
        n = tb.n
        if n >= tb.cap:
            n = rec._rotate(tb)
        _pack(tb.buf, n * ROW_SIZE, t0, t1, Kind.GPU_SPAN, name_id, comm_id, seq, device, cpu_t0, kind, 0, tb.tid, bound_ns)
        tb.n = n + 1

    def status(self) -> dict[str, int]:
        return {"pending": len(self.pending), "dropped": self.dropped, "resolved": self.resolved, "failed": self.failed}


def timer() -> Timer | None:
    """The process's timer, or None (no CUDA, or not installed)."""
    return _TIMER


_last_said: dict[str, Any] = {}


def _before_flush() -> None:
    """Called on the flusher thread before every flush (and by the close at exit)."""
    t = _TIMER
    if t is None:
        return
    t.resolve()
    try:
        from distdiag.shim import session

        sess = session.SESSION
        if sess is None:
            return
        for name, v in (("cuda_spans_dropped", t.dropped), ("cuda_spans_pending", len(t.pending))):
            if _last_said.get(name) != v:
                sess.writer.set_attr(name, int(v))
                _last_said[name] = v
        if not t.open and _last_said.get("off") is None:
            sess.writer.set_attr("cuda_timing", "off: a CUDA event call failed; later calls keep CPU times")
            _last_said["off"] = True
    except Exception:
        log.debug("distdiag: cuda status not written", exc_info=True)


def _set_timing_attr(text: str) -> None:
    try:
        from distdiag.shim import session

        sess = session.SESSION
        if sess is not None:
            sess.writer.set_attr("cuda_timing", text)
    except Exception:
        pass


def _start(cuda: Any, device_of: Callable[[Any], int | None], why: str) -> None:
    global _TIMER
    rec = _REC
    if rec is None or _TIMER is not None:
        return
    _TIMER = Timer(rec, cuda, device_of)
    _set_timing_attr(f"on: {why}; spans are placed on the host clock by an anchor event per flush")


def use_fake(cuda: Any, device_of: Callable[[Any], int | None]) -> None:
    """Time calls with a FAKE ``torch.cuda`` (``tests/fake_cuda``): for tests on machines
    without a GPU. Only a test program calls this; nothing in the shim does."""
    global _FAKE
    _FAKE = (cuda, device_of)
    _start(cuda, device_of, "FAKE CUDA (tests/fake_cuda), not a GPU")


def _on_torch(torch: Any) -> None:
    if _REC is None or _TIMER is not None:
        return
    # Not torch.cuda.is_available(): by default it calls cudaGetDeviceCount, whose cuInit
    # poisons fork (torch's docs: a child forked afterwards cannot use CUDA) in a program that
    # may never have touched CUDA before its fork. Whether torch was built with CUDA reads
    # nothing from the driver; Timer.begin waits for the program's own CUDA initialization.
    try:
        cuda = torch.cuda
        compiled = getattr(cuda, "_is_compiled", None)
        built = bool(compiled()) if callable(compiled) else bool(getattr(getattr(torch, "version", None), "cuda", None))
        if not built:
            _set_timing_attr("off: torch is built without CUDA")
            return
    except Exception as e:
        _set_timing_attr(f"off: {type(e).__name__}")
        return
    _start(cuda, _real_device_of, "torch.cuda events (timed once CUDA is initialized by the program)")


def install(rec: Recorder, cfg: Any = None) -> None:
    """Time GPU spans once torch is imported and CUDA is available. Never imports torch."""
    global _REC, _installed
    if _installed:
        return
    if not getattr(cfg, "cuda_events", True):
        return
    _REC, _installed = rec, True
    try:
        from distdiag.shim import rankfile

        rankfile.BEFORE_FLUSH.append(_before_flush)
    except Exception:
        log.debug("distdiag: no flush hook for CUDA events", exc_info=True)
    import os

    os.register_at_fork(after_in_child=_forget)
    from distdiag.shim import hooks as _hooks

    _hooks.when_imported("torch", _on_torch)


def _forget() -> None:
    """In a forked child: no timing (its events would be the parent's context's)."""
    global _TIMER, _REC
    _TIMER = None
    _REC = None


def uninstall() -> None:
    global _TIMER, _REC, _installed, _FAKE
    t = _TIMER
    if t is not None:
        deadline = time.monotonic() + 0.2
        while t.pending and time.monotonic() < deadline and t.open:  # what finished by now, no waiting on the GPU
            if t.resolve() == 0:
                break
    _TIMER = None
    _REC = None
    _FAKE = None
    _installed = False
    _last_said.clear()
    try:
        from distdiag.shim import rankfile

        while _before_flush in rankfile.BEFORE_FLUSH:
            rankfile.BEFORE_FLUSH.remove(_before_flush)
    except Exception:
        pass
