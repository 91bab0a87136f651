"""`distdiag analyze` turns numpy's huge-page advice off in its own process (``cli._no_huge_page_advice``:
fresh 2 MB pages cost the analysis far more than they save, benchmarks/NOTES.md "Huge pages"),
unless ``NUMPY_MADVISE_HUGEPAGE`` says otherwise; the library API leaves the caller's numpy alone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from factories import make_run

PROBE = """
import sys
try:
    from numpy._core import multiarray
except ImportError:
    from numpy.core import multiarray
before = multiarray._get_madvise_hugepage()
if sys.argv[1] == "cli":
    from distdiag import cli
    rc = cli.main(["analyze", sys.argv[2], "-f", "json", "-o", sys.argv[3]])
else:
    from distdiag.pipeline import analyze
    rc = 0 if analyze(sys.argv[2]).findings is not None else 1
print(rc, before, multiarray._get_madvise_hugepage())
"""


def _probe(tmp_path: Path, how: str, env_value: str | None) -> list[str]:
    run = make_run(tmp_path / "run", world_size=2, iters=20).run_dir
    env = {k: v for k, v in os.environ.items() if k != "NUMPY_MADVISE_HUGEPAGE"}
    if env_value is not None:
        env["NUMPY_MADVISE_HUGEPAGE"] = env_value
    p = subprocess.run([sys.executable, "-c", PROBE, how, str(run), str(tmp_path / "out.json")],
                       capture_output=True, text=True, timeout=120, env=env)  # fmt: skip
    assert p.returncode == 0, p.stderr
    return p.stdout.split()


def test_the_cli_analysis_runs_without_huge_page_advice(tmp_path: Path) -> None:
    rc, _before, after = _probe(tmp_path, "cli", None)
    assert (rc, after) == ("0", "False")
    assert (tmp_path / "out.json").stat().st_size > 0


@pytest.mark.parametrize("value", ["1", "0"])
def test_numpy_s_own_knob_wins(tmp_path: Path, value: str) -> None:
    rc, before, after = _probe(tmp_path, "cli", value)
    assert rc == "0"
    assert after == before == str(value == "1")


def test_the_library_api_leaves_numpy_as_the_caller_set_it(tmp_path: Path) -> None:
    rc, before, after = _probe(tmp_path, "lib", None)
    assert rc == "0" and after == before
