"""``distdiag analyze --parallel``: a failure on any analysis rank ends every rank, in bounded time.

A rank that raises where the others wait for it (rank 1 while reading, or
inside the match's exchange; rank 0 while the others compute their parts)
used to leave them blocked in a receive until killed. Each case here runs a
real ``mpiexec -n 2/3`` analysis with one function replaced on one rank by
one that raises (the harness below, in the analysis process itself), and
checks that the job ends well inside its timeout (a hang fails the test),
with one line naming the rank and the error and a non-zero exit. The
healthy twin runs the same harness with nothing replaced and must give the
serial report.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
from helpers import run_in_session

from distdiag.synth import synth

MPIEXEC = shutil.which("mpiexec")
pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="needs mpiexec (pip install mpich)")
REPO = Path(__file__).resolve().parent.parent

#: argv: FAIL_RANK MODULE:ATTR EXC -- distdiag CLI args. On rank FAIL_RANK, MODULE.ATTR raises EXC.
HARNESS = r"""
import importlib, sys
from mpi4py import MPI

fail_rank, where, exc = int(sys.argv[1]), sys.argv[2], sys.argv[3]
if MPI.COMM_WORLD.Get_rank() == fail_rank:
    from distdiag.run import DistdiagError
    errors = {"IndexError": IndexError, "MemoryError": MemoryError, "DistdiagError": DistdiagError}
    mod_name, attr = where.split(":")
    mod = importlib.import_module(mod_name)
    getattr(mod, attr)  # the name must exist: a typo here would test nothing

    def boom(*args, **kwargs):
        raise errors[exc]("injected \x1b[2J failure")

    setattr(mod, attr, boom)
from distdiag.cli import main
sys.exit(main(sys.argv[5:]))
"""

#: a hang fails the test well before this; a healthy 2-3 rank analysis of these runs takes ~2-5 s
TIMEOUT_S = 120


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("par-fail") / "run"
    synth(d, ranks=8, events=2000, fault="straggler", ranks_per_host=2, seed=3)
    return d


@pytest.fixture(scope="module")
def streamed_cfg(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A config that streams every run: the collective rows stay on the ranks that read them."""
    p = tmp_path_factory.mktemp("cfg") / "stream.toml"
    p.write_text("[analyze]\nstream_events = 0\n")
    return p


def _analyze(tmp: Path, run_dir: Path, n: int, fail_rank: int, where: str, exc: str, *extra: str):  # type: ignore[no-untyped-def]
    prog = tmp / "harness.py"
    prog.write_text(HARNESS)
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    argv = [MPIEXEC or "mpiexec", "-n", str(n), sys.executable, str(prog), str(fail_rank), where, exc, "--",
            "analyze", "--parallel", str(run_dir), "--format", "json", *extra]  # fmt: skip
    return run_in_session(argv, TIMEOUT_S, env=env)


def _our_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("distdiag:")]


@pytest.mark.parametrize(
    "n, fail_rank, where, exc, streamed",
    [
        # rank 1 fails while reading its block: rank 0 waits for its tables
        (2, 1, "distdiag.parallel:_read_block", "IndexError", False),
        # rank 2 fails on the command to match: ranks 0 and 1 wait inside the match's exchange
        (3, 2, "distdiag.parallel:_match_share", "IndexError", True),
        # an analysis rank's DistdiagError has no orderly way to rank 0 either
        (2, 1, "distdiag.parallel:_match_share", "DistdiagError", True),
        # rank 0 fails in the ranking while the others compute their breakdown blocks
        (2, 0, "distdiag.pipeline:rank_findings", "MemoryError", True),
    ],
)
def test_a_failing_rank_ends_every_rank_with_one_line(tmp_path: Path, run_dir: Path, streamed_cfg: Path, n: int,
                                                      fail_rank: int, where: str, exc: str, streamed: bool) -> None:  # fmt: skip
    extra = ("--config", str(streamed_cfg)) if streamed else ()
    got = _analyze(tmp_path, run_dir, n, fail_rank, where, exc, *extra)  # a hang: TimeoutExpired, the test fails
    assert got.returncode != 0
    assert got.stdout == ""  # no report from a failed analysis
    lines = _our_lines(got.stderr)
    assert len(lines) == 1, got.stderr
    assert lines[0].startswith(f"distdiag: analysis rank {fail_rank} of {n} failed ({exc}: injected ")
    assert lines[0].endswith(f"ending all {n} analysis ranks")
    assert "\x1b" not in got.stderr.split("distdiag: analysis rank")[1]  # the message is escaped


def test_rank_0s_own_error_lets_the_others_go_and_is_the_clis_line(tmp_path: Path, run_dir: Path,
                                                                    streamed_cfg: Path) -> None:  # fmt: skip
    # a DistdiagError on rank 0 while the others compute their blocks: the orderly end
    # (rank 0 takes their parts), the CLI's one line and exit code 2, nobody aborted
    got = _analyze(tmp_path, run_dir, 3, 0, "distdiag.pipeline:rank_findings", "DistdiagError",
                   "--config", str(streamed_cfg))  # fmt: skip
    assert got.returncode == 2, got.stderr
    assert _our_lines(got.stderr) == ["distdiag: injected \\x1b[2J failure"]
    assert "MPI_Abort" not in got.stderr


def test_healthy_twin_the_harness_alone_changes_nothing(tmp_path: Path, run_dir: Path, streamed_cfg: Path) -> None:
    # the same harness with the failing rank out of range: the serial report, exit 0
    serial = run_in_session([sys.executable, "-m", "distdiag.cli", "analyze", str(run_dir), "--format", "json"],
                            TIMEOUT_S)  # fmt: skip
    assert serial.returncode == 0, serial.stderr
    got = _analyze(tmp_path, run_dir, 3, 99, "distdiag.pipeline:rank_findings", "IndexError",
                   "--config", str(streamed_cfg))  # fmt: skip
    assert got.returncode == 0, got.stderr
    assert _our_lines(got.stderr) == []
    assert got.stdout == serial.stdout
