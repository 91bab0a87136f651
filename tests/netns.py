"""A small cluster of network namespaces for tests: N "nodes" on one bridge.

Layout (every interface lives inside a namespace this module creates; the root
namespace's interfaces are never touched)::

    <tok>-br   bridge namespace: br0 with ports v0 .. v{N-1}
    <tok>-n0   node 0: eth0 = 10.231.7.1/24 (veth peer of v0), lo
    <tok>-n1   node 1: eth0 = 10.231.7.2/24
    ...

Each veth is created directly with one end in the bridge namespace and the
other in the node namespace (``ip -n BR link add vK type veth peer name eth0
netns NK``), so nothing ever appears in the root namespace, not even briefly.

Shaping: ``shape(k, "50mbit")`` puts a ``tbf`` on both ends of node k's link
(eth0 inside node k shapes what it sends, vK in the bridge namespace what it
receives), so every path through node k is slow in both directions. The kernel
here has no ``netem``; ``tbf`` works.

Names carry the creating PID and a random token, so parallel test runs never
collide, and :func:`sweep_stale` removes namespaces left by a test process that
died without cleaning up (it only touches names of this pattern whose PID is
gone). :class:`NetnsCluster` is a context manager whose ``close`` kills the
processes it started (by PID) and deletes every namespace it made, also when
the test body raises.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import pytest

log = logging.getLogger(__name__)

NS_PREFIX = "ddnet"
_NS_RE = re.compile(rf"^{NS_PREFIX}-(\d+)x[0-9a-f]+-(?:br|n\d+)$")
SUBNET = "10.231.7"  # a private /24 that exists only inside our namespaces
IFNAME = "eth0"  # the node-side interface name, also GLOO_SOCKET_IFNAME
_IP_TIMEOUT_S = 10.0


def have_netns() -> str | None:
    """None when namespaces can be built here, else the reason to skip."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "no `ip` command (Debian package iproute2)"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=_IP_TIMEOUT_S)
    if check and p.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({p.returncode}): {p.stderr.strip()}")
    return p


def _tc(ns: str, *args: str) -> None:
    p = subprocess.run(["ip", "netns", "exec", ns, "tc", *args], capture_output=True, text=True, timeout=_IP_TIMEOUT_S)
    if p.returncode != 0:
        raise RuntimeError(f"tc {' '.join(args)} in {ns} failed: {p.stderr.strip()}")


def list_namespaces() -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale() -> list[str]:
    """Delete namespaces of this module's pattern whose creating process is gone."""
    removed = []
    for ns in list_namespaces():
        m = _NS_RE.match(ns)
        if m and not _pid_alive(int(m.group(1))):
            if _ip("netns", "del", ns, check=False).returncode == 0:
                removed.append(ns)
    return removed


class NetnsCluster:
    """N node namespaces on one bridge; use as a context manager.

    ``cluster.popen(k, argv, env)`` runs a process inside node k; the cluster
    remembers it and kills it (by PID) on close if it is still running.
    """

    def __init__(self, n: int = 4) -> None:
        if n < 1 or n > 250:
            raise ValueError("1 <= n <= 250")
        self.n = n
        self.token = f"{NS_PREFIX}-{os.getpid()}x{secrets.token_hex(3)}"
        self.bridge_ns = f"{self.token}-br"
        self.node_ns = [f"{self.token}-n{k}" for k in range(n)]
        self._made: list[str] = []  # namespaces created so far (deleted on close)
        self._procs: list[subprocess.Popen[Any]] = []
        self.shaped: dict[int, str] = {}

    # -- addressing -----------------------------------------------------------
    def addr(self, k: int) -> str:
        return f"{SUBNET}.{k + 1}"

    @staticmethod
    def node_name(k: int) -> str:
        return f"node{k}"

    # -- build / tear down ----------------------------------------------------
    def __enter__(self) -> NetnsCluster:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _add_ns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)

    def _build(self) -> None:
        br = self.bridge_ns
        self._add_ns(br)
        _ip("-n", br, "link", "add", "br0", "type", "bridge")
        _ip("-n", br, "link", "set", "br0", "up")
        for k, ns in enumerate(self.node_ns):
            self._add_ns(ns)
            _ip("-n", br, "link", "add", f"v{k}", "type", "veth", "peer", "name", IFNAME, "netns", ns)
            _ip("-n", br, "link", "set", f"v{k}", "master", "br0")
            _ip("-n", br, "link", "set", f"v{k}", "up")
            _ip("-n", ns, "addr", "add", f"{self.addr(k)}/24", "dev", IFNAME)
            _ip("-n", ns, "link", "set", IFNAME, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        self._wait_ready()

    def _wait_ready(self, timeout_s: float = 10.0) -> None:
        """Wait until the bridge ports forward (the veths start in a brief
        'no carrier' state; a connect in that window fails)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            out = _ip("-n", self.bridge_ns, "-o", "link", "show", "master", "br0").stdout
            ups = sum(1 for line in out.splitlines() if "LOWER_UP" in line)
            if ups >= self.n:
                return
            time.sleep(0.05)
        raise RuntimeError(f"bridge ports in {self.bridge_ns} did not come up within {timeout_s} s")

    def shape(self, k: int, rate: str = "50mbit", burst: str = "32kbit", latency: str = "400ms") -> None:
        """Rate-limit node k's link in both directions with tbf."""
        for ns, dev in ((self.node_ns[k], IFNAME), (self.bridge_ns, f"v{k}")):
            _tc(ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", burst, "latency", latency)
        self.shaped[k] = rate

    def close(self) -> None:
        for p in self._procs:
            if p.poll() is None:
                try:
                    os.kill(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    log.warning("process %d inside a test namespace did not die", p.pid)
        self._procs.clear()
        # Deleting a namespace destroys the veth ends inside it (and with them
        # their peers); the bridge goes with its namespace.
        for ns in reversed(self._made):
            p = _ip("netns", "del", ns, check=False)
            if p.returncode != 0 and ns in list_namespaces():
                log.warning("could not delete namespace %s: %s", ns, p.stderr.strip())
        self._made.clear()

    # -- running things inside a node ------------------------------------------
    def exec_argv(self, k: int, argv: Sequence[str]) -> list[str]:
        # `ip netns exec` execs the command after setns, so the PID we get is
        # the program's own: kill-by-PID reaches the right process.
        return ["ip", "netns", "exec", self.node_ns[k], *argv]

    def popen(self, k: int, argv: Sequence[str], env: Mapping[str, str] | None = None, **kw: Any) -> subprocess.Popen[Any]:
        p = subprocess.Popen(self.exec_argv(k, argv), env=dict(env) if env is not None else None, **kw)
        self._procs.append(p)
        return p

    def run(self, k: int, argv: Sequence[str], timeout_s: float = 30.0, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        p = self.popen(k, argv, env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = p.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.kill(p.pid, signal.SIGKILL)
            out, err = p.communicate(timeout=5)
            raise
        return subprocess.CompletedProcess(p.args, p.returncode, out, err)

    def torch_env(self, k: int, port: int, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """Environment for rank k of a torch.distributed job with one rank per node."""
        env = dict(os.environ if base is None else base)
        env.update(
            RANK=str(k),
            WORLD_SIZE=str(self.n),
            LOCAL_RANK="0",
            LOCAL_WORLD_SIZE="1",
            MASTER_ADDR=self.addr(0),
            MASTER_PORT=str(port),
            GLOO_SOCKET_IFNAME=IFNAME,
            DISTDIAG_HOST=self.node_name(k),
            OMP_NUM_THREADS="1",
        )
        return env

    def run_all(
        self,
        argv: Sequence[str],
        env_of: Any,
        timeout_s: float = 60.0,
        log_dir: Path | None = None,
    ) -> list[subprocess.CompletedProcess[str]]:
        """Start ``argv`` on every node at once (``env_of(k)`` gives each one's
        environment), wait for all with one deadline, kill the rest on timeout.
        Output goes to files (never pipes: a rank blocked on a full pipe would
        hang the job)."""
        log_dir = log_dir or Path("/tmp")
        procs = []
        files = []
        for k in range(self.n):
            fo = open(log_dir / f"{self.token}-rank{k}.out", "w+")
            files.append(fo)
            procs.append(self.popen(k, argv, env_of(k), stdout=fo, stderr=subprocess.STDOUT, text=True))
        deadline = time.monotonic() + timeout_s
        timed_out = False
        for p in procs:
            left = deadline - time.monotonic()
            try:
                p.wait(timeout=max(left, 0.01))
            except subprocess.TimeoutExpired:
                timed_out = True
                break
        if timed_out:
            for p in procs:
                if p.poll() is None:
                    os.kill(p.pid, signal.SIGKILL)
                    p.wait(timeout=5)
        out = []
        for p, fo in zip(procs, files):
            fo.seek(0)
            out.append(subprocess.CompletedProcess(p.args, p.returncode, fo.read(), ""))
            fo.close()
            os.unlink(fo.name)
        if timed_out:
            tails = "\n".join(f"--- rank {k} ---\n{c.stdout[-2000:]}" for k, c in enumerate(out))
            raise TimeoutError(f"job did not finish within {timeout_s} s\n{tails}")
        return out


def free_port_hint() -> int:
    """A port number for MASTER_PORT. Each cluster has its own network stack,
    so any fixed port is free inside it; vary it anyway so a lingering socket
    in TIME_WAIT from a previous job in the same cluster cannot bite."""
    return 20000 + secrets.randbelow(20000)


@pytest.fixture
def netns_cluster() -> Iterator[Any]:
    """Factory fixture: ``netns_cluster(4)`` -> a built NetnsCluster, torn down
    after the test whatever happens."""
    why = have_netns()
    if why:
        pytest.skip(why)
    sweep_stale()
    made: list[NetnsCluster] = []

    def make(n: int = 4) -> NetnsCluster:
        c = NetnsCluster(n)
        made.append(c)
        return c.__enter__()

    try:
        yield make
    finally:
        for c in made:
            c.close()
