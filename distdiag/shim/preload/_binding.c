/* The Python side's handle on the interposer (interpose.c), without ctypes: the shim must
 * not import modules the program has not (its imports and their order stay its own).
 *
 * The interposer is LD_PRELOADed, so its dd_* functions are in the process's global
 * scope: found here with dlsym(RTLD_DEFAULT), never linked. Without it, available() is
 * False and nothing else is called. wait() releases the GIL (the drainer sleeps in it).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>

static int (*p_version)(void);
static int (*p_slot_size)(void);
static int (*p_start)(long, const char *);
static void (*p_stop)(void);
static void (*p_mute)(int);
static long (*p_drain)(void *, long);
static long (*p_overflow)(void *, long);
static void (*p_wait)(long);
static void (*p_kick)(void);
static long long (*p_loaded_ns)(void); /* optional: a library older than it has none */
static void (*p_site)(int32_t, const char *, size_t); /* optional, as p_loaded_ns */
static int resolved = -1;

static int resolve(void) {
    if (resolved >= 0) return resolved;
    *(void **)&p_version = dlsym(RTLD_DEFAULT, "dd_version");
    *(void **)&p_slot_size = dlsym(RTLD_DEFAULT, "dd_slot_size");
    *(void **)&p_start = dlsym(RTLD_DEFAULT, "dd_start");
    *(void **)&p_stop = dlsym(RTLD_DEFAULT, "dd_stop");
    *(void **)&p_mute = dlsym(RTLD_DEFAULT, "dd_mute");
    *(void **)&p_drain = dlsym(RTLD_DEFAULT, "dd_drain");
    *(void **)&p_overflow = dlsym(RTLD_DEFAULT, "dd_overflow");
    *(void **)&p_wait = dlsym(RTLD_DEFAULT, "dd_wait");
    *(void **)&p_kick = dlsym(RTLD_DEFAULT, "dd_kick");
    *(void **)&p_loaded_ns = dlsym(RTLD_DEFAULT, "dd_loaded_ns");
    *(void **)&p_site = dlsym(RTLD_DEFAULT, "dd_site");
    resolved = p_version && p_slot_size && p_start && p_stop && p_mute && p_drain && p_overflow && p_wait && p_kick;
    return resolved;
}

#define NEED() if (!resolve()) { PyErr_SetString(PyExc_RuntimeError, "the interposer is not loaded"); return NULL; }

static PyObject *b_available(PyObject *self, PyObject *args) {
    (void)self; (void)args;
    return PyBool_FromLong(resolve());
}

static PyObject *b_version(PyObject *self, PyObject *args) {
    (void)self; (void)args; NEED();
    return Py_BuildValue("ii", p_version(), p_slot_size());
}

static PyObject *b_start(PyObject *self, PyObject *args) {
    (void)self;
    long n;
    PyObject *o;
    const char *skip = NULL;
    if (!PyArg_ParseTuple(args, "lO", &n, &o)) return NULL;
    if (o != Py_None) {
        if (!PyBytes_Check(o)) {
            PyErr_SetString(PyExc_TypeError, "skip_prefix: bytes or None");
            return NULL;
        }
        skip = PyBytes_AS_STRING(o);
    }
    NEED();
    return PyLong_FromLong(p_start(n, skip));
}

static PyObject *b_stop(PyObject *self, PyObject *args) {
    (void)self; (void)args; NEED();
    p_stop();
    Py_RETURN_NONE;
}

static PyObject *b_mute(PyObject *self, PyObject *args) {
    (void)self;
    int on;
    if (!PyArg_ParseTuple(args, "p", &on)) return NULL;
    NEED();
    p_mute(on);
    Py_RETURN_NONE;
}

/* fn(buffer, max) on a writable buffer of records of `size` bytes (0: the slot size): how many it took */
static PyObject *take(PyObject *args, long (**fn)(void *, long), long size) {
    Py_buffer buf;
    long max;
    if (!PyArg_ParseTuple(args, "w*l", &buf, &max)) return NULL;
    if (!resolve()) {
        PyBuffer_Release(&buf);
        PyErr_SetString(PyExc_RuntimeError, "the interposer is not loaded");
        return NULL;
    }
    if (size <= 0) size = p_slot_size();
    if (max < 0 || max * size > buf.len) max = (long)(buf.len / size);
    long n = (*fn)(buf.buf, max);
    PyBuffer_Release(&buf);
    return PyLong_FromLong(n);
}

static PyObject *b_drain(PyObject *self, PyObject *args) {
    (void)self;
    return take(args, &p_drain, 0);
}

static PyObject *b_overflow(PyObject *self, PyObject *args) {
    (void)self;
    return take(args, &p_overflow, 48 + 256); /* interpose.c's struct ovf_rec */
}

static PyObject *b_wait(PyObject *self, PyObject *args) {
    (void)self;
    long ms;
    if (!PyArg_ParseTuple(args, "l", &ms)) return NULL;
    NEED();
    Py_BEGIN_ALLOW_THREADS
    p_wait(ms);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *b_loaded_ns(PyObject *self, PyObject *args) {
    (void)self; (void)args; NEED();
    if (!p_loaded_ns) Py_RETURN_NONE;
    return PyLong_FromLongLong(p_loaded_ns());
}

static PyObject *b_kick(PyObject *self, PyObject *args) {
    (void)self; (void)args; NEED();
    p_kick();
    Py_RETURN_NONE;
}


/* -- call sites ------------------------------------------------------------------------------
 *
 * site(site_id, path): the calling thread's next libc call on `path` (str or bytes, as the
 * program passed it) comes from the Python call site `site_id` (interpose.c, dd_site). The file
 * hook's thin wrappers of open, os.open, os.scandir... call it just before the call they wrap
 * (fileio._wrap_site). A no-op with an interposer that has no dd_site. */
static PyObject *b_site(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "site(site_id, path)");
        return NULL;
    }
    long site = PyLong_AsLong(args[0]);
    if (site == -1 && PyErr_Occurred()) return NULL;
    if (!resolve() || !p_site) Py_RETURN_NONE;
    PyObject *path = args[1];
    if (PyUnicode_CheckExact(path) && PyUnicode_IS_ASCII(path)) { /* the same bytes in any file-system encoding */
        p_site((int32_t)site, (const char *)PyUnicode_DATA(path), (size_t)PyUnicode_GET_LENGTH(path));
    } else if (PyBytes_Check(path)) {
        p_site((int32_t)site, PyBytes_AS_STRING(path), (size_t)PyBytes_GET_SIZE(path));
    } else if (PyUnicode_Check(path)) {
        PyObject *b = PyUnicode_EncodeFSDefault(path);
        if (!b) return NULL;
        p_site((int32_t)site, PyBytes_AS_STRING(b), (size_t)PyBytes_GET_SIZE(b));
        Py_DECREF(b);
    } else {
        p_site(0, "", 0);
    }
    Py_RETURN_NONE;
}

/* -- convert: the drainer's per-slot work (preload/__init__.py, Drainer._convert_py is the
 * same in Python and the reference the tests compare with) --------------------------------
 *
 * convert(slots, n, rows, st, pend, shim_tids) -> rows written into ``rows``
 *
 * slots: n slots as dd_drain copied them; rows: a writable buffer of at least
 * (2 n + len(st.acc) + 1) event rows (69 bytes each, schema.EVENT_SPEC packed "<");
 * st: the Drainer (ops_table: per op its kind, mode (255: not recorded) and flags (1: an open,
 * 2: folded into the thread's pending open, 4: summed when hot), paths, tids, acc, rate, msum, op_ids,
 * big_bytes, big_ns, close_min_ns, hot_calls, hot_window_ns, _tag_of, _tid_of); pend: thread id -> its last open, held (a list of 9);
 * shim_tids: the OS thread ids of the shim's own threads (skipped). */
#define SLOT_HDR 64
#define ROW 69
#define NOPS_MAX 64

struct conv {
    unsigned char *out;
    Py_ssize_t cap, n;
};

static int put_row(struct conv *c, int64_t t0, int64_t t1, int kind, long long nid, long long cid,
                   int64_t nb, int64_t aux, long long site, long long tid, double val, int64_t seq) {
    if (c->n >= c->cap) {
        PyErr_SetString(PyExc_RuntimeError, "convert: the rows buffer is too small");
        return -1;
    }
    unsigned char *r = c->out + c->n * ROW;
    int32_t i32;
    memcpy(r + 0, &t0, 8);
    memcpy(r + 8, &t1, 8);
    r[16] = (unsigned char)kind;
    i32 = (int32_t)nid; memcpy(r + 17, &i32, 4);
    i32 = (int32_t)cid; memcpy(r + 21, &i32, 4);
    memcpy(r + 25, &seq, 8);
    i32 = -1; memcpy(r + 33, &i32, 4);
    memcpy(r + 37, &nb, 8);
    memcpy(r + 45, &aux, 8);
    i32 = (int32_t)site; memcpy(r + 53, &i32, 4);
    i32 = (int32_t)tid; memcpy(r + 57, &i32, 4);
    memcpy(r + 61, &val, 8);
    c->n++;
    return 0;
}

/* ``seq`` of a row that sums `calls` calls: the calls it stands for (distdiag.rows.calls_of), -1
 * for one call */
static int64_t sum_seq(long long calls) { return calls > 1 ? (int64_t)calls : -1; }

/* a row from a Python sequence (t0, t1, kind, name_id, comm_id, nbytes, aux, site_id, tid, value) */
static int put_seq(struct conv *c, PyObject *row) {
    PyObject *f = PySequence_Fast(row, "convert: a row is a sequence");
    if (!f) return -1;
    if (PySequence_Fast_GET_SIZE(f) != 10) {
        Py_DECREF(f);
        PyErr_SetString(PyExc_ValueError, "convert: a row has 10 fields");
        return -1;
    }
    PyObject **it = PySequence_Fast_ITEMS(f);
    long long v[9];
    for (int i = 0; i < 9; i++) {
        v[i] = PyLong_AsLongLong(it[i]);
        if (v[i] == -1 && PyErr_Occurred()) { Py_DECREF(f); return -1; }
    }
    double val = PyFloat_AsDouble(it[9]);
    Py_DECREF(f);
    if (val == -1.0 && PyErr_Occurred()) return -1;
    return put_row(c, v[0], v[1], (int)v[2], v[3], v[4], v[5], v[6], v[7], v[8], val, -1);
}

static long long as_ll(PyObject *o) { return PyLong_AsLongLong(o); }

static PyObject *attr(PyObject *o, const char *name) { return PyObject_GetAttrString(o, name); }

/* The rate rule (preload/__init__.py, HOT_WINDOW_NS): a thread's metadata call past hot_calls in
 * its window of hot_win ns is summed into msum[(kind, directory's name_id, tid, op)] = [first
 * start, summed ns, calls, directory's aux]; rate[tid] = [window start, calls in it]. Hot calls
 * come in runs (one thread, one directory), so one batch keeps the last thread's window and the
 * last sum in C (struct hot) and writes them back to the dicts' lists when another comes, and
 * at the batch's end (hot_flush): the dicts end each batch as the Python loop leaves them. */
struct hot {
    PyObject *rate, *msum, *paths, *tag_of;
    long long calls, win;
    /* the last thread's window */
    long long tid;
    PyObject *w; /* its list in rate (a reference held), NULL: none */
    long long w0, cnt;
    /* the last sum: its key, its list in msum (a reference held) and what to add to it */
    int kind, op;
    long long stid, dnid;
    PyObject *a;
    long long add_d, add_n;
    /* the last directory looked up, and its tag */
    char dir[256 + 2];
    Py_ssize_t dl;
    int dok; /* dir holds a looked-up directory; dnid_l/daux_l its tag, has_tag: it has one */
    int has_tag;
    long long dnid_l, daux_l;
};

static int set_ll(PyObject *list, Py_ssize_t i, long long v) {
    PyObject *o = PyLong_FromLongLong(v);
    if (!o) return -1;
    PyList_SetItem(list, i, o);
    return 0;
}

/* The last thread's window back into its list in rate. */
static int flush_w(struct hot *h) {
    int bad = 0;
    if (h->w) {
        bad = set_ll(h->w, 0, h->w0) < 0 || set_ll(h->w, 1, h->cnt) < 0;
        Py_CLEAR(h->w);
    }
    return bad ? -1 : 0;
}

/* What the last sum gathered back into its list in msum. */
static int flush_a(struct hot *h) {
    int bad = 0;
    if (h->a) {
        if (h->add_n) {
            long long d = as_ll(PyList_GET_ITEM(h->a, 1)) + h->add_d, n = as_ll(PyList_GET_ITEM(h->a, 2)) + h->add_n;
            bad = PyErr_Occurred() != NULL || set_ll(h->a, 1, d) < 0 || set_ll(h->a, 2, n) < 0;
        }
        Py_CLEAR(h->a);
    }
    h->add_d = h->add_n = 0;
    return bad ? -1 : 0;
}

static int hot_flush(struct hot *h) {
    int bad = flush_w(h) < 0;
    bad |= flush_a(h) < 0;
    return bad ? -1 : 0;
}

/* 1 when the call was summed, 0 when it is to be a row, -1 on an error. */
static int hot_sum(struct hot *h, long long tid, int kind, int op, int64_t t0, int64_t d, const char *path,
                   Py_ssize_t plen) {
    if (!h->w || tid != h->tid) {
        if (flush_w(h) < 0) return -1;
        PyObject *tk = PyLong_FromLongLong(tid);
        if (!tk) return -1;
        PyObject *w = PyDict_GetItemWithError(h->rate, tk);
        if (!w) {
            if (PyErr_Occurred() || !(w = Py_BuildValue("[Li]", (long long)t0, 0)) || PyDict_SetItem(h->rate, tk, w) < 0) {
                Py_XDECREF(w);
                Py_DECREF(tk);
                return -1;
            }
        } else {
            Py_INCREF(w);
        }
        Py_DECREF(tk);
        if (!PyList_Check(w) || PyList_GET_SIZE(w) != 2) {
            Py_DECREF(w);
            PyErr_SetString(PyExc_TypeError, "convert: a rate is a list of 2");
            return -1;
        }
        h->w0 = as_ll(PyList_GET_ITEM(w, 0));
        h->cnt = as_ll(PyList_GET_ITEM(w, 1));
        h->w = w;
        h->tid = tid;
        if (PyErr_Occurred()) return -1;
    }
    if (t0 - h->w0 >= h->win) { /* its window is over: a new one starts here */
        h->w0 = t0;
        h->cnt = 0;
    }
    if (++h->cnt <= h->calls) return 0;
    /* the directory: the path up to its last slash, and its tag (the path "<dir>/" + "*") */
    Py_ssize_t k = plen;
    while (k > 0 && path[k - 1] != '/') k--;
    Py_ssize_t dl = k > 0 ? k - 1 : 0;
    if (!h->dok || dl != h->dl || memcmp(path, h->dir, (size_t)dl) != 0) {
        memcpy(h->dir, path, (size_t)dl);
        memcpy(h->dir + dl, "/*", 2);
        h->dl = dl;
        h->dok = 0;
        PyObject *dk = PyBytes_FromStringAndSize(h->dir, dl + 2);
        if (!dk) return -1;
        PyObject *dtag = PyDict_GetItemWithError(h->paths, dk);
        if (dtag) Py_INCREF(dtag);
        else if (PyErr_Occurred() || !(dtag = PyObject_CallOneArg(h->tag_of, dk))) { Py_DECREF(dk); return -1; }
        Py_DECREF(dk);
        h->has_tag = PyTuple_Check(dtag) && PyTuple_GET_SIZE(dtag) >= 2;
        if (h->has_tag) {
            h->dnid_l = as_ll(PyTuple_GET_ITEM(dtag, 0));
            h->daux_l = as_ll(PyTuple_GET_ITEM(dtag, 1));
        }
        Py_DECREF(dtag);
        if (PyErr_Occurred()) return -1;
        h->dok = 1;
    }
    if (!h->has_tag) return 0;
    if (h->a && kind == h->kind && op == h->op && tid == h->stid && h->dnid_l == h->dnid) {
        h->add_d += d;
        h->add_n += 1;
        return 1;
    }
    if (flush_a(h) < 0) return -1;
    PyObject *key = Py_BuildValue("(iLLi)", kind, h->dnid_l, tid, op);
    if (!key) return -1;
    PyObject *a = PyDict_GetItemWithError(h->msum, key);
    if (!a) {
        if (PyErr_Occurred() || !(a = Py_BuildValue("[LLiL]", (long long)t0, (long long)d, 1, h->daux_l)) ||
            PyDict_SetItem(h->msum, key, a) < 0) {
            Py_XDECREF(a);
            Py_DECREF(key);
            return -1;
        }
    } else {
        Py_INCREF(a);
        if (!PyList_Check(a) || PyList_GET_SIZE(a) != 4) {
            Py_DECREF(a);
            Py_DECREF(key);
            PyErr_SetString(PyExc_TypeError, "convert: a metadata sum is a list of 4");
            return -1;
        }
        h->add_d = d;
        h->add_n = 1;
    }
    Py_DECREF(key);
    h->a = a;
    h->kind = kind;
    h->op = op;
    h->stid = tid;
    h->dnid = h->dnid_l;
    return 1;
}

/* The recorder thread id of OS thread ostid (the drainer's tids, else its _tid_of), cached in
 * *last_os / *last_tid; -1 on an error. */
static long long tid_for(PyObject *tids, PyObject *tid_of, long long ostid, long long *last_os, long long *last_tid) {
    if (ostid == *last_os) return *last_tid;
    PyObject *k = PyLong_FromLongLong(ostid), *v;
    if (!k) return -1;
    v = PyDict_GetItemWithError(tids, k);
    if (v) Py_INCREF(v);
    else if (PyErr_Occurred() || !(v = PyObject_CallOneArg(tid_of, k))) { Py_DECREF(k); return -1; }
    Py_DECREF(k);
    long long tid = as_ll(v);
    Py_DECREF(v);
    if (tid == -1 && PyErr_Occurred()) return -1;
    *last_os = ostid;
    *last_tid = tid;
    return tid;
}

/* The last open, held in C while its thread's next slot may come (most often the next slot
 * at all: open, then its reads), instead of a list in ``pend``: it goes into ``pend`` (the
 * Python loop's state) when another thread's open comes and at the batch's end. It is always
 * the batch's latest open, so ``pend`` keeps the Python loop's order. */
struct held {
    int on;
    long long t0, t1, kind, nid, cid, aux, site, tid;
    double err;
};

static int held_to_pend(struct held *h, PyObject *pend) {
    if (!h->on) return 0;
    h->on = 0;
    PyObject *tk = PyLong_FromLongLong(h->tid);
    PyObject *l = tk ? Py_BuildValue("[LLiLLiLiLd]", h->t0, h->t1, (int)h->kind, h->nid, h->cid, 0, h->aux,
                                     (int)h->site, h->tid, h->err) : NULL;
    int bad = !l || PyDict_SetItem(pend, tk, l) < 0;
    Py_XDECREF(l);
    Py_XDECREF(tk);
    return bad ? -1 : 0;
}

/* The last small read/write sum touched, held in C while the same (kind, file, thread) goes on
 * (a thread's reads of one file come in runs), instead of three new ints in its list in ``acc``
 * a call: ``list`` is its list in ``acc`` (a reference held), or NULL for a sum begun while
 * held. It goes back into ``acc`` (in place, or as a new list at the end: it is the latest
 * begun, so ``acc`` keeps the Python loop's order) when another sum is touched, before a
 * close flushes sums, and at the batch's end. */
struct sum {
    int on;
    long long kind, nid, tid;
    PyObject *list;
    long long t0, d, nb, calls, aux, cid, site;
};

static int sum_to_acc(struct sum *h, PyObject *acc) {
    if (!h->on) return 0;
    h->on = 0;
    int bad;
    if (h->list) {
        bad = set_ll(h->list, 1, h->d) < 0 || set_ll(h->list, 2, h->nb) < 0 || set_ll(h->list, 3, h->calls) < 0;
        Py_CLEAR(h->list);
        return bad ? -1 : 0;
    }
    PyObject *key = Py_BuildValue("(iLL)", (int)h->kind, h->nid, h->tid);
    PyObject *l = key ? Py_BuildValue("[LLLiLLi]", h->t0, h->d, h->nb, (int)h->calls, h->aux, h->cid, (int)h->site) : NULL;
    bad = !l || PyDict_SetItem(acc, key, l) < 0;
    Py_XDECREF(l);
    Py_XDECREF(key);
    return bad ? -1 : 0;
}

/* The held sum passed a limit: out of ``acc`` (if it was there) and a row, named with the
 * slot's ``aux`` as the Python loop names it. */
static int sum_emit(struct sum *h, struct conv *c, PyObject *acc, long long aux) {
    h->on = 0;
    if (h->list) {
        Py_CLEAR(h->list);
        PyObject *key = Py_BuildValue("(iLL)", (int)h->kind, h->nid, h->tid);
        int bad = !key || PyDict_DelItem(acc, key) < 0;
        Py_XDECREF(key);
        if (bad) return -1;
    }
    return put_row(c, h->t0, h->t0 + h->d, (int)h->kind, h->nid, h->cid, h->nb, aux, h->site, h->tid,
                   (double)h->calls, sum_seq(h->calls));
}

/* The fstat/lseek calls the interposer folded into the thread's open (slot.fold_t1): its
 * pending open, if this batch holds it, ends at fold. 0, or -1 on an error. */
static int fold_into(PyObject *pend, struct held *h, PyObject *tids, PyObject *tid_of, long long ostid, long long fold,
                     long long *last_os, long long *last_tid) {
    long long tid = tid_for(tids, tid_of, ostid, last_os, last_tid);
    if (tid == -1 && PyErr_Occurred()) return -1;
    if (h->on && h->tid == tid) {
        if (fold > h->t1) h->t1 = fold;
        return 0;
    }
    PyObject *tk = PyLong_FromLongLong(tid);
    if (!tk) return -1;
    PyObject *po = PyDict_GetItemWithError(pend, tk);
    Py_DECREF(tk);
    if (!po) return PyErr_Occurred() ? -1 : 0;
    if (!PyList_Check(po) || PyList_GET_SIZE(po) != 10) {
        PyErr_SetString(PyExc_TypeError, "convert: a pending open is a list of 10");
        return -1;
    }
    long long t1 = as_ll(PyList_GET_ITEM(po, 1));
    if (t1 == -1 && PyErr_Occurred()) return -1;
    return fold > t1 ? set_ll(po, 1, fold) : 0;
}

/* A close flushes its file's sums (Drainer._take_sums, without a Python call a close): each
 * acc entry (kind, name_id, tid) -> [t0, ns, bytes, calls, aux, comm_id, site] of that file,
 * in the dict's order, a row, and out of acc. 0, or -1 on an error. */
static int take_sums_c(struct conv *c, PyObject *acc, long long name_id) {
    PyObject *hit[8], **keys = hit;
    Py_ssize_t nk = 0, cap = 8, pos = 0;
    PyObject *key, *a;
    int bad = 0;
    while (PyDict_Next(acc, &pos, &key, &a)) {
        if (!PyTuple_Check(key) || PyTuple_GET_SIZE(key) != 3) continue;
        long long nid = as_ll(PyTuple_GET_ITEM(key, 1));
        if (nid == -1 && PyErr_Occurred()) { bad = 1; break; }
        if (nid != name_id) continue;
        if (!PyList_Check(a) || PyList_GET_SIZE(a) != 7) {
            PyErr_SetString(PyExc_TypeError, "convert: a sum is a list of 7");
            bad = 1;
            break;
        }
        long long v[7];
        for (int i = 0; i < 7; i++) v[i] = as_ll(PyList_GET_ITEM(a, i));
        long long kind = as_ll(PyTuple_GET_ITEM(key, 0)), tid = as_ll(PyTuple_GET_ITEM(key, 2));
        if (PyErr_Occurred() || put_row(c, v[0], v[0] + v[1], (int)kind, name_id, v[5], v[2], v[4], v[6], tid,
                                        (double)v[3], sum_seq(v[3])) < 0) {
            bad = 1;
            break;
        }
        if (nk == cap) { /* more than 8 sums of one file (threads): a bigger list */
            PyObject **more = PyMem_Malloc(sizeof(PyObject *) * (size_t)cap * 2);
            if (!more) { PyErr_NoMemory(); bad = 1; break; }
            memcpy(more, keys, sizeof(PyObject *) * (size_t)nk);
            if (keys != hit) PyMem_Free(keys);
            keys = more;
            cap *= 2;
        }
        Py_INCREF(key);
        keys[nk++] = key;
    }
    for (Py_ssize_t i = 0; i < nk; i++) { /* after the walk: a dict is not changed while walked */
        if (!bad && PyDict_DelItem(acc, keys[i]) < 0) bad = 1;
        Py_DECREF(keys[i]);
    }
    if (keys != hit) PyMem_Free(keys);
    return bad ? -1 : 0;
}

static PyObject *b_convert(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer sb, rb;
    Py_ssize_t n;
    PyObject *st, *pend, *shim;
    if (!PyArg_ParseTuple(args, "y*nw*OO!O", &sb, &n, &rb, &st, &PyDict_Type, &pend, &shim)) return NULL;
    PyObject *ops = NULL, *paths = NULL, *tids = NULL, *acc = NULL, *op_ids = NULL, *shimf = NULL;
    PyObject *tag_of = NULL, *tid_of = NULL, *res = NULL, *rate = NULL, *msum = NULL;
    struct hot hs;
    memset(&hs, 0, sizeof hs);
    struct held held;
    memset(&held, 0, sizeof held);
    struct sum sum;
    memset(&sum, 0, sizeof sum);
    struct conv c = {(unsigned char *)rb.buf, rb.len / ROW, 0};
    long long opid[NOPS_MAX];
    int nops;
    long long shim_tid[64];
    Py_ssize_t nshim = 0;
    long long big_b, big_ns, close_min;
    /* the last path and thread seen: most slots repeat them */
    PyObject *last_p = NULL, *last_tag = NULL;
    long long last_os = -1, last_tid = -1;

    if (n < 0 || n * (Py_ssize_t)(SLOT_HDR + 256) > sb.len) {
        PyErr_SetString(PyExc_ValueError, "convert: n is more than the slots buffer holds");
        goto done;
    }
    if (!(ops = attr(st, "ops_table")) || !(paths = attr(st, "paths")) || !(tids = attr(st, "tids")) ||
        !(acc = attr(st, "acc")) || !(op_ids = attr(st, "op_ids")) || !(tag_of = attr(st, "_tag_of")) ||
        !(tid_of = attr(st, "_tid_of")) || !(rate = attr(st, "rate")) ||
        !(msum = attr(st, "msum")))
        goto done;
    if (!PyBytes_Check(ops) || !PyDict_Check(paths) || !PyDict_Check(tids) || !PyDict_Check(acc) ||
        !PyDict_Check(rate) || !PyDict_Check(msum)) {
        PyErr_SetString(PyExc_TypeError, "convert: ops_table bytes, paths/tids/acc/rate/msum dicts");
        goto done;
    }
    nops = (int)(PyBytes_GET_SIZE(ops) / 3);
    if (nops > NOPS_MAX) nops = NOPS_MAX;
    {
        PyObject *f = PySequence_Fast(op_ids, "op_ids");
        if (!f) goto done;
        Py_ssize_t k = PySequence_Fast_GET_SIZE(f);
        for (int i = 0; i < nops; i++) opid[i] = i < k ? as_ll(PySequence_Fast_GET_ITEM(f, i)) : 0;
        Py_DECREF(f);
        if (PyErr_Occurred()) goto done;
    }
    if (!(shimf = PySequence_Fast(shim, "shim_tids"))) goto done;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(shimf) && nshim < 64; i++)
        shim_tid[nshim++] = as_ll(PySequence_Fast_GET_ITEM(shimf, i));
    {
        PyObject *o;
        if (!(o = attr(st, "big_bytes"))) goto done;
        big_b = as_ll(o); Py_DECREF(o);
        if (!(o = attr(st, "big_ns"))) goto done;
        big_ns = as_ll(o); Py_DECREF(o);
        if (!(o = attr(st, "close_min_ns"))) goto done;
        close_min = as_ll(o); Py_DECREF(o);
        if (!(o = attr(st, "hot_calls"))) goto done;
        hs.calls = as_ll(o); Py_DECREF(o);
        if (!(o = attr(st, "hot_window_ns"))) goto done;
        hs.win = as_ll(o); Py_DECREF(o);
        hs.rate = rate; hs.msum = msum; hs.paths = paths; hs.tag_of = tag_of;
        if (PyErr_Occurred()) goto done;
    }
    if (c.cap < 2 * n + PyDict_GET_SIZE(acc) + 1) {
        PyErr_SetString(PyExc_ValueError, "convert: the rows buffer is too small");
        goto done;
    }
    const unsigned char *opt = (const unsigned char *)PyBytes_AS_STRING(ops);
    for (Py_ssize_t i = 0; i < n; i++) {
        const unsigned char *s = (const unsigned char *)sb.buf + i * (SLOT_HDR + 256);
        int64_t t0, t1, nb;
        int32_t op, err, ostid, site;
        uint16_t plen;
        memcpy(&t0, s + 8, 8);
        memcpy(&t1, s + 16, 8);
        memcpy(&nb, s + 24, 8);
        memcpy(&op, s + 32, 4);
        memcpy(&err, s + 36, 4);
        memcpy(&ostid, s + 44, 4);
        memcpy(&plen, s + 48, 2);
        memcpy(&site, s + 52, 4);
        int64_t fold;
        memcpy(&fold, s + 56, 8);
        if (op < 0 || op >= nops || opt[3 * op + 1] == 255) continue;
        int is_shim = 0;
        for (Py_ssize_t k = 0; k < nshim; k++) if (shim_tid[k] == ostid) { is_shim = 1; break; }
        if (is_shim) continue;
        if (fold > 0 && fold_into(pend, &held, tids, tid_of, ostid, fold, &last_os, &last_tid) < 0) goto done;
        int kind = opt[3 * op], mode = opt[3 * op + 1], flags = opt[3 * op + 2];
        if (plen > 256) plen = 256;
        /* the path's tag: (name_id, aux), or () when it is not recorded */
        PyObject *tag;
        if (last_p && (Py_ssize_t)plen == PyBytes_GET_SIZE(last_p) &&
            memcmp(PyBytes_AS_STRING(last_p), s + SLOT_HDR, plen) == 0) {
            tag = last_tag;
        } else {
            PyObject *p = PyBytes_FromStringAndSize((const char *)s + SLOT_HDR, plen);
            if (!p) goto done;
            tag = PyDict_GetItemWithError(paths, p);
            if (tag) Py_INCREF(tag);
            else if (PyErr_Occurred() || !(tag = PyObject_CallOneArg(tag_of, p))) { Py_DECREF(p); goto done; }
            Py_XSETREF(last_p, p);
            Py_XSETREF(last_tag, tag);
        }
        if (!PyTuple_Check(tag) || PyTuple_GET_SIZE(tag) < 2) continue;
        long long name_id = as_ll(PyTuple_GET_ITEM(tag, 0)), aux = as_ll(PyTuple_GET_ITEM(tag, 1));
        if (PyErr_Occurred()) goto done;
        long long tid = tid_for(tids, tid_of, ostid, &last_os, &last_tid);
        if (tid == -1 && PyErr_Occurred()) goto done;
        if (held.on && held.tid == tid) { /* the thread's held open: its row, before this slot's */
            held.on = 0;
            if (put_row(&c, held.t0, held.t1, (int)held.kind, held.nid, held.cid, 0, held.aux, held.site, held.tid,
                        held.err, -1) < 0)
                goto done;
            if (flags & 1) goto hold;
            goto after_pend;
        }
        if ((flags & 1) && held_to_pend(&held, pend) < 0) goto done; /* another thread's, into pend */
        PyObject *tk = PyLong_FromLongLong(tid);
        if (!tk) goto done;
        PyObject *po = PyDict_GetItemWithError(pend, tk);
        if (!po && PyErr_Occurred()) { Py_DECREF(tk); goto done; }
        if (po) {
            if (!PyList_Check(po) || PyList_GET_SIZE(po) != 10) {
                Py_DECREF(tk);
                PyErr_SetString(PyExc_TypeError, "convert: a pending open is a list of 10");
                goto done;
            }
            /* (an fstat/lseek on the open's own descriptor never comes here: the interposer folded
             * it, fold_t1 above; one on another descriptor of the same file is a call of its own) */
            Py_INCREF(po);
            if (PyDict_DelItem(pend, tk) < 0 || put_seq(&c, po) < 0) { Py_DECREF(po); Py_DECREF(tk); goto done; }
            Py_DECREF(po);
        }
        Py_DECREF(tk);
        if (flags & 1) {
        hold:
            held.on = 1;
            held.t0 = t0; held.t1 = t1; held.kind = kind; held.nid = name_id; held.cid = opid[op];
            held.aux = aux; held.site = site; held.tid = tid; held.err = (double)err;
            continue;
        }
    after_pend:
        if (mode == 1) {
            int64_t d = t1 - t0;
            if (nb >= big_b || d >= big_ns) {
                if (put_row(&c, t0, t1, kind, name_id, opid[op], nb, aux, site, tid, 1.0, -1) < 0) goto done;
                continue;
            }
            if (sum.on && sum.kind == kind && sum.nid == name_id && sum.tid == tid) { /* the held sum */
                sum.d += d;
                sum.nb += nb;
                sum.calls += 1;
                if (sum.nb < big_b && sum.d < big_ns) continue;
                if (sum_emit(&sum, &c, acc, aux) < 0) goto done;
                continue;
            }
            if (sum_to_acc(&sum, acc) < 0) goto done;
            PyObject *key = Py_BuildValue("(iLL)", kind, name_id, tid);
            if (!key) goto done;
            PyObject *a = PyDict_GetItemWithError(acc, key);
            if (a && (!PyList_Check(a) || PyList_GET_SIZE(a) != 7)) {
                Py_DECREF(key);
                PyErr_SetString(PyExc_TypeError, "convert: a sum is a list of 7");
                goto done;
            }
            if (!a && PyErr_Occurred()) { Py_DECREF(key); goto done; }
            sum.kind = kind; sum.nid = name_id; sum.tid = tid;
            if (!a) { /* a new sum, held */
                sum.list = NULL;
                sum.t0 = t0; sum.d = d; sum.nb = nb; sum.calls = 1; sum.aux = aux; sum.cid = opid[op]; sum.site = site;
                Py_DECREF(key);
                sum.on = 1;
                continue;
            }
            Py_INCREF(a); /* held: its values in C until it goes back (sum_to_acc) or out (sum_emit) */
            sum.list = a;
            sum.t0 = as_ll(PyList_GET_ITEM(a, 0));
            sum.d = as_ll(PyList_GET_ITEM(a, 1)) + d;
            sum.nb = as_ll(PyList_GET_ITEM(a, 2)) + nb;
            sum.calls = as_ll(PyList_GET_ITEM(a, 3)) + 1;
            sum.aux = as_ll(PyList_GET_ITEM(a, 4));
            sum.cid = as_ll(PyList_GET_ITEM(a, 5));
            sum.site = as_ll(PyList_GET_ITEM(a, 6));
            Py_DECREF(key);
            sum.on = 1;
            if (PyErr_Occurred()) goto done;
            if (sum.nb < big_b && sum.d < big_ns) continue;
            if (sum_emit(&sum, &c, acc, aux) < 0) goto done;
        } else if (mode == 0) {
            if ((flags & 4) && t1 - t0 < big_ns) {
                int h = hot_sum(&hs, tid, kind, op, t0, t1 - t0, (const char *)s + SLOT_HDR, plen);
                if (h < 0) goto done;
                if (h) continue;
            }
            if (put_row(&c, t0, t1, kind, name_id, opid[op], 0, aux, site, tid, (double)err, -1) < 0) goto done;
        } else {
            if (mode == 3 && sum_to_acc(&sum, acc) < 0) goto done;
            if (mode == 3 && PyDict_GET_SIZE(acc) && take_sums_c(&c, acc, name_id) < 0) goto done;
            if (t1 - t0 >= close_min)
                if (put_row(&c, t0, t1, kind, name_id, opid[op], 0, aux, site, tid, (double)err, -1) < 0) goto done;
        }
    }
    if (hot_flush(&hs) < 0) goto done;
    if (held_to_pend(&held, pend) < 0 || sum_to_acc(&sum, acc) < 0) goto done;
    res = PyLong_FromSsize_t(c.n);
done:
    Py_XDECREF(sum.list);
    Py_XDECREF(hs.w);
    Py_XDECREF(hs.a);
    Py_XDECREF(last_p);
    Py_XDECREF(last_tag);
    Py_XDECREF(ops); Py_XDECREF(paths); Py_XDECREF(tids); Py_XDECREF(acc); Py_XDECREF(op_ids);
    Py_XDECREF(shimf); Py_XDECREF(tag_of); Py_XDECREF(tid_of);
    Py_XDECREF(rate); Py_XDECREF(msum);
    PyBuffer_Release(&sb);
    PyBuffer_Release(&rb);
    return res;
}

static PyMethodDef methods[] = {
    {"available", b_available, METH_NOARGS, "The interposer is loaded in this process."},
    {"version", b_version, METH_NOARGS, "(version, slot size) of the loaded interposer."},
    {"start", b_start, METH_VARARGS, "start(nslots, skip_prefix: bytes | None) -> ring slots (< 0: failed)."},
    {"stop", b_stop, METH_NOARGS, "Stop recording."},
    {"mute", b_mute, METH_VARARGS, "mute(on): the calling thread's calls are (not) recorded."},
    {"drain", b_drain, METH_VARARGS, "drain(writable buffer, max slots) -> slots copied."},
    {"overflow", b_overflow, METH_VARARGS, "overflow(writable buffer, max records) -> the overflow sums taken."},
    {"wait", b_wait, METH_VARARGS, "wait(ms): sleep (GIL released) until the ring is half full, kick() or ms."},
    {"kick", b_kick, METH_NOARGS, "Wake a wait()."},
    {"loaded_ns", b_loaded_ns, METH_NOARGS, "perf_counter_ns when the interposer was loaded (the process's start), or None."},
    {"site", (PyCFunction)(void (*)(void))b_site, METH_FASTCALL, "site(site_id, path): the calling thread's next libc call on path is from that call site."},
    {"convert", b_convert, METH_VARARGS, "convert(slots, n, rows, drainer, pend, shim_tids) -> event rows written."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_binding", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__binding(void) { return PyModule_Create(&module); }
