"""Slurm accounting: when the job was submitted, eligible, started and ended.

No profiler inside the job sees the time before it started: the queue. Slurm's
accounting does, at one-second resolution. This module reads the job's record
(``sacct --json`` by default; pyslurm when it is importable), keeps a copy in
the run dir (``slurm-accounting.json``, so a later analysis works offline, on
a laptop with no Slurm), and puts the scheduler's instants and the ranks' own
milestones on one timeline: seconds since submission.

    submit --(held: dependency, begin time, limits)--> eligible
           --(waiting for resources)--> start --(launch: srun, python, imports,
           init, rendezvous)--> slowest rank's first useful work --> ... --> end

Which record is used, in order:

1. the stored copy when it is final (the job had ended when it was read);
2. a live read (pyslurm, else ``sacct``), stored for next time;
3. a stored copy of a still running job (read by ``distdiag analyze`` inside
   the job's own batch script: its end is not known yet);
4. none, with one line that says why (not a Slurm job; no ``sacct`` and no
   stored copy; ``sacct`` has no record).

The analyzer calls :func:`accounting_of` (cached on the run); the detectors
``queue_wait`` and ``launch_overhead`` read the same view.

pyslurm: PyPI has no pyslurm build for Slurm 22.05 (pyslurm versions follow
Slurm's and need the matching libslurm headers), so CI cannot install it; the
backend below is small, used only when ``import pyslurm`` works, and skipped in
tests where it does not.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from distdiag.bands import Band, n_ranks
from distdiag.errors import SlurmError
from distdiag.passes import Pass, sweep
from distdiag.rows import rows_of
from distdiag.schema import COMM_KINDS, P2P_KINDS, PHASE_KINDS, Kind

if TYPE_CHECKING:
    from distdiag.run import Run

log = logging.getLogger(__name__)

ACCOUNTING_FILE = "slurm-accounting.json"
ACCOUNTING_SCHEMA = "distdiag.slurm-accounting/1"
#: sacct's times are whole seconds: differences below this are noise.
RESOLUTION_S = 1.0
#: states in which a job's record is still changing
_LIVE_STATES = frozenset({"PENDING", "RUNNING", "REQUEUED", "RESIZING", "SUSPENDED", "CONFIGURING", "COMPLETING"})
#: kinds that count as a rank's first useful work (not imports: file events; not the shim's own marks)
USEFUL_KINDS = frozenset(COMM_KINDS | P2P_KINDS | PHASE_KINDS | {Kind.STEP})
#: kinds at which a rank meets its peers at start: communicator creation (MPI
#: init, init_process_group's store) and the first useful work
RENDEZVOUS_KINDS = frozenset(USEFUL_KINDS | {Kind.COMM_CREATE})
#: rows where a rank waits for others (the rest of RENDEZVOUS_KINDS wait for nobody)
_SYNC_KINDS = frozenset(COMM_KINDS | P2P_KINDS | {Kind.COMM_CREATE})
#: the kinds whose rows can show a rank busy before its first rendezvous: every kind but
#: the rendezvous kinds (a rank's rows of those start at or after its first one, by
#: definition) and the shim's own milestones. The streamed compute phases
#: (distdiag.run.STREAMED_KINDS) are all rendezvous kinds, so these rows are all in run.events.
_BEFORE_KINDS = np.setdiff1d(np.arange(256), [int(k) for k in RENDEZVOUS_KINDS | {Kind.SHIM}]).astype(np.uint8)


@dataclass
class Accounting:
    """One job's accounting record. Times are Unix epoch seconds (None = unknown)."""

    job_id: str
    name: str = ""
    state: str = ""
    exit_code: int | None = None
    submit_s: int | None = None
    eligible_s: int | None = None
    start_s: int | None = None
    end_s: int | None = None
    nodes: str = ""
    cluster: str = ""
    #: job steps: {"step": "8.0", "name": ..., "start_s": ..., "end_s": ...}
    steps: list[dict[str, Any]] = field(default_factory=list)
    #: "sacct" or "pyslurm"
    backend: str = "sacct"
    #: time.time() when it was read
    read_at_s: float = 0.0

    @property
    def final(self) -> bool:
        """The job had ended when this was read: the record will not change."""
        if not self.end_s:
            return False
        return (self.state.split() or [""])[0] not in _LIVE_STATES

    @property
    def placeholder(self) -> bool:
        """The row slurmdbd shows for a few seconds right after a job ends
        (name "allocation", no eligible time): not the job's real record."""
        return self.name == "allocation" and not self.eligible_s

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["final"] = self.final
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Accounting:
        names = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in names})


def _t(x: Any) -> int | None:
    """sacct --json times: an int (0 = unknown), or {"set":..,"number":..} in later Slurm versions."""
    if isinstance(x, dict):
        if not x.get("set", True) or x.get("infinite"):
            return None
        x = x.get("number")
    try:
        v = int(x)
    except (TypeError, ValueError):
        return None
    return v if v > 0 else None


def _state(x: Any) -> str:
    """22.05: {"current": "COMPLETED", "reason": ...}; 23.x+: {"current": ["COMPLETED"], ...}."""
    if isinstance(x, dict):
        x = x.get("current", "")
    if isinstance(x, list):
        x = " ".join(str(s) for s in x)
    return str(x or "")


def _exit(x: Any) -> int | None:
    if isinstance(x, dict):
        rc = x.get("return_code")
        if isinstance(rc, dict):
            rc = rc.get("number") if rc.get("set", True) else None
        try:
            return int(rc) if rc is not None else None
        except (TypeError, ValueError):
            return None
    return None


def parse_sacct_job(rec: dict[str, Any]) -> Accounting:
    """One element of ``sacct --json``'s "jobs" list."""
    t = rec.get("time", {}) or {}
    steps = []
    for s in rec.get("steps", []) or []:  # a handful per job
        st = s.get("time", {}) or {}
        sid = s.get("step", {}) or {}
        # 22.05: {"job_id": 8, "id": 0 | "batch", ...}; 23.x+: {"id": {"job_id": 8, "step_id": "0"}, ...}
        sub = sid.get("id")
        step = (f"{sub.get('job_id', '')}.{sub.get('step_id', '')}" if isinstance(sub, dict)
                else f"{sid.get('job_id', rec.get('job_id', ''))}.{sub}")  # fmt: skip
        steps.append({
            "step": step,
            "name": str(sid.get("name", "")),
            "start_s": _t(st.get("start")),
            "end_s": _t(st.get("end")),
        })  # fmt: skip
    return Accounting(
        job_id=str(rec.get("job_id", "")),
        name=str(rec.get("name", "")),
        state=_state(rec.get("state")),
        exit_code=_exit(rec.get("exit_code")),
        submit_s=_t(t.get("submission")),
        eligible_s=_t(t.get("eligible")),
        start_s=_t(t.get("start")),
        end_s=_t(t.get("end")),
        nodes=str(rec.get("nodes", "") or ""),
        cluster=str(rec.get("cluster", "") or ""),
        steps=steps,
        backend="sacct",
        read_at_s=time.time(),
    )


def _pick(records: list[Accounting], near_wall_s: float | None) -> Accounting | None:
    """The record of *this* run: job ids repeat after a controller loses its
    state, so prefer the one whose [start, end] holds the run's first instant."""
    if not records:
        return None
    if near_wall_s is None or len(records) == 1:
        return records[-1]

    def miss(a: Accounting) -> float:
        lo = a.start_s or a.submit_s or 0
        hi = a.end_s or float("inf")
        return 0.0 if lo - 2 <= near_wall_s <= hi + 2 else min(abs(near_wall_s - lo), abs(near_wall_s - hi))

    return min(records, key=miss)


def read_sacct(job_id: str, near_wall_s: float | None = None, wait_s: float = 8.0, timeout_s: float = 20.0) -> Accounting:
    """The job's record from ``sacct -j JOB --json``.

    Right after a job ends slurmdbd may show a placeholder row for a few
    seconds; it is polled for up to ``wait_s``.
    """
    exe = shutil.which("sacct")
    if exe is None:
        raise SlurmError("sacct is not on PATH")
    deadline = time.monotonic() + wait_s
    while True:
        try:
            p = subprocess.run([exe, "-j", str(job_id), "--json"], capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise SlurmError(f"sacct did not answer within {timeout_s:.0f} s (slurmdbd down?)") from None
        except OSError as e:
            raise SlurmError(f"sacct cannot run: {e}") from None
        if p.returncode != 0:
            msg = (p.stderr.strip().splitlines() or ["(no message)"])[-1]
            raise SlurmError(f"sacct failed: {msg[:200]}")
        try:
            jobs = json.loads(p.stdout).get("jobs", [])
        except ValueError:
            raise SlurmError("sacct --json printed no JSON (Slurm older than 20.11?)") from None
        recs = [parse_sacct_job(j) for j in jobs if str(j.get("job_id")) == str(job_id)]
        got = _pick(recs, near_wall_s)
        if got is not None and not got.placeholder:
            return got
        if time.monotonic() >= deadline:
            if got is None:
                raise SlurmError(f"sacct has no record of job {job_id} (another cluster, or accounting disabled?)")
            return got
        time.sleep(0.5)


def read_pyslurm(job_id: str) -> Accounting:
    """The job's record through pyslurm (>= 23.2: ``pyslurm.db.Job.load``)."""
    try:
        import pyslurm
    except ImportError:
        raise SlurmError("pyslurm is not installed") from None
    try:
        job = pyslurm.db.Job.load(int(job_id))
    except Exception as e:  # pyslurm raises its own RPCError and friends
        raise SlurmError(f"pyslurm could not load job {job_id}: {e}") from None

    def g(name: str) -> Any:
        return getattr(job, name, None)

    return Accounting(
        job_id=str(job_id),
        name=str(g("name") or ""),
        state=str(g("state") or ""),
        exit_code=g("exit_code") if isinstance(g("exit_code"), int) else None,
        submit_s=_t(g("submit_time")),
        eligible_s=_t(g("eligible_time")),
        start_s=_t(g("start_time")),
        end_s=_t(g("end_time")),
        nodes=str(g("nodelist") or g("nodes") or ""),
        cluster=str(g("cluster") or ""),
        backend="pyslurm",
        read_at_s=time.time(),
    )


def read_accounting(job_id: str, near_wall_s: float | None = None, backend: str = "auto", wait_s: float = 8.0) -> Accounting:
    """Read the job's record live: ``backend`` is "auto" (pyslurm if importable, else sacct), "sacct" or "pyslurm"."""
    if backend == "pyslurm":
        return read_pyslurm(job_id)
    if backend == "auto":
        try:
            import pyslurm  # noqa: F401
        except ImportError:
            pass
        else:
            try:
                return read_pyslurm(job_id)
            except SlurmError as e:
                log.debug("pyslurm failed (%s); trying sacct", e)
    return read_sacct(job_id, near_wall_s=near_wall_s, wait_s=wait_s)


# -- the run dir copy ---------------------------------------------------------------


#: the most bytes of a stored accounting copy read (a job's is a few kB): a run dir is untrusted
MAX_STORED_BYTES = 16 << 20


def store(run_dir: str | Path, acct: Accounting) -> Path | None:
    """Write ``slurm-accounting.json`` into the run dir (atomic); None when it cannot be.

    Only into a run dir of the analyzing user's own (analyzing someone else's run dir
    writes nothing into it), through a temporary file created exclusively and never
    through a link (a planted ``.slurm-accounting.json.PID.tmp -> ~/.bashrc`` would
    otherwise be overwritten)."""
    path = Path(run_dir) / ACCOUNTING_FILE
    doc = {"schema": ACCOUNTING_SCHEMA, "job": acct.to_json()}
    tmp = path.with_name(f".{ACCOUNTING_FILE}.{os.getpid()}.tmp")
    try:
        if os.stat(run_dir).st_uid != os.geteuid():
            log.info("distdiag: %s is another user's run dir: the Slurm accounting is not stored in it", run_dir)
            return None
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as e:
        log.info("distdiag: cannot store Slurm accounting in %s: %s", run_dir, e)
        return None
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(json.dumps(doc, indent=1) + "\n")
        os.replace(tmp, path)
    except OSError as e:
        log.info("distdiag: cannot store Slurm accounting in %s: %s", run_dir, e)
        try:
            tmp.unlink()  # ours: created exclusively above
        except OSError:
            pass
        return None
    return path


def _read_own_file(path: Path, limit: int) -> bytes:
    """A regular file of the run dir's own, never through a link, a FIFO or a device, at most
    ``limit`` bytes (ValueError beyond)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("not a regular file")
        if st.st_size > limit:
            raise ValueError(f"{st.st_size} bytes, over the {limit} a stored copy may have")
        data = fh.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"over the {limit} bytes a stored copy may have")
    return data


def load_stored(run_dir: str | Path) -> Accounting | None:
    """The stored copy, or None when there is none (or it is unreadable, a link, or too big)."""
    path = Path(run_dir) / ACCOUNTING_FILE
    try:
        doc = json.loads(_read_own_file(path, MAX_STORED_BYTES))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError) as e:
        log.info("distdiag: ignoring unreadable %s: %s", path, e)
        return None
    if not isinstance(doc, dict) or doc.get("schema") != ACCOUNTING_SCHEMA or not isinstance(doc.get("job"), dict):
        return None
    try:
        return Accounting.from_json(doc["job"])
    except (TypeError, ValueError, KeyError, AttributeError):
        return None


# -- the view the analyzer uses ------------------------------------------------------


@dataclass
class SlurmView:
    """What the analysis knows about the job's life in Slurm."""

    #: None when there is no accounting; ``why`` says why
    acct: Accounting | None
    #: one line: where the record came from, or why there is none
    why: str
    #: "live" (read now), "stored" (the run dir's copy), or "" (none)
    origin: str = ""
    #: (instant, seconds since submission) in time order; see timeline()
    timeline: list[dict[str, Any]] = field(default_factory=list)
    #: per rank: wall seconds (epoch) of shim start, first useful work, first collective, last event
    rank_start_s: dict[int, float] = field(default_factory=dict)
    rank_first_work_s: dict[int, float] = field(default_factory=dict)
    rank_first_collective_s: dict[int, float] = field(default_factory=dict)
    #: last own activity before the first rendezvous (see rank_busy_until)
    rank_busy_until_s: dict[int, float] = field(default_factory=dict)
    rank_last_event_s: dict[int, float] = field(default_factory=dict)

    @property
    def end_s(self) -> float | None:
        """The job's end; for a running job, the last thing any rank did.

        sacct truncates to whole seconds, so a rank's last event (ns) may lie
        up to a second past the recorded end: the later of the two is the end.
        """
        last = max(self.rank_last_event_s.values()) if self.rank_last_event_s else None
        if self.acct is not None and self.acct.end_s:
            return max(float(self.acct.end_s), last or 0.0)
        return last

    @property
    def turnaround_s(self) -> float | None:
        """Submission to end: the wall-clock the user waited for the job."""
        if self.acct is None or not self.acct.submit_s or self.end_s is None:
            return None
        return max(0.0, self.end_s - self.acct.submit_s)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"available": self.acct is not None, "why": self.why}
        if self.acct is not None:
            out.update(origin=self.origin, job=self.acct.to_json(), turnaround_s=self.turnaround_s,
                       timeline=self.timeline, per_rank=self.per_rank())  # fmt: skip
        return out

    def per_rank(self) -> list[dict[str, Any]]:
        """Each rank's shim start, first useful work, first collective and last event, in seconds since submission."""
        t0 = self.acct.submit_s if self.acct is not None else None
        if t0 is None:
            return []

        def rel(d: dict[int, float], r: int) -> float | None:
            return round(d[r] - t0, 3) if r in d else None

        ranks = sorted(set(self.rank_start_s) | set(self.rank_first_work_s) | set(self.rank_last_event_s))  # per rank
        return [{"rank": r, "shim_start_s": rel(self.rank_start_s, r), "first_work_s": rel(self.rank_first_work_s, r),
                 "first_collective_s": rel(self.rank_first_collective_s, r),
                 "busy_until_s": rel(self.rank_busy_until_s, r),
                 "last_event_s": rel(self.rank_last_event_s, r)} for r in ranks]  # fmt: skip


def slurm_job_id(run: Run) -> str | None:
    """The Slurm job id the ranks ran in, from their recorded environment."""
    ids = {i.env.get("SLURM_JOB_ID") for i in run.ranks.values() if i.env.get("SLURM_JOB_ID")}
    if not ids:
        return None
    # Heterogeneous or mixed dirs: the one most ranks name.
    counts = {j: sum(1 for i in run.ranks.values() if i.env.get("SLURM_JOB_ID") == j) for j in ids}
    return str(max(counts, key=lambda j: counts[j]))


def _wall_map_ns(run: Run) -> int | None:
    """Add this to a timestamp of the run's (aligned) timeline to get Unix ns.

    Each rank recorded time.time_ns() and its event clock at one instant; on
    the aligned timeline that rank's clock is shifted by offset_ns[rank]. The
    reference rank (offset 0) gives the mapping; its wall clock is the one the
    mapping trusts (NTP-level agreement with slurmctld's, far below sacct's 1 s).
    """
    off = getattr(run, "offset_ns", None)
    for r in sorted(run.ranks):  # the first rank with both stamps: rank 0 normally
        i = run.ranks[r]
        if i.wall_ns_at_start is None or i.mono_ns_at_start is None:
            continue
        shift = int(off[r]) if off is not None and r < len(off) else 0
        return int(i.wall_ns_at_start) - (int(i.mono_ns_at_start) + shift)
    return None


def _table(kinds: frozenset[int] | set[int]) -> np.ndarray:
    """A 256-entry bool lookup: ``_table(k)[kind]`` says whether a uint8 kind is one of ``kinds``."""
    t = np.zeros(256, bool)
    t[sorted(int(k) for k in kinds)] = True
    return t


@dataclass
class RankFirsts:
    """Per rank (index = rank, :func:`distdiag.bands.n_ranks` entries), the t0_ns of its first
    row of each kind set (``_NONE`` when it has none), on the run's aligned timeline."""

    useful_ns: np.ndarray  # USEFUL_KINDS
    coll_ns: np.ndarray  # COMM_KINDS
    rendezvous_ns: np.ndarray  # RENDEZVOUS_KINDS
    #: the rank's first rendezvous row (at rendezvous_ns; the earliest such row in (rank, t0) order)
    #: waits for nobody: a phase or a step marker, no collective, p2p call or communicator creation
    lone: np.ndarray


_NONE = np.iinfo(np.int64).max
_USEFUL_TABLE = _table(USEFUL_KINDS)
_COMM_TABLE = _table(COMM_KINDS)
_SYNC_TABLE = _table(_SYNC_KINDS)


def _rank_firsts(run: Run) -> RankFirsts:
    """The first useful, collective and rendezvous instants of every rank, in one pass over
    :func:`distdiag.bands.bands` (cached on the run).

    The useful kinds include the compute phases, which a large run streams
    (absent from ``run.events``): so each band's rows of RENDEZVOUS_KINDS (a
    superset of the others) are read once, and per rank the three minima are
    reductions over its segment of them (``np.minimum.reduceat``; a rank's
    segment is found by a search of the band's per-rank row bounds, no rank
    column is gathered). Nothing depends on where the bands fall: each rank's
    rows are all in one band, and every number is the rank's own."""
    got: RankFirsts | None = run.cache.rank_firsts  # a sweep's (distdiag.passes.analysis_passes), or this one's
    if got is not None:
        return got
    got = rank_firsts_part(run, None)
    run.cache.rank_firsts = got
    return got


def needs_rank_firsts(run: Run) -> bool:
    """Whether the Slurm view reads the per-rank firsts (:func:`rank_milestones`,
    :func:`rank_busy_until`): a Slurm job, or stored accounting, and a wall-clock map.
    ``--parallel`` computes them on every analysis rank's bands beforehand when so."""
    if _wall_map_ns(run) is None:
        return False
    return slurm_job_id(run) is not None or load_stored(Path(run.path)) is not None


class FirstsPass(Pass[RankFirsts, RankFirsts, RankFirsts]):
    """:func:`_rank_firsts` as a per-rank pass (:mod:`distdiag.passes`): a block's part holds
    every rank's entry, those outside its bands ``_NONE`` / False, so the minima and the or
    over the parts of blocks that cover every rank once are each rank's own."""

    def begin(self, run: Run, part: tuple[int, int] | None) -> RankFirsts:
        n = n_ranks(run)
        return RankFirsts(np.full(n, _NONE, np.int64), np.full(n, _NONE, np.int64), np.full(n, _NONE, np.int64),
                          np.zeros(n, bool))  # fmt: skip

    def add(self, acc: RankFirsts, band: Band) -> None:
        """Each of the band's ranks' minima: O(1) numpy calls over the band's rows."""
        rows = band.rows(RENDEZVOUS_KINDS)
        if len(rows) == 0:
            return
        seg = np.searchsorted(rows, band.first)  # rank r_lo + i: rows[seg[i]:seg[i + 1]]
        cnt = np.diff(seg)
        have = np.flatnonzero(cnt)  # the band's ranks with such rows (offsets from r_lo)
        at = seg[:-1][have]  # the start of each one's segment: consecutive, none empty
        t0 = band.events["t0_ns"][rows]
        kind = band.events["kind"][rows]
        r = have + band.r_lo
        acc.rendezvous_ns[r] = np.minimum.reduceat(t0, at)
        acc.useful_ns[r] = np.minimum.reduceat(np.where(_USEFUL_TABLE[kind], t0, _NONE), at)
        acc.coll_ns[r] = np.minimum.reduceat(np.where(_COMM_TABLE[kind], t0, _NONE), at)
        # each rank's first row at its minimum (rows ascend, so the earliest in table order)
        hits = np.flatnonzero(t0 == np.repeat(acc.rendezvous_ns[r], cnt[have]))
        head = hits[np.searchsorted(hits, at)]  # every segment holds its minimum: a hit in it
        acc.lone[r] = ~_SYNC_TABLE[kind[head]]

    def part(self, acc: RankFirsts) -> RankFirsts:
        return acc

    def reduce(self, run: Run, parts: list[RankFirsts]) -> RankFirsts:
        if len(parts) == 1:
            return parts[0]
        return RankFirsts(
            np.minimum.reduce([p.useful_ns for p in parts]),
            np.minimum.reduce([p.coll_ns for p in parts]),
            np.minimum.reduce([p.rendezvous_ns for p in parts]),
            np.logical_or.reduce([p.lone for p in parts]),
        )


def rank_firsts_part(run: Run, part: tuple[int, int] | None) -> RankFirsts:
    """:class:`FirstsPass` over the bands of ``part`` (all when None), not cached."""
    got: RankFirsts = sweep(run, [FirstsPass()], part)[0]
    return got


def _as_wall_s(first_ns: np.ndarray, wall_map_ns: int) -> dict[int, float]:
    """rank -> Unix seconds of each rank's instant in ``first_ns`` (``_NONE``: left out), ascending ranks."""
    ranks = np.flatnonzero(first_ns != _NONE)
    return {int(r): (int(t) + wall_map_ns) / 1e9 for r, t in zip(ranks, first_ns[ranks])}


def rank_milestones(run: Run) -> tuple[dict[int, float], dict[int, float], dict[int, float], dict[int, float]]:
    """Per rank, in Unix seconds: shim start, first useful work, first collective, last event.

    First useful work is the start of the rank's first collective,
    point-to-point call, compute phase or step: before it the rank only
    imported, initialized and waited for its peers.
    """
    wm = _wall_map_ns(run)
    if wm is None:
        return {}, {}, {}, {}
    start = {int(r): (i.start_ns + wm) / 1e9 for r, i in run.ranks.items()}
    last = {int(r): (i.end_ns + wm) / 1e9 for r, i in run.ranks.items()}
    firsts = _rank_firsts(run)
    first = _as_wall_s(firsts.useful_ns, wm)
    first_coll = _as_wall_s(firsts.coll_ns, wm)
    return start, first, first_coll, last


def rank_busy_until(run: Run) -> dict[int, float]:
    """Per rank, Unix seconds when it last did something of its own before
    its first rendezvous (communicator creation or first useful work).

    MPI_Init and init_process_group block every rank until the last one
    arrives, so all ranks reach their first useful work together and the
    late one does not stand out there. What stands out is how long each was
    busy (importing, reading, computing) before it went into the rendezvous:
    the rank busy the longest is the one the others waited for. Worked
    example: rank 0 imports until +0.5 s and then sits in MPI_Init; rank 1
    imports from a slow file system until +6.2 s; both create COMM_WORLD at
    +6.8 s: rank 1 is named. Needs the recorded file events (the fileio hook);
    a rank without them falls back to its first rendezvous.

    The rendezvous starts at the ``t0_ns`` of the rank's first rendezvous row.
    For an mpi4py job that is COMM_WORLD's COMM_CREATE row, which the hook
    records as the span of ``import mpi4py.MPI`` (MPI_Init): its start is
    when the rank stopped working on its own and began to wait, so anything a
    rank records while blocked in MPI_Init (a loader thread's file reads)
    does not make it look busy.

    A rank whose first such row waits for nobody (a phase or a ``distdiag.step``
    marker: a job with no collective before it) was on its own until that row:
    it is busy until then. Worked example: rank 1 sleeps 6 s, then marks its
    first step; rank 0 marks its first at +0.4 s: rank 1 is named, not
    whichever rank's imports ran longer.
    """
    wm = _wall_map_ns(run)
    if wm is None:
        return {}
    firsts = _rank_firsts(run)  # one pass over the bands, shared with rank_milestones
    first = firsts.rendezvous_ns
    has = first != _NONE
    if not has.any():
        return {}
    n = len(first)
    # Rows before the rank's first rendezvous: only kinds outside RENDEZVOUS_KINDS can be
    # (_BEFORE_KINDS: all resident in run.events). Their rank and time columns, not the rows.
    ev = run.events
    idx = rows_of(run, _BEFORE_KINDS)  # the run's kind index (distdiag.rows): ascending rows
    p_rank = ev["rank"][idx].astype(np.int64)
    p_t0 = ev["t0_ns"][idx]
    before = p_t0 < first[p_rank]
    idx, p_rank, p_t0 = idx[before], p_rank[before], p_t0[before]
    until = np.full(n, np.iinfo(np.int64).min, np.int64)
    if len(idx):
        p_t1 = ev["t1_ns"][idx]
        t_end = np.where(p_t1 >= p_t0, p_t1, p_t0)
        np.maximum.at(until, p_rank, np.minimum(t_end, first[p_rank]))
    # No own activity before the rendezvous: the rank was ready at its shim start.
    starts = np.full(n, np.iinfo(np.int64).min, np.int64)
    for r, i in run.ranks.items():  # one per rank; n = n_ranks covers every file's rank
        starts[r] = i.start_ns
    busy = np.maximum(until, starts)
    # A first row that waits for nobody (a phase, a step marker) is no
    # rendezvous: the rank worked on its own right up to it.
    busy[firsts.lone] = first[firsts.lone]  # lone only where the rank has a rendezvous row
    return {int(r): (int(busy[r]) + wm) / 1e9 for r in np.flatnonzero(has)}


def timeline(acct: Accounting, start: dict[int, float], first: dict[int, float], last: dict[int, float],
             end_s: float | None, first_coll: dict[int, float] | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """The job's instants in order, as seconds since submission."""
    t_sub = acct.submit_s
    rows: list[tuple[str, float | None, list[int]]] = [
        ("submit", acct.submit_s, []),
        ("eligible", acct.eligible_s, []),
        ("start", acct.start_s, []),
    ]
    for s in acct.steps:  # a handful
        if s.get("start_s"):
            rows.append((f"step {s.get('step', '')} {s.get('name', '')} start".replace("  ", " "), s["start_s"], []))
    for label, d in (("first rank shim start", start), ("last rank shim start", start),
                     ("first rank first work", first), ("last rank first work", first),
                     ("first rank first collective", first_coll or {}),
                     ("last rank first collective", first_coll or {})):  # fmt: skip
        if d:
            pick = min if label.startswith("first") else max
            r = pick(d, key=lambda k: d[k])
            rows.append((label, d[r], [r]))
    if last:
        r = max(last, key=lambda k: last[k])
        rows.append(("last event", last[r], [r]))
    rows.append(("end" if acct.end_s else "end (still running: last event)", end_s, []))
    if t_sub is None:
        return []
    # Stable sort by time: equal instants keep the order above (submit first).
    timed = sorted(((float(t) - t_sub, label, ranks) for label, t, ranks in rows if t is not None),
                   key=lambda x: x[0])  # fmt: skip
    return [{"what": label, "t_s": round(dt, 3), "ranks": ranks} for dt, label, ranks in timed]


def accounting_of(run: Run, backend: str = "auto", live: bool | None = None) -> SlurmView:
    """The run's Slurm view, computed once per (aligned) run and cached on it.

    ``live=False`` never calls sacct/pyslurm (only the stored copy);
    the default reads live unless ``DISTDIAG_SLURM_OFFLINE=1``.
    """
    got: SlurmView | None = run.cache.slurm
    if got is not None:
        return got
    view = _compute_view(run, backend, live)
    run.cache.slurm = view
    return view


def _compute_view(run: Run, backend: str, live: bool | None) -> SlurmView:
    if live is None:
        live = os.environ.get("DISTDIAG_SLURM_OFFLINE", "") not in ("1", "true", "yes")
    job = slurm_job_id(run)
    run_dir = Path(run.path)
    stored = load_stored(run_dir)
    if stored is not None and job is not None and stored.job_id != job:
        log.info("distdiag: %s is for job %s, the ranks ran in job %s; ignored", ACCOUNTING_FILE, stored.job_id, job)
        stored = None
    if job is None and stored is None:
        return SlurmView(None, "no Slurm accounting: the job did not run under Slurm (no SLURM_JOB_ID in the ranks' "
                               "environment), so queue wait and launch overhead are unknown")  # fmt: skip
    job = job or (stored.job_id if stored else None)
    start, first, first_coll, last = rank_milestones(run)
    near = min(start.values()) if start else None

    acct: Accounting | None = None
    origin = ""
    why = ""
    if stored is not None and stored.final:
        acct, origin, why = stored, "stored", f"Slurm job {job}: accounting from {ACCOUNTING_FILE} (read by {stored.backend})"
    elif live:
        try:
            # Poll past slurmdbd's placeholder row only for a job that just ended.
            recent = bool(last) and time.time() - max(last.values()) < 60
            acct = read_accounting(str(job), near_wall_s=near, backend=backend, wait_s=8.0 if recent else 0.0)
            origin = "live"
            saved = store(run_dir, acct)
            why = f"Slurm job {job}: accounting read with {acct.backend}" + (
                f", saved to {ACCOUNTING_FILE}" if saved else " (run dir read-only: not saved)")
        except SlurmError as e:
            if stored is not None:
                acct, origin = stored, "stored"
                why = f"Slurm job {job}: accounting from {ACCOUNTING_FILE}, read while the job ran ({e} now)"
            else:
                why = f"no Slurm accounting for job {job}: {e}, and the run dir holds no {ACCOUNTING_FILE}"
    elif stored is not None:
        acct, origin = stored, "stored"
        why = f"Slurm job {job}: accounting from {ACCOUNTING_FILE}, read while the job ran"
    else:
        why = f"no Slurm accounting for job {job}: offline, and the run dir holds no {ACCOUNTING_FILE}"
    view = SlurmView(acct, why, origin, rank_start_s=start, rank_first_work_s=first, rank_last_event_s=last,
                     rank_first_collective_s=first_coll, rank_busy_until_s=rank_busy_until(run))  # fmt: skip
    if acct is not None:
        view.timeline = timeline(acct, start, first, last, view.end_s, first_coll)
    return view
