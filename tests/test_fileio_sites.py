"""Call sites of file rows made deep inside library imports (fileio._site's module-frame cache).

A stat made while a library package imports its sub-modules is attributed to
the program's ``import`` line, however deeply the library's imports nest; the
cache that makes that cheap (one entry per running library module body) must
never hand one import's line to another import, nor outlive the import.
"""

from __future__ import annotations

import importlib
import os
import sys
import textwrap
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from distdiag.schema import Kind
from distdiag.shim.hooks import fileio
from distdiag.shim.recorder import Recorder, as_events


def _events(rec: Recorder) -> np.ndarray:
    parts = [as_events(b, 0, n) for b, n in rec.full] + [as_events(tb.buf, 0, tb.n) for tb in rec.buffers]
    return np.concatenate(parts) if parts else np.zeros(0)


def _make_lib(root: Path, name: str, depth: int) -> None:
    """Package ``name``: sub-modules import each other ``depth`` deep; the innermost stats a file."""
    pkg = root / name
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("from . import m1\n")
    for i in range(1, depth + 1):
        nxt = f"from . import m{i + 1}\n" if i < depth else "import os\nos.stat(__file__)\nos.path.exists(__file__ + '.nope')\n"
        (pkg / f"m{i}.py").write_text(nxt)
    (pkg / "late.py").write_text(
        textwrap.dedent("""
            import os
            def probe(p):
                return os.path.exists(p)
        """)
    )


@pytest.fixture
def libroot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Path, Recorder]]:
    """A directory whose code counts as library code (like site-packages), on sys.path, hook on."""
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.setattr(fileio, "_LIB_PREFIXES", (*fileio._LIB_PREFIXES, str(root) + os.sep))
    monkeypatch.syspath_prepend(str(root))
    rec = Recorder(chunk_rows=4096)
    fileio.install(rec, None)
    try:
        yield root, rec
    finally:
        fileio.uninstall()
        for m in [m for m in sys.modules if m.startswith("ddlib_")]:
            del sys.modules[m]


def _sites_of(rec: Recorder, path_suffix: str) -> set[str]:
    ev = _events(rec)
    ids = {i for s, i in rec.strings.ids.items() if s.endswith(path_suffix)}
    sel = ev[np.isin(ev["name_id"], list(ids)) & (ev["kind"] == int(Kind.FILE_STAT))]
    return {rec.strings.strings[int(i)] for i in sel["site_id"]}


def test_stats_inside_nested_library_imports_name_the_programs_import_line(libroot: tuple[Path, Recorder]) -> None:
    root, rec = libroot
    _make_lib(root, "ddlib_a", depth=6)
    _make_lib(root, "ddlib_b", depth=3)
    importlib.invalidate_caches()
    line_a = sys._getframe().f_lineno + 1
    import ddlib_a  # noqa: F401
    line_b = sys._getframe().f_lineno + 1
    import ddlib_b  # noqa: F401

    # each package's innermost stat (and the failed exists) is attributed to
    # the line here that imported it, not to the other import's line
    assert _sites_of(rec, "ddlib_a/m6.py") == {f"{__file__}:{line_a}"}
    assert _sites_of(rec, "ddlib_a/m6.py.nope") == {f"{__file__}:{line_a}"}
    assert _sites_of(rec, "ddlib_b/m3.py") == {f"{__file__}:{line_b}"}
    assert fileio._modsites  # the walks stopped at the running module bodies
    # the import system's own stats of the package's files too
    assert _sites_of(rec, "ddlib_a/m4.py") <= {f"{__file__}:{line_a}"}


def test_a_finished_import_leaves_no_stale_site(libroot: tuple[Path, Recorder]) -> None:
    """After the import, a library function called from two lines gets each line."""
    root, rec = libroot
    _make_lib(root, "ddlib_c", depth=2)
    importlib.invalidate_caches()
    from ddlib_c import late

    target = str(root / "ddlib_c" / "m1.py")
    lines = []
    for _ in range(2):
        lines.append(sys._getframe().f_lineno + 1)
        late.probe(target)
        lines.append(sys._getframe().f_lineno + 1)
        late.probe(target)
    ev = _events(rec)
    pid = rec.strings.ids[target]
    sel = ev[(ev["name_id"] == pid) & (ev["kind"] == int(Kind.FILE_STAT))]
    got = [rec.strings.strings[int(i)] for i in sel["site_id"]][-4:]
    assert got == [f"{__file__}:{ln}" for ln in lines]


def test_cached_call_sites_follow_the_calling_line(libroot: tuple[Path, Recorder]) -> None:
    """The stat wrapper's own cache (by the caller's f_lasti, checked by code object): os.stat called
    directly and os.path.exists (one library frame between) from two lines each, alternately and
    repeatedly, name the right line on every call, also after the entries exist."""
    root, rec = libroot
    target = str(root / "probe.bin")
    Path(target).write_bytes(b"x")
    lines: list[int] = []
    for _ in range(3):
        lines.append(sys._getframe().f_lineno + 1)
        os.stat(target)
        lines.append(sys._getframe().f_lineno + 1)
        os.path.exists(target)
        lines.append(sys._getframe().f_lineno + 1)
        os.stat(target)
        lines.append(sys._getframe().f_lineno + 1)
        os.path.exists(target)
    ev = _events(rec)
    sel = ev[(ev["name_id"] == rec.strings.ids[target]) & (ev["kind"] == int(Kind.FILE_STAT))]
    assert [rec.strings.strings[int(i)] for i in sel["site_id"]] == [f"{__file__}:{ln}" for ln in lines]
