/* distdiag's LD_PRELOAD interposer for libc file calls (see __init__.py beside it).
 *
 * Loaded by the dynamic loader before the interpreter starts (distdiag-wrap re-executes
 * itself once with LD_PRELOAD set); inert until the shim calls dd_start(): until then, and
 * in every process that never calls it (the rank's exec'd children that are not wrapped),
 * each hooked call costs one load and a branch on top of libc's.
 *
 * Once started, every hooked call made on a path or on a descriptor this process opened
 * through a hooked call is one slot of a preallocated ring: start and end (CLOCK_MONOTONIC,
 * the clock of the recorder's perf_counter_ns), the call, bytes, errno, the OS thread and
 * the absolute path (the descriptor's path for fd calls). The Python side drains the ring
 * (dd_drain) into the recorder's rows from a thread that sleeps in dd_wait and is woken when
 * the ring is half full.
 *
 * The guest rules, as they are kept here:
 *  - errno: saved right after the real call, restored before returning.
 *  - no allocation in the hot path: the ring and the fd table are mapped once, in dd_start.
 *  - lock-free: a slot is reserved by a compare-and-swap on the head only while the ring has
 *    room (else the call is summed into the overflow table, below), filled, then published by
 *    its sequence word;
 *    nothing waits, so a signal handler that makes a file call cannot deadlock; the clock is
 *    the vDSO's clock_gettime and the wake is a raw futex syscall (both async-signal-safe).
 *  - re-entrancy: a per-thread guard; a call made while the thread is already inside a hook
 *    (a signal handler that interrupts one, a libc function that calls another) is passed on
 *    unrecorded. Per-thread `muted` is the shim's own threads (flusher, drainer).
 *  - fork: the child's ring drops what the parent had not drained yet (the parent drains it:
 *    the rows are the parent's), and so do its overflow sums; pthread_atfork's child handler.
 *  - the shim's own files: paths under the prefix given to dd_start (the run dir), /proc and
 *    /sys are never recorded and their descriptors never tracked.
 * Not seen: calls libc makes internally (fopen's open, readdir's getdents, stdio's reads
 * other than fread/fwrite), raw syscall(2), statically linked or setuid programs.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define API __attribute__((visibility("default")))
#define TLS __thread __attribute__((tls_model("initial-exec")))

/* -- the slot layout the Python side reads (keep in step with __init__.py) -- */
#define PATH_CAP 256
enum {
    OP_OPEN = 1, OP_CLOSE, OP_READ, OP_WRITE, OP_SEEK, OP_SYNC, OP_STAT, OP_FSTAT, OP_ACCESS,
    OP_LISTDIR, OP_READDIR, OP_MKDIR, OP_UNLINK, OP_RENAME, OP_MMAP, OP_FOPEN, OP_FREAD,
    OP_FWRITE, OP_LSTAT, OP_STATX, OP_GETDENTS, OP_RMDIR, OP_FCLOSE, OP_CLOSEDIR,
};
struct slot {
    _Atomic uint64_t seq; /* ticket + 1 once published */
    int64_t t0, t1, nbytes;
    int32_t op, err, fd, tid;
    uint16_t plen, flags; /* flags & 1: path truncated */
    int32_t site;         /* the Python call site's string id (dd_site), 0: none */
    int64_t fold_t1;      /* > 0: the thread's open before this slot lasted until then (fold_fd) */
    char path[PATH_CAP];
};
_Static_assert(sizeof(struct slot) == 64 + PATH_CAP, "slot layout");

/* -- state -------------------------------------------------------------------------- */
static volatile int dd_on;
static struct slot *ring;
static uint64_t cap, mask;
static _Atomic uint64_t head, tail;
static _Atomic uint32_t wakeword;
#define MAXFD 65536
static char (*fdpath)[PATH_CAP];   /* fd -> its absolute path; fdon[fd] says it is tracked */
static uint8_t *fdon;
static int32_t *fdsite;            /* fd -> the call site of its open (dd_site), 0: none */
static char skip[PATH_CAP];
static size_t skiplen;
static char cwd[PATH_CAP];
static size_t cwdlen;
static TLS int guard;
static TLS int muted;
/* The call site the Python side named for this thread's next call on site_path (dd_site: the
 * file hook's wrapper of open, os.scandir..., just before the call reaches libc), taken
 * by the thread's next recorded call on a path if it is that very path string and comes within
 * SITE_NS (a call that never reached libc, e.g. an opener that raised, leaves none for a later
 * one). rec_path returns the site its call took, which track gives the descriptor opened. */
#define SITE_NS 50000000 /* 50 ms of wall-clock: a loaded core preempts for a timeslice or more
                            * between the wrapper and the call (2 ms lost sites there) */
static TLS int32_t site_next;
static TLS int64_t site_t;
static TLS char site_path[PATH_CAP];
static TLS size_t site_plen;
/* The fstat/lseek calls a thread makes on the descriptor it just opened (Python's open() makes
 * two fstats and an lseek) are part of the open: the drainer folds them into the open's row
 * (its end moves to theirs). They are folded here instead, with no slot: fold_fd is the thread's
 * last recorded call's descriptor when that call was an open, and such a call only moves
 * fold_t1, which the thread's next slot carries (the drainer then moves its pending open's end). */
static TLS int fold_fd = -1;
static TLS int64_t fold_t1;

/* What every slot of this thread takes: the folded calls' end, if any; the fold chain ends. */
static inline int64_t fold_take(void) {
    int64_t f = fold_t1;
    fold_t1 = 0;
    fold_fd = -1;
    return f;
}

/* The site dd_site left for `path` (taken: the next call has none), else 0. One load and a
 * branch when none is left (every call but the few the Python side names). */
static inline int32_t site_take(const char *path, int64_t t0) {
    if (!site_next) return 0;
    int32_t s = 0;
    if (t0 - site_t < SITE_NS && path && strncmp(path, site_path, site_plen + 1) == 0) s = site_next;
    site_next = 0;
    return s;
}

/* -- the real functions ---------------------------------------------------------------- */
#define REAL(name) real_##name
#define DECL(ret, name, args) static ret(*real_##name) args
#define RESOLVE(name) \
    do { if (!real_##name) *(void **)&real_##name = dlsym(RTLD_NEXT, #name); } while (0)

DECL(int, open, (const char *, int, ...));
DECL(int, open64, (const char *, int, ...));
DECL(int, openat, (int, const char *, int, ...));
DECL(int, openat64, (int, const char *, int, ...));
DECL(int, __open_2, (const char *, int));
DECL(int, __open64_2, (const char *, int));
DECL(int, __openat_2, (int, const char *, int));
DECL(int, __openat64_2, (int, const char *, int));
DECL(int, creat, (const char *, mode_t));
DECL(int, creat64, (const char *, mode_t));
DECL(int, close, (int));
DECL(ssize_t, read, (int, void *, size_t));
DECL(ssize_t, pread, (int, void *, size_t, off_t));
DECL(ssize_t, pread64, (int, void *, size_t, off64_t));
DECL(ssize_t, readv, (int, const struct iovec *, int));
DECL(ssize_t, preadv, (int, const struct iovec *, int, off_t));
DECL(ssize_t, preadv64, (int, const struct iovec *, int, off64_t));
DECL(ssize_t, write, (int, const void *, size_t));
DECL(ssize_t, pwrite, (int, const void *, size_t, off_t));
DECL(ssize_t, pwrite64, (int, const void *, size_t, off64_t));
DECL(ssize_t, writev, (int, const struct iovec *, int));
DECL(ssize_t, pwritev, (int, const struct iovec *, int, off_t));
DECL(ssize_t, pwritev64, (int, const struct iovec *, int, off64_t));
DECL(off_t, lseek, (int, off_t, int));
DECL(off64_t, lseek64, (int, off64_t, int));
DECL(int, fsync, (int));
DECL(int, fdatasync, (int));
DECL(int, stat, (const char *, struct stat *));
DECL(int, stat64, (const char *, struct stat64 *));
DECL(int, lstat, (const char *, struct stat *));
DECL(int, lstat64, (const char *, struct stat64 *));
DECL(int, fstat, (int, struct stat *));
DECL(int, fstat64, (int, struct stat64 *));
DECL(int, fstatat, (int, const char *, struct stat *, int));
DECL(int, fstatat64, (int, const char *, struct stat64 *, int));
DECL(int, __xstat, (int, const char *, struct stat *));
DECL(int, __xstat64, (int, const char *, struct stat64 *));
DECL(int, __lxstat, (int, const char *, struct stat *));
DECL(int, __lxstat64, (int, const char *, struct stat64 *));
DECL(int, __fxstat, (int, int, struct stat *));
DECL(int, __fxstat64, (int, int, struct stat64 *));
DECL(int, __fxstatat, (int, int, const char *, struct stat *, int));
DECL(int, __fxstatat64, (int, int, const char *, struct stat64 *, int));
DECL(int, statx, (int, const char *, int, unsigned int, struct statx *));
DECL(int, access, (const char *, int));
DECL(int, faccessat, (int, const char *, int, int));
DECL(DIR *, opendir, (const char *));
DECL(DIR *, fdopendir, (int));
DECL(struct dirent *, readdir, (DIR *));
DECL(struct dirent64 *, readdir64, (DIR *));
DECL(int, closedir, (DIR *));
DECL(ssize_t, getdents64, (int, void *, size_t));
DECL(int, mkdir, (const char *, mode_t));
DECL(int, mkdirat, (int, const char *, mode_t));
DECL(int, rmdir, (const char *));
DECL(int, unlink, (const char *));
DECL(int, unlinkat, (int, const char *, int));
DECL(int, rename, (const char *, const char *));
DECL(int, renameat, (int, const char *, int, const char *));
DECL(void *, mmap, (void *, size_t, int, int, int, off_t));
DECL(void *, mmap64, (void *, size_t, int, int, int, off64_t));
DECL(FILE *, fopen, (const char *, const char *));
DECL(FILE *, fopen64, (const char *, const char *));
DECL(int, fclose, (FILE *));
DECL(size_t, fread, (void *, size_t, size_t, FILE *));
DECL(size_t, fwrite, (const void *, size_t, size_t, FILE *));
DECL(int, fseek, (FILE *, long, int));
DECL(int, fseeko, (FILE *, off_t, int));
DECL(int, fseeko64, (FILE *, off64_t, int));
DECL(long, ftell, (FILE *));
DECL(off_t, ftello, (FILE *));
DECL(off64_t, ftello64, (FILE *));
DECL(int, fgetpos, (FILE *, fpos_t *));
DECL(int, fgetpos64, (FILE *, fpos64_t *));
DECL(int, fsetpos, (FILE *, const fpos_t *));
DECL(int, fsetpos64, (FILE *, const fpos64_t *));
DECL(int, dup, (int));
DECL(int, dup2, (int, int));
DECL(int, dup3, (int, int, int));
DECL(int, fcntl, (int, int, ...));
DECL(int, fcntl64, (int, int, ...));
DECL(int, chdir, (const char *));
DECL(int, fchdir, (int));

/* -- helpers ---------------------------------------------------------------------------- */
static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static inline int active(void) { return dd_on && !guard && !muted; }

static size_t put_str(char *dst, size_t at, const char *s) {
    size_t n = strnlen(s, PATH_CAP - 1 - at);
    memcpy(dst + at, s, n);
    return at + n;
}

/* The absolute, lexical path of `path` relative to `dirfd` into dst; returns its length
 * (0: not recorded). *trunc is set when it did not fit. */
static size_t abs_path(char *dst, int dirfd, const char *path, int *trunc) {
    size_t n = 0;
    if (!path) return 0;
    if (path[0] != '/') {
        if (dirfd == AT_FDCWD) {
            memcpy(dst, cwd, cwdlen);
            n = cwdlen;
        } else if (dirfd >= 0 && dirfd < MAXFD && fdon[dirfd]) {
            n = put_str(dst, 0, fdpath[dirfd]);
        } else {
            return 0; /* relative to a directory we never saw opened: unknown */
        }
        if (path[0] == '\0') { /* AT_EMPTY_PATH: the directory itself */
            dst[n] = '\0';
            return n;
        }
        if (n == 0 || dst[n - 1] != '/') n = put_str(dst, n, "/");
    }
    size_t m = put_str(dst, n, path);
    if (path[m - n] != '\0') *trunc = 1;
    dst[m] = '\0';
    return m;
}

static inline int skipped(const char *p, size_t n) {
    if (n >= 5 && memcmp(p, "/proc", 5) == 0 && (n == 5 || p[5] == '/')) return 1;
    if (n >= 4 && memcmp(p, "/sys", 4) == 0 && (n == 4 || p[4] == '/')) return 1;
    return skiplen && n >= skiplen && memcmp(p, skip, skiplen) == 0 && (n == skiplen || p[skiplen] == '/');
}

static void wake(void) {
    atomic_fetch_add(&wakeword, 1);
    syscall(SYS_futex, &wakeword, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
}

static struct slot *reserve(uint64_t *ticket) {
    uint64_t h = atomic_load_explicit(&head, memory_order_relaxed);
    for (;;) {
        uint64_t t = atomic_load_explicit(&tail, memory_order_acquire);
        if (h - t >= cap) return NULL; /* the caller sums the call into the overflow table */
        if (atomic_compare_exchange_weak_explicit(&head, &h, h + 1, memory_order_acq_rel, memory_order_relaxed))
            break;
    }
    *ticket = h;
    return &ring[h & mask];
}

static void publish(struct slot *s, uint64_t ticket) {
    atomic_store_explicit(&s->seq, ticket + 1, memory_order_release);
    if (((ticket + 1) & (mask >> 1)) == 0) wake(); /* every half ring */
}

static TLS int32_t mytid;
static inline int32_t tid_now(void) {
    if (!mytid) mytid = (int32_t)syscall(SYS_gettid);
    return mytid;
}

/* -- overflow: a call the full ring has no slot for is summed, never lost (issue 21 item 3) --
 * A program that makes calls faster than the drainer moves them (10^5-10^6 stats a second
 * while the drainer waits for a core) fills the ring. Each call that finds it full is added
 * to the entry of its (call, directory, thread): calls, their summed duration and bytes, and
 * the start of the first since the last drain. The drainer makes each entry one row
 * (dd_overflow). Lock-free as the ring: an entry is claimed by a compare-and-swap of its key
 * (a 64-bit hash; a free entry is 0) within OVF_PROBE places of its hash, then its sums are
 * atomic adds. Entries are never freed while recording (a directory storm repeats); the
 * calls whose entry finds no room go to their call's own entry past the table (directory ""),
 * so the counts stay whole. */
#define OVF_N 1024
#define OVF_PROBE 8
#define OVF_OPS 32 /* > the last OP_ */
struct ovf {
    _Atomic uint64_t key;
    _Atomic uint32_t ready; /* op, tid and dir are written */
    int32_t op, tid;
    uint32_t dlen;
    _Atomic int64_t calls, ns, bytes, first;
    char dir[PATH_CAP];
};
static struct ovf *ovf; /* OVF_N + OVF_OPS entries, mapped by dd_start */
static _Atomic uint32_t ovf_any;

static void overflow(int op, int64_t t0, int64_t t1, const char *p, size_t n, int64_t nbytes) {
    if (!ovf) return;
    size_t d = n;
    while (d > 0 && p[d - 1] != '/') d--;
    if (d > 1) d--; /* the directory without its trailing slash ("/" stays) */
    int32_t tid = tid_now();
    uint64_t h = 1469598103934665603ULL;
    for (size_t i = 0; i < d; i++) h = (h ^ (unsigned char)p[i]) * 1099511628211ULL;
    h = (h ^ ((uint64_t)(uint32_t)op << 32 | (uint32_t)tid)) * 1099511628211ULL;
    h |= 1;
    struct ovf *e = NULL;
    for (int i = 0; i < OVF_PROBE && !e; i++) {
        struct ovf *c = &ovf[(h + (uint64_t)i) & (OVF_N - 1)];
        uint64_t k = atomic_load_explicit(&c->key, memory_order_acquire);
        if (k == 0 && atomic_compare_exchange_strong(&c->key, &k, h)) {
            c->op = op; c->tid = tid; c->dlen = (uint32_t)d;
            memcpy(c->dir, p, d);
            c->dir[d] = '\0';
            atomic_store_explicit(&c->ready, 1, memory_order_release);
            e = c;
        } else if (k == h) {
            e = c;
        }
    }
    if (!e) { /* the table is full: the call's own entry, no directory */
        e = &ovf[OVF_N + (op & (OVF_OPS - 1))];
        uint64_t k = 0;
        if (atomic_compare_exchange_strong(&e->key, &k, (uint64_t)op + 1)) {
            e->op = op; e->tid = tid; e->dlen = 0; e->dir[0] = '\0';
            atomic_store_explicit(&e->ready, 1, memory_order_release);
        }
    }
    int64_t z = 0;
    if (atomic_load_explicit(&e->first, memory_order_relaxed) == 0)
        atomic_compare_exchange_strong(&e->first, &z, t0);
    atomic_fetch_add_explicit(&e->ns, t1 - t0, memory_order_relaxed);
    atomic_fetch_add_explicit(&e->bytes, nbytes, memory_order_relaxed);
    atomic_fetch_add_explicit(&e->calls, 1, memory_order_release); /* last: the drainer takes it first */
    if (!atomic_load_explicit(&ovf_any, memory_order_relaxed)) atomic_store_explicit(&ovf_any, 1, memory_order_relaxed);
}

/* A call on a path (dirfd-relative when dirfd != AT_FDCWD); returns the call site it took. */
static int32_t rec_path(int op, int64_t t0, int64_t t1, int dirfd, const char *path, int err, int64_t nbytes, int fd) {
    uint64_t tk;
    int32_t site = site_take(path, t0);
    int64_t fold = fold_take();
    struct slot *s = reserve(&tk);
    int trunc = 0;
    if (!s) {
        char p[PATH_CAP];
        size_t n = abs_path(p, dirfd, path, &trunc);
        if (n && !skipped(p, n)) overflow(op, t0, t1, p, n, nbytes);
        return site;
    }
    size_t n = abs_path(s->path, dirfd, path, &trunc);
    if (n == 0 || skipped(s->path, n)) {
        s->op = 0; /* published empty: the drainer skips it (a reserved slot must be published) */
        s->plen = 0;
    } else {
        s->op = op;
        s->plen = (uint16_t)n;
    }
    s->t0 = t0; s->t1 = t1; s->nbytes = nbytes; s->err = err; s->fd = fd;
    s->tid = tid_now(); s->flags = (uint16_t)trunc; s->site = site; s->fold_t1 = fold;
    publish(s, tk);
    return site;
}

/* A call on descriptor fd, named `path` with call site `site`: fdpath[fd] and fdsite[fd], or
 * what a close took of them before the descriptor was freed (struct closing). */
static void rec_fd_as(int op, int64_t t0, int64_t t1, int fd, int err, int64_t nbytes, const char *path, int32_t site) {
    uint64_t tk;
    int64_t fold = fold_take();
    struct slot *s = reserve(&tk);
    if (!s) {
        overflow(op, t0, t1, path, strnlen(path, PATH_CAP - 1), nbytes);
        return;
    }
    size_t n = put_str(s->path, 0, path);
    s->path[n] = '\0';
    s->op = op; s->plen = (uint16_t)n;
    s->t0 = t0; s->t1 = t1; s->nbytes = nbytes; s->err = err; s->fd = fd;
    s->tid = tid_now(); s->flags = 0; s->site = site; s->fold_t1 = fold;
    publish(s, tk);
}

static void rec_fd(int op, int64_t t0, int64_t t1, int fd, int err, int64_t nbytes) {
    rec_fd_as(op, t0, t1, fd, err, nbytes, fdpath[fd], fdsite[fd]);
}

static inline int tracked(int fd) { return fd >= 0 && fd < MAXFD && fdon[fd]; }

/* fd was opened on path, by a call that took call site `site` (rec_path's): its reads,
 * writes and close carry that site */
static void track(int fd, int dirfd, const char *path, int32_t site) {
    if (fd < 0 || fd >= MAXFD) return;
    int trunc = 0;
    size_t n = abs_path(fdpath[fd], dirfd, path, &trunc);
    fdon[fd] = (n > 0 && !skipped(fdpath[fd], n));
    fdsite[fd] = site;
}

static void track_dup(int from, int to) {
    if (to < 0 || to >= MAXFD) return;
    if (tracked(from)) {
        memcpy(fdpath[to], fdpath[from], PATH_CAP);
        fdsite[to] = fdsite[from];
        fdon[to] = 1;
    } else {
        fdon[to] = 0;
    }
}

static inline void untrack(int fd) { if (fd >= 0 && fd < MAXFD) fdon[fd] = 0; }

/* What a close records of its descriptor, taken (and the descriptor forgotten) before the real
 * close: once the kernel frees fd, another thread's open may take that number and track() rewrite
 * fdpath[fd] while this thread reads it. Seen: a close row named "/root/.p" + the other thread's
 * "est-of-root/.../clock-ref.json" + NUL + the old path's tail, and the rank's string table then
 * could not be written; and untrack() after the close forgot the other thread's new descriptor. */
struct closing {
    char path[PATH_CAP];
    int32_t site;
};

static void closing_take(struct closing *c, int fd) {
    size_t n = put_str(c->path, 0, fdpath[fd]);
    c->path[n] = '\0';
    c->site = fdsite[fd];
    untrack(fd);
}

static void at_fork_child(void) {
    /* the parent's undrained slots are the parent's: drop them here */
    atomic_store(&tail, atomic_load(&head));
    /* the parent's overflow sums are the parent's, and its threads are not this process's */
    if (ovf) memset((void *)ovf, 0, (OVF_N + OVF_OPS) * sizeof(struct ovf));
    atomic_store(&ovf_any, 0);
    guard = 0;
    mytid = 0;
    site_next = 0;
    fold_fd = -1;
    fold_t1 = 0;
}

/* -- the API the Python side calls (ctypes) ----------------------------------------------- */
API int dd_version(void) { return 2; } /* 2: dd_overflow, no dd_lost (no call is lost) */

API int dd_slot_size(void) { return (int)sizeof(struct slot); }

/* The calling thread's next call on `path` (n bytes, as the program passed it) is from the
 * Python call site `site` (a string id of the recorder's); 0 forgets it. */
API void dd_site(int32_t site, const char *path, size_t n) {
    if (n >= PATH_CAP) site = 0;
    if (site) { memcpy(site_path, path, n); site_path[n] = '\0'; site_plen = n; site_t = now_ns(); }
    site_next = site;
}

/* Paths under `prefix` (trailing slashes ignored) are never recorded; NULL: none. */
static void set_skip(const char *prefix) {
    skiplen = 0;
    if (prefix) {
        size_t n = strlen(prefix);
        while (n > 1 && prefix[n - 1] == '/') n--;
        if (n < PATH_CAP) { memcpy(skip, prefix, n); skip[n] = '\0'; skiplen = n; }
    }
}

/* Start recording: a ring of 2^k >= nslots slots; paths under skip_prefix never recorded. */
API int dd_start(long nslots, const char *skip_prefix) {
    if (dd_on) { /* started early (dd_early): the shim's start only names what to skip */
        set_skip(skip_prefix);
        return (int)cap;
    }
    if (!ring) {
        uint64_t c = 1024;
        while (c < (uint64_t)nslots && c < (1u << 24)) c <<= 1;
        void *r = mmap(NULL, c * sizeof(struct slot), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (r == MAP_FAILED) return -1;
        void *f = mmap(NULL, (size_t)MAXFD * PATH_CAP, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (f == MAP_FAILED) return -1;
        void *o = mmap(NULL, MAXFD, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (o == MAP_FAILED) return -1;
        void *fs = mmap(NULL, (size_t)MAXFD * sizeof(int32_t), PROT_READ | PROT_WRITE,
                        MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (fs == MAP_FAILED) return -1;
        void *v = mmap(NULL, (OVF_N + OVF_OPS) * sizeof(struct ovf), PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (v == MAP_FAILED) return -1;
        ring = r; fdpath = f; fdon = o; fdsite = fs; ovf = v;
        cap = c; mask = c - 1;
        pthread_atfork(NULL, NULL, at_fork_child);
    }
    set_skip(skip_prefix);
    if (getcwd(cwd, PATH_CAP)) cwdlen = strlen(cwd); else cwdlen = 0;
    dd_on = 1;
    return (int)cap;
}

API void dd_stop(void) { dd_on = 0; wake(); }

/* The process's start as this library saw it: CLOCK_MONOTONIC when the dynamic loader ran
 * its constructor, before the interpreter's first instruction (the clock of
 * time.perf_counter_ns). With DISTDIAG_PRELOAD_EARLY=<slots> in the environment (the
 * wrapper's re-exec sets it) recording starts right there, so the interpreter's own start
 * and every import are seen (issue 21: startup from the first instruction we can see); the
 * variable is removed at once, so the programs this one execs do not start early. */
static int64_t t_loaded;

__attribute__((constructor)) static void dd_early(void) {
    t_loaded = now_ns();
    const char *v = getenv("DISTDIAG_PRELOAD_EARLY");
    if (!v) return;
    long n = atol(v);
    unsetenv("DISTDIAG_PRELOAD_EARLY");
    if (n > 0) dd_start(n, NULL);
}

API long long dd_loaded_ns(void) { return (long long)t_loaded; }

API void dd_mute(int on) { muted = on; }

/* Copy up to `max` published slots into out; returns how many. One reader (the drainer). */
API long dd_drain(void *out, long max) {
    if (!ring) return 0;
    uint64_t t = atomic_load_explicit(&tail, memory_order_relaxed);
    long n = 0;
    while (n < max) {
        struct slot *s = &ring[t & mask];
        if (atomic_load_explicit(&s->seq, memory_order_acquire) != t + 1) break;
        /* the header and the path's bytes only: the rest of the slot is stale */
        size_t len = offsetof(struct slot, path) + (s->plen < PATH_CAP ? s->plen + 1u : PATH_CAP); /* + its NUL */
        memcpy((char *)out + n * sizeof(struct slot), s, len);
        n++; t++;
        atomic_store_explicit(&tail, t, memory_order_release);
    }
    return n;
}

/* One record of dd_overflow (keep in step with __init__.py's _OVF). */
struct ovf_rec {
    int32_t op, tid;
    int64_t calls, ns, bytes, first;
    uint32_t dlen, pad;
    char dir[PATH_CAP];
};
_Static_assert(sizeof(struct ovf_rec) == 48 + PATH_CAP, "overflow record layout");

/* Take each overflow entry's sums since the last call into out (at most max records), and
 * zero them; returns how many. One reader (the drainer). A call being added as this runs is
 * counted once: its count and its seconds may land in two consecutive records. */
API long dd_overflow(void *out, long max) {
    if (!ovf || !atomic_exchange(&ovf_any, 0)) return 0;
    struct ovf_rec *o = out;
    long n = 0;
    for (int i = 0; i < OVF_N + OVF_OPS; i++) {
        struct ovf *e = &ovf[i];
        if (!atomic_load_explicit(&e->ready, memory_order_acquire)) continue;
        if (atomic_load_explicit(&e->calls, memory_order_relaxed) == 0) continue;
        if (n >= max) { atomic_store(&ovf_any, 1); break; } /* the rest at the next call */
        int64_t c = atomic_exchange_explicit(&e->calls, 0, memory_order_acquire);
        struct ovf_rec *r = &o[n++];
        r->op = e->op; r->tid = e->tid; r->calls = c;
        r->ns = atomic_exchange(&e->ns, 0);
        r->bytes = atomic_exchange(&e->bytes, 0);
        r->first = atomic_exchange(&e->first, 0);
        r->dlen = e->dlen; r->pad = 0;
        memcpy(r->dir, e->dir, e->dlen + 1u);
    }
    return n;
}

API long dd_pending(void) { return ring ? (long)(atomic_load(&head) - atomic_load(&tail)) : 0; }

/* Sleep until the ring is half full, dd_kick, or timeout_ms. Called with the GIL released. */
API void dd_wait(long timeout_ms) {
    uint32_t w = atomic_load(&wakeword);
    struct timespec ts = {timeout_ms / 1000, (timeout_ms % 1000) * 1000000L};
    syscall(SYS_futex, &wakeword, FUTEX_WAIT_PRIVATE, w, &ts, NULL, 0);
}

API void dd_kick(void) { wake(); }

/* -- the hooks ------------------------------------------------------------------------------ */
#define ENTER int64_t t0 = now_ns(); guard = 1
#define LEAVE_ERR(r) int e = errno; int64_t t1 = now_ns(); int err = (r) ? e : 0

static int open_common(int op, int dirfd, const char *path, int r, int64_t t0) {
    int e = errno;
    int64_t t1 = now_ns();
    int32_t site = rec_path(op, t0, t1, dirfd, path, r < 0 ? e : 0, 0, r);
    if (r >= 0) {
        track(r, dirfd, path, site);
        if (tracked(r)) fold_fd = r;
    }
    guard = 0;
    errno = e;
    return r;
}

#define OPEN_MODE(flags, mode) \
    mode_t mode = 0; \
    if ((flags) & (O_CREAT | __O_TMPFILE)) { va_list ap; va_start(ap, flags); mode = va_arg(ap, mode_t); va_end(ap); }

#define DEF_OPEN(name) \
    API int name(const char *path, int flags, ...) { \
        OPEN_MODE(flags, mode); RESOLVE(name); \
        if (!active()) return REAL(name)(path, flags, mode); \
        ENTER; int r = REAL(name)(path, flags, mode); \
        return open_common(OP_OPEN, AT_FDCWD, path, r, t0); \
    }
DEF_OPEN(open)
DEF_OPEN(open64)

#define DEF_OPENAT(name) \
    API int name(int dirfd, const char *path, int flags, ...) { \
        OPEN_MODE(flags, mode); RESOLVE(name); \
        if (!active()) return REAL(name)(dirfd, path, flags, mode); \
        ENTER; int r = REAL(name)(dirfd, path, flags, mode); \
        return open_common(OP_OPEN, dirfd, path, r, t0); \
    }
DEF_OPENAT(openat)
DEF_OPENAT(openat64)

#define DEF_OPEN2(name) \
    API int name(const char *path, int flags) { \
        RESOLVE(name); \
        if (!active()) return REAL(name)(path, flags); \
        ENTER; int r = REAL(name)(path, flags); \
        return open_common(OP_OPEN, AT_FDCWD, path, r, t0); \
    }
DEF_OPEN2(__open_2)
DEF_OPEN2(__open64_2)

#define DEF_OPENAT2(name) \
    API int name(int dirfd, const char *path, int flags) { \
        RESOLVE(name); \
        if (!active()) return REAL(name)(dirfd, path, flags); \
        ENTER; int r = REAL(name)(dirfd, path, flags); \
        return open_common(OP_OPEN, dirfd, path, r, t0); \
    }
DEF_OPENAT2(__openat_2)
DEF_OPENAT2(__openat64_2)

#define DEF_CREAT(name) \
    API int name(const char *path, mode_t mode) { \
        RESOLVE(name); \
        if (!active()) return REAL(name)(path, mode); \
        ENTER; int r = REAL(name)(path, mode); \
        return open_common(OP_OPEN, AT_FDCWD, path, r, t0); \
    }
DEF_CREAT(creat)
DEF_CREAT(creat64)

API int close(int fd) {
    RESOLVE(close);
    if (!active() || !tracked(fd)) {
        if (dd_on && fd >= 0 && fd < MAXFD) fdon[fd] = 0;
        return REAL(close)(fd);
    }
    struct closing c;
    closing_take(&c, fd);
    ENTER;
    int r = REAL(close)(fd);
    LEAVE_ERR(r < 0);
    rec_fd_as(OP_CLOSE, t0, t1, fd, err, 0, c.path, c.site);
    guard = 0;
    errno = e;
    return r;
}

/* fd calls that move bytes: ret is the byte count or -1 */
#define DEF_FDIO(ret_t, name, op, params, args) \
    API ret_t name params { \
        RESOLVE(name); \
        if (!active() || !tracked(fd)) return REAL(name) args; \
        ENTER; ret_t r = REAL(name) args; LEAVE_ERR(r < 0); \
        rec_fd(op, t0, t1, fd, err, r > 0 ? (int64_t)r : 0); \
        guard = 0; errno = e; return r; \
    }
DEF_FDIO(ssize_t, read, OP_READ, (int fd, void *b, size_t n), (fd, b, n))
DEF_FDIO(ssize_t, pread, OP_READ, (int fd, void *b, size_t n, off_t o), (fd, b, n, o))
DEF_FDIO(ssize_t, pread64, OP_READ, (int fd, void *b, size_t n, off64_t o), (fd, b, n, o))
DEF_FDIO(ssize_t, readv, OP_READ, (int fd, const struct iovec *v, int c), (fd, v, c))
DEF_FDIO(ssize_t, preadv, OP_READ, (int fd, const struct iovec *v, int c, off_t o), (fd, v, c, o))
DEF_FDIO(ssize_t, preadv64, OP_READ, (int fd, const struct iovec *v, int c, off64_t o), (fd, v, c, o))
DEF_FDIO(ssize_t, write, OP_WRITE, (int fd, const void *b, size_t n), (fd, b, n))
DEF_FDIO(ssize_t, pwrite, OP_WRITE, (int fd, const void *b, size_t n, off_t o), (fd, b, n, o))
DEF_FDIO(ssize_t, pwrite64, OP_WRITE, (int fd, const void *b, size_t n, off64_t o), (fd, b, n, o))
DEF_FDIO(ssize_t, writev, OP_WRITE, (int fd, const struct iovec *v, int c), (fd, v, c))
DEF_FDIO(ssize_t, pwritev, OP_WRITE, (int fd, const struct iovec *v, int c, off_t o), (fd, v, c, o))
DEF_FDIO(ssize_t, pwritev64, OP_WRITE, (int fd, const struct iovec *v, int c, off64_t o), (fd, v, c, o))
DEF_FDIO(ssize_t, getdents64, OP_GETDENTS, (int fd, void *b, size_t n), (fd, b, n))

#define DEF_FDOP(ret_t, name, op, params, args, fails) \
    API ret_t name params { \
        RESOLVE(name); \
        if (!REAL(name)) { errno = ENOSYS; return -1; } \
        if (!active() || !tracked(fd)) return REAL(name) args; \
        ENTER; ret_t r = REAL(name) args; LEAVE_ERR(fails); \
        rec_fd(op, t0, t1, fd, err, 0); \
        guard = 0; errno = e; return r; \
    }
/* fstat/lseek: folded into the thread's open of that descriptor when it comes right after
 * it (see fold_fd), else a slot */
static inline void rec_fold(int op, int64_t t0, int64_t t1, int fd, int err) {
    if (fd == fold_fd) {
        if (t1 > fold_t1) fold_t1 = t1;
    } else {
        rec_fd(op, t0, t1, fd, err, 0);
    }
}
#define DEF_FOLDOP(ret_t, name, op, params, args) \
    API ret_t name params { \
        RESOLVE(name); \
        if (!REAL(name)) { errno = ENOSYS; return -1; } \
        if (!active() || !tracked(fd)) return REAL(name) args; \
        ENTER; ret_t r = REAL(name) args; LEAVE_ERR(r < 0); \
        rec_fold(op, t0, t1, fd, err); \
        guard = 0; errno = e; return r; \
    }
DEF_FOLDOP(off_t, lseek, OP_SEEK, (int fd, off_t o, int w), (fd, o, w))
DEF_FOLDOP(off64_t, lseek64, OP_SEEK, (int fd, off64_t o, int w), (fd, o, w))
DEF_FDOP(int, fsync, OP_SYNC, (int fd), (fd), r < 0)
DEF_FDOP(int, fdatasync, OP_SYNC, (int fd), (fd), r < 0)
DEF_FOLDOP(int, fstat, OP_FSTAT, (int fd, struct stat *st), (fd, st))
DEF_FOLDOP(int, fstat64, OP_FSTAT, (int fd, struct stat64 *st), (fd, st))
DEF_FOLDOP(int, __fxstat, OP_FSTAT, (int v, int fd, struct stat *st), (v, fd, st))
DEF_FOLDOP(int, __fxstat64, OP_FSTAT, (int v, int fd, struct stat64 *st), (v, fd, st))

/* calls on a path */
#define DEF_PATH(name, op, params, args) \
    API int name params { \
        RESOLVE(name); \
        if (!REAL(name)) { errno = ENOSYS; return -1; } \
        if (!active()) return REAL(name) args; \
        ENTER; int r = REAL(name) args; LEAVE_ERR(r < 0); \
        rec_path(op, t0, t1, AT_FDCWD, path, err, 0, -1); \
        guard = 0; errno = e; return r; \
    }
DEF_PATH(stat, OP_STAT, (const char *path, struct stat *st), (path, st))
DEF_PATH(stat64, OP_STAT, (const char *path, struct stat64 *st), (path, st))
DEF_PATH(lstat, OP_LSTAT, (const char *path, struct stat *st), (path, st))
DEF_PATH(lstat64, OP_LSTAT, (const char *path, struct stat64 *st), (path, st))
DEF_PATH(__xstat, OP_STAT, (int v, const char *path, struct stat *st), (v, path, st))
DEF_PATH(__xstat64, OP_STAT, (int v, const char *path, struct stat64 *st), (v, path, st))
DEF_PATH(__lxstat, OP_LSTAT, (int v, const char *path, struct stat *st), (v, path, st))
DEF_PATH(__lxstat64, OP_LSTAT, (int v, const char *path, struct stat64 *st), (v, path, st))
DEF_PATH(access, OP_ACCESS, (const char *path, int m), (path, m))
DEF_PATH(mkdir, OP_MKDIR, (const char *path, mode_t m), (path, m))
DEF_PATH(rmdir, OP_RMDIR, (const char *path), (path))
DEF_PATH(unlink, OP_UNLINK, (const char *path), (path))

#define DEF_PATHAT(name, op, params, args) \
    API int name params { \
        RESOLVE(name); \
        if (!REAL(name)) { errno = ENOSYS; return -1; } \
        if (!active()) return REAL(name) args; \
        ENTER; int r = REAL(name) args; LEAVE_ERR(r < 0); \
        rec_path(op, t0, t1, dirfd, path, err, 0, -1); \
        guard = 0; errno = e; return r; \
    }
DEF_PATHAT(fstatat, OP_STAT, (int dirfd, const char *path, struct stat *st, int fl), (dirfd, path, st, fl))
DEF_PATHAT(fstatat64, OP_STAT, (int dirfd, const char *path, struct stat64 *st, int fl), (dirfd, path, st, fl))
DEF_PATHAT(__fxstatat, OP_STAT, (int v, int dirfd, const char *path, struct stat *st, int fl), (v, dirfd, path, st, fl))
DEF_PATHAT(__fxstatat64, OP_STAT, (int v, int dirfd, const char *path, struct stat64 *st, int fl), (v, dirfd, path, st, fl))
DEF_PATHAT(statx, OP_STATX, (int dirfd, const char *path, int fl, unsigned int m, struct statx *b), (dirfd, path, fl, m, b))
DEF_PATHAT(faccessat, OP_ACCESS, (int dirfd, const char *path, int m, int fl), (dirfd, path, m, fl))
DEF_PATHAT(mkdirat, OP_MKDIR, (int dirfd, const char *path, mode_t m), (dirfd, path, m))
DEF_PATHAT(unlinkat, OP_UNLINK, (int dirfd, const char *path, int fl), (dirfd, path, fl))

API int rename(const char *path, const char *to) {
    RESOLVE(rename);
    if (!active()) return REAL(rename)(path, to);
    ENTER; int r = REAL(rename)(path, to); LEAVE_ERR(r < 0);
    rec_path(OP_RENAME, t0, t1, AT_FDCWD, path, err, 0, -1);
    guard = 0; errno = e; return r;
}

API int renameat(int dirfd, const char *path, int dirfd2, const char *to) {
    RESOLVE(renameat);
    if (!active()) return REAL(renameat)(dirfd, path, dirfd2, to);
    ENTER; int r = REAL(renameat)(dirfd, path, dirfd2, to); LEAVE_ERR(r < 0);
    rec_path(OP_RENAME, t0, t1, dirfd, path, err, 0, -1);
    guard = 0; errno = e; return r;
}

/* directories */
API DIR *opendir(const char *path) {
    RESOLVE(opendir);
    if (!active()) return REAL(opendir)(path);
    ENTER; DIR *d = REAL(opendir)(path); LEAVE_ERR(d == NULL);
    int32_t site = rec_path(OP_LISTDIR, t0, t1, AT_FDCWD, path, err, 0, d ? dirfd(d) : -1);
    if (d) track(dirfd(d), AT_FDCWD, path, site);
    guard = 0; errno = e; return d;
}

API DIR *fdopendir(int fd) {
    RESOLVE(fdopendir);
    if (!active() || !tracked(fd)) return REAL(fdopendir)(fd);
    ENTER; DIR *d = REAL(fdopendir)(fd); LEAVE_ERR(d == NULL);
    rec_fd(OP_LISTDIR, t0, t1, fd, err, 0);
    guard = 0; errno = e; return d;
}

/* readdir: only the calls that went to the kernel (getdents under libc's buffer) are rows;
 * the others take tens of nanoseconds and read libc's buffer */
#define READDIR_MIN_NS 1000
#define DEF_READDIR(ret_t, name) \
    API ret_t *name(DIR *d) { \
        RESOLVE(name); \
        if (!active() || !d) return REAL(name)(d); \
        int fd = dirfd(d); \
        if (!tracked(fd)) return REAL(name)(d); \
        ENTER; ret_t *r = REAL(name)(d); int e = errno; int64_t t1 = now_ns(); \
        if (t1 - t0 >= READDIR_MIN_NS) rec_fd(OP_READDIR, t0, t1, fd, 0, 0); \
        guard = 0; errno = e; return r; \
    }
DEF_READDIR(struct dirent, readdir)
DEF_READDIR(struct dirent64, readdir64)

API int closedir(DIR *d) {
    RESOLVE(closedir);
    if (!active() || !d) {
        if (dd_on && d) untrack(dirfd(d));
        return REAL(closedir)(d);
    }
    int fd = dirfd(d);
    if (!tracked(fd)) return REAL(closedir)(d);
    struct closing c;
    closing_take(&c, fd);
    ENTER; int r = REAL(closedir)(d); LEAVE_ERR(r < 0);
    rec_fd_as(OP_CLOSEDIR, t0, t1, fd, err, 0, c.path, c.site);
    guard = 0; errno = e; return r;
}

/* mmap of a file: the mapping is one row (its page-fault reads are not seen) */
#define DEF_MMAP(name) \
    API void *name(void *a, size_t len, int prot, int fl, int fd, off_t off) { \
        RESOLVE(name); \
        if ((fl & MAP_ANONYMOUS) || !active() || !tracked(fd)) return REAL(name)(a, len, prot, fl, fd, off); \
        ENTER; void *r = REAL(name)(a, len, prot, fl, fd, off); LEAVE_ERR(r == MAP_FAILED); \
        rec_fd(OP_MMAP, t0, t1, fd, err, 0); \
        guard = 0; errno = e; return r; \
    }
DEF_MMAP(mmap)
DEF_MMAP(mmap64)

/* stdio: fopen's open and fread's reads happen inside libc, out of sight of the hooks above */
#define DEF_FOPEN(name) \
    API FILE *name(const char *path, const char *mode) { \
        RESOLVE(name); \
        if (!active()) return REAL(name)(path, mode); \
        ENTER; FILE *f = REAL(name)(path, mode); LEAVE_ERR(f == NULL); \
        int32_t site = rec_path(OP_FOPEN, t0, t1, AT_FDCWD, path, err, 0, f ? fileno(f) : -1); \
        if (f) { track(fileno(f), AT_FDCWD, path, site); if (tracked(fileno(f))) fold_fd = fileno(f); } \
        guard = 0; errno = e; return f; \
    }
DEF_FOPEN(fopen)
DEF_FOPEN(fopen64)

API int fclose(FILE *f) {
    RESOLVE(fclose);
    int fd = f ? fileno(f) : -1;
    if (!active() || !tracked(fd)) {
        if (dd_on) untrack(fd);
        return REAL(fclose)(f);
    }
    struct closing c;
    closing_take(&c, fd);
    ENTER; int r = REAL(fclose)(f); LEAVE_ERR(r != 0);
    rec_fd_as(OP_FCLOSE, t0, t1, fd, err, 0, c.path, c.site);
    guard = 0; errno = e; return r;
}

API size_t fread(void *p, size_t sz, size_t n, FILE *f) {
    RESOLVE(fread);
    int fd;
    if (!active() || !f || !tracked(fd = fileno(f))) return REAL(fread)(p, sz, n, f);
    ENTER; size_t r = REAL(fread)(p, sz, n, f); int e = errno; int64_t t1 = now_ns();
    rec_fd(OP_FREAD, t0, t1, fd, 0, (int64_t)(r * sz));
    guard = 0; errno = e; return r;
}

API size_t fwrite(const void *p, size_t sz, size_t n, FILE *f) {
    RESOLVE(fwrite);
    int fd;
    if (!active() || !f || !tracked(fd = fileno(f))) return REAL(fwrite)(p, sz, n, f);
    ENTER; size_t r = REAL(fwrite)(p, sz, n, f); int e = errno; int64_t t1 = now_ns();
    rec_fd(OP_FWRITE, t0, t1, fd, 0, (int64_t)(r * sz));
    guard = 0; errno = e; return r;
}

/* stdio's seeks: their first one on a FILE (and fread's first read) allocates its buffer
 * and asks the file's size with libc's internal fstat, which no hook sees; on a file system
 * that asks its server that is a server call (numpy.fromfile: fdopen, ftell, fseek: two
 * 1 ms fstats a file on the slow FUSE). Recorded as the fd's lseek (a row when slow, part
 * of the thread's open when it comes right after it: the drainer's fold), and only when it
 * took SLOW_SEEK_NS or more: most ftell/fseek calls are answered from the FILE's buffer in
 * ~20 ns, and a parser calling ftell per record must not fill the ring with slots the drainer
 * would drop (it keeps an lseek only from fileio.CLOSE_MIN_NS, the same 20 us) */
#define SLOW_SEEK_NS 20000
#define DEF_FSEEK(ret_t, name, params, args, failed) \
    API ret_t name params { \
        RESOLVE(name); \
        int fd; \
        if (!active() || !f || !tracked(fd = fileno(f))) return REAL(name) args; \
        ENTER; ret_t r = REAL(name) args; LEAVE_ERR(failed); \
        if (t1 - t0 >= SLOW_SEEK_NS) rec_fold(OP_SEEK, t0, t1, fd, err); \
        guard = 0; errno = e; return r; \
    }
DEF_FSEEK(int, fseek, (FILE *f, long o, int w), (f, o, w), r != 0)
DEF_FSEEK(int, fseeko, (FILE *f, off_t o, int w), (f, o, w), r != 0)
DEF_FSEEK(int, fseeko64, (FILE *f, off64_t o, int w), (f, o, w), r != 0)
DEF_FSEEK(long, ftell, (FILE *f), (f), r < 0)
DEF_FSEEK(off_t, ftello, (FILE *f), (f), r < 0)
DEF_FSEEK(off64_t, ftello64, (FILE *f), (f), r < 0)
DEF_FSEEK(int, fgetpos, (FILE *f, fpos_t *pos), (f, pos), r != 0)
DEF_FSEEK(int, fgetpos64, (FILE *f, fpos64_t *pos), (f, pos), r != 0)
DEF_FSEEK(int, fsetpos, (FILE *f, const fpos_t *pos), (f, pos), r != 0)
DEF_FSEEK(int, fsetpos64, (FILE *f, const fpos64_t *pos), (f, pos), r != 0)

/* descriptors that name the same file: numpy.fromfile reads a dup of the file's fd */
API int dup(int fd) {
    RESOLVE(dup);
    int r = REAL(dup)(fd);
    if (dd_on && r >= 0) { int e = errno; track_dup(fd, r); errno = e; }
    return r;
}

API int dup2(int fd, int to) {
    RESOLVE(dup2);
    int r = REAL(dup2)(fd, to);
    if (dd_on && r >= 0 && fd != to) { int e = errno; track_dup(fd, r); errno = e; }
    return r;
}

API int dup3(int fd, int to, int fl) {
    RESOLVE(dup3);
    int r = REAL(dup3)(fd, to, fl);
    if (dd_on && r >= 0) { int e = errno; track_dup(fd, r); errno = e; }
    return r;
}

#define DEF_FCNTL(name) \
    API int name(int fd, int cmd, ...) { \
        va_list ap; va_start(ap, cmd); void *arg = va_arg(ap, void *); va_end(ap); \
        RESOLVE(name); \
        int r = REAL(name)(fd, cmd, arg); \
        if (dd_on && r >= 0 && (cmd == F_DUPFD || cmd == F_DUPFD_CLOEXEC)) { int e = errno; track_dup(fd, r); errno = e; } \
        return r; \
    }
DEF_FCNTL(fcntl)
DEF_FCNTL(fcntl64)

/* the working directory relative paths are taken from */
static void refresh_cwd(void) {
    char buf[PATH_CAP];
    if (getcwd(buf, PATH_CAP)) { size_t n = strlen(buf); memcpy(cwd, buf, n + 1); cwdlen = n; }
}

API int chdir(const char *path) {
    RESOLVE(chdir);
    int r = REAL(chdir)(path);
    if (dd_on && r == 0) { int e = errno; refresh_cwd(); errno = e; }
    return r;
}

API int fchdir(int fd) {
    RESOLVE(fchdir);
    int r = REAL(fchdir)(fd);
    if (dd_on && r == 0) { int e = errno; refresh_cwd(); errno = e; }
    return r;
}
