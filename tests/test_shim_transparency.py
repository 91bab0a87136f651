"""The wrapper is transparent: the program runs as the command it was given would run it.

Real processes throughout, each program run plain and wrapped and compared:

* ``-c`` code is compiled as the interpreter compiles it (none of the
  wrapper's own ``from __future__`` imports), in a ``__main__`` with the
  interpreter's names;
* the interpreter the command names runs the program, with its options: a
  second interpreter without distdiag (Debian's ``/usr/bin/python3``) is
  refused in one line; a venv's ``python`` (distdiag importable there through
  ``PYTHONPATH``) runs it, in the same process, also as two ``mpiexec`` ranks
  that share one run dir; ``python -OO -X dev -W ... -u`` gets those options
  from the interpreter; the wrapper's own interpreter is not re-executed;
* a SIGTERM disposition of ``SIG_IGN`` (inherited, or set by the program) is
  kept at the OS level: the signal is dropped and children inherit it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Callable

import h5py
import pytest
from helpers import MPIEXEC, REPO

PY = sys.executable
_CONSOLE = Path(PY).parent / "distdiag-wrap"
WRAP_CONSOLE = [str(_CONSOLE)] if _CONSOLE.exists() else [shutil.which("distdiag-wrap") or "distdiag-wrap"]
WRAP_MODULE = [PY, "-m", "distdiag.wrap"]
TIMEOUT_S = 120
#: what a launcher or the calling test may have set, that a single run must not inherit
_DROP = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PMI_RANK", "PMI_SIZE",
         "PMI_FD", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PYTHONWARNINGS", "PYTHONDEVMODE",
         "PYTHONOPTIMIZE", "PYTHONDONTWRITEBYTECODE", "PYTHONSAFEPATH")  # fmt: skip


def env(**extra: str) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if k not in _DROP and not k.startswith(("DISTDIAG_", "SLURM_"))}
    e["PYTHONPATH"] = str(REPO)
    e["PYTHONHASHSEED"] = "0"
    e.update(extra)
    return e


def run(cmd: list[str], cwd: Path, env_: dict[str, str] | None = None,
        preexec_fn: Callable[[], Any] | None = None) -> subprocess.CompletedProcess[str]:  # fmt: skip
    return subprocess.run(cmd, cwd=cwd, env=env_ or env(), capture_output=True, text=True, timeout=TIMEOUT_S,
                          preexec_fn=preexec_fn)  # fmt: skip


def write(tmp: Path, name: str, src: str) -> Path:
    p = tmp / name
    p.write_text(textwrap.dedent(src))
    return p


def closed_rank_file(run_dir: Path, rank: int = 0) -> dict[str, Any]:
    with h5py.File(run_dir / f"rank-{rank:05d}.h5", "r") as f:
        attrs = dict(f.attrs)
    assert bool(attrs["closed_cleanly"]), attrs
    return attrs


# -- 14: -c code is compiled as the interpreter compiles it -------------------------------

DASH_C = (
    "x: int = 1\n"
    "def f(a: list) -> dict: pass\n"
    "print(__annotations__, f.__annotations__, list(globals()), __loader__, __spec__, __package__)\n"
)


@pytest.mark.parametrize("wrapper", ["console", "module"])
def test_dash_c_code_inherits_no_future_import_of_the_wrapper(tmp_path: Path, wrapper: str) -> None:
    plain = run([PY, "-c", DASH_C], tmp_path)
    w = [*(WRAP_CONSOLE if wrapper == "console" else WRAP_MODULE), "--dir", str(tmp_path / "r"), "python", "-c", DASH_C]
    wrapped = run(w, tmp_path)
    assert (wrapped.returncode, wrapped.stdout, wrapped.stderr) == (plain.returncode, plain.stdout, plain.stderr)
    # annotations evaluated (no PEP 563 strings), the interpreter's __main__ names in its order
    assert plain.stdout.startswith("{'x': <class 'int'>} {'a': <class 'list'>, 'return': <class 'dict'>}")
    assert "'__loader__', '__spec__', '__annotations__', '__builtins__', 'x', 'f'" in plain.stdout
    closed_rank_file(tmp_path / "r")


# -- 15: the interpreter the command names -------------------------------------------------

PROBE = """
import os, sys
print(sys.executable, sys.prefix, sys.base_prefix, sys.version_info[:3], flush=True)
print(sys.flags.optimize, sys.flags.dev_mode, sys.flags.dont_write_bytecode, sys.flags.bytes_warning,
      sys.warnoptions, __debug__, sys.stdout.write_through, type(sys.stdout.buffer).__name__, flush=True)
print("argv", sys.argv, "path0", sys.path[0] == os.path.dirname(os.path.abspath(__file__)), flush=True)
os.write(1, ("pid %d\\n" % os.getpid()).encode())
"""


def _pid_line(out: str) -> tuple[str, int]:
    """The output without its ``pid N`` line, and N."""
    lines = out.splitlines(keepends=True)
    pid = [ln for ln in lines if ln.startswith("pid ")]
    assert len(pid) == 1, out
    return "".join(ln for ln in lines if not ln.startswith("pid ")), int(pid[0].split()[1])


def _popen_run(cmd: list[str], cwd: Path, env_: dict[str, str] | None = None) -> tuple[int, str, str, int]:
    """rc, stdout less its pid line, stderr, and whether the program's pid was the started process's."""
    p = subprocess.Popen(cmd, cwd=cwd, env=env_ or env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = p.communicate(timeout=TIMEOUT_S)
    body, pid = _pid_line(out)
    return p.returncode, body, err, int(pid == p.pid)


def _other_python() -> str | None:
    """A second interpreter on this machine (not the one running the tests): Debian's."""
    for cand in ("/usr/bin/python3", "/bin/python3"):
        if os.path.isfile(cand) and os.path.realpath(cand) != os.path.realpath(PY):
            return cand
    return None


def test_a_named_interpreter_without_distdiag_is_refused_in_one_line(tmp_path: Path) -> None:
    other = _other_python()
    if other is None:
        pytest.skip("no second Python interpreter on this machine")
    probe = run([other, "-c", "import distdiag.shim.wrap"], tmp_path)
    if probe.returncode == 0:
        pytest.skip(f"distdiag is importable under {other}")
    prog = write(tmp_path, "p.py", "open('ran', 'w').close()\n" + PROBE)
    plain = run([other, str(prog)], tmp_path)
    assert plain.returncode == 0 and (tmp_path / "ran").exists()  # the program itself runs there
    (tmp_path / "ran").unlink()
    for wrap in (WRAP_CONSOLE, WRAP_MODULE):
        w = run([*wrap, other, str(prog)], tmp_path)
        assert w.returncode == 2, w
        assert w.stdout == ""
        assert w.stderr.count("\n") == 1 and w.stderr.startswith(f"distdiag-wrap: {other} cannot import distdiag ("), w.stderr
        assert not (tmp_path / "ran").exists(), "the program must not run under another interpreter"
        assert not list(tmp_path.glob("distdiag-*")), "nothing recorded for a refused interpreter"


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv of the test interpreter that sees its packages (numpy, h5py); distdiag comes
    from PYTHONPATH, as the tests run it."""
    d = tmp_path_factory.mktemp("venv") / "v"
    subprocess.run([PY, "-m", "venv", "--system-site-packages", "--without-pip", str(d)], check=True,
                   timeout=TIMEOUT_S, env=env())  # fmt: skip
    return d


@pytest.mark.parametrize("how", ["path", "on_PATH"])
def test_the_program_runs_under_the_interpreter_it_names(tmp_path: Path, venv: Path, how: str) -> None:
    prog = write(tmp_path, "p.py", PROBE)
    vpy = venv / "bin" / "python"
    e = env()
    if how == "on_PATH":  # ``python`` resolves to the venv's, as after ``source venv/bin/activate``
        e["PATH"] = f"{venv / 'bin'}{os.pathsep}{e['PATH']}"
        e["VIRTUAL_ENV"] = str(venv)
    token = str(vpy) if how == "path" else "python"
    plain = _popen_run([token, str(prog), "a"] if how == "on_PATH" else [str(vpy), str(prog), "a"], tmp_path, e)
    assert plain[0] == 0, plain
    assert f" {venv} " in plain[1]  # sys.prefix: the venv's
    for i, wrap in enumerate((WRAP_CONSOLE, WRAP_MODULE)):
        run_dir = tmp_path / f"run{i}"
        wrapped = _popen_run([*wrap, "--dir", str(run_dir), token, str(prog), "a"], tmp_path, e)
        # same executable, prefix, flags, argv; the same process (exec, no child)
        assert wrapped == plain, (wrapped, plain)
        assert wrapped[3] == 1
        attrs = closed_rank_file(run_dir)
        assert int(attrs["exit_code"]) == 0


def test_interpreter_options_are_the_interpreters(tmp_path: Path) -> None:
    """``-OO -X dev -W error::UserWarning -B -bb -u``: applied by the interpreter at its start,
    exactly (no emulation in the wrapper), with the rank recorded."""
    prog = write(tmp_path, "p.py", PROBE + "import warnings\nwarnings.warn('boom', UserWarning)\n")
    opts = ["-OO", "-X", "dev", "-W", "error::UserWarning", "-B", "-bb", "-u"]
    plain = _popen_run([PY, *opts, str(prog)], tmp_path)
    assert plain[0] == 1 and "UserWarning: boom" in plain[2], plain
    assert "2 True 1 2 ['default', 'error::UserWarning', 'error::BytesWarning'] False True FileIO" in plain[1]
    for i, wrap in enumerate((WRAP_CONSOLE, WRAP_MODULE)):
        wrapped = _popen_run([*wrap, "--dir", str(tmp_path / f"r{i}"), PY, *opts, str(prog)], tmp_path)
        assert wrapped == plain
        assert int(closed_rank_file(tmp_path / f"r{i}")["exit_code"]) == 1
    # grouped, as the interpreter also reads them
    plain = _popen_run([PY, "-uOO", "-Xdev", str(prog)], tmp_path)
    wrapped = _popen_run([*WRAP_CONSOLE, "--dir", str(tmp_path / "g"), PY, "-uOO", "-Xdev", str(prog)], tmp_path)
    assert wrapped == plain and plain[0] == 0 and "UserWarning: boom" in plain[2]  # -X dev shows it


@pytest.mark.parametrize("token", ["python", "python3", "python3.11"])
def test_the_wrappers_own_interpreter_runs_the_program_in_place(tmp_path: Path, token: str) -> None:
    """``python`` on PATH is the wrapper's interpreter: no re-exec (``sys.orig_argv`` is the
    wrapper's command line), and ``sys.executable`` is the name the interpreter would give itself."""
    if shutil.which(token) is None or os.path.realpath(shutil.which(token) or "") != os.path.realpath(PY):
        pytest.skip(f"{token} on PATH is not the test interpreter")
    prog = write(tmp_path, "p.py", PROBE + "print('-c' in sys.orig_argv, sys._base_executable)\n")
    plain = _popen_run([token, str(prog)], tmp_path)
    assert plain[0] == 0 and plain[1].endswith(f"False {shutil.which(token)}\n"), plain
    for i, wrap in enumerate((WRAP_CONSOLE, WRAP_MODULE)):
        wrapped = _popen_run([*wrap, "--dir", str(tmp_path / f"r{i}"), token, str(prog)], tmp_path)
        assert wrapped == plain
        closed_rank_file(tmp_path / f"r{i}")


@pytest.mark.mpi
def test_mpiexec_ranks_under_a_named_venv_share_one_run_dir(tmp_path: Path, venv: Path) -> None:
    """``mpiexec -n 2 python -m distdiag.wrap <venv>/bin/python x.py``: each rank re-executes
    under the venv, keeps its rank variables and pid, and the two find one default run dir."""
    if MPIEXEC is None:
        pytest.fail("mpiexec not found: install the 'mpi' extra")
    prog = write(tmp_path, "p.py", """
        import os, sys
        os.write(1, ("rank %s prefix %s pid %d\\n" % (os.environ.get("PMI_RANK"), sys.prefix, os.getpid())).encode())
    """)
    vpy = str(venv / "bin" / "python")
    p = run([MPIEXEC, "-n", "2", *WRAP_MODULE, vpy, str(prog)], tmp_path, env(DISTDIAG_HOOKS="mpi4py=0"))
    assert p.returncode == 0, p.stdout + p.stderr
    lines = sorted(p.stdout.splitlines())
    assert [ln.split()[:4] for ln in lines] == [["rank", "0", "prefix", str(venv)], ["rank", "1", "prefix", str(venv)]]
    dirs = list(tmp_path.glob("distdiag-*"))
    assert len(dirs) == 1, dirs
    pids = {int(ln.split()[-1]) for ln in lines}
    for r in (0, 1):
        attrs = closed_rank_file(dirs[0], r)
        assert (int(attrs["rank"]), int(attrs["world_size"]), attrs["launcher"]) == (r, 2, "mpich")
        assert int(attrs["pid"]) in pids  # the rank file's process is the program's


# -- 16: SIG_IGN stays SIG_IGN -------------------------------------------------------------

SIGIGN_PROG = r"""
import os, signal, subprocess, sys, time

def child_ignores_term():
    # what an exec'd child inherits: its SigIgn mask, bit 15 (SIGTERM)
    out = subprocess.run([sys.executable, "-S", "-c",
                          "print(int([l for l in open('/proc/self/status') if l.startswith('SigIgn')][0].split()[1], 16) >> 14 & 1)"],
                         capture_output=True, text=True).stdout.strip()
    return out

def term_self():
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.3)

mode = sys.argv[1]
if mode == "set":
    print("prev", signal.signal(signal.SIGTERM, signal.SIG_IGN), flush=True)
print("disposition", signal.getsignal(signal.SIGTERM), "child ignores", child_ignores_term(), flush=True)
term_self()
print("alive after SIGTERM", flush=True)
if mode == "set":
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    print("default again, child ignores", child_ignores_term(), flush=True)
    term_self()
    print("never printed", flush=True)
"""


def _ignore_term() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


@pytest.mark.parametrize("mode", ["inherited", "set"])
def test_sigterm_ignored_stays_ignored_and_children_inherit_it(tmp_path: Path, mode: str) -> None:
    prog = write(tmp_path, "p.py", SIGIGN_PROG)
    pre = _ignore_term if mode == "inherited" else None
    plain = run([PY, str(prog), mode], tmp_path, preexec_fn=pre)
    wrapped = run([*WRAP_CONSOLE, "--dir", str(tmp_path / "r"), PY, str(prog), mode], tmp_path, preexec_fn=pre)
    assert (wrapped.returncode, wrapped.stdout, wrapped.stderr) == (plain.returncode, plain.stdout, plain.stderr)
    assert "child ignores 1" in plain.stdout and "alive after SIGTERM" in plain.stdout
    attrs = closed_rank_file(tmp_path / "r")
    if mode == "set":
        # SIG_DFL again: the wrapper's handler is back, closes the file, and the rank dies by the signal
        assert "default again, child ignores 0" in plain.stdout and "never printed" not in plain.stdout
        assert plain.returncode == -signal.SIGTERM and int(attrs["exit_code"]) == -signal.SIGTERM
    else:
        assert plain.returncode == 0 and int(attrs["exit_code"]) == 0


# -- 17: warnings raised inside wrapped calls point at the program's line -----------------

WARN_PROG = r"""
import os, sys, warnings
import h5py

open("f.bin", "wb").close()
os.makedirs("d", exist_ok=True)
ba = bytearray(b"f.bin")

def cases():
    yield "open_rb_buffering1", lambda: open("f.bin", "rb", buffering=1).close()
    yield "open_wb_buffering1", lambda: open("f.bin", "ab", 1).close()
    yield "open_text_default_encoding", lambda: open("f.bin").close()
    yield "stat_bytearray", lambda: os.stat(ba)
    yield "lstat_bytearray", lambda: os.lstat(ba)
    yield "exists_bytearray", lambda: os.path.exists(ba)          # through genericpath: its line
    yield "listdir_bytearray", lambda: os.listdir(bytearray(b"d"))
    yield "os_open_bytearray", lambda: os.close(os.open(ba, os.O_RDONLY))
    yield "h5py_swmr_write", lambda: h5py.File("w.h5", "w", swmr=True).close()

for name, call in cases():
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        call()
    print(name, [(w.category.__name__, os.path.basename(w.filename), w.lineno, str(w.message)[:40]) for w in got],
          flush=True)

if sys.argv[1:] != ["raise"]:
    # the default filters: shown once per location (two lines, the first in a loop)
    for i in range(3):
        open("f.bin", "rb", buffering=1).close()
    open("f.bin", "rb", buffering=1).close()
else:
    try:
        os.stat(ba)
    except DeprecationWarning as e:
        print("caught", e, flush=True)
    open("f.bin", "rb", buffering=1)
print("end", flush=True)
"""

#: the line of the loop's open in WARN_PROG
LOOP = WARN_PROG.splitlines().index("    for i in range(3):") + 2


def _warn_runs(tmp_path: Path, pyopts: list[str], args: list[str], e: dict[str, str] | None = None,
               ) -> tuple[subprocess.CompletedProcess[str], subprocess.CompletedProcess[str]]:  # fmt: skip
    d = tmp_path / "work"
    d.mkdir()
    write(d, "w.py", WARN_PROG)
    plain = run([PY, *pyopts, "w.py", *args], d, e)
    wrapped = run([*WRAP_CONSOLE, "--dir", str(tmp_path / "r"), PY, *pyopts, "w.py", *args], d, e)
    closed_rank_file(tmp_path / "r")
    return plain, wrapped


@pytest.mark.parametrize("pyopts", [[], ["-X", "warn_default_encoding"]], ids=["plain", "warn_default_encoding"])
def test_warnings_in_wrapped_calls_point_at_the_programs_line(tmp_path: Path, pyopts: list[str]) -> None:
    plain, wrapped = _warn_runs(tmp_path, pyopts, [])
    assert plain.returncode == 0, plain.stderr
    assert (wrapped.returncode, wrapped.stdout, wrapped.stderr) == (plain.returncode, plain.stdout, plain.stderr)
    got = {ln.split(" ", 1)[0]: ln for ln in plain.stdout.splitlines()}
    # each case warned at the program's line (os.path.exists: genericpath's, as unwrapped)
    for name in ("open_rb_buffering1", "open_wb_buffering1", "stat_bytearray", "lstat_bytearray",
                 "listdir_bytearray", "os_open_bytearray", "h5py_swmr_write"):  # fmt: skip
        assert "'w.py'" in got[name] and "fileio" not in got[name], got[name]
    assert "genericpath" in got["exists_bytearray"]
    assert ("EncodingWarning" in got["open_text_default_encoding"]) == bool(pyopts)
    # once per location: the loop's line once, the next line once
    assert plain.stderr.count(f"w.py:{LOOP}: RuntimeWarning: line buffering") == 1, plain.stderr
    assert plain.stderr.count(f"w.py:{LOOP + 1}: RuntimeWarning: line buffering") == 1, plain.stderr


@pytest.mark.parametrize("via", ["option", "env"])
def test_module_warning_filters_match_as_unwrapped(tmp_path: Path, via: str) -> None:
    """``-W error::...:__main__`` (the interpreter's option: re-executed) and PYTHONWARNINGS
    (run in place): the filters match the program's module, the same exceptions and traceback."""
    spec = "error::RuntimeWarning:__main__,error::DeprecationWarning:__main__"
    if via == "option":
        pyopts = [x for s in spec.split(",") for x in ("-W", s)]
        plain, wrapped = _warn_runs(tmp_path, pyopts, ["raise"])
    else:
        plain, wrapped = _warn_runs(tmp_path, [], ["raise"], env(PYTHONWARNINGS=spec))
    assert (wrapped.returncode, wrapped.stdout, wrapped.stderr) == (plain.returncode, plain.stdout, plain.stderr)
    assert plain.returncode == 1 and "caught stat: path should be" in plain.stdout and "end" not in plain.stdout
    assert plain.stderr.startswith("Traceback") and plain.stderr.endswith(
        "RuntimeWarning: line buffering (buffering=1) isn't supported in binary mode, the default buffer size will be used\n")
    assert "fileio" not in plain.stderr + wrapped.stderr


# -- the wrapped file functions are the program's functions: pickled, copied, held in classes ------
PICKLE_PROG = """\
import copy, io, os, pickle, posix, sys
NAMES = ("open", "listdir", "scandir", "stat", "lstat", "mkdir", "remove", "unlink", "rmdir", "rename", "replace",
         "close", "fsync", "chdir")
for n in NAMES:
    f = getattr(os, n)
    print(n, pickle.loads(pickle.dumps(f)) is f, copy.copy(f) is f, repr(f))
for n, f in (("builtins.open", open), ("io.open_code", io.open_code), ("posix.listdir", posix.listdir)):
    print(n, f.__module__, pickle.loads(pickle.dumps(f)) is f, f.__name__, repr(f))
print("same_open", open is io.open)
# what multiprocessing does with a function it hands a worker
print("by_name", pickle.loads(pickle.dumps([os.listdir, open])) == [os.listdir, open])
class Holder:  # a builtin held in a class is no method: no self is passed
    opener = open
    lister = os.listdir
    stat = os.stat
    os_open = os.open
    os_close = os.close
h = Holder()
with h.opener(sys.argv[0]) as fh:
    print("class_attr", len(fh.readline()) > 0, h.lister(".") == os.listdir("."), h.stat(".").st_ino == os.stat(".").st_ino)
h.os_close(h.os_open(sys.argv[0], os.O_RDONLY))
print("class_fd ok")
"""


@pytest.mark.parametrize("capture", ["preload", "preload_no_hot", "python"])
def test_wrapped_file_functions_pickle_and_behave_as_the_originals(tmp_path: Path, capture: str) -> None:
    """Also where the wrappers are Python functions (the Python-level capture; the site wrappers
    without distdiag/shim/_hot.c): held in a class, they bound as methods and took the instance as
    their path ("stat() takes exactly 1 positional argument (2 given)")."""
    d = tmp_path / "work"
    d.mkdir()
    write(d, "p.py", PICKLE_PROG)
    e = {"python": env(DISTDIAG_HOOKS="preload=0"), "preload_no_hot": env(DISTDIAG_HOT="0")}.get(capture, env())
    plain = run([PY, "p.py"], d, e)
    wrapped = run([*WRAP_CONSOLE, "--dir", str(tmp_path / "r"), PY, "p.py"], d, e)
    assert plain.returncode == 0, plain.stderr
    closed_rank_file(tmp_path / "r")
    assert (wrapped.returncode, wrapped.stdout, wrapped.stderr) == (0, plain.stdout, plain.stderr)
    assert "class_attr True True True" in plain.stdout and "class_fd ok" in plain.stdout
    assert plain.stdout.count(" True True <built-in function") >= 14 and "by_name True" in plain.stdout
