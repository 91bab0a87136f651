"""One analysis, whoever runs it (issue 19): every executor and band size gives the in-memory
report, byte for byte.

The executors (:mod:`distdiag.passes`: the local sweep in memory or streamed from the rank
files, ``--parallel``'s analysis ranks under a real ``mpiexec``) run the same passes; what
differs is how the bands are cut and where the rows live. Each case below is a run dir whose
in-memory JSON report (default bands) is the reference; each mode must give it again:

* ``bands7``: in memory, bands of ~7 rows (a band boundary inside every rank's stretch);
* ``streamed512`` / ``streamed1``: the compute phases left on disk and read band by band
  (``stream_events = 0``), bands of ~512 rows / of one rank each;
* ``parallel1`` .. ``parallel3``: ``distdiag analyze --parallel`` on K analysis ranks;
* ``parallel2_streamed``: the same on 2 analysis ranks, each streaming its phases.

The cases: every synthetic fault at two sizes; a clock model wrong enough that the causality
repair moves a rank's times (its streamed rows must be repaired alike); per-rank string ids with
rows flushed out of time order; a truncated rank file beside a file that is not HDF5 (the
warnings come back in the serial order); a hang whose missing ranks' last rows are compute
phases (streamed rows where the hang detector looks).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import Callable

import h5py
import pytest
from factories import hang_in_phases, reorder_strings_and_rows, truncate_copy
from helpers import MPIEXEC, REPO, run_in_session

from distdiag import bands
from distdiag.config import Config
from distdiag.pipeline import analyze
from distdiag.render import render
from distdiag.synth import FAULTS, synth


def _clock_repair(d: Path) -> None:
    synth(d, ranks=8, events=2000, fault="straggler", ranks_per_host=2)
    with h5py.File(d / "rank-00005.h5", "r+") as f:  # rank 5's samples claim an offset 3 ms off
        s = f["clock_sync"][...]
        s["t_ref_ns"] -= 3_000_000
        f["clock_sync"][...] = s


def _strings_reordered(d: Path) -> None:
    synth(d, ranks=6, events=3000, fault="serial", ranks_per_host=2)
    reorder_strings_and_rows(d / "rank-00002.h5")


def _damaged_and_foreign(d: Path) -> None:
    synth(d, ranks=8, events=800, fault="serial", ranks_per_host=2, seed=2)
    truncate_copy(d / "rank-00006.h5", d / "cut.h5", (d / "rank-00006.h5").stat().st_size * 2 // 3)
    (d / "cut.h5").replace(d / "rank-00006.h5")
    (d / "rank-00008.h5").write_bytes(b"not hdf5")  # not in the launch, not a rank file


def _synth(fault: str, ranks: int, events: int, per_host: int) -> Callable[[Path], None]:
    def make(d: Path) -> None:
        synth(d, ranks=ranks, events=events, fault=fault, ranks_per_host=per_host, seed=3)

    return make


CASES: dict[str, Callable[[Path], None]] = {
    **{f"{f}_12x900": _synth(f, 12, 900, 3) for f in FAULTS},
    **{f"{f}_40x3000": _synth(f, 40, 3000, 4) for f in ("straggler", "storm", "serial")},
    "clock_repair": _clock_repair,
    "strings_reordered": _strings_reordered,
    "damaged_and_foreign": _damaged_and_foreign,
    "hang_in_phases": hang_in_phases,
}
MODES = ("bands7", "streamed512", "streamed1", "parallel1", "parallel2", "parallel3", "parallel2_streamed")


def _local(run_dir: Path, stream: bool, band_events: int) -> str:
    saved = bands.BAND_EVENTS
    bands.BAND_EVENTS = band_events
    try:
        cfg = dataclasses.replace(Config(), stream_events=0 if stream else -1)
        rep = analyze(run_dir, cfg, stream=stream)
        assert bool(rep.run.streamed_kinds) == stream
        return render(rep, "json")  # type: ignore[no-any-return]
    finally:
        bands.BAND_EVENTS = saved


def _parallel(run_dir: Path, k: int, stream: bool, tmp: Path) -> str:
    if MPIEXEC is None:
        pytest.skip("needs mpiexec (pip install mpich)")
    extra: list[str] = []
    if stream:
        cfg = tmp / "stream.toml"
        cfg.write_text("[analyze]\nstream_events = 0\n")
        extra = ["--config", str(cfg)]
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    got = run_in_session([MPIEXEC, "-n", str(k), sys.executable, "-m", "distdiag.cli", "analyze", "--parallel",
                          str(run_dir), "--format", "json", *extra], 180, env=env)  # fmt: skip
    assert got.returncode == 0, got.stderr
    return got.stdout


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, str]]:
    """case -> (its run dir, its in-memory report), each made once for every mode."""
    root = tmp_path_factory.mktemp("equivalence")
    done: dict[str, tuple[Path, str]] = {}

    def get(case: str) -> tuple[Path, str]:
        if case not in done:
            d = root / case
            CASES[case](d)
            done[case] = (d, _local(d, False, bands.BAND_EVENTS))
        return done[case]

    return get


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(CASES))
def test_every_executor_and_band_size_gives_the_in_memory_report(
    made: Callable[[str], tuple[Path, str]], case: str, mode: str, tmp_path: Path
) -> None:
    run_dir, want = made(case)
    if mode == "bands7":
        got = _local(run_dir, False, 7)
    elif mode.startswith("streamed"):
        got = _local(run_dir, True, int(mode.removeprefix("streamed")))
    else:
        k = int(mode.removeprefix("parallel")[0])
        got = _parallel(run_dir, k, mode.endswith("_streamed"), tmp_path)
    assert got == want


def test_the_cases_hold_what_they_are_there_for(made: Callable[[str], tuple[Path, str]]) -> None:
    # each case must still exercise its path: a repair, remapped strings, a skipped file, a hang
    _, rep = made("clock_repair")
    assert "repaired with a controlled logical clock" in rep
    _, rep = made("damaged_and_foreign")
    assert "rank-00008.h5 is not an HDF5 file" in rep and "rank-00006.h5" in rep
    _, rep = made("hang_in_phases")
    assert '"kind": "hang"' in rep and "BACKWARD bwd" in rep
    for fault in ("straggler", "serial"):
        _, rep = made(f"{fault}_12x900")
        assert f'"kind": "{fault}' in rep
