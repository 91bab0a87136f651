"""Analyzer settings: ``Config``, from configs/default.toml [analyze], then ``--config FILE``.

The [analyze] table holds the settings every stage shares; each detector reads
its own sub-table ``[analyze.<detector>]`` through :meth:`Config.value`, with
the default written next to the code that uses it, so adding a detector never
needs an edit here::

    [analyze]
    min_fraction = 0.02          # findings that cost less than this share of wall-clock are dropped

    [analyze.straggler]
    min_fraction = 0.02

A user file passed with ``--config FILE`` overrides the defaults key by key
(the shim's [shim] table in the same file is ignored here).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from pathlib import Path
from typing import Any

from distdiag.errors import DistdiagError
# one place decides where configs/default.toml is, so the shim and the analyzer read the same file
from distdiag.shim.config import default_config_path

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Config:
    #: findings whose cost is below this share of the wall-clock are not reported
    min_fraction: float = 0.02
    #: how many findings the text report lists (the JSON has them all)
    max_findings: int = 10
    #: a run with more event rows than this (estimated from its file sizes) is analyzed
    #: streaming: the compute phases stay out of the in-memory table and are read band by
    #: band from the rank files (distdiag.bands); 0 streams always, -1 never. Text and JSON
    #: reports only: HTML and Perfetto draw every row, so they load everything.
    stream_events: int = 20_000_000
    #: a PyTorch profiler (Kineto) trace larger than this many bytes (compressed or
    #: decompressed) is refused with one line (distdiag.kineto: parsing holds ~5-10x it)
    kineto_max_trace_bytes: int = 256 << 20
    #: detectors to run; empty = every registered one
    detectors: list[str] = dataclasses.field(default_factory=list)
    #: per-detector tables: [analyze.<name>] -> {key: value}
    sections: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)

    def section(self, name: str) -> dict[str, Any]:
        return self.sections.get(name, {})

    def value(self, section: str, key: str, default: Any) -> Any:
        """``[analyze.<section>] key``, else the [analyze] setting of that name
        (``min_fraction``), else ``default``; converted to the default's type."""
        sec = self.sections.get(section, {})
        if key in sec:
            v = sec[key]
        elif key in _SCALARS:
            v = getattr(self, key)
        else:
            v = default
        if default is None or v is default:
            return v
        try:
            if isinstance(default, bool):
                return bool(v)
            if isinstance(default, (int, float)) and not isinstance(v, bool):
                return type(default)(v)
        except (TypeError, ValueError):
            raise DistdiagError(f"config: [analyze.{section}] {key} = {v!r} is not a {type(default).__name__}") from None
        return v


_SCALARS = {f.name for f in dataclasses.fields(Config)} - {"sections"}


def _read_toml(path: Path) -> dict[str, Any]:
    import tomllib

    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise DistdiagError(f"config file '{path}' does not exist") from None
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise DistdiagError(f"config file '{path}' cannot be read: {e}") from None


def _apply(cfg: Config, table: dict[str, Any], source: str) -> None:
    for k, v in table.items():
        if isinstance(v, dict):
            sec = cfg.sections.setdefault(k, {})
            sec.update(v)
        elif k in _SCALARS:
            default = getattr(Config, k, None)
            try:
                if k == "detectors":
                    if not isinstance(v, list):
                        raise TypeError
                    setattr(cfg, k, [str(x) for x in v])
                elif isinstance(default, (int, float)):
                    setattr(cfg, k, type(default)(v))
                else:
                    setattr(cfg, k, v)
            except (TypeError, ValueError):
                raise DistdiagError(f"config {source}: [analyze] {k} = {v!r} has the wrong type") from None
        else:
            log.warning("distdiag: config %s: unknown setting [analyze] %s (ignored)", source, k)


def load_config(path: str | Path | None = None) -> Config:
    """Defaults, then configs/default.toml [analyze], then ``path`` [analyze] if given."""
    cfg = Config()
    dp = default_config_path()
    if dp is not None:
        _apply(cfg, copy.deepcopy(_read_toml(dp).get("analyze", {})), str(dp))
    if path is not None:
        data = _read_toml(Path(path))
        if "analyze" not in data and "shim" not in data:
            log.warning("distdiag: config %s has no [analyze] table; nothing to override", path)
        _apply(cfg, data.get("analyze", {}), str(path))
    return cfg
