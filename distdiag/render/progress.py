"""A progress bar on stderr while ``load_run`` reads many rank files; silent unless stderr is a terminal.

Kept apart from the renderers so the CLI can draw it before it imports pandas
and the detectors (a wrong path still answers in a fraction of a second).
"""

from __future__ import annotations

import os
import sys
import time
from typing import TextIO


class ProgressBar:
    """``[####......] 120/512 rank files`` on stderr, redrawn in place; silent unless stderr is a TTY.

    Call it as ``progress(done, total)`` (the ``load_run`` callback); it draws
    only for ``min_total`` files or more and at most every ``interval_s``.
    """

    def __init__(self, stream: TextIO | None = None, min_total: int = 16, interval_s: float = 0.1,
                 enabled: bool | None = None) -> None:  # fmt: skip
        self.stream = stream or sys.stderr
        try:
            tty = bool(self.stream.isatty()) and os.environ.get("TERM") != "dumb"
        except (AttributeError, ValueError):  # closed or replaced streams
            tty = False
        self.enabled = tty if enabled is None else enabled
        self.min_total = min_total
        self.interval_s = interval_s
        self._last = 0.0
        self._drawn = False

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled or total < self.min_total:
            return
        now = time.monotonic()
        if done < total and now - self._last < self.interval_s:
            return
        self._last = now
        width = 30
        k = width * done // max(total, 1)
        self.stream.write(f"\rdistdiag: loading [{'#' * k}{'.' * (width - k)}] {done}/{total} rank files")
        self._drawn = True
        if done >= total:
            self.stream.write("\r\x1b[K")  # clear the line: the report follows on stdout
        self.stream.flush()
