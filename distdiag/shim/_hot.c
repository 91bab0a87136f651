/* The shim's hot path in C: what an mpi4py call costs the program when it is recorded.
 *
 * Optional (setup.py builds it with optional=True): without it the same objects are
 * pure Python (distdiag.shim.recorder.ThreadBuffer's base, the mpi4py hook's _CommState
 * base and its generated wrappers), and record the same rows.
 *
 * Four types:
 *
 * - TBBase: the state of one thread's buffer (recorder.ThreadBuffer subclasses it):
 *   the chunk (a bytearray of 69-byte rows), the rows written, the capacity, the tid,
 *   the call a Python hook is inside of (``cur``) and its open spans. Python reads and
 *   sets every field as before; a Call below marks its call in flight in C fields, and
 *   ``ccur`` builds the row tuple from them when the flusher asks (rarely).
 * - CSBase: a communicator's state (the mpi4py hook's _CommState subclasses it): its
 *   key's string id, the recorder that id belongs to, the next collective's number.
 * - Call: the wrapper of one blocking collective or blocking send of mpi4py, a method
 *   descriptor with vectorcall. Per call: the comm state, the payload (``prep``, a
 *   generated Python function, only for calls that carry one), the sequence number,
 *   the caller's file:line (cached per (code, offset); a miss asks recorder.site_of),
 *   t0, the call marked in flight, the call, t1, one row packed into the chunk. Rows,
 *   in-flight rows and errors are those of the Python wrappers (tests/test_mpi_hook.py
 *   compares them); distdiag's own failures are reported to ``oops`` and never raise
 *   into the program; the call's result or exception passes through untouched.
 * - SiteCall: the file hook's wrapper of a path call (open, os.open, os.scandir...) that
 *   names the caller's line to the libc interposer; see its section below.
 *
 * Why: the Python wrapper spends ~800 ns of bytecode per call around a ~80 ns
 * COMM_SELF.Barrier (benchmarks/bench_intercept.py); the work itself is a few clock
 * reads and stores.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <frameobject.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "rows are little-endian; the pure-Python path serves other machines"
#endif

/* schema.EVENT_SPEC, packed: t0 i8, t1 i8, kind u1, name_id i4, comm_id i4, seq i8, peer i4,
 * nbytes i8, aux i8, site_id i4, tid i4, value f8. distdiag/shim/recorder.py checks ROW_SIZE
 * and a packed row against struct before it uses this module. */
#define ROW 69

static inline int64_t now_ns(void) { /* time.perf_counter_ns on Linux */
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

#define PUT(p, off, v, T) do { T v_ = (T)(v); memcpy((p) + (off), &v_, sizeof(T)); } while (0)

static void pack(char *p, int64_t t0, int64_t t1, int kind, int32_t nid, int32_t cid, int64_t seq, int32_t peer,
                 int64_t nb, int64_t aux, int32_t site, int32_t tid, double value) {
    PUT(p, 0, t0, int64_t);
    PUT(p, 8, t1, int64_t);
    p[16] = (char)(uint8_t)kind;
    PUT(p, 17, nid, int32_t);
    PUT(p, 21, cid, int32_t);
    PUT(p, 25, seq, int64_t);
    PUT(p, 33, peer, int32_t);
    PUT(p, 37, nb, int64_t);
    PUT(p, 45, aux, int64_t);
    PUT(p, 53, site, int32_t);
    PUT(p, 57, tid, int32_t);
    PUT(p, 61, value, double);
}

/* a frame's f_lasti, as Python code reads it (the bytecode offset) */
static int frame_lasti(PyFrameObject *f) {
#if PY_VERSION_HEX >= 0x030B0000
    return PyFrame_GetLasti(f);
#else
    return f->f_lasti * 2;
#endif
}

static int fits32(long long v) { return v >= INT32_MIN && v <= INT32_MAX; }

/* -- TBBase ------------------------------------------------------------------------------ */
/* Python's fields are objects, as __slots__ would hold them (an int field read from Python
 * is the stored int, not a new one: the Python hooks read and write them on every row). */
typedef struct {
    PyObject_HEAD
    PyObject *buf, *n, *cap, *tid, *cur, *spans, *alive;
    /* a C wrapper's call in flight (infl): ``ccur`` builds its row tuple on demand */
    int infl, f_kind;
    long long f_t0, f_nid, f_kid, f_seq, f_peer, f_nb, f_aux, f_site, f_tid;
} TB;

static int tb_init(TB *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"cap", "tid", "alive", NULL};
    PyObject *cap, *tid, *alive = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O!O!|O", names, &PyLong_Type, &cap, &PyLong_Type, &tid, &alive)) return -1;
    Py_ssize_t c = PyLong_AsSsize_t(cap);
    if (c == -1 && PyErr_Occurred()) return -1;
    if (c < 0 || c > PY_SSIZE_T_MAX / ROW) {
        PyErr_SetString(PyExc_ValueError, "cap out of range");
        return -1;
    }
    PyObject *buf = PyByteArray_FromStringAndSize(NULL, c * ROW);
    if (buf == NULL) return -1;
    memset(PyByteArray_AS_STRING(buf), 0, (size_t)(c * ROW));
    PyObject *spans = PyList_New(0);
    PyObject *zero = PyLong_FromLong(0);
    if (spans == NULL || zero == NULL) {
        Py_DECREF(buf);
        Py_XDECREF(spans);
        Py_XDECREF(zero);
        return -1;
    }
    Py_XSETREF(self->buf, buf);
    Py_XSETREF(self->spans, spans);
    Py_XSETREF(self->n, zero);
    Py_XSETREF(self->cap, Py_NewRef(cap));
    Py_XSETREF(self->tid, Py_NewRef(tid));
    Py_XSETREF(self->alive, Py_NewRef(alive));
    Py_XSETREF(self->cur, Py_NewRef(Py_None));
    self->infl = 0;
    return 0;
}

static int tb_traverse(TB *self, visitproc visit, void *arg) {
    Py_VISIT(self->buf);
    Py_VISIT(self->n);
    Py_VISIT(self->cap);
    Py_VISIT(self->tid);
    Py_VISIT(self->cur);
    Py_VISIT(self->spans);
    Py_VISIT(self->alive);
    return 0;
}

static int tb_clear(TB *self) {
    Py_CLEAR(self->buf);
    Py_CLEAR(self->n);
    Py_CLEAR(self->cap);
    Py_CLEAR(self->tid);
    Py_CLEAR(self->cur);
    Py_CLEAR(self->spans);
    Py_CLEAR(self->alive);
    return 0;
}

static void tb_dealloc(TB *self) {
    PyObject_GC_UnTrack(self);
    tb_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *tb_get_ccur(TB *self, void *closure) {
    if (!self->infl) Py_RETURN_NONE;
    return Py_BuildValue("(LiiLLLLLLLLd)", self->f_t0, -1, self->f_kind, self->f_nid, self->f_kid, self->f_seq,
                         self->f_peer, self->f_nb, self->f_aux, self->f_site, self->f_tid, 0.0);
}

static PyMemberDef tb_members[] = {
    {"buf", T_OBJECT_EX, offsetof(TB, buf), 0, "the current chunk (bytearray of rows)"},
    {"n", T_OBJECT_EX, offsetof(TB, n), 0, "rows written into the chunk"},
    {"cap", T_OBJECT_EX, offsetof(TB, cap), 0, "rows the chunk holds"},
    {"tid", T_OBJECT_EX, offsetof(TB, tid), 0, "the buffer's thread id in rows"},
    {"cur", T_OBJECT_EX, offsetof(TB, cur), 0, "the blocking call a Python hook is inside of, or None"},
    {"spans", T_OBJECT_EX, offsetof(TB, spans), 0, "open spans, outermost first"},
    {"alive", T_OBJECT_EX, offsetof(TB, alive), 0, "weak reference to the owner's marker, or None"},
    {NULL},
};

static PyGetSetDef tb_getset[] = {
    {"ccur", (getter)tb_get_ccur, NULL, "the blocking call a C wrapper is inside of, as a row tuple, or None", NULL},
    {NULL},
};

static PyTypeObject TBType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "distdiag.shim._hot.TBBase",
    .tp_basicsize = sizeof(TB),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "One thread's chunk and the call it is inside of (see distdiag.shim.recorder.ThreadBuffer).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)tb_init,
    .tp_traverse = (traverseproc)tb_traverse,
    .tp_clear = (inquiry)tb_clear,
    .tp_dealloc = (destructor)tb_dealloc,
    .tp_members = tb_members,
    .tp_getset = tb_getset,
};

/* -- CSBase ------------------------------------------------------------------------------ */
/* Objects, as __slots__ would hold them (the Python wrappers read them on every call). */
typedef struct {
    PyObject_HEAD
    PyObject *kid, *seq, *rec;
} CS;

static int cs_traverse(CS *self, visitproc visit, void *arg) {
    Py_VISIT(self->kid);
    Py_VISIT(self->seq);
    Py_VISIT(self->rec);
    return 0;
}

static int cs_clear(CS *self) {
    Py_CLEAR(self->kid);
    Py_CLEAR(self->seq);
    Py_CLEAR(self->rec);
    return 0;
}

static void cs_dealloc(CS *self) {
    PyObject_GC_UnTrack(self);
    cs_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMemberDef cs_members[] = {
    {"kid", T_OBJECT_EX, offsetof(CS, kid), 0, "string id of the communicator's key in rec"},
    {"seq", T_OBJECT_EX, offsetof(CS, seq), 0, "the next collective's sequence number"},
    {"rec", T_OBJECT_EX, offsetof(CS, rec), 0, "the recorder kid belongs to, or None"},
    {NULL},
};

static PyTypeObject CSType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "distdiag.shim._hot.CSBase",
    .tp_basicsize = sizeof(CS),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A communicator's key id and collective numbering (see the mpi4py hook's _CommState).",
    .tp_new = PyType_GenericNew,
    .tp_traverse = (traverseproc)cs_traverse,
    .tp_clear = (inquiry)cs_clear,
    .tp_dealloc = (destructor)cs_dealloc,
    .tp_members = cs_members,
};

/* -- the recorder the wrappers write to (install / uninstall) ------------------------------- */
static PyObject *g_rec;      /* the Recorder, or NULL: the wrappers pass straight through */
static PyObject *g_local;    /* rec._local */
static PyObject *g_tb;       /* rec._tb: the calling thread's buffer, made on first use */
static PyObject *g_rotate;   /* rec._rotate(tb) -> next row index */
static PyObject *g_site_of;  /* rec.site_of(frame) -> site id */
static PyObject *g_oops;     /* oops(name, exc): log distdiag's own failure once */
static unsigned long g_gen = 1; /* bumped at every install: cached site and name ids expire */
static PyObject *s_dd, *s_tb, *s_intern, *s_bind;

/* -- Call: the wrapper -------------------------------------------------------------------- */
#define NSITES 16

struct site {
    PyObject *code; /* strong: its address is the key */
    int lasti;
    unsigned long gen;
    long long id;
};

typedef struct {
    PyObject_HEAD
    PyObject *orig, *name, *prep, *dict;
    vectorcallfunc vectorcall;
    int kind, coll;
    long long nid;
    unsigned long nid_gen;
    struct site sites[NSITES];
} Call;

static void oops(Call *w) {
    /* distdiag's failure, never the program's: hand the exception to the hook (it logs once), drop it */
    PyObject *et, *ev, *etb;
    PyErr_Fetch(&et, &ev, &etb);
    PyErr_NormalizeException(&et, &ev, &etb);
    if (ev != NULL && etb != NULL) PyException_SetTraceback(ev, etb);
    if (g_oops != NULL) {
        PyObject *r = PyObject_CallFunctionObjArgs(g_oops, w->name, ev != NULL ? ev : Py_None, NULL);
        if (r == NULL) PyErr_Clear();
        Py_XDECREF(r);
    }
    Py_XDECREF(et);
    Py_XDECREF(ev);
    Py_XDECREF(etb);
}

static int as_ll(PyObject *o, long long *out) {
    long long v = PyLong_AsLongLong(o);
    if (v == -1 && PyErr_Occurred()) return -1;
    *out = v;
    return 0;
}

static int site_of_caller(Call *w, long long *out) {
    PyFrameObject *f = PyEval_GetFrame(); /* borrowed: the caller's (a C call pushes none) */
    if (f == NULL) {
        *out = 0;
        return 0;
    }
    PyCodeObject *code = PyFrame_GetCode(f); /* new reference */
    int lasti = frame_lasti(f);
    size_t h = (((uintptr_t)code >> 4) ^ (size_t)lasti * 2654435761u) % NSITES;
    struct site *s = &w->sites[h];
    if (s->gen == g_gen && s->code == (PyObject *)code && s->lasti == lasti) {
        Py_DECREF(code);
        *out = s->id;
        return 0;
    }
    PyObject *r = PyObject_CallOneArg(g_site_of, (PyObject *)f);
    if (r == NULL || as_ll(r, out) < 0) {
        Py_XDECREF(r);
        Py_DECREF(code);
        return -1;
    }
    Py_DECREF(r);
    Py_XSETREF(s->code, (PyObject *)code); /* takes the reference */
    s->lasti = lasti;
    s->gen = g_gen;
    s->id = *out;
    return 0;
}

/* the calling thread's buffer, new reference */
static TB *thread_buffer(void) {
    PyObject *tb = PyObject_GetAttr(g_local, s_tb);
    if (tb == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return NULL;
        PyErr_Clear();
        tb = PyObject_CallNoArgs(g_tb);
        if (tb == NULL) return NULL;
    }
    if (!PyObject_TypeCheck(tb, &TBType)) {
        Py_DECREF(tb);
        PyErr_SetString(PyExc_TypeError, "the thread's buffer is not a TBBase");
        return NULL;
    }
    return (TB *)tb;
}

static PyObject *call_vectorcall(Call *w, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    PyObject *rec = g_rec;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (rec == NULL || nargs < 1) return PyObject_Vectorcall(w->orig, args, nargsf, kwnames);
    Py_INCREF(rec); /* an uninstall inside the call must not free what we finish with */

    TB *tb = NULL;
    long long peer = -1, nb = 0, aux = 0, seq = -1, site = 0, kid = 0;
    int64_t t0 = 0;
    int open = 0;
    {
        PyObject *st = PyObject_GetAttr(args[0], s_dd);
        if (st == NULL) goto fail;
        if (!PyObject_TypeCheck(st, &CSType)) {
            Py_DECREF(st);
            PyErr_SetString(PyExc_TypeError, "_dd is not a CSBase");
            goto fail;
        }
        CS *cs = (CS *)st;
        if (w->coll) {
            PyObject *next;
            if (cs->seq == NULL || as_ll(cs->seq, &seq) < 0 || (next = PyLong_FromLongLong(seq + 1)) == NULL) {
                if (!PyErr_Occurred()) PyErr_SetString(PyExc_AttributeError, "seq");
                Py_DECREF(st);
                goto fail;
            }
            Py_SETREF(cs->seq, next);
        }
        if (w->prep != NULL) {
            PyObject *r = PyObject_Vectorcall(w->prep, args, nargsf, kwnames);
            if (r == NULL || !PyTuple_Check(r) || PyTuple_GET_SIZE(r) != 3 || as_ll(PyTuple_GET_ITEM(r, 0), &peer) < 0 ||
                as_ll(PyTuple_GET_ITEM(r, 1), &nb) < 0 || as_ll(PyTuple_GET_ITEM(r, 2), &aux) < 0) {
                if (r != NULL && !PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "prep: not (peer, nb, aux)");
                Py_XDECREF(r);
                Py_DECREF(st);
                goto fail;
            }
            Py_DECREF(r);
        }
        if (site_of_caller(w, &site) < 0) {
            Py_DECREF(st);
            goto fail;
        }
        if (w->nid_gen != g_gen) {
            PyObject *r = PyObject_CallMethodOneArg(rec, s_intern, w->name);
            if (r == NULL || as_ll(r, &w->nid) < 0) {
                Py_XDECREF(r);
                Py_DECREF(st);
                goto fail;
            }
            Py_DECREF(r);
            w->nid_gen = g_gen;
        }
        if (cs->rec == rec && cs->kid != NULL) {
            if (as_ll(cs->kid, &kid) < 0) {
                Py_DECREF(st);
                goto fail;
            }
        } else {
            PyObject *r = PyObject_CallMethodOneArg(st, s_bind, rec);
            if (r == NULL || as_ll(r, &kid) < 0) {
                Py_XDECREF(r);
                Py_DECREF(st);
                goto fail;
            }
            Py_DECREF(r);
        }
        Py_DECREF(st);
        if (!fits32(w->nid) || !fits32(kid) || !fits32(peer) || !fits32(site)) {
            PyErr_SetString(PyExc_OverflowError, "a row field is out of range");
            goto fail;
        }
        tb = thread_buffer();
        if (tb == NULL) goto fail;
        if (tb->tid == NULL || as_ll(tb->tid, &tb->f_tid) < 0 || !fits32(tb->f_tid)) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "the buffer's tid is not an int32");
            Py_CLEAR(tb);
            goto fail;
        }
        t0 = now_ns();
        tb->f_t0 = t0;
        tb->f_kind = w->kind;
        tb->f_nid = w->nid;
        tb->f_kid = kid;
        tb->f_seq = seq;
        tb->f_peer = peer;
        tb->f_nb = nb;
        tb->f_aux = aux;
        tb->f_site = site;
        tb->infl = 1;
        open = 1;
        goto call;
    }
fail:
    oops(w);
call:;
    PyObject *res = PyObject_Vectorcall(w->orig, args, nargsf, kwnames);
    if (open) {
        int64_t t1 = now_ns();
        tb->infl = 0;
        PyObject *et, *ev, *etb;
        PyErr_Fetch(&et, &ev, &etb); /* the call's own exception, if any: kept as it is */
        Py_ssize_t n = PyLong_AsSsize_t(tb->n), cap = PyLong_AsSsize_t(tb->cap);
        int ok = !PyErr_Occurred();
        if (ok && n >= cap) {
            PyObject *r = PyObject_CallOneArg(g_rotate, (PyObject *)tb);
            if (r == NULL || (n = PyLong_AsSsize_t(r)) < 0 || (cap = PyLong_AsSsize_t(tb->cap)) < 0) ok = 0;
            Py_XDECREF(r);
        }
        PyObject *n1 = NULL;
        if (ok && tb->buf != NULL && PyByteArray_Check(tb->buf) && n < cap && (n + 1) * ROW <= PyByteArray_GET_SIZE(tb->buf) &&
            (n1 = PyLong_FromSsize_t(n + 1)) != NULL) {
            pack(PyByteArray_AS_STRING(tb->buf) + n * ROW, t0, t1, w->kind, (int32_t)w->nid, (int32_t)kid, seq,
                 (int32_t)peer, nb, aux, (int32_t)site, (int32_t)tb->f_tid, 0.0);
            Py_SETREF(tb->n, n1); /* the publish: after the row */
        } else {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "the thread's chunk is not as expected");
            oops(w);
        }
        PyErr_Restore(et, ev, etb);
        Py_DECREF(tb);
    }
    Py_DECREF(rec);
    return res;
}

static int call_traverse(Call *self, visitproc visit, void *arg) {
    Py_VISIT(self->orig);
    Py_VISIT(self->name);
    Py_VISIT(self->prep);
    Py_VISIT(self->dict);
    for (int i = 0; i < NSITES; i++) Py_VISIT(self->sites[i].code);
    return 0;
}

static int call_clear(Call *self) {
    Py_CLEAR(self->orig);
    Py_CLEAR(self->name);
    Py_CLEAR(self->prep);
    Py_CLEAR(self->dict);
    for (int i = 0; i < NSITES; i++) Py_CLEAR(self->sites[i].code);
    return 0;
}

static void call_dealloc(Call *self) {
    PyObject_GC_UnTrack(self);
    call_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *call_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    static char *names[] = {"orig", "name", "kind", "coll", "prep", NULL};
    PyObject *orig, *name, *prep = Py_None;
    int kind, coll;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OUip|O", names, &orig, &name, &kind, &coll, &prep)) return NULL;
    if (!PyCallable_Check(orig) || (prep != Py_None && !PyCallable_Check(prep))) {
        PyErr_SetString(PyExc_TypeError, "orig and prep must be callable");
        return NULL;
    }
    if (kind < 0 || kind > 255) {
        PyErr_SetString(PyExc_ValueError, "kind out of range");
        return NULL;
    }
    Call *self = (Call *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->orig = Py_NewRef(orig);
    self->name = Py_NewRef(name);
    self->prep = prep == Py_None ? NULL : Py_NewRef(prep);
    self->kind = kind;
    self->coll = coll;
    self->vectorcall = (vectorcallfunc)call_vectorcall;
    return (PyObject *)self;
}

static PyObject *call_get(PyObject *self, PyObject *obj, PyObject *type) {
    if (obj == NULL || obj == Py_None) return Py_NewRef(self);
    return PyMethod_New(self, obj);
}

static PyGetSetDef call_getset[] = {
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, NULL, NULL},
    {NULL},
};

static PyTypeObject CallType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "distdiag.shim._hot.Call",
    .tp_basicsize = sizeof(Call),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_METHOD_DESCRIPTOR,
    .tp_doc = "Call(orig, name, kind, coll, prep=None): a recorded blocking mpi4py call (a method).",
    .tp_new = call_new,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(Call, vectorcall),
    .tp_dictoffset = offsetof(Call, dict),
    .tp_descr_get = call_get,
    .tp_traverse = (traverseproc)call_traverse,
    .tp_clear = (inquiry)call_clear,
    .tp_dealloc = (destructor)call_dealloc,
    .tp_getset = call_getset,
};

/* -- SiteCall: a path call that names its call site to the libc interposer ----------------------
 *
 * fileio._wrap_site's fast path in C: for ``open(path[, mode])``, ``os.open(path, ...)``,
 * ``os.scandir(path)``... with ``path`` a str or bytes, the caller's file:line (the wrapper's
 * ``sites`` cache, as fileio._cached_site reads it; a miss asks fileio._site_from, which fills
 * it), then ``put(site, path)`` (the interposer's dd_site, through _binding.site; called
 * directly where the interposer is loaded and the path is an ASCII str or bytes: the same bytes,
 * without the boxed call), then the original. The caller's site when it is the program's own
 * line is also kept in the wrapper (the last one answered): a loop that opens from one line finds
 * it with two compares. Measured: ~140 -> ~70 ns an open (benchmarks/bench_preload.py). Any
 * other call (another path type, keyword arguments or a buffering argument to open, warnings
 * that must point at the program's line) goes to the Python wrapper ``py``,
 * which does all of it as before. cached_site is fileio._cached_site on the same dict: a change
 * to one is a change to both (tests/test_preload.py's site test runs each). */
static int g_sites_on; /* fileio recording with the interposer: sites are named */
/* The interposer's dd_site, found when the sites are switched on (file_sites): an ASCII str or a
 * bytes path is handed to it directly, as _binding.site would (the same bytes); any other path
 * goes through ``put``. NULL: every path goes through ``put``. */
static void (*g_dd_site)(int32_t, const char *, size_t);

typedef struct {
    PyObject_HEAD
    PyObject *orig, *py, *sites, *site_from, *put, *dict;
    vectorcallfunc vectorcall;
    int is_open, warn_encoding;
    /* the last call site answered from ``sites`` for a caller that is the program's own frame
     * (an entry whose ``via`` is None): its code (held, so its address is never another code's),
     * f_lasti and site id. A loop that opens from one line asks the dict once. */
    PyObject *last_code;
    int last_lasti;
    long last_site;
} SiteCall;

static int cached_site(SiteCall *w, PyFrameObject *f, long *out) {
    PyCodeObject *code = PyFrame_GetCode(f);
    int lasti = frame_lasti(f);
    if ((PyObject *)code == w->last_code && lasti == w->last_lasti) {
        Py_DECREF(code);
        *out = w->last_site;
        return 0;
    }
    PyObject *key = PyLong_FromLong(lasti);
    if (key == NULL) {
        Py_DECREF(code);
        return -1;
    }
    PyObject *s = PyDict_GetItemWithError(w->sites, key); /* borrowed */
    Py_DECREF(key);
    int hit = 0;
    if (s != NULL && PyTuple_Check(s) && PyTuple_GET_SIZE(s) == 4 && PyTuple_GET_ITEM(s, 0) == (PyObject *)code) {
        PyObject *via = PyTuple_GET_ITEM(s, 2);
        if (via == Py_None) {
            hit = 1;
            long v = PyLong_AsLong(PyTuple_GET_ITEM(s, 1));
            if (!(v == -1 && PyErr_Occurred())) {
                Py_XSETREF(w->last_code, Py_NewRef((PyObject *)code));
                w->last_lasti = lasti;
                w->last_site = v;
            }
        } else {
            PyFrameObject *b = PyFrame_GetBack(f); /* new reference */
            if (b != NULL) {
                PyCodeObject *bc = PyFrame_GetCode(b);
                long want = PyLong_AsLong(PyTuple_GET_ITEM(s, 3));
                hit = (PyObject *)bc == via && want == frame_lasti(b);
                Py_DECREF(bc);
                Py_DECREF(b);
            }
        }
        if (hit) *out = PyLong_AsLong(PyTuple_GET_ITEM(s, 1));
    }
    Py_DECREF(code);
    if (PyErr_Occurred()) return -1;
    if (hit) return 0;
    PyObject *r = PyObject_CallFunctionObjArgs(w->site_from, (PyObject *)f, w->sites, NULL);
    if (r == NULL) return -1;
    *out = PyLong_AsLong(r);
    Py_DECREF(r);
    return PyErr_Occurred() ? -1 : 0;
}

static PyObject *sitecall_vectorcall(SiteCall *w, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *path = nargs ? args[0] : NULL;
    int plain = path != NULL && (PyUnicode_CheckExact(path) || PyBytes_CheckExact(path));
    int fast = plain && (!w->is_open || (kwnames == NULL && nargs <= 2 && !w->warn_encoding));
    if (!fast) return PyObject_Vectorcall(w->py, args, nargsf, kwnames);
    if (g_sites_on) {
        PyFrameObject *f = PyEval_GetFrame(); /* borrowed: the caller's */
        long site;
        if (f != NULL && cached_site(w, f, &site) == 0) {
            if (g_dd_site != NULL && site >= INT32_MIN && site <= INT32_MAX) {
                if (PyUnicode_CheckExact(path) && PyUnicode_IS_ASCII(path)) { /* as _binding.site */
                    g_dd_site((int32_t)site, (const char *)PyUnicode_DATA(path), (size_t)PyUnicode_GET_LENGTH(path));
                    return PyObject_Vectorcall(w->orig, args, nargsf, kwnames);
                }
                if (PyBytes_CheckExact(path)) {
                    g_dd_site((int32_t)site, PyBytes_AS_STRING(path), (size_t)PyBytes_GET_SIZE(path));
                    return PyObject_Vectorcall(w->orig, args, nargsf, kwnames);
                }
            }
            PyObject *sv = PyLong_FromLong(site);
            if (sv != NULL) {
                PyObject *pargs[2] = {sv, path};
                PyObject *r = PyObject_Vectorcall(w->put, pargs, 2, NULL);
                Py_XDECREF(r);
                Py_DECREF(sv);
            }
        }
        PyErr_Clear(); /* naming the site is distdiag's business: never the program's error */
    }
    return PyObject_Vectorcall(w->orig, args, nargsf, kwnames);
}

static int sitecall_traverse(SiteCall *self, visitproc visit, void *arg) {
    Py_VISIT(self->orig);
    Py_VISIT(self->py);
    Py_VISIT(self->sites);
    Py_VISIT(self->site_from);
    Py_VISIT(self->put);
    Py_VISIT(self->dict);
    Py_VISIT(self->last_code);
    return 0;
}

static int sitecall_clear(SiteCall *self) {
    Py_CLEAR(self->orig);
    Py_CLEAR(self->py);
    Py_CLEAR(self->sites);
    Py_CLEAR(self->site_from);
    Py_CLEAR(self->put);
    Py_CLEAR(self->dict);
    Py_CLEAR(self->last_code);
    return 0;
}

static void sitecall_dealloc(SiteCall *self) {
    PyObject_GC_UnTrack(self);
    sitecall_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *sitecall_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    static char *names[] = {"orig", "py", "sites", "site_from", "put", "is_open", "warn_encoding", NULL};
    PyObject *orig, *py, *sites, *site_from, *put;
    int is_open, warn_encoding;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOO!OOpp", names, &orig, &py, &PyDict_Type, &sites, &site_from, &put,
                                     &is_open, &warn_encoding))
        return NULL;
    if (!PyCallable_Check(orig) || !PyCallable_Check(py) || !PyCallable_Check(site_from) || !PyCallable_Check(put)) {
        PyErr_SetString(PyExc_TypeError, "orig, py, site_from and put must be callable");
        return NULL;
    }
    SiteCall *self = (SiteCall *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->orig = Py_NewRef(orig);
    self->py = Py_NewRef(py);
    self->sites = Py_NewRef(sites);
    self->site_from = Py_NewRef(site_from);
    self->put = Py_NewRef(put);
    self->is_open = is_open;
    self->warn_encoding = warn_encoding;
    self->vectorcall = (vectorcallfunc)sitecall_vectorcall;
    return (PyObject *)self;
}

static PyObject *sitecall_reduce(PyObject *self, PyObject *noargs) {
    /* pickled by name, as the builtin it stands for (pickle finds it in its __module__) */
    return PyObject_GetAttrString(self, "__qualname__");
}

static PyObject *sitecall_repr(SiteCall *self) {
    return PyObject_Repr(self->orig); /* the builtin's: "<built-in function open>" */
}

static PyMethodDef sitecall_methods[] = {
    {"__reduce__", sitecall_reduce, METH_NOARGS, NULL},
    {NULL},
};

static PyGetSetDef sitecall_getset[] = {
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, NULL, NULL},
    {NULL},
};

static PyTypeObject SiteCallType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "distdiag.shim._hot.SiteCall",
    .tp_basicsize = sizeof(SiteCall),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "SiteCall(orig, py, sites, site_from, put, is_open, warn_encoding): a path call naming its site.",
    .tp_new = sitecall_new,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(SiteCall, vectorcall),
    .tp_dictoffset = offsetof(SiteCall, dict),
    .tp_traverse = (traverseproc)sitecall_traverse,
    .tp_clear = (inquiry)sitecall_clear,
    .tp_dealloc = (destructor)sitecall_dealloc,
    .tp_repr = (reprfunc)sitecall_repr,
    .tp_methods = sitecall_methods,
    .tp_getset = sitecall_getset,
};

static PyObject *m_file_sites(PyObject *mod, PyObject *on) {
    int v = PyObject_IsTrue(on);
    if (v < 0) return NULL;
    g_sites_on = v;
    if (v && g_dd_site == NULL) *(void **)&g_dd_site = dlsym(RTLD_DEFAULT, "dd_site");
    Py_RETURN_NONE;
}

/* -- module functions ---------------------------------------------------------------------- */
static PyObject *m_install(PyObject *mod, PyObject *args) {
    PyObject *rec, *oops_fn;
    if (!PyArg_ParseTuple(args, "OO", &rec, &oops_fn)) return NULL;
    PyObject *local = PyObject_GetAttrString(rec, "_local");
    PyObject *tb = PyObject_GetAttrString(rec, "_tb");
    PyObject *rot = PyObject_GetAttrString(rec, "_rotate");
    PyObject *site = PyObject_GetAttrString(rec, "site_of");
    if (local == NULL || tb == NULL || rot == NULL || site == NULL) {
        Py_XDECREF(local);
        Py_XDECREF(tb);
        Py_XDECREF(rot);
        Py_XDECREF(site);
        return NULL;
    }
    Py_XSETREF(g_local, local);
    Py_XSETREF(g_tb, tb);
    Py_XSETREF(g_rotate, rot);
    Py_XSETREF(g_site_of, site);
    Py_XSETREF(g_oops, Py_NewRef(oops_fn));
    Py_XSETREF(g_rec, Py_NewRef(rec));
    g_gen++;
    Py_RETURN_NONE;
}

static PyObject *m_uninstall(PyObject *mod, PyObject *noargs) {
    Py_CLEAR(g_rec); /* first: a wrapper reads it before anything else */
    Py_CLEAR(g_local);
    Py_CLEAR(g_tb);
    Py_CLEAR(g_rotate);
    Py_CLEAR(g_site_of);
    Py_CLEAR(g_oops);
    g_gen++;
    Py_RETURN_NONE;
}

static PyObject *m_now_ns(PyObject *mod, PyObject *noargs) { return PyLong_FromLongLong(now_ns()); }

static PyObject *m_pack(PyObject *mod, PyObject *args) {
    /* pack(t0, t1, kind, nid, cid, seq, peer, nb, aux, site, tid, value) -> bytes: the row this module writes */
    long long t0, t1, seq, nb, aux;
    int kind, nid, cid, peer, site, tid;
    double value;
    if (!PyArg_ParseTuple(args, "LLiiiLiLLiid", &t0, &t1, &kind, &nid, &cid, &seq, &peer, &nb, &aux, &site, &tid, &value))
        return NULL;
    char row[ROW];
    pack(row, t0, t1, kind, nid, cid, seq, peer, nb, aux, site, tid, value);
    return PyBytes_FromStringAndSize(row, ROW);
}

static PyMethodDef methods[] = {
    {"install", m_install, METH_VARARGS, "install(rec, oops): the wrappers record into rec"},
    {"uninstall", m_uninstall, METH_NOARGS, "the wrappers pass every call straight through"},
    {"now_ns", m_now_ns, METH_NOARGS, "the wrappers' clock (time.perf_counter_ns's)"},
    {"pack", m_pack, METH_VARARGS, "the bytes of one row as the wrappers write it"},
    {"file_sites", m_file_sites, METH_O, "file_sites(on): SiteCall objects name call sites (or only call through)"},
    {NULL},
};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "_hot", "The shim's hot path in C (see _hot.c).", -1, methods};

PyMODINIT_FUNC PyInit__hot(void) {
    if (PyType_Ready(&TBType) < 0 || PyType_Ready(&CSType) < 0 || PyType_Ready(&CallType) < 0 ||
        PyType_Ready(&SiteCallType) < 0)
        return NULL;
    s_dd = PyUnicode_InternFromString("_dd");
    s_tb = PyUnicode_InternFromString("tb");
    s_intern = PyUnicode_InternFromString("intern");
    s_bind = PyUnicode_InternFromString("bind");
    if (s_dd == NULL || s_tb == NULL || s_intern == NULL || s_bind == NULL) return NULL;
    PyObject *m = PyModule_Create(&moddef);
    if (m == NULL) return NULL;
    if (PyModule_AddIntConstant(m, "ROW_SIZE", ROW) < 0 || PyModule_AddObjectRef(m, "TBBase", (PyObject *)&TBType) < 0 ||
        PyModule_AddObjectRef(m, "CSBase", (PyObject *)&CSType) < 0 ||
        PyModule_AddObjectRef(m, "Call", (PyObject *)&CallType) < 0 ||
        PyModule_AddObjectRef(m, "SiteCall", (PyObject *)&SiteCallType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
