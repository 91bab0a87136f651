"""Real rank files for analyzer tests, written through the shim's own writer.

:func:`make_run` simulates a bulk-synchronous job (compute, then one
all-reduce per iteration on "world") on a true timeline, then writes what each
rank's shim would have recorded: its own monotonic clock (a per-rank offset
from the true time), clock-sync samples against rank 0, and the events. The
files go through :func:`distdiag.shim.writer.write_rank_file`, so they have
exactly the layout the shim writes.

The simulation knows the truth (who arrived last, how long the others waited,
how much compute each rank did), and returns it in :class:`Truth` for the
tests to check the analyzer against.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from distdiag.replay import EAGER_BYTES
from distdiag.schema import EVENT_DTYPE, SYNC_DTYPE, Kind, SyncTag, rank_file_name
from distdiag.shim.writer import write_rank_file

MS = 1_000_000  # ns


@dataclass
class Truth:
    """What really happened in a simulated run (true timeline = rank 0's clock)."""

    run_dir: Path
    world_size: int
    iters: int
    #: per iteration: the last arriver and (last - second-to-last arrival) in ns
    last_rank: np.ndarray
    wait_ns: np.ndarray
    #: per rank: offset added to its clock (true = local + offset_ns)
    offset_ns: np.ndarray
    #: per rank: total ns waiting in the all-reduce before the last arrived
    comm_wait_ns: np.ndarray
    #: per rank: total ns in the all-reduce after the last arrived
    comm_transfer_ns: np.ndarray
    #: per rank: compute ns (time outside any recorded call)
    compute_ns: np.ndarray
    io_ns: np.ndarray
    wall_ns: int
    files: dict[int, Path] = field(default_factory=dict)

    arrive_ns: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.int64))
    #: per iteration: wait_ns less what the last arriver inherited from leaving
    #: the previous all-reduce later than the second-to-last (the straggler's charge)
    own_wait_ns: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    hosts: list[str] = field(default_factory=list)

    def straggler_cost_s(self, rank: int) -> float:
        # iteration 0 is every rank's first collective: launch skew, which the
        # straggler detector leaves to launch_overhead
        return float(self.own_wait_ns[1:][self.last_rank[1:] == rank].sum()) / 1e9

    def host_cost_s(self, host: str) -> float:
        """Sum over iterations where ``host`` held the last arriver of (last - last arrival elsewhere)."""
        on = np.array([h == host for h in self.hosts])
        a = self.arrive_ns
        last_on = on[a.argmax(axis=1)]
        gap = a[:, on].max(axis=1) - a[:, ~on].max(axis=1)
        return float(gap[1:][last_on[1:]].sum()) / 1e9  # iteration 0: launch skew, not charged


def make_run(
    run_dir: Path,
    *,
    world_size: int = 4,
    iters: int = 100,
    compute_ms: float = 5.0,
    jitter_ms: float = 0.2,
    transfer_ms: float = 0.3,
    slow_rank: int | Sequence[int] | None = None,
    slow_ms: float = 0.0,
    slow_every: int = 1,
    rotate_ms: float = 0.0,
    spread_ms: float = 0.0,
    io_ms: float = 0.0,
    seed: int = 0,
    hosts: Sequence[str] | None = None,
    clock_offsets_ms: Sequence[float] | None = None,
    sync: bool = True,
    skip_ranks: Sequence[int] = (),
    killed_ranks: Sequence[int] = (),
    job_id: str = "4242",
    comm: str = "world",
    op: str = "Allreduce",
    shuffle_strings: bool = False,
    nbytes: int = 8192,
) -> Truth:
    """Simulate and write one run; see the module docstring.

    ``slow_rank`` (one rank or several) computes ``slow_ms`` longer every
    ``slow_every``-th iteration. ``rotate_ms``: rank ``i % world_size`` computes that much
    longer in iteration ``i`` (a load imbalance that moves); ``spread_ms``: every rank
    computes that much longer in every iteration (``rotate_ms / world_size``: the same work
    balanced). Both leave the random draws as they are: a run and its twin share their jitter.
    ``io_ms`` adds a FILE_READ of that length at the start of every iteration on
    every rank. ``killed_ranks`` stop recording half-way through, with the
    all-reduce they were inside of left in flight and no clean close.
    ``shuffle_strings`` gives every rank its own order of string ids (as real
    ranks have: ids follow the order each rank first met a string). ``nbytes``: what each
    all-reduce moves.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    n = world_size
    hosts = list(hosts) if hosts is not None else [f"node{r // 2}" for r in range(n)]
    if clock_offsets_ms is None:
        # Different nodes boot at different times: offsets of seconds are normal.
        offsets = np.concatenate([[0], rng.integers(-5_000, 5_000, n - 1) * MS]).astype(np.int64)
    else:
        offsets = (np.asarray(clock_offsets_ms, dtype=np.float64) * MS).astype(np.int64)
    t_true0 = 10_000 * MS

    # --- the simulation, on the true timeline, vectorized over ranks ---------
    comp = compute_ms * MS + rng.uniform(-jitter_ms, jitter_ms, (iters, n)) * MS
    if slow_rank is not None:
        comp[::slow_every, np.atleast_1d(slow_rank)] += slow_ms * MS
    comp[np.arange(iters), np.arange(iters) % n] += rotate_ms * MS
    comp += spread_ms * MS
    comp = comp.astype(np.int64)
    io = np.full((iters, n), int(io_ms * MS), np.int64)
    start = np.zeros((iters, n), np.int64)
    arrive = np.zeros((iters, n), np.int64)
    exit_ = np.zeros((iters, n), np.int64)
    t = np.full(n, t_true0 + 2 * MS, np.int64)
    xfer = int(transfer_ms * MS)
    for i in range(iters):  # the iteration is the simulation's time step
        start[i] = t
        arrive[i] = t + io[i] + comp[i]
        last = arrive[i].max()
        exit_[i] = last + xfer + rng.integers(0, 20_000, n)  # ranks see completion a few µs apart
        t = exit_[i]
    t_end = int(exit_[-1].max()) + 2 * MS

    srt = np.sort(arrive, axis=1)
    last_rank = np.argmax(arrive, axis=1)
    wait_ns = srt[:, -1] - srt[:, -2]
    second_rank = np.argsort(arrive, axis=1, kind="stable")[:, -2]
    it = np.arange(1, iters)
    inherited = np.zeros(iters, np.int64)
    inherited[1:] = np.maximum(exit_[it - 1, last_rank[1:]] - exit_[it - 1, second_rank[1:]], 0)
    own_wait = np.clip(wait_ns - inherited, 0, wait_ns)
    last_t = arrive.max(axis=1, keepdims=True)
    comm_wait = (last_t - arrive).sum(axis=0)
    comm_xfer = (exit_ - last_t).sum(axis=0)

    strings = ["", op, comm, "train.py:42", "/data/shard-000.bin", "target_start"]
    sid = {s: i for i, s in enumerate(strings)}
    files: dict[int, Path] = {}
    for r in range(n):  # one file per rank
        if r in skip_ranks:
            continue
        killed = r in killed_ranks
        n_it = iters // 2 if killed else iters
        rows: list[np.ndarray] = []
        coll = np.zeros(n_it, EVENT_DTYPE)
        coll["t0_ns"] = arrive[:n_it, r]
        coll["t1_ns"] = exit_[:n_it, r]
        coll["kind"] = Kind.COLL
        coll["name_id"] = sid[op]
        coll["comm_id"] = sid[comm]
        coll["seq"] = np.arange(n_it)
        coll["peer"] = -1
        coll["nbytes"] = nbytes
        coll["site_id"] = sid["train.py:42"]
        rows.append(coll)
        if io_ms > 0:
            rd = np.zeros(n_it, EVENT_DTYPE)
            rd["t0_ns"] = start[:n_it, r]
            rd["t1_ns"] = start[:n_it, r] + io[:n_it, r]
            rd["kind"] = Kind.FILE_READ
            rd["name_id"] = sid["/data/shard-000.bin"]
            rd["seq"] = -1
            rd["peer"] = -1
            rd["nbytes"] = 1 << 20
            rows.append(rd)
        ev = np.concatenate(rows)
        ev = ev[np.argsort(ev["t0_ns"], kind="stable")]
        ev["t0_ns"] -= offsets[r]  # true -> this rank's clock
        ev["t1_ns"] -= offsets[r]
        attrs: dict[str, Any] = dict(
            rank=r,
            world_size=n,
            local_rank=r % 2,
            host=hosts[r],
            job_id=job_id,
            launch_id=f"launch-{job_id}",
            mono_ns_at_start=int(t_true0 - offsets[r]),
            wall_ns_at_start=int(1_700_000_000 * 10**9 + t_true0),
        )
        inflight = None
        if killed:
            inflight = np.zeros(1, EVENT_DTYPE)
            inflight[0] = (arrive[n_it, r] - offsets[r], -1, Kind.COLL, sid[op], sid[comm], n_it, -1, 8192, 0,
                           sid["train.py:42"], 0, 0.0)  # fmt: skip
            attrs.update(closed_cleanly=False, exit_code=None, end_mono_ns=None,
                         last_flush_mono_ns=int(arrive[n_it, r] - offsets[r] + MS))  # fmt: skip
        else:
            attrs.update(end_mono_ns=int(t_end - offsets[r]), last_flush_mono_ns=int(t_end - offsets[r]))
        sync_rows = None
        if sync and r != 0:
            # As the shim does: a round of exchanges at start and one at exit
            # (a killed rank has only the start round).
            k = 5
            rounds = [(t_true0, SyncTag.START)] + ([] if killed else [(t_end - MS, SyncTag.EXIT)])
            parts = []
            for t_round, tag in rounds:  # two rounds
                rtt = rng.integers(20_000, 200_000, k)  # 20-200 µs round trips
                t_send_true = t_round + np.arange(k) * 100_000
                s = np.zeros(k, SYNC_DTYPE)
                s["t_send_ns"] = t_send_true - offsets[r]
                s["t_recv_ns"] = t_send_true + rtt - offsets[r]
                s["t_ref_ns"] = t_send_true + rtt // 2  # rank 0's clock is the true clock
                s["ref_rank"] = 0
                s["tag"] = tag
                parts.append(s)
            sync_rows = np.concatenate(parts)
        path = run_dir / rank_file_name(r)
        rank_strings = strings
        if shuffle_strings:
            perm = np.concatenate([[0], 1 + rng.permutation(len(strings) - 1)])  # new id of old id i
            rank_strings = [""] * len(strings)
            for old, new in enumerate(perm):
                rank_strings[new] = strings[old]
            for arr in (ev, inflight):
                if arr is not None:
                    for col in ("name_id", "comm_id", "site_id"):
                        arr[col] = perm[arr[col]]
        write_rank_file(path, attrs, ev, rank_strings, sync=sync_rows, inflight=inflight)
        files[r] = path

    io_total = io.sum(axis=0)
    wall = t_end - t_true0
    compute = np.full(n, wall, np.int64) - comm_wait - comm_xfer - io_total
    return Truth(
        run_dir=run_dir,
        world_size=n,
        iters=iters,
        last_rank=last_rank,
        wait_ns=wait_ns,
        own_wait_ns=own_wait,
        offset_ns=offsets,
        comm_wait_ns=comm_wait,
        comm_transfer_ns=comm_xfer,
        compute_ns=compute,
        io_ns=io_total,
        wall_ns=wall,
        files=files,
        arrive_ns=arrive,
        hosts=hosts,
    )


def truncate_copy(src: Path, dst: Path, nbytes: int) -> Path:
    """``dst`` = the first ``nbytes`` bytes of ``src`` (a file cut off mid-write)."""
    dst.write_bytes(src.read_bytes()[:nbytes])
    return dst


def write_foreign_h5(path: Path) -> Path:
    """A valid HDF5 file that is not a distdiag rank file."""
    import h5py

    with h5py.File(path, "w") as f:
        f.create_dataset("temperature", data=np.arange(10.0))
        f.attrs["creator"] = "someone else"
    return path


def set_attr(path: Path, name: str, value: Any) -> None:
    """Change one root attribute of an existing rank file."""
    import h5py

    with h5py.File(path, "r+") as f:
        f.attrs[name] = value


def coll(
    t0_ms: float,
    t1_ms: float,
    seq: int,
    strings: list[str],
    op: str = "Allreduce",
    comm: str = "world",
    nbytes: int = 8,
    root: int = -1,
    kind: int = Kind.COLL,
) -> tuple[Any, ...]:
    """One collective row (a tuple for EVENT_DTYPE); adds its strings to ``strings``."""

    def sid(s: str) -> int:
        if s not in strings:
            strings.append(s)
        return strings.index(s)

    t1 = -1 if t1_ms < 0 else int(t1_ms * MS)
    return (int(t0_ms * MS), t1, int(kind), sid(op), sid(comm), seq, root, nbytes, 0, sid("job.py:7"), 0, 0.0)


def write_rank(
    run_dir: Path,
    rank: int,
    world_size: int,
    rows: list[tuple[Any, ...]],
    strings: list[str],
    inflight: list[tuple[Any, ...]] | None = None,
    host: str | None = None,
    **attrs: Any,
) -> Path:
    """A rank file holding exactly ``rows`` (all ranks share one true clock: no offsets)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    ev = np.array(rows, dtype=EVENT_DTYPE) if rows else np.zeros(0, EVENT_DTYPE)
    a: dict[str, Any] = dict(rank=rank, world_size=world_size, host=host or f"node{rank // 2}", job_id="77",
                             launch_id="launch-77", wall_ns_at_start=1_700_000_000 * 10**9, mono_ns_at_start=0)  # fmt: skip
    a.update(attrs)
    inf = np.array(inflight, dtype=EVENT_DTYPE) if inflight else None
    path = run_dir / rank_file_name(rank)
    write_rank_file(path, a, ev, list(strings), inflight=inf)
    return path


def reorder_strings_and_rows(path: Path) -> None:
    """Give a rank file another string order (ids follow the order a rank first met a
    string, so ranks' ids differ) and flush its rows out of time order (two halves swapped)."""
    import h5py

    from distdiag.schema import Kind

    with h5py.File(path, "r+") as f:
        strings = f["strings"][...]
        perm = np.r_[0, np.arange(len(strings) - 1, 0, -1)]  # id 0 stays ""
        inv = np.argsort(perm)
        ev = f["events"][...]
        for col in ("name_id", "comm_id", "site_id"):
            ev[col] = inv[ev[col]]
        aux_str = np.isin(ev["kind"], [int(Kind.COLL), int(Kind.COLL_ASYNC), int(Kind.WAIT), *range(20, 26)])
        ev["aux"][aux_str] = inv[ev["aux"][aux_str]]
        half = len(ev) // 2
        f["events"][...] = np.concatenate([ev[half:], ev[:half]])
        f["strings"][...] = strings[perm]


# -- point-to-point jobs (issue 20) --------------------------------------------------------------
def p2p_row(t0_ms: float, t1_ms: float, kind: int, peer: int, s: list[str], name: str = "Send",
            site: str = "halo.py:9", nbytes: int = 1024) -> tuple[Any, ...]:  # fmt: skip
    """One point-to-point row on the world communicator (``peer``: the world rank)."""
    for x in (name, "world", site):
        if x not in s:
            s.append(x)
    return (int(t0_ms * MS), int(t1_ms * MS), int(kind), s.index(name), s.index("world"), -1, peer, nbytes, 0,
            s.index(site), 0, 0.0)  # fmt: skip


XFER_MS = 0.1  # a message's transfer after the arrivals it waits for


def simulate_p2p(d: Path, n: int, compute: np.ndarray, pattern: str, big: bool, write: bool = True,
                 xfer_ms: float = XFER_MS) -> np.ndarray:  # fmt: skip
    """A job whose truth is computed here, one step at a time: every step each rank computes
    ``compute[step, rank]`` ms, then exchanges with its neighbours (``pattern``), then an
    all-reduce every other step. A receive ends ``xfer_ms`` after the later of its own and its
    sender's arrival; a small (eager) send returns ``xfer_ms`` after its own arrival, a big one
    (``big``: distdiag.replay.EAGER_BYTES) waits for its receiver too. Writes the rank files
    (``write``) and returns each rank's end (ms).

    Patterns: ``ring`` (one Sendrecv each: to the right, from the left), ``pairs`` (even ranks
    Send to the right then Recv from it, odd ranks Recv from the left then Send to it), ``isend``
    (an Isend to the right, completed at the step's end, then a Recv from the left), ``chain`` (a
    pipeline: rank 0 Sends to 1, each rank Recvs from the left, then Sends to the right),
    ``nonblocking`` (an Irecv from the left and an Isend to the right, completed in one Waitall),
    ``halo2`` (an Irecv from and an Isend to each neighbour, one Waitall; small messages only),
    ``oddeven`` (a ring without deadlock: even ranks Send right then Recv left, odd ranks Recv left
    then Send right; n even)."""
    s: list[str] = [""]
    rows: list[list[tuple[Any, ...]]] = [[] for _ in range(n)]
    nb = EAGER_BYTES if big else 1024
    t = np.zeros(n)
    for k in range(len(compute)):
        t = t + compute[k]
        a = t.copy()  # arrivals at the exchange
        if pattern == "ring":
            left = np.roll(a, 1)  # each one's source's arrival
            right = np.roll(a, -1)
            ex = np.maximum(a, left) + xfer_ms
            if big:
                ex = np.maximum(ex, right + xfer_ms)
            for r in range(n):
                rows[r].append(p2p_row(a[r], ex[r], Kind.SEND, (r + 1) % n, s, "Sendrecv", nbytes=nb))
                rows[r].append(p2p_row(a[r], ex[r], Kind.RECV, (r - 1) % n, s, "Sendrecv", nbytes=nb))
            t = ex
        elif pattern == "pairs":
            ex = a.copy()
            for r in range(0, n - 1, 2):
                q = r + 1
                s_end = (max(a[r], a[q]) if big else a[r]) + xfer_ms  # r's Send
                r_end = max(a[q], a[r]) + xfer_ms  # q's Recv
                rows[r].append(p2p_row(a[r], s_end, Kind.SEND, q, s, "Send", "halo.py:10", nb))
                rows[q].append(p2p_row(a[q], r_end, Kind.RECV, r, s, "Recv", "halo.py:11", nb))
                b_q = r_end  # q sends back right away, r receives
                b_s = (max(b_q, s_end) if big else b_q) + xfer_ms
                b_r = max(s_end, b_q) + xfer_ms
                rows[q].append(p2p_row(b_q, b_s, Kind.SEND, r, s, "Send", "halo.py:12", nb))
                rows[r].append(p2p_row(s_end, b_r, Kind.RECV, q, s, "Recv", "halo.py:13", nb))
                ex[r], ex[q] = b_r, b_s
            t = ex
        elif pattern == "oddeven":  # even ranks Send right then Recv left, odd ranks Recv left then Send right
            ex = a.copy()
            first_end = np.zeros(n)
            for e in range(0, n, 2):  # the first calls: e's Send to e + 1, e + 1's Recv from e
                q = (e + 1) % n
                first_end[e] = (max(a[e], a[q]) if big else a[e]) + xfer_ms
                first_end[q] = max(a[q], a[e]) + xfer_ms
                rows[e].append(p2p_row(a[e], first_end[e], Kind.SEND, q, s, "Send", "ring.py:30", nb))
                rows[q].append(p2p_row(a[q], first_end[q], Kind.RECV, e, s, "Recv", "ring.py:31", nb))
            for e in range(0, n, 2):  # then e's Recv from e - 1, which Sends once its own Recv returned
                q = (e - 1) % n
                r_end = max(first_end[e], first_end[q]) + xfer_ms
                s_end = (max(first_end[q], first_end[e]) if big else first_end[q]) + xfer_ms
                rows[e].append(p2p_row(first_end[e], r_end, Kind.RECV, q, s, "Recv", "ring.py:32", nb))
                rows[q].append(p2p_row(first_end[q], s_end, Kind.SEND, e, s, "Send", "ring.py:33", nb))
                ex[e], ex[q] = r_end, s_end
            t = ex
        elif pattern == "halo2":  # Irecv from both neighbours, Isend to both, one Waitall
            left, right = np.roll(a, 1), np.roll(a, -1)
            ex = np.maximum(a, np.maximum(left, right)) + xfer_ms  # the receives: after both senders posted
            for r in range(n):
                if "Waitall" not in s:
                    s.append("Waitall")
                for q, line in (((r - 1) % n, 30), ((r + 1) % n, 31)):
                    rows[r].append(p2p_row(a[r], ex[r], Kind.RECV_ASYNC, q, s, "Irecv", f"halo.py:{line}", nb))
                for q, line in (((r - 1) % n, 32), ((r + 1) % n, 33)):
                    posted = a[r] + 0.001 * line  # the two Isends a microsecond or so apart
                    rows[r].append(p2p_row(posted, ex[r], Kind.SEND_ASYNC, q, s, "Isend", f"halo.py:{line}", nb))
                rows[r].append((int(a[r] * MS + 0.04 * MS), int(ex[r] * MS), int(Kind.WAIT), s.index("Waitall"), 0, -1,
                                -1, 0, 0, 0, 0, 0.0))  # fmt: skip
            t = ex
        elif pattern == "nonblocking":  # Irecv from the left, Isend to the right, Waitall
            left, right = np.roll(a, 1), np.roll(a, -1)
            w0 = a  # posted and waited for at once (work between the posts and the wait is a segment)
            done_r = np.maximum(a, left) + xfer_ms  # the receive: after its sender posted
            done_s = (np.maximum(a, right) if big else a) + xfer_ms  # a large send: after its receiver posted
            ex = np.maximum(done_r, done_s)
            for r in range(n):
                if "Waitall" not in s:
                    s.append("Waitall")
                rows[r].append(p2p_row(a[r], ex[r], Kind.RECV_ASYNC, (r - 1) % n, s, "Irecv", "halo.py:20", nb))
                rows[r].append(p2p_row(a[r], ex[r], Kind.SEND_ASYNC, (r + 1) % n, s, "Isend", "halo.py:21", nb))
                rows[r].append((int(w0[r] * MS), int(ex[r] * MS), int(Kind.WAIT), s.index("Waitall"), 0, -1, -1, 0, 0,
                                0, 0, 0.0))  # fmt: skip
            t = ex
        elif pattern == "isend":
            left = np.roll(a, 1)
            r_end = np.maximum(a, left) + xfer_ms
            for r in range(n):
                rows[r].append(p2p_row(a[r], r_end[(r + 1) % n], Kind.SEND_ASYNC, (r + 1) % n, s, "Isend", nbytes=nb))
                rows[r].append(p2p_row(a[r], r_end[r], Kind.RECV, (r - 1) % n, s, "Recv", "halo.py:10", nb))
            t = r_end
        else:  # chain
            ex = a.copy()
            arrive_send = a.copy()
            for r in range(n):
                if r > 0:  # receive from the left, after its send
                    r_end = max(a[r], arrive_send[r - 1]) + xfer_ms
                    rows[r].append(p2p_row(a[r], r_end, Kind.RECV, r - 1, s, "Recv", "pipe.py:5", nb))
                    arrive_send[r] = r_end
                    ex[r] = r_end
                if r < n - 1:  # send to the right (eager)
                    s0 = arrive_send[r]
                    rows[r].append(p2p_row(s0, s0 + xfer_ms, Kind.SEND, r + 1, s, "Send", "pipe.py:6", nb))
                    arrive_send[r] = s0
                    ex[r] = s0 + xfer_ms
            t = ex
        if k % 2:
            t = t + 0.2
            out = float(t.max()) + 0.3
            for r in range(n):
                rows[r].append(coll(float(t[r]), out, k // 2, s))
            t = np.full(n, out)
    if write:
        for r in range(n):
            if "work" not in s:
                s.append("work")
            rows[r].append((int(t[r] * MS), int((t[r] + 0.5) * MS), int(Kind.PHASE), s.index("work"), 0, -1, -1, 0, 0,
                            0, 0, 0.0))  # fmt: skip
            write_rank(d, r, n, sorted(rows[r]), s)
    return t + 0.5


def hang_in_phases(d: Path, world: int = 10) -> None:
    """A job killed in Barrier #4 on world whose missing ranks' last rows are compute phases (the
    streamed kinds): every rank but 3 and 7 is inside the Barrier. Rank 3's last program rows are
    a FORWARD then a BACKWARD that ends last (a shim mark after them says nothing) and a file read
    before them; rank 7 is inside an open ``evaluate`` phase after a file read."""
    for r in range(world):
        s = [""]
        rows = []
        for i in range(4):  # healthy collectives, with compute phases between them
            rows.append(coll(10.0 * i + 3, 10.0 * i + 6, -1, s, op="fwd", kind=Kind.FORWARD))
            rows.append(coll(10.0 * i + 6.5, 10.0 * i + 8, -1, s, op="bwd", kind=Kind.BACKWARD))
            rows.append(coll(10.0 * i + 0.1 * r, 10.0 * i + 2, i, s))
        inf = None
        if r == 3:
            rows += [coll(45.0, 46.0, -1, s, op="/data/shard-3", kind=Kind.FILE_READ),
                     coll(47.0, 60.0, -1, s, op="fwd", kind=Kind.FORWARD),
                     coll(48.0, 70.0, -1, s, op="bwd", kind=Kind.BACKWARD),
                     coll(65.0, 65.0, -1, s, op="clock", kind=Kind.SHIM)]  # fmt: skip
        elif r == 7:
            rows.append(coll(44.0, 45.0, -1, s, op="/data/shard-7", kind=Kind.FILE_READ))
            inf = [coll(46.0, -1, -1, s, op="evaluate", kind=Kind.PHASE)]
        else:
            inf = [coll(50.0 + r, -1, 4, s, op="Barrier")]
        rows.sort(key=lambda row: row[0])
        write_rank(d, r, world, rows, s, inflight=inf, closed_cleanly=False, exit_code=None,
                   end_mono_ns=None, last_flush_mono_ns=int(2000 * MS))  # fmt: skip
