"""PyTorch profiler (Kineto / Chrome trace JSON) traces as an input to the analysis.

``distdiag analyze DIR`` reads a directory of per-rank trace files (what
``torch.profiler``'s ``export_chrome_trace`` / ``tensorboard_trace_handler``
write, and what Holistic Trace Analysis reads) when it holds no ``rank-*.h5``:
each trace becomes the rows one rank file would give (:func:`read_trace`),
and :func:`distdiag.run.load_run` assembles them exactly as it assembles rank
files, so clocks, matching, detectors, ranking, renderers and streaming run
unchanged.

Mapping (trace event -> ``distdiag.schema.Kind``), complete events (``ph: X``) only:

* collectives (``COLL``), one source a rank, the first present of:
  NCCL kernels (``cat: kernel``, ``ncclKernel_*`` / ``ncclDevKernel_*``: the
  GPU's own times, so arrival = the kernel's start, exit = its end);
  gloo's worker-thread annotations (``gloo:all_reduce``, ...: the collective as
  it ran, from the worker picking it up to its completion); the CPU-side
  ``record_param_comms`` ops, else ``c10d::*`` ops (enqueue times only).
  The op is the args' ``Collective name`` when present, else the name's; the
  communicator is ``Process Group Name`` (``"0"`` is ``default``, as the shim
  names the world group, else ``pg<name>``), else ``nccl-stream<N>`` for a
  kernel, else ``default``; ``seq`` is the args' ``Seq`` when every row has one,
  else the row's order on its communicator; ``nbytes`` = ``In msg nelems`` x the
  ``dtype``'s size when given (else 0: a signature every rank shares).
  Point-to-point (``send``/``recv``) become ``SEND``/``RECV`` rows without a peer.
* other kernels: ``PHASE`` rows named by the kernel (compute: they hide an
  input wait or a copy they overlap, as a forward phase does).
* ``gpu_memcpy`` HtoD: ``H2D`` (``nbytes`` = the args' ``bytes``); DtoH / DtoD:
  ``PHASE`` rows (the schema has no device-to-host kind).
* ``ProfilerStep#N``: a ``STEP`` row at its end (the iteration boundary).
* ``enumerate(DataLoader)#...``: ``INPUT_WAIT``.
* every other CPU op: not a row (compute is the time outside recorded calls).

The rank is ``distributedInfo.rank``, else ``rank<N>`` / ``rank-<N>`` /
``rank_<N>`` in the file name. Kineto traces carry no clock-sync samples:
:mod:`distdiag.clocks` aligns every rank but the reference from the exits of
the synchronizing collectives matched across ranks, and states that larger
bound in a warning and in each finding's ``evidence.clock_bound_ms``.

A run dir is untrusted input: only regular files of the dir's own are read
(``O_NOFOLLOW``; a link or special file is refused), at most ``max_bytes``
bytes each (compressed and decompressed alike: a gz bomb stops at the bound),
and every problem is one line (a warning and the file skipped; an error when
no file is usable). Building the rows is column work over the parsed list
(pandas/numpy), no Python step per event besides ``json.loads`` itself.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from distdiag.errors import TraceError
from distdiag.schema import EVENT_DTYPE, RANK_FILE_RE, Kind

#: Default bound on one trace file's bytes (compressed and decompressed): json.loads holds
#: ~5-10x the text in Python objects, so 256 MiB of trace is a few GB of peak memory.
DEFAULT_MAX_TRACE_BYTES = 256 << 20

#: Files of the run dir that are not traces (written by distdiag or its tests).
NOT_TRACES = frozenset({"launch.json", "clock-ref.json", "slurm-accounting.json", "synth.json"})

_NAME_RANK = re.compile(r"rank[-_.]?(\d+)", re.IGNORECASE)
#: A kernel name, an op name: longer ones (templated C++ names) are cut here.
MAX_NAME_CHARS = 512

#: Collective op names as the traces spell them (lowercased, prefix and trailing "_"
#: removed) -> torch.distributed's names, which the shim records and the clock
#: fallback's synchronizing set (distdiag.clocks.SYNC_OPS) knows.
_OPS = {
    "allreduce": "all_reduce", "all_reduce": "all_reduce", "allreduce_coalesced": "all_reduce_coalesced",
    "broadcast": "broadcast", "barrier": "barrier", "monitored_barrier": "monitored_barrier",
    "allgather": "all_gather", "all_gather": "all_gather", "_allgather_base": "all_gather_into_tensor",
    "allgather_into_tensor_coalesced": "all_gather_into_tensor", "all_gather_into_tensor": "all_gather_into_tensor",
    "allgather_coalesced": "all_gather_coalesced",
    "reduce_scatter": "reduce_scatter", "reducescatter": "reduce_scatter_tensor",
    "_reduce_scatter_base": "reduce_scatter_tensor", "reduce_scatter_tensor": "reduce_scatter_tensor",
    "reduce_scatter_tensor_coalesced": "reduce_scatter_tensor",
    "alltoall_base": "all_to_all_single", "all_to_allv": "all_to_all_single", "all_to_all_single": "all_to_all_single",
    "alltoall": "all_to_all", "all_to_all": "all_to_all",
    "reduce": "reduce", "gather": "gather", "scatter": "scatter",
}  # fmt: skip
_P2P = {"send": int(Kind.SEND), "recv": int(Kind.RECV), "sendrecv": int(Kind.SEND), "recv_any_source": int(Kind.RECV),
        "recvanysource": int(Kind.RECV)}  # fmt: skip
#: bytes per element of the args' ``dtype``
_DTYPE_BYTES = {
    "float": 4, "float32": 4, "half": 2, "float16": 2, "bfloat16": 2, "double": 8, "float64": 8,
    "int": 4, "int32": 4, "long": 8, "int64": 8, "short": 2, "int16": 2, "char": 1, "int8": 1, "byte": 1,
    "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "complexfloat": 8, "complexdouble": 16,
}  # fmt: skip

_COLUMNS = ["ph", "cat", "name", "pid", "tid", "ts", "dur", "args"]


@dataclass
class Trace:
    """One rank's trace as the rows a rank file gives (``EVENT_DTYPE``, rank-local ns)."""

    rank: int
    world_size: int
    host: str
    pid: int
    events: np.ndarray
    strings: np.ndarray
    #: (first, last) instant of any complete event in the trace, ns
    start_ns: int
    end_ns: int
    #: complete events in the trace / rows made of them / rows dropped (bad times)
    n_trace_events: int
    n_bad: int


def is_trace_name(name: str) -> bool:
    """A file name a trace may have: ``*.json`` (``*.pt.trace.json``) or ``*.json.gz``."""
    return (name.endswith(".json") or name.endswith(".json.gz")) and name not in NOT_TRACES


def trace_files(p: Path) -> list[Path]:
    """The run dir's trace files, sorted by name (links and special files listed: refused when read)."""
    try:
        entries = list(p.iterdir())
    except OSError:
        return []
    return sorted(q for q in entries if is_trace_name(q.name) and (q.is_symlink() or not q.is_dir()))


def is_kineto_dir(p: Path) -> bool:
    """A dir with no ``rank-*.h5`` and at least one trace file is read as Kineto traces."""
    try:
        names = [q.name for q in p.iterdir()]
    except OSError:
        return False
    return not any(RANK_FILE_RE.match(n) for n in names) and any(is_trace_name(n) for n in names)


def _read_bounded(path: Path, max_bytes: int) -> bytes:
    """The file's bytes (gunzipped when gzip), never through a link, at most ``max_bytes`` either way."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise TraceError("disappeared while the run dir was read") from None
    except OSError as e:
        if os.path.islink(path):
            raise TraceError("is a symbolic link (a run dir's files are read only as regular files of their own)") from None
        raise TraceError(f"cannot be opened ({e.strerror or e})") from None
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise TraceError("is not a regular file")
        if st.st_size > max_bytes:
            raise TraceError(f"is {st.st_size} bytes, over the {max_bytes} a trace may have (kineto_max_trace_bytes)")
        raw = fh.read(max_bytes + 1)
    if len(raw) > max_bytes:
        raise TraceError(f"grew past the {max_bytes} bytes a trace may have while it was read")
    if raw[:2] != b"\x1f\x8b":
        return raw
    try:
        with gzip.GzipFile(fileobj=io.BytesIO(raw)) as gz:
            data = gz.read(max_bytes + 1)
    except (OSError, EOFError, ValueError) as e:
        raise TraceError(f"is not a readable gzip file ({e})") from None
    if len(data) > max_bytes:
        raise TraceError(f"decompresses to more than the {max_bytes} bytes a trace may have (kineto_max_trace_bytes)")
    return data


def _parse(data: bytes) -> tuple[dict[str, Any], list[Any]]:
    try:
        doc = json.loads(data)
    except UnicodeDecodeError:
        raise TraceError("is not UTF-8 text (not a trace JSON)") from None
    except json.JSONDecodeError as e:
        raise TraceError(f"is not valid JSON (line {e.lineno} column {e.colno}: {e.msg})") from None
    except RecursionError:
        raise TraceError("is JSON nested too deeply to be a trace") from None
    if isinstance(doc, list):  # the Chrome trace "array format": events only
        return {}, doc
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise TraceError("is JSON but not a Kineto/Chrome trace (no 'traceEvents' list)")
    return doc, doc["traceEvents"]


def _rank_of(doc: dict[str, Any], name: str) -> int:
    info = doc.get("distributedInfo")
    r = info.get("rank") if isinstance(info, dict) else None
    if isinstance(r, int) and not isinstance(r, bool) and r >= 0:
        return r
    m = _NAME_RANK.search(name)
    if m:
        return int(m.group(1))
    raise TraceError("names no rank (no distributedInfo.rank in the trace, no rank<N> in its file name)")


def _frame(events: list[Any]) -> Any:
    import pandas as pd

    try:
        df = pd.DataFrame.from_records(events, columns=_COLUMNS) if events else pd.DataFrame(columns=_COLUMNS)
    except (TypeError, ValueError, AttributeError) as e:
        raise TraceError(f"has trace events that are not JSON objects ({type(e).__name__})") from None
    return df


def _str_col(s: Any) -> Any:
    """A column as text: missing values read as "", other non-strings as their text."""
    # as object first: a column that is all missing reads as float64, which pandas will not fill with a str
    return s.astype(object).fillna("").astype(str).astype(object)


def _args(col: Any, keys: list[str]) -> Any:
    """The ``args`` objects of some rows as one frame of ``keys`` (missing: NaN)."""
    import pandas as pd

    vals = col.tolist()
    try:
        return pd.DataFrame.from_records(vals, columns=keys, index=range(len(vals)))
    except (TypeError, ValueError, AttributeError):  # a row whose args is no object: read as none
        return pd.DataFrame.from_records([a if isinstance(a, dict) else {} for a in vals], columns=keys)


def read_trace(path: Path, max_bytes: int = DEFAULT_MAX_TRACE_BYTES) -> Trace:
    """One trace file as one rank's rows; :class:`TraceError` (one line) when it cannot be used."""
    import pandas as pd

    doc, events = _parse(_read_bounded(path, max_bytes))
    rank = _rank_of(doc, path.name)
    df = _frame(events)
    df = df[df["ph"] == "X"]
    ts = pd.to_numeric(df["ts"], errors="coerce").to_numpy(np.float64)
    dur = pd.to_numeric(df["dur"], errors="coerce").to_numpy(np.float64)
    ok = np.isfinite(ts) & np.isfinite(dur) & (dur >= 0) & (np.abs(ts) < 9e15)  # µs; ns must fit an int64
    n_bad = int(len(df) - ok.sum())
    df = df[ok]
    t0 = np.rint(ts[ok] * 1e3).astype(np.int64)
    t1 = t0 + np.rint(dur[ok] * 1e3).astype(np.int64)
    # Names repeat (a few hundred distinct in 10^5 events): each test runs on the distinct
    # names only and is indexed back by their codes, instead of a Python call per event.
    n_codes, n_uniq = pd.factorize(_str_col(df["name"]))
    names = pd.Series(n_uniq, dtype=object).str.slice(0, MAX_NAME_CHARS)
    c_codes, c_uniq = pd.factorize(_str_col(df["cat"]))
    cats = pd.Series(c_uniq, dtype=object).str.lower()

    def by_name(test: Any) -> np.ndarray:
        return np.asarray(test(names), bool)[n_codes] if len(n_uniq) else np.zeros(len(df), bool)

    def by_cat(test: Any) -> np.ndarray:
        return np.asarray(test(cats), bool)[c_codes] if len(c_uniq) else np.zeros(len(df), bool)

    name = pd.Series(names.to_numpy(object)[n_codes] if len(n_uniq) else np.zeros(0, object), dtype=object)
    cat = pd.Series(cats.to_numpy(object)[c_codes] if len(c_uniq) else np.zeros(0, object), dtype=object)
    is_kernel = by_cat(lambda c: c == "kernel")
    is_nccl = is_kernel & by_name(lambda n: n.str.startswith("nccl"))
    is_gloo = by_name(lambda n: n.str.startswith("gloo:"))
    is_rpc = by_name(lambda n: n == "record_param_comms")
    is_c10d = by_name(lambda n: n.str.startswith("c10d::"))
    if is_nccl.any():
        coll = is_nccl
    elif is_gloo.any():
        coll = is_gloo
    else:
        coll = is_rpc if is_rpc.any() else is_c10d
    is_memcpy = by_cat(lambda c: c.isin(["gpu_memcpy", "memcpy"]))
    is_h2d = is_memcpy & by_name(lambda n: n.str.contains("HtoD", regex=False))
    is_step = by_name(lambda n: n.str.startswith("ProfilerStep#"))
    is_input = by_name(lambda n: n.str.startswith("enumerate(DataLoader)#"))
    is_phase = (is_kernel & ~is_nccl) | (is_memcpy & ~is_h2d)

    # threads: GPU streams apart from CPU threads; the main thread (pid == tid) is 0
    pid_s = df["pid"].astype(str).to_numpy(object)
    tid_s = df["tid"].astype(str).to_numpy(object)
    gpu = is_kernel | is_memcpy | by_cat(lambda c: c == "gpu_memset")
    tkey = pd.Series(np.where(gpu, "g", "c")) + pid_s + "/" + tid_s
    codes, uniq = pd.factorize(tkey)
    main = np.flatnonzero(~gpu & (pid_s == tid_s))
    if len(main):
        m = codes[main[0]]
        codes = np.where(codes == m, 0, np.where(codes == 0, m, codes))
    cpu_pids = pd.to_numeric(df["pid"][~gpu], errors="coerce").dropna()
    pid = int(cpu_pids.mode().iloc[0]) if len(cpu_pids) else -1

    kind = np.zeros(len(df), np.uint8)
    kind[is_phase] = int(Kind.PHASE)
    kind[is_h2d] = int(Kind.H2D)
    kind[is_step] = int(Kind.STEP)
    kind[is_input] = int(Kind.INPUT_WAIT)
    n = len(df)
    comm = np.full(n, "", object)
    aux = np.full(n, "", object)
    seq = np.full(n, -1, np.int64)
    nbytes = np.zeros(n, np.int64)
    rname = name.to_numpy(object).copy()
    rname[is_step] = "ProfilerStep"
    ci = np.flatnonzero(coll)
    if len(ci):
        c_kind, c_name, c_comm, c_seq, c_nbytes, c_aux = _collectives(df.iloc[ci], name.iloc[ci], is_nccl[ci], tid_s[ci], t0[ci])
        kind[ci] = c_kind
        rname[ci], comm[ci], seq[ci], nbytes[ci], aux[ci] = c_name, c_comm, c_seq, c_nbytes, c_aux
    mi = np.flatnonzero(is_h2d)
    if len(mi):
        b = _args(df["args"].iloc[mi], ["bytes"])
        nbytes[mi] = pd.to_numeric(b["bytes"], errors="coerce").fillna(0).clip(lower=0).to_numpy(np.int64)
    t0[is_step] = t1[is_step]  # the boundary is the step's end

    keep = np.flatnonzero(kind != 0)
    order = keep[np.argsort(t0[keep], kind="stable")]
    strings, ids = _intern([rname[order], comm[order], aux[order]])
    ev = np.zeros(len(order), EVENT_DTYPE)
    ev["t0_ns"], ev["t1_ns"], ev["kind"] = t0[order], t1[order], kind[order]
    ev["name_id"], ev["comm_id"], ev["aux"] = ids[0], ids[1], ids[2]
    ev["seq"], ev["peer"], ev["nbytes"], ev["tid"] = seq[order], -1, nbytes[order], codes[order]
    info = doc.get("distributedInfo")
    ws = info.get("world_size") if isinstance(info, dict) else None
    host = doc.get("host_name") or doc.get("hostname") or ""
    start = int(t0.min()) if len(t0) else 0
    end = int(max(t1.max(), t0.max())) if len(t0) else 0
    return Trace(
        rank=rank, world_size=ws if isinstance(ws, int) and not isinstance(ws, bool) and ws > 0 else 0,
        host=str(host)[:256], pid=pid, events=ev, strings=strings, start_ns=start, end_ns=end,
        n_trace_events=n, n_bad=n_bad,
    )  # fmt: skip


def _collectives(df: Any, name: Any, nccl: np.ndarray, tid: np.ndarray, t0: np.ndarray) -> tuple[np.ndarray, ...]:
    """(kind, op, comm, seq, nbytes, dtype) of the collective rows ``df`` (one rank's, any order)."""
    import pandas as pd

    args = _args(df["args"], ["Collective name", "Process Group Name", "Seq", "In msg nelems", "dtype"])
    from_name = name.str.replace(r"^(c10d::|gloo:|nccl:)", "", regex=True).str.rstrip("_").str.lower()
    kernel_op = name.str.extract(r"^nccl(?:Dev)?Kernel_([A-Za-z]+)", expand=False).str.lower()
    key = pd.Series(np.where(nccl, kernel_op.fillna("").to_numpy(object), from_name.to_numpy(object)))
    given = _str_col(args["Collective name"]).str.lower().str.strip("_")
    key = given.where(given != "", key)
    p2p = key.map(_P2P)
    op = key.map(_OPS).fillna(key).to_numpy(object)
    kind = np.where(p2p.notna(), p2p.fillna(0).to_numpy(np.int64), int(Kind.COLL)).astype(np.uint8)
    pg = _str_col(args["Process Group Name"])
    comm = np.where(pg == "0", "default", "pg" + pg).astype(object)
    fallback = np.where(nccl, ("nccl-stream" + pd.Series(tid, dtype=object)).to_numpy(object), "default")
    comm = np.where(pg == "", fallback, comm).astype(object)
    given_seq = pd.to_numeric(args["Seq"], errors="coerce")
    is_coll = kind == int(Kind.COLL)
    if given_seq.notna().all() and len(given_seq):
        seq = given_seq.to_numpy(np.float64).astype(np.int64)
    else:
        # the row's order on its communicator (stable by start time)
        order = np.lexsort((t0, comm.astype(str)))
        ranks_in = pd.Series(comm[order]).groupby(comm[order], sort=False).cumcount().to_numpy(np.int64)
        seq = np.empty(len(df), np.int64)
        seq[order] = ranks_in
    seq = np.where(is_coll, seq, -1)
    dt = _str_col(args["dtype"]).str.lower()
    size = dt.map(_DTYPE_BYTES).fillna(0).to_numpy(np.int64)
    nel = pd.to_numeric(args["In msg nelems"], errors="coerce").fillna(0).clip(lower=0).to_numpy(np.float64)
    nbytes = np.where(nel < 2**62 / 16, nel, 0).astype(np.int64) * size
    return kind, op, comm, seq, nbytes, dt.to_numpy(object)


def _intern(cols: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
    """One string table (id 0 = "") for the string columns, and their ids."""
    import pandas as pd

    allv = np.concatenate([np.array([""], object), *cols])
    codes, uniq = pd.factorize(allv)
    # "" is the first value, so code 0
    out, a = [], 1
    for c in cols:  # three columns
        out.append(codes[a : a + len(c)].astype(np.int32))
        a += len(c)
    return np.asarray(uniq, dtype=object), out
