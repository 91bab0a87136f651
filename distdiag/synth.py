"""Synthetic runs: N ranks x M events in the real rank-file format, with chosen faults.

    distdiag synth OUT_DIR --ranks 1024 --events 100000 --fault straggler

Scale cannot be measured without a cluster unless something writes cluster-sized
run dirs; detectors cannot be tested fast unless their fault can be made on
demand. This module does both. Files go through
:func:`distdiag.shim.writer.write_rank_file`, so they have exactly the layout
the shim writes, and the real analyzer reads them.

The job simulated is bulk-synchronous data-parallel training: per iteration
every rank computes (a ``FORWARD`` phase, ``compute_ms`` +- ``jitter``), then
calls one ``Allreduce`` of ``nbytes`` on "world" (2 events per iteration).
Ranks sit ``ranks_per_host`` to a host. Every run carries what the shim
records besides: clock-sync exchanges against rank 0 (start, periodic, exit),
an active link probe between the hosts' first ranks (when there are at most
``PROBE_MAX_HOSTS`` hosts), per-host clock offsets.

Faults (``fault``):

* ``straggler``: rank ``fault_rank`` computes ``slow`` (default 30%) longer
  every iteration; everyone waits for it at every all-reduce.
* ``slow_link``: host ``fault_host``'s link runs at ``1/slow_link_factor`` of
  the others' bandwidth: the probe sees it and every all-reduce's transfer
  phase (after the last arrival) stretches, while arrivals stay on time.
* ``storm``: before the first iteration every rank stats ``storm_share`` of
  its events' worth of files on one Lustre mount, each call taking
  ``storm_latency_ms`` (a saturated metadata server).
* ``serial``: every ``serial_every``-th iteration rank ``fault_rank`` runs an
  "evaluate" phase of ``serial_ms`` and then a ``Bcast`` from it, which the
  other ranks enter at once and wait in (Amdahl's serial section).
* ``skew``: host clocks are seconds apart and drift by up to ``drift_ppm``;
  nothing else is wrong, so a correct analysis aligns them (run.offset_ns
  close to the truth) and finds nothing.
* ``none``: a healthy run (jitter only), for silence tests.

The simulation is vectorized over iterations; ranks are generated one at a
time from their own seeded stream (``default_rng([seed, rank])``), so memory is
one rank's events, whatever N, and the same (seed, rank) always gives the same
file. Two passes over the ranks: the first finds each iteration's last arrival
(the maximum over ranks), the second writes the files.

The truth (who straggles, which host is slow, each rank's clock offset,
the expected cost) is returned as :class:`SynthTruth` and written to
``OUT_DIR/synth.json`` for tests and benchmarks.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from distdiag.schema import EVENT_DTYPE, SYNC_DTYPE, Kind, SyncTag, rank_file_name

log = logging.getLogger(__name__)

FAULTS = ("none", "straggler", "slow_link", "storm", "serial", "skew")
MS = 1_000_000  # ns
#: the probe is all pairs of hosts: beyond this many hosts that is too many rows
PROBE_MAX_HOSTS = 128
#: the FILE_STAT latency of the healthy metadata server (far below any threshold)
_STAT_OK_NS = 50_000

_STRINGS = [
    "",
    "Allreduce",  # 1
    "world",  # 2
    "train.py:42",  # 3 all-reduce call site
    "forward",  # 4
    "Bcast",  # 5
    "evaluate",  # 6
    "train.py:57",  # 7 bcast call site
    "lustre:/scratch",  # 8 file system of the storm
    "/scratch/dataset/meta.json",  # 9
    "probe_bw",  # 10
    "probe_lat",  # 11
    "probe",  # 12
    "probe:mpi",  # 13
    "MPI_FLOAT",  # 14
    "target_start",  # 15
]
_SID = {s: i for i, s in enumerate(_STRINGS)}


@dataclass
class SynthTruth:
    """What the synthetic run really holds (true timeline = rank 0's clock)."""

    run_dir: str
    ranks: int
    events_per_rank: int
    iters: int
    fault: str
    hosts: int
    ranks_per_host: int
    #: rank the fault sits on (straggler, serial), -1 otherwise
    fault_rank: int = -1
    #: host name of the slow link, "" otherwise
    fault_host: str = ""
    #: expected cost of the fault in seconds (what removing it would save)
    expected_cost_s: float = 0.0
    wall_s: float = 0.0
    total_events: int = 0
    #: per rank: true = local + offset at the start of the run (ns)
    offset_ns: list[int] = field(default_factory=list)
    drift_ppm: list[float] = field(default_factory=list)
    gen_s: float = 0.0
    bytes_on_disk: int = 0


def _host_of(rank: int, rph: int) -> int:
    return rank // rph


class _Sim:
    """Parameters and the per-rank random streams; see the module docstring."""

    def __init__(self, ranks: int, events: int, fault: str, *, ranks_per_host: int, seed: int, compute_ms: float,
                 jitter: float, nbytes: int, bandwidth_bps: float, slow: float, slow_link_factor: float,
                 storm_share: float, storm_latency_ms: float, serial_every: int, serial_ms: float,
                 drift_ppm: float, fault_rank: int, fault_host: int) -> None:  # fmt: skip
        if fault not in FAULTS:
            raise ValueError(f"unknown fault {fault!r} (choose from {', '.join(FAULTS)})")
        if ranks < 1 or events < 4:
            raise ValueError("need at least 1 rank and 4 events per rank")
        self.n = ranks
        self.fault = fault
        self.rph = max(1, min(ranks_per_host, ranks))
        self.n_hosts = (ranks + self.rph - 1) // self.rph
        self.seed = seed
        self.compute_ns = compute_ms * MS
        self.jitter = jitter
        self.nbytes = nbytes
        self.fault_rank = fault_rank % ranks
        self.fault_host = fault_host % self.n_hosts
        self.slow = slow
        self.serial_every = max(2, serial_every)
        self.serial_ns = int(serial_ms * MS)
        self.storm_lat_ns = int(storm_latency_ms * MS)
        # storm: its stats take a share of the events; the rest are iterations
        self.n_stat = max(100, int(events * storm_share)) if fault == "storm" else 0
        self.n_stat = min(self.n_stat, events - 4)
        per_iter = 2.0 + (1.0 / self.serial_every if fault == "serial" else 0.0)
        self.iters = max(2, int((events - self.n_stat) / per_iter))
        # the ring all-reduce moves 2(n-1)/n of its bytes over the slowest link of the ring
        bus = nbytes * 2 * (self.n_hosts - 1) / self.n_hosts if self.n_hosts > 1 else 0.0
        self.bw = bandwidth_bps
        self.bw_slow = bandwidth_bps / slow_link_factor
        lat = 50_000
        self.xfer_ns = int(lat + bus / bandwidth_bps * 1e9)
        self.xfer_slow_ns = int(lat + bus / self.bw_slow * 1e9)
        if fault == "slow_link" and self.n_hosts > 1:
            self.xfer_ns, self.xfer_fast_ns = self.xfer_slow_ns, self.xfer_ns
        else:
            self.xfer_fast_ns = self.xfer_ns
        self.bcast_ns = 30_000
        self.serial_iter = np.zeros(self.iters, bool)
        if fault == "serial":
            self.serial_iter[self.serial_every - 1 :: self.serial_every] = True
        # clocks: per host an offset (nodes boot at different times) and, for skew, a drift
        hr = np.random.default_rng([seed, 1 << 30])
        if fault == "skew":
            self.host_off = hr.integers(-50_000, 50_000, self.n_hosts) * MS  # +-50 s
            self.host_drift = hr.uniform(-drift_ppm, drift_ppm, self.n_hosts) * 1e-6
        else:
            self.host_off = hr.integers(-5_000, 5_000, self.n_hosts) * MS
            self.host_drift = np.zeros(self.n_hosts)
        self.host_off[0] = 0
        self.host_drift[0] = 0.0
        self.t_start = 10_000 * MS  # true time of every shim's start
        self.probe = self.n_hosts > 1 and self.n_hosts <= PROBE_MAX_HOSTS
        self.probe_ns = self._probe_len_ns() if self.probe else 0

    # -- per-rank random draws -------------------------------------------------
    def draws(self, r: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(compute_ns[iters], exit_noise_ns[iters], bcast_noise_ns[iters], stat_ns[n_stat]) of rank r."""
        rng = np.random.default_rng([self.seed, r])
        comp = self.compute_ns * (1.0 + self.jitter * rng.uniform(-1.0, 1.0, self.iters))
        if self.fault == "straggler" and r == self.fault_rank:
            comp += self.slow * self.compute_ns
        noise = rng.integers(0, 20_000, self.iters)  # ranks see completion a few µs apart
        bnoise = rng.integers(0, 10_000, self.iters)
        stat = (self.storm_lat_ns * rng.uniform(0.8, 1.2, self.n_stat)).astype(np.int64)
        return comp.astype(np.int64), noise, bnoise, stat

    def _probe_len_ns(self) -> int:
        return int((self.n_hosts - 1) * (0.2 * MS + (1 << 20) / self.bw_slow * 1e9 + MS)) + 10 * MS

    def start_ns(self, stat: np.ndarray) -> int:
        """True time at which this rank's first iteration starts."""
        return int(self.t_start + 2 * MS + self.probe_ns + stat.sum())

    # -- pass 1: the job's timeline -----------------------------------------------
    def timeline(self) -> tuple[np.ndarray, np.ndarray]:
        """(last_ns[iters]: last arrival at each all-reduce, bcast_last_rel_ns[iters]).

        last[i+1] = last[i] + max over ranks of (rel_i,r + comp_{i+1},r), where
        rel is the rank's next start minus last[i]: the all-reduce's transfer
        and, on serial iterations, the wait for the evaluating rank's Bcast.
        """
        comp0, noise0, _, _ = self.draws(self.fault_rank if self.fault == "serial" else 0)
        # the serial rank arrives at the Bcast last: serial_ns (>> µs noise) after its all-reduce exit
        bcast_last_rel = np.where(self.serial_iter, self.xfer_ns + noise0 + self.serial_ns, 0).astype(np.int64)
        step = np.full(self.iters - 1, np.iinfo(np.int64).min, np.int64)
        first = np.iinfo(np.int64).min
        for r in range(self.n):  # per rank: the maximum over ranks, vectorized over iterations
            comp, noise, bnoise, stat = self.draws(r)
            rel = self._rel(noise, bnoise, bcast_last_rel)
            np.maximum(step, rel[:-1] + comp[1:], out=step)
            first = max(first, self.start_ns(stat) + int(comp[0]))
        last = np.empty(self.iters, np.int64)
        last[0] = first
        last[1:] = first + np.cumsum(step)
        return last, bcast_last_rel

    def _rel(self, noise: np.ndarray, bnoise: np.ndarray, bcast_last_rel: np.ndarray) -> np.ndarray:
        normal = self.xfer_ns + noise
        serial = bcast_last_rel + self.bcast_ns + bnoise
        return np.where(self.serial_iter, serial, normal)

    # -- pass 2: one rank's rows ----------------------------------------------------
    def rank_events(self, r: int, last: np.ndarray, bcast_last_rel: np.ndarray) -> np.ndarray:
        comp, noise, bnoise, stat = self.draws(r)
        it = self.iters
        rel = self._rel(noise, bnoise, bcast_last_rel)
        arrive = np.empty(it, np.int64)
        arrive[0] = self.start_ns(stat) + comp[0]
        arrive[1:] = last[:-1] + rel[:-1] + comp[1:]
        exit_ = last + self.xfer_ns + noise
        ser = self.serial_iter
        slots = 4 if self.fault == "serial" else 2
        ev = np.zeros((it, slots), EVENT_DTYPE)
        fw = ev[:, 0]
        fw["t0_ns"] = arrive - comp
        fw["t1_ns"] = arrive
        fw["kind"] = Kind.FORWARD
        fw["name_id"] = _SID["forward"]
        fw["seq"] = -1
        fw["peer"] = -1
        # seq per communicator: the all-reduce and the Bcast share "world"
        n_before = np.concatenate([[0], np.cumsum(ser)[:-1]]) if self.fault == "serial" else 0
        ar = ev[:, 1]
        ar["t0_ns"] = arrive
        ar["t1_ns"] = exit_
        ar["kind"] = Kind.COLL
        ar["name_id"] = _SID["Allreduce"]
        ar["comm_id"] = _SID["world"]
        ar["seq"] = np.arange(it) + n_before
        ar["peer"] = -1
        ar["nbytes"] = self.nbytes
        ar["aux"] = _SID["MPI_FLOAT"]
        ar["site_id"] = _SID["train.py:42"]
        keep = np.zeros((it, slots), bool)
        keep[:, :2] = True
        if self.fault == "serial":
            me = r == self.fault_rank
            b0 = exit_ + (self.serial_ns if me else 2_000 + noise % 5_000)
            if me:
                evl = ev[:, 2]
                evl["t0_ns"] = exit_
                evl["t1_ns"] = exit_ + self.serial_ns
                evl["kind"] = Kind.PHASE
                evl["name_id"] = _SID["evaluate"]
                evl["seq"] = -1
                evl["peer"] = -1
                keep[:, 2] = ser
            bc = ev[:, 3]
            bc["t0_ns"] = b0
            bc["t1_ns"] = last + bcast_last_rel + self.bcast_ns + bnoise
            bc["kind"] = Kind.COLL
            bc["name_id"] = _SID["Bcast"]
            bc["comm_id"] = _SID["world"]
            bc["seq"] = ar["seq"] + 1
            bc["peer"] = self.fault_rank
            bc["nbytes"] = 4096
            bc["aux"] = _SID["MPI_FLOAT"]
            bc["site_id"] = _SID["train.py:57"]
            keep[:, 3] = ser
        parts = [self._probe_rows(r)] if self.probe and r % self.rph == 0 else []
        if self.n_stat:
            parts.append(self._storm_rows(stat))
        parts.append(ev[keep])
        return np.concatenate(parts) if len(parts) > 1 else parts[0]

    def _storm_rows(self, stat: np.ndarray) -> np.ndarray:
        st = np.zeros(len(stat), EVENT_DTYPE)
        ends = self.t_start + 2 * MS + self.probe_ns + np.cumsum(stat)
        st["t0_ns"] = ends - stat
        st["t1_ns"] = ends
        st["kind"] = Kind.FILE_STAT
        st["name_id"] = _SID["/scratch/dataset/meta.json"]
        st["seq"] = -1
        st["peer"] = -1
        st["aux"] = _SID["lustre:/scratch"]
        return st

    def _probe_rows(self, r: int) -> np.ndarray:
        """This host leader's share of an all-pairs probe between host leaders.

        Pair (a, b) of hosts is measured in slot k = (b - a) mod H - 1 by both
        leaders at the same instant, so rows agree on both sides."""
        h = _host_of(r, self.rph)
        peers_h = np.array([q for q in range(self.n_hosts) if q != h])  # per host: H - 1 peers (H <= 128)
        slot = (np.minimum((peers_h - h) % self.n_hosts, (h - peers_h) % self.n_hosts)).astype(np.int64) - 1
        order = np.argsort(slot * self.n_hosts + np.minimum(peers_h, h), kind="stable")
        peers_h, slot = peers_h[order], slot[order]
        size = 1 << 20
        slow = self.fault == "slow_link"
        bw = np.where(slow & ((peers_h == self.fault_host) | (h == self.fault_host)), self.bw_slow, self.bw)
        # slot width fits the slowest transfer; pairs sharing a slot overlap (as a real
        # probe's disjoint pairs do)
        width = int(0.2 * MS + size / self.bw_slow * 1e9 + MS)
        t = self.t_start + MS + slot * width
        lat = np.zeros(len(peers_h), EVENT_DTYPE)
        lat["t0_ns"] = t
        lat["t1_ns"] = t + 100_000
        lat["nbytes"] = 8
        lat["name_id"] = _SID["probe_lat"]
        bwr = np.zeros(len(peers_h), EVENT_DTYPE)
        bwr["t0_ns"] = t + 100_000
        bwr["t1_ns"] = t + 100_000 + (size / bw * 1e9).astype(np.int64)
        bwr["nbytes"] = size
        bwr["name_id"] = _SID["probe_bw"]
        span = np.zeros(1, EVENT_DTYPE)
        span["t0_ns"] = self.t_start + MS
        span["t1_ns"] = self.t_start + self.probe_ns
        span["name_id"] = _SID["probe"]
        span["nbytes"] = self.n_hosts
        span["aux"] = 1
        span["value"] = 1.0
        rows = np.concatenate([span, np.stack([lat, bwr], axis=1).reshape(-1)])
        rows["kind"] = Kind.PROBE
        rows["comm_id"] = _SID["probe:mpi"]
        rows["seq"] = -1
        rows["peer"][0] = -1
        rows["peer"][1:] = np.repeat(peers_h * self.rph, 2)
        return rows

    # -- clocks -------------------------------------------------------------------
    def to_local(self, r: int, t_true: np.ndarray) -> np.ndarray:
        """true -> this rank's clock: local = true - offset - drift * (true - t_start)."""
        h = _host_of(r, self.rph)
        t: np.ndarray = (t_true - self.host_off[h] - (self.host_drift[h] * (t_true - self.t_start))).astype(np.int64)
        return t

    def sync_rows(self, r: int, t_end: int) -> np.ndarray | None:
        if r == 0:
            return None
        rng = np.random.default_rng([self.seed, r, 7])
        n_periodic = 8
        rounds = [(self.t_start, SyncTag.START)]
        rounds += [(int(t), SyncTag.PERIODIC) for t in np.linspace(self.t_start, t_end, n_periodic + 2)[1:-1]]
        rounds += [(t_end - MS, SyncTag.EXIT)]
        k = 5
        t_send = np.concatenate([t + np.arange(k) * 100_000 for t, _ in rounds])
        tags = np.repeat([tag for _, tag in rounds], k)
        rtt = rng.integers(20_000, 200_000, len(t_send))
        s = np.zeros(len(t_send), SYNC_DTYPE)
        s["t_send_ns"] = self.to_local(r, t_send)
        s["t_recv_ns"] = self.to_local(r, t_send + rtt)
        s["t_ref_ns"] = t_send + rtt // 2  # rank 0's clock is the true clock
        s["ref_rank"] = 0
        s["tag"] = tags
        return s


def synth(
    out_dir: str | Path,
    *,
    ranks: int = 8,
    events: int = 2_000,
    fault: str = "none",
    ranks_per_host: int = 8,
    seed: int = 0,
    compute_ms: float = 5.0,
    jitter: float = 0.02,
    nbytes: int = 1 << 20,
    bandwidth_bps: float = 10e9,
    slow: float = 0.3,
    slow_link_factor: float = 20.0,
    storm_share: float = 0.05,
    storm_latency_ms: float = 5.0,
    serial_every: int = 10,
    serial_ms: float = 20.0,
    drift_ppm: float = 50.0,
    fault_rank: int = 0,
    fault_host: int = 1,
    job_id: str = "synth",
) -> SynthTruth:
    """Write a synthetic run dir (see the module docstring); returns its truth.

    ``events`` is per rank (approximate: whole iterations, plus the probe rows
    on host leaders). ``fault_rank`` is the straggler / the serial rank,
    ``fault_host`` the host index of the slow link (host names are "nodeNNNN").
    """
    from distdiag.shim.writer import write_rank_file

    t_gen = time.perf_counter()
    if fault == "straggler" and fault_rank == 0 and ranks > 1:
        fault_rank = ranks // 2 + 1 if ranks > 2 else 1  # not rank 0, and not a host leader when it can
    sim = _Sim(ranks, events, fault, ranks_per_host=ranks_per_host, seed=seed, compute_ms=compute_ms, jitter=jitter,
               nbytes=nbytes, bandwidth_bps=bandwidth_bps, slow=slow, slow_link_factor=slow_link_factor,
               storm_share=storm_share, storm_latency_ms=storm_latency_ms, serial_every=serial_every,
               serial_ms=serial_ms, drift_ppm=drift_ppm, fault_rank=fault_rank, fault_host=fault_host)  # fmt: skip
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("rank-*.h5"):  # a rerun into the same dir must not mix runs
        old.unlink()
    last, bcast_rel = sim.timeline()
    t_end = int(last[-1] + sim.xfer_ns + 20_000 + (sim.serial_ns + MS if sim.serial_iter[-1] else 0)) + 5 * MS
    total = 0
    nbytes_disk = 0
    for r in range(ranks):  # one file per rank; memory is one rank's rows
        ev = sim.rank_events(r, last, bcast_rel)
        ev["t0_ns"] = sim.to_local(r, ev["t0_ns"])
        ev["t1_ns"] = sim.to_local(r, ev["t1_ns"])
        t0_local = int(sim.to_local(r, np.array([sim.t_start]))[0])
        t_end_local = int(sim.to_local(r, np.array([t_end]))[0])
        attrs: dict[str, Any] = dict(
            rank=r,
            world_size=ranks,
            local_rank=r % sim.rph,
            host=f"node{_host_of(r, sim.rph):04d}",
            job_id=job_id,
            launch_id=f"launch-{job_id}",
            mono_ns_at_start=t0_local,
            wall_ns_at_start=int(1_700_000_000 * 10**9 + sim.t_start),
            end_mono_ns=t_end_local,
            last_flush_mono_ns=t_end_local,
            pid=100_000 + r,
            hooks=["synth"],
        )
        path = out / rank_file_name(r)
        write_rank_file(path, attrs, ev, _STRINGS, sync=sim.sync_rows(r, t_end))
        total += len(ev)
        nbytes_disk += path.stat().st_size
    expected = _expected_cost_s(sim, last, bcast_rel)
    offsets = [int(sim.host_off[_host_of(r, sim.rph)]) for r in range(ranks)]
    truth = SynthTruth(
        run_dir=str(out),
        ranks=ranks,
        events_per_rank=events,
        iters=sim.iters,
        fault=fault,
        hosts=sim.n_hosts,
        ranks_per_host=sim.rph,
        fault_rank=sim.fault_rank if fault in ("straggler", "serial") else -1,
        fault_host=f"node{sim.fault_host:04d}" if fault == "slow_link" else "",
        expected_cost_s=expected,
        wall_s=(t_end - sim.t_start) / 1e9,
        total_events=total,
        offset_ns=offsets,
        drift_ppm=[float(sim.host_drift[_host_of(r, sim.rph)] * 1e6) for r in range(ranks)],
        gen_s=time.perf_counter() - t_gen,
        bytes_on_disk=nbytes_disk,
    )
    (out / "synth.json").write_text(json.dumps(asdict(truth)))
    log.info("synth: %d ranks x %d events (%s) in %.1f s", ranks, events, fault, truth.gen_s)
    return truth


def _expected_cost_s(sim: _Sim, last: np.ndarray, bcast_rel: np.ndarray) -> float:
    """What removing the fault would save, from the simulation's own numbers."""
    if sim.fault == "straggler":
        return float(sim.slow * sim.compute_ns * (sim.iters - 1)) / 1e9  # the first collective is launch skew
    if sim.fault == "slow_link":
        return float((sim.xfer_slow_ns - sim.xfer_fast_ns) * sim.iters) / 1e9
    if sim.fault == "storm":
        return float(sim.n_stat * sim.storm_lat_ns) / 1e9
    if sim.fault == "serial":
        return float(sim.serial_ns * int(sim.serial_iter.sum())) / 1e9
    return 0.0


def load_truth(run_dir: str | Path) -> dict[str, Any]:
    """The ``synth.json`` a synthetic run dir carries."""
    return dict(json.loads((Path(run_dir) / "synth.json").read_text()))


def add_parser(sub: Any) -> None:
    """``distdiag synth``'s arguments (called by distdiag.cli)."""
    p = sub.add_parser("synth", help="write a synthetic run dir (N ranks x M events, with a chosen fault)")
    p.add_argument("out_dir", metavar="OUT_DIR")
    p.add_argument("--ranks", "-n", type=int, default=8)
    p.add_argument("--events", "-m", type=int, default=2000, help="events per rank (default 2000)")
    p.add_argument("--fault", choices=FAULTS, default="none")
    p.add_argument("--ranks-per-host", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compute-ms", type=float, default=5.0)
    p.add_argument("--fault-rank", type=int, default=0, help="straggler / serial rank (straggler default: N/2+1)")
    p.add_argument("--fault-host", type=int, default=1, help="host index of the slow link")


def main_from_args(ns: Any) -> int:
    t = synth(ns.out_dir, ranks=ns.ranks, events=ns.events, fault=ns.fault, ranks_per_host=ns.ranks_per_host,
              seed=ns.seed, compute_ms=ns.compute_ms, fault_rank=ns.fault_rank, fault_host=ns.fault_host)  # fmt: skip
    where = f" on rank {t.fault_rank}" if t.fault_rank >= 0 else (f" on {t.fault_host}" if t.fault_host else "")
    print(
        f"wrote {t.ranks} rank files, {t.total_events:,} events ({t.bytes_on_disk / 1e6:.1f} MB) to {t.run_dir} "
        f"in {t.gen_s:.1f} s; fault {t.fault}{where}, expected cost {t.expected_cost_s:.2f} s of {t.wall_s:.2f} s"
    )
    return 0
