"""A second launch never overwrites the first one's rank files (issue 17, High finding 4).

Real launches: two ``torchrun`` launches in a row with the same ``--rdzv-id`` and
``--master-port`` (so the same launch hash), rank 0 starting a second after rank 1, each
launch's ranks must land in a run dir of their own, under a launch id of their own. Then the
rules underneath, in-process: rank 0 always makes a fresh dir and publishes the launch id;
the other ranks skip a dir that already holds their rank's file or whose rank 0 is gone; a
rank whose file exists records into the first sibling dir without one, and says so.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import h5py
import pytest

from distdiag.shim import rankinfo
from distdiag.shim.config import ShimConfig
from distdiag.shim.recorder import Recorder
from distdiag.shim.writer import base_attrs

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable
JOBS = REPO / "tests" / "jobs"

_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "PMI_RANK", "PMI_SIZE", "PMI_FD", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")  # fmt: skip

# One write per line: the two ranks share torchrun's stdout, and print()'s pieces
# interleave when it is unbuffered (CI once read "donedone  firstfirst").
PROG = """
import os, sys, time
time.sleep(0.3)
os.write(1, ("done %s\\n" % sys.argv[1]).encode())
"""


def env(**extra: str) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items()
         if k not in _LAUNCH_VARS and not k.startswith(("DISTDIAG_", "SLURM_", "TORCHELASTIC_"))}  # fmt: skip
    e["PYTHONPATH"] = str(REPO)
    e["OMP_NUM_THREADS"] = "1"
    e.update(extra)
    return e


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _attrs(path: Path) -> dict[str, Any]:
    with h5py.File(path, "r") as f:
        return dict(f.attrs)


def test_two_torchrun_launches_in_a_row_keep_their_own_run_dirs(tmp_path: Path) -> None:
    """Seen before: launch 2's rank 1 joined launch 1's dir (same hash, younger than 600 s,
    rank 0 not there yet) and overwrote its rank-00001.h5."""
    pytest.importorskip("torch")
    prog = tmp_path / "prog.py"
    prog.write_text(PROG)
    port = _free_port()
    for tag in ("first", "second"):
        cmd = [PY, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
               "--rdzv-id", "relaunch", "--master-addr", "127.0.0.1", "--master-port", str(port),
               str(JOBS / "late_rank0.py"), PY, str(prog), tag]  # fmt: skip
        p = subprocess.run(cmd, cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=240)
        assert p.returncode == 0, p.stdout + p.stderr
        assert sorted(p.stdout.split("\n")[:-1]) == [f"done {tag}"] * 2, p.stdout
        assert "distdiag:" not in p.stderr, p.stderr  # each rank found its launch's dir
    dirs = sorted(tmp_path.glob("distdiag-*"))
    assert len(dirs) == 2, [d.name for d in dirs]
    seen: dict[str, str] = {}
    for d in dirs:
        names = sorted(q.name for q in d.glob("rank-*"))
        assert names == ["rank-00000.h5", "rank-00001.h5"], (d.name, names)
        a0, a1 = _attrs(d / "rank-00000.h5"), _attrs(d / "rank-00001.h5")
        tag0, tag1 = json.loads(a0["argv"])[-1], json.loads(a1["argv"])[-1]
        assert tag0 == tag1, f"{d.name} mixes launches: rank 0 ran {tag0!r}, rank 1 {tag1!r}"
        assert a0["launch_id"] == a1["launch_id"]
        assert json.loads((d / "launch.json").read_text())["launch_id"] == a0["launch_id"]
        seen[tag0] = str(a0["launch_id"])
    assert sorted(seen) == ["first", "second"] and seen["first"] != seen["second"]
    hashes = {lid.split(".")[0] for lid in seen.values()}
    assert len(hashes) == 1  # the same launch hash: only the published part tells them apart


def _info(rank: int, **extra: str) -> rankinfo.RankInfo:
    e = {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "TORCHELASTIC_RUN_ID": "r",
         "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999", **extra}  # fmt: skip
    return rankinfo.detect(e, ppid=4242)


def test_rank0_makes_a_fresh_dir_each_launch_and_the_others_join_only_an_open_one(tmp_path: Path) -> None:
    from distdiag.shim.wrap import resolve_run

    d1, id1 = resolve_run(None, _info(0), {}, tmp_path)
    assert (d1 / "launch.json").exists() and id1.startswith(_info(0).launch_hash + ".")
    assert resolve_run(None, _info(1), {}, tmp_path, wait_s=1.0) == (d1, id1)
    (d1 / "rank-00001.h5").write_bytes(b"")  # launch 1's rank 1 recorded there
    d2, id2 = resolve_run(None, _info(0), {}, tmp_path)  # launch 2, maybe in the same second
    assert d2 != d1 and id2 != id1 and d2.name.endswith(_info(0).launch_hash)
    assert resolve_run(None, _info(1), {}, tmp_path, wait_s=1.0) == (d2, id2)
    (d2 / "rank-00001.h5").write_bytes(b"")
    # no open dir: launch 3's rank 1 waits, then makes its own (the launch hash as its id)
    lone, lid = resolve_run(None, _info(1), {}, tmp_path, wait_s=0.3)
    assert lone not in (d1, d2) and lid == _info(1).launch_hash


def test_a_dir_whose_rank0_is_gone_is_not_joined(tmp_path: Path) -> None:
    from distdiag.shim.wrap import resolve_run

    d, _ = resolve_run(None, _info(0), {}, tmp_path)
    dead = subprocess.run([PY, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, timeout=30)
    doc = json.loads((d / "launch.json").read_text())
    doc["pid"] = int(dead.stdout)  # rank 0 of an earlier launch on this host, ended
    (d / "launch.json").write_text(json.dumps(doc))
    other, _ = resolve_run(None, _info(1), {}, tmp_path, wait_s=0.3)
    assert other != d


def test_a_rank_file_that_exists_is_never_overwritten(tmp_path: Path) -> None:
    """A rerun into the same --dir: each rank records into the first DIR.k without its file
    (the ranks of one relaunch land together) and says so in one stderr line."""
    from distdiag.shim.wrap import _open_rank_file

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    got: dict[tuple[int, int], Path] = {}
    for launch in (1, 2, 3):
        for rank in (0, 1):
            w, d = _open_rank_file(run_dir, f"rank-{rank:05d}.h5", Recorder(), ShimConfig(),
                                   base_attrs(rank=rank, world_size=2, launch_id=f"L{launch}"))  # fmt: skip
            w.close(0)
            got[(launch, rank)] = d
    assert got[(1, 0)] == got[(1, 1)] == run_dir
    assert got[(2, 0)] == got[(2, 1)] == tmp_path / "run.relaunch-1"
    assert got[(3, 0)] == got[(3, 1)] == tmp_path / "run.relaunch-2"
    for launch, d in ((1, run_dir), (2, tmp_path / "run.relaunch-1"), (3, tmp_path / "run.relaunch-2")):
        assert {_attrs(d / f"rank-{r:05d}.h5")["launch_id"] for r in (0, 1)} == {f"L{launch}"}


def test_a_rerun_into_the_same_dir_records_beside_it_with_one_line(tmp_path: Path) -> None:
    prog = tmp_path / "p.py"
    prog.write_text("import sys\nprint('hello', sys.argv[1])\n")
    run_dir = tmp_path / "run"
    outs = []
    for tag in ("a", "b"):
        p = subprocess.run([PY, "-m", "distdiag.wrap", "--dir", str(run_dir), PY, str(prog), tag], cwd=tmp_path,
                           env=env(), capture_output=True, text=True, timeout=60)  # fmt: skip
        assert p.returncode == 0 and p.stdout == f"hello {tag}\n"
        outs.append(p.stderr)
    assert outs[0] == ""
    assert outs[1] == (f"distdiag: {run_dir / 'rank-00000.h5'} exists (another launch's; a rank file is never "
                       f"overwritten); this rank records into {tmp_path / 'run.relaunch-1' / 'rank-00000.h5'}\n")  # fmt: skip
    assert json.loads(_attrs(run_dir / "rank-00000.h5")["argv"])[-1] == "a"
    assert json.loads(_attrs(tmp_path / "run.relaunch-1" / "rank-00000.h5")["argv"])[-1] == "b"
