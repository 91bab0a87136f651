"""Clock-sync samples: min-RTT ping-pongs of every rank against rank 0, over UDP.

Why a UDP side channel and not the job's own communicator: it works the same
for MPI, torch-only and plain multi-process jobs, needs no collective call the
program did not make (a rank can sync while others compute), and never puts a
message into the program's communicators. Rank 0 (the reference) answers
pings from a daemon thread; the others find it through ``clock-ref.json`` in
the run dir, written atomically by rank 0, mode 0600::

    {"addrs": ["10.1.2.3", "127.0.0.1"], "ports": [40123, 40124], "port": 40123,
     "key": "<64 hex digits>", "launch_id": "...", "world_size": 4, "host": "n1", "pid": 4242}

Where rank 0 answers (:func:`bind_addrs`): never the wildcard 0.0.0.0, but
where the job's own traffic reaches rank 0: ``cfg.sync_addr`` when set;
127.0.0.1 when the launcher says every rank runs on rank 0's host
(``LOCAL_WORLD_SIZE``, ``MPI_LOCALNRANKS``, ``OMPI_COMM_WORLD_LOCAL_SIZE``
equal to the world size, or a one-node Slurm step); ``MASTER_ADDR`` when it
is one of this host's addresses; else each IPv4 address of the host, each on
a socket of its own, 127.0.0.1 last. ``addrs[i]`` answers on ``ports[i]``. A
client sends one ping to each at once (from a socket connected to that
address) and keeps the first that answers (ranks may sit on other nodes or
in other network namespaces).

Every packet carries an HMAC-SHA256 (truncated to 16 bytes) under ``key``, a
random 256-bit secret of this run that only the job's user can read (the
file is 0600 in a run dir of that user's; clients read it only from a regular
file of their own user that nobody else can write), over its direction, the
rank, a per-client random nonce and a sequence number: a packet that does
not verify is dropped and counted (``ClockSync.dropped``), as is a ping
whose sequence number is not above the last one of its client (a replay). It
replaces a 32-bit token in a world-readable file, with which anyone on the
network could skew the alignment.

One exchange: the client stamps ``t_send`` (its clock), sends; the reference
stamps ``t_ref`` (its clock) the moment the ping arrives and replies; the
client stamps ``t_recv``. The analyzer (``distdiag.clocks``) takes
``offset = t_ref - (t_send + t_recv)/2`` and trusts it to +-RTT/2, so each
round does ``cfg.sync_exchanges`` exchanges and every one is recorded: the
analyzer keeps the one with the smallest RTT per window. Rounds run at start
(``SyncTag.START``, from the daemon thread as soon as rank 0's file appears;
``cfg.sync_start_wait_s`` > 0 makes ``start()`` wait for it and take the round
in the program's thread, which gives cleaner samples but delays the program's
start: MPI_Init holds rank 0's GIL while it waits for the other ranks, so a
rank that syncs before its own MPI_Init can be held up ~0.1-0.3 s, and that
shows as a late rank at the first collective),
every ``cfg.sync_interval_s`` from a daemon thread (``PERIODIC``), and at
exit (``EXIT``, from :meth:`ClockSync.stop`). The reference lingers in
``stop()`` up to ``cfg.exit_sync_wait_s`` until every other rank said it
finished its exit round, so the last samples exist even when rank 0 ends first.

The shim's threads keep the job's scheduling priority (a guest never raises
its priority above the job's; they used to renice themselves to -10 as root).

The GIL: a sample taken while the program's main thread holds the GIL waits
for it (up to ``sys.getswitchinterval()``, 5 ms) on either side, which only
ever makes the RTT larger; min-RTT selection drops those samples, and a round
whose best RTT is far above the best seen so far takes a few more exchanges
(bounded in count and time).

Timestamps use the recorder's clock (``distdiag.shim.recorder.now_ns``), so
samples and events share one clock per rank. Nothing here raises into the
program: every failure is logged at debug level and the rank simply has fewer
samples (the analyzer says so).
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import secrets
import select
import socket
import struct
import threading
import time
from pathlib import Path
from typing import Any, Callable

from distdiag.schema import SyncTag
from distdiag.shim.ownfd import Ident, ident, let_go, still_ours
from distdiag.shim.recorder import now_ns

log = logging.getLogger(__name__)

#: The file through which rank 0 tells the others where to ping.
REF_FILE = "clock-ref.json"
#: The reference rank: every offset is measured against it.
REF_RANK = 0

_MAGIC = b"DDC2"
#: client -> reference: magic, rank, seq, op, client nonce; then the MAC
_PING = struct.Struct("<4siIB8s")
#: reference -> client: magic, rank, seq, t_ref_ns, client nonce; then the MAC
_PONG = struct.Struct("<4siIq8s")
_OP_PING = 0
_OP_BYE = 1
#: bytes of HMAC-SHA256 each packet carries (128 bits: forging one takes 2^128 tries)
MAC_BYTES = 16
#: bytes of the per-run key
KEY_BYTES = 32
#: what the MAC covers before the packet: its direction (a ping is never taken for a reply)
_DIR_PING = b"ping"
_DIR_PONG = b"pong"
_PING_SIZE = _PING.size + MAC_BYTES
_PONG_SIZE = _PONG.size + MAC_BYTES


class _Mac:
    """HMAC-SHA256 under one key, truncated to MAC_BYTES; the keyed state is made once and
    copied per packet (1.3 us a packet against 1.9 us for ``hmac.digest``, measured)."""

    def __init__(self, key: bytes) -> None:
        self._h = hmac.new(key, digestmod="sha256")

    def tag(self, direction: bytes, body: bytes) -> bytes:
        h = self._h.copy()
        h.update(direction)
        h.update(body)
        return h.digest()[:MAC_BYTES]

    def seal(self, direction: bytes, body: bytes) -> bytes:
        return body + self.tag(direction, body)

    def open(self, direction: bytes, data: bytes, st: struct.Struct) -> tuple[Any, ...] | None:
        """The fields of ``data`` when its size, magic and MAC are right; else None."""
        if len(data) != st.size + MAC_BYTES:
            return None
        body = data[: st.size]
        if not hmac.compare_digest(data[st.size :], self.tag(direction, body)):
            return None
        fields = st.unpack(body)
        return fields if fields[0] == _MAGIC else None


def seal_ping(key: bytes, rank: int, seq: int, op: int, nonce: bytes) -> bytes:
    """A ping as a client sends it (tests send forged ones with a wrong key)."""
    return _Mac(key).seal(_DIR_PING, _PING.pack(_MAGIC, rank, seq & 0xFFFFFFFF, op, nonce))


def seal_pong(key: bytes, rank: int, seq: int, t_ref_ns: int, nonce: bytes) -> bytes:
    """A reply as the reference sends it."""
    return _Mac(key).seal(_DIR_PONG, _PONG.pack(_MAGIC, rank, seq & 0xFFFFFFFF, t_ref_ns, nonce))

#: wait for one reply before calling the exchange lost (loopback RTT is ~20 us,
#: a busy reference whose thread waits for the GIL adds ~5 ms; longer is a GIL held
#: in a C call, such as MPI_Init: better to retry later than to wait)
EXCHANGE_TIMEOUT_S = 0.05
#: a round gives up after this many lost exchanges in a row (reference gone)
MAX_LOST_IN_ROW = 2
#: a round with a poor best RTT may take up to this many times sync_exchanges ...
EXTRA_FACTOR = 3
#: ... within this wall-clock budget
ROUND_BUDGET_S = 0.1
#: "poor": the round's best RTT is above this multiple of the best RTT seen so far
POOR_RTT_FACTOR = 4.0
#: after the synchronous wait at start, the background thread keeps looking
#: for rank 0's file this long
BACKGROUND_WAIT_S = 300.0
#: how long discovery waits for the first answer from any of rank 0's addresses
DISCOVER_TIMEOUT_S = 0.3
#: a round whose best RTT is above this (or that lost half its exchanges) was taken
#: while a GIL was held for long (MPI_Init holds rank 0's while it waits for the other
#: ranks): the thread takes another round soon, RETRY_FIRST_S later, doubling, at most
#: RETRY_MAX times, instead of waiting a whole sync interval
RETRY_RTT_NS = 1_000_000
RETRY_FIRST_S = 0.2
RETRY_MAX = 6
#: a round stops after this many exchanges slower than RETRY_RTT_NS (see _round)
POOR_STOP = 3
#: waits for a stop are sleeps of at most this long (see _wait_for)
POLL_S = 0.05


def _ipv4_addrs() -> list[str]:
    """Every non-loopback IPv4 address of this host, then 127.0.0.1 (stdlib only)."""
    out: list[str] = []
    try:
        import fcntl

        siocgifaddr = 0x8915  # Linux ioctl: the IPv4 address of one interface
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for _idx, name in socket.if_nameindex():  # a handful of interfaces
                try:
                    req = struct.pack("256s", name.encode()[:15])
                    res = fcntl.ioctl(s.fileno(), siocgifaddr, req)
                    out.append(socket.inet_ntoa(res[20:24]))
                except OSError:
                    continue  # no IPv4 address on this interface
    except Exception:
        log.debug("distdiag: interface addresses not listed", exc_info=True)
    if not out:
        try:
            out = [str(ai[4][0]) for ai in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)]
        except OSError:
            pass
    seen: list[str] = []
    for a in out:
        if not a.startswith("127.") and a not in seen:
            seen.append(a)
    return seen + ["127.0.0.1"]


def _local_world_size(env: Any) -> int | None:
    """How many ranks the launcher started on this host, when it says so."""
    for name in ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"):
        try:
            return int(env[name])
        except (KeyError, ValueError):
            continue
    return None


def _one_node_slurm(env: Any) -> bool:
    for name in ("SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES"):
        v = env.get(name)
        if v is not None:
            return v.strip() == "1"
    return False


def _resolve_v4(name: str) -> str | None:
    try:
        socket.inet_aton(name)
        return name if name.count(".") == 3 else None
    except OSError:
        pass
    try:  # the name the launcher gave (usually /etc/hosts or the resolver's cache, as torch reads it)
        return str(socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_DGRAM)[0][4][0])
    except (OSError, IndexError, UnicodeError):
        return None


def bind_addrs(world_size: int, cfg_addr: str = "", environ: Any = None) -> list[str]:
    """The IPv4 addresses rank 0 answers clock pings on: where the job's ranks reach it.

    ``cfg_addr`` (``ShimConfig.sync_addr``) when given; 127.0.0.1 when every
    rank runs on this host (the launcher's local size equals the world size,
    or a one-node Slurm step); ``MASTER_ADDR`` (torchrun, most Slurm+torch
    scripts: where rank 0's rendezvous listens) when it is one of this
    host's addresses (a loopback one only when all ranks are local: other
    nodes could not reach it); else every IPv4 address of the host (each its
    own socket), 127.0.0.1 last. Never 0.0.0.0."""
    env = os.environ if environ is None else environ
    if cfg_addr:
        return [str(cfg_addr)]
    local = _local_world_size(env)
    if (local is not None and local >= world_size) or _one_node_slurm(env):
        return ["127.0.0.1"]
    host_addrs = _ipv4_addrs()
    master = env.get("MASTER_ADDR")
    if master:
        ip = _resolve_v4(master)
        if ip is not None and not ip.startswith("127.") and ip in host_addrs:
            return [ip]
    return host_addrs


def _wait_for(ev: threading.Event, timeout_s: float) -> bool:
    """``ev.wait(timeout_s)`` made of short sleeps.

    Why not ``Event.wait``: a timed wait on a lock turns the timeout into an
    absolute CLOCK_MONOTONIC deadline in user space; under libfaketime (our
    tests, and users who fake time) that clock is shifted by decades, so the
    wait never ends. ``time.sleep`` and socket timeouts stay relative and work.
    """
    end = time.monotonic() + timeout_s
    while not ev.is_set():
        left = end - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(left, POLL_S))
    return True


def _acquire(lock: threading.Lock, timeout_s: float) -> bool:
    """``lock.acquire(timeout=timeout_s)`` without a timed lock wait (see :func:`_wait_for`)."""
    end = time.monotonic() + timeout_s
    while not lock.acquire(blocking=False):
        if time.monotonic() >= end:
            return False
        time.sleep(0.005)
    return True


def _cfg(cfg: Any, name: str, default: Any) -> Any:
    v = getattr(cfg, name, default)
    return default if v is None else v


class ClockSync:
    """Clock exchanges of one rank against rank 0 (see the module docstring).

    ``sink`` receives lists of SYNC_DTYPE rows as tuples, in ``schema.SYNC_SPEC``'s order
    (the wrapper passes ``writer.add_sync``).
    ``start()`` and ``stop()`` never raise; ``stop()`` is idempotent.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        run_dir: str | os.PathLike[str],
        cfg: Any,
        sink: Callable[[list[tuple[int, int, int, int, int]]], None],
        launch_id: str | None = None,
    ) -> None:
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.run_dir = Path(run_dir)
        self.sink = sink
        self.interval_s = float(_cfg(cfg, "sync_interval_s", 60.0))
        self.n_exchanges = int(_cfg(cfg, "sync_exchanges", 10))
        self.exit_wait_s = float(_cfg(cfg, "exit_sync_wait_s", 2.0))
        self.start_wait_s = float(_cfg(cfg, "sync_start_wait_s", 0.0))
        self.sync_addr = str(_cfg(cfg, "sync_addr", ""))
        if launch_id is None:
            try:
                from distdiag.shim import session

                launch_id = session.SESSION.launch_id if session.SESSION is not None else ""
            except Exception:
                launch_id = ""
        self.launch_id = launch_id or ""
        self.is_ref = self.rank == REF_RANK
        # sync_exchanges = 0 switches clock sync off (the analyzer then aligns from collective exits)
        self.active = self.world_size > 1 and self.rank >= 0 and self.n_exchanges > 0
        self._stop = threading.Event()
        self._stopped = False
        self._lock = threading.Lock()  # one round at a time (thread vs. stop())
        self._sock: socket.socket | None = None
        #: each socket's (device, inode) when made: checked before each use (distdiag.shim.ownfd)
        self._sock_id: Ident | None = None
        self._thread: threading.Thread | None = None
        self._mac: _Mac | None = None
        #: packets that did not verify (wrong key, size or magic; replayed pings): dropped
        self.dropped = 0
        # reference side
        self._socks: list[socket.socket] = []  # one per address it answers on
        self._socks_id: dict[int, Ident] = {}  # id(socket) -> (device, inode)
        #: (rank, client nonce) -> the last sequence number answered: a replayed ping is dropped
        self._last_seq: dict[tuple[int, bytes], int] = {}
        self._bye: set[int] = set()
        self._heard: set[int] = set()
        self._all_bye = threading.Event()
        # client side
        self._connected = False
        self._seq = 0
        self._nonce = secrets.token_bytes(8)  # this client's: replies to another's never match
        self.best_rtt_ns: int | None = None
        self._poor = True  # the last round was poor (or none was taken yet)
        #: rounds done per tag, and exchanges sent: for tests and the benchmark
        self.rounds: dict[int, int] = {int(t): 0 for t in SyncTag}
        self.exchanges = 0
        self.lost = 0

    # -- public -------------------------------------------------------------------
    def start(self) -> None:
        """Reference: publish and start answering. Others: the start round, then the periodic thread."""
        if not self.active:
            return
        try:
            if self.is_ref:
                self._start_ref()
            else:
                self._start_client()
        except Exception:
            log.debug("distdiag: clock sync start failed", exc_info=True)

    def stop(self) -> None:
        """Exit round (clients) or the bounded wait for the others' exit rounds (reference)."""
        if not self.active or self._stopped:
            return
        self._stopped = True
        self._stop.set()
        try:
            if self.is_ref:
                self._stop_ref()
            else:
                self._stop_client()
        except Exception:
            log.debug("distdiag: clock sync stop failed", exc_info=True)
        finally:
            self._close()

    # -- reference ------------------------------------------------------------------
    def _start_ref(self) -> None:
        from distdiag.shim.rankfile import write_private_file

        addrs: list[str] = []
        ports: list[int] = []
        try:
            for a in bind_addrs(self.world_size, self.sync_addr):
                sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                try:
                    sock.bind((a, 0))
                except OSError:
                    sock.close()
                    log.debug("distdiag: clock reference cannot listen on %s", a, exc_info=True)
                    continue
                sock.setblocking(False)
                self._socks.append(sock)
                self._socks_id[id(sock)] = ident(sock.fileno())
                addrs.append(a)
                ports.append(int(sock.getsockname()[1]))
        except BaseException:
            self._close()
            raise
        if not self._socks:
            log.debug("distdiag: clock reference has no address to listen on")
            return
        key = secrets.token_bytes(KEY_BYTES)
        self._mac = _Mac(key)
        log.debug("distdiag: clock reference listens on %s", list(zip(addrs, ports)))
        doc = {
            "addrs": addrs,
            "ports": ports,
            "port": ports[0],
            "key": key.hex(),
            "launch_id": self.launch_id,
            "world_size": self.world_size,
            "host": socket.gethostname(),
            "pid": os.getpid(),
        }
        self._thread = threading.Thread(target=self._serve, name="distdiag-clock-ref", daemon=True)
        self._thread.start()
        # Publish only once the sockets answer; atomically (a reader never sees half a
        # file), 0600, never through a link (see writer.write_private_file).
        write_private_file(self.run_dir / REF_FILE, json.dumps(doc).encode())

    def _serve(self) -> None:
        socks = list(self._socks)
        mac = self._mac
        if not socks or mac is None:
            return
        pack = _PONG.pack
        # What sealing a reply costs (~1 us; the least seen): it falls between the
        # stamp and the send, so the stamp is moved by it (see below)
        seal_ns = 1 << 62
        for _ in range(5):
            t0 = now_ns()
            mac.seal(_DIR_PONG, pack(_MAGIC, 0, 0, t0, b"\0" * 8))
            seal_ns = min(seal_ns, now_ns() - t0)
        while not self._stop.is_set() or not self._all_bye.is_set():
            socks = self._own_socks(socks)
            if not socks:
                return  # the program closed them (and may have opened its own on their numbers)
            try:
                ready, _, _ = select.select(socks, [], [], 0.5)  # checks for stop twice a second
            except (OSError, ValueError):
                return  # sockets closed by stop()
            if not ready:
                if self._closed_sock():
                    return
                continue
            for sock in ready:
                if not still_ours(sock, self._socks_id.get(id(sock))):
                    continue  # forgotten at the next turn: never read what is now the program's
                try:
                    data, addr = sock.recvfrom(128)
                    t_in = now_ns()  # first thing after the ping arrived: the reply leg starts here
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    if self._closed_sock():
                        return
                    continue
                try:
                    got = mac.open(_DIR_PING, data, _PING)
                    if got is None:
                        self.dropped += 1
                        continue
                    _magic, rank, seq, op, nonce = got
                    last = self._last_seq.get((rank, nonce))
                    if last is not None and seq <= last:
                        self.dropped += 1  # a replay (or a copy the network doubled)
                        continue
                    self._last_seq[(rank, nonce)] = seq
                    if op == _OP_PING:
                        # The midpoint of the time spent here, from the arrival to the
                        # send (the check above, the seal below: ~1 us each), so that
                        # offset = t_ref - (t_send + t_recv)/2 stays the NTP estimate;
                        # without it the MAC time would skew every offset by ~0.6 us.
                        t_out = now_ns()
                        t_ref = (t_in + t_out + seal_ns) // 2
                        msg = mac.seal(_DIR_PONG, pack(_MAGIC, rank, seq, t_ref, nonce))
                        seal_ns = min(seal_ns, now_ns() - t_out)
                        sock.sendto(msg, addr)
                        self._heard.add(rank)
                    elif op == _OP_BYE:
                        self._bye.add(rank)
                        if len(self._bye) >= self.world_size - 1:
                            self._all_bye.set()
                except (struct.error, OSError):
                    continue

    def _own_socks(self, socks: list[socket.socket]) -> list[socket.socket]:
        """``socks`` less those whose descriptor is no longer ours (forgotten, never closed)."""
        keep = [s for s in socks if still_ours(s, self._socks_id.get(id(s)))]
        if len(keep) < len(socks):
            for s in socks:
                if s not in keep:
                    let_go(s, self._socks_id.get(id(s)))
            log.debug("distdiag: clock reference: %d socket(s) closed by the program", len(socks) - len(keep))
        return keep

    def _closed_sock(self) -> bool:
        return not self._socks or any(s.fileno() < 0 for s in self._socks)

    def _stop_ref(self) -> None:
        # Linger (bounded) so ranks that finish after us still get their exit samples.
        _wait_for(self._all_bye, self.exit_wait_s)
        if not self._all_bye.is_set():
            missing = sorted(set(range(1, self.world_size)) - self._bye)
            log.debug("distdiag: clock reference stops without exit rounds of ranks %s", missing[:20])
        self._all_bye.set()  # lets the serving loop end

    # -- client -------------------------------------------------------------------------
    def _start_client(self) -> None:
        deadline = time.monotonic() + self.start_wait_s
        while self.start_wait_s > 0:
            if self._discover():
                self._round(SyncTag.START)
                break
            if time.monotonic() >= deadline or self._stop.is_set():
                break
            time.sleep(0.01)
        self._thread = threading.Thread(target=self._loop, name="distdiag-clock", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        try:
            if not self._connected:
                # Rank 0 was late: keep looking in the background, then take the start round here.
                deadline = time.monotonic() + BACKGROUND_WAIT_S
                while not self._connected and time.monotonic() < deadline:
                    if _wait_for(self._stop, 0.1):
                        return
                    with self._lock:
                        if self._stop.is_set():
                            return
                        if self._discover():
                            self._round(SyncTag.START)
                if not self._connected:
                    log.debug("distdiag: rank %d never found the clock reference", self.rank)
                    return
            retry_s = RETRY_FIRST_S
            for _ in range(RETRY_MAX):  # bounded: a few quick rounds while the last one was poor
                if not self._poor or retry_s >= self.interval_s:
                    break
                if _wait_for(self._stop, retry_s):
                    return
                with self._lock:
                    if self._stop.is_set():
                        return
                    self._round(SyncTag.PERIODIC)
                retry_s *= 2
            # Spread ranks over the interval so they do not all ping rank 0 at once.
            phase = (self.rank % 16) / 16.0 * min(self.interval_s, 1.0) * 0.5
            wait_s = self.interval_s + phase
            while not _wait_for(self._stop, wait_s):
                with self._lock:
                    if self._stop.is_set():
                        return
                    self._round(SyncTag.PERIODIC)
                wait_s = self.interval_s
        except Exception:
            log.debug("distdiag: clock sync thread ended", exc_info=True)

    def _stop_client(self) -> None:
        if not _acquire(self._lock, 1.0):
            return  # a periodic round is stuck (cannot happen with bounded rounds): skip the exit round
        try:
            if not self._connected:
                self._discover()  # rank 0 may have appeared since; one quick try
            if self._connected:
                self._round(SyncTag.EXIT)
                self._bye_msg()
        finally:
            self._lock.release()

    def _read_ref(self) -> dict[str, Any] | None:
        from distdiag.shim.rankfile import read_own_file

        # only a regular file of this user that nobody else can write: another user's
        # would name their own reference and key
        raw = read_own_file(self.run_dir / REF_FILE)
        if raw is None:
            return None
        try:
            doc = json.loads(raw)
        except ValueError:
            return None
        if not isinstance(doc, dict) or "addrs" not in doc or not isinstance(doc.get("key"), str):
            return None  # not a reference of this version (or none yet)
        # No launch-id check: under MPICH's Hydra the launch id rests on the parent pid,
        # which differs per node (and per rank under a wrapper such as faketime). A file
        # left by an earlier launch names ports that no longer answer under its key,
        # so discovery fails and we read the file again until rank 0 replaces it.
        return doc

    def _discover(self) -> bool:
        """Find rank 0: one ping to each of its addresses, keep the first that answers."""
        if self._connected:
            return True
        doc = self._read_ref()
        if doc is None:
            return False
        socks: dict[socket.socket, tuple[str, int]] = {}
        ids: dict[socket.socket, Ident] = {}
        try:
            key = bytes.fromhex(str(doc["key"]))
            addrs = [str(a) for a in doc["addrs"]]
            ports = [int(x) for x in doc.get("ports", [doc.get("port", 0)] * len(addrs))]
            mac = _Mac(key)
            self._seq = (self._seq + 1) & 0xFFFFFFFF
            seq = self._seq
            ping = mac.seal(_DIR_PING, _PING.pack(_MAGIC, self.rank, seq, _OP_PING, self._nonce))
            # A socket connected to each address: bound to the one local address that
            # reaches it, and the kernel delivers only that peer's packets to it.
            for a, port in zip(addrs, ports):  # a handful of addresses
                sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                try:
                    ids[sock] = ident(sock.fileno())
                    sock.connect((a, port))
                    sock.send(ping)
                except OSError:
                    sock.close()
                    continue  # unreachable from here
                socks[sock] = (a, port)
            deadline = time.monotonic() + DISCOVER_TIMEOUT_S
            while socks:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                ready, _, _ = select.select(list(socks), [], [], left)
                if not ready:
                    return False
                for sock in ready:
                    try:
                        data = sock.recv(128)
                    except OSError:
                        # e.g. ICMP port unreachable from one address: wait for the others
                        socks.pop(sock, None)
                        sock.close()
                        continue
                    got = mac.open(_DIR_PONG, data, _PONG)
                    if got is None:
                        self.dropped += 1
                        continue
                    _m, r, rseq, _t, nonce = got
                    if r != self.rank or rseq != seq or nonce != self._nonce:
                        continue  # a late reply to an earlier discovery
                    peer = socks.pop(sock)
                    self._sock, self._mac = sock, mac
                    self._sock_id = ids[sock]
                    self._connected = True
                    log.debug("distdiag: rank %d syncs clocks with rank 0 at %s from %s",
                              self.rank, peer, sock.getsockname())  # fmt: skip
                    return True
            return False
        except Exception:
            log.debug("distdiag: clock reference not reachable", exc_info=True)
            return False
        finally:
            for sock in socks:
                try:
                    sock.close()
                except OSError:
                    pass

    def _exchange(self) -> tuple[int, int, int] | None:
        """One ping-pong: (t_send, t_ref, t_recv), or None when lost."""
        sock, mac = self._own_sock(), self._mac
        if sock is None or mac is None:
            return None
        self._seq = (self._seq + 1) & 0xFFFFFFFF
        seq = self._seq
        ping = mac.seal(_DIR_PING, _PING.pack(_MAGIC, self.rank, seq, _OP_PING, self._nonce))
        sock.settimeout(EXCHANGE_TIMEOUT_S)
        deadline = time.monotonic() + EXCHANGE_TIMEOUT_S
        t_send = now_ns()
        try:
            sock.send(ping)
        except OSError:
            return None
        while True:
            try:
                data = sock.recv(128)
                t_recv = now_ns()
            except (socket.timeout, OSError):
                return None
            got = mac.open(_DIR_PONG, data, _PONG)
            if got is None:
                self.dropped += 1  # forged, or not the reference's: never a sample
            else:
                _m, r, rseq, t_ref, nonce = got
                if r == self.rank and rseq == seq and nonce == self._nonce:
                    return t_send, int(t_ref), t_recv
            # a late reply to an earlier, timed-out ping: skip it
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            sock.settimeout(left)

    def _round(self, tag: SyncTag) -> None:
        """``sync_exchanges`` exchanges (a few more when all were slow); rows go to the sink."""
        rows: list[tuple[int, int, int]] = []
        lost_in_row = 0
        poor = 0
        n_max = self.n_exchanges * EXTRA_FACTOR
        t_end = time.monotonic() + ROUND_BUDGET_S
        best: int | None = None
        i = 0
        while i < n_max:  # bounded: at most EXTRA_FACTOR * sync_exchanges exchanges
            if i >= self.n_exchanges:
                # Enough exchanges; go on only while the best is poor and time is left.
                # (the first round has no history to compare with: it stops at n unless it is poor)
                good = (
                    best is not None
                    and best <= RETRY_RTT_NS
                    and (self.best_rtt_ns is None or best <= POOR_RTT_FACTOR * self.best_rtt_ns)
                )
                if good or best is None or time.monotonic() >= t_end:
                    break
            i += 1
            self.exchanges += 1
            got = self._exchange()
            if got is None:
                self.lost += 1
                lost_in_row += 1
                if lost_in_row >= MAX_LOST_IN_ROW:
                    break
                continue
            lost_in_row = 0
            rows.append(got)
            rtt = got[2] - got[0]
            if best is None or rtt < best:
                best = rtt
            if rtt > RETRY_RTT_NS:
                # A GIL was busy on one side. Each further exchange would make the
                # program's main thread hand its GIL over (and, on a loaded node, wait
                # for a CPU to get it back): stop early and let a later round retry.
                poor += 1
                if poor >= POOR_STOP:
                    break
        if best is not None and (self.best_rtt_ns is None or best < self.best_rtt_ns):
            self.best_rtt_ns = best
        self.rounds[int(tag)] += 1
        self._poor = best is None or best > RETRY_RTT_NS or 2 * len(rows) < min(i, self.n_exchanges)
        log.debug("distdiag: rank %d clock round %s: %d samples, %d lost, best RTT %s ns",
                  self.rank, tag.name, len(rows), i - len(rows), best)  # fmt: skip
        if not rows:
            return
        # tuples in schema.SYNC_SPEC's order, not a numpy array: no numpy in the guest
        out = [(int(r[0]), int(r[1]), int(r[2]), REF_RANK, int(tag)) for r in rows]
        try:
            self.sink(out)
        except Exception:
            log.debug("distdiag: clock samples not stored", exc_info=True)

    def _own_sock(self) -> socket.socket | None:
        """The client's socket while its descriptor is still ours; else None (forgotten, not closed)."""
        sock = self._sock
        if sock is not None and not still_ours(sock, self._sock_id):
            let_go(sock, self._sock_id)
            self._sock = None
            log.debug("distdiag: rank %d: the clock socket was closed by the program; sync stops", self.rank)
            return None
        return sock

    def _bye_msg(self) -> None:
        sock, mac = self._own_sock(), self._mac
        if sock is None or mac is None:
            return
        for _ in range(2):  # UDP: a second copy in case one is dropped (its own sequence number)
            self._seq = (self._seq + 1) & 0xFFFFFFFF
            msg = mac.seal(_DIR_PING, _PING.pack(_MAGIC, self.rank, self._seq, _OP_BYE, self._nonce))
            try:
                sock.send(msg)
            except OSError:
                return

    def _close(self) -> None:
        s, self._sock = self._sock, None
        socks, self._socks = self._socks, []
        let_go(s, self._sock_id)
        for x in socks:
            let_go(x, self._socks_id.get(id(x)))
        if self.dropped:
            log.debug("distdiag: rank %d dropped %d clock packets that did not verify", self.rank, self.dropped)
