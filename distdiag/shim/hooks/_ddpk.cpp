// distdiag.shim.hooks._ddpk: DDP's gradient buckets on CPU, recorded by a C++ kernel.
//
// What it does is what torch_dist._allreduce_kernel does in Python (read that
// docstring first): a kernel for ``c10d::allreduce_`` at the AutogradCPU key
// that launches the real all-reduce (a redispatch below autograd) and, when
// the call is a bucket of a watched DDP, records its row: t0 at the launch,
// t1 in a completion callback on the Work's future. Why C++: a Python kernel
// costs the dispatcher a boxing of every argument into Python objects and
// back, and the callback a Python thread state on gloo's thread; together
// ~50-70 us a bucket on the 2-core test machine (benchmarks/NOTES.md), which
// is several per cent of a short CPU step. Here a bucket costs a few
// microseconds and no Python at all, but for the program's source line, which
// is looked up once per backward pass (the GIL, a frame walk in Python).
//
// The rows are the recorder's 69-byte rows (schema.EVENT_SPEC), kept in a
// bounded list here until the recorder's drain takes them (torch_dist._feed,
// under the lock of the shared callback buffer): no Python object is made on
// the backward or on gloo's threads. Rows that find the list full are counted
// and come back as lost rows (the analyzer says so), never silently.
//
// Built only where torch's headers are at build time (setup.py); used only by
// the torch whose version it was built against (DDPK_TORCH_VERSION, from setup.py).

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/library.h>

#include <pthread.h>
#include <time.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <new>
#include <vector>

namespace {

#pragma pack(push, 1)
struct Row {  // schema.EVENT_SPEC, little-endian, packed: 69 bytes
  int64_t t0, t1;
  uint8_t kind;
  int32_t name_id, comm_id;
  int64_t seq;
  int32_t peer;
  int64_t nbytes, aux;
  int32_t site_id, tid;
  double value;
};
#pragma pack(pop)
static_assert(sizeof(Row) == 69, "a row is schema.EVENT_SPEC");

constexpr int kSlots = 16;          // watched process groups (one kernel-recorded DDP each)
size_t max_rows = 1 << 16;  // completed rows held between two drains (~4.5 MB); set_limit
constexpr int kDtypes = 64;         // c10::ScalarType values with an interned name

struct Slot {
  c10d::ProcessGroup* pg = nullptr;  // identity; `alive` says it is still that group
  c10::weak_intrusive_ptr<c10d::ProcessGroup> alive{c10::weak_intrusive_ptr<c10d::ProcessGroup>(
      c10::intrusive_ptr<c10d::ProcessGroup>())};
  int32_t comm_id = 0, name_id = 0;
  int64_t seq = 0;
  int64_t gen = 0;  // watches of this slot so far: a handle names one of them
  bool on = false;
};

// Everything below is guarded by `mu` but `n_on` (read without it first).
std::mutex* mu = new std::mutex;  // never destroyed: gloo threads may call back during exit
Slot slots[kSlots];
std::atomic<int> n_on{0};
std::vector<Row>* done = new std::vector<Row>;
uint64_t dropped = 0;
int64_t dtype_ids[kDtypes];
uint8_t kind_coll_async = 0;
PyObject* site_fn = nullptr;  // () -> int: the program's line below the backward call
// The registration of the kernel while installed. A plain pointer, never freed at exit: no
// static destructor of ours runs against torch's dispatcher while the process ends.
torch::Library* lib = nullptr;

thread_local int busy = 0;      // inside a recorded Python call (torch_dist._tls.busy)
thread_local int in_join = 0;   // inside DDP's join hook (torch_dist._tls.ddp_join)
thread_local int64_t site_task = -2;  // the graph task whose site `site` is
thread_local int32_t site = 0;

inline int64_t now_ns() {  // time.perf_counter_ns on Linux
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

int32_t program_site(int64_t task) {
  // One frame walk per backward pass (per join-hook call): the same line for every bucket.
  if (task >= 0 && task == site_task) return site;
  int32_t s = 0;
#if PY_VERSION_HEX >= 0x030D0000
  const bool finalizing = Py_IsFinalizing();
#else
  const bool finalizing = _Py_IsFinalizing();
#endif
  if (site_fn != nullptr && Py_IsInitialized() && !finalizing) {
    PyGILState_STATE g = PyGILState_Ensure();
    PyObject* r = PyObject_CallNoArgs(site_fn);
    if (r != nullptr) {
      long v = PyLong_AsLong(r);
      s = (v == -1 && PyErr_Occurred()) ? 0 : int32_t(v);
      Py_DECREF(r);
    }
    PyErr_Clear();
    PyGILState_Release(g);
  }
  site_task = task;
  site = s;
  return s;
}

void push(const Row& r) {
  std::lock_guard<std::mutex> g(*mu);
  if (done->size() >= max_rows) {
    ++dropped;
    return;
  }
  done->push_back(r);
}

void kernel(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  // arguments: tensors, process_group, reduce_op, sparse_indices, async_op, timeout
  const int64_t t0 = now_ns();
  const size_t base = stack->size() - 6;
  const bool look = n_on.load(std::memory_order_relaxed) > 0 && busy == 0;
  c10::IValue tensors, pgv;
  if (look) {
    tensors = (*stack)[base];
    pgv = (*stack)[base + 1];
  }
  op.redispatchBoxed(ks & c10::after_autograd_keyset, stack);
  if (!look) return;
  try {
    const int64_t task = torch::autograd::get_current_graph_task_id();
    if (task < 0 && in_join == 0) return;  // not DDP's backward or its join hook
    auto pg = pgv.toCustomClass<c10d::ProcessGroup>();
    Row r{};
    {
      std::lock_guard<std::mutex> g(*mu);
      int i = 0;
      for (; i < kSlots; ++i)
        if (slots[i].on && slots[i].pg == pg.get() && !slots[i].alive.expired()) break;
      if (i == kSlots) return;
      auto list = tensors.toTensorList();
      if (list.size() == 0) return;
      const at::Tensor t = list.get(0);
      if (!t.is_floating_point()) return;  // the unused-parameter map is int32
      int st = int(t.scalar_type());
      r.t0 = t0;
      r.kind = kind_coll_async;
      r.name_id = slots[i].name_id;
      r.comm_id = slots[i].comm_id;
      r.seq = slots[i].seq++;
      r.peer = -1;
      r.nbytes = int64_t(t.nbytes());
      r.aux = (st >= 0 && st < kDtypes) ? dtype_ids[st] : 0;
    }
    r.site_id = program_site(task);
    auto work = stack->back().toCustomClass<c10d::Work>();
    work->getFuture()->addCallback(
        [r](c10::ivalue::Future&) mutable {
          r.t1 = now_ns();
          push(r);
        },
        /*uses_future=*/false);
  } catch (...) {
    // a row is not worth an error in the program's backward pass
  }
}

// -- ops: what Python hands over as torch objects --------------------------------------
// A handle (gen * kSlots + slot) names one watch: a late unwatch of an earlier DDP's
// handle never stops the recording of a later DDP that took the same slot.
int64_t watch(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, int64_t comm_id, int64_t name_id, int64_t seq,
              const std::vector<at::Tensor>& dtypes, std::vector<int64_t> ids) {
  std::lock_guard<std::mutex> g(*mu);
  for (size_t k = 0; k < dtypes.size() && k < ids.size(); ++k) {
    int st = int(dtypes[k].scalar_type());
    if (st >= 0 && st < kDtypes) dtype_ids[st] = ids[k];
  }
  int free = -1;
  for (int i = 0; i < kSlots; ++i) {
    bool live = slots[i].on && !slots[i].alive.expired();
    if (live && slots[i].pg == pg.get()) {  // one recorded DDP per group (torch_dist): the newest
      free = i;
      break;
    }
    if (!live && free < 0) free = i;
  }
  if (free < 0) return -1;
  Slot& s = slots[free];
  s.pg = pg.get();
  s.alive = c10::weak_intrusive_ptr<c10d::ProcessGroup>(pg);
  s.comm_id = int32_t(comm_id);
  s.name_id = int32_t(name_id);
  s.seq = seq;
  s.gen += 1;
  if (!s.on) n_on.fetch_add(1);
  s.on = true;
  return s.gen * kSlots + free;
}

int64_t unwatch(int64_t handle) {  // the next sequence number of that watch's bucket rows, or -1
  std::lock_guard<std::mutex> g(*mu);
  if (handle < 0) return -1;
  const int64_t i = handle % kSlots;
  if (!slots[i].on || slots[i].gen != handle / kSlots) return -1;
  slots[i].on = false;
  slots[i].pg = nullptr;
  slots[i].alive = c10::weak_intrusive_ptr<c10d::ProcessGroup>(c10::intrusive_ptr<c10d::ProcessGroup>());
  n_on.fetch_sub(1);
  return slots[i].seq;
}

TORCH_LIBRARY_FRAGMENT(distdiag, m) {
  m.def("watch(__torch__.torch.classes.c10d.ProcessGroup pg, int comm_id, int name_id, int seq, Tensor[] dtypes, "
        "int[] dtype_ids) -> int",
        &watch);
  m.def("unwatch(int handle) -> int", &unwatch);
}

void after_fork_in_child() {
  // The child has none of the parent's groups, and a gloo thread may have held `mu`
  // at the fork: a fresh lock and nothing watched, held or registered.
  mu = new (std::nothrow) std::mutex;
  for (auto& s : slots) {
    int64_t gen = s.gen;
    s = Slot();
    s.gen = gen;  // a handle from before the fork stays unmatched
  }
  n_on.store(0);
  done = new (std::nothrow) std::vector<Row>;
  dropped = 0;
  busy = in_join = 0;
  site_task = -2;
  lib = nullptr;  // the child's dispatcher entry stays (the kernel records nothing here)
}

// -- the module --------------------------------------------------------------------
PyObject* py_install(PyObject*, PyObject* args) {
  PyObject* fn;
  int kind;
  if (!PyArg_ParseTuple(args, "Oi", &fn, &kind)) return nullptr;
  if (!PyCallable_Check(fn)) {
    PyErr_SetString(PyExc_TypeError, "install(site_fn, kind): site_fn must be callable");
    return nullptr;
  }
  Py_INCREF(fn);
  Py_XSETREF(site_fn, fn);
  kind_coll_async = uint8_t(kind);
  if (lib == nullptr) {
    torch::Library* l = nullptr;
    try {
      l = new torch::Library(torch::Library::IMPL, "c10d", std::make_optional(c10::DispatchKey::AutogradCPU),
                             __FILE__, __LINE__);
      l->impl("allreduce_", torch::CppFunction::makeFromBoxedFunction<&kernel>());
    } catch (const std::exception& e) {
      delete l;
      PyErr_SetString(PyExc_RuntimeError, e.what());
      return nullptr;
    }
    lib = l;
  }
  Py_RETURN_NONE;
}

PyObject* py_uninstall(PyObject*, PyObject*) {
  delete lib;  // the Library's destructor takes the kernel off the dispatcher
  lib = nullptr;
  Py_CLEAR(site_fn);
  Py_RETURN_NONE;
}

PyObject* py_set_busy(PyObject*, PyObject* arg) {  // returns the old value
  int old = busy;
  busy = PyObject_IsTrue(arg);
  return PyBool_FromLong(old);
}

PyObject* py_set_join(PyObject*, PyObject* arg) {
  int old = in_join;
  in_join = PyObject_IsTrue(arg);
  return PyBool_FromLong(old);
}

PyObject* py_take(PyObject*, PyObject* args) {
  // take(buffer, byte offset, room in rows, tid) -> (rows copied, rows dropped since)
  Py_buffer b;
  Py_ssize_t off, room;
  int tid;
  if (!PyArg_ParseTuple(args, "w*nni", &b, &off, &room, &tid)) return nullptr;
  size_t k = 0;
  uint64_t lost = 0;
  if (off >= 0 && room > 0 && off + room * Py_ssize_t(sizeof(Row)) <= b.len) {
    std::lock_guard<std::mutex> g(*mu);
    k = std::min(done->size(), size_t(room));
    char* out = static_cast<char*>(b.buf) + off;
    for (size_t i = 0; i < k; ++i) {
      Row r = (*done)[i];
      r.tid = tid;
      std::memcpy(out + i * sizeof(Row), &r, sizeof(Row));
    }
    done->erase(done->begin(), done->begin() + k);
    lost = dropped;
    dropped = 0;
  }
  PyBuffer_Release(&b);
  return Py_BuildValue("nK", Py_ssize_t(k), (unsigned long long)lost);
}

PyObject* py_set_limit(PyObject*, PyObject* arg) {  // tests: a small list, to see what overflows
  Py_ssize_t n = PyLong_AsSsize_t(arg);
  if (n < 0) return nullptr;
  std::lock_guard<std::mutex> g(*mu);
  max_rows = size_t(n);
  Py_RETURN_NONE;
}

PyObject* py_pending(PyObject*, PyObject*) {
  std::lock_guard<std::mutex> g(*mu);
  return PyLong_FromSize_t(done->size());
}

PyMethodDef methods[] = {
    {"install", py_install, METH_VARARGS, "install(site_fn, kind): put the kernel on c10d::allreduce_ (AutogradCPU)"},
    {"uninstall", py_uninstall, METH_NOARGS, "take the kernel off"},
    {"set_busy", py_set_busy, METH_O, "this thread is inside a recorded call; returns the old flag"},
    {"set_join", py_set_join, METH_O, "this thread is inside DDP's join hook; returns the old flag"},
    {"take", py_take, METH_VARARGS, "take(buf, offset, room, tid) -> (rows, lost): completed rows into buf"},
    {"pending", py_pending, METH_NOARGS, "completed rows not yet taken"},
    {"set_limit", py_set_limit, METH_O, "how many completed rows are held until taken (default 65536)"},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_ddpk", "DDP bucket rows from a C++ allreduce kernel", -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit__ddpk(void) {
  PyObject* m = PyModule_Create(&module);
  if (m == nullptr) return nullptr;
  if (PyModule_AddStringConstant(m, "TORCH_VERSION", DDPK_TORCH_VERSION) < 0 ||
      PyModule_AddIntConstant(m, "ROW_SIZE", int(sizeof(Row))) < 0) {
    Py_DECREF(m);
    return nullptr;
  }
  static bool forked = false;
  if (!forked) {
    forked = true;
    pthread_atfork(nullptr, nullptr, after_fork_in_child);
  }
  return m;
}
