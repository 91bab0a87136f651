"""mpi4py capture: hand the program wrapped communicators.

mpi4py's ``Comm`` types are immutable C types: ``setattr(MPI.Comm, ...)``
raises ``TypeError`` and ``sys.setprofile`` never sees their methods. What
*is* allowed is a Python subclass of ``MPI.Intracomm`` built on an existing
communicator (``Sub(MPI.COMM_WORLD)`` is a second handle to the same
communicator) and rebinding module attributes. So when the program imports
``mpi4py.MPI`` we

* replace ``MPI.COMM_WORLD`` / ``MPI.COMM_SELF`` with instances of a
  subclass of ``MPI.Intracomm`` (named ``Intracomm`` too, in this module: see
  :func:`_build_classes`), whose collective and point-to-point methods record
  a row and call the original C method; Cartcomm, Graphcomm, Distgraphcomm and
  Intercomm get the same treatment;
* make every communicator constructor (``Dup``, ``Clone``, ``Split``,
  ``Split_type``, ``Create``, ``Create_group``, ``Create_cart``, ``Sub``,
  ``Create_graph``, ``Create_dist_graph*``, ``Create_intercomm``, ``Merge``,
  ``Idup``) return a wrapped communicator too, with a key that is the same on
  every rank that shares it (see :func:`_creation_key`);
* replace ``MPI.Request`` with a subclass (whose metaclass keeps
  ``isinstance(plain_request, MPI.Request)`` true), so the completion of a
  non-blocking call is seen in ``Wait``/``Test``/``Waitall``/``Waitany``/
  ``Testall``/``Waitsome``/... and their lower-case twins.

Names the program bound before the hook ran (``from mpi4py.MPI import
COMM_WORLD`` before ``distdiag-wrap`` installed us) keep the plain objects and
are not recorded: ``distdiag-wrap`` installs hooks before the program starts,
so that only happens when someone installs the hook late.

Rows (see ``distdiag.schema``)
------------------------------
* collectives: ``Kind.COLL`` (blocking, via ``rec.enter``/``rec.leave`` so a
  killed rank shows the collective it was inside of) or ``Kind.COLL_ASYNC``
  (t0 = post, t1 = completion seen); ``comm_id`` = communicator key,
  ``seq`` = per-communicator collective counter (0, 1, 2, ... counted on each
  rank; MPI requires every member to call collectives on a communicator in
  the same order, so equal ``(comm key, seq)`` is the same collective on every
  rank), ``peer`` = root of rooted collectives (a rank *in that
  communicator*), ``nbytes`` = bytes of the send buffer (scatter: of the
  receive buffer, the rank's share; object methods: ``len`` of bytes / numpy
  ``nbytes``, else 0: we never pickle twice), ``aux`` = string id of the
  datatype name (``"MPI_DOUBLE"``; ``"object"`` for pickled objects).
* point-to-point: ``SEND``/``RECV``/``SEND_ASYNC``/``RECV_ASYNC`` with ``peer`` =
  destination / source (for ``ANY_SOURCE`` the actual source from the status
  for blocking receives); ``Sendrecv`` gives a SEND and a RECV row with the
  same times.
* ``WAIT``: time blocked in ``Wait``/``Waitall``/``Waitany``/``Waitsome`` (and
  lower-case twins); ``comm_id``, ``seq``, ``peer`` and ``aux`` (= op name id,
  e.g. ``"Iallreduce"``) of the (first still pending) request it waits for, so
  a rank hung in a Wait shows which collective it waits on. ``Test*`` calls
  leave no WAIT rows (polling loops would flood the buffer), only completions.
* ``COMM_CREATE``: ``name_id`` = new key, ``comm_id`` = parent key, ``peer`` =
  this rank's rank in the new communicator, ``aux`` = its size (for an
  intercommunicator: rank in the local group, size of both groups). Together the
  members' rows map communicator ranks to world ranks (each file is one world
  rank), which the analyzer needs for roots and p2p peers on sub-communicators.
  COMM_WORLD's row (``"world"``) spans MPI_Init and the wire-up: ``import
  mpi4py.MPI`` (t0 when the import began, ``hooks.import_started_ns``, t1
  when it returned), or the program's own ``MPI.Init``/``MPI.Init_thread``
  call when ``mpi4py.rc.initialize`` is False (see "the program's MPI_Init"
  below: nothing MPI-ish happens before it), so the time a rank waits for the
  others at launch is recorded (``distdiag.slurm.rank_busy_until``).
  COMM_SELF's is an instant.

Pickling, ``copy`` and ``type(comm)`` as without us: see the "pickling" section.

Wrappers are generated from one template with the wrapped method's own
signature (see :func:`_make`), falling back to ``(*args, **kw)`` ones from
the same template if a signature is not what we expect. Blocking collectives
and blocking sends are C wrappers (``distdiag/shim/_hot.c``, :func:`_make_c`)
where that module is built: the template's work in C, with the payload's
peer/bytes/datatype from a generated Python ``prep`` for calls that carry one;
the same rows (tests/test_mpi_hook.py compares them with ``DISTDIAG_HOT=0``).
Cost: ``benchmarks/bench_intercept.py``. Bookkeeping never raises into the
program; results and exceptions of the MPI calls pass through.

Not recorded: persistent (``*_init``) and partitioned requests,
``Isendrecv*``, probes, one-sided (``Win``) and ``MPI.File`` calls, and
communicators the program builds itself from a handle (``MPI.Intracomm(c)``,
``mpi4py.util.pkl5.Intracomm(c)``: their own classes call mpi4py directly).
"""

from __future__ import annotations

import copyreg
import functools
import inspect
import logging
import pkgutil
import sys
import threading
import zlib
from typing import TYPE_CHECKING, Any, Callable


from distdiag.schema import Kind
from distdiag.shim import hooks as _hooks
from distdiag.shim.recorder import HOT as _HOT
from distdiag.shim.recorder import ROW_SIZE as _ROW_SIZE
from distdiag.shim.recorder import now_ns
from distdiag.shim.recorder import pack_row as _pack

log = logging.getLogger(__name__)

_MODULE = "mpi4py.MPI"

#: the Recorder while installed; every wrapper reads it first and passes
#: straight through when it is None (after uninstall()).
_rec: Any = None
#: the mpi4py.MPI module we patched, and the attributes we replaced
_mpi: Any = None
_saved: dict[str, Any] = {}
#: wrapper classes, built once per process (they do not depend on the recorder)
_classes: dict[str, type] | None = None
#: plain mpi4py communicator type -> our wrapped subclass
_wrap_of: dict[type, type] = {}
_ours: tuple[type, ...] = ()
_orig_request: Any = None
_world_group: Any = None
_lock = threading.Lock()

COLL = int(Kind.COLL)
COLL_ASYNC = int(Kind.COLL_ASYNC)
SEND = int(Kind.SEND)
RECV = int(Kind.RECV)
SEND_ASYNC = int(Kind.SEND_ASYNC)
RECV_ASYNC = int(Kind.RECV_ASYNC)
WAIT = int(Kind.WAIT)
COMM_CREATE = int(Kind.COMM_CREATE)


# -- string ids that depend on the recorder ------------------------------------
class _Ids:
    """Name ids interned in the current recorder; rebound at every install."""

    def __init__(self) -> None:
        self.names: dict[str, int] = {}
        self.obj = 0  # aux for pickled objects
        self.byte = 0  # aux for raw bytes
        #: datatype caches: MPI datatype handle / numpy dtype -> (extent, name id)
        self.dt: dict[int, tuple[int, int]] = {}
        self.np: dict[Any, tuple[int, int]] = {}

    def bind(self, rec: Any) -> None:
        self.names = {}
        self.dt = {}
        self.np = {}
        self.obj = rec.intern("object")
        self.byte = rec.intern("MPI_BYTE")


_ids = _Ids()


def _nid(name: str) -> int:
    """Id of an op name in the current recorder (cached)."""
    i = _ids.names.get(name)
    if i is None:
        i = _ids.names[name] = _rec.intern(name)
    return i


_warned: set[str] = set()


def _oops(where: str, exc: BaseException | None = None) -> None:
    """Bookkeeping failed: log once per place, never raise into the program.

    ``exc``: the failure, from the C wrappers (distdiag/shim/_hot.c); else the one being handled."""
    if where not in _warned:
        _warned.add(where)
        log.debug("distdiag: mpi4py hook bookkeeping failed in %s", where, exc_info=exc or True)


# -- per-communicator state ------------------------------------------------------
class _PyCommStateBase:
    """_CommState's hot fields where the C module (distdiag.shim._hot.CSBase) is not built."""

    __slots__ = ("kid", "rec", "seq")
    kid: int
    rec: Any
    seq: int


if TYPE_CHECKING:  # the checker sees the Python base's slots (the C base has the same fields)
    _CommStateBase = _PyCommStateBase
else:
    _CommStateBase = _HOT.CSBase if _HOT is not None else _PyCommStateBase


class _CommState(_CommStateBase):
    """What we know about one communicator on this rank."""

    __slots__ = ("key", "ncreate", "nsub")

    def __init__(self, key: str) -> None:
        self.key = key
        self.kid = 0
        self.rec: Any = None
        self.seq = 0  # next collective sequence number
        self.ncreate = 0  # communicators created from this one (collective over it)
        #: counters for creations that are collective over a subgroup only
        #: (Create_group, Create_intercomm): keyed by the subgroup's identity
        self.nsub: dict[str, int] = {}

    def bind(self, rec: Any) -> int:
        self.kid = rec.intern(self.key)
        self.rec = rec
        return self.kid


def _kid(st: _CommState, rec: Any) -> int:
    return st.kid if st.rec is rec else st.bind(rec)


# -- payload size and datatype ---------------------------------------------------
def _dt_info(dt: Any) -> tuple[int, int]:
    """(extent, name id) of an MPI datatype, cached by handle."""
    h = dt.handle
    r = _ids.dt.get(h)
    if r is None:
        name = dt.Get_name() or f"MPI_Datatype:{h:x}"
        r = _ids.dt[h] = (dt.extent, _rec.intern(name))
    return r


def _np_info(dtype: Any) -> int:
    """Name id of the MPI datatype mpi4py uses for a numpy dtype."""
    r = _ids.np.get(dtype)
    if r is None:
        mdt = _mpi._typedict.get(dtype.char)
        name = mdt.Get_name() if mdt is not None else f"numpy:{dtype.str}"
        r = _ids.np[dtype] = (dtype.itemsize, _rec.intern(name))
    return r[1]


def _plain_buf(buf: Any) -> tuple[int, int]:
    """(nbytes, aux) of a bare buffer object: numpy array, bytes, memoryview, tensor."""
    t = type(buf)
    if t is bytes or t is bytearray:
        return len(buf), _ids.byte
    nb = getattr(buf, "nbytes", None)
    if type(nb) is int:
        dtype = getattr(buf, "dtype", None)
        if dtype is not None and hasattr(dtype, "char"):
            return nb, _np_info(dtype)
        if t is memoryview:
            mdt = _mpi._typedict.get(buf.format)
            return nb, (_dt_info(mdt)[1] if mdt is not None else _ids.byte)
        return nb, (_rec.intern(str(dtype)) if dtype is not None else 0)
    try:
        return memoryview(buf).nbytes, _ids.byte
    except TypeError:
        return 0, 0


def _spec_info(spec: Any, v: bool) -> tuple[int, int]:
    """(nbytes, aux) of an mpi4py buffer spec.

    Specs: ``buf``, ``[buf, dt]``, ``[buf, count, dt]``, ``[buf, (count, displ), dt]``,
    ``[buf, count, displ, dt]`` and for v-variants (``v=True``) ``[buf, counts,
    displs, dt]`` / ``[buf, (counts, displs), dt]``; ``dt`` is an
    ``MPI.Datatype`` or a type code string. Anything we do not understand
    gives the whole buffer's size or 0: an estimate, never an error.
    """
    t = type(spec)
    if t is _ndarray:  # the common case first
        r = _ids.np.get(spec.dtype)
        if r is not None:
            return spec.nbytes, r[1]
        return spec.nbytes, _np_info(spec.dtype)
    if t is not list and t is not tuple:
        if spec is None or spec is _mpi.IN_PLACE or spec is _mpi.BOTTOM:
            return 0, 0
        return _plain_buf(spec)
    n = len(spec)
    if n == 0:
        return 0, 0
    buf = spec[0]
    dt = spec[-1] if n >= 2 else None
    if isinstance(dt, str):
        dt = _mpi._typedict.get(dt)
    if not isinstance(dt, _mpi.Datatype):
        # [buf, count] / [buf, counts, displs] / Alltoallw's list of types
        nb, aux = _plain_buf(buf)
        return nb, aux
    ext, aux = _dt_info(dt)
    if n == 2:
        return _plain_buf(buf)[0], aux
    c = spec[1]
    if type(c) is int:
        return c * ext, aux
    if c is None:
        return _plain_buf(buf)[0], aux
    if isinstance(c, (tuple, list)):
        if v:
            # [buf, (counts, displs), dt] or [buf, counts, displs, dt] or [buf, counts, dt]
            counts = c[0] if (n == 3 and len(c) == 2 and not isinstance(c[0], int)) else c
            if isinstance(counts, int):
                return counts * ext, aux
            return sum(counts) * ext, aux
        return int(c[0]) * ext, aux  # (count, displ)
    return _plain_buf(buf)[0], aux


def _obj_nbytes(o: Any) -> int:
    """Bytes of a Python object sent by a lower-case method, without pickling it."""
    t = type(o)
    if t is int or t is float or o is None:
        return 0
    if t is bytes or t is bytearray or t is str:
        return len(o)
    nb = getattr(o, "nbytes", None)
    return nb if type(nb) is int else 0


# -- argument access ---------------------------------------------------------------
_MISSING = object()


def _arg(args: tuple[Any, ...], kw: dict[str, Any], i: int, name: str, default: Any) -> Any:
    if len(args) > i:
        return args[i]
    return kw.get(name, default) if kw else default


# A collective's spec: (primary buffer (index, kwname, is_v) or None,
# fallback buffer when the primary is IN_PLACE/None, root (index, kwname) or None,
# object-mode?)
_B = tuple[int, str, bool]
_CollSpec = tuple["_B | None", "_B | None", "tuple[int, str] | None", bool]

_SEND0: _B = (0, "sendbuf", False)
_SEND0V: _B = (0, "sendbuf", True)
_RECV1: _B = (1, "recvbuf", False)
_RECV1V: _B = (1, "recvbuf", True)

_COLL_SPECS: dict[str, _CollSpec] = {
    "Barrier": (None, None, None, False),
    "Bcast": ((0, "buf", False), None, (1, "root"), False),
    "Gather": (_SEND0, _RECV1, (2, "root"), False),
    "Gatherv": (_SEND0, _RECV1V, (2, "root"), False),
    "Scatter": (_RECV1, _SEND0, (2, "root"), False),
    "Scatterv": (_RECV1, _SEND0V, (2, "root"), False),
    "Allgather": (_SEND0, _RECV1, None, False),
    "Allgatherv": (_SEND0, _RECV1V, None, False),
    "Alltoall": (_SEND0, _RECV1, None, False),
    "Alltoallv": (_SEND0V, _RECV1V, None, False),
    "Alltoallw": (_SEND0, _RECV1, None, False),
    "Reduce": (_SEND0, _RECV1, (3, "root"), False),
    "Allreduce": (_SEND0, _RECV1, None, False),
    "Reduce_scatter_block": (_SEND0, _RECV1, None, False),
    "Reduce_scatter": (_SEND0, _RECV1, None, False),
    "Scan": (_SEND0, _RECV1, None, False),
    "Exscan": (_SEND0, _RECV1, None, False),
    "Neighbor_allgather": (_SEND0, _RECV1, None, False),
    "Neighbor_allgatherv": (_SEND0, _RECV1V, None, False),
    "Neighbor_alltoall": (_SEND0, _RECV1, None, False),
    "Neighbor_alltoallv": (_SEND0V, _RECV1V, None, False),
    "Neighbor_alltoallw": (_SEND0, _RECV1, None, False),
    # object (pickle) methods
    "barrier": (None, None, None, True),
    "bcast": ((0, "obj", False), None, (1, "root"), True),
    "gather": ((0, "sendobj", False), None, (1, "root"), True),
    "scatter": ((0, "sendobj", False), None, (1, "root"), True),
    "allgather": ((0, "sendobj", False), None, None, True),
    "alltoall": ((0, "sendobj", False), None, None, True),
    "reduce": ((0, "sendobj", False), None, (2, "root"), True),
    "allreduce": ((0, "sendobj", False), None, None, True),
    "scan": ((0, "sendobj", False), None, None, True),
    "exscan": ((0, "sendobj", False), None, None, True),
    "neighbor_allgather": ((0, "sendobj", False), None, None, True),
    "neighbor_alltoall": ((0, "sendobj", False), None, None, True),
}
#: non-blocking twins: "I" + name (Ibarrier, Iallreduce, Ineighbor_alltoall, ...)
def _iname(name: str) -> str:
    # mpi4py spells the non-blocking twins "I" + lower case: Iallreduce, Ibarrier, Ineighbor_alltoall
    return "I" + name.lower()


_ICOLL_SPECS: dict[str, _CollSpec] = {_iname(k): v for k, v in _COLL_SPECS.items() if k[0].isupper()}
_ICOLL_SPECS["ibarrier"] = (None, None, None, True)


# -- the wrapper generator -----------------------------------------------------------
# Every collective and point-to-point wrapper is compiled from one template
# (:func:`_make`): the call's own parameter list when ``inspect.signature``
# reads mpi4py's Cython method as we expect (arguments are locals; the
# original is called positionally with the very default objects), else
# ``(self, *args, **kw)`` with the same body reading the arguments through
# ``_arg`` (the fallback; tests/test_mpi_hook.py checks both give the same rows).
#
# The hot path, per call, as measured in benchmarks/bench_intercept.py:
# * the row is written inline with the Recorder's protocol (see
#   distdiag.shim.recorder): ``tb.cur`` holds the open row while the call
#   runs (so a rank killed inside it shows it in flight) and after it one
#   ``pack_row`` writes t0, t1 and the fields from locals. No
#   ``rec.enter``/``rec.leave`` method calls, no re-read of the open row.
# * the call site: a per-wrapper dict ``f_lasti -> (code, site id)`` of the
#   caller's frame, checked by code identity (an int-keyed lookup; the
#   Recorder's own cache is the miss path). Cleared at every install.
# * names, comm keys and constants are closure cells or default-free globals
#   read once; the recorder's name id sits in ``cell`` with the recorder it
#   belongs to.
def _name_cell(name: str) -> list[Any]:
    """[name id, recorder it belongs to]: a wrapper's cached op-name id."""
    return [0, None]


def _bind_name(cell: list[Any], name: str, rec: Any) -> int:
    cell[0] = rec.intern(name)
    cell[1] = rec
    return cell[0]  # type: ignore[no-any-return]


#: every generated wrapper's call-site cache (f_lasti -> (code, site id)); install() clears them
_site_caches: list[dict[int, tuple[Any, int]]] = []


def _site_miss(sites: dict[int, tuple[Any, int]], f: Any, rec: Any) -> int:
    """The call site of frame ``f`` (the wrapper's caller), cached in ``sites``."""
    i = rec.site_of(f)
    sites[f.f_lasti] = (f.f_code, i)
    return i  # type: ignore[no-any-return]


def _finish_wrapper(wrapper: Callable[..., Any], name: str, orig: Callable[..., Any]) -> Callable[..., Any]:
    wrapper.__name__ = wrapper.__qualname__ = name
    wrapper.__doc__ = getattr(orig, "__doc__", None)
    wrapper.__wrapped__ = orig  # type: ignore[attr-defined]
    return wrapper


#: blocking collectives and sends get the C wrappers (distdiag/shim/_hot.c) where it is built;
#: False: the template's Python wrappers for every call (the tests compare the two's rows)
_USE_C = True

_IN_PLACE: Any = None  # MPI.IN_PLACE, set when the module is hooked
_Status: Any = None  # MPI.Status, likewise
_getframe = sys._getframe


def _params(orig: Callable[..., Any]) -> list[inspect.Parameter] | None:
    """The original's parameters when a wrapper can take them as they are, else None."""
    try:
        ps = list(inspect.signature(orig).parameters.values())
    except (TypeError, ValueError):
        return None
    if not ps or any(p.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD for p in ps):
        return None
    if any(p.name in _RESERVED for p in ps[1:]) or ps[0].name != "self":
        return None  # would clash with the generated body's own names
    return ps


#: the generated body's own names (a parameter called so gets the generic wrapper)
_RESERVED = frozenset(
    {"rec", "st", "seq", "peer", "nb", "aux", "t", "info", "ok", "result", "req", "t0", "t1", "orig", "cell",
     "NAME", "row", "tb", "n", "f", "s", "site", "nid", "kid", "sites", "args", "kw", "b_", "o_"}
)  # fmt: skip


# A p2p spec: (kind, buffer (index, kwname) or None, peer (index, kwname),
# object-mode?, status index or -1)
_P2PSpec = tuple[int, "tuple[int, str] | None", "tuple[int, str]", bool, int]


class _Args:
    """How the generated body reads argument ``i`` called ``kw``: a local, or ``_arg`` (generic)."""

    def __init__(self, ps: list[inspect.Parameter] | None) -> None:
        self.names = [p.name for p in ps[1:]] if ps is not None else None

    def __call__(self, i: int, kw: str, default: str) -> str | None:
        if self.names is None:
            return f"_arg(args, kw, {i}, {kw!r}, {default})"
        return kw if i < len(self.names) and self.names[i] == kw else None


def _payload_src(spec: _CollSpec, at: _Args, peer_default: str) -> list[str] | None:
    """Lines setting ``peer, nb, aux`` from the arguments, or None if the names disagree."""
    prim, alt, root_at, obj = spec
    if root_at is None:
        lines = ["peer = -1"]
    else:
        r = at(root_at[0], root_at[1], peer_default)
        if r is None:
            return None
        lines = [f"peer = {r}"]
    if prim is None:
        return lines + ["nb = 0", "aux = 0"]
    b = at(prim[0], prim[1], "None")
    if b is None:
        return None
    if obj:
        return lines + [f"o_ = {b}", "t = type(o_)", "nb = 0 if (t is int or t is float) else _obj_nbytes(o_)", "aux = _ids.obj"]
    if alt is None:
        return lines + [f"nb, aux = _spec_info({b}, {prim[2]})"]
    a = at(alt[0], alt[1], "None")
    if a is None:
        return None
    return lines + [
        f"b_ = {b}",
        "if b_ is None or b_ is _IN_PLACE:",
        f"    nb, aux = _spec_info({a}, {alt[2]})",
        "else:",
        f"    nb, aux = _spec_info(b_, {prim[2]})",
    ]


_TEMPLATE = """\
        rec = _rec
        if rec is None:
            return orig(CALL)
        row = None
        try:
            st = self._dd
{prepare}
            f = _getframe(1)
            s = sites.get(f.f_lasti)
            site = s[1] if s is not None and s[0] is f.f_code else _site_miss(sites, f, rec)
            nid = cell[0] if cell[1] is rec else _bind_name(cell, NAME, rec)
            kid = st.kid if st.rec is rec else st.bind(rec)
{open}
        except Exception:
            _oops(NAME)
{call}
"""
_SEQ = "seq = st.seq\nst.seq = seq + 1"
# a blocking call: the open row in tb.cur while it runs
_OPEN_ROW = """\
            try:
                tb = rec._local.tb
            except AttributeError:
                tb = rec._tb()
            t0 = now_ns()
            row = tb.cur = (t0, -1, KIND, nid, kid, SEQ, peer, nb, aux, site, tb.tid, 0.0)"""
_WRITE_ROW = """\
                    tb.cur = None
                    n = tb.n
                    if n >= tb.cap:
                        n = rec._rotate(tb)
                    _pack(tb.buf, n * _ROW_SIZE, t0, t1, KIND, nid, kid, SEQ, peer, nb, aux, site, tb.tid, 0.0)
                    tb.n = n + 1"""
_CALL_BLOCKING = f"""\
        try:
            return orig(CALL)
        finally:
            if row is not None:
                try:
                    t1 = now_ns()
{_WRITE_ROW}
                except Exception:
                    _oops(NAME)"""
# a receive learns its source (ANY_SOURCE) and a pickled one its size only on return
_CALL_RECV = f"""\
        ok = False
        try:
            result = orig(CALL)
            ok = True
            return result
        finally:
            if row is not None:
                try:
                    t1 = now_ns()
                    if ok:
                        if peer == _any_source and status is not None:
                            peer = status.Get_source()
{{nb_after}}
{_WRITE_ROW}
                except Exception:
                    _oops(NAME)"""
# a non-blocking call: the request carries the row, finished at its completion
_OPEN_ASYNC = "            row = [KIND, nid, kid, SEQ, peer, nb, aux, site, 0]"
_CALL_ASYNC = """\
        t0 = now_ns()
        req = orig(CALL)
        if row is None:
            return req
        return _track(req, row, t0)"""


def _indent(lines: list[str], n: int = 12) -> str:
    return "\n".join(" " * n + ln for ln in lines)


def _make(name: str, orig: Callable[..., Any], kind: int, spec: _CollSpec, *, generic: bool = False,
          seq: bool = True, status_at: int = -1) -> Callable[..., Any] | None:  # fmt: skip
    """Compile the wrapper of one collective or point-to-point call (see the section comment).

    ``kind``: COLL / SEND (blocking: an open row while it runs), RECV
    (blocking, peer and size amended on return), or COLL_ASYNC / SEND_ASYNC /
    RECV_ASYNC (the returned request finishes the row). ``seq``: a
    collective (numbered per communicator). ``status_at``: a receive's
    ``status`` argument index. Returns None where the exact signature is
    not what ``spec`` expects and ``generic`` is False.
    """
    ps = None if generic else _params(orig)
    if ps is None and not generic:
        return None
    at = _Args(ps)
    peer_default = "0" if seq else "_any_source"
    lines = _payload_src(spec, at, peer_default)
    if lines is None:
        return None
    if kind in (COLL, SEND) and _USE_C and _HOT is not None:
        payload = spec[0] is not None or spec[2] is not None  # a buffer or a root to read
        return _make_c(name, orig, kind, seq, lines if payload else None, ps)
    if seq:
        lines = _SEQ.split("\n") + lines
    if spec[0] is None and not seq:  # recv/irecv(buf=None): the size is known on return / at completion
        lines.append("aux = _ids.obj")
    nb_after = ""
    if kind == RECV:
        if ps is not None:
            if len(ps) <= status_at + 1 or ps[status_at + 1].name != "status":
                return None
            lines += ["if peer == _any_source and status is None:", "    status = _Status()  # mpi4py fills in the actual source"]
        else:
            lines += [
                f"status = _arg(args, kw, {status_at}, 'status', None)",
                f"if peer == _any_source and status is None and len(args) <= {status_at}:",
                "    status = _Status()  # mpi4py fills in the actual source",
                "    kw = dict(kw, status=status)",
            ]
        nb_after = " " * 24 + ("nb = _obj_nbytes(result)" if spec[3] else "pass")
    if kind in (COLL_ASYNC, SEND_ASYNC, RECV_ASYNC):
        opened, call = _OPEN_ASYNC, _CALL_ASYNC
    else:
        opened, call = _OPEN_ROW, (_CALL_RECV.format(nb_after=nb_after) if kind == RECV else _CALL_BLOCKING)
    body = _TEMPLATE.format(prepare=_indent(lines), open=opened, call=call)
    body = body.replace("KIND", str(kind)).replace("SEQ", "seq" if seq else "-1")
    sig, call_args, defaults = _signature(ps)
    free = ["orig", "cell", "NAME", "sites", *defaults]
    src = f"def _factory({', '.join(free)}):\n    def {name}({sig}):\n" + body.replace("CALL", call_args) + f"\n    return {name}\n"
    ns: dict[str, Any] = {}
    exec(compile(src, f"<distdiag mpi4py wrapper {name}>", "exec"), globals(), ns)
    sites: dict[int, tuple[Any, int]] = {}
    _site_caches.append(sites)
    fn = ns["_factory"](orig, _name_cell(name), name, sites, *defaults.values())
    return _finish_wrapper(fn, name, orig)


def _signature(ps: list[inspect.Parameter] | None) -> tuple[str, str, dict[str, Any]]:
    """(parameter list, call arguments, default values by name) of a generated function."""
    if ps is None:
        return "self, *args, **kw", "self, *args, **kw", {}
    defaults = {f"_d{i}": p.default for i, p in enumerate(ps) if p.default is not inspect.Parameter.empty}
    sig = ", ".join(p.name if p.default is inspect.Parameter.empty else f"{p.name}=_d{i}" for i, p in enumerate(ps))
    return sig, ", ".join(p.name for p in ps), defaults


def _make_c(name: str, orig: Callable[..., Any], kind: int, seq: bool, lines: list[str] | None,
            ps: list[inspect.Parameter] | None) -> Callable[..., Any]:  # fmt: skip
    """The C wrapper (distdiag/shim/_hot.c) of a blocking collective or send.

    It does what the template's blocking wrapper does, in C; the payload's ``peer, nb,
    aux`` come from ``prep``, compiled from the template's own ``lines`` with the method's
    signature. ``lines`` None: a call without payload (Barrier), no ``prep``: the C wrapper
    writes peer -1, 0 bytes and no datatype itself."""
    prep = None
    if lines is not None:
        sig, _, defaults = _signature(ps)
        src = (f"def _factory({', '.join(defaults)}):\n    def {name}({sig}):\n" + _indent(lines, 8)
               + f"\n        return peer, nb, aux\n    return {name}\n")  # fmt: skip
        ns: dict[str, Any] = {}
        exec(compile(src, f"<distdiag mpi4py payload {name}>", "exec"), globals(), ns)
        prep = ns["_factory"](*defaults.values())
    return _finish_wrapper(_HOT.Call(orig, name, kind, seq, prep), name, orig)


def _wrap_coll(name: str, orig: Callable[..., Any], spec: _CollSpec, blocking: bool) -> Callable[..., Any]:
    kind = COLL if blocking else COLL_ASYNC
    fn = _make(name, orig, kind, spec) or _make(name, orig, kind, spec, generic=True)
    assert fn is not None  # the generic wrapper always compiles
    return fn


def _wrap_p2p(name: str, orig: Callable[..., Any], pspec: _P2PSpec) -> Callable[..., Any]:
    kind, bspec, peer_at, obj, st_at = pspec
    spec: _CollSpec = ((bspec[0], bspec[1], False) if bspec is not None else None, None, peer_at, obj)
    fn = _make(name, orig, kind, spec, seq=False, status_at=st_at)
    fn = fn or _make(name, orig, kind, spec, generic=True, seq=False, status_at=st_at)
    assert fn is not None
    return fn


def _track(req: Any, info: list[Any], t0: int) -> Any:
    """Wrap a fresh request so its completion finishes the row in ``info``."""
    try:
        w = _classes["WRequest"](req)  # type: ignore[index]
        info[8] = t0
        w._dd = info
        return w
    except Exception:
        _oops("track")
        return req


_P2P_SPECS: dict[str, _P2PSpec] = {
    "Send": (SEND, (0, "buf"), (1, "dest"), False, -1),
    "Ssend": (SEND, (0, "buf"), (1, "dest"), False, -1),
    "Bsend": (SEND, (0, "buf"), (1, "dest"), False, -1),
    "Rsend": (SEND, (0, "buf"), (1, "dest"), False, -1),
    "Recv": (RECV, (0, "buf"), (1, "source"), False, 3),
    "send": (SEND, (0, "obj"), (1, "dest"), True, -1),
    "ssend": (SEND, (0, "obj"), (1, "dest"), True, -1),
    "bsend": (SEND, (0, "obj"), (1, "dest"), True, -1),
    "recv": (RECV, None, (1, "source"), True, 3),
    "Isend": (SEND_ASYNC, (0, "buf"), (1, "dest"), False, -1),
    "Issend": (SEND_ASYNC, (0, "buf"), (1, "dest"), False, -1),
    "Ibsend": (SEND_ASYNC, (0, "buf"), (1, "dest"), False, -1),
    "Irsend": (SEND_ASYNC, (0, "buf"), (1, "dest"), False, -1),
    "Irecv": (RECV_ASYNC, (0, "buf"), (1, "source"), False, -1),
    "isend": (SEND_ASYNC, (0, "obj"), (1, "dest"), True, -1),
    "issend": (SEND_ASYNC, (0, "obj"), (1, "dest"), True, -1),
    "ibsend": (SEND_ASYNC, (0, "obj"), (1, "dest"), True, -1),
    "irecv": (RECV_ASYNC, None, (1, "source"), True, -1),
}


def _mk_sendrecv(name: str, orig: Callable[..., Any], obj: bool, replace: bool) -> Callable[..., Any]:
    """Sendrecv / sendrecv / Sendrecv_replace: a SEND and a RECV row, same times."""
    # positions: (sendbuf, dest, sendtag, recvbuf, source, recvtag, status);
    # Sendrecv_replace: (buf, dest, sendtag, source, recvtag, status)
    src_at = 3 if replace else 4
    st_at = 5 if replace else 6

    def wrapper(self: Any, *args: Any, **kw: Any) -> Any:
        rec = _rec
        if rec is None:
            return orig(self, *args, **kw)
        info = None
        status = None
        try:
            st = self._dd
            nid = _ids.names.get(name) or _nid(name)
            kid = _kid(st, rec)
            dest = _arg(args, kw, 1, "dest", -1)
            source = _arg(args, kw, src_at, "source", _any_source)
            if obj:
                nb, aux = _obj_nbytes(_arg(args, kw, 0, "sendobj", None)), _ids.obj
            else:
                nb, aux = _spec_info(_arg(args, kw, 0, "buf" if replace else "sendbuf", None), False)
            site = rec.site(2)
            if source == _any_source:
                status = _arg(args, kw, st_at, "status", None)
                if status is None and len(args) <= st_at:
                    status = _mpi.Status()
                    kw = dict(kw, status=status)
            t0 = rec.enter(SEND, nid, kid, -1, dest, nb, aux, site)
            info = (t0, nid, kid, source, nb, aux, site)
        except Exception:
            _oops(name)
        ok = False
        try:
            result = orig(self, *args, **kw)
            ok = True
            return result
        finally:
            if info is not None:
                try:
                    t1 = now_ns()
                    rec.leave(t1)
                    src = status.Get_source() if (status is not None and ok) else info[3]
                    rnb = _obj_nbytes(result) if (obj and ok) else info[4]
                    rec.add(info[0], t1, RECV, info[1], info[2], -1, src, rnb, info[5], info[6])
                except Exception:
                    _oops(name)

    wrapper.__name__ = wrapper.__qualname__ = name
    wrapper.__doc__ = getattr(orig, "__doc__", None)
    wrapper.__wrapped__ = orig  # type: ignore[attr-defined]
    return wrapper


# -- communicator creation -----------------------------------------------------------
def _leader(comm: Any) -> int:
    """World rank of ``comm``'s rank 0: a local call (group translation)."""
    g = comm.Get_group()
    try:
        return int(_mpi.Group.Translate_ranks(g, [0], _world_grp())[0])
    finally:
        g.Free()


def _world_grp() -> Any:
    global _world_group
    if _world_group is None:
        _world_group = _saved["COMM_WORLD"].Get_group()
    return _world_group


def _members_crc(group: Any) -> tuple[int, int]:
    """(leader world rank, crc of all member world ranks) of a group: local calls."""
    n = group.Get_size()
    ranks = _mpi.Group.Translate_ranks(group, list(range(n)), _world_grp())
    return int(ranks[0]) if n else -1, zlib.crc32(",".join(map(str, ranks)).encode())


def _creation_key(parent: _CommState, op: str, new: Any, args: tuple[Any, ...], kw: dict[str, Any]) -> str:
    """A key for a new communicator that every member computes alike.

    Creation calls are collective over the parent (except Create_group and
    Create_intercomm), so a per-parent counter advances the same on every
    rank: ``world.dup0``. Where one call makes several disjoint communicators,
    a suffix tells them apart: Split's color (``world.split1.c3``), else the
    world rank of the new communicator's rank 0 (``world.splittype2.r4``),
    which is the same for all its members and differs between disjoint ones.
    Create_group is collective over the group alone, so its counter runs per
    (parent, member set, tag).
    """
    pk = parent.key
    if op in ("Create_group",):
        group = _arg(args, kw, 0, "group", None)
        tag = _arg(args, kw, 1, "tag", 0)
        lead, crc = _members_crc(group)
        sub = f"group.t{tag}.r{lead}.h{crc:08x}"
        m = parent.nsub.get(sub, 0)
        parent.nsub[sub] = m + 1
        return f"{pk}.{sub}.{m}"
    if op == "Create_intercomm":
        local = _leader(new)
        rg = new.Get_remote_group()
        try:
            remote = int(_mpi.Group.Translate_ranks(rg, [0], _world_grp())[0])
        finally:
            rg.Free()
        tag = _arg(args, kw, 3, "tag", 0)
        a, b = sorted((local, remote))
        sub = f"inter.r{a}-r{b}.t{tag}"
        m = parent.nsub.get(sub, 0)
        parent.nsub[sub] = m + 1
        return f"{sub}.{m}"  # both groups compute the same name, whatever their parents
    n = parent.ncreate
    parent.ncreate = n + 1
    if op in ("Dup", "Clone", "Dup_with_info", "Idup", "Idup_with_info"):
        return f"{pk}.dup{n}"
    if op == "Split":
        return f"{pk}.split{n}.c{_arg(args, kw, 0, 'color', 0)}"
    if op == "Create_cart":
        return f"{pk}.cart{n}"
    if op == "Create_graph":
        return f"{pk}.graph{n}"
    if op in ("Create_dist_graph", "Create_dist_graph_adjacent"):
        return f"{pk}.distgraph{n}"
    if op == "Merge":
        return f"{pk}.merge{n}"
    # Split_type, Create, Sub: possibly several disjoint results
    return f"{pk}.{op.lower().replace('_', '')}{n}.r{_leader(new)}"


def _adopt(new: Any, key: str) -> Any:
    """``new`` as a wrapped communicator with state for ``key``."""
    obj: Any
    if isinstance(new, _ours):
        obj = new  # Dup/Clone/Idup build type(self): already our class
    else:
        cls = _wrap_of.get(type(new))
        if cls is None:
            return new
        obj = cls(new)  # a second handle to the same communicator
    obj._dd = _CommState(key)
    return obj


def _mk_create(name: str, orig: Callable[..., Any]) -> Callable[..., Any]:
    returns_pair = name.startswith("Idup")

    def wrapper(self: Any, *args: Any, **kw: Any) -> Any:
        rec = _rec
        if rec is None:
            return orig(self, *args, **kw)
        t0 = now_ns()
        out = orig(self, *args, **kw)
        t1 = now_ns()
        try:
            new = out[0] if returns_pair else out
            st = self._dd
            if new == _mpi.COMM_NULL:
                # not a member: still advance the counter like the members do
                if name not in ("Create_group", "Create_intercomm"):
                    st.ncreate += 1
                return out
            key = _creation_key(st, name, new, args, kw)
            wrapped = _adopt(new, key)
            try:
                rank, size = wrapped.Get_rank(), wrapped.Get_size()
                if wrapped.Is_inter():  # members = both groups; rank is within the local one
                    size += wrapped.Get_remote_size()
            except Exception:
                rank, size = -1, 0
            rec.add(t0, t1, COMM_CREATE, rec.intern(key), _kid(st, rec), -1, rank, 0, size, rec.site(2))
            return (wrapped,) + tuple(out[1:]) if returns_pair else wrapped
        except Exception:
            _oops(name)
            return out

    wrapper.__name__ = wrapper.__qualname__ = name
    wrapper.__doc__ = getattr(orig, "__doc__", None)
    wrapper.__wrapped__ = orig  # type: ignore[attr-defined]
    return wrapper


_CREATE_NAMES = (
    "Dup",
    "Clone",
    "Dup_with_info",
    "Idup",
    "Idup_with_info",
    "Split",
    "Split_type",
    "Create",
    "Create_group",
    "Create_cart",
    "Create_graph",
    "Create_dist_graph",
    "Create_dist_graph_adjacent",
    "Create_intercomm",
    "Sub",
    "Merge",
)


# -- requests --------------------------------------------------------------------------
def _complete(req: Any, t1: int, status: Any = None, result: Any = _MISSING) -> None:
    """Write the row of a tracked request that has completed."""
    info = req._dd
    req._dd = None
    peer = info[4]
    if status is not None and peer == _any_source and info[0] == RECV_ASYNC:
        try:
            peer = status.Get_source()
        except Exception:
            pass
    nb = info[5]
    if result is not _MISSING and info[0] == RECV_ASYNC and nb == 0:
        nb = _obj_nbytes(result)
    _rec.add(info[8], t1, info[0], info[1], info[2], info[3], peer, nb, info[6], info[7])


def _scan(requests: Any, t1: int, results: Any = None) -> None:
    """After a multi-request completion call: finish every tracked request now null.

    ``results``: the received objects in request order (lower-case ``waitall``
    / ``testall``), so a pickled receive gets its size.
    """
    for i, r in enumerate(requests):  # one per request the program handed us: the events themselves
        info = getattr(r, "_dd", None)
        if info is not None and not r:
            _complete(r, t1, None, results[i] if results is not None and i < len(results) else _MISSING)


def _objs_of(name: str, out: Any) -> Any:
    """The list of received objects a lower-case multi-completion call returned, if any."""
    if name == "waitall":
        return out
    if name == "testall" and out[0]:
        return out[1]
    return None


def _wait_cm(rec: Any, name: str, requests: Any) -> int:
    """Open a WAIT row naming the first still-pending tracked request it waits for."""
    kid, seq, peer, op = 0, -1, -1, 0
    try:
        for r in requests:
            info = getattr(r, "_dd", None)
            if info is not None:
                kid, seq, peer, op = info[2], info[3], info[4], info[1]
                break
    except Exception:
        pass
    return rec.enter(WAIT, _ids.names.get(name) or _nid(name), kid, seq, peer, 0, op, rec.site(3))  # type: ignore[no-any-return]


def _build_request_class(MPI: Any) -> type:
    R = MPI.Request

    class _RequestMeta(type):
        # MPI.Request is rebound to WRequest; keep isinstance/issubclass true
        # for the plain requests mpi4py and un-wrapped calls hand out.
        def __instancecheck__(cls, obj: Any) -> bool:
            return isinstance(obj, R)

        def __subclasscheck__(cls, sub: type) -> bool:
            return issubclass(sub, R)

    def single(name: str, blocking: bool, lower: bool) -> Callable[..., Any]:
        orig = getattr(R, name)

        def method(self: Any, status: Any = None) -> Any:
            rec = _rec
            info = getattr(self, "_dd", None)
            if rec is None or info is None:
                return orig(self, status)
            if blocking:
                try:
                    rec.enter(WAIT, _ids.names.get(name) or _nid(name), info[2], info[3], info[4], 0, info[1], rec.site(2))
                except Exception:
                    _oops(name)
            try:
                if info[0] == RECV_ASYNC and info[4] == _any_source and status is None:
                    status = _mpi.Status()  # to learn the actual source; mpi4py fills it
                out = orig(self, status)
            finally:
                if blocking:
                    try:
                        rec.leave()
                    except Exception:
                        _oops(name)
            try:
                t1 = now_ns()
                if not self:  # completed (a non-persistent request turns null)
                    res = _MISSING
                    if lower:
                        res = out if blocking else out[1]
                    _complete(self, t1, status, res)
            except Exception:
                _oops(name)
            return out

        method.__name__ = method.__qualname__ = name
        method.__doc__ = orig.__doc__
        return method

    def multi(name: str, blocking: bool) -> Any:
        orig = getattr(R, name)

        def method(cls: Any, requests: Any, *args: Any, **kw: Any) -> Any:
            rec = _rec
            if rec is None:
                return orig(requests, *args, **kw)
            if blocking:
                try:
                    _wait_cm(rec, name, requests)
                except Exception:
                    _oops(name)
            out: Any = None
            try:
                out = orig(requests, *args, **kw)
                return out
            finally:
                try:
                    t1 = now_ns()
                    if blocking:
                        rec.leave(t1)
                    _scan(requests, t1, _objs_of(name, out) if out is not None else None)
                except Exception:
                    _oops(name)

        method.__name__ = method.__qualname__ = name
        method.__doc__ = orig.__doc__
        return classmethod(method)

    ns: dict[str, Any] = {"__slots__": ("_dd",), "__module__": __name__, "__doc__": R.__doc__,
                          "__reduce__": _mk_reduce(R, named=False)}  # fmt: skip
    for nm, blocking in (("Wait", True), ("Test", False)):
        ns[nm] = single(nm, blocking, False)
        ns[nm.lower()] = single(nm.lower(), blocking, True)
    for nm, blocking in (
        ("Waitany", True),
        ("Waitall", True),
        ("Waitsome", True),
        ("Testany", False),
        ("Testall", False),
        ("Testsome", False),
    ):
        for n2 in (nm, nm.lower()):
            if hasattr(R, n2):
                ns[n2] = multi(n2, blocking)
    cls = _RequestMeta("Request", (R,), ns)
    copyreg.pickle(_RequestMeta, _reduce_class)
    return cls


# -- pickling -----------------------------------------------------------------------------
# mpi4py pickles only its predefined handles, by name: ``COMM_WORLD.__reduce__()``
# is the string ``"COMM_WORLD"`` (pickle stores the global ``mpi4py.MPI.COMM_WORLD``
# and loading gives the module's constant back), a second handle to one is
# ``(copyreg.__newobj__, (type(self), <the constant>))``, and anything else raises
# ``ValueError("cannot serialize 'mpi4py.MPI.Intracomm' instance")`` (mpi4py's
# ``reduce_default`` in objmodel.pxi). Our substitutes are second handles of our
# own class, which pickle cannot find by name, and mpi4py's own constant no longer
# is the module attribute of its name, which pickle checks. So:
#
# * our communicators (and our Request) reduce through ``_mk_reduce``: the
#   module's constant by name, as ``pkgutil.resolve_name("mpi4py.MPI:COMM_WORLD")``
#   (stdlib only: a process without distdiag loads it; ``copy.copy`` gives the
#   constant itself, as without us); mpi4py's error, with mpi4py's class name,
#   for the rest;
# * our classes (``type(MPI.COMM_WORLD)``, ``MPI.Request``) reduce, through
#   copyreg on their metaclasses, to the mpi4py class of that name;
# * mpi4py's own constant (inside ``MPI.Intracomm(MPI.COMM_WORLD)``'s pickle, say)
#   reduces to the module's constant of its name while the hook has replaced it
#   (copyreg on ``MPI.Intracomm``, registered while installed unless the program
#   registered its own).
_resolve_name = pkgutil.resolve_name


class _CommMeta(type):
    """Metaclass of our communicator classes: only so copyreg can reduce them (see above)."""


def _reduce_class(cls: type) -> tuple[Any, ...]:
    # the mpi4py class of that name: the base we subclass (Request: the module attribute)
    return (_resolve_name, (f"{_MODULE}:{cls.__name__}",))


def _mk_reduce(base: type, named: bool) -> Callable[[Any], Any]:
    plain_reduce: Callable[[Any], Any] = base.__reduce__  # type: ignore[assignment]
    ours = f"{__name__}.{base.__name__}"
    theirs = f"{base.__module__}.{base.__name__}"

    def __reduce__(self: Any) -> Any:
        try:
            rv = plain_reduce(self)  # never an MPI call: mpi4py looks at the handle only
        except ValueError as e:  # not a predefined handle: not picklable, as without us
            raise ValueError(str(e).replace(ours, theirs)) from None
        if not named or type(rv) is not tuple or len(rv) != 2 or len(rv[1]) != 2:
            return rv
        const = rv[1][1]  # mpi4py's constant with this handle
        name = _own_reduce(const)
        mod = sys.modules.get(_MODULE)
        if type(name) is str and mod is not None and getattr(mod, name, None) is self:
            return (_resolve_name, (f"{_MODULE}:{name}",))  # MPI.COMM_WORLD itself: by name
        return (rv[0], (base, const))  # a second handle, of mpi4py's class

    __reduce__.__qualname__ = f"{base.__name__}.__reduce__"
    return __reduce__


def _own_reduce(obj: Any) -> Any:
    """mpi4py's own ``__reduce__`` of one of its objects (a name for its constants)."""
    r: Callable[[Any], Any] = type(obj).__reduce__  # type: ignore[assignment]
    return r(obj)


def _reduce_constant(obj: Any) -> Any:
    """copyreg reducer of ``MPI.Intracomm``: mpi4py's own, except for its constants we replaced."""
    rv = _own_reduce(obj)
    if type(rv) is str:
        mod = sys.modules.get(_MODULE)
        cur = getattr(mod, rv, None) if mod is not None else None
        if cur is not None and cur is not obj:
            return (_resolve_name, (f"{_MODULE}:{rv}",))
    return rv


# -- class construction ---------------------------------------------------------------------
def _build_classes(MPI: Any) -> dict[str, type]:
    out: dict[str, type] = {"WRequest": _build_request_class(MPI)}
    for wname, base in (
        ("WIntracomm", MPI.Intracomm),
        ("WCartcomm", MPI.Cartcomm),
        ("WGraphcomm", MPI.Graphcomm),
        ("WDistgraphcomm", MPI.Distgraphcomm),
        ("WIntercomm", MPI.Intercomm),
    ):
        ns: dict[str, Any] = {"__slots__": ("_dd",), "__module__": __name__, "__doc__": base.__doc__}
        # generated exact-signature wrappers where the signature is as expected,
        # the generic (*args, **kw) ones otherwise
        for name, spec in _COLL_SPECS.items():
            if hasattr(base, name):
                ns[name] = _wrap_coll(name, getattr(base, name), spec, True)
        for name, spec in _ICOLL_SPECS.items():
            if hasattr(base, name):
                ns[name] = _wrap_coll(name, getattr(base, name), spec, False)
        for name, pspec in _P2P_SPECS.items():
            if hasattr(base, name):
                ns[name] = _wrap_p2p(name, getattr(base, name), pspec)
        for name, obj, replace in (("Sendrecv", False, False), ("sendrecv", True, False), ("Sendrecv_replace", False, True)):
            if hasattr(base, name):
                ns[name] = _mk_sendrecv(name, getattr(base, name), obj, replace)
        for name in _CREATE_NAMES:
            if hasattr(base, name):
                ns[name] = _mk_create(name, getattr(base, name))
        ns["__reduce__"] = _mk_reduce(base, named=True)
        # the program sees the same class name as without us (type(comm).__name__,
        # error messages); the module tells ours apart
        cls = _CommMeta(base.__name__, (base,), ns)
        out[wname] = cls
        _wrap_of[base] = cls
    copyreg.pickle(_CommMeta, _reduce_class)
    return out


_any_source = -2  # MPI.ANY_SOURCE, refreshed from the module when hooked


# -- the program's MPI_Init ----------------------------------------------------------------
# mpi4py initializes MPI at ``import mpi4py.MPI`` unless ``mpi4py.rc.initialize``
# is False (or MPI4PY_RC_INITIALIZE=0); then the program calls ``MPI.Init()`` /
# ``MPI.Init_thread(level)`` itself, later or never. Until then no MPI routine but
# MPI_Initialized/MPI_Finalized may be called (MPICH aborts: "Attempting to use
# an MPI routine ... before initializing"), and a wrapped communicator cannot
# even be built (``Intracomm.__cinit__`` calls MPI_Comm_test_inter). So
# everything MPI-ish waits for :func:`when_initialized`: ``Init`` and
# ``Init_thread`` are rebound, as module attributes, to wrappers that call the
# original and then the callbacks, and are put back once it returned. An MPI
# initialized by other means (a C library's MPI_Init) is not seen: the program
# then keeps mpi4py's plain communicators, unrecorded.
_init_waiting: list[Callable[[Any, int | None], None]] = []
#: the module whose Init/Init_thread we rebound, the originals and our wrappers
_init_mod: Any = None
_init_orig: dict[str, Any] = {}
_init_ours: dict[str, Any] = {}


def when_initialized(MPI: Any, callback: Callable[[Any, int | None], None]) -> None:
    """Call ``callback(MPI, t0_ns)`` once the program's MPI is initialized.

    At once (``t0_ns`` None) if it is; else right after the program's
    ``MPI.Init``/``MPI.Init_thread`` returns, with ``t0_ns`` = when that call
    began. Never after ``MPI.Finalize``: a callback registered then is dropped.
    Callbacks run in registration order; one that raises is logged and skipped.
    """
    global _init_mod
    if MPI.Is_finalized():
        return
    if MPI.Is_initialized():
        callback(MPI, None)
        return
    with _lock:
        _init_waiting.append(callback)
        if _init_mod is not None:
            return
        _init_mod = MPI
        for name in ("Init", "Init_thread"):
            orig = getattr(MPI, name, None)
            if orig is None:
                continue
            _init_orig[name] = orig
            _init_ours[name] = w = _mk_init(orig)
            setattr(MPI, name, w)


def cancel_when_initialized(callback: Callable[[Any, int | None], None]) -> None:
    """Forget a pending :func:`when_initialized` callback; with none left, put Init back."""
    with _lock:
        _init_waiting[:] = [cb for cb in _init_waiting if cb is not callback]
        if not _init_waiting:
            _unpatch_init()


def _unpatch_init() -> None:
    global _init_mod
    mod = _init_mod
    if mod is None:
        return
    for name, orig in _init_orig.items():
        if getattr(mod, name, None) is _init_ours.get(name):  # still ours: nobody rebound it since
            setattr(mod, name, orig)
    _init_orig.clear()
    _init_ours.clear()
    _init_mod = None


def _mk_init(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def wrapper(*args: Any, **kw: Any) -> Any:
        t0 = now_ns()
        out = orig(*args, **kw)  # errors pass through; the callbacks then stay pending
        with _lock:
            mod = _init_mod
            callbacks = _init_waiting[:]
            _init_waiting.clear()
            _unpatch_init()
        for cb in callbacks:
            try:
                cb(mod, t0)
            except Exception:
                _oops("init callback")
        return out

    return wrapper


def _on_import(MPI: Any) -> None:
    """Post-import hook: build the wrapper classes; swap them in once MPI is initialized."""
    global _classes, _ours, _any_source, _IN_PLACE, _Status
    with _lock:
        if _rec is None or _mpi is not None:
            return
        if _classes is None:
            _classes = _build_classes(MPI)
            _ours = tuple(c for k, c in _classes.items() if k != "WRequest")
        _any_source = MPI.ANY_SOURCE
        _IN_PLACE = MPI.IN_PLACE
        _Status = MPI.Status
    # t0 of COMM_WORLD's row when MPI_Init ran inside the import: the import's start
    t_import = _hooks.import_started_ns.pop(_MODULE, None)
    try:
        if MPI.Is_initialized():
            _on_init(MPI, t_import)
        else:
            when_initialized(MPI, _on_init)
    except Exception:
        _oops("import")


def _on_init(MPI: Any, t0: int | None) -> None:
    """MPI is initialized: swap in the wrapped world/self communicators and Request.

    ``t0``: when MPI_Init began (the import's start when mpi4py initialized at
    import, the program's ``Init``/``Init_thread`` call otherwise), or None
    when hooked after the fact.
    """
    global _mpi, _orig_request, _reduce_registered
    with _lock:
        if _rec is None or _mpi is not None or _classes is None:
            return
        if MPI.Is_finalized():  # hooked after the program's Finalize: no MPI call may follow
            return
        world = _adopt(MPI.COMM_WORLD, "world")
        self_ = _adopt(MPI.COMM_SELF, "self")
        _saved.clear()
        _saved.update(COMM_WORLD=MPI.COMM_WORLD, COMM_SELF=MPI.COMM_SELF, Request=MPI.Request)
        _mpi = MPI
        MPI.COMM_WORLD = world
        MPI.COMM_SELF = self_
        MPI.Request = _classes["WRequest"]
        _orig_request = _saved["Request"]
        if copyreg.dispatch_table.get(MPI.Intracomm) is None:  # the program's own reducer wins
            copyreg.pickle(MPI.Intracomm, _reduce_constant)
            _reduce_registered = MPI.Intracomm
    # communicator map rows for the predefined ones. COMM_WORLD's row is the
    # span of MPI_Init when we saw it begin: it blocks every rank until the
    # last one arrives, so its start is the rank's rendezvous start
    # (distdiag.slurm.rank_busy_until). Hooked after the fact: an instant.
    try:
        t = now_ns()
        init_t0 = t if t0 is None else t0
        for key, c, t_0 in (("world", world, init_t0), ("self", self_, t)):
            _rec.add(t_0, t, COMM_CREATE, _rec.intern(key), 0, -1, c.Get_rank(), 0, c.Get_size(), 0)
    except Exception:
        _oops("predefined")


#: the class we registered _reduce_constant for with copyreg (uninstall takes it back)
_reduce_registered: Any = None


# -- the hook protocol -------------------------------------------------------------------------
class _NotImported:
    """Stands for ``numpy.ndarray`` until the program imports numpy: no object is of this type."""


#: ``numpy.ndarray`` once the program imported numpy (the shim never imports it for the
#: program: see distdiag.schema); the buffer specs' fast path compares types against it
_ndarray: Any = _NotImported


def _on_numpy(np: Any) -> None:
    global _ndarray
    _ndarray = np.ndarray


def install(rec: Any, cfg: Any = None) -> None:
    """Start recording mpi4py calls into ``rec`` (now, or when mpi4py.MPI is imported)."""
    global _rec
    if _rec is not None:
        uninstall()
    _ids.bind(rec)
    for sites in _site_caches:  # site ids belong to a recorder
        sites.clear()
    _rec = rec
    if _HOT is not None:
        _HOT.install(rec, _oops)  # the C wrappers' recorder (their cached ids expire)
    _hooks.when_imported("numpy", _on_numpy)
    _hooks.when_imported(_MODULE, _on_import)


def uninstall() -> None:
    """Stop recording and put back exactly what we replaced in mpi4py.MPI.

    Wrapped communicators the program still holds keep working: they pass
    every call straight to mpi4py once the recorder is gone.
    """
    global _rec, _mpi, _world_group, _reduce_registered
    with _lock:
        _rec = None
        if _HOT is not None:
            _HOT.uninstall()
        try:
            for mod, cb0 in ((_MODULE, _on_import), ("numpy", _on_numpy)):
                waiting = _hooks._waiting.get(mod)
                if waiting is not None:
                    waiting[:] = [cb for cb in waiting if cb is not cb0]
                    if not waiting:
                        del _hooks._waiting[mod]
        except Exception:
            _oops("uninstall")
        if _mpi is not None:
            for k, v in _saved.items():
                setattr(_mpi, k, v)
            _saved.clear()
            _mpi = None
        _world_group = None  # the group handle stays valid; we just forget it
        if _reduce_registered is not None:
            if copyreg.dispatch_table.get(_reduce_registered) is _reduce_constant:
                del copyreg.dispatch_table[_reduce_registered]
            _reduce_registered = None
    cancel_when_initialized(_on_init)
