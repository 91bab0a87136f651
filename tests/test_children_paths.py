"""distdiag.children on crafted fork files: a path two workers read is summed by its name
across their string tables (each child's ids are its own), the top files ordered by
seconds, and the per-path sums made without a loop over paths (a worker reads each sample
once, so distinct paths are as many as its calls)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np

from distdiag.children import children_io
from distdiag.schema import EVENT_DTYPE, Kind
from distdiag.shim.writer import write_rank_file

N = 1000


def test_paths_are_summed_by_name_across_children(tmp_path: Path) -> None:
    for pid, off in ((101, 0), (102, N // 2)):  # two workers; half of each one's paths the other's too
        strings = ["", "fuse.slowfs:/mnt"] + [f"/mnt/data/s{i:05d}" for i in range(off, off + N)]
        ev = np.zeros(N, EVENT_DTYPE)
        ev["t0_ns"] = np.arange(N) * 1000 + 10**6
        ev["t1_ns"] = ev["t0_ns"] + 500 + (np.arange(N) == 7) * 10**6  # its 8th path: 1 ms
        ev["kind"], ev["name_id"], ev["aux"], ev["nbytes"] = int(Kind.FILE_READ), np.arange(N) + 2, 1, 100
        ev["seq"], ev["peer"] = -1, -1
        write_rank_file(tmp_path / f"rank-00000.fork-{pid}.h5", {"rank": 0, "world_size": 1, "mono_ns_at_start": 0,
                        "end_mono_ns": int(ev["t1_ns"].max()) + 1}, ev, strings)  # fmt: skip
    run = SimpleNamespace(path=tmp_path, source="distdiag", warnings=[])
    c = children_io(run)[0]
    assert c.processes == 2 and c.calls == 2 * N and c.bytes_read == 2 * N * 100
    ((fs, (calls, secs, nbytes)),) = c.by_fs.items()
    assert (fs, calls, nbytes) == ("fuse.slowfs:/mnt", 2.0 * N, 2.0 * N * 100) and abs(secs - c.io_s) < 1e-9
    (p0, n0, s0, b0), (p1, n1, s1, b1) = c.top_files[:2]
    assert (p0, n0, b0) == (f"/mnt/data/s{N // 2 + 7:05d}", 2, 200) and abs(s0 - 1.001e-3) < 1e-9  # both read it
    assert (p1, n1, b1) == ("/mnt/data/s00007", 1, 100) and abs(s1 - 1.0005e-3) < 1e-9
    assert len(c.top_files) == 5 and not run.warnings
