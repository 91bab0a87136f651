"""Formatting shared by the text and HTML renderers, so both say the same numbers the same way."""

from __future__ import annotations

import re
from typing import Any

#: Characters a terminal acts on instead of showing: C0 controls but the newline (ESC
#: starts a sequence that can clear the screen or set the window title; CR overwrites
#: a line), DEL, C1 controls (0x9b is a one-byte CSI on some terminals), and the
#: invisible format characters that reorder or hide text (bidi overrides, zero-width
#: characters, line/paragraph separators); and lone surrogates (a name that was not
#: UTF-8, decoded with ``surrogateescape``), which no terminal encoding can write.
_CONTROLS = re.compile(
    "[\x00-\x09\x0b-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e\u2060-\u206f\ud800-\udfff\ufeff\ufff9-\ufffb]"
)


def _escape_one(m: re.Match[str]) -> str:
    c = ord(m.group())
    return f"\\x{c:02x}" if c <= 0xFF else f"\\u{c:04x}"


def escape_controls(text: str) -> str:
    """``text`` with every character a terminal would act on written out as ``\\xNN`` /
    ``\\uNNNN``: a run dir is untrusted, and its host names, paths and call sites reach the
    terminal (a host name holding ESC[2J cleared the analyst's screen)."""
    return _CONTROLS.sub(_escape_one, text)


def fmt_s(x: float) -> str:
    """A duration in a unit people read: 123 s, 4.56 s, 7.8 ms, 90 µs."""
    x = float(x)  # numpy scalars print like floats
    if x >= 100:
        return f"{x:.0f} s"
    if x >= 1:
        return f"{x:.2f} s"
    if x >= 1e-3:
        return f"{x * 1e3:.1f} ms"
    return f"{x * 1e6:.0f} µs"


def short_list(xs: list[Any], limit: int, sep: str = ", ") -> str:
    """The first ``limit`` items joined by ``sep``, then ``+N`` for the rest; ``-`` for none."""
    if not xs:
        return "-"
    s = sep.join(str(x) for x in xs[:limit])
    return s + (f"{sep}+{len(xs) - limit}" if len(xs) > limit else "")

