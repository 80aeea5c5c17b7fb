/*
 * SharedMapping: one MAP_SHARED mapping of a shared-memory file, placed at a 2 MiB-aligned
 * address, and the means to put the file on 2 MiB pages (transparent huge pages of tmpfs).
 *
 * Why: a pick touches one random 32-byte slot per block of a table of tens to hundreds of MiB.
 * On 4 KiB pages nearly every such slot is a TLB miss whose page walk misses the caches too, and
 * these walks do not overlap (native/README.md, "Measured cost"): ~60-90 ns a slot on the
 * development VM, against ~33 ns on 2 MiB pages. A process maps a huge page with one PMD entry
 * only where its virtual address is congruent to the file offset modulo 2 MiB; Python's
 * mmap.mmap lets the kernel choose the address, and tmpfs aligns it only when the mount or
 * /sys/kernel/mm/transparent_hugepage/shmem_enabled enables huge pages. So the mapping is made
 * here: a PROT_NONE reservation 2 MiB longer than the file, the file mapped MAP_FIXED over its
 * first aligned address, the slack unmapped.
 *
 * Putting the file on huge pages (`seed_huge` then `collapse`, the segment's creator, before any
 * page is touched): MADV_COLLAPSE (Linux >= 6.1) collapses tmpfs pages into 2 MiB folios even
 * with shmem_enabled = never (only `deny` refuses it). It needs at least one page present in each
 * 2 MiB range, and it copies the pages present, so the creator first allocates one 4 KiB page per
 * range (fallocate, never a first touch: a full tmpfs must fail with ENOSPC, not SIGBUS), then
 * collapses, then fallocates the whole file (a no-op where the collapse succeeded). Where it
 * fails (older kernel, `deny`, no free 2 MiB of physical memory) the file stays on 4 KiB pages
 * and everything works as before. Every process that maps the file aligned then maps its huge
 * pages with PMD entries: 64 page faults for a 128 MiB index instead of 32,768.
 *
 * Lifecycle as mmap.mmap: `close()` unmaps, refuses (BufferError) while a buffer is exported
 * (a Region or Index holds one), and is idempotent; buffers of a closed mapping are refused.
 * The mapping never touches the words inside the segment.
 */
#include "_native.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25 /* Linux 6.1 (uapi asm-generic/mman-common.h); older kernels: EINVAL */
#endif

#define HUGE_BYTES ((size_t)2 << 20)
#define COLLAPSE_TRIES 3 /* EAGAIN: a page was locked or under writeback at that moment */

typedef struct {
    PyObject_HEAD
    char *addr; /* NULL once closed */
    Py_ssize_t len;
    int writable;
    Py_ssize_t exports; /* buffers handed out and not yet released */
} SharedMapping;

/* SharedMapping(fd, length, writable=True) */
static int Mapping_init(SharedMapping *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"fd", "length", "writable", NULL};
    int fd, writable = 1, prot;
    Py_ssize_t len;
    size_t span;
    char *res, *at, *p;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "in|p:SharedMapping", kwlist, &fd, &len, &writable))
        return -1;
    if (self->addr != NULL) {
        PyErr_SetString(PyExc_TypeError, "SharedMapping is already initialised");
        return -1;
    }
    if (len <= 0) {
        PyErr_SetString(PyExc_ValueError, "length must be positive");
        return -1;
    }
    span = (size_t)len + HUGE_BYTES;
    res = mmap(NULL, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (res == MAP_FAILED) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    at = (char *)(((uintptr_t)res + HUGE_BYTES - 1) & ~(uintptr_t)(HUGE_BYTES - 1));
    prot = PROT_READ | (writable ? PROT_WRITE : 0);
    p = mmap(at, (size_t)len, prot, MAP_SHARED | MAP_FIXED, fd, 0);
    if (p == MAP_FAILED) {
        int err = errno;
        munmap(res, span);
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    if (at > res)
        munmap(res, (size_t)(at - res));
    if (at + len < res + span) {
        /* the file mapping ends on a page boundary: unmap the reservation from the next page */
        uintptr_t end = ((uintptr_t)at + (uintptr_t)len + (uintptr_t)sysconf(_SC_PAGESIZE) - 1) &
                        ~((uintptr_t)sysconf(_SC_PAGESIZE) - 1);
        if ((char *)end < res + span)
            munmap((char *)end, (size_t)(res + span - (char *)end));
    }
    self->addr = p;
    self->len = len;
    self->writable = writable;
    self->exports = 0;
    return 0;
}

static int mapping_unmap(SharedMapping *self)
{
    if (self->exports > 0) {
        PyErr_SetString(PyExc_BufferError, "cannot close exported pointers exist");
        return 0;
    }
    if (self->addr != NULL)
        munmap(self->addr, (size_t)self->len);
    self->addr = NULL;
    return 1;
}

static void Mapping_dealloc(SharedMapping *self)
{
    self->exports = 0; /* every export holds a reference: none is left at dealloc */
    mapping_unmap(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Mapping_close(SharedMapping *self, PyObject *unused)
{
    return mapping_unmap(self) ? Py_NewRef(Py_None) : NULL;
}

/* collapse() -> int: bytes of the mapping now backed by 2 MiB pages (whole 2 MiB ranges only;
 * the file's tail past the last one stays on 4 KiB pages). Asks MADV_COLLAPSE range by range,
 * retrying EAGAIN, with the GIL released (copying pages: ~15 ms for 128 MiB, up to ~0.4 s when
 * the host first backs the memory). 0 where the kernel cannot (older than 6.1, tmpfs huge pages
 * `deny`, no free 2 MiB of physical memory). Never raises for those; ValueError when closed. */
static PyObject *Mapping_collapse(SharedMapping *self, PyObject *unused)
{
    size_t whole, done = 0;
    if (self->addr == NULL) {
        PyErr_SetString(PyExc_ValueError, "mapping is closed");
        return NULL;
    }
    whole = (size_t)self->len & ~(HUGE_BYTES - 1);
    Py_BEGIN_ALLOW_THREADS
#ifdef MADV_HUGEPAGE
    if (whole > 0)
        madvise(self->addr, whole, MADV_HUGEPAGE); /* lets faults allocate huge pages under `advise` */
#endif
    for (size_t off = 0; off < whole; off += HUGE_BYTES) {
        int rc = -1;
        for (int t = 0; t < COLLAPSE_TRIES && rc != 0; t++)
            if ((rc = madvise(self->addr + off, HUGE_BYTES, MADV_COLLAPSE)) != 0 && errno != EAGAIN)
                break;
        if (rc == 0)
            done += HUGE_BYTES;
        else if (errno == EINVAL && off == 0)
            break; /* the kernel has no MADV_COLLAPSE, or shmem huge pages are denied */
    }
    Py_END_ALLOW_THREADS
    return PyLong_FromSize_t(done);
}

static PyObject *Mapping_get_closed(SharedMapping *self, void *closure)
{
    return PyBool_FromLong(self->addr == NULL);
}

static PyObject *Mapping_get_address(SharedMapping *self, void *closure)
{
    return PyLong_FromVoidPtr(self->addr);
}

static Py_ssize_t Mapping_length(SharedMapping *self) { return self->addr != NULL ? self->len : 0; }

/* [start:stop] (step 1) of the mapping: its bounds, or 0 with an exception set. */
static int mapping_slice(SharedMapping *self, PyObject *key, Py_ssize_t *start, Py_ssize_t *n)
{
    Py_ssize_t stop, step;
    if (self->addr == NULL) {
        PyErr_SetString(PyExc_ValueError, "mapping is closed");
        return 0;
    }
    if (PyIndex_Check(key)) {
        Py_ssize_t i = PyNumber_AsSsize_t(key, PyExc_IndexError);
        if (i == -1 && PyErr_Occurred())
            return 0;
        if (i < 0)
            i += self->len;
        if (i < 0 || i >= self->len) {
            PyErr_SetString(PyExc_IndexError, "mapping index out of range");
            return 0;
        }
        *start = i;
        *n = -1; /* one byte */
        return 1;
    }
    if (!PySlice_Check(key) || PySlice_Unpack(key, start, &stop, &step) < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "mapping indices must be integers or slices");
        return 0;
    }
    if (step != 1) {
        PyErr_SetString(PyExc_ValueError, "mapping slices take no step");
        return 0;
    }
    *n = PySlice_AdjustIndices(self->len, start, &stop, step);
    return 1;
}

/* m[i] -> int, m[a:b] -> bytes (a copy), as mmap.mmap */
static PyObject *Mapping_subscript(SharedMapping *self, PyObject *key)
{
    Py_ssize_t start, n;
    if (!mapping_slice(self, key, &start, &n))
        return NULL;
    if (n < 0)
        return PyLong_FromLong((unsigned char)self->addr[start]);
    return PyBytes_FromStringAndSize(self->addr + start, n);
}

/* m[i] = int, m[a:b] = bytes-like of the same length, as mmap.mmap (tests, diagnostics) */
static int Mapping_ass_subscript(SharedMapping *self, PyObject *key, PyObject *value)
{
    Py_ssize_t start, n;
    Py_buffer b;
    if (value == NULL) {
        PyErr_SetString(PyExc_TypeError, "mapping items cannot be deleted");
        return -1;
    }
    if (!mapping_slice(self, key, &start, &n))
        return -1;
    if (!self->writable) {
        PyErr_SetString(PyExc_TypeError, "mapping is read-only");
        return -1;
    }
    if (n < 0) {
        long v = PyLong_AsLong(value);
        if (v == -1 && PyErr_Occurred())
            return -1;
        if (v < 0 || v > 255) {
            PyErr_SetString(PyExc_ValueError, "mapping item must be in range(0, 256)");
            return -1;
        }
        self->addr[start] = (char)v;
        return 0;
    }
    if (PyObject_GetBuffer(value, &b, PyBUF_SIMPLE) < 0)
        return -1;
    if (b.len != n) {
        PyBuffer_Release(&b);
        PyErr_SetString(PyExc_IndexError, "mapping slice assignment is wrong size");
        return -1;
    }
    memcpy(self->addr + start, b.buf, (size_t)n);
    PyBuffer_Release(&b);
    return 0;
}

static int Mapping_getbuffer(SharedMapping *self, Py_buffer *view, int flags)
{
    if (self->addr == NULL) {
        PyErr_SetString(PyExc_ValueError, "mapping is closed");
        return -1;
    }
    if (PyBuffer_FillInfo(view, (PyObject *)self, self->addr, self->len, !self->writable, flags) < 0)
        return -1;
    self->exports++;
    return 0;
}

static void Mapping_releasebuffer(SharedMapping *self, Py_buffer *view) { self->exports--; }

/* seed_huge(fd, length) -> None: give the file its size and one allocated 4 KiB page at the start
 * of every 2 MiB range (fallocate; MADV_COLLAPSE refuses ranges with no page at all), so that
 * `collapse` can put it on huge pages before anything is written. Raises OSError (ENOSPC: the
 * tmpfs is full). Call before mapping it, then `collapse`, then posix_fallocate the whole file. */
PyObject *mod_seed_huge(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    int fd, rc = 0;
    Py_ssize_t len;
    if (nargs != 2 || !PyLong_Check(args[0]) || !PyLong_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "seed_huge(fd, length) takes two ints");
        return NULL;
    }
    long fdl = PyLong_AsLong(args[0]);
    len = PyLong_AsSsize_t(args[1]);
    if (PyErr_Occurred())
        return NULL;
    if (fdl < 0 || fdl > INT32_MAX || len <= 0) {
        PyErr_SetString(PyExc_ValueError, "need fd >= 0 and length > 0");
        return NULL;
    }
    fd = (int)fdl;
    Py_BEGIN_ALLOW_THREADS
    rc = posix_fallocate(fd, (off_t)len - 1, 1);
    for (off_t off = 0; rc == 0 && off + (off_t)HUGE_BYTES <= (off_t)len; off += (off_t)HUGE_BYTES)
        rc = posix_fallocate(fd, off, 4096);
    Py_END_ALLOW_THREADS
    if (rc != 0) {
        errno = rc;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

static PyMethodDef Mapping_methods[] = {
    {"close", (PyCFunction)Mapping_close, METH_NOARGS,
     "close(): unmap; BufferError while a buffer is exported; idempotent"},
    {"collapse", (PyCFunction)Mapping_collapse, METH_NOARGS,
     "collapse() -> int: bytes now on 2 MiB pages (MADV_COLLAPSE per 2 MiB range; 0 where the kernel cannot)"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Mapping_getset[] = {
    {"closed", (getter)Mapping_get_closed, NULL, "True once close() unmapped it", NULL},
    {"address", (getter)Mapping_get_address, NULL, "start address (2 MiB-aligned; 0 when closed)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMappingMethods Mapping_as_mapping = {
    .mp_length = (lenfunc)Mapping_length,
    .mp_subscript = (binaryfunc)Mapping_subscript,
    .mp_ass_subscript = (objobjargproc)Mapping_ass_subscript,
};
static PyBufferProcs Mapping_as_buffer = {
    .bf_getbuffer = (getbufferproc)Mapping_getbuffer,
    .bf_releasebuffer = (releasebufferproc)Mapping_releasebuffer,
};

PyTypeObject SharedMappingType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmdisagg._native.SharedMapping",
    .tp_basicsize = sizeof(SharedMapping),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "SharedMapping(fd, length, writable=True): a MAP_SHARED mapping at a 2 MiB-aligned "
              "address (huge pages map with PMD entries); buffer protocol, close(), collapse().",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Mapping_init,
    .tp_dealloc = (destructor)Mapping_dealloc,
    .tp_methods = Mapping_methods,
    .tp_getset = Mapping_getset,
    .tp_as_mapping = &Mapping_as_mapping,
    .tp_as_buffer = &Mapping_as_buffer,
};
