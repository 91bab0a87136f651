"""The shim is a guest of programs that initialize MPI themselves, pickle communicators, or
probe over NCCL (issue 17, items 11-13).

Items 12 and 13 run real ``mpiexec -n 2`` jobs plain and under ``distdiag-wrap`` and compare:
exit code, output, what each rank saw, and (wrapped) the rows recorded.
Item 11 (the GPU the NCCL link probe uses) needs a GPU this machine does not have: its
tests run in this process with named FAKES for torch.cuda and the process group, and
were not run on a real GPU.
"""

from __future__ import annotations

import json
import os
import re
import sys
import types
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
from helpers import MPIEXEC, REPO, run_in_session

from distdiag.run import Run, load_run
from distdiag.schema import Kind

JOBS = Path(__file__).parent / "jobs"
INIT_JOB = JOBS / "mpi_self_init.py"
PICKLE_JOB = JOBS / "mpi_pickle_comm.py"
TIMEOUT_S = 180


def _env() -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "DISTDIAG_"))}
    e["PYTHONPATH"] = str(REPO)
    e["DISTDIAG_SLURM_OFFLINE"] = "1"
    return e


def _mpi(tmp: Path, job: Path, *args: str, wrap: list[str] | None = None) -> tuple[Any, list[dict[str, Any]]]:
    """Run ``job`` on 2 ranks (under distdiag-wrap with ``wrap`` flags when given); (process, per-rank json)."""
    if MPIEXEC is None:
        pytest.fail("mpiexec not found: install the 'mpi' extra (mpi4py + mpich)")
    out = tmp / "out"
    out.mkdir(parents=True)
    pre = [] if wrap is None else [sys.executable, "-m", "distdiag.wrap", "--dir", str(tmp / "run"), *wrap]
    cmd = [MPIEXEC, "-n", "2", *pre, sys.executable, str(job), str(out), *args]
    p = run_in_session(cmd, TIMEOUT_S, env=_env())
    res = [json.loads(f.read_text()) for f in sorted(out.glob("*.json"))]
    return p, res


def _colls(run: Run, rank: int) -> list[tuple[str, int, str]]:
    ev = run.events
    c = ev[(ev["rank"] == rank) & np.isin(ev["kind"], [int(Kind.COLL), int(Kind.COLL_ASYNC)])]
    return sorted((run.s(int(k)), int(q), run.s(int(n))) for k, q, n in zip(c["comm_id"], c["seq"], c["name_id"]))


def _named(run: Run, rank: int, kind: Kind, name: str) -> np.ndarray:
    ev = run.events
    return ev[(ev["rank"] == rank) & (ev["kind"] == int(kind)) & (ev["name_id"] == run.sid(name))]


LINE = re.compile(r"rank \d \w+ done")


# -- item 12: programs that initialize MPI themselves -------------------------------------
@pytest.fixture(scope="module")
def auto_colls(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[tuple[str, int, str]]]:
    """What a program that lets mpi4py initialize at import records: the reference."""
    tmp = tmp_path_factory.mktemp("auto")
    p, _ = _mpi(tmp, INIT_JOB, "auto", wrap=[])
    assert p.returncode == 0, p.stderr
    run = load_run(tmp / "run")
    return {r: _colls(run, r) for r in (0, 1)}


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["init", "thread"])
def test_program_that_calls_init_itself_runs_as_plain_and_records_alike(
    tmp_path: Path, mode: str, auto_colls: dict[int, list[tuple[str, int, str]]]
) -> None:
    plain, plain_res = _mpi(tmp_path / "plain", INIT_JOB, mode)
    wrapped, wrapped_res = _mpi(tmp_path / "wrapped", INIT_JOB, mode, wrap=[])
    assert plain.returncode == 0, plain.stderr
    # exit code, output and what the program saw (thread level included) as without us
    assert wrapped.returncode == 0, wrapped.stderr
    assert "MPICH" not in wrapped.stderr and "Attempting" not in wrapped.stderr, wrapped.stderr
    assert sorted(LINE.findall(wrapped.stdout)) == sorted(LINE.findall(plain.stdout)) and len(LINE.findall(plain.stdout)) == 2
    assert wrapped_res == plain_res and len(plain_res) == 2
    assert plain_res[0]["initialized_at_import"] is False
    if mode == "thread":
        assert plain_res[0]["provided"] == plain_res[0]["query_thread"]
    run = load_run(tmp_path / "wrapped" / "run")
    for r in (0, 1):
        # the same collectives, keys and sequence numbers as a program initialized at import
        assert _colls(run, r) == auto_colls[r]
        assert ("world", 0, "Barrier") in auto_colls[r] and ("world.dup0", 0, "bcast") in auto_colls[r]
        # COMM_WORLD's row maps the communicator and spans the program's own MPI_Init
        w = _named(run, r, Kind.COMM_CREATE, "world")
        before, after = _named(run, r, Kind.MARK, "before_init"), _named(run, r, Kind.MARK, "after_init")
        assert len(w) == 1 and len(before) == 1 and len(after) == 1
        assert [int(w["peer"][0]), int(w["aux"][0])] == [r, 2]
        assert int(before["t0_ns"][0]) <= int(w["t0_ns"][0]) <= int(w["t1_ns"][0]) <= int(after["t0_ns"][0])
        assert len(_named(run, r, Kind.COMM_CREATE, "self")) == 1
    # rank 1 worked 1 s before its MPI_Init: rank 0 spent it inside its own
    w0 = _named(run, 0, Kind.COMM_CREATE, "world")
    assert int(w0["t1_ns"][0]) - int(w0["t0_ns"][0]) > 0.5e9


@pytest.mark.mpi
def test_program_that_never_initializes_mpi(tmp_path: Path) -> None:
    plain, plain_res = _mpi(tmp_path / "plain", INIT_JOB, "never")
    wrapped, wrapped_res = _mpi(tmp_path / "wrapped", INIT_JOB, "never", wrap=[])
    assert plain.returncode == 0 and wrapped.returncode == 0, wrapped.stderr
    assert "MPICH" not in wrapped.stderr and "Attempting" not in wrapped.stderr, wrapped.stderr
    assert wrapped_res == plain_res and plain_res[0]["initialized"] is False
    run = load_run(tmp_path / "wrapped" / "run")
    ev = run.events
    assert not (ev["kind"] == int(Kind.COMM_CREATE)).any()
    assert len(_named(run, 0, Kind.MARK, "after_init")) == 1  # the rank file is whole


@pytest.mark.mpi
def test_program_that_finalizes_itself(tmp_path: Path, auto_colls: dict[int, list[tuple[str, int, str]]]) -> None:
    """MPI.Finalize by the program: the shim makes no MPI call after it (MPICH would abort)."""
    plain, plain_res = _mpi(tmp_path / "plain", INIT_JOB, "finalize")
    wrapped, wrapped_res = _mpi(tmp_path / "wrapped", INIT_JOB, "finalize", wrap=[])
    assert plain.returncode == 0 and wrapped.returncode == 0, wrapped.stderr
    assert "MPICH" not in wrapped.stderr and "Attempting" not in wrapped.stderr, wrapped.stderr
    assert wrapped_res == plain_res and plain_res[0]["finalized"] is True
    run = load_run(tmp_path / "wrapped" / "run")
    assert _colls(run, 0) == auto_colls[0] and _colls(run, 1) == auto_colls[1]


@pytest.mark.mpi
def test_link_probe_waits_for_the_programs_own_init(tmp_path: Path) -> None:
    wrapped, res = _mpi(tmp_path, INIT_JOB, "thread", wrap=["--probe-links"])
    assert wrapped.returncode == 0, wrapped.stderr
    assert res[0]["sum"] == 3 and res[0]["type"] == "Intracomm"
    run = load_run(tmp_path / "run")
    for r in (0, 1):
        span = _named(run, r, Kind.PROBE, "probe")
        assert len(span) == 1
        assert int(span["t0_ns"][0]) >= int(_named(run, r, Kind.COMM_CREATE, "world")["t1_ns"][0])
    assert _colls(run, 0) == _colls(run, 1) and ("world", 0, "Barrier") in _colls(run, 0)


# -- item 13: pickling communicators ---------------------------------------------------------
@pytest.mark.mpi
def test_communicators_pickle_as_without_the_wrapper(tmp_path: Path) -> None:
    plain, plain_res = _mpi(tmp_path / "plain", PICKLE_JOB)
    wrapped, wrapped_res = _mpi(tmp_path / "wrapped", PICKLE_JOB, wrap=[])
    assert plain.returncode == 0, plain.stderr
    assert wrapped.returncode == 0, wrapped.stderr
    assert len(plain_res) == 2 and len(wrapped_res) == 2
    for p, w in zip(plain_res, wrapped_res):
        assert {k: w[k] for k in p} == p
    p0 = plain_res[0]
    # what plain mpi4py does, which the wrapped run matched: the constants come back as themselves ...
    assert p0["world"] == ["ok", ["comm", "Intracomm", True, False, False, True, False, True]]
    assert p0["self"][1][3] is True and p0["null"][1][4] is True
    # ... a duplicate is not picklable, with mpi4py's own error
    assert p0["dup"] == ["raise", "ValueError", "cannot serialize 'mpi4py.MPI.Intracomm' instance"]
    assert p0["type_world"] == ["ok", ["class", "Intracomm", True, False]]
    # a pickle made under the wrapper loads where distdiag does not run, and never names distdiag
    assert wrapped_res[0]["elsewhere"] == [0, "True True Intracomm True", False]
    assert p0["checks"][:4] == [True, True, True, True]


# -- item 11: the GPU of the NCCL link probe (FAKES: no GPU here) -------------------------------
class FakeNcclGroup:
    """FAKE process group: says it runs NCCL; delegates the rest to a real gloo group."""

    def __init__(self, real: Any, bound: Any = None) -> None:
        self._real = real
        self.bound_device_id = bound

    def name(self) -> str:
        return "nccl"

    def __getattr__(self, k: str) -> Any:
        return getattr(self._real, k)


class FakeCuda:
    """FAKE torch.cuda state: CUDA 'available', a current device the program sets."""

    def __init__(self) -> None:
        self.current = 0

    def install(self, mp: pytest.MonkeyPatch, torch: Any) -> None:
        mp.setattr(torch.cuda, "is_available", lambda: True)
        mp.setattr(torch.cuda, "current_device", lambda: self.current)
        mp.setattr(torch.cuda, "set_device", lambda d: setattr(self, "current", int(d)))


def test_probe_device_follows_device_id_or_the_bound_device_and_else_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    from distdiag.shim import probe

    cuda = FakeCuda()
    cuda.install(monkeypatch, torch)
    monkeypatch.setattr(probe, "_is_nccl", lambda pg: pg.name() == "nccl")
    cuda.current = 2
    nccl = FakeNcclGroup(None)
    assert probe.torch_probe_device(nccl, None) is None  # not known yet: wait for the first call
    assert probe.torch_probe_device(nccl, 3) == torch.device("cuda", 3)
    assert probe.torch_probe_device(nccl, torch.device("cuda:1")) == torch.device("cuda", 1)
    assert probe.torch_probe_device(nccl, torch.device("cuda")) == torch.device("cuda", 2)
    assert probe.torch_probe_device(FakeNcclGroup(None, bound=torch.device("cuda", 5)), None) == torch.device("cuda", 5)
    gloo = types.SimpleNamespace(name=lambda: "gloo")
    assert probe.torch_probe_device(gloo, None) == torch.device("cpu")
    # device_id as the program passed it to init_process_group, by keyword or by position
    import torch.distributed as dist

    ipg = dist.init_process_group
    assert probe._device_id_of(ipg, ("nccl",), {"device_id": 3}) == 3
    assert probe._device_id_of(ipg, ("nccl", None, None, -1, -1, None, "", None, 6), {}) == 6
    assert probe._device_id_of(ipg, ("nccl",), {}) is None
    # at the first call: the device of its CUDA tensor, else the current device read then
    cuda.current = 4
    assert probe.device_at_call((torch.zeros(1),), {}) == torch.device("cuda", 4)


def fake_transport(note: Callable[[Any], Any]) -> type:
    """A FAKE TorchTransport class: ``note(device)`` when made; one rank, so no probe runs."""

    class FakeTransport:
        name = "torch"

        def __init__(self, pg: Any, timeout_s: float, device: Any = None) -> None:
            note(device)
            self.rank, self.world_size = 0, 1

    return FakeTransport


def test_nccl_probe_runs_at_the_first_collective_on_the_device_set_after_init(monkeypatch: pytest.MonkeyPatch) -> None:
    """init_process_group, then set_device(1), then all_reduce: the probe runs at the all_reduce on cuda:1
    (FAKE cuda and FAKE NCCL group; a real one-rank gloo group underneath; FakeTransport keeps the CPU)."""
    torch = pytest.importorskip("torch")
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    from distdiag.shim import probe
    from distdiag.shim.recorder import Recorder

    cuda = FakeCuda()
    cuda.install(monkeypatch, torch)
    seen: list[tuple[Any, int, int]] = []
    order: list[str] = []

    monkeypatch.setattr(probe, "TorchTransport", fake_transport(lambda device: seen.append((device, cuda.current,
                                                                                               len(order)))))  # fmt: skip
    monkeypatch.setattr(probe, "_is_nccl", lambda pg: pg.name() == "nccl")
    real_default = distributed_c10d._get_default_group
    fakes: dict[Any, FakeNcclGroup] = {}

    def fake_default_group() -> Any:  # FAKE: the default group, seen as NCCL
        real = real_default()
        return fakes.setdefault(id(real), FakeNcclGroup(real))

    monkeypatch.setattr(distributed_c10d, "_get_default_group", fake_default_group)
    orig_all_reduce = dist.all_reduce
    probe.install(Recorder(), types.SimpleNamespace(probe_links=True))
    try:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        order.append("init returned")
        assert seen == []  # no device chosen yet: nothing probed inside init_process_group
        torch.cuda.set_device(1)
        t = torch.ones(3)
        dist.all_reduce(t)
        assert t.tolist() == [1.0, 1.0, 1.0]
        assert seen == [(torch.device("cuda", 1), 1, 1)]
        assert dist.all_reduce is orig_all_reduce  # the one-shot wrappers stepped aside
        dist.barrier()
        assert len(seen) == 1
    finally:
        probe.uninstall()
        if dist.is_initialized():
            dist.destroy_process_group()
    assert dist.all_reduce is orig_all_reduce


def test_nccl_probe_with_device_id_runs_at_init(monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    from distdiag.shim import probe
    from distdiag.shim.recorder import Recorder

    cuda = FakeCuda()
    cuda.install(monkeypatch, torch)
    seen: list[Any] = []

    monkeypatch.setattr(probe, "TorchTransport", fake_transport(seen.append))
    monkeypatch.setattr(probe, "_is_nccl", lambda pg: True)  # FAKE: NCCL
    monkeypatch.setattr(probe, "_device_id_of", lambda orig, a, k: 3)  # FAKE: as if device_id=3 was given
    probe.install(Recorder(), types.SimpleNamespace(probe_links=True))
    try:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        assert seen == [torch.device("cuda", 3)]
        assert probe._torch_pending is None and distributed_c10d._get_default_group() is not None
    finally:
        probe.uninstall()
        if dist.is_initialized():
            dist.destroy_process_group()


def test_a_one_rank_mpi_singleton_does_not_spend_the_torch_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    """A torchrun program that also imports mpi4py (some libraries do) runs MPI as a singleton of one
    rank: nothing to probe there, and the one probe of the process must still run on the torch group.
    (It was spent on the singleton: the torch group, the one spanning the ranks, was never probed.)
    Real mpi4py, imported in this process as such a program does; FAKE cuda and transport as above."""
    pytest.importorskip("mpi4py.MPI")  # MPI_Init at import: a singleton of one rank here
    torch = pytest.importorskip("torch")
    import torch.distributed as dist

    from distdiag.shim import probe
    from distdiag.shim.recorder import Recorder

    FakeCuda().install(monkeypatch, torch)
    made: list[tuple[str, Any]] = []

    monkeypatch.setattr(probe, "TorchTransport", fake_transport(lambda device: made.append(("torch", device))))
    monkeypatch.setattr(probe, "_is_nccl", lambda pg: True)  # FAKE: NCCL
    monkeypatch.setattr(probe, "_device_id_of", lambda orig, a, k: 2)  # FAKE: as if device_id=2 was given
    probe.install(Recorder(), types.SimpleNamespace(probe_links=True))  # mpi4py.MPI is imported: its probe runs now
    try:
        assert made == [] and not probe._done  # the singleton probed nothing and spent nothing
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        assert made == [("torch", torch.device("cuda", 2))]
    finally:
        probe.uninstall()
        if dist.is_initialized():
            dist.destroy_process_group()
