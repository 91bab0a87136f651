"""distdiag.shim.clock: real UDP exchanges on loopback, real processes where clocks differ."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from distdiag.schema import SYNC_DTYPE, SyncTag
from distdiag.shim.clock import REF_FILE, ClockSync
from distdiag.shim.config import ShimConfig

LIBFAKETIME = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1"


class Sink:
    def __init__(self) -> None:
        self.parts: list[np.ndarray] = []

    def __call__(self, rows: list[tuple[int, ...]]) -> None:
        self.parts.append(np.array(rows, SYNC_DTYPE))

    @property
    def rows(self) -> np.ndarray:
        return np.concatenate(self.parts) if self.parts else np.zeros(0, SYNC_DTYPE)


def cfg(**kw: float) -> ShimConfig:
    c = ShimConfig()
    for k, v in kw.items():
        setattr(c, k, v)
    return c


def wait_until(cond, timeout_s: float = 5.0) -> bool:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return False


def test_client_measures_the_offset_of_a_shifted_clock(tmp_path: Path) -> None:
    if not os.path.exists(LIBFAKETIME):
        pytest.fail("libfaketime not found: apt-get install faketime (listed in .ci/apt-packages.txt)")
    ref = ClockSync(0, 2, tmp_path, cfg(), Sink())
    ref.start()
    assert (tmp_path / REF_FILE).exists()
    doc = json.loads((tmp_path / REF_FILE).read_text())
    assert doc["addrs"][-1] == "127.0.0.1" and doc["port"] > 0
    code = (
        "import sys, time, numpy as np\n"
        "from distdiag.shim.clock import ClockSync\n"
        "from distdiag.shim.config import ShimConfig\n"
        "from distdiag.schema import SYNC_DTYPE\n"
        "rows = []\n"
        f"c = ClockSync(1, 2, {str(tmp_path)!r}, ShimConfig(), rows.extend)\n"
        "c.start(); time.sleep(0.5); c.stop()\n"
        f"np.save({str(tmp_path / 'rows.npy')!r}, np.array(rows, SYNC_DTYPE))\n"
    )
    env = dict(os.environ, LD_PRELOAD=LIBFAKETIME, FAKETIME="+0.3s")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    t = time.monotonic()
    ref.stop()  # the client said goodbye: no lingering
    assert time.monotonic() - t < 0.5
    rows = np.load(tmp_path / "rows.npy")
    assert set(rows["tag"].tolist()) >= {int(SyncTag.START), int(SyncTag.EXIT)}
    assert (rows["ref_rank"] == 0).all()
    rtt = rows["t_recv_ns"] - rows["t_send_ns"]
    best = int(np.argmin(rtt))
    offset_ns = int(rows["t_ref_ns"][best]) - (int(rows["t_send_ns"][best]) + int(rtt[best]) // 2)
    # faked clock = wall clock + 0.3 s; ours = CLOCK_MONOTONIC: compare through the wall clock
    expect_ns = (time.perf_counter_ns() - time.time_ns()) - int(0.3e9)
    assert abs(offset_ns - expect_ns) < 5_000_000  # the wall-vs-monotonic reading is good to ms
    assert rtt[best] < 2_000_000


def test_without_a_reference_start_and_stop_return_at_once(tmp_path: Path) -> None:
    sink = Sink()
    c = ClockSync(3, 4, tmp_path, cfg(), sink)
    t = time.monotonic()
    c.start()
    assert time.monotonic() - t < 0.1  # never holds the program up
    time.sleep(0.2)
    t = time.monotonic()
    c.stop()
    assert time.monotonic() - t < 1.0
    assert len(sink.rows) == 0


def test_a_stale_reference_file_is_skipped_until_rank_0_replaces_it(tmp_path: Path) -> None:
    dead = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    dead.bind(("127.0.0.1", 0))
    port = dead.getsockname()[1]
    dead.close()  # nobody answers there
    (tmp_path / REF_FILE).write_text(json.dumps({"port": port, "addrs": ["127.0.0.1"], "token": 1}))
    sink = Sink()
    client = ClockSync(1, 2, tmp_path, cfg(), sink)
    client.start()
    time.sleep(0.3)
    assert len(sink.rows) == 0
    ref = ClockSync(0, 2, tmp_path, cfg(), Sink())
    ref.start()
    try:
        assert wait_until(lambda: len(sink.rows) > 0, 5.0), "the client never found the new reference"
        assert sink.rows["tag"][0] == int(SyncTag.START)
    finally:
        client.stop()
        ref.stop()


def test_the_reference_lingers_for_exit_rounds_of_ranks_that_end_later(tmp_path: Path) -> None:
    import threading

    ref = ClockSync(0, 3, tmp_path, cfg(exit_sync_wait_s=3.0), Sink())
    ref.start()
    sinks = [Sink(), Sink()]
    clients = [ClockSync(r, 3, tmp_path, cfg(), sinks[r - 1]) for r in (1, 2)]
    for c in clients:
        c.start()
    assert wait_until(lambda: all(len(s.rows) for s in sinks))
    done = threading.Event()
    t0 = time.monotonic()
    threading.Thread(target=lambda: (ref.stop(), done.set()), daemon=True).start()  # rank 0 ends first
    time.sleep(0.3)
    assert not done.is_set()  # still answering
    for c in clients:
        c.stop()
    assert done.wait(2.0)
    assert 0.3 <= time.monotonic() - t0 < 2.5  # left once both said goodbye, before its 3 s limit
    for s in sinks:
        assert int(SyncTag.EXIT) in s.rows["tag"].tolist()


def test_periodic_rounds_follow_the_interval(tmp_path: Path) -> None:
    ref = ClockSync(0, 2, tmp_path, cfg(), Sink())
    ref.start()
    sink = Sink()
    c = ClockSync(1, 2, tmp_path, cfg(sync_interval_s=0.2, sync_exchanges=5), sink)
    c.start()
    time.sleep(1.2)
    c.stop()
    ref.stop()
    tags = sink.rows["tag"]
    assert c.rounds[int(SyncTag.START)] == 1 and c.rounds[int(SyncTag.EXIT)] == 1
    assert 3 <= c.rounds[int(SyncTag.PERIODIC)] <= 8, c.rounds
    assert (tags == int(SyncTag.PERIODIC)).sum() >= 3 * 5
    assert c.lost == 0


CLOSERANGE_PROGRAM = """
import os, socket, sys, time
from distdiag.shim.clock import ClockSync
from distdiag.shim.config import ShimConfig
cfg = ShimConfig()
cfg.sync_interval_s = 0.1
run_dir = sys.argv[1]
ref = ClockSync(0, 2, run_dir, cfg, lambda rows: None)
ref.start()
cli = ClockSync(1, 2, run_dir, cfg, lambda rows: None)
cli.start()
end = time.monotonic() + 10
while sum(cli.rounds.values()) < 2 and time.monotonic() < end:  # synced, periodic rounds going
    time.sleep(0.01)
assert sum(cli.rounds.values()) >= 2, cli.rounds
os.closerange(3, 4096)  # a daemonizer's: every descriptor the program did not open itself
pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM) for _ in range(8)]  # the lowest numbers again
for i, (a, b) in enumerate(pairs):
    a.send(b"a%d" % i)
    b.send(b"b%d" % i)
time.sleep(1.0)  # ~10 of the client's periods, the reference's loop awake on every packet
got = []
for a, b in pairs:
    for s in (a, b):
        s.setblocking(False)
        while True:
            try:
                got.append(s.recv(256))
            except BlockingIOError:
                break
cli.stop()
ref.stop()
still_open = 0
for a, b in pairs:
    for s in (a, b):
        try:  # the shim's stop closed none of them
            os.fstat(s.fileno())
            still_open += 1
        except OSError:
            pass
want = sorted([b"a%d" % i for i in range(8)] + [b"b%d" % i for i in range(8)])
print(sorted(got) == want, len(got), still_open, flush=True)
"""


def test_a_program_that_closes_every_descriptor_keeps_its_own_sockets(tmp_path: Path) -> None:
    """The program closes every descriptor and makes sockets of its own on the same numbers:
    the clock threads must never read their packets, send into them or close them."""
    prog = tmp_path / "prog.py"
    prog.write_text(CLOSERANGE_PROGRAM)
    p = subprocess.run([sys.executable, str(prog), str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["True", "16", "16"], (p.stdout, p.stderr)
