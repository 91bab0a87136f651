"""The JSON report: the stable contract of DESIGN.md (``schema: distdiag.report/1``)."""

from __future__ import annotations

import json
from typing import Any


class JsonRenderer:
    def __init__(self, indent: int | None = 2) -> None:
        self.indent = indent

    def render(self, report: Any) -> str:
        return json.dumps(report.to_json(), indent=self.indent, allow_nan=False) + "\n"
