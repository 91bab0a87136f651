"""DataLoader workers' file I/O, attributed to their rank (issue 21 item 2): the workers
are forked, each records into ``rank-NNNNN.fork-PID.h5`` (distdiag.shim.wrap._ForkStream),
and the analyzer folds their calls into the rank's ``children`` in the report
(distdiag.children), never into the rank's own time. Real runs: a torch DataLoader with 2
workers reading 120 files from a FUSE mount whose metadata calls take 1 ms, against the
same loop reading in the main process (no children: nothing reported)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import single_process_env
from slowfs import fuse_available, mount_slowfs

pytestmark = [pytest.mark.torch]

PY = sys.executable
JOB = str(Path(__file__).parent / "jobs" / "loader_workers.py")
N_FILES = 120
FILE_BYTES = 3000


def _run(tmp: Path, mnt: Path, workers: int) -> tuple[dict[str, Any], int, int]:
    run_dir = tmp / f"run{workers}"
    env = single_process_env(DISTDIAG_FLUSH_INTERVAL_S="0.2")
    p = subprocess.run([PY, "-m", "distdiag.wrap", "--dir", str(run_dir), PY, JOB, str(mnt / "data"), str(workers), "1"],
                       env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    words = p.stdout.split()
    files, nbytes = int(words[words.index("files") + 1]), int(words[words.index("bytes") + 1])
    a = subprocess.run([PY, "-m", "distdiag.cli", "analyze", str(run_dir), "--format", "json"], env=env,
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert a.returncode == 0, a.stderr[-3000:]
    t = subprocess.run([PY, "-m", "distdiag.cli", "analyze", str(run_dir)], env=env, capture_output=True, text=True,
                       timeout=300)  # fmt: skip
    rep = json.loads(a.stdout)
    rep["_text"] = t.stdout
    return rep, files, nbytes


@pytest.fixture(scope="module")
def loader_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, tuple[dict[str, Any], int, int]]:
    why = fuse_available()
    if why:
        pytest.skip(why)
    tmp = tmp_path_factory.mktemp("loader")
    backing = tmp / "backing"
    (backing / "data").mkdir(parents=True)
    for i in range(N_FILES):
        (backing / "data" / f"sample-{i:04d}.bin").write_bytes(bytes([i % 251]) * FILE_BYTES)
    with mount_slowfs(backing, tmp / "mnt", latency_ms=1.0) as mnt:
        return {w: _run(tmp, Path(mnt), w) for w in (2, 0)}


def test_the_workers_reads_are_the_ranks_children_with_what_they_read(loader_runs: dict[int, Any]) -> None:
    rep, files, nbytes = loader_runs[2]
    assert files == N_FILES and nbytes == N_FILES * FILE_BYTES
    (kids,) = rep["children"]
    assert kids["rank"] == 0 and kids["processes"] == 2 and kids["roles"] == {"dataloader_worker": 2}
    # what the workers read from the mount, against what the dataset read (every sample in a
    # worker; their other reads are their own imports, on other file systems)
    fuse = [fs for fs in kids["by_fs"] if "fuse" in fs["fs"]]
    assert len(fuse) == 1 and fuse[0]["bytes"] == nbytes, kids["by_fs"]
    assert kids["bytes_read"] >= nbytes
    # per sample a stat, an open, a close (and the workers' own imports elsewhere): 1 ms each on the mount
    assert kids["metadata_calls"] >= 3 * N_FILES
    assert fuse[0]["calls"] >= 3 * N_FILES and fuse[0]["seconds"] >= 3 * N_FILES * 1e-3
    top = kids["top_files"][0]
    assert "/data/sample-" in top["path"] and top["bytes"] == FILE_BYTES
    assert "CHILD PROCESSES" in rep["_text"] and "2 dataloader_worker" in rep["_text"]
    # the rank itself read none of it: its own I/O is not the workers'
    (row,) = rep["breakdown"]["per_rank"]
    assert row["io_s"] < 0.5 * fuse[0]["seconds"], row
    # the loop waits on its input: the input_bound finding says where the input comes from
    (ib,) = [f for f in rep["findings"] if f["kind"] == "input_bound"]
    assert ib["evidence"]["children_io"] == kids
    assert "loader processes spend" in ib["advice"] and "fuse.slowfs" in ib["advice"]  # the storage feeds it


def test_without_workers_there_are_no_children(loader_runs: dict[int, Any]) -> None:
    rep, files, _ = loader_runs[0]
    assert files == N_FILES
    assert rep["children"] == [] and "CHILD PROCESSES" not in rep["_text"]
