"""The namespace cluster itself: links work, tbf shaping really slows one node,
and every namespace is gone afterwards, also when the test body fails."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from netns import NetnsCluster, have_netns, list_namespaces

pytestmark = [pytest.mark.netns, pytest.mark.skipif(have_netns() is not None, reason=str(have_netns()))]

JOB = str(Path(__file__).parent / "jobs" / "net_tcp_bw.py")


def _throughput(c: NetnsCluster, src: int, dst: int, nbytes: int) -> float:
    srv = c.popen(dst, [sys.executable, JOB, "serve", "5001", str(nbytes)], stdout=subprocess.PIPE, text=True)
    c.run(src, [sys.executable, JOB, "send", c.addr(dst), "5001", str(nbytes)], timeout_s=30)
    out, _ = srv.communicate(timeout=30)
    m = re.search(r"bytes_per_s=([\d.]+)", out)
    assert m, out
    return float(m.group(1))


def test_links_work_and_tbf_slows_only_the_shaped_node() -> None:
    with NetnsCluster(3) as c:
        c.shape(2, "50mbit")
        fast = _throughput(c, 0, 1, 8 << 20)
        slow_in = _throughput(c, 0, 2, 2 << 20)
        slow_out = _throughput(c, 2, 1, 2 << 20)
    # 50 Mbit/s is 6.25 MB/s; an unshaped veth pair moves hundreds of MB/s.
    assert slow_in < 8e6 and slow_out < 8e6, (slow_in, slow_out)
    assert fast > 5 * max(slow_in, slow_out), (fast, slow_in, slow_out)


def test_every_namespace_is_removed_also_when_the_body_fails() -> None:
    names: list[str] = []
    with pytest.raises(RuntimeError, match="boom"):
        with NetnsCluster(2) as c:
            names = [c.bridge_ns, *c.node_ns]
            assert set(names) <= set(list_namespaces())
            sleeper = c.popen(0, [sys.executable, "-c", "import time; time.sleep(60)"])
            raise RuntimeError("boom")
    assert not set(names) & set(list_namespaces())
    assert sleeper.poll() is not None  # the process it started was killed


def test_root_namespace_interfaces_untouched() -> None:
    before = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=10).stdout
    with NetnsCluster(2):
        during = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=10).stdout
    names = lambda s: sorted(re.findall(r"^\d+: ([^:@]+)", s, re.M))  # noqa: E731
    assert names(before) == names(during)
