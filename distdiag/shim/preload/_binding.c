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
static unsigned long (*p_lost)(void);
static void (*p_wait)(long);
static void (*p_kick)(void);
static int resolved = -1;

static int resolve(void) {
    if (resolved >= 0) return resolved;
    *(void **)&p_version = dlsym(RTLD_DEFAULT, "dd_version");
    *(void **)&p_slot_size = dlsym(RTLD_DEFAULT, "dd_slot_size");
    *(void **)&p_start = dlsym(RTLD_DEFAULT, "dd_start");
    *(void **)&p_stop = dlsym(RTLD_DEFAULT, "dd_stop");
    *(void **)&p_mute = dlsym(RTLD_DEFAULT, "dd_mute");
    *(void **)&p_drain = dlsym(RTLD_DEFAULT, "dd_drain");
    *(void **)&p_lost = dlsym(RTLD_DEFAULT, "dd_lost");
    *(void **)&p_wait = dlsym(RTLD_DEFAULT, "dd_wait");
    *(void **)&p_kick = dlsym(RTLD_DEFAULT, "dd_kick");
    resolved = p_version && p_slot_size && p_start && p_stop && p_mute && p_drain && p_lost && p_wait && p_kick;
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

static PyObject *b_drain(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer buf;
    long max;
    if (!PyArg_ParseTuple(args, "w*l", &buf, &max)) return NULL;
    if (!resolve()) {
        PyBuffer_Release(&buf);
        PyErr_SetString(PyExc_RuntimeError, "the interposer is not loaded");
        return NULL;
    }
    long slot = p_slot_size();
    if (max < 0 || max * slot > buf.len) max = (long)(buf.len / slot);
    long n = p_drain(buf.buf, max);
    PyBuffer_Release(&buf);
    return PyLong_FromLong(n);
}

static PyObject *b_lost(PyObject *self, PyObject *args) {
    (void)self; (void)args; NEED();
    return PyLong_FromUnsignedLong(p_lost());
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

static PyObject *b_kick(PyObject *self, PyObject *args) {
    (void)self; (void)args; NEED();
    p_kick();
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"available", b_available, METH_NOARGS, "The interposer is loaded in this process."},
    {"version", b_version, METH_NOARGS, "(version, slot size) of the loaded interposer."},
    {"start", b_start, METH_VARARGS, "start(nslots, skip_prefix: bytes | None) -> ring slots (< 0: failed)."},
    {"stop", b_stop, METH_NOARGS, "Stop recording."},
    {"mute", b_mute, METH_VARARGS, "mute(on): the calling thread's calls are (not) recorded."},
    {"drain", b_drain, METH_VARARGS, "drain(writable buffer, max slots) -> slots copied."},
    {"lost", b_lost, METH_NOARGS, "Calls dropped because the ring was full."},
    {"wait", b_wait, METH_VARARGS, "wait(ms): sleep (GIL released) until the ring is half full, kick() or ms."},
    {"kick", b_kick, METH_NOARGS, "Wake a wait()."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_binding", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__binding(void) { return PyModule_Create(&module); }
