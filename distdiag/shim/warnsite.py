"""Warnings raised inside the shim's wrappers point at the program's line, as unwrapped.

A hooked call puts a frame of the shim (``hooks/fileio.py``'s ``open``,
``stat``, h5py's ``File.__init__`` wrapper) between the program and the
original. The warnings module attributes a warning to a frame: C code warns at
the current frame (``open(p, "rb", buffering=1)``'s RuntimeWarning, the
EncodingWarning of ``open(p)`` under ``-X warn_default_encoding``,
``os.stat(bytearray(...))``'s DeprecationWarning), library code
``stacklevel`` frames up (h5py's ``swmr`` UserWarning, ``stacklevel=2``).
That frame gives the file and line shown, the module that ``-W
error::RuntimeWarning:__main__`` matches, and the registry behind "once per
location"; were it the shim's, the filters would not match and every program
line would share one location.

:func:`call_as_caller` calls the original from a frame made to look like the
caller's to the warnings module: a one-line function whose code object carries
the caller's file name and current line and which runs in the caller's
globals (its ``__name__``, its ``__warningregistry__``). It stands exactly
where the hook's frame stood, so a C warning, or a library's
``stacklevel=2`` from the function called (``stacklevel=3`` through one
decorator of the library's own), lands on the program's line; only a
stacklevel reaching past the program's frame into its callers would count the
hook's frame. The hooks take this path only where a warning is possible
(a ``buffering`` argument, a default encoding with the warning on, a path
that is neither str, bytes, int nor path-like, h5py's open); the hot path
(``open(p)``, ``os.stat(str)``) calls the original directly. Exceptions pass
unchanged, without this module's frames in their traceback.
"""

from __future__ import annotations

import sys
import types
from typing import Any, Callable

#: co_name of the frames :func:`call_as_caller` makes
TRAMPOLINE_NAME = "<distdiag: as caller>"

# One line, so every instruction of it maps to co_firstlineno: replacing that gives the line.
_TRAMPOLINE = (lambda fn, args, kwargs: fn(*args, **kwargs)).__code__.replace(co_name=TRAMPOLINE_NAME)  # fmt: skip
#: (file, line) -> the trampoline's code for it; bounded (a program has few such call sites)
_codes: dict[tuple[str, int], types.CodeType] = {}
MAX_CODES = 1 << 12


def _code_for(filename: str, lineno: int) -> types.CodeType:
    key = (filename, lineno)
    code = _codes.get(key)
    if code is None:
        code = _TRAMPOLINE.replace(co_filename=filename, co_firstlineno=lineno)
        if len(_codes) >= MAX_CODES:
            _codes.clear()
        _codes[key] = code
    return code


def call_as_caller(f: types.FrameType | None, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``fn(*args, **kwargs)`` called from a frame that the warnings module takes for ``f``
    (the hook's caller): ``f``'s globals, file and current line."""
    try:
        lineno = f.f_lineno if f is not None else None
        if not lineno or lineno < 1:
            return fn(*args, **kwargs)
        assert f is not None
        tramp = types.FunctionType(_code_for(f.f_code.co_filename, lineno), f.f_globals)
    except Exception:
        return fn(*args, **kwargs)
    try:
        return tramp(fn, args, kwargs)
    except BaseException as e:
        # as the original raised it: drop this frame's and the trampoline's traceback entries
        tb = e.__traceback__
        if tb is not None and tb.tb_frame is sys._getframe():
            nxt = tb.tb_next
            if nxt is not None and nxt.tb_frame.f_code.co_name == TRAMPOLINE_NAME:
                e.__traceback__ = nxt.tb_next
        raise
