"""``distdiag-wrap``: run a Python program unchanged, with the per-rank shim.

::

    distdiag-wrap [--dir DIR] [--[no-]probe-links] [--config FILE] [--] python script.py args...
    distdiag-wrap [...] python -m module args...
    distdiag-wrap [...] script.py args...
    python -m distdiag.wrap script.py args...        # for torchrun -m distdiag.wrap

The target runs in this process (no child), so the program sees what it would
see under ``python`` itself: ``sys.argv`` (``argv[0]`` as typed for a script,
the module's file for ``-m``), ``sys.path[0]`` (the script's directory, or the
working directory for ``-m``), a fresh ``__main__`` module that stays in
``sys.modules`` (so classes defined in the script pickle, also from threads and
``atexit`` handlers), the same stdout/stderr, exit code and traceback.

The interpreter is the one the command names, with its options: when
``python`` there is the wrapper's own interpreter (same binary, same venv) and
no interpreter options are given, the program runs right here; otherwise
(``/usr/bin/python3``, another venv's ``python``, ``python -u``, ``-X dev``,
``-O``, ``-W error``) the wrapper re-executes itself, in the same process
(``exec``), under that interpreter and options (:func:`_reexec`), or, when
distdiag is not importable there, says so in one line and exits 2. Without an
interpreter in the command (``distdiag-wrap script.py``, ``torchrun -m
distdiag.wrap script.py``) the program runs under the wrapper's interpreter.

Exit handling mirrors the interpreter's: ``SystemExit`` and
``KeyboardInterrupt`` propagate unchanged (so ``sys.exit("msg")`` prints,
``Ctrl-C`` ends by SIGINT); an uncaught exception goes to ``sys.excepthook``
(the user's, if they set one) with the wrapper's frames cut off, exit code 1.

Sequence: rank info -> config -> run dir -> Recorder -> Writer -> SESSION ->
hooks -> clock sync -> SHIM "shim_start"/"target_start" rows -> target ->
"target_end" -> clock stop -> (atexit) writer close. The file is closed from an
``atexit`` handler registered before the target runs, so it runs after the
program's own atexit handlers and after its non-daemon threads finished: their
events are kept. SIGTERM closes the file at once (see :class:`_SigtermChain`).

Recording never breaks the job: if the run dir or file cannot be created the
wrapper prints one line (``distdiag: ...; the job runs without recording``)
and runs the program as is.
"""

from __future__ import annotations

import atexit
import builtins
import dataclasses
import io
import json
import logging
import os
import re
import secrets
import select
import shutil
import signal
import socket
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any, Callable, Sequence

from distdiag.schema import Kind, allowed_env, rank_file_name
from distdiag.shim.ownfd import dup_above, fd_is, ident, let_go, still_ours

log = logging.getLogger(__name__)

PROG = "distdiag-wrap"
USAGE = (
    f"usage: {PROG} [--dir DIR] [--[no-]probe-links] [--config FILE] [--] python script.py args...\n"
    f"       {PROG} [--dir DIR] [--[no-]probe-links] [--config FILE] [--] python -m module args...\n"
    "Runs the Python program unchanged and records this rank into DIR/rank-NNNNN.h5\n"
    "(DIR: --dir, else $DISTDIAG_DIR, else distdiag-<jobid> under Slurm,\n"
    "else distdiag-<YYYYmmdd-HHMMSS>-<launchhash> in the working directory)."
)
#: How long the SIGTERM watcher lets the main thread run our handler before acting itself.
SIGTERM_GRACE_S = 1.0
#: how often the SIGTERM watcher checks that its wakeup pair is still its own (see _mend_wake)
WAKE_CHECK_S = 1.0
#: How long ranks other than 0 look for rank 0's run dir before making their own.
FIND_DIR_WAIT_S = 3.0
#: What rank 0 publishes in the run dir it makes for its launch (default dir only):
#: ``{"launch_id": "<launchhash>.<nonce>", "pid": ..., "host": ..., "start": ...}``.
LAUNCH_FILE = "launch.json"
#: A rank whose file exists in its run dir records into the first of DIR.relaunch-1, -2, ...
#: where it does not (a rank file is never overwritten); this many at most.
MAX_SIBLING_DIRS = 1000
_PYTHON_RE = re.compile(r"^python(\d+(\.\d+)?)?$")


class UsageError(Exception):
    pass


@dataclasses.dataclass
class Options:
    dir: str | None = None
    #: True: --probe-links, False: --no-probe-links, None: the config's (default "auto")
    probe_links: bool | None = None
    config: str | None = None


@dataclasses.dataclass
class Target:
    kind: str  # "script" | "module" | "code"
    value: str  # script path as typed, module name, or code text
    args: list[str]
    #: the interpreter token as typed ("python3", "/usr/bin/python3"); None when the
    #: command names none (``distdiag-wrap script.py``, ``torchrun -m distdiag.wrap x.py``)
    interpreter: str | None = None
    #: interpreter options before the program, as the interpreter reads them ("-u", "-X", "dev")
    pyopts: list[str] = dataclasses.field(default_factory=list)

    @property
    def command(self) -> list[str]:
        """The program as typed after ``python``: ["train.py", ...], ["-m", "pkg.mod", ...], ["-c", code, ...]."""
        if self.kind == "module":
            return ["-m", self.value] + self.args
        if self.kind == "code":
            return ["-c", self.value] + self.args
        return [self.value] + self.args

    @property
    def argv(self) -> list[str]:
        """sys.argv as the interpreter sets it before the code runs."""
        if self.kind == "module":
            return ["-m"] + self.args  # runpy puts the module's file in argv[0]
        if self.kind == "code":
            return ["-c"] + self.args
        return [self.value] + self.args


# -- command line ------------------------------------------------------------------
def _is_python(tok: str) -> bool:
    if _PYTHON_RE.match(os.path.basename(tok)):
        return True
    try:
        found = shutil.which(tok) if os.sep not in tok else tok
        return found is not None and os.path.realpath(found) == os.path.realpath(sys.executable)
    except Exception:
        return False


def _looks_like_script(tok: str) -> bool:
    if tok.endswith((".py", ".pyw")):
        return True
    try:
        with open(tok, "rb") as f:
            first = f.readline(200)
        return first.startswith(b"#!") and b"python" in first
    except OSError:
        return False


def _cannot_wrap(tok: str) -> UsageError:
    return UsageError(
        f"can only wrap Python programs ('python script.py' or 'python -m module'), got {tok!r}"
    )


def parse_args(argv: Sequence[str], interpreter_chosen: bool = False) -> tuple[Options, Target]:
    """Split distdiag-wrap's own options from the target command.

    ``interpreter_chosen``: the wrapper was re-executed by the interpreter the
    user named (see :func:`_reexec`); the program follows ``--`` directly, as
    the interpreter's own arguments (``script.py ...``, ``-m mod ...``)."""
    opts = Options()
    i = 0
    argv = list(argv)
    while i < len(argv):
        a = argv[i]
        if a == "--":
            i += 1
            break
        if a in ("-h", "--help"):
            raise UsageError("help")
        if a == "--probe-links":
            opts.probe_links = True
        elif a == "--no-probe-links":
            opts.probe_links = False
        elif a in ("--dir", "--config"):
            if i + 1 >= len(argv):
                raise UsageError(f"{a} needs a value")
            setattr(opts, a[2:], argv[i + 1])
            i += 1
        elif a.startswith(("--dir=", "--config=")):
            k, _, v = a[2:].partition("=")
            setattr(opts, k, v)
        elif a.startswith("-"):
            raise UsageError(f"unknown option {a!r}")
        else:
            break
        i += 1
    rest = argv[i:]
    if not rest:
        raise UsageError("no program to run")
    if interpreter_chosen:
        return opts, _parse_python_args(rest, None)
    head = rest[0]
    if not _is_python(head):
        if _looks_like_script(head):
            return opts, Target("script", head, rest[1:])
        raise _cannot_wrap(head)
    return opts, _parse_python_args(rest[1:], head)


#: interpreter options without a value, passed on as typed (see _reexec)
_PY_FLAGS = frozenset("bBdEIOPqRsSuv")
#: interpreter options that would change what runs, refused with the reason
_PY_REFUSED = {
    "i": "interactive inspection after the program",
    "x": "skipping the script's first line",
}


def _parse_python_args(args: list[str], interpreter: str | None) -> Target:
    """The interpreter's options as it parses them (``-uW error``, ``-OO``, ``-Xdev``,
    ``-uc code``), then the program."""
    pyopts: list[str] = []
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--":
            i += 1
            break
        if a == "--check-hash-based-pycs":
            if i + 1 >= len(args):
                raise UsageError(f"python {a} needs a value")
            pyopts += [a, args[i + 1]]
            i += 2
            continue
        if a.startswith("--") or a in ("-h", "-?", "-V"):
            raise UsageError(f"python option {a!r} runs no program: nothing to wrap")
        if not a.startswith("-") or a == "-":
            break
        j = 1
        while j < len(a):
            c = a[j]
            if c in "cm":
                kind = "module" if c == "m" else "code"
                if j + 1 < len(a):
                    value, rest = a[j + 1 :], args[i + 1 :]
                elif i + 1 < len(args):
                    value, rest = args[i + 1], args[i + 2 :]
                else:
                    raise UsageError(f"python -{c} needs an argument")
                return Target(kind, value, rest, interpreter, pyopts)
            if c in "WX":
                if j + 1 < len(a):
                    val = a[j + 1 :]
                elif i + 1 < len(args):
                    i += 1
                    val = args[i]
                else:
                    raise UsageError(f"python -{c} needs a value")
                pyopts += [f"-{c}", val]
                break
            if c in _PY_REFUSED:
                raise UsageError(f"python option -{c} ({_PY_REFUSED[c]}) cannot be wrapped")
            if c not in _PY_FLAGS:
                raise UsageError(f"unknown python option -{c}")
            pyopts.append(f"-{c}")
            j += 1
        i += 1
    if i >= len(args):
        raise UsageError("no Python program given (interactive python cannot be wrapped)")
    if args[i] == "-":
        raise UsageError("cannot wrap a program read from stdin ('python -')")
    return Target("script", args[i], args[i + 1 :], interpreter, pyopts)


# -- the interpreter the user named ------------------------------------------------------
def _env_key(exe: str) -> tuple[str, str | None]:
    """What decides the environment an interpreter runs in: its binary, and its venv
    (``pyvenv.cfg`` beside the path as typed or one dir up, where the interpreter looks)."""
    a = os.path.abspath(exe)
    d = os.path.dirname(a)
    venv = next((p for p in (d, os.path.dirname(d)) if os.path.isfile(os.path.join(p, "pyvenv.cfg"))), None)
    return os.path.realpath(a), venv


def _which(tok: str) -> str | None:
    """The file ``tok`` names as an exec of it finds it: on PATH for a bare name."""
    if os.sep not in tok:
        return shutil.which(tok)
    return tok if os.path.isfile(tok) and os.access(tok, os.X_OK) else None


def _interpreter_path(t: Target) -> str | None:
    """The file of the interpreter the user named, when the program must run under it rather
    than here: another binary or venv (``/usr/bin/python3`` while the wrapper runs under a
    pyenv 3.11.7; a launcher script such as a pyenv shim, which picks the interpreter
    itself), or interpreter options (``-u``, ``-O``, ``-X dev``, ``-W``: only the interpreter
    applies them exactly, at its start). None: run here, nothing re-executed (``python`` on
    PATH is the wrapper's own interpreter). Raises UsageError when the named one is not found."""
    tok = t.interpreter
    if tok is None:
        return None
    found = _which(tok)
    if found is None:
        raise UsageError(f"interpreter {tok!r} not found" + ("" if os.sep in tok else " on PATH"))
    if not t.pyopts and sys.executable and _env_key(found) == _env_key(sys.executable):
        _adopt_executable(found)
        return None
    return found


def _adopt_executable(found: str) -> None:
    """``sys.executable`` as the named interpreter sets it from its ``argv[0]`` (the PATH
    entry or the path as typed, made absolute and normalized, links not resolved):
    ``python`` gives ``.../bin/python``, not the wrapper's ``.../bin/python3``. The same
    binary and venv, so only the name differs (it is what the program's ``subprocess``
    and ``multiprocessing`` children run)."""
    exe = os.path.abspath(found)
    if exe != sys.executable:
        if getattr(sys, "_base_executable", None) == sys.executable:  # not a venv: the same name
            sys._base_executable = exe  # type: ignore[attr-defined]
        sys.executable = exe


#: What the named interpreter runs (``<python> [options] -c _BOOT <wrap options> -- <program>``):
#: the wrapper when this distdiag (one with :func:`main_chosen`) is importable there, else
#: one line and exit code 2. It is the interpreter's ``-c`` code, so ``sys.path[0]`` is the
#: working directory while distdiag is imported, as for ``python -m distdiag.wrap``.
_BOOT = """\
import sys
try:
    from distdiag.shim.wrap import main_chosen
except Exception as e:
    sys.stderr.write("distdiag-wrap: %s cannot import distdiag (%s: %s); install distdiag there, or name the interpreter distdiag-wrap runs under (%s)\\n" % (sys.executable, type(e).__name__, " ".join(str(e).split()), {own!r}))
    raise SystemExit(2)
sys.exit(main_chosen(sys.argv[1:]))
"""


def _reexec(path: str, opts: Options, t: Target) -> int:
    """Replace this process by the named interpreter, with its options, running the wrapper
    on the program. ``exec``, not a child: the pid (launchers, ``srun``, ``kill``), parent,
    environment, open descriptors, signal dispositions and mask stay what they were, and
    the rank's launch detection sees the same process. The interpreter gets ``argv[0]`` as
    typed, so it finds itself (``sys.executable``, its venv) as it would unwrapped. Nothing
    of the shim is set up yet. Returns only on failure."""
    own = ["--dir", opts.dir] if opts.dir is not None else []
    own += [] if opts.probe_links is None else ["--probe-links" if opts.probe_links else "--no-probe-links"]
    own += ["--config", opts.config] if opts.config is not None else []
    # a script after "--": the interpreter-chosen parse reads it as a path whatever its name
    prog = ["--", *t.command] if t.kind == "script" else t.command
    argv = [t.interpreter or path, *t.pyopts, "-c", _BOOT.format(own=sys.executable), *own, "--", *prog]
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execv(path, argv)
    except OSError as e:
        sys.stderr.write(f"{PROG}: cannot run {t.interpreter!r}: {e.strerror or e}\n")
    return 2


# -- run dir -------------------------------------------------------------------------
#: Mode of a run dir the shim makes: its files hold the command line, the recorded
#: environment and the program's paths (support staff get it by the user's chmod)
RUN_DIR_MODE = 0o700


class UnsafeRunDir(OSError):
    """A run dir that is not the user's own (another owner, writable by others, not a dir)."""


def _dir_problem(d: Path) -> str | None:
    """Why the shim must not write into ``d`` (None: it may). It must be a directory of
    this user (the effective uid) that nobody else can write: anyone who can write
    there can swap a file for a link (the shim's writes then land in their target)
    or read what the job records. A link as the last component is followed only
    when it is the user's own (or root's) and leads to such a directory."""
    import stat

    euid = os.geteuid()
    try:
        st = os.lstat(d)
        if stat.S_ISLNK(st.st_mode):
            if st.st_uid not in (euid, 0):
                return f"is a link of another user (uid {st.st_uid})"
            st = os.stat(d)
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid != euid:
        return f"belongs to another user (uid {st.st_uid}, not {euid})"
    # (the group looked up only for a group-writable dir: with LDAP it is a network call)
    if st.st_mode & 0o002 or (st.st_mode & 0o020 and not _private_group(st.st_gid)):
        return f"is writable by others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def _private_group(gid: int) -> bool:
    """Whether ``gid`` is this user's private group (the user's primary group, named
    as the user, with no other members): with umask 002 (RHEL's default for such
    groups) a dir the user made is group-writable and still the user's alone."""
    try:
        import grp
        import pwd

        pw = pwd.getpwuid(os.geteuid())
        g = grp.getgrgid(gid)
    except (ImportError, KeyError, OSError):
        return False
    return gid == pw.pw_gid and g.gr_name == pw.pw_name and not [m for m in g.gr_mem if m != pw.pw_name]


def make_run_dir(d: Path) -> None:
    """Create ``d`` (mode :data:`RUN_DIR_MODE`; missing parents as ``mkdir -p``
    makes them) or check the one there: reused only when :func:`_dir_problem`
    finds none, else :class:`UnsafeRunDir` (the wrapper then runs the job
    without recording, after one stderr line)."""
    try:
        os.mkdir(d, RUN_DIR_MODE)
    except FileExistsError:
        pass
    except FileNotFoundError:
        d.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.mkdir(d, RUN_DIR_MODE)
        except FileExistsError:
            pass
    problem = _dir_problem(d)
    if problem is not None:
        raise UnsafeRunDir(f"{d} {problem}; distdiag records only into a dir of yours that nobody else can write")


def resolve_run_dir(
    opt_dir: str | None,
    info: Any,
    environ: dict[str, str] | os._Environ[str] | None = None,
    cwd: Path | None = None,
    wait_s: float = FIND_DIR_WAIT_S,
) -> Path:
    """The run directory, created if needed (:func:`resolve_run` without the launch id)."""
    return resolve_run(opt_dir, info, environ, cwd, wait_s)[0]


def resolve_run(
    opt_dir: str | None,
    info: Any,
    environ: dict[str, str] | os._Environ[str] | None = None,
    cwd: Path | None = None,
    wait_s: float = FIND_DIR_WAIT_S,
) -> tuple[Path, str]:
    """The run directory, created if needed, and the launch id this rank records.
    Raises OSError when the directory cannot be made.

    ``--dir``, else ``$DISTDIAG_DIR``, else ``distdiag-<jobid>`` under Slurm
    (``distdiag-<jobid>.<step>`` for steps other than 0), else
    ``distdiag-<YYYYmmdd-HHMMSS>-<launchhash>``: rank 0 makes a fresh one
    (never one that exists: a second launch in the same second gets
    ``distdiag-<stamp>.2-<launchhash>``) and publishes in it
    :data:`LAUNCH_FILE`, with a launch id unique to this launch
    (``<launchhash>.<nonce>``). The launch hash alone is the same for two
    launches with the same launcher settings (torchrun's ``--rdzv-id`` and
    ``--master-port``, or the same parent process), so the other ranks look
    for up to ``wait_s`` seconds for the newest ``distdiag-*-<launchhash>``
    that rank 0 published, that holds no file of their rank yet (one that
    does belongs to an earlier launch) and whose rank 0 is not known to have
    ended (same host: its process is gone), and take its launch id; when none
    appears (e.g. a node without a shared cwd) they make their own, with the
    launch hash as the id. With ``--dir``, ``$DISTDIAG_DIR`` or Slurm the
    launch id is the launch hash / job id as before.
    """
    env = os.environ if environ is None else environ
    base = Path.cwd() if cwd is None else cwd
    launch_id = info.launch_id
    if opt_dir:
        d = Path(opt_dir)
    elif env.get("DISTDIAG_DIR"):
        d = Path(env["DISTDIAG_DIR"])
    elif info.job_id:
        d = base / f"distdiag-{info.launch_id}"
    else:
        d, launch_id = _find_or_make_launch_dir(base, info.rank, info.launch_hash, wait_s)
    make_run_dir(d)
    return d, launch_id


def _proc_start(pid: int) -> int | None:
    """The start time of process ``pid`` (clock ticks since boot, /proc/PID/stat field 22);
    None when unknown. With the pid it names one process, even after the pid is reused."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
        return int(stat[stat.rfind(")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _maybe_alive(doc: dict[str, Any]) -> bool:
    """False only when the process that published ``doc`` is known to have ended
    (it ran on this host and is gone, or its pid now names another process)."""
    try:
        if doc.get("host") != socket.gethostname():
            return True  # another node's process: cannot tell
        pid = int(doc["pid"])
    except Exception:
        return True
    if os.path.isdir("/proc/self"):
        start = _proc_start(pid)
        if start is None:
            return False
        return doc.get("start") in (None, start)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        pass
    return True


def _publish_launch(d: Path, launch_id: str) -> None:
    """Rank 0: write LAUNCH_FILE into its run dir, atomically (a reader never sees half of it)."""
    doc = {
        "launch_id": launch_id,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "start": _proc_start(os.getpid()),
    }
    from distdiag.shim.rankfile import write_private_file

    try:  # exclusive temp file, 0600, never through a link
        write_private_file(d / LAUNCH_FILE, json.dumps(doc).encode())
    except OSError:
        log.debug("distdiag: %s not published in %s", LAUNCH_FILE, d, exc_info=True)


def _read_launch(d: Path) -> dict[str, Any] | None:
    from distdiag.shim.rankfile import read_own_file

    raw = read_own_file(d / LAUNCH_FILE)  # a regular file of this user's only
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) and isinstance(doc.get("launch_id"), str) else None


def _find_or_make_launch_dir(base: Path, rank: int, lhash: str, wait_s: float) -> tuple[Path, str]:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    if rank == 0:
        launch_id = f"{lhash}.{secrets.token_hex(3)}"
        for k in range(1, MAX_SIBLING_DIRS):
            d = base / (f"distdiag-{stamp}-{lhash}" if k == 1 else f"distdiag-{stamp}.{k}-{lhash}")
            try:
                base.mkdir(parents=True, exist_ok=True)
                os.mkdir(d, RUN_DIR_MODE)  # a fresh one, ours: never one that is there (a link neither)
            except FileExistsError:
                continue
            _publish_launch(d, launch_id)
            return d, launch_id
        return base / f"distdiag-{stamp}-{lhash}", launch_id  # exists: the writer moves on from it
    deadline = time.monotonic() + wait_s
    while True:
        found = _find_launch_dir(base, lhash, rank)
        if found is not None:
            return found
        if time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    log.debug("distdiag: no run dir of launch %s found; rank %d makes its own", lhash, rank)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for k in range(1, MAX_SIBLING_DIRS):
        # never a rank 0's dir (one this rank passed over); another lone rank's of the same second is shared
        d = base / (f"distdiag-{stamp}-{lhash}" if k == 1 else f"distdiag-{stamp}.{k}-{lhash}")
        if not os.path.lexists(d / LAUNCH_FILE) and (not os.path.lexists(d) or _dir_problem(d) is None):
            return d, lhash
    return base / f"distdiag-{stamp}-{lhash}", lhash


def _find_launch_dir(base: Path, lhash: str, rank: int = -1, max_age_s: float = 600.0) -> tuple[Path, str] | None:
    """The newest ``distdiag-*-<lhash>`` made recently whose rank 0 published this
    launch's id, that holds no file of ``rank`` yet and whose rank 0 may still run
    (a dir failing either belongs to an earlier launch with the same hash). Only
    a real directory (not a link) of this user that nobody else can write: a
    shared working directory may hold another user's dir (or link) of that name."""
    import stat

    from distdiag.schema import rank_file_name

    now = time.time()
    found: list[Path] = []
    try:
        for p in base.glob(f"distdiag-*-{lhash}"):
            try:
                st = os.lstat(p)
                if stat.S_ISDIR(st.st_mode) and now - st.st_mtime < max_age_s and _dir_problem(p) is None:
                    found.append(p)
            except OSError:
                continue
    except OSError:
        return None
    for p in sorted(found, key=lambda q: q.name, reverse=True):  # newest first
        doc = _read_launch(p)
        if doc is None:
            continue  # not made by a rank 0 (yet)
        if rank >= 0 and os.path.lexists(p / rank_file_name(rank)):
            continue  # this rank already recorded there: an earlier launch's dir
        if not _maybe_alive(doc):
            continue
        return p, str(doc["launch_id"])
    return None


def _open_rank_file(run_dir: Path, name: str, rec: Any, cfg: Any, attrs: dict[str, Any]) -> tuple[Any, Path]:
    """The rank's Writer, created exclusively, and the dir it is in.

    A rank file is never overwritten: when ``run_dir/name`` exists (an earlier
    launch's, a rerun into the same ``--dir``) the rank records into the first
    of ``DIR.relaunch-1``, ``DIR.relaunch-2``, ... that holds no such file (so
    the ranks of one relaunch land together; the name is neither a Slurm
    step's ``distdiag-<jobid>.<step>`` nor, not ending in the launch hash, a
    dir the other ranks' search would join) and says so in one stderr line."""
    from distdiag.shim.rankfile import RankFile

    first = run_dir / name
    root = run_dir.absolute()
    for k in range(MAX_SIBLING_DIRS):
        d = run_dir if k == 0 else root.with_name(f"{root.name}.relaunch-{k}")
        if k:
            if os.path.lexists(d / name):
                continue
            try:
                make_run_dir(d)
            except UnsafeRunDir:
                continue  # not ours (or open to others): the next one
        try:
            w = RankFile(d / name, rec, cfg, attrs)
        except FileExistsError:
            continue
        if k:
            try:
                sys.stderr.write(
                    f"distdiag: {first} exists (another launch's; a rank file is never overwritten); "
                    f"this rank records into {d / name}\n"
                )
                sys.stderr.flush()
            except Exception:
                pass
        return w, d
    raise FileExistsError(f"{first} exists, and so does {name} in {MAX_SIBLING_DIRS - 1} dirs next to it")


# -- the shim's state ------------------------------------------------------------------
def _drain_preload() -> None:
    """What the libc interposer recorded, into rows, before the last rows are written."""
    try:
        from distdiag.shim import preload

        preload.drain_now(final=True)
    except Exception:
        pass


class _Shim:
    """Everything wrap set up, and its orderly teardown."""

    def __init__(self, rec: Any, writer: Any, clock: Any) -> None:
        self.rec = rec
        self.writer = writer
        self.clock = clock
        self.pid = os.getpid()
        #: in a forked child: what the child records (see _ForkStream); set by setup()
        #: with what a child's file needs: config, run dir, rank and the rank's attributes
        self.fork: _ForkStream | None = None
        self.fork_args: tuple[Any, Path, int, dict[str, Any]] | None = None
        #: the rank's helper's connector (writer = "process"): forked children's files go to it too
        self.connector: Any = getattr(writer, "connector", None)
        self.exit_code: int | None = None
        self.target_ended = False
        self._closed = False
        # reentrant: the SIGTERM handler may interrupt the main thread inside close()
        self._lock = threading.RLock()
        self.sigterm: _SigtermChain | None = None
        # Interned now: a signal handler must never wait on the string table's
        # lock, which the interrupted main thread may hold.
        for name in ("sigterm", "sigterm_ignored", "target_end", "lost_events"):
            rec.intern(name)

    def patch_os_exit(self) -> None:
        """``os._exit(n)`` skips atexit: close the file first (only in this process, not in forks)."""
        orig = os._exit
        self._orig_os_exit = orig

        def _exit(n: int) -> None:  # the signature of os._exit
            try:
                if os.getpid() == self.pid:
                    self.target_end(int(n))
                    self.close(int(n))
                else:  # a forked child (multiprocessing's workers end so): its own file
                    self._close_fork(int(n))
            except BaseException:
                pass
            orig(n)

        os._exit = _exit  # type: ignore[assignment]

    def shim_row(self, name: str, t_ns: int | None = None) -> None:
        from distdiag.shim.recorder import now_ns

        try:
            t = now_ns() if t_ns is None else t_ns
            self.rec.add(t, t, Kind.SHIM, self.rec.intern(name))
        except Exception:
            log.debug("distdiag: shim row %s not recorded", name, exc_info=True)

    def target_end(self, exit_code: int) -> None:
        """The target finished (any way): mark it, finish the clock exchanges."""
        if os.getpid() != self.pid:
            fork = self.fork
            if fork is not None and fork.pid == os.getpid():
                fork.exit_code = exit_code  # a forked child leaving through the program's end
            return
        if self.target_ended:
            return
        self.target_ended = True
        self.exit_code = exit_code
        self.shim_row("target_end")
        self._stop_clock()

    def _stop_clock(self) -> None:
        clock, self.clock = self.clock, None
        if clock is not None:
            try:
                clock.stop()
            except Exception:
                log.debug("distdiag: clock sync stop failed", exc_info=True)

    def flush(self) -> None:
        if os.getpid() == self.pid:
            self.writer.flush()

    def close(self, exit_code: int | None = None) -> None:
        """Final flush and close. Idempotent; a forked child never touches the parent's file
        (it closes its own, see _ForkStream)."""
        if os.getpid() != self.pid:
            self._close_fork(exit_code)
            return
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if exit_code is not None:
            self.exit_code = exit_code
        try:
            from distdiag.shim import hooks

            hooks.cancel_all()
        except Exception:
            pass
        _drain_preload()
        self.writer.close(self.exit_code)
        if self.sigterm is not None:
            self.sigterm.restore()
        orig_exit = getattr(self, "_orig_os_exit", None)
        if orig_exit is not None:
            os._exit = orig_exit

    def close_at_exit(self) -> None:
        """The atexit handler: :meth:`close`, saying it is the interpreter's exit (h5py's own
        exit handler then runs right after the file's close, see distdiag.shim.rankfile)."""
        try:
            from distdiag.shim import rankfile

            rankfile.EXITING = True
        except Exception:
            pass
        self.close()

    def _close_fork(self, exit_code: int | None) -> None:
        fork = self.fork
        if fork is not None and fork.pid == os.getpid():
            _drain_preload()
            fork.close(exit_code)

    def _after_fork_in_child(self) -> None:
        # The child inherits the open HDF5 handle: it must never write, flush or
        # close it (see Writer.detach); nor the file of the process it forked
        # from, when that was itself a forked child.
        # a child of the rank itself starts its table with the rank's strings, which the rank's
        # helper has: its stream sends only those made after the fork (a grandchild sends all)
        inherited = len(self.rec.strings.strings) if self.fork is None else 0
        try:
            self.writer.detach()
            if self.fork is not None:
                self.fork.detach()
                self.fork = None
        except Exception:
            pass
        if self.sigterm is not None:
            # The child gets the program's own SIGTERM disposition back (the
            # kernel's default kills it at once, not at the next bytecode).
            self.sigterm.restore(in_child=True)
        try:
            from distdiag.shim import recorder, session

            session.SESSION = None
            recorder.RECORDER = None
        except Exception:
            pass
        # What the child records goes to a file of its own (the parent's rows stay
        # the parent's): the hooks keep the recorder, the recorder forgets the
        # parent's rows, and the child's file starts when the child first records.
        try:
            self.rec.on_new_buffer = None
            self.rec.reset_after_fork()
            if self.fork_args is not None:
                cfg, run_dir, rank, attrs = self.fork_args
                self.fork = _ForkStream(self.rec, cfg, run_dir, rank, attrs, self.connector, inherited)
                self.rec.on_new_buffer = self.fork.wake
            else:  # nobody would write what it records: keep it bounded
                self.rec.max_pending_chunks = 0
        except Exception:
            pass


def _child_role() -> str:
    """What a forked process is, for its file's ``role`` (distdiag.children): a DataLoader
    worker (torch's worker loop has set its worker info), a ``multiprocessing`` child, or
    another ``fork``. Read from modules already loaded; imports nothing."""
    w = sys.modules.get("torch.utils.data._utils.worker")
    if w is not None and getattr(w, "_worker_info", None) is not None:
        return "dataloader_worker"
    mp = sys.modules.get("multiprocessing")
    try:
        if mp is not None and mp.parent_process() is not None:
            return "multiprocessing"
    except Exception:
        pass
    return "fork"


class _ForkStream:
    """What a process forked from the rank records (DataLoader workers, daemons, ``pty.fork``):
    its own file, ``rank-NNNNN.fork-PID.h5`` in the rank's run dir (:func:`fork_file_name`).

    Nothing happens at the fork itself (a child that execs or ends at once
    costs a few microseconds and leaves no file). When a thread of the child
    first records, the recorder calls :meth:`wake`, which starts a flusher
    thread; the file is made at its first flush (one interval later) that has
    rows, with the rank's attributes plus ``pid`` (the child's) and
    ``forked_from_pid``, and written every interval like a rank's (string ids
    renumbered to the strings its rows use). The child's exit (``sys.exit``,
    the end of the program, ``os._exit`` as multiprocessing's workers end)
    writes the rest and closes it; a child killed by a signal loses at most one
    interval, as a rank does. If the file cannot be made, one stderr line, and
    the child's recording stays within the recorder's bound (its full chunks
    are dropped and counted).
    """

    def __init__(
        self,
        rec: Any,
        cfg: Any,
        run_dir: Path,
        rank: int,
        attrs: dict[str, Any],
        connector: Any = None,
        inherited: int = 0,
    ) -> None:
        from distdiag.shim.recorder import now_ns
        from distdiag.shim.rankfile import fork_file_name

        self.pid = os.getpid()
        self.rec = rec
        self.cfg = cfg
        self.path = Path(run_dir) / fork_file_name(rank, self.pid)
        t = now_ns()
        self.attrs = {
            **{k: v for k, v in attrs.items() if k != "process_start_mono_ns"},  # the rank's, not this child's
            "pid": self.pid,
            "forked_from_pid": os.getppid(),
            "wall_ns_at_start": time.time_ns(),
            "mono_ns_at_start": t,
            "last_flush_mono_ns": t,
        }
        self.interval_s = float(getattr(cfg, "flush_interval_s", 1.0))
        #: the rank's helper (writer = "process"): it writes this file too, from a stream
        self.connector = connector
        self.inherited = inherited
        self.exit_code: int | None = None
        self.writer: Any = None
        self.failed = False
        self._closed = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        rec.max_pending_chunks = int(getattr(cfg, "max_pending_chunks", rec.max_pending_chunks))

    def wake(self) -> None:
        """The child recorded its first row on some thread: start the flusher (once)."""
        if self._thread is not None or self._closed or os.getpid() != self.pid:
            return
        self.rec.on_new_buffer = None
        t = threading.Thread(target=self._loop, name="distdiag-fork-flusher", daemon=True)
        self._thread = t
        t.start()

    def _loop(self) -> None:
        self.rec.mute_thread()  # the file's own calls (h5py's imports) are not the child's I/O
        while not self._stop.wait(self.interval_s):
            with self._lock:
                if self._closed:
                    return
                w = self.writer if self.writer is not None else self._open()
                if w is not None:
                    w.flush()

    def _has_rows(self) -> bool:
        rec = self.rec
        return bool(rec.full) or rec.lost_events > 0 or any(tb.n for tb in list(rec.buffers))

    def _open(self) -> Any:
        """The child's Writer, made now if the child has rows to write; None otherwise."""
        if self.failed or not self._has_rows():
            return None
        from distdiag.shim.rankfile import RankFile

        try:
            self.attrs["role"] = _child_role()
            if self.connector is not None:
                try:  # the rank's helper writes it: this process loads no h5py and opens nothing in the run dir
                    self.writer = RankFile(self.path, self.rec, self.cfg, self.attrs, compact_strings=True,
                                           connector=self.connector, inherited=self.inherited)  # fmt: skip
                    return self.writer
                except OSError as e:  # the helper has ended: written here, as with writer = "thread"
                    log.debug("distdiag: %s not handed to the helper: %s", self.path, e)
            self.writer = RankFile(self.path, self.rec, self.cfg, self.attrs, compact_strings=True)
        except Exception as e:
            self.failed = True
            self.rec.max_pending_chunks = 0  # nobody writes: drop (and count) what fills up
            self.rec.full.clear()
            msg = " ".join(str(e).split())
            try:
                sys.stderr.write(f"distdiag: cannot write {self.path}: {msg}; this forked process runs without recording\n")
                sys.stderr.flush()
            except Exception:
                pass
        return self.writer

    def close(self, exit_code: int | None) -> None:
        """At the child's exit: write what is left and close its file. Idempotent, never raises."""
        if os.getpid() != self.pid:
            return
        self._stop.set()
        w0 = self.writer
        bound = float(getattr(w0, "exit_timeout_s", 10.0)) if w0 is not None else 10.0
        deadline = time.monotonic() + bound
        if w0 is not None:
            w0._deadline = deadline  # a flush under way stops at its next piece (Writer.close)
        from distdiag.shim.rankfile import wait_for_writes

        # bounded as the rank's own exit is: a worker on a slow disk does not hold its exit
        if not wait_for_writes(self._thread, self._lock, deadline, self.interval_s):
            return
        try:
            if self._closed:
                return
            self._closed = True
            try:
                w = self.writer if self.writer is not None else self._open()
                if w is not None:
                    w.close(exit_code if exit_code is not None else self.exit_code)
            except Exception:
                pass
        finally:
            self._lock.release()

    def detach(self) -> None:
        """In a process forked from this child: the child's file is the child's."""
        self._closed = True
        self._stop.set()
        self._lock = threading.Lock()
        if self.writer is not None:
            self.writer.detach()


def _moved(s: socket.socket, at_least: int) -> socket.socket:
    """``s`` on the lowest free number >= ``at_least`` (close-on-exec, non-blocking); as it is
    where that fails (it still works, its number only more likely to be reused)."""
    fd = s.detach()
    try:
        fd = dup_above(fd, at_least)
    except OSError:
        pass
    s = socket.socket(fileno=fd)
    s.setblocking(False)
    return s


def _high_fd() -> int:
    try:
        return max(16, min(int(os.sysconf("SC_OPEN_MAX")) // 2, 1024))
    except (ValueError, OSError):
        return 256


def _wake_pair() -> tuple[socket.socket, socket.socket]:
    """The SIGTERM watcher's socket pair (non-blocking, as ``set_wakeup_fd`` wants), both on
    high numbers: a program that closes every descriptor and opens its own takes the lowest
    free numbers, so ours stay free for :meth:`_SigtermChain._mend_wake` to take back."""
    r, w = socket.socketpair()
    return _moved(r, _high_fd()), _moved(w, _high_fd())


class _SigtermChain:
    """SIGTERM (Slurm time limit, scancel) closes the file, then does what the program wanted.

    Our handler is the one installed at the OS level. ``signal.signal`` and
    ``signal.getsignal`` are wrapped for SIGTERM only: a handler the program
    installs is remembered and called after our flush (the program may go on,
    e.g. write a checkpoint) and ``getsignal`` returns it. While the program's
    disposition is ``SIG_IGN`` (inherited from a parent that ignores it, or set
    by the program) the OS-level one is ``SIG_IGN`` too (:meth:`_sync_os`): the
    signal is dropped by the kernel and exec'd children inherit ``SIG_IGN``,
    exactly as unwrapped (nothing is recorded of it). The signal mask is never
    touched. With no program handler (the default action) we close the
    file with exit_code -15 and re-deliver SIGTERM with the default action, so
    the process dies by the signal exactly as it would unwrapped.

    A rank blocked inside a C call (a hung MPI collective, a long native
    computation) would not run a Python handler until the call returns, while
    unwrapped it dies at once; Slurm would then SIGKILL it KillWait seconds
    later. So the C-level handler also writes to a wakeup fd
    (``signal.set_wakeup_fd``) that a watcher thread reads: when a SIGTERM
    byte arrives and our Python handler has not run within
    ``SIGTERM_GRACE_S`` while the main thread's frame has not moved (it sits
    in one C call), the watcher closes the file and, under the default action,
    ends the process by SIGTERM itself. A frame that moved means the byte was
    not ours (a forked child, signalled before its after-fork hook ran, shares
    the descriptor): the watcher then does nothing. If the program sets its
    own wakeup fd (asyncio does) the watcher is simply out of the loop.
    """

    def __init__(self, shim: _Shim) -> None:
        self.shim = shim
        self._orig_signal = signal.signal
        self._orig_getsignal = signal.getsignal
        self.user: Any = self._orig_getsignal(signal.SIGTERM)
        self._handled = threading.Event()
        #: our handler is the OS-level one (see _sync_os)
        self._installed = False
        self._sync_os()
        signal.signal = self._signal  # type: ignore[assignment]
        signal.getsignal = self._getsignal  # type: ignore[assignment]
        self._restored = False
        self._wake: tuple[Any, Any] | None = None
        self._wake_ids: tuple[Any, Any] = (None, None)
        #: the wakeup number, when the program took it over (see _mend_wake)
        self._wake_lost: int | None = None
        try:
            self._start_watcher()
        except Exception:
            log.debug("distdiag: SIGTERM watcher not started", exc_info=True)

    def _sync_os(self) -> None:
        """The OS-level disposition for the program's: ours for SIG_DFL and a Python handler;
        SIG_IGN stays SIG_IGN (inherited, nohup-style, or set by the program), so the kernel
        drops the signal and exec'd children inherit SIG_IGN as they would unwrapped; a
        handler installed by C code (``getsignal`` gives None) is left alone."""
        user = self.user
        if user == signal.SIG_IGN:
            if self._installed:
                self._orig_signal(signal.SIGTERM, signal.SIG_IGN)
                self._installed = False
        elif user is not None and not self._installed:
            self._orig_signal(signal.SIGTERM, self._handler)
            self._installed = True

    # -- the watcher (SIGTERM while the main thread sits in C) -------------------
    def _start_watcher(self) -> None:
        r, w = _wake_pair()
        old = signal.set_wakeup_fd(w.fileno(), warn_on_full_buffer=False)
        if old != -1:  # the program's own wakeup fd: leave it alone
            signal.set_wakeup_fd(old)
            r.close()
            w.close()
            return
        self._wake = (r, w)
        self._wake_ids = (ident(r.fileno()), ident(w.fileno()))
        threading.Thread(target=self._watch, name="distdiag-sigterm", daemon=True).start()

    def _watch(self) -> None:
        while True:
            wake = self._wake
            if wake is None:
                return
            r = wake[0]
            try:  # awake now and then: a program that closed every descriptor is noticed (_mend_wake)
                poller = select.poll()  # not select(): the pair sits above FD_SETSIZE (_wake_pair)
                poller.register(r.fileno(), select.POLLIN)
                ready = poller.poll(int(WAKE_CHECK_S * 1000))
            except (OSError, ValueError):
                ready = []
            if not (still_ours(r, self._wake_ids[0]) and still_ours(wake[1], self._wake_ids[1])):
                if not self._mend_wake():
                    return
                continue
            if not ready:
                continue
            try:
                data = r.recv(64)
            except BlockingIOError:
                continue
            except OSError:
                return
            if not data:
                return
            if int(signal.SIGTERM) in data and os.getpid() == self.shim.pid:
                self._on_wakeup()

    def _mend_wake(self) -> bool:
        """The program closed our wakeup pair (``closerange``): Python's C signal handler still
        writes to the number it was given, which gave the program one "Exception ignored when
        trying to write to the signal wakeup fd ... EBADF" on its stderr per signal (or a byte
        in a file of its own on that number). Put a fresh pair's write end back on that very
        number while it is free (``F_DUPFD`` onto it: atomic, never over a descriptor of the
        program). False when the number is the program's now: the watcher ends, and the main
        thread drops the wakeup fd at the next chance (``_drop_lost_wake``)."""
        import fcntl

        wake = self._wake
        if wake is None or os.getpid() != self.shim.pid:
            return False
        let_go(wake[0], self._wake_ids[0])
        num = wake[1].fileno()
        let_go(wake[1], self._wake_ids[1])
        try:
            r, w = socket.socketpair()  # low numbers: the write end goes onto ``num`` first
        except OSError:
            self._wake, self._wake_lost = None, num
            return False
        try:
            got = fcntl.fcntl(w.fileno(), fcntl.F_DUPFD_CLOEXEC, num)
        except OSError:
            got = -1
        w.close()
        if got != num:  # taken: the program's descriptor; never touched
            if got >= 0:
                os.close(got)
            r.close()
            self._wake, self._wake_lost = None, num
            log.debug("distdiag: the SIGTERM wakeup descriptor %d is the program's now", num)
            return False
        w = socket.socket(fileno=got)
        w.setblocking(False)
        r = _moved(r, _high_fd())
        self._wake = (r, w)
        self._wake_ids = (ident(r.fileno()), ident(w.fileno()))
        log.debug("distdiag: the SIGTERM wakeup pair was closed by the program; made again on %d", num)
        return True

    def _drop_lost_wake(self) -> None:
        """On the main thread: a wakeup number that is the program's now is no longer given to Python."""
        num, self._wake_lost = self._wake_lost, None
        if num is None:
            return
        try:
            cur = signal.set_wakeup_fd(-1)
            if cur != num:  # the program's own wakeup fd since: put it back
                signal.set_wakeup_fd(cur)
        except (ValueError, OSError):
            pass

    def _main_position(self) -> tuple[int, int] | None:
        f = sys._current_frames().get(threading.main_thread().ident or -1)
        return None if f is None else (id(f), f.f_lasti)

    def _on_wakeup(self) -> None:
        before = self._main_position()
        if self._handled.wait(SIGTERM_GRACE_S):
            self._handled.clear()
            return  # the main thread ran our handler
        if before is None or self._main_position() != before:
            return  # the main thread runs bytecode: a stray byte, not our SIGTERM
        user = self.user
        self.shim.shim_row("sigterm")
        if callable(user) or user == signal.SIG_IGN:
            self.shim.flush()  # the program's own handler runs when the C call returns, as unwrapped
            return
        self.shim.close(-int(signal.SIGTERM))
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.signal.restype = ctypes.c_void_p
            libc.signal(ctypes.c_int(int(signal.SIGTERM)), ctypes.c_void_p(0))  # SIG_DFL, from any thread
            os.kill(os.getpid(), signal.SIGTERM)
        except Exception:
            log.debug("distdiag: could not re-deliver SIGTERM from the watcher", exc_info=True)

    def _stop_watcher(self, in_child: bool = False) -> None:
        wake, self._wake = self._wake, None
        if wake is None:
            return
        try:
            cur = signal.set_wakeup_fd(-1)
            if cur not in (-1, wake[1].fileno()):  # someone else's now: put it back
                signal.set_wakeup_fd(cur)
        except Exception:
            pass
        if in_child:
            # the parent's watcher still reads this pair: close only our copies (ours still)
            for s, i in zip(wake, self._wake_ids):
                try:
                    fd = s.detach()
                    if fd_is(fd, i):
                        os.close(fd)
                except Exception:
                    pass
            return
        for s, i in zip(wake, self._wake_ids):
            let_go(s, i)

    def _signal(self, signalnum: Any, handler: Any) -> Any:
        if self._wake_lost is not None and threading.current_thread() is threading.main_thread():
            self._drop_lost_wake()
        if signalnum != signal.SIGTERM or self._restored:
            return self._orig_signal(signalnum, handler)
        if threading.current_thread() is not threading.main_thread():
            return self._orig_signal(signalnum, handler)  # raises ValueError, as unwrapped
        if not (callable(handler) or handler in (signal.SIG_DFL, signal.SIG_IGN)):
            raise TypeError("signal handler must be signal.SIG_IGN, signal.SIG_DFL, or a callable object")
        prev, self.user = self.user, handler
        self._sync_os()
        return prev

    def _getsignal(self, signalnum: Any) -> Any:
        if signalnum == signal.SIGTERM and not self._restored:
            return self.user
        return self._orig_getsignal(signalnum)

    def _handler(self, signum: int, frame: Any) -> Any:
        self._handled.set()
        if self._wake_lost is not None:
            self._drop_lost_wake()
        user = self.user
        if os.getpid() != self.shim.pid:  # a forked child that kept our handler
            return self._act_as(user, signum, frame)
        if callable(user) and user not in (signal.SIG_DFL, signal.SIG_IGN):
            self.shim.shim_row("sigterm")
            self.shim.flush()
            return user(signum, frame)
        if user == signal.SIG_IGN:
            self.shim.shim_row("sigterm_ignored")
            self.shim.flush()
            return None
        self.shim.shim_row("sigterm")
        # the exit clock exchanges (bounded by exit_sync_wait_s) keep the
        # drift fit anchored at both ends also for jobs Slurm ends at their limit
        self.shim._stop_clock()
        self.shim.close(-int(signal.SIGTERM))
        self._die(signum)
        return None

    def _act_as(self, user: Any, signum: int, frame: Any) -> Any:
        if callable(user) and user not in (signal.SIG_DFL, signal.SIG_IGN):
            return user(signum, frame)
        if user == signal.SIG_IGN:
            return None
        self._die(signum)
        return None

    def _die(self, signum: int) -> None:
        self._orig_signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        time.sleep(5)  # the default action ends the process; never return into user code first

    def restore(self, in_child: bool = False) -> None:
        """Put the program's SIGTERM disposition back (at close, or in a forked child)."""
        if self._restored:
            return
        self._restored = True
        if threading.current_thread() is threading.main_thread():
            self._stop_watcher(in_child)
        signal.signal = self._orig_signal
        signal.getsignal = self._orig_getsignal
        if self._installed and threading.current_thread() is threading.main_thread() and (in_child or os.getpid() == self.shim.pid):
            try:
                self._orig_signal(signal.SIGTERM, self.user)
            except Exception:
                log.debug("distdiag: SIGTERM handler not restored", exc_info=True)


def _note(msg: str) -> None:
    msg = " ".join(msg.split())  # one line, whatever the OS/HDF5 message holds
    try:
        sys.stderr.write(f"distdiag: {msg}; the job runs without recording\n")
        sys.stderr.flush()
    except Exception:
        pass


def setup(opts: Options, target: Target, t_start_ns: int, wall_start_ns: int) -> _Shim | None:
    """Rank info -> config -> run dir -> recorder -> writer -> SESSION -> hooks -> clock.

    Returns None (after one stderr line) when recording cannot start."""
    from distdiag.shim import hooks, recorder, session
    from distdiag.shim.config import load_config
    from distdiag.shim.rankinfo import detect
    from distdiag.shim.rankfile import base_attrs

    info = detect()
    cfg = load_config(opts.config)
    if opts.probe_links is not None:
        cfg.probe_links = "on" if opts.probe_links else "off"
    try:
        run_dir, launch_id = resolve_run(opts.dir, info)
    except OSError as e:
        _note(f"cannot create run dir: {e}")
        return None
    rec = recorder.Recorder(chunk_rows=cfg.chunk_rows, max_pending_chunks=cfg.max_pending_chunks)
    attrs = base_attrs(info.rank, info.world_size, info.local_rank, info.host, info.job_id or launch_id, launch_id)
    attrs.update(
        argv=json.dumps(target.command),
        env=json.dumps(allowed_env(dict(os.environ))),
        wall_ns_at_start=wall_start_ns,
        mono_ns_at_start=t_start_ns,
        last_flush_mono_ns=t_start_ns,
        config=json.dumps(cfg.as_dict()),
        launcher=info.launcher,
    )
    try:
        from distdiag.shim import preload

        loaded = preload.loaded_ns()  # the interposer's load: the process's start, before the interpreter's
        if loaded is not None and 0 < loaded <= t_start_ns:
            attrs["process_start_mono_ns"] = loaded
    except Exception:
        log.debug("distdiag: the process's start not known", exc_info=True)
    name = rank_file_name(info.rank)
    try:
        writer, run_dir = _open_rank_file(run_dir, name, rec, cfg, attrs)
    except Exception as e:
        _note(f"cannot write {run_dir / name}: {e}")
        return None
    recorder.RECORDER = rec
    try:
        from distdiag.shim.rankfile import watch_h5py

        watch_h5py()
    except Exception:
        log.debug("distdiag: h5py's exit handler not watched", exc_info=True)
    try:  # before the shim's first thread: a fork never inherits an import one of them had under way
        from distdiag.shim import forkimports

        forkimports.install()
    except Exception:
        log.debug("distdiag: fork import repair not installed", exc_info=True)
    writer.start()
    shim = _Shim(rec, writer, None)
    shim.fork_args = (cfg, run_dir, info.rank, attrs)
    session.SESSION = session.Session(
        rec=rec,
        writer=writer,
        cfg=cfg,
        rank=info.rank,
        world_size=info.world_size,
        local_rank=info.local_rank,
        host=info.host,
        job_id=info.job_id or launch_id,
        launch_id=launch_id,
        run_dir=run_dir,
    )
    shim.shim_row("shim_start", t_start_ns)
    # Import the hook modules and the clock before any hook is live, so the
    # file-system hook does not record the shim's own imports as the job's I/O.
    import importlib

    for modname in [*hooks.HOOKS, "distdiag.shim.clock"]:
        try:
            importlib.import_module(modname)
        except Exception:
            log.debug("distdiag: %s not importable", modname, exc_info=True)
    try:
        from distdiag.shim import preload

        preload.SHIM_START_NS = t_start_ns  # an interposer that recorded from its load keeps what came before
    except Exception:
        pass
    try:
        installed = hooks.install_all(rec, cfg, cfg.hooks)
        writer.set_attr("hooks", json.dumps(installed))
    except Exception:
        log.debug("distdiag: hooks not installed", exc_info=True)
    try:
        from distdiag.shim.clock import ClockSync

        clock = ClockSync(info.rank, info.world_size, run_dir, cfg, writer.add_sync)
        clock.start()
        shim.clock = clock
    except Exception:
        log.debug("distdiag: clock sync not started", exc_info=True)
    try:
        shim.sigterm = _SigtermChain(shim)
    except Exception:
        log.debug("distdiag: SIGTERM handler not installed", exc_info=True)
    try:
        os.register_at_fork(after_in_child=shim._after_fork_in_child)
    except Exception:
        pass
    shim.patch_os_exit()
    atexit.register(shim.close_at_exit)
    return shim


# -- running the target ---------------------------------------------------------------
def _fresh_main() -> types.ModuleType:
    """A ``__main__`` as the interpreter makes it before it runs ``-c`` code, a script or
    ``-m`` (runpy then fills in the module's names): the same names, in the same order."""
    from importlib.machinery import BuiltinImporter

    main = types.ModuleType("__main__")
    main.__dict__.update(__loader__=BuiltinImporter, __annotations__={}, __builtins__=builtins)
    sys.modules["__main__"] = main
    return main


def _py_abspath(path: str) -> str:
    """The script path as the interpreter shows it (``__file__``, tracebacks): joined to the
    working directory, not normalized (``python ../x.py`` shows ``/cwd/../x.py``)."""
    return path if os.path.isabs(path) else os.path.join(os.getcwd(), path)


def _cant_open(path: str, e: OSError) -> SystemExit:
    sys.stderr.write(f"{sys.executable}: can't open file {_py_abspath(path)!r}: [Errno {e.errno}] {e.strerror}\n")
    return SystemExit(2)


def _set_path0(entry: str) -> None:
    """``sys.path[0]`` as the interpreter would set it for the target (it now holds the
    wrapper's own directory); with ``-P``/``PYTHONSAFEPATH`` it adds nothing, so neither do we."""
    if getattr(sys.flags, "safe_path", False):
        return
    if sys.path:
        sys.path[0] = entry
    else:
        sys.path.insert(0, entry)


def _run_target(t: Target) -> None:
    """Run the program exactly as ``python`` would. Tracebacks are cut at this frame."""
    import runpy

    sys.argv = t.argv
    if t.kind == "module":
        _set_path0(os.getcwd())
        _fresh_main()
        runpy._run_module_as_main(t.value, alter_argv=True)  # type: ignore[attr-defined]
        return
    if t.kind == "code":
        _set_path0("")
        main = _fresh_main()
        code = compile(t.value, "<string>", "exec", dont_inherit=True)  # not this module's __future__
        exec(code, main.__dict__)
        return
    path = t.value
    abspath = os.path.abspath(path)
    if os.path.isdir(path) or (os.path.isfile(path) and not path.endswith(".py") and _is_zip(path)):
        # a directory or zip with __main__.py, as `python dir/` runs it
        _set_path0(abspath)
        _fresh_main()
        runpy._run_module_as_main("__main__", alter_argv=False)  # type: ignore[attr-defined]
        return
    try:
        with io.open_code(abspath) as f:
            source = f.read()
    except OSError as e:
        raise _cant_open(path, e) from None
    _set_path0(os.path.dirname(abspath))
    shown = _py_abspath(path)
    main = _fresh_main()
    from importlib.machinery import SourceFileLoader

    main.__dict__.update(
        __file__=shown,
        __cached__=None,
        __loader__=SourceFileLoader("__main__", shown),
        __spec__=None,
        __package__=None,
        __annotations__={},
    )
    code = compile(source, shown, "exec", dont_inherit=True)
    exec(code, main.__dict__)


def _is_zip(path: str) -> bool:
    import zipfile

    try:
        return zipfile.is_zipfile(path)
    except OSError:
        return False


_MARKER_CODE = _run_target.__code__


_SHIM_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
#: distdiag.api: the phase decorator's wrapper frame exists only when recording
_API_FILE = os.path.join(os.path.dirname(_SHIM_DIR.rstrip(os.sep)), "api.py")


def _ours(filename: str) -> bool:
    return filename.startswith(_SHIM_DIR) or filename == _API_FILE


def strip_wrapper_frames(tb: types.TracebackType | None) -> types.TracebackType | None:
    """What an unwrapped run would show: the traceback below :func:`_run_target`,
    without the frames of the shim's hooks (a hooked ``open`` that raises
    would otherwise show ``hooks/fileio.py`` between the user's frames)."""
    cut = None
    t = tb
    while t is not None:
        if t.tb_frame.f_code is _MARKER_CODE:
            cut = t
        t = t.tb_next
    if cut is not None:
        tb = cut.tb_next
    frames = []
    t = tb
    while t is not None:
        frames.append(t)
        t = t.tb_next
    if not any(_ours(f.tb_frame.f_code.co_filename) for f in frames):
        return tb
    out: types.TracebackType | None = None
    for f in reversed(frames):  # rebuild the chain without our frames, innermost first
        if not _ours(f.tb_frame.f_code.co_filename):
            out = types.TracebackType(out, f.tb_frame, f.tb_lasti, f.tb_lineno)
    return out


def _strip_chain(value: BaseException) -> None:
    """Strip the tracebacks of the exceptions chained to ``value`` (cause/context) too."""
    seen: set[int] = {id(value)}
    todo = [value.__cause__, value.__context__]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        try:
            e.__traceback__ = strip_wrapper_frames(e.__traceback__)
        except Exception:
            pass
        todo += [e.__cause__, e.__context__]


def _install_excepthook_stripper() -> None:
    """Let the uncaught exception reach sys.excepthook (the user's, if set) without our frames."""
    user_hook: Callable[..., Any] = sys.excepthook

    def hook(etype: type[BaseException], value: BaseException, tb: types.TracebackType | None) -> None:
        tb = strip_wrapper_frames(tb)
        try:
            value = value.with_traceback(tb)
            _strip_chain(value)
        except Exception:
            pass
        sys.excepthook = user_hook  # what the user set, for anything that reads it later
        user_hook(etype, value, tb)

    sys.excepthook = hook


def _exit_code_of(e: SystemExit) -> int:
    code = e.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    return 1


def _preload(opts: Options, here: bool) -> None:
    """The libc interposer (distdiag.shim.preload): ``here`` (the program runs in this
    interpreter), re-execute it once with the library in LD_PRELOAD when it is wanted
    (``DISTDIAG_HOOKS`` preload not 0, fileio not 0) and not loaded, built, not tried; before a
    named interpreter's exec, put it in LD_PRELOAD for that one. Then ``os.environ`` is
    made what it would be unwrapped. Never raises."""
    try:
        from distdiag.shim import preload
        from distdiag.shim.config import load_config

        quiet = logging.getLogger("distdiag.shim.config")
        was, quiet.disabled = quiet.disabled, True  # setup() loads it again and says what is wrong
        try:
            cfg = load_config(opts.config)
        finally:
            quiet.disabled = was
        slots = int(getattr(cfg, "preload_ring_slots", 16384))
        if here:
            preload.reexec(cfg.hooks, slots)  # returns when nothing was re-executed
        else:
            preload.arm_env(cfg.hooks, slots)
            return
        preload.clean_environ()
    except Exception:
        log.debug("distdiag: LD_PRELOAD not set", exc_info=True)


def main_chosen(argv: Sequence[str]) -> int:
    """:func:`main` in the interpreter the user named (what :data:`_BOOT` calls after
    :func:`_reexec`): ``argv`` is the wrapper's options, ``--``, then the interpreter's own
    arguments (``-- script.py ...``, ``-m mod ...``); never re-executes again."""
    return main(argv, interpreter_chosen=True)


def main(argv: Sequence[str] | None = None, interpreter_chosen: bool = False) -> int:
    from distdiag.shim.recorder import now_ns

    t_start_ns, wall_start_ns = now_ns(), time.time_ns()
    try:
        opts, target = parse_args(sys.argv[1:] if argv is None else argv, interpreter_chosen)
        exe = None if interpreter_chosen else _interpreter_path(target)
    except UsageError as e:
        if str(e) == "help":
            try:
                print(USAGE)
            except BrokenPipeError:  # distdiag-wrap --help | head
                pass
            return 0
        sys.stderr.write(f"{PROG}: {e}\n")
        if "can only wrap" not in str(e):
            sys.stderr.write(USAGE.splitlines()[0] + "\n")
        return 2
    _preload(opts, exe is None)
    if exe is not None:
        return _reexec(exe, opts, target)
    shim: _Shim | None = None
    try:
        shim = setup(opts, target, t_start_ns, wall_start_ns)
    except Exception as e:  # never stop the user's job for our sake
        _note(f"setup failed: {e}")
    if shim is not None:
        shim.shim_row("target_start")
    try:
        _run_target(target)
    except SystemExit as e:
        if shim is not None:
            shim.target_end(_exit_code_of(e))
        raise
    except KeyboardInterrupt:
        if shim is not None:
            shim.target_end(-int(signal.SIGINT))
        _install_excepthook_stripper()
        raise
    except BaseException:
        if shim is not None:
            shim.target_end(1)
        _install_excepthook_stripper()
        raise
    if shim is not None:
        shim.target_end(0)
    return 0
