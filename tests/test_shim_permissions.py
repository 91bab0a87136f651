"""The shim is a guest in the user's files and network (issue 17, items 9 and 10).

Real processes throughout (``python -m distdiag.wrap``, ``mpiexec -n 2``, a
pid namespace, ``chown`` to ``nobody``, real UDP packets):

* the run dir is made 0700 and every file in it 0600 (checked with ``os.stat``);
* a link planted where the shim writes (``rank-00000.h5``, the reference's
  temporary file at its once predictable name) is never written through: the
  link's target stays as it was, the job's exit code is its own, one stderr line;
* a run dir of another user, or one others can write, is not used;
* the rank file keeps no secret given on the command line (``--token X``,
  ``--token=X``, ``api_key=X``, the text of ``-c CODE``);
* the clock channel answers only packets under the run's key (a forged ping
  gets no reply and is counted, a forged reply is never a sample) while the real
  exchanges go on; rank 0 listens on the job's address, never 0.0.0.0;
* the shim's threads keep the job's scheduling priority (they used to renice
  themselves to -10 when run as root).
"""

from __future__ import annotations

import json
import os
import pwd
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import h5py
import pytest
from helpers import MPIEXEC, single_process_env

from distdiag.shim import clock
from distdiag.shim.clock import REF_FILE, ClockSync
from distdiag.shim.config import ShimConfig

PY = sys.executable
WRAP = [PY, "-m", "distdiag.wrap"]
TIMEOUT_S = 120
ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="needs root (chown to nobody, setuid, a pid namespace)")


def _nobody() -> tuple[int, int]:
    try:
        pw = pwd.getpwnam("nobody")
        return pw.pw_uid, pw.pw_gid
    except KeyError:
        return 65534, 65534


def _mode(p: Path) -> int:
    return os.stat(p).st_mode & 0o7777


def _run(cmd: list[str], cwd: Path, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, env=single_process_env(**extra), capture_output=True, text=True,
                          timeout=TIMEOUT_S)  # fmt: skip


def _distdiag_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("distdiag:")]


# -- modes ----------------------------------------------------------------------------------
FORKING_PROG = """
import os, sys
pid = os.fork()
if pid == 0:
    for i in range(3):
        with open("child-%d.txt" % i, "w") as f:   # recorded: the child's own file
            f.write("x")
    os._exit(0)
os.waitpid(pid, 0)
os.write(1, b"done\\n")
"""


def test_the_run_dir_is_0700_and_every_file_in_it_0600(tmp_path: Path) -> None:
    """Default run dir (rank 0 makes it and publishes launch.json), a forked child's file."""
    (tmp_path / "prog.py").write_text(FORKING_PROG)
    p = _run([*WRAP, PY, "prog.py"], tmp_path, DISTDIAG_FLUSH_INTERVAL_S="0.1")
    assert p.returncode == 0 and p.stdout == "done\n", p.stderr
    (run_dir,) = tmp_path.glob("distdiag-*")
    assert _mode(run_dir) == 0o700
    names = sorted(q.name for q in run_dir.iterdir())
    assert "rank-00000.h5" in names and "launch.json" in names, names
    assert any(".fork-" in n for n in names), names  # the forked child's own file
    for q in run_dir.iterdir():
        assert _mode(q) == 0o600, (q.name, oct(_mode(q)))


def test_clock_ref_json_holds_its_key_in_a_file_only_the_user_reads(tmp_path: Path) -> None:
    """A dir the user opened to others (mode 0755): clock-ref.json stays 0600, and another
    user (a real process running as nobody) cannot read the key in it."""
    d = Path(tempfile.mkdtemp(prefix="distdiag-perm-"))  # /tmp: reachable by nobody once 0755
    try:
        os.chmod(d, 0o755)
        ref = ClockSync(0, 2, d, ShimConfig(), lambda rows: None)
        ref.start()
        try:
            f = d / REF_FILE
            assert _mode(f) == 0o600
            assert len(bytes.fromhex(json.loads(f.read_text())["key"])) == clock.KEY_BYTES
            if ROOT:
                uid, gid = _nobody()
                # cat, not python: the interpreter under /root is not nobody's to run
                q = subprocess.run(["cat", str(f)], user=uid, group=gid, capture_output=True, text=True,
                                   timeout=TIMEOUT_S)  # fmt: skip
                assert q.returncode != 0 and "Permission denied" in q.stderr and q.stdout == "", q
        finally:
            ref.stop()
        assert not [q.name for q in d.iterdir() if q.name.endswith(".tmp")]
    finally:
        for q in d.iterdir():
            q.unlink()
        d.rmdir()


# -- links ----------------------------------------------------------------------------------
def test_a_linked_rank_file_is_never_written_through(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's own data\n")
    (run_dir / "rank-00000.h5").symlink_to(victim)
    (tmp_path / "prog.py").write_text("import sys\nprint('hello')\nsys.exit(3)\n")
    p = _run([*WRAP, "--dir", str(run_dir), PY, "prog.py"], tmp_path)
    assert p.returncode == 3 and p.stdout == "hello\n", p.stderr
    assert victim.read_text() == "the user's own data\n"
    assert (run_dir / "rank-00000.h5").is_symlink()
    lines = _distdiag_lines(p.stderr)
    assert len(lines) == 1 and "records into" in lines[0], p.stderr
    moved = tmp_path / "run.relaunch-1" / "rank-00000.h5"
    assert _mode(moved.parent) == 0o700 and _mode(moved) == 0o600
    with h5py.File(moved, "r") as f:
        assert f.attrs["exit_code"] == 3


@needs_root
def test_a_link_at_the_clock_references_temporary_name_is_never_written_through(tmp_path: Path) -> None:
    """Rank 0 of two in a pid namespace runs as pid 1: the old temporary name,
    ``.clock-ref.json.1.tmp``, is known in advance; a link there made the shim
    write the reference (port and token) over the link's target."""
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's own data\n")
    for pid in (1, 2, 3):
        (run_dir / f".{REF_FILE}.{pid}.tmp").symlink_to(victim)
    (tmp_path / "prog.py").write_text("import os\nos.write(1, ('pid %d\\n' % os.getpid()).encode())\n")
    cmd = ["unshare", "--pid", "--fork", "--mount-proc", *WRAP, "--dir", str(run_dir), PY, "prog.py"]
    p = _run(cmd, tmp_path, RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", DISTDIAG_EXIT_SYNC_WAIT_S="0.2")
    if p.returncode != 0 and "unshare" in p.stderr and "pid 1" not in p.stdout:
        pytest.skip(f"no pid namespace here: {p.stderr.strip()}")
    assert p.returncode == 0 and p.stdout == "pid 1\n", p.stdout + p.stderr
    assert victim.read_text() == "the user's own data\n"
    assert _mode(run_dir / REF_FILE) == 0o600 and not (run_dir / REF_FILE).is_symlink()


# -- whose dir --------------------------------------------------------------------------------
PLAIN_PROG = "import sys\nprint('hello')\nsys.exit(4)\n"


@needs_root
def test_a_run_dir_of_another_user_is_not_used(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o755)
    uid, gid = _nobody()
    os.chown(run_dir, uid, gid)
    (tmp_path / "prog.py").write_text(PLAIN_PROG)
    p = _run([*WRAP, "--dir", str(run_dir), PY, "prog.py"], tmp_path)
    assert p.returncode == 4 and p.stdout == "hello\n", p.stderr
    assert list(run_dir.iterdir()) == []
    lines = _distdiag_lines(p.stderr)
    assert len(lines) == 1 and "another user" in lines[0] and "without recording" in lines[0], p.stderr


def test_a_run_dir_others_can_write_is_not_used(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    os.chmod(run_dir, 0o777)
    (tmp_path / "prog.py").write_text(PLAIN_PROG)
    p = _run([*WRAP, "--dir", str(run_dir), PY, "prog.py"], tmp_path)
    assert p.returncode == 4 and p.stdout == "hello\n", p.stderr
    assert list(run_dir.iterdir()) == []
    lines = _distdiag_lines(p.stderr)
    assert len(lines) == 1 and "writable by others" in lines[0], p.stderr


@needs_root
def test_a_run_dir_writable_by_a_shared_group_is_not_used_but_by_the_users_private_group_is(tmp_path: Path) -> None:
    from distdiag.shim.wrap import _private_group

    (tmp_path / "prog.py").write_text(PLAIN_PROG)
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chown(shared, os.geteuid(), _nobody()[1])  # a group others are in
    os.chmod(shared, 0o770)
    p = _run([*WRAP, "--dir", str(shared), PY, "prog.py"], tmp_path)
    assert p.returncode == 4 and list(shared.iterdir()) == [], p.stderr
    assert "writable by others" in p.stderr
    if _private_group(os.getegid()):  # umask 002 with a group of the user alone (RHEL's convention)
        own = tmp_path / "own"
        own.mkdir()
        os.chmod(own, 0o775)
        p = _run([*WRAP, "--dir", str(own), PY, "prog.py"], tmp_path)
        assert p.returncode == 4 and (own / "rank-00000.h5").exists(), p.stderr
        assert _distdiag_lines(p.stderr) == []


@needs_root
def test_the_other_ranks_never_join_another_users_launch_dir(tmp_path: Path) -> None:
    """A shared working dir holds ``distdiag-<stamp>-<launchhash>`` of user nobody, with
    a launch.json naming a live rank 0: a rank other than 0 does not record there."""
    from distdiag.shim.wrap import LAUNCH_FILE, _find_launch_dir, _proc_start

    lhash = "0123456789"
    d = tmp_path / f"distdiag-20260101-000000-{lhash}"
    d.mkdir(mode=0o700)
    doc = {"launch_id": f"{lhash}.abcdef", "pid": os.getpid(), "host": socket.gethostname(),
           "start": _proc_start(os.getpid())}  # fmt: skip
    (d / LAUNCH_FILE).write_text(json.dumps(doc))
    assert _find_launch_dir(tmp_path, lhash, 1) == (d, f"{lhash}.abcdef")  # ours: joined
    uid, gid = _nobody()
    for q in (d / LAUNCH_FILE, d):
        os.chown(q, uid, gid)
    assert _find_launch_dir(tmp_path, lhash, 1) is None
    os.chown(d, 0, 0)  # the dir ours again, launch.json still nobody's: not rank 0's
    assert _find_launch_dir(tmp_path, lhash, 1) is None


# -- argv --------------------------------------------------------------------------------------
CODE = "import sys; PASSWORD = 'c0de-s3cret-77'; print(len(sys.argv))"
SECRETS = ("tok-s3cret-11", "key-s3cret-22", "pw-s3cret-33", "c0de-s3cret-77", "url-s3cret-44")


def test_secrets_on_the_command_line_never_reach_the_rank_file(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = ["--token", SECRETS[0], f"--api-key={SECRETS[1]}", f"db_password={SECRETS[2]}",
            f"https://me:{SECRETS[4]}@example.org/data", "--lr", "0.1"]  # fmt: skip
    p = _run([*WRAP, "--dir", str(run_dir), PY, "-c", CODE, *args], tmp_path)
    assert p.returncode == 0 and p.stdout == f"{len(args) + 1}\n", p.stderr  # the program saw them all
    f = run_dir / "rank-00000.h5"
    with h5py.File(f, "r") as h:
        argv = json.loads(h.attrs["argv"])
    assert argv[0] == "-c" and argv[1] == clock_free_describe(CODE)
    assert argv[2:] == ["--token", "<redacted>", "--api-key=<redacted>", "db_password=<redacted>",
                        "https://me:<redacted>@example.org/data", "--lr", "0.1"]  # fmt: skip
    raw = f.read_bytes()
    for s in SECRETS:
        assert s.encode() not in raw, s


def clock_free_describe(code: str) -> str:
    import hashlib

    return f"<code: {len(code)} chars, sha256 {hashlib.sha256(code.encode()).hexdigest()[:16]}>"


def test_the_code_text_is_kept_when_configured_and_names_are_configurable(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    p = _run([*WRAP, "--dir", str(run_dir), PY, "-c", CODE, "--token", "t1", "--hush", "h1"], tmp_path,
             DISTDIAG_KEEP_CODE_TEXT="1", DISTDIAG_REDACT_ARGS="hush")  # fmt: skip
    assert p.returncode == 0, p.stderr
    with h5py.File(run_dir / "rank-00000.h5", "r") as h:
        assert json.loads(h.attrs["argv"]) == ["-c", CODE, "--token", "t1", "--hush", "<redacted>"]


# -- the clock channel ---------------------------------------------------------------------------
CLIENT = """
import json, sys, time, numpy as np
from distdiag.shim.clock import ClockSync
from distdiag.shim.config import ShimConfig
from distdiag.schema import SYNC_DTYPE
rows = []
c = ClockSync(1, 2, sys.argv[1], ShimConfig(sync_interval_s=0.1, sync_exchanges=5), rows.extend)
c.start(); time.sleep(1.5); c.stop()
got = np.array(rows, SYNC_DTYPE)
sys.stdout.write(json.dumps({"rows": len(got), "tags": sorted(set(got["tag"].tolist())) if len(got) else [],
                             "dropped": c.dropped}) + "\\n")
"""


def _ref_endpoints(run_dir: Path) -> list[tuple[str, int]]:
    doc = json.loads((run_dir / REF_FILE).read_text())
    return list(zip(doc["addrs"], doc.get("ports", [doc["port"]] * len(doc["addrs"]))))


def test_forged_pings_get_no_reply_and_the_real_sync_goes_on(tmp_path: Path) -> None:
    ref = ClockSync(0, 2, tmp_path, ShimConfig(exit_sync_wait_s=5.0), lambda rows: None)
    ref.start()
    eps = _ref_endpoints(tmp_path)
    assert all(a != "0.0.0.0" for a, _ in eps)
    stop = threading.Event()
    sent = [0]
    answers: list[bytes] = []

    def forge() -> None:
        wrong = os.urandom(clock.KEY_BYTES)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.settimeout(0.01)
            seq = 0
            while not stop.is_set():
                seq += 1
                for a, port in eps:
                    s.sendto(clock.seal_ping(wrong, 1, seq, 0, os.urandom(8)), (a, port))
                    s.sendto(clock.seal_ping(wrong, 1, seq, 1, os.urandom(8)), (a, port))  # a forged goodbye
                    s.sendto(b"DDCK" + os.urandom(17), (a, port))  # the old packet format
                    sent[0] += 3
                try:
                    answers.append(s.recv(256))
                except OSError:
                    pass

    t = threading.Thread(target=forge, daemon=True)
    t.start()
    try:
        p = subprocess.run([PY, "-c", CLIENT, str(tmp_path)], capture_output=True, text=True, timeout=TIMEOUT_S,
                           env=single_process_env())  # fmt: skip
    finally:
        stop.set()
        t.join(5)
    t0 = time.monotonic()
    ref.stop()  # the real client's goodbye ends the linger; the forged ones did not
    assert time.monotonic() - t0 < 4.0
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["rows"] >= 10 and set(out["tags"]) >= {0, 2}, out  # START and EXIT rounds
    assert answers == []
    assert sent[0] > 30 and ref.dropped >= sent[0] * 0.9, (ref.dropped, sent[0])


def test_a_reply_under_another_key_is_never_a_sample(tmp_path: Path) -> None:
    """A stand-in reference that answers every ping: under the key it published its
    replies are samples (so the check can see one), under another key none is."""
    key = os.urandom(clock.KEY_BYTES)
    for answer_key, expect_rows in ((os.urandom(clock.KEY_BYTES), False), (key, True)):
        d = tmp_path / ("forged" if not expect_rows else "real")
        d.mkdir(mode=0o700)
        srv = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        srv.bind(("127.0.0.1", 0))
        srv.settimeout(0.1)
        port = srv.getsockname()[1]
        (d / REF_FILE).write_text(json.dumps({"addrs": ["127.0.0.1"], "ports": [port], "port": port,
                                              "key": key.hex()}))  # fmt: skip
        os.chmod(d / REF_FILE, 0o600)
        stop = threading.Event()

        def serve(s: socket.socket = srv, k: bytes = answer_key, ev: threading.Event = stop) -> None:
            from distdiag.shim.recorder import now_ns

            while not ev.is_set():
                try:
                    data, addr = s.recvfrom(256)
                except OSError:
                    continue
                got = clock._Mac(key).open(clock._DIR_PING, data, clock._PING)
                if got is not None:
                    _m, rank, seq, _op, nonce = got
                    s.sendto(clock.seal_pong(k, rank, seq, now_ns(), nonce), addr)

        th = threading.Thread(target=serve, daemon=True)
        th.start()
        rows: list[Any] = []
        c = ClockSync(1, 2, d, ShimConfig(sync_interval_s=0.1, sync_exchanges=5), rows.append)
        try:
            c.start()
            time.sleep(1.0)
            c.stop()
        finally:
            stop.set()
            th.join(5)
            srv.close()
        if expect_rows:
            assert rows and c.dropped == 0
        else:
            assert rows == [] and c.dropped > 0


def test_bind_addrs_follow_the_launch_never_the_wildcard() -> None:
    host = clock._ipv4_addrs()
    assert clock.bind_addrs(4, environ={"LOCAL_WORLD_SIZE": "4"}) == ["127.0.0.1"]
    assert clock.bind_addrs(2, environ={"MPI_LOCALNRANKS": "2"}) == ["127.0.0.1"]
    assert clock.bind_addrs(8, environ={"SLURM_STEP_NUM_NODES": "1"}) == ["127.0.0.1"]
    assert clock.bind_addrs(4, "10.9.8.7", environ={}) == ["10.9.8.7"]
    assert clock.bind_addrs(4, environ={"LOCAL_WORLD_SIZE": "2"}) == host
    if host[0] != "127.0.0.1":
        assert clock.bind_addrs(4, environ={"LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": host[0]}) == [host[0]]
    # loopback MASTER_ADDR while ranks sit elsewhere: other nodes could not reach it
    assert clock.bind_addrs(4, environ={"LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.1.1"}) == host
    assert "0.0.0.0" not in host


# -- a real MPI job: sockets and thread priorities --------------------------------------------------
INSPECT_JOB = r"""
import json, os, sys, time
from mpi4py import MPI
comm = MPI.COMM_WORLD
time.sleep(1.0)  # the clock threads are up (the client connected during start: sync_start_wait_s)
inodes = set()
for fd in os.listdir("/proc/self/fd"):
    try:
        link = os.readlink("/proc/self/fd/" + fd)
    except OSError:
        continue
    if link.startswith("socket:["):
        inodes.add(link[8:-1])
udp = []
for table in ("/proc/self/net/udp",):
    for line in open(table).read().splitlines()[1:]:
        f = line.split()
        if f[9] in inodes:
            h, p = f[1].split(":")
            addr = ".".join(str(int(h[i:i + 2], 16)) for i in (6, 4, 2, 0))
            udp.append([addr, int(p, 16)])
base = os.getpriority(os.PRIO_PROCESS, 0)
prio = {}
for tid in os.listdir("/proc/self/task"):
    try:
        comm_name = open("/proc/self/task/%s/comm" % tid).read().strip()
        prio[tid] = [comm_name, os.getpriority(os.PRIO_PROCESS, int(tid))]
    except OSError:
        pass
out = {"rank": comm.Get_rank(), "udp": udp, "base": base, "threads": prio}
with open(os.path.join(sys.argv[1], "inspect-%d.json" % comm.Get_rank()), "w") as f:
    json.dump(out, f)
comm.Barrier()
"""


def test_an_mpi_job_listens_on_loopback_and_its_threads_keep_their_priority(tmp_path: Path) -> None:
    if MPIEXEC is None:
        pytest.fail("mpiexec not found: install the 'mpi' extra (mpi4py + mpich)")
    (tmp_path / "job.py").write_text(INSPECT_JOB)
    run_dir = tmp_path / "run"
    cmd = ["nice", "-n", "3", MPIEXEC, "-n", "2", *WRAP, "--dir", str(run_dir), PY, str(tmp_path / "job.py"),
           str(tmp_path)]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S,
                       env=single_process_env(DISTDIAG_SYNC_START_WAIT_S="10", OMP_NUM_THREADS="1"))  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr
    got = [json.loads((tmp_path / f"inspect-{r}.json").read_text()) for r in (0, 1)]
    eps = _ref_endpoints(run_dir)
    assert eps and all(a == "127.0.0.1" for a, _ in eps), eps  # every rank on this host: loopback only
    assert all(ep in [tuple(u) for u in got[0]["udp"]] for ep in eps), (eps, got[0]["udp"])
    for g in got:
        assert g["udp"], g  # rank 0 listens, rank 1 pings
        assert all(a != "0.0.0.0" for a, _ in g["udp"]), g["udp"]
        assert g["base"] == 3
        # every thread of the rank (the shim's clock, flusher and SIGTERM threads among them) at the job's niceness
        assert len(g["threads"]) >= 3 and all(pr == g["base"] for _n, pr in g["threads"].values()), g["threads"]
    with h5py.File(run_dir / "rank-00001.h5", "r") as f:
        assert len(f["clock_sync"]) >= 5  # and the exchanges worked
