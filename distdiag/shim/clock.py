"""Clock-sync samples: min-RTT ping-pongs of every rank against rank 0, over UDP.

Why a UDP side channel and not the job's own communicator: it works the same
for MPI, torch-only and plain multi-process jobs, needs no collective call the
program did not make (a rank can sync while others compute), and never puts a
message into the program's communicators. Rank 0 (the reference) answers
pings from a daemon thread; the others find it through ``clock-ref.json`` in
the run dir, written atomically by rank 0::

    {"port": 40123, "addrs": ["10.1.2.3", "127.0.0.1"], "token": 123456789,
     "launch_id": "...", "world_size": 4, "host": "n1", "pid": 4242}

``addrs`` are every non-loopback IPv4 address of rank 0's host, then
127.0.0.1 last. A client sends one ping to each at once and keeps the first
that answers (ranks may sit on other nodes or in other network namespaces).

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

import json
import logging
import os
import secrets
import socket
import struct
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from distdiag.schema import SYNC_DTYPE, SyncTag
from distdiag.shim.recorder import now_ns

log = logging.getLogger(__name__)

#: The file through which rank 0 tells the others where to ping.
REF_FILE = "clock-ref.json"
#: The reference rank: every offset is measured against it.
REF_RANK = 0

_MAGIC = b"DDCK"
#: client -> reference: magic, token, rank, seq, op
_PING = struct.Struct("<4sIiIB")
#: reference -> client: magic, token, rank, seq, t_ref_ns
_PONG = struct.Struct("<4sIiIq")
_OP_PING = 0
_OP_BYE = 1

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


def _boost_thread() -> None:
    """Raise the calling thread's scheduling priority where allowed (root / CAP_SYS_NICE).

    Why: on a node whose cores are all busy (ranks busy-polling in MPI) a thread
    that wakes up for a ping waits for a time slice, milliseconds, and every
    sample of that phase is poor. These threads sleep nearly all the time, so
    the boost costs the program nothing. Without the privilege nothing changes.
    """
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), -10)
    except (OSError, AttributeError):
        pass


def _cfg(cfg: Any, name: str, default: Any) -> Any:
    v = getattr(cfg, name, default)
    return default if v is None else v


class ClockSync:
    """Clock exchanges of one rank against rank 0 (see the module docstring).

    ``sink`` receives SYNC_DTYPE rows (the wrapper passes ``writer.add_sync``).
    ``start()`` and ``stop()`` never raise; ``stop()`` is idempotent.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        run_dir: str | os.PathLike[str],
        cfg: Any,
        sink: Callable[[np.ndarray], None],
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
        self._thread: threading.Thread | None = None
        # reference side
        self._token = 0
        self._bye: set[int] = set()
        self._heard: set[int] = set()
        self._all_bye = threading.Event()
        # client side
        self._connected = False
        self._seq = 0
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
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind(("0.0.0.0", 0))
        sock.settimeout(0.5)  # the serving thread checks for stop twice a second
        self._sock = sock
        self._token = secrets.randbits(32)
        port = sock.getsockname()[1]
        doc = {
            "port": port,
            "addrs": _ipv4_addrs(),
            "token": self._token,
            "launch_id": self.launch_id,
            "world_size": self.world_size,
            "host": socket.gethostname(),
            "pid": os.getpid(),
        }
        self._thread = threading.Thread(target=self._serve, name="distdiag-clock-ref", daemon=True)
        self._thread.start()
        # Publish only once the socket answers, atomically: a reader never sees half a file.
        tmp = self.run_dir / f".{REF_FILE}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, self.run_dir / REF_FILE)

    def _serve(self) -> None:
        sock = self._sock
        if sock is None:
            return
        _boost_thread()
        pong = _PONG.pack
        unpack = _PING.unpack_from
        token = self._token
        while not self._stop.is_set() or not self._all_bye.is_set():
            try:
                data, addr = sock.recvfrom(64)
                t_ref = now_ns()  # first thing after the ping arrived: the reply leg starts here
            except socket.timeout:
                if self._closed_sock():
                    return
                continue
            except OSError:
                return  # socket closed by stop()
            try:
                magic, tok, rank, seq, op = unpack(data)
                if magic != _MAGIC or tok != token:
                    continue
                if op == _OP_PING:
                    sock.sendto(pong(_MAGIC, token, rank, seq, t_ref), addr)
                    self._heard.add(rank)
                elif op == _OP_BYE:
                    self._bye.add(rank)
                    if len(self._bye) >= self.world_size - 1:
                        self._all_bye.set()
            except (struct.error, OSError):
                continue

    def _closed_sock(self) -> bool:
        s = self._sock
        return s is None or s.fileno() < 0

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
        _boost_thread()
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
        try:
            doc = json.loads((self.run_dir / REF_FILE).read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(doc, dict) or "port" not in doc:
            return None
        # No launch-id check: under MPICH's Hydra the launch id rests on the parent pid,
        # which differs per node (and per rank under a wrapper such as faketime). A file
        # left by an earlier launch names a port that no longer answers with its token,
        # so discovery fails and we read the file again until rank 0 replaces it.
        return doc

    def _discover(self) -> bool:
        """Find rank 0: one ping to each of its addresses, keep the first that answers."""
        if self._connected:
            return True
        doc = self._read_ref()
        if doc is None:
            return False
        try:
            port = int(doc["port"])
            token = int(doc.get("token", 0)) & 0xFFFFFFFF
            addrs = [str(a) for a in doc.get("addrs", ["127.0.0.1"])]
            if self._sock is None:
                self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            sock = self._sock
            self._token = token
            self._seq += 1
            ping = _PING.pack(_MAGIC, token, self.rank, self._seq, _OP_PING)
            for a in addrs:  # a handful of addresses
                try:
                    sock.sendto(ping, (a, port))
                except OSError:
                    continue  # unreachable from here
            deadline = time.monotonic() + DISCOVER_TIMEOUT_S
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                sock.settimeout(left)
                try:
                    data, src = sock.recvfrom(64)
                except socket.timeout:
                    return False
                except OSError:
                    continue  # e.g. ICMP port unreachable from one address: wait for the others
                if len(data) == _PONG.size:
                    magic, tok, _r, seq, _t = _PONG.unpack(data)
                    if magic == _MAGIC and tok == token and seq == self._seq:
                        sock.connect(src)
                        self._connected = True
                        log.debug("distdiag: rank %d syncs clocks with rank 0 at %s", self.rank, src)
                        return True
        except Exception:
            log.debug("distdiag: clock reference not reachable", exc_info=True)
            return False

    def _exchange(self) -> tuple[int, int, int] | None:
        """One ping-pong: (t_send, t_ref, t_recv), or None when lost."""
        sock = self._sock
        if sock is None:
            return None
        self._seq = (self._seq + 1) & 0xFFFFFFFF
        seq = self._seq
        ping = _PING.pack(_MAGIC, self._token, self.rank, seq, _OP_PING)
        sock.settimeout(EXCHANGE_TIMEOUT_S)
        deadline = time.monotonic() + EXCHANGE_TIMEOUT_S
        t_send = now_ns()
        try:
            sock.send(ping)
        except OSError:
            return None
        while True:
            try:
                data = sock.recv(64)
                t_recv = now_ns()
            except (socket.timeout, OSError):
                return None
            if len(data) == _PONG.size:
                magic, tok, _r, rseq, t_ref = _PONG.unpack(data)
                if magic == _MAGIC and tok == self._token and rseq == seq:
                    return t_send, t_ref, t_recv
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
        out = np.zeros(len(rows), SYNC_DTYPE)
        arr = np.array(rows, dtype=np.int64)
        out["t_send_ns"] = arr[:, 0]
        out["t_ref_ns"] = arr[:, 1]
        out["t_recv_ns"] = arr[:, 2]
        out["ref_rank"] = REF_RANK
        out["tag"] = int(tag)
        try:
            self.sink(out)
        except Exception:
            log.debug("distdiag: clock samples not stored", exc_info=True)

    def _bye_msg(self) -> None:
        sock = self._sock
        if sock is None:
            return
        msg = _PING.pack(_MAGIC, self._token, self.rank, 0, _OP_BYE)
        for _ in range(2):  # UDP: a second copy in case one is dropped
            try:
                sock.send(msg)
            except OSError:
                return

    def _close(self) -> None:
        s, self._sock = self._sock, None
        if s is not None:
            try:
                s.close()
            except OSError:
                pass
