"""A DDP job whose Dataset reads its samples' files in DataLoader workers from a slow file
system (issue 21's test): the report names the file system and prices the input pipeline
with the workers' calls.

Real runs: 2 ranks on gloo under torchrun, each with 2 persistent DataLoader workers that
``os.stat``, open and read one 2 kB file per sample (tests/jobs/torch_ddp.py ``--files``),
from the slow FUSE mount (every call 1 ms: tests/slowfs.py) or, the healthy twin,
from the same files on the local disk. What the slow mount costs the job is measured: the
loop's wall-clock between two barriers, in the analyzed (wrapped) pair, with the spread of
2 plain launches of each, by turns, as the noise (tests/truth.py). The input pipeline's
price in the faulty run less the twin's is what the slow mount costs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
from helpers import run_in_session
from slowfs import slow_mount_over
from truth import Saving, measure_saving

pytest.importorskip("torch")
pytestmark = pytest.mark.torch

REPO = Path(__file__).resolve().parent.parent
JOB = REPO / "tests" / "jobs" / "torch_ddp.py"
STEPS, BATCH, NPROC = 12, 4, 2
LATENCY_MS = 1.0


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    """(the samples on the slow mount, the same files on the local disk)."""

    def fill(backing: Path) -> None:
        d = backing / "data"
        d.mkdir()
        for i in range(NPROC * STEPS * BATCH):
            (d / f"sample-{i:05d}.bin").write_bytes(bytes([i % 251]) * 2048)

    tmp = tmp_path_factory.mktemp("ddpio")
    with slow_mount_over(tmp, LATENCY_MS, fill) as mnt:
        yield mnt / "data", tmp / "backing" / "data"


def torchrun(tmp: Path, files: Path, wrapped: bool) -> dict[int, dict[str, Any]]:
    tmp.mkdir(parents=True, exist_ok=True)
    out = tmp / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(NPROC)]
    if wrapped:
        cmd += ["-m", "distdiag.wrap"]
    cmd += [str(JOB), "--out", str(out), "--steps", str(STEPS), "--batch", str(BATCH), "--width", "64",
            "--files", str(files), "--workers", "2", "--timed"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTDIAG_")}
    env.update(DISTDIAG_DIR=str(tmp / "run"), PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))
    run_in_session(cmd, 400, cwd=tmp, env=env, check=True, merged=True)
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(NPROC)}


def analyze(run_dir: Path) -> dict[str, Any]:
    p = subprocess.run([sys.executable, "-m", "distdiag.cli", "analyze", str(run_dir), "--format", "json"],
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout)  # type: ignore[no-any-return]


def input_cost(rep: dict[str, Any]) -> float:
    return sum(float(f["cost_s"]) for f in rep["findings"] if f["kind"] == "input_bound")


def test_ddp_workers_reading_a_slow_mount_price_the_input_pipeline(data: tuple[Path, Path], tmp_path: Path) -> None:
    slow, local = data

    def plain(faulty: bool, i: int) -> float:
        ranks = torchrun(tmp_path / f"plain{int(faulty)}{i}", slow if faulty else local, wrapped=False)
        return float(ranks[0]["loop_s"])

    saving: Saving = measure_saving(plain, pairs=2)
    f_loop = float(torchrun(tmp_path / "faulty", slow, wrapped=True)[0]["loop_s"])
    h_loop = float(torchrun(tmp_path / "healthy", local, wrapped=True)[0]["loop_s"])
    faulty, healthy = analyze(tmp_path / "faulty" / "run"), analyze(tmp_path / "healthy" / "run")
    # the workers' reads are their ranks' children, on the slow mount
    kids = {k["rank"]: k for k in faulty["children"]}
    assert sorted(kids) == list(range(NPROC)), faulty["children"]
    for k in kids.values():
        assert k["roles"] == {"dataloader_worker": 2}, k
        fuse = [fs for fs in k["by_fs"] if "fuse" in fs["fs"]]
        assert len(fuse) == 1 and fuse[0]["bytes"] == STEPS * BATCH * 2048, k["by_fs"]
        assert fuse[0]["calls"] >= 3 * STEPS * BATCH, fuse  # a stat, an open, a close per sample at least
    # the input pipeline is what holds the job, and the report says where its input comes from
    ib = [f for f in faulty["findings"] if f["kind"] == "input_bound"]
    assert ib and faulty["findings"][0]["kind"] == "input_bound", [(f["kind"], f["cost_s"]) for f in faulty["findings"]]
    assert "fuse.slowfs" in ib[0]["advice"], ib[0]["advice"]
    # priced at what the slow mount cost these two runs (their loops' wall-clocks: the slow mount's
    # own pace moves by half beside a loaded core, so the plain runs give the noise, not the loss)
    excess = input_cost(faulty) - input_cost(healthy)
    print(f"input_bound {input_cost(faulty):.3f} s, twin {input_cost(healthy):.3f} s; the analyzed pair's loops "
          f"{f_loop:.3f} and {h_loop:.3f} s; plain: {saving}")  # fmt: skip
    saving.assert_within(excess, f_loop - h_loop, 0.25, f"input_bound less the twin's {excess:.3f} s, but the pair")
    assert saving.median_s > 0.5, saving  # the slow mount is the fault, plain too
    # the twin: nothing on the local disk is a storage finding
    loud = [(f["kind"], f["cost_s"]) for f in healthy["findings"] if f["cost_s"] > 0.02 * healthy["run"]["wall_s"]]
    assert not [k for k, _ in loud if k in ("metadata_storm", "io_bound", "io_bandwidth")], loud
