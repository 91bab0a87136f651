"""Formatting shared by the text and HTML renderers, so both say the same numbers the same way."""

from __future__ import annotations

from typing import Any


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
