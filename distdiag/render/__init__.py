"""Renderers: a renderer is a class with ``render(report) -> str`` (see STYLE.md).

``RENDERERS`` is the one registry the CLI's ``--format`` choices come from;
add a format by adding a line here. Renderers draw, they never compute a
finding.
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol


class Renderer(Protocol):
    def render(self, report: Any) -> str: ...


#: format name -> "module:Class", imported only when used
RENDERERS: dict[str, str] = {
    "text": "distdiag.render.text:TextRenderer",
    "json": "distdiag.render.json:JsonRenderer",
    "html": "distdiag.render.html:HtmlRenderer",
}


def get_renderer(fmt: str, **options: Any) -> Renderer:
    mod, _, cls = RENDERERS[fmt].partition(":")
    return getattr(importlib.import_module(mod), cls)(**options)  # type: ignore[no-any-return]


def render(report: Any, fmt: str = "text", **options: Any) -> str:
    return get_renderer(fmt, **options).render(report)
