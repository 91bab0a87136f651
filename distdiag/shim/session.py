"""The running shim's state, for hooks and the user API.

``SESSION`` is None when the program runs without ``distdiag-wrap`` (or when
the wrapper could not set up recording); everything that records checks it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from distdiag.shim.config import ShimConfig
    from distdiag.shim.recorder import Recorder
    from distdiag.shim.writer import Writer


@dataclasses.dataclass
class Session:
    rec: Recorder
    writer: Writer
    cfg: ShimConfig
    rank: int
    world_size: int
    local_rank: int
    host: str
    job_id: str
    launch_id: str
    run_dir: Path


SESSION: Session | None = None
