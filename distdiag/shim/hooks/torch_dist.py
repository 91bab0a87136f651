"""torch.distributed capture: every collective and point-to-point call, and DDP's buckets.

What is recorded, and how:

* **Python-level calls** (``all_reduce``, ``broadcast``, ``all_gather``, ...,
  ``send``/``recv``/``isend``/``irecv``, ``batch_isend_irecv``, the object
  collectives): the functions are replaced *as module attributes* of
  ``torch.distributed`` and ``torch.distributed.distributed_c10d`` right after
  ``torch.distributed`` finishes importing, i.e. before the user's code runs,
  so ``from torch.distributed import all_reduce`` binds the wrapper too.
  A blocking call is one row between ``rec.enter`` and ``rec.leave`` (a rank
  killed inside it shows it in ``/inflight``); ``async_op=True`` records the post
  time as t0 and the completion of the Work as t1: through the Work's future
  callback where the backend has one (gloo and NCCL collectives), else (gloo
  point-to-point: ``Work::getFuture not implemented``) when the program's
  ``Work.wait()`` returns. Calls torch makes *inside* a recorded call (e.g.
  ``all_gather_object`` -> ``all_gather``) are not recorded twice.

* **DDP gradient buckets** do not pass through those Python functions: the C++
  Reducer calls the process group directly. ``DistributedDataParallel.__init__``
  is wrapped to attach each new DDP in one of two ways:

  - *DDP on CPU* (gloo): no comm hook. The Reducer keeps its built-in path
    (results bit-identical by construction) and launches each bucket through
    the dispatcher op ``c10d::allreduce_``, where our kernel at the
    AutogradCPU key runs first, launches the real one and records the row
    (:func:`_ensure_kernel` says why and what it costs). The kernel is C++
    (``_ddpk.cpp``: no Python on a bucket's path but one call per backward
    pass for the program's line) where ``pip install`` built it against the
    torch that runs, else Python (``ddp_kernel_impl``). One such DDP per
    process group; a second on the same group takes the comm hook.
  - *Otherwise* (CUDA, or a second DDP on a group): our comm hook, which
    replicates the Reducer's built-in default (pre-divide by the group size,
    sum all-reduce) so the gradients are bit-identical.

  A hook the user registers later through ``register_comm_hook`` is not lost:
  it becomes the inner hook that ours times (a kernel-recorded DDP switches to
  our hook then). ``_register_builtin_comm_hook`` on a kernel-recorded DDP is
  torch's own (its C++ hook's all-reduce reaches the kernel); on a hooked DDP
  its Python equivalent runs inside ours. Bucket rows are ``COLL_ASYNC`` named
  ``ddp_bucket_allreduce`` (t0 at launch, t1 at the Work's completion) on their
  own communicator key ``ddp<N>:<group key>`` (N = DDP construction order, the
  same on every rank) so their sequence numbers stay consistent whatever
  Python-level collectives the program interleaves.

  What it costs (``benchmarks/bench_torch_step.py``, 2-core machine). With any
  comm hook the Reducer copies gradients into the bucket unscaled, so the
  1/world scaling is a second pass over the bucket (~0.2-0.4 ms of CPU per
  4 MB here; torch's own C++ allreduce hook pays it too), and a Python hook
  adds GIL hand-offs and a ``then`` callback per bucket (~25-50 us); recording
  inside the hook adds ~9 us. That floor is why CPU DDPs use the kernel (no
  extra pass; the C++ kernel adds a few us a bucket, the Python one ~50-70 us:
  ``benchmarks/NOTES.md``). Ruled out, measured:
  sampling steps (the Reducer takes one hook for its lifetime, so unsampled
  steps would still pay the hook floor and save only the ~9 us, while the
  analyzer would lose per-step rows); a ``ProcessGroup`` subclass (the Reducer
  never calls Python); DDP's runtime logging (averages per DDP, no per-bucket
  rows to match across ranks); a completion time without a callback (gloo
  Works have no duration; a Python hook must return a ``then`` future).

Process-group key (the ``comm_id`` string, identical on every rank): ``default``
for the world group, ``pg<name>`` for others, where ``<name>`` is torch's own
``group_name`` (a creation counter that every rank advances in step, since every
rank must call ``new_group``). ``seq`` counts recorded collectives per key.
``nbytes`` is what this rank sends (the input tensor(s)); ``aux`` is the string id
of the dtype; ``peer`` the *global* rank of the root / peer (-1 if none).

Timing caveat: on NCCL the CPU-side times are enqueue times for blocking calls
and stream-ordered completion for futures, not kernel time on the GPU. So a
*blocking* collective on CUDA tensors also gets its GPU-side span: a CUDA event
pair on the current stream around the call (:mod:`distdiag.shim.hooks.cuda_events`),
written later as a ``GPU_SPAN`` row keyed by the row's t0; the analyzer then
uses GPU start / end as the collective's arrival / exit (``distdiag.run``).
``async_op=True`` collectives (with a future) and DDP's buckets (the comm
hook, CUDA DDPs' path) are timed too: the start event on the current stream
at the post, the end event in the Work's future callback, where torch makes
the current stream one synchronized with the collective's kernel
(``Future.then``'s contract for CUDA values). Not timed on the GPU (their rows
keep CPU times): point-to-point calls, async calls without a future. Verified only against
``tests/fake_cuda`` (no GPU here); ``benchmarks/gpu_check.py`` is the device check.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import sys
import threading
import types
import weakref
from typing import Any, Callable

from distdiag.schema import Kind
from distdiag.shim import hooks as _hooks
from distdiag.shim.hooks import cuda_events as _cuda_events
from distdiag.shim.recorder import ROW_SIZE, Recorder, now_ns
from distdiag.shim.recorder import pack_row as _pack

log = logging.getLogger(__name__)

# name -> (payload parameter or None, (global peer param, group peer param) or None, sync kind, async kind)
_C = (Kind.COLL, Kind.COLL_ASYNC)
_OPS: dict[str, tuple[str | None, tuple[str, str] | None, int, int]] = {
    "all_reduce": ("tensor", None, *_C),
    "all_reduce_coalesced": ("tensors", None, *_C),
    "broadcast": ("tensor", ("src", "group_src"), *_C),
    "all_gather": ("tensor", None, *_C),
    "all_gather_into_tensor": ("input_tensor", None, *_C),
    "all_gather_single": ("input_tensor", None, *_C),  # torch >= 2.13; FSDP2's all-gather
    "_all_gather_base": ("input_tensor", None, *_C),
    "all_gather_coalesced": ("input_tensor_list", None, *_C),
    "reduce_scatter": ("input_list", None, *_C),
    "reduce_scatter_tensor": ("input", None, *_C),
    "reduce_scatter_single": ("input", None, *_C),  # torch >= 2.13; FSDP2's reduce-scatter
    "_reduce_scatter_base": ("input", None, *_C),
    "all_to_all": ("input_tensor_list", None, *_C),
    "all_to_all_single": ("input", None, *_C),
    "barrier": (None, None, *_C),
    "monitored_barrier": (None, None, *_C),
    "reduce": ("tensor", ("dst", "group_dst"), *_C),
    "gather": ("tensor", ("dst", "group_dst"), *_C),
    "scatter": ("scatter_list", ("src", "group_src"), *_C),
    "all_gather_object": (None, None, *_C),
    "gather_object": (None, ("dst", "group_dst"), *_C),
    "broadcast_object_list": (None, ("src", "group_src"), *_C),
    "scatter_object_list": (None, ("src", "group_src"), *_C),
    "send": ("tensor", ("dst", "group_dst"), Kind.SEND, Kind.SEND_ASYNC),
    "recv": ("tensor", ("src", "group_src"), Kind.RECV, Kind.RECV_ASYNC),
    "isend": ("tensor", ("dst", "group_dst"), Kind.SEND_ASYNC, Kind.SEND_ASYNC),
    "irecv": ("tensor", ("src", "group_src"), Kind.RECV_ASYNC, Kind.RECV_ASYNC),
    "send_object_list": (None, ("dst", "group_dst"), Kind.SEND, Kind.SEND_ASYNC),
    "recv_object_list": (None, ("src", "group_src"), Kind.RECV, Kind.RECV_ASYNC),
}
#: point-to-point ops carry seq -1 (they are matched by peer, not by sequence)
_P2P = frozenset({"send", "recv", "isend", "irecv", "send_object_list", "recv_object_list"})
#: always asynchronous, whatever the arguments say
_ALWAYS_ASYNC = frozenset({"isend", "irecv"})

BUCKET_OP = "ddp_bucket_allreduce"


class _TLS(threading.local):
    busy = False  # inside a recorded call: calls torch makes from within it are not recorded again
    batch: list[tuple[Any, ...]] | None = None  # rows posted inside batch_isend_irecv without their own Work
    batch_site = 0
    ddp_join = False  # inside DDP's join hook shadowing the other ranks' bucket all-reduces


_tls = _TLS()


def _busy(on: bool) -> tuple[bool, bool]:
    """Set this thread's "inside a recorded call" flag where both kernels read it (``_tls`` for
    the Python one, a C++ thread-local for ``_ddpk``, which cannot read Python's); the old
    values, for :func:`_unbusy`."""
    tls = _tls
    was = tls.busy
    tls.busy = on
    ck = _ck
    return was, (ck.set_busy(on) if ck is not None else False)


def _unbusy(was: tuple[bool, bool]) -> None:
    _tls.busy = was[0]
    ck = _ck
    if ck is not None:
        ck.set_busy(was[1])


_REC: Recorder | None = None
_CFG: Any = None
_patched: list[tuple[Any, str, Any]] = []  # (owner, attribute, original): undone in reverse order
_seq: dict[int, int] = {}
_pg_ids: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
_dtype_ids: dict[Any, int] = {}
_default_comm_id = 0
_future_ok: dict[tuple[str, int], bool] = {}
#: async Works whose backend has no future: recorded when the program's wait() returns
_pending: weakref.WeakKeyDictionary[Any, tuple[Any, ...]] = weakref.WeakKeyDictionary()
#: async Works completed through their future: (comm, seq, op) for the WAIT row of a later wait(),
#: so the analysis can split that wait at the collective's last arrival (distdiag.breakdown)
_issued: weakref.WeakKeyDictionary[Any, tuple[int, int, int]] = weakref.WeakKeyDictionary()
_ddp_states: weakref.WeakKeyDictionary[Any, _DDPState] = weakref.WeakKeyDictionary()
_ddp_count = 0
_c10d: types.ModuleType | None = None
_dist: types.ModuleType | None = None
_installed = False


# -- helpers ----------------------------------------------------------------------
def _nbytes(x: Any) -> int:
    """Bytes of a tensor or of a list of tensors; 0 for anything else."""
    if x is None:
        return 0
    try:
        if isinstance(x, (list, tuple)):
            return sum(int(t.numel()) * int(t.element_size()) for t in x if hasattr(t, "element_size"))
        return int(x.numel()) * int(x.element_size())
    except Exception:
        return 0


def _dtype_id(rec: Recorder, x: Any) -> int:
    if isinstance(x, (list, tuple)):
        x = x[0] if x else None
    dt = getattr(x, "dtype", None)
    if dt is None:
        return 0
    i = _dtype_ids.get(dt)
    if i is None:
        i = _dtype_ids[dt] = rec.intern(str(dt))
    return i


def _comm_id(rec: Recorder, group: Any) -> int | None:
    """String id of the group's key; None when this rank is not a member (torch does nothing then)."""
    if group is None:
        return _default_comm_id
    try:
        return _pg_ids[group]
    except KeyError:
        pass
    except TypeError:  # an int: GroupMember.NON_GROUP_MEMBER
        return None
    key = "pg?"
    try:
        c10d = _c10d
        if c10d is not None and c10d.is_initialized() and group is c10d._get_default_group():
            key = "default"
        else:
            key = f"pg{group.group_name}"
    except Exception:
        log.debug("distdiag: no name for process group %r", group, exc_info=True)
    i = rec.intern(key)
    try:
        _pg_ids[group] = i
    except TypeError:
        pass
    return i


def _global_peer(args: tuple[Any, ...], kwargs: dict[str, Any], idx: dict[str, int], names: tuple[str, str], group: Any) -> int:
    g_name, l_name = names
    v = _arg(args, kwargs, idx, g_name)
    if v is not None:
        return int(v)
    v = _arg(args, kwargs, idx, l_name)
    if v is None:
        return -1
    if group is None:
        return int(v)
    try:
        return int(_c10d.get_global_rank(group, int(v)))  # type: ignore[union-attr]
    except Exception:
        return int(v)


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], idx: dict[str, int], name: str) -> Any:
    i = idx.get(name)
    if i is not None and i < len(args):
        return args[i]
    return kwargs.get(name)


_cb_lock = threading.Lock()
#: (recorder, the one ThreadBuffer every future callback writes into, under _cb_lock);
#: kept across uninstall/install with the same recorder, so re-installing makes no new chunk
_cb_buffer: tuple[Recorder, Any] | None = None


def _shared_buffer(rec: Recorder) -> Any:
    """A recorder buffer of its own for future callbacks: owned by no thread, so the
    writer never prunes it (it prunes the buffers of threads that ended)."""
    return rec.shared_buffer()


def _callback_buffer(rec: Recorder) -> Any:
    """The shared callback buffer of ``rec``, made on first use. Call with _cb_lock held."""
    global _cb_buffer
    ent = _cb_buffer
    if ent is None or ent[0] is not rec:
        ent = _cb_buffer = (rec, _shared_buffer(rec))
    return ent[1]


def _add_from_callback(rec: Recorder, row: tuple[Any, ...], t1: int) -> None:
    """Record ``row`` (t0 first, no t1) finished at ``t1`` from a future callback. Never raises.

    Every callback writes into one shared buffer, one at a time under a lock
    (the recorder's rule, one writer per buffer, holds), following the
    recorder's inline-row protocol (pack, then publish ``n``). Why not
    ``rec.add``: a backend's callback thread (gloo's workers) is a C++ thread
    that pybind11 gives a fresh Python thread state each time it takes the GIL
    and drops afterwards, and with it every ``threading.local``. ``rec.add``
    there found no buffer each time and made one: a 16384-row chunk (1.1 MB
    zeroed, ~200 us) per completed Work, kept for the rest of the run
    (measured: 79 buffers after 79 DDP buckets). Even touching a thread-local
    in such a fresh thread state costs ~35 us of CPU (first access: the state's
    dict and the local's per-thread dict are made), so this path touches none.
    """
    try:
        with _cb_lock:
            tb = _callback_buffer(rec)
            n = tb.n
            if n >= tb.cap:
                n = rec._rotate(tb)
            _pack(tb.buf, n * ROW_SIZE, row[0], t1, *row[1:], tb.tid, 0.0)
            tb.n = n + 1  # publish after the row is complete
    except Exception:
        pass


def _record_done(rec: Recorder, row: tuple[Any, ...], _fut: Any = None) -> None:
    """Future callback: the Work completed now. Runs on a backend thread; never raises."""
    _add_from_callback(rec, row, now_ns())


def _gpu_begin(timer: Any, data: Any) -> tuple[Any, Any] | None:
    """(timer, token) of a CUDA event pair started now on ``data``'s device, or None."""
    try:
        dev = timer.device_of(data)
        tok = timer.begin(dev) if dev is not None else None
    except Exception:
        return None
    return (timer, tok) if tok is not None else None


def _gpu_end(gpu: tuple[Any, Any] | None, row: tuple[Any, ...]) -> None:
    """The end event of ``row``'s pair (t0 first), recorded now on the current stream. In a
    CUDA future's callback the current stream is one torch synchronized with the
    collective's kernel (``Future.then``'s contract), so the event follows its end."""
    if gpu is not None:
        try:
            gpu[0].end(gpu[1], row[1], row[2], row[0], row[3], row[4])
        except Exception:
            pass


def _record_done_gpu(rec: Recorder, row: tuple[Any, ...], gpu: tuple[Any, Any] | None, _fut: Any = None) -> None:
    """:func:`_record_done`, and the end event of the row's CUDA pair. Never raises."""
    _add_from_callback(rec, row, now_ns())
    _gpu_end(gpu, row)


def _track(rec: Recorder, name: str, work: Any, row: tuple[Any, ...], gpu: tuple[Any, Any] | None = None) -> None:
    """Arrange for ``row`` (t0 first, no t1) to be recorded when ``work`` completes
    (with its CUDA pair's end, ``gpu``, when the Work has a future: else not GPU-timed)."""
    if work is None:
        batch = _tls.batch
        if batch is not None:  # coalesced inside batch_isend_irecv: completes with the batch's Work
            batch.append(row)
        else:
            rec.add(row[0], now_ns(), *row[1:])
        return
    key = (name, row[3])
    if _future_ok.get(key, True):
        try:
            fut = work.get_future()
            if gpu is None:
                fut.add_done_callback(functools.partial(_record_done, rec, row))
            else:
                fut.add_done_callback(functools.partial(_record_done_gpu, rec, row, gpu))
        except Exception:  # gloo p2p: "Work::getFuture not implemented"
            _future_ok[key] = False
        else:
            if row[4] >= 0:  # a collective: its wait() names it (a Work without weakrefs: nothing named)
                try:
                    _issued[work] = (row[3], row[4], row[2])
                except TypeError:
                    pass
            return
    try:
        _pending[work] = row
    except TypeError:
        rec.add(row[0], now_ns(), *row[1:])


# -- the wrappers -------------------------------------------------------------------
def _make_wrapper(name: str, orig: Callable[..., Any]) -> Callable[..., Any]:
    payload, peer_names, kind_sync, kind_async = _OPS[name]
    try:
        params = list(inspect.signature(orig).parameters)
    except (TypeError, ValueError):
        params = []
    idx = {p: i for i, p in enumerate(params)}
    has_async = "async_op" in idx
    always_async = name in _ALWAYS_ASYNC
    is_p2p = name in _P2P
    name_ids: dict[int, int] = {}

    @functools.wraps(orig)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        rec = _REC
        tls = _tls
        if rec is None or tls.busy:
            return orig(*args, **kwargs)
        try:
            group = _arg(args, kwargs, idx, "group")
            comm = _comm_id(rec, group)
            if comm is None:  # not a member: torch returns without communicating
                return orig(*args, **kwargs)
            is_async = always_async or (has_async and bool(_arg(args, kwargs, idx, "async_op")))
            if is_p2p:
                seq = -1
            else:
                seq = _seq.get(comm, 0)
                _seq[comm] = seq + 1
            peer = _global_peer(args, kwargs, idx, peer_names, group) if peer_names else -1
            data = _arg(args, kwargs, idx, payload) if payload else None
            nbytes = _nbytes(data)
            aux = _dtype_id(rec, data) if data is not None else 0
            # the program's line, also when torch calls this for it (FSDP's all-gathers)
            site = tls.batch_site if tls.batch is not None else (_user_site(rec) if _TORCH_DIR else rec.site(2))
            nid = name_ids.get(id(rec))
            if nid is None:
                nid = name_ids[id(rec)] = rec.intern(name)
        except Exception:  # bookkeeping never breaks the call
            log.debug("distdiag: could not describe %s", name, exc_info=True)
            return orig(*args, **kwargs)
        if is_async:
            timer = _cuda_events._TIMER
            gpu = _gpu_begin(timer, data) if timer is not None and data is not None and seq >= 0 else None
            t0 = now_ns()
            was = _busy(True)
            try:
                work = orig(*args, **kwargs)
            finally:
                _unbusy(was)
            try:
                _track(rec, name, work, (t0, kind_async, nid, comm, seq, peer, nbytes, aux, site), gpu)
            except Exception:
                log.debug("distdiag: could not track %s", name, exc_info=True)
            return work
        timer = _cuda_events._TIMER
        if timer is not None and data is not None:  # CUDA tensors: GPU-side times too (cuda_events)
            return _timed_call(rec, timer, orig, args, kwargs, data, kind_sync, nid, comm, seq, peer, nbytes, aux, site)
        rec.enter(kind_sync, nid, comm, seq, peer, nbytes, aux, site)
        was = _busy(True)
        try:
            return orig(*args, **kwargs)
        finally:
            _unbusy(was)
            rec.leave()

    wrapper.__distdiag_original__ = orig  # type: ignore[attr-defined]
    return wrapper


def _timed_call(rec: Recorder, timer: Any, orig: Callable[..., Any], args: Any, kwargs: Any, data: Any, kind: int,
                nid: int, comm: int, seq: int, peer: int, nbytes: int, aux: int, site: int) -> Any:  # fmt: skip
    """A blocking collective on CUDA tensors: its row as usual, and a CUDA event pair on the
    tensor's device's current stream around it, resolved later on the flusher thread
    (:mod:`distdiag.shim.hooks.cuda_events`). Point-to-point calls are not timed (seq -1:
    nothing to join them on)."""
    tok = None
    if seq >= 0:
        try:
            dev = timer.device_of(data)
            tok = timer.begin(dev) if dev is not None else None
        except Exception:
            tok = None
    t0 = rec.enter(kind, nid, comm, seq, peer, nbytes, aux, site)
    was = _busy(True)
    try:
        return orig(*args, **kwargs)
    finally:
        _unbusy(was)
        rec.leave()
        if tok is not None:
            timer.end(tok, kind, nid, t0, comm, seq)


def _make_batch_wrapper(orig: Callable[..., Any]) -> Callable[..., Any]:
    """batch_isend_irecv: the isend/irecv it calls record themselves (one row per op).

    With a coalescing backend (NCCL) those calls return no Work of their own;
    their rows then complete with the last Work the batch returns.
    """

    @functools.wraps(orig)
    def wrapper(p2p_op_list: Any, *args: Any, **kwargs: Any) -> Any:
        rec = _REC
        tls = _tls
        if rec is None or tls.busy or tls.batch is not None:
            return orig(p2p_op_list, *args, **kwargs)
        try:
            tls.batch_site = _user_site(rec) if _TORCH_DIR else rec.site(2)
        except Exception:
            tls.batch_site = 0
        rows: list[tuple[Any, ...]] = []
        tls.batch = rows
        try:
            works = orig(p2p_op_list, *args, **kwargs)
        finally:
            tls.batch = None
        if rows:
            try:
                last = works[-1] if works else None
                for row in rows:
                    _track(rec, "batch_isend_irecv", last, row)
            except Exception:
                log.debug("distdiag: could not track batch_isend_irecv", exc_info=True)
        return works

    wrapper.__distdiag_original__ = orig  # type: ignore[attr-defined]
    return wrapper


def _make_wait(orig: Callable[..., Any]) -> Callable[..., Any]:
    """Work.wait: completes Works whose backend has no future, and records the program's own waiting."""

    @functools.wraps(orig)
    def wait(self: Any, *args: Any, **kwargs: Any) -> Any:
        rec = _REC
        if rec is None or _tls.busy:
            return orig(self, *args, **kwargs)
        try:
            row = _pending.pop(self, None)
            got = (row[3], row[4], row[2]) if row is not None else _issued.get(self)
        except TypeError:
            row = got = None
        # (comm, seq, op) of what it waits for, as MPI's Wait rows: seq is -1 for point-to-point
        if got is not None:
            rec.enter(Kind.WAIT, _wait_name_id(rec), got[0], got[1], row[5] if row else -1, 0, got[2])
        else:
            rec.enter(Kind.WAIT, _wait_name_id(rec), 0, -1, -1)
        try:
            return orig(self, *args, **kwargs)
        finally:
            t1 = now_ns()
            rec.leave(t1)
            if row is not None:
                rec.add(row[0], t1, *row[1:])

    wait.__distdiag_original__ = orig  # type: ignore[attr-defined]
    return wait


_wait_ids: dict[int, int] = {}


def _wait_name_id(rec: Recorder) -> int:
    i = _wait_ids.get(id(rec))
    if i is None:
        i = _wait_ids[id(rec)] = rec.intern("Work.wait")
    return i


# -- DDP ----------------------------------------------------------------------------
class _DDPState:
    """Per-DDP bookkeeping; also the ``state`` our comm hook receives."""

    __slots__ = ("pg", "comm_id", "name_id", "div", "as_view", "inner", "inner_state", "seq", "user_hooked", "kernel",
                 "handle", "__weakref__")  # fmt: skip

    def __init__(self, pg: Any, comm_id: int, name_id: int, div: int, as_view: bool) -> None:
        self.pg = pg
        self.comm_id = comm_id
        self.name_id = name_id
        self.div = div
        self.as_view = as_view
        self.inner: Callable[[Any, Any], Any] | None = None  # the user's hook, once registered
        self.inner_state: Any = None
        self.seq = 0
        self.user_hooked = False
        self.kernel = False  # recorded by the allreduce kernel, no comm hook (see _attach_ddp)
        self.handle = -1  # the C++ kernel's handle on this DDP's group (it counts seq then), else -1


def _default_bucket_hook(st: _DDPState, bucket: Any, row: tuple[Any, ...] | None = None,
                         gpu: tuple[Any, Any] | None = None) -> Any:  # fmt: skip
    """The Reducer's built-in behaviour without a hook, in Python.

    Without a hook the Reducer scales each gradient by 1/world while copying it
    into the bucket (``mul`` by the reciprocal; ``div`` when the gradient already
    is a view of the bucket) and then sum-all-reduces the bucket; with a hook it
    copies unscaled. Doing the same scaling here keeps the result bit-identical.

    ``row`` given: the one ``then`` callback DDP needs anyway (to hand back the
    tensor) also records the bucket's completion. A second callback per bucket
    measurably slowed steps on an oversubscribed CPU (each is a thread handoff).
    """
    buf = bucket.buffer()
    if st.as_view:
        buf.div_(st.div)
    else:
        buf.mul_(1.0 / st.div)
    was = _busy(True)  # not a bucket of a kernel-recorded DDP on the same group
    try:
        fut = st.pg.allreduce([buf]).get_future()
    finally:
        _unbusy(was)
    if row is None:
        return fut.then(_first_value)
    return fut.then(functools.partial(_first_value_and_record, _REC, row, gpu))


def _first_value(fut: Any) -> Any:
    return fut.value()[0]


def _first_value_and_record(rec: Recorder | None, row: tuple[Any, ...], gpu: tuple[Any, Any] | None, fut: Any) -> Any:
    t1 = now_ns()
    if rec is not None:
        _add_from_callback(rec, row, t1)
        _gpu_end(gpu, row)
    return fut.value()[0]


_TORCH_DIR = ""
_SHIM_DIR = __file__.rsplit("/", 2)[0]  # distdiag/shim
#: id(code) -> (code, in torch or distdiag: a frame to walk past). Keyed by id (hashing a code
#: object hashes its bytecode, ~150 ns); holding the code keeps its id from being reused.
_internal_code: dict[int, tuple[Any, bool]] = {}


def _user_site(rec: Recorder) -> int:
    """String id of the first frame outside torch and distdiag: the user's ``loss.backward()`` line.

    A bucket hook runs inside the autograd engine, below the program's backward
    call; straggler findings are actionable only with that line. A few frames'
    walk per bucket (not per event), one dict look-up each; the line comes
    from the recorder's own site cache (:meth:`Recorder.site_of`, by code and
    bytecode offset, ids of that recorder). 0 when no Python frame is below
    the hook (an autograd device thread).
    """
    try:
        f: types.FrameType | None = sys._getframe(2)
    except ValueError:
        return 0
    internal = _internal_code
    while f is not None:
        code = f.f_code
        ent = internal.get(id(code))
        if ent is None:
            fn = code.co_filename
            ent = internal[id(code)] = (code, fn.startswith(_TORCH_DIR) or fn.startswith(_SHIM_DIR))
        if not ent[1]:
            break
        f = f.f_back
    return rec.site_of(f) if f is not None else 0


def _bucket_row(rec: Recorder, st: _DDPState, t0: int, seq: int, buf: Any) -> tuple[Any, ...]:
    """The ``COLL_ASYNC`` row (t0 first, no t1) of bucket ``seq`` of ``st``, all-reducing ``buf``."""
    aux = _dtype_ids.get(buf.dtype)
    if aux is None:
        aux = _dtype_id(rec, buf)
    return (t0, Kind.COLL_ASYNC, st.name_id, st.comm_id, seq, -1, buf.numel() * buf.element_size(), aux,
            _user_site(rec) if _TORCH_DIR else 0)  # fmt: skip


def _bucket_hook(st: _DDPState, bucket: Any) -> Any:
    """DDP's comm hook: one ``COLL_ASYNC`` row per bucket, t0 at launch, t1 at completion.

    Per bucket this costs a few microseconds of Python on the autograd thread
    and one callback on the backend's thread, which DDP needs anyway to hand
    the bucket back (``benchmarks/bench_torch_step.py --micro`` measures it).
    What having *any* comm hook costs (the Reducer copies gradients into the
    bucket unscaled, so the scaling is a second pass over the bucket) is
    measured by ``bench_torch_step.py --variants``.
    """
    rec = _REC
    inner = st.inner
    if rec is None:
        return inner(st.inner_state, bucket) if inner is not None else _default_bucket_hook(st, bucket)
    timer = _cuda_events._TIMER
    gpu = _gpu_begin(timer, bucket.buffer()) if timer is not None else None
    t0 = now_ns()
    seq = st.seq
    st.seq = seq + 1
    try:
        row = _bucket_row(rec, st, t0, seq, bucket.buffer())
    except Exception:
        row = (t0, Kind.COLL_ASYNC, st.name_id, st.comm_id, seq, -1, 0, 0, 0)
    if inner is None:
        return _default_bucket_hook(st, bucket, row, gpu)
    was = _busy(True)  # collectives the user's hook makes are the bucket's, not rows of their own
    try:
        fut = inner(st.inner_state, bucket)
    finally:
        _unbusy(was)
    try:
        fut.add_done_callback(functools.partial(_record_done_gpu, rec, row, gpu))
    except Exception:
        log.debug("distdiag: could not time a DDP bucket", exc_info=True)
    return fut


def _attach_ddp(ddp: Any) -> None:
    global _ddp_count
    rec = _REC
    reducer = getattr(ddp, "reducer", None)
    if rec is None or reducer is None or _dist is None or not getattr(_CFG, "ddp_buckets", True):
        return
    pg = ddp.process_group
    comm = _comm_id(rec, pg)
    if comm is None:
        return
    n = _ddp_count
    _ddp_count += 1
    st = _DDPState(
        pg=pg,
        comm_id=rec.intern(f"ddp{n}:{rec.strings.strings[comm]}"),
        name_id=rec.intern(BUCKET_OP),
        div=int(pg.size()),
        as_view=bool(getattr(ddp, "gradient_as_bucket_view", False)),
    )
    with _cb_lock:  # made now, on the program's thread, not by the first bucket's callback
        _callback_buffer(rec)
    use_kernel = getattr(_CFG, "ddp_kernel", True)  # DISTDIAG_DDP_KERNEL=0: the comm hook, as on GPUs
    if (use_kernel and getattr(ddp, "device_type", None) == "cpu" and _kernel_ddp(pg) is None and _ensure_kernel()
            and (_ck is None or _ck_watch(st, ddp))):  # fmt: skip
        st.kernel = True
        # the DDP gone, the C++ kernel stops recording its group (a handle names this DDP's watch only)
        _kernel_pgs[id(pg)] = weakref.ref(st, functools.partial(_ck_unwatch, st.handle)) if st.handle >= 0 else weakref.ref(st)
    else:
        _original("_register_comm_hook")(reducer, st, _bucket_hook)
    _ddp_states[ddp] = st


# -- DDP on CPU: the Reducer's own path, recorded by an allreduce kernel --------------
#: id(process group) -> the kernel-recorded DDP's state on it (at most one per group: its rows need
#: one owner; a second DDP on the group gets the comm hook). Weak: a DDP's state lives as long as it.
_kernel_pgs: dict[int, weakref.ref[_DDPState]] = {}


def _kernel_ddp(group: Any) -> _DDPState | None:
    r = _kernel_pgs.get(id(group))
    st = r() if r is not None else None
    return st if st is not None and st.pg is group else None


_kernel_lib: Any = None
#: the C++ kernel's module while it is the kernel (then _kernel_lib is it too), else None
_ck: Any = None
_kernel_refs: tuple[Any, ...] = ()  # (op, keyset below autograd, ProcessGroup.unbox, Work.unbox, graph task id)


def _ensure_kernel() -> bool:
    """Register :func:`_allreduce_kernel` for ``c10d::allreduce_`` at the AutogradCPU key; False if torch can't.

    Why, for DDP on CPU only: any comm hook makes the Reducer copy gradients
    into the bucket unscaled, so the 1/world scaling becomes a second pass over
    every bucket (~0.4 ms of CPU per 4 MB on the 2-core test machine, the bulk
    of what bucket capture cost there). Without a hook the Reducer takes its
    built-in path (scaling fused into the copy, results bit-identical by
    construction) and calls ``c10d::allreduce_`` through the dispatcher, where
    a kernel at the Autograd key runs first: it launches the real one
    (``redispatch`` below autograd) and, for a DDP bucket, records the row.
    The Python kernel costs ~12-14 us of CPU on *every* CPU allreduce of the
    process (``bench_torch_step.py --micro``), and a bucket ~50-70 us in all
    (the dispatcher boxes the call into Python; the callback takes a Python
    thread state on gloo's thread), so the C++ kernel (``_ddpk``, the same
    rule in C++; its rows wait in C++ until the recorder's drain takes them,
    :func:`_feed`) is the one used wherever it was built. On GPUs
    the scaling pass is a cheap kernel and NCCL all-reduces are launched far
    more often (tensor parallelism), so CUDA DDPs keep the comm hook.
    """
    global _kernel_lib, _kernel_refs, _ck
    if _kernel_lib is not None:
        return True
    if getattr(_CFG, "ddp_kernel_impl", "auto") != "python":
        ck = _load_ck()
        if ck is not None:
            try:
                ck.install(_ck_site, int(Kind.COLL_ASYNC))
            except Exception:
                log.debug("distdiag: the C++ allreduce kernel did not install; the Python one does", exc_info=True)
            else:
                _kernel_lib = _ck = ck
                return True
    try:
        import torch

        op = torch.ops.c10d.allreduce_.default
        refs = (op, torch._C._after_autograd_keyset, _dist.ProcessGroup.unbox, _dist.Work.unbox,  # type: ignore[union-attr]
                torch._C._current_graph_task_id)  # fmt: skip
        lib = torch.library.Library("c10d", "IMPL")
        lib.impl("allreduce_", _allreduce_kernel, "AutogradCPU", with_keyset=True)
    except Exception:
        log.debug("distdiag: no allreduce kernel; DDP buckets go through a comm hook", exc_info=True)
        return False
    _kernel_refs, _kernel_lib = refs, lib
    return True


def _load_ck() -> Any:
    """distdiag.shim.hooks._ddpk (the C++ kernel), or None where it is not built, or was built
    against another torch than the one running (its C++ types would not be this torch's)."""
    try:
        import torch

        from distdiag.shim.hooks import _ddpk  # type: ignore[attr-defined]
    except Exception:
        return None
    if getattr(_ddpk, "TORCH_VERSION", None) != torch.__version__ or getattr(_ddpk, "ROW_SIZE", 0) != ROW_SIZE:
        return None
    return _ddpk


def _ck_site() -> int:
    """The C++ kernel's call for a bucket's source line, once per backward pass (GIL held).

    Called from C on the thread running the backward: the frame below is the
    program's (or torch's) Python frame that started it."""
    rec = _REC
    if rec is None or not _TORCH_DIR:
        return 0
    try:
        return _user_site(rec)
    except Exception:
        return 0


def _ck_watch(st: _DDPState, ddp: Any) -> bool:
    """Have the C++ kernel record ``st``'s buckets (it counts their seq from ``st.seq`` on);
    False if it cannot (then the DDP takes the comm hook).

    The kernel takes no GIL for a bucket's dtype: it is handed the string ids of the
    dtypes a bucket of this DDP can have (its parameters', and its mixed-precision
    ones) now; a bucket of another dtype would carry aux 0."""
    try:
        import torch

        rec = _REC
        assert rec is not None
        dtypes = _bucket_dtypes(torch, ddp)
        ids = [_dtype_id(rec, torch.empty(0, dtype=d)) for d in dtypes]
        handle = int(torch.ops.distdiag.watch(st.pg.boxed(), st.comm_id, st.name_id, st.seq,
                                            [torch.empty(0, dtype=d) for d in dtypes], ids))  # fmt: skip
    except Exception:
        log.debug("distdiag: the C++ kernel cannot watch this group", exc_info=True)
        return False
    st.handle = handle
    return handle >= 0


def _bucket_dtypes(torch: Any, ddp: Any) -> list[Any]:
    """The floating-point dtypes ``ddp``'s buckets can have, in first-seen order: its
    parameters', its mixed-precision ones, and the half precisions torch's compression
    hooks all-reduce in."""
    seen: dict[Any, None] = {}
    for p in ddp.parameters():
        if p.requires_grad and p.dtype.is_floating_point:
            seen[p.dtype] = None
    mp = getattr(ddp, "mixed_precision", None)
    for name in ("param_dtype", "reduce_dtype"):
        d = getattr(mp, name, None)
        if isinstance(d, torch.dtype) and d.is_floating_point:
            seen[d] = None
    for d in (torch.float16, torch.bfloat16):
        seen[d] = None
    return list(seen)


def _ck_unwatch(handle: int, _ref: Any = None) -> int:
    """Stop the C++ kernel's recording of the watch ``handle``; its next seq, or -1. Never raises."""
    ck = _ck
    if ck is None or handle < 0:
        return -1
    try:
        import torch

        return int(torch.ops.distdiag.unwatch(handle))
    except Exception:
        return -1


def _feed(rec: Recorder) -> None:
    """The recorder's drain takes the C++ kernel's completed rows first: into the shared
    callback buffer, under its lock (one writer at a time, as every callback writes). Rows the
    kernel could not hold come back as lost rows. Never raises."""
    ck = _ck
    if ck is None or rec is not _REC:
        return
    try:
        with _cb_lock:
            tb = _callback_buffer(rec)
            while True:
                n = tb.n
                if n >= tb.cap:
                    n = rec._rotate(tb)
                k, lost = ck.take(tb.buf, n * ROW_SIZE, tb.cap - n, tb.tid)
                if lost:
                    rec.lost_events += lost
                if not k:
                    break
                tb.n = n + k  # publish after the rows are complete
    except Exception:
        log.debug("distdiag: could not take the C++ kernel's rows", exc_info=True)


def _drop_kernel() -> None:
    global _kernel_lib, _ck
    lib, _kernel_lib = _kernel_lib, None
    if lib is not None and lib is _ck:
        _ck = None
        try:
            lib.uninstall()
        except Exception:
            log.debug("distdiag: could not remove the C++ allreduce kernel", exc_info=True)
    elif lib is not None:
        try:
            lib._destroy()
        except Exception:
            log.debug("distdiag: could not remove the allreduce kernel", exc_info=True)


def _allreduce_kernel(keyset: Any, tensors: Any, pg: Any, op: Any, sparse: Any, async_op: bool = True, timeout: int = -1) -> Any:
    """``c10d::allreduce_`` at AutogradCPU: the real all-reduce, and a row if it is a kernel-recorded DDP's bucket.

    A bucket: launched on that DDP's group, not from inside a recorded call
    (our Python wrappers and comm hooks set ``_tls.busy``), from the autograd
    engine (backward) or from DDP's join hook shadowing the others' buckets, on
    a floating-point tensor (the unused-parameter map is int32).
    """
    refs = _kernel_refs
    t0 = now_ns()
    out = refs[0].redispatch(keyset & refs[1], tensors, pg, op, sparse, async_op, timeout)
    if _kernel_pgs and not _tls.busy:
        try:
            _kernel_record(refs, t0, tensors, pg, out)
        except Exception:
            log.debug("distdiag: could not time a DDP bucket", exc_info=True)
    return out


def _kernel_record(refs: tuple[Any, ...], t0: int, tensors: Any, pg: Any, out: Any) -> None:
    rec = _REC
    if rec is None:
        return
    st = _kernel_ddp(refs[2](pg))
    if st is None or not (_tls.ddp_join or refs[4]() >= 0):
        return
    buf = tensors[0]
    if not buf.is_floating_point():
        return
    seq = st.seq
    st.seq = seq + 1
    row = _bucket_row(rec, st, t0, seq, buf)
    refs[3](out[1]).get_future().add_done_callback(functools.partial(_record_done, rec, row))


def _kernel_to_hook(st: _DDPState, reducer: Any, register: Callable[..., Any]) -> None:
    """A kernel-recorded DDP gets a Python comm hook from the user: time it with ours around it."""
    if _kernel_ddp(st.pg) is st:
        del _kernel_pgs[id(st.pg)]
    if st.handle >= 0:
        seq = _ck_unwatch(st.handle)
        st.handle = -1
        if seq >= 0:
            st.seq = seq  # the hook's rows go on from the kernel's
    st.kernel = False
    register(reducer, st, _bucket_hook)


def _original(attr: str) -> Any:
    """torch.distributed's own function, even while we swap the module attribute."""
    for owner, name, orig in _patched:
        if owner is _dist and name == attr:
            return orig
    return getattr(_dist, attr)


class _Capture:
    """Swaps ``torch.distributed.<attr>`` for a function that hands its arguments to ``fn``."""

    def __init__(self, attr: str, fn: Callable[..., None]) -> None:
        self.attr, self.fn = attr, fn

    def __enter__(self) -> None:
        self.saved = getattr(_dist, self.attr)
        setattr(_dist, self.attr, self.fn)

    def __exit__(self, *exc: Any) -> None:
        setattr(_dist, self.attr, self.saved)


def _make_ddp_init(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        orig(self, *args, **kwargs)
        if _REC is not None and self not in _ddp_states:
            try:
                _attach_ddp(self)
            except Exception:
                log.debug("distdiag: DDP buckets will not be recorded", exc_info=True)

    __init__.__distdiag_original__ = orig  # type: ignore[attr-defined]
    return __init__


def _make_register_comm_hook(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def register_comm_hook(self: Any, state: object, hook: Callable[..., Any]) -> None:
        st = _ddp_states.get(self)
        if st is None or st.user_hooked:  # not ours, or a second registration: torch's own answer
            return orig(self, state, hook)

        def capture(reducer: Any, s: Any, h: Any) -> None:
            st.inner, st.inner_state, st.user_hooked = h, s, True
            if st.kernel:
                _kernel_to_hook(st, reducer, cap.saved)

        # torch's checks and logging run unchanged; only the final registration
        # with the Reducer (which already holds our hook, or gets it now) is redirected.
        cap = _Capture("_register_comm_hook", capture)
        with cap:
            return orig(self, state, hook)

    register_comm_hook.__distdiag_original__ = orig  # type: ignore[attr-defined]
    return register_comm_hook


def _make_register_builtin(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def _register_builtin_comm_hook(self: Any, comm_hook_type: Any) -> None:
        st = _ddp_states.get(self)
        if st is None or st.user_hooked:
            return orig(self, comm_hook_type)
        if st.kernel:  # torch's C++ hook calls the group's allreduce: the kernel records it
            st.user_hooked = True
            return orig(self, comm_hook_type)

        def capture(reducer: Any, t: Any) -> None:
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            if t == _dist.BuiltinCommHookType.FP16_COMPRESS:  # type: ignore[union-attr]
                st.inner, st.inner_state = default_hooks.fp16_compress_hook, st.pg
            else:
                st.inner, st.inner_state = default_hooks.allreduce_hook, st.pg
            st.user_hooked = True

        with _Capture("_register_builtin_comm_hook", capture):
            return orig(self, comm_hook_type)

    _register_builtin_comm_hook.__distdiag_original__ = orig  # type: ignore[attr-defined]
    return _register_builtin_comm_hook


def _make_join_shadow(orig: Callable[..., Any]) -> Callable[..., Any]:
    """DDP's join hook: a joined rank's shadow bucket all-reduces run outside backward; mark them."""

    @functools.wraps(orig)
    def _match_all_reduce_for_bwd_pass(self: Any, *args: Any, **kwargs: Any) -> Any:
        tls = _tls
        was = tls.ddp_join
        tls.ddp_join = True
        ck = _ck
        ck_was = ck.set_join(True) if ck is not None else False
        try:
            return orig(self, *args, **kwargs)
        finally:
            tls.ddp_join = was
            if ck is not None:
                ck.set_join(ck_was)

    _match_all_reduce_for_bwd_pass.__distdiag_original__ = orig  # type: ignore[attr-defined]
    return _match_all_reduce_for_bwd_pass


# -- install ------------------------------------------------------------------------
def _patch(owner: Any, attr: str, new: Any) -> None:
    _patched.append((owner, attr, getattr(owner, attr)))
    setattr(owner, attr, new)


def _on_torch_distributed(dist: types.ModuleType) -> None:
    global _c10d, _dist, _default_comm_id
    rec = _REC
    if rec is None or not getattr(dist, "is_available", lambda: False)():
        return
    c10d = dist.distributed_c10d
    _c10d, _dist = c10d, dist
    _default_comm_id = rec.intern("default")
    for name in list(_OPS) + ["batch_isend_irecv"]:
        orig = getattr(c10d, name, None)
        if orig is None or hasattr(orig, "__distdiag_original__"):
            continue
        new = _make_batch_wrapper(orig) if name == "batch_isend_irecv" else _make_wrapper(name, orig)
        _patch(c10d, name, new)
        if getattr(dist, name, None) is orig:
            _patch(dist, name, new)
    work = getattr(c10d, "Work", None)
    if work is not None:
        try:
            _patch(work, "wait", _make_wait(work.wait))
        except (TypeError, AttributeError):
            log.debug("distdiag: Work.wait not patchable; async p2p completes unseen")
    if _kernel_pgs:  # installed again: DDPs attached before record again
        _ensure_kernel()
    _hooks.when_imported("torch.nn.parallel.distributed", _on_ddp_module)


def _on_ddp_module(mod: types.ModuleType) -> None:
    global _TORCH_DIR
    if _REC is None:
        return
    import torch

    _TORCH_DIR = torch.__file__.rsplit("/", 1)[0]
    ddp = mod.DistributedDataParallel
    if hasattr(ddp.__init__, "__distdiag_original__"):
        return
    _patch(ddp, "__init__", _make_ddp_init(ddp.__init__))
    _patch(ddp, "register_comm_hook", _make_register_comm_hook(ddp.register_comm_hook))
    if hasattr(ddp, "_match_all_reduce_for_bwd_pass"):
        _patch(ddp, "_match_all_reduce_for_bwd_pass", _make_join_shadow(ddp._match_all_reduce_for_bwd_pass))
    if hasattr(ddp, "_register_builtin_comm_hook"):
        _patch(ddp, "_register_builtin_comm_hook", _make_register_builtin(ddp._register_builtin_comm_hook))


def _forget_recorder() -> None:
    global _REC, _cb_lock, _cb_buffer
    _REC = None
    _cb_lock = threading.Lock()  # another thread may have held it at fork
    _cb_buffer = None


def install(rec: Recorder, cfg: Any = None) -> None:
    """Hook torch.distributed now if imported, else the moment it is. Never imports torch."""
    global _REC, _CFG, _installed
    if _installed:
        return
    _REC, _CFG = rec, cfg
    _installed = True
    if _feed not in rec.feeders:
        rec.feeders.append(_feed)
    # A forked child (DataLoader workers) must not fill a recorder nobody flushes.
    os.register_at_fork(after_in_child=_forget_recorder)
    _hooks.when_imported("torch.distributed", _on_torch_distributed)


def uninstall() -> None:
    """Restore every original attribute exactly. DDPs built meanwhile keep a pass-through hook."""
    global _REC, _installed, _ddp_count
    rec = _REC
    if rec is not None:
        _feed(rec)  # the C++ kernel's rows so far go to the recorder before it is let go
    _REC = None
    _installed = False
    _drop_kernel()
    if rec is not None and _feed in rec.feeders:
        rec.feeders.remove(_feed)
    while _patched:
        owner, attr, orig = _patched.pop()
        try:
            setattr(owner, attr, orig)
        except Exception:
            log.debug("distdiag: could not restore %r.%s", owner, attr, exc_info=True)
    _seq.clear()
    _pg_ids.clear()
    _dtype_ids.clear()
    _future_ok.clear()
    _wait_ids.clear()
    _ddp_count = 0
