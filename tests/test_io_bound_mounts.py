"""io_bound's evidence on a crafted rank file: the mounts it lists (``top`` of them) are the
ones the rank spent most time on, so the summary's "most on" names the busiest one even
when the rank touched more mounts than ``top`` and the busiest has the highest string id."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from distdiag.analysis import Analysis
from distdiag.config import Config
from distdiag.detectors.io_bound import detect
from distdiag.run import load_run
from distdiag.schema import EVENT_DTYPE, Kind
from distdiag.shim.writer import write_rank_file

MS = 1_000_000


def test_the_busiest_mount_is_named_past_the_first_top_ids(tmp_path: Path) -> None:
    mounts = [f"ext4:/m{i}" for i in range(7)]  # string ids 1..7; the last is the busiest
    strings = ["", *mounts, "/data/f"]
    rows = []
    t = 10 * MS
    for i in range(7):
        for _ in range(3 if i < 6 else 30):  # 3 reads of 1 ms on each of six mounts, 30 on the seventh
            rows.append((t, t + MS, int(Kind.FILE_READ), 8, 0, -1, -1, 4096, i + 1, 0, 0, 0.0))
            t += 5 * MS  # gaps over gap_ms: one burst a call
    ev = np.zeros(len(rows), EVENT_DTYPE)
    for k, r in enumerate(rows):  # a few dozen rows
        ev[k] = r
    write_rank_file(tmp_path / "rank-00000.h5", {"rank": 0, "world_size": 1, "mono_ns_at_start": 0,
                                                  "end_mono_ns": t + 10 * MS}, ev, strings)  # fmt: skip
    run = load_run(tmp_path)
    (f,) = detect(Analysis.of(run, Config()))
    by = [m["mount"] for m in f.evidence["by_mount"]]
    assert by[0] == "ext4:/m6" and len(by) == 5, by
    assert "most on ext4:/m6" in f.summary, f.summary
