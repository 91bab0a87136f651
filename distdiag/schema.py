"""The on-disk contract shared by the shim (writer) and the analyzer (reader).

This is the only module both sides import. It must stay importable with the
standard library alone, since the shim runs inside the user's job before the
program's own imports: the numpy dtypes (``EVENT_DTYPE``, ``SYNC_DTYPE``,
``GPU_DTYPE``, ``COUNTER_DTYPE``) are built from the field
lists below on first access (a module ``__getattr__``), so ``from
distdiag.schema import Kind`` never imports numpy; a program that sets
``OPENBLAS_NUM_THREADS`` before its own ``import numpy`` gets what it set.

One HDF5 file per rank, ``rank-NNNNN.h5``::

    /                       attrs: see FILE_ATTRS
    /events                 EVENT_DTYPE rows, appended in chunks (resizable, chunked)
    /strings                variable-length UTF-8; row i is string id i (id 0 is "")
    /clock_sync             SYNC_DTYPE rows: min-RTT exchanges against a reference rank
    /inflight               EVENT_DTYPE rows with t1_ns == -1: calls entered but not left
                            at the last flush (replaced at every flush)
    /gpu                    GPU_DTYPE rows (NVML samples), when a sampler ran

Times are integers in nanoseconds of the rank's own monotonic clock
(``time.perf_counter_ns``); the analyzer maps them onto one reference timeline
(see ``distdiag.clocks``). Strings never sit in a row: ``name_id``, ``comm_id``
and ``site_id`` index ``/strings``.
"""

from __future__ import annotations

import enum
import re
from typing import Any

SCHEMA_VERSION = 1
#: The attribute that marks a file as distdiag's; its value is SCHEMA_VERSION.
SCHEMA_ATTR = "distdiag_schema"

RANK_FILE_RE = re.compile(r"^rank-(\d{5,})\.h5$")


def rank_file_name(rank: int) -> str:
    return f"rank-{rank:05d}.h5"


class Kind(enum.IntEnum):
    """What a row records. Values are stored on disk: never renumber, only add."""

    # communication ---------------------------------------------------------
    COLL = 1  # blocking collective: t0 = call, t1 = return
    COLL_ASYNC = 2  # non-blocking collective: t0 = post, t1 = completion seen (Wait/Test/future)
    SEND = 3  # blocking point-to-point send; peer = destination
    RECV = 4  # blocking receive; peer = source
    SEND_ASYNC = 5  # Isend: t0 = post, t1 = completion seen
    RECV_ASYNC = 6  # Irecv: t0 = post, t1 = completion seen
    WAIT = 7  # time blocked in Wait/Waitall/Test loops (the program's own waiting)
    COMM_CREATE = 8  # Dup/Split/Create: name_id = new communicator key, comm_id = parent
    # file system -----------------------------------------------------------
    FILE_OPEN = 20
    FILE_CLOSE = 21
    FILE_STAT = 22
    FILE_LISTDIR = 23
    FILE_READ = 24
    FILE_WRITE = 25
    # compute phases ----------------------------------------------------------
    PHASE = 40  # user-marked phase: name_id = phase name
    INPUT_WAIT = 41  # blocked in a data loader's __next__
    H2D = 42  # host-to-device copy; nbytes
    FORWARD = 43
    BACKWARD = 44
    OPTIMIZER = 45
    STEP = 46  # iteration boundary (instant, t0 == t1): nbytes = samples, aux = tokens, value = flops
    GPU_SPAN = 47  # the GPU-side span of another row, from a pair of CUDA events around it on its stream
    #              (distdiag.shim.hooks.cuda_events): t0/t1 = GPU start/end on this rank's host clock;
    #              aux = the kind of the row it times, nbytes = that row's t0_ns (the key: its CPU
    #              enqueue time; the analyzer's load replaces it by that row's bytes, see
    #              distdiag.gpu_timeline), name_id/comm_id/seq = that row's, peer = CUDA device index,
    #              value = the anchor's bound (ns) on where GPU times sit on the host clock
    # bookkeeping -------------------------------------------------------------
    MARK = 60  # instant user mark
    LOST = 61  # events dropped because the shim could not keep up: aux = how many
    SHIM = 62  # the shim's own milestones: name_id in {"target_start", "target_end", ...}
    # network ------------------------------------------------------------------
    PROBE = 70  # active link probe (distdiag.shim.probe): name_id "probe_bw" | "probe_lat" | "probe";
    #            peer = partner rank, nbytes = bytes each way, aux = round; "probe" spans the whole probe


COMM_KINDS = frozenset({Kind.COLL, Kind.COLL_ASYNC})
P2P_KINDS = frozenset({Kind.SEND, Kind.RECV, Kind.SEND_ASYNC, Kind.RECV_ASYNC})
FILE_KINDS = frozenset(range(20, 26))
PHASE_KINDS = frozenset({Kind.PHASE, Kind.INPUT_WAIT, Kind.H2D, Kind.FORWARD, Kind.BACKWARD, Kind.OPTIMIZER})

#: One event. 69 bytes a row, packed. Field meanings depend on ``kind``:
#:   name_id  op name ("Allreduce", "all_reduce"), path, or phase name
#:   comm_id  communicator / process-group key (a string id: the same key on
#:            every rank that shares the communicator), 0 when none
#:   seq      per-communicator sequence number of collectives (0, 1, 2, ...),
#:            or -1 when not a collective; on a file row that sums several calls
#:            (small reads/writes summed per file and thread, whose ``value`` counts
#:            them too; calls the interposer's full ring or its rate rule summed per
#:            directory), the calls it stands for (distdiag.rows.calls_of), else -1
#:   peer     root of a rooted collective, peer of point-to-point, -1 otherwise
#:   nbytes   payload bytes this rank contributed (send side), or samples for STEP
#:   aux      kind-specific integer (datatype id for collectives, tokens for
#:            STEP, lost count for LOST, file-system id for file events)
#:   site_id  "file:line" of the user's call site, 0 when unknown
#:   tid      small per-process thread index (0 = main thread)
#:   value    kind-specific float (flops for STEP)
EVENT_SPEC = (
        ("t0_ns", "<i8"),
        ("t1_ns", "<i8"),
        ("kind", "u1"),
        ("name_id", "<i4"),
        ("comm_id", "<i4"),
        ("seq", "<i8"),
        ("peer", "<i4"),
        ("nbytes", "<i8"),
        ("aux", "<i8"),
        ("site_id", "<i4"),
        ("tid", "<i4"),
        ("value", "<f8"),
)

#: One clock exchange with the reference rank: this rank sent at t_send_ns and
#: got the reply at t_recv_ns (both local clock); the reference stamped t_ref_ns
#: (its clock) in between. offset = t_ref - (t_send + t_recv) / 2, rtt = t_recv - t_send.
SYNC_SPEC = (
        ("t_send_ns", "<i8"),
        ("t_ref_ns", "<i8"),
        ("t_recv_ns", "<i8"),
        ("ref_rank", "<i4"),
        ("tag", "u1"),  # SyncTag
)


class SyncTag(enum.IntEnum):
    START = 0
    PERIODIC = 1
    EXIT = 2


#: One NVML sample of one local GPU.
#: ``/counters`` (only in a file whose rank reached its byte budget, ``max_file_bytes``):
#: per (kind, name) totals of the rows it did not write; ``name_id`` -1 is "other names"
COUNTER_SPEC = (("kind", "u1"), ("name_id", "<i4"), ("count", "<i8"), ("dur_ns", "<i8"), ("nbytes", "<i8"))

GPU_SPEC = (
        ("t_ns", "<i8"),
        ("gpu", "<i4"),  # local device index
        ("sm_util_pct", "<f4"),
        ("mem_util_pct", "<f4"),
        ("sm_clock_mhz", "<f4"),
        ("mem_used_bytes", "<i8"),
        ("power_w", "<f4"),
        ("pcie_tx_bytes_per_s", "<f8"),
        ("pcie_rx_bytes_per_s", "<f8"),
        ("nvlink_bytes_per_s", "<f8"),
        # added later (a file without them reads 0 there): NVML's clock-event (throttle) reason
        # bits (-1: not readable), the GPU temperature, and the last XID error NVML reported
        # since the previous sample (0: none, -1: XID events not readable on this device)
        ("throttle_reasons", "<i8"),
        ("temp_c", "<f4"),
        ("xid", "<i4"),
)

#: numpy dtype name -> its field list; built by ``__getattr__`` below on first access
_DTYPE_SPECS = {"EVENT_DTYPE": EVENT_SPEC, "SYNC_DTYPE": SYNC_SPEC, "COUNTER_DTYPE": COUNTER_SPEC, "GPU_DTYPE": GPU_SPEC}
EVENT_FIELDS = tuple(name for name, _ in EVENT_SPEC)


def __getattr__(name: str) -> Any:
    """``EVENT_DTYPE`` and the other dtypes, made (and kept) on first access: numpy is
    imported then, by the analyzer or the shim's writer, never by ``import distdiag``."""
    spec = _DTYPE_SPECS.get(name)
    if spec is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import numpy as np

    dt = np.dtype(list(spec))
    globals()[name] = dt
    return dt

#: Root attributes of a rank file (name -> meaning). Written at open, some
#: updated at every flush and at close.
FILE_ATTRS = {
    SCHEMA_ATTR: "SCHEMA_VERSION of the writer",
    "distdiag_version": "package version of the writer",
    "rank": "global rank",
    "world_size": "number of ranks in the launch",
    "local_rank": "rank on this node",
    "host": "node name (SLURMD_NODENAME, else the host name)",
    "job_id": "scheduler job id, or the launch id outside a scheduler",
    "launch_id": "id shared by every rank of one launch",
    "pid": "process id",
    "argv": "JSON list: the wrapped program's argv",
    "env": "JSON object: allow-listed environment (scheduler/MPI/CUDA variables only)",
    "clock": "name of the clock the timestamps come from",
    "wall_ns_at_start": "time.time_ns() when the shim started",
    "mono_ns_at_start": "the event clock when the shim started (same instant as wall_ns_at_start)",
    "last_flush_mono_ns": "the event clock at the last flush",
    "closed_cleanly": "True once the shim closed the file at exit or on SIGTERM",
    "end_mono_ns": "the event clock at close (absent when killed)",
    "exit_code": "the wrapped program's exit code (absent when killed)",
    "lost_events": "events dropped (bounded memory)",
    "config": "JSON object: the shim settings in force",
    "file_opened_on": "when the shim opened the file as HDF5: start, numpy (after the program's own "
    "numpy import), memory (rows waiting passed 8 MiB) or exit (open_file_at, distdiag.shim.rankfile)",
    "launcher": "where the rank identity came from: torchrun, openmpi, pmix, mpich, slurm or single",
    "hooks": "JSON list: the hooks that installed (short names)",
    "fileio_capture": "what recorded the file calls: preload (the libc interposer), python (the "
    "Python-level wrappers) or off (distdiag.shim.preload)",
    "recording_stopped": "why the writer stopped early (e.g. the disk was nearly full); absent normally",
    "rows_not_written_at_exit": "rows the writer's close left out when exit_timeout_s passed",
    "budget_bytes": "max_file_bytes in force once the file reached it (absent until then)",
    "budget_reached_mono_ns": "the event clock at the flush that reached the budget",
    "sample_every": "past the budget, 1 row in this many was written",
    "rows_counted_only": "past the budget, rows only counted in /counters",
    "cuda_timing": "GPU-side timing by CUDA events (GPU_SPAN rows): 'on: ...' or 'off: <why>' (cuda_events hook)",
    "cuda_spans_dropped": "GPU spans not timed because too many were pending (bounded; those rows keep CPU times)",
    "cuda_spans_pending": "GPU spans still pending (their events not done) at the last flush",
}

#: Environment variables worth keeping: the scheduler's, MPI's, torch's and
#: CUDA's. Never the whole environment (it holds tokens and passwords).
ENV_ALLOW_PREFIXES = (
    "SLURM_",
    "SLURMD_",
    "OMPI_COMM_WORLD_",
    "PMI_RANK",
    "PMI_SIZE",
    "PMIX_RANK",
    "MPI_LOCALRANKID",
    "MPI_LOCALNRANKS",
    "HYDRA_",
    "CUDA_VISIBLE_DEVICES",
    "NCCL_",
    "GLOO_",
    "TORCH_",
    "TORCHELASTIC_",
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "OMP_NUM_THREADS",
    "DISTDIAG_",
    "HOSTNAME",
)
#: Substrings that disqualify a variable even when its prefix is allowed.
ENV_DENY_SUBSTRINGS = ("TOKEN", "SECRET", "PASSWORD", "KEY", "CRED")


def allowed_env(environ: dict[str, str]) -> dict[str, str]:
    """The subset of ``environ`` that a rank file may keep."""
    out = {}
    for k, v in environ.items():
        if not k.startswith(ENV_ALLOW_PREFIXES):
            continue
        if any(s in k.upper() for s in ENV_DENY_SUBSTRINGS):
            continue
        out[k] = v
    return out
