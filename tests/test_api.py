"""distdiag.phase / step / mark: records under the wrapper, nothing (and no error) without it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import h5py
import numpy as np
import pytest

import distdiag
from distdiag import api
from distdiag.schema import Kind
from distdiag.shim import session

from test_wrap import WRAP_CONSOLE, clean_env


def test_without_the_wrapper_they_do_nothing_and_never_raise() -> None:
    assert session.SESSION is None

    def f(x: int) -> int:
        return x + 1

    assert distdiag.phase("x")(f) is f  # the decorator returns the function itself
    with distdiag.phase("y") as p:
        pass
    assert p is api._NULL
    assert distdiag.step(samples=3, tokens=4, flops=5.0) is None
    assert distdiag.step(samples="garbage") is None  # type: ignore[arg-type]
    assert distdiag.mark("m") is None
    with pytest.raises(KeyError):  # the user's exception passes through untouched
        with distdiag.phase("z"):
            raise KeyError("k")


class _FakeSession:
    """A Session stand-in holding a real Recorder (only .rec is read by the API)."""

    def __init__(self) -> None:
        from distdiag.shim.recorder import Recorder

        self.rec = Recorder(chunk_rows=128)


def _rows(rec) -> np.ndarray:  # type: ignore[no-untyped-def]
    from distdiag.shim.recorder import as_events

    tb = rec.buffers[0]
    return as_events(tb.buf, 0, tb.n)


def test_phase_step_mark_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakeSession()
    monkeypatch.setattr(session, "SESSION", fake)
    rec = fake.rec

    @distdiag.phase("deco")
    def work() -> int:
        return 42

    with distdiag.phase("outer"):
        with distdiag.phase("inner"):
            pass
        assert work() == 42
    distdiag.step(samples=8, tokens=1024, flops=2.5e9)
    distdiag.step()
    distdiag.mark("ckpt")
    with pytest.raises(ValueError):
        with distdiag.phase("failing"):
            raise ValueError("x")
    ev = _rows(rec)
    s = rec.strings.strings
    got = [(int(k), s[n]) for k, n in zip(ev["kind"], ev["name_id"])]
    assert got == [(Kind.PHASE, "inner"), (Kind.PHASE, "deco"), (Kind.PHASE, "outer"), (Kind.STEP, "step"),
                   (Kind.STEP, "step"), (Kind.MARK, "ckpt"), (Kind.PHASE, "failing")]
    outer, inner = ev[2], ev[0]
    assert outer["t0_ns"] <= inner["t0_ns"] <= inner["t1_ns"] <= outer["t1_ns"]
    step = ev[3]
    assert (step["nbytes"], step["aux"], step["value"], step["t0_ns"] == step["t1_ns"]) == (8, 1024, 2.5e9, True)
    assert (ev[4]["nbytes"], ev[4]["aux"], ev[4]["value"]) == (0, 0, 0.0)
    mark_line = next(i for i, line in enumerate(Path(__file__).read_text().splitlines(), 1) if 'mark("ckpt")' in line)
    assert s[ev[5]["site_id"]] == f"{Path(__file__).resolve()}:{mark_line}"


def test_broken_recorder_never_reaches_the_user(monkeypatch: pytest.MonkeyPatch) -> None:
    class Broken:
        rec = None  # every recorder call raises AttributeError

    monkeypatch.setattr(session, "SESSION", Broken())
    with distdiag.phase("p"):
        pass
    distdiag.step(samples=1)
    distdiag.mark("m")
    assert distdiag.phase("q")(len)([1, 2]) == 2


def test_api_under_the_real_wrapper(tmp_path: Path) -> None:
    prog = tmp_path / "train.py"
    prog.write_text(textwrap.dedent(
        """
        import time, distdiag

        @distdiag.phase("evaluate")
        def evaluate():
            time.sleep(0.02)

        for i in range(3):
            with distdiag.phase("load"):
                time.sleep(0.01)
            distdiag.step(samples=64, tokens=64 * 128)
        evaluate()
        distdiag.mark("done")
        print("ok")
        """
    ))
    p = subprocess.run([*WRAP_CONSOLE, "--dir", str(tmp_path / "run"), sys.executable, str(prog)], cwd=tmp_path,
                       env=clean_env(), capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout == "ok\n", p.stderr
    with h5py.File(tmp_path / "run" / "rank-00000.h5", "r") as f:
        ev, s = f["events"][:], f["strings"].asstr()[:]
    names = s[ev["name_id"]]
    load = ev[(ev["kind"] == Kind.PHASE) & (names == "load")]
    assert len(load) == 3 and np.all(load["t1_ns"] - load["t0_ns"] >= 10_000_000)
    steps = ev[ev["kind"] == Kind.STEP]
    assert len(steps) == 3 and set(steps["nbytes"]) == {64} and set(steps["aux"]) == {64 * 128}
    ev_eval = ev[(ev["kind"] == Kind.PHASE) & (names == "evaluate")]
    assert len(ev_eval) == 1 and ev_eval["t1_ns"][0] - ev_eval["t0_ns"][0] >= 20_000_000
    assert s[ev_eval["site_id"][0]] == f"{prog}:4"
    assert list(names[ev["kind"] == Kind.MARK]) == ["done"]
