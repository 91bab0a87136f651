"""distdiag-wrap runs the program unchanged and leaves a readable rank file, whatever happens.

Every case is a real subprocess: the same program run with plain ``python``
and under the wrapper (console script and ``python -m distdiag.wrap``) must
give the same exit code, stdout and stderr byte for byte; killed and
terminated runs must leave files that open.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Iterator

import h5py
import numpy as np
import pytest
from helpers import fill_prog, small_tmpfs, wait_until_closed

from distdiag.run import open_rank_file
from distdiag.schema import Kind
from distdiag.shim import rankinfo
from distdiag.shim.wrap import UsageError, parse_args, resolve_run_dir

PY = sys.executable
_CONSOLE = Path(PY).parent / "distdiag-wrap"
WRAP_CONSOLE = [str(_CONSOLE)] if _CONSOLE.exists() else [shutil.which("distdiag-wrap") or "distdiag-wrap"]
WRAP_MODULE = [PY, "-m", "distdiag.wrap"]
TIMEOUT_S = 60

#: launcher variables a test must not inherit from whatever runs pytest
_LAUNCH_VARS = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT",
    "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "PMIX_RANK", "PMIX_NAMESPACE",
    "PMI_RANK", "PMI_SIZE", "PMI_FD", "PMI_PORT", "PMI_KVSNAME", "MPI_LOCALRANKID", "MPI_LOCALNRANKS",
    "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_JOB_ID", "SLURM_STEP_ID", "SLURMD_NODENAME",
)


#: the checkout these tests belong to: subprocesses import distdiag from here, not from
#: whatever tree an editable install in the shared environment points at
REPO = str(Path(__file__).resolve().parent.parent)


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS and not k.startswith("DISTDIAG_")}
    env["PYTHONHASHSEED"] = "0"
    env["PYTHONPATH"] = os.pathsep.join([REPO] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.update(extra)
    return env


def run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, env=env or clean_env(), capture_output=True, text=True, timeout=timeout)


def rank_file(run_dir: Path, rank: int = 0) -> Path:
    return run_dir / f"rank-{rank:05d}.h5"


def events_of(path: Path) -> tuple[np.ndarray, np.ndarray, dict]:
    """A rank file's tables as the analyzer reads them (its spill log in its place, if one is there)."""
    with open_rank_file(path) as f:
        return f["events"][:], f["strings"].asstr()[:], dict(f.attrs)


def shim_names(path: Path) -> list[str]:
    ev, s, _ = events_of(path)
    return [s[i] for i in ev["name_id"][ev["kind"] == Kind.SHIM]]


PROGRAMS = {
    "raises": """
        import sys
        def inner(x):
            return {}[x]
        def outer():
            inner("missing")
        print("before", flush=True)
        outer()
    """,
    "exit3": """
        import sys
        print("out")
        print("err", file=sys.stderr)
        sys.exit(3)
    """,
    "exit_msg": """
        import sys
        sys.exit("fatal: no input files")
    """,
    "argv": """
        import os, sys
        print(sys.argv)
        print(__name__, __file__, __package__, __spec__, __doc__)
        print(sys.path[0], os.getcwd())
        print(type(__loader__).__name__, __loader__.name, __loader__.path)
        print(sorted(k for k in globals() if k.startswith("__")))
    """,
    "main_pickle": '''
        """Docstring of the program."""
        import atexit, pickle, sys, threading

        class Point:
            def __init__(self, x):
                self.x = x

        def roundtrip(tag):
            p = pickle.loads(pickle.dumps(Point(7)))
            print(tag, type(p).__module__, type(p).__qualname__, p.x, flush=True)

        if __name__ == "__main__":
            print(__doc__)
            roundtrip("main")
            t = threading.Thread(target=roundtrip, args=("thread",))
            t.start(); t.join()
            atexit.register(roundtrip, "atexit")
            print(sys.modules["__main__"].Point is Point)
    ''',
    "excepthook": """
        import sys
        def hook(t, v, tb):
            n = 0
            while tb is not None:
                n += 1; tb = tb.tb_next
            print("user hook:", t.__name__, v, "frames", n, file=sys.stderr)
        sys.excepthook = hook
        def f():
            raise RuntimeError("custom")
        f()
    """,
    "keyboard": """
        print("interrupting", flush=True)
        raise KeyboardInterrupt
    """,
    "syntax": """
        def broken(:
            pass
    """,
    "phase_raises": """
        import distdiag

        @distdiag.phase("train")
        def train(n):
            with distdiag.phase("inner"):
                return 10 // n

        print(train(2))
        train(0)
    """,
    "chained": """
        def load():
            try:
                open("/nonexistent/definitely/not")
            except OSError as e:
                raise ValueError("could not load") from e
        load()
    """,
}


def _write(tmp_path: Path, name: str) -> Path:
    d = tmp_path / "prog"
    d.mkdir(exist_ok=True)
    p = d / f"{name}.py"
    p.write_text(textwrap.dedent(PROGRAMS[name]))
    return p


@pytest.mark.parametrize("name", sorted(PROGRAMS))
@pytest.mark.parametrize("wrapper", ["console", "module"])
def test_wrapped_program_behaves_exactly_like_unwrapped(tmp_path: Path, name: str, wrapper: str) -> None:
    prog = _write(tmp_path, name)
    rel = os.path.relpath(prog, tmp_path)  # argv[0] as typed, relative to cwd
    plain = run([PY, rel, "a1", "--flag"], cwd=tmp_path)
    wrap = WRAP_CONSOLE if wrapper == "console" else WRAP_MODULE
    run_dir = tmp_path / "run"
    wrapped = run([*wrap, "--dir", str(run_dir), "python", rel, "a1", "--flag"], cwd=tmp_path)
    assert (wrapped.returncode, wrapped.stdout, wrapped.stderr) == (plain.returncode, plain.stdout, plain.stderr)
    # and the run was recorded, closed cleanly, with the program's exit code
    _, _, attrs = events_of(rank_file(run_dir))
    assert bool(attrs["closed_cleanly"]) is True
    expected = plain.returncode if plain.returncode >= 0 else plain.returncode  # -2 for KeyboardInterrupt
    assert int(attrs["exit_code"]) == expected
    assert json.loads(attrs["argv"]) == [rel, "a1", "--flag"]


def test_sanity_programs_really_differ(tmp_path: Path) -> None:
    """The comparison above can fail: the programs' outcomes are what we think."""
    outs = {n: run([PY, str(_write(tmp_path, n))], cwd=tmp_path) for n in ("raises", "exit3", "keyboard", "syntax")}
    assert outs["raises"].returncode == 1 and "KeyError: 'missing'" in outs["raises"].stderr
    assert outs["exit3"].returncode == 3
    assert outs["keyboard"].returncode == -signal.SIGINT
    assert outs["syntax"].returncode == 1 and "SyntaxError" in outs["syntax"].stderr


def test_dash_m_module_behaves_like_python_dash_m(tmp_path: Path) -> None:
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "tool.py").write_text(
        textwrap.dedent(
            """
            import sys
            print(sys.argv, __name__, __spec__.name, __package__, sys.path[0])
            if sys.argv[1:] == ["fail"]:
                raise SystemExit(5)
            raise LookupError("from module")
            """
        )
    )
    for i, args in enumerate((["x", "y"], ["fail"])):
        plain = run([PY, "-m", "mypkg.tool", *args], cwd=tmp_path)
        for j, wrap in enumerate((WRAP_CONSOLE, WRAP_MODULE)):
            # a run dir each: a rank file is never overwritten (a rerun into one says so on stderr)
            w = run([*wrap, "--dir", str(tmp_path / f"run{i}{j}"), "python3", "-m", "mypkg.tool", *args], cwd=tmp_path)
            assert (w.returncode, w.stdout, w.stderr) == (plain.returncode, plain.stdout, plain.stderr)
    assert "LookupError: from module" in run([PY, "-m", "mypkg.tool"], cwd=tmp_path).stderr
    missing_plain = run([PY, "-m", "no_such_module_xyz"], cwd=tmp_path)
    missing_wrap = run([*WRAP_CONSOLE, "--dir", str(tmp_path / "run"), PY, "-m", "no_such_module_xyz"], cwd=tmp_path)
    assert missing_wrap.returncode == missing_plain.returncode == 1
    # "<sys.executable>: No module named ...": the interpreter's name may differ (python vs python3.11)
    assert missing_wrap.stderr.split(": ", 1)[1] == missing_plain.stderr.split(": ", 1)[1]


def test_dash_c_and_script_without_python_prefix(tmp_path: Path) -> None:
    code = "import sys; print(sys.argv, __name__, repr(sys.path[0])); sys.exit(4)"
    plain = run([PY, "-c", code, "z"], cwd=tmp_path)
    w = run([*WRAP_CONSOLE, "--dir", str(tmp_path / "r"), "python", "-c", code, "z"], cwd=tmp_path)
    assert (w.returncode, w.stdout, w.stderr) == (plain.returncode, plain.stdout, plain.stderr) and plain.returncode == 4
    prog = _write(tmp_path, "argv")
    plain = run([PY, str(prog), "q"], cwd=tmp_path)
    # its own dir: a rank file is never overwritten (a rerun into one says so on stderr)
    w = run([*WRAP_CONSOLE, "--dir", str(tmp_path / "r2"), str(prog), "q"], cwd=tmp_path)
    assert (w.returncode, w.stdout, w.stderr) == (plain.returncode, plain.stdout, plain.stderr)


def test_missing_script_exits_2_like_python(tmp_path: Path) -> None:
    plain = run([PY, "nope.py"], cwd=tmp_path)
    w = run([*WRAP_CONSOLE, "--dir", str(tmp_path / "r"), "python", "nope.py"], cwd=tmp_path)
    assert w.returncode == plain.returncode == 2
    assert "can't open file" in w.stderr and str(tmp_path / "nope.py") in w.stderr


@pytest.mark.parametrize("cmd", [["/bin/echo", "hi"], ["bash", "job.sh"], ["./a.out"], ["perl", "x.pl"]])
def test_non_python_target_is_one_line_exit_2(tmp_path: Path, cmd: list[str]) -> None:
    p = run([*WRAP_CONSOLE, *cmd], cwd=tmp_path)
    assert p.returncode == 2
    assert p.stdout == ""
    assert p.stderr == (
        "distdiag-wrap: can only wrap Python programs ('python script.py' or 'python -m module'), "
        f"got '{cmd[0]}'\n"
    )
    assert not list(tmp_path.glob("distdiag-*")), "nothing recorded for a refused target"


def test_parse_args_options_and_python_flags() -> None:
    o, t = parse_args(["--dir", "D", "--probe-links", "--config=c.toml", "--", "python3.11", "-u", "-W", "ignore", "s.py", "-x"])
    assert (o.dir, o.probe_links, o.config) == ("D", True, "c.toml")
    assert (t.kind, t.value, t.args, t.interpreter, t.pyopts) == ("script", "s.py", ["-x"], "python3.11", ["-u", "-W", "ignore"])
    o, t = parse_args([PY, "-m", "pkg.mod", "--dir", "x"])
    assert (t.kind, t.value, t.args, o.dir, t.interpreter, t.pyopts) == ("module", "pkg.mod", ["--dir", "x"], None, PY, [])
    # grouped and attached options, as the interpreter reads them
    _, t = parse_args(["python", "-uWerror", "-OO", "-Xdev", "-X", "importtime", "-bBc", "print(1)", "a"])
    assert (t.kind, t.value, t.args) == ("code", "print(1)", ["a"])
    assert t.pyopts == ["-u", "-W", "error", "-O", "-O", "-X", "dev", "-X", "importtime", "-b", "-B"]
    _, t = parse_args(["python", "-E", "--", "s.py"])
    assert (t.kind, t.value, t.pyopts) == ("script", "s.py", ["-E"])
    # no interpreter in the command: none is chosen
    _, t = parse_args(["s.py", "1"])
    assert (t.kind, t.value, t.args, t.interpreter) == ("script", "s.py", ["1"], None)
    with pytest.raises(UsageError, match="interactive"):
        parse_args(["python", "-i", "s.py"])
    with pytest.raises(UsageError, match="unknown python option -Z"):
        parse_args(["python", "-Z", "s.py"])
    with pytest.raises(UsageError, match="runs no program"):
        parse_args(["python", "--version"])
    with pytest.raises(UsageError, match="no program"):
        parse_args(["--dir", "x"])


# -- crash safety ------------------------------------------------------------------------

KILL_PROG = """
import sys, time
import distdiag
from distdiag.schema import Kind
from distdiag.shim import session

n = int(sys.argv[1])
for i in range(n):
    distdiag.mark("tick")
    if i % 100 == 0:
        time.sleep(0.001)
rec = session.SESSION.rec
time.sleep(0.5)                                       # a few flushes happen before the enter
rec.enter(Kind.COLL, rec.intern("stuck_allreduce"), comm_id=rec.intern("world"), seq=41)
print("inside", n, flush=True)
time.sleep(60)
"""


@contextlib.contextmanager
def _started(cmd: list[str], cwd: Path, env: dict[str, str]) -> Iterator[subprocess.Popen[str]]:
    """The process, text stdout/stderr piped; killed (by its own PID) if the test leaves it running."""
    p = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        yield p
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=TIMEOUT_S)


def _wait_line(p: subprocess.Popen[str], want: str, timeout_s: float = 30.0) -> str:
    assert p.stdout is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        if want in line:
            return line
        if not line and p.poll() is not None:
            break
    p.kill()
    raise AssertionError(f"never printed {want!r}; stderr: {p.stderr.read() if p.stderr else ''}")


def _wait_flushed(path: Path, dataset: str, min_rows: int, timeout_s: float = 30.0) -> None:
    """Poll a rank file the live writer holds until ``dataset`` has ``min_rows`` rows on disk
    (a loaded machine may delay the flusher well past its interval)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open_rank_file(path) as f:  # or its spill log, before the HDF5 file opened
                if len(f[dataset]) >= min_rows:
                    return
        except (OSError, KeyError, RuntimeError):
            pass  # mid-write: try again
        time.sleep(0.05)
    raise AssertionError(f"{path}:{dataset} never reached {min_rows} rows")


@pytest.mark.parametrize(("writer", "open_at"), [("process", "numpy"), ("thread", "numpy"), ("thread", "start")])
def test_sigkill_leaves_a_file_with_every_flushed_row_and_the_inflight_call(tmp_path: Path, writer: str,
                                                                            open_at: str) -> None:  # fmt: skip
    """The program never imports numpy. With the helper process (the default) the helper writes
    the file, also after the kill; in-process with open_file_at=numpy its rows are in the spill
    log, which the analyzer reads in the empty file's place; with "start" in the file."""
    prog = tmp_path / "kill.py"
    prog.write_text(KILL_PROG)
    run_dir = tmp_path / "run"
    env = clean_env(DISTDIAG_FLUSH_INTERVAL_S="0.2", DISTDIAG_OPEN_FILE_AT=open_at, DISTDIAG_WRITER=writer)
    with _started([*WRAP_CONSOLE, "--dir", str(run_dir), PY, str(prog), "5000"], tmp_path, env) as p:
        _wait_line(p, "inside")
        _wait_flushed(rank_file(run_dir), "inflight", 1)  # the enter is on disk as in flight
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=TIMEOUT_S)
    assert p.returncode == -signal.SIGKILL
    path = rank_file(run_dir)
    spill = path.with_name(path.name + ".log")
    if writer == "process":
        wait_until_closed(path)  # the helper writes what the rank sent, then closes the file
        assert not spill.exists() and path.stat().st_size > 0
    elif open_at == "numpy":
        assert path.stat().st_size == 0 and spill.stat().st_size > 0  # the HDF5 file never opened
    else:
        assert not spill.exists()
    with open_rank_file(path) as f:  # opens after SIGKILL
        ev, s, attrs = f["events"][:], f["strings"].asstr()[:], dict(f.attrs)
        inflight = f["inflight"][:]
    names = s[ev["name_id"]]
    assert int(((ev["kind"] == Kind.MARK) & (names == "tick")).sum()) == 5000
    assert bool(attrs["closed_cleanly"]) is False
    assert "exit_code" not in attrs and "end_mono_ns" not in attrs
    assert len(inflight) == 1
    row = inflight[0]
    assert (row["kind"], s[row["name_id"]], s[row["comm_id"]], row["seq"], row["t1_ns"]) == (
        Kind.COLL, "stuck_allreduce", "world", 41, -1)
    # the last flush was recent: within a few intervals of the kill
    assert attrs["last_flush_mono_ns"] > row["t0_ns"]


TERM_PROG = """
import signal, sys, time
import distdiag

mode = sys.argv[1]
if mode == "handler":
    def on_term(signum, frame):
        print("user handler ran", signum, flush=True)
        sys.exit(7)
    old = signal.signal(signal.SIGTERM, on_term)
    assert signal.getsignal(signal.SIGTERM) is on_term
    print("previous", old, flush=True)
for i in range(3000):
    distdiag.mark("tick")
distdiag.step(samples=1)
print("ready", flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("mode", ["default", "handler"])
def test_sigterm_closes_the_file_with_every_row(tmp_path: Path, mode: str) -> None:
    prog = tmp_path / "term.py"
    prog.write_text(TERM_PROG)
    run_dir = tmp_path / "run"
    env = clean_env(DISTDIAG_FLUSH_INTERVAL_S="30")  # no periodic flush: SIGTERM must write everything
    results = {}
    for wrapped in (False, True):
        cmd = [*WRAP_CONSOLE, "--dir", str(run_dir), PY, str(prog), mode] if wrapped else [PY, str(prog), mode]
        with _started(cmd, tmp_path, env) as p:
            _wait_line(p, "ready")
            p.send_signal(signal.SIGTERM)
            out, err = p.communicate(timeout=TIMEOUT_S)
        results[wrapped] = (p.returncode, out, err)
    assert results[True] == results[False]
    rc = results[True][0]
    assert rc == (7 if mode == "handler" else -signal.SIGTERM)
    ev, s, attrs = events_of(rank_file(run_dir))
    assert bool(attrs["closed_cleanly"]) is True
    assert int(attrs["exit_code"]) == rc
    assert int((ev["kind"] == Kind.MARK).sum()) == 3000 and int((ev["kind"] == Kind.STEP).sum()) == 1
    assert "sigterm" in shim_names(rank_file(run_dir))


def test_unwritable_run_dir_job_still_runs_with_one_stderr_line(tmp_path: Path) -> None:
    prog = _write(tmp_path, "exit3")
    blocker = tmp_path / "afile"
    blocker.write_text("not a directory")
    plain = run([PY, str(prog)], cwd=tmp_path)
    w = run([*WRAP_CONSOLE, "--dir", str(blocker / "run"), PY, str(prog)], cwd=tmp_path)
    assert w.returncode == plain.returncode == 3
    assert w.stdout == plain.stdout
    extra = w.stderr.replace(plain.stderr, "", 1)
    assert extra.count("\n") == 1
    assert extra.startswith("distdiag: ") and extra.endswith("; the job runs without recording\n")


def test_full_disk_mid_run_job_finishes_with_its_exit_code(tmp_path: Path) -> None:
    """A 3 MiB tmpfs fills while the job records 5.5 MB of events: one stderr line, the job
    finishes with its own exit code, and the file keeps every row written before the stop."""
    with small_tmpfs(tmp_path, "3m") as mnt:
        prog = tmp_path / "fill.py"
        prog.write_text(fill_prog(9))
        w = run([*WRAP_CONSOLE, "--dir", str(mnt / "run"), PY, str(prog)], cwd=tmp_path,
                env=clean_env(DISTDIAG_FLUSH_INTERVAL_S="0.05"))
        assert w.returncode == 9
        assert w.stdout == "finished\n"
        assert w.stderr.count("\n") == 1 and w.stderr.startswith("distdiag: cannot write ")
        assert w.stderr.endswith("; the job runs without recording\n")
        ev, _, attrs = events_of(rank_file(mnt / "run"))
        assert 0 < len(ev) < 80000 and "recording_stopped" in attrs


# -- run dir --------------------------------------------------------------------------


def _info(env: dict[str, str]) -> rankinfo.RankInfo:
    return rankinfo.detect(env, ppid=4242)


def test_run_dir_precedence_and_slurm_names(tmp_path: Path) -> None:
    slurm = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "981", "SLURM_STEP_ID": "0"}
    assert resolve_run_dir(str(tmp_path / "opt"), _info(slurm), {"DISTDIAG_DIR": str(tmp_path / "env")}, tmp_path) == tmp_path / "opt"
    assert resolve_run_dir(None, _info(slurm), {"DISTDIAG_DIR": str(tmp_path / "env")}, tmp_path) == tmp_path / "env"
    assert resolve_run_dir(None, _info(slurm), {}, tmp_path) == tmp_path / "distdiag-981"
    step3 = {**slurm, "SLURM_STEP_ID": "3"}
    assert resolve_run_dir(None, _info(step3), {}, tmp_path) == tmp_path / "distdiag-981.3"
    assert (tmp_path / "distdiag-981.3").is_dir()


def test_run_dir_outside_slurm_is_shared_by_the_launch(tmp_path: Path) -> None:
    env0 = {"PMI_RANK": "0", "PMI_SIZE": "2", "PMI_KVSNAME": "kvs_77_0"}
    env1 = {**env0, "PMI_RANK": "1"}
    other = {**env0, "PMI_KVSNAME": "kvs_78_0"}
    d0 = resolve_run_dir(None, _info(env0), {}, tmp_path)
    assert d0.name.startswith("distdiag-") and d0.name.endswith("-" + _info(env0).launch_hash)
    assert resolve_run_dir(None, _info(env1), {}, tmp_path, wait_s=1.0) == d0
    t = time.monotonic()
    lone = resolve_run_dir(None, _info({**other, "PMI_RANK": "1"}), {}, tmp_path, wait_s=0.3)
    assert time.monotonic() - t >= 0.3
    assert lone != d0 and lone.name.endswith(_info(other).launch_hash)


@pytest.mark.mpi
@pytest.mark.parametrize("via_shell", [False, True])
def test_mpiexec_ranks_share_one_default_run_dir(tmp_path: Path, via_shell: bool) -> None:
    """No --dir: the ranks of one mpiexec find each other's dir (also under `bash -c`, where
    the parent is the shell and the launch is recognised by Hydra's proxy up the tree)."""
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        pytest.fail("mpiexec not found: install the 'mpi' extra")
    prog = tmp_path / "hello.py"
    prog.write_text("import distdiag\ndistdiag.mark('hello')\n")
    cmd = [*WRAP_CONSOLE, PY, str(prog)]
    if via_shell:
        cmd = ["bash", "-c", " ".join(cmd)]
    p = run([mpiexec, "-n", "2", *cmd], cwd=tmp_path, env=clean_env(DISTDIAG_HOOKS="mpi4py=0"))
    assert p.returncode == 0, p.stderr
    dirs = list(tmp_path.glob("distdiag-*"))
    assert len(dirs) == 1, dirs
    assert sorted(x.name for x in dirs[0].glob("rank-*")) == ["rank-00000.h5", "rank-00001.h5"]
    for r in (0, 1):
        _, _, attrs = events_of(rank_file(dirs[0], r))
        assert (int(attrs["rank"]), int(attrs["world_size"]), attrs["launcher"]) == (r, 2, "mpich")


FORK_PROG = """
import os, signal, sys, time
import distdiag
distdiag.mark("parent_before")
pid = os.fork()
if pid == 0:
    for i in range(1000):
        distdiag.mark("child")
    time.sleep(0.3)         # the parent's flusher runs meanwhile; the child has none
    sys.exit(0)             # runs atexit in the child: it must not touch the parent's file
os.waitpid(pid, 0)
r, w = os.pipe()
pid2 = os.fork()
if pid2 == 0:
    os.write(w, b"x")
    time.sleep(30)
    os._exit(0)
os.read(r, 1)                   # the child runs: SIGTERM must kill it as it would unwrapped
os.kill(pid2, signal.SIGTERM)
_, status = os.waitpid(pid2, 0)
print("child2", os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM)
distdiag.mark("parent_after")
"""


def test_forked_children_never_write_the_parents_file(tmp_path: Path) -> None:
    prog = tmp_path / "fork.py"
    prog.write_text(FORK_PROG)
    run_dir = tmp_path / "run"
    p = run([*WRAP_CONSOLE, "--dir", str(run_dir), PY, str(prog)], cwd=tmp_path,
            env=clean_env(DISTDIAG_FLUSH_INTERVAL_S="0.1"))
    assert p.returncode == 0, p.stderr
    assert p.stdout == "child2 True\n" and p.stderr == ""
    ev, s, attrs = events_of(rank_file(run_dir))
    names = list(s[ev["name_id"][ev["kind"] == Kind.MARK]])
    assert names == ["parent_before", "parent_after"]
    assert bool(attrs["closed_cleanly"]) and int(attrs["exit_code"]) == 0


def test_os_exit_still_closes_the_file(tmp_path: Path) -> None:
    prog = tmp_path / "hard.py"
    prog.write_text("import os, distdiag\ndistdiag.mark('before')\nprint('bye', flush=True)\nos._exit(6)\n")
    run_dir = tmp_path / "run"
    plain = run([PY, str(prog)], cwd=tmp_path)
    w = run([*WRAP_CONSOLE, "--dir", str(run_dir), PY, str(prog)], cwd=tmp_path, env=clean_env(DISTDIAG_FLUSH_INTERVAL_S="30"))
    assert (w.returncode, w.stdout, w.stderr) == (plain.returncode, plain.stdout, plain.stderr) == (6, "bye\n", "")
    ev, s, attrs = events_of(rank_file(run_dir))
    assert bool(attrs["closed_cleanly"]) and int(attrs["exit_code"]) == 6
    assert list(s[ev["name_id"][ev["kind"] == Kind.MARK]]) == ["before"]


CBLOCK_PROG = """
import hashlib, os, distdiag
distdiag.mark("before")
print("blocking", flush=True)
hashlib.pbkdf2_hmac("sha256", b"x", b"y", 2 * 10**9)   # minutes inside one C call, no signal checks
print("never")
"""


def _sigterm_inside_c(cmd: list[str], cwd: Path, env: dict[str, str]) -> tuple[int, float]:
    """Start ``cmd``, SIGTERM it once it printed "blocking" (then inside a long C call): its exit
    status and the seconds it took to end."""
    with _started(cmd, cwd, env) as p:
        _wait_line(p, "blocking")
        time.sleep(0.3)  # inside the C call
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=30)
        return p.returncode, time.monotonic() - t0


def test_sigterm_while_the_main_thread_sits_in_c_still_ends_the_rank_and_closes(tmp_path: Path) -> None:
    """Unwrapped, SIGTERM kills a process inside a long C call at once; wrapped it must too
    (within the watcher's grace), with the file closed, instead of waiting for SIGKILL."""
    prog = tmp_path / "cblock.py"
    prog.write_text(CBLOCK_PROG)
    run_dir = tmp_path / "run"
    rc, took_s = _sigterm_inside_c([*WRAP_CONSOLE, "--dir", str(run_dir), PY, str(prog)], tmp_path,
                                   clean_env(DISTDIAG_FLUSH_INTERVAL_S="30"))  # fmt: skip
    assert rc == -signal.SIGTERM
    assert took_s < 10
    ev, s, attrs = events_of(rank_file(run_dir))
    assert bool(attrs["closed_cleanly"]) and int(attrs["exit_code"]) == -signal.SIGTERM
    assert "before" in set(s[ev["name_id"]]) and "sigterm" in shim_names(rank_file(run_dir))


DAEMON_PROG = """
import hashlib, os, signal, sys, time
os.closerange(3, 65536)  # a daemonizer's: every descriptor it did not open itself
r, w = os.pipe()  # its own, on the lowest free numbers
time.sleep(1.5)
signal.signal(signal.SIGUSR1, lambda *a: None)
for i in range(3):
    os.kill(os.getpid(), signal.SIGUSR1)
    time.sleep(0.05)
os.set_blocking(r, False)
try:
    print("pipe got", os.read(r, 100), flush=True)
except BlockingIOError:
    print("pipe empty", flush=True)
if sys.argv[1:] == ["block"]:
    print("blocking", flush=True)
    hashlib.pbkdf2_hmac("sha256", b"x", b"y", 2 * 10**9)
"""


def test_a_program_that_closes_every_descriptor_gets_its_signals_as_unwrapped(tmp_path: Path) -> None:
    """Python's C signal handler writes to the wakeup descriptor the SIGTERM watcher gave it;
    after the program closed it, every signal printed "Exception ignored when trying to write to
    the signal wakeup fd ... Bad file descriptor" on the program's stderr (or wrote a byte into a
    file of the program's on that number). The watcher takes the number back while it is free,
    and SIGTERM inside a C call still ends the rank."""
    prog = tmp_path / "daemon.py"
    prog.write_text(DAEMON_PROG)
    plain = run([PY, str(prog)], cwd=tmp_path)
    w = run([*WRAP_CONSOLE, "--dir", str(tmp_path / "run"), PY, str(prog)], cwd=tmp_path)
    own = [ln for ln in w.stderr.splitlines() if not ln.startswith("distdiag: ")]  # the shim's one line: its file
    assert (w.returncode, w.stdout, own) == (plain.returncode, plain.stdout, []) == (0, "pipe empty\n", []), w.stderr
    rc, took_s = _sigterm_inside_c([*WRAP_CONSOLE, "--dir", str(tmp_path / "run2"), PY, str(prog), "block"], tmp_path,
                                   clean_env())  # fmt: skip
    assert rc == -signal.SIGTERM and took_s < 10


ASYNC_PROG = """
import asyncio, os, signal

async def main():
    loop = asyncio.get_running_loop()
    got = loop.create_future()
    loop.add_signal_handler(signal.SIGTERM, got.set_result, "term")
    os.kill(os.getpid(), signal.SIGTERM)
    print(await asyncio.wait_for(got, 10))
    loop.remove_signal_handler(signal.SIGTERM)

asyncio.run(main())
os.kill(os.getpid(), signal.SIGTERM)   # default action again
"""


def test_asyncio_signal_handlers_work_as_unwrapped(tmp_path: Path) -> None:
    prog = tmp_path / "aio.py"
    prog.write_text(ASYNC_PROG)
    plain = run([PY, str(prog)], cwd=tmp_path)
    w = run([*WRAP_CONSOLE, "--dir", str(tmp_path / "run"), PY, str(prog)], cwd=tmp_path)
    assert (w.returncode, w.stdout, w.stderr) == (plain.returncode, plain.stdout, plain.stderr)
    assert plain.returncode == -signal.SIGTERM and plain.stdout == "term\n"
    _, _, attrs = events_of(rank_file(tmp_path / "run"))
    assert bool(attrs["closed_cleanly"]) and int(attrs["exit_code"]) == -signal.SIGTERM


def test_safe_path_mode_adds_no_script_dir_as_unwrapped(tmp_path: Path) -> None:
    prog = _write(tmp_path, "argv")
    env = clean_env(PYTHONSAFEPATH="1")
    plain = run([PY, str(prog)], cwd=tmp_path, env=env)
    w = run([*WRAP_MODULE, "--dir", str(tmp_path / "r"), "python", str(prog)], cwd=tmp_path, env=env)
    assert (w.returncode, w.stdout, w.stderr) == (plain.returncode, plain.stdout, plain.stderr)
    assert str(prog.parent) not in plain.stdout.splitlines()[2]


def test_config_file_then_env_and_the_config_attr(tmp_path: Path) -> None:
    from distdiag.shim.config import load_config

    cfg_file = tmp_path / "site.toml"
    cfg_file.write_text('[shim]\nflush_interval_s = 0.25\nchunk_rows = 512\nbogus = 1\n[shim.hooks]\nfileio = false\n')
    cfg = load_config(cfg_file, environ={"DISTDIAG_CHUNK_ROWS": "2048", "DISTDIAG_HOOKS": "mpi4py=0"})
    assert (cfg.flush_interval_s, cfg.chunk_rows, cfg.hooks) == (0.25, 2048, {"fileio": False, "mpi4py": False})
    bad = load_config(cfg_file, environ={"DISTDIAG_FLUSH_INTERVAL_S": "soon"})  # bad value: file's kept
    assert bad.flush_interval_s == 0.25
    prog = tmp_path / "p.py"
    prog.write_text("pass\n")
    p = run([*WRAP_CONSOLE, "--dir", str(tmp_path / "run"), "--config", str(cfg_file), PY, str(prog)], cwd=tmp_path,
            env=clean_env(DISTDIAG_CHUNK_ROWS="1024"))
    assert p.returncode == 0 and p.stderr == "", p.stderr
    _, _, attrs = events_of(rank_file(tmp_path / "run"))
    recorded = json.loads(attrs["config"])
    assert (recorded["flush_interval_s"], recorded["chunk_rows"], recorded["hooks"]["fileio"]) == (0.25, 1024, False)
    assert "fileio" not in json.loads(attrs["hooks"])


CONTINUOUS_PROG = """
import distdiag
print("go", flush=True)
i = 0
while True:
    distdiag.mark("tick")
    i += 1
    if i % 1000 == 0:
        distdiag.step(samples=i)
"""


@pytest.mark.parametrize("delay_s", [0.0, 0.2, 0.5])
def test_sigkill_while_recording_continuously_leaves_a_gapless_prefix(tmp_path: Path, delay_s: float) -> None:
    """Killed at an arbitrary moment (flushes every 50 ms, so usually mid-write): the file opens
    and holds a prefix of the run without holes: STEP rows 1000, 2000, ... up to some k."""
    prog = tmp_path / "cont.py"
    prog.write_text(CONTINUOUS_PROG)
    run_dir = tmp_path / "run"
    with _started([*WRAP_CONSOLE, "--dir", str(run_dir), PY, str(prog)], tmp_path,
                  clean_env(DISTDIAG_FLUSH_INTERVAL_S="0.05")) as p:
        _wait_line(p, "go")
        _wait_flushed(rank_file(run_dir), "events", 3000)
        time.sleep(delay_s)
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=TIMEOUT_S)
    ev, s, attrs = events_of(rank_file(run_dir))
    steps = np.sort(ev["nbytes"][ev["kind"] == Kind.STEP])
    assert len(steps) >= 1
    np.testing.assert_array_equal(steps, 1000 * np.arange(1, len(steps) + 1))
    ticks = int((ev["kind"] == Kind.MARK).sum())
    assert ticks >= steps[-1]  # every tick before the last flushed step is there
    assert bool(attrs["closed_cleanly"]) is False


MPI_HANG_PROG = """
import os, sys, time
from mpi4py import MPI
comm = MPI.COMM_WORLD
comm.Barrier()
if comm.Get_rank() == 1:
    time.sleep(60)            # never joins the second barrier
print("entering", comm.Get_rank(), os.getpid(), flush=True)
comm.Barrier()                # rank 0 busy-polls in MPICH's C code here
"""


@pytest.mark.mpi
def test_sigterm_to_a_rank_hung_in_a_collective_ends_it_with_the_call_in_flight(tmp_path: Path) -> None:
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        pytest.fail("mpiexec not found: install the 'mpi' extra")
    prog = tmp_path / "hang.py"
    prog.write_text(MPI_HANG_PROG)
    run_dir = tmp_path / "run"
    p = subprocess.Popen([mpiexec, "-n", "2", *WRAP_CONSOLE, "--dir", str(run_dir), PY, str(prog)], cwd=tmp_path,
                         env=clean_env(DISTDIAG_FLUSH_INTERVAL_S="30"), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        line = _wait_line(p, "entering 0", timeout_s=60)
        rank0_pid = int(line.split()[2])  # a process of this test's own job
        time.sleep(0.5)
        os.kill(rank0_pid, signal.SIGTERM)
        p.wait(timeout=60)  # Hydra ends the job once rank 0 is gone
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)  # the job's own process group (start_new_session)
            p.wait(timeout=TIMEOUT_S)
    with open_rank_file(rank_file(run_dir, 0)) as f:
        attrs, s = dict(f.attrs), f["strings"].asstr()[:]
        inflight = f["inflight"][:]
    assert bool(attrs["closed_cleanly"]) and int(attrs["exit_code"]) == -signal.SIGTERM
    assert len(inflight) == 1 and s[inflight["name_id"][0]] == "Barrier" and inflight["t1_ns"][0] == -1
