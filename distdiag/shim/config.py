"""Shim settings: ``ShimConfig``, filled from ``configs/default.toml`` [shim],
then an optional ``--config FILE`` [shim] table, then ``DISTDIAG_*`` variables.

Environment: every field has a variable named ``DISTDIAG_`` + the field name in
upper case (``DISTDIAG_FLUSH_INTERVAL_S=0.2``, ``DISTDIAG_PROBE_LINKS=1``).
Hooks are switched with ``DISTDIAG_HOOKS="mpi4py=1,fileio=0"`` (short module
names as in ``distdiag.shim.hooks.HOOKS``); file calls are recorded by the libc
interposer (a re-exec with LD_PRELOAD; distdiag.shim.preload.PRELOAD_DEFAULT), ``preload=0``
there records them with the Python-level wrappers instead. Variables the config does not know
(``DISTDIAG_DIR``, ``DISTDIAG_HOST``; ``DISTDIAG_HOT=0``, read when distdiag.shim.recorder is
imported, before any config: the pure-Python twins of the C hot path) are left to their owners.

To add a setting: add a typed field with its default here and (optionally) a
line in configs/default.toml. The loader converts by the field's type
(bool, int, float, str, dict[str, bool]).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Any, Mapping

log = logging.getLogger(__name__)

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


#: What ``redact_args`` holds unless configured: the substrings schema.ENV_DENY_SUBSTRINGS
#: drops environment variables by, plus "passwd"
DEFAULT_REDACT_ARGS = "token,secret,password,passwd,key,cred"


@dataclasses.dataclass
class ShimConfig:
    #: seconds between background flushes: a SIGKILL loses at most this much
    flush_interval_s: float = 1.0
    #: rows per recorder chunk (one chunk = chunk_rows * 69 bytes per thread)
    chunk_rows: int = 16384
    #: full chunks waiting for the flusher before new ones are dropped (counted as lost)
    max_pending_chunks: int = 64
    #: bytes a rank file may take before it records in a degraded form (1 in
    #: ``sample_every`` rows kept, the rest counted per (kind, name) in /counters; see
    #: distdiag.shim.writer._Budget); 0: no bound
    max_file_bytes: int = 1 << 30
    sample_every: int = 64
    #: the writer's close (at exit, on SIGTERM) ends within this many seconds whatever the
    #: file system does; rows it could not write by then are counted, not waited for
    exit_timeout_s: float = 10.0
    #: when the HDF5 rank file opens (and numpy and h5py load into the program's process):
    #: "numpy" (the default) at the first flush after the program's own import of numpy (or
    #: once 8 MiB of rows wait, or at exit), so that what the program sets before that
    #: import holds, the rows spilled to a log until then (see distdiag.shim.rankfile and
    #: distdiag.shim.spill); "start" at start, before the program runs
    open_file_at: str = "numpy"
    #: who writes the rank file: "process" (the default: a helper process fed through a socket; a
    #: hung file system never holds the job's exit, a SIGKILLed rank's file is finished by
    #: construction, nothing of the writer loads into the program or its forked children;
    #: distdiag.shim.helper) or "thread" (a flusher thread of the program's process, open_file_at
    #: deciding when numpy and h5py load; also the fallback where the helper cannot start)
    writer: str = "process"
    #: the helper process opens the HDF5 file (importing numpy and h5py) only after this many
    #: seconds of the rank's run, once 8 MiB of rows wait, or at the rank's end, whichever comes
    #: first; until then it appends the flushes to the spill log (distdiag.shim.helper._Helper._defer).
    #: 0: at the first flush
    helper_open_after_s: float = 30.0
    #: clock sync: seconds between periodic exchanges, exchanges per round, exit wait
    sync_interval_s: float = 60.0
    sync_exchanges: int = 10
    exit_sync_wait_s: float = 2.0
    #: clock sync: how long start() waits for rank 0's clock-ref.json and takes the start round
    #: in the program's thread (0: all in the background, the program is never held up)
    sync_start_wait_s: float = 0.0
    #: clock sync: the IPv4 address rank 0 answers on ("": chosen from the launch, see
    #: distdiag.shim.clock.bind_addrs: loopback when every rank is on rank 0's host,
    #: MASTER_ADDR when it is one of the host's, else each of the host's addresses)
    sync_addr: str = ""
    #: argument names (comma-separated substrings, case-insensitive) whose values the
    #: rank files never hold ("--token X", "--token=X", "api_key=X" -> "<redacted>"); "" for none
    redact_args: str = DEFAULT_REDACT_ARGS
    #: keep the text of ``python -c CODE`` in the files (default: its length and hash only)
    keep_code_text: bool = False
    #: measure point-to-point links at start: "auto" (the default) where the job spans more
    #: than one host, within probe_auto_budget_s; "on" (distdiag-wrap --probe-links) also on
    #: one host, within probe_budget_s; "off" (--no-probe-links) never (distdiag.shim.probe)
    probe_links: str = "auto"
    #: the probe's time budget, its most rounds, and the wait for a peer that never answers
    probe_budget_s: float = 3.0
    probe_auto_budget_s: float = 1.0
    probe_max_rounds: int = 15
    probe_timeout_s: float = 30.0
    #: NVML sampling interval
    gpu_interval_s: float = 1.0
    #: wrap Tensor.to/.cuda/.copy_ to time host-to-device copies: "auto" (only
    #: when an accelerator is present), "on" (always), "off"
    h2d_copies: str = "auto"
    #: time DDP's gradient-bucket all-reduces through a comm hook (costs one
    #: Python callback per bucket; see benchmarks/bench_torch_step.py)
    ddp_buckets: bool = True
    #: on CPU DDPs, record buckets with a kernel on the dispatcher's c10d::allreduce_
    #: instead of a comm hook (cheaper: DDP keeps its built-in path; see
    #: hooks/torch_dist.py); false: always the comm hook
    ddp_kernel: bool = True
    #: which kernel: "auto" (the C++ one, distdiag/shim/hooks/_ddpk.cpp, where it was built
    #: against the torch that runs, else the Python one), "c++" (the same), "python" (always the
    #: Python one: ~50-70 us more a bucket, the dispatcher boxes each call into Python)
    ddp_kernel_impl: str = "auto"
    #: count bytes of binary files opened with open() (the fileio hook gives them
    #: a counting raw layer under the real buffered object); false: opens only
    fileio_count_bytes: bool = True
    #: slots of the libc interposer's ring (320 bytes each, rounded up to a power of two): what
    #: a process may record between two drains (the drainer wakes when it is half full);
    #: past it calls are summed per (call, directory, thread) into one row each (none is lost)
    preload_ring_slots: int = 16384
    #: a thread's fast metadata calls (stat, lstat, access...) past this rate are summed per
    #: (call, directory, thread), one row per drain batch, instead of a row each: each 10 ms
    #: window keeps its first rate/100 as rows (distdiag.shim.preload, HOT_WINDOW_NS)
    preload_rows_per_s: int = 100000
    #: hook short name -> enabled; absent names use the HOOKS registry default
    hooks: dict[str, bool] = dataclasses.field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def default_config_path() -> Path | None:
    """configs/default.toml next to the package (source checkout or installed package data)."""
    here = Path(__file__).resolve().parent.parent  # distdiag/
    for p in (here.parent / "configs" / "default.toml", here / "configs" / "default.toml"):
        if p.is_file():
            return p
    return None


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ImportError:
            log.debug("distdiag: no TOML reader; %s ignored", path)
            return {}
    with open(path, "rb") as f:
        return tomllib.load(f)


def _convert(field: dataclasses.Field[Any], raw: Any) -> Any:
    typ = str(field.type)
    if typ.startswith("dict"):
        if isinstance(raw, Mapping):
            return {str(k): _to_bool(v) for k, v in raw.items()}
        out: dict[str, bool] = {}
        for item in str(raw).split(","):
            item = item.strip()
            if not item:
                continue
            name, _, val = item.partition("=")
            out[name.strip()] = _to_bool(val.strip() or "1")
        return out
    if typ == "bool":
        return _to_bool(raw)
    if typ == "int":
        return int(raw)
    if typ == "float":
        return float(raw)
    return str(raw)


def _to_bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    s = str(v).strip().lower()
    if s in _TRUE:
        return True
    if s in _FALSE:
        return False
    raise ValueError(f"not a boolean: {v!r}")


def _apply(cfg: ShimConfig, values: Mapping[str, Any], source: str) -> None:
    fields = {f.name: f for f in dataclasses.fields(cfg)}
    for k, raw in values.items():
        f = fields.get(k)
        if f is None:
            log.debug("distdiag: unknown shim setting %r in %s ignored", k, source)
            continue
        try:
            val = _convert(f, raw)
        except (TypeError, ValueError) as e:
            log.warning("distdiag: bad value for %s in %s (%s); default kept", k, source, e)
            continue
        if isinstance(val, dict):
            getattr(cfg, k).update(val)  # hooks: merge, so the file and env combine
        else:
            setattr(cfg, k, val)


def load_config(path: str | os.PathLike[str] | None = None, environ: Mapping[str, str] | None = None) -> ShimConfig:
    """Defaults <- configs/default.toml [shim] <- ``path`` [shim] <- DISTDIAG_* env. Never raises."""
    env = os.environ if environ is None else environ
    cfg = ShimConfig()
    files = [p for p in (default_config_path(), Path(path) if path else None) if p is not None]
    for p in files:
        try:
            _apply(cfg, _read_toml(p).get("shim", {}), str(p))
        except Exception as e:  # a broken config never breaks the job
            log.warning("distdiag: cannot read config %s: %s", p, e)
    prefix = "DISTDIAG_"
    from_env = {k[len(prefix) :].lower(): v for k, v in env.items() if k.startswith(prefix)}
    _apply(cfg, {f.name: from_env[f.name] for f in dataclasses.fields(cfg) if f.name in from_env}, "environment")
    return cfg
