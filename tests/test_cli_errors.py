"""`distdiag analyze` as a subprocess: one-line errors, exit code 2 only when nothing can be analyzed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from factories import make_run, set_attr, truncate_copy, write_foreign_h5


def cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "distdiag.cli", *args], capture_output=True, text=True,
                          timeout=120, cwd=cwd)  # fmt: skip


def one_line_error(p: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    assert p.stdout == ""
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("distdiag: ") and "Traceback" not in p.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def _bad_dir(tmp_path: Path, kind: str) -> Path:
    d = tmp_path / "run"
    if kind == "nonexistent":
        return d
    d.mkdir()
    if kind == "empty":
        return d
    if kind == "foreign":
        write_foreign_h5(d / "rank-00000.h5")
    elif kind == "not_hdf5":
        (d / "rank-00000.h5").write_text("not hdf5 at all\n")
    elif kind == "truncated":
        t = make_run(tmp_path / "src", world_size=2, iters=20)
        truncate_copy(t.files[0], d / "rank-00000.h5", 4000)
    elif kind == "other_version":
        t = make_run(d, world_size=2, iters=5)
        for f in t.files.values():
            set_attr(f, "distdiag_schema", 7)
            set_attr(f, "distdiag_version", "3.0.0")
    return d


@pytest.mark.parametrize(
    "kind, needles",
    [
        ("nonexistent", ["does not exist"]),
        ("empty", ["holds no rank-*.h5 files (did the job run under distdiag-wrap?)"]),
        ("foreign", ["rank-00000.h5 is an HDF5 file but not a distdiag rank file"]),
        ("not_hdf5", ["rank-00000.h5 is not an HDF5 file"]),
        ("truncated", ["rank-00000.h5 cannot be opened as HDF5 (truncated or corrupt: 4000 of"]),
        ("other_version", ["schema 7", "distdiag==3.0.0", "(and 1 more)"]),
    ],
)
def test_nothing_to_analyze_is_one_line_and_exit_2(tmp_path: Path, kind: str, needles: list[str]) -> None:
    one_line_error(cli("analyze", str(_bad_dir(tmp_path, kind))), *needles)


def test_a_file_instead_of_a_dir(tmp_path: Path) -> None:
    t = make_run(tmp_path / "r", world_size=2, iters=5)
    one_line_error(cli("analyze", str(t.files[0])), "is not a directory")


def test_missing_rank_is_analyzed_with_a_warning(tmp_path: Path) -> None:
    make_run(tmp_path / "r", iters=20, skip_ranks=[1])
    p = cli("analyze", str(tmp_path / "r"), "--format", "json")
    assert p.returncode == 0, p.stderr
    rep = json.loads(p.stdout)
    assert rep["run"]["missing_ranks"] == [1] and rep["run"]["ranks"] == 4
    assert any("no usable file: 1" in w for w in rep["run"]["warnings"])
    t = cli("analyze", str(tmp_path / "r"))
    assert t.returncode == 0 and "WARNINGS" in t.stdout and "3 of 4 ranks" in t.stdout


def test_bad_files_next_to_good_ones_are_warnings_not_errors(tmp_path: Path) -> None:
    t = make_run(tmp_path / "r", iters=20)
    truncate_copy(t.files[1], tmp_path / "cut.h5", 3000)
    (tmp_path / "cut.h5").replace(t.files[1])
    write_foreign_h5(t.files[2])
    p = cli("analyze", str(tmp_path / "r"), "--format", "json")
    assert p.returncode == 0, p.stderr
    rep = json.loads(p.stdout)
    assert rep["run"]["missing_ranks"] == [1, 2]
    w = " | ".join(rep["run"]["warnings"])
    assert "rank-00001.h5 cannot be opened" in w and "rank-00002.h5 is an HDF5 file but not a distdiag" in w


def test_output_file_and_config_override(tmp_path: Path) -> None:
    make_run(tmp_path / "r", iters=50, slow_rank=2, slow_ms=1.0)
    out = tmp_path / "rep.json"
    p = cli("analyze", str(tmp_path / "r"), "--format", "json", "-o", str(out))
    assert p.returncode == 0 and p.stdout == ""
    assert [f["ranks"] for f in json.loads(out.read_text())["findings"]] == [[2]]
    cfg = tmp_path / "strict.toml"
    cfg.write_text("[analyze.straggler]\nmin_fraction = 0.9\n")
    p = cli("analyze", str(tmp_path / "r"), "--format", "json", "--config", str(cfg))
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["findings"] == []


@pytest.mark.parametrize(
    "content, needle",
    [(None, "config file"), ("[analyze\nmin_fraction = ", "cannot be read"),
     ('[analyze]\nmin_fraction = "lots"\n', "min_fraction")],  # fmt: skip
)
def test_bad_config_is_one_line(tmp_path: Path, content: str | None, needle: str) -> None:
    make_run(tmp_path / "r", world_size=2, iters=5)
    cfg = tmp_path / "c.toml"
    if content is not None:
        cfg.write_text(content)
    one_line_error(cli("analyze", str(tmp_path / "r"), "--config", str(cfg)), needle)


def test_usage_errors_exit_2(tmp_path: Path) -> None:
    p = cli()
    assert p.returncode == 2
    p = cli("analyze", str(tmp_path), "--format", "pdf")
    assert p.returncode == 2 and "invalid choice" in p.stderr and "Traceback" not in p.stderr


def test_unwritable_output_is_one_line(tmp_path: Path) -> None:
    make_run(tmp_path / "r", world_size=2, iters=5)
    one_line_error(cli("analyze", str(tmp_path / "r"), "-o", str(tmp_path / "no" / "such" / "dir" / "x.txt")),
                   "cannot write")  # fmt: skip
