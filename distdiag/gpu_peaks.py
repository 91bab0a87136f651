"""Which GPU a rank ran on and what it can do: the device names its rank file records (NVML's)
and their peak FLOP/s and memory bandwidth from ``configs/gpus.toml``. The ``gpu_underutilized``
detector and the GPU timeline's evidence (:mod:`distdiag.gpu_timeline`) read them.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from distdiag.config import Config
    from distdiag.run import Run


def gpus_file(cfg: Config) -> Path | None:
    """The table of GPU peaks: ``[analyze.gpu_underutilized] gpus_file``, else the project's."""
    p = cfg.value("gpu_underutilized", "gpus_file", "")
    if p:
        return Path(p)
    here = Path(__file__).resolve().parent  # distdiag/
    for c in (here.parent / "configs" / "gpus.toml", here / "configs" / "gpus.toml"):
        if c.is_file():
            return c
    return None


@lru_cache(maxsize=8)
def load_table(path: str) -> list[dict[str, Any]]:
    """The ``[[gpu]]`` entries of a peaks table."""
    import tomllib

    with open(path, "rb") as f:
        return list(tomllib.load(f).get("gpu", []))


def peak_for(name: str, table: list[dict[str, Any]], precision: str) -> tuple[str, float, float] | None:
    """(table entry name, peak TFLOP/s at ``precision``, memory GB/s) for an NVML device name."""
    low = name.lower()
    for g in table:
        if all(str(m).lower() in low for m in g.get("match", [])):
            tf = float(g.get(f"tflops_{precision}", 0) or 0)
            if tf <= 0:
                continue
            return str(g.get("name", name)), tf, float(g.get("mem_gb_per_s", 0) or 0)
    return None


def gpu_names(run: Run, ranks: np.ndarray) -> dict[int, dict[str, str]]:
    """The ``gpu_names`` attribute of each rank file (JSON {nvml index: name})."""
    out: dict[int, dict[str, str]] = {}
    for r in ranks:  # only ranks that have GPU samples
        info = run.ranks.get(int(r))
        if info is None:
            continue
        raw = (getattr(info, "attrs", None) or {}).get("gpu_names")
        if raw is None:
            try:
                from distdiag.run import open_rank_file

                with open_rank_file(info.path) as f:  # a regular file of the run dir's own, never a link
                    raw = f.attrs.get("gpu_names")
            except Exception:
                raw = None
        if raw is None:
            continue
        try:
            out[int(r)] = {str(k): str(v) for k, v in json.loads(raw if isinstance(raw, str) else raw.decode()).items()}
        except Exception:
            continue
    return out
