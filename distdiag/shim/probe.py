"""Active link probe: a short, bounded pairwise bandwidth/latency measurement.

On by default where the job spans more than one host (``ShimConfig.probe_links``
= ``"auto"``), within ``probe_auto_budget_s`` (1 s); ``distdiag-wrap --probe-links``
(``"on"``) probes also on one host, within ``probe_budget_s``;
``--no-probe-links`` (``"off"``) never. Under ``"auto"`` nothing is installed when
the launcher says every rank is on one host (``SLURM_NNODES=1``, or its local
size equals the world size: torchrun's ``LOCAL_WORLD_SIZE``, Open MPI's
``OMPI_COMM_WORLD_LOCAL_SIZE``, MPICH's ``MPI_LOCALNRANKS``); when it does not
say (or ``DISTDIAG_HOST`` names the hosts), the probe's first step (the host names' all-gather, 64 bytes a rank) decides,
and on one host it ends there. On healthy links the probe takes milliseconds (its
sizes grow only while a step stays under an eighth of the round's share of the
budget); a slow link is what spends the budget. It runs once per process, over the
job's own transport, right after that transport is up; a transport of one rank (an
MPI singleton in a torchrun job whose program also imports mpi4py) probes nothing
and leaves the one probe to the next transport that spans ranks:

* torch.distributed: right after ``init_process_group`` returns, on the
  default process group, calling the ProcessGroup's own ``send``/``recv`` (not
  the ``torch.distributed`` functions, so the torch hook does not record the
  probe's traffic as the program's, and the program's sequence numbers stay
  untouched). Over NCCL on the program's GPU: when init_process_group was not
  told which (``device_id=``), at the program's first collective instead (see
  "torch: on which device, and when" below);
* MPI: once MPI is initialized: when ``mpi4py.MPI`` has been imported (MPI_Init
  happens at import), or right after the program's own ``MPI.Init`` /
  ``MPI.Init_thread`` (``mpi4py.rc.initialize = False``), on a private ``Dup``
  of a plain handle to COMM_WORLD, so a late probe message can never match one
  of the program's receives.

Who probes whom. When ranks sit on more than one host only the first rank of
each host (its "leader") probes: the question is which *node pair* is slow,
and several ranks of one node would share and contend for the same NIC. With a
single host every rank probes. Among the m participants the rounds are XOR
masks: in round ``mask`` participant i exchanges with ``i ^ mask`` (skipped
when that is >= m). The masks 1, 2, 4, ... come first (a hypercube: every
participant meets log2(m) partners, so a slow node shows within O(log m)
rounds); the remaining masks follow while ``probe_max_rounds`` allows, and with
all P-1 masks (P = next power of two >= m) every pair is covered exactly once.
Worked example, m = 4: masks 1, 2, 3 give (0,1)(2,3), (0,2)(1,3), (0,3)(1,2).

Each exchange is symmetric: both partners post a send and a receive of the same
size at once, so both see the same transfer and can take the same decisions
without a coordinator. Per pair and round:

1. latency: a few 8-byte exchanges, the fastest kept ("probe_lat");
2. bandwidth: sizes 16 KiB, 64 KiB, ... up to 4 MiB ("probe_bw"); after each
   size the partners swap their measured times in an 8-byte exchange and both
   continue only while the slower of the two stayed under 1/8 of the round's
   share of the budget. Sizes grow 4x, so the next step stays under about half
   the share and the round under the share: the probe ends within the budget
   (a link so slow that 16 KiB alone overruns it ends after that one step).

Rows (``Kind.PROBE``): peer = partner's global rank, nbytes = bytes sent each
way, t0/t1 around the exchange on this rank's clock, aux = round index; one
"probe" row spans the whole probe (aux = rounds, nbytes = participants). The
analyzer (``distdiag.links``) turns them into a node x node matrix.

The probe is a guest like every hook: any failure is logged and swallowed, and
every wait has a deadline, so a peer that never answers costs at most
``probe_timeout_s`` once, never a hang.
"""

from __future__ import annotations

import datetime
import functools
import inspect
import logging
import os
import socket
import threading
import time
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from distdiag.schema import Kind
from distdiag.shim.recorder import now_ns

log = logging.getLogger(__name__)

#: bytes each way per bandwidth step; 4x growth keeps the time bound simple
SIZES = (16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20)
LAT_SAMPLES = 3
#: tag of the probe's torch messages (the program's default tag is 0)
TORCH_TAG = 0x0D1A6
MPI_TAG = 0x0D1A6
DEFAULT_BUDGET_S = 3.0
#: the budget when the probe is on by default (probe_links = "auto"): small enough to leave on
DEFAULT_AUTO_BUDGET_S = 1.0
DEFAULT_MAX_ROUNDS = 15
HOST_BYTES = 64


class Transport(Protocol):
    rank: int
    world_size: int
    name: str

    def exchange(self, peer: int, nbytes: int) -> None: ...

    def exchange_float(self, peer: int, value: float) -> float: ...

    def allgather_host(self, host: str) -> list[str]: ...


@dataclass
class ProbeResult:
    participants: list[int]
    rounds: int
    #: (round, peer, nbytes, t0_ns, t1_ns) of every bandwidth step
    bw_steps: list[tuple[int, int, int, int, int]] = field(default_factory=list)
    #: (round, peer, best round-trip ns) per pair
    latency: list[tuple[int, int, int]] = field(default_factory=list)
    elapsed_s: float = 0.0


def plan_masks(m: int, max_rounds: int) -> list[int]:
    """XOR masks for m participants: powers of two first, then the rest."""
    if m < 2:
        return []
    p = 1 << (m - 1).bit_length()
    powers = [1 << k for k in range(p.bit_length() - 1)]
    rest = [x for x in range(1, p) if x & (x - 1)]
    return (powers + rest)[: max(1, max_rounds)]


def participants_of(hosts: list[str]) -> list[int]:
    """Ranks that probe: the first rank of each host, or every rank on one host."""
    if len(set(hosts)) <= 1:
        return list(range(len(hosts)))
    first: dict[str, int] = {}
    for r, h in enumerate(hosts):
        first.setdefault(h, r)
    return sorted(first.values())


def run_probe(
    tr: Transport,
    host: str,
    rec: Any,
    budget_s: float = DEFAULT_BUDGET_S,
    max_rounds: int = DEFAULT_MAX_ROUNDS,
    across_hosts_only: bool = False,
) -> ProbeResult | None:
    """Run the probe on this rank; every rank of the transport must call it.
    ``across_hosts_only`` (the default mode): on one host, end after the host names."""
    start_ns = now_ns()
    hosts = tr.allgather_host(host)
    if across_hosts_only and len(set(hosts)) <= 1:
        return None
    members = participants_of(hosts)
    if tr.rank not in members:
        return None
    me = members.index(tr.rank)
    masks = plan_masks(len(members), max_rounds)
    res = ProbeResult(participants=members, rounds=len(masks))
    share_s = budget_s / max(len(masks), 1)
    # both partners hold the same two times, so both stop at the same step
    grow_limit_s = share_s / 8
    intern = rec.intern if rec is not None else (lambda s: 0)
    bw_id, lat_id, span_id = intern("probe_bw"), intern("probe_lat"), intern("probe")
    comm_id = intern(f"probe:{tr.name}")
    for rnd, mask in enumerate(masks):
        j = me ^ mask
        if j >= len(members):
            continue
        peer = members[j]
        best_rtt = -1
        best_t0 = 0
        for _ in range(LAT_SAMPLES):
            t0 = now_ns()
            tr.exchange_float(peer, 0.0)
            t1 = now_ns()
            if best_rtt < 0 or t1 - t0 < best_rtt:
                best_rtt, best_t0 = t1 - t0, t0
        res.latency.append((rnd, peer, best_rtt))
        if rec is not None:
            rec.add(best_t0, best_t0 + best_rtt, Kind.PROBE, lat_id, comm_id, -1, peer, 8, rnd)
        for nbytes in SIZES:
            t0 = now_ns()
            tr.exchange(peer, nbytes)
            t1 = now_ns()
            res.bw_steps.append((rnd, peer, nbytes, t0, t1))
            if rec is not None:
                rec.add(t0, t1, Kind.PROBE, bw_id, comm_id, -1, peer, nbytes, rnd)
            mine_s = (t1 - t0) / 1e9
            theirs_s = tr.exchange_float(peer, mine_s)
            if max(mine_s, theirs_s) >= grow_limit_s:
                break
    end_ns = now_ns()
    res.elapsed_s = (end_ns - start_ns) / 1e9
    if rec is not None:
        rec.add(start_ns, end_ns, Kind.PROBE, span_id, comm_id, -1, -1, len(members), len(masks), 0, budget_s)
    return res


# -- transports ----------------------------------------------------------------


class TorchTransport:
    """Probe over a torch.distributed ProcessGroup (gloo, nccl on CUDA tensors)."""

    name = "torch"

    def __init__(self, pg: Any, timeout_s: float, device: Any = None) -> None:
        import torch

        self._torch = torch
        self.pg = pg
        self.rank = pg.rank()
        self.world_size = pg.size()
        self._timeout = datetime.timedelta(seconds=timeout_s)
        # the device the program's own NCCL traffic uses (see torch_probe_device), else the CPU
        self._dev = torch.device("cpu") if device is None else torch.device(device)
        self._bufs: dict[int, tuple[Any, Any]] = {}

    def _pair(self, nbytes: int) -> tuple[Any, Any]:
        b = self._bufs.get(nbytes)
        if b is None:
            z = self._torch.zeros
            b = (z(nbytes, dtype=self._torch.uint8, device=self._dev), z(nbytes, dtype=self._torch.uint8, device=self._dev))
            self._bufs[nbytes] = b
        return b

    def _sendrecv(self, send: Any, recv: Any, peer: int) -> None:
        ws = self.pg.send([send], peer, TORCH_TAG)
        wr = self.pg.recv([recv], peer, TORCH_TAG)
        wr.wait(self._timeout)
        ws.wait(self._timeout)
        if self._dev.type == "cuda":
            self._torch.cuda.synchronize(self._dev)

    def exchange(self, peer: int, nbytes: int) -> None:
        s, r = self._pair(nbytes)
        self._sendrecv(s, r, peer)

    def exchange_float(self, peer: int, value: float) -> float:
        s = self._torch.tensor([value], dtype=self._torch.float64, device=self._dev)
        r = self._torch.zeros(1, dtype=self._torch.float64, device=self._dev)
        self._sendrecv(s, r, peer)
        return float(r.item())

    def allgather_host(self, host: str) -> list[str]:
        t = self._torch
        raw = host.encode()[:HOST_BYTES].ljust(HOST_BYTES, b"\0")
        mine = t.tensor(list(raw), dtype=t.uint8, device=self._dev)
        out = [t.zeros(HOST_BYTES, dtype=t.uint8, device=self._dev) for _ in range(self.world_size)]
        w = self.pg.allgather([out], [mine])
        w.wait(self._timeout)
        return [bytes(o.cpu().tolist()).rstrip(b"\0").decode(errors="replace") for o in out]


class MpiTransport:
    """Probe over a private duplicate of MPI_COMM_WORLD (mpi4py)."""

    name = "mpi"

    def __init__(self, comm: Any, mpi: Any, timeout_s: float) -> None:
        import numpy as np

        self._np = np
        self._mpi = mpi
        self.comm = comm
        self.rank = comm.Get_rank()
        self.world_size = comm.Get_size()
        self._timeout_s = timeout_s
        self._bufs: dict[int, tuple[Any, Any]] = {}

    def _wait(self, reqs: list[Any]) -> None:
        # Testall of the requests' own (plain) class: the mpi4py hook rebinds
        # MPI.Request to a recording subclass, and the probe's waiting is not
        # the program's.
        testall = type(reqs[0]).Testall
        deadline = time.monotonic() + self._timeout_s
        while not testall(reqs):
            if time.monotonic() > deadline:
                raise TimeoutError("distdiag probe: peer did not answer")

    def exchange(self, peer: int, nbytes: int) -> None:
        b = self._bufs.get(nbytes)
        if b is None:
            b = (self._np.zeros(nbytes, self._np.uint8), self._np.zeros(nbytes, self._np.uint8))
            self._bufs[nbytes] = b
        self._wait([self.comm.Irecv(b[1], peer, MPI_TAG), self.comm.Isend(b[0], peer, MPI_TAG)])

    def exchange_float(self, peer: int, value: float) -> float:
        s = self._np.array([value], self._np.float64)
        r = self._np.zeros(1, self._np.float64)
        self._wait([self.comm.Irecv(r, peer, MPI_TAG + 1), self.comm.Isend(s, peer, MPI_TAG + 1)])
        return float(r[0])

    def allgather_host(self, host: str) -> list[str]:
        np = self._np
        mine = np.frombuffer(host.encode()[:HOST_BYTES].ljust(HOST_BYTES, b"\0"), np.uint8).copy()
        out = np.zeros((self.world_size, HOST_BYTES), np.uint8)
        self._wait([self.comm.Iallgather(mine, out)])
        return [bytes(row).rstrip(b"\0").decode(errors="replace") for row in out]

    def close(self) -> None:
        self.comm.Free()


# -- installation ----------------------------------------------------------------

_rec: Any = None
_cfg: Any = None
_done = False
#: cleared by uninstall: post-import callbacks still pending then do nothing
_active = False
#: the probe is on by default here (probe_links = "auto"): across hosts only, the small budget
_auto = False
_patched: list[tuple[Any, str, Any]] = []  # (owner, attribute, original)
#: the last probe's result in this process (tests and the wrapper's log read it)
LAST: ProbeResult | None = None


def _host() -> str:
    try:
        from distdiag.shim import session

        s = getattr(session, "SESSION", None)
        if s is not None and getattr(s, "host", None):
            return str(s.host)
    except Exception:
        pass
    return os.environ.get("DISTDIAG_HOST") or socket.gethostname()


def probe_mode(v: Any) -> str:
    """``ShimConfig.probe_links`` as ``"on"``, ``"off"`` or ``"auto"`` (bools and the usual
    spellings of true and false taken; anything else is ``"auto"``)."""
    if isinstance(v, bool):
        return "on" if v else "off"
    s = str(v).strip().lower()
    if s in ("1", "true", "yes", "on"):
        return "on"
    if s in ("0", "false", "no", "off"):
        return "off"
    return "auto"


def _int_env(env: Any, *names: str) -> int | None:
    for n in names:
        try:
            v = int(str(env.get(n, "")).strip())
        except ValueError:
            continue
        if v > 0:
            return v
    return None


def one_host_said(env: Any) -> bool:
    """The launcher says every rank of the job is on this host (see the module docstring).
    Not when ``DISTDIAG_HOST`` names the host (tests lay out nodes on one machine with it):
    the host names' all-gather decides then."""
    if env.get("DISTDIAG_HOST"):
        return False
    nodes = _int_env(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
    if nodes is not None and "SLURM_PROCID" in env:
        return nodes == 1
    world = _int_env(env, "WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE")
    local = _int_env(env, "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")
    return world is not None and local is not None and local >= world


def _settings() -> tuple[float, int, float]:
    budget_s = float(getattr(_cfg, "probe_budget_s", DEFAULT_BUDGET_S))
    if _auto:
        budget_s = min(budget_s, float(getattr(_cfg, "probe_auto_budget_s", DEFAULT_AUTO_BUDGET_S)))
    max_rounds = int(getattr(_cfg, "probe_max_rounds", DEFAULT_MAX_ROUNDS))
    # generous: only a peer that never joins hits it, and then once
    timeout_s = float(getattr(_cfg, "probe_timeout_s", 30.0))
    return budget_s, max_rounds, timeout_s


def _run(make: Callable[[float], Transport]) -> None:
    global _done, LAST
    if _done:
        return
    _done = True
    try:
        budget_s, max_rounds, timeout_s = _settings()
        tr = make(timeout_s)
        try:
            if tr.world_size < 2:
                # nothing to probe, and the one probe is not spent on it: a program under torchrun
                # that also imports mpi4py (an MPI singleton of one rank) still probes its torch group
                _done = False
                return
            LAST = run_probe(tr, _host(), _rec, budget_s, max_rounds, across_hosts_only=_auto)
        finally:  # also after `return`: a private MPI communicator is freed
            close = getattr(tr, "close", None)
            if close is not None:
                close()
        if LAST is not None:
            log.info("distdiag: link probe over %s: %d rounds in %.2f s", tr.name, LAST.rounds, LAST.elapsed_s)
    except Exception as e:  # never into the user's program
        log.warning("distdiag: link probe failed: %s", e)


# -- torch: on which device, and when ------------------------------------------------
# Over NCCL the probe's tensors must sit on the GPU this rank's program uses, or
# every local rank would probe from GPU 0 (and create a CUDA context there).
# Right after init_process_group that GPU is known only when the program said
# so: ``device_id=`` of init_process_group, or the group's ``bound_device_id``
# (set by it). Otherwise programs call ``torch.cuda.set_device`` after init (or
# never, and put their tensors on ``cuda:<local rank>``), so the probe waits
# for the program's first collective or point-to-point call through
# torch.distributed, or its first ``DistributedDataParallel(...)``, and runs just
# before it, on the GPU of the call's CUDA tensor (a module's parameters for
# DDP), else on ``torch.cuda.current_device()`` read then. Waiting for the same
# event on every rank keeps the ranks in step: the decision to wait depends only
# on the backend and on what init_process_group was given, alike on all ranks.
# Gloo and CPU-only machines probe at once, on the CPU, as before. A program
# that makes no such call (or calls through a name it bound before
# init_process_group returned) is not probed.

#: torch.distributed calls that start the deferred probe (module attributes)
_TORCH_CALLS = (
    "all_reduce", "all_reduce_coalesced", "broadcast", "all_gather", "all_gather_into_tensor",
    "all_gather_single", "_all_gather_base", "all_gather_coalesced", "reduce_scatter",
    "reduce_scatter_tensor", "reduce_scatter_single", "_reduce_scatter_base", "all_to_all",
    "all_to_all_single", "barrier", "monitored_barrier", "reduce", "gather", "scatter",
    "all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list",
    "send", "recv", "isend", "irecv", "send_object_list", "recv_object_list", "batch_isend_irecv",
)  # fmt: skip

#: the deferred torch probe: (process group it is for) while waiting, else None
_torch_pending: Any = None
_torch_wrapped: list[tuple[Any, str, Any, Any]] = []  # (owner, attribute, original, ours)
_torch_lock = threading.Lock()


def _is_nccl(pg: Any) -> bool:
    try:
        import torch.distributed as dist

        return "nccl" in str(dist.get_backend(pg)).lower()
    except Exception:
        return "nccl" in str(pg.name()).lower()


def torch_probe_device(pg: Any, device_id: Any = None) -> Any:
    """The device to probe ``pg`` on right after init_process_group; None: not known yet.

    The CPU unless ``pg`` runs NCCL and CUDA is there; then ``device_id`` (what
    the program gave init_process_group) or ``pg.bound_device_id``, else None
    (wait for the program's first call, see :func:`device_at_call`).
    """
    import torch

    if not _is_nccl(pg) or not torch.cuda.is_available():
        return torch.device("cpu")
    d = device_id if device_id is not None else getattr(pg, "bound_device_id", None)
    if d is None:
        return None
    d = torch.device("cuda", d) if isinstance(d, int) else torch.device(d)
    if d.type != "cuda":
        return None
    return d if d.index is not None else torch.device("cuda", torch.cuda.current_device())


def _cuda_device_in(torch: Any, objs: Any, depth: int = 0) -> Any:
    for o in objs:
        if isinstance(o, torch.Tensor):
            if o.is_cuda:
                return o.device
        elif isinstance(o, torch.nn.Module):
            p = next(o.parameters(), None)
            if p is not None and p.is_cuda:
                return p.device
        elif isinstance(o, (list, tuple)) and depth < 2:
            d = _cuda_device_in(torch, o[:16], depth + 1)
            if d is not None:
                return d
        elif type(o).__name__ == "P2POp":  # batch_isend_irecv's ops
            t = getattr(o, "tensor", None)
            if isinstance(t, torch.Tensor) and t.is_cuda:
                return t.device
    return None


def device_at_call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The device of the program's first NCCL call: its CUDA tensor's, else the current one."""
    import torch

    d = _cuda_device_in(torch, (*args, *kwargs.values()))
    return d if d is not None else torch.device("cuda", torch.cuda.current_device())


def _probe_torch(device_id: Any = None) -> None:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    if not dist.is_initialized():
        return
    pg = distributed_c10d._get_default_group()
    if pg is None:
        return
    dev = torch_probe_device(pg, device_id)
    if dev is None:
        _defer_torch(pg, dist)
        return
    _run(lambda timeout_s: TorchTransport(pg, timeout_s, dev))


def _defer_torch(pg: Any, dist: Any) -> None:
    global _torch_pending
    _undefer_torch()
    owners: list[Any] = [dist]
    c10d = getattr(dist, "distributed_c10d", None)
    if c10d is not None:
        owners.append(c10d)
    for owner in owners:
        for name in _TORCH_CALLS:
            orig = owner.__dict__.get(name)
            if callable(orig):
                _wrap_torch(owner, name, orig, _mk_first_call(orig))
    try:
        from torch.nn.parallel import distributed as ddp_mod

        ddp = ddp_mod.DistributedDataParallel
        _wrap_torch(ddp, "__init__", ddp.__init__, _mk_first_call(ddp.__init__, method=True))
    except Exception:
        log.debug("distdiag: probe not deferred to DDP", exc_info=True)
    _torch_pending = pg


def _wrap_torch(owner: Any, name: str, orig: Any, ours: Any) -> None:
    _torch_wrapped.append((owner, name, orig, ours))
    setattr(owner, name, ours)


def _undefer_torch() -> None:
    """Put back every attribute the deferral replaced (those still ours)."""
    global _torch_pending
    _torch_pending = None
    for owner, name, orig, ours in reversed(_torch_wrapped):
        if owner.__dict__.get(name) is ours:
            setattr(owner, name, orig)
    _torch_wrapped.clear()


def _mk_first_call(orig: Callable[..., Any], method: bool = False) -> Callable[..., Any]:
    @functools.wraps(orig)
    def first_call(*args: Any, **kwargs: Any) -> Any:
        if _torch_pending is not None:
            _first_torch_call(args[1:] if method else args, kwargs)
        return orig(*args, **kwargs)

    return first_call


def _first_torch_call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """The program's first call after a deferred init: probe now (once), then step aside."""
    # another thread's call waits here until the probe is over: the probe's messages
    # and the program's must not interleave differently on different ranks
    with _torch_lock:
        pg = _torch_pending
        if pg is None:
            return
        _undefer_torch()
        try:
            from torch.distributed import distributed_c10d

            if not _active or distributed_c10d._get_default_group() is not pg:
                return  # uninstalled, or the group was destroyed meanwhile
            dev = device_at_call(args, kwargs)
            _run(lambda timeout_s: TorchTransport(pg, timeout_s, dev))
        except Exception as e:
            log.warning("distdiag: link probe skipped: %s", e)


def _device_id_of(orig: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``device_id`` as the program passed it to init_process_group (None if not)."""
    if "device_id" in kwargs:
        return kwargs["device_id"]
    try:
        return inspect.signature(orig).bind_partial(*args, **kwargs).arguments.get("device_id")
    except Exception:
        return None


def _patch_torch(mod: types.ModuleType) -> None:
    if not _active:
        return
    orig = getattr(mod, "init_process_group", None)
    if orig is None or getattr(orig, "_distdiag_probe", False):
        return

    @functools.wraps(orig)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        out = orig(*args, **kwargs)
        try:
            _probe_torch(_device_id_of(orig, args, kwargs))
        except Exception as e:
            log.warning("distdiag: link probe skipped: %s", e)
        return out

    init_process_group._distdiag_probe = True  # type: ignore[attr-defined]
    owners = [mod]
    c10d = getattr(mod, "distributed_c10d", None)
    if c10d is not None and getattr(c10d, "init_process_group", None) is orig:
        owners.append(c10d)
    for owner in owners:
        _patched.append((owner, "init_process_group", orig))
        setattr(owner, "init_process_group", init_process_group)


def _on_mpi(mpi: types.ModuleType) -> None:
    if not _active or _done:
        return
    # MPI may not be initialized yet (mpi4py.rc.initialize = False): then the
    # probe runs right after the program's own MPI.Init / MPI.Init_thread
    from distdiag.shim.hooks import mpi4py as mpi_hook

    mpi_hook.when_initialized(mpi, _probe_mpi)


def _probe_mpi(mpi: Any, _t0: int | None = None) -> None:
    M: Any = mpi
    if not _active or _done or M.Is_finalized():
        return

    def make(timeout_s: float) -> Transport:
        # A plain handle to COMM_WORLD (the mpi4py hook may have replaced
        # MPI.COMM_WORLD with a recording wrapper), then a private Dup: the
        # probe's messages live in their own context and are never recorded.
        # Non-blocking Idup with a deadline: a rank that never imports
        # mpi4py cannot hold the others for longer than probe_timeout_s.
        base = M.Intracomm(M.COMM_WORLD)
        dup, req = base.Idup()
        tr = MpiTransport(dup, M, timeout_s)
        tr._wait([req])
        return tr

    _run(make)


def install(rec: Any, cfg: Any, environ: Any = None) -> None:
    global _rec, _cfg, _active, _auto
    mode = probe_mode(getattr(cfg, "probe_links", "auto"))
    if mode == "off" or (mode == "auto" and one_host_said(os.environ if environ is None else environ)):
        return
    _rec, _cfg, _active, _auto = rec, cfg, True, mode == "auto"
    from distdiag.shim.hooks import when_imported

    when_imported("torch.distributed", _patch_torch)
    when_imported("mpi4py.MPI", _on_mpi)


def uninstall() -> None:
    global _rec, _cfg, _done, LAST, _active, _auto
    _active = False
    _undefer_torch()
    try:
        from distdiag.shim.hooks import mpi4py as mpi_hook

        mpi_hook.cancel_when_initialized(_probe_mpi)
    except Exception:
        log.debug("distdiag: probe's MPI init callback not cancelled", exc_info=True)
    for owner, attr, orig in reversed(_patched):
        setattr(owner, attr, orig)
    _patched.clear()
    _rec = _cfg = None
    _done = False
    LAST = None
    _auto = False
