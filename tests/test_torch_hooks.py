"""distdiag's torch hooks in one real process, and the NVML sampler.

The GPU sampler is tested against ``tests/fake_pynvml`` (a FAKE NVML module,
named as such: this machine has no GPU) and against the real nvidia-ml-py,
which here must report that the NVML library is missing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from distdiag.schema import Kind

REPO = Path(__file__).resolve().parent.parent
FAKE_NVML = REPO / "tests" / "fake_pynvml"
TIMEOUT_S = 180


def _run(args: list[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    p = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=TIMEOUT_S,
                       env=dict(os.environ, **(env or {})), cwd=cwd)  # fmt: skip
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return p


# -- torch hooks driven directly --------------------------------------------------------------------
@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    pytest.importorskip("torch")
    tmp = tmp_path_factory.mktemp("single")
    p = _run([str(REPO / "tests" / "jobs" / "torch_single.py"), str(tmp)])
    return json.loads(p.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.mark.torch
def test_install_patches_and_uninstall_restores_every_attribute(single: dict[str, Any]) -> None:
    assert all(single["wrapped"]), single["wrapped"]
    assert all(single["restored"]), single["restored"]


@pytest.mark.torch
def test_blocking_async_and_nested_collectives(single: dict[str, Any]) -> None:
    rows = [r for r in single["rows"] if r[2] == "default" and r[0] != int(Kind.WAIT)]
    # the async all_reduce's wait() names the collective it waits for (comm, seq), as MPI's Wait does
    waits = [(r[1], r[2], r[3]) for r in single["rows"] if r[0] == int(Kind.WAIT)]
    assert waits == [("Work.wait", "default", 2)], waits
    assert [(r[0], r[1], r[3]) for r in rows] == [
        (1, "all_reduce", 0),  # bound with `from torch.distributed import all_reduce` after install
        (1, "all_gather_object", 1),  # one row: its inner all_gather is not recorded twice
        (2, "all_reduce", 2),  # async_op=True
        (1, "barrier", 3),
    ]
    assert rows[0][4] == 16 and rows[2][4] == 8
    # call sites: the job's own lines (not torch's, not distdiag's), one per call
    assert all(r[5].rsplit(":", 1)[0].endswith("tests/jobs/torch_single.py") for r in rows)
    assert len({r[5] for r in rows}) == 4
    assert single["kinds"]["COLL"] == 3  # the all_reduce after uninstall is not recorded


@pytest.mark.torch
def test_meta_and_cpu_copies_are_not_host_to_device(single: dict[str, Any]) -> None:
    # with h2d_copies="on" the wrappers run on CPU: a `meta` tensor holds no data,
    # a dtype change or a CPU->CPU copy moves nothing across a bus: no H2D rows,
    # and the results are what torch returns without the shim
    assert single["h2d_results"] == ["meta", True, True, "meta"]
    assert single["kinds"]["H2D"] == 0


@pytest.mark.torch
def test_ddp_buckets_with_user_and_builtin_hooks_and_step_marks(single: dict[str, Any]) -> None:
    assert single["user_hook_calls"] == 3
    b = [r for r in single["rows"] if r[1] == "ddp_bucket_allreduce"]
    assert sorted((r[2], r[3]) for r in b) == [(f"ddp{i}:default", s) for i in (0, 1) for s in range(3)]
    assert {r[4] for r in b if r[2] == "ddp0:default"} == {(8 * 8 + 8 + 8 * 2 + 2) * 4}  # the bucket's bytes
    k = single["kinds"]
    assert k["OPTIMIZER"] == 6 and k["STEP"] == 3  # two optimizers; only the first one's steps mark iterations
    assert k["INPUT_WAIT"] == 4 and k["BACKWARD"] == 3


@pytest.mark.torch
def test_api_outside_the_wrapper_changes_nothing() -> None:
    code = (
        "import torch, distdiag\n"
        "orig = (torch.nn.Module.__call__, torch.Tensor.backward, torch.distributed.all_reduce)\n"
        "with distdiag.phase('x'):\n"
        "    y = torch.nn.Linear(2, 2)(torch.ones(2)).sum()\n"
        "distdiag.step(samples=4, tokens=8, flops=1e9)\n"
        "assert (torch.nn.Module.__call__, torch.Tensor.backward, torch.distributed.all_reduce) == orig\n"
        "from distdiag.shim import session, recorder\n"
        "assert session.SESSION is None and recorder.RECORDER is None\n"
        "print('ok', float(y) == float(y))\n"
    )
    assert _run(["-c", code]).stdout.strip() == "ok True"


# -- NVML -------------------------------------------------------------------------------------------
def _sampler_in_subprocess(env: dict[str, str], code: str) -> dict[str, Any]:
    env = dict(env, PYTHONPATH=os.pathsep.join([str(FAKE_NVML), os.environ.get("PYTHONPATH", "")]))
    return json.loads(_run(["-c", code], env=env).stdout)  # type: ignore[no-any-return]


_SAMPLE = """
import json, time, numpy, pynvml  # numpy first: the sampler's first row would import it (~0.2 s on a busy core)
from types import SimpleNamespace
from distdiag.shim.hooks import nvml
rows, attrs = [], {}
s = nvml.start_sampler(SimpleNamespace(gpu_interval_s=0.02), rows.append, attrs.__setitem__, %s)
time.sleep(0.2)
if s: s.stop()
r = [x.tolist() for b in rows for x in b]
print(json.dumps({"fake": getattr(pynvml, "FAKE", False), "attrs": attrs, "rows": r}))
"""


def test_sampler_against_the_fake_nvml_module() -> None:
    d = _sampler_in_subprocess({"FAKE_NVML_GPUS": "4"}, _SAMPLE % "local_rank=1, local_world=4, environ={}")
    assert d["fake"] is True  # the FAKE module, not NVIDIA's
    assert d["attrs"]["gpu_sampler"].startswith("on: 1 GPU")
    assert json.loads(d["attrs"]["gpu_names"]) == {"1": "FAKE NVIDIA H100 80GB HBM3"}
    rows = d["rows"]
    assert len(rows) >= 4
    t, gpu, sm, mem, clk, used, pw, tx, rx, nvl = rows[-1][:10]  # then throttle reasons, temperature, XID
    assert gpu == 1 and sm == 97 and mem == 35 and clk == 1755 and used == (20 << 30) + 1 and pw == 350.0
    assert tx == 1000 * 1024 and rx == 2000 * 1024  # KB/s -> bytes/s
    assert nvl == pytest.approx(2 * (1 << 30), rel=0.05)  # tx + rx counters, 1 GiB/s each
    assert np.isnan(rows[0][9])  # no rate before the second sample
    assert all(r[0] > 0 for r in rows)


def test_sampler_visible_devices_and_unsupported_metrics() -> None:
    env = {"FAKE_NVML_GPUS": "4", "FAKE_NVML_NO_NVLINK": "1"}
    d = _sampler_in_subprocess(env, _SAMPLE % "local_rank=0, local_world=1, environ={'CUDA_VISIBLE_DEVICES': 'GPU-fake-0003,1'}")
    assert sorted(json.loads(d["attrs"]["gpu_names"])) == ["1", "3"]
    assert {r[1] for r in d["rows"]} == {1, 3}
    assert all(np.isnan(r[9]) for r in d["rows"])  # NVLink not supported: NaN, not an error


def test_sampler_off_without_the_library() -> None:
    d = _sampler_in_subprocess({"FAKE_NVML_FAIL": "library_not_found"}, _SAMPLE % "")
    assert d["attrs"] == {"gpu_sampler": "off: NVML library not found"} and d["rows"] == []


def test_real_nvml_on_this_machine_says_off_in_the_rank_file(tmp_path: Path) -> None:
    """With nvidia-ml-py and no GPU, the wrapped job's file says why there are no GPU samples."""
    pytest.importorskip("pynvml")
    import pynvml

    if getattr(pynvml, "FAKE", False):
        pytest.skip("the fake module shadows nvidia-ml-py here")
    try:
        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        pytest.skip("this machine has a working NVML")
    except pynvml.NVMLError:
        pass
    # a GPU program imports numpy (torch does): the sampler starts then (not before the
    # program's own imports), and finds no NVML library here
    (tmp_path / "job.py").write_text("import numpy, time\ntime.sleep(0.5)\nprint('hi')\n")
    _run(["-m", "distdiag.wrap", "job.py"], env={"DISTDIAG_DIR": str(tmp_path / "run"), "DISTDIAG_HOOKS": "fileio=0"}, cwd=tmp_path)
    import h5py

    (f,) = (tmp_path / "run").glob("rank-*.h5")
    with h5py.File(f, "r") as h:
        assert h.attrs["gpu_sampler"] == "off: NVML library not found"
        assert len(h["gpu"]) == 0


def test_wrapped_job_records_fake_gpu_samples(tmp_path: Path) -> None:
    # the sampler starts at numpy's import, in a thread of its own (pynvml's import: ~0.2 s, more under load)
    (tmp_path / "job.py").write_text("import numpy, time\ntime.sleep(2.0)\n")
    env = {"DISTDIAG_DIR": str(tmp_path / "run"), "DISTDIAG_HOOKS": "fileio=0", "DISTDIAG_GPU_INTERVAL_S": "0.05",
           "FAKE_NVML_GPUS": "1", "PYTHONPATH": os.pathsep.join([str(FAKE_NVML), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    _run(["-m", "distdiag.wrap", "job.py"], env=env, cwd=tmp_path)
    from distdiag.run import load_run

    run = load_run(tmp_path / "run")
    assert len(run.gpu) >= 5
    assert np.all(run.gpu["sm_util_pct"] == 97) and np.all(run.gpu["rank"] == 0)
