"""The user-facing annotations: ``phase``, ``step``, ``mark``.

::

    import distdiag

    with distdiag.phase("data"):          # a named span (Kind.PHASE)
        batch = next(it)

    @distdiag.phase("eval")                # also a decorator
    def evaluate(model): ...

    distdiag.step(samples=256, tokens=256 * 2048, flops=3.1e15)   # iteration boundary
    distdiag.mark("checkpoint written")                            # an instant

Without ``distdiag-wrap`` (``SESSION`` is None) they do nothing: ``phase``
returns one shared no-op object (and a decorated function is returned
unchanged), ``step``/``mark`` return after one attribute read. They never
raise and never change what the program computes.

``step`` row: ``nbytes`` = samples, ``aux`` = tokens, ``value`` = flops; a value
not given is stored as 0 ("unknown").
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, TypeVar

from distdiag.schema import Kind
from distdiag.shim import session as _session
from distdiag.shim.recorder import now_ns

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])

# plain ints: an IntEnum attribute lookup costs ~50 ns a call
_PHASE = int(Kind.PHASE)
_STEP = int(Kind.STEP)
_MARK = int(Kind.MARK)


class _NullPhase:
    """What ``phase()`` returns when nothing records."""

    __slots__ = ()

    def __enter__(self) -> _NullPhase:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def __call__(self, fn: F) -> F:
        return fn


_NULL = _NullPhase()


class _Phase:
    """A recording span. Nested and repeated use are fine; one object per ``with`` is typical."""

    __slots__ = ("name", "_name_id", "_t0s", "_spans")

    def __init__(self, name: str) -> None:
        self.name = name
        self._name_id = -1
        self._t0s: list[int] = []
        #: the open span of each active ``with`` (None when it could not be opened)
        self._spans: list[Any] = []

    def __enter__(self) -> _Phase:
        t0 = now_ns()
        self._t0s.append(t0)
        span = None
        try:  # open span: a rank killed inside the phase shows it in /inflight
            s = _session.SESSION
            if s is not None:
                rec = s.rec
                if self._name_id < 0:
                    self._name_id = rec.intern(self.name)
                span = rec.open_span(_PHASE, self._name_id, rec.site(2), t0)
        except Exception:
            log.debug("distdiag: phase %r not opened", self.name, exc_info=True)
        self._spans.append(span)
        return self

    def __exit__(self, *exc: Any) -> None:
        t1 = now_ns()
        try:
            t0 = self._t0s.pop()
            span = self._spans.pop() if self._spans else None
            s = _session.SESSION
            if s is not None and span is not None:
                s.rec.close_span(span)
            if s is None:
                return None
            rec = s.rec
            if self._name_id < 0:
                self._name_id = rec.intern(self.name)
            # the call site taken at enter (the `with` line) saves a second frame lookup
            rec.add(t0, t1, _PHASE, self._name_id, 0, -1, -1, 0, 0, span[9] if span is not None else rec.site(2))
        except Exception:  # never into the user's code
            log.debug("distdiag: phase %r not recorded", self.name, exc_info=True)
        return None  # never swallow the user's exception

    def __call__(self, fn: F) -> F:
        name = self.name
        code = getattr(fn, "__code__", None)
        where = f"{code.co_filename}:{code.co_firstlineno}" if code is not None else ""

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = now_ns()
            span = None
            try:
                s = _session.SESSION
                if s is not None:
                    span = s.rec.open_span(_PHASE, s.rec.intern(name), s.rec.intern(where), t0)
            except Exception:
                log.debug("distdiag: phase %r not opened", name, exc_info=True)
            try:
                return fn(*args, **kwargs)
            finally:
                t1 = now_ns()
                try:
                    s = _session.SESSION
                    if s is not None:
                        rec = s.rec
                        if span is not None:
                            rec.close_span(span)
                        rec.add(t0, t1, _PHASE, rec.intern(name), 0, -1, -1, 0, 0, rec.intern(where))
                except Exception:
                    log.debug("distdiag: phase %r not recorded", name, exc_info=True)

        return wrapper  # type: ignore[return-value]


def phase(name: str) -> Any:
    """``with distdiag.phase("name"):`` or ``@distdiag.phase("name")``: record a named span."""
    if _session.SESSION is None:
        return _NULL
    try:
        return _Phase(str(name))
    except Exception:
        return _NULL


def step(samples: int | None = None, tokens: int | None = None, flops: float | None = None) -> None:
    """Mark an iteration boundary (instant Kind.STEP row) with what the step processed."""
    s = _session.SESSION
    if s is None:
        return
    try:
        t = now_ns()
        rec = s.rec
        rec.add(t, t, _STEP, rec.intern("step"), 0, -1, -1, int(samples or 0), int(tokens or 0), 0, float(flops or 0.0))
    except Exception:
        log.debug("distdiag: step not recorded", exc_info=True)


def mark(name: str) -> None:
    """Record an instant named event (Kind.MARK)."""
    s = _session.SESSION
    if s is None:
        return
    try:
        t = now_ns()
        rec = s.rec
        rec.add(t, t, _MARK, rec.intern(str(name)), 0, -1, -1, 0, 0, rec.site(2))
    except Exception:
        log.debug("distdiag: mark not recorded", exc_info=True)
