"""Compute phases of a PyTorch program, recorded without the user changing a line.

* ``INPUT_WAIT``: time the program is blocked in a DataLoader iterator's
  ``__next__`` (``torch.utils.data.dataloader._BaseDataLoaderIter``; the
  single- and multi-process iterators both inherit it). With worker processes
  this is only the part the workers did not hide.
* ``FORWARD``: the *outermost* ``nn.Module.__call__`` on the thread (the DDP
  wrapper or the top-level model); nested sub-module calls are not rows.
* ``BACKWARD``: ``torch.Tensor.backward`` / ``torch.autograd.backward`` (the
  outer one; ``Tensor.backward`` calls ``autograd.backward``). With DDP this
  includes waiting for the last gradient buckets, which the bucket rows show.
* ``OPTIMIZER``: every ``Optimizer.step`` via torch's global step pre/post hooks.
  Each step of the first optimizer that steps also writes an instant ``STEP``
  row named ``optimizer_step``: the iteration boundary. (``distdiag.step()``
  writes ``STEP`` rows of its own, with samples/flops, under another name.)
* ``H2D``: ``Tensor.to`` / ``Tensor.cuda`` / ``Tensor.copy_`` that moves a CPU
  tensor onto a device that is neither CPU nor ``meta`` (``meta`` tensors hold
  no data: no bytes cross any bus). ``nbytes`` is the tensor's size. A
  ``non_blocking`` copy from pinned memory records the time to enqueue it, not
  the transfer. These three methods are called very often, so they are only
  wrapped when an accelerator is present (``ShimConfig.h2d_copies = "auto"``),
  or always with ``"on"`` (tests on CPU-only machines, where no such copy can
  happen), never with ``"off"``.

Phases are finished rows (``rec.add`` with a t0 kept on the stack), never
``enter``/``leave``: a collective or a file read inside a phase keeps the
thread's one in-flight slot.

On a GPU (once the program initialized CUDA), FORWARD, BACKWARD, OPTIMIZER
and H2D also get their GPU-side span: a CUDA event pair on the current
device's current stream around the call, resolved later on the flusher
thread into a ``GPU_SPAN`` row (:mod:`distdiag.shim.hooks.cuda_events`). The
span runs from the GPU reaching the phase's first queued work to its last
work's end, so gaps inside a phase (the CPU launching too slowly) count as
the phase's; :mod:`distdiag.gpu_timeline` builds the per-step GPU breakdown
from these spans. Verified only against ``tests/fake_cuda`` (no GPU here).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import types
from typing import Any, Callable

from distdiag.schema import Kind
from distdiag.shim import hooks as _hooks
from distdiag.shim.hooks import cuda_events as _cuda_events
from distdiag.shim.recorder import Recorder, now_ns

log = logging.getLogger(__name__)

STEP_NAME = "optimizer_step"


class _TLS(threading.local):
    in_forward = False
    in_backward = False
    in_h2d = False


_tls = _TLS()
_REC: Recorder | None = None
_CFG: Any = None
_patched: list[tuple[Any, str, Any]] = []
_handles: list[Any] = []
_ids: dict[str, int] = {}
_cls_ids: dict[type, int] = {}  # module class -> string id of its name (the FORWARD row's name)
_opt_t0: dict[int, tuple[int, Any]] = {}  # id(optimizer) -> (t0, CUDA token) of the step in progress
_primary_opt: list[int] = []  # id of the optimizer whose steps mark iterations
_installed = False


def _sid(name: str) -> int:
    i = _ids.get(name)
    if i is None and _REC is not None:
        i = _ids[name] = _REC.intern(name)
    return i or 0


def _gpu_begin() -> Any:
    """A CUDA event token for the phase starting now (None without CUDA: one global read)."""
    t = _cuda_events._TIMER
    if t is None:
        return None
    return t, t.begin()


def _gpu_end(tok: Any, kind: int, name_id: int, t0: int) -> None:
    if tok is not None:
        tok[0].end(tok[1], kind, name_id, t0)


def _patch(owner: Any, attr: str, new: Any) -> None:
    _patched.append((owner, attr, getattr(owner, attr)))
    setattr(owner, attr, new)


# -- data loader -----------------------------------------------------------------------
def _make_next(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def __next__(self: Any) -> Any:
        rec = _REC
        if rec is None:
            return orig(self)
        t0 = now_ns()
        try:
            return orig(self)
        finally:
            try:
                rec.add(t0, now_ns(), Kind.INPUT_WAIT, _sid("DataLoader.__next__"))
            except Exception:
                pass

    __next__.__distdiag_original__ = orig  # type: ignore[attr-defined]
    return __next__


def _on_dataloader(mod: types.ModuleType) -> None:
    cls = getattr(mod, "_BaseDataLoaderIter", None)
    if cls is None or _REC is None or hasattr(cls.__next__, "__distdiag_original__"):
        return
    _patch(cls, "__next__", _make_next(cls.__next__))


# -- forward / backward ------------------------------------------------------------------
def _make_module_call(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        tls = _tls
        if tls.in_forward or _REC is None:  # a sub-module: the outer call's row covers it
            return orig(self, *args, **kwargs)
        tls.in_forward = True
        t0 = now_ns()
        gtok = _gpu_begin()
        try:
            return orig(self, *args, **kwargs)
        finally:
            tls.in_forward = False
            rec = _REC
            if rec is not None:
                try:
                    cls = type(self)
                    nid = _cls_ids.get(cls)
                    if nid is None:
                        nid = _cls_ids[cls] = _sid(cls.__name__)
                    rec.add(t0, now_ns(), Kind.FORWARD, nid)
                    _gpu_end(gtok, Kind.FORWARD, nid, t0)
                except Exception:
                    pass

    __call__.__distdiag_original__ = orig  # type: ignore[attr-defined]
    return __call__


def _make_backward(orig: Callable[..., Any], name: str) -> Callable[..., Any]:
    @functools.wraps(orig)
    def backward(*args: Any, **kwargs: Any) -> Any:
        tls = _tls
        if tls.in_backward or _REC is None:
            return orig(*args, **kwargs)
        tls.in_backward = True
        t0 = now_ns()
        gtok = _gpu_begin()
        try:
            return orig(*args, **kwargs)
        finally:
            tls.in_backward = False
            rec = _REC
            if rec is not None:
                try:
                    nid = _sid(name)
                    rec.add(t0, now_ns(), Kind.BACKWARD, nid)
                    _gpu_end(gtok, Kind.BACKWARD, nid, t0)
                except Exception:
                    pass

    backward.__distdiag_original__ = orig  # type: ignore[attr-defined]
    return backward


# -- optimizer ----------------------------------------------------------------------------
def _opt_pre(optimizer: Any, args: Any, kwargs: Any) -> None:
    try:
        _opt_t0[id(optimizer)] = (now_ns(), _gpu_begin())
    except Exception:
        pass


def _opt_post(optimizer: Any, args: Any, kwargs: Any) -> None:
    rec = _REC
    if rec is None:
        return
    try:
        t1 = now_ns()
        key = id(optimizer)
        t0, gtok = _opt_t0.pop(key, (t1, None))
        nid = _sid(type(optimizer).__name__)
        rec.add(t0, t1, Kind.OPTIMIZER, nid)
        _gpu_end(gtok, Kind.OPTIMIZER, nid, t0)
        if not _primary_opt:
            _primary_opt.append(key)
        if _primary_opt[0] == key:
            rec.add(t1, t1, Kind.STEP, _sid(STEP_NAME))
    except Exception:
        pass


# -- host-to-device copies -------------------------------------------------------------------
def _is_h2d(src: Any, dst: Any) -> bool:
    """A copy from host memory onto an accelerator: CPU source, destination neither CPU nor meta."""
    return bool(src.is_cpu) and not dst.is_cpu and not dst.is_meta


def _tensor_nbytes(t: Any) -> int:
    try:
        return int(t.numel()) * int(t.element_size())
    except Exception:
        return 0


def _make_to(orig: Callable[..., Any], name: str) -> Callable[..., Any]:
    """Tensor.to / Tensor.cuda: the result lives on the device when a copy happened."""

    @functools.wraps(orig)
    def to(self: Any, *args: Any, **kwargs: Any) -> Any:
        rec = _REC
        if rec is None or _tls.in_h2d or not self.is_cpu:
            return orig(self, *args, **kwargs)
        _tls.in_h2d = True
        t0 = now_ns()
        gtok = _gpu_begin()
        try:
            out = orig(self, *args, **kwargs)
        finally:
            _tls.in_h2d = False
        try:
            if out is not self and _is_h2d(self, out):
                nid = _sid(name)
                rec.add(t0, now_ns(), Kind.H2D, nid, nbytes=_tensor_nbytes(out), site_id=rec.site(2))
                _gpu_end(gtok, Kind.H2D, nid, t0)
            elif gtok is not None:
                gtok[0].cancel(gtok[1])
        except Exception:
            pass
        return out

    to.__distdiag_original__ = orig  # type: ignore[attr-defined]
    return to


def _make_copy(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def copy_(self: Any, src: Any, *args: Any, **kwargs: Any) -> Any:
        rec = _REC
        if rec is None or _tls.in_h2d or self.is_cpu:
            return orig(self, src, *args, **kwargs)
        _tls.in_h2d = True
        t0 = now_ns()
        gtok = _gpu_begin()
        try:
            out = orig(self, src, *args, **kwargs)
        finally:
            _tls.in_h2d = False
        try:
            if _is_h2d(src, self):
                nid = _sid("Tensor.copy_")
                rec.add(t0, now_ns(), Kind.H2D, nid, nbytes=_tensor_nbytes(src), site_id=rec.site(2))
                _gpu_end(gtok, Kind.H2D, nid, t0)
            elif gtok is not None:
                gtok[0].cancel(gtok[1])
        except Exception:
            pass
        return out

    copy_.__distdiag_original__ = orig  # type: ignore[attr-defined]
    return copy_


def _h2d_mode() -> str:
    mode = str(getattr(_CFG, "h2d_copies", "") or os.environ.get("DISTDIAG_H2D_COPIES", "auto")).lower()
    return mode if mode in ("auto", "on", "off") else "auto"


def _accelerator_present(torch: Any) -> bool:
    """A torch built with CUDA (or XPU, MPS available), read without the CUDA driver: not
    ``torch.cuda.is_available()``, whose cudaGetDeviceCount runs cuInit, and a cuInit in a
    program that had not touched CUDA poisons fork (torch's docs: a child forked afterwards
    cannot use CUDA). A CUDA build on a node without a GPU wraps the copies for nothing."""
    try:
        compiled = getattr(torch.cuda, "_is_compiled", None)
        if bool(compiled()) if callable(compiled) else bool(getattr(getattr(torch, "version", None), "cuda", None)):
            return True
    except Exception:
        pass
    for dev in ("xpu", "mps"):
        try:
            m = getattr(torch, dev, None) or getattr(getattr(torch, "backends", None), dev, None)
            if m is not None and m.is_available():
                return True
        except Exception:
            pass
    return False


# -- install ------------------------------------------------------------------------------------
def _on_torch(torch: types.ModuleType) -> None:
    if _REC is None:
        return
    Module = torch.nn.Module
    if not hasattr(Module.__call__, "__distdiag_original__"):
        _patch(Module, "__call__", _make_module_call(Module.__call__))
    Tensor = torch.Tensor
    if not hasattr(Tensor.backward, "__distdiag_original__"):
        _patch(Tensor, "backward", _make_backward(Tensor.backward, "Tensor.backward"))
    ag = torch.autograd
    if not hasattr(ag.backward, "__distdiag_original__"):
        _patch(ag, "backward", _make_backward(ag.backward, "autograd.backward"))
    try:
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        _handles.append(register_optimizer_step_pre_hook(_opt_pre))
        _handles.append(register_optimizer_step_post_hook(_opt_post))
    except Exception:
        log.debug("distdiag: no global optimizer hooks in this torch", exc_info=True)
    mode = _h2d_mode()
    if mode == "on" or (mode == "auto" and _accelerator_present(torch)):
        if not hasattr(Tensor.to, "__distdiag_original__"):
            _patch(Tensor, "to", _make_to(Tensor.to, "Tensor.to"))
            _patch(Tensor, "cuda", _make_to(Tensor.cuda, "Tensor.cuda"))
            _patch(Tensor, "copy_", _make_copy(Tensor.copy_))
    _hooks.when_imported("torch.utils.data.dataloader", _on_dataloader)


def _forget_recorder() -> None:
    global _REC
    _REC = None


def install(rec: Recorder, cfg: Any = None) -> None:
    """Hook torch's phases once torch has finished importing. Never imports torch."""
    global _REC, _CFG, _installed
    if _installed:
        return
    _REC, _CFG, _installed = rec, cfg, True
    # A forked child (DataLoader workers) must not fill a recorder nobody flushes.
    os.register_at_fork(after_in_child=_forget_recorder)
    # "torch", not a submodule: nn, autograd and optim are all loaded once it is
    _hooks.when_imported("torch", _on_torch)


def uninstall() -> None:
    global _REC, _installed
    _REC = None
    _installed = False
    while _handles:
        try:
            _handles.pop().remove()
        except Exception:
            pass
    while _patched:
        owner, attr, orig = _patched.pop()
        try:
            setattr(owner, attr, orig)
        except Exception:
            log.debug("distdiag: could not restore %r.%s", owner, attr, exc_info=True)
    _ids.clear()
    _cls_ids.clear()
    _opt_t0.clear()
    _primary_opt.clear()
